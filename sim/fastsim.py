"""The fast engine: one simulated S-SGD iteration for thousands of ranks, a vectorised round at a time.

The message-level engine (:mod:`sim.cluster`, SimPy) moves every message through the network as an event:
the dense ring at P = 1024 is 2.1M messages and takes minutes. This engine evaluates a collective a whole
*round* at a time with numpy over all P ranks, using the same communication patterns as the per-rank
programs: the schedules of :mod:`sim.collectives` (``ring_schedule``, ``rd_schedule``, ``bruck_schedule``,
``binomial_reduce_schedule``, ``binomial_bcast_schedule``) are written once and evaluated here on an array
of ranks, there on one rank. Memory is O(P) per round.

Model (the same rules as the message-level engine):

- each rank has a clock ``ready[r]``; a Compute costs :meth:`sim.compute.ComputeModel.seconds_all`;
- a message from s to d starts when both have posted (rendezvous): ``max(ready[s], ready[d])``;
- it crosses its route's links (:meth:`sim.topology.ClusterSpec.routes`) store-and-forward: each hop takes
  ``latency + n / bandwidth`` after the link falls free; a link serves messages FIFO in order of arrival;
- a sender is done when its message has arrived, a receiver when the message it waits for has arrived, a
  rank that both sends and receives (SendRecv) when both are done.

Exactness. In every pattern here a rank sends at most one message and receives at most one per round, so a
link that only one rank's sends (its GPU port, its own NIC) or only one rank's receives use is never
contended: for those the engine adds the hop delays and equals the message-level engine to rounding
(tested at 1e-9 relative, with jitter and stragglers). Links shared by several ranks (a NIC shared by the
GPUs of a node, leaf uplinks, PCIe ports carrying intra- and inter-node traffic, the links of a ring
topology) are served FIFO within a round, in order of arrival (ties: lower sending rank first), starting
from where the previous round left the link. The approximation: a message of round r+1 that would reach
a shared link before a late message of round r is served after it here (the message-level engine serves
it first). ``tests/test_fastsim.py`` measures the difference on a grid of P <= 64, sizes and presets.
With ``quantum_s > 0`` use the message-level engine.
"""
from __future__ import annotations

import numpy as np

from . import collectives as C
from .algorithms import AlgorithmSpec
from .cluster import CATEGORY_OF_KIND
from .compute import ComputeModel
from .errors import ConfigError, SparsimError, check_range
from .network import NetworkSpec
from .topology import ClusterSpec

__all__ = ["FastCluster", "fast_iteration", "simulate_timing_fast", "as_cluster"]


def as_cluster(network, P: int):
    """The fabric of ``network`` for P ranks: a :class:`ClusterSpec` (a star NetworkSpec is the flat cluster
    gpus_per_node = 1 with the same two hops), or the NetworkSpec itself for ``direct`` and ``ring``.
    Raises ConfigError for quantum_s > 0 (not modelled here) or a ClusterSpec of another size."""
    if isinstance(network, ClusterSpec):
        if network.P != P:
            raise ConfigError(f"P = {P} but the cluster has {network.nodes} x {network.gpus_per_node} = "
                              f"{network.P} ranks: valid P = nodes x gpus_per_node")
        return network
    if not isinstance(network, NetworkSpec):
        raise SparsimError(f"network = {network!r} is invalid: valid NetworkSpec or ClusterSpec")
    if network.quantum_s > 0:
        raise ConfigError(f"quantum_s = {network.quantum_s} is not modelled by the fast engine: valid quantum_s = 0, "
                          "or engine = message")
    if network.topology == "star":
        return ClusterSpec(P, 1, "nvswitch", inter_alpha_s=2 * network.link_latency_s,
                           inter_bandwidth_Bps=network.link_bandwidth_Bps / 2, name="star")
    return network


def _fifo(links, t, hold, free, order):
    """Serve messages on links FIFO: message i reaches link ``links[i]`` at ``t[i]`` and holds it ``hold[i]``;
    the link is free from ``free[link]``. Returns each message's start time (float array) and updates
    ``free``. Within a link, messages are served in order of (t, order). Lindley's recursion
    start_i = max(t_i, start_{i-1} + hold_{i-1}) evaluated as a segmented running maximum."""
    o = np.lexsort((order, t, links))
    lk, ts, h = links[o], t[o], hold[o]
    m = lk.shape[0]
    first = np.ones(m, dtype=bool)
    first[1:] = lk[1:] != lk[:-1]
    x = ts.copy()
    x[first] = np.maximum(x[first], free[lk[first]])
    gid = np.cumsum(first) - 1
    cs = np.cumsum(h) - h
    S = cs - cs[first][gid]  # holds of the earlier messages of the same link
    y = x - S
    starts = np.flatnonzero(first)
    longest = int(np.max(np.diff(np.append(starts, m))))
    k = 1
    while k < longest:  # Hillis-Steele segmented running max
        same = gid[k:] == gid[:-k]
        y[k:] = np.where(same, np.maximum(y[k:], y[:-k]), y[k:])
        k <<= 1
    start = np.where(first, x, y + S)
    last = np.ones(m, dtype=bool)
    last[:-1] = lk[1:] != lk[:-1]
    free[lk[last]] = start[last] + h[last]
    out = np.empty(m)
    out[o] = start
    return out


class FastCluster:
    """P simulated ranks advanced a round at a time (see the module docstring).

    P: int >= 1. network: a :class:`~sim.network.NetworkSpec` (quantum_s = 0) or a
    :class:`~sim.topology.ClusterSpec` with P ranks. compute: a :class:`~sim.compute.ComputeModel`
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
        self.busy = np.zeros((self.P, 3))
        self.messages = 0
        self.bytes = 0
        self._cache_key = None
        if isinstance(self.fabric, ClusterSpec):
            self._lat, self._bw, _ = self.fabric.link_table()
            self._inv_bw = 1.0 / self._bw
            self._shared = set(self.fabric.shared_levels())
            self._free = np.zeros(self._lat.shape[0])
        else:
            f = self.fabric
            self._free = np.zeros(2 * self.P) if f.topology == "ring" else None

    # -- compute ---------------------------------------------------------------------------
    def compute(self, kind: str, work, iteration: int) -> None:
        """Every rank computes ``work`` (scalar or (P,) array) of ``kind`` (:data:`sim.ops.COMPUTE_KINDS`)."""
        sec = self.model.seconds_all(kind, work, self.P, iteration)
        if np.ndim(sec) == 0 and sec == 0:
            return
        self.ready = self.ready + sec
        self.busy[:, CATEGORY_OF_KIND[kind]] += sec

    # -- communication ---------------------------------------------------------------------
    def exchange(self, dst, src, nbytes) -> None:
        """One round: rank r sends ``nbytes[r]`` bytes to ``dst[r]`` (-1: no send) and receives from ``src[r]``
        (-1: nothing). dst, src: int arrays (P,); nbytes: int array (P,) or an int for all.
        Raises RuntimeError if the round is not a matching (a receiver expecting another sender)."""
        key = (id(dst), id(src))
        if key != self._cache_key or self._cache_obj[0] is not dst or self._cache_obj[1] is not src:
            s = np.flatnonzero(dst >= 0)
            d = dst[s]
            if not np.array_equal(src[d], s) or int(np.count_nonzero(src >= 0)) != s.shape[0]:
                raise RuntimeError("fast engine: the round's sends and receives do not match (a pattern bug)")
            self._cache_key, self._cache_obj = key, (dst, src)
            self._cache = (s, d, self._route(s, d))
        s, d, route = self._cache
        if s.shape[0] == 0:
            return
        nb = np.broadcast_to(np.asarray(nbytes, dtype=np.int64), (self.P,))[s]
        ready = self.ready
        start = np.maximum(ready[s], ready[d])
        arrive = self._transfer(s, nb, start, route)
        new = ready.copy()
        new[s] = arrive
        new[d] = np.maximum(new[d], arrive)
        self.busy[:, 2] += new - ready
        self.ready = new
        self.messages += int(s.shape[0])
        self.bytes += int(nb.sum())

    def _route(self, s, d):
        f = self.fabric
        if isinstance(f, ClusterSpec):
            R = f.routes(s, d)
            segs = []  # runs of uncontended levels (summed) and single shared levels, in path order
            lat_acc = np.zeros(s.shape[0])
            inv_acc = np.zeros(s.shape[0])
            plain = False
            for lev in range(6):
                col = R[:, lev]
                if not (col >= 0).any():
                    continue
                if lev in self._shared:
                    if plain:
                        segs.append(("sum", lat_acc, inv_acc))
                        lat_acc, inv_acc, plain = np.zeros(s.shape[0]), np.zeros(s.shape[0]), False
                    idx = np.flatnonzero(col >= 0)
                    segs.append(("fifo", idx, col[idx]))
                else:
                    has = col >= 0
                    lat_acc = lat_acc + np.where(has, self._lat[col], 0.0)
                    inv_acc = inv_acc + np.where(has, self._inv_bw[col], 0.0)
                    plain = True
            if plain:
                segs.append(("sum", lat_acc, inv_acc))
            return segs
        if f.topology == "direct":
            return None
        P = self.P  # ring topology: shortest direction, ties clockwise; link ids cw = node, ccw = P + node
        cw = (d - s) % P
        step = np.where(cw <= P - cw, 1, -1)
        hops = np.where(step == 1, cw, P - cw)
        return step, hops

    def _transfer(self, s, nb, start, route):
        f = self.fabric
        t = start.copy()
        if isinstance(f, ClusterSpec):
            for seg in route:
                if seg[0] == "sum":
                    t = t + (seg[1] + nb * seg[2])
                else:
                    idx, links = seg[1], seg[2]
                    hold = nb[idx] / self._bw[links]
                    st = _fifo(links, t[idx], hold, self._free, s[idx])
                    t[idx] = st + (self._lat[links] + hold)
            return t
        lat, bw = f.link_latency_s, f.link_bandwidth_Bps
        hold_all = nb / bw
        if f.topology == "direct":
            return t + (lat + hold_all)
        step, hops = route
        P = self.P
        for j in range(int(hops.max())):
            idx = np.flatnonzero(hops > j)
            node = (s[idx] + step[idx] * j) % P
            links = np.where(step[idx] == 1, node, P + node)
            hold = hold_all[idx]
            st = _fifo(links, t[idx], hold, self._free, s[idx])
            t[idx] = st + (lat + hold)
        return t

    def barrier(self) -> float:
        """Every rank waits for the slowest (the start of a synchronous iteration); returns that time (s)."""
        t = float(self.ready.max())
        self.ready = np.full(self.P, t)
        return t


# ----------------------------------------------------------------------------- the collectives, vectorised


def _split_sizes(total, parts: int, c):
    """Elements of chunk ``c`` when ``total`` elements are cut by ``np.array_split`` into ``parts``."""
    return total // parts + (c < total % parts)


def _mapper(valid_base, scale, offset):
    """Position -> rank map for a group on every rank at once: rank = pos * scale + offset, -1 stays -1."""
    def to_rank(p):
        return np.where(p >= 0, p * scale + offset, -1)
    return to_rank


def _ring(eng, steps, to_rank, size_of, vb, it):
    mapped = {}
    for dst, src, send_c, recv_c, reduce in steps:
        key = id(dst)
        if key not in mapped:
            mapped[key] = (dst, to_rank(dst), to_rank(src))
        _, gd, gs = mapped[key]
        eng.exchange(gd, gs, size_of(send_c) * vb)
        if reduce:
            eng.compute("reduce", size_of(recv_c), it)


def _binomial(eng, schedule, to_rank, nbytes_of, merge_work, it):
    for mask, dst, src in schedule:
        eng.exchange(to_rank(dst), to_rank(src), nbytes_of(mask, dst))
        if merge_work:
            eng.compute("merge", np.where(src >= 0, merge_work, 0), it)


def _gtopk_rd(eng, pos, n, to_rank, k, s_el, b, it, active=None):
    for phase, dst, src in C.rd_schedule(pos, n):
        if active is not None:
            dst, src = np.where(active, dst, -1), np.where(active, src, -1)
        nb = k * s_el + (b if phase == "unfold" else 0)
        eng.exchange(to_rank(dst), to_rank(src), nb)
        if phase == "fold":
            eng.compute("merge", np.where(src >= 0, 2 * k, 0), it)
        elif phase == "exchange":
            eng.compute("merge", np.where(dst >= 0, 2 * k, 0), it)


def fast_collective(eng: FastCluster, spec: AlgorithmSpec, d: int, it: int, G: int = 1) -> None:
    """Run ``spec``'s collective on every rank of ``eng`` in timing-only terms (the sizes of
    :func:`sim.timing.timing_program`: dense messages of d values, sparse selections of exactly k entries,
    every merge keeping k). G: ranks per node for the hierarchical collectives."""
    P = eng.P
    R = np.arange(P, dtype=np.int64)
    ident = _mapper(None, 1, 0)
    vb, ib = spec.value_bytes, spec.index_bytes
    s_el = vb + ib
    coll = spec.collective
    if spec.name == "dense":
        if coll == "ring":
            _ring(eng, C.ring_schedule(R, P), ident, lambda c: _split_sizes(d, P, c), vb, it)
        elif coll == "recursive_doubling":
            for phase, dst, src in C.rd_schedule(R, P):
                eng.exchange(dst, src, d * vb)
                if phase == "fold":
                    eng.compute("reduce", np.where(src >= 0, d, 0), it)
                elif phase == "exchange":
                    eng.compute("reduce", np.where(dst >= 0, d, 0), it)
        elif coll == "hierarchical":
            local, node = R % G, R // G
            N = P // G
            intra = _mapper(None, 1, node * G)
            steps = list(C.ring_schedule(local, G))
            _ring(eng, steps[:G - 1], intra, lambda c: _split_sizes(d, G, c), vb, it)
            own = _split_sizes(d, G, (local + 1) % G)
            _ring(eng, C.ring_schedule(node, N), _mapper(None, G, local), lambda c: _split_sizes(own, N, c), vb, it)
            _ring(eng, steps[G - 1:], intra, lambda c: _split_sizes(d, G, c), vb, it)
        else:
            raise SparsimError(f"collective = {coll!r} has no timing-only mode: valid ring, recursive_doubling, hierarchical")
        return
    k = spec.k
    m = k * s_el
    if spec.name in ("topk", "randk"):
        if coll == "hierarchical":
            local, node = R % G, R // G
            N = P // G
            intra = _mapper(None, 1, node * G)
            _binomial(eng, C.binomial_reduce_schedule(local, G), intra,
                      lambda mask, dst: np.minimum(mask, G - local) * m, 0, it)
            leader = local == 0
            for dst, src, cnt in C.bruck_schedule(node, N):
                eng.exchange(np.where(leader, dst * G, -1), np.where(leader, src * G, -1), cnt * G * m)
            _binomial(eng, C.binomial_bcast_schedule(local, G), intra, lambda mask, dst: P * m, 0, it)
        else:
            for dst, src, cnt in C.bruck_schedule(R, P):
                eng.exchange(dst, src, cnt * m)
        eng.compute("reduce", P * k, it)
        return
    b = C.mask_nbytes(k) if spec.mask == "exact" else 0
    if coll == "tree":
        _binomial(eng, C.binomial_reduce_schedule(R, P), ident, lambda mask, dst: m, 2 * k, it)
        _binomial(eng, C.binomial_bcast_schedule(R, P), ident, lambda mask, dst: m + b, 0, it)
    elif coll == "recursive_doubling":
        _gtopk_rd(eng, R, P, ident, k, s_el, b, it)
    elif coll == "hierarchical":
        local, node = R % G, R // G
        N = P // G
        intra = _mapper(None, 1, node * G)
        _binomial(eng, C.binomial_reduce_schedule(local, G), intra, lambda mask, dst: m, 2 * k, it)
        _gtopk_rd(eng, node, N, _mapper(None, G, 0), k, s_el, b, it, active=local == 0)
        _binomial(eng, C.binomial_bcast_schedule(local, G), intra, lambda mask, dst: m + b, 0, it)
    else:
        raise SparsimError(f"collective = {coll!r} is unknown for {spec.name}")


def fast_iteration(eng: FastCluster, spec: AlgorithmSpec, d: int, batch_size: int, it: int, G: int = 1) -> None:
    """One timing-only S-SGD iteration on every rank, the operations of :func:`sim.timing.timing_program`:
    forward_backward, select (sparse), the collective, update."""
    eng.compute("forward_backward", batch_size, it)
    if spec.name != "dense":
        eng.compute("select", d, it)
    fast_collective(eng, spec, d, it, G)
    eng.compute("update", d, it)


def simulate_timing_fast(spec: AlgorithmSpec, P: int, d: int, *, network, compute: ComputeModel | None = None,
                         batch_size: int = 1, iterations: int = 1):
    """:func:`sim.timing.simulate_timing` on the fast engine; returns a :class:`sim.timing.TimingResult`.

    Every iteration starts with all ranks together (synchronous S-SGD). Memory O(P). Raises SparsimError /
    ConfigError for bad P, d, k or iterations, and for a hierarchical collective on a flat network."""
    from .timing import TimingResult

    check_range("P", P, 1)
    check_range("d", d, 1)
    check_range("iterations", iterations, 1)
    spec.check_dim(d)
    eng = FastCluster(P, network, compute)
    G = eng.fabric.gpus_per_node if isinstance(eng.fabric, ClusterSpec) else 1
    if spec.collective == "hierarchical" and G == 1 and not isinstance(eng.fabric, ClusterSpec):
        G = 1
    times = []
    for it in range(iterations):
        t0 = eng.barrier()
        fast_iteration(eng, spec, d, batch_size, it + 1, G)
        times.append(float(eng.ready.max()) - t0)
    b0 = eng.busy[0] / iterations
    return TimingResult(np.asarray(times), float(b0[0]), float(b0[1]), float(b0[2]),
                        eng.messages // iterations, eng.bytes // iterations)
