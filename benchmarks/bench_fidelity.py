"""Fidelity of the simulator against the real torch backend (gloo on loopback): communication time per iteration.

For each algorithm and P in --P, runs --iters iterations on P local processes with
:mod:`sim.distributed.backend`, recording each rank's measured local timeline (``record_trace``: gradient,
selection, merges, reductions, update, and when each step started). The simulator then replays exactly
that local time (:func:`sim.engine.replay.replay`) with the calibrated alpha-beta network (``sparsim
calibrate``, exchange pattern by default; star topology), so a rank that waits for a slower peer waits
in the prediction too, and the prediction error is the network model's alone. Compared: the
communication seconds per iteration (time blocked in messages, codec and dense reductions included),
mean over ranks, mean over iterations 2..T (iteration 1 is warm-up). Prints a Markdown table with
the relative error (predicted - measured) / measured, its median over the cases, and the dense /
gTop-k ratio measured and predicted; --csv writes the rows. Not a test: nothing asserts on time.

The transmitted sizes are the real ones: float64 values (value_bytes = 8) and int64 indices
(index_bytes = 8), as the codec sends them.

    .venv/bin/python benchmarks/bench_fidelity.py --calibration cal.toml --d 100000 --density 0.001
"""
from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tomllib
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown_table, write_csv  # noqa: E402

from sim.algorithms import AlgorithmSpec  # noqa: E402
from sim.workloads.data import shard_indices  # noqa: E402
from sim.machine.network import NetworkSpec  # noqa: E402
from sim.workloads.objectives import make_objective  # noqa: E402
from sim.engine.runner import Workers  # noqa: E402

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
    """Per-rank body: run each algorithm with its trace recorded; returns {name: [StepTrace per iteration]}."""
    from sim.distributed.backend import run_worker

    w, x0 = _setup(ctx.P, d)
    return {name: run_worker(ctx.rank, ctx.P, ALGOS[name](k), w, T=iters, lr=lr_const, x0=x0, transport=ctx.transport,
                             eval_every=iters, record_trace=True).steps for name in names}


def main(argv=None):
    """Run the benchmark (options: see --help) and print the Markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", help="TOML written by sparsim calibrate (default: calibrate now)")
    ap.add_argument("--P", default="2,3,4")
    ap.add_argument("--d", type=int, default=100_000)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--algorithms", default=",".join(ALGOS))
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--csv", help="also write the rows to this CSV file")
    ap.add_argument("--calib-busy-s", type=float, default=0.002,
                    help="without --calibration: busy seconds before each timed exchange (about a step's compute)")
    a = ap.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so launch_local's cleanup kills the ranks
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from sim.engine.replay import replay
    from sim.distributed.backend import launch_local

    if a.iters < 2:
        ap.error(f"--iters {a.iters}: valid >= 2 (iteration 1 is dropped as warm-up)")
    try:
        Ps = [int(x) for x in a.P.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--P {a.P!r}: valid a comma-separated list of integers >= 2")
    if not Ps or min(Ps) < 2:
        ap.error(f"--P {a.P!r}: valid integers >= 2 (P = 1 has no communication to predict)")
    names = [n.strip() for n in a.algorithms.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALGOS]
    if not names or unknown:
        ap.error(f"--algorithms {a.algorithms!r}: valid a comma-separated subset of {', '.join(ALGOS)}")
    if a.d < 2 or not 0 < a.density <= 1:
        ap.error(f"--d {a.d} / --density {a.density}: valid d >= 2 and 0 < density <= 1")
    if not 0 < a.timeout <= 86_400:
        ap.error(f"--timeout {a.timeout}: valid 0 < timeout <= 86400 (s)")
    if not 0 <= a.calib_busy_s <= 10:
        ap.error(f"--calib-busy-s {a.calib_busy_s}: valid 0 <= seconds <= 10")
    if a.csv:  # checked before measuring, by writing the temporary file the results will go through
        probe = Path(a.csv + ".tmp")
        try:
            if Path(a.csv).is_dir() or not probe.parent.is_dir():
                raise OSError("not a file path in an existing directory")
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            ap.error(f"--csv {a.csv!r}: cannot write there ({err.strerror or err}); valid a file path in an "
                     "existing, writable directory")
    if a.calibration:
        try:
            cl = tomllib.loads(Path(a.calibration).read_text())["cluster"]
            alpha, bw = float(cl["alpha_s"]), float(cl["bandwidth_Bps"])
        except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as err:
            ap.error(f"--calibration {a.calibration!r}: not a TOML file with a [cluster] table holding alpha_s and "
                     f"bandwidth_Bps as sparsim calibrate writes ({type(err).__name__}: {err})")
    else:
        from experiments.calibrate import calibrate

        _, fit = calibrate(2, 1, 1 << 24, 20, a.timeout, "exchange", a.calib_busy_s)
        alpha, bw = fit["alpha_s"], fit["bandwidth_Bps"]
    net = NetworkSpec.from_alpha_beta(alpha, 1.0 / bw, "star")
    k = max(1, round(a.density * a.d))
    print(f"d = {a.d}, k = {k}, {a.iters} iterations (first dropped); network alpha = {alpha:.4g} s, "
          f"bandwidth = {bw / 1e6:.4g} MB/s; times: comm seconds per iteration in ms, mean over ranks and "
          "iterations; prediction = measured local time replayed on the simulator")
    table, errs, ratios, rows = [], [], [], []
    for P in Ps:
        got = launch_local(P, bench_job, (names, a.d, k, a.iters), timeout_s=a.timeout)
        w, x0 = _setup(P, a.d)
        per = {}
        for name in names:
            r = replay(ALGOS[name](k), w, x0=x0, lr=lr_const, network=net, traces=[g[name] for g in got])
            meas, pred = float(r.measured_comm_s[1:].mean()), float(r.predicted_comm_s[1:].mean())
            comp = float(r.measured_busy_s[1:, :, 0].mean())
            compress = float(r.measured_busy_s[1:, :, 1].mean())
            span_m, span_p = float(r.measured_span_s[1:].mean()), float(r.predicted_span_s[1:].mean())
            err = (pred - meas) / meas
            errs.append(abs(err))
            per[name] = (meas, pred)
            table.append([name, str(P), f"{1e3 * meas:.3f}", f"{1e3 * pred:.3f}", f"{100 * err:+.1f} %",
                          f"{1e3 * span_m:.3f}", f"{1e3 * span_p:.3f}", f"{1e3 * comp:.3f}", f"{1e3 * compress:.3f}"])
            rows.append({"algorithm": name, "P": P, "d": a.d, "k": k, "measured_comm_s": meas, "predicted_comm_s": pred,
                         "rel_error": err, "measured_iter_s": span_m, "predicted_iter_s": span_p,
                         "compute_s": comp, "compress_s": compress, "alpha_s": alpha, "bandwidth_Bps": bw})
        if "dense_ring" in per and "gtopk_tree" in per:
            ratios.append((P, per["dense_ring"][0] / per["gtopk_tree"][0], per["dense_ring"][1] / per["gtopk_tree"][1]))
    print(markdown_table(["algorithm", "P", "measured comm ms", "predicted comm ms", "error", "measured iter ms",
                          "predicted iter ms", "compute ms", "compress ms"], table))
    print(f"\nmedian |error| = {100 * statistics.median(errs):.1f} % over {len(errs)} cases")
    for P, m, p in ratios:
        print(f"P = {P}: dense_ring / gtopk_tree comm time, measured {m:.2f}, predicted {p:.2f}")
    if a.csv:
        write_csv(a.csv, list(rows[0]), [list(r.values()) for r in rows])
        print(f"wrote {a.csv}")


if __name__ == "__main__":
    main()
