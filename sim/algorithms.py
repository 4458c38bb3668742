"""Dense, Top-k and gTop-k S-SGD: one per-worker step definition for every backend.

:func:`sgd_step` is a sans-I/O program (:mod:`sim.ops`): it computes the real numbers (gradient,
error-feedback accumulator, selection, residual, update) and yields the compute and communication
operations that a driver carries out -- the SimPy cluster (:mod:`sim.cluster`), the lock-step
reference (:mod:`sim.drivers`) or torch.distributed (:mod:`sim.torch_backend`).

Per iteration t and worker p (THEORY.md section 2; Shi et al. IJCAI 2019, Algorithm 1):

- dense S-SGD:  g = allreduce(alpha_t G_p);                                residual stays 0.
- Top-k S-SGD:  acc_p = eps_p + alpha_t G_p;  g = sum_q TopK(acc_q) (allgather);  eps_p = acc_p - TopK(acc_p).
- gTop-k S-SGD: acc_p = eps_p + alpha_t G_p;  (g, gMask_p) = gTopK(acc_1..acc_P);  eps_p = acc_p * (1 - gMask_p).
- Rand-k S-SGD: as Top-k with RandK(acc_p) (k uniformly drawn coordinates) in place of TopK(acc_p); with
  P = 1 this is Mem-SGD with rand-k (Stich et al. 2018): acc = m + eta g, send RandK(acc), m = acc - RandK(acc).

and every worker applies v_t = v_{t-1} - g / P. Mass is conserved exactly for every algorithm:
sum_p acc_p = g + sum_p eps_p (up to floating-point rounding), unless the gTop-k ``reference`` mask
rule (the released code's) is chosen, which can lose mass on purpose so the loss can be measured.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import collectives as C
from .compression import Sparse, randk, topk
from .errors import ConfigError, NonFiniteError, SparsimError, check_range
from .ops import AllReduce, Compute

__all__ = ["AlgorithmSpec", "StepOutput", "sgd_step", "ALGORITHMS", "COLLECTIVES"]

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
    Raises ConfigError for an unknown name, collective or mask, or a negative seed.
    """

    name: str
    k: int | None = None
    collective: str | None = None
    mask: str = "exact"
    value_bytes: int = 4
    index_bytes: int = 4
    seed: int = 0
    gpus_per_node: int = 1

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

    @property
    def label(self) -> str:
        """Short display name, e.g. ``gtopk``, ``gtopk[reference]`` or ``dense[backend_allreduce]``."""
        if self.name == "gtopk" and self.mask == "reference":
            return "gtopk[reference]"
        if self.name == "dense" and self.collective == "backend_allreduce":
            return "dense[backend_allreduce]"
        return self.name

    def check_dim(self, d: int) -> None:
        """Raise SparsimError unless 1 <= k <= d (sparse algorithms)."""
        if self.name != "dense":
            if isinstance(self.k, bool) or not isinstance(self.k, (int, np.integer)):
                raise SparsimError(f"k = {self.k!r} must be an integer: valid 1 <= k <= d = {d}")
            check_range("k", int(self.k), 1, d)


@dataclass(frozen=True)
class StepOutput:
    """What one worker's step produced (all float arrays have shape (d,)).

    v: parameters after the update. residual: eps_p after the step. acc: the accumulator
    eps_p + alpha_t G_p that was compressed. grad: the local stochastic gradient G_p.
    update: g, the summed update every worker applied (v_new = v - g/P). n_selected: entries this
    worker sent in its own selection (d for dense); n_applied: how many of them reached g.
    """

    v: np.ndarray
    residual: np.ndarray
    acc: np.ndarray
    grad: np.ndarray
    update: np.ndarray
    n_selected: int
    n_applied: int


def _check_finite(arr: np.ndarray, what: str, rank: int, iteration: int) -> None:
    if not np.all(np.isfinite(arr)):
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise NonFiniteError(
            f"{what} of worker {rank} at iteration {iteration} is not finite (coordinate {bad} = {arr[bad]}): "
            "valid values are finite; lower the learning rate or check the data")


def sgd_step(spec: AlgorithmSpec, rank: int, P: int, v: np.ndarray, residual: np.ndarray, grad_fn,
             batch_size: int, lr: float, iteration: int):
    """One S-SGD iteration of worker ``rank`` (a sans-I/O program; returns :class:`StepOutput`).

    v: float array (d,), the current parameters v_{t-1} (identical on all workers).
    residual: float array (d,), eps_p (zeros for dense). grad_fn: callable v -> float array (d,), this
    worker's mini-batch stochastic gradient G_p(v) (numerics; costed as ``forward_backward`` work of
    ``batch_size`` samples). lr: alpha_t > 0. iteration: t (>= 1), used in error messages and by the
    compute model's seeded jitter. Raises NonFiniteError naming worker and iteration if the gradient
    or the accumulator is NaN/Inf.
    """
    d = v.shape[0]
    with np.errstate(over="ignore", invalid="ignore"):
        grad = np.asarray(grad_fn(v), dtype=v.dtype)
    yield Compute("forward_backward", batch_size)
    _check_finite(grad, "gradient", rank, iteration)
    with np.errstate(over="ignore", invalid="ignore"):
        acc = residual + lr * grad
    _check_finite(acc, "error-feedback accumulator", rank, iteration)
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
    v_new = v - g / P
    return StepOutput(v_new, new_res, acc, grad, g, n_sel, n_app)


def _gtopk_collective(spec: AlgorithmSpec, rank: int, P: int, sel: Sparse):
    """The gTop-k collective ``spec.collective`` (tree, recursive_doubling or hierarchical) on ``sel``."""
    kw = dict(exact=spec.mask == "exact", value_bytes=spec.value_bytes, index_bytes=spec.index_bytes)
    if spec.collective == "hierarchical":
        return (yield from C.hier_gtopk(rank, P, spec.gpus_per_node, sel, spec.k, **kw))
    coll = C.gtopk_tree if spec.collective == "tree" else C.gtopk_rd
    return (yield from coll(rank, P, sel, spec.k, **kw))
