"""Passes over memory of a top-k selection and of a dense add, measured on this CPU (issue 22, item 0).

The device presets' selection, merge, reduce and update costs (:mod:`sim.workloads.devices`) are a memory model:
``seconds = passes x elements x value_bytes / (memory bandwidth x mem_efficiency)``, where a *pass* moves the
vector's bytes once (a read or a write), as a GPU's memory bandwidth and the measured copy bandwidth behind
``mem_efficiency`` count them. This script measures how many passes each kernel costs on this CPU: at each d in
--d (float32, x ~ N(0, 1), seeded) and k = density x d, it times in one process, one thread, round-robin (each
round runs every method once, so a load spike from the other sessions on this machine hits all of them):

- ``copy``: ``np.copyto(b, x)`` into a buffer written before: one read and one write, **2 passes by
  definition** (the unit: a pass is half a copy);
- ``read``: ``x.max()``, one streaming read on one core (context: a single core's reads alone do not saturate
  the memory system, so this comes out below 1 pass when the vector is beyond the cache);
- ``reduce``: ``np.add(b, x, out=b)``: two reads and a write, the check of the unit (the model's dense reduction
  is 3 passes);
- ``topk_numpy``: :func:`sim.comm.compression.topk`'s numpy path (``_topk_fast(x, k, use_numba=False)``: a sampled
  threshold, then ``np.abs``, a compare, a compaction and an exact selection among the candidates: the
  elementwise operations a GPU implementation built from tensor operations also runs);
- ``topk_numba``: the same function with its numba kernel (:mod:`sim.comm._topk_numba`: one fused filtering pass)
  forced, when numba is installed; checked to return the same indices and values as the numpy path;
- ``torch_topk``: ``torch.topk(torch.abs(t), k, sorted=False)`` on the CPU, t sharing x's memory (if torch is
  importable): what a torch user writes; on a GPU torch runs another algorithm (radix select), so this row is
  context, not the GPU's pass count.

``passes`` = 2 x best time of the method / best time of ``copy`` at the same d (best of R: the least disturbed by
the other processes on this machine's 2 cores; the CSV also has the median). The sizes from 1e8 up (400 MB and
more) exceed this VM's 300 MiB L3 cache, as ResNet-50's 102 MB gradient exceeds an H100's 50 MB L2: the mean of
``topk_numpy`` over those rows is the presets' :data:`sim.workloads.model.SELECT_PASSES`. The header also says
which path :func:`sim.comm.compression.topk` takes as shipped.

This is a benchmark, not a test: nothing asserts on time. Example:

    .venv/bin/python benchmarks/bench_select_passes.py                 # d = 1e7, 25,557,032, 1e8, 2e8; ~2 min
    .venv/bin/python benchmarks/bench_select_passes.py --d 1e7 --repeats 3 --out /tmp/p.csv
"""
from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import contextlib
import gc
import importlib
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import environment_line, markdown_table, tune_malloc, write_csv  # noqa: E402

import sim.comm.compression as C  # noqa: E402

try:
    import torch
    torch.set_num_threads(1)
except ImportError:  # torch is optional
    torch = None

METHODS = ("copy", "read", "reduce", "topk_numpy", "topk_numba", "torch_topk")
HEADER = ["d", "dtype", "density", "k", "method", "ns_per_element_best", "ns_per_element_median", "passes", "repeats"]
#: d from which the vector exceeds this VM's L3 cache: the rows the presets' pass count is the mean of
OUT_OF_CACHE_D = 10**8


def numba_kernels():
    """The numba top-k kernel module sim.comm._topk_numba, or None when numba is not installed."""
    try:
        return importlib.import_module("sim.comm._topk_numba")
    except ImportError:
        return None


@contextlib.contextmanager
def forced_numba(K):
    """Inside: :func:`sim.comm.compression.topk` uses the numba kernel module K (restored on exit)."""
    before = C._kernels
    C._kernels = lambda: K
    try:
        yield
    finally:
        C._kernels = before


def topk_path() -> str:
    """Which path sim.comm.compression.topk takes for d >= 2^15 as shipped: 'numba' or 'numpy'."""
    return "numba" if C._kernels() is not None else "numpy"


def methods_for(x: np.ndarray, k: int, K) -> dict:
    """The timed callables (name -> fn) on x."""
    b = np.empty_like(x)
    b.fill(0)
    fns = {"copy": lambda: np.copyto(b, x), "read": lambda: x.max(), "reduce": lambda: np.add(b, x, out=b),
           "topk_numpy": lambda: C._topk_fast(x, k, use_numba=False)}
    if K is not None:
        def numba_topk():
            with forced_numba(K):
                return C.topk(x, k)
        fns["topk_numba"] = numba_topk
    if torch is not None:
        tx = torch.from_numpy(x)
        fns["torch_topk"] = lambda: torch.topk(torch.abs(tx), k, sorted=False)
    return fns


def round_robin(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of ``repeats`` calls of each fn, one call of every fn per round (after one untimed call each),
    garbage collection off."""
    for fn in fns.values():
        fn()
    out = {m: [] for m in fns}
    gc.disable()
    try:
        for _ in range(repeats):
            for m, fn in fns.items():
                t = time.perf_counter()
                fn()
                out[m].append(time.perf_counter() - t)
    finally:
        gc.enable()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", default="1e7,25557032,1e8,2e8", help="comma list of dimensions (default 1e7,25557032,1e8,2e8)")
    ap.add_argument("--density", type=float, default=1e-3, help="k/d (default 1e-3, c = 1000 as the gTop-k papers)")
    ap.add_argument("--repeats", type=int, default=7, help="rounds at d = 1e7, fewer above (at least 5)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list from {','.join(METHODS)} (copy, the unit, is always timed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/select_passes.csv", help="CSV path")
    args = ap.parse_args(argv)
    ds = [int(float(v)) for v in args.d.split(",")]
    wanted = {"copy", *(m for m in args.methods.split(",") if m)}
    unknown = wanted - set(METHODS)
    if unknown:
        ap.error(f"--methods: unknown {', '.join(sorted(unknown))}: valid {', '.join(METHODS)}")
    note = tune_malloc()
    K = numba_kernels()
    path = topk_path()
    print("# Passes over memory of top-k and add: 2 x time / time of a copy (np.copyto), one thread\n")
    print(f"float32, x ~ N(0, 1), k/d = {args.density:g}; sim.comm.compression.topk as shipped takes its {path} path"
          f"{'' if path == 'numba' else ' (sim.base.optional.kernels does not find its numba kernel)'}; "
          f"numba kernel {'timed as topk_numba' if K is not None else 'not installed'}; "
          f"torch {torch.__version__ if torch is not None else 'not installed'}")
    print(f"{environment_line()}; {note}\n", flush=True)
    rows, table, beyond = [], [], []
    t_start = time.perf_counter()
    with threadpool_limits(1):
        for d in ds:
            reps = max(5, round(args.repeats * min(1.0, (1e7 / d) ** 0.5)))
            x = np.random.default_rng(args.seed).standard_normal(d).astype(np.float32)
            k = max(1, round(args.density * d))
            fns = {m: f for m, f in methods_for(x, k, K).items() if m in wanted}
            if "topk_numba" in fns:
                a = C._topk_fast(x, k, use_numba=False)
                with forced_numba(K):
                    b = C.topk(x, k)
                if not (np.array_equal(a.idx, b.idx) and np.array_equal(a.val, b.val)):
                    print(f"d = {d}: the numba kernel's selection differs from topk's: not timed", file=sys.stderr)
                    return 1
            r = round_robin(fns, reps)
            best = {m: min(v) for m, v in r.items()}
            unit = best["copy"] / 2
            for m, v in r.items():
                rows.append([d, "float32", args.density, k, m, f"{1e9 * best[m] / d:.4f}",
                             f"{1e9 * statistics.median(v) / d:.4f}", f"{best[m] / unit:.3f}", len(v)])
                if m == "topk_numpy" and d >= OUT_OF_CACHE_D:
                    beyond.append(best[m] / unit)
            table.append([f"{d:,}", f"{1e9 * unit / d:.3f}",
                          *(f"{best[m] / unit:.2f}" if m in best else "" for m in METHODS[1:])])
            print(f"d = {d:,}: " + ", ".join(f"{m} {1e9 * best[m] / d:.3f} ns/el ({best[m] / unit:.2f} passes)"
                                             for m in best) + f"  ({time.perf_counter() - t_start:.0f} s)", flush=True)
            del x, fns, r
            gc.collect()
    print()
    print(markdown_table(["d", "pass ns/el", *(f"{m} passes" for m in METHODS[1:])], table))
    if beyond:
        print(f"\ntopk_numpy at d >= {OUT_OF_CACHE_D:.0e}: mean {statistics.mean(beyond):.2f} passes "
              "(sim.workloads.model.SELECT_PASSES)")
    out = write_csv(args.out, HEADER, rows)
    print(f"\nCSV: {out}  (total {time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
