"""Top-k and gTop-k with error feedback as DistributedDataParallel communication hooks.

Two lines add gTop-k to an existing DDP training loop::

    from sim.ddp_hooks import register_sparse_hook
    state = register_sparse_hook(ddp_model, "gtopk", density=0.01)

Each gradient bucket is compressed by the one definition of the algorithm: the hook runs
:func:`sim.algorithms.sgd_step` on the bucket (its "gradient" is the bucket's local gradient, its
parameters a zero vector) through :func:`sim.torch_backend.execute` and the point-to-point
:class:`~sim.torch_backend.TorchTransport`, so the selection, the collective (Bruck allgather for Top-k,
binomial tree or recursive doubling for gTop-k, exact or reference mask) and the residual are exactly
the simulator's. Residuals are kept per parameter (so DDP's bucket rebuild after the first iteration
does not mix them up) and the hook returns g / P, the summed sparse update divided by the world size,
as DDP expects of an averaging hook.

Step size: the error-feedback accumulator is ``eps + lr * grad`` with the hook's ``lr``. Either keep
``lr = 1`` and your optimizer's learning rate (residuals in gradient units, the usual practice), or
pass the step size as the hook's ``lr`` and use ``torch.optim.SGD(lr=1.0)`` without momentum or weight
decay: that is Algorithm 1 of Shi et al. (IJCAI 2019) exactly, and the model follows the same
trajectory as :func:`sim.torch_backend.run_worker` (tested bit-identical in float64).

Limits: the default process group only; CPU (gloo) or CUDA (NCCL) buckets; all ranks must produce
their buckets in the same order (true for the same model and graph), since each bucket's collective
runs synchronously inside the hook.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .algorithms import AlgorithmSpec, sgd_step
from .errors import ConfigError, check_range

__all__ = ["SparseHookState", "sparse_hook", "register_sparse_hook"]


@dataclass
class SparseHookState:
    """State of :func:`sparse_hook`.

    algorithm: "topk" or "gtopk". density: k / n per bucket of n elements (k = max(1, round(density n)),
    at most n); or k: a fixed k per bucket (capped at n). collective: gTop-k "tree" (default) or
    "recursive_doubling". mask: gTop-k "exact" or "reference". lr: step size folded into the
    accumulator (see the module docstring; default 1.0). timeout_s: seconds a rank may wait on a peer.
    Attributes kept across steps: ``residuals`` (dict: parameter position in the model -> float array,
    eps for that parameter), ``iteration`` (completed steps), ``busy`` (float array (3,): seconds in
    compute / compress / comm inside the hook), ``selected`` / ``applied`` (entries sent / applied).
    Raises ConfigError for an unknown algorithm, collective or mask, or a density outside (0, 1].
    """

    algorithm: str = "gtopk"
    density: float = 0.01
    k: int | None = None
    collective: str | None = None
    mask: str = "exact"
    lr: float = 1.0
    timeout_s: float = 60.0
    residuals: dict = field(default_factory=dict)
    iteration: int = 0
    busy: np.ndarray = field(default_factory=lambda: np.zeros(3))
    selected: int = 0
    applied: int = 0

    def __post_init__(self):
        if self.algorithm not in ("topk", "gtopk"):
            raise ConfigError(f"algorithm = {self.algorithm!r} is not a sparse hook: valid topk, gtopk")
        check_range("density", self.density, 0, 1, lo_open=True)
        check_range("lr", self.lr, 0, lo_open=True)
        if self.k is not None:
            check_range("k", self.k, 1)
        AlgorithmSpec(self.algorithm, k=1, collective=self.collective, mask=self.mask)  # validates names
        self._transport = None
        self._positions = None

    def k_for(self, n: int) -> int:
        """k for a bucket of n elements."""
        k = self.k if self.k is not None else max(1, round(self.density * n))
        return min(int(k), int(n))

    def transport(self, device: str):
        """The :class:`~sim.torch_backend.TorchTransport` of this rank (created on first use)."""
        if self._transport is None:
            import torch.distributed as dist

            from .torch_backend import TorchTransport

            self._transport = TorchTransport(dist.get_rank(), dist.get_world_size(), device=device,
                                             timeout_s=self.timeout_s)
        return self._transport


def sparse_hook(state: SparseHookState, bucket):
    """DDP communication hook: Top-k / gTop-k with error feedback over the shared collectives.

    bucket: a ``torch.distributed.GradBucket``; its buffer (flat, float, n elements) holds this rank's
    local gradient. Returns a completed ``torch.futures.Future`` of a tensor like the buffer holding
    g / P (same dtype and device). Raises WorkerFailure if a peer fails, NonFiniteError for NaN/Inf.
    """
    import torch
    import torch.distributed as dist

    from .torch_backend import execute

    buf = bucket.buffer()
    P, rank = dist.get_world_size(), dist.get_rank()
    device = "cpu" if buf.device.type == "cpu" else str(buf.device)
    tr = state.transport(device)
    grad = buf.detach().cpu().numpy().copy()
    n = grad.shape[0]
    params = bucket.parameters()
    keys = [id(p) for p in params]
    sizes = [p.numel() for p in params]
    eps = np.concatenate([state.residuals.get(key, np.zeros(sz, dtype=grad.dtype)) for key, sz in zip(keys, sizes)]) \
        if keys else np.zeros(n, dtype=grad.dtype)
    if eps.shape[0] != n:  # bucket layout unknown: fall back to a per-bucket residual
        keys, sizes = [("bucket", bucket.index())], [n]
        eps = state.residuals.get(keys[0], np.zeros(n, dtype=grad.dtype))
    spec = AlgorithmSpec(state.algorithm, k=state.k_for(n), collective=state.collective, mask=state.mask,
                         value_bytes=grad.dtype.itemsize, index_bytes=8)
    tr.where = f"DDP step {state.iteration + 1}, bucket {bucket.index()}"
    prog = sgd_step(spec, rank, P, np.zeros_like(grad), eps, lambda v: grad, 1, state.lr, state.iteration + 1)
    out = execute(prog, tr if P > 1 else None, state.busy)
    off = 0
    for key, sz in zip(keys, sizes):
        state.residuals[key] = out.residual[off:off + sz].copy()
        off += sz
    state.selected += out.n_selected
    state.applied += out.n_applied
    if bucket.is_last():
        state.iteration += 1
    avg = torch.from_numpy(out.update / P).to(device=buf.device, dtype=buf.dtype)
    fut = torch.futures.Future()
    fut.set_result(avg)
    return fut


def register_sparse_hook(ddp_model, algorithm: str = "gtopk", **kwargs) -> SparseHookState:
    """Register :func:`sparse_hook` on a ``DistributedDataParallel`` model; return its state.

    kwargs: the fields of :class:`SparseHookState` (density or k, collective, mask, lr, timeout_s).
    Call once, before the first backward. Raises ConfigError for bad options.
    """
    state = SparseHookState(algorithm=algorithm, **kwargs)
    ddp_model.register_comm_hook(state, sparse_hook)
    return state
