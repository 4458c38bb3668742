"""The simulated cluster: drives per-rank sans-I/O programs on a SimPy clock.

Numerics and time are separate: the programs (collectives, S-SGD steps) compute the real numbers;
this driver only advances the simulated clock, through the network model (:mod:`sim.machine.network`) for
messages and the compute model (:mod:`sim.machine.compute`) for :class:`~sim.base.ops.Compute` operations.

Message semantics are rendezvous (:mod:`sim.base.ops`): a transfer starts when the sender's Send and
the receiver's Recv for that ordered pair are both posted, and both sides complete when the last
byte has arrived. Per rank the driver accounts seconds in three categories:
``compute`` (forward_backward, update), ``compress`` (select, merge) and ``comm`` (time blocked in
Send/Recv/SendRecv, plus dense reduction compute).

Events: on a network whose links rendezvous traffic never shares (flat star and direct,
:attr:`sim.machine.network.Network.rendezvous_uncontended`) a message costs one SimPy event: when both sides
have posted, its arrival time is computed at once with the same float operations the hop-by-hop
model performs (:meth:`sim.machine.network.Network.uncontended_arrival`), and one event, scheduled at that
instant, completes both the Send and the Recv. Elsewhere (rings, hierarchical clusters) every message
runs as its own process through :meth:`sim.machine.network.Network.transfer`, hop by hop; ``fast=False``
forces that everywhere (the reference the fast path is tested against: same clock, same counters,
same busy seconds, bit for bit). A Compute operation whose duration is 0 costs no event.
"""
from __future__ import annotations

import math
from collections import deque
from heapq import heappush

import numpy as np
import simpy
from simpy.events import NORMAL, Event

from sim.machine.compute import ComputeModel
from sim.base.errors import SparsimError, check_range
from sim.machine.network import Network
from sim.base.ops import AllReduce, Compute, Recv, Send, SendRecv, signature

__all__ = ["SimCluster", "CATEGORY_OF_KIND"]

#: Which timeline category each compute kind is accounted to (0 compute, 1 compress, 2 comm: the
#: columns of ``SimCluster.busy``). The compression kinds (:data:`sim.base.ops.COMPRESSION_KINDS`: a selection, a
#: compressor's memory passes, its matrix products) and gTop-k's merges are compression; a reduction is part of its
#: collective.
CATEGORY_OF_KIND = {
    "forward_backward": 0,
    "update": 0,
    "select": 1,
    "merge": 1,
    "scan": 1,
    "matmul": 1,
    "reduce": 2,
}


#: The message operations, by exact type (subclasses take the isinstance checks).
_MESSAGE_OPS = (Send, Recv, SendRecv)


class SimCluster:
    """P simulated ranks on one SimPy environment, a network and a compute model.

    P: int >= 1. network: a :class:`~sim.machine.network.NetworkSpec` (flat) or a :class:`~sim.machine.topology.ClusterSpec`
    with P ranks (hierarchical). compute: a
    :class:`~sim.machine.compute.ComputeModel` (default: all compute costs zero). fast: False runs every message
    hop by hop as its own SimPy process also where one event per message gives the same times (module
    docstring) and asks the compute model for every duration; the results are the same either way.
    Attributes: ``env`` (simpy.Environment, time in seconds), ``net`` (:class:`~sim.machine.network.Network`),
    ``busy`` (float array (P, 3): seconds per rank in compute / compress / comm, cumulative).
    Raises SparsimError for P < 1.
    """

    def __init__(self, P: int, network, compute: ComputeModel | None = None, *, fast: bool = True):
        check_range("P", P, 1)
        self.P = int(P)
        self.env = simpy.Environment()
        self.net = Network(self.env, self.P, network)
        self.compute = compute if compute is not None else ComputeModel(forward_backward_s=0.0, select_coeff_s=0.0)
        self._sends: dict[tuple[int, int], deque] = {}
        self._recvs: dict[tuple[int, int], deque] = {}
        self.busy = np.zeros((self.P, 3))
        # one event per message where that is exact (and SimPy's event queue is the heap this code knows)
        self._one_event = bool(fast and self.net.rendezvous_uncontended
                               and isinstance(getattr(self.env, "_queue", None), list) and hasattr(self.env, "_eid"))
        # the stock compute model's durations depend only on (kind, work), and forward_backward's on rank and
        # iteration only through jitter and stragglers: remembered per (kind, work) once computed (and validated)
        cm = self.compute
        self._sec_memo: dict | None = {} if fast and type(cm) is ComputeModel else None
        self._fb_fixed = type(cm) is ComputeModel and cm.jitter == "none" and cm.straggler_prob == 0.0

    # -- rendezvous matching ------------------------------------------------------------------
    def _start(self, src, dst, payload, nbytes, send_ev, recv_ev):
        env = self.env
        if self._one_event:  # send_ev is recv_ev: one event at the arrival instant completes both sides
            t = self.net.uncontended_arrival(src, dst, nbytes, env._now)
            recv_ev._ok, recv_ev._value = True, payload
            heappush(env._queue, (t, NORMAL, next(env._eid), recv_ev))  # at t exactly (schedule() adds a delay)
            return

        def xfer():
            yield self.net.transfer(src, dst, nbytes)
            send_ev.succeed()
            recv_ev.succeed(payload)

        env.process(xfer())

    def _post_send(self, src, dst, payload, nbytes):
        """Post rank src's Send to dst; returns the event that fires when the message has arrived."""
        q = self._recvs.get((src, dst))
        if self._one_event:
            if q:
                ev = q.popleft()
                self._start(src, dst, payload, nbytes, ev, ev)
                return ev
            ev = Event(self.env)
        else:
            ev = self.env.event()
            if q:
                self._start(src, dst, payload, nbytes, ev, q.popleft())
                return ev
        self._sends.setdefault((src, dst), deque()).append((payload, nbytes, ev))
        return ev

    def _post_recv(self, src, dst):
        """Post rank dst's Recv from src; returns the event that fires (value: the payload) when it has arrived."""
        q = self._sends.get((src, dst))
        if q:
            payload, nbytes, send_ev = q.popleft()
            if self._one_event:
                self._start(src, dst, payload, nbytes, send_ev, send_ev)
                return send_ev
            ev = self.env.event()
            self._start(src, dst, payload, nbytes, send_ev, ev)
            return ev
        ev = Event(self.env)
        self._recvs.setdefault((src, dst), deque()).append(ev)
        return ev

    # -- program execution ----------------------------------------------------------------------
    def execute(self, rank: int, program, iteration: int = 0, replay=None):
        """SimPy process body: run one program for ``rank``; use as ``yield from cluster.execute(...)``.

        Returns the program's return value. Compute operations cost
        ``compute.seconds(kind, work, rank, iteration)`` seconds of simulated time.

        replay: optional sequence of ``(category, seconds, signature)``, one per operation the program
        yields plus one for the end, as :func:`sim.distributed.backend.execute` measures them (``segments=``).
        Before each operation the rank then spends the measured local time (accounted to that
        category) and Compute operations cost nothing more: only messages are modelled.
        Raises SparsimError when the program yields more or fewer operations than the replay holds,
        or another operation (:func:`sim.base.ops.signature`: kind, peer, size) than the one recorded.
        """
        env = self.env
        busy = self.busy[rank]
        one_event = self._one_event
        cm = self.compute
        memo = self._sec_memo if (type(iteration) is int and iteration >= 0 and type(rank) is int
                                   and 0 <= rank < self.P) else None
        fb_fixed = self._fb_fixed
        value = None
        n_op = 0
        while True:
            try:
                op = program.send(value)
            except StopIteration as stop:
                if replay is not None:
                    yield from self._replay_segment(rank, replay, n_op, None)
                return stop.value
            value = None
            cls = type(op)
            if replay is not None:
                yield from self._replay_segment(rank, replay, n_op, op)
                n_op += 1
                if cls is Compute or isinstance(op, Compute):
                    continue
            if cls is Compute or (cls not in _MESSAGE_OPS and isinstance(op, Compute)):
                kind, work = op.kind, op.work
                sec = None
                if memo is not None and (type(work) is float or type(work) is int):
                    key = (kind, work)
                    sec = memo.get(key)
                    if sec is None:
                        sec = cm.seconds(kind, work, rank, iteration)
                        if fb_fixed or kind != "forward_backward":
                            memo[key] = sec
                if sec is None:
                    sec = cm.seconds(kind, work, rank, iteration)
                if sec > 0:
                    yield env.timeout(sec)
                busy[CATEGORY_OF_KIND[kind]] += sec
                continue
            t0 = env.now
            if cls is SendRecv or (cls not in _MESSAGE_OPS and isinstance(op, SendRecv)):
                s_ev = self._post_send(rank, op.dst, op.payload, op.nbytes)
                r_ev = self._post_recv(op.src, rank)
                if one_event:  # both events fire at their arrival; yielding a fired one continues at once
                    yield s_ev
                    value = yield r_ev
                else:
                    yield s_ev & r_ev
                    value = r_ev.value
            elif cls is Send or (cls not in _MESSAGE_OPS and isinstance(op, Send)):
                yield self._post_send(rank, op.dst, op.payload, op.nbytes)
            elif cls is Recv or (cls not in _MESSAGE_OPS and isinstance(op, Recv)):
                value = yield self._post_recv(op.src, rank)
            elif isinstance(op, AllReduce):
                raise SparsimError("collective backend_allreduce runs only on the torch backend: valid here ring, recursive_doubling")
            else:
                raise TypeError(f"rank {rank} yielded {op!r}, not a sim.base.ops operation")
            busy[2] += env.now - t0

    def _replay_segment(self, rank, replay, i, op):
        if i >= len(replay) or (op is None and i != len(replay) - 1):
            raise SparsimError(f"replay of rank {rank} holds {len(replay)} segments but the program yields "
                               f"{'more' if i >= len(replay) else 'fewer'} operations: not the same step")
        seg = replay[i]
        if len(seg) != 3:
            raise SparsimError(f"replay of rank {rank}: segment {i} is {seg!r}: valid (category, seconds, "
                               "signature) as sim.distributed.backend.execute records it")
        cat, sec, sig = seg
        if cat not in (0, 1, 2) or isinstance(cat, bool) or not (isinstance(sec, (int, float)) and 0 <= sec < math.inf):
            raise SparsimError(f"replay of rank {rank}: segment {i} has category {cat!r} and seconds {sec!r}: "
                               "valid category 0, 1 or 2 (compute, compress, comm) and finite seconds >= 0")
        if tuple(sig) != signature(op):
            raise SparsimError(f"replay of rank {rank}: operation {i} is {signature(op)} in the program but "
                               f"{tuple(sig)} in the trace: not the same step (algorithm, k, P, data or sizes differ)")
        if sec > 0:
            yield self.env.timeout(sec)
        self.busy[rank, cat] += sec

    def run_programs(self, programs: list, iteration: int = 0, *, offsets=None, replays=None) -> tuple[list, np.ndarray]:
        """Run one program per rank from the current time to completion.

        offsets: optional seconds (>= 0) per rank to wait before starting (not accounted to any
        category); replays: optional per-rank replay sequences (see :meth:`execute`).
        Returns (results by rank, finish time of each rank in seconds as float array (P,)).
        Raises RuntimeError if some rank never finishes (a deadlocked collective).
        """
        if len(programs) != self.P:
            raise ValueError(f"{len(programs)} programs for P = {self.P} ranks")
        results = [None] * self.P
        finish = np.full(self.P, np.nan)

        def body(r):
            if offsets is not None and offsets[r] > 0:
                yield self.env.timeout(offsets[r])
            results[r] = yield from self.execute(r, programs[r], iteration,
                                                 None if replays is None else replays[r])
            finish[r] = self.env.now

        for r in range(self.P):
            self.env.process(body(r))
        self.env.run()
        if np.isnan(finish).any():
            stuck = [int(r) for r in np.flatnonzero(np.isnan(finish))]
            raise RuntimeError(f"deadlock: ranks {stuck} never finished")
        return results, finish
