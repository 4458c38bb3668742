"""Closed-form alpha-beta costs of the collectives in :mod:`sim.comm.collectives` (seconds).

alpha: per-message latency (s); beta: seconds per byte; P: ranks (>= 1); n, m: bytes.
Each function is the exact time of the matching message-level collective on a contention-free
network (every message alone costs alpha + bytes * beta) with zero compute cost, for ANY P;
``tests/test_costs.py`` checks that equality on the SimPy network for P in 1..16, 31, 32, 33.
For P a power of two they are the formulas of Thakur, Rabenseifner and Gropp (2005) and
docs/costs.md. Reduction and merge compute are a separate, explicit term of the compute model.
"""
from __future__ import annotations

from sim.comm.collectives import mask_nbytes, pof2_split

__all__ = [
    "ceil_lg",
    "ring_allreduce_time",
    "rd_allreduce_time",
    "bruck_allgather_time",
    "topk_allgather_time",
    "gtopk_tree_time",
    "gtopk_rd_time",
    "hier_allreduce_time",
    "hier_topk_time",
    "hier_gtopk_time",
]


def ceil_lg(P: int) -> int:
    """ceil(log2 P) for P >= 1 (0 for P = 1)."""
    return (int(P) - 1).bit_length()


def ring_allreduce_time(P: int, d: int, alpha: float, beta: float, value_bytes: int = 4) -> float:
    """Ring allreduce of d values: 2(P-1) (alpha + ceil(d/P) * value_bytes * beta).

    With n = d * value_bytes divisible by P this is 2(P-1) alpha + 2 n (P-1)/P beta (docs/costs.md);
    otherwise every step is paced by the largest chunk, ceil(d/P) elements.
    """
    if P == 1:
        return 0.0
    chunk = -(-d // P) * value_bytes
    return 2 * (P - 1) * (alpha + chunk * beta)


def rd_allreduce_time(P: int, n: int, alpha: float, beta: float) -> float:
    """Recursive-doubling allreduce of n bytes: (lg pof2 + 2*[rem > 0]) (alpha + n beta)."""
    pof2, rem = pof2_split(P)
    rounds = pof2.bit_length() - 1 + (2 if rem else 0)
    return rounds * (alpha + n * beta)


def bruck_allgather_time(P: int, m: int, alpha: float, beta: float) -> float:
    """Bruck allgather of one m-byte block per rank: ceil(lg P) alpha + (P-1) m beta."""
    return ceil_lg(P) * alpha + (P - 1) * m * beta


def topk_allgather_time(P: int, k: int, alpha: float, beta: float, value_bytes: int = 4, index_bytes: int = 4) -> float:
    """Top-k S-SGD allgather, k elements of s = value_bytes + index_bytes per rank: ceil(lg P) alpha + (P-1) k s beta."""
    return bruck_allgather_time(P, k * (value_bytes + index_bytes), alpha, beta)


def gtopk_tree_time(P: int, k: int, alpha: float, beta: float, value_bytes: int = 4, index_bytes: int = 4,
                    exact: bool = True) -> float:
    """gTop-k binomial-tree reduce + broadcast with k-element messages.

    ceil(lg P) (alpha + k s beta) + ceil(lg P) (alpha + (k s + b) beta), b = ceil(k/8) survival-mask bytes
    for the exact mask, 0 for the reference-code rule; = 2 lg P (alpha + k s beta) (ICDCS 2019) when b = 0.
    """
    ks = k * (value_bytes + index_bytes)
    b = mask_nbytes(k) if exact else 0
    L = ceil_lg(P)
    return L * (alpha + ks * beta) + L * (alpha + (ks + b) * beta)


def gtopk_rd_time(P: int, k: int, alpha: float, beta: float, value_bytes: int = 4, index_bytes: int = 4,
                  exact: bool = True) -> float:
    """gTop-k recursive doubling with k-element messages.

    lg pof2 (alpha + k s beta), plus (alpha + k s beta) + (alpha + (k s + b) beta) when P is not a power of
    two (fold in and result back to the extra ranks), b = ceil(k/8) (exact mask) or 0 (reference rule).
    """
    ks = k * (value_bytes + index_bytes)
    pof2, rem = pof2_split(P)
    t = (pof2.bit_length() - 1) * (alpha + ks * beta)
    if rem:
        b = mask_nbytes(k) if exact else 0
        t += (alpha + ks * beta) + (alpha + (ks + b) * beta)
    return t


# ----------------------------------------------------------------------------- hierarchical clusters
# N = P / G nodes of G ranks; (alpha_i, beta_i): an uncontended message inside a node, (alpha_e, beta_e):
# between nodes (sim.machine.topology.ClusterSpec.intra_alpha_beta / inter_alpha_beta). Exact on a contention-free
# cluster: one NIC per GPU (rail-optimised), or any cluster where at most one rank per NIC talks off-node.


def hier_allreduce_time(N: int, G: int, d: int, alpha_i: float, beta_i: float, alpha_e: float, beta_e: float,
                        value_bytes: int = 4, nic_share: int = 1) -> float:
    """Two-level dense allreduce of d values (:func:`sim.comm.collectives.hier_allreduce`):
    2(G-1)(alpha_i + ceil(d/G) v beta_i) + 2(N-1)(alpha_e + S ceil(ceil(d/G)/N) v beta_e), v = value_bytes,
    S = nic_share; with G N dividing d, n = d v: 2(G-1)(alpha_i + n/G beta_i) + 2(N-1)(alpha_e + S n/(G N) beta_e)
    (docs/costs.md). S = 1: one NIC per GPU (rail-optimised), exact on a contention-free cluster when G N divides d
    (otherwise the time paced by the largest chunk in every step). S = G / nics_per_node: the S inter-node
    rings that share a NIC served back to back (docs/costs.md's shared-NIC form, an upper bound: the simulation
    overlaps part of their latencies)."""
    c = -(-d // G)
    t = 2 * (G - 1) * (alpha_i + c * value_bytes * beta_i)
    if N > 1:
        t += 2 * (N - 1) * (alpha_e + nic_share * -(-c // N) * value_bytes * beta_e)
    return t


def hier_topk_time(N: int, G: int, k: int, alpha_i: float, beta_i: float, alpha_e: float, beta_e: float,
                   value_bytes: int = 4, index_bytes: int = 4) -> float:
    """Hierarchical Top-k allgather (:func:`sim.comm.collectives.hier_topk_allgather_sum`), m = k s bytes per rank:
    gather ceil(lg G) alpha_i + (G-1) m beta_i, inter-node Bruck of G m-byte node blocks
    ceil(lg N) alpha_e + (N-1) G m beta_e, broadcast of all P blocks ceil(lg G)(alpha_i + N G m beta_i)."""
    m = k * (value_bytes + index_bytes)
    return (bruck_allgather_time(G, m, alpha_i, beta_i) + bruck_allgather_time(N, G * m, alpha_e, beta_e)
            + ceil_lg(G) * (alpha_i + N * G * m * beta_i))


def hier_gtopk_time(N: int, G: int, k: int, alpha_i: float, beta_i: float, alpha_e: float, beta_e: float,
                    value_bytes: int = 4, index_bytes: int = 4, exact: bool = True) -> float:
    """Hierarchical gTop-k (:func:`sim.comm.collectives.hier_gtopk`): intra-node binomial reduce
    ceil(lg G)(alpha_i + k s beta_i), inter-node recursive doubling :func:`gtopk_rd_time` (N, alpha_e, beta_e),
    intra-node broadcast ceil(lg G)(alpha_i + (k s + b) beta_i), b = ceil(k/8) (exact mask) or 0 (reference).
    G = 1 is :func:`gtopk_rd_time`."""
    ks = k * (value_bytes + index_bytes)
    b = mask_nbytes(k) if exact else 0
    L = ceil_lg(G)
    return (L * (alpha_i + ks * beta_i) + gtopk_rd_time(N, k, alpha_e, beta_e, value_bytes, index_bytes, exact)
            + L * (alpha_i + (ks + b) * beta_i))


# ----------------------------------------------------------------------------- successors (issue #11)


def binomial_bcast_time(P: int, m: int, alpha: float, beta: float) -> float:
    """Binomial-tree broadcast of m bytes from any root (:func:`sim.comm.collectives.binomial_bcast_schedule` on ranks
    relative to the root): ceil(lg P) (alpha + m beta); the root sends in every round, so the last round ends
    after ceil(lg P) message times. 0 for P = 1."""
    return ceil_lg(P) * (alpha + m * beta)


def cltk_time(P: int, k: int, alpha: float, beta: float, value_bytes: int = 4, index_bytes: int = 4,
              allreduce: str = "ring") -> float:
    """ScaleCom's CLT-k exchange (:mod:`sim.algorithms.cltk`): the leader's binomial broadcast of k indices, then a
    dense allreduce of the k values at them: ceil(lg P) (alpha + k index_bytes beta) plus
    :func:`ring_allreduce_time` (P, k) (``allreduce="ring"``) or :func:`rd_allreduce_time` (P, k value_bytes)
    (``"recursive_doubling"``). Raises KeyError for another allreduce."""
    bcast = binomial_bcast_time(P, k * index_bytes, alpha, beta)
    if allreduce == "ring":
        return bcast + ring_allreduce_time(P, k, alpha, beta, value_bytes)
    if allreduce == "recursive_doubling":
        return bcast + rd_allreduce_time(P, k * value_bytes, alpha, beta)
    raise KeyError(allreduce)


__all__ += ["binomial_bcast_time", "cltk_time"]


def oktopk_time(P: int, k: int, alpha: float, beta: float, value_bytes: int = 4, index_bytes: int = 4,
                count_bytes: int = 4) -> float:
    """Ok-Topk's sparse allreduce (:mod:`sim.algorithms.oktopk`) in a steady-state iteration under the timing-only
    assumption (balanced regions: every rank selects kr = ceil(k/P) entries in every region and the global
    selection holds kr entries in every region, so the balance step sends nothing):

    (P-1)(alpha + kr s beta)                     split and reduce, P-1 rotation rounds (Li and Hoefler 2022, Eq. 1)
    + ceil(lg P) alpha + (P-1) count_bytes beta  allgather of the candidate counts (Bruck)
    + ceil(lg P) alpha + (P-1) kr s beta         allgatherv of the balanced blocks (Bruck)

    with s = value_bytes + index_bytes; 0 for P = 1. For P a power of two dividing k, with 8-byte entries (the
    paper's two 4-byte words) and ignoring the counts' bytes, this is (P - 1 + 2 lg P) alpha + 4k(P-1)/P words
    beta, below the paper's bound :func:`oktopk_bound_time` by (P + 1) alpha + 2k(P-1)/P words beta: the bound's
    worst-case balance step (P alpha + 2k(P-1)/P words) and one alpha of its split-and-reduce."""
    if P == 1:
        return 0.0
    m = -(-int(k) // P) * (value_bytes + index_bytes)
    L = ceil_lg(P)
    return (P - 1) * (alpha + m * beta) + (L * alpha + (P - 1) * count_bytes * beta) + (L * alpha + (P - 1) * m * beta)


def oktopk_bound_time(P: int, k: int, alpha: float, beta: float, value_bytes: int = 4, index_bytes: int = 4) -> float:
    """The paper's upper bound on Ok-Topk's sparse allreduce (Li and Hoefler, PPoPP 2022, Eq. 3):
    (2P + 2 lg P) alpha + 6k(P-1)/P beta with beta per 4-byte word and an entry of two words, i.e.
    (2P + 2 log2 P) alpha + 3k(P-1)/P s beta with s = value_bytes + index_bytes bytes per entry (log2 P real, the
    paper assumes P a power of two). Eq. 1 (split and reduce, (P-1) alpha + 2k(P-1)/P words) plus Eq. 2 (balance
    and allgatherv, <= (P + 2 lg P) alpha + 4k(P-1)/P words). 0 for P = 1."""
    import math

    if P == 1:
        return 0.0
    return (2 * P + 2 * math.log2(P)) * alpha + 3 * k * (P - 1) / P * (value_bytes + index_bytes) * beta


__all__ += ["oktopk_time", "oktopk_bound_time"]


# ----------------------------------------------------------------------------- SparCML (issue #11)


def _ssar_bytes(c: int, width: int, value_bytes: int, index_bytes: int, dense_threshold: float) -> int:
    """Bytes of a SparCML stream of c entries (at most width) over width coordinates: width * value_bytes if
    :func:`sim.comm.collectives.ssar_is_dense` (c, width), else c (value_bytes + index_bytes)."""
    from sim.comm.collectives import ssar_is_dense

    if ssar_is_dense(c, width, value_bytes, index_bytes, dense_threshold):
        return int(width) * int(value_bytes)
    return min(int(c), int(width)) * (int(value_bytes) + int(index_bytes))


def sparcml_rd_time(P: int, k: int, n: int, alpha: float, beta: float, value_bytes: int = 4, index_bytes: int = 4,
                    dense_threshold: float = 1.0) -> float:
    """SparCML's SSAR_Recursive_double (:func:`sim.comm.collectives.ssar_recursive_doubling`) of P selections of k
    entries over n coordinates, with pairwise disjoint supports (the worst case; the timing-only assumption):

    [rem > 0] (alpha + B(k) beta) + sum_{j=1..lg pof2} (alpha + B(S_j) beta) + [rem > 0] (alpha + B(P k) beta),
    S_j = (2^(j-1) + min(rem, 2^(j-1))) k,

    the fold, the lg pof2 rounds paced by the lowest block (its stream, holding the folded pairs, is the largest;
    every message is sent by one of two blocks of equal ready time), the unfold. B(c) = n value_bytes if the
    stream is dense (c (value_bytes + index_bytes) >= dense_threshold n value_bytes), else c (value_bytes +
    index_bytes): the messages double each round until they switch. For P = 2^L before any switch this is the
    paper's worst case lg P alpha + (P - 1) k beta, beta per (index, value) pair; after the switch at round j*
    every round costs alpha + n value_bytes beta. 0 for P = 1."""
    if P == 1:
        return 0.0
    pof2, rem = pof2_split(P)
    b = lambda c: _ssar_bytes(c, n, value_bytes, index_bytes, dense_threshold)  # noqa: E731
    t = alpha + b(k) * beta if rem else 0.0
    m = 1
    while m < pof2:
        t += alpha + b((m + min(rem, m)) * k) * beta
        m <<= 1
    if rem:
        t += alpha + b(P * k) * beta
    return t


def sparcml_split_time(P: int, k: int, n: int, alpha: float, beta: float, value_bytes: int = 4,
                       index_bytes: int = 4, dense_threshold: float = 1.0) -> float:
    """SparCML's SSAR_Split_allgather (:func:`sim.comm.collectives.ssar_split_allgather`) of P selections of k entries
    over n coordinates under the timing-only assumption (disjoint supports spread evenly over the pof2 regions,
    every piece of a stream of c entries holding ceil(c / pof2) entries over the largest region's width
    m = ceil(n / pof2)):

    [rem > 0] (alpha + B(k) beta) + (pof2 - 1)(alpha + b beta) + sum_{j=1..lg pof2} (alpha + B(2^(j-1) R) beta)
    + [rem > 0] (alpha + B(pof2 R) beta),

    the fold; pof2 - 1 pairwise rounds of the split phase, paced by the largest piece b (of a folded survivor's
    stream of c = 2k entries when rem > 0, else c = k: m value_bytes if its stream is dense or ceil(c / pof2)
    (value_bytes + index_bytes) >= dense_threshold m value_bytes, else ceil(c / pof2)(value_bytes + index_bytes));
    the allgather's lg pof2 rounds of the region sums, R = min(rem ceil(2k / pof2) + (pof2 - rem) ceil(k / pof2), m)
    entries each, doubling each round until the switch (B as in :func:`sparcml_rd_time`, over n); the unfold.
    For P = 2^L dividing k before any switch: (P - 1 + lg P) alpha + ((P - 1) k / P + (P - 1) k) s beta. 0 for
    P = 1."""
    if P == 1:
        return 0.0
    from sim.comm.collectives import ssar_is_dense

    pof2, rem = pof2_split(P)
    s = value_bytes + index_bytes
    m = -(-int(n) // pof2)
    c_big = min(2 * k, n) if rem else k
    p_big, p_small = -(-c_big // pof2), -(-k // pof2)
    dense_big = (ssar_is_dense(c_big if not rem else 2 * k, n, value_bytes, index_bytes, dense_threshold)
                 or ssar_is_dense(p_big, m, value_bytes, index_bytes, dense_threshold))
    piece = m * value_bytes if dense_big else p_big * s
    R = min(rem * p_big + (pof2 - rem) * p_small, m)
    b = lambda c: _ssar_bytes(c, n, value_bytes, index_bytes, dense_threshold)  # noqa: E731
    t = alpha + b(k) * beta if rem else 0.0
    t += (pof2 - 1) * (alpha + piece * beta)
    j = 1
    while j < pof2:
        t += alpha + b(j * R) * beta
        j <<= 1
    if rem:
        t += alpha + b(pof2 * R) * beta
    return t


__all__ += ["sparcml_rd_time", "sparcml_split_time"]


def powersgd_time(P: int, d: int, rows: int, cols: int, r: int, alpha: float, beta: float, value_bytes: int = 4,
                  allreduce: str = "ring") -> float:
    """PowerSGD's exchange of one segment of d values viewed as a rows x cols matrix at rank r
    (:mod:`sim.algorithms.powersgd`; Vogels et al. NeurIPS 2019, Algorithm 1): an allreduce of the rows r values
    of P, then one of the cols r values of Q. ``allreduce="ring"``:
    2(P-1)(alpha + ceil(rows r / P) value_bytes beta) + 2(P-1)(alpha + ceil(cols r / P) value_bytes beta)
    (:func:`ring_allreduce_time` twice); ``"recursive_doubling"``: :func:`rd_allreduce_time` of rows r and of
    cols r values. r = 0 (a segment not worth compressing): one allreduce of the d values. 0 for P = 1.
    Raises KeyError for another allreduce."""
    if allreduce == "ring":
        one = lambda n: ring_allreduce_time(P, n, alpha, beta, value_bytes)  # noqa: E731
    elif allreduce == "recursive_doubling":
        one = lambda n: rd_allreduce_time(P, n * value_bytes, alpha, beta)  # noqa: E731
    else:
        raise KeyError(allreduce)
    if r == 0:
        return one(d)
    return one(rows * r) + one(cols * r)


__all__ += ["powersgd_time"]
