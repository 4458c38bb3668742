"""``sparsim check RUN_DIR``: hold a finished run against the gTop-k paper's assumptions and bounds.

Per step (Top-k and gTop-k rows of metrics.csv):

- Assumption 1: delta_t <= 1 (docs/theory.md section 4).
- Lemma 2, pathwise, with delta_t replaced by 1 (the lemma's statement under Assumption 1) and the
  best Young parameter eta for the step (min over eta > 0 of (1+eta)a + (1+1/eta)b = (sqrt a + sqrt b)^2):
  ||eps_t||^2 <= gamma (||eps_{t-1}|| + alpha_t ||G_t||)^2, with eps the mean residual and G_t the averaged
  stochastic gradient, both measured.

At the end (Theorem 1 and Corollary 2, published M^2/B and corrected M^2 variants): the empirical weighted
average sum_t alpha_t ||grad f(v_{t-1})||^2 / sum_t alpha_t against
- ``theorem1_on_schedule`` (the bound evaluated on the actual schedule, no D),
- ``theorem1_<variant>`` with the smallest D satisfying condition (18) for the schedule,
- ``corollary2_<variant>`` when the schedule is constant (theta = alpha / sqrt(B/T)),
each at the eta minimising Corollary 2's ratio tau/(eta(1-tau)) (theory.bounds.optimal_eta).
The bounds are on an expectation; a single run is one sample of it, which the report says.
Constants L (smoothness of f), M, f(x_0) - f* come from summary.json; the report names whether each is
analytic or estimated. Results go to ``check.json`` and ``check.txt`` in the run directory.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sim.base.errors import ConfigError, SparsimError
from theory.bounds import BOUNDS, condition18_D, optimal_eta, theorem1_on_schedule

from .outdir import atomic_write_text, verify_record
from .record import read_metrics
from .resolve import measured_selection

__all__ = ["Verdict", "CheckReport", "check_run"]


@dataclass
class Verdict:
    """One check: ``value`` (measured) against ``bound``; holds iff value <= bound (margin = bound - value)."""

    algorithm: str
    check: str
    value: float
    bound: float
    holds: bool
    margin: float
    note: str = ""


@dataclass
class CheckReport:
    """All verdicts of a run plus the constants used (with provenance)."""

    run_dir: str
    constants: dict
    verdicts: list[Verdict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: per sparse algorithm, [iteration, delta_t] of every step with a measured delta (check.json only)
    deltas: dict = field(default_factory=dict)

    def render(self) -> str:
        """Human-readable table: one line per verdict with holds / violated and its margin."""
        lines = [f"check of {self.run_dir}"]
        for k, v in self.constants.items():
            lines.append(f"  {k} = {v['value']:.6g} ({v['how']}{': ' + v['note'] if v.get('note') else ''})")
        lines.append(f"{'algorithm':<18}{'check':<44}{'value':>12}{'bound':>12}  {'verdict':<9}{'margin':>12}")
        for v in self.verdicts:
            lines.append(f"{v.algorithm:<18}{v.check:<44}{v.value:>12.4g}{v.bound:>12.4g}  "
                         f"{'holds' if v.holds else 'VIOLATED':<9}{v.margin:>12.4g}" + (f"  ({v.note})" if v.note else ""))
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_json(self) -> dict:
        """JSON-ready dict: run_dir, constants (value, how, note), verdicts (one dict each), notes."""
        return {"run_dir": self.run_dir, "constants": self.constants,
                "verdicts": [asdict(v) for v in self.verdicts], "notes": self.notes,
                "assumption1_delta_by_step": self.deltas}


def _is_dense(label: str) -> bool:
    """Whether an algorithm label (``dense``, ``dense[backend_allreduce]``, ``topk``, ...) names a registered
    algorithm that sends everything (not sparse: no k, no Assumption 1 ratio)."""
    from sim.algorithms import REGISTRY

    algo = REGISTRY.get(label.split("[", 1)[0])
    return algo is not None and not algo.sparse

def _constants(c: dict, f0: float) -> tuple[dict, list[str]]:
    """L, M and f(x_0) - f* for the bounds, from the run's resolved constants ``c`` and its initial loss ``f0``.

    Returns (constants, unknown): the known ones as {name: {value, how, note}}, and one sentence per constant the
    objective cannot give (a ReLU network's L and M, a synthetic objective's M): the bounds that need it are then not
    evaluated, and the report says so instead of guessing a value."""
    L = c.get("L_f") if c.get("L_f", {}).get("value") is not None else c["L"]
    M = c["M"]
    fstar = c["f_star_lower"]
    out, unknown = {}, []
    if L.get("value") is None:
        unknown.append("the objective's smoothness constant L is unknown" + (f" ({L['note']})" if L.get("note") else ""))
    else:
        out["L"] = {"value": float(L["value"]), "how": L["how"], "note": "smoothness of f"}
    if M.get("value") is None:
        unknown.append("the objective's gradient bound M is unknown" + (f" ({M['note']})" if M.get("note") else ""))
    else:
        out["M"] = {"value": float(M["value"]), "how": M["how"], "note": "per-sample gradient-norm bound"}
    if fstar.get("value") is None:
        unknown.append("no certified lower bound f* is known for this objective")
    else:
        out["f0_minus_fstar"] = {"value": float(f0 - fstar["value"]), "how": fstar["how"],
                                 "note": f"f(x_0) = {f0:.6g} measured, f* >= {fstar['value']:.6g}"}
    return out, unknown


def _gamma(summary: dict, d: int, k: int) -> tuple[float, str, int, int]:
    """The contraction gamma of one worker's selection, ||x - select(x)||^2 <= gamma ||x||^2, for the k and the
    segments the run used: 1 - k/d for whole-model selection; with layer-wise selection (segments d_1..d_B, each
    selecting k_b = min(d_b, max(1, round(k d_b / d))), sim.algorithms.base.segment_k) the worst segment's
    max_b (1 - k_b / d_b), which is what Top-k on each segment guarantees. Returns (gamma, how, d', k') with
    gamma = 1 - k'/d': (d, k), or the worst segment's (d_b, k_b), the pair the bounds' c = d/k is evaluated at."""
    from sim.algorithms.base import segment_k

    res = summary.get("resolved", {})
    segs = res.get("segments") or summary.get("scenario", {}).get("compression", {}).get("layer_sizes")
    if not segs or len(segs) < 2:
        return 1.0 - k / d, f"1 - k/d with k = {k}, d = {d}", d, k
    ks = [segment_k(k, d, int(n)) for n in segs]
    g, kb, db = max((1.0 - kb / int(n), kb, int(n)) for kb, n in zip(ks, segs))
    return g, (f"max over {len(segs)} segments of 1 - k_b/d_b with the selection operator's nominal k_b = min(d_b, "
               f"max(1, round(k d_b / d))) ({sum(ks)} per worker in all, not k = {k}); the bound is about the "
               f"operator, so a step that selected fewer (exact zeros are never selected) does not change it"), db, kb


def _nominal_total(summary: dict, d: int, k: int) -> int:
    """The selection operator's entries per worker per step: sum_b k_b over the run's segments (k without)."""
    from sim.algorithms.base import segment_k

    res = summary.get("resolved", {})
    segs = res.get("segments") or summary.get("scenario", {}).get("compression", {}).get("layer_sizes")
    return sum(segment_k(k, d, int(n)) for n in segs) if segs and len(segs) >= 2 else k


def check_run(run_dir, *, write: bool = True) -> CheckReport:
    """Run every check on a finished simulator run directory; write check.json/check.txt; return the report.

    Per-step checks (Assumption 1, Lemma 2) need only measured quantities and always run; Theorem 1 and Corollary 2
    need L, M and f*, and are left out (with a note naming the unknown constant) when the objective cannot give
    them (a ReLU network on images, a synthetic objective without M). The run's scenario is rebuilt and summary.json's
    d, k, B and constants must be what it gives (else ConfigError: the verdicts would use constants the run never
    had); where it cannot be rebuilt (data not here) a note says they were not verified. A directory that cannot be
    written still gets its report (a note names the files not written). The bounds use the selection operator's
    nominal k (or the segments' k_b); where a step selected another count (metrics.csv's selected_per_worker: exact
    zeros are never selected) a note gives the measured mean / min / max beside it. No compression (k = d, or every
    segment with k_b = d_b: gamma = 0) is a note with no bound evaluated. Raises ConfigError if the directory is not
    a finished run.
    """
    run_dir = Path(run_dir)
    sp = run_dir / "summary.json"
    if not sp.is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a finished run directory: summary.json is missing")
    try:
        summary = json.loads(sp.read_text())
        if str(summary.get("mode", "")).startswith("workload"):
            raise ConfigError(f"{str(run_dir)!r} is a timing-only workload run (no objective, no convergence): the "
                              "bounds apply to runs that train the [data] objective")
        verify_record(run_dir, summary.get("metrics_csv"))  # a truncated or edited metrics.csv gets no verdict
        res = summary["resolved"]
        d, k, B = int(res["d"]), int(res["k"]), int(res["global_batch_B"])
        by_alg = read_metrics(run_dir)
        first = next(iter(by_alg.values()))
        c, f0 = summary["resolved"]["constants"], float(first[0]["loss"])
    except SparsimError:
        raise
    except OSError as err:  # a file of the run that cannot be read is not a write error, nor a damaged one
        name = Path(err.filename).name if err.filename else "a file"
        raise ConfigError(f"{str(run_dir)!r}: cannot read {name}: {err.strerror or err}") from None
    except (ValueError, KeyError, TypeError, StopIteration, IndexError) as err:  # JSONDecodeError is a ValueError
        raise ConfigError(f"{str(run_dir)!r} is not a readable finished run directory: summary.json or metrics.csv "
                          f"is damaged ({type(err).__name__}: {err})") from None
    built, why = _rebuild(summary)
    if built is not None:
        _verify_resolved(run_dir, summary, built)
    consts, unknown = _constants(c, f0)
    report = CheckReport(str(run_dir), consts)
    if built is None:
        report.notes.append(f"summary.json's d, k, B and constants (L, M, f*) were not verified against the run's "
                            f"scenario: {why}")
    else:
        report.notes.append("summary.json's d, k, B and constants (L, M, f*) are those its scenario gives (rebuilt "
                            "and recomputed here)")
    bounds_ok = not unknown
    gamma, gamma_how, d_c, k_c = _gamma(summary, d, k)
    report.notes.append(f"gamma = {gamma:.12g}: {gamma_how}")
    for u in unknown:
        report.notes.append(f"{u}: Theorem 1 and Corollary 2 are not evaluated (no value is guessed); Assumption 1 "
                            "and Lemma 2 need only measured quantities and are checked")
    report.notes.append(
        "Theorem 1 and Corollary 2 bound an expectation over the sampling; a single run is one sample of it.")
    bias = _sampling_bias(summary, built)
    if bias is not None:
        report.notes.append(
            f"unbiasedness: the bounds assume E[G_t] = grad f(v_t); here E[G] (the mean of the P shards' mean "
            f"gradients) differs from grad f at x_0 by {bias:.3g} relative (||E[G] - grad f|| / ||grad f||), "
            + ("0: unbiased" if bias == 0 else "because the shards differ in size or content (sharding = "
                                               f"{summary['scenario']['data']['sharding']})"))
    nominal = _nominal_total(summary, d, k)
    for alg, rows in by_alg.items():  # what was selected where it is not the nominal count the bounds use
        m = None if _is_dense(alg) else measured_selection(rows)
        if m is not None and (nominal != k or m["min"] != nominal or m["max"] != nominal):
            report.notes.append(f"{alg}: selected per worker per step, measured (metrics.csv): mean {m['mean']:.6g}, "
                                f"min {m['min']:.6g}, max {m['max']:.6g} over {m['steps']} steps; nominal "
                                f"{nominal} (the bounds use the nominal k)")
    if k >= d:
        report.notes.append("k = d: no compression, the sparse bounds reduce to plain SGD's; nothing to check")
        return _finish(report, run_dir, write)
    if gamma == 0.0:
        report.notes.append("gamma = 0: every segment selects all its entries (k_b = d_b), so there is no compression "
                            "and the sparse bounds reduce to plain SGD's; nothing to check for the compression bounds")
        return _finish(report, run_dir, write)
    eta = optimal_eta(d_c / k_c).value
    tau = gamma * (1 + eta)
    at = f"d/k = {d_c}/{k_c}" if d_c == d else f"the worst segment's d_b/k_b = {d_c}/{k_c}"
    report.notes.append(f"eta = {eta:.6g} (minimises tau/(eta(1-tau)) at c = {d_c / k_c:.6g}, {at}); "
                        f"tau = {tau:.12g}")
    for alg, rows in by_alg.items():
        if _is_dense(alg):
            continue
        steps = [r for r in rows if r["iteration"] >= 1]
        T = len(steps)
        # Assumption 1 per step
        deltas = [r["delta"] for r in steps if not math.isnan(r["delta"])]
        bad = [r for r in steps if not math.isnan(r["delta"]) and r["delta"] > 1]
        worst = max(deltas) if deltas else math.nan
        report.verdicts.append(Verdict(alg, "Assumption 1: max_t delta_t <= 1", worst, 1.0, not bad, 1.0 - worst,
                                       f"{len(bad)} of {len(deltas)} steps have delta > 1"))
        report.deltas[alg] = [[int(r["iteration"]), r["delta"]] for r in steps if not math.isnan(r["delta"])]
        # Lemma 2 pathwise with delta := 1 and the per-step optimal eta
        viol, min_margin, worst_lhs, worst_rhs = 0, math.inf, math.nan, math.nan
        prev = rows[0]["residual_norm_sq"]
        for r in steps:
            rhs = gamma * (math.sqrt(prev) + r["lr"] * math.sqrt(r["stoch_grad_norm_sq"])) ** 2
            lhs = r["residual_norm_sq"]
            m = rhs - lhs
            tol = 1e-12 * max(rhs, 1e-300)
            if m < -tol:
                viol += 1
            if m < min_margin:
                min_margin, worst_lhs, worst_rhs = m, lhs, rhs
            prev = lhs
        report.verdicts.append(Verdict(alg, "Lemma 2 pathwise (delta := 1), worst step", worst_lhs, worst_rhs,
                                       viol == 0, min_margin, f"{viol} of {T} steps violate"))
        if not bounds_ok:
            g_max = max((math.sqrt(r["stoch_grad_norm_sq"]) for r in steps if not math.isnan(r["stoch_grad_norm_sq"])),
                        default=math.nan)
            report.notes.append(f"{alg}: measured max_t ||G_t|| = {g_max:.6g} (the averaged stochastic gradient), a "
                                "lower bound on M only; the theorems need an upper bound")
            continue
        # end-of-run bounds
        L, M, F = (consts[x]["value"] for x in ("L", "M", "f0_minus_fstar"))
        alphas = [r["lr"] for r in steps]
        gn_before = [r["grad_norm_sq"] for r in rows[:-1]]  # ||grad f(v_{t-1})||^2, t = 1..T
        pairs = [(a, g) for a, g in zip(alphas, gn_before) if not math.isnan(g)]
        note_emp = "" if len(pairs) == T else f"subsampled: {len(pairs)} of {T} steps evaluated (eval_every)"
        emp = sum(a * g for a, g in pairs) / sum(a for a, _ in pairs)
        S1, S2 = sum(alphas), sum(a * a for a in alphas)
        D = condition18_D(alphas, tau)
        const_step = max(alphas) == min(alphas)
        for variant in ("published", "corrected"):
            b = theorem1_on_schedule(alphas, L, M, B, F, gamma, eta, variant)
            report.verdicts.append(Verdict(alg, f"Theorem 1 on schedule [{variant}]", emp, b, emp <= b, b - emp, note_emp))
            kw = dict(d=d_c, k=k_c, eta=eta, L=L, M=M, f0_minus_fstar=F, D=D, S1=S1, S2=S2)
            if variant == "published":
                kw["B"] = B
            b = BOUNDS[f"theorem1_{variant}"].evaluate(**kw)
            report.verdicts.append(Verdict(alg, f"Theorem 1 with D (cond. 18) [{variant}]", emp, b, emp <= b, b - emp,
                                           f"D = {D:.4g}"))
            if const_step:
                theta = alphas[0] / math.sqrt(B / T)
                b = BOUNDS[f"corollary2_{variant}"].evaluate(d=d_c, k=k_c, eta=eta, L=L, M=M, B=B, f0_minus_fstar=F,
                                                             theta=theta, T=T)
                report.verdicts.append(Verdict(alg, f"Corollary 2 [{variant}]", emp, b, emp <= b, b - emp,
                                               f"theta = {theta:.4g}"))
    figure = (lambda: _figure(report, by_alg, run_dir, consts["L"]["value"], consts["M"]["value"], B,
                              consts["f0_minus_fstar"]["value"], gamma, eta)) if bounds_ok else None
    return _finish(report, run_dir, write, figure)


def _rebuild(summary: dict):
    """The run's scenario (summary.json's ``scenario``) built again here: (Built, "") or (None, why not) when it
    cannot be (its data are not on this machine, a file moved, another version's keys)."""
    from .build import build
    from .scenario import Scenario

    try:
        return build(Scenario.model_validate(summary["scenario"])), ""
    except Exception as err:  # noqa: BLE001 - the run's data are not available here: say so, do not guess
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return None, f"it cannot be rebuilt here ({first[:200]})"


#: Relative tolerance of a recomputed constant against summary.json's (an eigensolver's last bits may differ
#: between machines; JSON keeps every float exactly).
CONSTANT_RTOL = 1e-9


def _verify_resolved(run_dir: Path, summary: dict, built) -> None:
    """Raise ConfigError (one line) unless summary.json's resolved d, k, global batch B and constants (L, L_f, M,
    f*) are those the run's own scenario gives (``built``: it rebuilt): an edited summary.json, or one written by
    another version, would otherwise give verdicts on constants the run never had."""
    res = summary["resolved"]
    want = {"d": built.d, "k": built.k, "global_batch_B": len(built.shards) * int(summary["scenario"]["training"]
                                                                                     ["batch_size"])}
    for key, value in want.items():
        if int(res[key]) != int(value):
            raise ConfigError(f"{str(run_dir)!r}: summary.json says resolved.{key} = {res[key]!r} but the run's "
                              f"scenario gives {value!r}: summary.json was edited or written by another version; "
                              "rerun the scenario")
    got = built.objective.constants()
    for key, rec in got.items():
        have = res["constants"].get(key, {}).get("value")
        new = rec.get("value")
        same = (have is None and new is None) or (have is not None and new is not None and
                                                  math.isclose(float(have), float(new), rel_tol=CONSTANT_RTOL,
                                                               abs_tol=0.0))
        if not same:
            raise ConfigError(f"{str(run_dir)!r}: summary.json says constants.{key} = {have!r} but the run's "
                              f"objective gives {new!r}: summary.json was edited or written by another version; "
                              "rerun the scenario")


def _sampling_bias(summary: dict, built=None) -> float | None:
    """||E[G] - grad f|| / ||grad f|| at the run's x_0, where E[G] = (1/P) sum_p (mean gradient of shard p): the
    bias of the averaged stochastic gradient that unequal shards cause (uniform sampling within each shard).
    built: the run rebuilt (:func:`_rebuild`; None: built here). None when the scenario cannot be rebuilt here
    (another backend's data, a missing file)."""
    import numpy as np

    if summary.get("scenario", {}).get("model", {}).get("name"):
        return None  # a network: P+1 full passes over the data to measure a bias that equal iid shards do not have
    b = built if built is not None else _rebuild(summary)[0]
    if b is None:  # the run's data are not available here: say nothing rather than guess
        return None
    x0, obj = b.x0, b.objective
    full = obj.full_grad(x0)
    eg = sum(obj.batch_grad(x0, s) for s in b.shards) / len(b.shards)
    nf = float(np.linalg.norm(full))
    return float(np.linalg.norm(eg - full)) / nf if nf > 0 else float(np.linalg.norm(eg - full))


def _figure(report, by_alg, run_dir, L, M, B, F, gamma, eta):
    """check.png: running empirical weighted average vs Theorem 1 (on the schedule prefix), both variants, log-log."""
    import numpy as np

    from .plots import plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (alg, rows) in enumerate(a for a in by_alg.items() if not _is_dense(a[0])):
        steps = [r for r in rows if r["iteration"] >= 1]
        alphas = [r["lr"] for r in steps]
        gn = [r["grad_norm_sq"] for r in rows[:-1]]
        T = len(steps)
        grid = sorted({int(x) for x in np.unique(np.geomspace(1, T, num=min(T, 40)).round())})
        emp, bounds = [], {"published": [], "corrected": []}
        for Tp in grid:
            pairs = [(a, g) for a, g in zip(alphas[:Tp], gn[:Tp]) if not math.isnan(g)]
            emp.append(sum(a * g for a, g in pairs) / sum(a for a, _ in pairs) if pairs else math.nan)
            for v in bounds:
                bounds[v].append(theorem1_on_schedule(alphas[:Tp], L, M, B, F, gamma, eta, v))
        ax.loglog(grid, emp, color=f"C{i}", label=f"{alg}: empirical")
        ax.loglog(grid, bounds["published"], color=f"C{i}", ls="--", label=f"{alg}: Theorem 1 published (M^2/B)")
        ax.loglog(grid, bounds["corrected"], color=f"C{i}", ls=":", label=f"{alg}: Theorem 1 corrected (M^2)")
    ax.set(xlabel="iterations T", ylabel="weighted average ||grad f(v_t)||^2", title="bound vs empirical")
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:  # nothing to draw for a dense-only run
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(run_dir / "check.png", dpi=110)
    plt.close(fig)


def _finish(report: CheckReport, run_dir: Path, write: bool, figure=None) -> CheckReport:
    """Write check.png (``figure()``, when given), check.json and check.txt into ``run_dir`` when ``write``; a
    directory that cannot be written (read-only, full) leaves the verdicts as they are and adds a note saying
    which files were not written and why, so the caller still prints them."""
    if write:
        try:
            if figure is not None:
                figure()
            atomic_write_text(run_dir / "check.json", json.dumps(report.to_json(), indent=2, default=float))
            atomic_write_text(run_dir / "check.txt", report.render() + "\n")
        except OSError as err:
            names = ("check.png, " if figure is not None else "") + "check.json and check.txt"
            report.notes.append(f"{names} were not written: {str(run_dir)!r} cannot be written "
                                f"({err.strerror or type(err).__name__}); the verdicts above are complete")
    return report
