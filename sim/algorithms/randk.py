"""Rand-k S-SGD with error feedback: as Top-k with k uniformly drawn coordinates.

acc_p = eps_p + alpha_t G_p; g = sum_q RandK(acc_q) (allgather); eps_p = acc_p - RandK(acc_p). With P = 1
this is Mem-SGD with rand-k (Stich, Cordonnier and Jaggi, NeurIPS 2018, Algorithm 1): acc = m + eta g, send
RandK(acc), m = acc - RandK(acc). Worker p at iteration t draws with
``np.random.default_rng([seed, p, t, RANDK_STREAM])`` (independent of the mini-batch draw ``[seed, p, t]``);
with segments that one generator draws the segments' coordinates in segment order.
"""
from __future__ import annotations

import numpy as np

from sim.comm.compression import randk
from sim.algorithms.base import GATHER_SECTOR_BYTES, register
from sim.algorithms.topk import AllgatherSparse

#: Stream tag appended to ``[seed, rank, iteration]`` for the rand-k coordinate draw ("RAND" in ASCII).
RANDK_STREAM = 0x52414E44


@register
class RandK(AllgatherSparse):
    """Rand-k S-SGD: k coordinates drawn uniformly without replacement, allgathered and summed."""

    name = "randk"
    summary = "rand-k S-SGD with error feedback (Mem-SGD with rand-k): allgather of k random coordinates"
    uses_seed = True
    predict_default = False  # its allgather costs what Top-k's does
    source = "Stich, Cordonnier and Jaggi, NeurIPS 2018 (Mem-SGD), Algorithm 1 with rand-k"
    cost_kinds = ("scan", "reduce")  # the draw and gather of k entries (no selection), and the allgather's sum

    def compression_work(self, spec, d_b, k_b):
        """Rand-k reads only what it sends: ``(("scan", k_b (2 index_bytes + 32 + value_bytes)),)`` bytes -- per
        drawn coordinate its index written by the generator and read back (2 index_bytes), its value gathered from
        a random position (one 32-byte sector, :data:`~sim.algorithms.base.GATHER_SECTOR_BYTES`) and written to the
        message (value_bytes). Independent of d_b: the draw of k of d_b without replacement is O(k) (numpy's
        ``Generator.choice`` runs Floyd's algorithm for k <= d / 50; one by ``torch.randperm(d)[:k]``, as GRACE's,
        would scan d). The generator's arithmetic and the sort of the k indices are not charged."""
        return (("scan", int(k_b) * (2 * spec.index_bytes + GATHER_SECTOR_BYTES + spec.value_bytes)),)

    hook_combine = "sum"

    def hook_select(self, acc, k, hook_state):
        """RandK(acc) on a torch tensor: k coordinates drawn uniformly without replacement, exact zeros dropped.
        The coordinates come from the hook state's per-iteration generator ``default_rng([seed, rank, t,
        RANDK_STREAM])`` (t the 1-based iteration, rank in the hook's process group), ``rng.choice(n, k,
        replace=False)`` for the units in the order the hook handles them -- with the hook's ``scope="model"``
        exactly the draw of :meth:`select`. Only the k indices are drawn on the host; acc stays on its device.
        Returns (idx int64 ascending, val)."""
        import torch

        n = int(acc.shape[0])
        sel = np.sort(hook_state._rng().choice(n, size=int(k), replace=False)).astype(np.int64)
        idx = torch.from_numpy(sel).to(acc.device)
        val = acc[idx]
        nz = val != 0
        if not bool(nz.all()):
            idx, val = idx[nz], val[nz]
        return idx, val

    def select(self, spec, acc, k, ctx):
        rng = ctx.scratch.get("randk_rng")
        if rng is None:
            rng = ctx.scratch["randk_rng"] = np.random.default_rng([spec.seed, ctx.rank, ctx.iteration, RANDK_STREAM])
        return randk(acc, k, rng)
