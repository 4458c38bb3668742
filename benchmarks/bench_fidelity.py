"""Fidelity of the simulator against the real torch backend (gloo on loopback): communication time per iteration.

For each algorithm and P in --P, runs --iters iterations on P local processes with
:mod:`sim.torch_backend` (the measured ``comm_s`` column: seconds a rank spends blocked in
Send/Recv/SendRecv plus dense reductions, averaged over ranks, iteration 1 dropped as warm-up) and
runs the SimPy simulator on the same scenario with the calibrated network (``sparsim calibrate``:
alpha, bandwidth; star topology) and the measured compute times plugged into the compute model
(forward_backward_s = measured compute_s; select_coeff_s fitted to the measured compress_s). Prints a
Markdown table with the relative error (predicted - measured) / measured, its median, and the
dense / gTop-k ratio measured and predicted. Not a test: nothing asserts on time.

The transmitted sizes are the real ones: float64 values (value_bytes = 8) and int64 indices
(index_bytes = 8), as the codec sends them.

    .venv/bin/python benchmarks/bench_fidelity.py --calibration cal.toml --d 100000 --density 0.001
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import tomllib
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown_table  # noqa: E402

from sim.algorithms import AlgorithmSpec  # noqa: E402
from sim.compute import ComputeModel  # noqa: E402
from sim.data import shard_indices  # noqa: E402
from sim.network import NetworkSpec  # noqa: E402
from sim.objectives import make_objective  # noqa: E402
from sim.runner import Workers, run_algorithm  # noqa: E402

ALGOS = {
    "dense_ring": lambda k: AlgorithmSpec("dense", collective="ring", value_bytes=8),
    "dense_rd": lambda k: AlgorithmSpec("dense", collective="recursive_doubling", value_bytes=8),
    "topk": lambda k: AlgorithmSpec("topk", k=k, value_bytes=8, index_bytes=8),
    "gtopk_tree": lambda k: AlgorithmSpec("gtopk", k=k, collective="tree", value_bytes=8, index_bytes=8),
    "gtopk_rd": lambda k: AlgorithmSpec("gtopk", k=k, collective="recursive_doubling", value_bytes=8, index_bytes=8),
}


def lr_const(t):
    """Step size 0.05 (module level: spawned ranks unpickle it)."""
    return 0.05


def _setup(P, d, seed=0):
    obj = make_objective("sines", d=d, n=32 * P, seed=seed)
    return Workers(obj, shard_indices(obj.n, P, seed=seed), 8, seed), obj.x0(seed)


def bench_job(ctx, names, d, k, iters):
    """Per-rank body: run each algorithm; rank 0 returns {name: rows}."""
    from sim.torch_backend import run_worker

    w, x0 = _setup(ctx.P, d)
    out = {}
    for name in names:
        r = run_worker(ctx.rank, ctx.P, ALGOS[name](k), w, T=iters, lr=lr_const, x0=x0, transport=ctx.transport,
                       eval_every=iters)
        out[name] = r.rows
    return out if ctx.rank == 0 else None


def _mean(rows, col):
    vals = [r[col] for r in rows if r["iteration"] >= 2]
    return sum(vals) / len(vals)


def main(argv=None):
    """Run the benchmark (options: see --help) and print the Markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", help="TOML written by sparsim calibrate (default: calibrate now)")
    ap.add_argument("--P", default="2,3,4")
    ap.add_argument("--d", type=int, default=100_000)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--algorithms", default=",".join(ALGOS))
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args(argv)
    from sim.torch_backend import launch_local

    if a.calibration:
        cl = tomllib.loads(Path(a.calibration).read_text())["cluster"]
        alpha, bw = cl["alpha_s"], cl["bandwidth_Bps"]
    else:
        from experiments.calibrate import calibrate

        _, fit = calibrate(2, 1, 1 << 22, 10, a.timeout)
        alpha, bw = fit["alpha_s"], fit["bandwidth_Bps"]
    net = NetworkSpec.from_alpha_beta(alpha, 1.0 / bw, "star")
    names = [n.strip() for n in a.algorithms.split(",") if n.strip()]
    k = max(1, round(a.density * a.d))
    print(f"d = {a.d}, k = {k}, {a.iters} iterations (first dropped); network alpha = {alpha:.4g} s, "
          f"bandwidth = {bw / 1e6:.4g} MB/s; times are mean comm_s per iteration in ms")
    table, errs, ratios = [], [], []
    for P in [int(x) for x in a.P.split(",")]:
        got = launch_local(P, bench_job, (names, a.d, k, a.iters), timeout_s=a.timeout)[0]
        w, x0 = _setup(P, a.d)
        per = {}
        for name in names:
            rows = got[name]
            meas = _mean(rows, "comm_s")
            comp, compress = _mean(rows, "compute_s"), _mean(rows, "compress_s")
            sel = compress / (a.d * math.log2(a.d)) if a.d > 1 else 0.0
            cm = ComputeModel(forward_backward_s=comp, select_coeff_s=sel)
            sim = run_algorithm(ALGOS[name](k), w, T=a.iters, lr=lr_const, x0=x0, network=net, compute=cm,
                                eval_every=a.iters)
            pred = _mean(sim, "comm_s")
            err = (pred - meas) / meas
            errs.append(abs(err))
            per[name] = (meas, pred)
            table.append([name, str(P), f"{1e3 * meas:.3f}", f"{1e3 * pred:.3f}", f"{100 * err:+.1f} %",
                          f"{1e3 * comp:.3f}", f"{1e3 * compress:.3f}"])
        if "dense_ring" in per and "gtopk_tree" in per:
            ratios.append((P, per["dense_ring"][0] / per["gtopk_tree"][0], per["dense_ring"][1] / per["gtopk_tree"][1]))
    print(markdown_table(["algorithm", "P", "measured comm ms", "predicted comm ms", "error", "compute ms",
                          "compress ms"], table))
    print(f"\nmedian |error| = {100 * statistics.median(errs):.1f} % over {len(errs)} cases")
    for P, m, p in ratios:
        print(f"P = {P}: dense_ring / gtopk_tree comm time, measured {m:.2f}, predicted {p:.2f}")


if __name__ == "__main__":
    main()
