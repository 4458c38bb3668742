"""Collectives, each written once as a per-rank sans-I/O generator (see :mod:`sim.base.ops`).

Every collective here is a generator ``f(rank, P, ...)`` that yields :class:`~sim.base.ops.Send`,
:class:`~sim.base.ops.Recv`, :class:`~sim.base.ops.SendRecv` and :class:`~sim.base.ops.Compute` operations and
returns its result. The same code runs under the lock-step driver (no clock), the SimPy cluster
(alpha-beta network) and torch.distributed (point-to-point). All work for any P >= 1.

Costs: alpha = per-message latency (s), beta = s/byte, n = bytes, lg = log2, pof2 = the largest
power of two <= P, rem = P - pof2, s = value_bytes + index_bytes per sparse element. The
closed forms (functions in :mod:`sim.comm.costs`) are the time on a contention-free network with the
rendezvous semantics of :mod:`sim.base.ops` and zero compute cost; they reduce to the formulas of
Thakur, Rabenseifner and Gropp (2005) / docs/costs.md when P is a power of two.
"""
from __future__ import annotations

from dataclasses import dataclass


import numpy as np

from sim.base.optional import kernels
from sim.comm.compression import Sparse, merge
from sim.base.ops import Compute, Recv, Send, SendRecv

__all__ = [
    "ring_allreduce",
    "rd_allreduce",
    "bruck_allgather",
    "topk_allgather_sum",
    "sparse_sum",
    "gtopk_tree",
    "gtopk_rd",
    "GTopKResult",
    "pof2_split",
    "mask_nbytes",
    "hier_allreduce",
    "hier_topk_allgather_sum",
    "hier_allgather",
    "hier_gtopk",
    "ring_schedule",
    "rd_schedule",
    "bruck_schedule",
    "binomial_reduce_schedule",
    "binomial_bcast_schedule",
]


def pof2_split(P: int) -> tuple[int, int]:
    """(pof2, rem): the largest power of two <= P and P - pof2 (P >= 1)."""
    pof2 = 1 << (int(P).bit_length() - 1)
    return pof2, P - pof2


def mask_nbytes(m: int) -> int:
    """Bytes of a survival bitmask over m sparse entries: ceil(m / 8)."""
    return (int(m) + 7) // 8


# ----------------------------------------------------------------------------- communication patterns
#
# Who sends to whom, written once. Each schedule below is a generator over the rounds of one pattern; a
# round says, per rank, whom it sends to (``dst``, -1 for nobody) and whom it receives from (``src``,
# -1 for nobody). ``rank`` is either one rank (a Python int: the per-rank programs below iterate it) or an
# int64 array of ranks (the vectorised fast engine, :mod:`sim.engine.fastsim`, evaluates a whole round for every
# rank at once). The arithmetic is written with operators that mean the same on both, and
# :func:`_where` / :func:`_not` for the branches.


def _where(cond, a, b):
    """``a if cond else b`` for a Python bool, ``np.where(cond, a, b)`` for arrays."""
    if isinstance(cond, (bool, np.bool_)):
        return a if cond else b
    return np.where(cond, a, b)


def _ident(p):
    """The identity rank map: a collective run on all P ranks rather than on a sub-group."""
    return p


def _not(cond):
    """Logical not of a Python bool or a bool array."""
    if isinstance(cond, (bool, np.bool_)):
        return not cond
    return ~cond


def _rd_newrank(rank, rem: int):
    """Rank among the pof2 survivors of MPICH's fold (odd ranks < 2*rem hold their even partner's data)."""
    return _where(rank < 2 * rem, rank // 2, rank - rem)


def _rd_real(newrank, rem: int):
    """Inverse of :func:`_rd_newrank`: the real rank behind a survivor's new rank."""
    return _where(newrank < rem, 2 * newrank + 1, newrank + rem)


def ring_schedule(rank, P: int):
    """Ring allreduce pattern (Patarasuk and Yuan 2009): 2(P-1) rounds of
    ``(dst, src, send_chunk, recv_chunk, reduce)``: every rank sends chunk ``send_chunk`` to rank + 1 and
    receives chunk ``recv_chunk`` from rank - 1 (mod P); ``reduce`` is True in the P-1 reduce-scatter rounds
    (the received chunk is added) and False in the P-1 allgather rounds (it is copied). After the
    reduce-scatter, rank r owns the full sum of chunk (r + 1) % P. No rounds for P = 1."""
    right, left = (rank + 1) % P, (rank - 1) % P
    send = rank % P  # reduce-scatter step s: send chunk (rank - s) % P, receive chunk (rank - s - 1) % P
    for _ in range(P - 1):
        recv = (send - 1) % P
        yield right, left, send, recv, True
        send = recv
    send = right  # allgather step s: send chunk (rank + 1 - s) % P, receive chunk (rank - s) % P
    for _ in range(P - 1):
        recv = (send - 1) % P
        yield right, left, send, recv, False
        send = recv


def rd_schedule(rank, P: int):
    """Recursive-doubling pattern with MPICH's fold for P not a power of two: rounds of
    ``(phase, dst, src)``, phase "fold" (even ranks < 2*rem send to rank + 1), "exchange" (lg pof2 rounds,
    the pof2 survivors swap with partner newrank ^ mask) and "unfold" (odd ranks < 2*rem send the result
    back to rank - 1). Fold and unfold rounds exist only when rem > 0."""
    pof2, rem = pof2_split(P)
    folded = rank < 2 * rem
    even = folded & (rank % 2 == 0)
    odd = folded & (rank % 2 == 1)
    if rem:
        yield "fold", _where(even, rank + 1, -1), _where(odd, rank - 1, -1)
    newrank = _rd_newrank(rank, rem)
    active = _not(even)
    mask = 1
    while mask < pof2:
        partner = _where(active, _rd_real(newrank ^ mask, rem), -1)
        yield "exchange", partner, partner
        mask <<= 1
    if rem:
        yield "unfold", _where(odd, rank - 1, -1), _where(even, rank + 1, -1)


def bruck_schedule(rank, P: int):
    """Bruck allgather pattern (Bruck et al. 1997): ceil(lg P) rounds of ``(dst, src, count)``; in round i
    (dist = 2^i) every rank sends its first ``count = min(dist, P - dist)`` blocks to rank - dist and
    receives as many from rank + dist (mod P)."""
    dist = 1
    while dist < P:
        yield (rank - dist) % P, (rank + dist) % P, min(dist, P - dist)
        dist <<= 1


def binomial_reduce_schedule(rank, P: int):
    """Binomial-tree reduce to rank 0: rounds of ``(mask, dst, src)`` for mask = 1, 2, 4, ... < P. A rank
    whose lowest set bit is ``mask`` sends to rank - mask (and is done); a rank with no bit below 2*mask
    receives from rank + mask if that rank exists."""
    mask = 1
    while mask < P:
        low = (rank & (mask - 1)) == 0
        send = low & ((rank & mask) != 0)
        recv = low & ((rank & mask) == 0) & (rank + mask < P)
        yield mask, _where(send, rank - mask, -1), _where(recv, rank + mask, -1)
        mask <<= 1


def binomial_bcast_schedule(rank, P: int):
    """Binomial-tree broadcast from rank 0, the reduce tree run backwards: rounds of ``(mask, dst, src)`` for
    mask = the largest power of two < P down to 1. A rank whose lowest set bit is ``mask`` receives from
    rank - mask; a rank with no bit below 2*mask sends to rank + mask if that rank exists."""
    mask = 1 << max(0, (P - 1).bit_length() - 1) if P > 1 else 0
    while mask >= 1:
        low = (rank & (2 * mask - 1))
        send = (low == 0) & (rank + mask < P)
        recv = low == mask
        yield mask, _where(send, rank + mask, -1), _where(recv, rank - mask, -1)
        mask >>= 1


# ----------------------------------------------------------------------------- dense allreduce


def ring_allreduce(rank: int, P: int, x: np.ndarray, value_bytes: int = 4):
    """Ring allreduce (reduce-scatter then allgather, Patarasuk and Yuan 2009; NCCL's ring).

    x: float array (d,), this rank's contribution. Returns the sum over ranks, float array (d,),
    bit-identical on every rank (each chunk is summed once, by its owner, then copied around).
    The vector is cut into P chunks by ``np.array_split`` (sizes differ by at most one element);
    2(P-1) steps, each a SendRecv of one chunk to the right neighbour (rank+1) and from the left.
    Cost with n = d * value_bytes divisible by P: 2(P-1) alpha + 2 n (P-1)/P beta.
    Any P >= 1 works unchanged (P = 1 returns a copy, no messages).
    """
    buf = np.array(x, copy=True)
    if P == 1:
        return buf
    return (yield from _ring_steps(buf, _chunk_bounds(buf.shape[0], P), ring_schedule(rank, P), _ident, value_bytes))


def _chunk_bounds(d: int, P: int) -> np.ndarray:
    """Bounds of ``np.array_split(range(d), P)``: int64 array (P + 1,)."""
    sizes = [d // P + (1 if i < d % P else 0) for i in range(P)]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def _ring_steps(buf: np.ndarray, bounds: np.ndarray, steps, to_rank, value_bytes: int):
    """Run ring steps (from :func:`ring_schedule`, whose peers are positions in a group mapped to ranks by
    ``to_rank``) on ``buf`` in place, chunk c being ``buf[bounds[c]:bounds[c + 1]]``; returns buf."""
    for dst, src, send_c, recv_c, reduce in steps:
        data = buf[bounds[send_c]:bounds[send_c + 1]].copy()
        got = yield SendRecv(to_rank(dst), data, data.shape[0] * value_bytes, to_rank(src))
        rc = slice(bounds[recv_c], bounds[recv_c + 1])
        if reduce:
            yield Compute("reduce", got.shape[0])
            buf[rc] = got + buf[rc]
        else:
            buf[rc] = got
    return buf


def rd_allreduce(rank: int, P: int, x: np.ndarray, value_bytes: int = 4):
    """Recursive-doubling allreduce (MPICH ``MPIR_Allreduce_intra_recursive_doubling``).

    x: float array (d,). Returns the sum over ranks (d,), bit-identical on every rank (each pairwise
    sum is formed as lower-rank data + higher-rank data on both sides).
    Extra ranks (P not a power of two): the first 2*rem ranks pair up; each even rank sends its whole
    vector to rank+1 and sits out; the lg(pof2) exchange rounds run on pof2 ranks; at the end each
    odd rank < 2*rem sends the result back to rank-1.
    Cost: (lg pof2 + 2*[rem > 0]) (alpha + n beta), n = d * value_bytes; = lg P (alpha + n beta) for P = 2^m.
    """
    buf = np.array(x, copy=True)
    n = buf.shape[0] * value_bytes
    for phase, dst, src in rd_schedule(rank, P):
        if phase == "fold":
            if dst >= 0:
                yield Send(dst, buf, n)
            elif src >= 0:
                got = yield Recv(src)
                yield Compute("reduce", buf.shape[0])
                buf = got + buf  # lower rank first
        elif phase == "exchange":
            if dst >= 0:
                got = yield SendRecv(dst, buf, n, src)
                yield Compute("reduce", buf.shape[0])
                buf = (buf + got) if rank < dst else (got + buf)
        elif dst >= 0:  # unfold: the result back to the folded rank
            yield Send(dst, buf, n)
        elif src >= 0:
            buf = yield Recv(src)
    return buf


# ----------------------------------------------------------------------------- sparse allgather


def bruck_allgather(rank: int, P: int, item, nbytes_of):
    """Bruck allgather of one variable-size item per rank (Bruck et al. 1997; MPICH allgather for any P).

    item: this rank's block (any payload); nbytes_of(item) -> int, its bytes on the wire.
    Returns a list of P items, entry r being rank r's item, identical on every rank.
    ceil(lg P) rounds; in round i (distance 2^i) each rank sends its first min(2^i, P - 2^i) blocks to
    rank - 2^i and receives as many from rank + 2^i (mod P). Cost with equal blocks of m bytes:
    ceil(lg P) alpha + (P-1) m beta; = lg P alpha + (P-1) m beta for P = 2^m (recursive doubling).
    """
    return (yield from _bruck(rank, P, _ident, item, nbytes_of))


def _bruck(pos: int, n: int, to_rank, item, nbytes_of):
    """Bruck allgather among the n members of a group (position ``pos``; peers mapped by ``to_rank``)."""
    blocks = [item]
    for dst, src, cnt in bruck_schedule(pos, n):
        out = blocks[:cnt]
        got = yield SendRecv(to_rank(dst), out, sum(nbytes_of(b) for b in out), to_rank(src))
        blocks.extend(got)
    # blocks[j] came from position (pos + j) % n
    return [blocks[(r - pos) % n] for r in range(n)]


def topk_allgather_sum(rank: int, P: int, sel: Sparse, value_bytes: int = 4, index_bytes: int = 4):
    """Top-k S-SGD communication: allgather every rank's selection (Bruck) and sum them.

    sel: this rank's TopK selection (at most k entries). Returns the dense sum
    g = sum_p TopK(acc_p), float array (d,), added in rank order 0..P-1 so it is bit-identical on
    every rank. Cost with k entries per rank: ceil(lg P) alpha + (P-1) k s beta (docs/costs.md, Top-k via
    allgather). Every local selection is applied, so residual_p = acc_p - TopK(acc_p).
    """
    blocks = yield from bruck_allgather(rank, P, sel, lambda s_: s_.nbytes(value_bytes, index_bytes))
    return (yield from _sum_in_rank_order(sel, blocks))


def _sum_in_rank_order(sel: Sparse, blocks: list):
    """Dense sum of P selections (``blocks[r]`` = rank r's), added in rank order, in the dtype of this rank's
    selection values (the accumulator's, also when the selection is empty); costed as one reduce."""
    yield Compute("reduce", sum(len(b) for b in blocks))
    return sparse_sum(blocks, sel.d, sel.val.dtype)


#: Below this many entries in all, :func:`sparse_sum` uses numpy (microseconds either way): no numba import or
#: compilation for small runs.
_NUMBA_MIN_ENTRIES = 1 << 15
#: From this many vectors on, the numba sum walks the coordinates in cache-sized chunks
#: (:func:`sim.comm._sparse_numba.sum_into`); below it, one vector after another (``sum_into_by_rank``). Measured at d = 2.5e7, k = 25,000 on the 2-core VM
#: (README, "Merge speed"): in the CLI's heap (4 KiB pages) by-rank is faster up to P = 512 (P = 64: 10.8 against
#: 23.6 ms), the chunks win at P = 1024 in float32 (108 against 141 ms); both give the same bits.
_CHUNKED_MIN_P = 1024


def _kernels():
    return kernels("sim.comm._sparse_numba")


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` (``a`` itself when already read-only)."""
    if not a.flags.writeable:
        return a
    v = a.view()
    v.flags.writeable = False
    return v


def sparse_sum(blocks, d: int, dtype, *, use_numba: bool | None = None) -> np.ndarray:
    """Dense sum of sparse vectors, added in list order: array (d,) of ``dtype``, the bits of
    ``g = np.zeros(d, dtype); for b in blocks: g[b.idx] += b.val``.

    blocks: :class:`Sparse` vectors of dimension d with strictly increasing indices, as every selection's are
    (a vector that repeats an index gets both terms added on the ``np.add.at`` path, where ``+=`` kept one).
    Every coordinate receives its terms in list order whatever the path: with numba (``use_numba`` None: from
    ``_NUMBA_MIN_ENTRIES`` entries on, if installed; True: whenever installed; False: never) one compiled pass
    per vector, or, from ``_CHUNKED_MIN_P`` vectors on, one that visits the coordinates in cache-sized chunks
    (:func:`sim.comm._sparse_numba.sum_into`); otherwise
    ``np.add.at`` per vector (one pass where ``g[idx] += val`` makes three). Values of a dtype other than
    ``dtype`` take the ``g[idx] += val`` path.
    """
    dtype = np.dtype(dtype)
    g = np.zeros(int(d), dtype=dtype)
    same = dtype in (np.float32, np.float64) and all(b.val.dtype == dtype and b.idx.dtype == np.int64 for b in blocks)
    if same and (use_numba or (use_numba is None and sum(len(b) for b in blocks) >= _NUMBA_MIN_ENTRIES)):
        K = _kernels()
        if K is not None and all(b.idx.flags.c_contiguous and b.val.flags.c_contiguous for b in blocks):
            from numba.typed import List

            ia, va = [b.idx for b in blocks], [b.val for b in blocks]
            if len({a.flags.writeable for a in ia}) > 1 or len({a.flags.writeable for a in va}) > 1:
                # a typed List holds one array type: read-only views of all (the kernels only read them), where a
                # mix would be cast unsafely (NumbaTypeSafetyWarning)
                ia, va = [_read_only(a) for a in ia], [_read_only(a) for a in va]
            try:
                idxs, vals = List(ia), List(va)
            except Exception:  # noqa: BLE001 - whatever numba cannot hold: numpy below
                idxs = None
            if idxs is not None and len(idxs):
                done = (K.sum_into(g, idxs, vals, max(1, (1 << 20) // dtype.itemsize)) if len(idxs) >= _CHUNKED_MIN_P
                        else K.sum_into_by_rank(g, idxs, vals))
                if done:
                    return g
                g[:] = 0  # an index out of order or range: the plain sum below, which raises as it always did
                same = False
    for b in blocks:
        if same:
            np.add.at(g, b.idx, b.val)
        else:
            g[b.idx] += b.val
    return g


# ----------------------------------------------------------------------------- gTop-k


@dataclass(frozen=True)
class GTopKResult:
    """Result of a gTop-k collective on one rank.

    g: the global selection gTopK(acc_1..acc_P), a :class:`Sparse` with at most k entries, identical on
    every rank. applied: bool array (len(sel),) over this rank's own selection entries: True where this
    rank's value is inside g (gMask_p). The residual is acc_p with the applied entries zeroed.
    """

    g: Sparse
    applied: np.ndarray


class _Tracker:
    """Survival bookkeeping for the exact gTop-k mask.

    Tracks, for each vector this rank has absorbed (its own selection, and each vector a child or a
    folded rank sent it), which entries are still inside the running merge result.
    """

    def __init__(self, own: Sparse):
        self.sources: list[tuple[object, np.ndarray, np.ndarray]] = [("own", own.idx, np.ones(len(own), bool))]

    def absorb(self, who, s: Sparse):
        self.sources.append((who, s.idx, np.ones(len(s), bool)))

    def survive(self, support: np.ndarray):
        """Keep only entries whose index is in ``support`` (sorted int64). Only the entries still alive are
        looked up (those of this rank's own selection thin out merge after merge)."""
        for _, idx, alive in self.sources:
            live = np.flatnonzero(alive)
            if live.shape[0]:
                alive[live] = in_sorted(idx[live], support)

    def survive_sent(self, sent_idx: np.ndarray, bits: np.ndarray):
        """Apply the survival bits returned for the vector this rank sent (entries sent_idx)."""
        self.survive(sent_idx[bits])

    def bits_for(self, who) -> np.ndarray:
        for w, _, alive in self.sources:
            if w == who:
                return alive.copy()
        raise KeyError(who)


def in_sorted(x: np.ndarray, support: np.ndarray) -> np.ndarray:
    """``np.isin(x, support, assume_unique=True)`` for ``support`` sorted ascending: a binary search per entry
    of x when x is short next to support or both are short (np.isin's own set-up costs some 30 us a call; the
    default scenario makes 11,000 such lookups at k = 6), np.isin (a sort of both) otherwise. The same booleans
    either way."""
    if x.shape[0] * 16 < support.shape[0] or support.shape[0] <= 256:
        pos = np.searchsorted(support, x)
        out = pos < support.shape[0]
        out[out] = support[pos[out]] == x[out]
        return out
    return np.isin(x, support, assume_unique=True)


def _merge(cur: Sparse, got: Sparse, k: int):
    yield Compute("merge", len(cur) + len(got))
    return merge(cur, got, k)


def _reference_mask(sel: Sparse, g: Sparse) -> np.ndarray:
    return np.isin(sel.idx, g.idx, assume_unique=True)


def gtopk_tree(rank: int, P: int, sel: Sparse, k: int, *, exact: bool = True,
               value_bytes: int = 4, index_bytes: int = 4):
    """gTop-k as a binomial-tree reduction to rank 0 followed by a binomial-tree broadcast.

    sel: this rank's TopK(acc_p) (at most k entries). Returns :class:`GTopKResult`.
    Reduce: for mask = 1, 2, 4, ...: a rank with bit ``mask`` set sends its running vector to
    rank - mask and stops; otherwise it receives from rank + mask (if < P) and merges
    (running T received). Works for any P: ranks whose partner would be >= P skip that round.
    Broadcast: the reverse tree; each parent sends its children the result g and, for the exact mask,
    a survival bitmask over the entries that child sent (ceil(m/8) bytes), so every rank learns which
    of its values reached g. ``exact=False`` is the released reference code's rule
    gMask_p = (support of g) AND (support of TopK(acc_p)), which can lose mass; its broadcast carries g only.
    Cost with k entries per message: ceil(lg P) (alpha + k s beta) + ceil(lg P) (alpha + (k s + b) beta),
    b = ceil(k/8) for the exact mask and 0 for the reference rule; = 2 lg P (alpha + k s beta) (ICDCS 2019)
    up to the mask bytes.
    """
    s_el = value_bytes + index_bytes
    track = _Tracker(sel)
    cur, children = yield from _gtopk_reduce(rank, P, _ident, track, sel, k, s_el)
    g = yield from _gtopk_bcast(rank, P, _ident, track, cur, cur, children, exact, s_el)
    applied = track.bits_for("own") if exact else _reference_mask(sel, g)
    return GTopKResult(g, applied)


def _gtopk_reduce(pos: int, n: int, to_rank, track: _Tracker, cur: Sparse, k: int, s_el: int):
    """gTop-k binomial reduce to position 0 of a group: merge what children send, send the running vector
    to the parent. Returns (cur, children): the vector this member holds last (the one it sent, or the
    group's result at the root) and [(child rank, what it sent)] in the order received."""
    children: list[tuple[int, Sparse]] = []
    for _, dst, src in binomial_reduce_schedule(pos, n):
        if dst >= 0:
            yield Send(to_rank(dst), cur, len(cur) * s_el)
        elif src >= 0:
            who = to_rank(src)
            got = yield Recv(who)
            cur = yield from _absorb(track, who, got, cur, k)
            children.append((who, got))
    return cur, children


def _absorb(track: _Tracker, who: int, got: Sparse, cur: Sparse, k: int):
    """Merge the vector ``got`` that rank ``who`` sent into ``cur``, tracking which entries survive."""
    track.absorb(who, got)
    cur = yield from _merge(cur, got, k)
    track.survive(cur.idx)
    return cur


def _gtopk_bcast(pos: int, n: int, to_rank, track: _Tracker, g: Sparse, sent: Sparse, children, exact: bool,
                 s_el: int):
    """Broadcast the result g from position 0 down the binomial tree, each parent sending a child g plus
    (exact mask) the survival bits of what that child sent (ceil(m/8) bytes). ``sent``: what this member sent
    to its parent in :func:`_gtopk_reduce`. Returns g."""
    got_of = dict(children)
    for _, dst, src in binomial_bcast_schedule(pos, n):
        if src >= 0:
            g, bits = yield Recv(to_rank(src))
            if exact:
                track.survive_sent(sent.idx, bits)
        if dst >= 0:
            child = to_rank(dst)
            bits = track.bits_for(child) if exact else None
            yield Send(child, (g, bits), len(g) * s_el + (mask_nbytes(len(got_of[child])) if exact else 0))
    return g


def gtopk_rd(rank: int, P: int, sel: Sparse, k: int, *, exact: bool = True,
             value_bytes: int = 4, index_bytes: int = 4):
    """gTop-k by recursive doubling (butterfly): every rank merges in every round, no broadcast.

    sel: this rank's TopK(acc_p). Returns :class:`GTopKResult`, g identical on every rank because the
    merge operator is commutative bit-for-bit. Exact mask: a rank's entry survives iff its index is in
    the output of every merge it took part in, so each rank computes its own gMask_p with no extra bytes.
    Extra ranks (P not a power of two), as MPICH's recursive doubling: the first 2*rem ranks pair up,
    each even rank sends its selection to rank+1, which merges it before the butterfly and at the end
    returns g plus (exact mask) a survival bitmask of ceil(m/8) bytes.
    ``exact=False``: the reference code's rule (support of g AND own selection).
    Cost with k entries per message: lg pof2 (alpha + k s beta), plus, when rem > 0,
    (alpha + k s beta) + (alpha + (k s + b) beta) with b = ceil(k/8) (exact) or 0 (reference).
    """
    s_el = value_bytes + index_bytes
    track = _Tracker(sel)
    g = yield from _gtopk_rd_group(rank, P, _ident, track, sel, k, exact, s_el)
    applied = track.bits_for("own") if exact else _reference_mask(sel, g)
    return GTopKResult(g, applied)


def _gtopk_rd_group(pos: int, n: int, to_rank, track: _Tracker, cur: Sparse, k: int, exact: bool, s_el: int):
    """gTop-k recursive doubling among the n members of a group (:func:`rd_schedule`), starting from this
    member's vector ``cur``; the tracker learns which of its entries survive. Returns g."""
    sent = folded = None
    for phase, dst, src in rd_schedule(pos, n):
        if phase == "fold":
            if dst >= 0:
                sent = cur
                yield Send(to_rank(dst), cur, len(cur) * s_el)
            elif src >= 0:
                who = to_rank(src)
                folded = yield Recv(who)
                cur = yield from _absorb(track, who, folded, cur, k)
        elif phase == "exchange":
            if dst >= 0:
                got = yield SendRecv(to_rank(dst), cur, len(cur) * s_el, to_rank(src))
                cur = yield from _merge(cur, got, k)
                track.survive(cur.idx)
        elif dst >= 0:  # unfold: g and the folded member's survival bits
            who = to_rank(dst)
            bits = track.bits_for(who) if exact else None
            yield Send(who, (cur, bits), len(cur) * s_el + (mask_nbytes(len(folded)) if exact else 0))
        elif src >= 0:
            cur, bits = yield Recv(to_rank(src))
            if exact:
                track.survive_sent(sent.idx, bits)
    return cur


# ----------------------------------------------------------------------------- hierarchical collectives
#
# On a cluster of N = P / G nodes of G ranks each (rank r on node r // G, local index r % G, as
# sim.machine.topology places them): work inside each node over the fast fabric, exchange between nodes only
# among one rank per node (or per local index), then spread the result inside each node.


def _node_layout(rank: int, P: int, G: int) -> tuple[int, int, int]:
    """(node, local index, number of nodes) of ``rank``; raises SparsimError unless G divides P."""
    from sim.base.errors import SparsimError

    if G < 1 or P % G:
        raise SparsimError(f"gpus_per_node = {G} does not divide P = {P}: valid divisors of P")
    node, local = divmod(rank, G)
    return node, local, P // G


def hier_allreduce(rank: int, P: int, G: int, x: np.ndarray, value_bytes: int = 4):
    """Two-level dense allreduce (the scheme of NCCL's trees-of-rings and Horovod's hierarchical allreduce).

    x: float array (d,). Returns the sum over all P ranks, float array (d,), bit-identical on every rank.
    1. Intra-node ring reduce-scatter among the G ranks of each node (chunks ``np.array_split(d, G)``):
       local rank l then owns the node's sum of chunk (l + 1) % G.
    2. Inter-node ring allreduce of that chunk among the N ranks with the same local index (one ring per
       local index, all at once: on a rail-optimised cluster each on its own NIC).
    3. Intra-node ring allgather of the G reduced chunks.
    Cost on a contention-free cluster with G N dividing d, n = d * value_bytes (docs/costs.md, hierarchical):
    2(G-1)(alpha_i + n/G beta_i) + 2(N-1)(alpha_e + n/(G N) beta_e) (:func:`sim.comm.costs.hier_allreduce_time`).
    G = 1 is the flat ring; N = 1 the ring inside one node.
    """
    node, local, N = _node_layout(rank, P, G)
    buf = np.array(x, copy=True)
    base = node * G
    bounds = _chunk_bounds(buf.shape[0], G)
    steps = list(ring_schedule(local, G))

    def intra(p):
        return base + p

    yield from _ring_steps(buf, bounds, steps[:G - 1], intra, value_bytes)
    own = (local + 1) % G
    part = buf[bounds[own]:bounds[own + 1]]  # a view: the inter-node ring sums it in place
    yield from _ring_steps(part, _chunk_bounds(part.shape[0], N), ring_schedule(node, N), lambda q: q * G + local,
                           value_bytes)
    yield from _ring_steps(buf, bounds, steps[G - 1:], intra, value_bytes)
    return buf


def hier_topk_allgather_sum(rank: int, P: int, G: int, sel: Sparse, value_bytes: int = 4, index_bytes: int = 4):
    """Top-k allgather, hierarchical: gather the node's selections to its local rank 0 (binomial tree over the
    intra-node fabric), Bruck allgather of the node blocks among the N local ranks 0 (the only inter-node
    traffic), binomial-tree broadcast of all P selections inside each node, then the dense sum in rank order.

    sel: this rank's TopK(acc_p). Returns g = sum_p TopK(acc_p), float array (d,), bit-identical to
    :func:`topk_allgather_sum` (same additions in the same order) on every rank; residual rule unchanged
    (every local selection is applied). Cost with k entries of s bytes per rank, contention-free:
    ceil(lg G) alpha_i + (G-1) k s beta_i + ceil(lg N) alpha_e + (N-1) G k s beta_e
    + ceil(lg G)(alpha_i + P k s beta_i) (:func:`sim.comm.costs.hier_topk_time`).
    """
    blocks = yield from hier_allgather(rank, P, G, sel, lambda b: b.nbytes(value_bytes, index_bytes))
    return (yield from _sum_in_rank_order(sel, blocks))


def hier_allgather(rank: int, P: int, G: int, item, nbytes_of):
    """Hierarchical allgather of one item per rank: binomial gather to local rank 0 of each node, Bruck
    allgather of the node blocks among the N local ranks 0, binomial broadcast of all P items inside each
    node. Returns the list of P items, entry r being rank r's, on every rank. nbytes_of(item) -> int."""
    node, local, N = _node_layout(rank, P, G)
    base = node * G

    def nb(blocks):
        return sum(nbytes_of(b) for _, b in blocks)

    blocks = [(rank, item)]
    for _, dst, src in binomial_reduce_schedule(local, G):
        if dst >= 0:
            yield Send(base + dst, blocks, nb(blocks))
        elif src >= 0:
            blocks = blocks + (yield Recv(base + src))
    if local == 0:
        per_node = yield from _bruck(node, N, lambda q: q * G, blocks, nb)
        blocks = [b for node_blocks in per_node for b in node_blocks]
    for _, dst, src in binomial_bcast_schedule(local, G):
        if src >= 0:
            blocks = yield Recv(base + src)
        if dst >= 0:
            yield Send(base + dst, blocks, nb(blocks))
    return [b for _, b in sorted(blocks, key=lambda rb: rb[0])]


def hier_gtopk(rank: int, P: int, G: int, sel: Sparse, k: int, *, exact: bool = True, value_bytes: int = 4,
               index_bytes: int = 4):
    """gTop-k, hierarchical (in the spirit of HiTopKComm, Shi et al. MLSys 2021): a gTop-k binomial reduce
    inside each node to its local rank 0 over the intra-node fabric, gTop-k recursive doubling among the N
    local ranks 0 (sparse exchange between nodes only), then a binomial broadcast of g and each child's
    survival bits inside each node.

    sel: this rank's TopK(acc_p). Returns :class:`GTopKResult` (g identical on every rank; ``applied``
    exact: an entry is applied iff it survived every merge it entered, so sum_p acc_p = g + sum_p eps_p;
    ``exact=False``: the released code's rule, support of g AND own selection).
    Cost with k entries per message, contention-free: ceil(lg G)(alpha_i + k s beta_i)
    + gtopk_rd_time(N, k, alpha_e, beta_e) + ceil(lg G)(alpha_i + (k s + b) beta_i), b = ceil(k/8) for the
    exact mask, 0 for the reference rule (:func:`sim.comm.costs.hier_gtopk_time`).
    """
    node, local, N = _node_layout(rank, P, G)
    base = node * G
    s_el = value_bytes + index_bytes
    track = _Tracker(sel)

    def intra(p):
        return base + p

    cur, children = yield from _gtopk_reduce(local, G, intra, track, sel, k, s_el)
    g = cur
    if local == 0:
        g = yield from _gtopk_rd_group(node, N, lambda q: q * G, track, cur, k, exact, s_el)
    g = yield from _gtopk_bcast(local, G, intra, track, g, cur, children, exact, s_el)
    applied = track.bits_for("own") if exact else _reference_mask(sel, g)
    return GTopKResult(g, applied)


# ----------------------------------------------------------------------------- SparCML's sparse allreduce
#
# Renggli, Ashkboos, Aghagolzadeh, Alistarh and Hoefler, "SparCML: High-Performance Sparse Communication for
# Machine Learning", SC 2019: sparse allreduces on "sparse streams" that switch to a dense representation once
# their sparse encoding would not be smaller than the dense one. Two of the paper's static sparse allreduces
# (SSAR) are here, :func:`ssar_recursive_doubling` (the paper's SSAR_Recursive_double) and
# :func:`ssar_split_allgather` (SSAR_Split_allgather), written against a small stream algebra
# (:class:`SparseStreams`) so that the timing-only mode runs the same programs on streams that carry only their
# sizes (:class:`sim.algorithms.sparcml.PhantomStreams`).
#
# A stream over a window [lo, lo + width) of a vector of n coordinates is either a :class:`Sparse` (absolute
# indices, dimension n; ``len * (value_bytes + index_bytes)`` bytes on the wire) or a dense float array of the
# window's ``width`` values (``width * value_bytes`` bytes). The rule (:func:`ssar_is_dense`): a stream of
# ``count`` entries is dense iff count (v + i) >= t width v, with t = ``dense_threshold`` in (0, 1] (t = 1: the
# paper's switch where the sparse encoding reaches the dense size). ``dense_rule`` "union" applies it to the
# merged stream's own entry count (the union of the supports); "bound" to the sum of the two inputs' counts before
# the merge, as the authors' library does (``sum_streams`` in its c_common.h, which must size the output buffer
# before merging). Dense is absorbing: a merge with a dense stream is dense.


def ssar_is_dense(count: int, width: int, value_bytes: int = 4, index_bytes: int = 4,
                  dense_threshold: float = 1.0) -> bool:
    """SparCML's switch: a stream of ``count`` entries over ``width`` coordinates is dense iff
    count (value_bytes + index_bytes) >= dense_threshold * width * value_bytes (integers compared exactly when
    dense_threshold = 1)."""
    lhs = int(count) * (int(value_bytes) + int(index_bytes))
    if dense_threshold == 1.0:
        return lhs >= int(width) * int(value_bytes)
    return lhs >= float(dense_threshold) * (int(width) * int(value_bytes))


class SparseStreams:
    """The numeric stream algebra of SparCML's allreduces (see the section comment above).

    n: the vector's dimension; dtype: the values' dtype (the accumulator's); value_bytes, index_bytes: bytes per
    value / index on the wire; dense_threshold: t in (0, 1]; dense_rule: "union" or "bound".
    Sums are formed as lower operand + upper operand; IEEE addition being commutative, either order gives the
    same bits. Merges never modify their inputs (a sent payload is shared with its receiver).
    """

    def __init__(self, n: int, dtype, value_bytes: int = 4, index_bytes: int = 4, dense_threshold: float = 1.0,
                 dense_rule: str = "union"):
        self.n = int(n)
        self.dtype = np.dtype(dtype)
        self.vb, self.ib = int(value_bytes), int(index_bytes)
        self.t = float(dense_threshold)
        self.rule = dense_rule

    def dense(self, count: int, width: int) -> bool:
        """:func:`ssar_is_dense` with this algebra's bytes and threshold."""
        return ssar_is_dense(count, width, self.vb, self.ib, self.t)

    def start(self, sel: Sparse):
        """This rank's stream over the whole vector: its selection, dense if the rule says so."""
        if self.dense(len(sel), self.n):
            out = np.zeros(self.n, dtype=self.dtype)
            out[sel.idx] = sel.val
            return out
        return sel

    def nbytes(self, s) -> int:
        """Bytes of stream ``s`` on the wire."""
        if isinstance(s, Sparse):
            return len(s) * (self.vb + self.ib)
        return int(s.shape[0]) * self.vb

    @staticmethod
    def count(s) -> int:
        """Entries of a sparse stream; the width of a dense one."""
        return len(s) if isinstance(s, Sparse) else int(s.shape[0])

    def merge(self, lower, upper, lo: int, width: int):
        """(sum, compute kind, work): the sum of two streams over the window [lo, lo + width), lower + upper at
        common coordinates. Kind "reduce" (work: elements added) when a dense stream is involved, "merge" (work:
        len(lower) + len(upper)) for two sparse streams."""
        ld, ud = not isinstance(lower, Sparse), not isinstance(upper, Sparse)
        if ld and ud:
            return lower + upper, "reduce", width
        if ld or ud:
            dense, sp = (lower, upper) if ld else (upper, lower)
            out = dense.copy()
            out[sp.idx - lo] += sp.val
            return out, "reduce", len(sp)
        work = len(lower) + len(upper)
        union = np.union1d(lower.idx, upper.idx)
        count = work if self.rule == "bound" else int(union.shape[0])
        if self.dense(count, width):
            out = np.zeros(width, dtype=self.dtype)
            out[lower.idx - lo] = lower.val
            out[upper.idx - lo] += upper.val
            return out, "merge", work
        val = np.zeros(union.shape[0], dtype=self.dtype)
        val[np.searchsorted(union, lower.idx)] = lower.val
        val[np.searchsorted(union, upper.idx)] += upper.val
        return Sparse(union.astype(np.int64, copy=False), val, self.n), "merge", work

    def split(self, s, bounds: np.ndarray) -> list:
        """The pieces of stream ``s`` (over the whole vector) in the regions [bounds[r], bounds[r + 1]): slices of a
        dense stream (dense), else the entries in each region, dense if the rule says so for that region."""
        out = []
        if not isinstance(s, Sparse):
            return [s[bounds[r]:bounds[r + 1]].copy() for r in range(len(bounds) - 1)]
        cut = np.searchsorted(s.idx, bounds)
        for r in range(len(bounds) - 1):
            lo, width = int(bounds[r]), int(bounds[r + 1] - bounds[r])
            idx, val = s.idx[cut[r]:cut[r + 1]], s.val[cut[r]:cut[r + 1]]
            if self.dense(idx.shape[0], width):
                piece = np.zeros(width, dtype=self.dtype)
                piece[idx - lo] = val
                out.append(piece)
            else:
                out.append(Sparse(idx, val, self.n))
        return out

    def to_full(self, region, lo: int, width: int):
        """A region's sum as a stream over the whole vector (the input of the allgather): a dense region becomes
        the sparse list of its nonzero entries (exact zeros carry nothing), then the rule is applied over n."""
        if not isinstance(region, Sparse):
            nz = np.flatnonzero(region)
            region = Sparse((nz + lo).astype(np.int64), region[nz], self.n)
        if self.dense(len(region), self.n):
            out = np.zeros(self.n, dtype=self.dtype)
            out[region.idx] = region.val
            return out
        return region

    def finish(self, s) -> np.ndarray:
        """The dense vector (n,) of the final stream ``s``."""
        if isinstance(s, Sparse):
            out = np.zeros(self.n, dtype=self.dtype)
            out[s.idx] = s.val
            return out
        return s


def _ssar_merge(ops, lower, upper, lo: int, width: int):
    out, kind, work = ops.merge(lower, upper, lo, width)
    yield Compute(kind, work)
    return out


def ssar_recursive_doubling(rank: int, P: int, sel: Sparse, *, value_bytes: int = 4, index_bytes: int = 4,
                            dense_threshold: float = 1.0, dense_rule: str = "union", streams=None):
    """SparCML's SSAR_Recursive_double (Renggli et al. SC 2019; the authors' ``c_allreduce_recdoubling``): lg P
    rounds of recursive doubling on sparse streams, each round merging the partner's stream into one's own, a
    stream switching to dense by the rule of :func:`ssar_is_dense`.

    sel: this rank's selection (Sparse of dimension n, at most k entries). Returns the final stream (Sparse or a
    dense float array (n,)), identical on every rank; ``streams.finish`` of it is g = sum_p sel_p. Summation
    order at a coordinate: the butterfly's, each merge adding the lower block's partial sum and the upper
    block's, with the extra ranks of P not a power of two folded first (MPICH's fold, :func:`rd_schedule`: even
    rank r < 2 rem sends its stream to r + 1, which adds the two, rank r's first) and sent the result at the end.
    streams: the stream algebra (default :class:`SparseStreams` for ``sel``; the timing-only mode passes one of
    stream sizes).
    Cost with pairwise disjoint supports of k entries (the worst case; overlaps make the messages smaller):
    [rem > 0] (alpha + B(k) beta) + sum_{j=1..lg pof2} (alpha + B(S_j) beta) + [rem > 0] (alpha + B(P k) beta),
    S_j = (2^(j-1) + min(rem, 2^(j-1))) k, B(c) = n v if dense else c (v + i) (:func:`sim.comm.costs.sparcml_rd_time`);
    = lg P alpha + (P - 1) k (v + i) beta for P a power of two before any switch (the paper's worst case).
    """
    ops = streams if streams is not None else SparseStreams(sel.d, sel.val.dtype, value_bytes, index_bytes,
                                                           dense_threshold, dense_rule)
    n = ops.n
    cur = ops.start(sel)
    for phase, dst, src in rd_schedule(rank, P):
        if phase == "fold":
            if dst >= 0:
                yield Send(dst, cur, ops.nbytes(cur))
            elif src >= 0:
                got = yield Recv(src)
                cur = yield from _ssar_merge(ops, got, cur, 0, n)
        elif phase == "exchange":
            if dst >= 0:
                got = yield SendRecv(dst, cur, ops.nbytes(cur), src)
                lower, upper = (cur, got) if rank < dst else (got, cur)
                cur = yield from _ssar_merge(ops, lower, upper, 0, n)
        elif dst >= 0:  # unfold: the result back to the folded rank
            yield Send(dst, cur, ops.nbytes(cur))
        elif src >= 0:
            cur = yield Recv(src)
    return cur


def ssar_split_allgather(rank: int, P: int, sel: Sparse, *, value_bytes: int = 4, index_bytes: int = 4,
                         dense_threshold: float = 1.0, dense_rule: str = "union", streams=None):
    """SparCML's SSAR_Split_allgather (Renggli et al. SC 2019; the authors' ``c_allreduce_small``): the index
    space is split into pof2 regions (``np.array_split`` bounds; survivor newrank u owns region u), every rank
    sends each region's piece of its stream to the region's owner, the owner sums its region of everyone's
    pieces, then the region sums are allgathered by recursive doubling (disjoint supports: each round
    concatenates the partner's regions), every stream switching to dense by the rule of :func:`ssar_is_dense`
    (pieces and region sums over their region's width, allgather streams over n).

    The extra ranks of P not a power of two are folded in first and sent the result at the end, as in
    :func:`ssar_recursive_doubling` (the authors' code does the same). The direct exchange of the split phase
    runs as pof2 - 1 pairwise rounds, round j pairing newranks u and u XOR j (the authors post all sends and
    receives at once). Summation order at a coordinate of region r: the owner adds the pieces in newrank order,
    ((y_0 + y_1) + y_2) + ..., y_u being survivor u's stream (a folded pair's sum, its even rank's first); the
    allgather adds nothing (disjoint regions). A region sum that went dense enters the allgather as the sparse
    list of its nonzero entries (the authors' code drops |v| <= 1e-8 there; here only exact zeros, so g is exact).

    sel: this rank's selection. Returns the final stream, identical on every rank (``streams.finish`` gives g).
    Cost under the timing-only assumption (disjoint supports spread evenly, :func:`sim.comm.costs.sparcml_split_time`):
    [rem > 0] (alpha + B(k) beta) + (pof2 - 1)(alpha + b beta) + sum_{j=1..lg pof2}(alpha + B(2^(j-1) R) beta)
    + [rem > 0] (alpha + B(pof2 R) beta), b the largest piece, R the entries of a region sum.
    """
    ops = streams if streams is not None else SparseStreams(sel.d, sel.val.dtype, value_bytes, index_bytes,
                                                           dense_threshold, dense_rule)
    n = ops.n
    pof2, rem = pof2_split(P)
    cur = ops.start(sel)
    split_done = False
    for phase, dst, src in rd_schedule(rank, P):
        if phase == "fold":
            if dst >= 0:
                yield Send(dst, cur, ops.nbytes(cur))
            elif src >= 0:
                got = yield Recv(src)
                cur = yield from _ssar_merge(ops, got, cur, 0, n)
        elif phase == "exchange":
            if dst < 0:
                continue
            if not split_done:  # the split phase, once, before the allgather's first round
                cur = yield from _ssar_split_reduce(ops, int(_rd_newrank(rank, rem)), pof2, rem, cur)
                split_done = True
            got = yield SendRecv(dst, cur, ops.nbytes(cur), src)
            lower, upper = (cur, got) if rank < dst else (got, cur)
            cur = yield from _ssar_merge(ops, lower, upper, 0, n)
        elif dst >= 0:
            yield Send(dst, cur, ops.nbytes(cur))
        elif src >= 0:
            cur = yield Recv(src)
    return cur


def _ssar_split_reduce(ops, u: int, pof2: int, rem: int, cur):
    """The split phase of :func:`ssar_split_allgather` on survivor newrank u: send region w's piece to its owner
    in round u XOR w, sum region u's pieces in newrank order, return that sum as a stream over the whole vector."""
    bounds = _chunk_bounds(ops.n, pof2)
    pieces = ops.split(cur, bounds)
    got = {u: pieces[u]}
    for j in range(1, pof2):
        w = u ^ j
        peer = int(_rd_real(w, rem))
        got[w] = yield SendRecv(peer, pieces[w], ops.nbytes(pieces[w]), peer)
    lo, width = int(bounds[u]), int(bounds[u + 1] - bounds[u])
    region = got[0]
    for w in range(1, pof2):
        region = yield from _ssar_merge(ops, region, got[w], lo, width)
    return ops.to_full(region, lo, width)


__all__ += ["ssar_is_dense", "SparseStreams", "ssar_recursive_doubling", "ssar_split_allgather"]
