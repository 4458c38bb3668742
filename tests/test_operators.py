"""Property tests of the compression operators and of Assumption 1 / Lemma 2 (docs/theory.md sections 1, 4, 5).

- TopK is a k-contraction for every x (checked in exact rational arithmetic and in float64), keeps
  min(k, nnz(x)) entries, and picks the k largest |x_i| with ties to the lower index.
- RandK: E||x - RandK(x)||^2 = (1 - k/d)||x||^2, computed exactly by enumerating every k-subset
  through the real ``randk``; a seeded RandK is reproducible and returns k distinct sorted coordinates.
- The merge operator is commutative bit-for-bit and not associative (hypothesis ``find`` plus the
  hard-coded witness it found).
- Assumption 1 (delta <= 1) always holds for P = 1 and fails for some P >= 2 inputs (``find`` plus a
  hard-coded witness run through the real gtopk_tree collective); step_stats reports delta > 1.
- Lemma 2's one-step inequality along gTop-k trajectories (sgd_step + run_lockstep) whenever delta_t <= 1.

Exact checks use :class:`fractions.Fraction` (every float is a dyadic rational), so ties, subnormals and
huge values cannot produce a spurious pass or failure through rounding.
"""
from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, find, given, settings
from hypothesis import strategies as st

from sim.algorithms import AlgorithmSpec, sgd_step
from sim.comm.collectives import gtopk_rd, gtopk_tree
from sim.comm.compression import Sparse, merge, randk, topk
from sim.engine.drivers import run_lockstep
from sim.engine.runner import step_stats

EPS = 2.0 ** -52
TINY = 2.0 ** -1074  # smallest subnormal

# ----------------------------------------------------------------------------- helpers


def fr(v) -> Fraction:
    """Exact rational value of a float64."""
    return Fraction(float(v))


def exact_sq(vec) -> Fraction:
    """||vec||^2 in exact rational arithmetic (vec: iterable of floats or Fractions)."""
    return sum(((v if isinstance(v, Fraction) else fr(v)) ** 2 for v in vec), Fraction(0))


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=np.float64).view(np.int64).tobytes()


def same_sparse(a: Sparse, b: Sparse) -> bool:
    """Same dimension, same support, same value bits."""
    return a.d == b.d and np.array_equal(a.idx, b.idx) and bits(a.val) == bits(b.val)


def ref_topk_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Reference TopK support: k largest |x_i|, ties to the lower index, exact zeros dropped, sorted."""
    d = x.shape[0]
    order = np.lexsort((np.arange(d), -np.abs(x)))[:k]
    return np.sort(order[x[order] != 0])


# ----------------------------------------------------------------------------- strategies

tie_values = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, 3.0, -3.0])
subnormals = st.floats(-2.0 ** -1022, 2.0 ** -1022, allow_subnormal=True, allow_nan=False)
HUGE = 1e150  # |x_i| <= 1e150 and d <= 32: ||x||^2 <= 3.2e301 stays finite in float64
huge_values = st.floats(-HUGE, HUGE, allow_nan=False, allow_infinity=False) | st.sampled_from([HUGE, -HUGE, 1e149])
tiny_values = st.floats(-1e-300, 1e-300, allow_subnormal=True, allow_nan=False) | subnormals
# every magnitude from subnormal to 1e150 in one vector
mixed_values = st.floats(-HUGE, HUGE, allow_subnormal=True, allow_nan=False, allow_infinity=False)


@st.composite
def vectors(draw, max_d=32):
    """(x, k): x a float64 vector of length d in [1, max_d] in one magnitude regime, 1 <= k <= d."""
    d = draw(st.integers(1, max_d))
    regime = draw(st.sampled_from(["ties", "tiny", "huge", "mixed"]))
    elem = {
        "ties": tie_values,
        "tiny": tiny_values | st.just(0.0),
        "huge": huge_values | tie_values,
        "mixed": mixed_values | tie_values | subnormals,
    }[regime]
    x = np.array(draw(st.lists(elem, min_size=d, max_size=d)), dtype=np.float64)
    k = draw(st.integers(1, d))
    return x, k


# ----------------------------------------------------------------------------- 1. TopK


def check_topk_contraction(x: np.ndarray, k: int) -> None:
    d = x.shape[0]
    s = topk(x, k)
    r = x - s.to_dense()  # exact: kept entries become exactly 0, the rest are untouched
    # exact rational arithmetic: d ||x - TopK(x)||^2 <= (d - k) ||x||^2
    lhs, nx = exact_sq(r), exact_sq(x)
    assert d * lhs <= (d - k) * nx, (x, k)
    # float64 as the workbench computes it, with a rounding allowance (relative + subnormal absolute)
    lhs_f = float(np.dot(r, r))
    rhs_f = (1.0 - k / d) * float(np.dot(x, x))
    assert math.isfinite(lhs_f) and math.isfinite(rhs_f)
    assert lhs_f <= rhs_f * (1 + 4 * (d + 2) * EPS) + 4 * d * TINY, (x, k, lhs_f, rhs_f)


@settings(deadline=None)
@given(vectors())
def test_topk_is_k_contraction(case):
    """||x - TopK(x)||^2 <= (1 - k/d)||x||^2 for every x: ties, zeros, subnormals, huge and tiny magnitudes."""
    x, k = case
    check_topk_contraction(x, k)


@settings(deadline=None)
@given(vectors())
def test_topk_selects_k_largest_ties_to_lower_index(case):
    """TopK keeps exactly min(k, nnz(x)) entries: the k largest |x_i|, ties to the lower index, zeros dropped."""
    x, k = case
    s = topk(x, k)
    nnz = int(np.count_nonzero(x))
    assert len(s) == min(k, nnz)
    assert s.d == x.shape[0]
    assert np.array_equal(s.idx, ref_topk_indices(x, k))
    assert np.all(np.diff(s.idx) > 0)
    assert bits(s.val) == bits(x[s.idx])  # values copied bit-for-bit
    assert np.all(s.val != 0)


@settings(deadline=None)
@given(vectors(), st.integers(-1100, 1100), st.sampled_from([1.0, -1.0]))
def test_topk_scaling_invariance(case, e, sign):
    """TopK(c x) = c TopK(x) for every exact scaling c = +-2^e (same support, same contraction ratio),
    from subnormal to huge magnitudes; the contraction holds at every scale."""
    x, k = case
    d = x.shape[0]
    with np.errstate(all="ignore"):
        y = sign * np.ldexp(x, e)
        assume(np.all(np.isfinite(y)))
        # the scaling is exact iff it can be undone exactly (no overflow, no bits lost to underflow)
        assume(np.array_equal(sign * np.ldexp(y, -e), x))
    sx, sy = topk(x, k), topk(y, k)
    assert np.array_equal(sx.idx, sy.idx)
    assert bits(sy.val) == bits(sign * np.ldexp(sx.val, e))
    # the contraction ratio is scale invariant, exactly
    rx, ry = x - sx.to_dense(), y - sy.to_dense()
    nx, ny = exact_sq(x), exact_sq(y)
    if nx:
        assert exact_sq(rx) / nx == exact_sq(ry) / ny
    if np.all(np.abs(y) <= HUGE):  # keep ||y||^2 finite for the float half of the check
        check_topk_contraction(y, k)


@pytest.mark.parametrize("x", [[0.0], [-0.0], [5e-324], [-1e150], [3.0]])
def test_topk_d1(x):
    """d = 1 (so k = d = 1): TopK keeps the single entry unless it is zero; the residual is exactly 0."""
    x = np.array(x)
    s = topk(x, 1)
    assert len(s) == (1 if x[0] != 0 else 0)
    assert np.all(x - s.to_dense() == 0)
    check_topk_contraction(x, 1)


@settings(deadline=None)
@given(vectors())
def test_topk_k_equals_d_keeps_everything(case):
    """k = d: TopK(x) = x (every non-zero kept), ||x - TopK(x)||^2 = 0 = (1 - d/d)||x||^2."""
    x, _ = case
    d = x.shape[0]
    s = topk(x, d)
    assert np.array_equal(s.idx, np.flatnonzero(x))
    assert bits(s.to_dense()[s.idx]) == bits(x[s.idx])
    assert np.all(x - s.to_dense() == 0)
    check_topk_contraction(x, d)


def test_topk_contraction_tight_on_ties():
    """All-equal |x_i| is the tight case: equality holds exactly (the float check must allow rounding)."""
    for d in range(1, 12):
        for k in range(1, d + 1):
            x = np.array([(-1.0) ** i * 3.0 for i in range(d)])
            s = topk(x, k)
            assert np.array_equal(s.idx, np.arange(k))  # ties: lower indices win
            r = x - s.to_dense()
            assert d * exact_sq(r) == (d - k) * exact_sq(x)
            check_topk_contraction(x, k)


# ----------------------------------------------------------------------------- 2. RandK


class _SubsetRng:
    """Stand-in for a numpy Generator whose ``choice`` returns one prescribed k-subset (shuffled order)."""

    def __init__(self, subset, d, k):
        self.subset, self.d, self.k = subset, d, k

    def choice(self, n, size, replace):
        assert (n, size, replace) == (self.d, self.k, False)
        return np.array(self.subset[::-1], dtype=np.int64)


# 0 or 1e-100 <= |v| <= 1e100: squares stay normal floats (no underflow, no overflow)
moderate_values = (st.sampled_from([0.0, 1.0, -1.0, 2.0]) | st.floats(1e-100, 1e100)
                   | st.floats(-1e100, -1e-100))


@settings(deadline=None)
@given(st.data())
def test_randk_expectation_exact_by_enumeration(data):
    """E||x - RandK(x)||^2 = (1 - k/d)||x||^2: averaging the real ``randk`` over every k-subset
    (each equally likely under uniform sampling without replacement) gives it exactly."""
    d = data.draw(st.integers(1, 7))
    k = data.draw(st.integers(1, d))
    x = np.array(data.draw(st.lists(moderate_values | subnormals, min_size=d, max_size=d)), dtype=np.float64)
    subsets = list(itertools.combinations(range(d), k))
    assert len(subsets) == math.comb(d, k)
    total, total_f, kept = Fraction(0), 0.0, np.zeros(d, dtype=np.int64)
    for S in subsets:
        s = randk(x, k, _SubsetRng(S, d, k))
        assert np.array_equal(s.idx, [i for i in S if x[i] != 0])  # sorted, zeros dropped
        kept[list(S)] += 1
        r = x - s.to_dense()
        total += exact_sq(r)
        total_f += float(np.dot(r, r))
    # each coordinate is kept in exactly C(d-1, k-1) of the C(d, k) subsets: probability k/d
    assert np.all(kept * d == k * len(subsets))
    nx = exact_sq(x)
    assert total / len(subsets) == Fraction(d - k, d) * nx  # exact
    expect_f = (1.0 - k / d) * float(np.dot(x, x))
    mean_f = total_f / len(subsets)
    assert math.isclose(mean_f, expect_f, rel_tol=1e-12, abs_tol=1e-12 * float(np.dot(x, x)) + 64 * TINY)


@settings(deadline=None)
@given(st.data())
def test_randk_expectation_float_relative(data):
    """Same expectation in float64 for vectors without underflow: relative error <= 1e-12."""
    d = data.draw(st.integers(1, 7))
    k = data.draw(st.integers(1, d))
    x = np.array(data.draw(st.lists(moderate_values, min_size=d, max_size=d)), dtype=np.float64)
    losses = [float(np.dot(r, r)) for r in
              (x - randk(x, k, _SubsetRng(S, d, k)).to_dense() for S in itertools.combinations(range(d), k))]
    expect = (1.0 - k / d) * float(np.dot(x, x))
    mean = float(np.mean(losses))
    assert abs(mean - expect) <= 1e-12 * abs(expect)


nonzero_values = (st.floats(5e-324, 1e300, allow_subnormal=True) | st.floats(-1e300, -5e-324, allow_subnormal=True)
                  | st.sampled_from([1.0, -1.0, 5e-324]))


@settings(deadline=None)
@given(st.data(), st.integers(0, 2 ** 63 - 1))
def test_randk_seeded_k_distinct_sorted_reproducible(data, seed):
    """A seeded RandK of an x without zeros returns exactly k distinct coordinates, sorted, the values of x
    there, and the same seed gives the same selection."""
    d = data.draw(st.integers(1, 40))
    k = data.draw(st.integers(1, d))
    x = np.array(data.draw(st.lists(nonzero_values, min_size=d, max_size=d)), dtype=np.float64)
    s1 = randk(x, k, np.random.default_rng(seed))
    s2 = randk(x, k, np.random.default_rng(seed))
    assert len(s1) == k
    assert np.all(np.diff(s1.idx) > 0)  # sorted and distinct
    assert s1.idx[0] >= 0 and s1.idx[-1] < d
    assert bits(s1.val) == bits(x[s1.idx])
    assert same_sparse(s1, s2)


# ----------------------------------------------------------------------------- 3. merge

merge_values = st.floats(-1e300, 1e300, allow_nan=False, allow_subnormal=True) | tie_values


@st.composite
def sparse_pairs(draw):
    """(a, b, k): two at most k-sparse selections TopK(x), TopK(y) of the same dimension."""
    d = draw(st.integers(1, 24))
    k = draw(st.integers(1, d))
    vec = st.lists(merge_values, min_size=d, max_size=d)
    return topk(np.array(draw(vec)), k), topk(np.array(draw(vec)), k), k


@settings(deadline=None)
@given(sparse_pairs())
def test_merge_commutative_bit_for_bit(case):
    """a T b == b T a: same support and the same value bits."""
    a, b, k = case
    ab, ba = merge(a, b, k), merge(b, a, k)
    assert same_sparse(ab, ba)
    # and it is TopK of the dense sum (the merge's definition), with exact zeros dropped
    with np.errstate(over="ignore"):
        dense = a.to_dense() + b.to_dense()
    ref = topk(dense, k)
    assert same_sparse(ab, ref)


@st.composite
def sparse_triples(draw):
    """(k, [x, y, z]): small integer vectors; the merged operands are TopK(x), TopK(y), TopK(z)."""
    d = draw(st.integers(1, 4))
    k = draw(st.integers(1, d))
    vec = st.lists(st.integers(-3, 3), min_size=d, max_size=d)
    return k, [np.array(draw(vec), dtype=np.float64) for _ in range(3)]


def _not_associative(case) -> bool:
    k, (x, y, z) = case
    a, b, c = topk(x, k), topk(y, k), topk(z, k)
    return not same_sparse(merge(merge(a, b, k), c, k), merge(a, merge(b, c, k), k))


def test_merge_not_associative_found_by_hypothesis():
    """Hypothesis finds a, b, c with (a T b) T c != a T (b T c)."""
    witness = find(sparse_triples(), _not_associative, settings=settings(database=None, max_examples=2000))
    assert _not_associative(witness)


def test_merge_not_associative_witness():
    """The witness hypothesis found (d = 2, k = 1): a = b = [0, 1], c = [1, 0].

    (a T b) T c: a + b = [0, 2], then [0, 2] + [1, 0] = [1, 2] -> keeps [0, 2].
    a T (b T c): b + c = [1, 1], tie -> lower index -> [1, 0]; a + [1, 0] = [1, 1], tie -> [1, 0].
    """
    k = 1
    a = topk(np.array([0.0, 1.0]), k)
    b = topk(np.array([0.0, 1.0]), k)
    c = topk(np.array([1.0, 0.0]), k)
    left = merge(merge(a, b, k), c, k)
    right = merge(a, merge(b, c, k), k)
    assert np.array_equal(left.idx, [1]) and np.array_equal(left.val, [2.0])
    assert np.array_equal(right.idx, [0]) and np.array_equal(right.val, [1.0])
    assert not same_sparse(left, right)
    assert _not_associative((k, [np.array([0.0, 1.0]), np.array([0.0, 1.0]), np.array([1.0, 0.0])]))


# ----------------------------------------------------------------------------- 4. Assumption 1


def gtopk_collective(xs: np.ndarray, k: int, coll=gtopk_tree) -> np.ndarray:
    """gTopK(x_1..x_P) through the real collective under run_lockstep: dense g (identical on all ranks)."""
    P = xs.shape[0]
    res = run_lockstep([coll(r, P, topk(xs[r], k), k) for r in range(P)])
    g = res[0].g
    for r in range(1, P):
        assert same_sparse(res[r].g, g)
    return g.to_dense()


def exact_delta(xs: np.ndarray, g: np.ndarray, k: int) -> Fraction | None:
    """delta = ||sum_p x_p - g||^2 / ((1 - k/d)||sum_p x_p||^2) exactly; None when sum_p x_p = 0."""
    d = xs.shape[1]
    s = [sum((fr(v) for v in xs[:, i]), Fraction(0)) for i in range(d)]
    num = exact_sq([s[i] - fr(g[i]) for i in range(d)])
    den = Fraction(d - k, d) * exact_sq(s)
    return None if den == 0 else num / den


def one_gtopk_step(xs: np.ndarray, k: int, collective: str = "tree"):
    """One gTop-k sgd_step with eps_p = 0, alpha = 1 and G_p = x_p (so acc_p = x_p), under run_lockstep."""
    P, d = xs.shape
    spec = AlgorithmSpec("gtopk", k=k, collective=collective)
    progs = [sgd_step(spec, r, P, np.zeros(d), np.zeros(d), (lambda a: (lambda v: a))(xs[r]), 1, 1.0, 1)
             for r in range(P)]
    return spec, run_lockstep(progs)


@settings(deadline=None)
@given(vectors(), st.sampled_from(["tree", "recursive_doubling"]))
def test_assumption1_holds_for_one_worker(case, collective):
    """P = 1: gTopK(x) = TopK(x), so delta <= 1 always (exactly, and as step_stats measures it)."""
    x, k = case
    d = x.shape[0]
    assume(k < d)  # delta is undefined for k = d (gamma = 0)
    xs = x[None, :]
    g = gtopk_collective(xs, k, gtopk_tree if collective == "tree" else gtopk_rd)
    assert np.array_equal(g, topk(x, k).to_dense())
    dl = exact_delta(xs, g, k)
    assert dl is None or dl <= 1
    from sim.base.errors import DIVERGENCE_LIMIT

    if float(np.max(np.abs(x))) > DIVERGENCE_LIMIT:  # sgd_step stops a run whose gradient is beyond the limit
        return
    spec, outs = one_gtopk_step(xs, k, collective)
    st_ = step_stats(spec, outs)  # must not raise, whatever the magnitudes up to the limit
    if dl is None:  # sum acc = 0 (or its square underflows): 0 when nothing was applied either, else undefined
        assert st_.delta == 0.0 or math.isnan(st_.delta)
    elif float(np.dot(x, x)) >= 1e-290:
        # ||x||^2 is a normal float: step_stats' float delta tracks the exact one and is <= 1 up to rounding
        assert st_.delta <= 1 + 1e-12
        assert math.isclose(st_.delta, float(dl), rel_tol=1e-12, abs_tol=1e-12)


@st.composite
def multi_worker(draw):
    """(k, xs): P in [2, 4] workers, small integer vectors of length d in [2, 4], 1 <= k < d."""
    P = draw(st.integers(2, 4))
    d = draw(st.integers(2, 4))
    k = draw(st.integers(1, d - 1))
    vec = st.lists(st.integers(-3, 3), min_size=d, max_size=d)
    return k, np.array([draw(vec) for _ in range(P)], dtype=np.float64)


def _violates_assumption1(case) -> bool:
    k, xs = case
    dl = exact_delta(xs, gtopk_collective(xs, k), k)
    return dl is not None and dl > 1


def test_assumption1_violation_found_by_hypothesis():
    """For P >= 2, hypothesis finds worker vectors with delta > 1 (gTop-k worse than random selection)."""
    witness = find(multi_worker(), _violates_assumption1, settings=settings(database=None, max_examples=2000))
    assert _violates_assumption1(witness)
    assert witness[1].shape[0] >= 2


# the witness hypothesis found: P = 2, d = 2, k = 1
WITNESS_K = 1
WITNESS_XS = np.array([[0.0, 1.0],
                       [1.0, 1.0]])


@pytest.mark.parametrize("coll", [gtopk_tree, gtopk_rd])
def test_assumption1_violation_witness(coll):
    """x_1 = [0, 1], x_2 = [1, 1], k = 1: TopK(x_1) = [0, 1], TopK(x_2) = [1, 0] (tie, lower index),
    their merge [1, 1] ties again -> g = [1, 0]; sum = [1, 2]; delta = 4 / (0.5 * 5) = 8/5 > 1."""
    g = gtopk_collective(WITNESS_XS, WITNESS_K, coll)
    assert np.array_equal(g, [1.0, 0.0])
    dl = exact_delta(WITNESS_XS, g, WITNESS_K)
    assert dl == Fraction(8, 5)
    assert dl > 1


@pytest.mark.parametrize("collective", ["tree", "recursive_doubling"])
def test_step_stats_reports_assumption1_violation(collective):
    """step_stats measures delta > 1 on the witness step and reports it (no exception)."""
    spec, outs = one_gtopk_step(WITNESS_XS, WITNESS_K, collective)
    st_ = step_stats(spec, outs)
    assert st_.delta == pytest.approx(1.6, rel=1e-12)
    assert st_.delta > 1
    assert st_.mass_error == 0.0  # the violation is not a bookkeeping error: mass is conserved
    # worker 1's coordinate 1 was dropped in the merge and is kept in its residual
    assert np.array_equal(outs[0].update, [1.0, 0.0])
    assert np.array_equal(outs[0].residual, [0.0, 1.0]) and np.array_equal(outs[1].residual, [0.0, 1.0])


# ----------------------------------------------------------------------------- 5. Lemma 2


@st.composite
def trajectories(draw):
    """A gTop-k run: P, d, k, collective, eta > 0, alpha = 2^-j and T steps of per-worker gradients.

    Gradients are multiples of 2^-8 with |G| <= 2^12 and alpha a power of two, so every accumulator,
    merge sum and residual is exact in float64: rounding can neither fake nor hide a violation.
    """
    P = draw(st.integers(1, 5))
    d = draw(st.integers(1, 10))
    k = draw(st.integers(1, d))
    T = draw(st.integers(1, 6))
    coll = draw(st.sampled_from(["tree", "recursive_doubling"]))
    eta = draw(st.floats(1e-4, 1e4, allow_nan=False) | st.sampled_from([k / max(d - k, 1), 1.0, 1e6]))
    alpha = 2.0 ** -draw(st.integers(0, 6))
    if draw(st.booleans()):
        grad = st.integers(-(2 ** 20), 2 ** 20).map(lambda n: n * 2.0 ** -8) | st.sampled_from([0.0, 1.0, -1.0])
    else:  # magnitude ties: TopK's contraction is tight (delta_t = 1), so the inequality can be nearly tight
        grad = st.sampled_from([1.0, -1.0, 2.0, 0.0])
    grads = np.array(draw(st.lists(st.lists(st.lists(grad, min_size=d, max_size=d), min_size=P, max_size=P),
                                   min_size=T, max_size=T)), dtype=np.float64)
    return P, d, k, coll, eta, alpha, grads


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajectories())
def test_lemma2_one_step_along_gtopk_trajectories(case):
    """||eps_{t+1}||^2 <= gamma((1+eta)||eps_t||^2 + (1+1/eta) alpha^2 ||G_{t+1}||^2) at every step with
    delta_t <= 1 (eps = mean residual, G = mean gradient), and the delta_t form at every step."""
    P, d, k, coll, eta, alpha, grads = case
    T = grads.shape[0]
    spec = AlgorithmSpec("gtopk", k=k, collective=coll)
    gamma = 1.0 - k / d
    v = np.zeros(d)
    res = [np.zeros(d) for _ in range(P)]
    eps_sq = 0.0  # ||eps_0||^2
    for t in range(1, T + 1):
        progs = [sgd_step(spec, r, P, v, res[r], (lambda a: (lambda _v: a))(grads[t - 1, r]), 1, alpha, t)
                 for r in range(P)]
        outs = run_lockstep(progs)
        stats = step_stats(spec, outs)
        assert stats.mass_error == 0.0  # exact arithmetic on this grid
        eps = np.sum([o.residual for o in outs], axis=0) / P
        G = np.sum([o.grad for o in outs], axis=0) / P
        new_sq, G_sq = float(eps @ eps), float(G @ G)
        assert new_sq == stats.residual_norm_sq and G_sq == stats.stoch_grad_norm_sq
        young = (1 + eta) * eps_sq + (1 + 1 / eta) * alpha ** 2 * G_sq
        if k == d:
            assert stats.delta is None and new_sq == 0.0
        else:
            delta = stats.delta
            if math.isnan(delta):  # sum_p acc_p = 0: nothing to select, nothing left
                assert new_sq == 0.0
            else:
                # Lemma 2 with the measured delta_t holds at every step
                assert new_sq <= delta * gamma * young * (1 + 1e-12)
                if delta <= 1:
                    event("checked a step with delta_t <= 1" + (" (P >= 2)" if P >= 2 else " (P = 1)"))
                    assert new_sq <= gamma * young * (1 + 1e-12), (t, delta, new_sq, gamma * young)
                    # the bound holds for every eta > 0, so also at its minimiser eta* = alpha||G|| / ||eps_t||:
                    # gamma (||eps_t|| + alpha ||G||)^2 (the tightest member of the family)
                    tight = gamma * (math.sqrt(eps_sq) + alpha * math.sqrt(G_sq)) ** 2
                    assert new_sq <= tight * (1 + 1e-12), (t, delta, new_sq, tight)
                else:
                    event("skipped a step with delta_t > 1")
        eps_sq = new_sq
        res = [o.residual for o in outs]
        v = outs[0].v
