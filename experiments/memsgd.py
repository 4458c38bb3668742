"""``sparsim experiment memsgd``: Mem-SGD (Stich, Cordonnier, Jaggi, NeurIPS 2018) -- top-k vs rand-k vs SGD.

Single worker (P = 1), batch 1, regularised logistic regression f(x) = (1/n) sum_i log(1 + exp(-s_i a_i^T x))
+ (lambda/2)||x||^2 with lambda = 1/n (objective ``logistic`` with lam = 0, i.e. no non-convex term, and
mu = 1/n), on

- the synthetic epsilon-like set (``synthetic_epsilon``: d = 2000, n = 10000, unit-norm rows), k in {1, 2, 3};
- any binary LIBSVM file given with ``--libsvm PATH``: k in {1, 2, 3} times ceil(d/2000) (the paper uses
  {10, 20, 30} for RCV1; the output states the k used).

Mem-SGD's memory update is our error feedback with P = 1: acc = m + eta_t g; send comp_k(acc);
m = acc - comp_k(acc) (docs/theory.md section 2), with comp = top-k (``topk``) or rand-k (``randk``,
:func:`sim.comm.compression.randk`, seeded per iteration). Plain SGD = ``dense`` with P = 1. Two step sizes:

- ``thm24``: Theorem 2.4's eta_t = 8/(mu(a + t)) with alpha = 5, a = (alpha+1) d/k + rho/(rho+1),
  rho = 4 alpha/((alpha-4)(alpha+1)^2) (docs/theory.md section 6);
- ``gamma2``: the paper's practical eta_t = gamma/(lambda(t + a)) with gamma = 2, a = d/k;

with k = d for plain SGD (so a = 6.36 and a = 1). t counts from 0 at the first step. The y-axis is the
suboptimality f(x_t) - f* of the last iterate (not Theorem 2.4's weighted average), f* estimated by
``scipy.optimize.minimize(method="L-BFGS-B")`` on the (strongly convex) full objective from x = 0 (gtol
1e-10; the gradient norm reached is reported). Bits communicated per iteration: k (32 + ceil(log2 d))
for top-k and rand-k (a 32-bit value and its index per element), 32 d for SGD.

Output directory (built as ``DIR.partial``, renamed when complete; finished runs are reused):
``memsgd.csv`` (:data:`CURVE_COLUMNS`), ``summary.csv`` (:data:`SUMMARY_COLUMNS`), ``fstar.json``,
``memsgd.png``/``.pdf``, ``results.md``, ``runs/``.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.base.errors import ConfigError

from .outdir import atomic_write_text, check_out, partial_dir, publish, save_figure, write_csv
from .paper_common import cached_run
from .sweep import map_jobs, resolve_jobs

__all__ = ["MemSGDData", "plan", "run_memsgd", "step_schedule", "bits_per_iteration", "estimate_fstar",
           "CURVE_COLUMNS", "SUMMARY_COLUMNS"]

CURVE_COLUMNS = ("dataset", "schedule", "algorithm", "k", "a", "iteration", "lr", "bits", "loss", "suboptimality")
SUMMARY_COLUMNS = ("dataset", "schedule", "algorithm", "k", "a", "T", "initial_suboptimality",
                   "final_suboptimality", "min_suboptimality", "total_bits")
SCHEDULES = ("thm24", "gamma2")
ALPHA = 5.0
SEED = 0


@dataclass(frozen=True)
class MemSGDData:
    """One data set: load_dataset name and keyword arguments, a display name, the k values and T."""

    name: str
    dataset: str
    kwargs: tuple
    ks: tuple[int, ...]
    T: int
    note: str = ""


def plan(quick: bool = False, libsvm: str | None = None) -> tuple[tuple[MemSGDData, ...], tuple[str, ...]]:
    """(data sets, schedules). Full: synthetic epsilon (d = 2000, n = 10000, T = 30000 = 3 epochs), both
    schedules, plus ``libsvm`` (T = min(3 n, 30000)). Quick (CI): a d = 200, n = 1000 epsilon-like set,
    T = 3000, gamma2 only. Raises ConfigError / DataError for a missing, malformed or non-binary file."""
    if quick:
        sets = [MemSGDData("synthetic_epsilon_small", "synthetic_epsilon", (("n", 1000), ("d", 200), ("seed", SEED)),
                           (1, 2, 3), 3000, "quick size: epsilon-like set with d = 200, n = 1000")]
        schedules: tuple[str, ...] = ("gamma2",)
    else:
        sets = [MemSGDData("synthetic_epsilon", "synthetic_epsilon", (("n", 10_000), ("d", 2000), ("seed", SEED)),
                           (1, 2, 3), 30_000)]
        schedules = SCHEDULES
    if libsvm is not None:
        from sim.workloads.data import load_dataset

        ds = load_dataset("libsvm", libsvm)
        if ds.n_classes != 2:
            raise ConfigError(f"--libsvm {libsvm!r} has {ds.n_classes} classes: memsgd needs a binary data set")
        n, d = ds.X.shape
        scale = max(1, math.ceil(d / 2000))
        note = f"{ds.name}: d = {d}, n = {n}; k = (1, 2, 3) x ceil(d/2000) = {tuple(scale * k for k in (1, 2, 3))}"
        sets.append(MemSGDData(Path(libsvm).name, "libsvm", (("path", str(libsvm)),),
                               tuple(min(d, scale * k) for k in (1, 2, 3)), min(3 * n, 300 if quick else 30_000), note))
    return tuple(sets), schedules


@functools.lru_cache(maxsize=4)
def _objective(ds: MemSGDData):
    from sim.workloads.data import load_dataset
    from sim.workloads.objectives import make_objective

    data = load_dataset(ds.dataset, **dict(ds.kwargs))
    return make_objective("logistic", dataset=data, lam=0.0, mu=1.0 / data.n)


def step_schedule(schedule: str, mu: float, d: int, k: int) -> tuple[float, callable]:
    """(a, eta): the offset a and t -> eta_t (t = 1..T is the runner's step counter, Mem-SGD's t = t - 1).

    ``thm24``: eta = 8/(mu(a + t - 1)), a = (alpha+1) d/k + rho/(rho+1), alpha = 5 (Theorem 2.4).
    ``gamma2``: eta = 2/(mu(a + t - 1)), a = d/k (the paper's experiments). mu: strong convexity (= lambda).
    Raises ConfigError for an unknown schedule.
    """
    if schedule == "thm24":
        rho = 4 * ALPHA / ((ALPHA - 4) * (ALPHA + 1) ** 2)
        a, num = (ALPHA + 1) * d / k + rho / (rho + 1), 8.0
    elif schedule == "gamma2":
        a, num = d / k, 2.0
    else:
        raise ConfigError(f"schedule = {schedule!r} is unknown: valid {', '.join(SCHEDULES)}")
    return a, (lambda t: num / (mu * (a + t - 1)))


def bits_per_iteration(d: int, k: int | None) -> int:
    """Bits sent per iteration: 32 d (dense, k None) or k (32 + ceil(log2 d)) (value + index per element)."""
    if k is None:
        return 32 * d
    return k * (32 + max(1, math.ceil(math.log2(d))))


def estimate_fstar(obj) -> dict:
    """f* of the convex objective by scipy L-BFGS-B from x = 0: {"f_star", "grad_norm", "iterations", "method"}."""
    from scipy.optimize import minimize

    res = minimize(lambda x: (obj.loss(x), obj.full_grad(x)), np.zeros(obj.d), jac=True, method="L-BFGS-B",
                   options={"maxiter": 10_000, "gtol": 1e-10, "ftol": 1e-15})
    g = obj.full_grad(res.x)
    return {"f_star": float(res.fun), "grad_norm": float(np.linalg.norm(g)), "iterations": int(res.nit),
            "method": "scipy.optimize.minimize L-BFGS-B on the full objective from x = 0 (gtol 1e-10)"}


def _fstar_job(ds: MemSGDData, path: str) -> dict:
    p = Path(path)
    if p.is_file():
        return json.loads(p.read_text())
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        info = estimate_fstar(_objective(ds))
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(p, json.dumps(info, indent=2))  # a resumed sweep reads it back: never half a file
    return info


def _one_run(ds: MemSGDData, schedule: str, alg: str, k: int | None, run_dir: str) -> list[dict]:
    """Run (or reuse) one (data set, schedule, algorithm, k) on one worker; return its metrics rows."""
    from sim.algorithms import AlgorithmSpec
    from sim.engine.runner import Workers, run_algorithm

    def compute():
        obj = _objective(ds)
        _a, lr = step_schedule(schedule, obj.mu, obj.d, obj.d if k is None else k)
        spec = AlgorithmSpec("dense") if alg == "sgd" else AlgorithmSpec(alg, k=k, seed=SEED)
        w = Workers(obj, [np.arange(obj.n, dtype=np.int64)], 1, SEED)
        return run_algorithm(spec, w, T=ds.T, lr=lr, x0=obj.x0(SEED), driver="lockstep", eval_every=max(1, ds.T // 100))

    return cached_run(Path(run_dir), compute)


def _figure(sets, schedules, curves, fstars, outdir: Path) -> None:
    from .plots import plt

    rows = [(ds, s) for ds in sets for s in schedules]
    fig, axes = plt.subplots(len(rows), 2, figsize=(12, 3.9 * len(rows)), squeeze=False)
    for (ds, s), (axi, axb) in zip(rows, axes):
        for alg, ls in (("sgd", "-"), ("topk", "-"), ("randk", "--")):
            for i, k in enumerate((None,) if alg == "sgd" else ds.ks):
                rr = [r for r in curves if r["dataset"] == ds.name and r["schedule"] == s and r["algorithm"] == alg
                      and r["k"] == (k or 0) and not math.isnan(r["suboptimality"])]
                lab = "SGD (no compression)" if alg == "sgd" else f"{alg} k={k}"
                col = "k" if alg == "sgd" else f"C{i}"
                y = [max(r["suboptimality"], 1e-12) for r in rr]
                axi.semilogy([r["iteration"] for r in rr], y, color=col, ls=ls, lw=1.1, label=lab)
                # log x: the starting point (0 bits) has no place on it; drawing it at 1 bit made a false ramp
                pts = [(r["bits"], v) for r, v in zip(rr, y) if r["bits"] > 0]
                axb.loglog([b for b, _ in pts], [v for _, v in pts], color=col, ls=ls, lw=1.1, label=lab)
        sched = ("Thm 2.4: eta_t = 8/(mu(a+t)), a = 6d/k + 0.36" if s == "thm24" else
                 "practical: eta_t = 2/(lambda(t+a)), a = d/k")
        fs = fstars[ds.name]
        axi.set(xlabel="iteration t", ylabel="f(x_t) - f*", title=f"{ds.name}, {sched}")
        axb.set(xlabel="bits communicated", ylabel="f(x_t) - f*",
                title=f"f* = {fs['f_star']:.6g} (L-BFGS-B, ||grad|| = {fs['grad_norm']:.1e})")
        for ax in (axi, axb):
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
    fig.suptitle("Mem-SGD: top-k vs rand-k (with memory) vs SGD, logistic regression, lambda = 1/n, P = 1, batch 1",
                 fontsize=10)
    fig.tight_layout()
    save_figure(fig, outdir, "memsgd")


def markdown(summary: list[dict], fstars: dict, notes: list[str]) -> str:
    """The final suboptimality per run as a Markdown table, with f* and notes."""
    lines = ["| dataset | schedule | algorithm | k | a | T | f(x_0) - f* | final f(x_T) - f* | bits sent |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['dataset']} | {s['schedule']} | {s['algorithm']} | {s['k'] or 'd'} | {s['a']:.4g} | "
                     f"{s['T']} | {s['initial_suboptimality']:.4g} | {s['final_suboptimality']:.4g} | {s['total_bits']:.3g} |")
    lines.append("")
    for name, f in fstars.items():
        lines.append(f"f* ({name}) = {f['f_star']:.10g}: {f['method']}; ||grad f|| there = {f['grad_norm']:.2e}.")
    lines.extend(f"Note: {n}." for n in notes)
    return "\n".join(lines)


def run_memsgd(out, *, quick: bool = False, force: bool = False, jobs: int | None = None,
        scheduler: str | None = None, progress: bool = True,
               libsvm: str | None = None) -> tuple[Path, list[dict], str]:
    """Run the Mem-SGD experiment into ``out`` (via ``out.partial``); return (path, summary rows, Markdown).

    libsvm: path of a binary LIBSVM-format file to add as a second data set (None: synthetic only).
    Raises ConfigError if ``out`` exists and is not empty (unless ``force``), ``jobs`` < 1, or the LIBSVM
    file is missing, malformed or not binary. Finished runs in ``out.partial/runs`` are reused.
    """
    out = Path(out)
    check_out(out, force)
    jobs = resolve_jobs(jobs, scheduler)  # checked (and the scheduler reached) before any output
    sets, schedules = plan(quick, libsvm)
    tmp = partial_dir(out, fresh=False, resume_key=f"memsgd quick={quick} libsvm={libsvm}")
    fjobs = [(ds, str(tmp / "runs" / f"{ds.name}_fstar.json")) for ds in sets]
    args = [(ds, s, alg, k, str(tmp / "runs" / (f"{ds.name}_{s}_{alg}" + ("" if k is None else f"_k{k}"))))
            for ds in sets for s in schedules for alg, k in [("sgd", None)] + [(a, k) for a in ("topk", "randk")  # algorithms: Mem-SGD's figure
                                                                                for k in ds.ks]]
    both = map_jobs(_dispatch, [("f", *a) for a in fjobs] + [("r", *a) for a in args], jobs=jobs, scheduler=scheduler, desc="memsgd",
                    progress=progress)
    fstars = {ds.name: f for ds, f in zip(sets, both[:len(sets)])}
    results = both[len(sets):]
    curves, summary = [], []
    for (ds, s, alg, k, _d), rows in zip(args, results):
        obj_d = dict(ds.kwargs).get("d") or _objective(ds).d
        fs = fstars[ds.name]["f_star"]
        mu = 1.0 / (dict(ds.kwargs).get("n") or _objective(ds).n)
        a, _lr = step_schedule(s, mu, obj_d, obj_d if k is None else k)
        bpi = bits_per_iteration(obj_d, k)
        sub = []
        for r in rows:
            t = int(r["iteration"])
            so = float(r["loss"]) - fs
            curves.append({"dataset": ds.name, "schedule": s, "algorithm": alg, "k": k or 0, "a": a, "iteration": t,
                           "lr": float(r["lr"]), "bits": t * bpi, "loss": float(r["loss"]), "suboptimality": so})
            if not math.isnan(so):
                sub.append(so)
        summary.append({"dataset": ds.name, "schedule": s, "algorithm": alg, "k": k or 0, "a": a, "T": ds.T,
                        "initial_suboptimality": sub[0], "final_suboptimality": sub[-1],
                        "min_suboptimality": min(sub), "total_bits": ds.T * bpi})
    write_csv(tmp / "memsgd.csv", CURVE_COLUMNS, curves)
    write_csv(tmp / "summary.csv", SUMMARY_COLUMNS, summary)
    (tmp / "fstar.json").write_text(json.dumps(fstars, indent=2) + "\n")
    _figure(sets, schedules, curves, fstars, tmp)
    notes = [ds.note for ds in sets if ds.note] + [
        "k = 0 in the CSVs means no compression (plain SGD, k = d)",
        "rand-k's indices could be regenerated from a shared seed instead of sent; they are counted here "
        "as the brief's uniform 32 + ceil(log2 d) bits per element"]
    report = markdown(summary, fstars, notes)
    (tmp / "results.md").write_text(report + "\n")
    publish(tmp, out)
    return out, summary, report


def _dispatch(kind: str, *a):
    return _fstar_job(*a) if kind == "f" else _one_run(*a)
