"""Wall time per simulated iteration of the message-level SimPy simulation at large P.

For P in --P (default 64, 256, 1024) and topk (Bruck allgather), gtopk (tree) and gtopk
(recursive_doubling), run run_algorithm(driver="simpy") with real numerics at a small dimension
(default d = 10^4, k = 10, b = 1, T = 3, eval_every = T) on the 1GbE preset, and report

- wall seconds per iteration: (time the last metrics row was emitted - time row 0 was emitted) / T,
  i.e. the steady iterations without the set-up and the initial evaluation (taken with on_row);
- total wall seconds of the run_algorithm call;
- simulated seconds per iteration (sim_time_s of the last row / T);
- messages per iteration, measured from the network counters (Network.messages_sent summed over
  ranks, divided by T), next to the closed form: topk Bruck P*ceil(lg P), gtopk tree 2(P-1) (binomial
  reduce + broadcast), gtopk recursive doubling pof2*lg(pof2) + 2*rem (pof2 = largest power of two
  <= P, rem = P - pof2); and the SimPy events scheduled per iteration;
- bytes on the wire per iteration (all ranks).

The SimCluster that run_algorithm builds is not returned, so this script replaces
sim.engine.runner.SimCluster, in its own process only, by a subclass that remembers the last instance (no
behaviour change). Configurations whose wall time per iteration exceeds --slow-threshold (default
60 s) are re-run under cProfile with T = 1 and the top 15 functions are printed (--profile all
profiles every configuration).

This is a benchmark, not a test: nothing asserts on time.

Example:
    .venv/bin/python benchmarks/bench_large_p.py
    .venv/bin/python benchmarks/bench_large_p.py --P 64,256 --lockstep
"""
from __future__ import annotations

import os

# single-threaded BLAS (set before numpy is imported; an explicit environment setting wins): both drivers
# then do the same single-threaded numerics and process CPU time is comparable with wall time
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (closed_form_messages, environment_line, markdown_table, median, profile_by_module,  # noqa: E402
                     tune_malloc, write_csv)

import sim.engine.runner as runner_mod  # noqa: E402
from sim.algorithms import AlgorithmSpec  # noqa: E402
from sim.engine.cluster import SimCluster  # noqa: E402
from sim.workloads.data import shard_indices  # noqa: E402
from sim.machine.network import PRESETS  # noqa: E402
from sim.workloads.objectives import make_objective  # noqa: E402
from sim.engine.runner import Workers, run_algorithm  # noqa: E402


class _RecordingCluster(SimCluster):
    """SimCluster that remembers the last instance, so its network counters can be read afterwards."""

    last: SimCluster | None = None

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        _RecordingCluster.last = self


runner_mod.SimCluster = _RecordingCluster  # this process only; same behaviour

ALGOS = {
    "topk": lambda k: AlgorithmSpec("topk", k=k),
    "gtopk_tree": lambda k: AlgorithmSpec("gtopk", k=k, collective="tree"),
    "gtopk_rd": lambda k: AlgorithmSpec("gtopk", k=k, collective="recursive_doubling"),
}


def parse_args(argv=None):
    """The command-line options (see --help); argv: list of strings, default sys.argv[1:]."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--P", default="64,256,1024", help="comma list of worker counts (default 64,256,1024)")
    p.add_argument("--d", type=int, default=10**4, help="parameters (default 10^4)")
    p.add_argument("--k", type=int, default=10, help="selected coordinates per worker (default 10)")
    p.add_argument("--b", type=int, default=1, help="per-worker batch size (default 1)")
    p.add_argument("--n", type=int, default=0, help="samples (default max(1024, P*b))")
    p.add_argument("--iterations", "-T", type=int, default=3, help="iterations T per run (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration; median reported (default 3)")
    p.add_argument("--objective", default="double_well", choices=("double_well", "sines"))
    p.add_argument("--network", default="1GbE", choices=tuple(PRESETS))
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--algorithms", default=",".join(ALGOS), help=f"comma list from {','.join(ALGOS)}")
    p.add_argument("--lockstep", action="store_true",
                   help="also time driver='lockstep' (same numerics, no SimPy) for comparison")
    p.add_argument("--slow-threshold", type=float, default=60.0,
                   help="profile configurations slower than this many wall seconds per iteration (default 60)")
    p.add_argument("--profile", choices=("auto", "all", "none"), default="auto",
                   help="auto: profile only slow configurations; all: every one; none: never")
    p.add_argument("--no-malloc-tuning", action="store_true", help="leave glibc malloc at its defaults")
    p.add_argument("--out", default="benchmarks/results/large_p.csv", help="CSV path")
    return p.parse_args(argv)


def one_run(spec, workers, x0, T, args, driver="simpy"):
    """Run once; return dict with wall_total_s, wall_per_iter_s, rows, cluster (or None)."""
    stamps = []
    _RecordingCluster.last = None
    gc.collect()
    t0 = time.perf_counter()
    rows = run_algorithm(spec, workers, T=T, lr=lambda t: args.lr, x0=x0, network=PRESETS[args.network],
                         driver=driver, eval_every=T, on_row=lambda row: stamps.append(time.perf_counter()))
    total = time.perf_counter() - t0
    return {"wall_total_s": total, "wall_per_iter_s": (stamps[-1] - stamps[0]) / T, "rows": rows,
            "cluster": _RecordingCluster.last if driver == "simpy" else None}


def main(argv=None):
    """Run the benchmark with the options of :func:`parse_args` and print its Markdown report."""
    args = parse_args(argv)
    note = "malloc tuning: off" if args.no_malloc_tuning else tune_malloc()
    Ps = [int(x) for x in args.P.split(",") if x.strip()]
    names = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    for nm in names:
        if nm not in ALGOS:
            raise SystemExit(f"unknown algorithm {nm!r}: valid {', '.join(ALGOS)}")
    T = args.iterations
    print("# Large-P message-level simulation: wall time per simulated iteration\n")
    print(f"P = {Ps}, d = {args.d}, k = {args.k}, b = {args.b}, T = {T}, eval_every = T, objective = "
          f"{args.objective}, network = {args.network}, driver = simpy, repeats = {args.repeats} (median)  ")
    print(f"{environment_line()}; {note}\n", flush=True)

    header = ["P", "algorithm", "collective", "T", "wall_s_per_iter", "wall_total_s", "lockstep_wall_s_per_iter",
              "sim_s_per_iter", "messages_per_iter", "messages_per_iter_closed_form", "messages_per_rank_per_iter",
              "simpy_events_per_iter", "bytes_per_iter", "us_wall_per_message"]
    csv_rows, md_rows, slow = [], [], []
    for P in Ps:
        n = args.n or max(1024, P * args.b)
        obj = make_objective(args.objective, d=args.d, n=n, seed=args.seed)
        workers = Workers(obj, shard_indices(obj.n, P, seed=args.seed), args.b, args.seed)
        x0 = obj.x0(args.seed)
        for nm in names:
            spec = ALGOS[nm](args.k)
            runs = []
            for _ in range(args.repeats):
                runs.append(one_run(spec, workers, x0, T, args))
                print(f"  P = {P:5d} {nm:<11} wall/iter {runs[-1]['wall_per_iter_s']:8.3f} s", file=sys.stderr,
                      flush=True)
            wpi = median([r["wall_per_iter_s"] for r in runs])
            wtot = median([r["wall_total_s"] for r in runs])
            last = runs[-1]
            cl = last["cluster"]
            msgs = float(cl.net.messages_sent.sum()) / T
            nbytes = float(cl.net.bytes_sent.sum()) / T
            eid = getattr(cl.env, "_eid", None)  # simpy's event counter (private; may be absent)
            events = (next(eid) / T) if eid is not None else float("nan")
            sim_pi = last["rows"][-1]["sim_time_s"] / T
            cf = closed_form_messages(nm, P)
            lock_pi = ""
            if args.lockstep:
                lr_ = [one_run(spec, workers, x0, T, args, "lockstep")["wall_per_iter_s"] for _ in range(args.repeats)]
                lock_pi = f"{median(lr_):.4f}"
            if wpi > args.slow_threshold:
                slow.append((P, nm, spec))
            csv_rows.append([P, spec.name, spec.collective, T, f"{wpi:.4f}", f"{wtot:.4f}", lock_pi, f"{sim_pi:.6g}",
                             f"{msgs:g}", cf, f"{msgs / P:.3f}", f"{events:.1f}", f"{nbytes:g}",
                             f"{wpi / msgs * 1e6:.1f}" if msgs else ""])
            md_rows.append([str(P), spec.name, spec.collective, f"{wpi:.3f}", f"{wtot:.2f}"]
                           + ([f"{float(lock_pi):.3f}"] if args.lockstep else [])
                           + [f"{sim_pi * 1e3:.3f}", f"{msgs:g}", str(cf), f"{events:.0f}", f"{nbytes / 1e3:.1f}",
                              f"{wpi / msgs * 1e6:.0f}" if msgs else ""])
        del workers, obj
    cols = ["P", "algorithm", "collective", "wall s/iter", "wall total (s)"]
    if args.lockstep:
        cols.append("lockstep wall s/iter")
    cols += ["sim ms/iter", "messages/iter", "closed form", "SimPy events/iter", "kB on wire/iter",
             "wall us/message (all work)"]
    print(markdown_table(cols, md_rows))
    print()
    mism = [(r[0], r[1], r[2]) for r in csv_rows if float(r[8]) != r[9]]
    print("messages/iter measured (Network.messages_sent / T) " +
          ("equal the closed forms for every row" if not mism else f"DIFFER from the closed form for {mism}"))
    if slow:
        print(f"slower than {args.slow_threshold:g} s per iteration: "
              + ", ".join(f"P = {P} {nm}" for P, nm, _ in slow))
    path = write_csv(args.out, header, csv_rows)
    print(f"CSV: {path}")

    todo = []
    if args.profile == "all":
        todo = [(P, nm, ALGOS[nm](args.k)) for P in Ps for nm in names]
    elif args.profile == "auto":
        todo = slow
    for P, nm, spec in todo:
        n = args.n or max(1024, P * args.b)
        obj = make_objective(args.objective, d=args.d, n=n, seed=args.seed)
        workers = Workers(obj, shard_indices(obj.n, P, seed=args.seed), args.b, args.seed)
        print(f"\n## cProfile: P = {P} {nm} (T = 1)\n\n```")
        print(profile_by_module(lambda: one_run(spec, workers, obj.x0(args.seed), 1, args), "T = 1, profiled").rstrip())
        print("```")


if __name__ == "__main__":
    main()
