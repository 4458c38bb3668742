"""DGC: Deep Gradient Compression (Lin, Han, Mao, Wang and Dally, ICLR 2018) over Top-k's allgather.

Per worker p and iteration t, on each segment (tensor) of the model vector (Algorithm 1 and eq. 5 of the
paper; ``dgc/memory.py`` ``DGCSGDMemory`` and ``dgc/compression.py`` ``DGCCompressor`` of the official code,
github.com/synxlin/deep-gradient-compression):

1. local gradient clipping (section 3.2, option ``clip_norm`` c > 0): G <- G * coef with
   coef = (c / sqrt(P)) / (||G||_2 + 1e-6) when coef < 1, per segment (the official code clips per tensor, with
   its ``clip_grad_norm_`` formula; the paper scales the global threshold by N^{-1/2} for N = P workers; the
   official code ships the formula but no config wires it, so the N^{-1/2} factor is the paper's);
2. momentum correction (eq. 5): u = m u + alpha_t G, v = v + u (Nesterov, option ``nesterov``:
   u = m (u + alpha_t G), v = v + u + alpha_t G), m = ``AlgorithmSpec.momentum`` (0 with exact selection:
   error-feedback Top-k, bit for bit); weight decay is already in G (the project's placement, applied locally
   before error feedback; the official code applies it after the exchange with its own momentum buffer in
   ``DGCSGD``);
3. selection from v (not from G): option ``selection`` = ``"sampled"`` (the official code's threshold: sample
   |v| at a random stride, take its ceil(ratio * samples)-th largest magnitude as the threshold, keep the
   entries at or above it, and adapt: re-select the top k of the candidates (``resample``) or raise / lower
   the threshold when the count leaves [0.8 k, 1.3 k]; :func:`sampled_select`) or ``"exact"`` (the project's
   :func:`~sim.comm.compression.topk`);
4. the allgather of every worker's selection and its sum in rank order (Top-k's collectives, ``allgather`` and
   ``hierarchical``); v keeps what was not sent (the residual eps_p of the project's mass accounting is v);
5. momentum factor masking (section 3.2, option ``momentum_masking``): u and v zeroed at the sent coordinates
   (v always, u unless the option is off) -- v by the exchange's residual, u in :meth:`DGC.after_step`.

Units: the step size alpha_t is folded into u and v (both in parameter units, as the project's error feedback
accumulates alpha_t G); the paper and the official code keep them in gradient units and multiply the whole
sparse sum by the current step size. With a constant step the two agree, to the bit for a power-of-two step
(lr = 1 and 0.5 in the peer comparison) and to rounding otherwise; with a changing step they differ (each
gradient keeps the step of its own iteration here).

Warm-up (section 3.3, "warm-up training"): with ``warmup_iters`` = E > 0 and ``warmup_densities``
(r_0 > r_1 > ... > r_{S-1}, each in (0, 1), a sequence or in a scenario a comma-separated string; default the
paper's 75%, 93.75%, 98.4375%, 99.6% sparsity, i.e. densities 0.25, 0.0625, 0.015625, 0.004, its 99.9% being
the final k / d; one that is not strictly decreasing is a one-line ConfigError), iteration t (1-based) is in stage
s = (t - 1) // E; for s < S a segment of d_b entries selects k_b(t) = min(d_b, max(k_b, ceil(r_s d_b))) (the
official ``num_selects = ceil(numel * compress_ratio)``; never fewer than the final k_b), and from iteration
S E + 1 on k_b. An epoch of the paper is E iterations here: set E to the scenario's iterations per epoch. The
official code's default coefficients (warmup_epochs = E', no list) are (k/d)^((j + 1) / (E' + 1)) for j < E',
which a scenario writes as that explicit list.

Selected counts: exact selection sends at most k_b(t) entries (exact zeros never); the sampled selection a
data-dependent count <= k_b(t) (the official truncation ``indices[:num_selects]``, then exact zeros dropped),
reported per step in ``n_selected``; the messages then carry what was selected. The timing-only mode, the fast
engine and the closed form (Top-k's allgather, :func:`sim.comm.costs.topk_allgather_time`) assume k entries per
worker and no warm-up: after the warm-up an upper bound of the sampled selection's traffic, during it a lower
bound (the warm-up sends more).

Compute (:meth:`DGC.compression_work`): exact selection is Top-k's, one ``select`` over d_b entries. The sampled
selection runs the top-k on the sample only, ``select`` over num_samples (:func:`sample_layout`), and the rest as
``scan`` bytes over the segment: |v| (a read and a write), the threshold filter (``torch.ge``: a read and a one-byte
mask written; ``nonzero``: the mask read), the sample gathered at its stride (a 32-byte sector per sample, when the
segment is sampled) and the k selected values gathered and written; the adaptation's re-filters and resample
(data-dependent, :func:`sampled_select`'s ``passes``) are not charged: the first filter is the bound the timing
uses. The O(d) momentum correction has no kind of its own, as error feedback's addition.

Other deviations from the official code (docs/algorithms/dgc.md): it compresses only tensors of dimension > 1
(train.py; biases and norms go through a dense allreduce with plain momentum), here every segment is
compressed; its ``sample_ratio = 1`` path keeps the first k indices at or above the k-th largest |v|, which with
a tie at that magnitude can drop a larger entry (exact selection here is top-k, ties to the lower index); a
warm-up density of 1 (its uncompressed path) is not modelled (densities must be < 1).

Random draws: worker p at iteration t draws its sample offsets (strided) or indices (uniform) from
``np.random.default_rng([seed, p, t, DGC_STREAM])``, segments in order; a segment small enough to be sampled
whole draws nothing (as the official code).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sim.comm.compression import Sparse, topk, topk_select_indices
from sim.base.errors import ConfigError
from sim.algorithms.base import GATHER_SECTOR_BYTES, Option, register
from sim.algorithms.topk import AllgatherSparse

__all__ = ["DGC", "DGC_STREAM", "PAPER_WARMUP_DENSITIES", "sample_layout", "sampled_select", "warmup_k",
           "clip_coefficient"]

#: Stream tag appended to ``[seed, rank, iteration]`` for DGC's sample draw ("DGCS" in ASCII).
DGC_STREAM = 0x44474353
#: The paper's warm-up densities (75%, 93.75%, 98.4375%, 99.6% sparsity; section 3.3): the fifth stage, 99.9%,
#: is the final density k / d.
PAPER_WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.004)
#: The official ``clip_grad_norm_``'s epsilon: coef = max_norm / (||G|| + 1e-6).
CLIP_EPS = 1e-6


@dataclass(frozen=True)
class _Densities(Option):
    """An option holding a strictly decreasing sequence of densities in (0, 1): a sequence of numbers, or a
    comma-separated string of them (what a scenario's [algorithm.dgc] table holds, e.g. "0.25, 0.0625"); empty:
    no warm-up stage. Checked to a tuple of floats."""

    def check(self, algorithm, name, value):
        label = f"{algorithm}.{name}"
        valid = ("valid a strictly decreasing sequence of densities r with 0 < r < 1, e.g. "
                 "\"0.25, 0.0625, 0.015625, 0.004\"")
        seq = None
        if isinstance(value, str):
            try:
                seq = tuple(float(r) for r in value.split(",")) if value.strip() else ()
            except ValueError:
                seq = None
        elif not isinstance(value, bytes):
            try:
                seq = tuple(value)
            except TypeError:
                seq = None
        if seq is None or any(isinstance(r, bool) or not isinstance(r, (int, float, np.integer, np.floating))
                              or not 0 < r < 1 for r in seq):
            raise ConfigError(f"{label} = {value!r} is out of range: {valid}")
        seq = tuple(float(r) for r in seq)
        if any(b >= a for a, b in zip(seq, seq[1:])):
            raise ConfigError(f"{label} = {value!r} is not decreasing in density: {valid}")
        return seq


def sample_layout(numel: int, ratio: float, sample_ratio: float) -> tuple[int, int, int]:
    """The official ``DGCCompressor.initialize`` sample layout of a tensor of ``numel`` entries at density
    ``ratio`` (0 < ratio <= 1) sampling a fraction ``sample_ratio`` (0.01 <= sample_ratio <= 1) of it.

    Returns (num_samples, top_k_samples, sample_stride): at least max(ceil(numel sample_ratio), ceil(2 / ratio))
    samples at a stride of the form 32 j + 1 - 8 i (or the whole tensor, stride 1, when it has at most
    ceil(2 / ratio) entries or sample_ratio = 1); top_k_samples = ceil(num_samples ratio). Float arithmetic as
    the official code's, so the layouts agree whenever ``ratio`` is the same double."""
    if sample_ratio < 1.0:
        pct_numel = int(math.ceil(numel * sample_ratio))
        cpr_numel = int(math.ceil(2 / ratio))
        if numel <= cpr_numel:
            stride, num_samples = 1, numel
        else:
            stride = int(math.ceil(numel / max(pct_numel, cpr_numel) / 32)) * 32 + 1
            num_samples = numel // stride
            while num_samples < max(pct_numel, cpr_numel):
                stride -= 8
                num_samples = numel // stride
    else:
        stride, num_samples = 1, numel
    return num_samples, int(math.ceil(num_samples * ratio)), stride


def sampled_select(x: np.ndarray, k: int, ratio: float, *, sample_ratio: float = 0.01, strided: bool = True,
                   rng: np.random.Generator | None = None, start: int | None = None,
                   sample_idx: np.ndarray | None = None, upper: float = 1.3, lower: float = 0.8,
                   max_iters: int = 10, resample: bool = True) -> tuple[np.ndarray, int]:
    """DGC's sampled threshold selection (the official ``DGCCompressor._sparsify``) of ``x`` (float array (n,),
    finite).

    k: the count to send (``num_selects``), ratio: the density that sizes the sample (:func:`sample_layout`).
    The sample: |x|[start::stride] (``strided``; ``start`` drawn uniformly in [0, stride) from ``rng`` unless
    given) or |x|[sample_idx] (uniform with replacement, ``sample_idx`` drawn from ``rng`` unless given); none
    when the layout samples the whole vector. threshold = the top_k_samples-th largest sampled magnitude;
    candidates = {i : |x_i| >= threshold}; then up to ``max_iters`` times: more than ``upper`` k candidates ->
    the top k of them by magnitude (``resample``; ties to the lower index) and stop, or threshold *= upper;
    between k and upper k -> stop; fewer than ``lower`` k -> threshold *= lower (all in x's dtype); re-filter.
    The first k candidates by index are kept (the official ``indices[:num_selects]``) and exact zeros dropped
    (the project never sends them; the official code would when the threshold is 0).

    Returns (indices, passes): int64 array, strictly increasing, at most k entries; passes = filtering passes
    over x (1 + re-filters). Raises ValueError for a sample that is given and does not fit the layout.
    """
    d = x.shape[0]
    imp = np.abs(x)
    dt = imp.dtype.type
    num_samples, top_k_samples, stride = sample_layout(d, ratio, sample_ratio)
    sampled = d > num_samples
    if not sampled:
        samples = imp
    elif strided:
        if start is None:
            start = int(rng.integers(0, stride))
        if not 0 <= start < stride:
            raise ValueError(f"start = {start} is out of range: valid 0 <= start < {stride}")
        samples = imp[start::stride]
    else:
        if sample_idx is None:
            sample_idx = rng.integers(0, d, num_samples)
        sample_idx = np.asarray(sample_idx, dtype=np.int64)
        if sample_idx.shape != (num_samples,):
            raise ValueError(f"sample_idx has shape {sample_idx.shape}: valid ({num_samples},)")
        samples = imp[sample_idx]
    m = samples.shape[0]
    thr = dt(np.partition(samples, m - top_k_samples)[m - top_k_samples])
    idx = np.flatnonzero(imp >= thr)
    passes = 1
    if sampled:
        for _ in range(max_iters):
            n = idx.shape[0]
            if n > k:
                if n > k * upper:
                    if resample:
                        idx = idx[topk_select_indices(imp[idx], k)]
                        break
                    thr = dt(thr * dt(upper))
                else:
                    break
            elif n < lower * k:
                thr = dt(thr * dt(lower))
            else:
                break
            idx = np.flatnonzero(imp >= thr)
            passes += 1
    idx = idx[:k]
    idx = idx[x[idx] != 0]
    return idx.astype(np.int64, copy=False), passes


def warmup_k(k_b: int, d_b: int, iteration: int, warmup_iters: int, densities) -> tuple[int, float]:
    """The count a segment of d_b entries selects at ``iteration`` (>= 1) and the density that sizes its sample:
    stage s = (iteration - 1) // warmup_iters; while s < len(densities): (min(d_b, max(k_b, ceil(r_s d_b))), r_s)
    or (k_b, k_b / d_b) when r_s d_b rounds up to at most k_b; after the warm-up (or warmup_iters = 0):
    (k_b, k_b / d_b)."""
    if warmup_iters > 0:
        s = (iteration - 1) // warmup_iters
        if s < len(densities):
            r = densities[s]
            k_t = min(d_b, int(math.ceil(d_b * r)))
            if k_t > k_b:
                return k_t, r
    return k_b, k_b / d_b


def clip_coefficient(g: np.ndarray, max_norm: float):
    """The official ``clip_grad_norm_`` factor of one tensor ``g`` (float array) in its dtype:
    max_norm / (||g||_2 + 1e-6), computed as torch computes ``max_norm / t`` (``t.reciprocal() * max_norm``);
    None when it is >= 1 (no clipping). The norm is numpy's (BLAS) sum of squares: bit-equal to torch's only
    when both sums are exact (the peer fixture's integer gradients)."""
    dt = g.dtype.type
    norm = np.sqrt(np.dot(g, g))
    coef = (dt(1) / dt(norm + dt(CLIP_EPS))) * dt(max_norm)
    return coef if coef < 1 else None


_ON_OFF = ("on", "off")


@register
class DGC(AllgatherSparse):
    """Deep Gradient Compression (Lin et al., ICLR 2018): momentum correction, momentum factor masking, local
    gradient clipping, exponential sparsity warm-up and the sampled threshold selection, over Top-k's allgather.
    State per worker: ``state["dgc_u"]``, the momentum u (float array (d,), the accumulator's dtype); the
    velocity v is the residual."""

    name = "dgc"
    trace_name = "dgc"
    local_momentum = True
    uses_seed = True
    summary = ("DGC: momentum correction and masking, local clipping, sparsity warm-up, sampled top-k threshold; "
               "Top-k's allgather")
    source = "Lin, Han, Mao, Wang and Dally, ICLR 2018 (Deep Gradient Compression), Algorithm 1, eq. 5, section 3"
    predict_default = False  # its allgather costs what Top-k's does (k entries per worker)
    options = {
        "selection": Option("sampled", "sampled (the official threshold estimate with adaptation) or exact top-k",
                            kind=str, choices=("sampled", "exact")),
        "sample_ratio": Option(0.01, "fraction of |v| sampled for the threshold (official sample_ratio)",
                               lo=0.01, hi=1.0),
        "sampling": Option("strided", "strided (random offset, official default) or uniform (with replacement)",
                           kind=str, choices=("strided", "uniform")),
        "compress_upper_bound": Option(1.3, "re-select when more than this times k entries pass the threshold",
                                       lo=1.0, lo_open=True),
        "compress_lower_bound": Option(0.8, "lower the threshold when fewer than this times k entries pass",
                                       lo=0.0, hi=1.0, lo_open=True),
        "max_adaptation_iters": Option(10, "threshold adaptation passes at most", kind=int, lo=0, hi=1000),
        "resample": Option("on", "on: take the top k of the candidates when too many pass; off: raise the threshold",
                           kind=str, choices=_ON_OFF),
        "momentum_masking": Option("on", "zero the momentum u at the sent coordinates (v is always zeroed)",
                                   kind=str, choices=_ON_OFF),
        "nesterov": Option("off", "Nesterov momentum correction (official DGCSGDMemory nesterov)", kind=str,
                           choices=_ON_OFF),
        "clip_norm": Option(0.0, "global gradient-norm threshold c (0: off); each worker clips to c / sqrt(P)",
                            lo=0.0),
        "warmup_iters": Option(0, "iterations per warm-up stage (an epoch of the paper; 0: no warm-up)",
                               kind=int, lo=0),
        "warmup_densities": _Densities(PAPER_WARMUP_DENSITIES,
                                       "warm-up stage densities, strictly decreasing in (0, 1) (the paper's: "
                                       "0.25, 0.0625, 0.015625, 0.004, then k / d)", kind=tuple),
    }

    cost_kinds = ("select", "scan", "reduce")  # top-k (of the sample, or exact), the filter's bytes, the allgather's sum

    def scenario_settings(self, compression):
        return {}  # its collective is set in [algorithm.dgc]

    def compression_work(self, spec, d_b, k_b):
        """selection = "exact": Top-k's, ``(("select", d_b),)``. selection = "sampled" (module docstring, the
        official ``_sparsify``): ``(("select", n_s), ("scan", d_b (3 vb + 2) + [n_s 32 if sampled] + k_b (32 +
        vb)))`` with n_s the sample of :func:`sample_layout` at density k_b / d_b (the whole segment when it is
        small, then nothing is gathered for it) and vb = value_bytes: a top-k of the sample, |v| (2 vb), the first
        threshold filter (vb read, a one-byte mask written and read), the strided sample (a 32-byte sector each), the
        k_b values gathered (a sector each) and written. The warm-up's larger k (iterations <= warmup_iters x stages)
        is not charged, as the timing-only mode's k."""
        if spec.opt("selection") == "exact":
            return (("select", d_b),)
        d_b, k_b, vb = int(d_b), int(k_b), spec.value_bytes
        n_s, _, _ = sample_layout(d_b, k_b / d_b, spec.opt("sample_ratio"))
        gathered = n_s * GATHER_SECTOR_BYTES if d_b > n_s else 0
        return (("select", n_s), ("scan", d_b * (3 * vb + 2) + gathered + k_b * (GATHER_SECTOR_BYTES + vb)))

    #: the options only the sampled threshold's adaptation reads (:func:`sampled_select`)
    ADAPTATION_OPTIONS = ("compress_upper_bound", "compress_lower_bound", "resample")

    def unused_options(self, options, *, iterations, momentum):
        """The options its other settings switch off: the sampled threshold's (sample_ratio, sampling, the adaptation
        bounds and passes, resample) with selection = "exact"; the sample's layout and adaptation with
        sample_ratio = 1 (the whole segment is the sample: nothing drawn, nothing adapted); the adaptation's bounds
        and resample with max_adaptation_iters = 0; warmup_densities with warmup_iters = 0 and warmup_iters with no
        densities; nesterov and momentum_masking with training.momentum = 0 (u = alpha_t G each step: the same
        numbers either way)."""
        opt = {k: options.get(k, o.default) for k, o in self.options.items()}
        out = {}
        if opt["selection"] == "exact":
            for k in ("sample_ratio", "sampling", "max_adaptation_iters", *self.ADAPTATION_OPTIONS):
                out[k] = "unused with selection = 'exact': used only with selection = 'sampled'"
        elif opt["sample_ratio"] >= 1.0:
            for k in ("sampling", "max_adaptation_iters", *self.ADAPTATION_OPTIONS):
                out[k] = ("unused with sample_ratio = 1 (the whole segment is the sample: nothing drawn or adapted): "
                          "used only with sample_ratio < 1")
        elif opt["max_adaptation_iters"] == 0:
            for k in self.ADAPTATION_OPTIONS:
                out[k] = "unused with max_adaptation_iters = 0: used only with max_adaptation_iters >= 1"
        if opt["warmup_iters"] == 0:
            out["warmup_densities"] = "unused with warmup_iters = 0 (no warm-up): used only with warmup_iters >= 1"
        elif not opt["warmup_densities"]:
            out["warmup_iters"] = "unused with warmup_densities empty (no warm-up stage): used only with densities"
        if momentum == 0:
            for k in ("nesterov", "momentum_masking"):
                out[k] = ("unused with training.momentum = 0 (the momentum u is alpha_t G each step: the same numbers "
                          "either way): used only with training.momentum > 0")
        return {k: why for k, why in out.items() if k in options}

    def label_tags(self, spec):
        tags = []
        if spec.opt("selection") == "exact":
            tags.append("exact")
        if spec.opt("momentum_masking") == "off":
            tags.append("nomask")
        if spec.opt("nesterov") == "on":
            tags.append("nesterov")
        return tags

    # ------------------------------------------------------------------ numerics
    def accumulate(self, spec, grad, lr, residual, ctx):
        """Clip (per segment, to clip_norm / sqrt(P)), then u = m u + lr G and v = eps + u (Nesterov:
        u = m (u + lr G), v = eps + u + lr G). Returns v (a fresh array); u is kept in ``ctx.state["dgc_u"]``."""
        c = spec.opt("clip_norm")
        if c > 0:
            thr = c / math.sqrt(ctx.P)
            bounds = spec.segment_bounds(grad.shape[0]) if spec.segments is not None else (0, grad.shape[0])
            clipped = None
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                seg = grad[lo:hi]
                coef = clip_coefficient(seg, thr)
                if coef is not None:
                    if clipped is None:
                        clipped = grad.copy()  # the reported gradient stays the unclipped one
                    clipped[lo:hi] = seg * coef
            if clipped is not None:
                grad = clipped
        with np.errstate(over="ignore", invalid="ignore"):
            g = np.multiply(grad, lr)
            u = ctx.state.get("dgc_u")
            if u is None or u.shape != g.shape or u.dtype != g.dtype:
                u = np.zeros_like(g)
            m = g.dtype.type(spec.momentum)
            if spec.opt("nesterov") == "on":
                u += g
                u *= m
                acc = residual + u
                acc += g
            else:
                u *= m
                u += g
                acc = residual + u
        ctx.state["dgc_u"] = u
        return acc

    def select(self, spec, acc, k, ctx) -> Sparse:
        """This worker's selection of the segment ``acc`` (v, float array (d_b,)) at the iteration's warm-up
        count: at most k_b(t) entries, indices ascending, exact zeros never."""
        d_b = acc.shape[0]
        k_t, ratio = warmup_k(k, d_b, ctx.iteration, spec.opt("warmup_iters"), spec.opt("warmup_densities"))
        if spec.opt("selection") == "exact":
            sel = topk(acc, k_t)
        else:
            sel = self._sampled(spec, acc, k_t, ratio, ctx)
        # the exchange (AllgatherSparse's) sends exactly sel and zeroes v there; u is masked in after_step
        ctx.scratch.setdefault("dgc_sent", []).append(sel.idx + ctx.lo)
        return sel

    def _sampled(self, spec, acc, k_t, ratio, ctx) -> Sparse:
        rng = ctx.scratch.get("dgc_rng")
        if rng is None:
            rng = ctx.scratch["dgc_rng"] = np.random.default_rng([spec.seed, ctx.rank, ctx.iteration, DGC_STREAM])
        idx, _ = sampled_select(
            acc, k_t, ratio, sample_ratio=spec.opt("sample_ratio"), strided=spec.opt("sampling") == "strided",
            rng=rng, upper=spec.opt("compress_upper_bound"), lower=spec.opt("compress_lower_bound"),
            max_iters=spec.opt("max_adaptation_iters"), resample=spec.opt("resample") == "on")
        return Sparse(idx, acc[idx], acc.shape[0])

    def after_step(self, spec, acc, residual, ctx):
        """Momentum factor masking: u zeroed at every coordinate sent this step (unless momentum_masking = off)."""
        sent = ctx.scratch.pop("dgc_sent", [])
        if spec.opt("momentum_masking") == "on" and sent:
            ctx.state["dgc_u"][np.concatenate(sent)] = 0.0
