"""Wall time of the fast engine's ring kernel at one P: tiled (``ring_run``, by tile width) against one pass per round.

A flat ring allreduce on ``dgx-h100`` (8 ranks a node: NVSwitch inside, InfiniBand between; the preset's alpha
and beta, 3e-6 s and 2.22e-12 s/byte inside a node, 5e-6 s and 2e-11 s/byte between nodes) of n values
(``np.array_split``'s chunk table, 4 bytes a value) with its reduces, 2(P - 1) rounds, evaluated by
:func:`sim.engine._fast_numba._ring_rounds` (one pass over the P ranks per round) and by
:func:`sim.engine._fast_numba.ring_run` at each tile width (``--tiles``; the engine uses ``TILE``). Each variant
runs ``--reps`` times in turn (one warm-up call first, so compilation is not timed); the table gives the form that
ran (the tiled kernel falls back to one pass per round where a block would have fewer than
``sim.engine._fast_numba.MIN_BLOCK`` rounds: a small P for the tile, or a large c), the minimum, the median and the
speed-up of the minimum over the one-pass form's, and whether the clocks and busy row are equal (==) to the
one-pass form's. c: the rotation (1: a flat ring; 8: the ring across nodes of a 2D layout).

Results: ``benchmarks/results/ring_kernel.csv`` (``--out``) with its meta.json sidecar; docs/cluster-scale.md shows
the table (``python benchmarks/tables.py``). A benchmark: nothing asserts on time.

Example:
    .venv/bin/python benchmarks/bench_ring_kernel.py                     # P = 16384, about 30 s
    .venv/bin/python benchmarks/bench_ring_kernel.py --P 4096 --out /tmp/rk.csv
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's sim, not an installed one
from _common import check_out, environment_line, markdown_table, save_results  # noqa: E402

from sim.engine import _fast_numba as K  # noqa: E402

HEADER = ["P", "c", "variant", "tile", "form", "min_s", "median_s", "speedup", "same_bits"]


def ring_inputs(P: int, c: int, n: int):
    """The kernel's arguments but ``ready`` / ``busy`` for a ring of n values on P ranks rotated by c."""
    ch = np.array([len(x) for x in np.array_split(np.arange(n), P)], dtype=np.float64)
    sizes = np.concatenate([ch, ch]) * 4
    offs = np.array([(P - i) % P for i in range(P - 1)] * 2, dtype=np.int64)
    wo = np.array([(P - i) % P for i in range(P - 1)] + [-1] * (P - 1), dtype=np.int64)
    node_edge = np.arange(P) % 8 + c >= 8  # rank r's message to r + c leaves its node of 8 (every one for c >= 8)
    lat = np.where(node_edge, 5e-6, 3e-6)  # dgx-h100: inter / intra alpha (s)
    inv = np.where(node_edge, 2e-11, 2.22e-12)  # and beta (s/byte)
    return lat, inv, sizes, offs, 4.1e-12, np.concatenate([ch, ch]), wo


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--P", type=int, default=16384, help="ranks (default 16384)")
    ap.add_argument("--c", default="1,8", help="comma list of rotations (default 1,8)")
    ap.add_argument("--n", type=int, default=102_351, help="values reduced (default 102351)")
    ap.add_argument("--tiles", default="512,1024,2048,4096", help="comma list of tile widths")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per variant (default 3)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "ring_kernel.csv")
    a = ap.parse_args(argv)
    check_out(ap, a.out)
    if not 16 <= a.P <= 65536:
        ap.error(f"--P {a.P} is out of range: valid 16 <= P <= 65536")
    if a.n < 1:
        ap.error(f"--n {a.n} is out of range: valid n >= 1")
    if a.reps < 1:
        ap.error(f"--reps {a.reps} is out of range: valid reps >= 1")
    try:
        cs = [int(x) for x in a.c.split(",")]
        tiles = [int(x) for x in a.tiles.split(",")]
    except ValueError:
        ap.error(f"--c {a.c!r} / --tiles {a.tiles!r}: valid comma lists of integers")
    for c in cs:
        if not 1 <= c < a.P:
            ap.error(f"--c {c} is out of range: valid 1 <= c < P = {a.P}")
    for t in tiles:
        if t < 1:
            ap.error(f"--tiles {t} is out of range: valid tile >= 1")
    print(environment_line(), flush=True)
    rows = []
    for c in cs:
        args = ring_inputs(a.P, c, a.n)
        r0 = np.linspace(0.0, 1e-4, a.P) ** 2
        variants = [("one pass per round", None)] + [("tiled", t) for t in tiles]

        def call(tile):
            """(wall s, ready, busy, the form that ran) of one evaluation: one pass per round, or ring_run's tiled
            kernel (which falls back to one pass where a block would have too few rounds: said in the form)."""
            ready, busy = r0.copy(), np.zeros(a.P)
            t0 = time.perf_counter()
            if tile is None:
                K._ring_rounds(ready, c, *args, busy)
                form = "one pass"
            elif K._ring_tiled(ready, c, *args, busy, tile):
                form = "tiled"
            else:
                K._ring_rounds(ready, c, *args, busy)
                form = "one pass (fallback)"
            return time.perf_counter() - t0, ready, busy, form

        ref = call(None)  # warm-up (compilation) and the reference bits
        for _, tile in variants[1:]:
            call(tile)
        times = {v: [] for v in variants}
        same = {v: True for v in variants}
        form = {}
        for _ in range(a.reps):
            for v in variants:
                dt, ready, busy, form[v] = call(v[1])
                times[v].append(dt)
                same[v] &= bool(np.array_equal(ready, ref[1]) and np.array_equal(busy, ref[2]))
        base = min(times[variants[0]])
        for v in variants:
            rows.append([a.P, c, v[0], v[1] if v[1] is not None else "", form[v], round(min(times[v]), 4),
                         round(statistics.median(times[v]), 4), round(base / min(times[v]), 2), same[v]])
            print(f"  P = {a.P} c = {c} {v[0]:<20} tile {v[1]}: {min(times[v]):.3f} s", flush=True)
    print(markdown_table(HEADER, rows))
    return save_results(a.out, HEADER, rows)


if __name__ == "__main__":
    sys.exit(main())
