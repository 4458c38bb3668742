"""Collectives over all ranks at once, as data: the vectorised twin of the per-rank programs.

A per-rank program (:mod:`sim.comm.collectives`) yields one rank's operations (:mod:`sim.base.ops`). The
programs here yield the same collective for *every* rank at once, one round at a time, as two kinds of plain
data that any engine may interpret (the fast engine, :meth:`sim.engine.fastsim.FastCluster.run`, does):

- :class:`Work`  -- every rank computes ``work`` of ``kind`` (a scalar for all, or an int / float array (P,));
- :class:`Round` -- rank r sends ``nbytes`` (scalar or array (P,), bytes) to ``dst[r]`` and receives from
  ``src[r]`` (int arrays (P,), -1 = none), a matching.

Both read the schedules of :mod:`sim.comm.collectives` (``ring_schedule``, ``rd_schedule``, ``bruck_schedule``,
``binomial_reduce_schedule``, ``binomial_bcast_schedule``), which take one rank or an array of ranks; the
sequence of phases of each collective (which schedule on which group of ranks, with which message sizes and
compute) is written once per collective below (:func:`ring_allreduce_rounds`, :func:`hier_gtopk_rounds`, ...),
and an algorithm chooses one; it never touches an engine. The per-rank programs of the same collectives yield,
rank by rank, the same messages and compute; ``tests/test_fastsim.py`` holds the two to 1e-9 on every
collective through the two engines, and ``tests/test_timing.py`` the timing-only sizes to the numerics'.

Sizes are timing-only (:mod:`sim.comm.payloads`): dense messages of every value, sparse selections of exactly
k entries, every merge keeping k. Identity of arrays matters for speed, not for the numbers: a ring reuses the
same (dst, src) arrays every round so an engine may cache their routes, and its sizes are slices of one read-only
table (:func:`shifted_ring_rounds`) so an engine may evaluate elementwise costs of the table once.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Hashable, Iterator, Union

import numpy as np

from sim.comm import collectives as C

__all__ = ["Work", "Round", "RingTable", "SKIP_RING", "Rounds", "count_messages", "chunk_size", "mapper", "ring_rounds",
           "shifted_ring_rounds", "binomial_rounds", "ring_allreduce_rounds", "rd_allreduce_rounds", "hier_allreduce_rounds", "bcast_rounds",
           "topk_allgather_rounds", "hier_topk_allgather_rounds",
           "gtopk_tree_rounds", "gtopk_rd_rounds", "hier_gtopk_rounds"]


@dataclass(frozen=True, eq=False)
class Work:
    """Every rank computes ``work`` of ``kind`` (a key of :data:`sim.base.ops.COMPUTE_KINDS`): a scalar for all
    ranks or an array (P,) (0 = nothing on that rank)."""

    kind: str
    work: Union[int, float, np.ndarray]


@dataclass(frozen=True, eq=False)
class Round:
    """One round of messages: rank r sends ``nbytes`` (int, or int array (P,)) bytes to ``dst[r]`` and receives
    from ``src[r]`` (int arrays (P,); -1: no send / no receive). The sends and receives form a matching.

    ``pattern``: an optional hashable name of (dst, src) that an engine may use in its caches: ``("rotation", c)``
    promises dst[r] = (r + c) % P and src[r] = (r - c) % P for every rank (1 <= c < P); any other name promises
    only that Rounds of one collective on one P with equal names have equal dst and src (tests/test_fastsim_runs.py
    checks both for every registered algorithm). None: no promise."""

    dst: np.ndarray
    src: np.ndarray
    nbytes: Union[int, np.ndarray]
    pattern: Hashable = None
    #: On the first Round of a ring from :func:`shifted_ring_rounds` only: the whole ring as tables
    #: (:class:`RingTable`), for an engine that evaluates it at once and then sends the program :data:`SKIP_RING`.
    ring: "RingTable | None" = None


#: What an engine may ``send`` a program (a generator) right after it yielded a Round whose ``ring`` is set: the
#: program then jumps past that ring's remaining Rounds and Works (:func:`shifted_ring_rounds`; through ``yield
#: from`` the value reaches it) and ``send`` returns the op after the ring. An engine must check that it did: a
#: program that loops over a sub-program instead of delegating to it goes on with the ring's next round.
SKIP_RING = object()


@dataclass(frozen=True, eq=False)
class RingTable:
    """A ring of :func:`shifted_ring_rounds` as tables, on its first :class:`Round`: the rounds are rotations by
    ``c`` (the Round's pattern ``("rotation", c)``, the same dst / src arrays every round); round i sends
    ``sizes_b[send_at[i]:send_at[i] + P]`` bytes (int64 (2P,), read-only, the Rounds' own ``nbytes`` are these
    slices) and, where ``reduce_at[i] >= 0``, is followed by ``Work("reduce", elems[reduce_at[i]:reduce_at[i] +
    P])`` (elements, int64 (2P,) read-only). Both tables are one chunk table laid out twice (``sizes_b[j] ==
    sizes_b[j + P]``: rank r's neighbour r - c sends ``sizes_b[send_at[i] + r - c]``, read wrapped), send_at /
    reduce_at: int64 (rounds,) in [0, P]. The same rounds as the Rounds that follow, so an engine that uses the
    table computes what it would compute from them."""

    c: int
    sizes_b: np.ndarray
    elems: np.ndarray
    send_at: np.ndarray
    reduce_at: np.ndarray


#: What a vectorised collective yields.
Rounds = Iterator[Union[Work, Round]]


def count_messages(ops) -> int:
    """Messages a vectorised program sends, summed over all ranks: the number of ranks r with ``dst[r] >= 0`` in
    every :class:`Round` (Work is skipped). ops: an iterable of Work and Round. Returns an int >= 0."""
    n = 0
    seen = {}  # a ring reuses its (dst) arrays every round: count each array once
    for op in ops:
        if isinstance(op, Round):
            key = id(op.dst)
            got = seen.get(key)
            if got is None or got[0] is not op.dst:
                got = seen[key] = (op.dst, int(np.count_nonzero(op.dst >= 0)))
            n += got[1]
    return n


def chunk_size(total, parts: int, c):
    """Elements of chunk ``c`` when ``total`` elements are cut by ``np.array_split`` into ``parts`` (scalars or
    int arrays, broadcast)."""
    return total // parts + (c < total % parts)


def mapper(scale, offset):
    """Position -> rank map of a group, on every rank at once: rank = pos * scale + offset (scale, offset: ints or
    int arrays (P,)); -1 (no partner) stays -1."""
    def to_rank(p):
        return np.where(p >= 0, p * scale + offset, -1)
    return to_rank


# ----------------------------------------------------------------------------- one schedule, any group


def ring_rounds(steps, to_rank, size_of, value_bytes: int) -> Rounds:
    """Rounds of ring steps ``(dst, src, send_chunk, recv_chunk, reduce)`` (:func:`sim.comm.collectives.ring_schedule`
    on positions): each a Round of ``size_of(send_chunk) * value_bytes`` bytes, then a ``reduce`` Work of the received
    chunk in reduce-scatter steps. ``to_rank`` maps positions to ranks."""
    mapped = {}
    for dst, src, send_c, recv_c, reduce in steps:
        key = id(dst)
        if key not in mapped:  # the ring's (dst, src) arrays are the same objects every step: map them once
            mapped[key] = (dst, to_rank(dst), to_rank(src))
        _, gd, gs = mapped[key]
        yield Round(gd, gs, size_of(send_c) * value_bytes)
        if reduce:
            yield Work("reduce", size_of(recv_c))


def binomial_rounds(schedule, to_rank, nbytes_of, merge_work) -> Rounds:
    """Rounds of a binomial schedule ``(mask, dst, src)`` (reduce or broadcast, on positions): each a Round of
    ``nbytes_of(mask, dst)`` bytes, then (if ``merge_work``) a ``merge`` Work of ``merge_work`` elements on the
    receivers."""
    for mask, dst, src in schedule:
        yield Round(to_rank(dst), to_rank(src), nbytes_of(mask, dst))
        if merge_work:
            yield Work("merge", np.where(src >= 0, merge_work, 0))


def bcast_rounds(R: np.ndarray, P: int, root: int, nbytes: int) -> Rounds:
    """Binomial broadcast of ``nbytes`` from ``root`` over ranks R = arange(P) (the tree rotated so root is
    position 0), as :func:`sim.algorithms.cltk.bcast_from` per rank."""
    def to_rank(p):
        return np.where(p >= 0, (p + root) % P, -1)

    for _, dst, src in C.binomial_bcast_schedule((R - root) % P, P):
        yield Round(to_rank(dst), to_rank(src), nbytes)


# ----------------------------------------------------------------------------- dense allreduce


def shifted_ring_rounds(pos: np.ndarray, n_ring: int, inner: int, sizes: np.ndarray, value_bytes: int) -> Rounds:
    """:func:`ring_rounds` of :func:`sim.comm.collectives.ring_schedule` on ring positions ``pos`` (int array (P,))
    where rank r = pos[r] * inner + (r % inner), with chunk sizes ``sizes[c, l]`` (int array (n_ring, inner): the
    elements of chunk c on the ranks of inner index l). The schedule shifts with the position (``ring_schedule``: at
    step s rank r sends chunk (pos - s) % n_ring, then (pos + 1 - s) % n_ring), so it is read once on position 0
    (Python ints) and every round's sizes are a slice of the chunk table laid out twice: chunk (c0 + pos) % n_ring
    of the rank r = pos * inner + l sits at (c0 * inner + r) of the flattened doubled table. The same Rounds and
    Work as :func:`ring_rounds` (equal arrays), without O(P) index arithmetic per round. In the usual layout (every
    round the rotation by ``inner``) the first Round carries the whole ring as a :class:`RingTable`, and the
    generator ends early when it is sent :data:`SKIP_RING` there (an engine that evaluated the ring from the table
    skips its 2(P - 1) rounds: about 10 us each of Python at P = 16384)."""
    steps = C.ring_schedule(pos, n_ring)
    first = next(steps, None)
    if first is None:  # n_ring = 1: no rounds
        return
    right, left = first[0], first[1]
    offset = np.arange(pos.shape[0], dtype=np.int64) % inner if inner > 1 else 0
    gd, gs = right * inner + offset, left * inner + offset  # the same arrays every round (an engine may cache)
    flat = sizes.reshape(-1)
    ext = np.concatenate((flat, flat))  # (2 n_ring * inner,): chunk c of inner index l at c * inner + l
    ext_b = ext * value_bytes
    ext.setflags(write=False)  # read-only: an engine may compute elementwise functions of them once
    ext_b.setflags(write=False)
    P = pos.shape[0]
    # the usual layout, rank r = (r // inner) * inner + r % inner: every round is the rotation by inner
    rot = ("rotation", inner) if P > inner and np.array_equal(gd, (np.arange(P) + inner) % P) else None
    steps, send, recv = _ring_steps(n_ring)
    table = None
    if rot is not None:
        send_at = send * inner
        reduce_at = np.where(recv >= 0, recv * inner, -1)
        send_at.setflags(write=False)
        reduce_at.setflags(write=False)
        table = RingTable(inner, ext_b, ext, send_at, reduce_at)
    for i, (send_c, recv_c, reduce) in enumerate(steps):
        if (yield Round(gd, gs, ext_b[send_c * inner:send_c * inner + P], rot, table if i == 0 else None)) \
                is SKIP_RING and i == 0:
            return
        if reduce:
            yield Work("reduce", ext[recv_c * inner:recv_c * inner + P])


@functools.lru_cache(maxsize=16)
def _ring_steps(n_ring: int):
    """Position 0's ring schedule (:func:`sim.comm.collectives.ring_schedule`) on n_ring positions, read once per
    n_ring (a plan asks for a hundred rings of one P): (list of (send chunk, received chunk, reduce) Python ints and
    bools, int64 (rounds,) send chunks, int64 (rounds,) received chunks where reduced else -1), arrays read-only."""
    steps = [(send_c, recv_c, reduce) for _, _, send_c, recv_c, reduce in C.ring_schedule(0, n_ring)]
    send = np.array([st[0] for st in steps], dtype=np.int64)
    recv = np.array([st[1] if st[2] else -1 for st in steps], dtype=np.int64)
    send.setflags(write=False)
    recv.setflags(write=False)
    return steps, send, recv


def ring_allreduce_rounds(R: np.ndarray, P: int, n, value_bytes: int, to_rank=None) -> Rounds:
    """:func:`sim.comm.collectives.ring_allreduce` of n values on every rank R = arange(P): 2(P-1) rounds of one
    ``np.array_split`` chunk each, a ``reduce`` Work of the received chunk in the first P-1. to_rank: the position
    -> rank map (default: the identity, evaluated by :func:`shifted_ring_rounds`)."""
    if to_rank is None:
        yield from shifted_ring_rounds(R, P, 1, chunk_size(n, P, np.arange(P, dtype=np.int64))[:, None], value_bytes)
        return
    yield from ring_rounds(C.ring_schedule(R, P), to_rank, lambda c: chunk_size(n, P, c), value_bytes)


def rd_allreduce_rounds(R: np.ndarray, P: int, n: int, value_bytes: int) -> Rounds:
    """:func:`sim.comm.collectives.rd_allreduce` of n values: MPICH's recursive doubling with fold / unfold for P
    not a power of two, every message n values, a ``reduce`` Work of n on the receivers of fold and exchange."""
    for phase, dst, src in C.rd_schedule(R, P):
        yield Round(dst, src, n * value_bytes)
        if phase == "fold":
            yield Work("reduce", np.where(src >= 0, n, 0))
        elif phase == "exchange":
            yield Work("reduce", np.where(dst >= 0, n, 0))


def hier_allreduce_rounds(R: np.ndarray, P: int, G: int, n: int, value_bytes: int) -> Rounds:
    """:func:`sim.comm.collectives.hier_allreduce`: ring reduce-scatter inside each node of G ranks, ring allreduce
    across the P / G nodes of the chunk each rank owns (rank = node * G + local), ring allgather inside the node."""
    local, node = R % G, R // G
    N = P // G
    intra = mapper(1, node * G)
    steps = list(C.ring_schedule(local, G))
    yield from ring_rounds(steps[:G - 1], intra, lambda c: chunk_size(n, G, c), value_bytes)
    own_l = chunk_size(n, G, (np.arange(G, dtype=np.int64) + 1) % G)  # each local index's own chunk
    yield from shifted_ring_rounds(node, N, G, chunk_size(own_l[None, :], N, np.arange(N, dtype=np.int64)[:, None]),
                                   value_bytes)
    yield from ring_rounds(steps[G - 1:], intra, lambda c: chunk_size(n, G, c), value_bytes)


# ----------------------------------------------------------------------------- sparse allgather


def topk_allgather_rounds(R: np.ndarray, P: int, k: int, entry_bytes: int) -> Rounds:
    """The Bruck allgather of :func:`sim.comm.collectives.topk_allgather_sum`: ceil(lg P) rounds, each rank's
    k entries of ``entry_bytes`` per block, then the ``reduce`` Work of the P k entries it sums."""
    m = k * entry_bytes
    for dst, src, cnt in C.bruck_schedule(R, P):
        yield Round(dst, src, cnt * m)
    yield Work("reduce", P * k)


def hier_topk_allgather_rounds(R: np.ndarray, P: int, G: int, k: int, entry_bytes: int) -> Rounds:
    """:func:`sim.comm.collectives.hier_topk_allgather_sum`: binomial gather of the node's G selections to its
    leader, Bruck allgather of the nodes' blocks among leaders, binomial broadcast of all P blocks in the node,
    then the ``reduce`` Work of the P k entries."""
    m = k * entry_bytes
    local, node = R % G, R // G
    N = P // G
    intra = mapper(1, node * G)
    yield from binomial_rounds(C.binomial_reduce_schedule(local, G), intra,
                               lambda mask, dst: np.minimum(mask, G - local) * m, 0)
    leader = local == 0
    for dst, src, cnt in C.bruck_schedule(node, N):
        yield Round(np.where(leader, dst * G, -1), np.where(leader, src * G, -1), cnt * G * m)
    yield from binomial_rounds(C.binomial_bcast_schedule(local, G), intra, lambda mask, dst: P * m, 0)
    yield Work("reduce", P * k)


# ----------------------------------------------------------------------------- gTop-k


def _gtopk_rd_group(pos, n: int, to_rank, k: int, entry_bytes: int, mask_bytes: int, active=None) -> Rounds:
    """gTop-k's recursive doubling on positions ``pos`` of groups of n (fold, lg pof2 exchanges, unfold): k entries
    per message plus the survival bits on unfold, a ``merge`` Work of 2k on each receiver of fold and exchange."""
    for phase, dst, src in C.rd_schedule(pos, n):
        if active is not None:
            dst, src = np.where(active, dst, -1), np.where(active, src, -1)
        nb = k * entry_bytes + (mask_bytes if phase == "unfold" else 0)
        yield Round(to_rank(dst), to_rank(src), nb)
        if phase == "fold":
            yield Work("merge", np.where(src >= 0, 2 * k, 0))
        elif phase == "exchange":
            yield Work("merge", np.where(dst >= 0, 2 * k, 0))


def gtopk_tree_rounds(R: np.ndarray, P: int, k: int, entry_bytes: int, mask_bytes: int) -> Rounds:
    """:func:`sim.comm.collectives.gtopk_tree`: binomial reduce to rank 0 (k entries up, a ``merge`` of 2k on each
    receiver), then binomial broadcast of g with ``mask_bytes`` of survival bits (0 for the reference mask)."""
    m = k * entry_bytes
    ident = mapper(1, 0)
    yield from binomial_rounds(C.binomial_reduce_schedule(R, P), ident, lambda mask, dst: m, 2 * k)
    yield from binomial_rounds(C.binomial_bcast_schedule(R, P), ident, lambda mask, dst: m + mask_bytes, 0)


def gtopk_rd_rounds(R: np.ndarray, P: int, k: int, entry_bytes: int, mask_bytes: int) -> Rounds:
    """:func:`sim.comm.collectives.gtopk_rd`: recursive doubling over all P ranks (see :func:`_gtopk_rd_group`)."""
    yield from _gtopk_rd_group(R, P, mapper(1, 0), k, entry_bytes, mask_bytes)


def hier_gtopk_rounds(R: np.ndarray, P: int, G: int, k: int, entry_bytes: int, mask_bytes: int) -> Rounds:
    """:func:`sim.comm.collectives.hier_gtopk`: binomial reduce inside each node of G ranks, recursive doubling
    among the node leaders (rank = node * G), binomial broadcast inside the node."""
    m = k * entry_bytes
    local, node = R % G, R // G
    N = P // G
    intra = mapper(1, node * G)
    yield from binomial_rounds(C.binomial_reduce_schedule(local, G), intra, lambda mask, dst: m, 2 * k)
    yield from _gtopk_rd_group(node, N, mapper(G, 0), k, entry_bytes, mask_bytes, active=local == 0)
    yield from binomial_rounds(C.binomial_bcast_schedule(local, G), intra, lambda mask, dst: m + mask_bytes, 0)
