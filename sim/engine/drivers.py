"""The lock-step driver: runs P per-rank programs (sans-I/O generators) with no clock.

It is the plain reference the SimPy cluster and the torch backend are tested against, and the
baseline of the event-overhead benchmark. Messages are matched per ordered pair of ranks in FIFO
order with rendezvous semantics (:mod:`sim.base.ops`); :class:`~sim.base.ops.Compute` operations are skipped.
"""
from __future__ import annotations

from collections import deque

from sim.base.errors import SparsimError
from sim.base.ops import AllReduce, Compute, Recv, Send, SendRecv

__all__ = ["run_lockstep", "DeadlockError"]


class DeadlockError(RuntimeError):
    """Every unfinished program waits on a message nobody will send (a bug in a collective)."""


def run_lockstep(programs: list) -> list:
    """Run generators ``programs[r]`` (rank r) to completion; return their return values by rank.

    Deterministic: ranks are advanced in a fixed order (lowest runnable rank first). Sends are
    buffered in FIFO queues per (src, dst); a Send completes at once (no clock), a Recv completes
    when a message from its source is queued. Raises :class:`DeadlockError` naming the blocked ranks.
    """
    P = len(programs)
    queues: dict[tuple[int, int], deque] = {}
    results = [None] * P
    done = [False] * P
    waiting: list = [None] * P  # src a rank waits on, or None when runnable
    send_value = [None] * P
    started = [False] * P

    def post(src, dst, payload):
        queues.setdefault((src, dst), deque()).append(payload)

    def step(r):
        """Advance rank r until it blocks or finishes. Returns True if it made progress."""
        progressed = False
        while True:
            if waiting[r] is not None:
                q = queues.get((waiting[r], r))
                if not q:
                    return progressed
                send_value[r] = q.popleft()
                waiting[r] = None
            try:
                if not started[r]:
                    started[r] = True
                    op = next(programs[r])
                else:
                    op = programs[r].send(send_value[r])
            except StopIteration as stop:
                results[r] = stop.value
                done[r] = True
                return True
            progressed = True
            send_value[r] = None
            if isinstance(op, Send):
                post(r, op.dst, op.payload)
            elif isinstance(op, Recv):
                waiting[r] = op.src
            elif isinstance(op, SendRecv):
                post(r, op.dst, op.payload)
                waiting[r] = op.src
            elif isinstance(op, Compute):
                pass
            elif isinstance(op, AllReduce):
                raise SparsimError("collective backend_allreduce runs only on the torch backend: valid here ring, recursive_doubling")
            else:
                raise TypeError(f"rank {r} yielded {op!r}, not a sim.base.ops operation")

    while not all(done):
        progress = False
        for r in range(P):
            if not done[r] and step(r):
                progress = True
        if not progress:
            blocked = {r: waiting[r] for r in range(P) if not done[r]}
            raise DeadlockError(f"deadlock: ranks waiting on sources {blocked}")
    return results
