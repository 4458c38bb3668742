"""Run the Ok-Topk reference code (github.com/Shigangli/Ok-Topk, ``VGG/allreducer.py`` and ``VGG/compression.py``)
over MPI on constructed inputs and record what it computes, as the fixture tests/test_oktopk.py compares
sim/algorithms/oktopk.py against (CI has neither the peer code nor MPI).

Usage (the checkout is the authors' tree, e.g. from ``git archive`` of the fetched mirror; nothing of it is
copied here; the peer environment needs torch, numpy, scipy and mpi4py with an MPI, e.g. ``pip install mpi4py
mpich``)::

    python benchmarks/peers/oktopk_peer.py /work/peers/Ok-Topk/VGG \\
        --python /work/peers/venv-oktopk/bin/python --mpiexec /work/peers/venv-oktopk/bin/mpiexec \\
        [--out tests/fixtures/peers/oktopk.npz]

The driver (this script, any Python with numpy) builds the gradients, starts ``mpiexec -n P <python> <this
script> --worker ...`` per case and collects the ranks' files. Each MPI rank imports their ``allreducer`` and
``compression`` modules unchanged and runs their ``AllReducer.run`` (the ``oktopk`` branch) on one tensor ``w`` of
d float32 entries, one call per step, with MPI.COMM_WORLD of P processes. Stand-ins, not changes of their code:
``torch.Tensor.cuda`` returns the tensor itself and ``torch.cuda.synchronize`` does nothing (their branch moves
buffers to the gradient's device with ``.cuda(device)``; here the device is the CPU); the allreduce counter of
``w`` starts at 512 (their first sparse step: the 512 dense warm-up steps are skipped), so their step 512 + t
is our iteration t + 1 (threshold re-estimation and repartition at t = 0, thresholds reused after: their
intervals 32 and 64 are our defaults tau = 32, repartition_period = 64); their density is (k + 0.5) / d, so
``int(d * density) = k``. Their ``compressbythreshold`` is wrapped (the wrapper calls theirs and records its
output) to capture the local selection: its first P calls of a step are the P regions of the local selection.

Inputs: rank p's gradient at step t is integers, distinct magnitudes in [1, 4000) (after the first step in
[1, later)) with random signs, from ``np.random.default_rng([seed, p, t])`` (float32, :func:`gradients`); with lr = 1 every accumulator, sum and threshold is exact in
float32 and float64, so their float32 results and our float64 ones must agree exactly, whatever the summation
order. (Integer magnitudes below 4096 also keep the threshold comparisons clear of float32 rounding.)

Recorded per case c (``--out``, an .npz of small arrays): ``c{c}_meta`` = (P, d, k, T, seed, later); ``c{c}_grad``
(T, P, d) float32; per step t and rank p: ``c{c}_t{t}_r{p}_result`` (their output, g / P, float32 (d,)),
``_residual`` (their residual after the step), ``_sel`` (the locally selected indices, int64, ascending),
``_offsets`` (their region offsets, int64 (P,)), ``_local_th`` and ``_global_th`` (their thresholds after the
step, float64).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "peers" / "oktopk.npz"

#: (P, d, k, T, seed, later): P = 3 is not a power of two; T = 4 or 6 steps cover the re-estimation step and
#: threshold-filter steps (thresholds reused, raised and scaled both ways, residuals carried); ``later`` bounds
#: the magnitudes after the first step (4000: all steps alike, the counts overshoot and the thresholds rise;
#: 300: small gradients after the first step, the counts undershoot and the thresholds fall). No P = 1: their
#: repartition indexes the first of P - 1 = 0 boundaries there (IndexError in AllReducer.run).
CASES = [(2, 64, 8, 4, 11, 4000), (3, 101, 12, 4, 12, 4000), (4, 160, 16, 4, 13, 4000), (3, 90, 9, 6, 14, 300)]


def gradients(P: int, d: int, T: int, seed: int, later: int = 4000) -> np.ndarray:
    """(T, P, d) float32: rank p at step t draws d distinct magnitudes in [1, 4000) (t = 0) or [1, later) (t > 0)
    and random signs from ``np.random.default_rng([seed, p, t])``."""
    out = np.empty((T, P, d), dtype=np.float32)
    for t in range(T):
        for p in range(P):
            rng = np.random.default_rng([seed, p, t])
            mag = rng.choice(np.arange(1, 4000 if t == 0 else later), size=d, replace=False)
            out[t, p] = mag * rng.choice([-1.0, 1.0], size=d)
    return out


# ----------------------------------------------------------------------------- one MPI rank (their code)


def worker(peer: str, grad_file: str, k: int, out_dir: str) -> None:
    import queue
    import threading

    import torch

    torch.Tensor.cuda = lambda self, *a, **kw: self  # stand-in: their buffers stay on the CPU
    torch.cuda.synchronize = lambda *a, **kw: None
    sys.path.insert(0, peer)
    import allreducer as ar  # noqa: E402  (theirs, unchanged)
    import compression as cmp  # noqa: E402

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, P = comm.rank, comm.size
    grads = np.load(grad_file)  # (T, P, d)
    T, _, d = grads.shape
    calls = []
    theirs = cmp.GaussianCompressor.compressbythreshold

    def recording(tensor, thres=0.0):
        idx, val = theirs(tensor, thres)
        calls.append(idx.numpy().astype(np.int64).copy())
        return idx, val

    cmp.GaussianCompressor.compressbythreshold = staticmethod(recording)
    param = torch.nn.Parameter(torch.zeros(d, dtype=torch.float32))
    q1, q2 = queue.Queue(), queue.Queue()
    red = ar.AllReducer([("w", param)], threading.Lock(), threading.Lock(), cmp.compressors["oktopk"], sparse=True,
                        density=(k + 0.5) / d, msg_queue=q1, msg_queue2=q2)
    red._allreduce_counter["w"] = 512
    out = {}
    for t in range(T):
        calls.clear()
        red.add_tensor("w", torch.from_numpy(grads[t, rank].copy()))
        q1.put("w")
        q1.put("STOP")
        red.run()
        offsets = np.asarray(red._region_offsets["w"], dtype=np.int64)
        sel = np.concatenate([calls[j] + offsets[j] for j in range(P)]) if P else np.empty(0, np.int64)
        out[f"t{t}_result"] = red.get_result("w").numpy().copy()
        out[f"t{t}_residual"] = cmp.GaussianCompressor.residuals["w"].numpy().copy()
        out[f"t{t}_sel"] = np.sort(sel)
        out[f"t{t}_offsets"] = offsets
        out[f"t{t}_local_th"] = np.float64(red._local_threshold["w"])
        out[f"t{t}_global_th"] = np.float64(red._global_threshold["w"])
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **out)


# ----------------------------------------------------------------------------- the driver


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("peer", nargs="?", help="the authors' VGG directory (allreducer.py, compression.py, ...)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="fixture to write (.npz)")
    ap.add_argument("--python", default=sys.executable, help="Python of the peer environment (torch, mpi4py)")
    ap.add_argument("--mpiexec", default="mpiexec", help="mpiexec of the MPI that mpi4py uses")
    ap.add_argument("--worker", nargs=3, metavar=("GRADS", "K", "OUTDIR"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.peer, a.worker[0], int(a.worker[1]), a.worker[2])
        return
    if not a.peer:
        ap.error("the path of the authors' VGG directory is required")
    rec = {}
    for c, (P, d, k, T, seed, later) in enumerate(CASES):
        g = gradients(P, d, T, seed, later)
        rec[f"c{c}_meta"] = np.array([P, d, k, T, seed, later], dtype=np.int64)
        rec[f"c{c}_grad"] = g
        with tempfile.TemporaryDirectory() as tmp:
            gf = os.path.join(tmp, "grads.npy")
            np.save(gf, g)
            cmd = [a.mpiexec, "-n", str(P), a.python, str(Path(__file__).resolve()), a.peer, "--worker", gf, str(k), tmp]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=a.peer)
            for p in range(P):
                with np.load(os.path.join(tmp, f"rank{p}.npz")) as z:
                    for key in z.files:
                        t, what = key.split("_", 1)
                        rec[f"c{c}_{t}_r{p}_{what}"] = z[key]
        print(f"case {c}: P = {P}, d = {d}, k = {k}, T = {T}: recorded")
    np.savez_compressed(a.out, **rec)
    print(f"wrote {a.out} ({Path(a.out).stat().st_size} bytes)")


if __name__ == "__main__":
    main()
