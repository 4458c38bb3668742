"""Trace replay: the simulator's prediction of a real run's communication time, from its measured local time.

The torch backend (:func:`sim.distributed.backend.run_worker` with ``record_trace=True``) records, per rank and
iteration, a :class:`StepTrace`: when the step started (this machine's monotonic clock) and how long
the local Python code ran before each operation the S-SGD program yielded (gradient, top-k selection,
merges, reductions, the update; see :func:`sim.distributed.backend.execute`). :func:`replay` re-runs the same
programs on a :class:`~sim.engine.cluster.SimCluster` in which each rank spends exactly that measured local
time, starts at its measured offset, and only the messages go through the network model (alpha-beta,
for instance from ``sparsim calibrate``). So a rank that waits for a slower peer waits in the
replay too, and the difference between predicted and measured communication time is the network
model's error alone (transfer, codec, and what the OS scheduler adds), not a compute model's.

Iterations are separated as on the torch backend: all ranks meet between iterations (an untimed
barrier there), so iteration t starts in the replay when every rank has finished t - 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.algorithms import AlgorithmSpec, sgd_step
from sim.engine.cluster import SimCluster
from sim.base.errors import SparsimError
from sim.machine.network import NetworkSpec

__all__ = ["StepTrace", "ReplayResult", "replay"]


@dataclass(frozen=True)
class StepTrace:
    """One rank's measured step.

    start_s: step start on the measuring machine's monotonic clock (``time.perf_counter``, s; only
    differences between ranks of one machine are used). segments: ``(category, seconds, signature)``
    per yielded operation plus one for the end (category 0/1/2 = compute/compress/comm; signature:
    :func:`sim.base.ops.signature` of the operation, ``("end",)`` for the end). busy_s: the
    step's measured (compute, compress, comm) seconds, comm including the time blocked in messages.
    wall_s: the step's wall seconds (perf_counter from start_s to the step's end; the busy segments lie inside
    it, so sum(busy_s) <= wall_s), or None where not measured.
    """

    start_s: float
    segments: tuple
    busy_s: tuple
    wall_s: float | None = None


@dataclass
class ReplayResult:
    """Measured next to predicted, per iteration t = 1..T (row t - 1) and rank.

    measured_busy_s, predicted_busy_s: float arrays (T, P, 3), seconds in compute / compress / comm
    (compute and compress agree by construction; comm is the prediction). measured_span_s,
    predicted_span_s: float arrays (T,), first start to last finish of each iteration (s).
    """

    measured_busy_s: np.ndarray
    predicted_busy_s: np.ndarray
    measured_span_s: np.ndarray
    predicted_span_s: np.ndarray

    @property
    def measured_comm_s(self) -> np.ndarray:
        """float array (T,): communication seconds per iteration, mean over ranks, measured."""
        return self.measured_busy_s[:, :, 2].mean(axis=1)

    @property
    def predicted_comm_s(self) -> np.ndarray:
        """float array (T,): communication seconds per iteration, mean over ranks, predicted."""
        return self.predicted_busy_s[:, :, 2].mean(axis=1)


def replay(spec: AlgorithmSpec, workers, *, x0: np.ndarray, lr, network: NetworkSpec,
           traces: list[list[StepTrace]]) -> ReplayResult:
    """Replay a measured run of ``spec`` on the simulator and predict its communication time.

    workers, x0, lr: exactly those of the measured run (:class:`sim.engine.runner.Workers`, float array (d,),
    t -> alpha_t), so that every rank yields the same operations (the float64 trajectories of the two
    backends are bit-identical). network: the model to test. traces: ``traces[r][t - 1]`` is rank r's
    :class:`StepTrace` of iteration t, P ranks, T iterations each.
    Returns a :class:`ReplayResult`. Raises SparsimError for ragged traces or a trace that does not
    match the program: other operations (kind, peer or message size, :func:`sim.base.ops.signature`), as
    another algorithm, k or P gives. Other data or seeds with the same operations replay without
    error, and rightly so: the messages, all the replay models, are then the same.
    Start times are compared between ranks, so the traces must come from ranks of one machine
    (one monotonic clock).
    """
    P = len(traces)
    if P < 1 or len({len(tr) for tr in traces}) != 1 or len(traces[0]) < 1:
        raise SparsimError(f"traces must hold the same number (>= 1) of iterations for each of P >= 1 ranks, "
                           f"got lengths {[len(tr) for tr in traces]}")
    if len(workers.shards) != P:
        raise SparsimError(f"traces are for P = {P} ranks but workers has {len(workers.shards)} shards")
    T = len(traces[0])
    cluster = SimCluster(P, network)
    vs = [x0.copy() for _ in range(P)]
    res = [np.zeros_like(x0) for _ in range(P)]
    meas = np.array([[tr.busy_s for tr in traces[r]] for r in range(P)], dtype=np.float64).transpose(1, 0, 2)
    pred = np.zeros((T, P, 3))
    mspan, pspan = np.zeros(T), np.zeros(T)
    for t in range(1, T + 1):
        steps = [traces[r][t - 1] for r in range(P)]
        starts = np.array([s.start_s for s in steps])
        offsets = starts - starts.min()
        mspan[t - 1] = max(o + sum(s.busy_s) for o, s in zip(offsets, steps))
        t0, before = cluster.env.now, cluster.busy.copy()
        progs = [sgd_step(spec, r, P, vs[r], res[r], workers.grad_fn(r, t), workers.b, lr(t), t) for r in range(P)]
        outs, finish = cluster.run_programs(progs, t, offsets=offsets, replays=[s.segments for s in steps])
        pred[t - 1] = cluster.busy - before
        pspan[t - 1] = finish.max() - t0
        vs = [o.v for o in outs]
        res = [o.residual for o in outs]
    return ReplayResult(meas, pred, mspan, pspan)
