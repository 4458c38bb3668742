"""GPU / NCCL check (issue 4, item 7): top-k selection time and per-iteration time on a CUDA machine.

Run on a machine with CUDA GPUs (torch with CUDA; the repository installed with the torch extra):

    python benchmarks/gpu_check.py --out gpu_out                      # d = 1e7 and 1e8, density 1e-3
    python benchmarks/gpu_check.py --device cpu --d 100000 --out dry  # dry run without a GPU (CI does this)

Measures, and writes ``OUT/gpu_check.json`` and ``OUT/gpu_check.md`` (a Markdown table for the notes):

1. Top-k selection time at each d: ``torch.topk(|x|, k)`` on the device (float32, k = density * d;
   median of --repeats after a warm-up, CUDA-synchronised), next to the simulator's numpy selection
   (:func:`sim.comm.compression.topk`, float64, on the CPU). Each is also given as the coefficient
   ``c = t / (d log2 d)`` of the compute model's selection cost (``ComputeModel.select_coeff_s``; the
   default 2.19e-10 s is the gTop-k authors' P102-100 fit). Also the exact selection the torch backend's
   ranks make with ``torch.select_device: auto`` (``sim.comm.compression.selection_device``: a float32 host vector
   copied to the device, the tie rule applied there, int64 indices back), next to the same vector on the CPU
   (``cpu``), after checking both return the same indices.
2. Per-iteration time of dense (the shared ring definition and the backend's ``all_reduce`` fast path),
   Top-k and gTop-k (tree) through :mod:`sim.distributed.backend` with NCCL on P = number of visible GPUs
   (``--P`` to lower it): the numerics are the simulator's numpy code on the CPU, the bytes go through
   NCCL from device buffers, and the Top-k selections are made on the rank's GPU (``torch.select_device``'s
   default, ``auto``). NCCL refuses two ranks on one GPU, so with one GPU P = 1 and only the
   NCCL set-up, the device staging and the backend's ``all_reduce`` are exercised; the per-iteration
   times are then the local (gradient + selection) times. Mean of iterations 2..--iters (the first is
   warm-up), seconds: compute, compress, comm, total (``iter_time_s``).

Nothing here asserts on time. Exits 2 with one line if --device cuda is asked for and no GPU is visible.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.outdir import atomic_write_text  # noqa: E402
from sim.algorithms import AlgorithmSpec  # noqa: E402
from sim.comm.compression import topk as np_topk  # noqa: E402
from sim.workloads.data import shard_indices  # noqa: E402
from sim.workloads.objectives import make_objective  # noqa: E402
from sim.engine.runner import Workers  # noqa: E402

DEFAULT_SELECT_COEFF_S = 2.19e-10


def lr_const(t):
    """Step size 0.01 (module level: spawned ranks unpickle it)."""
    return 0.01


def _specs(k):
    return {
        "dense_ring": (AlgorithmSpec("dense", collective="ring", value_bytes=8), False),
        "dense_allreduce": (AlgorithmSpec("dense", collective="ring", value_bytes=8), True),
        "topk": (AlgorithmSpec("topk", k=k, value_bytes=8, index_bytes=8), False),
        "gtopk_tree": (AlgorithmSpec("gtopk", k=k, collective="tree", value_bytes=8, index_bytes=8), False),
    }


def _setup(P, d):
    obj = make_objective("double_well", d=d, n=8 * P, seed=0)
    return Workers(obj, shard_indices(obj.n, P, seed=0), 4, 0), obj.x0(0)


def select_times(device: str, d: int, k: int, repeats: int) -> dict:
    """Median seconds of one top-k selection of k of d: torch on ``device`` and numpy on the CPU."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(d, generator=gen, dtype=torch.float32).to(device)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    ts = []
    for i in range(repeats + 2):
        sync()
        t0 = time.perf_counter()
        torch.topk(x.abs(), k, sorted=False)
        sync()
        if i >= 2:
            ts.append(time.perf_counter() - t0)
    xn = np.random.default_rng(0).standard_normal(d)
    tn = []
    for _ in range(max(1, min(repeats, 3))):
        t0 = time.perf_counter()
        np_topk(xn, k)
        tn.append(time.perf_counter() - t0)
    # the exact selection of the torch backend's ranks: host float32 vector, on the device (auto) and here (cpu)
    from sim.comm.compression import selection_device

    x32 = xn.astype(np.float32)
    with selection_device(device):
        on_dev = np_topk(x32, k)
    here = np_topk(x32, k)
    same = bool(np.array_equal(on_dev.idx, here.idx) and np.array_equal(on_dev.val, here.val))
    te, th = [], []
    for _ in range(max(1, min(repeats, 5))):
        with selection_device(device):
            t0 = time.perf_counter()
            np_topk(x32, k)
            te.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        np_topk(x32, k)
        th.append(time.perf_counter() - t0)
    dl = d * math.log2(d)
    t_dev, t_np = statistics.median(ts), statistics.median(tn)
    return {"d": d, "k": k, "device": device, "torch_topk_s": t_dev, "torch_select_coeff_s": t_dev / dl,
            "numpy_topk_s": t_np, "numpy_select_coeff_s": t_np / dl,
            "default_select_coeff_s": DEFAULT_SELECT_COEFF_S,
            "exact_on_device_s": statistics.median(te), "exact_on_cpu_s": statistics.median(th),
            "exact_same_indices": same}


def iteration_job(ctx, d, k, iters, names):
    """Per-rank body: each algorithm for ``iters`` iterations; rank 0 returns {name: mean times}."""
    from sim.distributed.backend import resolve_select_device, run_worker

    w, x0 = _setup(ctx.P, d)
    out = {}
    for name in names:
        spec, fast = _specs(k)[name]
        r = run_worker(ctx.rank, ctx.P, spec, w, T=iters, lr=lr_const, x0=x0, transport=ctx.transport,
                       eval_every=iters, backend_allreduce=fast,
                       select_device=resolve_select_device("auto", ctx.rank))  # as a torch-backend run does
        if ctx.rank == 0:
            rows = [row for row in r.rows if row["iteration"] >= 2]
            out[name] = {c: float(np.mean([row[c] for row in rows]))
                         for c in ("compute_s", "compress_s", "comm_s", "iter_time_s")}
    return out if ctx.rank == 0 else None


def main(argv=None) -> int:
    """Run the check (see the module docstring); returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--d", default="10000000,100000000", help="comma-separated model sizes")
    ap.add_argument("--density", type=float, default=1e-3)
    ap.add_argument("--repeats", type=int, default=10, help="timed top-k selections per d")
    ap.add_argument("--iters", type=int, default=4, help="iterations per algorithm (first dropped)")
    ap.add_argument("--P", type=int, default=0, help="ranks (default: number of GPUs; 2 on --device cpu)")
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwind: ranks are killed
    import torch

    from sim.distributed.backend import launch_local

    try:
        ds = [int(float(x)) for x in a.d.split(",") if x.strip()]
    except ValueError:
        print(f"error: --d {a.d!r} is not a comma-separated list of integers", file=sys.stderr)
        return 2
    if not ds or min(ds) < 2 or not 0 < a.density <= 1 or a.iters < 2 or a.repeats < 1 or a.P < 0 \
            or not 0 < a.timeout <= 86_400:
        print(f"error: need d >= 2 (got {ds}), 0 < --density <= 1 (got {a.density}), --iters >= 2 "
              f"(got {a.iters}), --repeats >= 1 (got {a.repeats}), --P >= 1 or 0 for the default (got {a.P}), "
              f"0 < --timeout <= 86400 (got {a.timeout})", file=sys.stderr)
        return 2
    if a.device == "cuda":
        if not torch.cuda.is_available():
            print("error: --device cuda but no CUDA GPU is visible (torch.cuda.is_available() is False): "
                  "run on a GPU machine, or --device cpu for a dry run", file=sys.stderr)
            return 2
        n_gpu = torch.cuda.device_count()
        P = a.P or n_gpu
        if not 1 <= P <= n_gpu:
            print(f"error: --P {P} is out of range: valid 1 <= P <= {n_gpu} (one GPU per NCCL rank)", file=sys.stderr)
            return 2
        dev, backend = "cuda:0", "nccl"
        gpu = torch.cuda.get_device_name(0)
    else:
        P, dev, backend, gpu = (a.P or 2), "cpu", "gloo", "none"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": gpu,
           "gpus_visible": torch.cuda.device_count() if torch.cuda.is_available() else 0,
           "cpu_count": os.cpu_count(), "python": platform.python_version(), "backend": backend, "P": P}
    print(json.dumps(env), flush=True)
    sel, its = [], []
    for d in ds:
        k = max(1, round(a.density * d))
        s = select_times(dev, d, k, a.repeats)
        sel.append(s)
        print(f"top-k d = {d}: torch {1e3 * s['torch_topk_s']:.3f} ms on {dev}, numpy {1e3 * s['numpy_topk_s']:.1f} ms",
              flush=True)
    for d in ds:
        k = max(1, round(a.density * d))
        names = list(_specs(k))
        t0 = time.perf_counter()
        res = launch_local(P, iteration_job, (d, k, a.iters, names), timeout_s=a.timeout, backend=backend)[0]
        for name in names:
            its.append({"d": d, "k": k, "P": P, "algorithm": name, **res[name]})
        print(f"iterations d = {d}: {time.perf_counter() - t0:.1f} s", flush=True)
    md = [f"GPU check: {gpu}, torch {torch.__version__}, backend {backend}, P = {P}, {env['date']}", "",
          "| d | k | torch top-k ms | c = t/(d lg d) s | numpy top-k ms | numpy c s | exact float32 ms, select_device "
          "auto (copy + device) | cpu | same indices |", "|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {s['d']} | {s['k']} | {1e3 * s['torch_topk_s']:.3f} | {s['torch_select_coeff_s']:.3g} | "
           f"{1e3 * s['numpy_topk_s']:.1f} | {s['numpy_select_coeff_s']:.3g} | {1e3 * s['exact_on_device_s']:.2f} | "
           f"{1e3 * s['exact_on_cpu_s']:.2f} | {s['exact_same_indices']} |" for s in sel]
    md += ["", "| d | P | algorithm | compute ms | compress ms | comm ms | iteration ms |", "|---|---|---|---|---|---|---|"]
    md += [f"| {r['d']} | {r['P']} | {r['algorithm']} | {1e3 * r['compute_s']:.2f} | {1e3 * r['compress_s']:.2f} | "
           f"{1e3 * r['comm_s']:.2f} | {1e3 * r['iter_time_s']:.2f} |" for r in its]
    for name, text in (("gpu_check.json", json.dumps({"environment": env, "select": sel, "iterations": its}, indent=1)),
                       ("gpu_check.md", "\n".join(md) + "\n")):
        atomic_write_text(out / name, text)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
