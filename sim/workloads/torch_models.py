"""Gradients from torch modules behind the simulator's worker interface.

:class:`ModuleWorkers` is a duck-typed :class:`sim.engine.runner.Workers`: its ``grad_fn(rank, t)`` maps a
flat parameter vector v (numpy, (d,)) to the mini-batch gradient of a torch module's loss, so the same
``sgd_step`` programs train a torch model in the simulator (any driver) and on the torch backend, and a
DDP model with the hooks of :mod:`sim.distributed.ddp_hooks` can be compared with both.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.workloads.data import minibatch
from sim.base.errors import SparsimError

__all__ = ["ModuleWorkers", "mlp", "flat_params", "set_flat_params"]


def mlp(d_in: int, hidden: int, classes: int, *, seed: int = 0, dtype=None):
    """A 2-layer MLP ``Linear(d_in, hidden) -> tanh -> Linear(hidden, classes)`` with seeded init.

    dtype: torch dtype of the parameters (default float64). Returns a torch.nn.Module.
    Raises SparsimError for sizes < 1.
    """
    import torch

    if min(d_in, hidden, classes) < 1:
        raise SparsimError(f"mlp sizes ({d_in}, {hidden}, {classes}) must be >= 1")
    g = torch.Generator().manual_seed(int(seed))
    dt = torch.float64 if dtype is None else dtype
    m = torch.nn.Sequential(torch.nn.Linear(d_in, hidden, dtype=dt), torch.nn.Tanh(),
                            torch.nn.Linear(hidden, classes, dtype=dt))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=dt))
    return m


def flat_params(module) -> np.ndarray:
    """The module's parameters concatenated in ``module.parameters()`` order: numpy array (d,), their dtype."""
    return np.concatenate([p.detach().cpu().numpy().ravel() for p in module.parameters()])


def set_flat_params(module, v: np.ndarray) -> None:
    """Copy the flat vector v (d,) into the module's parameters (inverse of :func:`flat_params`).
    Raises SparsimError if the length differs from the parameter count."""
    import torch

    n = sum(p.numel() for p in module.parameters())
    if v.shape != (n,):
        raise SparsimError(f"parameter vector of shape {v.shape}: the module has {n} parameters")
    off = 0
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.from_numpy(np.ascontiguousarray(v[off:off + p.numel()])).reshape(p.shape))
            off += p.numel()


class _ModuleObjective:
    """f(v) = mean loss of the module over all samples (numpy in, numpy / float out)."""

    def __init__(self, w: "ModuleWorkers"):
        self.w = w
        self.n = w.X.shape[0]
        self.d = w.d

    def loss(self, v):
        """Mean loss over all n samples at v (float)."""
        return float(self.w._loss_grad(v, np.arange(self.n), grad=False)[0])

    def full_grad(self, v):
        """Gradient of the mean loss over all samples at v: float array (d,)."""
        return self.w._loss_grad(v, np.arange(self.n))[1]

    def batch_grad(self, v, idx):
        """Gradient of the mean loss over samples idx (int array) at v: float array (d,)."""
        return self.w._loss_grad(v, np.asarray(idx))[1]


@dataclass
class ModuleWorkers:
    """P workers training a torch module on (X, y) with loss_fn, as a duck-typed :class:`sim.engine.runner.Workers`.

    module: torch.nn.Module (its parameters are only used as a template; the flat vector v of length d
    is loaded into a private copy). X: float array (n, ...), y: array (n,) (int64 class labels or
    float targets). loss_fn: callable (outputs, targets) -> scalar tensor, a *mean* over the batch
    (default: cross entropy). shards: list of P int64 index arrays; b: per-worker batch size; seed:
    mini-batch seed (the same draws as :class:`sim.engine.runner.Workers`). Attributes: ``objective`` (loss,
    full_grad, batch_grad over all n samples), ``d``.
    """

    module: object
    X: np.ndarray
    y: np.ndarray
    shards: list
    b: int
    seed: int = 0
    loss_fn: object = None

    def __post_init__(self):
        import copy

        import torch

        self._m = copy.deepcopy(self.module)
        self._dtype = next(self._m.parameters()).dtype
        self._X = torch.as_tensor(np.asarray(self.X)).to(self._dtype)
        self._y = torch.as_tensor(np.asarray(self.y))
        if self.loss_fn is None:
            self.loss_fn = torch.nn.functional.cross_entropy
        self.d = sum(p.numel() for p in self._m.parameters())
        self.objective = _ModuleObjective(self)

    def _loss_grad(self, v, idx, grad=True):
        import torch

        set_flat_params(self._m, np.asarray(v))
        self._m.zero_grad(set_to_none=True)
        ii = torch.as_tensor(idx, dtype=torch.int64)
        loss = self.loss_fn(self._m(self._X[ii]), self._y[ii])
        if not grad:
            return loss.item(), None
        loss.backward()
        g = np.concatenate([p.grad.detach().cpu().numpy().ravel() for p in self._m.parameters()])
        return loss.item(), g

    def batch_indices(self, rank: int, iteration: int) -> np.ndarray:
        """Sample indices of worker ``rank``'s mini-batch at ``iteration`` (int64 array (b,))."""
        return minibatch(self.shards[rank], self.b, self.seed, rank, iteration)

    def grad_fn(self, rank: int, iteration: int):
        """Worker ``rank``'s stochastic gradient at ``iteration``: v (d,) -> float array (d,)."""
        idx = self.batch_indices(rank, iteration)
        return lambda v: self._loss_grad(v, idx)[1]
