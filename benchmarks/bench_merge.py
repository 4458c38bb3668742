"""Merge and sparse-sum speed (issue 12, item 2): the gTop-k merge operator, the Top-k allgather's dense sum and
one simulated gTop-k iteration, before and after the fast versions.

``before`` is the code as it was, kept below verbatim (and in tests/test_merge_fast.py as the tests'
reference): the merge as np.union1d of the supports, accumulation into a zero vector and np.partition over the
union; the survival tracker's np.isin; the allgather's ``for b in blocks: g[b.idx] += b.val``. ``after`` is
what the simulator runs now (sim.comm.compression.merge, sim.comm.collectives._Tracker.survive, sim.comm.collectives.sparse_sum
with numba when installed; ``after_numpy`` the same sum without numba, what a machine without numba gets).
Each fast result is checked against the old one bit for bit before it is timed.

Cases (defaults; all seeded):

- ``merge``: merge(a, b, k) of two k-entry selections of d = 25,000,000 coordinates, k = 25,000 and 250,000,
  a and b from :func:`sim.comm.payloads.random_selection` (what the timing-only mode merges: random supports,
  positive values), float64, and float32 with signed values; plus ``merge+survive``: the merge and the
  survival lookup of a k-entry selection in its result, what each gTop-k round costs a rank.
- ``allgather_sum``: the dense sum of P selections of k = 25,000 entries (random supports, signed values) at
  d = 25,000,000, P = 64 and 1024, float32 and float64; ``dense_output_only`` (in the after column) is the part
  no method avoids: a fresh zeroed (d,) vector with every page touched.
- ``gtopk_rd_iteration``: wall seconds of one simulated iteration,
  ``simulate_timing(AlgorithmSpec("gtopk", k=25000, collective="recursive_doubling"), P, 25_000_000,
  network=get_preset("1GbE"), engine="message")``, at P = 256 (--gtopk-P, a comma-separated list; the old code
  needs minutes at P = 1024), before (the old merge and survival lookup patched in) and after; the simulated
  times are checked equal.

--malloc: ``keep`` (default) times both sides with freed memory kept in the heap, as ``sparsim`` runs now;
``glibc`` with glibc's defaults, as the code before #12 ran. The before column of a ``glibc`` run against the
after column of a ``keep`` run compares the two as their CLIs run them.

Each time is the best of R runs (--repeats; the gTop-k iteration: --iteration-repeats), since other processes
share this machine's 2 cores and best-of-R is the least disturbed by them; the CSV also has the median.

This is a benchmark, not a test: nothing asserts on time.

Example:
    .venv/bin/python benchmarks/bench_merge.py                        # P = 256 for the iteration, ~3 minutes
    .venv/bin/python benchmarks/bench_merge.py --gtopk-P 256,1024 --iteration-repeats 1   # the README's table, ~8 min
"""
from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment_line, markdown_table, tune_malloc, write_csv  # noqa: E402

import sim.comm.collectives as C  # noqa: E402
from sim.algorithms import AlgorithmSpec  # noqa: E402
from sim.comm.compression import Sparse, merge  # noqa: E402
from sim.machine.network import get_preset  # noqa: E402
from sim.comm.payloads import random_selection, simulate_timing  # noqa: E402

HEADER = ["case", "k", "P", "d", "dtype", "path", "before_ms", "after_ms", "speedup", "before_median_ms",
          "after_median_ms", "repeats"]


# ---------------------------------------------------------------- the code as it was (issue 12's "before")


from sim.comm.reference import ref_merge as old_merge  # noqa: E402  (the code as it was)
from sim.comm.reference import ref_sum as old_sum  # noqa: E402
from sim.comm.reference import ref_survive as old_survive  # noqa: E402


# ---------------------------------------------------------------- timing


def best_of(fns, repeats: int) -> list[tuple[float, float]]:
    """[(best, median) wall seconds] of each function in ``fns`` over ``repeats`` rounds, after one untimed call
    of each; a round calls every function once, in an order that rotates from round to round, so that a change
    in the machine's load reaches all of them alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for r in range(repeats):
        for j in range(len(fns)):
            i = (j + r) % len(fns)
            gc.collect()
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
    return [(min(t), statistics.median(t)) for t in times]


def _same(x: Sparse, y: Sparse) -> bool:
    return (np.array_equal(x.idx, y.idx) and x.val.dtype == y.val.dtype
            and np.array_equal(x.val.view(f"u{x.val.dtype.itemsize}"), y.val.view(f"u{y.val.dtype.itemsize}")))


def _signed(s: Sparse, rng, dtype) -> Sparse:
    return Sparse(s.idx, (s.val * rng.choice([-1.0, 1.0], len(s))).astype(dtype), s.d)


def bench_merge(ks, d, repeats, rows):
    rng = np.random.default_rng(0)
    for k in ks:
        for dtype in (np.float64, np.float32):
            a, b = random_selection(k, d, rng), random_selection(k, d, rng)
            if dtype == np.float32:
                a, b = _signed(a, rng, dtype), _signed(b, rng, dtype)
            new = merge(a, b, k)
            if not _same(new, old_merge(a, b, k)):
                raise SystemExit(f"merge differs from the old one at k = {k}, {np.dtype(dtype).name}")
            tb, ta = best_of([lambda: old_merge(a, b, k), lambda: merge(a, b, k)], repeats)
            rows.append(_row("merge", k, 2, d, dtype, "numpy", tb, ta, repeats))
            # a round of gTop-k on one rank: the merge, then which of its own k entries are in the result
            track = C._Tracker(a)
            alive = track.sources[0][2]

            def before():
                m = old_merge(a, b, k)
                alive[:] = True
                old_survive(track, m.idx)

            def after():
                m = merge(a, b, k)
                alive[:] = True
                track.survive(m.idx)

            before()
            expect = alive.copy()
            after()
            if not np.array_equal(alive, expect):
                raise SystemExit(f"survival mask differs from the old one at k = {k}")
            rows.append(_row("merge+survive", k, 2, d, dtype, "numpy", *best_of([before, after], repeats), repeats))
            print(f"# merge k={k} {np.dtype(dtype).name}: done", file=sys.stderr, flush=True)


def bench_sum(Ps, k, d, repeats, rows):
    rng = np.random.default_rng(1)
    for P in Ps:
        base = [random_selection(k, d, rng) for _ in range(P)]
        for dtype in (np.float32, np.float64):
            blocks = [_signed(s, rng, dtype) for s in base]
            paths = [("numba" if C._kernels() else "numpy", None)] + ([("numpy", False)] if C._kernels() else [])
            ref = old_sum(blocks, d, dtype)
            for path, use_numba in paths:
                got = C.sparse_sum(blocks, d, dtype, use_numba=use_numba)
                if not np.array_equal(got.view(f"u{got.dtype.itemsize}"), ref.view(f"u{ref.dtype.itemsize}")):
                    raise SystemExit(f"sum differs from the old one at P = {P}, {np.dtype(dtype).name}, {path}")
            del got, ref
            fns = [lambda: old_sum(blocks, d, dtype), lambda: _fresh_dense(d, dtype)]
            fns += [lambda u=u: C.sparse_sum(blocks, d, dtype, use_numba=u) for _, u in paths]
            tb, floor, *tas = best_of(fns, repeats)
            rows.append(_row("dense_output_only", k, P, d, dtype, "numpy", tb, floor, repeats))
            for (path, _), ta in zip(paths, tas):
                rows.append(_row("allgather_sum", k, P, d, dtype, path, tb, ta, repeats))
            print(f"# allgather_sum P={P} {np.dtype(dtype).name}: done", file=sys.stderr, flush=True)


def _fresh_dense(d, dtype):
    """What every dense sum pays whatever its method: a zeroed (d,) vector of fresh memory, each page touched."""
    g = np.zeros(d, dtype=dtype)
    g[::4096 // g.itemsize] = 1
    return g


def bench_iteration(P, k, d, repeats, rows):
    spec = AlgorithmSpec("gtopk", k=k, collective="recursive_doubling")

    def run():
        return simulate_timing(spec, P, d, network=get_preset("1GbE"), engine="message")

    def before():
        saved = C.merge, C._Tracker.survive
        C.merge, C._Tracker.survive = old_merge, old_survive
        try:
            return run()
        finally:
            C.merge, C._Tracker.survive = saved

    times = {}
    for name, fn in (("before", before), ("after", run)):
        ts = []
        for _ in range(repeats):
            gc.collect()
            t0 = time.perf_counter()
            res = fn()
            ts.append(time.perf_counter() - t0)
        times[name] = (min(ts), statistics.median(ts), res.iter_s)
        print(f"# gtopk_rd_iteration P={P} {name}: {min(ts):.1f} s", file=sys.stderr, flush=True)
    if not np.array_equal(times["before"][2], times["after"][2]):
        raise SystemExit("the simulated iteration time changed")
    rows.append(_row("gtopk_rd_iteration", k, P, d, np.float64, "numpy", times["before"][:2], times["after"][:2],
                     repeats))


def _row(case, k, P, d, dtype, path, before, after, repeats):
    return [case, k, P, d, np.dtype(dtype).name, path, round(before[0] * 1e3, 3), round(after[0] * 1e3, 3),
            round(before[0] / after[0], 2), round(before[1] * 1e3, 3), round(after[1] * 1e3, 3), repeats]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=float, default=25e6, help="dimension (default 2.5e7)")
    ap.add_argument("--merge-k", default="25000,250000", help="k of the merge cases")
    ap.add_argument("--sum-P", default="64,1024", help="P of the allgather-sum cases")
    ap.add_argument("--sum-k", type=int, default=25_000)
    ap.add_argument("--gtopk-P", default="256", help="P of the simulated gTop-k iteration (default 256; the old code "
                    "takes minutes at 1024)")
    ap.add_argument("--gtopk-k", type=int, default=25_000)
    ap.add_argument("--repeats", type=int, default=7, help="runs per case (merge, sum); best is reported")
    ap.add_argument("--iteration-repeats", type=int, default=2, help="runs of the simulated iteration")
    ap.add_argument("--skip", default="", help="comma-separated cases to skip: merge, allgather_sum, gtopk_rd_iteration")
    ap.add_argument("--malloc", choices=["keep", "glibc"], default="keep",
                    help="keep: freed memory stays in the heap, as the CLI sets it (sim/base/malloc.py); glibc: glibc's "
                         "defaults, as the code before #12 ran (large arrays mmap'd, zeroed by the kernel)")
    ap.add_argument("--out", default="benchmarks/results/merge.csv")
    args = ap.parse_args(argv)
    d = int(args.d)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    print("# " + environment_line(), file=sys.stderr)
    print("# " + (tune_malloc() if args.malloc == "keep" else "malloc: glibc defaults"), file=sys.stderr)
    print(f"# numba: {'yes' if C._kernels() else 'no (numpy paths)'}", file=sys.stderr)
    rows: list[list] = []
    if "merge" not in skip:
        bench_merge([int(x) for x in args.merge_k.split(",")], d, args.repeats, rows)
    if "allgather_sum" not in skip:
        bench_sum([int(x) for x in args.sum_P.split(",")], args.sum_k, d, max(1, args.repeats - 2), rows)
    if "gtopk_rd_iteration" not in skip:
        for P in (int(x) for x in args.gtopk_P.split(",")):
            bench_iteration(P, args.gtopk_k, d, args.iteration_repeats, rows)
    path = write_csv(args.out, HEADER, rows)
    print("# Merge and sparse-sum speed: best of R, milliseconds\n")
    print(markdown_table(["case", "k", "P", "d", "dtype", "path", "before ms", "after ms", "speed-up"],
                         [r[:9] for r in rows]))
    print(f"\n(written to {path})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
