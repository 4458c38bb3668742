"""PowerSGD (sim/algorithms/powersgd.py) against torch's own ``powerSGD_hook``, bit for bit in float64, and the
paper's properties.

The torch side runs in two gloo processes (:func:`sim.distributed.backend.launch_local`) with
ATEN_CPU_CAPABILITY=default, so torch's reductions use the kernels this module reproduces whatever vector unit the
machine has (AVX-512 builds fuse multiply-adds in the rank-1 column norm): a real DistributedDataParallel model
with torch's hook registered (several buckets, several tensors per bucket, several steps, warm start, error
feedback), whose every hook call is recorded, and torch's hook called directly on GradBucket-like buckets of larger
tensors. The simulator side replays the recorded local gradients through our code. Where torch leaves the
arithmetic this module reproduces (MKL's dgemm at 400 multiply-adds and more per product, LAPACK's QR at rank > 2)
the remaining difference is pinned exactly: substituting torch's own product (and orthogonalisation) for ours
makes everything bit-equal again.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.comm import collectives as C
from sim.algorithms import AlgorithmSpec, get
from sim.algorithms import powersgd as ps
from sim.algorithms.base import sgd_step
from sim.engine.drivers import run_lockstep
from sim.base.errors import ConfigError
from sim.machine.network import PRESETS
from sim.engine.timing import closed_form_comm_s, simulate_timing

W = 2  # ranks of the torch runs
SEED = 7
START = 2  # torch's minimum start_powerSGD_iter with error feedback / warm start in DDP
STEPS = 6
TIMEOUT = 60.0


# ------------------------------------------------------------------ options, matrix view, costs

def test_bad_options_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"^powersgd.rank = 0 is out of range: valid 1 <= powersgd.rank$"):
        AlgorithmSpec("powersgd", options=(("rank", 0),))
    for bad in ("yes", 2, 0.5):
        with pytest.raises(ConfigError, match=rf"^powersgd.warm_start = {bad!r} is not a switch: valid on, off, true, "
                                              r"false, 1, 0$"):
            AlgorithmSpec("powersgd", options=(("warm_start", bad),))
    assert AlgorithmSpec("powersgd", options=(("warm_start", 0),)).opt("warm_start") is False
    # every on/off option of the registry takes the same spellings (PowerSGD's bool, DGC's "on" / "off")
    for on, off in ((True, False), (1, 0), ("on", "off"), ("TRUE", "false")):
        assert [AlgorithmSpec("powersgd", options=(("warm_start", v),)).opt("warm_start") for v in (on, off)] == \
            [True, False]
        assert [AlgorithmSpec("dgc", k=1, options=(("nesterov", v),)).opt("nesterov") for v in (on, off)] == \
            ["on", "off"]
    for key, bad in (("start_iter", -1), ("matrix_rows", -2), ("orthogonalization_epsilon", -1e-8),
                     ("min_compression_rate", -1.0), ("rank", 1.5)):
        with pytest.raises(ConfigError, match=f"powersgd.{key} = "):
            AlgorithmSpec("powersgd", options=((key, bad),))
    spec = AlgorithmSpec("powersgd", options=(("rank", 4), ("warm_start", False)))
    assert spec.opt("rank") == 4 and spec.opt("warm_start") is False and spec.opt("start_iter") == 0
    assert spec.label == "powersgd[r4]" and AlgorithmSpec("powersgd").label == "powersgd"


def test_matrix_view_and_plans():
    assert ps.matrix_shape(24) == (4, 6) and ps.matrix_shape(10_000) == (100, 100)  # exact near-square divisors
    assert ps.matrix_shape(10_007) == (101, 100)  # prime: ceil(sqrt(n)) rows, 93 zeros of padding
    assert ps.matrix_shape(25_557_032) == (5056, 5055)  # 8 x 3,194,629 is too thin: padded instead
    assert ps.matrix_shape(7) == (1, 7) and ps.matrix_shape(12) == (3, 4) and ps.matrix_shape(2 * 4999) == (100, 100)
    assert ps.matrix_shape(10_007, 100) == (100, 101) and ps.matrix_shape(5, 9) == (5, 1)
    # torch's _should_compress at its default rate 2: 1 x n and n x 1 never, 4 x 6 at rank 1 (20 < 24)
    assert ps.segment_plan(24, 1).compressed == (ps.Entry(0, 24, 4, 6, 1),)
    assert ps.segment_plan(24, 2).compressed == () and ps.segment_plan(24, 2, 1.0).compressed != ()
    assert ps.segment_plan(7, 1, 0.1).uncompressed == (ps.Entry(0, 7, 7, 1, 0),)
    assert ps.segment_plan(10_007, 1).compressed == (ps.Entry(0, 10_007, 101, 100, 1),)
    assert ps.segment_plan(10_007, 1, matrix_rows=100).compressed == (ps.Entry(0, 10_007, 100, 101, 1),)
    # a bucket as torch sees it: biases and small tensors uncompressed, the rest grouped by shape
    plan = ps.bucket_plan([(3,), (12, 16), (16,), (16, 12), (12, 16), (4, 2, 3, 3)], 2, 1.0)
    assert [e.offset for e in plan.uncompressed] == [0, 195]
    assert [(e.offset, e.rows, e.cols, e.r) for e in plan.compressed] == [
        (3, 12, 16, 2), (403, 12, 16, 2), (211, 16, 12, 2), (595, 4, 18, 2)]
    with pytest.raises(ConfigError, match="0-d tensor"):
        ps.bucket_plan([()], 1)


@pytest.mark.parametrize("P", [1, 2, 3, 5, 8, 16, 33])
def test_closed_form_equals_timing_and_fast_engine_when_compressed(P):
    """As the registry tests, at d = 10,000 (100 x 100) and at 10,007 padded to 100 x 101 (P and Q sizes that P
    does not divide)."""
    net = PRESETS["1GbE"]
    a, b = net.end_to_end_alpha_beta()
    for coll in ("ring", "recursive_doubling"):
        for d, opts in ((10_000, (("rank", 4),)), (10_007, (("rank", 2), ("matrix_rows", 100)))):
            spec = AlgorithmSpec("powersgd", collective=coll, options=opts)
            msg = simulate_timing(spec, P, d, network=net, engine="message")
            fast = simulate_timing(spec, P, d, network=net, engine="fast")
            cf = closed_form_comm_s(spec, P, d, a, b)
            assert msg.iter_s[0] == pytest.approx(cf, rel=1e-12, abs=1e-15)
            assert fast.iter_s[0] == pytest.approx(msg.iter_s[0], rel=1e-9)
            assert (fast.messages, fast.bytes) == (msg.messages, msg.bytes)
            e = get("powersgd").plan(spec, d).compressed[0]
            if coll == "ring" and P > 1:
                step = lambda n: 2 * (P - 1) * (a + -(-n // P) * 4 * b)  # noqa: E731
                assert cf == pytest.approx(step(e.rows * e.r) + step(e.cols * e.r), rel=1e-12)


def test_timing_only_equals_the_real_exchange_with_compute():
    """Timing-only mode yields the numerics' operations: same simulated time under a compute model."""
    from sim.engine.cluster import SimCluster
    from sim.machine.compute import ComputeModel

    net = PRESETS["1GbE"]
    cm = ComputeModel(forward_backward_s=1e-3)
    d, P = 2_400, 4
    for coll in ("ring", "recursive_doubling"):
        spec = AlgorithmSpec("powersgd", collective=coll, options=(("rank", 3),))
        cl = SimCluster(P, net, cm)
        v, res = np.zeros(d), [np.zeros(d)] * P
        grads = [np.random.default_rng([1, r]).standard_normal(d) for r in range(P)]
        _, fin = cl.run_programs([sgd_step(spec, r, P, v, res[r], (lambda g: lambda _v: g)(grads[r]), 8, 0.1, 1)
                                  for r in range(P)], iteration=1)
        timing = simulate_timing(spec, P, d, network=net, compute=cm, batch_size=8).iter_s[0]
        assert timing == pytest.approx(float(fin.max()), rel=1e-12)


# ------------------------------------------------------------------ torch's arithmetic, reproduced


def test_q_initialisation_is_torch_randn():
    torch = pytest.importorskip("torch")
    for seed in (0, 1, 999_999_999):
        for sizes in ([3], [1, 1, 1], [5, 4], [16], [17], [40, 3, 2], [33, 7, 1]):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                want = [torch.randn(n, dtype=torch.float64).numpy() for n in sizes]
            gen = ps.TorchNormal(seed)
            for n, w in zip(sizes, want):
                assert np.array_equal(gen.randn(n), w), (seed, sizes)


def test_small_products_are_torch_bmm():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    for n, m, r in ((5, 7, 1), (12, 16, 2), (19, 20, 1), (3, 66, 2)):  # n m r < 400: torch's ordered kernel
        A, B = rng.standard_normal((n, m)), rng.standard_normal((m, r))
        want = torch.bmm(torch.from_numpy(A)[None], torch.from_numpy(B)[None])[0].numpy()
        assert np.array_equal(ps.matmul(A, B), want)
        At = rng.standard_normal((m, n))
        assert np.array_equal(ps.matmul(At.T, B), torch.bmm(torch.from_numpy(At)[None].transpose(1, 2),
                                                            torch.from_numpy(B)[None])[0].numpy())


# ------------------------------------------------------------------ the torch runs (2 gloo processes)


def _models():
    import torch.nn as nn

    class Mixed(nn.Module):
        """Conv (4-D weight), biases, an uncompressed small weight, two shapes interleaved (12x16, 16x12, 12x16)."""

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 4, 3)
            self.fc1, self.fc2, self.fc3 = nn.Linear(16, 12), nn.Linear(12, 16), nn.Linear(16, 12)
            self.fc4 = nn.Linear(12, 3)

        def forward(self, x):
            h = self.conv(x).tanh().flatten(1)
            return self.fc4(self.fc3(self.fc2(self.fc1(h).tanh()).tanh()).tanh())

    class Plain(nn.Module):
        """One 2-D weight per bucket, every weight 16 rows: the simulator's segments with matrix_rows = 16."""

        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(12, 16, bias=False)
            self.fc2, self.fc3 = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)

        def forward(self, x):
            return self.fc3(self.fc2(self.fc1(x).tanh()).tanh())

    return Mixed, Plain


class _Bucket:
    """A GradBucket-like bucket for calling torch's hook directly: a flat float64 buffer and its tensors' views."""

    def __init__(self, buf, shapes, index, last):
        self._buf, self._index, self._last = buf, index, last
        self._views, off = [], 0
        for s in shapes:
            n = int(np.prod(s))
            self._views.append(buf[off:off + n].view(s))
            off += n

    def buffer(self):
        return self._buf

    def gradients(self):
        return self._views

    def index(self):
        return self._index

    def is_last(self):
        return self._last


#: the direct calls: buckets of tensors beyond torch's ordered-product regime (n m r >= 400: MKL's dgemm)
LARGE = [[(64, 50), (50,), (32, 3, 5, 5)], [(100, 80), (7, 7), (100, 80)]]


def _recorder(state, log, names=None):
    """torch's hook, recording each call: bucket index, state.iter, shapes, parameter names (``names``: data_ptr
    -> name), the local gradients (before the error is added), the output, the error and the Q memory after."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    def hook(_, bucket):
        views = bucket.gradients()
        base = bucket.buffer().data_ptr()
        offs = [v.data_ptr() - base for v in views]
        assert offs == list(np.cumsum([0] + [8 * v.numel() for v in views])[:-1]), "bucket views not consecutive"
        idx = bucket.index()
        rec = {"index": idx, "iter": state.iter, "shapes": [tuple(v.shape) for v in views],
               "input": bucket.buffer().detach().clone().numpy(),
               "names": [names[q.data_ptr()] for q in bucket.parameters()] if names else None}

        def done(fut):
            out = fut.value()
            rec["output"] = out.detach().clone().numpy()
            rec["error"] = state.error_dict[idx].clone().numpy() if idx in state.error_dict else None
            q = state.q_memory_dict.get(idx)
            rec["q"] = None if q is None else q.clone().numpy()
            log.append(rec)
            return out
        # one bucket at a time: torch's hook issues its allreduces from future callbacks, so two buckets in
        # flight can reach gloo in a different order on each rank (a collective mismatch)
        fut = powerSGD_hook(state, bucket).then(done)
        fut.wait()
        return fut
    return hook


def torch_job(ctx):
    """Per rank: DDP + torch's hook on two models (recorded per call), and direct calls on LARGE buckets."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
    from torch.nn.parallel import DistributedDataParallel as DDP

    assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
    Mixed, Plain = _models()
    logs = {}
    # (name, model, rank, min_compression_rate, bucket cap in doubles, input shape)
    for name, cls, rank, rate, cap, xshape in (("mixed", Mixed, 2, 1.0, 600, (5, 2, 4, 4)),
                                              ("plain", Plain, 1, 2.0, 8, (5, 12))):
        torch.manual_seed(0)
        model = cls().double()
        ddp = DDP(model, bucket_cap_mb=cap * 8 / 2 ** 20)
        state = PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=START,
                              min_compression_rate=rate, random_seed=SEED)
        log = logs[name] = []
        ddp.register_comm_hook(state, _recorder(state, log, {q.data_ptr(): n for n, q in model.named_parameters()}))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(100 + ctx.rank)
        for _ in range(STEPS):
            x = torch.randn(*xshape, generator=gen, dtype=torch.float64)
            loss = (ddp(x) - 0.3).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    for rank in (1, 2, 4):
        state = PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=START, random_seed=SEED)
        log = logs[f"large{rank}"] = []
        hook = _recorder(state, log)
        rng = np.random.default_rng([5, ctx.rank])
        for _ in range(STEPS - 2):
            for b, shapes in enumerate(LARGE):
                buf = torch.from_numpy(rng.standard_normal(sum(int(np.prod(s)) for s in shapes)))
                hook(state, _Bucket(buf, shapes, b, b == len(LARGE) - 1)).wait()
    return logs


@pytest.fixture(scope="module")
def torch_logs():
    pytest.importorskip("torch")
    from sim.distributed.backend import launch_local

    mp = pytest.MonkeyPatch()
    mp.setenv("ATEN_CPU_CAPABILITY", "default")  # the spawned ranks' torch: no AVX-512 FMA in its norms
    try:
        logs = launch_local(W, torch_job, timeout_s=TIMEOUT)
    finally:
        mp.undo()
    for name in logs[0]:
        assert [(r["index"], r["iter"], r["shapes"]) for r in logs[0][name]] == \
               [(r["index"], r["iter"], r["shapes"]) for r in logs[1][name]], name
    return logs


def _replay(logs, name, rank, rate, *, epsilon=0.0):
    """Our bucket exchange on torch's recorded local gradients, in torch's call order, on W lockstep ranks.
    Yields (record per rank, our average, our residual per rank, our Q memory per rank) for each call."""
    mem = [{} for _ in range(W)]
    rngs = [np.random.RandomState(SEED) for _ in range(W)]
    res = [{} for _ in range(W)]
    algo = get("powersgd")
    for recs in zip(*(logs[p][name] for p in range(W))):
        idx, it, shapes = recs[0]["index"], recs[0]["iter"], recs[0]["shapes"]
        accs = [algo.accumulate(None, recs[p]["input"].copy(), 1.0, res[p].get(idx, np.zeros_like(recs[p]["input"])),
                                None) for p in range(W)]
        if it < START:  # torch's plain allreduce phase: our plain allreduce, no error feedback yet
            out = run_lockstep([C.ring_allreduce(p, W, accs[p], 8) for p in range(W)])
            yield recs, [o / W for o in out], [None] * W, [None] * W
            continue
        plan = ps.bucket_plan(shapes, rank, rate)
        out = run_lockstep([ps.powersgd_bucket(p, W, accs[p], plan, mem[p], idx, rngs[p], epsilon=epsilon)
                            for p in range(W)])
        for p in range(W):
            res[p][idx] = accs[p] - out[p][0]
        q = [np.concatenate([m.ravel() for m in mem[p][idx]]) for p in range(W)]
        yield recs, [o[0] for o in out], [res[p][idx] for p in range(W)], q


@pytest.mark.parametrize("name,rank,rate", [("mixed", 2, 1.0), ("plain", 1, 2.0)])
def test_ddp_buckets_equal_torch_bit_for_bit(torch_logs, name, rank, rate):
    calls = compressed = 0
    for recs, avg, res, q in _replay(torch_logs, name, rank, rate):
        calls += 1
        for p in range(W):
            assert np.array_equal(avg[p], recs[p]["output"]), (name, recs[p]["index"], recs[p]["iter"], p)
            if res[p] is None:
                assert recs[p]["error"] is None
                continue
            compressed += 1
            assert np.array_equal(res[p], recs[p]["error"]), (name, recs[p]["index"], recs[p]["iter"], p)
            assert np.array_equal(q[p], recs[p]["q"]), (name, recs[p]["index"], recs[p]["iter"], p)
    assert calls >= 2 * STEPS - 1 and compressed >= (STEPS - START) * 2 * W  # DDP: one bucket in step 0
    if name == "mixed":  # the run really had several tensors per bucket and both kinds of tensors
        shapes = {tuple(map(tuple, r["shapes"])) for r in torch_logs[0][name]}
        assert any(len(s) >= 4 for s in shapes) and len({r["index"] for r in torch_logs[0][name]}) >= 2


def test_the_simulators_segments_equal_torch_bit_for_bit(torch_logs):
    """The registered algorithm itself (sgd_step, segments = the DDP buckets in call order, matrix_rows = 16,
    start_iter = torch's start_powerSGD_iter, lr = 1): its update / W and residuals are torch's hook's. (DDP's
    first step runs one bucket of every parameter before it rebuilds its buckets: that plain-allreduce step is
    mapped onto our layout by parameter name.)"""
    log = [torch_logs[p]["plain"] for p in range(W)]
    steady = [r for r in log[0] if r["iter"] == STEPS - 1]
    layout = [n for r in steady for n in r["names"]]  # one weight per bucket, buckets in call order
    sizes = tuple(r["input"].size for r in steady)
    off = dict(zip(layout, np.cumsum((0,) + sizes)))
    spec = AlgorithmSpec("powersgd", seed=SEED, segments=sizes,
                         options=(("rank", 1), ("start_iter", START), ("matrix_rows", 16)))
    d = sum(sizes)

    def place(recs, key):
        out = np.zeros(d)
        for r in recs:
            i = 0
            for name, shape in zip(r["names"], r["shapes"]):
                n = int(np.prod(shape))
                if r[key] is not None:
                    out[off[name]:off[name] + n] = r[key][i:i + n]
                i += n
        return out

    v = np.zeros(d)
    res = [np.zeros(d) for _ in range(W)]
    states = [None] * W
    for t in range(STEPS):
        recs = [[r for r in log[p] if r["iter"] == t] for p in range(W)]
        grads = [place(recs[p], "input") for p in range(W)]
        outs = run_lockstep([sgd_step(spec, p, W, v, res[p], (lambda g: lambda _v: g)(grads[p]), 1, 1.0, t + 1,
                                      states[p]) for p in range(W)])
        for p in range(W):
            assert np.array_equal(outs[p].update / W, place(recs[p], "output")), (t, p)
            assert np.array_equal(outs[p].residual, place(recs[p], "error")), (t, p)
        res, states, v = [o.residual for o in outs], [o.state for o in outs], outs[0].v
    assert len(steady) == 3 and any(r["error"] is not None for r in steady)


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_large_buckets_differ_from_torch_only_by_its_kernels(torch_logs, rank):
    """At n m r >= 400 torch multiplies with MKL's dgemm (and at rank > 2 orthogonalises with LAPACK's QR): ours
    stays within rounding of torch, and with torch's product (and QR) substituted it is bit-equal."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    name = f"large{rank}"
    worst = 0.0
    for recs, avg, res, q in _replay(torch_logs, name, rank, 2.0):
        for p in range(W):
            scale = np.abs(recs[p]["output"]).max()
            worst = max(worst, np.abs(avg[p] - recs[p]["output"]).max() / scale)
    assert 0 < worst < 1e-12, worst  # observed 7.5e-16 (r = 1), 7.2e-16 (r = 2), 1.2e-15 (r = 4)

    def bmm(A, B):  # torch's product on the same strides (M^T and Q^T are transposed views there too)
        return torch.bmm(torch.from_numpy(A)[None], torch.from_numpy(B)[None])[0].numpy()

    def qr(M, epsilon=0.0):
        T = torch.from_numpy(M)[None]
        _orthogonalize(T, epsilon)
        return M

    threads = torch.get_num_threads()
    mp = pytest.MonkeyPatch()
    mp.setattr(ps, "matmul", bmm)
    if rank > 2:
        mp.setattr(ps, "orthogonalize", qr)
    try:
        torch.set_num_threads(1)  # as the ranks (MKL's blocking can depend on its thread count)
        for recs, avg, res, q in _replay(torch_logs, name, rank, 2.0):
            for p in range(W):
                assert np.array_equal(avg[p], recs[p]["output"]), (rank, recs[p]["iter"], p)
                if res[p] is not None:
                    assert np.array_equal(res[p], recs[p]["error"]) and np.array_equal(q[p], recs[p]["q"])
    finally:
        mp.undo()
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ the paper's properties


def _compress(Ms, rank, warm=None, mem=None, epsilon=0.0):
    """Our exchange of the matrices Ms (one per worker) at ``rank``: (D, g, memory)."""
    rows, cols = Ms[0].shape
    Pw = len(Ms)
    plan = ps.Plan((), (ps.Entry(0, rows * cols, rows, cols, ps.effective_rank(rows, cols, rank)),))
    mem = [{} for _ in range(Pw)] if mem is None else mem
    rngs = [np.random.RandomState(3) for _ in range(Pw)]
    out = run_lockstep([ps.powersgd_bucket(p, Pw, Ms[p].ravel(), plan, mem[p], 0, rngs[p], epsilon=epsilon)
                        for p in range(Pw)])
    return out[0][0].reshape(rows, cols), out[0][1].reshape(rows, cols), mem


shapes_st = st.tuples(st.integers(2, 12), st.integers(2, 12), st.integers(0, 2 ** 32 - 1))


@given(shapes_st)
def test_full_rank_reproduces_the_matrix(args):
    """rank = min(rows, cols), one worker: P Q^T = P P^T M = M (P spans M's column space)."""
    rows, cols, seed = args
    M = np.random.default_rng(seed).standard_normal((rows, cols))
    D, g, _ = _compress([M], min(rows, cols))
    np.testing.assert_allclose(D, M, rtol=0, atol=1e-9 * np.abs(M).max())
    assert np.array_equal(g, D)


@given(shapes_st, st.integers(1, 4), st.integers(1, 4))
def test_one_power_step_is_a_projection_of_the_mean(args, rank, Pw):
    """D = P P^T mean_p(M_p) with P orthonormal (Algorithm 1): D has rank <= r, the error energy
    ||mean M - D||^2 = ||mean M||^2 - ||P^T mean M||^2 <= ||mean M||^2, and >= the best rank-r error
    (Eckart-Young); the exchange is linear (W workers = one worker on the mean, up to rounding); g = W D."""
    rows, cols, seed = args
    rng = np.random.default_rng(seed)
    Ms = [rng.standard_normal((rows, cols)) for _ in range(Pw)]
    mean = sum(Ms) / Pw
    D, g, _ = _compress(Ms, rank)
    r = ps.effective_rank(rows, cols, rank)
    s = np.linalg.svd(mean, compute_uv=False)
    err, energy = np.sum((mean - D) ** 2), np.sum(mean ** 2)
    assert err <= energy * (1 + 1e-12)
    assert err >= np.sum(s[r:] ** 2) * (1 - 1e-9) - 1e-12 * energy
    assert np.linalg.matrix_rank(D, tol=1e-9 * max(1.0, np.abs(D).max())) <= r
    D1, _, _ = _compress([mean], rank)
    np.testing.assert_allclose(D, D1, rtol=0, atol=1e-9 * np.abs(mean).max())
    np.testing.assert_allclose(g, Pw * D, rtol=1e-15, atol=0)


@given(shapes_st)
def test_warm_start_error_never_increases_on_a_fixed_matrix(args):
    """Rank 1 with warm start on the same M every step is the power method on M M^T (section 3, "warm start"):
    the captured energy ||M^T p||^2 is non-decreasing (moments of a positive semi-definite matrix are log-convex),
    so the error ||M - D_t||^2 never increases, and it approaches the best rank-1 error."""
    rows, cols, seed = args
    M = np.random.default_rng(seed).standard_normal((rows, cols))
    mem, errs = None, []
    for _ in range(30):
        D, _, mem = _compress([M], 1, mem=mem)
        errs.append(np.sum((M - D) ** 2))
    tol = 1e-12 * np.sum(M ** 2)
    assert all(b <= a + tol for a, b in zip(errs, errs[1:])), errs
    s = np.linalg.svd(M, compute_uv=False)
    assert errs[-1] >= np.sum(s[1:] ** 2) - tol


def test_zero_columns_and_epsilon():
    M = np.zeros((4, 6))
    D, g, _ = _compress([M, M], 2)
    assert not D.any() and not g.any()
    M = np.random.default_rng(0).standard_normal((4, 6))
    D, _, _ = _compress([M], 1, epsilon=1e-8)
    D0, _, _ = _compress([M], 1)
    assert np.allclose(D, D0, rtol=1e-6) and not np.array_equal(D, D0)


def test_state_is_keyed_by_segment_and_warm_start_off_redraws():
    spec = AlgorithmSpec("powersgd", segments=(100, 144), options=(("rank", 2),))
    spec_cold = AlgorithmSpec("powersgd", segments=(100, 144), options=(("rank", 2), ("warm_start", False)))
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(244) for _ in range(2)]
    for sp, kept in ((spec, True), (spec_cold, False)):
        states, res = [None, None], [np.zeros(244)] * 2
        for t in (1, 2):
            outs = run_lockstep([sgd_step(sp, p, 2, np.zeros(244), res[p], (lambda g: lambda _v: g)(grads[p]),
                                          1, 0.1, t, states[p]) for p in range(2)])
            states, res = [o.state for o in outs], [o.residual for o in outs]
        q = states[0]["powersgd"]["q"]
        assert set(q) == {0, 1} and all((v is not None) == kept for v in q.values())
        # two segments per step, one seed each: 2 draws with warm start, 4 without
        nxt = np.random.RandomState(0).randint(ps.SEED_BOUND, size=5)[2 if kept else 4]
        assert states[0]["powersgd"]["rng"].randint(ps.SEED_BOUND) == nxt
        # identical state on every rank
        assert all(np.array_equal(a, b) for a, b in zip(q[0] or [], states[1]["powersgd"]["q"][0] or []))
