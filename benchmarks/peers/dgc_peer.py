"""Run the official DGC code (github.com/synxlin/deep-gradient-compression) on constructed inputs and record what
it computes, as the fixture tests/test_dgc.py compares sim/algorithms/dgc.py against (CI has neither the peer
code nor its dependencies).

Usage (the checkout is the authors' tree, e.g. from ``git archive`` of the fetched mirror; nothing of it is
copied here)::

    python benchmarks/peers/dgc_peer.py /work/peers/dgc [--out tests/fixtures/peers/dgc.npz]

Their ``dgc/memory.py`` (DGCSGDMemory), ``dgc/compression.py`` (DGCCompressor), ``dgc/clip_grad.py``
(clip_grad_norm_) and ``dgc/optim/sgd.py`` (DGCSGD) are imported unchanged. They import horovod (not installable
here: it builds against MPI / NCCL) and ``torch._six`` (removed in torch 2): this script puts stand-ins for those
two modules in ``sys.modules`` before the import -- ``horovod.torch.rank()`` = 0, ``size()`` = P, and the names
``mpi_ops`` exports, which the pieces used here never call (the allgather is done below by concatenating the
workers' tensors in rank order, as horovod's allgather returns them); ``torch._six.inf`` = math.inf.

What is recorded (``--out``, an .npz of small arrays):

1. ``mem_*``: P workers (one DGCSGDMemory + DGCCompressor each) run T steps of compress -> allgather ->
   decompress -> DGCSGD.step on two tensors of shapes (20, 32) and (8, 16) (d = 768; the clipping cases
   (8, 32) and (2, 32), d = 320) at compress_ratio 1/32 (k = 20 + 4, resp. 8 + 2), with ``sample_ratio = 1.0``:
   their exact path (the threshold is the k-th largest |v|, then the first k indices at or above it), which is
   exact top-k when no tie sits at the k-th magnitude (the inputs below have none). Gradients: worker p at step
   t uses ``np.random.default_rng([seed, p, t])`` (:func:`gradient`: standard normal, or for the clipping cases
   distinct magnitudes whose sums of squares are exact in any order, so torch's norm and numpy's agree to the
   bit). Per step and worker: sha256 of their momentum u, velocity v and parameters (the tensors' bytes,
   concatenated in tensor order) and the sent indices (offset by the tensor's start). Cases: float64 and
   float32, momentum masking off, Nesterov, local clipping (max_norm = c / sqrt(P), the paper's N^{-1/2}
   scaling, passed to their clip_grad_norm_ through DGCSGDMemory's gradient_clipping), lr = 0.5, and P = 3
   (whose 1/P is not a power of two: their update multiplies by 1/P, ours divides; the final parameters are
   stored for a tolerance check).
2. ``thr_*``: their ``_sparsify`` with the sampled threshold (sample_ratio 0.01, strided and uniform samples,
   resample on and off) on float32 vectors from ``np.random.default_rng(seed)`` of several distributions; the
   sample is theirs: the strided offset is ``random.randint`` after ``random.seed(draw)`` and the uniform
   indices ``torch.randint`` after ``torch.manual_seed(draw)`` (both drawn again here with the same seed and
   recorded, then the seed is reset before their call). Per draw: the sample offset / indices, their selected
   count and the sha256 of their sorted indices (int64).
3. ``layout``: their ``initialize`` attributes (num_selects, num_samples, top_k_samples, sample_stride) for a
   grid of (numel, compress_ratio, sample_ratio).
4. ``warmup_*``: their ``warmup_compress_ratio(epoch)`` compress ratios and num_selects for epochs 0..7 of a
   tensor of 100,000 entries at base ratio 0.001: warmup_epochs 5 and 4 with the default coefficient, and 4 with
   the paper's list [0.25, 0.0625, 0.015625, 0.004].
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import io
import math
import random
import sys
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "peers" / "dgc.npz"

#: the memory comparison's tensors, shapes as in a model (their compressor flattens them); the clipping cases use
#: smaller ones, whose sums of squares of distinct magnitudes stay exact in float32
MEM_SHAPES = ((20, 32), (8, 16))
CLIP_SHAPES = ((8, 32), (2, 32))
MEM_RATIO = 1 / 32
MEM_T = 6
MEM_SEED = 11
#: name -> (dtype, P, momentum, masking, nesterov, clip c (0: off), lr, integer gradients)
MEM_CASES = {
    "f64": ("float64", 4, 0.9, True, False, 0.0, 1.0, False),
    "f32": ("float32", 4, 0.9, True, False, 0.0, 1.0, False),
    "f32_nomask": ("float32", 4, 0.9, False, False, 0.0, 1.0, False),
    "f64_nesterov": ("float64", 4, 0.9, True, True, 0.0, 1.0, False),
    "f32_clip": ("float32", 4, 0.9, True, False, 60.0, 1.0, True),
    "f64_clip": ("float64", 4, 0.9, True, False, 60.0, 1.0, True),
    "f64_lr_half": ("float64", 4, 0.9, True, False, 0.0, 0.5, False),
    "f64_P3": ("float64", 3, 0.9, True, False, 0.0, 1.0, False),
}


def mem_shapes(case) -> tuple:
    """The tensor shapes of a memory case: CLIP_SHAPES for the clipping cases, else MEM_SHAPES."""
    return CLIP_SHAPES if case[5] > 0 else MEM_SHAPES


#: threshold cases: name -> (numel, compress_ratio, distribution, strided, resample, draws)
THR_CASES = {
    "normal_256": (65536, 1 / 256, "normal", True, True, 24),
    "laplace_1024": (65536, 1 / 1024, "laplace", True, True, 24),
    "lognormal_64": (65536, 1 / 64, "lognormal", True, True, 24),
    "mixed_256_noresample": (65536, 1 / 256, "mixed", True, False, 24),
    "normal_1000_noresample": (100000, 0.001, "normal", True, False, 24),
    "normal_1000": (100000, 0.001, "normal", True, True, 24),
    "laplace_256_uniform": (65536, 1 / 256, "laplace", False, True, 6),
    "normal_1024_uniform_noresample": (65536, 1 / 1024, "normal", False, False, 6),
}
THR_SEED = 5

#: layout grid: (numel, compress_ratio, sample_ratio)
LAYOUTS = [(n, r, s) for n in (10, 63, 64, 65, 500, 4096, 65536, 100000, 1000003, 25557032)
           for r in (0.25, 1 / 32, 0.001) for s in (0.01, 0.05, 1.0)]

WARMUP_NUMEL = 100000
WARMUP_CASES = {"e5_default": (5, None), "e4_default": (4, None), "e4_paper": (4, [0.25, 0.0625, 0.015625, 0.004])}


def gradient(kind: str, seed: int, p: int, t: int, d: int, dtype) -> np.ndarray:
    """Worker p's step-t gradient of the memory cases (also regenerated by tests/test_dgc.py): standard normal
    ("normal"), or ("exact") the magnitudes 1..d in a random order with random signs times 2^-(5 + t mod 3):
    distinct magnitudes (no tie decides a top-k, see below) whose sums of squares are exact in float32 for
    d = 320 in any summation order, so torch's norm and numpy's agree to the bit.

    Ties matter: their sample_ratio = 1 path keeps the first num_selects indices among the entries at or above
    the num_selects-th largest magnitude, which with a tie at that magnitude can drop a larger entry of higher
    index (exact top-k, ours, keeps every entry strictly above it)."""
    rng = np.random.default_rng([seed, p, t])
    if kind == "exact":
        mag = rng.permutation(np.arange(1, d + 1)).astype(np.float64)
        return (mag * rng.choice([-1.0, 1.0], d) * 2.0 ** -(5 + t % 3)).astype(dtype)
    return rng.standard_normal(d).astype(dtype)


def vector(dist: str, seed: int, d: int) -> np.ndarray:
    """A float32 vector of the threshold cases (also regenerated by tests/test_dgc.py)."""
    rng = np.random.default_rng([seed, d])
    if dist == "normal":
        x = rng.standard_normal(d)
    elif dist == "laplace":
        x = rng.laplace(size=d)
    elif dist == "lognormal":
        x = rng.lognormal(0.0, 2.0, d) * rng.choice([-1.0, 1.0], d)
    else:  # mixed: 95% small, 5% large
        x = rng.standard_normal(d) * np.where(rng.random(d) < 0.05, 10.0, 0.01)
    return x.astype(np.float32)


def digest(*arrays) -> np.ndarray:
    """sha256 of the arrays' bytes, as 32 uint8 (also used by tests/test_dgc.py)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return np.frombuffer(h.digest(), dtype=np.uint8)


def load_peer(checkout: Path, world: dict):
    """Import their modules with stand-ins for horovod and torch._six; returns (memory, compression, clip, sgd)."""
    import torch

    six = types.ModuleType("torch._six")
    six.inf = math.inf
    sys.modules["torch._six"] = six
    hvd = types.ModuleType("horovod.torch")
    hvd.rank = lambda: 0
    hvd.size = lambda: world["P"]

    def _no_comm(*a, **k):
        raise RuntimeError("the peer comparison does not communicate through horovod")

    hvd.allreduce_ = _no_comm
    mpi = types.ModuleType("horovod.torch.mpi_ops")
    mpi.Average, mpi.Sum, mpi.Adasum = "Average", "Sum", "Adasum"
    mpi.allreduce_async_ = mpi.allgather_async = mpi.synchronize = mpi.size = _no_comm
    hvd.mpi_ops = mpi
    top = types.ModuleType("horovod")
    top.torch = hvd
    sys.modules.update({"horovod": top, "horovod.torch": hvd, "horovod.torch.mpi_ops": mpi})
    sys.path.insert(0, str(checkout))
    import dgc.clip_grad as clip
    import dgc.compression as compression
    import dgc.memory as memory
    import dgc.optim.sgd as sgd

    for mod in (clip, compression, memory, sgd):
        if not Path(mod.__file__).resolve().is_relative_to(checkout.resolve()):
            raise SystemExit(f"{mod.__name__} was imported from {mod.__file__}, not from {checkout}")
    return memory, compression, clip, sgd, torch


def run_memory_case(peer, world, name, case):
    memory, compression, clip, sgd, torch = peer
    dtype, P, m, masking, nesterov, c, lr, integer = case
    world["P"] = P
    tdt = getattr(torch, dtype)
    names = [f"w{i}" for i in range(len(mem_shapes(case)))]
    shapes = mem_shapes(case)
    numels = [int(np.prod(s)) for s in shapes]
    offsets = np.concatenate([[0], np.cumsum(numels)])
    d = int(offsets[-1])
    x0 = np.random.default_rng([MEM_SEED, 999]).standard_normal(d).astype(dtype)
    workers = []
    with contextlib.redirect_stdout(io.StringIO()):
        for p in range(P):
            clipping = functools.partial(clip.clip_grad_norm_, max_norm=c / math.sqrt(P)) if c > 0 else None
            mem = memory.DGCSGDMemory(momentum=m, nesterov=nesterov, gradient_clipping=clipping,
                                      momentum_masking=masking)
            params = [torch.nn.Parameter(torch.from_numpy(x0[offsets[i]:offsets[i + 1]].copy()).view(*s))
                      for i, s in enumerate(shapes)]
            named = list(zip(names, params))
            mem.initialize(named)
            comp = compression.DGCCompressor(MEM_RATIO, memory=mem, sample_ratio=1.0)
            comp.initialize(named)
            opt = sgd.DGCSGD(params, lr=lr, momentum=m, weight_decay=0.0)
            workers.append((mem, comp, params, opt))
    ks = [comp.attributes[n][2] for n in names]
    dig = np.empty((MEM_T, P, 3, 32), dtype=np.uint8)
    grads = []
    sent = np.full((MEM_T, P, sum(ks)), -1, dtype=np.int32)
    for t in range(1, MEM_T + 1):
        outs = []
        for p, (mem, comp, params, opt) in enumerate(workers):
            g = gradient("exact" if integer else "normal", MEM_SEED, p, t, d, dtype)
            grads.append(g)
            per = []
            for i, (n, prm) in enumerate(zip(names, params)):
                prm.grad = torch.from_numpy(g[offsets[i]:offsets[i + 1]].copy()).view(*shapes[i])
                (vals, idx), ctx = comp.compress(prm.grad, n)
                per.append((vals, idx, ctx))
            outs.append(per)
        for i, n in enumerate(names):  # allgather: every worker's tensors, concatenated in rank order
            vals = torch.cat([outs[p][i][0] for p in range(P)])
            idx = torch.cat([outs[p][i][1] for p in range(P)])
            for p, (mem, comp, params, opt) in enumerate(workers):
                params[i].grad = comp.decompress((vals, idx), outs[p][i][2])
        for p, (mem, comp, params, opt) in enumerate(workers):
            opt.step()
            u = torch.cat([mem.momentums[n].reshape(-1) for n in names]).numpy()
            v = torch.cat([mem.velocities[n].reshape(-1) for n in names]).numpy()
            x = torch.cat([prm.detach().reshape(-1) for prm in params]).numpy()
            assert u.dtype == np.dtype(dtype) and x.dtype == np.dtype(dtype)
            dig[t - 1, p] = (digest(u), digest(v), digest(x))
            s = np.concatenate([np.sort(outs[p][i][1].view(-1).numpy()) + offsets[i] for i in range(len(names))])
            sent[t - 1, p, :s.shape[0]] = s
    final_x = torch.cat([prm.detach().reshape(-1) for prm in workers[0][2]]).numpy().copy()
    return {f"mem_{name}_digests": dig, f"mem_{name}_inputs": digest(x0, *grads), f"mem_{name}_sent": sent,
            f"mem_{name}_ks": np.array(ks), f"mem_{name}_final_x": final_x if P & (P - 1) else np.zeros(0)}


def run_threshold_case(peer, world, name, case):
    memory, compression, clip, sgd, torch = peer
    numel, ratio, dist, strided, resample, draws = case
    world["P"] = 1
    with contextlib.redirect_stdout(io.StringIO()):
        comp = compression.DGCCompressor(ratio, sample_ratio=0.01, strided_sample=strided, resample=resample)
        comp.initialize([("x", (numel, [numel]))])
    _, _, num_selects, num_samples, top_k_samples, stride = comp.attributes["x"]
    x = torch.from_numpy(vector(dist, THR_SEED, numel))
    picks, counts, digs = [], [], []
    for draw in range(draws):
        if strided:
            random.seed(draw)
            picks.append(random.randint(0, stride - 1))
            random.seed(draw)
        else:
            torch.manual_seed(draw)
            picks.append(torch.randint(0, numel, (num_samples,)).numpy().astype(np.int32))
            torch.manual_seed(draw)
        _, idx, _, _, _ = comp._sparsify(x, "x")
        idx = np.sort(idx.numpy().astype(np.int64))
        counts.append(idx.shape[0])
        digs.append(digest(idx))
    return {f"thr_{name}_picks": np.array(picks, dtype=np.int32), f"thr_{name}_counts": np.array(counts),
            f"thr_{name}_digests": np.array(digs), f"thr_{name}_input": digest(x.numpy()),
            f"thr_{name}_layout": np.array([num_selects, num_samples, top_k_samples, stride])}


def run_layouts(peer, world):
    memory, compression, clip, sgd, torch = peer
    world["P"] = 1
    rows = []
    for numel, ratio, sratio in LAYOUTS:
        with contextlib.redirect_stdout(io.StringIO()):
            comp = compression.DGCCompressor(ratio, sample_ratio=sratio)
            comp.initialize([("x", (numel, [numel]))])
        _, _, num_selects, num_samples, top_k_samples, stride = comp.attributes["x"]
        rows.append([numel, num_selects, num_samples, top_k_samples, stride])
    return {"layout_grid": np.array([[r, s] for _, r, s in LAYOUTS]), "layout_rows": np.array(rows, dtype=np.int64)}


def run_warmups(peer, world):
    memory, compression, clip, sgd, torch = peer
    world["P"] = 1
    out = {}
    for name, (epochs, coeff) in WARMUP_CASES.items():
        with contextlib.redirect_stdout(io.StringIO()):
            comp = compression.DGCCompressor(0.001, warmup_epochs=epochs, warmup_coeff=coeff)
            comp.initialize([("x", (WARMUP_NUMEL, [WARMUP_NUMEL]))])
            ratios, selects = [], []
            for e in range(8):
                comp.warmup_compress_ratio(e)
                ratios.append(comp.compress_ratio)
                selects.append(comp.attributes["x"][2])
        out[f"warmup_{name}_ratios"] = np.array(ratios)
        out[f"warmup_{name}_selects"] = np.array(selects)
        out[f"warmup_{name}_epochs"] = np.array(epochs)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", type=Path, help="the authors' tree (synxlin/deep-gradient-compression)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if not (args.checkout / "dgc" / "memory.py").is_file():
        raise SystemExit(f"{args.checkout} has no dgc/memory.py: valid a checkout of synxlin/deep-gradient-compression")
    world = {"P": 1}
    peer = load_peer(args.checkout, world)
    torch = peer[-1]
    torch.set_num_threads(1)
    out = {"peer_torch_version": np.array(torch.__version__)}
    for name, case in MEM_CASES.items():
        out.update(run_memory_case(peer, world, name, case))
        print(f"memory {name}: P = {case[1]}, {MEM_T} steps, k = {out[f'mem_{name}_ks'].tolist()}")
    for name, case in THR_CASES.items():
        out.update(run_threshold_case(peer, world, name, case))
        c = out[f"thr_{name}_counts"]
        lay = out[f"thr_{name}_layout"]
        print(f"threshold {name}: k = {lay[0]}, {lay[1]} samples at stride {lay[3]} (top {lay[2]}): selected "
              f"counts {c.min()}..{c.max()} (mean {c.mean():.1f}) over {c.shape[0]} draws")
    out.update(run_layouts(peer, world))
    out.update(run_warmups(peer, world))
    for name in WARMUP_CASES:
        print(f"warm-up {name}: ratios {np.round(out[f'warmup_{name}_ratios'], 5).tolist()}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
