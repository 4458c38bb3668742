"""Run S-SGD algorithms on P workers and measure time and convergence, one metrics row per iteration.

:func:`run_algorithm` drives :func:`sim.algorithms.sgd_step` for every worker on either the SimPy
cluster (simulated time from the network and compute models) or the lock-step driver (numerics
only, no clock: the baseline of the event-overhead benchmark). Both produce identical numbers.

Metrics row columns (units): see :data:`METRIC_COLUMNS` and the README.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .algorithms import AlgorithmSpec, StepOutput, sgd_step
from .cluster import SimCluster
from .compute import ComputeModel
from .data import minibatch
from .drivers import run_lockstep
from .errors import check_range
from .network import NetworkSpec

__all__ = ["METRIC_COLUMNS", "Workers", "run_algorithm", "StepStats", "step_stats"]

#: Column order of metrics.csv; units in the README.
METRIC_COLUMNS = (
    "algorithm", "iteration", "lr", "sim_time_s", "iter_time_s", "compute_s", "compress_s", "comm_s",
    "loss", "grad_norm_sq", "stoch_grad_norm_sq", "residual_norm_sq", "delta", "bytes_sent",
    "applied_fraction", "mass_error", "aux_gap",
)


@dataclass(frozen=True)
class Workers:
    """The data side of P simulated workers: an objective, each worker's shard, batch size and seed.

    objective: a :class:`sim.objectives.Objective`. shards: list of P int64 arrays of sample indices.
    b: per-worker mini-batch size (samples). seed: int, seeds the mini-batch draws (worker r at
    iteration t draws with ``minibatch(shards[r], b, seed, r, t)``, independent of the driver).
    """

    objective: object
    shards: list
    b: int
    seed: int

    def grad_fn(self, rank: int, iteration: int) -> Callable[[np.ndarray], np.ndarray]:
        """Worker ``rank``'s stochastic gradient at ``iteration``: v -> mean of grad f_i over its batch."""
        idx = minibatch(self.shards[rank], self.b, self.seed, rank, iteration)
        return lambda v: self.objective.batch_grad(v, idx)


@dataclass(frozen=True)
class StepStats:
    """Global quantities of one iteration computed from all workers' outputs.

    update_norm etc. are float; delta is None for dense (Assumption 1 ratio, THEORY.md section 4).
    mass_error: max_i |sum_p acc_p - g - sum_p eps_p|_i (0 up to rounding for exact algorithms).
    """

    stoch_grad_norm_sq: float
    residual_norm_sq: float
    delta: float | None
    applied_fraction: float
    mass_error: float


def step_stats(spec: AlgorithmSpec, outs: list[StepOutput]) -> StepStats:
    """Compute :class:`StepStats` from the P workers' :class:`~sim.algorithms.StepOutput`.

    delta = ||sum_p acc_p - g||^2 / ((1 - k/d) ||sum_p acc_p||^2): <= 1 iff Assumption 1 holds this step
    (nan when sum_p acc_p = 0; None for dense or k = d).
    """
    P = len(outs)
    d = outs[0].v.shape[0]
    sum_acc = np.sum([o.acc for o in outs], axis=0)
    sum_res = np.sum([o.residual for o in outs], axis=0)
    g = outs[0].update
    G = np.sum([o.grad for o in outs], axis=0) / P
    delta = None
    if spec.name != "dense" and spec.k < d:
        num = float(np.dot(sum_acc - g, sum_acc - g))
        den = (1.0 - spec.k / d) * float(np.dot(sum_acc, sum_acc))
        delta = num / den if den > 0 else math.nan
    eps = sum_res / P
    n_sel = sum(o.n_selected for o in outs)
    return StepStats(
        stoch_grad_norm_sq=float(G @ G),
        residual_norm_sq=float(eps @ eps),
        delta=delta,
        applied_fraction=(sum(o.n_applied for o in outs) / n_sel) if n_sel else 1.0,
        mass_error=float(np.max(np.abs(sum_acc - g - sum_res))) if d else 0.0,
    )


def run_algorithm(spec: AlgorithmSpec, workers: Workers, *, T: int, lr: Callable[[int], float], x0: np.ndarray,
                  network: NetworkSpec | None = None, compute: ComputeModel | None = None, driver: str = "simpy",
                  eval_every: int = 1, on_row: Callable[[dict], None] | None = None,
                  on_step: Callable[[int, list[StepOutput]], None] | None = None) -> list[dict]:
    """Run T iterations of ``spec`` on ``len(workers.shards)`` workers; return the metrics rows.

    lr: t -> alpha_t (t = 1..T, > 0). x0: float array (d,), v_0 = x_0 on every worker.
    driver: "simpy" (needs ``network``; times from the network and compute models) or "lockstep"
    (numerics only; time columns are 0). eval_every: compute loss and grad_norm_sq of the full
    objective every this many iterations (and at the first and last); other rows leave them empty (nan).
    on_row(row) is called after each row (progress bars); on_step(t, outs) sees the raw outputs (tests).
    Row 0 holds the initial point. Raises SparsimError for bad T, k, P or eval_every, and NonFiniteError
    naming worker and iteration if a gradient becomes NaN/Inf.
    """
    P = len(workers.shards)
    check_range("P", P, 1)
    check_range("T", T, 1)
    check_range("eval_every", eval_every, 1)
    obj = workers.objective
    d = x0.shape[0]
    spec.check_dim(d)
    if driver not in ("simpy", "lockstep"):
        raise ValueError(f"driver = {driver!r}: valid simpy, lockstep")
    rows: list[dict] = []
    # the auxiliary sequence x_t = x_{t-1} - alpha_t G_t (THEORY.md section 3). v_t has applied only what
    # reached g, so v_t = x_t + eps_t: THEORY.md writes x_t - v_t = eps_t, the sign is the other way round
    # (the norm ||x_t - v_t|| = ||eps_t|| that the bounds use is the same).
    x_aux = x0.copy()

    def evaluate(t, v):
        return t == 0 or t == T or t % eval_every == 0

    def emit(row):
        rows.append(row)
        if on_row is not None:
            on_row(row)

    g0 = obj.full_grad(x0)
    emit(_row(spec, 0, math.nan, 0.0, 0.0, np.zeros(3), obj.loss(x0), float(g0 @ g0), None, 0.0, 0, 0.0))

    state = {"prev_time": 0.0, "prev_busy": np.zeros((P, 3)), "prev_bytes": np.zeros(P)}

    def finish_iteration(t, outs, now, busy, bytes_sent):
        nonlocal x_aux
        if on_step is not None:
            on_step(t, outs)
        st = step_stats(spec, outs)
        x_aux = x_aux - lr(t) * (np.sum([o.grad for o in outs], axis=0) / P)
        v = outs[0].v
        eps = np.sum([o.residual for o in outs], axis=0) / P
        aux_gap = float(np.max(np.abs((v - x_aux) - eps))) if d else 0.0  # v_t - x_t = eps_t
        if evaluate(t, v):
            with np.errstate(over="ignore", invalid="ignore"):
                gf = obj.full_grad(v)
                loss, gn = obj.loss(v), float(gf @ gf)
        else:
            loss = gn = math.nan
        dbusy = (busy - state["prev_busy"]).mean(axis=0)
        dbytes = float((bytes_sent - state["prev_bytes"]).mean())
        row = _row(spec, t, lr(t), now, now - state["prev_time"], dbusy, loss, gn, st, dbytes,
                   st.applied_fraction, aux_gap)
        state.update(prev_time=now, prev_busy=busy.copy(), prev_bytes=bytes_sent.copy())
        emit(row)

    if driver == "lockstep":
        vs = [x0.copy() for _ in range(P)]
        res = [np.zeros_like(x0) for _ in range(P)]
        for t in range(1, T + 1):
            progs = [sgd_step(spec, r, P, vs[r], res[r], workers.grad_fn(r, t), workers.b, lr(t), t) for r in range(P)]
            outs = run_lockstep(progs)
            vs = [o.v for o in outs]
            res = [o.residual for o in outs]
            finish_iteration(t, outs, 0.0, np.zeros((P, 3)), np.zeros(P))
        return rows

    cluster = SimCluster(P, network, compute)
    pending: dict[int, list] = {}
    end_time: dict[int, float] = {}

    def proc(r):
        v, res = x0.copy(), np.zeros_like(x0)
        for t in range(1, T + 1):
            prog = sgd_step(spec, r, P, v, res, workers.grad_fn(r, t), workers.b, lr(t), t)
            out = yield from cluster.execute(r, prog, t)
            v, res = out.v, out.residual
            slot = pending.setdefault(t, [None] * P)
            # per-rank snapshot at the end of ITS iteration t (other ranks may be further on)
            slot[r] = (out, cluster.busy[r].copy(), float(cluster.net.bytes_sent[r]))
            end_time[t] = max(end_time.get(t, 0.0), cluster.env.now)
            if all(o is not None for o in slot):
                snaps = pending.pop(t)
                finish_iteration(t, [s_[0] for s_ in snaps], end_time.pop(t),
                                 np.array([s_[1] for s_ in snaps]), np.array([s_[2] for s_ in snaps]))

    for r in range(P):
        cluster.env.process(proc(r))
    cluster.env.run()
    if len(rows) != T + 1:
        raise RuntimeError(f"simulation stopped after {len(rows) - 1} of {T} iterations (deadlock)")
    return rows


def _row(spec, t, lr_t, now, dt, dbusy, loss, gn, st: StepStats | None, dbytes, applied, aux_gap) -> dict:
    return {
        "algorithm": spec.label,
        "iteration": t,
        "lr": lr_t,
        "sim_time_s": now,
        "iter_time_s": dt,
        "compute_s": float(dbusy[0]),
        "compress_s": float(dbusy[1]),
        "comm_s": float(dbusy[2]),
        "loss": loss,
        "grad_norm_sq": gn,
        "stoch_grad_norm_sq": st.stoch_grad_norm_sq if st else math.nan,
        "residual_norm_sq": st.residual_norm_sq if st else 0.0,
        "delta": (st.delta if st and st.delta is not None else None),
        "bytes_sent": dbytes,
        "applied_fraction": applied if st else math.nan,
        "mass_error": st.mass_error if st else 0.0,
        "aux_gap": aux_gap,
    }
