"""sim.workloads.nets: the zoo's parameter counts against closed forms by hand, NetObjective's gradients against independent
torch computations (vmap vs the per-worker loop, the loop vs a plain module's ``loss.backward()``), BatchNorm's
per-worker normalisation and rank 0's running statistics, evaluate() against an independent eval-mode accuracy,
the image normalisation, bad input (one-line ConfigError), and bad [model] runs through the CLI on the real data.

The gradient tests use small synthetic uint8 images (P = 3 workers of b = 4) so that the whole file runs in
seconds; the tests marked ``needs_data`` read the Fashion-MNIST IDX files (skipped without them unless CI=true).
"""
from __future__ import annotations

import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from click.testing import CliRunner  # noqa: E402
from torch import nn  # noqa: E402

from sim.base.errors import ConfigError  # noqa: E402
from sim.workloads.nets import BATCHED_RTOL, GRADIENT_MODES, NET_PARAMS, NET_ZOO, NetObjective, build_net  # noqa: E402

FMNIST = "/usr/share/datasets/fashion-mnist"
HAVE_DATA = os.path.isdir(FMNIST)
needs_data = pytest.mark.skipif(not HAVE_DATA and os.environ.get("CI") != "true",
                                reason="dataset-fashion-mnist not installed (CI installs it)")
SCENARIO = os.path.join(os.path.dirname(__file__), "..", "experiments", "scenarios", "fmnist-resnet20-gtopk-icdcs.toml")

#: the nets the gradient tests run (mlp-1024 / mlp-3000 differ from mlp-256 only in size)
GRAD_NETS = ("mlp-256", "lenet5", "resnet20")


# --------------------------------------------------------------------------- helpers

def _conv(c_in, c_out, k, bias):
    return c_in * c_out * k * k + (c_out if bias else 0)


def _linear(n_in, n_out):
    return n_in * n_out + n_out


def _resnet20_by_hand() -> int:
    """ResNet-20 (CIFAR variant, 1 input channel): conv3x3 1-16 without bias + BN(16), three stages of three basic
    blocks (two conv3x3 without bias, each followed by a BN with weight and bias), the first block of stages 2 and 3
    going from c/2 to c channels (option-A shortcut: no parameters), then a 64-10 linear layer."""
    bn = lambda c: 2 * c  # noqa: E731 - weight and bias
    total = _conv(1, 16, 3, False) + bn(16)
    c_in = 16
    for c in (16, 32, 64):
        for _ in range(3):
            total += _conv(c_in, c, 3, False) + bn(c) + _conv(c, c, 3, False) + bn(c)
            c_in = c
    return total + _linear(64, 10)


BY_HAND = {
    "mlp-256": _linear(784, 256) + _linear(256, 10),                                  # 203,530
    "mlp-1024": _linear(784, 1024) + _linear(1024, 1024) + _linear(1024, 10),         # 1,863,690
    "mlp-3000": _linear(784, 3000) + _linear(3000, 3000) + _linear(3000, 10),         # 11,388,010
    # conv5x5 1-6 (pad 2: 28 x 28 -> 28, pool 14), conv5x5 6-16 (14 -> 10, pool 5), 16 x 5 x 5 = 400 -> 120 -> 84 -> 10
    "lenet5": _conv(1, 6, 5, True) + _conv(6, 16, 5, True) + _linear(400, 120) + _linear(120, 84) + _linear(84, 10),
    "resnet20": _resnet20_by_hand(),
}


def _images(n, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n)


X_TR, Y_TR = _images(64, 1)
X_TE, Y_TE = _images(40, 2)


def _objective(name, dtype="float64", gradients="loop", seed=3, **kw):
    """(module, NetObjective) of zoo net ``name`` on the synthetic images: every training image is in the
    evaluation subset (eval_samples = 0, chunk 4 divides 64) and every test image in the test metrics."""
    m = build_net(name, seed=seed, dtype=dtype)
    kw = {"eval_samples": 0, "chunk": 4, **kw}
    return m, NetObjective(m, X_TR, Y_TR, X_TE, Y_TE, dtype=dtype, gradients=gradients, name=name, **kw)


def _normalise(X, X_train, dtype):
    """uint8 images (n, 28, 28) -> (n, 1, 28, 28) torch tensor: scaled by 1/255 and standardised by the mean and
    population std of X_train / 255, all in float64 with plain numpy reductions (not the objective's histogram)."""
    ref = X_train.astype(np.float64) / 255.0
    mean, std = ref.mean(), ref.std()
    return torch.from_numpy(((X.astype(np.float64) / 255.0 - mean) / std).astype(dtype)[:, None])


def _plain_copy(module, x):
    """A copy of module (same buffers) whose parameters are the flat vector x, in train mode."""
    ref = copy.deepcopy(module)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(torch.from_numpy(np.array(x)), ref.parameters())
    return ref.train()


def _plain_grad(ref, images, labels):
    """``loss.backward()`` of the mean cross-entropy of ref on the images: the gradient as a flat numpy vector."""
    ref.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(ref(images), torch.as_tensor(labels, dtype=torch.int64)).backward()
    return torch.nn.utils.parameters_to_vector([p.grad for p in ref.parameters()]).detach().numpy()


def _buffers(module):
    return {k: b.detach().clone() for k, b in module.named_buffers()}


class one_thread:
    """torch at one intra-op thread inside the block (the objective computes with one: sim.workloads.nets)."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)


def _rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


IDXS = np.array([[0, 5, 9, 17], [3, 3, 40, 63], [22, 8, 1, 50]])  # P = 3 workers, b = 4 (a repeat in worker 1)


# --------------------------------------------------------------------------- the zoo

@pytest.fixture(scope="module")
def zoo():
    """Every zoo network built once (mlp-3000 has 11.4M parameters: float32 keeps it at 46 MB)."""
    return {name: build_net(name, dtype="float32") for name in NET_ZOO}


def test_parameter_counts_match_the_closed_forms(zoo):
    assert BY_HAND == {"mlp-256": 203_530, "mlp-1024": 1_863_690, "mlp-3000": 11_388_010, "lenet5": 61_706,
                       "resnet20": 269_434}
    assert set(NET_PARAMS) == set(NET_ZOO) == set(BY_HAND)
    for name, m in zoo.items():
        assert sum(p.numel() for p in m.parameters()) == NET_PARAMS[name] == BY_HAND[name], name


def test_zoo_maps_images_to_ten_logits_and_seeds_its_initialisation(zoo):
    state = torch.random.get_rng_state()
    x = torch.zeros(2, 1, 28, 28)
    for name, m in zoo.items():
        m.eval()
        with torch.no_grad():
            assert m(x).shape == (2, 10), name
        assert next(m.parameters()).dtype == torch.float32
    a, b, c = (torch.nn.utils.parameters_to_vector(build_net("lenet5", seed=s).parameters()) for s in (7, 7, 8))
    assert a.dtype == torch.float64 and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global generator is left as it was


# --------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", GRAD_NETS)
def test_vmap_within_batched_rtol_of_the_loop_and_the_loop_has_batch_grads_bits(name, dtype):
    m, loop = _objective(name, dtype, "loop")
    vm = NetObjective(m, X_TR, Y_TR, X_TE, Y_TE, dtype=dtype, gradients="vmap", eval_samples=0, chunk=4, name=name)
    x = loop.x0()
    G_loop, G_vmap = loop.batch_grads(x, IDXS), vm.batch_grads(x, IDXS)
    assert G_loop.shape == G_vmap.shape == (3, NET_PARAMS[name]) and G_loop.dtype == G_vmap.dtype == np.dtype(dtype)
    for p in range(3):
        ref = loop.batch_grad(x, IDXS[p])
        assert np.array_equal(G_loop[p], ref), p
        assert np.array_equal(vm.batch_grad(x, IDXS[p]), ref)  # batch_grad does not depend on the mode
        assert np.linalg.norm(ref) > 0
        assert _rel(G_vmap[p], ref) <= BATCHED_RTOL[dtype], (p, _rel(G_vmap[p], ref))
    # three different batches give three different gradients (no row is another's copy)
    assert not np.array_equal(G_loop[0], G_loop[1]) and not np.array_equal(G_loop[1], G_loop[2])
    assert loop.gradients == "loop" and vm.gradients == "vmap"


@pytest.mark.parametrize("name", GRAD_NETS)
def test_batch_grad_equals_a_plain_modules_backward(name):
    """float64. On the objective's own normalised batch the plain module's eager ``loss.backward()`` gives
    batch_grad's bits: both run the same aten forward and backward kernels in the same order at one thread (the
    objective's torch.func.grad and its BatchNorm copy without running statistics change neither; the plain
    module's BatchNorm in train mode normalises by the batch too). On images normalised here independently (numpy
    mean and std instead of the objective's 256-bin histogram, which may differ in the last bit) the gradients
    agree to 1e-12 relative."""
    m, obj = _objective(name, "float64", "loop")
    rng = np.random.default_rng(0)
    x = obj.x0() + 1e-2 * rng.standard_normal(obj.d)  # away from the initialisation
    idx = IDXS[1]
    g = obj.batch_grad(x, idx)
    ref = _plain_copy(m, x)
    with one_thread():
        own = _plain_grad(ref, obj._X[torch.from_numpy(idx)], Y_TR[idx])
    assert np.array_equal(g, own)
    indep = _plain_grad(ref, _normalise(X_TR[idx], X_TR, np.float64), Y_TR[idx])
    assert _rel(g, indep) <= 1e-12
    assert _rel(g, obj.batch_grad(x, IDXS[0])) > 1e-3  # another batch: another gradient


@pytest.mark.parametrize("name", ["lenet5", "resnet20"])
def test_gradients_do_not_depend_on_torchs_thread_count(name):
    """The objective computes every operator at one torch thread whatever the caller's setting (restored after);
    the per-worker loop and the evaluation batches run on as many Python threads as the caller's setting allows,
    each result with the bits it has alone (2 and 3 threads over P = 3 workers and 16 evaluation batches)."""
    _, obj = _objective(name, "float32", "loop")
    x = obj.x0()
    n = torch.get_num_threads()
    got = {}
    try:
        for th in (1, 2, 3):
            torch.set_num_threads(th)
            got[th] = (obj.batch_grad(x, IDXS[0]), obj.batch_grads(x, IDXS), obj.loss_and_grad(x), obj.loss(x))
            assert torch.get_num_threads() == th
    finally:
        torch.set_num_threads(n)
    g, G, (f, gf), f2 = got[1]
    assert f == f2  # loss_and_grad's loss has loss's bits
    for th in (2, 3):
        g_, G_, (f_, gf_), f2_ = got[th]
        assert np.array_equal(g, g_) and np.array_equal(G, G_) and np.array_equal(gf, gf_) and f == f_ == f2_, th
    assert np.array_equal(G[0], g)


@pytest.mark.parametrize("name", ["mlp-256", "resnet20"])
def test_loss_and_full_gradient_equal_a_plain_modules_over_the_evaluation_batches(name):
    """f = the mean over the evaluation subset's batches of chunk images (train mode: BatchNorm per batch) of their
    mean cross-entropy; here all 64 images in 16 batches of 4, in the subset's (sorted) order."""
    m, obj = _objective(name, "float64", "vmap")
    x = obj.x0() + 1e-2 * np.random.default_rng(3).standard_normal(obj.d)
    f, g = obj.loss_and_grad(x)
    ref = _plain_copy(m, x)
    images = _normalise(X_TR, X_TR, np.float64)
    y = torch.as_tensor(Y_TR, dtype=torch.int64)
    losses = [torch.nn.functional.cross_entropy(ref(images[i:i + 4]), y[i:i + 4]) for i in range(0, 64, 4)]
    total = sum(losses) / 16
    total.backward()
    g_ref = torch.nn.utils.parameters_to_vector([p.grad for p in ref.parameters()]).detach().numpy()
    assert f == pytest.approx(float(total.detach()), rel=1e-12) and f == obj.loss(x)
    assert _rel(g, g_ref) <= 1e-12 and np.array_equal(obj.full_grad(x), g)
    # 16 batches of 4 (BatchNorm per batch) are another function than 8 batches of 8
    _, obj8 = _objective(name, "float64", "loop", chunk=8)
    if name == "resnet20":
        assert abs(obj8.loss(x) - f) > 1e-6
    else:
        assert obj8.loss(x) == pytest.approx(f, rel=1e-12)


def test_sample_grad_norms_are_the_single_sample_gradients_norms():
    _, obj = _objective("mlp-256", "float64")
    x = obj.x0()
    norms = obj.sample_grad_norms(x)
    assert norms.shape == (64,)
    want = [np.linalg.norm(obj.batch_grad(x, np.array([i]))) for i in range(64)]
    np.testing.assert_allclose(norms, want, rtol=1e-12)


@pytest.mark.parametrize("gradients", ["loop", "vmap"])
def test_batchnorm_per_worker_and_rank_zeros_running_statistics(gradients):
    m, obj = _objective("resnet20", "float64", gradients)
    x = obj.x0() + 1e-2 * np.random.default_rng(1).standard_normal(obj.d)
    init = _buffers(obj._stats)
    G = obj.batch_grads(x, IDXS)
    # DDP's rule: the running statistics are a plain copy's after one train-mode forward of rank 0's batch at x
    ref = _plain_copy(m, x)
    with torch.no_grad():
        ref(_normalise(X_TR[IDXS[0]], X_TR, np.float64))
    got, want = _buffers(obj._stats), _buffers(ref)
    assert set(got) == set(want) and any(k.endswith("running_mean") for k in got)
    for k in got:
        if k.endswith("num_batches_tracked"):
            assert int(got[k]) == int(want[k]) == 1, k
        else:
            assert torch.allclose(got[k], want[k], rtol=1e-12, atol=1e-14), k
            assert not torch.equal(got[k], init[k]), k  # they moved (momentum 0.1)
    other = _plain_copy(m, x)  # worker 1's batch would give other statistics
    with torch.no_grad():
        other(_normalise(X_TR[IDXS[1]], X_TR, np.float64))
    assert not torch.allclose(got["bn_1.running_mean"], _buffers(other)["bn_1.running_mean"], rtol=1e-6)
    # the batch gradients left the plain module's statistics alone and reset_state restores construction's
    obj.reset_state()
    for k, b in _buffers(obj._stats).items():
        assert torch.equal(b, init[k]), k
    assert torch.equal(_buffers(obj._stats)["bn_1.running_var"], torch.ones(16, dtype=torch.float64))
    # a worker's gradient depends only on its own batch: another batch for worker 1 leaves rows 0 and 2 unchanged
    idxs2 = IDXS.copy()
    idxs2[1] = [60, 61, 62, 2]
    G2 = obj.batch_grads(x, idxs2)
    assert np.array_equal(G2[0], G[0]) and np.array_equal(G2[2], G[2])
    assert _rel(G2[1], G[1]) > 1e-3
    # ... and is batch_grad over that batch alone (BatchNorm over its b = 4 images, not the P x b)
    assert _rel(G2[1], obj.batch_grad(x, idxs2[1])) <= BATCHED_RTOL["float64"]
    ref = _plain_copy(m, x)
    pooled = _plain_grad(ref, _normalise(X_TR[IDXS.ravel()], X_TR, np.float64), Y_TR[IDXS.ravel()])
    assert _rel(G.mean(axis=0), pooled) > 1e-6  # one BatchNorm over the union would be another gradient


def test_worker_grad_updates_statistics_only_for_rank_zero():
    _, obj = _objective("resnet20", "float64")
    x = obj.x0()
    init = _buffers(obj._stats)
    g1 = obj.worker_grad(x, IDXS[1], 1)
    assert all(torch.equal(b, init[k]) for k, b in _buffers(obj._stats).items())
    assert np.array_equal(g1, obj.batch_grad(x, IDXS[1]))
    obj.worker_grad(x, IDXS[0], 0)
    after_worker = _buffers(obj._stats)
    obj.reset_state()
    obj.batch_grads(x, IDXS)
    assert all(torch.equal(b, after_worker[k]) for k, b in _buffers(obj._stats).items())


# --------------------------------------------------------------------------- evaluation

def _eval_mode_metrics(ref, X, y, X_train):
    """(accuracy, mean cross-entropy) of ref in eval mode on uint8 images X, computed here."""
    ref.eval()
    with torch.no_grad():
        out = ref(_normalise(X, X_train, np.float64))
    y = torch.as_tensor(y, dtype=torch.int64)
    return float((out.argmax(dim=1) == y).double().mean()), float(torch.nn.functional.cross_entropy(out, y))


@pytest.mark.parametrize("name", ["mlp-256", "resnet20"])
def test_evaluate_equals_an_independent_eval_mode_accuracy(name):
    m, obj = _objective(name, "float64", "loop")
    x = obj.x0() + 5e-2 * np.random.default_rng(2).standard_normal(obj.d)
    obj.batch_grads(x, IDXS)  # the running statistics move to rank 0's batch at x
    ev = obj.evaluate(x)
    ref = _plain_copy(m, x)
    with torch.no_grad():
        ref(_normalise(X_TR[IDXS[0]], X_TR, np.float64))
    tr_acc, _ = _eval_mode_metrics(ref, X_TR, Y_TR, X_TR)
    te_acc, te_loss = _eval_mode_metrics(ref, X_TE, Y_TE, X_TR)
    assert ev["train_accuracy"] == tr_acc and ev["test_accuracy"] == te_acc
    assert ev["test_loss"] == pytest.approx(te_loss, rel=1e-10)
    assert obj._stats.training  # evaluate leaves the module in train mode


@needs_data
def test_evaluate_on_fashion_mnist_after_training_steps():
    """mlp-256 on 2048 real training images: 40 SGD steps of the mean of P = 4 worker gradients lift the accuracy
    far above chance, and evaluate() agrees with argmax accuracy computed here."""
    from sim.workloads.idx import load_image_dataset

    ds = load_image_dataset("fashion-mnist", FMNIST)
    Xtr, ytr, Xte, yte = ds.X_train[:2048], ds.y_train[:2048], ds.X_test[:1000], ds.y_test[:1000]
    m = build_net("mlp-256", seed=0, dtype="float32")
    obj = NetObjective(m, Xtr, ytr, Xte, yte, dtype="float32", eval_samples=0, chunk=32, name="mlp-256")
    x = obj.x0()
    rng = np.random.default_rng(0)
    for _ in range(40):
        x = x - np.float32(0.1) * obj.batch_grads(x, rng.integers(0, 2048, (4, 32))).mean(axis=0)
    ev = obj.evaluate(x)
    ref = _plain_copy(m, x)
    ref.eval()
    with torch.no_grad():
        for X, y, key in ((Xtr, ytr, "train_accuracy"), (Xte, yte, "test_accuracy")):
            pred = ref(_normalise(X, Xtr, np.float32)).argmax(dim=1).numpy()
            assert ev[key] == pytest.approx(float(np.mean(pred == y)), abs=1.5 / len(y)), key  # float32 ties
    assert ev["test_accuracy"] > 0.6 and ev["train_accuracy"] > 0.6


# --------------------------------------------------------------------------- images

def test_normalisation_uses_the_training_statistics():
    _, obj = _objective("mlp-256", "float64")
    Xn = obj._X.numpy()
    assert Xn.shape == (64, 1, 28, 28)
    assert abs(Xn.mean()) < 1e-12 and abs(Xn.std() - 1.0) < 1e-12
    np.testing.assert_allclose(Xn, _normalise(X_TR, X_TR, np.float64).numpy(), rtol=0, atol=1e-13)
    # test images are standardised with the training set's mean and std, not their own
    white = np.full((3, 28, 28), 255, dtype=np.uint8)
    o2 = NetObjective(build_net("mlp-256"), X_TR, Y_TR, white, Y_TE[:3], eval_samples=0, chunk=4)
    ref = X_TR / 255.0
    np.testing.assert_allclose(o2._Xt.numpy(), (1.0 - ref.mean()) / ref.std(), rtol=1e-13)


@needs_data
def test_normalised_fashion_mnist_has_mean_zero_std_one():
    from sim.workloads.idx import load_image_dataset

    ds = load_image_dataset("fashion-mnist", FMNIST)
    raw = ds.X_train / 255.0
    # the published Fashion-MNIST statistics (Xiao et al. 2017 images; the usual 0.2860 / 0.3530)
    assert raw.mean() == pytest.approx(0.2860, abs=1e-4) and raw.std() == pytest.approx(0.3530, abs=1e-4)
    obj = NetObjective(build_net("mlp-256", dtype="float32"), ds.X_train, ds.y_train, ds.X_test[:10],
                       ds.y_test[:10], dtype="float32", name="mlp-256")
    Xn = obj._X.numpy().astype(np.float64)
    assert Xn.shape == (60000, 1, 28, 28) and obj.n == 60000 and obj.n_classes == 10
    assert abs(Xn.mean()) < 1e-6 and abs(Xn.std() - 1.0) < 1e-6


# --------------------------------------------------------------------------- bad input

def test_build_net_names_timing_only_and_unknown_networks():
    with pytest.raises(ConfigError, match="'resnet50' is a timing-only model") as info:
        build_net("resnet50")
    assert "\n" not in str(info.value) and "valid mlp-256, mlp-1024, mlp-3000, lenet5, resnet20" in str(info.value)
    with pytest.raises(ConfigError, match=r"'vgg7' is unknown: valid mlp-256, mlp-1024, mlp-3000, lenet5, resnet20"):
        build_net("vgg7")
    for bad in ("float16", "int32"):
        with pytest.raises(ConfigError, match=f"dtype = '{bad}' is unknown: valid float64, float32"):
            build_net("mlp-256", dtype=bad)


@pytest.mark.parametrize("module, needle", [
    (nn.Linear(100, 10), "1 x 28 x 28"),                                      # no Flatten: 28 x 28 into 100 inputs
    (nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 26 * 26, 10)), "1 x 28 x 28"),  # 3 channels
    (nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(10)), "1 x 28 x 28"),  # lazy, 3 channels
    (nn.Sequential(nn.Flatten(), nn.Linear(784, 5)), "outputs shape (1, 5)"),  # 5 outputs, 10 classes
    (nn.Linear(28, 10), "outputs shape (1, 1, 28, 10)"),                      # not (1, C)
])
def test_a_module_that_does_not_fit_the_images_is_a_config_error(module, needle):
    with pytest.raises(ConfigError) as info:
        NetObjective(module, X_TR, Y_TR, X_TE, Y_TE, eval_samples=0, chunk=4, name="mine")
    msg = str(info.value)
    assert "\n" not in msg and "network 'mine'" in msg and needle in msg, msg
    if "outputs" in needle:
        assert "valid (1, C) with C >= 10 classes" in msg


def test_a_lazy_module_that_fits_is_materialised_first():
    torch.manual_seed(0)
    obj = NetObjective(nn.Sequential(nn.Flatten(), nn.LazyLinear(10)), X_TR, Y_TR, X_TE, Y_TE, eval_samples=0,
                       chunk=4, name="lazy")
    assert obj.d == 784 * 10 + 10 and obj.tensor_names == ["1.weight", "1.bias"]
    assert obj.batch_grad(obj.x0(), IDXS[0]).shape == (obj.d,)


def test_bad_dtype_gradients_and_sizes_are_config_errors():
    m = build_net("mlp-256")
    for bad in ("float16", "int8", "bogus"):
        with pytest.raises(ConfigError, match="dtype = .* is unknown: valid float64, float32"):
            NetObjective(m, X_TR, Y_TR, X_TE, Y_TE, dtype=bad, eval_samples=0, chunk=4)
    with pytest.raises(ConfigError, match="model.gradients = 'fast' is unknown: valid " + ", ".join(GRADIENT_MODES)):
        NetObjective(m, X_TR, Y_TR, X_TE, Y_TE, gradients="fast")
    with pytest.raises(ConfigError, match="model.eval_samples = 3 is out of range"):
        NetObjective(m, X_TR, Y_TR, X_TE, Y_TE, eval_samples=3, chunk=4)
    with pytest.raises(ConfigError, match="chunk = 0 is out of range"):
        NetObjective(m, X_TR, Y_TR, X_TE, Y_TE, chunk=0)
    obj = NetObjective(m, X_TR, Y_TR, X_TE, Y_TE, eval_samples=0, chunk=4)
    with pytest.raises(ConfigError, match="valid float64, float32"):
        obj.astype("float16")
    assert obj.astype("float64") is obj and obj.astype("float32").batch_grad(obj.x0(), IDXS[0]).dtype == np.float32


# --------------------------------------------------------------------------- the CLI on the real data

def _bad_run(tmp_path, sets, *needles):
    from experiments.cli import main

    out = tmp_path / "out"
    args = ["run", SCENARIO, "--out", str(out), "--quiet"]
    for s in sets:
        args += ["--set", s]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    # nothing that looks like a finished run: no directory, no summary.json, no DIR.partial
    assert not (out / "summary.json").exists() and not out.exists() and not (tmp_path / "out.partial").exists()
    return lines[0]


@needs_data
def test_cli_timing_only_model_name_exits_2(tmp_path):
    _bad_run(tmp_path, ["model.name='resnet50'"], "model.name = 'resnet50' is a timing-only model",
             "valid mlp-256, mlp-1024, mlp-3000, lenet5, resnet20")


@needs_data
def test_cli_global_batch_larger_than_the_training_set_exits_2(tmp_path):
    _bad_run(tmp_path, ["cluster.P=2000", "training.batch_size=31"],
             "cluster.P x training.batch_size = 2000 x 31 = 62000", "valid P x batch_size <= 60000")


@needs_data
def test_cli_data_path_without_the_files_exits_2(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    _bad_run(tmp_path, [f"data.path='{empty}'"], f"data.path = '{empty}'", "train-images-idx3-ubyte.gz not found")


@pytest.mark.parametrize("make, match", [
    (lambda nn: _Tuple(), "returns a tuple"),
    (lambda nn: nn.Sequential(nn.Flatten(), nn.Linear(784, 10), nn.Dropout(0.5)), "Dropout"),
    (lambda nn: _frozen(nn), "frozen parameters"),
])
def test_modules_the_flat_vector_cannot_train_are_refused(make, match):
    """Found by a fresh user: a tuple output or no parameters raised AttributeError / ValueError, Dropout failed inside
    vmap (or made the loop non-deterministic), a frozen parameter was trained."""
    pytest.importorskip("torch")
    from torch import nn

    from sim.base.errors import ConfigError
    from sim.workloads.nets import NetObjective

    X = np.zeros((8, 28, 28), dtype=np.uint8)
    X[:, 3, 3] = 255
    y = np.arange(8) % 10
    with pytest.raises(ConfigError, match=match):
        NetObjective(make(nn), X, y, X, y, chunk=4, eval_samples=8)


def _frozen(nn):
    m = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    m[1].bias.requires_grad_(False)
    return m


class _Tuple:
    def __new__(cls):
        from torch import nn

        class T(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(784, 10)

            def forward(self, x):
                return self.fc(x.flatten(1)), None

        return T()
