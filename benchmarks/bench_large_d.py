"""A large synthetic problem in memory: d = 10^7 parameters, P = 16 workers, float32, Top-k and gTop-k.

For each algorithm (topk: Bruck allgather; gtopk: binomial tree; --algorithms) a fresh child process builds
the ``double_well`` objective (d = 10^7, n = 1024; --objective, --d, --n) in --dtype (default float32, the
scenario key ``training.dtype``), P = 16 workers with iid shards and b = 1, k = d / 1000 (c = 1000), and runs
``run_algorithm`` on the SimPy cluster (1GbE preset; --driver lockstep for the numerics alone) for
T = --skip + --iterations iterations (default 2 + 4) with the full objective evaluated every iteration
(eval_every = 1, the default scenario's; --eval-every). It reports

- wall and process CPU seconds per iteration in the steady state: (clock when the last metrics row was emitted -
  clock when row --skip was) / --iterations (the goal: <= 2 s of wall time); and the same over the first --skip
  iterations, which on this VM cost several times more: the run's working set (about 200 vectors of 40 MB) is
  first touched there, in transparent huge pages that the kernel has to find and zero;
- the set-up time (objective, shards, x_0), after an untimed warm-up iteration at d = 2^16 that makes numba
  compile its kernels (otherwise the first timed iteration pays seconds of compilation);
- memory: the process's peak resident set size (``ru_maxrss``, set-up included) and, in a second run of
  2 iterations under ``tracemalloc``, the peak of the traced allocations (numpy reports its buffers to
  tracemalloc) during ``run_algorithm`` alone, also as vectors of d per worker (``sim.engine.runner.ARRAYS_PER_RANK``
  is the estimate the resource check uses);
- with --profile, a cProfile of one more 2-iteration run: self time by module and the top functions.

BLAS is single-threaded and glibc malloc is tuned as in bench_event_overhead.py (vectors of 40 MB are above
malloc's largest mmap threshold, so every fresh one still costs page faults). Wall time depends on what else
the machine runs: the CPU column is the steadier one on a loaded machine.

Outputs: --out (default benchmarks/results/large_d.csv) and a Markdown table on stdout.

This is a benchmark, not a test: nothing asserts on time.

Example:
    .venv/bin/python benchmarks/bench_large_d.py                      # d = 10^7, P = 16, float32, T = 2 + 4
    .venv/bin/python benchmarks/bench_large_d.py --profile
"""
from __future__ import annotations

import os

# single-threaded BLAS (set before numpy is imported; an explicit environment setting wins)
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import gc
import json
import math
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment_line, markdown_table, profile_by_module, tune_malloc, write_csv  # noqa: E402

ALGOS = ("topk", "gtopk")
GOAL_S = 2.0


def parse_args(argv=None):
    """The command-line options (see --help); argv: list of strings, default sys.argv[1:]."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=float, default=1e7, help="parameters (default 1e7)")
    p.add_argument("--P", type=int, default=16, help="workers (default 16)")
    p.add_argument("--c", type=float, default=1000.0, help="compression ratio d/k (default 1000)")
    p.add_argument("--n", type=int, default=1024, help="samples of the synthetic objective (default 1024)")
    p.add_argument("--b", type=int, default=1, help="per-worker batch size (default 1)")
    p.add_argument("--objective", default="double_well", choices=("double_well", "sines", "robust_regression"))
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--iterations", "-T", type=int, default=4, help="timed steady iterations (default 4)")
    p.add_argument("--skip", type=int, default=2, help="first iterations of the run left out of the steady time "
                                                       "(default 2)")
    p.add_argument("--eval-every", type=int, default=1, help="full evaluation every this many iterations (default 1)")
    p.add_argument("--driver", default="simpy", choices=("simpy", "lockstep"))
    p.add_argument("--algorithms", default=",".join(ALGOS), help=f"comma list from {','.join(ALGOS)}")
    p.add_argument("--lr", type=float, default=0.05, help="constant learning rate (default 0.05)")
    p.add_argument("--no-tracemalloc", dest="trace", action="store_false", help="skip the tracemalloc run")
    p.add_argument("--profile", action="store_true", help="cProfile a 2-iteration run of each algorithm")
    p.add_argument("--out", default="benchmarks/results/large_d.csv", help="CSV path")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one algorithm, print JSON
    return p.parse_args(argv)


def _setup(args):
    from sim.algorithms import AlgorithmSpec
    from sim.workloads.data import shard_indices
    from sim.workloads.objectives import make_objective
    from sim.engine.runner import Workers

    d = int(args.d)
    obj = make_objective(args.objective, d=d, n=args.n, seed=0).astype(args.dtype)
    workers = Workers(obj, shard_indices(obj.n, args.P, seed=0), args.b, 0)
    x0 = obj.x0(0)
    k = max(1, round(d / args.c))
    spec = AlgorithmSpec("topk", k=k) if args.child == "topk" else AlgorithmSpec("gtopk", k=k, collective="tree")
    return workers, x0, spec


def _run(args, workers, x0, spec, T):
    """One run_algorithm call of T iterations; returns the (wall s, cpu s) clocks at each row and the rows."""
    from sim.machine.network import PRESETS
    from sim.engine.runner import run_algorithm

    marks = []

    def on_row(row):
        marks.append((time.perf_counter(), time.process_time()))

    rows = run_algorithm(spec, workers, T=T, lr=lambda t: args.lr, x0=x0, network=PRESETS["1GbE"],
                         driver=args.driver, eval_every=min(args.eval_every, T), on_row=on_row)
    return marks, rows


def _warm_up(args) -> float:
    """One untimed iteration of the same algorithm and dtype at d = 2^16 (P = 2), so that numba compiles its
    kernels (top-k selection, sparse sums; compiled per dtype on first use) before the timed run; seconds."""
    t0 = time.perf_counter()
    small = argparse.Namespace(**{**vars(args), "d": float(1 << 16), "P": 2})
    workers, x0, spec = _setup(small)
    _run(small, workers, x0, spec, 1)
    return time.perf_counter() - t0


def child(args) -> dict:
    """Run one algorithm (args.child) in this process; return the measurements as a dict."""
    import numpy as np

    note = tune_malloc()
    warm_s = _warm_up(args)
    t0 = time.perf_counter()
    workers, x0, spec = _setup(args)
    setup_s = time.perf_counter() - t0
    d, P, S, T = x0.shape[0], args.P, args.skip, args.skip + args.iterations
    gc.collect()
    marks, rows = _run(args, workers, x0, spec, T)
    assert all(np.isfinite(r["stoch_grad_norm_sq"]) for r in rows[1:])
    (w0, c0), (ws, cs), (w1, c1) = marks[0], marks[S], marks[T]
    out = {"algorithm": spec.name, "collective": spec.collective, "d": d, "P": P, "k": spec.k, "dtype": args.dtype,
           "objective": args.objective, "driver": args.driver, "T": T, "skip": S, "eval_every": min(args.eval_every, T),
           "wall_s_per_iter": (w1 - ws) / (T - S), "cpu_s_per_iter": (c1 - cs) / (T - S),
           "first_wall_s_per_iter": (ws - w0) / S if S else math.nan, "setup_s": setup_s, "warm_up_s": warm_s,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "final_loss": rows[-1]["loss"], "malloc": note}
    del rows
    if args.trace:
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        _run(args, workers, x0, spec, 2)
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        out["tracemalloc_peak_bytes"] = peak
        out["vectors_per_worker"] = peak / (P * d * x0.dtype.itemsize)
    if args.profile:
        out["profile"] = profile_by_module(lambda: _run(args, workers, x0, spec, 2),
                                           f"{spec.name} {spec.collective}, 2 iterations", top=20, modules=10)
    return out


def main(argv=None):
    """Run the benchmark with the options of :func:`parse_args` and print its Markdown report."""
    args = parse_args(argv)
    if args.child is not None:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    names = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    for nm in names:
        if nm not in ALGOS:
            raise SystemExit(f"unknown algorithm {nm!r}: valid {', '.join(ALGOS)}")
    d = int(args.d)
    print(f"# A large problem in memory: d = {d:,}, P = {args.P}, {args.dtype}\n")
    print(f"{args.objective} (n = {args.n}), k = d/{args.c:g}, b = {args.b}, T = {args.skip} + {args.iterations} "
          f"(first {args.skip} left out of the steady time), eval_every = "
          f"{args.eval_every}, driver = {args.driver}, network = 1GbE  ")
    print(f"{environment_line()}\n", flush=True)
    results = []
    fwd = [a for a in (argv if argv is not None else sys.argv[1:])]
    for nm in names:
        cmd = [sys.executable, str(Path(__file__).resolve()), *fwd, "--child", nm]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit(f"{nm}: the child process failed (exit {proc.returncode})")
        r = json.loads(line[len("RESULT "):])
        results.append(r)
        print(f"  {nm}: {r['wall_s_per_iter']:.2f} s wall / {r['cpu_s_per_iter']:.2f} s CPU per steady iteration, "
              f"{r['first_wall_s_per_iter']:.2f} s wall per first iteration", file=sys.stderr, flush=True)
    gib = 2.0 ** 30
    md, rows = [], []
    for r in results:
        ok = r["wall_s_per_iter"] <= GOAL_S
        tm = r.get("tracemalloc_peak_bytes")
        md.append([r["algorithm"], r["collective"], f"{r['wall_s_per_iter']:.2f}", f"{r['cpu_s_per_iter']:.2f}",
                   "yes" if ok else "**no**", f"{r['first_wall_s_per_iter']:.2f}", f"{r['setup_s']:.1f}",
                   f"{r['peak_rss_bytes'] / gib:.2f}", "" if tm is None else f"{tm / gib:.2f}",
                   "" if tm is None else f"{r['vectors_per_worker']:.1f}"])
        rows.append([r["algorithm"], r["collective"], r["d"], r["P"], r["k"], r["dtype"], r["objective"], r["driver"],
                     r["T"], r["skip"], r["eval_every"], f"{r['wall_s_per_iter']:.4f}", f"{r['cpu_s_per_iter']:.4f}", ok,
                     f"{r['first_wall_s_per_iter']:.4f}", f"{r['setup_s']:.3f}", r["peak_rss_bytes"],
                     "" if tm is None else tm, "" if tm is None else f"{r['vectors_per_worker']:.2f}",
                     f"{os.getloadavg()[0]:.2f}"])
    print(markdown_table(["algorithm", "collective", "wall s/iter (steady)", "CPU s/iter (steady)", f"<= {GOAL_S:g} s",
                          "wall s/iter (first)", "set-up s", "peak RSS GiB", "tracemalloc peak GiB",
                          "vectors of d per worker"], md))
    path = write_csv(args.out, ["algorithm", "collective", "d", "P", "k", "dtype", "objective", "driver", "T", "skip",
                                "eval_every", "wall_s_per_iter", "cpu_s_per_iter", "goal_met", "first_wall_s_per_iter",
                                "setup_s", "peak_rss_bytes", "tracemalloc_peak_bytes", "vectors_per_worker",
                                "load_average"], rows)
    print(f"\nCSV: {path}")
    for r in results:
        if "profile" in r:
            print(f"\n## cProfile: {r['algorithm']} {r['collective']}\n\n```\n{r['profile'].rstrip()}\n```")


if __name__ == "__main__":
    main()
