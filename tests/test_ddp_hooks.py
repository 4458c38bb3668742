"""DDP communication hooks: Top-k / gTop-k with error feedback give the backend's trajectory.

A softmax-regression model (one weight tensor, one DDP bucket) trained on digits by DDP with
:func:`sim.ddp_hooks.register_sparse_hook` (hook lr = alpha, SGD(lr=1.0)) follows bit-for-bit in
float64 the trajectory of :func:`sim.torch_backend.run_worker` on the same data, seeds and P, and the
simulator's (lock-step driver). Every launch has a 60 s timeout.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]' (torch==2.13.0)")

from sim.algorithms import AlgorithmSpec  # noqa: E402
from sim.data import load_dataset, shard_indices  # noqa: E402
from sim.errors import ConfigError  # noqa: E402
from sim.runner import run_algorithm  # noqa: E402
from sim.torch_backend import launch_local  # noqa: E402

T, LR, K = 5, 0.5, 40


def _setup(P):
    from sim.torch_models import ModuleWorkers

    ds = load_dataset("digits")
    X, y = ds.X[:400], ds.y[:400]
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(64, 10, bias=False, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(0.1 * torch.randn(model.weight.shape, generator=g, dtype=torch.float64))
    w = ModuleWorkers(model, X, y, shard_indices(len(y), P, seed=0), 8, seed=0)
    return model, w


def _spec(name, coll, mask):
    return AlgorithmSpec(name, k=K, collective=coll, mask=mask, value_bytes=8, index_bytes=8)


CASES = [("topk", None, "exact"), ("gtopk", "tree", "exact"), ("gtopk", "recursive_doubling", "reference")]


def ddp_job(ctx, P):
    """Per-rank body: for each case, train with DDP + hook, then with run_worker; return both trajectories."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from sim.ddp_hooks import register_sparse_hook
    from sim.torch_backend import run_worker
    from sim.torch_models import flat_params

    out = []
    for name, coll, mask in CASES:
        model, w = _setup(P)
        ddp = DDP(copy.deepcopy(model))
        register_sparse_hook(ddp, name, k=K, collective=coll, mask=mask, lr=LR)
        opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
        Xt, yt = torch.as_tensor(w.X), torch.as_tensor(w.y)
        hook_traj = []
        for t in range(1, T + 1):
            idx = torch.as_tensor(w.batch_indices(ctx.rank, t))
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(Xt[idx]), yt[idx]).backward()
            opt.step()
            hook_traj.append(flat_params(ddp.module))
        r = run_worker(ctx.rank, ctx.P, _spec(name, coll, mask), w, T=T, lr=lambda t: LR, x0=flat_params(model),
                       transport=ctx.transport, keep_trajectory=True, eval_every=T)
        out.append((hook_traj, r.trajectory))
    return out


@pytest.mark.parametrize("P", [2, 3])
def test_hook_trained_model_equals_backend_and_simulator(P):
    got = launch_local(P, ddp_job, (P,), timeout_s=60.0)
    for c, (name, coll, mask) in enumerate(CASES):
        model, w = _setup(P)
        from sim.torch_models import flat_params

        ref = []
        run_algorithm(_spec(name, coll, mask), w, T=T, lr=lambda t: LR, x0=flat_params(model), driver="lockstep",
                      eval_every=T, on_step=lambda t, outs: ref.append(outs[0].v.copy()))
        for r in range(P):
            hook, backend = got[r][c]
            for t in range(T):
                assert np.array_equal(hook[t], backend[t]), f"{name} P={P} rank {r} iteration {t + 1}: hook != backend"
                assert np.array_equal(backend[t], ref[t]), f"{name} P={P} rank {r} iteration {t + 1}: backend != sim"
        assert not np.array_equal(got[0][c][0][-1], flat_params(model))  # it trained


def test_hook_state_rejects_bad_options():
    from sim.ddp_hooks import SparseHookState

    with pytest.raises(ConfigError, match="not a sparse hook"):
        SparseHookState(algorithm="dense")
    with pytest.raises(ConfigError):
        SparseHookState(collective="ring")
    assert SparseHookState(density=0.1).k_for(25) == 2 and SparseHookState(k=50).k_for(25) == 25


# ------------------------------------------------------------------------------------------ several buckets

MB_K, MB_T = 7, 4


def _mlp_setup(P):
    from sim.torch_models import ModuleWorkers, mlp

    ds = load_dataset("digits")
    X, y = ds.X[:300], ds.y[:300]
    model = mlp(64, 12, 10, seed=1)  # four parameters (W1, b1, W2, b2), float64
    return model, ModuleWorkers(model, X, y, shard_indices(len(y), P, seed=0), 8, seed=0)


def multibucket_job(ctx, P):
    """Per-rank body: DDP with tiny buckets (one or two parameters each) and the Top-k hook; returns the
    parameters after each step and, per step, the buckets the hook saw (parameter positions, in order)."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from sim.ddp_hooks import SparseHookState, sparse_hook
    from sim.torch_models import flat_params

    model, w = _mlp_setup(P)
    ddp = DDP(copy.deepcopy(model), bucket_cap_mb=1e-4)
    pos = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    state = SparseHookState(algorithm="topk", k=MB_K, lr=LR)
    layouts = []

    def recording_hook(st, bucket):
        layouts[-1].append([pos[id(p)] for p in bucket.parameters()])
        return sparse_hook(st, bucket)

    ddp.register_comm_hook(state, recording_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
    Xt, yt = torch.as_tensor(w.X), torch.as_tensor(w.y)
    traj = []
    for t in range(1, MB_T + 1):
        layouts.append([])
        idx = torch.as_tensor(w.batch_indices(ctx.rank, t))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(Xt[idx]), yt[idx]).backward()
        opt.step()
        traj.append(flat_params(ddp.module))
    return traj, layouts


def _layerwise_topk_reference(P, layouts):
    """Per-bucket Top-k S-SGD with error feedback, written out in numpy: residuals per parameter, k per
    bucket, the P selections summed, parameters moved by -sum / P."""
    from sim.compression import topk
    from sim.torch_models import flat_params, set_flat_params

    model, w = _mlp_setup(P)
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    offs = np.concatenate([[0], np.cumsum(sizes)])
    v = flat_params(model)
    eps = [np.zeros(v.shape[0]) for _ in range(P)]
    traj = []
    for t in range(1, MB_T + 1):
        grads = []
        for r in range(P):
            set_flat_params(model, v)
            model.zero_grad()
            idx = torch.as_tensor(w.batch_indices(r, t))
            torch.nn.functional.cross_entropy(model(torch.as_tensor(w.X)[idx]), torch.as_tensor(w.y)[idx]).backward()
            grads.append(np.concatenate([p.grad.numpy().ravel() for p in params]))
        step = np.zeros_like(v)
        for bucket in layouts[t - 1]:
            sl = np.concatenate([np.arange(offs[i], offs[i + 1]) for i in bucket])
            total = np.zeros(sl.shape[0])
            for r in range(P):
                acc = eps[r][sl] + LR * grads[r][sl]
                sel = topk(acc, min(MB_K, sl.shape[0])).to_dense()
                total += sel
                eps[r][sl] = acc - sel
            step[sl] = total / P
        v = v - step
        traj.append(v.copy())
    return traj


@pytest.mark.parametrize("P", [2, 3])
def test_hook_with_several_buckets_is_layerwise_topk(P):
    got = launch_local(P, multibucket_job, (P,), timeout_s=60.0)
    traj0, layouts = got[0]
    # DDP rebuilds its buckets after the first step (here from one bucket to two): residuals kept per
    # parameter must follow the parameters into their new buckets
    assert len(layouts[0]) != len(layouts[-1]) and all(len(step) >= 2 for step in layouts[1:]), layouts
    for step in layouts:
        assert sorted(i for b in step for i in b) == [0, 1, 2, 3]  # each parameter in exactly one bucket
    ref = _layerwise_topk_reference(P, layouts)
    for r in range(P):
        assert got[r][1] == layouts  # every rank saw the same buckets
        for t in range(MB_T):
            assert np.array_equal(got[r][0][t], traj0[t])  # ranks agree bit for bit
            np.testing.assert_allclose(got[r][0][t], ref[t], rtol=1e-12, atol=1e-14)
