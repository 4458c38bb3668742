"""Fast merges and sums (issue #12, items 2 and 3): the gTop-k merge operator, the survival masks, the dense sum
of the Top-k allgather, and the dtype of every collective's result.

The implementations these replaced are kept here, verbatim, as the references: ``merge`` (a union of the
supports by np.union1d, accumulation into a zero vector, np.partition over the union), the survival tracker's
``np.isin`` and the allgather's ``g[b.idx] += b.val`` loop. The fast versions must give the same bits: the
same indices, values, dtypes, survival masks and applied flags.
"""
from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sim.comm.collectives as C
from sim.algorithms import AlgorithmSpec
from sim.comm.compression import Sparse, densify, merge, topk
from sim.workloads.data import shard_indices
from sim.engine.drivers import run_lockstep
from sim.base.errors import SparsimError
from sim.workloads.objectives import make_objective
from sim.engine.runner import Workers, run_algorithm

# ---------------------------------------------------------------- the former implementations (references)


from sim.comm.reference import ref_merge, ref_sum, ref_survive  # noqa: E402  (the former implementations)


def _same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.dtype.kind == "f":
        return np.array_equal(x.view(f"u{x.dtype.itemsize}"), y.view(f"u{y.dtype.itemsize}"))
    return np.array_equal(x, y)


def _same_sparse(s: Sparse, r: Sparse) -> bool:
    return s.d == r.d and _same_bits(s.idx, r.idx) and _same_bits(s.val, r.val)


# ---------------------------------------------------------------- generated pairs of sparse vectors

# ties in magnitude, both signs, tiny and huge values, and (rarely in a selection, but merge takes them) zeros
VALUES = [1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0, -3.0, 0.25, 1e-30, -1e30, 0.0, -0.0]
DTYPES = [(np.float64, np.float64), (np.float32, np.float32), (np.float32, np.float64), (np.float64, np.float32)]


@st.composite
def pairs(draw):
    """(a, b, k): two sparse vectors of one dimension whose supports are disjoint, overlapping, identical,
    random or empty, values with ties and exact cancellations, k from 1 to d (often above the union's size)."""
    d = draw(st.integers(1, 48))
    mode = draw(st.sampled_from(["disjoint", "overlap", "identical", "random", "a_empty", "b_empty", "both_empty"]))
    coords = draw(st.permutations(range(d)))
    if mode == "disjoint":
        cut = draw(st.integers(0, d))
        end = draw(st.integers(cut, d))
        ia, ib = coords[:cut], coords[cut:end]
    elif mode == "overlap":
        na = draw(st.integers(0, d))
        lo = draw(st.integers(0, na))
        hi = draw(st.integers(na, d))
        ia, ib = coords[:na], coords[lo:hi]
    elif mode == "identical":
        ia = ib = coords[:draw(st.integers(0, d))]
    elif mode == "random":
        ia = sorted(draw(st.sets(st.integers(0, d - 1))))
        ib = sorted(draw(st.sets(st.integers(0, d - 1))))
    else:
        n = draw(st.integers(0, d))
        ia = [] if mode in ("a_empty", "both_empty") else coords[:n]
        ib = [] if mode in ("b_empty", "both_empty") else coords[-n:] if n else []
    ia, ib = np.sort(np.asarray(ia, dtype=np.int64)), np.sort(np.asarray(ib, dtype=np.int64))
    ta, tb = draw(st.sampled_from(DTYPES))
    value = st.sampled_from(VALUES) | st.floats(-4, 4, width=32, allow_subnormal=True)
    va = np.asarray(draw(st.lists(value, min_size=len(ia), max_size=len(ia))), dtype=ta)
    vb = np.asarray(draw(st.lists(value, min_size=len(ib), max_size=len(ib))), dtype=tb)
    if draw(st.booleans()):  # exact cancellation on the shared coordinates: a_i + b_i == 0
        shared = np.isin(ib, ia)
        vb[shared] = -va[np.searchsorted(ia, ib[shared])].astype(tb)
    k = draw(st.integers(1, d))
    return Sparse(ia, va, d), Sparse(ib, vb, d), k


@settings(deadline=None, max_examples=600)
@given(pairs())
def test_merge_equals_reference(case):
    a, b, k = case
    got = merge(a, b, k)
    assert _same_sparse(got, ref_merge(a, b, k))
    assert _same_sparse(merge(b, a, k), got)  # still commutative bit for bit
    assert np.all(np.diff(got.idx) > 0) and len(got) <= k and np.all(got.val != 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k", [1, 7, 2000, 5000])
def test_merge_equals_reference_large(dtype, k):
    """Thousands of entries, many coordinates shared, magnitudes rounded to create ties."""
    rng = np.random.default_rng(k)
    d = 20_000
    for overlap in (0.0, 0.3, 1.0):
        ia = np.sort(rng.choice(d, 2000, replace=False))
        fresh = np.setdiff1d(np.arange(d), ia)
        n_sh = int(overlap * 2000)
        ib = np.sort(np.concatenate([rng.choice(ia, n_sh, replace=False),
                                     rng.choice(fresh, 2000 - n_sh, replace=False)]))
        a = Sparse(ia, np.round(rng.standard_normal(2000), 1).astype(dtype), d)
        b = Sparse(ib, np.round(rng.standard_normal(2000), 1).astype(dtype), d)
        assert _same_sparse(merge(a, b, k), ref_merge(a, b, k))


def test_merge_rejects_what_it_rejected():
    a = Sparse(np.array([0]), np.array([1.0]), 3)
    with pytest.raises(SparsimError, match="dimensions must match"):
        merge(a, Sparse(np.array([0]), np.array([1.0]), 4), 1)
    for k in (0, 4, 1.5):
        with pytest.raises(SparsimError):
            merge(a, a, k)


# ---------------------------------------------------------------- survival masks and applied flags


@st.composite
def selections(draw):
    """P ranks' TopK selections (some empty: an all-zero accumulator) of tie-heavy accumulators."""
    P = draw(st.integers(1, 12))
    d = draw(st.integers(1, 24))
    k = draw(st.integers(1, d))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    value = st.sampled_from([0.0, 0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0]) | st.floats(-4, 4, width=32)
    accs = np.array(draw(st.lists(st.lists(value, min_size=d, max_size=d), min_size=P, max_size=P)), dtype=dtype)
    for r in draw(st.sets(st.integers(0, P - 1), max_size=P)):
        accs[r] = 0
    return P, k, [topk(acc, k) for acc in accs]


def _gtopk_runs(P, k, sels):
    """Every gTop-k collective's result on every rank: {(name, exact): [GTopKResult by rank]}."""
    out = {}
    for exact in (True, False):
        out["tree", exact] = run_lockstep([C.gtopk_tree(r, P, sels[r], k, exact=exact) for r in range(P)])
        out["rd", exact] = run_lockstep([C.gtopk_rd(r, P, sels[r], k, exact=exact) for r in range(P)])
        for G in [g for g in (2, 3, 4) if P % g == 0 and g < P]:
            out[f"hier{G}", exact] = run_lockstep([C.hier_gtopk(r, P, G, sels[r], k, exact=exact) for r in range(P)])
    return out


@settings(deadline=None, max_examples=150)
@given(selections())
def test_gtopk_results_and_applied_flags_equal_reference(case):
    """g, and every rank's applied flags (exact survival masks and the reference rule), are the bits the former
    merge and survival tracker gave, for the tree, recursive doubling and hierarchical collectives."""
    P, k, sels = case
    fast = _gtopk_runs(P, k, sels)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(C, "merge", lambda a, b, k_: ref_merge(a, b, k_))
        mp.setattr(C._Tracker, "survive", ref_survive)
        ref = _gtopk_runs(P, k, sels)
    assert fast.keys() == ref.keys()
    for key in fast:
        for r in range(P):
            x, y = fast[key][r], ref[key][r]
            assert _same_sparse(x.g, y.g), key
            assert x.applied.dtype == y.applied.dtype == bool and np.array_equal(x.applied, y.applied), key


@settings(deadline=None, max_examples=300)
@given(st.integers(1, 200), st.data())
def test_in_sorted_equals_isin(n, data):
    """Both branches of the survival lookup (binary search for a few live entries, np.isin otherwise)."""
    support = np.asarray(sorted(data.draw(st.sets(st.integers(0, 400), max_size=n))), dtype=np.int64)
    x = np.asarray(sorted(data.draw(st.sets(st.integers(0, 400), max_size=n))), dtype=np.int64)
    expect = np.isin(x, support, assume_unique=True)
    assert np.array_equal(C.in_sorted(x, support), expect)
    big = np.arange(0, 20 * (len(x) + 1) * 401, 7, dtype=np.int64)  # x is short next to it: binary search
    assert np.array_equal(C.in_sorted(x, big), np.isin(x, big, assume_unique=True))


# ---------------------------------------------------------------- the allgather's dense sum


@st.composite
def block_lists(draw):
    """P sparse vectors (rank order) of one dimension, some empty, sharing coordinates, values with ties."""
    P = draw(st.integers(0, 12))
    d = draw(st.integers(1, 40))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    value = st.sampled_from([1.0, -1.0, 0.1, -0.1, 1e8, -1e8, 3.0, 1e-7]) | st.floats(-1e6, 1e6, width=32)
    blocks = []
    for _ in range(P):
        idx = np.asarray(sorted(draw(st.sets(st.integers(0, d - 1)))), dtype=np.int64)
        val = np.asarray(draw(st.lists(value, min_size=len(idx), max_size=len(idx))), dtype=dtype)
        blocks.append(Sparse(idx, val, d))
    return d, dtype, blocks


# the numba sum has two kernels (chunked from C._CHUNKED_MIN_P vectors on, by rank below): each test runs both
_KERNELS = {"chunked": 0, "by_rank": 10**9}


@settings(deadline=None, max_examples=300)
@given(block_lists(), st.sampled_from([None, False, True]), st.sampled_from(sorted(_KERNELS)))
def test_sparse_sum_equals_reference(case, use_numba, kernel):
    d, dtype, blocks = case
    with mock.patch.object(C, "_CHUNKED_MIN_P", _KERNELS[kernel]):
        got = C.sparse_sum(blocks, d, dtype, use_numba=use_numba)
    assert _same_bits(got, ref_sum(blocks, d, dtype))


@pytest.mark.parametrize("kernel", sorted(_KERNELS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("use_numba", [None, False, True])
def test_sparse_sum_equals_reference_large(dtype, use_numba, kernel, monkeypatch):
    """Many ranks hitting the same coordinates (rounding order matters), several cache chunks of the kernel."""
    monkeypatch.setattr(C, "_CHUNKED_MIN_P", _KERNELS[kernel])
    rng = np.random.default_rng(1)
    d, P, k = 600_000, 40, 5_000
    blocks = [Sparse(np.sort(rng.choice(d, k, replace=False)),
                     (rng.standard_normal(k) * 10.0 ** rng.integers(-6, 6, k)).astype(dtype), d) for _ in range(P)]
    blocks.append(Sparse(np.arange(0, d, 3, dtype=np.int64), np.full(len(range(0, d, 3)), 1e-3, dtype), d))
    assert _same_bits(C.sparse_sum(blocks, d, dtype, use_numba=use_numba), ref_sum(blocks, d, dtype))


@pytest.mark.parametrize("kernel", sorted(_KERNELS))
def test_sparse_sum_mixed_dtypes_and_bad_indices(kernel, monkeypatch):
    """Values of another dtype than the accumulator's, and indices out of order or range, behave as before."""
    monkeypatch.setattr(C, "_CHUNKED_MIN_P", _KERNELS[kernel])
    d = 10
    b32 = Sparse(np.array([1, 4], dtype=np.int64), np.array([0.1, 0.2], np.float32), d)
    b64 = Sparse(np.array([1, 9], dtype=np.int64), np.array([1 / 3, 2.0]), d)
    for dtype in (np.float32, np.float64):
        for use_numba in (None, False, True):
            assert _same_bits(C.sparse_sum([b32, b64, b32], d, dtype, use_numba=use_numba),
                              ref_sum([b32, b64, b32], d, dtype))
    unsorted = Sparse(np.array([5, 2], dtype=np.int64), np.array([1.0, 2.0]), d)
    later = Sparse(np.array([2, 3], dtype=np.int64), np.array([1e-17, 1.0]), d)
    for use_numba in (False, True):
        assert _same_bits(C.sparse_sum([later, unsorted, later], d, np.float64, use_numba=use_numba),
                          ref_sum([later, unsorted, later], d, np.float64))
        with pytest.raises(IndexError):
            C.sparse_sum([later, Sparse(np.array([3, 10]), np.array([1.0, 2.0]), d)], d, np.float64,
                         use_numba=use_numba)
        negative = Sparse(np.array([-1, 3]), np.array([1.0, 2.0]), d)  # numpy wraps it to d - 1, as it did
        assert _same_bits(C.sparse_sum([later, negative], d, np.float64, use_numba=use_numba),
                          ref_sum([later, negative], d, np.float64))


# ---------------------------------------------------------------- float32: every rank the same bits and dtype


def test_empty_selection_keeps_the_accumulator_dtype():
    """The rank whose selection is empty gets the float32 sum the others get (it used to get float64)."""
    d = 6
    sels = [topk(np.zeros(d, np.float32), 2), topk(np.array([0, 1, 0, 2, 0, 0], np.float32) / 3, 2),
            topk(np.array([1, 0, 0, 0, 0, 5], np.float32) / 7, 2)]
    assert sels[0].val.dtype == np.float32 and len(sels[0]) == 0
    for outs in (run_lockstep([C.topk_allgather_sum(r, 3, sels[r]) for r in range(3)]),
                 run_lockstep([C.hier_topk_allgather_sum(r, 3, 3, sels[r]) for r in range(3)])):
        for g in outs:
            assert g.dtype == np.float32 and _same_bits(g, outs[1])
    assert densify(sels[0]).dtype == np.float32
    assert densify(Sparse(np.zeros(0, np.int64), np.zeros(0, np.float32), 4)).dtype == np.float32
    assert merge(sels[0], sels[0], 1).val.dtype == np.float32


class _PerWorkerObjective:
    """The objective, without its batched gradient: the drivers then ask each worker's own ``grad_fn``."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        if name in ("batch_grads", "shares_point_work"):
            raise AttributeError(name)
        return getattr(self._obj, name)


class _ZeroedWorkers:
    """The digits softmax workers, with some ranks' gradients zero on some coordinates (or everywhere), so that
    their selections there are empty (their accumulator stays exactly zero)."""

    def __init__(self, P: int, zero_on: dict):
        from sim.workloads.data import load_dataset

        obj = make_objective("softmax", dataset=load_dataset("digits"), lam=1e-3, mu=0.0)
        self.objective = _PerWorkerObjective(obj)
        self.shards = shard_indices(obj.n, P, seed=0)
        self.b, self.seed = 4, 0
        self._w = Workers(obj, self.shards, self.b, self.seed)
        self.zero_on = zero_on  # rank -> the slices of coordinates where its gradient is zero

    def grad_fn(self, rank, t):
        f = self._w.grad_fn(rank, t)
        zero = self.zero_on.get(rank, ())

        def g(v):
            out = np.array(f(v), dtype=np.float64)
            for sl in zero:
                out[sl] = 0.0
            return out
        return g


def _float32_specs(d: int):
    k = 9
    segs = (d // 3, d // 3, d - 2 * (d // 3))
    out = []
    for G, P in ((1, 5), (2, 6)):
        for coll in ("ring", "recursive_doubling") if G == 1 else ("hierarchical",):
            out.append((P, AlgorithmSpec("dense", collective=coll, gpus_per_node=G)))
        for segments in (None, segs):
            for name in ("topk", "randk"):
                out.append((P, AlgorithmSpec(name, k=k, collective="hierarchical" if G > 1 else "allgather",
                                             gpus_per_node=G, seed=2, segments=segments)))
            for coll in ("tree", "recursive_doubling") if G == 1 else ("hierarchical",):
                for mask in ("exact", "reference"):
                    out.append((P, AlgorithmSpec("gtopk", k=k, collective=coll, mask=mask, gpus_per_node=G,
                                                 segments=segments)))
    return out


def test_float32_runs_are_identical_on_every_rank():
    """float32 parameters, every algorithm and collective (dense ring / recursive doubling / hierarchical,
    Top-k, rand-k, gTop-k tree / recursive doubling / hierarchical with exact and reference masks, whole-model
    and layer-wise), rank 0's selection always empty, rank 1's on the first segment, and every rank's on the last
    segment (so that there the gTop-k result g is empty too): after every step every rank holds the same float32
    parameters (and the same float32 update), bit for bit."""
    d = _ZeroedWorkers(1, {}).objective.d
    first, last = slice(0, d // 3), slice(2 * (d // 3), d)
    seen = set()
    for P, spec in _float32_specs(d):
        w = _ZeroedWorkers(P, {r: [slice(None)] if r == 0 else [first, last] if r == 1 else [last] for r in range(P)})
        x0 = w.objective.x0(0).astype(np.float32)
        steps = []

        def on_step(t, outs):
            steps.append(t)
            for o in outs:
                for arr in (o.v, o.update, o.residual, o.acc):
                    assert arr.dtype == np.float32, (spec, t)
                assert _same_bits(o.v, outs[0].v) and _same_bits(o.update, outs[0].update), (spec, t)
            if spec.name != "dense":
                assert outs[0].n_selected == 0  # the case this test is about
                seen.add(spec.label)

        run_algorithm(spec, w, T=3, lr=lambda t: 0.5, x0=x0, driver="lockstep", on_step=on_step)
        assert steps == [1, 2, 3]
    assert {"topk", "randk", "gtopk", "gtopk[reference]", "topk[layerwise]", "gtopk[reference,layerwise]"} <= seen


@pytest.mark.parametrize("kernel", sorted(_KERNELS))
def test_sparse_sum_read_only_among_writable_selections_no_warning(kernel, monkeypatch):
    """A read-only selection (e.g. a shared result's arrays) among writable ones: same bits, no numba warning."""
    import warnings

    monkeypatch.setattr(C, "_CHUNKED_MIN_P", _KERNELS[kernel])
    rng = np.random.default_rng(3)
    d = 200_000
    blocks = [Sparse(np.sort(rng.choice(d, 20_000, replace=False)), rng.standard_normal(20_000), d) for _ in range(3)]
    blocks[1].idx.flags.writeable = False
    blocks[2].val.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = C.sparse_sum(blocks, d, np.float64, use_numba=True)
    assert _same_bits(got, ref_sum(blocks, d, np.float64))
