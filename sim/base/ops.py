"""The sans-I/O operations that every collective and every algorithm step yields.

A collective (``sim.comm.collectives``) or an S-SGD worker step (``sim.algorithms``) is a Python
generator, one per rank. It never touches a clock or a socket: it *yields* operations and a
driver carries them out.

- :class:`Send`  -- deliver ``payload`` (``nbytes`` bytes on the wire) to rank ``dst``. The
  yielding rank is blocked until the message has been delivered. The generator receives ``None``.
- :class:`Recv`  -- wait for the next message from rank ``src``; messages between one ordered
  pair of ranks arrive in FIFO order. The generator receives the payload.
- :class:`SendRecv` -- both at once (MPI_Sendrecv): send to ``dst`` and receive from ``src``
  concurrently; the generator receives the payload from ``src``. Used by pairwise exchanges
  (recursive doubling, ring steps), where two blocking sends would deadlock.

Matching is rendezvous: a transfer starts when the sender has posted its Send and the receiver its
Recv for that pair (MPI's rendezvous protocol for large messages). A rank posts one receive at a
time, so on a non-blocking switch the round-structured collectives here never contend, and an
uncontended message costs ``alpha + nbytes * beta`` (the alpha-beta model).
- :class:`Compute` -- local work of a given ``kind`` and size (``work``, in the unit the kind
  defines); a simulated driver turns it into seconds through a compute model, a real driver
  ignores it (real time passes by itself).

Drivers: ``sim.engine.drivers.run_lockstep`` (no clock, plain Python), ``sim.engine.cluster`` (SimPy network
and compute models) and ``sim.distributed.backend`` (torch.distributed point-to-point). Because the
numerics live in the generators, every driver computes the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator

#: Compute kinds and the unit of their ``work`` field.
COMPUTE_KINDS = {
    "forward_backward": "samples in the local mini-batch",
    "select": "elements scanned by a top-k selection",
    "merge": "elements merged (sparse add + top-k over the union)",
    "reduce": "elements added in a dense reduction",
    "update": "parameters updated",
    "scan": "bytes read or written in device memory by a compressor's streaming or gathering kernels",
    "matmul": "floating-point operations of a compressor's dense matrix products (2 per multiply-add)",
}

#: The compute kinds of compression itself (:meth:`sim.algorithms.base.Algorithm.compression_work`): what an
#: algorithm does to its accumulator before its collective starts (a top-k selection, a threshold's passes, a
#: low-rank product). The iteration timeline charges them before each bucket's collective and its collective timer
#: leaves them out (sim/engine/timeline.py); merges and reductions belong to the collectives.
COMPRESSION_KINDS = ("select", "scan", "matmul")


@dataclass(frozen=True)
class Send:
    """Send ``payload`` to rank ``dst``; ``nbytes`` (int, bytes) is its size on the wire."""

    dst: int
    payload: Any
    nbytes: int


@dataclass(frozen=True)
class Recv:
    """Receive the next message from rank ``src`` (FIFO per ordered pair of ranks)."""

    src: int


@dataclass(frozen=True)
class SendRecv:
    """Send ``payload`` (``nbytes`` bytes) to ``dst`` and receive the next message from ``src``, concurrently."""

    dst: int
    payload: Any
    nbytes: int
    src: int


@dataclass(frozen=True)
class AllReduce:
    """Sum ``payload`` (float array (d,)) over all ranks with the transport's own allreduce.

    Only the torch backend carries it out (``torch.distributed.all_reduce``: the named fast path
    ``backend_allreduce`` of dense S-SGD); the simulated drivers reject it with a SparsimError, since
    the backend's internal algorithm is not a message-level model.
    """

    payload: Any
    nbytes: int


@dataclass(frozen=True)
class Compute:
    """Local work: ``kind`` is a key of :data:`COMPUTE_KINDS`; ``work`` its size (>= 0)."""

    kind: str
    work: float


#: Type of a per-rank collective or step generator returning ``R``.
Program = Generator[Any, Any, Any]


def signature(op) -> tuple:
    """What an operation is, without its payload: ``("Send", dst, nbytes)``, ``("Recv", src)``,
    ``("SendRecv", dst, src, nbytes)``, ``("AllReduce", nbytes)``, ``("Compute", kind)``, or ``("end",)``
    for None (a program's end). Two runs of one step on the same data and state yield the same
    signatures in the same order (message sizes depend on the numbers: exact zeros are not sent), so a
    measured trace can be checked against the program it is replayed on. Raises TypeError for
    anything else."""
    if op is None:
        return ("end",)
    if isinstance(op, Send):
        return ("Send", op.dst, op.nbytes)
    if isinstance(op, Recv):
        return ("Recv", op.src)
    if isinstance(op, SendRecv):
        return ("SendRecv", op.dst, op.src, op.nbytes)
    if isinstance(op, AllReduce):
        return ("AllReduce", op.nbytes)
    if isinstance(op, Compute):
        return ("Compute", op.kind)
    raise TypeError(f"{op!r} is not a sim.base.ops operation")
