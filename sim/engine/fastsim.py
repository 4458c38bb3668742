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
"""
from __future__ import annotations

import numpy as np

from sim.comm.rounds import Round, Work
from sim.algorithms import AlgorithmSpec
from sim.engine.cluster import CATEGORY_OF_KIND
from sim.machine.compute import ComputeModel
from sim.base.errors import ConfigError, SparsimError, check_range
from sim.machine.network import NetworkSpec
from sim.machine.topology import ClusterSpec

__all__ = ["FastCluster", "fast_iteration", "fast_collective", "as_cluster",
           "fast_engine_refusal"]


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
        self._unshared = (not self.fabric.shared_levels() if isinstance(self.fabric, ClusterSpec)
                          else self.fabric.topology in ("star", "direct"))
        self._overtaken = False
        self._ops = None  # while a step is recorded for the event replay: its operations
        self.event_replays = 0

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
        m = self.model
        if {"merge": m.merge_coeff_s, "reduce": m.reduce_coeff_s, "update": m.update_coeff_s}.get(kind, 1.0) == 0.0:
            return  # costs nothing on any rank
        sec = m.seconds_all(kind, work, self.P, iteration)
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
        Raises TypeError for anything else."""
        for op in ops:
            if isinstance(op, Round):
                self.exchange(op.dst, op.src, op.nbytes)
            elif isinstance(op, Work):
                self.compute(op.kind, op.work, iteration)
            else:
                raise TypeError(f"{op!r} is not a sim.comm.rounds Work or Round")

    # -- communication ---------------------------------------------------------------------
    def exchange(self, dst, src, nbytes) -> None:
        """One round: rank r sends ``nbytes[r]`` bytes to ``dst[r]`` (-1: no send) and receives from ``src[r]``
        (-1: nothing). dst, src: int arrays (P,); nbytes: int array (P,) or an int for all.
        Raises RuntimeError if the round is not a matching (a receiver expecting another sender)."""
        if self._ops is not None:  # recording for the event replay: the clock is left alone
            self._ops.append(("x", dst, src, nbytes))
            return
        key = (id(dst), id(src))
        if key != self._cache_key or self._cache_obj[0] is not dst or self._cache_obj[1] is not src:
            s = np.flatnonzero(dst >= 0)
            d = dst[s]
            if not np.array_equal(src[d], s) or int(np.count_nonzero(src >= 0)) != s.shape[0]:
                raise RuntimeError("fast engine: the round's sends and receives do not match (a pattern bug)")
            self._cache_key, self._cache_obj = key, (dst, src)
            self._cache = (s, d, self._route(s, d), s.shape[0] == self.P)
        s, d, route, everyone = self._cache
        if s.shape[0] == 0:
            return
        ready = self.ready
        if np.ndim(nbytes) == 0:
            nb = nbytes
            self.bytes += int(nbytes) * int(s.shape[0])
        else:
            nb = nbytes if everyone else nbytes[s]
            self.bytes += int(nb.sum())
        if everyone:  # every rank sends one message and receives one: no gathers by s
            start = np.maximum(ready, ready[d])
            arrive = self._transfer(s, nb, start, route)
            new = np.maximum(arrive, arrive[src])
        else:
            start = np.maximum(ready[s], ready[d])
            arrive = self._transfer(s, nb, start, route)
            new = ready.copy()
            new[s] = arrive
            new[d] = np.maximum(new[d], arrive)
        self.ready = new
        self.messages += int(s.shape[0])

    def _route(self, s, d):
        """What :meth:`_transfer` needs of the messages s -> d (int arrays (m,)), built once per pattern:
        ("sum", latency sums, 1 / slowest bandwidths) when no link is shared; for a ClusterSpec, per group of
        messages crossing the same levels, the :meth:`_plan` segments; for a ring topology, (direction, hops)."""
        f = self.fabric
        if self._unshared:  # no link is ever shared: a path costs its latencies plus n / its slowest bandwidth
            if isinstance(f, ClusterSpec):
                R = f.routes(s, d)
                has = R >= 0
                L = np.where(has, self._lat[R], 0.0).sum(axis=1)
                inv = np.where(has, 1.0 / self._bw[R], 0.0).max(axis=1)
            else:  # star: two store-and-forward hops; direct: one
                hops = 2 if f.topology == "star" else 1
                L = np.full(s.shape, hops * f.link_latency_s)
                inv = np.full(s.shape, hops / f.link_bandwidth_Bps)
            return ("sum", L, inv)
        if isinstance(f, ClusterSpec):
            R = f.routes(s, d)
            sig = ((R >= 0) * (1 << np.arange(6))).sum(axis=1)  # which levels each message crosses
            groups = [np.flatnonzero(sig == g) for g in np.unique(sig).tolist()]
            shared_links = [R[gi][:, lev] for gi in groups for lev in self._shared if (R[gi][:, lev] >= 0).all()]
            allsh = np.concatenate(shared_links) if shared_links else np.empty(0, dtype=np.int64)
            if len(groups) > 1 and np.unique(allsh).shape[0] < allsh.shape[0]:
                groups = [np.arange(s.shape[0])]  # a link shared across groups: serve all messages together
            return [(None if gi.shape[0] == s.shape[0] else gi, self._plan(R[gi], s[gi])) for gi in groups]
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
            state = "unique" if np.unique(links).shape[0] == links.shape[0] else "fifo"
            if state == "fifo":  # every link with the same number of messages: a (links x messages) table
                pos = np.lexsort((order[has], links))
                _, counts = np.unique(links[pos], return_counts=True)
                if counts.min() == counts.max():
                    members = pos.reshape(-1, int(counts[0]))  # row: one link's messages, by sender rank
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
            _, L, inv = route
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
