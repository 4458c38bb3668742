"""Tests for sim.workloads.data and sim.workloads.objectives: gradients, batch means, constants, sharding, loading."""
from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.datasets import dump_svmlight_file

from sim.workloads.data import Dataset, load_dataset, minibatch, shard_indices
from sim.base.errors import ConfigError, DataError, SparsimError
from sim.workloads.objectives import OBJECTIVES, make_objective

from _shared import ObjectiveCache
from _shared import small_dataset as _small_dataset


# ------------------------------------------------------------------------------------ fixtures
def small_dataset(*, sparse: bool, C: int) -> Dataset:
    return _small_dataset(sparse=sparse, C=C, n=40, p=6)


def _build(key: str):
    if key == "sines":
        return make_objective("sines", d=10, n=16, seed=1)
    if key == "sines_flat":  # lam = 0: bounded gradients, analytic M
        return make_objective("sines", d=10, n=16, seed=1, lam_min=0.0, lam_max=0.0)
    if key == "double_well":
        return make_objective("double_well", d=10, n=17, seed=2)
    if key == "robust":
        return make_objective("robust_regression", d=12, n=20, nnz=3, seed=3)
    if key == "robust_big_nnz":
        return make_objective("robust_regression", d=8, n=20, nnz=8, seed=4)
    if key == "logistic_dense":
        return make_objective("logistic", dataset=small_dataset(sparse=False, C=2), lam=0.1, mu=0.0)
    if key == "logistic_sparse":
        return make_objective("logistic", dataset=small_dataset(sparse=True, C=2), lam=0.1, mu=0.05)
    if key == "logistic_bc":
        return make_objective("logistic", dataset=load_dataset("breast_cancer", n_max=80), lam=1e-2)
    if key == "softmax_dense":
        return make_objective("softmax", dataset=small_dataset(sparse=False, C=3), lam=0.1, mu=0.0)
    if key == "softmax_sparse":
        return make_objective("softmax", dataset=small_dataset(sparse=True, C=4), lam=0.1, mu=0.05)
    if key == "softmax_digits":
        return make_objective("softmax", dataset=load_dataset("digits", n_max=30), lam=1e-2)
    raise KeyError(key)


KEYS = [
    "sines", "sines_flat", "double_well", "robust", "robust_big_nnz", "logistic_dense", "logistic_sparse",
    "logistic_bc", "softmax_dense", "softmax_sparse", "softmax_digits",
]
_CACHE = ObjectiveCache(_build)


@pytest.fixture(params=KEYS)
def obj(request):
    return _CACHE(request.param)


def _points(o, m=4, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return [scale * rng.standard_normal(o.d) for _ in range(m)]


def _fd_grad(fun, x, h=1e-6):
    g = np.empty_like(x)
    for j in range(x.size):
        e = np.zeros_like(x)
        e[j] = h
        g[j] = (fun(x + e) - fun(x - e)) / (2 * h)
    return g


# ------------------------------------------------------------------------------- gradients
def test_full_grad_matches_finite_differences(obj):
    for x in _points(obj, m=2, seed=1) + [obj.x0(0)]:
        g = obj.full_grad(x)
        fd = _fd_grad(obj.loss, x)
        assert g.shape == (obj.d,) and g.dtype == np.float64
        np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-6 * (1 + np.abs(fd).max()))


def test_batch_grad_matches_finite_differences(obj):
    idx = np.array([0, 3, 3, obj.n - 1], dtype=np.int64)  # repeats allowed: a multiset
    x = _points(obj, m=1, seed=2)[0]
    g = obj.batch_grad(x, idx)
    fd = _fd_grad(lambda z: obj.batch_loss(z, idx), x)
    np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-6 * (1 + np.abs(fd).max()))


def test_mean_of_batch_means_equals_union(obj):
    rng = np.random.default_rng(5)
    P, b = 4, 3
    idx = rng.permutation(obj.n)[: P * b].astype(np.int64)
    x = _points(obj, m=1, seed=3)[0]
    parts = [obj.batch_grad(x, idx[p * b:(p + 1) * b]) for p in range(P)]
    union = obj.batch_grad(x, idx)
    np.testing.assert_allclose(np.mean(parts, axis=0), union, rtol=1e-12, atol=1e-13 * np.abs(union).max())
    losses = [obj.batch_loss(x, idx[p * b:(p + 1) * b]) for p in range(P)]
    assert math.isclose(np.mean(losses), obj.batch_loss(x, idx), rel_tol=1e-12, abs_tol=1e-13)
    all_idx = np.arange(obj.n)
    full = obj.full_grad(x)
    np.testing.assert_allclose(obj.batch_grad(x, all_idx), full, rtol=1e-10, atol=1e-12 * (1 + np.abs(full).max()))
    assert math.isclose(obj.batch_loss(x, all_idx), obj.loss(x), rel_tol=1e-10, abs_tol=1e-12)


def test_deterministic_and_pure(obj):
    x = _points(obj, m=1, seed=4)[0]
    idx = np.array([1, 2], dtype=np.int64)
    a = obj.batch_grad(x, idx)
    x_copy = x.copy()
    b = obj.batch_grad(x, idx)
    assert np.array_equal(a, b) and np.array_equal(x, x_copy)


def test_sample_grad_norms_match_per_sample_grads(obj):
    x = _points(obj, m=1, seed=6)[0]
    norms = obj.sample_grad_norms(x)
    ref = np.array([np.linalg.norm(obj.batch_grad(x, np.array([i]))) for i in range(obj.n)])
    assert norms.shape == (obj.n,)
    np.testing.assert_allclose(norms, ref, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------- constants
def test_constants_structure(obj):
    c = obj.constants()
    for key in ("L", "M", "f_star_lower", "L_f"):
        entry = c[key]
        assert set(entry) == {"value", "how", "note"}
        assert entry["how"] in ("analytic", "estimated", "unknown")
        assert (entry["value"] is None) == (entry["how"] == "unknown")
        assert isinstance(entry["note"], str) and entry["note"]
    assert c["L"]["value"] > 0 and c["L_f"]["value"] <= c["L"]["value"] * (1 + 1e-12)


def test_L_holds_on_random_pairs(obj):
    c = obj.constants()
    L, Lf = c["L"]["value"], c["L_f"]["value"]
    rng = np.random.default_rng(7)
    for t in range(30):
        scale = [0.1, 1.0, 3.0][t % 3]
        x = scale * rng.standard_normal(obj.d)
        y = x + 10.0 ** rng.uniform(-4, 0) * rng.standard_normal(obj.d)
        dist = np.linalg.norm(x - y)
        assert np.linalg.norm(obj.full_grad(x) - obj.full_grad(y)) <= Lf * dist * (1 + 1e-9)
        i = np.array([t % obj.n])
        assert np.linalg.norm(obj.batch_grad(x, i) - obj.batch_grad(y, i)) <= L * dist * (1 + 1e-9)


def test_M_holds_where_analytic(obj):
    c = obj.constants()
    M = c["M"]
    pts = _points(obj, m=3, seed=8) + _points(obj, m=3, seed=9, scale=30.0) + [obj.x0(0)]
    est = obj.estimate_M(pts)
    assert est["how"] == "estimated" and est["value"] > 0
    if M["how"] == "analytic":
        for x in pts:
            assert obj.sample_grad_norms(x).max() <= M["value"] * (1 + 1e-12)
        assert est["value"] <= M["value"] * (1 + 1e-12)
    else:
        assert M["value"] is None and "estimate_M" in M["note"]


def test_f_star_lower_below_loss(obj):
    fs = obj.constants()["f_star_lower"]["value"]
    for x in _points(obj, m=5, seed=10) + _points(obj, m=3, seed=11, scale=5.0) + [obj.x0(0)]:
        assert fs <= obj.loss(x)


def test_expected_analytic_M():
    for key in ("sines_flat", "robust", "logistic_dense", "softmax_dense", "softmax_digits"):
        assert _build(key).constants()["M"]["how"] == "analytic", key
    for key in ("sines", "double_well", "logistic_sparse", "softmax_sparse"):  # lam > 0 or mu > 0
        assert _build(key).constants()["M"]["how"] == "unknown", key


def test_synthetic_L_is_tight():
    o = make_objective("sines", d=10, n=4, seed=0, sigma=0.0)
    L = o.constants()["L"]["value"]
    assert L == pytest.approx(o.lam.max() + o.a)
    j = int(np.argmax(o.lam))
    x = np.full(o.d, np.pi)
    e = np.zeros(o.d)
    e[j] = 1e-4
    ratio = np.linalg.norm(o.full_grad(x + e) - o.full_grad(x)) / 1e-4
    assert 0.999 * L <= ratio <= L * (1 + 1e-9)


def test_double_well_f_star_is_exact():
    o = make_objective("double_well", d=6, n=4, seed=0, lam_min=0.05, lam_max=3.0, a=1.0)
    fs = o.constants()["f_star_lower"]["value"]
    t = np.linspace(0, 20, 400001)
    num = sum(np.min(0.5 * lam * t * t - o.a * t * t / (1 + t * t)) for lam in o.lam)
    assert fs <= num <= fs + 1e-6


def test_sines_f_star_is_certified_and_tight():
    o = make_objective("sines", d=8, n=4, seed=0, lam_min=0.0, lam_max=2.0, a=1.0)
    fs = o.constants()["f_star_lower"]["value"]
    t = np.linspace(0, 40, 800001)
    num = sum(np.min(0.5 * lam * t * t + o.a * np.cos(t)) for lam in o.lam)
    assert fs <= num <= fs + 1e-4


def _curvature(o, x, v, h=1e-5):
    return float(v @ (o.full_grad(x + h * v) - o.full_grad(x - h * v))) / (2 * h)


@pytest.mark.parametrize("key", ["sines", "double_well", "robust"])
def test_synthetic_objectives_are_nonconvex(key):
    o = _build(key)
    rng = np.random.default_rng(12)
    found = []
    for scale in (0.0, 0.3, 1.0, 10.0):
        for _ in range(10):
            x = scale * rng.standard_normal(o.d) if key != "robust" else scale * o.x0(0)
            v = rng.standard_normal(o.d)
            found.append(_curvature(o, x, v))
    assert min(found) < -1e-3


# ----------------------------------------------------------------------------- registry / errors
def test_registry_and_config_errors():
    assert set(OBJECTIVES) >= {"sines", "double_well", "robust_regression", "logistic", "softmax"}
    for spec in OBJECTIVES.values():
        assert isinstance(spec["params"], dict) and spec["summary"]
    with pytest.raises(ConfigError, match="unknown objective 'nope'.*valid.*sines"):
        make_objective("nope")
    with pytest.raises(ConfigError, match="unknown parameter 'dd'.*valid d, n"):
        make_objective("sines", dd=3)
    with pytest.raises(ConfigError, match=r"d = 0 is out of range: valid 1 <= d"):
        make_objective("sines", d=0)
    with pytest.raises(ConfigError, match="dataset = None"):
        make_objective("logistic")
    with pytest.raises(ConfigError, match="10 classes.*softmax"):
        make_objective("logistic", dataset=load_dataset("digits", n_max=20))
    with pytest.raises(ConfigError, match=r"nnz = 9 is out of range: valid 1 <= nnz <= 8"):
        make_objective("robust_regression", d=8, nnz=9)
    with pytest.raises(ConfigError, match=r"lam = -1"):
        make_objective("logistic", dataset=small_dataset(sparse=False, C=2), lam=-1)


def test_bad_x_and_idx():
    o = _build("sines")
    with pytest.raises(SparsimError, match=r"x has shape \(3,\): valid shape is \(10,\)"):
        o.loss(np.zeros(3))
    with pytest.raises(SparsimError, match=r"sample index 16 is out of range: valid 0 <= index <= 15"):
        o.batch_grad(np.zeros(10), np.array([0, 16]))
    with pytest.raises(SparsimError, match="non-empty 1-D integer"):
        o.batch_grad(np.zeros(10), np.array([], dtype=np.int64))


def test_sparse_and_dense_logistic_agree():
    dense = small_dataset(sparse=False, C=2)
    sparse = Dataset(X=sp.csr_matrix(dense.X), y=dense.y, n_classes=2, name="s", source="test")
    for name in ("logistic", "softmax"):
        a = make_objective(name, dataset=dense, lam=0.1, mu=0.01)
        b = make_objective(name, dataset=sparse, lam=0.1, mu=0.01)
        x = np.random.default_rng(0).standard_normal(a.d)
        np.testing.assert_allclose(a.full_grad(x), b.full_grad(x), rtol=1e-12, atol=1e-14)
        assert a.loss(x) == pytest.approx(b.loss(x), rel=1e-12)
        assert a.constants()["L"]["value"] == pytest.approx(b.constants()["L"]["value"], rel=1e-12)


def test_large_d_synthetic_build_and_batch():
    for name in ("sines", "double_well", "robust_regression"):
        o = make_objective(name, d=200_000, n=64)
        g = o.batch_grad(o.x0(0), np.array([1, 5], dtype=np.int64))
        assert g.shape == (200_000,) and np.isfinite(g).all()


# ----------------------------------------------------------------------------------- data
def test_sklearn_datasets_shapes():
    bc = load_dataset("breast_cancer")
    assert bc.X.shape == (569, 30) and bc.y.shape == (569,) and bc.n_classes == 2
    assert bc.X.dtype == np.float64 and bc.y.dtype == np.int64
    np.testing.assert_allclose(bc.X.mean(axis=0), 0.0, atol=1e-12)
    np.testing.assert_allclose(bc.X.std(axis=0), 1.0, rtol=1e-12)
    dg = load_dataset("digits")
    assert dg.X.shape == (1797, 64) and dg.n_classes == 10 and set(np.unique(dg.y)) == set(range(10))
    assert dg.X.min() >= 0.0 and dg.X.max() <= 1.0
    assert load_dataset("digits", n_max=10).X.shape == (10, 64)


def test_synthetic_epsilon():
    ds = load_dataset("synthetic_epsilon", d=50, n=300, seed=3)
    assert ds.X.shape == (300, 50) and ds.n_classes == 2 and not ds.is_sparse
    np.testing.assert_allclose(np.linalg.norm(ds.X, axis=1), 1.0, rtol=1e-12)
    assert 0.3 < ds.y.mean() < 0.7
    head = load_dataset("synthetic_epsilon", d=50, n=300, seed=3, n_max=40)
    assert np.array_equal(head.X, ds.X[:40]) and np.array_equal(head.y, ds.y[:40])
    again = load_dataset("synthetic_epsilon", d=50, n=300, seed=3)
    assert np.array_equal(again.X, ds.X)
    other = load_dataset("synthetic_epsilon", d=50, n=300, seed=4)
    assert not np.array_equal(other.X, ds.X)


def test_libsvm_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((25, 7))
    X[rng.random(X.shape) < 0.5] = 0.0
    y = np.where(rng.random(25) < 0.5, -1.0, 1.0)
    path = tmp_path / "small.svm"
    dump_svmlight_file(X, y, str(path), zero_based=False)
    ds = load_dataset("libsvm", str(path))
    assert ds.is_sparse and ds.X.format == "csr" and ds.X.dtype == np.float64
    assert ds.n_classes == 2 and ds.y.dtype == np.int64
    assert np.array_equal(ds.y, (y > 0).astype(np.int64))
    np.testing.assert_allclose(ds.X.toarray()[:, : X.shape[1]], X, rtol=1e-15)
    o = make_objective("logistic", dataset=ds, lam=1e-3)
    x = rng.standard_normal(o.d)
    np.testing.assert_allclose(o.full_grad(x), _fd_grad(o.loss, x), rtol=1e-5, atol=1e-7)


def test_libsvm_multiclass_labels_sorted(tmp_path):
    X = np.eye(4)
    path = tmp_path / "m.svm"
    dump_svmlight_file(X, np.array([7.0, -2.0, 3.0, 7.0]), str(path))
    ds = load_dataset("libsvm", path)
    assert ds.n_classes == 3 and ds.y.tolist() == [2, 0, 1, 2]


def test_libsvm_missing_and_malformed(tmp_path):
    missing = tmp_path / "nope.svm"
    with pytest.raises(DataError, match="not found") as err:
        load_dataset("libsvm", str(missing))
    assert str(missing) in str(err.value)
    bad = tmp_path / "bad.svm"
    bad.write_text("1 1:0.5 2:x\n0 3:1\n")
    with pytest.raises(DataError, match="malformed LIBSVM file") as err:
        load_dataset("libsvm", str(bad))
    assert str(bad) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="path = None"):
        load_dataset("libsvm")


def test_nan_raises_data_error(tmp_path):
    X = np.ones((5, 4))
    X[2, 3] = np.nan
    X[4, 0] = np.inf
    with pytest.raises(DataError, match=r"'toy'.*\(row, column\) = \(2, 3\)"):
        Dataset(X=X, y=np.zeros(5, dtype=np.int64), n_classes=1, name="toy")
    with pytest.raises(DataError, match=r"\(row, column\) = \(2, 3\)"):
        Dataset(X=sp.csr_matrix(X), y=np.zeros(5, dtype=np.int64), n_classes=1, name="toy")
    path = tmp_path / "nan.svm"
    path.write_text("1 1:0.5 2:1\n-1 1:1 3:nan\n")
    with pytest.raises(DataError, match=r"\(row, column\) = \(1, 2\)"):
        load_dataset("libsvm", str(path))


def test_dataset_validation_and_unknown_name():
    with pytest.raises(ConfigError, match="unknown data set 'mnist'.*breast_cancer"):
        load_dataset("mnist")
    with pytest.raises(DataError, match=r"label 3 is out of range: valid 0 <= label <= 1"):
        Dataset(X=np.zeros((2, 2)), y=np.array([0, 3]), n_classes=2, name="t")
    with pytest.raises(ConfigError, match=r"n_max = 0 is out of range"):
        load_dataset("digits", n_max=0)


# ----------------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("n,P", [(10, 1), (10, 3), (569, 8), (7, 7)])
def test_shard_iid_covers_each_index_once(n, P):
    shards = shard_indices(n, P, seed=1)
    assert len(shards) == P and all(s.dtype == np.int64 for s in shards)
    assert np.array_equal(np.sort(np.concatenate(shards)), np.arange(n))
    sizes = [s.size for s in shards]
    assert max(sizes) - min(sizes) <= 1
    again = shard_indices(n, P, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(shards, again))


def test_shard_iid_depends_on_seed():
    a = shard_indices(100, 4, seed=0)
    b = shard_indices(100, 4, seed=1)
    assert any(not np.array_equal(x, y) for x, y in zip(a, b))


def test_shard_label_mode_sorted():
    labels = np.array([2, 0, 1, 0, 2, 1, 0, 1, 2, 2])
    shards = shard_indices(10, 3, mode="label", labels=labels)
    cat = np.concatenate(shards)
    assert np.array_equal(np.sort(cat), np.arange(10))
    keys = list(zip(labels[cat], cat))
    assert keys == sorted(keys)
    assert [s.size for s in shards] == [4, 3, 3]


def test_shard_errors():
    with pytest.raises(SparsimError, match=r"P = 0 is out of range: valid 1 <= P <= 10"):
        shard_indices(10, 0)
    with pytest.raises(SparsimError, match=r"P = 11 is out of range: valid 1 <= P <= 10"):
        shard_indices(10, 11)
    with pytest.raises(SparsimError, match="labels = None"):
        shard_indices(10, 2, mode="label")
    with pytest.raises(ConfigError, match="unknown shard mode"):
        shard_indices(10, 2, mode="zipf")


def test_minibatch_deterministic_without_replacement():
    shard = shard_indices(1000, 4, seed=0)[2]
    a = minibatch(shard, 32, seed=5, rank=2, iteration=17)
    _ = minibatch(shard, 32, seed=5, rank=2, iteration=18)  # a different call in between
    b = minibatch(shard, 32, seed=5, rank=2, iteration=17)
    assert np.array_equal(a, b) and a.dtype == np.int64
    assert np.unique(a).size == 32 and np.all(np.diff(a) > 0)
    assert np.isin(a, shard).all()
    assert not np.array_equal(a, minibatch(shard, 32, seed=5, rank=1, iteration=17))
    full = minibatch(shard, shard.size, seed=0, rank=0, iteration=0)
    assert np.array_equal(full, np.sort(shard))
    with pytest.raises(SparsimError, match=rf"b = {shard.size + 1} is out of range: valid 1 <= b <= {shard.size}"):
        minibatch(shard, shard.size + 1, seed=0, rank=0, iteration=0)
    with pytest.raises(SparsimError, match=r"b = 0 is out of range"):
        minibatch(shard, 0, seed=0, rank=0, iteration=0)


def test_minibatch_uniform_coverage():
    shard = np.arange(20, dtype=np.int64)
    counts = np.zeros(20)
    for it in range(2000):
        counts[minibatch(shard, 5, seed=0, rank=0, iteration=it)] += 1
    expected = 2000 * 5 / 20
    assert np.abs(counts - expected).max() < 5 * math.sqrt(expected)
