"""Timing-only mode: simulated S-SGD iteration times from message sizes, without the data.

At d = 61M parameters and P = 128 workers the real numerics (P dense float arrays of d values, P
accumulators, P dense sums) do not fit in memory, yet the simulated time of an iteration depends only
on the sizes of the messages and on the compute work. Each algorithm states its exchange once in timing-only
sizes, for every rank at once (:meth:`sim.algorithms.Algorithm.fast_rounds`: Work and Round data, usually a
collective of :mod:`sim.comm.rounds`): dense messages of every value, sparse selections of exactly k entries,
every gTop-k merge keeping k, Top-k's ``reduce`` of the P k received entries without its dense sum.

- the fast engine (:func:`simulate_timing_fast`, :mod:`sim.engine.fastsim`) interprets that data a round at a
  time over all ranks;
- the message-level engine (:func:`simulate_timing` with ``engine = "message"``, :mod:`sim.engine.cluster`) runs
  each rank's part of it (:func:`rank_program`) as a per-rank program: every message an event.

:func:`timing_program` mirrors :func:`sim.algorithms.sgd_step` operation for operation
(``forward_backward``, ``select`` for sparse algorithms, the collective, ``update``);
``tests/test_timing.py`` checks that its simulated time equals the real ``sgd_step``'s (whose per-rank
collectives carry the data, :mod:`sim.comm.collectives`) at small d, and that its collective time equals the
closed forms of :mod:`sim.comm.costs`; ``tests/test_fastsim.py`` holds the two engines together at 1e-9.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.algorithms import AlgorithmSpec
from sim.engine.cluster import SimCluster
from sim.engine.fastsim import FastCluster, fast_iteration
from sim.machine.compute import ComputeModel
from sim.base.errors import ConfigError, check_range
from sim.base.ops import Compute, Recv, Send, SendRecv
from sim.comm.rounds import Round

__all__ = ["timing_program", "rank_program", "simulate_timing_fast", "TimingResult",
           "simulate_timing", "closed_form_comm_s", "ENGINES", "resolve_engine", "check_cluster_matches"]


def rank_program(ops, rank: int):
    """Rank ``rank``'s part of a vectorised program (:mod:`sim.comm.rounds`) as a per-rank sans-I/O program
    (:mod:`sim.base.ops`): the timing-only form of every collective, derived from its one all-ranks definition.

    ops: a sequence of :class:`~sim.comm.rounds.Work` and :class:`~sim.comm.rounds.Round`. A Work becomes
    ``Compute(kind, work[rank])`` (nothing where that is 0: zero work costs 0 s in every compute model); a Round
    becomes ``SendRecv`` when the rank both sends and receives, ``Send`` or ``Recv`` when it does one, nothing
    when neither. Payloads are None: only sizes (``nbytes[rank]`` bytes) count. Returns None."""
    for op in ops:
        if isinstance(op, Round):
            dst = int(op.dst[rank])
            src = int(op.src[rank])
            if dst >= 0:
                nb = int(op.nbytes if np.ndim(op.nbytes) == 0 else op.nbytes[rank])
                if src >= 0:
                    yield SendRecv(dst, None, nb, src)
                else:
                    yield Send(dst, None, nb)
            elif src >= 0:
                yield Recv(src)
        else:
            w = op.work if np.ndim(op.work) == 0 else op.work[rank]
            if w:
                yield Compute(op.kind, w.item() if isinstance(w, np.generic) else w)


def timing_program(spec: AlgorithmSpec, rank: int, P: int, d: int, batch_size: int, ops):
    """One S-SGD iteration of worker ``rank`` in timing-only mode (a sans-I/O program, :mod:`sim.base.ops`).

    Yields the operations of :func:`sim.algorithms.sgd_step` in the same order: ``forward_backward``
    (``batch_size`` samples), the exchange -- rank ``rank``'s part (:func:`rank_program`) of ``ops``, the
    algorithm's vectorised exchange ``list(spec.algorithm.fast_rounds(spec, P, d, iteration, G))`` (selection
    Work, then the collective's rounds) -- then ``update`` of d parameters. Returns None (only the time counts).
    Raises ConfigError (on its first step) if ``spec.segments`` is set: layer-wise timing is done by the
    iteration timeline (sim/engine/timeline.py), not here.
    """
    spec.require_whole_model("the timing-only mode (sim.engine.timing)")
    yield Compute("forward_backward", batch_size)
    yield from rank_program(ops, rank)
    yield Compute("update", d)


@dataclass(frozen=True)
class TimingResult:
    """Simulated times of one configuration, seconds per iteration.

    iter_s: synchronous iteration time (start to the last rank's finish), float array (iterations,).
    compute_s, compress_s, comm_s: per-iteration seconds on rank 0 in the cluster's three categories
    (``comm`` is time blocked in messages, which on rank 0 -- the root of the gTop-k tree and a ring
    member -- equals the critical-path communication). messages, bytes: totals over all ranks per iteration.
    """

    iter_s: np.ndarray
    compute_s: float
    compress_s: float
    comm_s: float
    messages: int
    bytes: int


#: Valid values of the ``engine`` argument / scenario key ``cluster.engine``.
ENGINES = ("auto", "message", "fast")


def resolve_engine(engine: str, network) -> str:
    """The engine a timing-only simulation uses: ``"message"`` (SimPy, :mod:`sim.engine.cluster`) or ``"fast"``
    (:mod:`sim.engine.fastsim`). ``"auto"`` picks the fast engine unless it refuses the network
    (:func:`sim.engine.fastsim.fast_engine_refusal`: ``quantum_s > 0``, or zero latency on shared links). Raises
    ConfigError for an unknown engine, or ``"fast"`` on a network the fast engine refuses."""
    if engine not in ENGINES:
        raise ConfigError(f"engine = {engine!r} is unknown: valid engines are {', '.join(ENGINES)}")
    from sim.engine.fastsim import fast_engine_refusal

    why = fast_engine_refusal(network)
    if engine == "auto":
        return "message" if why else "fast"
    if engine == "fast" and why:
        raise ConfigError(f"engine = fast: {why}")
    return engine


def check_cluster_matches(spec: AlgorithmSpec, network) -> None:
    """Raise ConfigError when a hierarchical collective's ``spec.gpus_per_node`` is not the cluster's (or the
    network is flat): the collective's node groups must be the cluster's nodes."""
    from sim.machine.topology import ClusterSpec

    if spec.collective != "hierarchical":
        return
    if not isinstance(network, ClusterSpec):
        raise ConfigError(f"collective = hierarchical ({spec.name}) needs a hierarchical cluster (a ClusterSpec: "
                          "cluster.network = a cluster preset or hierarchical), not a flat network")
    if spec.gpus_per_node != network.gpus_per_node:
        raise ConfigError(f"gpus_per_node = {spec.gpus_per_node} of the {spec.name} hierarchical collective differs "
                          f"from the cluster's {network.gpus_per_node}: valid {network.gpus_per_node}")


def simulate_timing(spec: AlgorithmSpec, P: int, d: int, *, network, compute: ComputeModel | None = None,
                    batch_size: int = 1, iterations: int = 1, seed: int = 0, engine: str = "message") -> TimingResult:
    """Simulate ``iterations`` timing-only iterations of ``spec`` on P ranks with d parameters.

    network: a :class:`~sim.machine.network.NetworkSpec` or a :class:`~sim.machine.topology.ClusterSpec` with P ranks.
    engine: ``"message"`` (every message an event on the SimPy network; the reference), ``"fast"``
    (:func:`sim.engine.timing.simulate_timing_fast`, a vectorised round at a time: thousands of ranks in about a
    second, same times to 1e-9 on contention-free links) or ``"auto"`` (:func:`resolve_engine`).
    Each iteration starts with all ranks together (synchronous S-SGD). Memory: O(P k) for sparse
    algorithms, O(1) per rank for dense, whatever d (fast engine: O(P)). Message-level cost: dense ring
    makes 2P(P-1) messages per iteration (about 2 s of wall time at P = 128). Raises SparsimError for
    P < 1, d < 1, k out of [1, d], iterations < 1, or an unknown engine, and ConfigError if ``spec.segments``
    is set (layer-wise timing is done by the iteration timeline, sim/engine/timeline.py).
    """
    spec.require_whole_model("the timing-only mode (sim.engine.timing)")
    check_range("P", P, 1)
    check_range("d", d, 1)
    check_range("iterations", iterations, 1)
    spec.check_dim(d)
    check_cluster_matches(spec, network)
    if resolve_engine(engine, network) == "fast":

        return simulate_timing_fast(spec, P, d, network=network, compute=compute, batch_size=batch_size,
                                    iterations=iterations)
    cl = SimCluster(P, network, compute)
    times = []
    for it in range(iterations):
        t0 = cl.env.now
        # the exchange's one definition (the algorithm's vectorised rounds), each rank running its part
        ops = list(spec.algorithm.fast_rounds(spec, P, d, it + 1, spec.gpus_per_node))
        _, finish = cl.run_programs([timing_program(spec, r, P, d, batch_size, ops) for r in range(P)],
                                    iteration=it + 1)
        times.append(float(finish.max()) - t0)
    b0 = cl.busy[0] / iterations
    return TimingResult(np.asarray(times), float(b0[0]), float(b0[1]), float(b0[2]),
                        int(cl.net.messages_sent.sum()) // iterations, int(cl.net.bytes_sent.sum()) // iterations)


def closed_form_comm_s(spec: AlgorithmSpec, P: int, d: int, alpha: float, beta: float, cluster=None) -> float:
    """The :mod:`sim.comm.costs` closed form (s) of ``spec``'s collective on P ranks (alpha s, beta s/byte).

    For the ``"hierarchical"`` collectives pass ``cluster`` (a :class:`~sim.machine.topology.ClusterSpec`): its intra-
    and inter-node alpha and beta are used (alpha and beta are then ignored), and for the dense allreduce the
    GPUs sharing a NIC (:func:`sim.comm.costs.hier_allreduce_time`'s nic_share: an upper bound when > 1); without
    one, the hierarchy is ``spec.gpus_per_node`` ranks per node with alpha and beta everywhere. Raises ConfigError
    if ``spec.segments`` is set (whole-model closed forms only)."""
    spec.require_whole_model("the closed forms (sim.engine.timing.closed_form_comm_s)")
    return spec.algorithm.closed_form_s(spec, P, d, alpha, beta, cluster)


def simulate_timing_fast(spec: AlgorithmSpec, P: int, d: int, *, network, compute: ComputeModel | None = None,
                         batch_size: int = 1, iterations: int = 1):
    """:func:`sim.engine.timing.simulate_timing` on the fast engine; returns a :class:`sim.engine.timing.TimingResult`.

    Every iteration starts with all ranks together (synchronous S-SGD). Memory O(P) (a step replayed event by
    event: O(its messages)). Raises SparsimError / ConfigError for bad P, d, k or iterations, or a network the
    fast engine does not model (:func:`fast_engine_refusal`), and ConfigError if ``spec.segments`` is set
    (layer-wise timing is done by the iteration timeline, sim/engine/timeline.py)."""
    spec.require_whole_model("the fast engine (sim.engine.fastsim)")

    check_range("P", P, 1)
    check_range("d", d, 1)
    check_range("iterations", iterations, 1)
    spec.check_dim(d)
    eng = FastCluster(P, network, compute)
    G = spec.gpus_per_node  # as sgd_step and timing_program take it (sim.engine.timing checks it against the cluster)
    times = []
    for it in range(iterations):
        t0 = eng.barrier()
        eng.step(lambda e: fast_iteration(e, spec, d, batch_size, it + 1, G))
        times.append(float(eng.ready.max()) - t0)
    b0 = eng.busy[0] / iterations
    return TimingResult(np.asarray(times), float(b0[0]), float(b0[1]), float(b0[2]),
                        eng.messages // iterations, eng.bytes // iterations)
