"""The fast engine: one simulated S-SGD iteration for thousands of ranks, a vectorised round at a time.

The message-level engine (:mod:`sim.engine.cluster`, SimPy) moves every message through the network as an event:
the dense ring at P = 1024 is 2.1M messages and takes minutes. This engine evaluates a collective a whole
*round* at a time with numpy over all P ranks, using the same communication patterns as the per-rank
programs: the schedules of :mod:`sim.comm.collectives` (``ring_schedule``, ``rd_schedule``, ``bruck_schedule``,
``binomial_reduce_schedule``, ``binomial_bcast_schedule``) are written once and evaluated here on an array
of ranks, there on one rank. Memory is O(P) per round.

Model (the same rules, and the same floating-point operations, as the message-level engine):

- each rank has a clock ``ready[r]``; a Compute costs :meth:`sim.machine.compute.ComputeModel.seconds_all`;
- a message from s to d starts when both have posted (rendezvous): ``max(ready[s], ready[d])``;
- it crosses its route's links: on a :class:`~sim.machine.topology.ClusterSpec`, pipelined links cut into runs of
  unshared links and single shared links (:meth:`~sim.machine.topology.ClusterSpec.path_plan`); on a flat
  :class:`~sim.machine.network.NetworkSpec`, store-and-forward hops (latency + n / bandwidth each). A shared link
  serves heads FIFO in order of arrival, ties to the lower sending rank;
- a sender is done when its message has arrived, a receiver when the message it waits for has arrived, a
  rank that both sends and receives (SendRecv) when both are done.

Exactness. In every pattern a rank sends at most one message and receives at most one per round, so links of
unshared levels are never contended and cost their closed form. Shared links (a NIC shared by the GPUs of a
node, leaf uplinks, PCIe ports carrying a node's inter-node traffic, the links of a ring topology) are
served FIFO within a round, in order of arrival, from where the previous round left each link. If some head
reaches a shared link no later than the head of a message an earlier round already served there, round order
may differ from time order, and :meth:`FastCluster.step` replays that iteration message by message in global
time order (:meth:`FastCluster._event_replay`). So the fast engine gives the message-level engine's times (to
the last bit in the tests' cases, asserted at 1e-9), on any fabric :func:`fast_engine_refusal` accepts:
quantum_s > 0 and zero latencies on shared links are left to the message-level engine.

Speed (the same floats, by construction, tested bit for bit): a round's pattern is analysed once per (dst, src)
array pair; on a fabric with no shared link a message's cost is looked up by its class (to itself, inside its node,
to another node: every link of a level is alike there) instead of summed over its route's links; a round that
is a rotation r -> (r + c) % P of every rank gathers by two slices; and sizes or work that are slices of a
read-only table (:func:`sim.comm.rounds.shifted_ring_rounds`) take their costs as slices of the table's
elementwise costs, computed once. Each is the same elementwise operation on the same values as the direct
evaluation, so every number is unchanged.

Runs of named rounds (:attr:`sim.comm.rounds.Round.pattern`, see :meth:`FastCluster.run`) go further, still with
the same bits: on a fabric with no shared link a ring's 2(P - 1) rotations and reduces run in one compiled loop
(:mod:`sim.engine._fast_numba`, numba), and rotations of one size per round from clocks that are the same on every
node (Ok-Topk's P - 1) are evolved for one node's G ranks only; on a fabric with shared links a named run that
starts from an untouched engine (the collective timer's case) is simulated once per fabric, P and sizes and then
reused (:data:`PHASES`). The cost of a ring stays O(P^2) operations, about a nanosecond each compiled
(benchmarks/bench_fast_p16k.py gives the seconds per collective, docs/cluster-scale.md shows them).
"""
from __future__ import annotations

import numpy as np

from sim.comm.rounds import SKIP_RING, Round, Work
from sim.algorithms import AlgorithmSpec
from sim.engine.cluster import CATEGORY_OF_KIND
from sim.machine.compute import ComputeModel
from sim.base.errors import ConfigError, SparsimError, check_range
from sim.machine.network import NetworkSpec
from sim.machine.topology import ClusterSpec

__all__ = ["FastCluster", "fast_iteration", "fast_collective", "as_cluster",
           "fast_engine_refusal"]


#: Arrays shorter than this are computed directly rather than sliced from tables (:meth:`FastCluster._slice_of`):
#: below it the look-up's Python overhead costs more than the elementwise operations it saves.
_SLICE_MIN = 2048


def as_cluster(network, P: int):
    """The fabric of ``network`` for P ranks: the :class:`ClusterSpec` or :class:`NetworkSpec` itself.
    Raises ConfigError for quantum_s > 0 (not modelled here) or a ClusterSpec of another size."""
    if isinstance(network, ClusterSpec):
        if network.P != P:
            raise ConfigError(f"P = {P} but the cluster has {network.nodes} x {network.gpus_per_node} = "
                              f"{network.P} ranks: valid P = nodes x gpus_per_node")
        return network
    if not isinstance(network, NetworkSpec):
        raise SparsimError(f"network = {network!r} is invalid: valid NetworkSpec or ClusterSpec")
    why = fast_engine_refusal(network)
    if why:
        raise ConfigError(why)
    return network


def fast_engine_refusal(network) -> str | None:
    """Why the fast engine cannot give ``network`` the message-level engine's times (a one-line error text), or
    None: a time quantum (ASTRA-sim's integer ns) is modelled only message by message, and on links shared by
    several ranks a zero latency lets heads reach the next shared link in the same instant, where the two
    engines' tie orders differ (the fast engine: lower sender first; the message-level engine: the order the
    instant's events cascade in)."""
    if isinstance(network, ClusterSpec):
        if network.zero_latency_shared():
            return ("the fast engine needs a positive latency on shared links (here intra_alpha_s, alpha_s or "
                    "spine_alpha_s is 0): valid latency > 0, or engine = message")
        return None
    if network.quantum_s > 0:
        return f"quantum_s = {network.quantum_s} is not modelled by the fast engine: valid quantum_s = 0, or engine = message"
    if network.topology == "ring" and network.link_latency_s == 0:
        return "the fast engine needs a positive latency on a ring topology: valid alpha > 0, or engine = message"
    return None


def _fifo(links, head, hold, tail, free, order, last_head):
    """Serve messages FIFO on shared links, a whole round at once, with the message-level engine's arithmetic.

    Message i's head reaches link ``links[i]`` at ``head[i]``; it holds the link ``hold[i]`` seconds and at
    least until ``tail[i]`` (its last byte arriving from the previous link; -inf for none). The link is free
    from ``free[link]``. Messages of one link are served in order of (head, order): Lindley's recursion
    start_i = max(head_i, end_{i-1}), end_i = max(start_i + hold_i, tail_i), evaluated for the j-th message
    of every link at once, j = 0, 1, ... (as many numpy passes as the busiest link has messages).
    ``last_head[link]``: the head time of the link's last message before this round, updated here.
    Returns (start, end, overtaken) with start and end in the input order; overtaken is True when some
    head is not later than that of a message served before it on the same link in an earlier round (the
    message-level engine may have served it first: see :meth:`FastCluster.step`)."""
    o = np.lexsort((order, head, links))
    lk = links[o]
    m = lk.shape[0]
    first = np.ones(m, dtype=bool)
    first[1:] = lk[1:] != lk[:-1]
    g0 = np.flatnonzero(first)  # where each link's messages start in the sorted order
    sizes = np.diff(np.append(g0, m))
    overtaken = bool(np.any(head[o[g0]] <= last_head[lk[g0]]))
    prev = free[lk[g0]].copy()
    start, end = np.empty(m), np.empty(m)
    for j in range(int(sizes.max())):
        grp = np.flatnonzero(sizes > j)
        ii = o[g0[grp] + j]  # the j-th message of each of those links, as input positions
        st = np.maximum(head[ii], prev[grp])
        en = np.maximum(st + hold[ii], tail[ii])
        start[ii], end[ii] = st, en
        prev[grp] = en
    last = o[g0 + sizes - 1]
    free[lk[g0]] = prev
    last_head[lk[g0]] = head[last]
    return start, end, overtaken


def _by_link_then_sender(links, order):
    """Positions sorted by (link, order): ``np.lexsort((order, links))`` (int arrays (m,) of ids >= 0), with one
    stable counting-friendly sort of the link ids when ``order`` is already increasing (the senders of a round,
    listed by rank), the same permutation."""
    if order.shape[0] < 2 or bool(np.all(order[1:] > order[:-1])):
        key = links.astype(np.uint16) if links.shape[0] and int(links.max()) < 1 << 16 else links
        return np.argsort(key, kind="stable")  # a radix sort for 16-bit keys
    return np.lexsort((order, links))


class _FabricMemo:
    """Read-only results kept across :class:`FastCluster` instances for one fabric and P at a time: key -> value
    (nested tuples / lists of numpy arrays and scalars). A plan times hundreds of collectives on one cluster, and
    some of their work depends only on the fabric and a key. Holds at most ``max_elements`` array elements (64M: about
    0.5 GB of int64 / float64), counted over the values' arrays; cleared when another fabric or P comes or the bound
    would be passed. ``entries``: the dict held; ``fabric``, ``P``: what it is for."""

    def __init__(self, max_elements: int = 1 << 26):
        self.max_elements = max_elements
        self.clear()

    def clear(self) -> None:
        """Forget every entry (and the fabric)."""
        self.fabric, self.P, self.elements, self.entries = None, None, 0, {}

    def _holds(self, fabric, P: int) -> bool:
        return self.P == P and (self.fabric is fabric or self.fabric == fabric)

    def get(self, fabric, P: int, key):
        """The value stored for ``key`` on (fabric, P), or None."""
        return self.entries.get(key) if self._holds(fabric, P) else None

    def put(self, fabric, P: int, key, value) -> None:
        """Store ``value`` for ``key`` on (fabric, P); its arrays are made read-only."""
        if not self._holds(fabric, P):
            self.clear()
            self.fabric, self.P = fabric, P
        arrays = list(_arrays(value))
        n = sum(x.size for x in arrays)
        if self.elements + n > self.max_elements:
            self.entries, self.elements = {}, 0
        for x in arrays:
            x.setflags(write=False)
        self.entries[key] = value
        self.elements += n


def _arrays(x):
    """The numpy arrays inside nested lists / tuples (a route), depth first."""
    if isinstance(x, np.ndarray):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _arrays(y)


#: Routes of rotations r -> (r + c) % P on a shared ClusterSpec: c -> :meth:`FastCluster._route` of that rotation
#: (:meth:`FastCluster._rotation_route`). Ok-Topk's P - 1 rotations each build a :meth:`FastCluster._plan` that
#: depends only on the fabric and c; a cached route (link ids, latencies, bandwidths, FIFO tables) gives the same bits.
ROTATION_ROUTES = _FabricMemo()

#: A run of at least this many named rounds is evaluated whole (:meth:`FastCluster.run`).
_RUN_MIN = 16

#: A run of named rounds is collected up to this many bytes of arrays of its own (not views), then cut.
_RUN_MAX_BYTES = 256 << 20
_END = object()  # the end of a program (FastCluster.run)


def unshared_fabric(fabric) -> bool:
    """True when no link of ``fabric`` (a ClusterSpec, or a NetworkSpec: star, direct, ring, ...) carries messages of
    more than one sender or receiver (:meth:`ClusterSpec.shared_levels` empty; a flat star or direct network): every
    message then costs its path's closed form, and the fast engine takes its compiled paths."""
    if isinstance(fabric, ClusterSpec):
        return not fabric.shared_levels()
    return fabric.topology in ("star", "direct")


def _scalar(x) -> bool:
    """np.ndim(x) == 0 for a Round's nbytes (an int, a numpy scalar or an array), without np.ndim's dispatch
    (about 1 us, once per round of Ok-Topk's P - 1)."""
    return not isinstance(x, np.ndarray) or x.ndim == 0


#: Results of runs of named rounds from an untouched engine on a shared fabric (:meth:`FastCluster._memo_phase`):
#: (rounds' names and sizes) -> (clocks (P,), link free times, link last heads, messages, bytes, overtaken). A plan
#: times the same phase for every k whose messages have the same size (Ok-Topk's P - 1 rotations of ceil(k / P)
#: entries, SparCML's split pieces); the same bits as simulating it again (the same operations on the same inputs).
PHASES = _FabricMemo()


class FastCluster:
    """P simulated ranks advanced a round at a time (see the module docstring).

    P: int >= 1. network: a :class:`~sim.machine.network.NetworkSpec` (quantum_s = 0) or a
    :class:`~sim.machine.topology.ClusterSpec` with P ranks. compute: a :class:`~sim.machine.compute.ComputeModel`
    (default: zero costs). Attributes: ``ready`` (float array (P,), each rank's clock in s), ``busy``
    (float array (P, 3): s per rank in compute / compress / comm, cumulative), ``messages`` and ``bytes``
    (totals sent, ints). Raises SparsimError / ConfigError for bad input (see :func:`as_cluster`).
    """

    def __init__(self, P: int, network, compute: ComputeModel | None = None):
        check_range("P", P, 1)
        self.P = int(P)
        self.fabric = as_cluster(network, self.P)
        self.model = compute if compute is not None else ComputeModel(forward_backward_s=0.0, select_coeff_s=0.0)
        self.ready = np.zeros(self.P)
        self._busy = np.zeros((3, self.P))  # compute, compress, reduce compute (comm is derived, see busy)
        self._idle = np.zeros(self.P)  # seconds each rank waited at barrier() (no category)
        self.messages = 0
        self.bytes = 0
        self._cache_key = None
        if isinstance(self.fabric, ClusterSpec):
            self._lat, self._bw, _ = self.fabric.link_table()
            self._shared = set(self.fabric.shared_levels())
            self._free = np.zeros(self._lat.shape[0])
        else:  # store-and-forward links; only the ring topology's are shared by these patterns
            self._free = np.zeros(2 * self.P) if self.fabric.topology == "ring" else None
        self._last_head = None if self._free is None else np.full(self._free.shape, -np.inf)
        # no shared link anywhere: every path is uncontended and costs a closed form (1e-15 relative to the
        # message-level engine's hop-by-hop sums, which only ties on shared links would need bit for bit)
        self._unshared = unshared_fabric(self.fabric)
        self._overtaken = False
        self._ops = None  # while a step is recorded for the event replay: its operations
        self.event_replays = 0
        self._R = np.arange(self.P, dtype=np.int64)
        self._R2 = np.concatenate((self._R, self._R))  # its slices are the rotations r -> (r + c) % P
        m = self.model  # frozen: the kinds that cost nothing on any rank, decided once
        self._free_kinds = {k for k, c in (("merge", m.merge_coeff_s), ("reduce", m.reduce_coeff_s),
                                           ("update", m.update_coeff_s)) if c == 0.0}
        self._classes = self._class_table() if self._unshared and isinstance(self.fabric, ClusterSpec) else None
        self._bases = {}  # id -> (read-only base, its flat view, its address): see _slice_of
        self._sec_cache = {}  # (kind, id(base)) -> (base, seconds of every element of the base)
        self._cost_cache = {}  # (id(route), id(base)) -> (route, base, per-class cost tables or None)

    def _slice_of(self, a):
        """(flat base, offset) when ``a`` is a contiguous 1-D slice of a read-only contiguous array (a program's
        table that cannot change under the engine, e.g. :func:`sim.comm.rounds.shifted_ring_rounds`' chunk sizes),
        so that elementwise functions of ``a`` are slices of the same function of the base, computed once; else
        None."""
        b = a.base
        if b is None or b.flags.writeable or not b.flags.c_contiguous or a.ndim != 1 or not a.flags.c_contiguous \
                or b.dtype != a.dtype:
            return None
        got = self._bases.get(id(b))
        if got is None or got[0] is not b:
            if len(self._bases) > 64:
                self._bases.clear()
            got = self._bases[id(b)] = (b, b.reshape(-1), b.__array_interface__["data"][0])
        off = (a.__array_interface__["data"][0] - got[2]) // a.itemsize
        return got[1], off

    def _class_table(self):
        """On an unshared cluster (no shared level, hence no fat tree: :meth:`ClusterSpec.shared_levels`) every
        link of a level has the same latency and bandwidth, so a message's (summed latency, 1 / slowest bandwidth)
        depends only on its class: 0 to itself, 1 inside its node, 2 to another node. Returns (G, node shift or
        None, L float array (3,), inv float array (3,)), L and inv computed by :meth:`_path_sums` (the expression
        every route of the class would take) on one representative route per class (a class the cluster
        lacks gets rank 0's self-route: never looked up)."""
        f = self.fabric
        G = f.gpus_per_node
        rep_d = np.array([0, 1 if G > 1 else 0, G if f.nodes > 1 else 0], dtype=np.int64)
        L, inv = self._path_sums(f.routes(np.zeros(3, dtype=np.int64), rep_d))
        shift = G.bit_length() - 1 if G & (G - 1) == 0 else None  # node = r >> shift for G a power of two
        return G, shift, L, inv

    def _path_sums(self, R):
        """(summed latency s, max 1 / bandwidth s/byte) of routes R (int array (m, 6), -1 = level not crossed):
        float arrays (m,), the levels in path order."""
        has = R >= 0
        return (np.where(has, self._lat[R], 0.0).sum(axis=1),
                np.where(has, 1.0 / self._bw[R], 0.0).max(axis=1))

    def _class_of(self, s, d, rot):
        """Class (:meth:`_class_table`) of each message s -> d (int arrays (m,)): int8 array (m,). rot: c when the
        round is the rotation r -> (r + c) % P of every rank (then the class is periodic in r with period G)."""
        G, shift, _, _ = self._classes
        if rot is not None and self.P % G == 0:  # rank r = node * G + l: the class depends on l alone
            loc = np.arange(G, dtype=np.int64)
            code = (((loc + rot) // G) % (self.P // G) != 0).astype(np.int8) + np.int8(rot != 0)
            return np.tile(code, self.P // G)
        if G == 1:
            return (s != d).view(np.int8) * np.int8(2)
        ns, nd = (s >> shift, d >> shift) if shift is not None else (s // G, d // G)
        return (s != d).view(np.int8) + (ns != nd).view(np.int8)

    @property
    def busy(self) -> np.ndarray:
        """Seconds per rank in compute / compress / comm, cumulative: float array (P, 3). A rank's clock only
        advances in a Compute or blocked in a round (or idle at :meth:`barrier`), so comm is the rest:
        ready - idle - compute - compress (equal to the message-level engine's sum of blocked spells)."""
        out = self._busy.T.copy()
        if self.messages:
            out[:, 2] = np.maximum(self.ready - self._idle - self._busy[0] - self._busy[1], 0.0)
        # else no message at all: comm is the reductions' compute alone (row 2), not the difference's rounding
        return out

    # -- compute ---------------------------------------------------------------------------
    def compute(self, kind: str, work, iteration: int) -> None:
        """Every rank computes ``work`` (scalar or (P,) array) of ``kind`` (:data:`sim.base.ops.COMPUTE_KINDS`)."""
        if kind in self._free_kinds:
            return  # costs nothing on any rank
        view = None
        if kind not in ("forward_backward", "select") and isinstance(work, np.ndarray) and work.shape[0] >= _SLICE_MIN:
            view = self._slice_of(work)
        if view is not None:  # a slice of a read-only table: the same slice of the table's seconds
            base, off = view
            got = self._sec_cache.get((kind, id(base)))
            if got is None or got[0] is not base:
                if len(self._sec_cache) > 64:
                    self._sec_cache.clear()
                got = self._sec_cache[(kind, id(base))] = (base, self.model.seconds_all(kind, base, self.P, iteration))
            sec = got[1][off:off + work.shape[0]]
        else:
            sec = self.model.seconds_all(kind, work, self.P, iteration)
        if np.ndim(sec) == 0 and sec == 0:
            return
        if self._ops is not None:  # recording for the event replay: the clock is left alone
            self._ops.append(("c", CATEGORY_OF_KIND[kind], sec))
            return
        self.ready = self.ready + sec
        self._busy[CATEGORY_OF_KIND[kind]] += sec

    def run(self, ops, iteration: int) -> None:
        """Interpret a vectorised program (:mod:`sim.comm.rounds`): each :class:`~sim.comm.rounds.Work` as
        :meth:`compute` at ``iteration``, each :class:`~sim.comm.rounds.Round` as :meth:`exchange`, in order.

        Runs of rounds that name their pattern (:attr:`~sim.comm.rounds.Round.pattern`) are evaluated whole where
        that gives the same bits: on a fabric with no shared link, rotations in compiled loops (a ring's rounds
        with their reduces, :func:`sim.engine._fast_numba.ring_run`; rotations of one size per round on a state
        periodic in the local index, folded to one node, :func:`sim.engine._fast_numba.rotations_folded`); on a
        fabric with shared links, a run of named rounds of scalar sizes that starts from the untouched state of a
        new engine (every clock 0, every link free at 0 and never used) is simulated once per process and fabric
        and reused (:data:`PHASES`: Ok-Topk's P - 1 rotations and SparCML's split rounds repeat for every k of a
        plan). Raises TypeError for anything else than Work and Round."""
        it = iter(ops)
        back = []  # an op pulled while collecting a run and not part of it: handled next
        while True:
            op = back.pop() if back else next(it, _END)
            if op is _END:
                return
            if isinstance(op, Round) and op.ring is not None and self._ops is None:
                after = self._ring_whole(op, it)
                if after is not None:  # evaluated whole; ``after``: the op after the ring
                    if after is not _END:
                        back.append(after)
                    continue
            if isinstance(op, Round) and op.pattern is not None and _scalar(op.nbytes) and self._ops is None:
                seg, after = self._collect(op, it)
                if after is not _END:
                    back.append(after)
                for x in seg[self._named_run(seg):]:  # what was not evaluated whole: one by one
                    self._one(x, iteration)
                continue
            self._one(op, iteration)

    def _one(self, op, iteration: int) -> None:
        """One op of a program: a Round as :meth:`exchange`, a Work as :meth:`compute`; TypeError otherwise."""
        if isinstance(op, Round):
            self.exchange(op.dst, op.src, op.nbytes)
        elif isinstance(op, Work):
            self.compute(op.kind, op.work, iteration)
        else:
            raise TypeError(f"{op!r} is not a sim.comm.rounds Work or Round")

    def _collect(self, first, it):
        """The ops of the run of named rounds of scalar sizes that starts with ``first``, pulled from ``it`` (a program
        is not held whole: a round of SparCML's P - 1 has arrays of its own); returns (the run's ops, the first op
        after it or _END). On a fabric with no shared link only rotations are taken (:meth:`_folded_rotations`); a
        run whose rounds hold more than :data:`_RUN_MAX_BYTES` of their own arrays is cut there (its pieces then go
        round by round). Rounds of array sizes (rings) are evaluated from their tables instead (:meth:`_ring_whole`)."""
        unshared = self._unshared

        def takes(op):
            return isinstance(op, Round) and op.pattern is not None and _scalar(op.nbytes) and not (
                unshared and not (isinstance(op.pattern, tuple) and op.pattern[0] == "rotation"))

        seg = [first]
        if not takes(first):
            return seg, _END
        held = 0
        while held <= _RUN_MAX_BYTES:  # (per round Python: Ok-Topk's P - 1 rounds are pulled here)
            op = next(it, _END)
            if not takes(op):
                return seg, op
            seg.append(op)
            d, s = op.dst, op.src  # the arrays the round owns (not views of a program's table), each once
            held += (d.nbytes if d.base is None else 0) + (s.nbytes if s is not d and s.base is None else 0)
        return seg, _END

    # -- runs of named rounds ---------------------------------------------------------------
    def _named_run(self, seg) -> int:
        """Evaluate ``seg``, a run of :meth:`_collect` (see :meth:`run`), whole if it can; returns how many of its ops
        were evaluated (all, or 0)."""
        if len(seg) < _RUN_MIN:
            return 0
        done = self._folded_rotations(seg) if self._unshared else self._memo_phase(seg)
        return len(seg) if done else 0

    def _kernels(self):
        from sim.base.optional import kernels

        return kernels("sim.engine._fast_numba")

    def _folded_rotations(self, rounds) -> bool:
        """Rotations of scalar sizes on a fabric with no shared link, from clocks periodic in the local index:
        every rank does the same operations as its local index on node 0, so the G clocks of node 0 are evolved
        alone (:func:`sim.engine._fast_numba.rotations_folded`) and tiled. ``rounds``: named rotations
        (:meth:`_collect` takes no other kind on such a fabric). False (nothing done) when the clocks are not
        periodic or numba is missing."""
        K = self._kernels()
        if K is None:
            return False
        f = self.fabric
        G = f.gpus_per_node if isinstance(f, ClusterSpec) else 1
        P = self.P
        fold = self.ready[:G]
        if G > 1 and not np.array_equal(self.ready.reshape(-1, G), np.broadcast_to(fold, (P // G, G))):
            return False
        if G == 1 and not bool(np.all(self.ready == self.ready[0])):
            return False
        shifts = np.array([r.pattern[1] for r in rounds], dtype=np.int64)
        if np.any((shifts < 1) | (shifts >= P)):
            return False
        nbs = np.array([int(r.nbytes) for r in rounds], dtype=np.int64)
        if isinstance(f, ClusterSpec):
            _, _, Lt, it = self._classes
        else:  # star / direct: every message the same path, in every class
            L, inv = self._flat_path()
            Lt, it = np.full(3, L), np.full(3, inv)
        cost = Lt[None, :] + nbs[:, None] * it[None, :]  # (rounds, 3): the L + n inv of _transfer, per class
        fold = fold.copy()
        K.rotations_folded(fold, shifts, P // G, cost)
        self.ready = np.tile(fold, P // G)
        self.messages += P * len(rounds)
        self.bytes += int(nbs.sum()) * P
        return True

    def _ring_whole(self, first, it):
        """A ring on a fabric with no shared link, from its table (``first.ring``, :class:`~sim.comm.rounds.RingTable`
        of :func:`sim.comm.rounds.shifted_ring_rounds`): every round with its reduce in one compiled loop
        (:func:`sim.engine._fast_numba.ring_run`, the same operations as :meth:`exchange` and :meth:`compute`, so
        the same bits), then the rest of the ring skipped in the program ``it`` (:data:`~sim.comm.rounds.SKIP_RING`,
        or drained where the program does not pass it on). Returns the op after the ring (or _END), or None when
        nothing was done (a shared fabric, fewer than :data:`_RUN_MIN` rounds, sizes not integers, a table not laid
        out as :class:`~sim.comm.rounds.RingTable` says, numba missing).
        Raises RuntimeError when the rounds are not the rotation the table names (a program bug)."""
        t = first.ring
        P = self.P
        rounds = t.send_at.shape[0]
        if not self._unshared or rounds < _RUN_MIN or not 1 <= t.c < P or t.sizes_b.dtype.kind not in "iu" \
                or t.elems.dtype.kind not in "iu" or t.sizes_b.shape != (2 * P,) or t.elems.shape != (2 * P,) \
                or not np.array_equal(t.sizes_b[:P], t.sizes_b[P:]) \
                or t.send_at.min() < 0 or t.send_at.max() > P or t.reduce_at.max() > P:
            return None  # (the kernel reads the size table wrapped, and slices past its ends would be cut short)
        K = self._kernels()
        if K is None:
            return None
        _, _, route, everyone, rot = self._cached_pattern(first.dst, first.src)  # (validates the matching)
        if rot != t.c or not everyone or first.pattern != ("rotation", t.c):
            raise RuntimeError(f"fast engine: a ring table of rotation {t.c} on rounds {first.pattern!r} that are "
                               "not that rotation (a program bug)")
        _, L, inv, _, _, _ = route  # per message (or scalars): the L + n inv of _transfer, element by element
        # every array a fresh writable copy: one compiled signature (numba types read-only arrays apart)
        lat = np.array(np.broadcast_to(L, (P,)), dtype=np.float64)
        inv_ = np.array(np.broadcast_to(inv, (P,)), dtype=np.float64)
        # ComputeModel.seconds_all("reduce", w) = reduce_coeff_s * w; a reduce that costs nothing is not charged
        work_at = np.full(rounds, -1, dtype=np.int64) if "reduce" in self._free_kinds else t.reduce_at
        ready = self.ready.copy()
        busy = self._busy[CATEGORY_OF_KIND["reduce"]].copy()
        # integer sizes as float64, the conversion numpy makes in nb * inv (exact below 2^53; vectorises)
        K.ring_run(ready, int(t.c), lat, inv_, t.sizes_b.astype(np.float64), np.array(t.send_at, dtype=np.int64),
                   float(self.model.reduce_coeff_s), t.elems.astype(np.float64), np.array(work_at, dtype=np.int64), busy)
        self.ready = ready
        self._busy[CATEGORY_OF_KIND["reduce"]] = busy
        self.messages += P * rounds
        csum = np.concatenate(([0], np.cumsum(t.sizes_b, dtype=np.int64)))  # exact: integer bytes
        self.bytes += int((csum[t.send_at + P] - csum[t.send_at]).sum())
        return self._skip_ring(first, it, rounds + int((t.reduce_at >= 0).sum()) - 1)

    @staticmethod
    def _skip_ring(first, it, left: int):
        """Move the program ``it`` past the ``left`` ops of the ring that follow ``first`` (just pulled from it):
        ``send(SKIP_RING)`` where ``it`` is a generator that passes it on to
        :func:`sim.comm.rounds.shifted_ring_rounds`, else by pulling them. Returns the op after the ring or _END;
        RuntimeError when an op pulled is not one of the ring's (a program that does not follow its own table)."""
        t = first.ring
        # a slice's base is the array that owns the memory (numpy collapses chains of views)
        sizes = t.sizes_b if t.sizes_b.base is None else t.sizes_b.base
        elems = t.elems if t.elems.base is None else t.elems.base

        def ours(op):  # one of the ring's rounds or reduces: a slice of its table
            return (isinstance(op, Round) and isinstance(op.nbytes, np.ndarray) and op.nbytes.base is sizes) or (
                isinstance(op, Work) and op.kind == "reduce" and isinstance(op.work, np.ndarray)
                and op.work.base is elems)

        if hasattr(it, "send"):
            try:
                op = it.send(SKIP_RING)
            except StopIteration:
                return _END
            if not ours(op):
                return op  # skipped: the op after the ring
            # a program that loops over the ring instead of delegating to it: the rest is pulled
        else:
            op = next(it, _END)
        while True:
            if not ours(op):
                raise RuntimeError("fast engine: a ring's program yielded an op that is not in its table "
                                   "(a program bug)")
            left -= 1
            if left == 0:
                return next(it, _END)
            op = next(it, _END)

    def _memo_phase(self, rounds) -> bool:
        """A run of named rounds of scalar sizes on a fabric with shared links, from the untouched state of a new
        engine: its result (clocks, link states, counts) from :data:`PHASES`, simulated there on first use. False
        (nothing done) when the state is not untouched."""
        P = self.P
        if self._free is None or not (bool(np.all(self.ready == 0.0)) and bool(np.all(self._free == 0.0))
                                      and bool(np.all(self._last_head == -np.inf))):
            return False
        sig = tuple((r.pattern, int(r.nbytes)) for r in rounds)
        got = PHASES.get(self.fabric, P, sig)
        if got is None:
            m0, b0 = self.messages, self.bytes
            for r in rounds:
                self.exchange(r.dst, r.src, r.nbytes)
            got = (self.ready.copy(), self._free.copy(), self._last_head.copy(), self.messages - m0,
                   self.bytes - b0, self._overtaken)
            PHASES.put(self.fabric, P, sig, got)  # (read-only from here: the engine's own arrays are new ones)
            return True
        ready, free, last_head, msgs, nbytes, overtaken = got
        self.ready, self._free, self._last_head = ready.copy(), free.copy(), last_head.copy()
        self.messages += msgs
        self.bytes += nbytes
        self._overtaken |= overtaken
        return True

    # -- communication ---------------------------------------------------------------------
    def exchange(self, dst, src, nbytes) -> None:
        """One round: rank r sends ``nbytes[r]`` bytes to ``dst[r]`` (-1: no send) and receives from ``src[r]``
        (-1: nothing). dst, src: int arrays (P,); nbytes: int array (P,) or an int for all.
        Raises RuntimeError if the round is not a matching (a receiver expecting another sender)."""
        if self._ops is not None:  # recording for the event replay: the clock is left alone
            self._ops.append(("x", dst, src, nbytes))
            return
        s, d, route, everyone, rot = self._cached_pattern(dst, src)
        if s.shape[0] == 0:
            return
        ready = self.ready
        if np.ndim(nbytes) == 0:
            nb = nbytes
            self.bytes += int(nbytes) * int(s.shape[0])
        else:
            nb = nbytes if everyone else nbytes[s]
            self.bytes += int(nb.sum())
        if rot is not None:  # r -> (r + c) % P for every r: the gathers are two slices each
            start = np.maximum(ready, np.concatenate((ready[rot:], ready[:rot])))
            arrive = self._transfer(s, nb, start, route)
            back = self.P - rot
            new = np.maximum(arrive, np.concatenate((arrive[back:], arrive[:back])))
        elif everyone:  # every rank sends one message and receives one: no gathers by s
            start = np.maximum(ready, np.take(ready, d))
            arrive = self._transfer(s, nb, start, route)
            new = np.maximum(arrive, np.take(arrive, src))
        else:
            start = np.maximum(ready[s], ready[d])
            arrive = self._transfer(s, nb, start, route)
            new = ready.copy()
            new[s] = arrive
            new[d] = np.maximum(new[d], arrive)
        self.ready = new
        self.messages += int(s.shape[0])

    def _cached_pattern(self, dst, src):
        """:meth:`_pattern` of (dst, src), kept for the last pair of array objects (a ring reuses its arrays every
        round)."""
        key = (id(dst), id(src))
        if key != self._cache_key or self._cache_obj[0] is not dst or self._cache_obj[1] is not src:
            self._cache_key, self._cache_obj = None, None
            self._cache = self._pattern(dst, src)
            self._cache_key, self._cache_obj = key, (dst, src)
        return self._cache

    def _sliced_cost(self, route, view, m):
        """L + n inv of an unshared route (:meth:`_route`) whose sizes n are the slice (flat base, offset) of a
        read-only table, from per-class tables of L_c + base inv_c built the second time the (route, base) pair is
        seen (the same elementwise operations, so the same bits); None before that."""
        base, off = view
        key = (id(route), id(base))
        got = self._cost_cache.get(key)
        if got is None or got[0] is not route or got[1] is not base:
            if len(self._cost_cache) > 64:
                self._cost_cache.clear()
            self._cost_cache[key] = (route, base, None)
            return None
        tables = got[2]
        if tables is None:
            _, L, inv, code, Lt, it = route
            if code is None:
                tables = (L + base * inv,)
            else:
                present = np.flatnonzero(np.bincount(code, minlength=Lt.shape[0]))
                per = [Lt[c] + base * it[c] for c in range(Lt.shape[0])]
                tables = ((code == present[1], per[present[0]], per[present[1]]) if present.shape[0] == 2
                          else (code, *per))
            self._cost_cache[key] = (route, base, tables)
        sl = slice(off, off + m)
        if len(tables) == 1:
            return tables[0][sl]
        if len(tables) == 3 and tables[0].dtype == bool:
            return np.where(tables[0], tables[2][sl], tables[1][sl])
        return np.choose(tables[0], [t[sl] for t in tables[1:]])

    def _pattern(self, dst, src):
        """(s, d, route, everyone, rot) of a round's (dst, src) (see :meth:`exchange`), built once per pattern:
        the senders s and their destinations d (int arrays (m,)), :meth:`_route`, whether every rank sends, and
        c when the round is the rotation r -> (r + c) % P of every rank (else None). Raises RuntimeError if the
        round is not a matching."""
        P = self.P
        bad = "fast engine: the round's sends and receives do not match (a pattern bug)"
        rot = None
        if int(np.count_nonzero(dst >= 0)) == P:  # everyone sends: s = 0..P-1, d = dst
            s, d = self._R, dst
            c = int(dst[0])
            if c < P and np.array_equal(dst, self._R2[c:c + P]):  # a rotation: its inverse is the only match
                if not np.array_equal(src, self._R2[P - c:2 * P - c]):
                    raise RuntimeError(bad)
                rot = c
            elif int(np.count_nonzero(src >= 0)) != P or not np.array_equal(np.take(src, dst), self._R):
                raise RuntimeError(bad)
        else:
            s = np.flatnonzero(dst >= 0)
            d = dst[s]
            if not np.array_equal(src[d], s) or int(np.count_nonzero(src >= 0)) != s.shape[0]:
                raise RuntimeError(bad)
        everyone = s.shape[0] == P
        if rot is not None and isinstance(self.fabric, ClusterSpec) and not self._unshared:
            return s, d, self._rotation_route(rot), everyone, rot
        return s, d, (self._route(s, d, rot) if s.shape[0] else None), everyone, rot

    def _rotation_route(self, c: int):
        """:meth:`_route` of the rotation by c (1 <= c < P) on this engine's shared ClusterSpec, from
        :data:`ROTATION_ROUTES` (built there on first use)."""
        got = ROTATION_ROUTES.get(self.fabric, self.P, c)
        if got is None:
            got = self._route(self._R, self._R2[c:c + self.P], c)
            ROTATION_ROUTES.put(self.fabric, self.P, c, got)
        return got

    def _flat_path(self):
        """(latency s, 1 / bandwidth s/byte) of every path on a star or direct NetworkSpec (no link shared): star,
        two store-and-forward hops; direct, one. float64 scalars."""
        f = self.fabric
        hops = 2 if f.topology == "star" else 1
        return np.float64(hops * f.link_latency_s), np.float64(hops / f.link_bandwidth_Bps)

    def _route(self, s, d, rot=None):
        """What :meth:`_transfer` needs of the messages s -> d (int arrays (m,)), built once per pattern:
        ("sum", latency sums, 1 / slowest bandwidths, class, L by class, inv by class) when no link is shared
        (scalars and no class when every message costs the same, else float arrays (m,) and the int8 classes of
        :meth:`_class_of`); for a ClusterSpec, per group of messages crossing the same levels, the :meth:`_plan`
        segments; for a ring topology, (direction, hops). rot: see :meth:`_class_of`."""
        f = self.fabric
        if self._unshared:  # no link is ever shared: a path costs its latencies plus n / its slowest bandwidth
            if isinstance(f, ClusterSpec):  # looked up by class: the values of _path_sums(f.routes(s, d))
                code = self._class_of(s, d, rot)
                _, _, Lt, it = self._classes
                c0 = int(code[0])
                if not np.any(code != c0):
                    return ("sum", Lt[c0], it[c0], None, None, None)
                return ("sum", np.take(Lt, code), np.take(it, code), code, Lt, it)
            return ("sum", *self._flat_path(), None, None, None)
        if isinstance(f, ClusterSpec):
            R = f.routes(s, d)
            sig = (R >= 0).astype(np.int64) @ (1 << np.arange(6, dtype=np.int64))  # which levels each message crosses
            present = np.flatnonzero(np.bincount(sig, minlength=64))  # (np.unique's values, by counting: O(m))
            if present.shape[0] == 1:
                return [(None, self._plan(R, s))]
            groups = [np.flatnonzero(sig == g) for g in present.tolist()]
            Rg = [R[gi] for gi in groups]
            shared_links = [r[:, lev] for r in Rg for lev in self._shared if (r[:, lev] >= 0).all()]
            allsh = np.concatenate(shared_links) if shared_links else np.empty(0, dtype=np.int64)
            if allsh.shape[0] and np.bincount(allsh).max() > 1:  # a link shared across groups: serve all together
                return [(None, self._plan(R, s))]
            return [(gi, self._plan(r, s[gi])) for gi, r in zip(groups, Rg)]
        P = self.P  # ring topology (star and direct are _unshared): shortest direction, ties clockwise; link ids cw = node, ccw = P + node
        cw = (d - s) % P
        step = np.where(cw <= P - cw, 1, -1)
        hops = np.where(step == 1, cw, P - cw)
        return step, hops

    def _plan(self, R, order):
        """The segments the messages with routes R (int array (m, 6), -1 = level not crossed) go through, in
        order, as :meth:`sim.machine.topology.ClusterSpec.path_plan` cuts each path: ``("run", k, L, inv)`` flushes the
        accumulated run of unshared links of messages k (None: all), ``("link", k, links, lat, bw, state)``
        is a shared level. Built once per route; evaluated every round by :meth:`_transfer`."""
        m = R.shape[0]
        pL, pinv = np.zeros(m), np.zeros(m)
        pend = np.zeros(m, dtype=bool)
        segs = []

        def sub(mask):
            k = np.flatnonzero(mask)
            return None if k.shape[0] == m else k

        def flush(mask):
            mask = mask & pend
            if mask.any():
                k = sub(mask)
                segs.append(("run", k, pL[mask].copy(), pinv[mask].copy()))
                pL[mask], pinv[mask], pend[mask] = 0.0, 0.0, False

        for lev in range(6):
            col = R[:, lev]
            has = col >= 0
            if not has.any():
                continue
            if lev not in self._shared:
                L = col[has]
                pL[has] = np.where(pend[has], pL[has] + self._lat[L], self._lat[L])
                pinv[has] = np.maximum(pinv[has], 1.0 / self._bw[L])
                pend[has] = True
                continue
            flush(has)
            links = col[has]
            per_link = np.bincount(links)  # messages on each link (np.unique's counts, by counting: O(m))
            state = "unique" if per_link.max() <= 1 else "fifo"
            if state == "fifo":  # every link with the same number of messages: a (links x messages) table
                counts = per_link[per_link > 0]
                if counts.min() == counts.max():
                    members = _by_link_then_sender(links, order[has]).reshape(-1, int(counts[0]))  # row: a link's messages
                    state = ("table", members, links[members[:, 0]])
            segs.append(("link", sub(has), links, self._lat[links], self._bw[links], state))
        flush(np.ones(m, dtype=bool))
        return segs

    def _fifo_table(self, members, row_links, hd, hold, tl):
        """:func:`_fifo` when every link of the segment carries the same number G of messages: ``members``
        (int array (links, G), positions by sender rank) and ``row_links`` (int array (links,)). Sorts each row by
        head time (stably, so ties keep the lower sender first) and runs Lindley's recursion over the G columns;
        the same operations as :func:`_fifo`, in fewer numpy calls. Returns (start, end) float arrays."""
        H = hd[members]
        pos = np.take_along_axis(members, np.argsort(H, axis=1, kind="stable"), axis=1)
        if np.any(hd[pos[:, 0]] <= self._last_head[row_links]):
            self._overtaken = True
        prev = self._free[row_links]
        st_all, en_all = np.empty(hd.shape), np.empty(hd.shape)
        for j in range(pos.shape[1]):
            p = pos[:, j]
            st = np.maximum(hd[p], prev)
            en = np.maximum(st + hold[p], tl[p])
            st_all[p], en_all[p] = st, en
            prev = en
        self._free[row_links] = prev
        self._last_head[row_links] = hd[pos[:, -1]]
        return st_all, en_all

    def _transfer(self, s, nb, start, route):
        """Arrival time of each message (float array (m,)) that leaves its sender at ``start``."""
        f = self.fabric
        if self._unshared:
            _, L, inv, code, Lt, it = route
            if np.ndim(nb) == 0:
                if code is not None:  # the same n for all: L + n inv per class, looked up
                    return start + np.take(Lt + nb * it, code)
            elif nb.shape[0] >= _SLICE_MIN:
                view = self._slice_of(nb)
                if view is not None:
                    cost = self._sliced_cost(route, view, nb.shape[0])
                    if cost is not None:
                        return start + cost
            return start + (L + nb * inv)
        if isinstance(f, ClusterSpec):  # pipelined links (sim.machine.topology), the message-level engine's arithmetic
            arrive = np.empty(start.shape)
            for gidx, segs in route:
                head = start if gidx is None else start[gidx]
                n = nb if (gidx is None or np.ndim(nb) == 0) else nb[gidx]
                order = s if gidx is None else s[gidx]
                tail = None  # nothing has crossed a link yet (-inf)
                for seg in segs:
                    k = seg[1]
                    if k is not None and tail is None:
                        tail = np.full(head.shape, -np.inf)
                    if k is None:
                        hd, tl, nn, oo = head, tail, n, order
                    else:
                        hd, tl, nn, oo = head[k], tail[k], (n[k] if np.ndim(n) else n), order[k]
                    if seg[0] == "run":  # = ClusterSpec.path_plan's run: t = head + (L + n inv), max with tail + L
                        L, inv = seg[2], seg[3]
                        en = hd + (L + nn * inv)
                        if tl is not None:
                            en = np.maximum(en, tl + L)
                        nh, nt = hd + L, en
                    else:
                        links, lat, bw, state = seg[2:]
                        hold = nn / bw
                        if tl is None:
                            tl = np.full(hd.shape, -np.inf)
                        if state == "unique":  # one message on each link this round
                            if np.any(hd <= self._last_head[links]):
                                self._overtaken = True
                            self._last_head[links] = hd
                            st = np.maximum(hd, self._free[links])
                            en = np.maximum(st + hold, tl)
                            self._free[links] = en
                        elif state == "fifo":
                            st, en, ov = _fifo(links, hd, np.broadcast_to(hold, hd.shape), tl, self._free, oo,
                                               self._last_head)
                            self._overtaken |= ov
                        else:  # _fifo on a regular table: each row a link, sorted by (head, sender) per round
                            st, en = self._fifo_table(state[1], state[2], hd, np.broadcast_to(hold, hd.shape), tl)
                        nh, nt = hd + ((st - hd) + lat), en + lat
                    if k is None:
                        head, tail = nh, nt
                    else:
                        head = head.copy() if head is start else head
                        head[k], tail[k] = nh, nt
                fin = np.where(tail > head, head + (tail - head), head)
                if gidx is None:
                    arrive = fin
                else:
                    arrive[gidx] = fin
            return arrive
        # ring topology: store-and-forward links (sim.machine.network), every one shared
        lat, bw = f.link_latency_s, f.link_bandwidth_Bps
        hold_all = np.broadcast_to(nb / bw, start.shape)
        t = start.copy()
        step, hops = route
        P = self.P
        for j in range(int(hops.max())):
            idx = np.flatnonzero(hops > j)
            node = (s[idx] + step[idx] * j) % P
            links = np.where(step[idx] == 1, node, P + node)
            hold = hold_all[idx]
            ti = t[idx]
            st, _, ov = _fifo(links, ti, hold, np.full(idx.shape, -np.inf), self._free, s[idx], self._last_head)
            self._overtaken |= ov
            t[idx] = ti + ((st - ti) + (lat + hold))
        return t

    # -- exactness under contention ---------------------------------------------------------
    def step(self, body) -> None:
        """Run ``body(self)`` (one iteration's computes and rounds) exactly.

        The rounds are evaluated vectorised; if on some shared link a message's head arrived before that of a
        message served ahead of it in an earlier round (an overtaking the round order cannot represent), the
        step is undone and replayed by :meth:`_event_replay`, a lean event-driven evaluation of the same
        recorded rounds in global time order. Either way the times are the message-level engine's."""
        snap = (self.ready.copy(), self._busy.copy(), self.messages, self.bytes,
                None if self._free is None else (self._free.copy(), self._last_head.copy()))
        self._overtaken = False
        body(self)  # vectorised, memory O(P): nothing is kept of the rounds
        if self._overtaken:  # undo, record the same rounds (memory O(messages)), replay them in time order
            self.ready, self._busy, self.messages, self.bytes = snap[0], snap[1], snap[2], snap[3]
            self._free[:], self._last_head[:] = snap[4]
            self._ops = []
            try:
                body(self)
                ops = self._ops
            finally:
                self._ops = None
            self.event_replays += 1
            self._event_replay(ops)

    def _event_replay(self, ops) -> None:
        """Evaluate recorded operations (``("c", category, seconds)`` and ``("x", dst, src, nbytes)``) message by
        message in global time order: rank r walks the list, adding its compute seconds and posting its part
        of each round it takes part in; a message starts when both ends have posted, crosses unshared links
        directly and waits in a heap for each shared link, which serves heads in time order (ties: lower
        sender first). Cost O(messages x log) in Python: used only when the vectorised rounds cannot be exact."""
        import heapq

        P = self.P
        f = self.fabric
        cluster = isinstance(f, ClusterSpec)
        free, last_head = self._free, self._last_head
        t = self.ready.copy()
        busy = self._busy.T  # a view: compute and compress columns (comm is derived)
        if cluster:
            lat_t, bw_t = self._lat.tolist(), self._bw.tolist()
        else:
            lat_r, bw_r = f.link_latency_s, f.link_bandwidth_Bps
        rounds = []  # per op: None for compute, else (dst list, src list, nbytes list, path per sender)
        for op in ops:
            if op[0] == "c":
                rounds.append(None)
                continue
            _, dst, src, nbytes = op
            snd = np.flatnonzero(dst >= 0)
            nb = np.broadcast_to(np.asarray(nbytes, dtype=np.int64), (P,))
            hops = {}
            if cluster:  # each path cut as ClusterSpec.path_plan cuts it: runs of unshared links, shared links
                R = f.routes(snd, dst[snd])
                for row, sr in zip(R.tolist(), snd.tolist()):
                    hops[sr] = f.plan_of_route(row)
            else:
                for sr in snd.tolist():
                    dr = int(dst[sr])
                    cw = (dr - sr) % P
                    stp, h = (1, cw) if cw <= P - cw else (-1, P - cw)
                    hops[sr] = [("link", (sr + stp * j) % P if stp == 1 else P + (sr + stp * j) % P) for j in range(h)]
            rounds.append((dst.tolist(), src.tolist(), nb.tolist(), hops))
            self.messages += int(snd.shape[0])
            self.bytes += int(nb[snd].sum())

        n_ops = len(ops)
        pos = [0] * P  # next op of each rank
        posted = [-1] * P  # op index a rank is blocked in, or -1
        post_t = [0.0] * P
        left = [0] * P  # parts (send, receive) of the current round not yet done
        done_t = [0.0] * P
        heap = []

        def hop_walk(sr, dr, i, k, head, tail, nbytes):
            """Carry message sr -> dr of op i from hop k (head and tail times) until a shared link or the end."""
            path = rounds[i][3][sr]
            while k < len(path):
                seg = path[k]
                if cluster and seg[0] == "run":  # the message-level engine's arithmetic for a run
                    _, L, inv, _ = seg
                    t = head + (L + nbytes * inv)
                    if tail + L > t:
                        t = tail + L
                    head, tail = head + L, t
                    k += 1
                    continue
                heapq.heappush(heap, (head, sr, i, k, tail, dr, nbytes))
                return
            arrive = (head + (tail - head) if tail > head else head) if cluster else head
            finish(sr, arrive)
            finish(dr, arrive)

        def start_msg(sr, dr, i, t0):
            hop_walk(sr, dr, i, 0, t0, -np.inf, rounds[i][2][sr])  # (star and direct are never replayed)

        def finish(r, when):
            if when > done_t[r]:
                done_t[r] = when
            left[r] -= 1
            if left[r] == 0:
                t[r] = done_t[r]
                posted[r] = -1
                advance(r)

        def advance(r):
            """Run rank r's computes up to its next round; post its part there."""
            i = pos[r]
            while i < n_ops:
                rd = rounds[i]
                if rd is None:
                    _, cat, sec = ops[i]
                    x = sec if np.ndim(sec) == 0 else float(sec[r])
                    t[r] += x
                    busy[r, cat] += x
                    i += 1
                    continue
                dst, src = rd[0][r], rd[1][r]
                if dst < 0 and src < 0:
                    i += 1
                    continue
                pos[r] = i + 1
                posted[r], post_t[r], done_t[r] = i, t[r], t[r]
                left[r] = (dst >= 0) + (src >= 0)
                if dst >= 0 and posted[dst] == i:
                    start_msg(r, dst, i, max(t[r], post_t[dst]))
                if src >= 0 and posted[src] == i:
                    start_msg(src, r, i, max(t[r], post_t[src]))
                return
            pos[r] = n_ops

        for r in range(P):
            advance(r)
        while heap:
            head, sr, i, k, tail, dr, nbytes = heapq.heappop(heap)
            L = rounds[i][3][sr][k][1]
            start = head if head >= free[L] else free[L]
            last_head[L] = head
            if cluster:
                end = start + nbytes / bw_t[L]
                if tail > end:
                    end = tail
                free[L] = end
                hop_walk(sr, dr, i, k + 1, head + ((start - head) + lat_t[L]), end + lat_t[L], nbytes)
            else:  # store and forward
                hold = nbytes / bw_r
                free[L] = start + hold
                hop_walk(sr, dr, i, k + 1, head + ((start - head) + (lat_r + hold)), -np.inf, nbytes)
        if any(p_ != n_ops for p_ in pos) or any(x >= 0 for x in posted):
            raise RuntimeError("fast engine: event replay ended with ranks still waiting (a pattern bug)")
        self.ready = t

    def barrier(self) -> float:
        """Every rank waits for the slowest (the start of a synchronous iteration); returns that time (s)."""
        t = float(self.ready.max())
        self._idle += t - self.ready
        self.ready = np.full(self.P, t)
        return t


# ----------------------------------------------------------------------------- iterations


def fast_collective(eng: FastCluster, spec: AlgorithmSpec, d: int, it: int, G: int = 1) -> None:
    """Run ``spec``'s exchange (selection and collective) on every rank of ``eng`` in timing-only terms (the sizes
    of :func:`sim.engine.timing.timing_program`: dense messages of d values, sparse selections of exactly k entries,
    every merge keeping k), by the algorithm's :meth:`~sim.algorithms.Algorithm.fast_rounds` (data, interpreted by
    :meth:`FastCluster.run`). G: ranks per node for the hierarchical collectives. Raises ConfigError if ``spec.segments`` is set (layer-wise timing is done by
    the iteration timeline, sim/engine/timeline.py) or the algorithm has no timing-only form (fast_rounds)."""
    spec.require_whole_model("the fast engine (sim.engine.fastsim)")
    eng.run(spec.algorithm.fast_rounds(spec, eng.P, d, it, G), it)


def fast_iteration(eng: FastCluster, spec: AlgorithmSpec, d: int, batch_size: int, it: int, G: int = 1) -> None:
    """One timing-only S-SGD iteration on every rank, the operations of :func:`sim.engine.timing.timing_program`:
    forward_backward, the exchange (selection for sparse algorithms, the collective), update."""
    eng.compute("forward_backward", batch_size, it)
    fast_collective(eng, spec, d, it, G)
    eng.compute("update", d, it)
