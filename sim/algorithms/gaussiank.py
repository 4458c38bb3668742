"""Gaussian-k S-SGD with error feedback: a threshold from the accumulator's mean and standard deviation
instead of an exact top-k, over Top-k's allgather.

Source: Shi, Chu, Cheung and See, "Understanding Top-k Sparsification in Distributed Deep Learning",
arXiv:1911.08772 (2019), the Gaussian_k operator (threshold = the percent point of N(mu, sigma) at
p = 1 - k/d, then adjusted until about k entries pass), and its released code hclhkbu/GaussianK-SGD,
``compression.py`` ``GaussianCompressor.compress`` with ``utils.gen_threshold_from_normal_distribution``,
which this module follows operation for operation:

1. mu = mean(u), sigma = std(u) (sample standard deviation, divisor d_b - 1, as ``torch.std``), with u the
   accumulator segment acc_p (d_b elements);
2. z = ndtri((1 - (1 - rho)) / 2) (``scipy.stats.norm.ppf``, rho = k / d_b the density, the code's
   ``p_value = 1 - ratio``), threshold t = mu - z sigma (the code's ``right_thres``, float64);
3. up to ``loops`` times (the code: 3): n = #{i : |u_i| > t} with t rounded to u's dtype (torch compares a
   float32 tensor with a Python float in float32); n < 2k/3: t <- t / 2 (``*= 0.5``); n > 4k/3: t <- 1.5 t;
   else stop. The selection is the last evaluated set {i : |u_i| > t} (when the loops run out, the code's final
   multiplication is never evaluated: the set and t are those of the last comparison);
4. the selected entries are allgathered and summed exactly as Top-k's (:class:`sim.algorithms.topk.AllgatherSparse`);
   eps_p = acc_p with the selected entries zeroed.

Deviations from the code, each documented where it acts (:func:`gaussiank_select`): exact zeros are never
selected (the code selects them when t < 0, possible when |mu| is large against sigma; they carry no mass, the
loop's counts are the code's); the statistics are accumulated in float64 and rounded to u's dtype (torch sums
a float32 mean in float32 and its reduction order is its own: the statistics can differ in the last bit, see
docs/algorithms/gaussiank.md for how often); a segment of one element (``torch.std`` is NaN there and the code
selects nothing) is selected when non-zero, as Top-1.

The count n actually selected varies per step and rank: :attr:`sim.algorithms.Exchange.n_selected` reports it
(StepOutput.n_selected; summed over segments), the numerics send exactly those entries (the wire bytes in
metrics.csv are the real ones). The timing-only mode, the fast engine and the closed form assume exactly k
entries per rank (Top-k's allgather of k entries): the data-dependent count has no timing-only model.
Compute (:meth:`GaussianK.compression_work`): no top-k, but passes over the segment, charged as ``scan`` bytes
(d_b (4 value_bytes + loops (value_bytes + 2)) + k_b (32 + value_bytes)): the statistics (``torch.std`` and
``torch.mean``, one read each), ``torch.abs`` (a read and a write), each threshold evaluation (``abs_tensor > t``:
a read and a one-byte mask written; ``nonzero``: the mask read), and the k selected values gathered (one 32-byte
sector each) and written. The evaluations are charged at ``loops``, the most the code runs (it stops early when the
count is within [2k/3, 4k/3]; the count is data-dependent, the timing is not).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sim.comm.compression import Sparse
from sim.algorithms.base import GATHER_SECTOR_BYTES, Option, register
from sim.algorithms.topk import AllgatherSparse

__all__ = ["GaussianK", "GaussianSelection", "gaussian_threshold", "gaussiank_select", "gaussian_stats"]


def gaussian_threshold(mean: float, std: float, density: float) -> float:
    """The initial Gaussian-k threshold (float64): ``mean - ndtri((1 - (1 - density)) / 2) * std``, the code's
    ``gen_threshold_from_normal_distribution(1 - ratio, mean, std)[1]`` (``stats.norm.ppf`` is ``ndtri`` at loc 0,
    scale 1), i.e. mu + z_{1 - rho/2} sigma: a N(mu, sigma) value exceeds it in magnitude with probability about rho
    when mu = 0. density: rho in (0, 1]; mean, std: the statistics as Python floats."""
    from scipy.special import ndtri

    p_value = 1 - float(density)
    z = float(ndtri((1 - p_value) / 2))
    return float(mean) - z * float(std)


def gaussian_stats(u: np.ndarray) -> tuple[float, float]:
    """(mean, sample std with divisor n - 1) of ``u`` (float array (n,), n >= 2), accumulated in float64 and
    rounded to u's dtype (as ``torch.mean`` / ``torch.std`` return them), as Python floats."""
    dt = u.dtype.type
    m64 = np.mean(u, dtype=np.float64)
    dev = u.astype(np.float64, copy=False) - m64
    dev *= dev
    var = float(np.sum(dev)) / (u.shape[0] - 1)  # numpy's pairwise sum: no BLAS, the same on every machine
    return float(dt(m64)), float(dt(math.sqrt(var)))


@dataclass(frozen=True)
class GaussianSelection:
    """What :func:`gaussiank_select` did: ``sel`` (the selected entries, indices ascending, no exact zeros),
    ``threshold`` (float64, the one of the last comparison, compared in u's dtype), ``initial`` (the Gaussian
    threshold before adjustment), ``mean`` and ``std`` (the statistics used), ``counts`` (the code's count at each
    evaluation, zeros included when the threshold is negative) and ``thresholds`` (float64, the threshold of each
    evaluation, the last being ``threshold``)."""

    sel: Sparse
    threshold: float
    initial: float
    mean: float
    std: float
    counts: tuple[int, ...]
    thresholds: tuple[float, ...]


def gaussiank_select(u: np.ndarray, k: int, loops: int = 3, stats: tuple[float, float] | None = None
                     ) -> GaussianSelection:
    """Gaussian-k selection of the segment ``u`` (float array (n,), finite; not modified) for k (1 <= k <= n).

    The released code's GaussianCompressor.compress (module docstring, steps 1-3); ``loops`` >= 1 threshold
    evaluations at most (the code: 3; its GaussianCompressor2: 5); ``stats`` = (mean, std) to use instead of
    :func:`gaussian_stats` (the peer comparison feeds torch's). The selection is
    {i : |u_i| > t and u_i != 0} with t the returned threshold rounded to u's dtype. n = 1: the entry if non-zero
    (t = 0; the code's std is NaN there and it selects nothing).
    """
    n = u.shape[0]
    k = int(k)
    absu = np.abs(u)
    if n == 1:
        idx = np.flatnonzero(u != 0).astype(np.int64)
        return GaussianSelection(Sparse(idx, u[idx], 1), 0.0, 0.0, float(u[0]), 0.0, (len(idx),), (0.0,))
    mean, std = gaussian_stats(u) if stats is None else (float(stats[0]), float(stats[1]))
    t = initial = gaussian_threshold(mean, std, k / n)
    dt = u.dtype.type
    lo, hi = 2 * k / 3, 4 * k / 3
    counts, evaluated = [], []
    with np.errstate(over="ignore"):  # a threshold beyond the dtype's range rounds to inf: nothing passes
        for _ in range(int(loops)):
            tt = t
            evaluated.append(t)
            mask = absu > dt(t)
            c = int(np.count_nonzero(mask))
            counts.append(c)
            if c < lo:
                t *= 0.5
            elif c > hi:
                t *= 1.5
            else:
                break
    if tt < 0:  # the code would also select the exact zeros (no mass): never sent here
        mask &= u != 0
    idx = np.flatnonzero(mask).astype(np.int64, copy=False)
    return GaussianSelection(Sparse(idx, u[idx], n), float(tt), float(initial), mean, std, tuple(counts),
                             tuple(evaluated))


@register
class GaussianK(AllgatherSparse):
    """Gaussian-k S-SGD (Shi et al. 2019; hclhkbu/GaussianK-SGD's GaussianCompressor): each worker sends the
    entries above its Gaussian threshold (about k of them, their number reported per step), allgathered and
    summed as Top-k's; eps_p = acc_p with those entries zeroed. Timing-only mode: exactly k entries per rank."""

    name = "gaussiank"
    summary = "Gaussian-k S-SGD: threshold from the accumulator's mean and std (about k entries), allgathered"
    source = ("Shi, Chu, Cheung and See, arXiv:1911.08772 (2019), Gaussian_k; hclhkbu/GaussianK-SGD "
              "compression.py GaussianCompressor")
    options = {
        "loops": Option(3, "threshold evaluations at most (the code's GaussianCompressor: 3, GaussianCompressor2: 5)",
                        kind=int, lo=1, hi=100),
    }

    cost_kinds = ("scan", "reduce")  # the statistics and threshold passes (no selection), and the allgather's sum

    def compression_work(self, spec, d_b, k_b):
        """``(("scan", d_b (4 vb + loops (vb + 2)) + k_b (32 + vb)),)`` bytes (vb = value_bytes; module docstring):
        mean and std (2 vb per element), abs (2 vb), ``loops`` threshold evaluations (read |u|: vb; write and read
        the one-byte mask: 2), the k_b values gathered (a 32-byte sector each) and written (vb). With vb = 4 and
        loops = 3: 8.5 passes of 4 bytes over d_b, against a top-k selection's SELECT_PASSES = 9 on the memory
        model."""
        vb, loops = spec.value_bytes, spec.opt("loops")
        return (("scan", int(d_b) * (4 * vb + loops * (vb + 2)) + int(k_b) * (GATHER_SECTOR_BYTES + vb)),)

    def select(self, spec, acc, k, ctx):
        return gaussiank_select(acc, k, spec.opt("loops")).sel
