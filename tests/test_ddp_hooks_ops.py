"""The torch operations of the asynchronous DDP hook equal the sans-I/O definitions bit for bit (float64 and
float32), without processes: the merge (:func:`sim.comm.compression.merge`), the gTop-k collectives replayed
locally (:func:`sim.comm.collectives.gtopk_tree` / :func:`~sim.comm.collectives.gtopk_rd` under the lock-step driver:
g on every rank and every rank's mask, both mask rules), the selection (:func:`sim.comm.compression.topk`), the
state's options and errors, its schedules and its pickling. Inputs have ties and cancellations on purpose."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]' (torch==2.13.0)")

from sim.comm.collectives import gtopk_rd, gtopk_tree, topk_allgather_sum  # noqa: E402
from sim.comm.compression import Sparse, merge, topk  # noqa: E402
from sim.distributed.ddp_hooks import (SparseHookState, SparseState, dgc_warmup, gtopk_replay, merge_torch,  # noqa: E402
                           register_hook_algorithm, select_topk)
from sim.engine.drivers import run_lockstep  # noqa: E402
from sim.base.errors import ConfigError  # noqa: E402


def _sparse(rng, d, m, dtype, ties):
    idx = np.sort(rng.choice(d, size=m, replace=False)).astype(np.int64)
    if ties:  # few distinct magnitudes and both signs: ties and exact cancellations in the sums
        val = rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], size=m).astype(dtype)
    else:
        val = rng.standard_normal(m).astype(dtype)
    return Sparse(idx, val, d)


def _t(s: Sparse):
    return torch.from_numpy(s.idx.copy()), torch.from_numpy(s.val.copy())


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_merge_torch_is_merge(dtype):
    rng = np.random.default_rng(0)
    for trial in range(300):
        d = int(rng.integers(1, 60))
        a = _sparse(rng, d, int(rng.integers(0, d + 1)), dtype, ties=trial % 2 == 0)
        b = _sparse(rng, d, int(rng.integers(0, d + 1)), dtype, ties=trial % 2 == 0)
        k = int(rng.integers(1, d + 1))
        want = merge(a, b, k)
        gi, gv = merge_torch(_t(a), _t(b), k)
        assert np.array_equal(gi.numpy(), want.idx) and gv.numpy().tobytes() == want.val.tobytes(), trial


@pytest.mark.parametrize("collective", ["tree", "recursive_doubling"])
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("impl", ["numpy", "torch"])
def test_gtopk_replay_is_the_collective(collective, exact, impl):
    rng = np.random.default_rng(1)
    coll = gtopk_tree if collective == "tree" else gtopk_rd
    for trial in range(60):
        P = int(rng.integers(1, 10))
        d = int(rng.integers(1, 80))
        k = int(rng.integers(1, d + 1))
        sels = []
        for _ in range(P):
            x = rng.choice([-2.0, -1.0, 1.0, 2.0, 3.0], size=d) if trial % 2 else rng.standard_normal(d)
            x[rng.random(d) < 0.2] = 0.0
            sels.append(topk(x, k))
        ref = run_lockstep([coll(r, P, sels[r], k, exact=exact) for r in range(P)])
        tsels = [_t(s) for s in sels]
        for r in range(P):
            gi, gv, applied = gtopk_replay(tsels, k, r, collective, exact, impl=impl)
            assert np.array_equal(gi.numpy(), ref[r].g.idx), (trial, P, r)
            assert gv.numpy().tobytes() == ref[r].g.val.tobytes(), (trial, P, r)
            assert np.array_equal(applied.numpy(), ref[r].applied), (trial, P, r, collective, exact)


def test_allgather_sum_in_rank_order_is_topk_allgather_sum():
    """The hook's sum (:func:`sim.distributed.ddp_hooks._combine_into`: each rank's row added in rank order, padding slots
    (0, +0.0), the division on the union or, when the rows are dense enough, on the whole buffer) equals
    topk_allgather_sum / P bit for bit; also with the torch operations the GPU runs (index_add_, division on
    the union)."""
    from types import SimpleNamespace

    from sim.distributed.ddp_hooks import _combine_into, _divide

    state = SimpleNamespace(spec=SimpleNamespace(combine="sum"))
    rng = np.random.default_rng(2)
    for trial in range(200):
        P = int(rng.integers(1, 7))
        d = int(rng.integers(1, 50)) if trial % 2 else int(rng.integers(100, 5000))
        k = int(rng.integers(1, d + 1)) if trial % 4 < 2 else int(rng.integers(1, max(2, d // (64 * P))))
        dtype = np.float64 if trial % 3 else np.float32
        sels = [topk((rng.choice([-1.0, 1.0, 0.5, 0.0], size=d) if trial % 2 else rng.standard_normal(d)
                      ).astype(dtype), k) for _ in range(P)]
        want = run_lockstep([topk_allgather_sum(r, P, sels[r], 8, 8) for r in range(P)])[0] / dtype(P)
        assert want.dtype == dtype
        rows = []
        for s in sels:
            vals, idx = torch.zeros(k, dtype=torch.from_numpy(want).dtype), torch.zeros(k, dtype=torch.int64)
            vals[:len(s)], idx[:len(s)] = torch.from_numpy(s.val), torch.from_numpy(s.idx)
            rows.append((vals, idx))
        out = torch.zeros(d, dtype=vals.dtype)
        _combine_into(state, out, [], rows, P, 0)
        assert out.numpy().tobytes() == want.tobytes(), trial
        ref = torch.zeros(d, dtype=vals.dtype)  # the torch operations of the device path
        for vals, idx in rows:
            ref.index_add_(0, idx, vals)
        u = torch.cat([i for _, i in rows])
        ref[u] = _divide(ref[u], P)
        assert ref.numpy().tobytes() == want.tobytes(), trial


def test_select_topk_is_topk_and_topk_torch():
    from sim.comm.torch_kernels import topk_torch

    rng = np.random.default_rng(3)
    for dtype in (np.float64, np.float32):
        for d, k in ((1, 1), (50, 7), (40_000, 400), (70_000, 700)):  # the last two: numba's path when installed
            x = rng.standard_normal(d).astype(dtype)
            x[::5] = 0.0
            x[1::7] = x[-1]  # ties
            want = topk(x, k)
            gi, gv = select_topk(torch.from_numpy(x), k)
            ti, tv = topk_torch(torch.from_numpy(x), k)
            assert np.array_equal(gi.numpy(), want.idx) and np.array_equal(gv.numpy(), want.val)
            assert np.array_equal(ti.numpy(), want.idx) and np.array_equal(tv.numpy(), want.val)


def test_state_options_and_one_line_errors():
    cases = [
        (dict(algorithm="foo"), "algorithm = 'foo' is not a sparse hook: valid cltk, dense, dgc, gaussiank, gtopk,"),
        (dict(algorithm="powersgd", wire="allgather"), "wire = 'allgather' for the powersgd hook: valid wire = 'p2p'"),
        (dict(algorithm="powersgd", options={"rank": 0}), "rank = 0 is out of range"),
        (dict(algorithm="powersgd", options={"ranks": 2}), "option 'ranks' is unknown for powersgd: valid"),
        (dict(algorithm="oktopk", scope="model", options={"tau": 0}), "tau = 0 is out of range"),
        (dict(algorithm="topk", options={"rank": 2}), "valid options only with wire = 'p2p'"),
        (dict(algorithm="dgc", scope="parameter"), "dgc with wire = 'p2p' and scope = 'parameter'"),
        (dict(density=0.0), "density = 0.0 is out of range: valid 0 < density <= 1"),
        (dict(density=1.5), "density = 1.5 is out of range: valid 0 < density <= 1"),
        (dict(scope="layer"), "scope = 'layer' is unknown: valid parameter, bucket, model"),
        (dict(wire="ring"), "wire = 'ring' is unknown: valid allgather, p2p"),
        (dict(start_iter=-1), "start_iter = -1 is out of range: valid an integer >= 0"),
        (dict(density_schedule=[0.1, 0.25]), "is not decreasing"),
        (dict(density=0.5, density_schedule=[0.25]), "is not decreasing"),
        (dict(density_schedule=[2.0]), "density_schedule[0] = 2.0 is out of range: valid 0 < density_schedule[0] <= 1"),
        (dict(collective="ring"), "collective = 'ring' is not available for the gtopk hook: valid tree, recursive_doubling"),
        (dict(algorithm="topk", collective="tree"), "valid allgather"),
        (dict(k=0), "k = 0 is out of range: valid 1 <= k"),
        (dict(k=3, density_schedule=[0.5]), "valid one of them"),
        (dict(mask="none"), "mask = 'none' is unknown: valid exact, reference"),
        (dict(lr=0), "lr = 0 is out of range: valid 0 < lr"),
        (dict(algorithm="randk", wire="p2p"), "valid scope = 'model'"),
    ]
    for kwargs, text in cases:
        with pytest.raises(ConfigError) as err:
            SparseState(**kwargs)
        msg = str(err.value)
        assert text in msg and "\n" not in msg, (kwargs, msg)
    st = SparseState(density=0.001, start_iter=2, density_schedule=dgc_warmup(0.001), schedule_iters=3)
    assert st.density_schedule == (0.25, 0.0625, 0.015625, 0.00390625)
    assert [st.density_at(t) for t in range(2, 16)] == [0.25] * 3 + [0.0625] * 3 + [0.015625] * 3 + \
        [0.00390625] * 3 + [0.001] * 2
    assert st.k_for(10_000, iteration=2) == 2500 and st.k_for(10_000, iteration=40) == 10 and st.k_for(7, 40) == 1
    # every registered algorithm is a hook: the ones without the asynchronous path default to the p2p wire
    assert (SparseState(algorithm="powersgd").wire, SparseState(algorithm="topk").wire) == ("p2p", "allgather")
    assert SparseState(algorithm="powersgd", options={"rank": 4}).options == {"rank": 4}
    assert SparseState(algorithm="oktopk", scope="model").collective == "split_reduce_allgatherv"
    assert SparseState(k=50).k_for(25) == 25 and SparseState(density=0.1).k_for(25) == 2  # round half to even
    assert dgc_warmup(0.01, 4) == (0.25, 0.0625, 0.015625)
    # the previous version's state: per-bucket selection, synchronous point-to-point wire
    old = SparseHookState("topk", k=3)
    assert (old.scope, old.wire, old.algorithm, old.k) == ("bucket", "p2p", "topk", 3)
    with pytest.raises(ConfigError, match="state_dict of an unbound SparseState"):
        SparseState().state_dict()
    with pytest.raises(ConfigError, match="is not a sparse-hook state"):
        SparseState().load_state_dict({"format": "x"})


def test_state_pickles_and_plugins_register():
    st = SparseState(algorithm="topk", density=0.05, scope="bucket")
    st.residuals["w"] = torch.arange(4.0)
    st.iteration = 7
    back = pickle.loads(pickle.dumps(st))
    assert back.iteration == 7 and back.scope == "bucket" and torch.equal(back.residuals["w"], torch.arange(4.0))
    assert back.process_group is None

    def threshold(acc, k, state):  # a plug-in: every entry of magnitude >= 1 (at most k of them)
        idx = (acc.abs() >= 1).nonzero().flatten()[:k]
        return idx, acc[idx]

    register_hook_algorithm("threshold1", threshold)
    try:
        assert SparseState(algorithm="threshold1").collective == "allgather"
    finally:
        from sim.distributed.ddp_hooks import HOOK_ALGORITHMS

        del HOOK_ALGORITHMS["threshold1"]
    with pytest.raises(ConfigError, match="combine = 'mean' is unknown"):
        register_hook_algorithm("x", threshold, combine="mean")


def gpu_job(ctx):
    """P = 1 on NCCL: a bfloat16 MLP on the GPU trained by DDP with the gTop-k hook (selection on the device)."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from sim.workloads.data import load_dataset
    from sim.distributed.ddp_hooks import register_sparse_hook
    from sim.workloads.torch_models import mlp

    ds = load_dataset("digits")
    X, y = torch.as_tensor(ds.X, dtype=torch.bfloat16, device="cuda"), torch.as_tensor(ds.y, device="cuda")
    model = mlp(64, 64, 10, seed=0, dtype=torch.bfloat16).cuda()
    ddp = DDP(copy.deepcopy(model), device_ids=[0])
    state = register_sparse_hook(ddp, "gtopk", density=0.1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2)

    def loss():
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(ddp.module(X).float(), y))

    before = loss()
    for t in range(40):
        idx = torch.randint(0, len(ds.y), (32,), device="cuda")
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(X[idx]), y[idx]).backward()
        opt.step()
    return before, loss(), sorted({str(r.device.type) + str(r.dtype) for r in state.residuals.values()})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible: the hook's device path needs one")
def test_gpu_selection_merges_and_nccl_training():
    """On the GPU: the selection, merges and gTop-k replays equal the CPU's bit for bit (float64), and a
    bfloat16 model trains through DDP on NCCL with float32 residuals on the device."""
    from sim.distributed.backend import launch_local

    rng = np.random.default_rng(5)
    for trial in range(20):
        P, d = int(rng.integers(1, 6)), int(rng.integers(10, 3000))
        k = int(rng.integers(1, d + 1))
        xs = [torch.from_numpy(rng.choice([-1.0, 1.0, 2.0, 0.0], size=d) if trial % 2 else rng.standard_normal(d))
              for _ in range(P)]
        cpu = [select_topk(x, k) for x in xs]
        gpu = [select_topk(x.cuda(), k) for x in xs]
        for (ci, cv), (gi, gv) in zip(cpu, gpu):
            assert torch.equal(ci, gi.cpu()) and torch.equal(cv, gv.cpu())
        for r in range(P):
            for coll in ("tree", "recursive_doubling"):
                a = gtopk_replay(cpu, k, r, coll, True)
                b = gtopk_replay(gpu, k, r, coll, True)
                assert all(torch.equal(u, v.cpu()) for u, v in zip(a, b)), (trial, r, coll)
    before, after, res = launch_local(1, gpu_job, (), timeout_s=60.0, backend="nccl")[0]
    assert after < 0.7 * before and res == ["cudatorch.float32"]


@pytest.mark.parametrize("collective", ["tree", "recursive_doubling"])
@pytest.mark.parametrize("mask", ["exact", "reference"])
def test_gtopk_combine_of_all_units_at_once_is_per_unit(collective, mask):
    """The CPU gTop-k completion of a bucket of several parameters merges all of them at once
    (:func:`sim.distributed.ddp_hooks._merge_units`): g / P, the residuals and the applied count equal, bit for bit, those of
    each unit replayed alone (:func:`gtopk_replay` on the unit's selections, the collectives' result)."""
    from types import SimpleNamespace

    from sim.distributed.ddp_hooks import _combine_into

    state = SimpleNamespace(spec=SimpleNamespace(combine="gtopk"), mask=mask, collective=collective)
    rng = np.random.default_rng(6)
    for trial in range(40):
        P, dtype = int(rng.integers(1, 8)), (np.float64, np.float32)[trial % 2]
        sizes = [int(n) for n in rng.integers(1, 60, size=int(rng.integers(2, 6)))]
        offs = np.concatenate(([0], np.cumsum(sizes)))
        ks = [int(rng.integers(1, n + 1)) for n in sizes]
        slots = np.concatenate(([0], np.cumsum(ks)))
        accs = [[(rng.choice([-2.0, -1.0, 1.0, 2.0, 3.0], size=n) if trial % 3 else rng.standard_normal(n))
                 .astype(dtype) * (rng.random(n) > 0.2) for n in sizes] for _ in range(P)]
        rows = []
        for q in range(P):
            vals, idx = np.zeros(slots[-1], dtype=dtype), np.zeros(slots[-1], dtype=np.int32)
            for u, n in enumerate(sizes):
                s = topk(accs[q][u], ks[u])
                vals[slots[u]:slots[u] + len(s)], idx[slots[u]:slots[u] + len(s)] = s.val, s.idx + offs[u]
            rows.append((torch.from_numpy(vals), torch.from_numpy(idx).long()))
        for r in range(P):
            def units():
                out = []
                for u, n in enumerate(sizes):
                    s = topk(accs[r][u], ks[u])
                    out.append((int(offs[u]), n, ks[u], int(slots[u]), torch.from_numpy(accs[r][u].copy()),
                                (torch.from_numpy(s.idx), torch.from_numpy(s.val))))
                return out
            together, alone = units(), units()
            out_t = torch.zeros(int(offs[-1]), dtype=torch.from_numpy(accs[0][0]).dtype)
            out_a = out_t.clone()
            _, applied_t = _combine_into(state, out_t, together, rows, P, r)
            applied_a = sum(_combine_into(state, out_a, [u], rows, P, r)[1] for u in alone)
            assert out_t.numpy().tobytes() == out_a.numpy().tobytes(), (trial, r)
            assert applied_t == applied_a, (trial, r)
            for a, b in zip(together, alone):
                assert a[4].numpy().tobytes() == b[4].numpy().tobytes(), (trial, r)


def test_algorithm_state_checkpoints_as_plain_types(tmp_path):
    """The p2p wire's algorithm state (PowerSGD's RandomState and Q list, Ok-Topk's float thresholds and int64
    bounds, numpy scalars) round-trips through torch.save / torch.load(weights_only=True): same types, dtypes,
    values and generator stream; another type is one clear error."""
    from sim.distributed.ddp_hooks import _from_plain, _to_plain
    from sim.base.errors import SparsimError

    rs = np.random.RandomState(7)
    rs.standard_normal(3)
    state = {("w", "b"): {"powersgd": {"rng": rs, "q": {0: [np.arange(6.0).reshape(2, 3)]}},
                          "oktopk": {0: {"local_th": 0.25, "bounds": np.array([0, 4, 9]), "th": np.float32(1.5)}}}}
    torch.save(_to_plain(state), tmp_path / "s.pt")
    back = _from_plain(torch.load(tmp_path / "s.pt", weights_only=True))
    got = back[("w", "b")]
    assert np.array_equal(got["powersgd"]["q"][0][0], np.arange(6.0).reshape(2, 3))
    assert got["oktopk"][0]["bounds"].dtype == np.int64 and got["oktopk"][0]["local_th"] == 0.25
    th = got["oktopk"][0]["th"]
    assert type(th) is np.float32 and th == np.float32(1.5)
    assert np.array_equal(got["powersgd"]["rng"].standard_normal(4), rs.standard_normal(4))
    with pytest.raises(SparsimError, match="algorithm state of type object cannot be checkpointed"):
        _to_plain({"x": object()})
