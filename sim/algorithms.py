"""Dense, Top-k and gTop-k S-SGD: one per-worker step definition for every backend.

:func:`sgd_step` is a sans-I/O program (:mod:`sim.ops`): it computes the real numbers (gradient,
error-feedback accumulator, selection, residual, update) and yields the compute and communication
operations that a driver carries out -- the SimPy cluster (:mod:`sim.cluster`), the lock-step
reference (:mod:`sim.drivers`) or torch.distributed (:mod:`sim.torch_backend`).

Per iteration t and worker p (docs/theory.md section 2; Shi et al. IJCAI 2019, Algorithm 1):

- dense S-SGD:  g = allreduce(alpha_t G_p);                                residual stays 0.
- Top-k S-SGD:  acc_p = eps_p + alpha_t G_p;  g = sum_q TopK(acc_q) (allgather);  eps_p = acc_p - TopK(acc_p).
- gTop-k S-SGD: acc_p = eps_p + alpha_t G_p;  (g, gMask_p) = gTopK(acc_1..acc_P);  eps_p = acc_p * (1 - gMask_p).
- Rand-k S-SGD: as Top-k with RandK(acc_p) (k uniformly drawn coordinates) in place of TopK(acc_p); with
  P = 1 this is Mem-SGD with rand-k (Stich et al. 2018): acc = m + eta g, send RandK(acc), m = acc - RandK(acc).

and every worker applies v_t = v_{t-1} - g / P. Mass is conserved exactly for every algorithm:
sum_p acc_p = g + sum_p eps_p (up to floating-point rounding), unless the gTop-k ``reference`` mask
rule (the released code's) is chosen, which can lose mass on purpose so the loss can be measured.

Whole-model versus layer-wise selection. By default (``AlgorithmSpec.segments = None``) the selection
runs over the whole model vector, as the released gTop-k code does (one buffer after backward). With
``segments = (d_1, ..., d_B)`` the vector is cut into B consecutive segments (layers or buckets, in
vector order) and every sparse operator above is applied to each segment b on its own with
k_b = min(d_b, max(1, round(k / d * d_b))) (:meth:`AlgorithmSpec.segment_ks`), followed by one collective
per segment, in segment order -- what per-layer / per-bucket libraries (GRACE, Horovod compression,
DDP communication hooks) do:

- Top-k / rand-k: g[b] = sum_q TopK_{k_b}(acc_q[b]) (one allgather per segment);
  eps_p[b] = acc_p[b] - TopK_{k_b}(acc_p[b]) (RandK_{k_b} in place of TopK_{k_b} for rand-k).
- gTop-k:  (g[b], gMask_p[b]) = gTopK_{k_b}(acc_1[b], ..., acc_P[b]) (one gTop-k collective per segment);
  eps_p[b] = acc_p[b] * (1 - gMask_p[b]).

Mass is conserved on every segment, and a single segment (segments = (d,)) reproduces whole-model
selection bit for bit. Dense S-SGD is unaffected by segments (the sum is the same vector).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import collectives as C
from .compression import Sparse, randk, topk
from .errors import DIVERGENCE_LIMIT, ConfigError, NonFiniteError, SparsimError, check_range
from .ops import AllReduce, Compute

__all__ = ["AlgorithmSpec", "StepOutput", "sgd_step", "segment_k", "ALGORITHMS", "COLLECTIVES"]

#: Algorithm names and the collectives each may use (the first is the default).
COLLECTIVES = {
    "dense": ("ring", "recursive_doubling", "backend_allreduce", "hierarchical"),
    "topk": ("allgather", "hierarchical"),
    "gtopk": ("tree", "recursive_doubling", "hierarchical"),
    "randk": ("allgather", "hierarchical"),
}
ALGORITHMS = tuple(COLLECTIVES)
#: Stream tag appended to ``[seed, rank, iteration]`` for the rand-k coordinate draw ("RAND" in ASCII).
RANDK_STREAM = 0x52414E44


def segment_k(k: int, d: int, d_b: int) -> int:
    """Coordinates selected in a segment (bucket, layer) of d_b elements when the whole model of d selects k:
    ``min(d_b, max(1, round(k / d * d_b)))`` in float64 with Python's round (halves to even), and k itself when
    d_b = d. The one rule of layer-wise selection, for the numerics (:meth:`AlgorithmSpec.segment_ks`) and the
    iteration timeline (:func:`sim.timeline.bucket_k`). 1 <= result <= d_b for 1 <= d_b <= d."""
    return int(k) if d_b == d else int(min(d_b, max(1, round(k / d * d_b))))


@dataclass(frozen=True)
class AlgorithmSpec:
    """What one S-SGD variant does each step.

    name: "dense" | "topk" | "gtopk" | "randk". k: selected coordinates per worker (1 <= k <= d; ignored by dense).
    collective: one of :data:`COLLECTIVES` [name] ("ring"/"recursive_doubling" allreduce for dense,
    "allgather" for Top-k, "tree" (binomial reduce + broadcast) or "recursive_doubling" for gTop-k).
    mask: gTop-k only, "exact" (gMask_p = entries that reached g) or "reference" (the released code's
    final-support AND local-top-k rule, which can lose mass). value_bytes, index_bytes: bytes per
    transmitted value / index (default 4 + 4: fp32 values, int32 indices).
    gpus_per_node: ranks per node G (integer >= 1) for the ``"hierarchical"`` collectives
    (:func:`sim.collectives.hier_allreduce`, :func:`~sim.collectives.hier_topk_allgather_sum`,
    :func:`~sim.collectives.hier_gtopk`); it must divide P. Ignored by the flat collectives.
    seed: randk only, seeds the coordinate draw: worker p at iteration t selects with
    ``np.random.default_rng([seed, p, t, RANDK_STREAM])`` (the extra constant keeps the draw independent
    of the mini-batch draw, which uses ``[seed, p, t]``), so a run is reproducible for a given seed.
    With segments, that one generator draws the segments' coordinates one after the other in segment
    order (segment b: ``rng.choice(d_b, k_b, replace=False)``), so a single segment draws exactly what
    whole-model rand-k draws.
    segments: None (whole-model selection, the default) or the sizes (d_1, ..., d_B) in elements of
    consecutive segments of the model vector (layers or buckets) in vector order: a non-empty tuple of
    integers >= 1 that must sum to d (checked by :meth:`check_dim`, since d is not known here). Sparse
    algorithms then select and communicate per segment with k_b coordinates (:meth:`segment_ks`:
    k_b = min(d_b, max(1, round(k / d * d_b))), so the selected total sum_b k_b may differ from k by
    rounding); dense S-SGD is unaffected. Layer-wise timing is the iteration timeline's business
    (sim/timeline.py): the timing-only mode and the fast engine refuse segments with a ConfigError.
    Raises ConfigError for an unknown name, collective or mask, a negative seed, or segments that are
    not a non-empty sequence of integers >= 1.
    """

    name: str
    k: int | None = None
    collective: str | None = None
    mask: str = "exact"
    value_bytes: int = 4
    index_bytes: int = 4
    seed: int = 0
    gpus_per_node: int = 1
    segments: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.name not in COLLECTIVES:
            raise ConfigError(f"algorithm = {self.name!r} is unknown: valid algorithms are {', '.join(ALGORITHMS)}")
        if self.collective is None:
            object.__setattr__(self, "collective", COLLECTIVES[self.name][0])
        if self.collective not in COLLECTIVES[self.name]:
            raise ConfigError(
                f"collective = {self.collective!r} is not available for {self.name}: valid {', '.join(COLLECTIVES[self.name])}")
        if self.mask not in ("exact", "reference"):
            raise ConfigError(f"mask = {self.mask!r} is unknown: valid exact, reference")
        check_range("value_bytes", self.value_bytes, 1, 16)
        check_range("index_bytes", self.index_bytes, 0, 16)
        check_range("seed", self.seed, 0)
        check_range("gpus_per_node", self.gpus_per_node, 1)
        if self.name != "dense" and self.k is None:
            raise ConfigError(f"{self.name} needs k (1 <= k <= d)")
        if self.segments is not None:
            object.__setattr__(self, "segments", _check_segments(self.segments))

    @property
    def label(self) -> str:
        """Short display name, e.g. ``gtopk``, ``gtopk[reference]``, ``dense[backend_allreduce]`` or, with more than one
        segment, ``topk[layerwise]`` / ``gtopk[reference,layerwise]``."""
        tags = []
        if self.name == "gtopk" and self.mask == "reference":
            tags.append("reference")
        if self.name == "dense" and self.collective == "backend_allreduce":
            tags.append("backend_allreduce")
        if self.segments is not None and self.name != "dense" and len(self.segments) > 1:
            tags.append("layerwise")
        return f"{self.name}[{','.join(tags)}]" if tags else self.name

    def check_dim(self, d: int) -> None:
        """Raise SparsimError unless 1 <= k <= d (sparse algorithms) and, when ``segments`` is set, the
        segment sizes sum to d (the message names the sizes, their sum and the valid value)."""
        if self.name != "dense":
            if isinstance(self.k, bool) or not isinstance(self.k, (int, np.integer)):
                raise SparsimError(f"k = {self.k!r} must be an integer: valid 1 <= k <= d = {d}")
            check_range("k", int(self.k), 1, d)
        if self.segments is not None and sum(self.segments) != d:
            raise SparsimError(f"segments = {_segments_text(self.segments)} sum to {sum(self.segments)}: valid "
                               f"segment sizes (integers >= 1) that sum to d = {d}")

    def segment_bounds(self, d: int) -> np.ndarray:
        """Start offsets of the segments plus d: int64 array (B + 1,), segment b being ``[out[b], out[b + 1])``
        in vector coordinates. ``[0, d]`` (one segment) when ``segments`` is None. Raises SparsimError as
        :meth:`check_dim`."""
        self.check_dim(d)
        sizes = (d,) if self.segments is None else self.segments
        return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)

    def segment_ks(self, d: int) -> tuple[int, ...]:
        """Coordinates each worker selects per segment, (k_1, ..., k_B), for a model of d parameters.

        The rule (layer-wise selection at the whole model's density k / d, at least one per segment):
        ``k_b = min(d_b, max(1, round(k / d * d_b)))`` in float64 with Python's ``round`` (halves to even),
        and k_b = k for a segment of the whole size d_b = d -- the same expression as the iteration
        timeline's per-bucket k (``sim.timeline.bucket_k``), so the timeline's times and these numerics
        select the same counts. 1 <= k_b <= d_b. The total sum_b k_b may differ from k (rounding, and the
        minimum of one). One segment (segments None or (d,)) gives (k,). Dense: (d_1, ..., d_B), everything
        is sent (d_b = d when segments is None). Raises SparsimError as :meth:`check_dim`.
        """
        self.check_dim(d)
        sizes = (d,) if self.segments is None else self.segments
        if self.name == "dense":
            return tuple(int(n) for n in sizes)
        return tuple(segment_k(int(self.k), d, n) for n in sizes)

    def total_k(self, d: int) -> int:
        """Coordinates each worker selects per step: sum of :meth:`segment_ks` (k for whole-model
        selection, d for dense). Raises SparsimError as :meth:`check_dim`."""
        return sum(self.segment_ks(d))

    def require_whole_model(self, where: str) -> None:
        """Raise ConfigError if ``segments`` is set: ``where`` (e.g. "the fast engine") models whole-model
        selection only, and layer-wise timing is done by the iteration timeline (sim/timeline.py)."""
        if self.segments is not None:
            raise ConfigError(
                f"segments = {_segments_text(self.segments)} ({self.name}): {where} models whole-model selection "
                "only; layer-wise timing is done by the iteration timeline (sim/timeline.py): "
                "valid here segments = None")


def _segments_text(segments) -> str:
    """A short text of a segment-size tuple for error messages (long tuples abbreviated, with their length)."""
    seq = tuple(segments)
    if len(seq) <= 8:
        return repr(seq)
    return f"({', '.join(map(repr, seq[:3]))}, ..., {', '.join(map(repr, seq[-2:]))}) ({len(seq)} segments)"


def _check_segments(segments) -> tuple[int, ...]:
    """``segments`` as a tuple of Python ints; ConfigError unless a non-empty sequence of integers >= 1."""
    try:
        seq = tuple(segments)
    except TypeError:
        seq = None
    if seq is None or isinstance(segments, (str, bytes)) or not seq or any(
            isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 1 for n in seq):
        shown = _segments_text(seq) if seq and not isinstance(segments, (str, bytes)) else repr(segments)
        raise ConfigError(f"segments = {shown} is out of range: valid None or a non-empty sequence of integers "
                          ">= 1 (segment sizes summing to d)")
    return tuple(int(n) for n in seq)


@dataclass(frozen=True)
class StepOutput:
    """What one worker's step produced (all float arrays have shape (d,)).

    v: parameters after the update. residual: eps_p after the step. acc: the accumulator
    eps_p + alpha_t G_p that was compressed. grad: the local stochastic gradient G_p.
    update: g, the summed update every worker applied (v_new = v - g/P). n_selected: entries this
    worker sent in its own selection (d for dense; summed over segments with layer-wise selection);
    n_applied: how many of them reached g.
    """

    v: np.ndarray
    residual: np.ndarray
    acc: np.ndarray
    grad: np.ndarray
    update: np.ndarray
    n_selected: int
    n_applied: int


def _check_finite(arr: np.ndarray, what: str, rank: int, iteration: int, label: str = "") -> None:
    """Raise NonFiniteError unless every entry of ``arr`` is finite with |value| <= DIVERGENCE_LIMIT (1e100).

    NaN/Inf: the message names the worker, the iteration and the first bad coordinate. A finite entry beyond
    the limit: the run diverged; the message names the iteration, the algorithm ``label``, the worker, the
    coordinate and the value, and suggests a smaller step size. Only reads ``arr`` (two reductions)."""
    # as Python floats: compared with a float32 scalar the limit would be cast to float32 (inf)
    if arr.size == 0 or (-DIVERGENCE_LIMIT <= float(arr.min()) and float(arr.max()) <= DIVERGENCE_LIMIT):  # NaN fails
        return
    finite = np.isfinite(arr)
    if not finite.all():
        bad = int(np.flatnonzero(~finite)[0])
        raise NonFiniteError(
            f"{what} of worker {rank} at iteration {iteration} is not finite (coordinate {bad} = {arr[bad]}): "
            "valid values are finite; lower the learning rate or check the data")
    bad = int(np.argmax(np.abs(arr)))
    raise NonFiniteError(
        f"the run diverged at iteration {iteration}{f' of {label}' if label else ''}: the {what} of worker {rank} "
        f"is {arr[bad]:.4g} at coordinate {bad} (valid |value| <= {DIVERGENCE_LIMIT:g}, beyond which float64 "
        "squares and sums overflow); lower training.lr")


def sgd_step(spec: AlgorithmSpec, rank: int, P: int, v: np.ndarray, residual: np.ndarray, grad_fn,
             batch_size: int, lr: float, iteration: int):
    """One S-SGD iteration of worker ``rank`` (a sans-I/O program; returns :class:`StepOutput`).

    v: float array (d,), the current parameters v_{t-1} (identical on all workers).
    residual: float array (d,), eps_p (zeros for dense). grad_fn: callable v -> float array (d,), this
    worker's mini-batch stochastic gradient G_p(v) (numerics; costed as ``forward_backward`` work of
    ``batch_size`` samples). lr: alpha_t > 0. iteration: t (>= 1), used in error messages and by the
    compute model's seeded jitter. Raises NonFiniteError naming worker and iteration if the gradient
    or the accumulator is NaN/Inf, or, naming the algorithm too, if one of their entries exceeds
    :data:`sim.errors.DIVERGENCE_LIMIT` in magnitude (the run diverged: lower the step size).

    With ``spec.segments`` (sparse algorithms; see the module docstring and :func:`_layerwise`) the step
    yields, per segment in segment order, ``Compute("select", d_b)`` then that segment's collective with
    k_b; otherwise one ``select`` over d and one collective with k. Raises SparsimError if the segments
    do not sum to d.
    """
    d = v.shape[0]
    with np.errstate(over="ignore", invalid="ignore"):
        grad = np.asarray(grad_fn(v), dtype=v.dtype)
    yield Compute("forward_backward", batch_size)
    _check_finite(grad, "gradient", rank, iteration, spec.label)
    with np.errstate(over="ignore", invalid="ignore"):
        acc = np.multiply(grad, lr)  # residual + lr * grad with one array instead of two (addition commutes)
        if acc.dtype == np.result_type(acc, residual):
            acc += residual
        else:
            acc = residual + acc
    _check_finite(acc, "error-feedback accumulator", rank, iteration, spec.label)
    vb, ib = spec.value_bytes, spec.index_bytes
    if spec.name == "dense":
        if spec.collective == "ring":
            g = yield from C.ring_allreduce(rank, P, acc, vb)
        elif spec.collective == "hierarchical":
            g = yield from C.hier_allreduce(rank, P, spec.gpus_per_node, acc, vb)
        elif spec.collective == "backend_allreduce":  # torch backend only: dist.all_reduce
            g = yield AllReduce(acc, d * vb)
        else:
            g = yield from C.rd_allreduce(rank, P, acc, vb)
        new_res = np.zeros_like(acc)
        n_sel = n_app = d
    elif spec.segments is not None:
        g, new_res, n_sel, n_app = yield from _layerwise(spec, rank, P, acc, iteration)
    else:
        yield Compute("select", d)
        if spec.name == "randk":
            sel: Sparse = randk(acc, spec.k, np.random.default_rng([spec.seed, rank, iteration, RANDK_STREAM]))
        else:
            sel = topk(acc, spec.k)
        new_res = acc.copy()
        if spec.name in ("topk", "randk"):
            if spec.collective == "hierarchical":
                g = yield from C.hier_topk_allgather_sum(rank, P, spec.gpus_per_node, sel, vb, ib)
            else:
                g = yield from C.topk_allgather_sum(rank, P, sel, vb, ib)
            new_res[sel.idx] = 0.0
            n_sel = n_app = len(sel)
        else:
            res = yield from _gtopk_collective(spec, rank, P, sel)
            g = res.g.to_dense()
            # res.applied already follows the mask rule: exact (what reached g) or the released
            # reference code's (every local top-k entry whose index is in g)
            new_res[sel.idx[res.applied]] = 0.0
            n_sel, n_app = len(sel), int(res.applied.sum())
    yield Compute("update", d)
    v_new = g / P  # v - g / P with one array instead of two
    if v_new.dtype == np.result_type(v, v_new):
        np.subtract(v, v_new, out=v_new)
    else:
        v_new = v - v_new
    return StepOutput(v_new, new_res, acc, grad, g, n_sel, n_app)


def _layerwise(spec: AlgorithmSpec, rank: int, P: int, acc: np.ndarray, iteration: int):
    """Layer-wise (per-segment) selection and communication of a sparse algorithm (a sans-I/O program).

    acc: float array (d,), this worker's accumulator eps_p + alpha_t G_p. For each segment b = [lo, hi) of
    ``spec.segment_bounds(d)``, in order: ``Compute("select", d_b)``; the selection of acc[lo:hi] with
    k_b = ``spec.segment_ks(d)[b]`` (TopK, or RandK drawing ``rng.choice(d_b, k_b)`` from the one generator
    ``default_rng([seed, rank, iteration, RANDK_STREAM])`` in segment order); then one collective on that
    segment: Top-k / rand-k allgather-and-sum, gTop-k the gTop-k collective of ``spec.collective`` with k_b
    (Shi et al. IJCAI 2019, Algorithm 1, per segment; rand-k as Mem-SGD, Stich et al. 2018, per segment).
    Selections travel in segment coordinates [0, d_b), as a per-bucket library sends a bucket's own
    indices (the wire size, m (value_bytes + index_bytes), does not depend on it); they are offset by lo to
    global coordinates when g and the residual are assembled. Returns (g, residual, n_selected, n_applied):
    g float array (d,) (the segments' dense sums concatenated), residual float array (d,) = acc with the
    applied entries zeroed, and the entry counts summed over segments.
    """
    d = acc.shape[0]
    bounds = spec.segment_bounds(d)
    ks = spec.segment_ks(d)
    vb, ib = spec.value_bytes, spec.index_bytes
    rng = np.random.default_rng([spec.seed, rank, iteration, RANDK_STREAM]) if spec.name == "randk" else None
    new_res = acc.copy()
    parts = []
    n_sel = n_app = 0
    for b, k_b in enumerate(ks):
        lo, hi = int(bounds[b]), int(bounds[b + 1])
        yield Compute("select", hi - lo)
        seg = acc[lo:hi]
        sel: Sparse = randk(seg, k_b, rng) if spec.name == "randk" else topk(seg, k_b)
        if spec.name in ("topk", "randk"):
            if spec.collective == "hierarchical":
                g_b = yield from C.hier_topk_allgather_sum(rank, P, spec.gpus_per_node, sel, vb, ib)
            else:
                g_b = yield from C.topk_allgather_sum(rank, P, sel, vb, ib)
            new_res[lo + sel.idx] = 0.0
            n_sel += len(sel)
            n_app += len(sel)
        else:
            res = yield from _gtopk_collective(spec, rank, P, sel, k_b)
            g_b = res.g.to_dense()
            new_res[lo + sel.idx[res.applied]] = 0.0
            n_sel += len(sel)
            n_app += int(res.applied.sum())
        parts.append(g_b)
    return np.concatenate(parts), new_res, n_sel, n_app


def _gtopk_collective(spec: AlgorithmSpec, rank: int, P: int, sel: Sparse, k: int | None = None):
    """The gTop-k collective ``spec.collective`` (tree, recursive_doubling or hierarchical) on ``sel``,
    keeping k entries (default ``spec.k``; a segment's k_b with layer-wise selection)."""
    k = spec.k if k is None else k
    kw = dict(exact=spec.mask == "exact", value_bytes=spec.value_bytes, index_bytes=spec.index_bytes)
    if spec.collective == "hierarchical":
        return (yield from C.hier_gtopk(rank, P, spec.gpus_per_node, sel, k, **kw))
    coll = C.gtopk_tree if spec.collective == "tree" else C.gtopk_rd
    return (yield from coll(rank, P, sel, k, **kw))
