"""Event overhead of the SimPy driver: run_algorithm(driver="simpy") vs driver="lockstep".

Both drivers execute the same sans-I/O per-rank programs (sim.algorithms.sgd_step), so they do the
same numerics; the SimPy driver adds the discrete-event clock (network model, rendezvous matching,
per-rank processes). This benchmark times whole run_algorithm calls for P = 16 workers at
d = 10^6, k = 10^3 (c = d/k = 1000), b = 1, on a synthetic objective, for

    topk (allgather), gtopk (tree), gtopk (recursive_doubling), dense (ring),

and reports the median wall time of each driver over --repeats runs and the ratio simpy/lockstep
(target <= 1.3x). eval_every = T, so the full objective is evaluated only at t = 0 and t = T.
It also checks that both drivers produce bit-identical numbers: the final parameters v_T (captured
with on_step) and every numeric metrics column except the time columns.

Objective: ``double_well`` by default, the cheapest synthetic objective with a dense gradient at
d = 10^6 (one batch gradient ~10 ms vs ~18 ms for ``sines``). ``robust_regression`` has a cheaper
batch gradient (~0.2 ms) but it is only b*nnz = 8-sparse, so the error-feedback accumulator is almost
all exact zeros, top-k degenerates (fewer than k non-zeros: every algorithm sends the same entries)
and np.partition hits its slow path on the many ties (~0.35 s per call instead of ~20 ms), which
makes a whole step several times MORE expensive. Choose it with --objective to see that.

This is a benchmark, not a test: nothing asserts on time.

Example:
    .venv/bin/python benchmarks/bench_event_overhead.py                 # defaults: T = 10, 3 repeats
    .venv/bin/python benchmarks/bench_event_overhead.py --iterations 5 --repeats 5 --profile all
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import math
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment_line, fmt, markdown_table, median, tune_malloc, write_csv  # noqa: E402

from sim.algorithms import AlgorithmSpec  # noqa: E402
from sim.data import shard_indices  # noqa: E402
from sim.network import PRESETS  # noqa: E402
from sim.objectives import make_objective  # noqa: E402
from sim.runner import Workers, run_algorithm  # noqa: E402

NUMERIC_COLUMNS = ("loss", "grad_norm_sq", "stoch_grad_norm_sq", "residual_norm_sq", "delta", "bytes_sent",
                   "applied_fraction", "mass_error", "aux_gap")
# bytes_sent is 0 under lockstep (no network): compared only between runs of the same driver
COMPARED_COLUMNS = tuple(c for c in NUMERIC_COLUMNS if c != "bytes_sent")

ALGOS = {
    "topk": lambda k: AlgorithmSpec("topk", k=k),
    "gtopk_tree": lambda k: AlgorithmSpec("gtopk", k=k, collective="tree"),
    "gtopk_rd": lambda k: AlgorithmSpec("gtopk", k=k, collective="recursive_doubling"),
    "dense_ring": lambda k: AlgorithmSpec("dense", collective="ring"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--P", type=int, default=16, help="workers (default 16)")
    p.add_argument("--d", type=int, default=10**6, help="parameters (default 10^6)")
    p.add_argument("--k", type=int, default=10**3, help="selected coordinates per worker (default 10^3)")
    p.add_argument("--b", type=int, default=1, help="per-worker batch size (default 1)")
    p.add_argument("--n", type=int, default=1024, help="samples of the synthetic objective (default 1024)")
    p.add_argument("--iterations", "-T", type=int, default=10, help="iterations T per run (default 10)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per (algorithm, driver); median reported")
    p.add_argument("--objective", default="double_well", choices=("double_well", "sines", "robust_regression"))
    p.add_argument("--network", default="1GbE", choices=tuple(PRESETS), help="network preset (default 1GbE)")
    p.add_argument("--lr", type=float, default=0.05, help="constant learning rate (default 0.05)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--algorithms", default=",".join(ALGOS), help=f"comma list from {','.join(ALGOS)}")
    p.add_argument("--target", type=float, default=1.3, help="ratio target printed next to the results")
    p.add_argument("--profile", choices=("none", "auto", "all"), default="none",
                   help="cProfile one run of each driver: for algorithms above --target (auto) or all")
    p.add_argument("--no-malloc-tuning", action="store_true", help="leave glibc malloc at its defaults")
    p.add_argument("--out", default="benchmarks/results/event_overhead.csv", help="CSV path")
    return p.parse_args(argv)


def one_run(spec, workers, x0, args, driver):
    """Time one run_algorithm call; return (wall_s, rows, final v)."""
    T = args.iterations
    cap = {}

    def on_step(t, outs):
        if t == T:
            cap["v"] = outs[0].v.copy()

    gc.collect()
    t0 = time.perf_counter()
    rows = run_algorithm(spec, workers, T=T, lr=lambda t: args.lr, x0=x0, network=PRESETS[args.network],
                         driver=driver, eval_every=T, on_step=on_step)
    wall = time.perf_counter() - t0
    return wall, rows, cap["v"]


def same_numbers(rows_a, rows_b) -> bool:
    if len(rows_a) != len(rows_b):
        return False
    for ra, rb in zip(rows_a, rows_b):
        for c in COMPARED_COLUMNS:
            a, b = ra[c], rb[c]
            if a is None or b is None:
                if a is not b:
                    return False
                continue
            if not (a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))):
                return False
    return True


def profile_run(spec, workers, x0, args, driver, top=15) -> str:
    prof = cProfile.Profile()
    prof.enable()
    one_run(spec, workers, x0, args, driver)
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    # where the time goes, by package
    by_pkg = {}
    for (fn, _, _), (_, _, tt, _, _) in st.stats.items():
        key = ("simpy" if "/simpy/" in fn else
               "sim.cluster" if fn.endswith("sim/cluster.py") else
               "sim.network" if fn.endswith("sim/network.py") else
               "sim.runner" if fn.endswith("sim/runner.py") else
               "sim (other)" if "/sim/" in fn else
               "numpy" if "numpy" in fn else
               "builtins/C" if fn == "~" else "other")
        by_pkg[key] = by_pkg.get(key, 0.0) + tt
    total = sum(by_pkg.values())
    s.write(f"total {total:.2f} s (profiled, T = {args.iterations}); self time by module: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(by_pkg.items(), key=lambda kv: -kv[1])) + "\n")
    st.sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main(argv=None):
    args = parse_args(argv)
    note = "malloc tuning: off" if args.no_malloc_tuning else tune_malloc()
    names = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    for nm in names:
        if nm not in ALGOS:
            raise SystemExit(f"unknown algorithm {nm!r}: valid {', '.join(ALGOS)}")
    T, P = args.iterations, args.P
    print(f"# Event overhead: simpy vs lockstep driver\n")
    print(f"P = {P}, d = {args.d}, k = {args.k} (c = d/k = {args.d / args.k:g}), b = {args.b}, T = {T}, "
          f"eval_every = T, objective = {args.objective} (n = {args.n}), network = {args.network}, "
          f"repeats = {args.repeats} (median)  ")
    print(f"{environment_line()}; {note}\n", flush=True)

    obj = make_objective(args.objective, d=args.d, n=args.n, seed=args.seed)
    workers = Workers(obj, shard_indices(obj.n, P, seed=args.seed), args.b, args.seed)
    x0 = obj.x0(args.seed)
    specs = {nm: ALGOS[nm](args.k) for nm in names}

    # untimed warm-up (pre-faults the heap the first timed run would otherwise pay for)
    one_run(specs[names[0]], workers, x0, argparse.Namespace(**{**vars(args), "iterations": 1}), "lockstep")

    walls = {(nm, drv): [] for nm in names for drv in ("simpy", "lockstep")}
    first = {}
    identical_repeat = {nm: True for nm in names}
    for rep in range(args.repeats):
        order = ("lockstep", "simpy") if rep % 2 == 0 else ("simpy", "lockstep")  # cancel drift
        for nm in names:
            for drv in order:
                wall, rows, v = one_run(specs[nm], workers, x0, args, drv)
                walls[(nm, drv)].append(wall)
                if (nm, drv) not in first:
                    first[(nm, drv)] = (rows, v)
                else:  # same driver twice: must reproduce itself exactly
                    r0, v0 = first[(nm, drv)]
                    identical_repeat[nm] &= bool(np.array_equal(v, v0)) and same_numbers(rows, r0)
                print(f"  repeat {rep + 1}/{args.repeats} {nm:<11} {drv:<8} {wall:8.2f} s", file=sys.stderr,
                      flush=True)

    header = ["algorithm", "collective", "simpy_median_s", "lockstep_median_s", "ratio_simpy_over_lockstep",
              "simpy_s_per_iter", "lockstep_s_per_iter", "overhead_s_per_iter", "sim_time_per_iter_s",
              "identical", "simpy_runs_s", "lockstep_runs_s"]
    csv_rows, md_rows = [], []
    all_identical = True
    over = []
    for nm in names:
        s_med = median(walls[(nm, "simpy")])
        l_med = median(walls[(nm, "lockstep")])
        ratio = s_med / l_med
        rows_s, v_s = first[(nm, "simpy")]
        rows_l, v_l = first[(nm, "lockstep")]
        ident = bool(np.array_equal(v_s, v_l)) and same_numbers(rows_s, rows_l) and identical_repeat[nm]
        all_identical &= ident
        if ratio > args.target:
            over.append(nm)
        sim_per_iter = rows_s[-1]["sim_time_s"] / T
        spec = specs[nm]
        csv_rows.append([nm, spec.collective, f"{s_med:.4f}", f"{l_med:.4f}", f"{ratio:.4f}", f"{s_med / T:.4f}",
                         f"{l_med / T:.4f}", f"{(s_med - l_med) / T:.4f}", f"{sim_per_iter:.6g}", ident,
                         " ".join(f"{w:.3f}" for w in walls[(nm, "simpy")]),
                         " ".join(f"{w:.3f}" for w in walls[(nm, "lockstep")])])
        md_rows.append([spec.name, spec.collective, f"{s_med:.2f}", f"{l_med:.2f}", f"{ratio:.2f}x",
                        f"{(s_med - l_med) / T * 1e3:+.0f}", fmt(sim_per_iter, ".4g"), str(ident)])
    print(markdown_table(["algorithm", "collective", "simpy wall (s)", "lockstep wall (s)", "simpy/lockstep",
                          "overhead per iter (ms)", "sim time per iter (s)", "identical"], md_rows))
    print()
    print(f"identical: {all_identical}  (final v_T and every numeric metrics column, simpy vs lockstep)")
    print(f"target ratio <= {args.target}x: " + ("met by all" if not over else f"NOT met by {', '.join(over)}"))
    path = write_csv(args.out, header, csv_rows)
    print(f"CSV: {path}")

    todo = names if args.profile == "all" else (over if args.profile == "auto" else [])
    for nm in todo:
        for drv in ("simpy", "lockstep"):
            print(f"\n## cProfile: {nm} driver={drv}\n\n```")
            print(profile_run(specs[nm], workers, x0, args, drv).rstrip())
            print("```")


if __name__ == "__main__":
    main()
