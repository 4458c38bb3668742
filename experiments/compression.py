"""``sparsim experiment compression``: convergence against the compression ratio (gTop-k paper, Figure 2).

loss and ||grad f(v_t)||^2 against iteration for dense S-SGD and gTop-k S-SGD at c = d/k in
{1000, 4000, 10000, 20000}, P = 4 workers, per-worker batch 16 (B = 64), a fixed budget of T iterations
and the Corollary 2 constant step alpha = theta sqrt(B/T) (theta = 0.5), on

- ``robust_regression`` (synthetic), d = 20000, n = 1024, 64 non-zeros per row: the paper's ratios
  (k = 20, 5, 2, 1);
- ``softmax`` on scikit-learn's digits (real), d = 640: the ratios are scaled by d/20000 so that the
  largest maps to k = 1, i.e. c in {32, 128, 320, 640} (k = 20, 5, 2, 1); the output says so.

Over the measured curves the Corollary 2 bound on (1/T) sum_t ||grad f(v_{t-1})||^2 is drawn in both
variants, published (M^2/B) and corrected (M^2) (:data:`theory.bounds.BOUNDS` ``corollary2_published`` /
``corollary2_corrected`` at the eta minimising tau/(eta(1-tau)), :func:`theory.bounds.optimal_eta`; for
dense, c = 1, ``corollary2_c_*`` at c = 1 where the compression term vanishes), as horizontal lines at
the level each variant guarantees for the T-step average, next to the running average it bounds.
Constants as in ``sparsim check`` (:mod:`experiments.check`): L = L_f (smoothness of f) when known,
else L; M the objective's analytic per-sample gradient bound; f(x_0) - f* with f* the certified lower
bound. Output directory (built as ``DIR.partial``, renamed when complete; finished runs are reused):
``compression.csv`` (:data:`CURVE_COLUMNS`, one row per objective, c and evaluated iteration),
``bounds.csv`` (:data:`BOUND_COLUMNS`), ``compression.png``/``.pdf``, ``results.md``, ``runs/``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.base.errors import SparsimError

from .outdir import check_out, partial_dir, publish
from .outdir import save_figure, write_csv
from .paper_common import cached_run
from .sweep import map_jobs, resolve_jobs

__all__ = ["CompressionObjective", "plan", "run_compression", "CURVE_COLUMNS", "BOUND_COLUMNS", "corollary2_bounds"]

PAPER_RATIOS = (1000, 4000, 10_000, 20_000)
CURVE_COLUMNS = ("objective", "algorithm", "c", "k", "d", "iteration", "lr", "loss", "grad_norm_sq",
                 "running_avg_grad_norm_sq")
BOUND_COLUMNS = ("objective", "algorithm", "c", "k", "d", "T", "B", "theta", "eta", "L", "M", "f0_minus_fstar",
                 "empirical_avg_grad_norm_sq", "bound_published", "bound_corrected", "published_holds",
                 "corrected_holds", "note")
P_WORKERS = 4
BATCH = 16
THETA = 0.5
SEED = 0


@dataclass(frozen=True)
class CompressionObjective:
    """One objective: make_objective name and parameters, its dimension d, the k values and a note."""

    name: str
    objective: str
    params: tuple
    d: int
    ks: tuple[int, ...]
    note: str = ""

    @property
    def ratios(self) -> tuple[float, ...]:
        """c = d/k for each k."""
        return tuple(self.d / k for k in self.ks)


DIGITS_NOTE = ("digits softmax has d = 640, so the paper's ratios c in {1000, 4000, 10000, 20000} are scaled by "
               "d/20000 = 0.032: c in {32, 128, 320, 640} (k = 20, 5, 2, 1)")
OBJECTIVES = (
    CompressionObjective("robust_regression", "robust_regression", (("d", 20_000), ("n", 1024), ("nnz", 64)),
                         20_000, tuple(20_000 // c for c in PAPER_RATIOS)),
    CompressionObjective("softmax_digits", "softmax", (("dataset", "digits"), ("lam", 1e-3)), 640,
                         tuple(max(1, round(640 / (c * 640 / 20_000))) for c in PAPER_RATIOS), DIGITS_NOTE),
)


def plan(quick: bool = False) -> tuple[tuple[CompressionObjective, ...], int]:
    """(objectives, iterations T): full T = 1500, quick (CI) T = 60; both objectives, all ratios, either way."""
    return OBJECTIVES, (60 if quick else 1500)


@functools.lru_cache(maxsize=4)
def _objective(o: CompressionObjective):
    from sim.workloads.objectives import make_objective

    return make_objective(o.objective, **dict(o.params))


def _one_run(o: CompressionObjective, k: int | None, T: int, run_dir: str, algorithm: str = "gtopk") -> list[dict]:
    """Run (or reuse) dense (k None) or the sparse ``algorithm`` (a registered name, default gTop-k as in the
    paper) with k on objective ``o``; return its metrics rows."""
    from sim.algorithms import AlgorithmSpec
    from sim.workloads.data import shard_indices
    from sim.engine.runner import Workers, run_algorithm

    def compute():
        obj = _objective(o)
        w = Workers(obj, shard_indices(obj.n, P_WORKERS, seed=SEED), BATCH, SEED)
        alpha = THETA * math.sqrt(P_WORKERS * BATCH / T)
        spec = AlgorithmSpec("dense") if k is None else AlgorithmSpec(algorithm, k=k)
        return run_algorithm(spec, w, T=T, lr=lambda t: alpha, x0=obj.x0(SEED), driver="lockstep", eval_every=1)

    return cached_run(Path(run_dir), compute)


def constants(o: CompressionObjective, f0: float) -> tuple[float, float, float]:
    """(L, M, f(x_0) - f*) of objective ``o`` as :mod:`experiments.check` takes them (L_f if known, else L;
    analytic M; f* = the certified lower bound). f0: the measured f(x_0). Raises SparsimError if one is unknown."""
    c = _objective(o).constants()
    L = c.get("L_f") if c.get("L_f", {}).get("value") is not None else c["L"]
    M, fstar = c["M"], c["f_star_lower"]
    for name, v in (("L", L), ("M", M), ("f*", fstar)):
        if v.get("value") is None:
            raise SparsimError(f"objective {o.name}: constant {name} is unknown, the Corollary 2 bound cannot be drawn")
    return float(L["value"]), float(M["value"]), float(f0 - fstar["value"])


def corollary2_bounds(d: int, k: int | None, L: float, M: float, B: int, F: float, theta: float,
                      T: int) -> tuple[float, float, float]:
    """(eta, published, corrected): Corollary 2 on (1/T) sum_t ||grad f(v_{t-1})||^2 for alpha = theta sqrt(B/T).

    k None or k = d: no compression, ``corollary2_c_*`` at c = 1 (compression term 0; eta reported nan);
    else ``corollary2_*`` at eta = :func:`theory.bounds.optimal_eta` (d/k). Source: Shi et al., IJCAI 2019,
    Corollary 2; docs/theory.md section 5. Units: those of ||grad f||^2.
    """
    from theory.bounds import BOUNDS, optimal_eta

    if k is None or k >= d:
        kw = dict(c=1, L=L, M=M, B=B, f0_minus_fstar=F, theta=theta, T=T)
        return math.nan, BOUNDS["corollary2_c_published"].evaluate(**kw), BOUNDS["corollary2_c_corrected"].evaluate(**kw)
    eta = optimal_eta(d / k).value
    kw = dict(d=d, k=k, eta=eta, L=L, M=M, B=B, f0_minus_fstar=F, theta=theta, T=T)
    return eta, BOUNDS["corollary2_published"].evaluate(**kw), BOUNDS["corollary2_corrected"].evaluate(**kw)


def _label(o: CompressionObjective, k: int | None, algorithm: str = "gtopk") -> str:
    return "dense" if k is None else f"{algorithm} c={o.d / k:g} (k={k})"


def _figure(objs, curves: list[dict], bounds: list[dict], outdir: Path, T: int,
            algorithms: tuple[str, ...] = ("gtopk",)) -> None:
    from .plots import plt

    fig, axes = plt.subplots(2, len(objs), figsize=(6.6 * len(objs), 8.4), squeeze=False)
    for j, o in enumerate(objs):
        axl, axg = axes[0][j], axes[1][j]
        cases = [(None, None)] + [(a, k) for a in algorithms for k in o.ks]
        for i, (alg, k) in enumerate(cases):
            lab = _label(o, k, alg)
            rr = [r for r in curves if r["objective"] == o.name and r["algorithm"] == lab]
            it = [r["iteration"] for r in rr]
            axl.plot(it, [r["loss"] for r in rr], color=f"C{i}", lw=1.0, label=lab)
            axg.semilogy(it, [r["grad_norm_sq"] for r in rr], color=f"C{i}", lw=0.6, alpha=0.45)
            axg.semilogy(it[1:], [r["running_avg_grad_norm_sq"] for r in rr[1:]], color=f"C{i}", lw=1.4, label=lab)
            b = next(x for x in bounds if x["objective"] == o.name and x["algorithm"] == lab)
            axg.axhline(b["bound_published"], color=f"C{i}", ls="--", lw=0.9)
            axg.axhline(b["bound_corrected"], color=f"C{i}", ls=":", lw=1.2)
        title = f"{o.name}: d = {o.d}, P = {P_WORKERS}, B = {P_WORKERS * BATCH}, T = {T}"
        if o.note:
            title += "\n(c scaled by d/20000: d = 640 < 20000)"
        axl.set(xlabel="iteration t", ylabel="loss f(v_t)", title=title)
        axg.set(xlabel="iteration t", ylabel="||grad f(v_t)||^2",
                title="thin: per step; thick: running average (what Cor. 2 bounds)\n"
                      "dashed: Cor. 2 published (M^2/B); dotted: corrected (M^2)")
        for ax in (axl, axg):
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
    fig.suptitle(f"{', '.join(algorithms)} at several compression ratios (gTop-k paper, Figure 2); constant step "
                 f"theta sqrt(B/T), theta = {THETA}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, outdir, "compression")


def markdown(bounds: list[dict]) -> str:
    """The bounds table (Markdown), with notes."""
    lines = ["| objective | algorithm | c | k | T | final-T average ||grad f||^2 | Cor. 2 published | Cor. 2 corrected |",
             "|---|---|---|---|---|---|---|---|"]
    for b in bounds:
        lines.append(f"| {b['objective']} | {b['algorithm']} | {b['c']:g} | {b['k']} | {b['T']} | "
                     f"{b['empirical_avg_grad_norm_sq']:.4g} | {b['bound_published']:.4g} | {b['bound_corrected']:.4g} |")
    notes = sorted({b["note"] for b in bounds if b["note"]})
    return "\n".join(lines + [""] + [f"Note: {n}." for n in notes])


def run_compression(out, *, quick: bool = False, force: bool = False, jobs: int | None = None,
                    scheduler: str | None = None, progress: bool = True,
                    algorithms: tuple[str, ...] = ("gtopk",)) -> tuple[Path, list[dict], str]:
    """Run the compression experiment into ``out`` (via ``out.partial``); return (path, bound rows, Markdown).

    algorithms: the sparse algorithms compared with dense at every ratio (registered names, ``sparsim
    algorithms``; default gTop-k, the paper's). Corollary 2's bound is drawn for each: it holds for any compressor
    that satisfies Assumption 1 (docs/theory.md), which ``sparsim check`` measures per run.
    Raises ConfigError if ``out`` exists and is not empty (unless ``force``), ``jobs`` < 1, or an algorithm is
    unknown or not sparse; SparsimError if an objective lacks a constant of the bound. Finished runs in
    ``out.partial/runs`` are reused.
    """
    from sim.algorithms import get

    from sim.base.errors import ConfigError

    algorithms = tuple(algorithms)
    if not algorithms:
        raise ConfigError("algorithms = () names none: valid one or more sparse algorithms of `sparsim algorithms`")
    dup = next((a for i, a in enumerate(algorithms) if a in algorithms[:i]), None)
    if dup is not None:
        raise ConfigError(f"algorithms = {','.join(algorithms)} names {dup} twice: valid each algorithm once")
    for a in algorithms:
        if not get(a).sparse:
            raise ConfigError(f"algorithm = {a!r} is not sparse (it has no compression ratio): valid sparse "
                              "algorithms of `sparsim algorithms`")
    out = Path(out)
    check_out(out, force)
    jobs = resolve_jobs(jobs, scheduler)  # checked (and the scheduler reached) before any output
    objs, T = plan(quick)
    tmp = partial_dir(out, fresh=False, resume_key=f"compression quick={quick}")
    # the paper's gTop-k runs keep their directory names (runs/NAME_kK), so earlier partial runs are reused
    args = [(o, None, T, str(tmp / "runs" / f"{o.name}_dense"), "dense") for o in objs]
    args += [(o, k, T, str(tmp / "runs" / f"{o.name}_{'' if a == 'gtopk' else a + '_'}k{k}"), a)  # algorithms: paper's
             for o in objs for a in algorithms for k in o.ks]
    results = map_jobs(_one_run, args, jobs=jobs, scheduler=scheduler, desc="compression", progress=progress)
    curves, bounds = [], []
    B = P_WORKERS * BATCH
    for (o, k, _T, _d, alg), rows in zip(args, results):
        lab = _label(o, k, alg)
        kk = o.d if k is None else k
        c = o.d / kk
        gn = [float(r["grad_norm_sq"]) for r in rows]
        csum = np.cumsum(gn)
        for r, s in zip(rows, csum):
            t = int(r["iteration"])
            # running average of ||grad f(v_{s-1})||^2 over s = 1..t, i.e. of rows 0..t-1
            avg = float((s - gn[t]) / t) if t >= 1 else math.nan
            curves.append({"objective": o.name, "algorithm": lab, "c": c, "k": kk, "d": o.d, "iteration": t,
                           "lr": float(r["lr"]), "loss": float(r["loss"]), "grad_norm_sq": gn[t],
                           "running_avg_grad_norm_sq": avg})
        L, M, F = constants(o, float(rows[0]["loss"]))
        eta, bp, bc = corollary2_bounds(o.d, k, L, M, B, F, THETA, T)
        emp = float(np.mean(gn[:-1]))
        bounds.append({"objective": o.name, "algorithm": lab, "c": c, "k": kk, "d": o.d, "T": T, "B": B,
                       "theta": THETA, "eta": eta, "L": L, "M": M, "f0_minus_fstar": F,
                       "empirical_avg_grad_norm_sq": emp, "bound_published": bp, "bound_corrected": bc,
                       "published_holds": bp >= emp, "corrected_holds": bc >= emp, "note": o.note})
    write_csv(tmp / "compression.csv", CURVE_COLUMNS, curves)
    write_csv(tmp / "bounds.csv", BOUND_COLUMNS, bounds)
    _figure(objs, curves, bounds, tmp, T, algorithms)
    report = markdown(bounds)
    (tmp / "results.md").write_text(report + "\n")
    publish(tmp, out)
    return out, bounds, report
