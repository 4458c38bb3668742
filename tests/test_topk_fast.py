"""The fast exact top-k (issue 12, item 1): sim.comm.compression.topk against a plain reference, bit for bit.

Reference: a full stable sort by magnitude, descending (ties keep the lower index first), the first k, exact
zeros dropped, indices ascending. Every path of the fast selection is checked against it: the numba kernel
and the numpy path, a threshold from the sample that is too high (second pass over all non-zeros), too low
(many candidates: the buffer fills and is cut, with ``cap`` forcing it at k + 1), and none at all; on generated
inputs (ties, zeros of both signs, subnormals, +-inf, a single non-zero, k = d) and on the adversarial cases
(all equal, all zero but k, sorted, Cauchy, ties at the threshold, ...) at sizes that reach the fallbacks.
No speed assertions here: benchmarks/bench_topk.py measures.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import sim.comm.compression as C
from sim.comm.compression import Sparse, topk
from sim.base.errors import NonFiniteError, SparsimError

HAVE_NUMBA = C._kernels() is not None
DTYPES = (np.float32, np.float64)


def reference(x: np.ndarray, k: int) -> Sparse:
    a = np.abs(x)
    order = np.argsort(-a, kind="stable")[:k]  # magnitude descending, ties: lower index first
    sel = np.sort(order[a[order] > 0]).astype(np.int64)
    return Sparse(sel, x[sel], x.shape[0])


def assert_same(got: Sparse, want: Sparse):
    assert got.d == want.d
    assert got.idx.dtype == np.int64 and got.val.dtype == want.val.dtype
    np.testing.assert_array_equal(got.idx, want.idx)
    assert got.val.tobytes() == want.val.tobytes()  # bit for bit (signs of zeros and subnormals included)


def variants(d: int, k: int):
    """Keyword sets of C._topk_fast that force each path: default, numpy, numba, threshold from a forced sample
    too high (frac tiny: the sample's maximum) or too low (frac 1: its minimum, with a buffer of k + 1)."""
    m = max(1, d // 3)
    out = [dict(), dict(use_numba=False), dict(use_numba=False, sample=m, frac=1e-9),
           dict(use_numba=False, sample=m, frac=1.0), dict(use_numba=False, sample=0)]
    if HAVE_NUMBA:
        out += [dict(use_numba=True), dict(use_numba=True, sample=m, frac=1e-9),
                dict(use_numba=True, sample=m, frac=1.0, cap=k + 1), dict(use_numba=True, sample=0, cap=k + 1),
                dict(use_numba=True, sample=1, frac=0.5, cap=k + 1), dict(use_numba=True, sample=d, frac=k / d)]
    return out


def check_all_paths(x: np.ndarray, k: int):
    want = reference(x, k)
    assert_same(topk(x, k), want)
    for kw in variants(x.shape[0], k):
        assert_same(C._topk_fast(x, k, **kw), want)


# ------------------------------------------------------------------------------------------- generated inputs

SPECIAL = [0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 3.0, 1e-30, 5e-324, -5e-324, 1e-45, -1e-45, 1e-310, 1e30, -1e30]


@st.composite
def vectors(draw):
    dt = draw(st.sampled_from(DTYPES))
    d = draw(st.integers(1, 300))
    width = 32 if dt == np.float32 else 64
    finite = st.floats(allow_nan=False, allow_infinity=False, width=width)
    pool = st.sampled_from([dt(v) for v in SPECIAL] + [dt(np.inf), dt(-np.inf)])
    kind = draw(st.sampled_from(["mixed", "ties", "sparse", "single", "finite"]))
    if kind == "single":
        x = np.zeros(d, dt)
        x[draw(st.integers(0, d - 1))] = draw(finite.filter(lambda v: v != 0))
    elif kind == "sparse":
        x = np.zeros(d, dt)
        for i in draw(st.lists(st.integers(0, d - 1), max_size=d)):
            x[i] = draw(st.one_of(pool, finite))
    elif kind == "ties":
        x = np.array(draw(st.lists(st.sampled_from([0.0, 1.0, -1.0, 2.0, -2.0]), min_size=d, max_size=d)), dt)
    else:
        elems = st.one_of(pool, finite) if kind == "mixed" else finite
        x = np.array(draw(st.lists(elems, min_size=d, max_size=d)), dt)
    k = draw(st.one_of(st.integers(1, d), st.just(d), st.just(1)))
    return x, k


@given(vectors())
def test_topk_equals_the_reference_on_generated_inputs(case):
    x, k = case
    check_all_paths(x, k)


@given(vectors())
def test_old_partition_selection_equals_the_reference(case):
    """The implementation the benchmark compares with (kept for other dtypes) selects the same."""
    x, k = case
    assert_same(C._topk_partition(x, k), reference(x, k))


# ------------------------------------------------------------------------------------------- adversarial cases

def _adversarial(name: str, d: int, k: int, dt) -> np.ndarray:
    rng = np.random.default_rng(7)
    if name == "all_equal":
        return np.full(d, 0.75, dt)
    if name == "all_equal_negative_mixed":
        return np.where(rng.random(d) < 0.5, -0.75, 0.75).astype(dt)
    if name == "all_zero_but_k":
        x = np.zeros(d, dt)
        x[rng.choice(d, k, replace=False)] = rng.standard_normal(k)
        return x
    if name == "all_zero_but_fewer_than_k":
        x = np.zeros(d, dt)
        x[rng.choice(d, max(1, k // 2), replace=False)] = 1.0
        return x
    if name == "all_zero":
        return np.where(rng.random(d) < 0.5, -0.0, 0.0).astype(dt)
    if name == "ascending":
        return np.sort(np.abs(rng.standard_normal(d))).astype(dt)
    if name == "descending":
        return -np.sort(-np.abs(rng.standard_normal(d))).astype(dt)
    if name == "cauchy":
        return rng.standard_cauchy(d).astype(dt)
    if name == "ties_at_threshold":  # k lands inside a long run of equal magnitudes
        x = np.where(rng.random(d) < 0.5, 1.0, 2.0) * np.where(rng.random(d) < 0.5, -1, 1)
        x[rng.choice(d, k // 2, replace=False)] = 3.0
        return x.astype(dt)
    if name == "subnormals":
        tiny = np.finfo(dt).smallest_subnormal
        return (rng.integers(-20, 21, d) * tiny).astype(dt)
    if name == "single_nonzero":
        x = np.zeros(d, dt)
        x[d // 3] = -1e-3
        return x
    if name == "layers":  # blocks of very different scales, like a model's layers
        return np.concatenate([rng.standard_normal(d // 4 + (i < d % 4)) * s
                               for i, s in enumerate((1e-3, 1.0, 1e-2, 10.0))]).astype(dt)
    raise KeyError(name)


ADVERSARIAL = ["all_equal", "all_equal_negative_mixed", "all_zero_but_k", "all_zero_but_fewer_than_k", "all_zero",
               "ascending", "descending", "cauchy", "ties_at_threshold", "subnormals", "single_nonzero", "layers"]


@pytest.mark.parametrize("dt", DTYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("name", ADVERSARIAL)
@pytest.mark.parametrize("d,k", [(5000, 1), (5000, 37), (5000, 500), (5000, 5000), (70001, 7)])
def test_adversarial_inputs_keep_the_exact_result(name, d, k, dt):
    check_all_paths(_adversarial(name, d, k, dt), k)


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba is not installed: the numpy path is tested above")
@pytest.mark.parametrize("dt", DTYPES, ids=lambda t: t.__name__)
def test_large_d_default_path_is_the_numba_kernel_and_exact(dt):
    d = 3 * C._NUMBA_MIN_D + 5
    x = np.random.default_rng(3).standard_normal(d).astype(dt)
    for k in (1, 10, 300, d // 10, d):
        assert_same(topk(x, k), reference(x, k))


def test_other_layouts_and_dtypes():
    rng = np.random.default_rng(4)
    x = rng.standard_normal(4000)
    xs = x[::2]  # not contiguous
    assert_same(topk(xs, 50), reference(xs, 50))
    be = x.astype(">f8")  # big-endian: the partition path
    assert_same(topk(be, 50), reference(be, 50))
    xi = rng.integers(-5, 6, 3000)  # integers: the partition path, same rule
    got, want = topk(xi, 40), reference(xi, 40)
    np.testing.assert_array_equal(got.idx, want.idx)
    np.testing.assert_array_equal(got.val, want.val)
    ro = x.copy()
    ro.flags.writeable = False
    assert_same(topk(ro, 50), reference(ro, 50))


# ------------------------------------------------------------------------------------------------- rejections

@pytest.mark.parametrize("dt", DTYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("d", [10, 5000, 2 * C._NUMBA_MIN_D])
def test_nan_is_rejected_naming_the_first_nan_coordinate(d, dt):
    x = np.random.default_rng(5).standard_normal(d).astype(dt)
    first = d // 2 + 1
    x[first] = np.nan
    x[-1] = np.nan
    paths = [dict(), dict(use_numba=False), dict(use_numba=False, sample=d, frac=0.1)]
    if HAVE_NUMBA:
        paths += [dict(use_numba=True), dict(use_numba=True, sample=d, frac=0.1),
                  dict(use_numba=True, sample=0, cap=2)]
    for kw in paths:
        with pytest.raises(NonFiniteError, match=rf"coordinate {first} of the vector is nan"):
            C._topk_fast(x, 1, **kw)
    with pytest.raises(SparsimError, match=rf"coordinate {first} "):
        topk(x, max(1, d // 100))


def test_infinities_rank_above_every_finite_value():
    x = np.array([1.0, -np.inf, 3.0, np.inf, 0.0, -np.inf, 2.0])
    check_all_paths(x, 2)
    assert list(topk(x, 2).idx) == [1, 3]
    assert list(topk(x, 4).idx) == [1, 2, 3, 5]


@pytest.mark.parametrize("k", [0, -1, 11, 2.0, True])
def test_bad_k_is_rejected(k):
    with pytest.raises(SparsimError, match="k = "):
        topk(np.ones(10), k)


# ------------------------------------------------------------------------------------------------- torch

def test_torch_selection_matches_on_the_cpu():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from sim.comm.torch_kernels import topk_torch

    for name in ADVERSARIAL:
        for dt in DTYPES:
            for k in (1, 37, 500, 2000):
                x = _adversarial(name, 2000, k, dt)
                want = reference(x, k)
                idx, val = topk_torch(torch.from_numpy(x), k)
                assert idx.dtype == torch.int64
                np.testing.assert_array_equal(idx.numpy(), want.idx)
                assert val.numpy().tobytes() == want.val.tobytes()
    x = np.ones(50)
    x[7] = np.nan
    with pytest.raises(NonFiniteError, match="coordinate 7 "):
        topk_torch(torch.from_numpy(x), 3)


def _n_gpu() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_n_gpu() < 1, reason="no CUDA GPU visible: the GPU selection runs only on a GPU machine")
def test_torch_selection_on_the_gpu_gives_the_same_indices():
    import torch

    from sim.comm.torch_kernels import topk_torch

    for name in ADVERSARIAL + ["normal"]:
        for dt in DTYPES:
            for d, k in ((5000, 37), (5000, 5000), (1_000_003, 1000), (1_000_003, 10_000)):
                x = (np.random.default_rng(1).standard_normal(d).astype(dt) if name == "normal"
                     else _adversarial(name, d, k, dt))
                want = topk(x, k)
                idx, val = topk_torch(torch.from_numpy(x).cuda(), k)
                assert idx.device.type == "cuda"
                np.testing.assert_array_equal(idx.cpu().numpy(), want.idx)
                assert val.cpu().numpy().tobytes() == want.val.tobytes()


def test_the_numba_kernels_load_whenever_numba_is_installed():
    """numba is a dependency: the kernels must load with it. After the layering move they silently did not (their
    loader still imported sim._topk_numba), and every top-k and merge ran the numpy path, 5x slower."""
    import importlib.util

    import sim.comm.collectives as K
    from sim.base.optional import kernels

    if importlib.util.find_spec("numba") is None:
        pytest.skip("numba is not installed")
    assert C._kernels() is not None and K._kernels() is not None
    with pytest.raises(ModuleNotFoundError):
        kernels("sim.comm._no_such_kernels")  # a moved module is an error, not the slow path
