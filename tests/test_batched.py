"""Issue #12 items 3-5: batched worker gradients (same bits as the per-worker calls) and float32 numerics.

- ``Objective.batch_grads`` equals the stacked ``batch_grad`` calls bit for bit, for every objective (dense and
  CSR data), both shardings and both dtypes; ``loss_and_grad`` equals ``(loss, full_grad)``.
- :class:`sim.engine.runner.BatchedGradients`: one objective call per iteration, per-worker fallback when a replica's
  parameters differ; the default scenario's metrics.csv is byte-identical between the per-worker path (the code
  before the batching) and the batched path.
- ``training.dtype = "float32"``: parameters, gradients, accumulators, residuals, updates and messages stay
  float32, and every rank ends every iteration with the same parameters.
"""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from click.testing import CliRunner

from sim.algorithms import AlgorithmSpec
from sim.workloads.data import Dataset, load_dataset, minibatch, shard_indices
from sim.base.errors import ConfigError, SparsimError
from sim.machine.network import PRESETS
from sim.workloads.objectives import make_objective
from sim.engine.runner import BatchedGradients, Workers, run_algorithm

from _shared import ObjectiveCache, small_dataset


def _dataset(*, sparse: bool, C: int) -> Dataset:
    return small_dataset(sparse=sparse, C=C, n=60, p=7, name=f"t_{sparse}_{C}")


OBJECTIVES = {
    "sines": lambda: make_objective("sines", d=301, n=64, seed=1),
    "sines_r1": lambda: make_objective("sines", d=300, n=64, seed=1, r=1),
    "sines_noise_free": lambda: make_objective("sines", d=50, n=64, seed=1, sigma=0.0),
    "double_well": lambda: make_objective("double_well", d=257, n=65, seed=2, r=7),
    "robust": lambda: make_objective("robust_regression", d=120, n=64, nnz=5, seed=3),
    "robust_nnz1": lambda: make_objective("robust_regression", d=30, n=64, nnz=1, seed=3),
    "logistic_dense": lambda: make_objective("logistic", dataset=_dataset(sparse=False, C=2), lam=0.1),
    "logistic_dense_mu": lambda: make_objective("logistic", dataset=_dataset(sparse=False, C=2), lam=0.0, mu=0.1),
    "logistic_sparse": lambda: make_objective("logistic", dataset=_dataset(sparse=True, C=2), lam=0.1, mu=0.05),
    "logistic_bc": lambda: make_objective("logistic", dataset=load_dataset("breast_cancer", n_max=120), lam=1e-2),
    "softmax_dense": lambda: make_objective("softmax", dataset=_dataset(sparse=False, C=3), lam=0.1),
    "softmax_sparse": lambda: make_objective("softmax", dataset=_dataset(sparse=True, C=4), lam=0.1, mu=0.05),
    "softmax_digits": lambda: make_objective("softmax", dataset=load_dataset("digits"), lam=1e-3),
}
_obj = ObjectiveCache(lambda key: OBJECTIVES[key]())  # _obj(key, dtype)


def _labels(obj):
    ds = getattr(obj, "dataset", None)
    return ds.y if ds is not None else np.arange(obj.n) % 5


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("sharding", ["iid", "label"])
@pytest.mark.parametrize("key", list(OBJECTIVES))
def test_batched_gradients_equal_the_per_worker_ones_bit_for_bit(key, sharding, dtype):
    obj = _obj(key, dtype)
    for P, b in ((1, 1), (3, 2), (4, 5), (8, 1), (8, 3)):
        shards = shard_indices(obj.n, P, mode=sharding, labels=_labels(obj), seed=4)
        for t in (1, 9):
            x = (np.random.default_rng([P, b, t]).standard_normal(obj.d) * 0.7).astype(dtype)
            idxs = [minibatch(shards[r], b, 0, r, t) for r in range(P)]
            G = obj.batch_grads(x, idxs)
            assert G.shape == (P, obj.d) and G.dtype == np.dtype(dtype)
            for r in range(P):
                g = obj.batch_grad(x, idxs[r])
                assert g.dtype == np.dtype(dtype)
                assert _bits(G[r]) == _bits(g), (key, sharding, dtype, P, b, t, r)
            # the (P, b) array form and the scratch give the same bits
            assert _bits(obj.batch_grads(x, np.stack(idxs), scratch={})) == _bits(G)
        loss, gf = obj.loss_and_grad(x, {})
        assert loss == obj.loss(x) and _bits(gf) == _bits(obj.full_grad(x))


def test_scratch_shares_the_separable_gradient_at_one_point():
    obj = make_objective("double_well", d=100, n=32, seed=0)
    x = obj.x0(0)
    scratch: dict = {}
    G = obj.batch_grads(x, [np.array([0, 1]), np.array([5, 6])], scratch)
    _, gf = obj.loss_and_grad(x, scratch)
    assert gf is scratch["h"] and not gf.flags.writeable and _bits(gf) == _bits(obj.full_grad(x))
    assert _bits(G[1]) == _bits(obj.batch_grad(x, np.array([5, 6])))


def test_bad_batches_are_refused():
    obj = make_objective("sines", d=10, n=16, seed=0)
    x = obj.x0(0)
    with pytest.raises(SparsimError, match="one size"):
        obj.batch_grads(x, [np.array([0, 1]), np.array([2])])
    with pytest.raises(SparsimError, match="out of range"):
        obj.batch_grads(x, [np.array([0, 16])])
    with pytest.raises(SparsimError, match="valid"):
        obj.batch_grads(x, np.zeros((2, 0), dtype=np.int64))


class _PerWorker:
    """An objective seen through the per-worker interface only (no batch_grads, no loss_and_grad): the runner
    then calls batch_grad once per worker and loss and full_grad separately, as it did before batching."""

    def __init__(self, obj):
        self._o, self.n, self.d = obj, obj.n, obj.d

    def batch_grad(self, x, idx):
        return self._o.batch_grad(x, idx)

    def full_grad(self, x):
        return self._o.full_grad(x)

    def loss(self, x):
        return self._o.loss(x)


def test_default_scenario_metrics_are_byte_identical_per_worker_and_batched(tmp_path):
    """The default scenario (every algorithm, all 400 iterations, the SimPy cluster) writes the same metrics.csv
    through the per-worker path and through the batched one."""
    from experiments.run import build, run_id, write_metrics
    from experiments.scenario import load_scenario

    sc = load_scenario(None)
    built = build(sc)
    texts = []
    for name, workers in (("per_worker", Workers(_PerWorker(built.objective), built.shards, sc.training.batch_size,
                                                 sc.seed)),
                          ("batched", built.workers)):
        rows = []
        for spec in built.specs:
            rows += run_algorithm(spec, workers, T=sc.training.iterations, lr=built.lr, x0=built.x0,
                                  network=built.network, compute=built.compute, eval_every=sc.training.eval_every)
        write_metrics(tmp_path / f"{name}.csv", rows, run_id(sc))
        texts.append((tmp_path / f"{name}.csv").read_bytes())
    assert texts[0] == texts[1]


class _Counting:
    """Wraps an objective and counts its batch_grads / batch_grad calls."""

    def __init__(self, obj):
        self._o, self.n, self.d = obj, obj.n, obj.d
        self.shares_point_work = obj.shares_point_work
        self.batched = self.single = 0

    def batch_grads(self, x, idxs, scratch=None):
        self.batched += 1
        return self._o.batch_grads(x, idxs, scratch)

    def batch_grad(self, x, idx):
        self.single += 1
        return self._o.batch_grad(x, idx)

    def loss_and_grad(self, x, scratch=None):
        return self._o.loss_and_grad(x, scratch)


@pytest.mark.parametrize("driver", ["simpy", "lockstep"])
def test_one_batched_call_per_iteration(driver):
    obj = _Counting(make_objective("double_well", d=400, n=64, seed=0))
    w = Workers(obj, shard_indices(obj.n, 6, seed=0), 2, 0)
    run_algorithm(AlgorithmSpec("gtopk", k=7), w, T=5, lr=lambda t: 0.05, x0=obj._o.x0(0),
                  network=PRESETS["1GbE"], driver=driver)
    assert (obj.batched, obj.single) == (5, 0)


def test_a_replica_with_other_parameters_gets_its_own_gradient():
    obj = make_objective("sines", d=50, n=32, seed=0)
    w = Workers(obj, shard_indices(obj.n, 3, seed=0), 2, 0)
    bg = BatchedGradients(w)
    v = obj.x0(0)
    other = v + 1.0
    g0 = bg.grad_fn(0, 1)(v)
    g1 = bg.grad_fn(1, 1)(other)
    g2 = bg.grad_fn(2, 1)(v.copy())  # equal bits, another array
    assert _bits(g0) == _bits(w.grad_fn(0, 1)(v))
    assert _bits(g1) == _bits(w.grad_fn(1, 1)(other))
    assert _bits(g2) == _bits(w.grad_fn(2, 1)(v))


# ------------------------------------------------------------------------------------------------ float32
SPECS = [AlgorithmSpec("dense"), AlgorithmSpec("dense", collective="recursive_doubling"),
         AlgorithmSpec("topk", k=9), AlgorithmSpec("randk", k=9), AlgorithmSpec("gtopk", k=9),
         AlgorithmSpec("gtopk", k=9, collective="recursive_doubling", mask="reference"),
         AlgorithmSpec("topk", k=9, segments=(100, 200, 100)), AlgorithmSpec("gtopk", k=9, segments=(150, 250))]


@pytest.mark.parametrize("driver", ["simpy", "lockstep"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.label}-{s.collective}")
def test_float32_stays_float32_and_replicas_stay_identical(spec, driver, monkeypatch):
    import sim.engine.cluster as cluster_mod

    obj = make_objective("double_well", d=400, n=64, seed=0).astype("float32")
    x0 = obj.x0(0)
    assert x0.dtype == np.float32 and obj.G.dtype == np.float32
    P = 5
    w = Workers(obj, shard_indices(obj.n, P, seed=0), 2, 0)
    payload_dtypes = set()
    if driver == "simpy":
        post = cluster_mod.SimCluster._post_send

        def walk(obj):
            if isinstance(obj, np.ndarray):
                if obj.dtype.kind == "f":
                    payload_dtypes.add(obj.dtype)
            elif isinstance(obj, (tuple, list)):
                for part in obj:
                    walk(part)
            elif isinstance(obj, dict):
                for part in obj.values():
                    walk(part)
            elif hasattr(obj, "val"):  # a Sparse selection
                walk(obj.val)

        def recording(self, src, dst, payload, nbytes):
            walk(payload)
            return post(self, src, dst, payload, nbytes)

        monkeypatch.setattr(cluster_mod.SimCluster, "_post_send", recording)
    seen = []

    def on_step(t, outs):
        for o in outs:
            for arr in (o.v, o.residual, o.acc, o.grad, o.update):
                assert arr.dtype == np.float32, (t, arr.dtype)
        v0 = _bits(outs[0].v)
        assert all(_bits(o.v) == v0 and _bits(o.update) == _bits(outs[0].update) for o in outs), t
        seen.append(t)

    rows = run_algorithm(spec, w, T=6, lr=lambda t: 0.05, x0=x0, network=PRESETS["1GbE"], driver=driver,
                         on_step=on_step)
    assert seen == list(range(1, 7)) and all(np.isfinite(r["loss"]) for r in rows)
    assert payload_dtypes <= {np.dtype(np.float32)}
    if driver == "simpy":
        assert payload_dtypes == {np.dtype(np.float32)}


def test_float32_needs_value_bytes_at_most_4():
    obj = make_objective("sines", d=50, n=16, seed=0).astype("float32")
    w = Workers(obj, shard_indices(obj.n, 2, seed=0), 1, 0)
    with pytest.raises(SparsimError, match="value_bytes = 8 with float32"):
        run_algorithm(AlgorithmSpec("topk", k=3, value_bytes=8), w, T=1, lr=lambda t: 0.1, x0=obj.x0(0),
                      driver="lockstep")
    from experiments.scenario import load_scenario

    with pytest.raises(ConfigError, match="value_bytes <= 4"):
        load_scenario(None, ['training.dtype="float32"', "compression.value_bytes=8"])
    with pytest.raises(ConfigError, match="dtype"):
        make_objective("sines", d=5, n=4).astype("float16")


def test_astype_keeps_the_float64_constants_and_shares_nothing_mutable():
    o64 = make_objective("sines", d=80, n=16, seed=0)
    o32 = o64.astype("float32")
    assert o64.astype("float64") is o64 and o32.dtype == np.float32 and o64.dtype == np.float64
    assert o32.constants() == o64.constants()
    assert o64.G.dtype == np.float64 and o32.G.dtype == np.float32
    assert _bits(o32.G) == _bits(o64.G.astype(np.float32))
    x = o64.x0(0)
    assert isinstance(o32.loss(x), float) and o32.full_grad(x).dtype == np.float32


def test_cli_float32_run_and_the_default_run_id(tmp_path):
    from experiments.cli import main
    from experiments.run import run_id
    from experiments.scenario import load_scenario

    out = tmp_path / "f32"
    r = CliRunner().invoke(main, ["run", "--out", str(out), "--quiet", "--set", "training.iterations=6",
                                  "--set", 'training.dtype="float32"'])
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert len(rows) == 3 * 7 and all(np.isfinite(float(x["loss"])) for x in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scenario"]["training"]["dtype"] == "float32"
    # the id hashes the keys the run uses; keys left at their defaults that were added later (dtype, momentum,
    # weight_decay, [algorithm]) do not enter it: the default scenario keeps the id earlier versions wrote
    sc = load_scenario(None)
    old = "1e45cf0a66e67687"
    assert run_id(sc) == old != run_id(load_scenario(None, ['training.dtype="float32"']))
