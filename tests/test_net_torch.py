"""A network on images ([model]) on the real backend and through the DDP hook: the simulator's numbers (#24 item 6).

1. Torch backend. The MLP (mlp-256), LeNet-5 and ResNet-20 (BatchNorm: the running statistics, used by the
   eval-mode accuracy columns, are rank 0's) at P = 2 and 3 with dense, DGC and PowerSGD (algorithms with state),
   Top-k and gTop-k (:data:`NETS`) run in P gloo processes by :func:`experiments.torch_run.run_built` (what ``sparsim
   run --backend torch`` runs in each rank) and on the simulator by :func:`sim.engine.runner.run_algorithm` with the
   scenario's timeline clock (what ``sparsim run`` runs), float64, ``model.gradients = "loop"`` (the per-worker
   reference gradients). Both run directories are written by :func:`experiments.run.write_run_directory` and every
   value column of their metrics.csv is equal as text (floats are written in repr form: equal bit for bit). Not
   compared as numerics: the time columns (the backend measures wall time) and ``bytes_sent`` (the simulated clock's
   in a [model] run; checked where it must agree, see the test). Both sides compute torch with ONE thread: the ranks
   always do, and so does NetObjective (MKL's float64 products round differently with 2 threads: 1 ulp in a gradient
   norm at b = 32); the test process pins it too. The MLP has a time budget: the backend runs each algorithm for the
   simulator's iteration count on the simulated clock, and its summary says the time columns are measured.

2. DDP hook. A real ``DistributedDataParallel`` over the zoo network (:func:`sim.workloads.nets.build_net`, the scenario's seed)
   in P gloo processes, each rank fed the simulator's mini-batches of the same scenario (``Workers.batch_indices``),
   plain SGD, against the simulator's run of that scenario with ``workload.sparse_policy = "bucket"`` (one selection
   per DDP bucket, :func:`sim.engine.timeline.ddp_buckets`; ``compression.value_bytes = 8`` = float64 gradients, the bytes
   DDP's bucket caps count). DDP's first iteration has ONE bucket of every parameter (torch 2.13 buckets by the
   real gradient order only from the second iteration on); the simulator selects per rebuilt bucket from the first
   iteration, so each DDP model first takes one backward without a step and without the hook, model and buffers
   unchanged (:func:`sim.distributed.ddp_hooks.settle_buckets`), after which its buckets are the simulator's segments. Then:

   - Top-k and gTop-k hooks (scope "bucket", the hook's ``lr`` = alpha, ``SGD(lr=1)``): equal bit for bit, every rank,
     every iteration; for ResNet-20 also rank 0's BatchNorm running statistics;
   - DDP without a hook (dense, ``SGD(lr=alpha)``) and the gTop-k hook with ``lr = 1`` and ``SGD(lr=alpha)``: within
     :data:`ROUNDING_RTOL` (reasons there).
"""
from __future__ import annotations

import csv
import json
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]' (torch==2.13.0)")

FMNIST = "/usr/share/datasets/fashion-mnist"
HAVE_DATA = os.path.isdir(FMNIST)
needs_data = pytest.mark.skipif(not HAVE_DATA and os.environ.get("CI") != "true",
                                reason="dataset-fashion-mnist not installed (CI installs it)")
pytestmark = needs_data

TIMEOUT = 120.0  # seconds a rank may wait on a peer (each rank builds three networks and their data first)
T, LR = 3, 0.1
#: the first images of Fashion-MNIST's splits the runs use (written as IDX files; a run reads any non-empty subsets):
#: every process converts its training images to float64, 376 MB and a second each for all 60,000
N_TRAIN, N_TEST = 2048, 256

#: network -> (algorithms, its scenario keys). LeNet-5 and ResNet-20 select per DDP bucket (LeNet-5's buckets capped
#: at 0.05 MiB: three; ResNet-20's at DDP's defaults: two); the MLP over the whole model, with a time budget. Every row
#: is evaluated (loss, accuracies) but ResNet-20's, at the start and the end only (its float64 evaluation costs more
#: than its steps).
NETS = {
    "mlp-256": (["dense", "dgc", "powersgd", "gtopk"], ["model.eval_samples=64", "model.test_samples=100"]),
    "lenet5": (["dense", "topk", "gtopk"],
               ["model.eval_samples=64", "model.test_samples=100", "workload.sparse_policy='bucket'",
                "workload.bucket_cap_mb=0.05"]),
    "resnet20": (["dense", "gtopk"],
                 ["model.eval_samples=8", "model.test_samples=16", f"training.eval_every={T}",
                  "workload.sparse_policy='bucket'"]),
}
#: metrics.csv columns the simulator's clock or the backend's wall clock fill (not numerics), and the run's id
TIME_COLUMNS = ("sim_time_s", "iter_time_s", "compute_s", "compress_s", "comm_s", "exposed_comm_s", "overlap_ratio",
                "run_id")

#: DDP cases: (network, label) -> (hook algorithm or None for DDP's own allreduce, where alpha goes: "hook" = the hook's
#: lr with SGD(lr=1), "optimizer" = SGD(lr=alpha) with the hook's lr = 1 / no hook).
DDP_CASES = {
    ("lenet5", "topk"): ("topk", "hook"),
    ("lenet5", "gtopk"): ("gtopk", "hook"),
    ("lenet5", "gtopk-optimizer-lr"): ("gtopk", "optimizer"),
    ("lenet5", "dense"): (None, "optimizer"),
    ("resnet20", "gtopk"): ("gtopk", "hook"),
}
#: ||v_DDP - v_sim|| / ||v_sim - x0|| allowed after each step where the two round differently (observed at most 1.2e-15
#: for LeNet-5, P = 2 and 3, 3 steps):
#: - DDP without a hook multiplies each rank's gradient by 1/P, sums the ranks in gloo's order, and SGD multiplies the
#:   average by alpha; the simulator's dense sums alpha G_p in its ring's order and divides by P;
#: - the gTop-k hook with lr = 1 accumulates eps + G (gradient units) and SGD multiplies g / P by alpha; the simulator
#:   accumulates eps + alpha G (equal bit for bit when alpha is a power of two, where every scaling is exact).
#: Either way about one rounding per coordinate and step, far below the 1e-12 bound unless a Top-k selection flips.
ROUNDING_RTOL = 1e-12


def _write_idx(path, a: np.ndarray) -> None:
    """An uncompressed IDX file of uint8 array a (magic 0x0000 08 ndim, big-endian uint32 dimensions, the bytes)."""
    with open(path, "wb") as fh:
        fh.write(bytes([0, 0, 8, a.ndim]) + np.asarray(a.shape, dtype=">u4").tobytes() + a.astype(np.uint8).tobytes())


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A folder with the first N_TRAIN training and N_TEST test images and labels of Fashion-MNIST."""
    from sim.workloads.idx import load_image_dataset

    ds = load_image_dataset("fashion-mnist", FMNIST if HAVE_DATA else "")
    d = tmp_path_factory.mktemp("fmnist-subset")
    for split, X, y, n in (("train", ds.X_train, ds.y_train, N_TRAIN), ("t10k", ds.X_test, ds.y_test, N_TEST)):
        _write_idx(d / f"{split}-images-idx3-ubyte", X[:n])
        _write_idx(d / f"{split}-labels-idx1-ubyte", y[:n])
    return str(d)


def _scenario(name: str, P: int, path: str, budget_s: float = 0.0):
    from experiments.scenario import load_scenario

    algorithms, keys = NETS[name]
    ov = [f"model.name='{name}'", "data.dataset='fashion-mnist'", f"data.path='{path}'", "model.gradients='loop'",
          f"cluster.P={P}", f"training.iterations={T}", "training.batch_size=4", f"training.lr={LR}",
          "training.eval_every=1", "training.dtype='float64'", "compression.density=0.01", "compression.value_bytes=8",
          f"algorithms={algorithms!r}", *keys]
    if budget_s:
        ov.append(f"training.time_budget_s={budget_s!r}")
    return load_scenario(None, ov)


def _budget(P: int, path: str) -> float:
    """A time budget for the MLP that ends dense's run (the slowest per iteration on the simulated clock: its whole
    gradient on 1 GbE) after its first iteration: halfway between the ends of its iterations 1 and 2; the sparse
    algorithms' T iterations end before it."""
    from experiments.run import build

    built = build(_scenario("mlp-256", P, path))
    spec = next(s for s in built.specs if s.name == "dense")
    end = np.cumsum(built.clock(spec, T).iter_s)
    return float((end[0] + end[1]) / 2)


# ------------------------------------------------------------------------------------------ per rank


def _ddp_case(ctx, sc, built, algorithm, where):
    """Train a DDP model of the scenario's network T steps on this rank's mini-batches; returns (the flat parameters
    after each step, the buckets of each step as parameter positions, rank 0's buffers after the last step)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sim.distributed.ddp_hooks import SparseState, settle_buckets, sparse_hook
    from sim.workloads.nets import build_net
    from sim.workloads.torch_models import flat_params

    obj = built.objective
    X, y = obj._X, obj._y  # the normalised images and labels the simulator's workers read (NetObjective's own)
    cap = sc.workload.bucket_cap_mb
    ddp = DDP(build_net(sc.model.name, seed=sc.seed, dtype=sc.training.dtype),
              **({} if cap is None else {"bucket_cap_mb": cap}))
    batch = lambda t: torch.from_numpy(built.workers.batch_indices(t)[ctx.rank].copy())  # noqa: E731
    # DDP's first backward has one bucket of every parameter: let it rebuild them first (model and buffers unchanged)
    settle_buckets(ddp, lambda m: torch.nn.functional.cross_entropy(m(X[batch(1)]), y[batch(1)]))
    pos = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    layouts = []
    opt_lr = sc.training.lr
    if algorithm is not None:
        spec = next(s for s in built.specs if s.name == algorithm)
        state = SparseState(ddp.process_group, algorithm, spec.k / built.d, scope="bucket",
                            lr=sc.training.lr if where == "hook" else 1.0).bind(ddp)
        opt_lr = 1.0 if where == "hook" else sc.training.lr

        def hook(st, bucket):
            if bucket.index() == 0:
                layouts.append([])
            layouts[-1].append([pos[id(p)] for p in bucket.parameters()])
            return sparse_hook(st, bucket)

        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=opt_lr)
    traj = []
    for t in range(1, sc.training.iterations + 1):
        idx = batch(t)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(X[idx]), y[idx]).backward()
        opt.step()
        traj.append(flat_params(ddp.module))
    buffers = {k: b.detach().clone() for k, b in ddp.module.named_buffers()} if ctx.rank == 0 else None
    return traj, layouts, buffers


def _first_iteration_buckets(ctx, sc):
    """The buckets of a fresh DDP model's first backward (parameter positions; DDP's own allreduce, recorded), and
    what settle_buckets says once a hook is registered."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sim.distributed.ddp_hooks import settle_buckets
    from sim.base.errors import ConfigError
    from sim.workloads.nets import build_net

    ddp = DDP(build_net(sc.model.name, seed=sc.seed, dtype=sc.training.dtype), bucket_cap_mb=sc.workload.bucket_cap_mb)
    pos = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    seen = []

    def hook(pg, bucket):
        seen.append([pos[id(p)] for p in bucket.parameters()])
        return allreduce_hook(pg, bucket)

    ddp.register_comm_hook(ddp.process_group, hook)
    x = torch.zeros((2, 1, 28, 28), dtype=getattr(torch, sc.training.dtype))
    ddp(x).sum().backward()
    try:
        settle_buckets(ddp, lambda m: m(x).sum())
        refused = None
    except ConfigError as err:
        refused = str(err)
    return seen, refused


def rank_job(ctx, P, path, budget_s):
    """Per rank: each network's scenario on the torch backend (rank 0's metrics rows), then its DDP cases."""
    from experiments.run import build
    from experiments.torch_run import run_built

    out = {"rows": {}, "ddp": {}, "first_buckets": None}
    for name in NETS:
        sc = _scenario(name, P, path, budget_s if name == "mlp-256" else 0.0)
        built = build(sc)
        out["rows"][name] = run_built(ctx, sc, built)
        for (net, label), (algorithm, where) in DDP_CASES.items():
            if net == name:
                out["ddp"][(net, label)] = _ddp_case(ctx, sc, built, algorithm, where)
        if name == "lenet5":
            out["first_buckets"] = _first_iteration_buckets(ctx, sc)
        del built
    return out


# ------------------------------------------------------------------------------------------ the two sides


@pytest.fixture(scope="module", params=[2, 3], ids=["P2", "P3"])
def runs(request, tmp_path_factory, data_dir):
    """Both sides at P: the ranks' results, and per network the simulator's and the backend's run directories, the
    simulator's parameter trajectory (rank 0) per algorithm and its running statistics after each algorithm. The
    simulator runs here while the ranks run (their launcher waits in a thread): one torch thread, as each rank."""
    from concurrent.futures import ThreadPoolExecutor

    from experiments.run import build, torch_backend_info, write_run_directory
    from sim.engine.runner import run_algorithm
    from sim.distributed.backend import launch_local

    P = request.param
    budget = _budget(P, data_dir)
    out = {"P": P, "budget": budget, "dirs": {}, "traj": {}, "buffers": {}, "x0": {}, "segments": {}}
    sims = {}
    threads = torch.get_num_threads()
    with ThreadPoolExecutor(1) as pool:
        launch = pool.submit(launch_local, P, rank_job, (P, data_dir, budget), timeout_s=TIMEOUT)
        torch.set_num_threads(1)  # as every rank and NetObjective itself (see the module docstring)
        try:
            for name in NETS:
                sc = _scenario(name, P, data_dir, budget if name == "mlp-256" else 0.0)
                built = build(sc)
                rows = []
                for spec in built.specs:
                    traj = []
                    rows += run_algorithm(spec, built.workers, T=sc.training.iterations, lr=built.lr, x0=built.x0,
                                          network=built.network, compute=built.compute,
                                          eval_every=sc.training.eval_every, clock=built.clock,
                                          on_step=lambda t, outs, traj=traj: traj.append(outs[0].v.copy()))
                    out["traj"][(name, spec.name)] = traj
                    out["segments"][(name, spec.name)] = spec.segments
                    # the running statistics after this algorithm (NetObjective keeps them in its _stats module)
                    stats = built.objective._stats.named_buffers()
                    out["buffers"][(name, spec.name)] = {k: b.clone() for k, b in stats}
                out["x0"][name] = built.x0
                sims[name] = (sc, built, rows)
        finally:
            torch.set_num_threads(threads)
        out["ranks"] = got = launch.result()
    for name, (sc, built, rows) in sims.items():
        base = tmp_path_factory.mktemp(f"{name}-P{P}")
        for which, rs, info in (("sim", rows, {"name": "sim"}),
                                ("torch", got[0]["rows"][name], torch_backend_info(sc, P, launcher="sparsim run"))):
            d = base / which
            d.mkdir()
            write_run_directory(d, sc, built, rs, 0.0, figure=False, backend=info)
            out["dirs"][(name, which)] = d
    return out


def _csv(d):
    with open(d / "metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))


# ------------------------------------------------------------------------------------------ 1. torch backend


@pytest.mark.parametrize("name", list(NETS))
def test_backend_metrics_csv_equals_simulator(runs, name):
    sim, tor = _csv(runs["dirs"][(name, "sim")]), _csv(runs["dirs"][(name, "torch")])
    assert [(r["algorithm"], r["iteration"]) for r in tor] == [(r["algorithm"], r["iteration"]) for r in sim]
    assert {r["algorithm"].split("[")[0] for r in sim} == set(NETS[name][0])  # e.g. "gtopk[layerwise]": segments
    for a, b in zip(sim, tor):
        where = f"{name} P={runs['P']} {a['algorithm']} iteration {a['iteration']}"
        for col in a:
            if col in TIME_COLUMNS or col == "bytes_sent":
                continue
            assert a[col] == b[col], f"{where} column {col}: simulator {a[col]} != torch {b[col]}"
        # bytes_sent: a [model] run's simulator takes it from the network's timeline (the clock), the backend from the
        # programs' messages. Equal for dense, Top-k and gTop-k; DGC's threshold selection sends at most the k per
        # bucket the clock charges; PowerSGD is not compared (the clock charges it per DDP bucket, while the numerics
        # compress the whole model as one matrix: only sparse algorithms get per-bucket segments)
        alg = a["algorithm"].split("[")[0]
        if alg in ("dense", "topk", "gtopk"):  # means over ranks, summed in another order at P = 3
            assert math.isclose(float(a["bytes_sent"]), float(b["bytes_sent"]), rel_tol=1e-12), where
        elif alg == "dgc" and a["iteration"] != "0":
            assert 0 < float(b["bytes_sent"]) <= float(a["bytes_sent"]), where
        if name != "resnet20" or a["iteration"] in ("0", str(T)):  # evaluated rows: a network's four columns
            for col in ("loss", "test_accuracy", "test_loss", "train_accuracy"):
                assert a[col] != "", f"{where}: {col} empty"
        if a["iteration"] != "0":  # measured wall time
            assert float(b["iter_time_s"]) > 0, where


def test_backend_runs_the_simulators_iterations_within_the_time_budget(runs):
    sim, tor = _csv(runs["dirs"][("mlp-256", "sim")]), _csv(runs["dirs"][("mlp-256", "torch")])
    last = {}
    for r in sim:
        last[r["algorithm"]] = int(r["iteration"])
    # the budget ends dense's run after one iteration on the simulated clock; the others run all T within it
    assert last == {"dense": 1, "dgc": T, "powersgd": T, "gtopk": T}
    assert max(float(r["sim_time_s"]) for r in sim) <= runs["budget"]
    assert {r["algorithm"]: int(r["iteration"]) for r in tor} == last  # rows in order: the last one wins


@pytest.mark.parametrize("name", list(NETS))
def test_backend_summary_says_the_times_are_measured(runs, name):
    from experiments.torch_run import TORCH_NET_CLOCK

    s_sim = json.loads((runs["dirs"][(name, "sim")] / "summary.json").read_text())
    s_tor = json.loads((runs["dirs"][(name, "torch")] / "summary.json").read_text())
    assert s_tor["mode"] == s_sim["mode"] == "network on images"
    assert s_tor["resolved"]["clock"] == TORCH_NET_CLOCK and "measured wall time" in TORCH_NET_CLOCK
    assert "lock-step" in s_sim["resolved"]["clock"] and "backend" not in s_sim
    assert s_tor["backend"]["name"] == "torch" and "measured" in s_tor["backend"]["time_columns"]
    # the numerics' settings agree: the same segments (workload.sparse_policy) on both backends
    assert s_tor["resolved"]["segments"] == s_sim["resolved"]["segments"]
    assert set(s_tor["totals"]) == set(s_sim["totals"])
    for alg, ts in s_sim["totals"].items():
        tt = s_tor["totals"][alg]
        for key in ("iterations", "final_loss", "final_grad_norm_sq", "max_delta", "final_train_accuracy",
                    "final_test_loss", "final_test_accuracy", "best_test_accuracy", "best_test_iteration"):
            assert tt[key] == ts[key], (name, alg, key)


# ------------------------------------------------------------------------------------------ 2. DDP hook


def _rel(a, b, x0):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b - x0))


_MODULES = {}


def _module(name):
    from sim.workloads.nets import build_net

    if name not in _MODULES:
        _MODULES[name] = build_net(name)
    return _MODULES[name]


@pytest.mark.parametrize("case", list(DDP_CASES), ids=["-".join(c) for c in DDP_CASES])
def test_ddp_follows_the_simulators_per_bucket_policy(runs, case):
    name, label = case
    algorithm, where = DDP_CASES[case]
    P = runs["P"]
    ref = runs["traj"][(name, algorithm or "dense")]
    x0 = runs["x0"][name]
    exact = algorithm is not None and where == "hook"
    for r in range(P):
        traj, layouts, _ = runs["ranks"][r]["ddp"][case]
        assert len(traj) == T
        for t in range(T):
            what = f"{name} {label} P={P} rank {r} iteration {t + 1}"
            if exact:
                assert np.array_equal(traj[t], ref[t]), \
                    f"{what}: DDP hook != simulator (relative difference {_rel(traj[t], ref[t], x0):.3g})"
            else:
                rel = _rel(traj[t], ref[t], x0)
                assert rel <= ROUNDING_RTOL, f"{what}: relative difference {rel:.3g} > {ROUNDING_RTOL:g}"
        if algorithm is not None:  # every step's DDP buckets are the simulator's segments (in flat-vector position)
            segments = runs["segments"][(name, algorithm)]
            sizes = [p.numel() for p in _module(name).parameters()]
            for step in layouts:
                spans = sorted((min(b), sum(sizes[i] for i in b)) for b in step)
                assert tuple(n for _, n in spans) == segments, (what, step, segments)
            assert len(segments) > 1


def test_ddp_rank0_batchnorm_statistics_are_the_simulators(runs):
    sim = runs["buffers"][("resnet20", "gtopk")]
    ddp = runs["ranks"][0]["ddp"][("resnet20", "gtopk")][2]
    assert set(sim) == set(ddp) and any(k.endswith("running_mean") for k in sim)
    for k, b in sim.items():
        assert torch.equal(ddp[k], b), k
    assert int(sim["bn_1.num_batches_tracked"]) == T


def test_ddp_first_iteration_is_one_bucket(runs):
    """Why each DDP model settles its buckets first: a fresh DDP model's first backward communicates every parameter in
    one bucket (torch 2.13 without find_unused_parameters), which a per-bucket selection would select over as one
    unit. settle_buckets refuses to run once a hook is registered (the hook would count its backward as a step)."""
    n = sum(1 for _ in _module("lenet5").parameters())
    for r in range(runs["P"]):
        seen, refused = runs["ranks"][r]["first_buckets"]
        assert seen == [list(range(n))]
        assert refused is not None and refused.startswith("settle_buckets after a communication hook was registered")
