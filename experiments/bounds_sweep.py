"""``sparsim experiment bounds``: Corollary 2 (published M^2/B vs corrected M^2) against measured runs.

Sweeps the compression ratio c = d/k, the global batch B = P*b (P fixed, per-worker b varied) and seeds,
for Top-k and gTop-k S-SGD with the Corollary 2 constant step alpha = theta*sqrt(B/T), on

- ``robust_regression`` (synthetic, analytic M), d = 10000: c in {10, 100, 1000, 10000};
- ``softmax`` on scikit-learn's digits (real), d = 640: c in {10, 100, 640} -- d is small, so the
  largest ratio is c = d (k = 1) instead of 1000+ (the sweep is scaled and the output says so).

For each (objective, algorithm, c, B) the empirical weighted average of ||grad f(v_t)||^2 (identical to
the plain average for a constant step) is averaged over seeds with a 95% Student-t confidence interval
(``scipy.stats.t.interval``) and compared with both Corollary 2 variants taken from
:func:`experiments.check.check_run` (each bound averaged over seeds; the seeds change x_0 and, for the
synthetic objective, the data). Output directory (built as ``DIR.partial``, renamed when complete):

- ``runs/<objective>_c<c>_b<b>_s<seed>/``: one simulator run per (objective, c, B, seed), both algorithms;
  a re-run after an interruption reuses every run directory that already has ``summary.json``.
- ``results.csv``: one row per configuration (columns :data:`RESULT_COLUMNS`).
- ``bounds.png`` / ``bounds.pdf``: bounds and empirical values against c, log scales, one panel per objective.
- ``results.md``: the Markdown table and the answer, also printed.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .outdir import check_out, partial_dir, publish, save_figure, write_csv
from .sweep import map_jobs, resolve_jobs
from sim.base.errors import ConfigError

__all__ = ["SweepPlan", "RESULT_COLUMNS", "plan", "run_sweep", "confidence_interval", "markdown_table"]

RESULT_COLUMNS = ("objective", "algorithm", "c", "k", "d", "B", "T", "seeds", "empirical_mean", "ci_low", "ci_high",
                  "bound_published", "bound_corrected", "published_holds", "corrected_holds")

ALGORITHMS = ("topk", "gtopk")  # algorithms: the two the bounds are stated for
P_WORKERS = 4


@dataclass(frozen=True)
class ObjectiveSpec:
    """One objective of the sweep: scenario overrides, its dimension d, the ratios c and the step constant."""

    name: str
    overrides: tuple[str, ...]
    d: int
    ratios: tuple[int, ...]
    theta: float
    note: str = ""


@dataclass(frozen=True)
class SweepPlan:
    """The whole sweep: objectives, per-worker batch sizes (P = 4), seeds and iterations T."""

    objectives: tuple[ObjectiveSpec, ...]
    batch_sizes: tuple[int, ...]
    seeds: tuple[int, ...]
    iterations: int

    def configs(self) -> list[tuple[ObjectiveSpec, int, int, int]]:
        """Every (objective, c, b, seed) run of the sweep, in a fixed order."""
        return [(o, c, b, s) for o in self.objectives for c in o.ratios for b in self.batch_sizes for s in self.seeds]


DIGITS_NOTE = ("digits softmax has d = 640, so its compression ratios are scaled down: c = 640 (k = 1) is the "
               "largest possible, in place of c >= 1000")

_DIGITS = ObjectiveSpec("softmax_digits", ("data.objective=softmax", "data.dataset=digits"), 640, (10, 100, 640),
                        theta=0.5, note=DIGITS_NOTE)
_ROBUST = ObjectiveSpec("robust_regression", ("data.objective=robust_regression", "data.d=10000", "data.n=1024"),
                        10_000, (10, 100, 1000, 10_000), theta=0.5)


def plan(quick: bool = False) -> SweepPlan:
    """The sweep: full (both objectives, B in {16, 128}, seeds 0-2, T = 200) or quick (CI-sized)."""
    if quick:
        digits = ObjectiveSpec(_DIGITS.name, _DIGITS.overrides, _DIGITS.d, (10, 100), _DIGITS.theta,
                               "quick size: digits softmax only, c in {10, 100}")
        return SweepPlan((digits,), (4,), (0, 1), 30)
    return SweepPlan((_ROBUST, _DIGITS), (4, 32), (0, 1, 2), 200)


def _run_dir_name(o: ObjectiveSpec, c: int, b: int, seed: int) -> str:
    return f"{o.name}_c{c}_b{b}_s{seed}"


def _scenario(o: ObjectiveSpec, c: int, b: int, seed: int, T: int):
    from .scenario import load_scenario

    k = max(1, round(o.d / c))
    ov = [f'name="bounds-{_run_dir_name(o, c, b, seed)}"', f"seed={seed}", "algorithms=" + ",".join(ALGORITHMS),
          f"cluster.P={P_WORKERS}", *o.overrides, f"training.iterations={T}", f"training.batch_size={b}",
          'training.schedule="corollary2"', f"training.theta={o.theta}", "training.eval_every=1",
          f"compression.k={k}"]
    return load_scenario(None, ov)


def _one_run(o: ObjectiveSpec, c: int, b: int, seed: int, T: int, run_dir: str) -> dict:
    """Run (or reuse) one configuration and return its Corollary 2 verdicts per algorithm."""
    from .check import check_run
    from .run import run_scenario

    from threadpoolctl import threadpool_limits

    path = Path(run_dir)
    if not (path / "summary.json").is_file():
        # small matrices: one BLAS thread per run (several runs share the cores; threads only contend)
        with threadpool_limits(1):
            run_scenario(_scenario(o, c, b, seed, T), path, force=True, progress=False, figure=False)
    rep = check_run(path, write=False)
    import json

    res = json.loads((path / "summary.json").read_text())["resolved"]
    out = {"k": int(res["k"]), "d": int(res["d"]), "B": int(res["global_batch_B"]), "algs": {}}
    for v in rep.verdicts:
        if v.check.startswith("Corollary 2 ["):
            variant = v.check[len("Corollary 2 ["):-1]
            out["algs"].setdefault(v.algorithm, {})["emp"] = v.value
            out["algs"][v.algorithm][variant] = v.bound
    for alg in ALGORITHMS:
        a = out["algs"].get(alg, {})
        if not {"emp", "published", "corrected"} <= a.keys():
            raise ConfigError(f"run {run_dir}: no Corollary 2 verdicts for {alg} (is the step constant?)")
    return out


def confidence_interval(values, level: float = 0.95, lower: float | None = None) -> tuple[float, float, float]:
    """(mean, low, high): Student-t interval of the mean via ``scipy.stats.t.interval``; a point if n < 2 or no spread.

    lower: a bound the mean cannot go below (0 for a non-negative quantity); the interval is cut there.
    Intersecting with the parameter space keeps the coverage: if the true mean lies in [low, high] and
    above ``lower``, it lies in [max(low, lower), high]."""
    from scipy import stats

    x = np.asarray(values, dtype=float)
    m = float(x.mean())
    if x.size < 2:
        return m, m, m
    sem = float(stats.sem(x))
    if not sem > 0:
        return m, m, m
    lo, hi = stats.t.interval(level, x.size - 1, loc=m, scale=sem)
    if lower is not None:
        lo = max(lo, lower)
    return m, float(min(lo, m)), float(max(hi, m))


def _aggregate(sp: SweepPlan, results: dict) -> list[dict]:
    rows = []
    for o in sp.objectives:
        for alg in ALGORITHMS:
            for c in o.ratios:
                for b in sp.batch_sizes:
                    per = [results[(o.name, c, b, s)] for s in sp.seeds]
                    emp = [p["algs"][alg]["emp"] for p in per]
                    mean, lo, hi = confidence_interval(emp, lower=0.0)  # a mean squared gradient norm: >= 0
                    bp = float(np.mean([p["algs"][alg]["published"] for p in per]))
                    bc = float(np.mean([p["algs"][alg]["corrected"] for p in per]))
                    rows.append({"objective": o.name, "algorithm": alg, "c": c, "k": per[0]["k"], "d": per[0]["d"],
                                 "B": per[0]["B"], "T": sp.iterations, "seeds": len(sp.seeds),
                                 "empirical_mean": mean, "ci_low": lo, "ci_high": hi,
                                 "bound_published": bp, "bound_corrected": bc,
                                 "published_holds": bp >= mean, "corrected_holds": bc >= mean})
    return rows


def answer(rows: list[dict]) -> str:
    """The yes/no answer: does the published bound fall below the empirical value while the corrected one holds?"""
    hits = [r for r in rows if not r["published_holds"] and r["corrected_holds"]]
    if hits:
        cases = "; ".join(f"{r['objective']} {r['algorithm']} c={r['c']} B={r['B']}" for r in hits)
        return f"YES: in {len(hits)} of {len(rows)} configurations the published bound is below the empirical value while the corrected one holds ({cases})."
    n_fail = sum(not r["corrected_holds"] for r in rows)
    extra = f" (the corrected bound is violated in {n_fail})" if n_fail else ""
    return f"NO: in none of {len(rows)} configurations does the published bound fall below the empirical value while the corrected one holds{extra}."


def markdown_table(rows: list[dict]) -> str:
    """results as a Markdown table (one row per configuration)."""
    head = ("| objective | algorithm | c | k | d | B | T | seeds | empirical mean [95% CI] | Cor. 2 published | "
            "Cor. 2 corrected | published holds | corrected holds |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['objective']} | {r['algorithm']} | {r['c']} | {r['k']} | {r['d']} | {r['B']} | {r['T']} | "
                     f"{r['seeds']} | {r['empirical_mean']:.3g} [{r['ci_low']:.3g}, {r['ci_high']:.3g}] | "
                     f"{r['bound_published']:.3g} | {r['bound_corrected']:.3g} | "
                     f"{'yes' if r['published_holds'] else '**no**'} | {'yes' if r['corrected_holds'] else '**no**'} |")
    return "\n".join(lines)


def _figure(sp: SweepPlan, rows: list[dict], outdir: Path) -> None:
    from .plots import plt

    objs = sp.objectives
    fig, axes = plt.subplots(1, len(objs), figsize=(6.5 * len(objs), 4.8), squeeze=False)
    for ax, o in zip(axes[0], objs):
        mine = [r for r in rows if r["objective"] == o.name]
        Bs = sorted({r["B"] for r in mine})
        for j, B in enumerate(Bs):
            ref = sorted((r for r in mine if r["B"] == B and r["algorithm"] == ALGORITHMS[0]), key=lambda r: r["c"])
            cs = [r["c"] for r in ref]
            ax.loglog(cs, [r["bound_published"] for r in ref], color=f"C{j}", ls="--", marker="v",
                      label=f"B={B}: Cor. 2 published (M^2/B)")
            ax.loglog(cs, [r["bound_corrected"] for r in ref], color=f"C{j}", ls=":", marker="^",
                      label=f"B={B}: Cor. 2 corrected (M^2)")
            for i, alg in enumerate(ALGORITHMS):
                rr = sorted((r for r in mine if r["B"] == B and r["algorithm"] == alg), key=lambda r: r["c"])
                m = np.array([r["empirical_mean"] for r in rr])
                err = np.array([[r["empirical_mean"] - r["ci_low"] for r in rr], [r["ci_high"] - r["empirical_mean"] for r in rr]])
                xs = [r["c"] for r in rr]
                ax.errorbar(xs, m, yerr=err, color=f"C{j}", ls="-" if i == 0 else "-.", marker="os"[i], ms=5 + 2 * i,
                            mfc="none" if i else None, capsize=4, elinewidth=1.5, alpha=0.9,
                            label=f"B={B}: {alg} empirical (95% CI)")
                # the CI band, visible even where the interval is narrower than a marker on this log scale
                ax.fill_between(xs, [r["ci_low"] for r in rr], [r["ci_high"] for r in rr], color=f"C{j}", alpha=0.15)
        ax.set_xscale("log")
        ax.set_yscale("log")
        title = f"{o.name} (d = {o.d}, P = {P_WORKERS}, T = {sp.iterations})"
        if o.d < 1000:
            title += f"\n(c scaled: d = {o.d}, so max c = {o.d}, k = 1)"
        ax.set(xlabel="compression ratio c = d/k", ylabel="avg ||grad f(v_t)||^2", title=title)
        ax.grid(alpha=0.3, which="both")
    from .plots import figure_legend

    figure_legend(fig, *axes[0, 0].get_legend_handles_labels())  # one legend, readable, below the panels
    save_figure(fig, outdir, "bounds")


def run_sweep(out, *, quick: bool = False, force: bool = False, jobs: int | None = None, scheduler: str | None = None,
              progress: bool = True) -> tuple[Path, list[dict], str]:
    """Run the bounds sweep into ``out`` (via ``out.partial``); return (path, result rows, Markdown report).

    jobs: local processes (default all cores; 1 runs inline); scheduler: a Dask scheduler address to run the
    runs on a Dask cluster instead (:func:`experiments.sweep.map_jobs`). Raises ConfigError if ``out`` exists
    and is not empty (unless ``force``) or ``jobs`` < 1; SparsimError if ``scheduler`` is given and Dask is
    missing or unreachable. Finished runs left in ``out.partial`` by an interrupted sweep are reused.
    """
    out = Path(out)
    check_out(out, force)
    resolve_jobs(jobs, scheduler)  # checked (and the scheduler reached) before any output
    sp = plan(quick)
    tmp = partial_dir(out, fresh=False, resume_key=f"bounds quick={quick}")  # finished runs of an interrupted sweep are reused
    (tmp / "runs").mkdir(exist_ok=True)
    cfgs = sp.configs()
    args = [(o, c, b, s, sp.iterations, str(tmp / "runs" / _run_dir_name(o, c, b, s))) for o, c, b, s in cfgs]
    got = map_jobs(_one_run, args, jobs=jobs, scheduler=scheduler, progress=progress, desc="bounds sweep")
    results = {(a[0].name, a[1], a[2], a[3]): r for a, r in zip(args, got)}
    rows = _aggregate(sp, results)
    write_csv(tmp / "results.csv", RESULT_COLUMNS, rows)
    _figure(sp, rows, tmp)
    notes = [o.note for o in sp.objectives if o.note]
    report = "\n\n".join([markdown_table(rows), *(f"Note: {n}." for n in notes),
                          "Question: does the published-variant Corollary 2 bound ever fall below the empirical "
                          "value while the corrected one holds?\nAnswer: " + answer(rows)])
    (tmp / "results.md").write_text(report + "\n")
    publish(tmp, out)
    return out, rows, report
