"""The torch.distributed backend runs the same programs as the simulator and gets the same numbers.

Equivalence: for P = 1..4, dense (ring, recursive doubling), Top-k and gTop-k (tree, recursive doubling;
exact and reference masks) give a parameter trajectory over gloo that is bit-identical in float64 to the
lock-step simulator's, on a real objective and on crafted gradients with many tied magnitudes and all-zero
steps; float32 trajectories agree within rtol 1e-6 (observed: identical, since both sides run the same
numpy arithmetic and the codec moves the bytes unchanged). Failures: a raising, killed or hung rank ends
the run with a message naming it, within the timeout. Every launch has a timeout, so nothing hangs.
"""
from __future__ import annotations

import json
import math
import os
import signal
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]' (torch==2.13.0)")

from click.testing import CliRunner  # noqa: E402

from sim.algorithms import AlgorithmSpec  # noqa: E402
from sim.comm.compression import Sparse  # noqa: E402
from sim.workloads.data import shard_indices  # noqa: E402
from sim.base.errors import SparsimError  # noqa: E402
from sim.machine.network import PRESETS  # noqa: E402
from sim.workloads.objectives import make_objective  # noqa: E402
from sim.engine.runner import Workers, run_algorithm  # noqa: E402
from sim.distributed.backend import (WorkerFailure, decode, encode, fit_alpha_beta, launch_local,  # noqa: E402
                               run_worker)

TIMEOUT = 60.0  # seconds a rank may wait on a peer; every launch below is bounded by it
T = 4


# ------------------------------------------------------------------------------------------ codec


def _same(a, b):
    if isinstance(a, Sparse):
        return isinstance(b, Sparse) and a.d == b.d and _same(a.idx, b.idx) and _same(a.val, b.val)
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))


@pytest.mark.parametrize("payload", [
    None,
    np.array([1.0, -0.0, np.nan, np.inf, 5e-324, 1e308]),
    np.arange(6, dtype=np.float32).reshape(2, 3),
    np.zeros(0),
    np.array([True, False, True]),
    Sparse(np.array([0, 7, 9], dtype=np.int64), np.array([1.5, -2.0, 3e-300]), 10),
    Sparse(np.zeros(0, dtype=np.int64), np.zeros(0), 10),
    Sparse(np.array([2], dtype=np.int64), np.array([0.25], dtype=np.float32), 3),
    [Sparse(np.array([1], dtype=np.int64), np.array([2.0]), 4), Sparse(np.zeros(0, np.int64), np.zeros(0), 4)],
    (Sparse(np.array([1, 3], dtype=np.int64), np.array([2.0, -1.0]), 4), np.array([True, False])),
    (Sparse(np.zeros(0, np.int64), np.zeros(0), 4), None),
    (np.ones(3), np.zeros(3), 7, 2.5, True, np.arange(3, dtype=np.int32)),
])
def test_codec_roundtrip_is_bit_exact(payload):
    buf = encode(payload)
    assert buf.dtype == np.uint8 and buf.ndim == 1 and buf.shape[0] >= 1
    assert _same(payload, decode(buf))


def test_codec_rejects_bad_payloads():
    with pytest.raises(SparsimError, match="cannot encode"):
        encode({"a": 1})
    with pytest.raises(SparsimError, match="cannot encode"):
        encode(np.array([object()], dtype=object))
    buf = encode(np.arange(4.0))
    with pytest.raises(SparsimError, match="corrupt"):
        decode(buf[:-3])
    with pytest.raises(SparsimError, match="corrupt"):
        decode(np.concatenate([buf, buf]))


def test_fit_alpha_beta_recovers_a_line():
    n = np.array([1, 10, 100, 1e4, 1e6])
    fit = fit_alpha_beta(n, 5e-5 + n * 2e-9)
    assert fit["alpha_s"] == pytest.approx(5e-5, rel=1e-9) and fit["beta_s_per_byte"] == pytest.approx(2e-9, rel=1e-9)
    assert fit["rms_rel_residual"] < 1e-12
    with pytest.raises(SparsimError):
        fit_alpha_beta([10], [1e-3])


# ------------------------------------------------------------------------------------------ test doubles


def constant_lr(t):
    """alpha_t = 0.3 (module level so spawned ranks can unpickle it)."""
    return 0.3


class QuadObjective:
    """f(x) = ||x||^2 / 2, for the metrics rows of crafted-gradient runs (rank 0 only)."""

    n = 1

    def loss(self, x):
        return 0.5 * float(x @ x)

    def full_grad(self, x):
        return x.copy()


class CraftedWorkers:
    """Duck-typed workers whose gradient is a crafted vector per (rank, iteration).

    Iterations 2 and 5: every worker's gradient is zero (an all-zero step). Otherwise gradients are small
    integers times powers of two with many tied magnitudes across coordinates and workers; worker 1's
    gradient is also zero at iteration 3 (one silent worker). ``fault`` = (rank, iteration, how) makes that
    rank (every rank for "all") raise ("raise"), SIGKILL itself ("kill") or hang ("hang") when asked for that
    gradient.
    """

    def __init__(self, P, d, fault=None):
        self.P, self.d, self.b, self.fault = P, d, 1, fault
        self.shards = [np.array([0])] * P  # run_algorithm reads P from len(shards)
        self.objective = QuadObjective()
        rng = np.random.default_rng(7)
        self.table = rng.choice([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0], size=(8, P, d))
        self.table[:, :, : d // 2] = np.sign(self.table[:, :, : d // 2])  # half the coordinates tie at +-1 / 0
        self.table[2 - 1] = 0.0
        self.table[5 - 1] = 0.0
        if P > 1:
            self.table[3 - 1, 1] = 0.0

    def grad_fn(self, rank, t):
        def g(v):
            if self.fault is not None and self.fault[0] in (rank, "all") and self.fault[1] == t:
                how = self.fault[2]
                if how == "raise":
                    raise RuntimeError(f"injected failure on rank {rank}")
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if how == "hang":
                    time.sleep(1000)
            return self.table[(t - 1) % 8, rank].astype(v.dtype)

        return g


def _objective_workers(P):
    obj = make_objective("sines", d=24, n=48, seed=3)
    return Workers(obj, shard_indices(obj.n, P, seed=3), 4, 3), obj.x0(3)


def _specs():
    return [
        AlgorithmSpec("dense", collective="ring"),
        AlgorithmSpec("dense", collective="recursive_doubling"),
        AlgorithmSpec("topk", k=5),
        AlgorithmSpec("gtopk", k=5, collective="tree"),
        AlgorithmSpec("gtopk", k=5, collective="tree", mask="reference"),
        AlgorithmSpec("gtopk", k=5, collective="recursive_doubling"),
        AlgorithmSpec("gtopk", k=5, collective="recursive_doubling", mask="reference"),
    ]


def _cases(P):
    """(name, spec, workers, x0, T) for every equivalence case at this P."""
    out = []
    w, x0 = _objective_workers(P)
    for s in _specs():
        out.append(("sines-f64", s, w, x0, T))
    cw = CraftedWorkers(P, 12)
    for s in _specs():
        out.append(("ties-f64", s, cw, np.linspace(-1, 1, 12), 6))
    for s in (_specs()[0], _specs()[2], _specs()[3], _specs()[5]):
        out.append(("sines-f32", s, w, x0.astype(np.float32), T))
    return out


def equivalence_job(ctx, P):
    """Per-rank body: run every case; return [(rows or None, trajectory)] in case order."""
    res = []
    for _, spec, w, x0, TT in _cases(P):
        r = run_worker(ctx.rank, ctx.P, spec, w, T=TT, lr=constant_lr, x0=x0, transport=ctx.transport,
                       keep_trajectory=True)
        res.append((r.rows, r.trajectory))
    return res


def fault_job(ctx, P, fault):
    """Per-rank body of the failure tests: gTop-k on crafted gradients with an injected fault."""
    spec = AlgorithmSpec("gtopk", k=3)
    return run_worker(ctx.rank, ctx.P, spec, CraftedWorkers(P, 12, fault), T=6, lr=constant_lr,
                      x0=np.zeros(12), transport=ctx.transport).rows


def allreduce_job(ctx, P):
    """Per-rank body: dense with the backend's all_reduce fast path."""
    w, x0 = _objective_workers(P)
    return run_worker(ctx.rank, ctx.P, AlgorithmSpec("dense"), w, T=T, lr=constant_lr, x0=x0,
                      transport=ctx.transport, backend_allreduce=True, keep_trajectory=True).trajectory


def transport_job(ctx):
    """Per-rank body: payloads of sizes around the eager first message, through send/recv and sendrecv."""
    tr = ctx.transport
    room = tr.eager_bytes - 8
    payloads = [None, np.zeros(0), Sparse(np.zeros(0, np.int64), np.zeros(0), 5)]
    for n in (room - 40, room - 26, room - 25, room - 24, room, room + 1, 3 * room, 200_000):
        payloads.append(np.arange(max(n // 8, 0), dtype=np.float64) * (ctx.rank + 1))
    got = []
    peer = 1 - ctx.rank
    for p in payloads:
        if ctx.rank == 0:
            tr.send(1, p)
            got.append(tr.recv(1))
        else:
            got.append(tr.recv(0))
            tr.send(0, p)
        got.append(tr.sendrecv(peer, p, peer))
    return payloads, got, tr.wire_bytes, tr.eager_bytes


def test_transport_moves_every_size_exactly():
    (p0, g0, w0, eager), (p1, g1, w1, _) = launch_local(2, transport_job, (), timeout_s=TIMEOUT)
    for i, (a, b) in enumerate(zip(p0, p1)):
        assert _same(g0[2 * i], b) and _same(g0[2 * i + 1], b), i
        assert _same(g1[2 * i], a) and _same(g1[2 * i + 1], a), i
    # wire bytes: each payload goes twice (send/recv, sendrecv) as one eager first message (length header
    # + the start of the encoding) and, when the encoding does not fit, a second message with the rest
    for payloads, wire in ((p0, w0), (p1, w1)):
        assert wire == sum(2 * (eager + max(0, encode(p).shape[0] - (eager - 8))) for p in payloads)


# ------------------------------------------------------------------------------------------ equivalence

NUMERIC = ("loss", "grad_norm_sq", "stoch_grad_norm_sq", "residual_norm_sq", "delta", "applied_fraction",
           "mass_error", "aux_gap", "lr", "iteration", "algorithm")


def _eq(a, b):
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_trajectories_bit_identical_to_simulator(P):
    got = launch_local(P, equivalence_job, (P,), timeout_s=TIMEOUT)
    for i, (name, spec, w, x0, TT) in enumerate(_cases(P)):
        traj = []
        ref = run_algorithm(spec, w, T=TT, lr=constant_lr, x0=x0, driver="lockstep",
                            on_step=lambda t, outs: traj.append([o.v.copy() for o in outs]))
        sim = run_algorithm(spec, w, T=TT, lr=constant_lr, x0=x0, driver="simpy", network=PRESETS["1GbE"])
        what = f"{name} {spec} P={P}"
        for r in range(P):
            mine = got[r][i][1]
            assert len(mine) == TT
            for t in range(TT):
                assert mine[t].dtype == x0.dtype, what
                if name.endswith("f64"):
                    assert np.array_equal(mine[t], traj[t][r]), f"{what} rank {r} iteration {t + 1}"
                else:  # float32: stated tolerance rtol 1e-6 (observed identical)
                    np.testing.assert_allclose(mine[t], traj[t][r], rtol=1e-6, atol=1e-7, err_msg=what)
        rows = got[0][i][0]
        assert got[1 % P][i][0] is None or P == 1
        assert len(rows) == TT + 1
        for a, b, c in zip(rows, ref, sim):
            for col in NUMERIC:
                assert _eq(a[col], b[col]), f"{what} iteration {a['iteration']} column {col}: {a[col]} != {b[col]}"
            assert a["bytes_sent"] == c["bytes_sent"], what  # the modelled wire bytes agree with the simulator
            assert a["sim_time_s"] >= 0 and a["comm_s"] >= 0 and a["iter_time_s"] >= 0
        times = [r_["sim_time_s"] for r_ in rows]
        assert times == sorted(times)


def _hier_specs(G):
    return [
        AlgorithmSpec("dense", collective="hierarchical", gpus_per_node=G),
        AlgorithmSpec("topk", k=5, collective="hierarchical", gpus_per_node=G),
        AlgorithmSpec("gtopk", k=5, collective="hierarchical", gpus_per_node=G),
        AlgorithmSpec("gtopk", k=5, collective="hierarchical", gpus_per_node=G, mask="reference"),
    ]


def hierarchical_job(ctx, G):
    """Per-rank body: the hierarchical collectives on sines and on crafted ties; trajectories per case."""
    w, x0 = _objective_workers(ctx.P)
    cw = CraftedWorkers(ctx.P, 12)
    out = []
    for spec in _hier_specs(G):
        for ww, xx, TT in ((w, x0, T), (cw, np.linspace(-1, 1, 12), 6)):
            out.append(run_worker(ctx.rank, ctx.P, spec, ww, T=TT, lr=constant_lr, x0=xx, transport=ctx.transport,
                                  keep_trajectory=True).trajectory)
    return out


def test_hierarchical_collectives_bit_identical_to_simulator_on_2_nodes_of_2():
    """P = 4 as 2 nodes x 2 local ranks: the torch backend runs the same hierarchical programs and every
    rank's parameters equal the simulator's (on the hierarchical cluster) bit for bit."""
    from sim.machine.topology import ClusterSpec

    P, G = 4, 2
    got = launch_local(P, hierarchical_job, (G,), timeout_s=TIMEOUT)
    w, x0 = _objective_workers(P)
    cw = CraftedWorkers(P, 12)
    cluster = ClusterSpec(2, 2, "pcie", 1e-5, 1e9, 4e-4, 1.25e8)
    i = 0
    for spec in _hier_specs(G):
        for ww, xx, TT in ((w, x0, T), (cw, np.linspace(-1, 1, 12), 6)):
            traj = []
            run_algorithm(spec, ww, T=TT, lr=constant_lr, x0=xx, driver="simpy", network=cluster,
                          on_step=lambda t, outs: traj.append([o.v.copy() for o in outs]))
            for r in range(P):
                assert len(got[r][i]) == TT
                for t in range(TT):
                    assert np.array_equal(got[r][i][t], traj[t][r]), f"{spec} rank {r} iteration {t + 1}"
            i += 1


def test_backend_allreduce_fast_path_matches_ring_closely():
    P = 3
    got = launch_local(P, allreduce_job, (P,), timeout_s=TIMEOUT)
    w, x0 = _objective_workers(P)
    traj = []
    run_algorithm(AlgorithmSpec("dense"), w, T=T, lr=constant_lr, x0=x0, driver="lockstep",
                  on_step=lambda t, outs: traj.append(outs[0].v.copy()))
    for r in range(P):
        assert np.array_equal(got[r][-1], got[0][-1])  # identical on every rank
        for t in range(T):
            np.testing.assert_allclose(got[r][t], traj[t], rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------------------------------ failures


@pytest.mark.parametrize("how,needle", [("raise", "rank 2: RuntimeError: injected failure on rank 2"),
                                        ("kill", "rank 2 died (signal 9")])
def test_failed_worker_names_the_rank_quickly(how, needle):
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure) as ei:
        launch_local(3, fault_job, (3, (2, 3, how)), timeout_s=TIMEOUT)
    elapsed = time.monotonic() - t0
    assert needle in str(ei.value), str(ei.value)
    assert "\n" not in str(ei.value)
    assert elapsed < TIMEOUT, elapsed  # the peers notice the closed connection; no timeout needed


def test_hung_worker_is_detected_within_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure) as ei:
        launch_local(3, fault_job, (3, (1, 2, "hang")), timeout_s=3.0)
    elapsed = time.monotonic() - t0
    msg = str(ei.value)
    assert "rank 1 hung" in msg and "3 s timeout" in msg, msg
    assert elapsed < 45, elapsed  # start-up + 3 s for the peers to give up + 3 + 2 s before the kill


@pytest.mark.parametrize("P", [1, 2])
def test_every_rank_hung_in_computation_is_stopped_by_the_stall_timeout(P):
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure) as ei:
        launch_local(P, fault_job, (P, ("all", 2, "hang")), timeout_s=30.0, stall_timeout_s=2.0)
    elapsed = time.monotonic() - t0
    msg = str(ei.value)
    for r in range(P):
        assert f"rank {r} made no progress in iteration 2" in msg, msg
    assert "2 s stall timeout" in msg and "stuck in local computation" in msg, msg
    assert elapsed < 45, elapsed  # start-up + 2 s, well before the 30 s peer timeout


def test_a_stall_timeout_leaves_healthy_and_finished_ranks_alone():
    # fast steps keep making progress; ranks that have returned (and are shutting down) are not stalled
    for _ in range(2):
        rows = launch_local(2, fault_job, (2, None), timeout_s=30.0, stall_timeout_s=1.0)[0]
        assert [r["iteration"] for r in rows] == list(range(7))


def sleepy_job(ctx, seconds):
    """Per-rank body: compute nothing for a while, without any message (no progress recorded)."""
    time.sleep(seconds)
    return ctx.rank


def test_long_local_computation_is_not_a_failure_unless_a_stall_timeout_is_set():
    # off by default: a step may compute longer than the peer timeout
    assert launch_local(1, sleepy_job, (4.0,), timeout_s=1.0) == [0]
    with pytest.raises(WorkerFailure, match="rank 0 made no progress for .* within the 1 s stall timeout"):
        launch_local(1, sleepy_job, (30.0,), timeout_s=1.0, start_timeout_s=0.5, stall_timeout_s=1.0)
    with pytest.raises(SparsimError, match="stall_timeout_s"):
        launch_local(1, sleepy_job, (0.0,), stall_timeout_s=0.0)


# ------------------------------------------------------------------------------------------ CLI


def test_cli_torch_backend_writes_the_run_directory(tmp_path):
    from experiments.cli import main

    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["run", "--backend", "torch", "--nproc", "2", "--out", str(out), "--quiet",
                                  "--set", "training.iterations=3", "--algorithms", "dense,gtopk",
                                  "--timeout", "60"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    for name in ("metrics.csv", "summary.json", "figure.png"):
        assert (out / name).stat().st_size > 0
    s = json.loads((out / "summary.json").read_text())
    assert s["backend"]["name"] == "torch" and s["backend"]["nproc"] == 2 and s["resolved"]["P"] == 2
    assert set(s["totals"]) == {"dense", "gtopk"}
    assert s["totals"]["gtopk"]["sim_time_s"] > 0
    assert not (tmp_path / "run.partial").exists()


@pytest.mark.parametrize("args,needle", [
    (["--nproc", "2"], "--nproc needs --backend torch"),
    (["--backend", "torch", "--nproc", "0"], "--nproc 0 is out of range"),
    (["--backend", "torch", "--nproc", "2", "--set", "cluster.P=3"], "--nproc 2 differs"),
    (["--backend", "torch", "--nproc", "2", "--timeout", "0"], "torch.timeout_s = 0.0 is out of range: valid 0 < timeout_s <= 604_800"),
])
def test_cli_torch_user_errors_are_one_line(tmp_path, args, needle):
    from experiments.cli import main

    out = tmp_path / "bad"
    r = CliRunner().invoke(main, ["run", "--out", str(out), "--quiet", *args])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert not out.exists()


def test_cli_failed_run_records_the_error_and_exits_2(tmp_path):
    from experiments.cli import main

    out = tmp_path / "nan"
    r = CliRunner().invoke(main, ["run", "--backend", "torch", "--nproc", "2", "--out", str(out), "--quiet",
                                  "--set", "training.iterations=3", "--set", "training.lr=1e308",
                                  "--set", "data.objective=sines", "--set", "data.d=16", "--set", "data.n=64",
                                  "--algorithms", "dense"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "torch backend failed: rank" in lines[0] and "not finite" in lines[0], r.stderr
    assert not out.exists()
    assert "not finite" in (tmp_path / "nan.partial" / "error.txt").read_text()


# ------------------------------------------------------------------------------------------ trace replay and calibration


def trace_job(ctx, P):
    """Per-rank body: gTop-k (tree) and dense ring on the sines objective with the trace recorded."""
    w, x0 = _objective_workers(P)
    out = {}
    for spec in (AlgorithmSpec("gtopk", k=5, collective="tree"), AlgorithmSpec("dense", collective="ring")):
        r = run_worker(ctx.rank, ctx.P, spec, w, T=T, lr=constant_lr, x0=x0, transport=ctx.transport,
                       record_trace=True)
        out[spec.label] = r.steps
        out[spec.label + "/rows"] = r.rows
    return out


@pytest.mark.parametrize("P", [2, 3])
def test_recorded_trace_replays_on_the_simulator(P):
    from sim.engine.replay import replay

    got = launch_local(P, trace_job, (P,), timeout_s=TIMEOUT)
    w, x0 = _objective_workers(P)
    net = PRESETS["10GbE"]
    for spec in (AlgorithmSpec("gtopk", k=5, collective="tree"), AlgorithmSpec("dense", collective="ring")):
        traces = [g[spec.label] for g in got]
        for steps in traces:
            assert len(steps) == T
            for st in steps:
                cats = np.zeros(3)
                for c, sec, _sig in st.segments:
                    assert c in (0, 1, 2) and sec >= 0
                    cats[c] += sec
                # compute and compress are local segments only; comm adds the time blocked in messages
                np.testing.assert_allclose(cats[:2], st.busy_s[:2], rtol=1e-9, atol=1e-12)
                assert st.busy_s[2] >= cats[2] - 1e-12
        # iter_time_s is the slowest rank's step wall time (steps are separated by a barrier; to the rounding of
        # the clock's differences, (a + b) - a), and sim_time_s their sum; each rank's busy seconds lie inside its step. (Comparing the busy sum with the
        # wall time to a tolerance failed under load: the Python between operations is in neither.)
        for tr in traces:
            for st in tr:
                assert st.wall_s is not None and sum(st.busy_s) <= st.wall_s * (1 + 1e-12) + 1e-12
        slowest = [max(tr[t].wall_s for tr in traces) for t in range(T)]
        rows = got[0][spec.label + "/rows"][1:]
        np.testing.assert_allclose([row["iter_time_s"] for row in rows], slowest, rtol=1e-9, atol=0)
        np.testing.assert_allclose([row["sim_time_s"] for row in rows], np.cumsum([row["iter_time_s"] for row in rows]),
                                   rtol=1e-12)
        r = replay(spec, w, x0=x0, lr=constant_lr, network=net, traces=traces)
        # the replay spends exactly the measured local time: compute and compress agree with the measurement
        np.testing.assert_allclose(r.predicted_busy_s[:, :, :2], r.measured_busy_s[:, :, :2], rtol=1e-9, atol=1e-12)
        assert np.all(r.predicted_comm_s > 0) and np.all(r.measured_comm_s > 0)


@pytest.mark.parametrize("pattern", ["exchange", "pingpong"])
def test_calibration_patterns_time_every_size(pattern):
    from sim.distributed.backend import pingpong_job

    sizes = [1, 3000]
    res = launch_local(2, pingpong_job, (sizes, 3, 1, pattern, 0.001), timeout_s=TIMEOUT)[0]
    assert [n for n, _, _ in res] == sizes
    for _, med, times in res:
        assert len(times) == 3 and all(t > 0 for t in times) and med == float(np.median(times))


def test_cli_calibrate_writes_both_fits_and_a_preset(tmp_path):
    import tomllib

    from experiments.cli import main
    from sim.machine.network import NetworkSpec

    out = tmp_path / "cal.toml"
    r = CliRunner().invoke(main, ["calibrate", "--out", str(out), "--max-bytes", "4000000", "--repeats", "3",
                                  "--pattern", "pingpong"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert "#   exchange: alpha =" in text and "#   pingpong: alpha =" in text and "<- this preset" in text
    cl = tomllib.loads(text)["cluster"]
    assert cl["network"] == "custom" and cl["alpha_s"] >= 0 and cl["bandwidth_Bps"] > 0
    NetworkSpec.from_alpha_beta(cl["alpha_s"], 1.0 / cl["bandwidth_Bps"], cl["topology"])  # a valid network
    r = CliRunner().invoke(main, ["calibrate", "--out", str(out), "--repeats", "3"])
    assert r.exit_code == 2 and "exists" in r.stderr and out.read_text() == text
    r = CliRunner().invoke(main, ["calibrate", "--out", str(tmp_path / "x.toml"), "--busy-s", "-1"])
    assert r.exit_code == 2 and "--busy-s = -1.0 is out of range" in r.stderr


def test_torchrun_entry_point_writes_the_same_run_directory(tmp_path):
    """The several-machines path of the README, on one machine: torchrun --standalone, 2 ranks."""
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not next to this Python: pip install -e '.[torch]'")
    out = tmp_path / "tr"
    r = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "experiments.torch_run",
                        "--out", str(out), "--set", "training.iterations=2", "--set", "cluster.P=2",
                        "--dist-backend", "gloo", "--timeout", "60"],
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["backend"]["launcher"] == "torchrun" and s["backend"]["nproc"] == 2
    assert s["backend"]["stall_timeout_s"] == 0.0 and s["resolved"]["P"] == 2
    assert set(s["totals"]) == {"dense", "topk", "gtopk"}
    assert (out / "metrics.csv").stat().st_size > 0 and not (tmp_path / "tr.partial").exists()


# ------------------------------------------------------------------ every registered algorithm (issue #11)

def _registry_specs():
    """Every registered algorithm at every flat collective (default options), whole-model and layer-wise."""
    from sim.algorithms import REGISTRY

    out = []
    for name, algo in REGISTRY.items():
        for coll in algo.collectives:
            if coll in ("backend_allreduce", "hierarchical"):
                continue
            k = 5 if algo.sparse else None
            out.append(AlgorithmSpec(name, k=k, collective=coll))
            if algo.segmented:
                out.append(AlgorithmSpec(name, k=k, collective=coll, segments=(7, 10, 7)))
    return out


def registry_job(ctx, P):
    """Per-rank body: every registered algorithm's trajectory over torch.distributed."""
    w, x0 = _objective_workers(ctx.P)
    return [run_worker(ctx.rank, ctx.P, spec, w, T=4, lr=constant_lr, x0=x0, transport=ctx.transport,
                       keep_trajectory=True).trajectory for spec in _registry_specs()]


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_every_registered_algorithm_is_bit_identical_to_the_simulator(P):
    got = launch_local(P, registry_job, (P,), timeout_s=TIMEOUT)
    w, x0 = _objective_workers(P)
    for i, spec in enumerate(_registry_specs()):
        traj = []
        run_algorithm(spec, w, T=4, lr=constant_lr, x0=x0, driver="lockstep",
                      on_step=lambda t, outs: traj.append([o.v.copy() for o in outs]))
        for r in range(P):
            for t in range(4):
                assert np.array_equal(got[r][i][t], traj[t][r]), f"{spec.label} P={P} rank {r} iteration {t + 1}"
