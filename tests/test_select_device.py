"""Top-k selection on a torch device (issue #12 item 1): ``sim.comm.compression.selection_device`` and the torch
backend's ``torch.select_device``.

On a machine without a GPU the device path is exercised with torch on the CPU, which runs the same code
(``topk_torch`` on a tensor, indices back to numpy, values read from the host vector): the selection must equal
``topk``'s bit for bit on adversarial and generated inputs, a whole torch-backend run with it must write the
same rows, and the routing (which vectors go to the device, restoring the setting) is checked by counting
calls. The CUDA tests at the end run only where a GPU is visible.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sim.comm.compression as C
from sim.comm.compression import selection_device, topk
from sim.base.errors import ConfigError, NonFiniteError

torch = pytest.importorskip("torch")

from test_topk_fast import ADVERSARIAL, DTYPES, _adversarial  # noqa: E402

D = C._DEVICE_MIN_D + 3  # the smallest vectors that go to the device, plus an odd tail


def _same(a, b):
    np.testing.assert_array_equal(a.idx, b.idx)
    assert a.idx.dtype == b.idx.dtype == np.int64
    assert a.val.dtype == b.val.dtype and a.val.tobytes() == b.val.tobytes()
    assert a.d == b.d


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("name", ADVERSARIAL + ["normal"])
def test_device_selection_equals_topk_on_adversarial_inputs(name, dt):
    for d, k in ((D, 1), (D, 37), (D, 3000), (70_001, 700)):
        x = np.random.default_rng(1).standard_normal(d).astype(dt) if name == "normal" else _adversarial(name, d, k, dt)
        want = topk(x, k)
        with selection_device("cpu"):
            got = topk(x, k)
        _same(got, want)


@settings(max_examples=25, deadline=None)
@given(pattern=st.lists(st.sampled_from([0.0, 1.0, -1.0, 2.5, -2.5, 1e-310, 3.0]), min_size=1, max_size=40),
       k=st.integers(1, 5000), f32=st.booleans())
def test_device_selection_equals_topk_with_many_ties(pattern, k, f32):
    """A short pattern tiled over d >= 2^15 entries: thousands of exact ties, zeros and subnormals."""
    dt = np.float32 if f32 else np.float64
    x = np.resize(np.array(pattern, dtype=dt), D)
    want = topk(x, k)
    with selection_device("cpu"):
        _same(topk(x, k), want)


def test_routing_only_large_vectors_and_the_setting_is_restored(monkeypatch):
    import sim.comm.torch_kernels as TB

    calls = []
    real = TB.topk_torch

    def counting(xt, k):
        calls.append((tuple(xt.shape), str(xt.device)))
        return real(xt, k)

    monkeypatch.setattr(TB, "topk_torch", counting)
    big = np.random.default_rng(2).standard_normal(D)
    small = big[: C._DEVICE_MIN_D - 1]
    topk(big, 10)
    assert calls == []  # off by default
    with selection_device("cpu"):
        topk(big, 10)
        topk(small, 10)  # below 2^15: stays in numpy
        assert C._SELECT_DEVICE == "cpu"
    assert calls == [((D,), "cpu")]
    with pytest.raises(RuntimeError):
        with selection_device("cpu"):
            raise RuntimeError("boom")
    assert C._SELECT_DEVICE is None
    with selection_device("cpu"), selection_device(None):  # an inner None turns it off
        topk(big, 10)
    assert len(calls) == 1


def test_device_selection_rejects_nan_with_the_same_message():
    x = np.random.default_rng(3).standard_normal(D)
    x[12345] = np.nan
    with pytest.raises(NonFiniteError) as host:
        topk(x, 100)
    with selection_device("cpu"), pytest.raises(NonFiniteError) as dev:
        topk(x, 100)
    assert str(dev.value) == str(host.value) and "coordinate 12345 " in str(host.value)


def test_resolve_select_device():
    from sim.distributed.backend import resolve_select_device

    assert resolve_select_device("cpu", 3) is None
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        assert resolve_select_device("auto", 0) is None
        with pytest.raises(ConfigError, match="torch.select_device = 'cuda' needs a CUDA GPU"):
            resolve_select_device("cuda", 0)
    else:
        assert resolve_select_device("auto", n + 1) == f"cuda:{1 % n}"
    with pytest.raises(ConfigError, match="valid auto, cpu, cuda"):
        resolve_select_device("tpu")


def _numbers(rows):
    """The rows without the measured wall times (the *_s columns and overlap_ratio, which derive from them)."""
    return [{k: v for k, v in r.items() if not k.endswith("_s") and k != "overlap_ratio"} for r in rows]


def _run(select_device, algo):
    from sim.algorithms import AlgorithmSpec
    from sim.workloads.objectives import make_objective
    from sim.workloads.data import shard_indices
    from sim.engine.runner import Workers
    from sim.distributed.backend import run_worker

    obj = make_objective("double_well", d=D, n=64, seed=5)
    w = Workers(obj, shard_indices(obj.n, 1, seed=5), 4, 5)
    spec = AlgorithmSpec(algo, k=300)
    return run_worker(0, 1, spec, w, T=4, lr=lambda t: 0.05, x0=obj.x0(5), transport=None,
                      keep_trajectory=True, select_device=select_device)


@pytest.mark.parametrize("algo", ["topk", "gtopk"])
def test_torch_backend_rank_with_device_selection_writes_the_same_rows(algo, monkeypatch):
    import sim.comm.torch_kernels as TB

    calls = []
    real = TB.topk_torch
    monkeypatch.setattr(TB, "topk_torch", lambda xt, k: calls.append(1) or real(xt, k))
    want = _run(None, algo)
    assert calls == []
    got = _run("cpu", algo)
    assert len(calls) == 4  # one selection per iteration on this single rank
    assert _numbers(got.rows) == _numbers(want.rows)
    for a, b in zip(got.trajectory, want.trajectory):
        assert a.tobytes() == b.tobytes()


def test_select_device_scenario_key(tmp_path):
    from click.testing import CliRunner

    from experiments.cli import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: 'cuda' is valid here")
    r = CliRunner().invoke(main, ["run", "--backend", "torch", "--out", str(tmp_path / "r"),
                                  "--set", "torch.select_device=cuda", "--set", "training.iterations=2"])
    assert r.exit_code == 2, r.output
    assert "torch.select_device = 'cuda' needs a CUDA GPU" in r.output
    assert not (tmp_path / "r").exists() and not (tmp_path / "r.partial").exists()
    r = CliRunner().invoke(main, ["run", "--out", str(tmp_path / "s"), "--set", "torch.select_device=tpu"])
    assert r.exit_code == 2 and "select_device" in r.output


def _n_gpu() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_n_gpu() < 1, reason="no CUDA GPU visible: the GPU selection runs only on a GPU machine")
@pytest.mark.parametrize("dt", DTYPES)
def test_gpu_selection_through_topk_equals_the_cpu_one(dt):
    for name in ADVERSARIAL + ["normal"]:
        for d, k in ((D, 37), (1_000_003, 1000), (1_000_003, 10_000)):
            x = np.random.default_rng(1).standard_normal(d).astype(dt) if name == "normal" else _adversarial(name, d, k, dt)
            want = topk(x, k)
            with selection_device("cuda"):
                _same(topk(x, k), want)


@pytest.mark.skipif(_n_gpu() < 1, reason="no CUDA GPU visible: the GPU selection runs only on a GPU machine")
@pytest.mark.parametrize("algo", ["topk", "gtopk"])
def test_torch_backend_rank_selecting_on_the_gpu_writes_the_same_rows(algo):
    want = _run(None, algo)
    got = _run("cuda:0", algo)
    assert _numbers(got.rows) == _numbers(want.rows)
