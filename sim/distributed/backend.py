"""The real backend: the same per-rank sans-I/O programs, driven over torch.distributed point-to-point.

Every rank is an OS process (local: :func:`launch_local`; several machines: ``torchrun``, see the
README). A rank runs :func:`sim.algorithms.sgd_step` -- the one definition of dense, Top-k and gTop-k
S-SGD and of their collectives -- through :func:`execute`, which carries out the yielded operations
(:mod:`sim.base.ops`) with a :class:`TorchTransport`:

- ``Send``     -> a blocking send (gloo's send is rendezvous for large messages, as the simulator's),
- ``Recv``     -> a blocking receive,
- ``SendRecv`` -> ``isend`` + ``irecv``, then wait for both (pairwise exchanges cannot deadlock),
- ``Compute``  -> nothing (real time passes by itself); it only marks which category the wall time
  of the surrounding Python code belongs to.

Payloads are numpy arrays, :class:`~sim.comm.compression.Sparse`, lists of them (Bruck allgather blocks),
tuples ``(Sparse, bool ndarray | None)`` (gTop-k broadcast) or None. :func:`encode` / :func:`decode`
turn them into a uint8 buffer and back bit-exactly (dtypes kept; float64 stays float64) without
pickle. On the wire a payload is a fixed-size first message (an int64 length header and the first
bytes) and, for a larger payload, a second message with the rest, so variable sizes (empty selections
included) need no agreement between the ranks.

Because the numbers are computed by the same numpy code as in the simulator and the bytes travel
unchanged, the parameter trajectory of every algorithm is bit-identical to the simulator's for the
same data, seeds and P (``tests/test_torch_backend.py``).

Timing (per rank, seconds, cumulative, the same three categories as ``SimCluster.busy``):
``compute`` (the gradient, which ``sgd_step`` computes *before* yielding ``Compute("forward_backward")``,
and the update after ``Compute("update")``), ``compress`` (the Python code after ``Compute("select")`` /
``Compute("merge")`` up to the next operation: top-k selection and merges) and ``comm`` (time blocked in
Send/Recv/SendRecv, encoding and decoding included, plus the dense reductions after
``Compute("reduce")``, as the simulator accounts them). Metrics gathering to rank 0 happens after each
step and is not timed.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import pickle
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from sim.algorithms import AlgorithmSpec, StepOutput, sgd_step
from sim.engine.cluster import CATEGORY_OF_KIND
from sim.engine.replay import StepTrace
from sim.comm.compression import Sparse, selection_device
from sim.base.process import die_with_parent
from sim.base.errors import SparsimError, check_range, range_text
from sim.base.ops import AllReduce, Compute, Recv, Send, SendRecv, signature

__all__ = [
    "group_failed",
    "dist_failed",
    "encode",
    "decode",
    "TorchTransport",
    "WorkerFailure",
    "execute",
    "run_worker",
    "WorkerResult",
    "BACKEND_ALLREDUCE",
    "launch_local",
    "hung_ranks",
    "HANG_GRACE_S",
    "DistContext",
    "init_from_env",
    "pingpong_job",
    "PATTERNS",
    "fit_alpha_beta",
]

#: Name of the dense fast path: torch.distributed.all_reduce instead of the shared ring/RD definition.
BACKEND_ALLREDUCE = "backend_allreduce"


class WorkerFailure(SparsimError):
    """A rank raised, died, hung or timed out; the message names the rank (and what it waited on).

    ``log``: what the ranks wrote to their stderr (torch's c10d messages and C++ stack frames, Python
    warnings) and the failed ranks' tracebacks, one section per rank ("" when there is none); kept off the
    terminal, which shows only the one-line message, so a caller can record it (``sparsim run`` writes it to
    ``DIR.partial/error.txt`` after the message)."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


# progress of this rank, shared with launch_local (set in spawned ranks only): (times, iterations, rank)
_PROGRESS = None


def _beat(iteration: int | None = None) -> None:
    """Record that this rank made progress now (a message done, a step started) for launch_local's watchdog."""
    if _PROGRESS is not None:
        times, its, rank = _PROGRESS
        times[rank] = time.monotonic()
        if iteration is not None:
            its[rank] = iteration


# ============================================================================ codec (no pickle)

_NONE, _ARRAY, _SPARSE, _LIST, _TUPLE, _INT, _FLOAT, _BOOL = range(8)
_ARRAY_KINDS = "biufc"  # bool, signed, unsigned, float, complex: plain bytes, no objects


def _enc(obj, out: list) -> None:
    if obj is None:
        out.append(bytes([_NONE]))
    elif isinstance(obj, Sparse):
        out.append(bytes([_SPARSE]) + struct.pack("<q", int(obj.d)))
        _enc(np.asarray(obj.idx), out)
        _enc(np.asarray(obj.val), out)
    elif isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _ARRAY_KINDS:
            raise SparsimError(f"cannot encode an array of dtype {obj.dtype}: valid bool, integer, float, complex")
        ds = obj.dtype.str.encode("ascii")
        out.append(bytes([_ARRAY, len(ds)]) + ds + struct.pack("<B", obj.ndim)
                   + struct.pack(f"<{obj.ndim}q", *obj.shape))
        out.append(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, (list, tuple)):
        out.append(bytes([_LIST if isinstance(obj, list) else _TUPLE]) + struct.pack("<q", len(obj)))
        for item in obj:
            _enc(item, out)
    elif isinstance(obj, (bool, np.bool_)):
        out.append(bytes([_BOOL, 1 if obj else 0]))
    elif isinstance(obj, (int, np.integer)):
        out.append(bytes([_INT]) + struct.pack("<q", int(obj)))
    elif isinstance(obj, (float, np.floating)):
        if isinstance(obj, np.floating) and obj.dtype != np.float64:
            _enc(np.asarray(obj), out)  # keep the dtype (0-d array)
            return
        out.append(bytes([_FLOAT]) + struct.pack("<d", float(obj)))
    else:
        raise SparsimError(f"cannot encode a payload of type {type(obj).__name__}: valid None, numpy array, "
                           "Sparse, list, tuple, int, float, bool")


def encode(payload) -> np.ndarray:
    """Serialize a payload to bytes, bit-exactly and without pickle.

    payload: None, a numpy array of bool/integer/float/complex dtype (any shape; dtype and byte order
    kept), a :class:`~sim.comm.compression.Sparse`, int, float, bool, or a list/tuple of these (nested).
    Returns a uint8 array (n,), n >= 1. Raises SparsimError for any other type (e.g. object arrays).
    """
    out: list[bytes] = []
    _enc(payload, out)
    return np.frombuffer(b"".join(out), dtype=np.uint8)


def _dec(mv: memoryview, pos: int):
    tag = mv[pos]
    pos += 1
    if tag == _NONE:
        return None, pos
    if tag == _ARRAY:
        n = mv[pos]
        dt = np.dtype(bytes(mv[pos + 1:pos + 1 + n]).decode("ascii"))
        pos += 1 + n
        ndim = mv[pos]
        pos += 1
        shape = struct.unpack_from(f"<{ndim}q", mv, pos)
        pos += 8 * ndim
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * dt.itemsize
        arr = np.frombuffer(mv[pos:pos + nbytes], dtype=dt, count=count).reshape(shape).copy()
        return arr, pos + nbytes
    if tag == _SPARSE:
        (d,) = struct.unpack_from("<q", mv, pos)
        idx, pos = _dec(mv, pos + 8)
        val, pos = _dec(mv, pos)
        return Sparse(idx, val, int(d)), pos
    if tag in (_LIST, _TUPLE):
        (n,) = struct.unpack_from("<q", mv, pos)
        pos += 8
        items = []
        for _ in range(n):
            item, pos = _dec(mv, pos)
            items.append(item)
        return (items if tag == _LIST else tuple(items)), pos
    if tag == _INT:
        return struct.unpack_from("<q", mv, pos)[0], pos + 8
    if tag == _FLOAT:
        return struct.unpack_from("<d", mv, pos)[0], pos + 8
    if tag == _BOOL:
        return bool(mv[pos]), pos + 1
    raise SparsimError(f"corrupt message: unknown type tag {tag} at byte {pos - 1}")


def decode(buf) -> Any:
    """Inverse of :func:`encode`: buf is a uint8 array (or bytes). Returns the payload (arrays are
    fresh, writable copies). Raises SparsimError for a corrupt or truncated buffer."""
    mv = memoryview(np.ascontiguousarray(np.frombuffer(buf, dtype=np.uint8) if isinstance(buf, (bytes, bytearray))
                                         else buf, dtype=np.uint8)).cast("B")
    try:
        obj, pos = _dec(mv, 0)
    except (struct.error, ValueError, TypeError, IndexError) as err:
        raise SparsimError(f"corrupt message of {len(mv)} bytes: {err}") from None
    if pos != len(mv):
        raise SparsimError(f"corrupt message: {len(mv) - pos} trailing bytes after the payload")
    return obj


# ============================================================================ transport


class TorchTransport:
    """Point-to-point messages between ranks of the default torch.distributed process group.

    rank, P: this rank and the world size (ints). device: "cpu" for gloo, "cuda:N" for NCCL (the uint8
    buffers are staged there). timeout_s: seconds any single send/receive may block before
    :class:`WorkerFailure` is raised (naming this rank and the peer). A payload travels as a first
    message of exactly ``eager_bytes`` bytes (default 1024: an int64 length header, then the start of
    the :func:`encode` bytes, zero-padded) and, if it does not fit, one more message with the rest; the
    receiver learns the size from the header, so variable sizes need no agreement beforehand and a
    small payload costs one message, not two. ``wire_bytes`` counts what this rank sent (bytes, first
    messages' padding included). Requires torch.distributed to be initialised.

    On NCCL (untested here: no GPU has been available to this project) waits do not take timeout_s
    (``work.wait()`` only orders the CUDA stream; the process group's own timeout applies), and a send
    returns once it is queued, so its transfer time shows up at the next synchronising copy to the host.
    """

    def __init__(self, rank: int, P: int, *, device: str = "cpu", timeout_s: float = 60.0,
                 eager_bytes: int = 1024):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.P, self.device = int(rank), int(P), device
        self.nccl = str(device).startswith("cuda")
        self.timeout = datetime.timedelta(seconds=float(timeout_s))
        self.timeout_s = float(timeout_s)
        self.eager_bytes = int(check_range("eager_bytes", eager_bytes, 16))
        self.wire_bytes = 0
        self.where = ""  # context for error messages, e.g. "iteration 3"

    # -- helpers -------------------------------------------------------------------------------
    def _fail(self, what: str, peer: int, err: BaseException):
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        who = f"rank {peer}" if peer >= 0 else "another rank"
        if "timed out" in first.lower() or "timeout" in first.lower():
            why = f"no answer within the {self.timeout_s:g} s timeout ({who} hung, died or is stuck)"
        elif "closed" in first or "not connected" in first.lower() or "reset" in first.lower():
            why = f"{who} closed its connection (it raised or died)"
        else:
            why = first
        where = f" at {self.where}" if self.where else ""
        target = f" rank {peer}" if peer >= 0 else " the other ranks"
        raise WorkerFailure(f"rank {self.rank}: {what}{target} failed{where}: {why}") from None

    def _wait(self, work):
        if self.nccl:
            work.wait()
        else:
            work.wait(timeout=self.timeout)

    def _body(self, buf: np.ndarray):
        t = self.torch.from_numpy(np.array(buf, dtype=np.uint8, copy=True))
        return t.to(self.device) if self.device != "cpu" else t

    def _to_numpy(self, t) -> np.ndarray:
        return t.cpu().numpy() if self.device != "cpu" else t.numpy()

    def _split(self, payload):
        """(first message: eager_bytes, the rest or None, wire bytes) for a payload."""
        buf = encode(payload)
        n, room = buf.shape[0], self.eager_bytes - 8
        first = np.zeros(self.eager_bytes, dtype=np.uint8)
        first[:8] = np.frombuffer(np.int64(n).tobytes(), dtype=np.uint8)
        m = min(n, room)
        first[8:8 + m] = buf[:m]
        rest = buf[m:] if n > room else None
        return self._body(first), (self._body(rest) if rest is not None else None), \
            self.eager_bytes + (0 if rest is None else rest.shape[0])

    def _empty_first(self):
        return self.torch.empty(self.eager_bytes, dtype=self.torch.uint8, device=self.device)

    def _rest_len(self, first) -> tuple[int, int]:
        """(payload length, bytes still to receive after the first message)."""
        n = int(np.frombuffer(self._to_numpy(first[:8]).tobytes(), dtype=np.int64)[0])
        return n, max(0, n - (self.eager_bytes - 8))

    def _join(self, first, rest, n: int):
        head = self._to_numpy(first)[8:8 + min(n, self.eager_bytes - 8)]
        return decode(head if rest is None else np.concatenate([head, self._to_numpy(rest)]))

    # -- operations ----------------------------------------------------------------------------
    def send(self, dst: int, payload) -> None:
        """Send ``payload`` to rank ``dst`` and return when it has been handed over (blocking)."""
        first, rest, wire = self._split(payload)
        dist = self.dist
        try:
            self._wait(dist.isend(first, dst))
            if rest is not None:
                self._wait(dist.isend(rest, dst))
        except RuntimeError as err:
            self._fail("send to", dst, err)
        self.wire_bytes += wire
        _beat()

    def recv(self, src: int):
        """Receive the next message from rank ``src`` (FIFO per pair) and return its payload."""
        dist = self.dist
        first, rest = self._empty_first(), None
        try:
            self._wait(dist.irecv(first, src))
            n, left = self._rest_len(first)
            if left:
                rest = self.torch.empty(left, dtype=self.torch.uint8, device=self.device)
                self._wait(dist.irecv(rest, src))
        except RuntimeError as err:
            self._fail("receive from", src, err)
        _beat()
        return self._join(first, rest, n)

    def sendrecv(self, dst: int, payload, src: int):
        """Send ``payload`` to ``dst`` and receive from ``src`` concurrently (MPI_Sendrecv); returns
        what ``src`` sent. gloo: isend and irecv of the first messages, then the remainders; NCCL: the
        same two phases, each launched as one batch (NCCL needs matched pairs launched together)."""
        dist, torch = self.dist, self.torch
        first_out, rest_out, wire = self._split(payload)
        first_in, rest_in = self._empty_first(), None
        peer = src
        try:
            if self.nccl:
                for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, first_out, dst),
                                                 dist.P2POp(dist.irecv, first_in, src)]):
                    w.wait()
                n, left = self._rest_len(first_in)
                ops = [dist.P2POp(dist.isend, rest_out, dst)] if rest_out is not None else []
                if left:
                    rest_in = torch.empty(left, dtype=torch.uint8, device=self.device)
                    ops.append(dist.P2POp(dist.irecv, rest_in, src))
                if ops:
                    for w in dist.batch_isend_irecv(ops):
                        w.wait()
            else:
                sends = [dist.isend(first_out, dst)]
                r_first = dist.irecv(first_in, src)
                if rest_out is not None:
                    sends.append(dist.isend(rest_out, dst))
                self._wait(r_first)
                n, left = self._rest_len(first_in)
                if left:
                    rest_in = torch.empty(left, dtype=torch.uint8, device=self.device)
                    self._wait(dist.irecv(rest_in, src))
                peer = dst
                for w in sends:
                    self._wait(w)
        except RuntimeError as err:
            self._fail("exchange with" if dst == src else "send/receive with", peer, err)
        self.wire_bytes += wire
        _beat()
        return self._join(first_in, rest_in, n)

    def barrier(self) -> None:
        """All ranks meet (untimed bookkeeping); raises WorkerFailure after the process group's timeout."""
        try:
            self.dist.barrier()
        except RuntimeError as err:
            self._fail("barrier with", -1, err)
        _beat()


# ============================================================================ driver




def execute(program, transport: TorchTransport | None, busy: np.ndarray, bytes_sent: np.ndarray | None = None,
            clock: Callable[[], float] = time.perf_counter, segments: list | None = None):
    """Run one sans-I/O program on this rank over ``transport``; return the program's return value.

    busy: float64 array (3,), cumulative seconds in compute / compress / comm, updated in place (see the
    module docstring for the attribution rule). bytes_sent: optional float/int array (1,), incremented
    by each message's modelled size ``op.nbytes`` (the simulator's bytes_sent, headers excluded).
    transport may be None only for a program that sends nothing (P = 1). segments: optional list; when
    given, one ``(category, seconds, signature)`` triple is appended per yielded operation -- the local
    Python code that ran *before* that yield (category 0/1/2 = compute/compress/comm by the attribution
    rule) and :func:`sim.base.ops.signature` of the operation -- and one last triple (signature
    ``("end",)``) for the code after the last operation: the measured local timeline that
    :meth:`sim.engine.cluster.SimCluster.execute` replays (``replay=``) to predict the waiting and transfer
    time alone. Raises WorkerFailure when a peer fails or the transport times out, TypeError for an
    unknown operation.
    """
    value = None
    cat = 0  # category of the Python code currently running: compute until told otherwise
    t_last = clock()
    while True:
        try:
            op = program.send(value)
        except StopIteration as stop:
            dt = clock() - t_last
            busy[cat] += dt
            if segments is not None:
                segments.append((cat, dt, ("end",)))
            return stop.value
        now = clock()
        value = None
        if segments is not None:
            segments.append((0 if isinstance(op, Compute) and op.kind == "forward_backward" else cat, now - t_last,
                             signature(op)))
        if isinstance(op, Compute):
            if op.kind == "forward_backward":  # the gradient is computed before this yield
                busy[0] += now - t_last
                cat = 0
            else:  # select / merge / reduce / update: the work follows the yield
                busy[cat] += now - t_last
                cat = CATEGORY_OF_KIND[op.kind]
            t_last = now
            continue
        busy[cat] += now - t_last
        if transport is None:
            raise WorkerFailure(f"a program yielded {type(op).__name__} but there is no transport (P = 1)")
        if isinstance(op, Send):
            transport.send(op.dst, op.payload)
            nb = op.nbytes
        elif isinstance(op, Recv):
            value = transport.recv(op.src)
            nb = 0
        elif isinstance(op, SendRecv):
            value = transport.sendrecv(op.dst, op.payload, op.src)
            nb = op.nbytes
        elif isinstance(op, AllReduce):
            value = _all_reduce(transport, op.payload)
            nb = op.nbytes
        else:
            raise TypeError(f"rank {transport.rank} yielded {op!r}, not a sim.base.ops operation")
        if bytes_sent is not None:
            bytes_sent[0] += nb
        t_last = clock()
        busy[2] += t_last - now
        cat = 2


def _all_reduce(tr: TorchTransport, x: np.ndarray) -> np.ndarray:
    torch, dist = tr.torch, tr.dist
    t = torch.from_numpy(np.array(x, copy=True))
    if tr.device != "cpu":
        t = t.to(tr.device)
    try:
        work = dist.all_reduce(t, async_op=True)
        tr._wait(work)
    except RuntimeError as err:
        tr._fail("all_reduce with", -1, err)
    _beat()
    return tr._to_numpy(t).copy()


@dataclass
class WorkerResult:
    """What :func:`run_worker` returns on each rank.

    rank: int. v: float array (d,), the final parameters. rows: the metrics rows (list of dicts,
    :data:`sim.engine.runner.METRIC_COLUMNS`) on rank 0, None elsewhere. trajectory: list of T float arrays
    (d,), v after each iteration, when requested (else None). busy: float array (3,), this rank's
    cumulative seconds in compute / compress / comm. wall_s: this rank's summed step wall time (s).
    steps: with ``record_trace``, one :class:`sim.engine.replay.StepTrace` per iteration (start on this
    machine's monotonic clock, the local segments, the step's busy seconds); else None.
    """

    rank: int
    v: np.ndarray
    rows: list | None = None
    trajectory: list | None = None
    busy: np.ndarray = field(default_factory=lambda: np.zeros(3))
    wall_s: float = 0.0
    steps: list | None = None


def run_worker(rank: int, P: int, spec: AlgorithmSpec, workers, *, T: int, lr: Callable[[int], float],
               x0: np.ndarray, transport: TorchTransport | None, eval_every: int = 1,
               backend_allreduce: bool = False, keep_trajectory: bool = False, record_trace: bool = False,
               on_row: Callable[[dict], None] | None = None, select_device=None) -> WorkerResult:
    """Run T iterations of ``spec`` as rank ``rank`` of P over torch.distributed; return a :class:`WorkerResult`.

    workers: anything with ``grad_fn(rank, t) -> (v -> float array (d,))``, ``b`` (int, samples per
    batch) and, on rank 0, ``objective`` (loss, full_grad) -- :class:`sim.engine.runner.Workers` or a duck-typed
    test double. lr: t -> alpha_t. x0: float array (d,) (its dtype is the arithmetic dtype).
    backend_allreduce: dense only, use dist.all_reduce (sgd_step's collective ``backend_allreduce``).
    record_trace: keep each step's measured local timeline (:class:`sim.engine.replay.StepTrace`) for
    :func:`sim.engine.replay.replay` (the fidelity benchmark).
    select_device: a torch device (e.g. "cuda:0") on which the Top-k selections of vectors of d >= 2^15 are made
    (:func:`sim.comm.compression.selection_device`: the same indices and values as on the CPU), or None (numpy/numba on
    the CPU); :func:`resolve_select_device` turns the scenario key ``torch.select_device`` into it.
    Every rank must call this with the same arguments. After each step every rank sends its
    accumulator, residual, gradient, counters and clocks to rank 0 (untimed), which builds the metrics
    row with :class:`sim.engine.runner.MetricsRecorder` exactly as the simulator does; iter_time_s is the
    slowest rank's step wall time and sim_time_s their running sum (s). A barrier (untimed) then starts the next step.
    Raises SparsimError for bad T/k/eval_every, WorkerFailure when a peer fails, NonFiniteError
    for NaN/Inf gradients.
    """
    from sim.engine.runner import MetricsRecorder

    check_range("T", T, 1)
    check_range("eval_every", eval_every, 1)
    spec.check_dim(x0.shape[0])
    if backend_allreduce and "backend_allreduce" not in spec.algorithm.collectives:
        raise SparsimError(f"backend_allreduce is a dense fast path: algorithm {spec.name} cannot use it")
    if backend_allreduce:
        spec = dataclasses.replace(spec, collective=BACKEND_ALLREDUCE)
    if P > 1 and transport is None:
        raise SparsimError(f"P = {P} ranks need a transport")
    rec = None
    if hasattr(getattr(workers, "objective", None), "reset_state"):  # BatchNorm statistics: each algorithm from the start
        workers.objective.reset_state()
    if rank == 0:
        rec = MetricsRecorder(spec, workers.objective, T=T, lr=lr, x0=x0, eval_every=eval_every, on_row=on_row)
        _beat()  # the recorder evaluated the objective at x0
    if transport is not None and P > 1:
        transport.where = "start"
        transport.barrier()
    v, res, state = x0.copy(), np.zeros_like(x0), {}
    busy = np.zeros(3)
    nbytes = np.zeros(1)
    wall = 0.0
    sim_now = 0.0  # rank 0: sum over steps of the slowest rank's step time
    traj = [] if keep_trajectory else None
    steps = [] if record_trace else None
    with selection_device(select_device):  # the Top-k selections on this rank's GPU, if given
        for t in range(1, T + 1):
            _beat(t)
            if transport is not None:
                transport.where = f"iteration {t} of {spec.label}"
            prog = sgd_step(spec, rank, P, v, res, workers.grad_fn(rank, t), workers.b, lr(t), t, state)
            segs = [] if record_trace else None
            before = busy.copy()
            t0 = time.perf_counter()
            out: StepOutput = execute(prog, transport, busy, nbytes, segments=segs)
            step_s = time.perf_counter() - t0
            wall += step_s
            if steps is not None:
                steps.append(StepTrace(t0, tuple(segs), tuple(float(x) for x in busy - before), float(step_s)))
            v, res = out.v, out.residual
            if traj is not None:
                traj.append(v.copy())
            # ---- metrics gathering (untimed)
            mine = (out.acc, out.residual, out.grad, int(out.n_selected), int(out.n_applied), float(step_s), busy.copy(),
                    float(nbytes[0]))
            if transport is not None:
                transport.where = f"metrics gathering after iteration {t} of {spec.label}"
            if rank == 0:
                snaps = [mine] + [transport.recv(q) for q in range(1, P)]
                outs = [StepOutput(out.v, s[1], s[0], s[2], out.update, s[3], s[4]) for s in snaps]
                sim_now += max(s[5] for s in snaps)  # steps are separated by a barrier: the slowest rank sets the pace
                _beat()
                rec.finish_iteration(t, outs, sim_now, np.array([s[6] for s in snaps]),
                                     np.array([s[7] for s in snaps]))
            else:
                transport.send(0, mine)
            if P > 1:
                transport.barrier()
    rows = rec.rows if rec is not None else None
    return WorkerResult(rank, v, rows, traj, busy, wall, steps)


def resolve_select_device(setting: str, rank: int = 0):
    """The torch device a rank makes its Top-k selections on, from the scenario key ``torch.select_device``:
    "cpu" -> None (numpy/numba on the CPU); "cuda" -> "cuda:N" with N = rank mod the number of visible GPUs;
    "auto" -> as "cuda" when torch sees a GPU, else None. Raises ConfigError (one line, naming the key) for "cuda"
    without a visible GPU or an unknown setting. The selection is the same bit for bit on either device."""
    from sim.base.errors import ConfigError

    if setting not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"torch.select_device = {setting!r} is unknown: valid auto, cpu, cuda")
    if setting == "cpu":
        return None
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        if setting == "cuda":
            raise ConfigError("torch.select_device = 'cuda' needs a CUDA GPU and none is visible: valid auto, cpu")
        return None
    return f"cuda:{rank % n}"


# ============================================================================ process group setup


@dataclass
class DistContext:
    """This process's place in the run: ``rank``, ``P`` (world size), ``transport`` (None when P = 1 and
    no process group was needed), ``device`` ("cpu" or "cuda:N"), ``timeout_s`` (s)."""

    rank: int
    P: int
    transport: TorchTransport | None
    device: str
    timeout_s: float


def _pick_backend(backend: str) -> tuple[str, str, int]:
    import torch

    local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise SparsimError(f"dist backend = {backend!r} is unknown: valid auto, gloo, nccl")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise SparsimError("dist backend = 'nccl' needs a CUDA GPU; none is visible (use gloo)")
        dev = local % torch.cuda.device_count()
        torch.cuda.set_device(dev)
        return backend, f"cuda:{dev}", local
    return backend, "cpu", local


#: The valid range of ``torch.timeout_s`` (s), as the scenario schema has it, for the set-up errors below.
_TIMEOUT_RANGE = "valid 0 < timeout_s <= 604_800 s, default 60"


def _timeout_hint(timeout_s: float) -> str:
    """The closing words of a set-up error that ran out of time: the timeout, its key and its valid range."""
    small = " (too small to start and connect the ranks: raise it)" if timeout_s < 1.0 else ""
    return f"--timeout / torch.timeout_s = {timeout_s:g} s{small}; {_TIMEOUT_RANGE}"


def group_failed(rank: int, backend: str, P: int, err: BaseException, timeout_s: float) -> str:
    """The one line for a process group that did not form (a store or a peer that did not answer within the
    timeout: torch's ``DistStoreError: wait timeout``, gloo's ``Connect timeout``): the rank, torch's first line
    (cut to 200 characters) and :func:`_timeout_hint` (the timeout, "too small" below 1 s, its valid range). The
    torchrun entry point (:func:`init_from_env`) and the local launcher's ranks (``sparsim run --backend torch``)
    say the same."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (f"rank {rank}: the {backend} process group of P = {P} did not form ({type(err).__name__}: "
            f"{first[:200]}); {_timeout_hint(timeout_s)}")


def dist_failed(rank, err: BaseException, timeout_s: float | None = None) -> str:
    """The one line for torch's own c10d error after set-up (a peer gone, a store or collective timeout): the rank,
    torch's first line (cut to 300 characters), and the likely causes, with :func:`_timeout_hint` when the timeout
    is known."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    tail = "a peer died or hung, or --timeout is too small for this run" if timeout_s is None else \
        f"a peer died or hung, or the timeout is too small for this run: {_timeout_hint(timeout_s)}"
    return f"rank {rank}: torch.distributed failed ({type(err).__name__}: {first[:300]}); {tail}"


def _env_int(name: str, lo: int, hi: int | None = None) -> int:
    text = os.environ[name]
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < lo or (hi is not None and value > hi):
        raise SparsimError(f"environment variable {name} = {text!r} is out of range: valid integer "
                           + range_text(name, lo, hi))
    return value


def _join(rank: int, P: int, addr: str, port: int, timeout_s: float):
    """Rendezvous of torchrun's ranks at ``addr:port``: rank 0 hosts the store (unless torchrun's agent does), every
    rank checks in and waits for all P, so a rank that never joins is named. Returns the store. Raises SparsimError
    (one line) for a port in use, an unreachable rendezvous, missing ranks or a timeout too small to connect."""
    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout_s)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
    host = rank == 0 and not agent
    where = f"{addr}:{port}"
    try:
        store = dist.TCPStore(addr, port, P, is_master=host, timeout=td, wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "EADDRINUSE" in first or "address already in use" in first.lower():
            raise SparsimError(f"rank {rank}: MASTER_PORT {port} is in use on this machine (another process listens "
                               "there), so rank 0 cannot host the rendezvous: choose a free port, valid 1 <= "
                               "MASTER_PORT <= 65535") from None
        if host:
            raise SparsimError(f"rank 0 could not open its own rendezvous at {where} within the timeout: "
                               f"{_timeout_hint(timeout_s)}") from None
        raise SparsimError(f"rank {rank} could not reach the rendezvous at {where} (MASTER_ADDR:MASTER_PORT) within "
                           f"the timeout: rank 0 never started there, the address is wrong, or the timeout is too "
                           f"short; {_timeout_hint(timeout_s)}") from None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    keys = [f"sparsim/attempt_{attempt}/joined/{r}" for r in range(P)]
    try:
        store.set(keys[rank], "1")
        store.wait(keys, td)
    except (RuntimeError, OSError):
        try:
            missing = [r for r in range(P) if not store.check([keys[r]])]
        except (RuntimeError, OSError):  # the store itself is gone (rank 0, its host, died)
            missing = None
        who = ("the rendezvous host (rank 0) went away" if missing is None else
               f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of P = {P} never joined")
        raise SparsimError(f"rank {rank}: {who} at {where} within the timeout (start every rank with the same "
                           f"MASTER_ADDR, MASTER_PORT and WORLD_SIZE); {_timeout_hint(timeout_s)}") from None
    return store


class _HeldStderr:
    """Holds what this process writes to file descriptor 2 (torch's C++ c10d log lines and stack frames) in a
    temporary file while set-up runs: replayed to stderr when it succeeds, dropped when it fails with a one-line
    error (which says all the frames would)."""

    def __enter__(self):
        sys.stderr.flush()
        self.saved = os.dup(2)
        self.file = tempfile.TemporaryFile()
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, kind, value, tb):
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        if kind is None:
            self.file.seek(0)
            text = self.file.read()
            if text:
                sys.stderr.buffer.write(text) if hasattr(sys.stderr, "buffer") else sys.stderr.write(text.decode())
                sys.stderr.flush()
        self.file.close()
        return False


def init_from_env(*, backend: str = "auto", timeout_s: float = 60.0) -> DistContext:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT); backend "auto" picks NCCL when a GPU is visible, else gloo. timeout_s (s, > 0): how long the
    rendezvous may take (every rank waits for all WORLD_SIZE ranks to check in) and how long a blocked operation
    waits afterwards. Returns a :class:`DistContext`. Raises SparsimError, one line: a variable missing or out of
    range, MASTER_PORT in use, the rendezvous unreachable, ranks that never joined (named), a process group that
    did not form; the set-up errors name the timeout and its valid range."""
    import torch.distributed as dist

    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise SparsimError(f"torchrun environment variables {', '.join(missing)} are not set: launch with torchrun")
    check_range("timeout_s", timeout_s, 0, 604_800, lo_open=True)
    P = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0, P - 1)
    port = _env_int("MASTER_PORT", 1, 65535)
    be, device, _ = _pick_backend(backend)
    with _HeldStderr():
        store = _join(rank, P, os.environ["MASTER_ADDR"], port, timeout_s)
        try:
            dist.init_process_group(be, store=store, rank=rank, world_size=P,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, OSError) as err:
            raise SparsimError(group_failed(rank, be, P, err, timeout_s)) from None
    return DistContext(rank, P, TorchTransport(rank, P, device=device, timeout_s=timeout_s), device, timeout_s)


def _child(rank: int, P: int, port: int, backend: str, timeout_s: float, target, args, tmpdir: str,
           progress=None, parent_pid: int | None = None) -> None:
    """Body of one spawned local rank: join the group via the parent's TCPStore, run target, report.
    progress: (shared double array of last-progress times, shared int array of iterations), by rank.
    parent_pid: the launcher; the rank dies with it (a SIGKILLed ``sparsim run --backend torch`` leaves no rank
    training: :func:`sim.base.process.die_with_parent`)."""
    global _PROGRESS
    if parent_pid is not None:
        die_with_parent(parent_pid)
    err_path = os.path.join(tmpdir, f"error_{rank}.txt")
    # this rank's stderr (file descriptor 2: Python's warnings and tracebacks and torch's C++ c10d logging,
    # which prints dozens of stack frames when a store or a peer times out) goes to a log file that
    # launch_local hands to its caller, not to the user's terminal
    sys.stderr.flush()
    log_fd = os.open(os.path.join(tmpdir, f"log_{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    try:
        if progress is not None:
            _PROGRESS = (progress[0], progress[1], rank)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo" if sys.platform.startswith("linux") else "lo0")
        os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"] = str(rank), str(rank), str(P)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        be, device, _ = _pick_backend(backend)
        td = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=td)
            dist.init_process_group(be, store=store, rank=rank, world_size=P, timeout=td)
        except (RuntimeError, OSError) as err:  # a store or a peer not reached in time: say the timeout, as torchrun's
            raise SparsimError(group_failed(rank, be, P, err, timeout_s)) from None
        ctx = DistContext(rank, P, TorchTransport(rank, P, device=device, timeout_s=timeout_s), device, timeout_s)
        from threadpoolctl import threadpool_limits

        with threadpool_limits(1):  # one BLAS thread per rank, as torch: idle OpenBLAS threads spin and starve gloo
            result = target(ctx, *args)
        tmp = os.path.join(tmpdir, f"result_{rank}.pkl.tmp")
        with open(tmp, "wb") as fh:
            pickle.dump(result, fh, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, os.path.join(tmpdir, f"result_{rank}.pkl"))
        if _PROGRESS is not None:
            _PROGRESS[1][rank] = -1  # done: the stall watchdog leaves this rank alone while it shuts down
        try:
            # no rank closes its connections while a peer may still have collective work in flight on them (a
            # gloo thread that finds its peer gone aborts the whole process: rank 0 "died (signal 6 (SIGABRT))"
            # in tests/test_ddp_hooks.py, seen under load only)
            dist.barrier()
        except Exception:  # pragma: no cover - a peer that failed is reported by the launcher, not here
            pass
        try:
            dist.destroy_process_group()
        except Exception:  # pragma: no cover - best effort
            pass
    except BaseException as err:  # report, then die fast so the peers see closed connections
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if not isinstance(err, SparsimError):
            msg = f"rank {rank}: {type(err).__name__}: {msg}"
        elif not msg.startswith(f"rank {rank}"):
            msg = f"rank {rank}: {msg}"
        with open(err_path, "w") as fh:
            fh.write(msg + "\n" + ("" if isinstance(err, SparsimError) else traceback.format_exc()))
        sys.stderr.flush()
        os._exit(1)


def _rank_logs(tmpdir: str, P: int) -> str:
    """The ranks' stderr logs and error reports in ``tmpdir`` as one text, a ``--- rank r ...`` header before
    each non-empty one ("" when every rank was silent)."""
    parts = []
    for r in range(P):
        for name, what in ((f"error_{r}.txt", "error"), (f"log_{r}.txt", "stderr")):
            try:
                with open(os.path.join(tmpdir, name), errors="replace") as fh:
                    text = fh.read()
            except OSError:
                continue
            if text.strip():
                parts.append(f"--- rank {r} {what}\n{text.rstrip()}\n")
    return "".join(parts)


#: Seconds past the timeout before the launcher kills a rank that made no progress once another rank failed (a peer
#: blocked on it gives up after the timeout; the hung rank is killed this much later) -- see :func:`hung_ranks`.
HANG_GRACE_S = 2.0


def hung_ranks(now: float, first_fail: float, beats, working, timeout_s: float,
               grace_s: float = HANG_GRACE_S) -> dict[int, float]:
    """The rule by which :func:`launch_local` kills hung ranks once a rank has failed, on a given clock (s).

    now, first_fail: the clock now and when the first rank was seen failing (``first_fail <= now``). beats: per
    rank, the clock at its last progress (0: none yet). working: per rank, bool, alive and not yet done.
    timeout_s: the transport's timeout (s). A working rank whose last progress is more than ``timeout_s + grace_s``
    old is hung: a rank blocked on a peer gives up after ``timeout_s`` by itself, so one silent for longer is stopped
    (SIGSTOP, a debugger) or stuck, and killing it at once reports the run ``grace_s`` after its peers gave up, not
    ``timeout_s + grace_s`` after that. Ranks that made no progress yet are left to the launcher's overall limit
    (``timeout_s + grace_s`` after ``first_fail``). Returns {rank: seconds since its last progress} of the hung
    ranks (empty before anything qualifies).
    """
    limit = timeout_s + grace_s
    return {r: now - b for r, (b, w) in enumerate(zip(beats, working)) if w and b > 0 and now - b > limit}


def launch_local(P: int, target: Callable, args: tuple = (), *, timeout_s: float = 60.0, backend: str = "gloo",
                 start_timeout_s: float = 120.0, stall_timeout_s: float | None = None) -> list:
    """Run ``target(ctx, *args)`` in P local processes joined by torch.distributed on loopback.

    P: ranks (>= 1). target: a module-level function (spawn pickles it by name) taking a
    :class:`DistContext`; its return value must be picklable and comes back here. timeout_s (> 0): how
    long any rank may block on a peer, and how long the others get to stop after one fails; hung
    ranks are then killed: once a rank has failed, a rank with no progress for timeout_s + 2 s at once
    (:func:`hung_ranks`; a peer waiting on it gave up after timeout_s), every other rank still running
    timeout_s + 2 s after the first failure. stall_timeout_s (> 0, or None: off,
    the default): a watchdog that ends the run when *no* rank has made progress for that long -- every
    rank stuck in local computation, where no peer is left waiting to time out -- naming each rank and
    its iteration. Progress is a :class:`TorchTransport` operation or ``dist.all_reduce`` of
    :func:`execute` finishing, a :func:`run_worker` step starting, or rank 0's metrics evaluation
    starting or ending; a rank that has returned its result no longer counts. So the stall timeout
    also bounds the local computation between two such points (a step's gradient and selection,
    rank 0's full-objective evaluation, building the data): set it well above the longest.
    start_timeout_s (s): grace before the first progress (imports, process-group set-up). The
    rendezvous store is hosted by this process on 127.0.0.1 (a free port) and gloo is bound to the
    loopback interface, so nothing listens beyond this machine.
    Each rank's stderr (torch's C++ logging, warnings) goes to a log file, not to this process's stderr:
    when the run fails it becomes :attr:`WorkerFailure.log` (with the failed ranks' tracebacks), so the
    terminal shows only the caller's one line; when it succeeds, what the ranks wrote is copied to this
    process's stderr as before.
    Returns the P results by rank. Raises :class:`WorkerFailure` naming the failed rank(s) (raised,
    died with exit code / signal, hung), SparsimError for bad arguments.
    """
    import multiprocessing as mp

    import torch.distributed as dist

    check_range("P", P, 1)
    check_range("timeout_s", timeout_s, 0, lo_open=True)
    if stall_timeout_s is not None:
        check_range("stall_timeout_s", stall_timeout_s, 0, lo_open=True)
    import socket

    # the rendezvous store listens on a socket bound to loopback only (TCPStore alone binds every interface)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s + start_timeout_s),
                          master_listen_fd=sock.fileno())
    sock.detach()  # the store owns (and closes) the listening socket now
    tmpdir = tempfile.mkdtemp(prefix="sparsim_torch_")
    ctx = mp.get_context("spawn")
    beats, iters = ctx.Array("d", P, lock=False), ctx.Array("q", P, lock=False)
    procs = [ctx.Process(target=_child, args=(r, P, store.port, backend, float(timeout_s), target, args, tmpdir,
                                              (beats, iters), os.getpid()),
                         name=f"sparsim-rank{r}", daemon=True) for r in range(P)]
    from multiprocessing.connection import wait as mp_wait

    try:
        for p in procs:
            p.start()
        t_launch = time.monotonic()
        first_fail = None
        killed: dict[int, str] = {}
        stalled: dict[int, str] = {}
        while True:
            alive = [p for p in procs if p.exitcode is None]
            if not alive:
                break
            mp_wait([p.sentinel for p in alive], timeout=0.2)
            if first_fail is None and any(p.exitcode not in (None, 0) for p in procs):
                first_fail = time.monotonic()
            now = time.monotonic()
            working = [r for r, p in enumerate(procs) if p.exitcode is None and iters[r] != -1]
            last = max(beats[r] for r in working) if working else now
            last = last or (t_launch + start_timeout_s)
            if stall_timeout_s is not None and first_fail is None and working and now - last > stall_timeout_s:
                for r in working:
                    p = procs[r]
                    where = f" in iteration {iters[r]}" if iters[r] > 0 else ""
                    idle = now - beats[r] if beats[r] > 0 else now - t_launch
                    stalled[r] = (f"rank {r} made no progress{where} for {idle:.3g} s (no working rank progressed "
                                  f"within the {stall_timeout_s:g} s stall timeout: stuck in local computation; "
                                  "killed)")
                    p.kill()
                for p in procs:
                    p.join(10)
                break
            if first_fail is not None:
                done = [r for r in range(P) if procs[r].exitcode is None and iters[r] == -1]
                late = hung_ranks(now, first_fail, [beats[r] for r in range(P)],
                                  [procs[r].exitcode is None and r not in done for r in range(P)], timeout_s)
                if now - first_fail > timeout_s + HANG_GRACE_S:  # the rest: done but not shutting down, never started
                    late.update({r: None for r, p in enumerate(procs) if p.exitcode is None and r not in late})
                for r, idle in late.items():
                    where = f" in iteration {iters[r]}" if iters[r] > 0 else ""
                    killed[r] = (f"rank {r} hung{where} (no progress for {idle:.3g} s: its peers give up after the "
                                 f"{timeout_s:g} s timeout, it was killed {HANG_GRACE_S:g} s later)" if idle is not None
                                 else f"rank {r} hung (still running {timeout_s + HANG_GRACE_S:g} s after another "
                                 "rank failed; killed)")
                    procs[r].kill()
                if late and all(p.exitcode is not None or r in killed for r, p in enumerate(procs)):
                    for p in procs:
                        p.join(10)
                    break
        results, problems = [], []
        for r, p in enumerate(procs):
            path = os.path.join(tmpdir, f"result_{r}.pkl")
            err = os.path.join(tmpdir, f"error_{r}.txt")
            if r in stalled:
                problems.append((0, stalled[r]))
            elif r in killed:
                problems.append((1, killed[r]))
            elif os.path.exists(err):
                text = open(err).read().splitlines()[0]
                # a rank that merely saw its peer go away is a consequence, not the cause
                prio = 2 if ("closed its connection" in text or "no answer within" in text) else 0
                problems.append((prio, text))
            elif p.exitcode != 0:
                how = f"signal {-p.exitcode} ({signal.Signals(-p.exitcode).name})" if p.exitcode < 0 \
                    else f"exit code {p.exitcode}"
                problems.append((0, f"rank {r} died ({how})"))
            elif not os.path.exists(path):
                problems.append((0, f"rank {r} exited without a result"))
            else:
                with open(path, "rb") as fh:
                    results.append(pickle.load(fh))
        logs = _rank_logs(tmpdir, P)
        if problems:
            problems.sort(key=lambda x: x[0])
            head = problems[0][1]
            rest = "; ".join(m for _, m in problems[1:])
            raise WorkerFailure(f"torch backend failed: {head}" + (f" (also: {rest})" if rest else ""), logs)
        if logs:
            sys.stderr.write(logs)
            sys.stderr.flush()
        return results
    finally:
        for p in procs:
            if p.pid is not None and p.exitcode is None:  # started (a failed start leaves pid None) and alive
                p.kill()
                p.join(5)
        shutil.rmtree(tmpdir, ignore_errors=True)
        del store


# ============================================================================ calibration (ping-pong)


#: Valid calibration patterns: one-way time from a ping-pong, or the time of a pairwise exchange.
PATTERNS = ("exchange", "pingpong")


def pingpong_job(ctx: DistContext, sizes: list[int], repeats: int, warmup: int = 2,
                 pattern: str = "pingpong", busy_s: float = 0.0) -> list | None:
    """Ranks 0 and 1 time messages of each size (bytes) ``repeats`` times through the
    :class:`TorchTransport` (header + codec included, as in a collective).

    pattern "pingpong": rank 0 sends, rank 1 sends it back; the time is half the round trip (the
    classical one-way latency). pattern "exchange": both ranks send to and receive from each other at
    once (``sendrecv``, the step of ring / recursive-doubling allreduce, Bruck allgather and gTop-k's
    recursive doubling); the time is rank 0's exchange time, which on a full-duplex network equals the
    one-way time and on a shared medium (loopback: one kernel, shared CPUs) does not.
    busy_s: seconds (>= 0) each rank computes (a busy loop) before each timed exchange or round trip,
    as a training step does between its messages; 0 times messages back to back.
    Returns on rank 0 a list of (size_bytes, median time in s, list of times); None on the other ranks.
    Raises SparsimError for P < 2 or an unknown pattern.
    """
    tr = ctx.transport
    if ctx.P < 2:
        raise SparsimError(f"calibration needs 2 ranks, got P = {ctx.P}")
    if pattern not in PATTERNS:
        raise SparsimError(f"pattern = {pattern!r} is unknown: valid {', '.join(PATTERNS)}")
    check_range("busy_s", busy_s, 0)
    if ctx.rank > 1:  # only ranks 0 and 1 time messages; the others leave at once (no barrier to time out in)
        return None
    out = []
    for n in sizes:
        payload = np.zeros(int(n), dtype=np.uint8)
        times = []
        for i in range(warmup + repeats):
            if busy_s > 0:
                t_end = time.perf_counter() + busy_s
                while time.perf_counter() < t_end:
                    pass
            t0 = time.perf_counter()
            if pattern == "exchange":
                tr.sendrecv(1 - ctx.rank, payload, 1 - ctx.rank)
                dt = time.perf_counter() - t0
            elif ctx.rank == 0:
                tr.send(1, payload)
                tr.recv(1)
                dt = (time.perf_counter() - t0) / 2
            else:
                tr.send(0, tr.recv(0))
            if ctx.rank == 0 and i >= warmup:
                times.append(dt)
        if ctx.rank == 0:
            out.append((int(n), float(np.median(times)), times))
    return out if ctx.rank == 0 else None


def fit_alpha_beta(sizes, times) -> dict:
    """Least-squares fit t = alpha + n * beta of message times (s; one-way or exchange) against sizes (bytes).

    Minimises the relative residual sum_i ((alpha + n_i beta - t_i) / t_i)^2 (sizes span decades, so
    an absolute fit would ignore the small messages). A negative alpha is set to 0 and beta refitted
    with alpha = 0. Returns a dict: alpha_s, beta_s_per_byte,
    bandwidth_Bps, rms_rel_residual, max_rel_residual, rms_abs_residual_s. Raises SparsimError for
    fewer than 2 sizes or a non-positive fitted beta.
    """
    n = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if n.shape[0] < 2 or np.unique(n).shape[0] < 2:
        raise SparsimError("calibration needs at least 2 distinct message sizes")
    A = np.stack([np.ones_like(n), n], axis=1) / t[:, None]
    coef, *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    alpha, beta = float(coef[0]), float(coef[1])
    if alpha < 0:  # refit through the origin: t = n beta
        alpha = 0.0
        beta = float(np.sum(n / t) / np.sum((n / t) ** 2))
    if beta <= 0:
        raise SparsimError(f"calibration fit gave beta = {beta:.3g} s/byte <= 0: use larger message sizes")
    pred = alpha + beta * n
    rel = (pred - t) / t
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "bandwidth_Bps": 1.0 / beta,
            "rms_rel_residual": float(math.sqrt(np.mean(rel ** 2))), "max_rel_residual": float(np.max(np.abs(rel))),
            "rms_abs_residual_s": float(math.sqrt(np.mean((pred - t) ** 2)))}
