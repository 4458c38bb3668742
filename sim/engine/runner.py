"""Run S-SGD algorithms on P workers and measure time and convergence, one metrics row per iteration.

:func:`run_algorithm` drives :func:`sim.algorithms.sgd_step` for every worker on either the SimPy
cluster (simulated time from the network and compute models) or the lock-step driver (numerics
only, no clock: the baseline of the event-overhead benchmark). Both produce identical numbers. Both take
the workers' gradients of an iteration from one batched objective call (:class:`BatchedGradients`), with the
bits of the per-worker calls.

Metrics row columns (units): see :data:`METRIC_COLUMNS` and the README.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from sim.algorithms import AlgorithmSpec, StepOutput, sgd_step
from sim.engine.cluster import SimCluster
from sim.machine.compute import ComputeModel
from sim.workloads.data import minibatch
from sim.engine.drivers import run_lockstep
from sim.base.errors import DIVERGENCE_LIMIT, NonFiniteError, SparsimError, check_range
from sim.machine.network import NetworkSpec

__all__ = ["METRIC_COLUMNS", "Workers", "BatchedGradients", "run_algorithm", "StepStats", "step_stats",
           "MetricsRecorder", "CLOCK_RTOL", "ARRAYS_PER_RANK", "ARRAYS_SHARED", "EVAL_COLUMNS"]

#: The clock a run reports must resolve every iteration: the float64 spacing of the clock's value
#: (``math.ulp(sim_time_s)``) at most CLOCK_RTOL x ``iter_time_s``, so that rounding the clock moves no step of an
#: iteration by more than a millionth of it; a positive iteration whose clock did not move (every duration
#: absorbed by a clock far larger) also fails. Runs whose times stay within 10^9 of each other never come
#: near it (the clock is at most the number of iterations times the longest one).
CLOCK_RTOL = 1e-6

#: Memory of a simulated run, measured (tracemalloc, every algorithm, P = 1..32, d = 10^4..10^6): at most
#: 11.2 float64 vectors of d per simulated worker at the peak (its parameters and residual, the step's
#: gradient, accumulator, update, new parameters and residual, the collective's buffers, and the finished step
#: kept until every worker has finished that iteration) plus about 3 shared (the metrics' sums, the auxiliary
#: sequence); the estimate rounds up to these counts.
ARRAYS_PER_RANK = 12
ARRAYS_SHARED = 8

#: Bytes of mini-batch indices a :class:`Workers` keeps for the run's next algorithm (64 MiB: 4 million indices).
BATCH_MEMO_BYTES = 64 * 2**20

#: Column order of metrics.csv; units in the README.
METRIC_COLUMNS = (
    "algorithm", "iteration", "lr", "sim_time_s", "iter_time_s", "compute_s", "compress_s", "comm_s",
    "loss", "grad_norm_sq", "stoch_grad_norm_sq", "residual_norm_sq", "delta", "bytes_sent",
    "applied_fraction", "selected_per_worker", "mass_error", "aux_gap", "exposed_comm_s", "overlap_ratio",
    "train_accuracy", "test_loss", "test_accuracy", "run_id",
)

#: The columns an objective with an ``evaluate(v)`` method (a network on images, :class:`sim.workloads.nets.NetObjective`)
#: fills at each evaluation point; empty otherwise.
EVAL_COLUMNS = ("train_accuracy", "test_loss", "test_accuracy")


@dataclass(frozen=True)
class Workers:
    """The data side of P simulated workers: an objective, each worker's shard, batch size and seed.

    objective: a :class:`sim.workloads.objectives.Objective`. shards: list of P int64 arrays of sample indices.
    b: per-worker mini-batch size (samples). seed: int, seeds the mini-batch draws (worker r at
    iteration t draws with ``minibatch(shards[r], b, seed, r, t)``, independent of the driver).
    """

    objective: object
    shards: list
    b: int
    seed: int
    #: iteration -> :meth:`batch_indices`'s array, kept while they fit in :data:`BATCH_MEMO_BYTES`: a run's
    #: algorithms draw the same mini-batches one after another (the default scenario: 3 x 400 x 8 draws)
    _batch_memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def grad_fn(self, rank: int, iteration: int) -> Callable[[np.ndarray], np.ndarray]:
        """Worker ``rank``'s stochastic gradient at ``iteration``: v -> mean of grad f_i over its batch.

        The per-worker path (one objective call per worker; the torch backend's, where each process is one
        worker). The simulated drivers use :class:`BatchedGradients`, which gives the same bits."""
        idx = minibatch(self.shards[rank], self.b, self.seed, rank, iteration)
        worker_grad = getattr(self.objective, "worker_grad", None)
        if worker_grad is not None:  # an objective with per-rank state (BatchNorm statistics kept from rank 0's batch)
            return lambda v: worker_grad(v, idx, rank)
        return lambda v: self.objective.batch_grad(v, idx)

    def batch_indices(self, iteration: int) -> np.ndarray:
        """Every worker's mini-batch at ``iteration``: int64 array (P, b), row r = ``grad_fn(r, iteration)``'s.

        The draws depend only on (seed, rank, iteration) (:func:`sim.workloads.data.minibatch`), so each iteration's array
        is drawn once and kept (read-only) for the next algorithm of the run, up to :data:`BATCH_MEMO_BYTES` in
        all; beyond that the draws are made again, with the same result."""
        memo = self._batch_memo
        got = memo.get(iteration)
        if got is None:
            got = np.stack([minibatch(s, self.b, self.seed, r, iteration) for r, s in enumerate(self.shards)])
            if (len(memo) + 1) * got.nbytes <= BATCH_MEMO_BYTES:
                got.flags.writeable = False
                memo[iteration] = got
        return got

    def prefetch_batches(self, T: int) -> int:
        """Draw and keep the mini-batches of iterations 1, 2, ... T while they fit in :data:`BATCH_MEMO_BYTES`
        (what the first algorithm of a serial run leaves to the next ones); returns how many iterations are kept.
        Stops at the first iteration that no longer fits: of those it cannot keep it draws only that one."""
        for t in range(1, int(T) + 1):
            if t not in self._batch_memo:
                self.batch_indices(t)
                if t not in self._batch_memo:
                    return t - 1
        return int(T)


class BatchedGradients:
    """The P workers' stochastic gradients of an iteration computed in one objective call, for the simulated drivers.

    In synchronous S-SGD every worker starts iteration t from the same parameters v_{t-1}: each applies the same
    update g (every collective hands every rank the same bits of g) to the same v_{t-2}. So the first worker
    to ask for its gradient at iteration t (:meth:`grad_fn`, the ``grad_fn`` that :func:`sim.algorithms.sgd_step`
    calls) has all P computed at its v by ``objective.batch_grads`` (one vectorised call; row r has the bits of
    worker r's own ``batch_grad``), and each worker then takes its row. A worker whose v is not that v
    (compared exactly; it does not happen in S-SGD) gets its own ``batch_grad`` at its own v instead, so the
    numbers never depend on the batching. The sans-I/O program keeps its one definition: it still asks
    ``grad_fn(v)`` for its gradient.

    :meth:`scratch` gives the objective's scratch dict for a point (``shares_point_work`` objectives reuse work
    between the batch gradients at v_t and the metrics' full gradient at v_t; :class:`MetricsRecorder`).
    Workers whose gradients are not :class:`Workers`' own (a duck-typed object with its own ``grad_fn``) and an
    objective without ``batch_grads`` are asked once per worker (``workers.grad_fn``), as before batching.
    """

    def __init__(self, workers: Workers):
        self.workers = workers
        obj = workers.objective
        self._batched = (hasattr(obj, "batch_grads") and getattr(type(workers), "grad_fn", None) is Workers.grad_fn
                         and getattr(type(workers), "batch_indices", None) is Workers.batch_indices)
        self._shares = bool(getattr(obj, "shares_point_work", False))
        self._pending: dict[int, list] = {}  # t -> [v, G (P, d), idxs (P, b), rows not yet taken]
        self._point: tuple | None = None  # (v, scratch dict) of the latest point

    def scratch(self, v: np.ndarray) -> dict | None:
        """The objective's scratch dict for point v (None unless the objective shares work at a point): the
        latest point's dict when v is that point (the same array, or equal bits), else a fresh one."""
        if not self._shares:
            return None
        if self._point is not None and _same_point(self._point[0], v):
            return self._point[1]
        self._point = (v, {})
        return self._point[1]

    def grad_fn(self, rank: int, iteration: int) -> Callable[[np.ndarray], np.ndarray]:
        """Worker ``rank``'s stochastic gradient at ``iteration``: v -> its row of the iteration's batch."""
        if not self._batched:
            return self.workers.grad_fn(rank, iteration)
        return lambda v: self._row(rank, iteration, v)

    def _row(self, rank: int, t: int, v: np.ndarray) -> np.ndarray:
        w = self.workers
        ent = self._pending.get(t)
        if ent is None:
            idxs = w.batch_indices(t)
            ent = self._pending[t] = [v, w.objective.batch_grads(v, idxs, self.scratch(v)), idxs, len(w.shards)]
        ent[3] -= 1
        if ent[3] == 0:
            del self._pending[t]
        if _same_point(ent[0], v):
            return ent[1][rank]
        return w.objective.batch_grad(v, ent[2][rank])


def _same_point(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether a and b are the same point: the same array, or the same dtype, shape and bits."""
    return a is b or (a.dtype == b.dtype and np.array_equal(a, b))


@dataclass(frozen=True)
class StepStats:
    """Global quantities of one iteration computed from all workers' outputs.

    Norms are float; delta is None for dense (Assumption 1 ratio, docs/theory.md section 4).
    mean_grad: G_t = (1/P) sum_p G_p and mean_residual: eps_t = (1/P) sum_p eps_p, float arrays (d,).
    segment_mass_errors: float array (B,), entry b = max_{i in segment b} |sum_p acc_p - g - sum_p eps_p|_i
    over the segments of ``spec.segment_bounds(d)`` (B = 1, the whole vector, without segments).
    mass_error: their max, i.e. max_i |sum_p acc_p - g - sum_p eps_p|_i (the segments partition [0, d)), 0 up
    to rounding for exact algorithms on every segment. selected_per_worker: entries the workers sent in their
    own selections this step, averaged over the P workers (k for Top-k; what the threshold kept for
    Gaussian-k and DGC, which varies step to step; d for dense).
    """

    stoch_grad_norm_sq: float
    residual_norm_sq: float
    delta: float | None
    applied_fraction: float
    mass_error: float
    mean_grad: np.ndarray
    mean_residual: np.ndarray
    segment_mass_errors: np.ndarray | None = None
    selected_per_worker: float = math.nan


def step_stats(spec: AlgorithmSpec, outs: list[StepOutput]) -> StepStats:
    """Compute :class:`StepStats` from the P workers' :class:`~sim.algorithms.StepOutput`.

    delta = ||sum_p acc_p - g||^2 / ((1 - K/d) ||sum_p acc_p||^2): <= 1 iff Assumption 1 holds this step
    (when sum_p acc_p = 0: 0 if g = 0 too -- the assumption holds trivially -- else nan, undefined; None for
    dense or K = d). K is what each worker actually selected:
    ``spec.total_k(d)``, i.e. k for whole-model selection and sum_b k_b with layer-wise segments (the
    contraction of layer-wise selection over the whole vector at the same total budget; per segment the
    guarantee is 1 - k_b/d_b, so delta can exceed 1 when the segments' densities k_b/d_b differ by rounding).
    mass_error: max over the segments of their max |sum_p acc_p - g - sum_p eps_p| (= the max over all
    coordinates). Raises SparsimError if ``spec.segments`` does not sum to d.
    """
    P = len(outs)
    d = outs[0].v.shape[0]
    sum_acc = _sum_rows(o.acc for o in outs)
    sum_res = _sum_rows(o.residual for o in outs)
    g = outs[0].update
    G = _sum_rows(o.grad for o in outs)  # a fresh array: divided in place
    G /= P
    delta = None
    diff = None  # sum_acc - g, once
    if spec.algorithm.sparse:
        K = spec.total_k(d)
        if K < d:
            diff = sum_acc - g
            num = float(np.dot(diff, diff))
            den = (1.0 - K / d) * float(np.dot(sum_acc, sum_acc))
            # sum_p acc_p = 0: the assumption holds trivially when g = 0 too (delta 0); if g != 0 the ratio is
            # undefined (nan, an empty metrics cell) and the assumption fails this step
            delta = num / den if den > 0 else (0.0 if num == 0 else math.nan)
    n_sel = sum(o.n_selected for o in outs)
    if d:
        # one max per segment (np.maximum.reduceat over the segment starts; NaN propagates), then their max
        if diff is None:
            diff = sum_acc - g
        diff = _minus(diff, sum_res)  # sum_acc - g - sum_res
        np.abs(diff, out=diff)
        seg_err = np.maximum.reduceat(diff, spec.segment_bounds(d)[:-1])
    else:
        seg_err = np.zeros(1)
    eps = sum_res  # a fresh array: divided in place, after its last other use above
    eps /= P
    return StepStats(
        stoch_grad_norm_sq=float(G @ G),
        residual_norm_sq=float(eps @ eps),
        delta=delta,
        applied_fraction=(sum(o.n_applied for o in outs) / n_sel) if n_sel else 1.0,
        selected_per_worker=n_sel / P,
        mass_error=float(np.max(seg_err)),
        mean_grad=G,
        mean_residual=eps,
        segment_mass_errors=seg_err,
    )


def _minus(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a - b, written into ``a`` (a fresh array the caller owns) when that keeps the dtype ``a - b`` would have."""
    if a.dtype == np.result_type(a, b):
        a -= b
        return a
    return a - b


def _sum_rows(arrays) -> np.ndarray:
    """Sum of equal-shape arrays in the given order, added one after the other (the same bits as
    ``np.sum(np.stack(arrays), axis=0)``) without building the (P, d) stack."""
    it = iter(arrays)
    total = np.array(next(it), copy=True)
    for a in it:
        total += a
    return total



class MetricsRecorder:
    """Turns each iteration's worker outputs into one metrics row; shared by every driver.

    The simulated drivers (:func:`run_algorithm`) and the torch backend (:mod:`sim.distributed.backend`,
    on rank 0) feed it the P :class:`~sim.algorithms.StepOutput` of iteration t plus the clock, so the
    rows have one definition. objective: the :class:`sim.workloads.objectives.Objective` (loss_and_grad, or loss and
    full_grad). scratch: optional v -> the objective's scratch dict for point v (:meth:`BatchedGradients.scratch`),
    so that the full gradient reuses work done there for the batch gradients.
    T, lr, x0, eval_every, on_row, on_step: as in :func:`run_algorithm`. Creating it evaluates the
    objective at x0 and emits row 0. Attributes: ``rows`` (list of dicts, :data:`METRIC_COLUMNS`).

    Nothing it reports is silently wrong: NonFiniteError when the loss or ||grad f|| at x0 is not finite or
    beyond :data:`~sim.base.errors.DIVERGENCE_LIMIT` (1e100; the data or the objective's parameters are to blame),
    and when an iteration's loss, ||grad f||, ||G_t|| or ||residual|| is (the run diverged: the message names
    the iteration, the algorithm and the values, and suggests a smaller step size); SparsimError when a time
    or byte count is not finite or the clock cannot resolve an iteration (:data:`CLOCK_RTOL`).
    """

    def __init__(self, spec: AlgorithmSpec, objective, *, T: int, lr: Callable[[int], float], x0: np.ndarray,
                 eval_every: int = 1, on_row: Callable[[dict], None] | None = None,
                 on_step: Callable[[int, list[StepOutput]], None] | None = None,
                 scratch: Callable[[np.ndarray], dict | None] | None = None):
        self.spec, self.obj, self.T, self.lr, self.eval_every = spec, objective, T, lr, eval_every
        self.on_row, self.on_step = on_row, on_step
        self._scratch = scratch
        self.rows: list[dict] = []
        self.d = x0.shape[0]
        # the auxiliary sequence x_t = x_{t-1} - alpha_t G_t (docs/theory.md section 3). v_t has applied only what
        # reached g, so v_t = x_t + eps_t (docs/theory.md section 3; eq. (9) of the IJCAI paper)
        # (the norm ||x_t - v_t|| = ||eps_t|| that the bounds use is the same).
        self.x_aux = x0.copy()
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below
            loss0, g0 = self._loss_and_grad(x0)
            gn0 = float(g0 @ g0)
        if not (abs(loss0) <= DIVERGENCE_LIMIT and gn0 <= DIVERGENCE_LIMIT ** 2):
            raise NonFiniteError(
                f"at the initial point (iteration 0) of {spec.label}: loss = {loss0:.4g}, ||grad f||^2 = {gn0:.4g} "
                f"(valid: finite, |loss| and ||grad f|| <= {DIVERGENCE_LIMIT:g}); no step has been taken, so the "
                "data or the objective's parameters are out of range (check the data's magnitudes, data.lam, data.mu)")
        self._emit(self._with_eval(_row(spec, 0, math.nan, 0.0, 0.0, np.zeros(3), loss0, gn0, None, 0.0, 0.0), x0))
        self._prev_time = 0.0
        self._prev_busy = None
        self._prev_bytes = None

    def _loss_and_grad(self, v):
        """(f(v), grad f(v)): the objective's ``loss_and_grad`` (one pass for both; with the scratch of point v
        when the recorder has one), or ``loss`` and ``full_grad`` for an objective without it."""
        obj = self.obj
        if hasattr(obj, "loss_and_grad"):
            return obj.loss_and_grad(v, self._scratch(v) if self._scratch is not None else None)
        return obj.loss(v), obj.full_grad(v)

    def _with_eval(self, row: dict, v: np.ndarray) -> dict:
        """row with :data:`EVAL_COLUMNS` from ``objective.evaluate(v)`` when the objective has it (else left empty)."""
        ev = getattr(self.obj, "evaluate", None)
        if ev is not None:
            row.update(ev(v))
        return row

    def _emit(self, row):
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(row)

    def _evaluate(self, t):
        return t == 0 or t == self.T or t % self.eval_every == 0

    def finish_iteration(self, t: int, outs: list[StepOutput], now: float, busy: np.ndarray,
                         bytes_sent: np.ndarray) -> dict:
        """Record iteration t: outs (P StepOutputs, rank order), now = clock at its end (s),
        busy = cumulative seconds per rank and category, float array (P, 3), bytes_sent = cumulative
        bytes per rank, array (P,). Returns the row (also appended to ``rows``)."""
        spec, obj, lr, d = self.spec, self.obj, self.lr, self.d
        P = len(outs)
        if self._prev_busy is None:
            self._prev_busy, self._prev_bytes = np.zeros((P, 3)), np.zeros(P)
        if self.on_step is not None:
            self.on_step(t, outs)
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below as divergence
            st = step_stats(spec, outs)
        step = lr(t) * st.mean_grad
        if step.dtype == np.result_type(self.x_aux, step):  # x_aux - step, written into step
            self.x_aux = np.subtract(self.x_aux, step, out=step)
        else:
            self.x_aux = self.x_aux - step
        v = outs[0].v
        eps = st.mean_residual
        if d:  # v_t - x_t = eps_t
            gap = _minus(v - self.x_aux, eps)
            aux_gap = float(np.max(np.abs(gap, out=gap)))
        else:
            aux_gap = 0.0
        lim, lim_sq = DIVERGENCE_LIMIT, DIVERGENCE_LIMIT ** 2
        if self._evaluate(t):
            with np.errstate(over="ignore", invalid="ignore"):
                loss, gf = self._loss_and_grad(v)
                gn = float(gf @ gf)
            diverged = not (abs(loss) <= lim and gn <= lim_sq)  # NaN fails too
        else:
            loss = gn = math.nan
            diverged = False
        if diverged or not (st.residual_norm_sq <= lim_sq and st.stoch_grad_norm_sq <= lim_sq):
            raise NonFiniteError(
                f"the run diverged at iteration {t} of {spec.label}: loss = {loss:.4g}, ||grad f||^2 = {gn:.4g}, "
                f"||residual||^2 = {st.residual_norm_sq:.4g}, ||G_t||^2 = {st.stoch_grad_norm_sq:.4g} (valid: finite, "
                f"|loss| and the norms <= {lim:g}); lower training.lr")
        dbusy = (busy - self._prev_busy).mean(axis=0)
        dbytes = float((bytes_sent - self._prev_bytes).mean())
        dt = now - self._prev_time
        _check_clock(spec, t, now, dt, dbusy, dbytes)
        row = _row(spec, t, lr(t), now, dt, dbusy, loss, gn, st, dbytes, aux_gap)
        if self._evaluate(t):
            self._with_eval(row, v)
        self._prev_time, self._prev_busy, self._prev_bytes = now, busy.copy(), bytes_sent.copy()
        self._emit(row)
        return row


def _check_clock(spec: AlgorithmSpec, t: int, now: float, dt: float, dbusy: np.ndarray, dbytes: float) -> None:
    """Raise SparsimError unless iteration t's clock (now, s), its length dt (s), its time split dbusy (s) and
    bytes dbytes are finite and non-negative and the clock resolves the iteration (:data:`CLOCK_RTOL`)."""
    values = (now, dt, dbytes, *(float(x) for x in dbusy))
    if not all(math.isfinite(x) and x >= 0 for x in values):
        raise SparsimError(
            f"iteration {t} of {spec.label}: a time or byte count is not finite and non-negative (clock {now:.4g} s, "
            f"iteration {dt:.4g} s, compute / compress / comm {', '.join(f'{x:.4g}' for x in dbusy)} s, "
            f"{dbytes:.4g} bytes): valid finite values >= 0; a model duration overflowed (check compute.* and "
            "cluster.*)")
    spacing = math.ulp(now)
    if (dt == 0 and now > 0) or spacing > CLOCK_RTOL * dt > 0:
        raise SparsimError(
            f"iteration {t} of {spec.label}: the simulated clock at {now:.4g} s cannot resolve the iteration's "
            f"{dt:.4g} s (float64 spacing there {spacing:.3g} s; valid: at most {CLOCK_RTOL:g} x the iteration "
            "time): the run's durations span too many orders of magnitude for one clock; lower "
            "training.iterations or the longest durations (compute.forward_backward_s, straggler_factor, "
            "jitter_scale; cluster.bandwidth_Bps)")


def run_algorithm(spec: AlgorithmSpec, workers: Workers, *, T: int, lr: Callable[[int], float], x0: np.ndarray,
                  network: NetworkSpec | None = None, compute: ComputeModel | None = None, driver: str = "simpy",
                  eval_every: int = 1, on_row: Callable[[dict], None] | None = None,
                  on_step: Callable[[int, list[StepOutput]], None] | None = None, clock=None) -> list[dict]:
    """Run T iterations of ``spec`` on ``len(workers.shards)`` workers; return the metrics rows.

    lr: t -> alpha_t (t = 1..T, > 0). x0: float64 or float32 array (d,), v_0 = x_0 on every worker; its dtype is the
    arithmetic of parameters, accumulators and residuals (the objective's, :meth:`sim.workloads.objectives.Objective.astype`,
    for gradients too), and ``spec.value_bytes`` may not exceed its item size.
    driver: "simpy" (needs ``network``; times from the network and compute models) or "lockstep"
    (numerics only; time columns are 0). eval_every: compute loss and grad_norm_sq of the full
    objective every this many iterations (and at the first and last); other rows leave them empty (nan).
    on_row(row) is called after each row (progress bars); on_step(t, outs) sees the raw outputs (tests).
    clock: a :class:`sim.engine.timeline.TimelineClock` (a network trained on images): the numbers come from the lock-step
    driver and each iteration's time columns from the network's layer-wise timeline on the cluster (rank 0's split,
    the slowest rank's iteration time, its exposed communication and overlap ratio, as a ``[workload]`` run);
    with its time budget the run stops after the last iteration whose clock is within it (fewer than T rows).
    ``network``, ``compute`` and ``driver`` are then unused. An objective with ``reset_state()`` (BatchNorm
    statistics) is reset first, so each algorithm starts from the same state.
    Row 0 holds the initial point. Raises SparsimError for bad T, k, P, eval_every, x0 dtype or value_bytes,
    NonFiniteError naming worker and iteration if a gradient becomes NaN/Inf, naming the iteration, the algorithm
    and the value when the run diverges (:data:`sim.base.errors.DIVERGENCE_LIMIT`), and SparsimError when the clock cannot
    resolve an iteration (:class:`MetricsRecorder`) or a time quantum truncates a hop to 0
    (:class:`sim.machine.network.NetworkSpec`).

    The run uses one BLAS thread (threadpoolctl; restored afterwards): a multi-threaded BLAS splits products by
    its thread count, which changes their last bits, so the numbers would depend on the machine's cores.
    """
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1, user_api="blas"):
        return _run_algorithm(spec, workers, T=T, lr=lr, x0=x0, network=network, compute=compute, driver=driver,
                              eval_every=eval_every, on_row=on_row, on_step=on_step, clock=clock)


def _run_algorithm(spec, workers, *, T, lr, x0, network, compute, driver, eval_every, on_row, on_step, clock=None):
    """:func:`run_algorithm`'s body (under its one-thread BLAS limit)."""
    P = len(workers.shards)
    check_range("P", P, 1)
    check_range("T", T, 1)
    check_range("eval_every", eval_every, 1)
    obj = workers.objective
    d = x0.shape[0]
    spec.check_dim(d)
    if x0.dtype not in (np.float32, np.float64):
        raise SparsimError(f"x0 has dtype {x0.dtype}: valid float64 or float32 (the run's arithmetic)")
    if spec.value_bytes > x0.dtype.itemsize:
        raise SparsimError(f"value_bytes = {spec.value_bytes} with {x0.dtype} arithmetic: a value is "
                           f"{x0.dtype.itemsize} bytes on the wire: valid value_bytes <= {x0.dtype.itemsize}")
    timeline = None
    if clock is not None:
        timeline = clock(spec, T)
        T = clock.iterations_within(timeline)
        if T < 1:
            raise SparsimError(f"training.time_budget_s = {clock.time_budget_s:g} s is out of range for {spec.label}: its "
                               f"first iteration alone takes {timeline.iter_s[0]:.6g} s of simulated time: valid budget >= "
                               "that")
        driver = "lockstep"
    elif driver == "simpy":
        from sim.engine.timing import check_cluster_matches

        check_cluster_matches(spec, network)
    if driver not in ("simpy", "lockstep"):
        raise ValueError(f"driver = {driver!r}: valid simpy, lockstep")
    if hasattr(obj, "reset_state"):
        obj.reset_state()
    grads = BatchedGradients(workers)
    rec = MetricsRecorder(spec, obj, T=T, lr=lr, x0=x0, eval_every=eval_every, on_row=on_row, on_step=on_step,
                          scratch=grads.scratch)
    rows = rec.rows
    finish_iteration = rec.finish_iteration

    if driver == "lockstep":
        vs = [x0.copy() for _ in range(P)]
        res = [np.zeros_like(x0) for _ in range(P)]
        states = [{} for _ in range(P)]
        if timeline is not None:  # the clock, rank 0's split and bytes, cumulative, every rank alike
            now = np.cumsum(timeline.iter_s)
            busy = np.cumsum(np.stack([timeline.compute_s, timeline.compress_s, timeline.comm_s], axis=1), axis=0)
        for t in range(1, T + 1):
            progs = [sgd_step(spec, r, P, vs[r], res[r], grads.grad_fn(r, t), workers.b, lr(t), t, states[r])
                     for r in range(P)]
            outs = run_lockstep(progs)
            vs = [o.v for o in outs]
            res = [o.residual for o in outs]
            if timeline is None:
                finish_iteration(t, outs, 0.0, np.zeros((P, 3)), np.zeros(P))
                continue
            row = finish_iteration(t, outs, float(now[t - 1]), np.broadcast_to(busy[t - 1], (P, 3)),
                                   np.full(P, timeline.bytes_per_rank * t))
            row["exposed_comm_s"] = float(timeline.exposed_comm_s[t - 1])
            row["overlap_ratio"] = float(timeline.overlap_ratio[t - 1])
        return rows

    cluster = SimCluster(P, network, compute)
    pending: dict[int, list] = {}
    end_time: dict[int, float] = {}

    def proc(r):
        v, res, state = x0.copy(), np.zeros_like(x0), {}
        for t in range(1, T + 1):
            prog = sgd_step(spec, r, P, v, res, grads.grad_fn(r, t), workers.b, lr(t), t, state)
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


def _row(spec, t, lr_t, now, dt, dbusy, loss, gn, st: StepStats | None, dbytes, aux_gap) -> dict:
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
        "applied_fraction": st.applied_fraction if st else math.nan,
        "selected_per_worker": st.selected_per_worker if st else 0.0,
        "mass_error": st.mass_error if st else 0.0,
        "aux_gap": aux_gap,
        # this model runs compute, selection and the collective one after another: nothing is hidden
        "exposed_comm_s": max(0.0, dt - float(dbusy[0])),
        "overlap_ratio": 0.0,
        **{c: math.nan for c in EVAL_COLUMNS},
    }
