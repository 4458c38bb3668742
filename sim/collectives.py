"""Collectives, each written once as a per-rank sans-I/O generator (see :mod:`sim.ops`).

Every collective here is a generator ``f(rank, P, ...)`` that yields :class:`~sim.ops.Send`,
:class:`~sim.ops.Recv`, :class:`~sim.ops.SendRecv` and :class:`~sim.ops.Compute` operations and
returns its result. The same code runs under the lock-step driver (no clock), the SimPy cluster
(alpha-beta network) and torch.distributed (point-to-point). All work for any P >= 1.

Costs: alpha = per-message latency (s), beta = s/byte, n = bytes, lg = log2, pof2 = the largest
power of two <= P, rem = P - pof2, s = value_bytes + index_bytes per sparse element. The
closed forms (functions in :mod:`sim.costs`) are the time on a contention-free network with the
rendezvous semantics of :mod:`sim.ops` and zero compute cost; they reduce to the formulas of
Thakur, Rabenseifner and Gropp (2005) / ../shared/COSTS.md when P is a power of two.
"""
from __future__ import annotations

from dataclasses import dataclass


import numpy as np

from .compression import Sparse, merge
from .ops import Compute, Recv, Send, SendRecv

__all__ = [
    "ring_allreduce",
    "rd_allreduce",
    "bruck_allgather",
    "topk_allgather_sum",
    "gtopk_tree",
    "gtopk_rd",
    "GTopKResult",
    "pof2_split",
    "mask_nbytes",
]


def pof2_split(P: int) -> tuple[int, int]:
    """(pof2, rem): the largest power of two <= P and P - pof2 (P >= 1)."""
    pof2 = 1 << (int(P).bit_length() - 1)
    return pof2, P - pof2


def mask_nbytes(m: int) -> int:
    """Bytes of a survival bitmask over m sparse entries: ceil(m / 8)."""
    return (int(m) + 7) // 8


def _rd_newrank(rank: int, rem: int) -> int:
    """Rank among the pof2 survivors of MPICH's fold (odd ranks < 2*rem hold their even partner's data)."""
    return rank // 2 if rank < 2 * rem else rank - rem


def _rd_real(newrank: int, rem: int) -> int:
    """Inverse of :func:`_rd_newrank`: the real rank behind a survivor's new rank."""
    return 2 * newrank + 1 if newrank < rem else newrank + rem


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
    d = buf.shape[0]
    sizes = [d // P + (1 if i < d % P else 0) for i in range(P)]
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    right, left = (rank + 1) % P, (rank - 1) % P

    def chunk(c):
        return slice(bounds[c], bounds[c + 1])

    # reduce-scatter: after P-1 steps rank r owns the full sum of chunk (r + 1) % P
    for s in range(P - 1):
        send_c = (rank - s) % P
        recv_c = (rank - s - 1) % P
        data = buf[chunk(send_c)].copy()
        got = yield SendRecv(right, data, data.shape[0] * value_bytes, left)
        yield Compute("reduce", got.shape[0])
        buf[chunk(recv_c)] = got + buf[chunk(recv_c)]
    # allgather of the reduced chunks
    for s in range(P - 1):
        send_c = (rank + 1 - s) % P
        recv_c = (rank - s) % P
        data = buf[chunk(send_c)].copy()
        got = yield SendRecv(right, data, data.shape[0] * value_bytes, left)
        buf[chunk(recv_c)] = got
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
    pof2, rem = pof2_split(P)
    if rank < 2 * rem:
        if rank % 2 == 0:
            yield Send(rank + 1, buf, n)
            return (yield Recv(rank + 1))
        got = yield Recv(rank - 1)
        yield Compute("reduce", buf.shape[0])
        buf = got + buf  # lower rank first
    newrank = _rd_newrank(rank, rem)
    mask = 1
    while mask < pof2:
        partner = _rd_real(newrank ^ mask, rem)
        got = yield SendRecv(partner, buf, n, partner)
        yield Compute("reduce", buf.shape[0])
        buf = (buf + got) if rank < partner else (got + buf)
        mask <<= 1
    if rank < 2 * rem:
        yield Send(rank - 1, buf, n)
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
    blocks = [item]
    dist = 1
    while dist < P:
        cnt = min(dist, P - dist)
        out = blocks[:cnt]
        got = yield SendRecv((rank - dist) % P, out, sum(nbytes_of(b) for b in out), (rank + dist) % P)
        blocks.extend(got)
        dist <<= 1
    # blocks[j] came from rank (rank + j) % P
    return [blocks[(r - rank) % P] for r in range(P)]


def topk_allgather_sum(rank: int, P: int, sel: Sparse, value_bytes: int = 4, index_bytes: int = 4):
    """Top-k S-SGD communication: allgather every rank's selection (Bruck) and sum them.

    sel: this rank's TopK selection (at most k entries). Returns the dense sum
    g = sum_p TopK(acc_p), float array (d,), added in rank order 0..P-1 so it is bit-identical on
    every rank. Cost with k entries per rank: ceil(lg P) alpha + (P-1) k s beta (COSTS.md, Top-k via
    allgather). Every local selection is applied, so residual_p = acc_p - TopK(acc_p).
    """
    blocks = yield from bruck_allgather(rank, P, sel, lambda s_: s_.nbytes(value_bytes, index_bytes))
    g = np.zeros(sel.d, dtype=sel.val.dtype if len(sel) else np.float64)
    yield Compute("reduce", sum(len(b) for b in blocks))
    for b in blocks:
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
        """Keep only entries whose index is in ``support`` (sorted int64)."""
        for _, idx, alive in self.sources:
            alive &= np.isin(idx, support, assume_unique=True)

    def survive_sent(self, sent_idx: np.ndarray, bits: np.ndarray):
        """Apply the survival bits returned for the vector this rank sent (entries sent_idx)."""
        self.survive(sent_idx[bits])

    def bits_for(self, who) -> np.ndarray:
        for w, _, alive in self.sources:
            if w == who:
                return alive.copy()
        raise KeyError(who)


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
    cur = sel
    children: list[tuple[int, Sparse]] = []
    parent = None
    mask = 1
    while mask < P:
        if rank & mask:
            parent = rank - mask
            yield Send(parent, cur, len(cur) * s_el)
            break
        if rank + mask < P:
            got = yield Recv(rank + mask)
            track.absorb(rank + mask, got)
            cur = yield from _merge(cur, got, k)
            track.survive(cur.idx)
            children.append((rank + mask, got))
        mask <<= 1
    if parent is None:
        g = cur
    else:
        g, bits = yield Recv(parent)
        if exact:
            track.survive_sent(cur.idx, bits)
    for child, got in reversed(children):
        bits = track.bits_for(child) if exact else None
        yield Send(child, (g, bits), len(g) * s_el + (mask_nbytes(len(got)) if exact else 0))
    applied = track.bits_for("own") if exact else _reference_mask(sel, g)
    return GTopKResult(g, applied)


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
    pof2, rem = pof2_split(P)
    if rank < 2 * rem and rank % 2 == 0:
        yield Send(rank + 1, sel, len(sel) * s_el)
        g, bits = yield Recv(rank + 1)
        applied = bits if exact else _reference_mask(sel, g)
        return GTopKResult(g, applied)
    track = _Tracker(sel)
    cur = sel
    folded = None
    if rank < 2 * rem:
        folded = yield Recv(rank - 1)
        track.absorb(rank - 1, folded)
        cur = yield from _merge(cur, folded, k)
        track.survive(cur.idx)
    newrank = _rd_newrank(rank, rem)
    mask = 1
    while mask < pof2:
        partner = _rd_real(newrank ^ mask, rem)
        got = yield SendRecv(partner, cur, len(cur) * s_el, partner)
        cur = yield from _merge(cur, got, k)
        track.survive(cur.idx)
        mask <<= 1
    if folded is not None:
        bits = track.bits_for(rank - 1) if exact else None
        yield Send(rank - 1, (cur, bits), len(cur) * s_el + (mask_nbytes(len(folded)) if exact else 0))
    applied = track.bits_for("own") if exact else _reference_mask(sel, cur)
    return GTopKResult(cur, applied)
