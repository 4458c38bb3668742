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

Measurement: each (algorithm, driver) pair is run --repeats times, the two drivers alternating
first/second from repeat to repeat, after one untimed T = 1 warm-up run per algorithm. Reported per
run: wall time, process CPU time and minor page faults; the table gives medians (wall ratio is the
target metric; CPU ratio is less sensitive to other processes competing for the 2 cores). BLAS is
single-threaded and glibc malloc is tuned to keep freed memory (see _common.tune_malloc); both
apply to both drivers.

Driver cost in isolation (--small-d, default 16000 with k scaled to keep c): the same P and message
pattern at a small d, where the numerics are cheap, gives the SimPy driver's own CPU cost per
iteration (events, rendezvous matching, network model). Dividing it by the lockstep CPU time per
iteration at the large d predicts the ratio that the driver's own work alone would cause; a measured
ratio above that prediction comes from the numerics running slower under the SimPy ordering (ranks
run ahead into iteration t+1 while iteration t's outputs wait for the slowest rank, so more arrays
are alive at once: larger heap, more page faults and cache misses) or from noise.

Outputs: --out (default benchmarks/results/event_overhead.csv) and <out stem>_small_d.csv.

This is a benchmark, not a test: nothing asserts on time.

Example:
    .venv/bin/python benchmarks/bench_event_overhead.py                 # defaults: T = 10, 3 repeats
    .venv/bin/python benchmarks/bench_event_overhead.py --iterations 5 --repeats 5 --profile all
"""
from __future__ import annotations

import os

# single-threaded BLAS (set before numpy is imported; an explicit environment setting wins): both drivers
# then do the same single-threaded numerics and process CPU time is comparable with wall time
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import gc
import math
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (closed_form_messages, environment_line, fmt, markdown_table, median, profile_by_module,  # noqa: E402
                     tune_malloc, write_csv)

from sim.algorithms import AlgorithmSpec  # noqa: E402
from sim.workloads.data import shard_indices  # noqa: E402
from sim.machine.network import PRESETS  # noqa: E402
from sim.workloads.objectives import make_objective  # noqa: E402
from sim.engine.runner import Workers, run_algorithm  # noqa: E402

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
    """The command-line options (see --help); argv: list of strings, default sys.argv[1:]."""
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
    p.add_argument("--small-d", type=int, default=16000,
                   help="also time both drivers at this small d (k scaled to keep c = d/k), where the numerics are "
                        "cheap, to isolate the driver's own cost per iteration; 0 skips it (default 16000)")
    p.add_argument("--small-repeats", type=int, default=7, help="runs per driver at --small-d (default 7)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed T = 1 warm-up runs")
    p.add_argument("--no-malloc-tuning", action="store_true", help="leave glibc malloc at its defaults")
    p.add_argument("--out", default="benchmarks/results/event_overhead.csv", help="CSV path")
    return p.parse_args(argv)


def one_run(spec, workers, x0, args, driver):
    """Time one run_algorithm call; return ((wall_s, cpu_s, minor_faults), rows, final v)."""
    T = args.iterations
    cap = {}

    def on_step(t, outs):
        if t == T:
            cap["v"] = outs[0].v.copy()

    gc.collect()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0 = time.process_time()
    t0 = time.perf_counter()
    rows = run_algorithm(spec, workers, T=T, lr=lambda t: args.lr, x0=x0, network=PRESETS[args.network],
                         driver=driver, eval_every=T, on_step=on_step)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    return (wall, cpu, faults), rows, cap["v"]


def same_numbers(rows_a, rows_b) -> bool:
    """Whether two runs' metrics rows (lists of dicts) hold the same numbers, NaN equal to NaN."""
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


def isolate(args, names, lock_cpu_big):
    """Driver cost in isolation: both drivers at a small d, where the shared numerics are cheap.

    lock_cpu_big: algorithm -> median lockstep CPU seconds of the main (large-d) runs, used to predict the
    ratio the driver cost alone would give there: 1 + (driver cost per iteration) / (lockstep per iteration).
    """
    T, P = args.iterations, args.P
    d = args.small_d
    k = max(1, round(args.k * d / args.d))
    obj = make_objective(args.objective, d=d, n=args.n, seed=args.seed)
    workers = Workers(obj, shard_indices(obj.n, P, seed=args.seed), args.b, args.seed)
    x0 = obj.x0(args.seed)
    md_rows, csv_rows = [], []
    for nm in names:
        spec = ALGOS[nm](k)
        cpu = {"simpy": [], "lockstep": []}
        wall = {"simpy": [], "lockstep": []}
        for rep in range(args.small_repeats):
            for drv in (("lockstep", "simpy") if rep % 2 == 0 else ("simpy", "lockstep")):
                m, _, _ = one_run(spec, workers, x0, args, drv)
                wall[drv].append(m[0])
                cpu[drv].append(m[1])
        s_c, l_c = median(cpu["simpy"]) / T, median(cpu["lockstep"]) / T
        s_w, l_w = median(wall["simpy"]) / T, median(wall["lockstep"]) / T
        over = s_c - l_c
        msgs = closed_form_messages(nm, P)
        pred = 1.0 + over / (lock_cpu_big[nm] / T)
        md_rows.append([spec.name, spec.collective, f"{l_c * 1e3:.2f}", f"{s_c * 1e3:.2f}", f"{over * 1e3:.2f}",
                        f"{(s_w - l_w) * 1e3:.2f}", str(msgs), f"{over / msgs * 1e6:.1f}" if msgs else "",
                        f"{lock_cpu_big[nm] / T * 1e3:.0f}", f"{pred:.3f}x"])
        csv_rows.append([nm, spec.collective, d, k, T, args.small_repeats, f"{l_c:.6f}", f"{s_c:.6f}", f"{over:.6f}",
                         f"{s_w - l_w:.6f}", msgs, f"{over / msgs * 1e6:.2f}" if msgs else "",
                         f"{lock_cpu_big[nm] / T:.6f}", f"{pred:.4f}"])
    print(f"\n## Driver cost in isolation: same P = {P} and message pattern at d = {d}, k = {k} "
          f"(c = {d / k:g}), T = {T}, median of {args.small_repeats} runs, process CPU time\n")
    print(markdown_table(["algorithm", "collective", "lockstep ms/iter", "simpy ms/iter", "driver cost ms/iter",
                          "(wall) ms/iter", "messages/iter", "us CPU/message", f"lockstep ms/iter at d={args.d}",
                          "predicted ratio at large d"], md_rows))
    print("\npredicted ratio = 1 + (driver cost per iteration at small d) / (lockstep CPU per iteration at "
          f"d = {args.d}): the slowdown the SimPy driver's own work alone would cause there.")
    out = Path(args.out)
    path = write_csv(out.with_name(out.stem + "_small_d" + out.suffix),
                     ["algorithm", "collective", "d", "k", "T", "repeats", "lockstep_cpu_s_per_iter",
                      "simpy_cpu_s_per_iter", "driver_cost_cpu_s_per_iter", "driver_cost_wall_s_per_iter",
                      "messages_per_iter", "us_cpu_per_message", "lockstep_cpu_s_per_iter_large_d",
                      "predicted_ratio_large_d"], csv_rows)
    print(f"CSV: {path}")


def main(argv=None):
    """Run the benchmark with the options of :func:`parse_args` and print its Markdown report."""
    args = parse_args(argv)
    note = "malloc tuning: off" if args.no_malloc_tuning else tune_malloc()
    names = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    for nm in names:
        if nm not in ALGOS:
            raise SystemExit(f"unknown algorithm {nm!r}: valid {', '.join(ALGOS)}")
    T, P = args.iterations, args.P
    print("# Event overhead: simpy vs lockstep driver\n")
    print(f"P = {P}, d = {args.d}, k = {args.k} (c = d/k = {args.d / args.k:g}), b = {args.b}, T = {T}, "
          f"eval_every = T, objective = {args.objective} (n = {args.n}), network = {args.network}, "
          f"repeats = {args.repeats} (median)  ")
    print(f"{environment_line()}; {note}\n", flush=True)

    obj = make_objective(args.objective, d=args.d, n=args.n, seed=args.seed)
    workers = Workers(obj, shard_indices(obj.n, P, seed=args.seed), args.b, args.seed)
    x0 = obj.x0(args.seed)
    specs = {nm: ALGOS[nm](args.k) for nm in names}

    # untimed warm-up, T = 1 per algorithm on the simpy driver (the larger peak memory): grows and
    # pre-faults the heap that the first timed runs would otherwise pay for
    if args.warmup:
        for nm in names:
            one_run(specs[nm], workers, x0, argparse.Namespace(**{**vars(args), "iterations": 1}), "simpy")

    meas = {(nm, drv): [] for nm in names for drv in ("simpy", "lockstep")}  # (wall, cpu, faults)
    first = {}
    identical_repeat = {nm: True for nm in names}
    for rep in range(args.repeats):
        order = ("lockstep", "simpy") if rep % 2 == 0 else ("simpy", "lockstep")  # cancel drift
        for nm in names:
            for drv in order:
                m, rows, v = one_run(specs[nm], workers, x0, args, drv)
                meas[(nm, drv)].append(m)
                if (nm, drv) not in first:
                    first[(nm, drv)] = (rows, v)
                else:  # same driver twice: must reproduce itself exactly
                    r0, v0 = first[(nm, drv)]
                    identical_repeat[nm] &= bool(np.array_equal(v, v0)) and same_numbers(rows, r0)
                print(f"  repeat {rep + 1}/{args.repeats} {nm:<11} {drv:<8} wall {m[0]:7.2f} s  cpu {m[1]:7.2f} s  "
                      f"minor faults {m[2]:>8}", file=sys.stderr, flush=True)

    def med(nm, drv, i):
        return median([m[i] for m in meas[(nm, drv)]])

    header = ["algorithm", "collective", "T", "repeats",
              "simpy_wall_median_s", "lockstep_wall_median_s", "ratio_wall",
              "simpy_cpu_median_s", "lockstep_cpu_median_s", "ratio_cpu",
              "simpy_wall_min_s", "lockstep_wall_min_s", "ratio_wall_min",
              "overhead_wall_s_per_iter", "simpy_minor_faults_median", "lockstep_minor_faults_median",
              "sim_time_per_iter_s", "identical", "simpy_wall_runs_s", "lockstep_wall_runs_s"]
    csv_rows, md_rows = [], []
    all_identical = True
    over = []
    for nm in names:
        sw, lw = med(nm, "simpy", 0), med(nm, "lockstep", 0)
        sc, lc = med(nm, "simpy", 1), med(nm, "lockstep", 1)
        sf, lf = med(nm, "simpy", 2), med(nm, "lockstep", 2)
        swm = min(m[0] for m in meas[(nm, "simpy")])
        lwm = min(m[0] for m in meas[(nm, "lockstep")])
        ratio = sw / lw
        rows_s, v_s = first[(nm, "simpy")]
        rows_l, v_l = first[(nm, "lockstep")]
        ident = bool(np.array_equal(v_s, v_l)) and same_numbers(rows_s, rows_l) and identical_repeat[nm]
        all_identical &= ident
        if ratio > args.target:
            over.append(nm)
        sim_per_iter = rows_s[-1]["sim_time_s"] / T
        spec = specs[nm]
        csv_rows.append([nm, spec.collective, T, args.repeats, f"{sw:.4f}", f"{lw:.4f}", f"{ratio:.4f}",
                         f"{sc:.4f}", f"{lc:.4f}", f"{sc / lc:.4f}", f"{swm:.4f}", f"{lwm:.4f}", f"{swm / lwm:.4f}",
                         f"{(sw - lw) / T:.4f}", int(sf), int(lf), f"{sim_per_iter:.6g}", ident,
                         " ".join(f"{m[0]:.3f}" for m in meas[(nm, "simpy")]),
                         " ".join(f"{m[0]:.3f}" for m in meas[(nm, "lockstep")])])
        md_rows.append([spec.name, spec.collective, f"{sw:.2f}", f"{lw:.2f}", f"**{ratio:.2f}x**",
                        f"{sc / lc:.2f}x", f"{swm / lwm:.2f}x", f"{(sw - lw) / T * 1e3:+.0f}",
                        f"{sf / 1e3:.0f}k / {lf / 1e3:.0f}k", fmt(sim_per_iter, ".4g"), str(ident)])
    print(markdown_table(["algorithm", "collective", "simpy wall (s)", "lockstep wall (s)", "wall ratio",
                          "cpu ratio", "min-wall ratio", "overhead/iter (ms)", "minor faults simpy/lockstep",
                          "sim time/iter (s)", "identical"], md_rows))
    print()
    print("wall ratio = median simpy wall / median lockstep wall (the target metric); cpu ratio uses process "
          "CPU time (less sensitive to other processes on the machine); min-wall ratio uses the fastest run "
          "of each.")
    print(f"identical: {all_identical}  (final v_T and every numeric metrics column, simpy vs lockstep)")
    print(f"target wall ratio <= {args.target}x: " + ("met by all" if not over else f"NOT met by {', '.join(over)}"))
    path = write_csv(args.out, header, csv_rows)
    print(f"CSV: {path}")

    if args.small_d:
        isolate(args, names, {nm: med(nm, "lockstep", 1) for nm in names})

    todo = names if args.profile == "all" else (over if args.profile == "auto" else [])
    for nm in todo:
        for drv in ("simpy", "lockstep"):
            print(f"\n## cProfile: {nm} driver={drv}\n\n```")
            print(profile_by_module(lambda: one_run(specs[nm], workers, x0, args, drv),
                                        f"profiled, T = {args.iterations}").rstrip())
            print("```")


if __name__ == "__main__":
    main()
