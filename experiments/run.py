"""Run a scenario: build the objective, shard the data, run each algorithm, write the run directory.

Run directory (written to ``DIR.partial`` and renamed to ``DIR`` only when complete, so a failed or
interrupted run never leaves a directory that looks finished):

- ``metrics.csv``: one row per (algorithm, iteration); columns in :data:`sim.engine.runner.METRIC_COLUMNS`.
- ``summary.json``: the fully resolved scenario, seed, package versions, derived constants and totals.
- ``figure.png`` / ``figure.pdf``: loss and grad_norm_sq against iteration and simulated time, the
  per-iteration time breakdown and delta over training, one line per algorithm.
"""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import shutil
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

import numpy as np

from sim.algorithms import AlgorithmSpec
from sim.machine.compute import ComputeModel
from sim.workloads.data import load_dataset, shard_indices
from sim.base.errors import ConfigError
from sim.machine.network import PRESETS, NetworkSpec, get_preset
from sim.machine.topology import CLUSTER_PRESETS, ClusterSpec, get_cluster_preset
from sim.workloads.objectives import make_objective
from sim.engine.runner import METRIC_COLUMNS, Workers

from .outdir import check_out, file_record, partial_dir, publish, write_csv
from .scenario import Scenario, used_keys_dump

log = logging.getLogger("sparsim.run")

__all__ = ["algorithm_specs", "build", "run_scenario", "write_metrics", "write_run_directory", "Built"]

REAL_OBJECTIVES = ("logistic", "softmax")
#: Largest model the simulator builds (parameters; every worker holds several float64 copies), the same
#: cap as the synthetic objectives' data.d, and the largest dense data matrix it generates (elements).
MAX_PARAMETERS = 10_000_000
MAX_DENSE_ELEMENTS = 250_000_000


class Built:
    """Everything a scenario resolves to: objective, workers, specs, network, compute, x0, schedule.

    check: optional callable ``check(d, data_bytes)`` called once d (parameters) and the bytes of the data and
    objective are known and before the objective and the workers' arrays are allocated (for a real data set
    after loading it, for synthetic_epsilon and the synthetic objectives before anything): run_scenario passes
    :func:`experiments.resources.check_resources`, which raises ResourceError for a run that does not fit.
    """

    def __init__(self, sc: Scenario, check=None):
        self.scenario = sc
        data = sc.data
        self.clock = None  # a [model] run's TimelineClock (the network's layer-wise timeline)
        self.workload = None
        if sc.model.name:
            labels = self._build_net(sc, check)
        elif data.objective in REAL_OBJECTIVES:
            if data.dataset == "libsvm" and not data.path:
                raise ConfigError("data.path is empty: dataset = libsvm needs the path of a LIBSVM-format file")
            kw = {"path": data.path} if data.dataset == "libsvm" else {}
            if data.dataset == "synthetic_epsilon":
                kw = {"n": data.n, "seed": sc.seed}
            if data.dataset == "synthetic_epsilon" and data.n * 2000 > MAX_DENSE_ELEMENTS:
                raise ConfigError(f"data.n = {data.n} is out of range for synthetic_epsilon (n x 2000 dense floats): "
                                  f"valid 1 <= n <= {MAX_DENSE_ELEMENTS // 2000}")
            if check is not None and data.dataset == "synthetic_epsilon":  # generated: known before it exists
                check(2000 * (2 if data.objective == "softmax" else 1), 8 * data.n * (2000 + 3 * 2 + 8))
            ds = load_dataset(data.dataset, **kw)
            d = ds.d * (ds.n_classes if data.objective == "softmax" else 1)
            if d > MAX_PARAMETERS:
                raise ConfigError(f"the model would have d = {d} parameters ({ds.d} features from {ds.name}"
                                  f"{f' x {ds.n_classes} classes' if data.objective == 'softmax' else ''}): "
                                  f"valid d <= {MAX_PARAMETERS}")
            if check is not None and data.dataset != "synthetic_epsilon":
                from .resources import data_bytes_dataset

                check(d, data_bytes_dataset(ds, data.objective))
            self.objective = make_objective(data.objective, dataset=ds, lam=data.lam, mu=data.mu).astype(
                sc.training.dtype)
            labels = ds.y
        else:
            if check is not None:
                from .resources import data_bytes_synthetic

                check(data.d, data_bytes_synthetic(data.objective, data.d, data.n))
            self.objective = make_objective(data.objective, d=data.d, n=data.n, seed=sc.seed).astype(sc.training.dtype)
            labels = None
        obj = self.objective
        P = sc.cluster.P
        if P > obj.n:
            raise ConfigError(f"cluster.P = {P} is out of range: valid 1 <= P <= n = {obj.n} samples")
        self.shards = shard_indices(obj.n, P, mode=data.sharding, labels=labels, seed=sc.seed)
        smallest = min(len(s) for s in self.shards)
        if sc.training.batch_size > smallest:
            raise ConfigError(
                f"training.batch_size = {sc.training.batch_size} is out of range: valid 1 <= batch_size <= "
                f"{smallest} (the smallest shard with P = {P})")
        self.workers = Workers(obj, self.shards, sc.training.batch_size, sc.seed)
        self.d = obj.d
        self.k = sc.k_for(self.d)
        if self.k > self.d:
            raise ConfigError(f"compression.k = {self.k} is out of range: valid 1 <= k <= d = {self.d}")
        self.network = build_network(sc.cluster, timing_only=bool(sc.model.name))
        G = self.network.gpus_per_node if isinstance(self.network, ClusterSpec) else 1
        self.compute = ComputeModel(seed=sc.seed, **sc.compute.model_dump())
        self.x0 = obj.x0(sc.seed)
        c = sc.compression
        self.specs = algorithm_specs(sc, self.k, G)
        if self.workload is not None:
            self._net_segments(sc)
        if c.layer_sizes:
            sizes = tuple(c.layer_sizes)
            if min(sizes) < 1 or sum(sizes) != self.d:
                raise ConfigError(f"compression.layer_sizes = {list(sizes)} (sum {sum(sizes)}) is out of range: valid sizes "
                                  f">= 1 summing to d = {self.d}")
            import dataclasses as _dc

            self.specs = [_dc.replace(s, segments=sizes) if s.algorithm.segmented else s for s in self.specs]
        if not isinstance(self.network, ClusterSpec):
            hier = [f"compression.{k}" for k in ("dense_collective", "topk_collective", "gtopk_collective")
                    if getattr(c, k) == "hierarchical"]
            if hier:
                raise ConfigError(f"{', '.join(hier)} = 'hierarchical' needs a hierarchical cluster: valid "
                                  f"cluster.network = {', '.join(CLUSTER_PRESETS)} or hierarchical "
                                  f"(here {sc.cluster.network!r})")
        tr = sc.training
        B = P * tr.batch_size
        T = tr.iterations
        if tr.schedule == "constant":
            self.lr = lambda t: tr.lr
        elif tr.schedule == "corollary2":
            a = tr.theta * math.sqrt(B / T)
            self.lr = lambda t: a
        else:
            self.lr = lambda t: tr.lr * tr.inverse_a / (tr.inverse_a + t)


    def _build_net(self, sc: Scenario, check):
        """A [model] run: the image data (sim.workloads.idx), the network (sim.workloads.nets) as the objective, its layer-wise
        workload; returns the training labels (for label sharding)."""
        from sim.workloads.idx import load_image_dataset
        from sim.workloads.nets import NET_PARAMS, NetObjective, build_net

        from .run_net import net_data_bytes

        m, tr = sc.model, sc.training
        if m.name not in NET_PARAMS:
            build_net(m.name)  # ConfigError naming the valid networks (and timing-only zoo models as such)
        ds = load_image_dataset(sc.data.dataset, sc.data.path)
        P, b = sc.cluster.P, tr.batch_size
        if P * b > ds.n_train:
            raise ConfigError(f"cluster.P x training.batch_size = {P} x {b} = {P * b} samples per step is out of range: "
                              f"valid P x batch_size <= {ds.n_train} training images of {sc.data.dataset}")
        d = NET_PARAMS[m.name]
        if check is not None:
            check(d, net_data_bytes(ds, sc))
        module = build_net(m.name, seed=sc.seed, dtype=tr.dtype)
        self.objective = NetObjective(module, ds.X_train, ds.y_train, ds.X_test, ds.y_test, dtype=tr.dtype,
                                      eval_samples=m.eval_samples, test_samples=m.test_samples, gradients=m.gradients,
                                      chunk=b, name=m.name)
        self.workload = self.objective.workload()
        self.dataset = ds
        return ds.y_train

    def _net_segments(self, sc: Scenario):
        """A [model] run: the timeline clock, and per-bucket / per-layer exchange on the network's own tensors (the
        buckets the timeline communicates) for the segmented algorithms. Raises ConfigError for a dense-like segmented
        algorithm (PowerSGD) under Horovod's fusion, and for buckets that are not consecutive in the flat vector."""
        import dataclasses as _dc

        from sim.engine.timeline import TimelineClock, ddp_buckets, flat_segments, layer_buckets

        from .workload_run import _policy, resolve_device

        policy = _policy(sc)
        dev = resolve_device(sc)
        self.clock = TimelineClock(self.workload, sc.cluster.P, self.network, policy,
                                   dev, sc.training.batch_size, self.compute, sc.cluster.engine,
                                   sc.training.time_budget_s)
        # the numerics exchange per segment exactly as the timeline communicates: sparse algorithms per the sparse
        # policy's buckets or layers; dense-like segmented ones (PowerSGD: one matrix per DDP bucket, as torch's hook)
        # per DDP bucket under dense_policy = "ddp"; dense itself sums the same vector either way (not segmented)
        vb = sc.compression.value_bytes
        sparse_sizes = None if policy.sparse == "model" else flat_segments(
            self.workload, ddp_buckets(self.workload, policy, vb) if policy.sparse == "bucket"
            else layer_buckets(self.workload))
        dense_like = [s for s in self.specs if not s.algorithm.sparse and s.algorithm.segmented]
        dense_sizes = None
        if dense_like and policy.dense == "horovod":
            raise ConfigError(f"workload.dense_policy = 'horovod' with {dense_like[0].label}: Horovod's fusion buffers "
                              "depend on the gradients' ready times, so the numerics cannot exchange per buffer as the "
                              "timeline does: valid dense_policy ddp or none for it")
        if dense_like and policy.dense == "ddp":
            dense_sizes = flat_segments(self.workload, ddp_buckets(self.workload, policy, vb))
        sparse_sizes, dense_sizes = (None if z is None or len(z) < 2 else z for z in (sparse_sizes, dense_sizes))
        self.specs = [s if not s.algorithm.segmented else
                      _dc.replace(s, segments=sparse_sizes) if s.algorithm.sparse and sparse_sizes is not None else
                      _dc.replace(s, segments=dense_sizes) if not s.algorithm.sparse and dense_sizes is not None else s
                      for s in self.specs]


def algorithm_specs(sc: Scenario, k: int, G: int) -> list[AlgorithmSpec]:
    """The scenario's algorithms as :class:`~sim.algorithms.AlgorithmSpec`, in order: k selected coordinates
    per worker (sparse algorithms), the collectives and settings each algorithm reads from [compression]
    (:meth:`~sim.algorithms.Algorithm.scenario_settings`), its [algorithm.NAME] options, the training
    momentum and weight decay, the byte sizes, G ranks per node for the hierarchical collectives.
    Whole-model selection (a numerics run adds its layer split afterwards). Raises ConfigError as
    AlgorithmSpec does."""
    from sim.algorithms import get, resolve

    c, tr = sc.compression, sc.training
    out = []
    for entry in sc.algorithms:
        name, preset = resolve(entry)
        algo = get(name)
        opts = dict(sc.algorithm.get(name, {}))
        kw = dict(value_bytes=c.value_bytes, gpus_per_node=G)
        kw.update(algo.scenario_settings(c))
        if "collective" in opts:
            kw["collective"] = opts.pop("collective")
        if algo.sparse:
            kw.update(k=k, index_bytes=c.index_bytes)
        if algo.uses_seed:
            kw["seed"] = sc.seed
        if tr.momentum:
            kw["momentum"] = tr.momentum
        if tr.weight_decay:
            kw["weight_decay"] = tr.weight_decay
        kw.update(preset)
        out.append(AlgorithmSpec(name, options=tuple(opts.items()), **kw))
    return out


def build_network(cl, timing_only: bool = False) -> "NetworkSpec | ClusterSpec":
    """The network of a scenario's [cluster] table: a flat :class:`NetworkSpec` (presets 1GbE, 10GbE, IB100,
    or custom) or a hierarchical :class:`ClusterSpec` (a cluster preset, or ``hierarchical`` from the keys).
    Raises ConfigError when gpus_per_node does not divide P, for quantum_s > 0 on a hierarchical cluster, and
    for engine = fast unless ``timing_only`` (a run with numerics is simulated message by message; a workload
    timeline is timing only)."""
    if cl.engine == "fast" and not timing_only:
        raise ConfigError("cluster.engine = 'fast' simulates timing-only iterations (sparsim predict --simulate, "
                          "sparsim experiment scaling, a [workload] run); a run with numerics uses the message-level engine: valid "
                          "engine = auto or message here")
    if cl.network == "custom":
        return NetworkSpec.from_alpha_beta(cl.alpha_s, 1.0 / cl.bandwidth_Bps, cl.topology, cl.quantum_s)
    if cl.network in CLUSTER_PRESETS or cl.network == "hierarchical":
        if cl.quantum_s > 0:
            raise ConfigError(f"cluster.quantum_s = {cl.quantum_s} applies to flat networks only: valid 0 with "
                              f"network = {cl.network!r}")
        G = CLUSTER_PRESETS[cl.network].gpus_per_node if cl.network in CLUSTER_PRESETS else cl.gpus_per_node
        if cl.P % G:
            raise ConfigError(f"cluster.P = {cl.P} is not a multiple of gpus_per_node = {G} (network = {cl.network!r}): "
                              f"valid P = {G}, {2 * G}, {3 * G}, ...")
        if cl.network in CLUSTER_PRESETS:
            return get_cluster_preset(cl.network, cl.P)
        return ClusterSpec(cl.P // G, G, cl.intra, cl.intra_alpha_s, cl.intra_bandwidth_Bps, cl.alpha_s,
                           cl.bandwidth_Bps, cl.nics_per_node, cl.nodes_per_leaf, cl.oversubscription,
                           cl.spine_alpha_s, name="hierarchical")
    if cl.network not in PRESETS:
        raise ConfigError(f"cluster.network = {cl.network!r} is unknown: valid {', '.join(PRESETS)}, custom, "
                          f"{', '.join(CLUSTER_PRESETS)}, hierarchical")
    base = get_preset(cl.network)
    return NetworkSpec(base.topology, base.link_latency_s, base.link_bandwidth_Bps, cl.quantum_s)


def network_summary(net) -> dict:
    """summary.json's description of the network: its fields, and the end-to-end alpha (s) and beta (s/byte)
    of a message between nodes (``alpha_s``, ``beta_s_per_byte``) and, for a hierarchical cluster, inside one
    (``intra_alpha_s``, ``intra_beta_s_per_byte``), plus the engine the run used."""
    if isinstance(net, ClusterSpec):
        (ai, bi), (ae, be) = net.intra_alpha_beta(), net.inter_alpha_beta()
        return {**asdict(net), "P": net.P, "alpha_s": ae, "beta_s_per_byte": be, "intra_alpha_s": ai,
                "intra_beta_s_per_byte": bi, "engine": "message"}
    a, b = net.end_to_end_alpha_beta()
    return {**asdict(net), "alpha_s": a, "beta_s_per_byte": b, "engine": "message"}


def build(sc: Scenario, check=None) -> Built:
    """Resolve a validated scenario into runnable parts. Raises SparsimError for inconsistent values, and
    whatever ``check(d, data_bytes)`` raises before the run's arrays are allocated (see :class:`Built`)."""
    return Built(sc, check)


def run_id(sc: Scenario, backend: str = "sim") -> str:
    """A run's identity in metrics.csv's ``run_id`` column: the first 16 hex digits of the sha256 of the keys the
    run uses (:func:`experiments.scenario.used_keys_dump`, canonical JSON) and the backend, so rows of different
    runs concatenated stay apart, the same scenario gives the same id on every machine, and a key added for
    another kind of run does not change this one's id. training.dtype, momentum and weight_decay and the
    [algorithm] table enter only when set away from their defaults."""
    import hashlib

    dump = used_keys_dump(sc, backend if backend in ("sim", "torch") else "sim")
    # keys added after a run kind existed enter only when set away from their default, so old ids stay valid
    for table, key, default in (("training", "dtype", "float64"), ("training", "momentum", 0.0),
                                ("training", "weight_decay", 0.0), ("torch", "select_device", "auto")):
        if dump.get(table, {}).get(key, default) == default:
            dump.get(table, {}).pop(key, None)
    if not dump.get("algorithm", True):
        del dump["algorithm"]
    tr = dump.get("training", {})
    if "schedule" in tr:  # the schedule's unused step keys (at their defaults: others are refused) entered the old ids
        for key in ("lr", "theta", "inverse_a"):
            tr.setdefault(key, getattr(sc.training, key))
    text = json.dumps({"scenario": dump, "backend": backend}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def provenance() -> dict:
    """summary.json's ``provenance``: the command line, the UTC time the run finished, the git revision of the
    code (None outside a git checkout) and the summary's schema version."""
    import datetime
    import subprocess
    import sys

    rev = None
    try:
        here = Path(__file__).resolve().parent.parent
        if (here / ".git").exists():
            rev = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                                 timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        rev = None
    return {"command": " ".join(sys.argv), "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "git_revision": rev, "schema_version": SUMMARY_SCHEMA_VERSION}


#: Version of summary.json's layout (2: provenance, metrics_csv checksum, run_id column).
SUMMARY_SCHEMA_VERSION = 2


def write_metrics(path: Path, rows: list[dict], rid: str | None = None) -> None:
    """Write rows to CSV with the :data:`METRIC_COLUMNS` header; floats in repr (round-trip) form, nan/None empty.
    rid: the run's :func:`run_id`, written in every row's ``run_id`` column (rows keep any they already have)."""
    if rid is not None:
        for r in rows:
            r.setdefault("run_id", rid)
    write_csv(path, METRIC_COLUMNS, rows)


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("sparsim", "numpy", "scipy", "simpy", "sympy", "scikit-learn", "matplotlib"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _totals(rows: list[dict]) -> dict:
    last = rows[-1]
    it = [r for r in rows if r["iteration"] > 0]
    n = max(len(it), 1)
    evald = [r for r in rows if not math.isnan(r["loss"])]
    deltas = [r["delta"] for r in it if r["delta"] is not None and not math.isnan(r["delta"])]
    return {
        "iterations": len(it),
        "sim_time_s": last["sim_time_s"],
        "mean_iter_time_s": sum(r["iter_time_s"] for r in it) / n,
        "mean_compute_s": sum(r["compute_s"] for r in it) / n,
        "mean_compress_s": sum(r["compress_s"] for r in it) / n,
        "mean_comm_s": sum(r["comm_s"] for r in it) / n,
        "bytes_sent_per_worker": sum(r["bytes_sent"] for r in it),
        "initial_loss": rows[0]["loss"],
        "final_loss": evald[-1]["loss"],
        "final_grad_norm_sq": evald[-1]["grad_norm_sq"],
        "min_grad_norm_sq": min(r["grad_norm_sq"] for r in evald),
        "max_delta": max(deltas) if deltas else None,
        "mean_delta": (sum(deltas) / len(deltas)) if deltas else None,
        "max_mass_error": max(r["mass_error"] for r in rows),
        **_accuracy_totals(evald),
    }


def _accuracy_totals(evald: list[dict]) -> dict:
    """A [model] run's accuracy totals from its evaluated rows: the final train / test accuracy and test loss,
    and the best test accuracy with its iteration and simulated time; {} for an objective without them."""
    acc = [r for r in evald if not math.isnan(r.get("test_accuracy", math.nan))]
    if not acc:
        return {}
    best = max(acc, key=lambda r: r["test_accuracy"])
    return {"final_train_accuracy": acc[-1]["train_accuracy"], "final_test_loss": acc[-1]["test_loss"],
            "final_test_accuracy": acc[-1]["test_accuracy"], "best_test_accuracy": best["test_accuracy"],
            "best_test_iteration": best["iteration"], "best_test_sim_time_s": best["sim_time_s"]}


def run_scenario(sc: Scenario, out: str | os.PathLike, *, force: bool = False, progress: bool = True,
                 figure: bool = True, backend: str = "sim", nproc: int | None = None, yes: bool = False,
                 jobs: int | None = None) -> Path:
    """Run every algorithm of ``sc`` and write the run directory ``out``; return its path.

    The directory is built as ``out.partial`` and renamed when complete. Raises ConfigError if ``out``
    exists and is not empty (unless ``force``), and any SparsimError of the run (the partial directory
    is removed).

    Before anything large is allocated, :func:`experiments.resources.check_resources` holds the run's memory
    estimate against the machine's available memory and its estimated work against
    :data:`experiments.resources.MAX_WORK`; it raises ResourceError (one line, naming the estimate and the
    limit) when the run does not fit, or when the work is above the limit and ``yes`` is false (``--yes``).
    progress: tqdm bars (on a terminal only) with the whole run's remaining wall time, estimated from the
    iterations done so far.

    backend: "sim" (the SimPy cluster; simulated times) or "torch" (``nproc`` local processes over
    torch.distributed on loopback, :mod:`sim.distributed.backend`; the time columns are measured wall times
    iter_time_s is the slowest rank's step time and sim_time_s their running sum). nproc: must equal cluster.P (None: cluster.P).
    The torch settings come from the scenario's ``[torch]`` section (:class:`~experiments.scenario.TorchCfg`):
    timeout_s (seconds a rank may wait on a peer before the run fails), stall_timeout_s (seconds every
    rank may go without progress; 0 = no limit), dist_backend ("gloo", "nccl" or "auto") and backend_allreduce (dense uses
    torch.distributed.all_reduce). When a torch rank fails, :class:`sim.distributed.backend.WorkerFailure` is raised naming the
    rank and ``out.partial/error.txt`` records it (``out`` is not created).

    jobs (backend "sim"): how many algorithms are simulated at the same time, each in a forked process
    (:mod:`experiments.algorithm_pool`; the same rows in the same order); None: as many as there are algorithms,
    at most twice the usable cores and what half the available memory holds; 1: one after another. Raises ConfigError
    for jobs < 1 and ResourceError when an explicit jobs does not fit in memory.
    """
    out = Path(out)
    if backend not in ("sim", "torch"):
        raise ConfigError(f"backend = {backend!r} is unknown: valid sim, torch")
    from .algorithm_pool import algorithm_jobs, check_jobs, run_algorithms

    check_jobs(jobs)  # a bad --jobs fails before anything is built
    if jobs is not None and (backend != "sim" or sc.workload.active):
        raise ConfigError("--jobs runs the simulator's algorithms in parallel: valid with --backend sim and without "
                          "workload.model / workload.table (a workload run is one timeline)")
    if jobs is not None and jobs > 1 and sc.model.name:
        raise ConfigError(f"--jobs {jobs} with model.name = {sc.model.name!r}: torch cannot run in a forked process "
                          "once its thread pool has started, and the per-worker gradients spread over the cores already "
                          "(sim.workloads.nets), so its algorithms run one after another: valid --jobs 1 or none")
    if sc.workload.active:
        if backend != "sim" or nproc is not None:
            raise ConfigError("workload.model / workload.table simulate a real model's iteration timeline: valid "
                              "--backend sim (without --nproc)")
        from .workload_run import run_workload

        return run_workload(sc, out, force=force, progress=progress, figure=figure, yes=yes)
    timeout_s, dist_backend = sc.torch.timeout_s, sc.torch.dist_backend
    backend_allreduce = sc.torch.backend_allreduce
    if backend == "sim" and (nproc is not None or backend_allreduce):
        raise ConfigError("--nproc and --backend-allreduce (torch.backend_allreduce) need --backend torch")
    if nproc is not None and nproc != sc.cluster.P:
        raise ConfigError(f"--nproc {nproc} differs from cluster.P = {sc.cluster.P}: they must be equal")
    check_out(out, force)
    if backend == "torch":
        _check_torch()
        if dist_backend == "nccl":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("torch.dist_backend = 'nccl' (--dist-backend) needs a CUDA GPU and none is "
                                  "visible: use gloo")
        if sc.torch.select_device == "cuda":
            from sim.distributed.backend import resolve_select_device

            resolve_select_device("cuda")  # ConfigError now, before any rank starts, when no GPU is visible
        if backend_allreduce and "dense" not in sc.algorithms:
            raise ConfigError("torch.backend_allreduce (--backend-allreduce) needs dense among the algorithms")
    from .resources import check_resources

    estimate: dict = {}

    def check(d, data_bytes):
        estimate.update(check_resources(sc, d, data_bytes, backend=backend, yes=yes))

    built = build(sc, check)
    tmp = partial_dir(out)
    try:
        t_wall = time.perf_counter()
        if backend == "sim":
            clock = _RunClock(sc.training.iterations * len(built.specs))
            # a [model] run: torch does not survive fork, and its per-worker gradients spread over the cores already
            n_jobs = 1 if sc.model.name else algorithm_jobs(jobs, len(built.specs), estimate or None)
            per_spec = run_algorithms(built.specs, built, T=sc.training.iterations,
                                      eval_every=sc.training.eval_every, jobs=n_jobs,
                                      bar_for=lambda spec: _progress(spec.label, sc.training.iterations, progress,
                                                                     clock))
            rows = [row for r in per_spec for row in r]
            info = {"name": "sim"}
        else:
            from sim.distributed.backend import WorkerFailure, launch_local

            from .torch_run import scenario_job

            try:
                results = launch_local(sc.cluster.P, scenario_job, (sc.model_dump(),),
                                       timeout_s=timeout_s, backend=dist_backend,
                                       stall_timeout_s=sc.torch.stall_timeout_s or None)
            except WorkerFailure as err:  # the terminal gets one line; error.txt also keeps the ranks' logs
                (tmp / "error.txt").write_text(f"{err}\n" + (f"\n{err.log}" if err.log else ""))
                tmp = None  # keep DIR.partial/error.txt as the record of the failure
                raise
            rows = results[0]
            info = torch_backend_info(sc, sc.cluster.P, launcher="sparsim run")
        write_run_directory(tmp, sc, built, rows, time.perf_counter() - t_wall, figure=figure, backend=info)
        publish(tmp, out)
        log.info("published %s (%.2f s of wall time)", out, time.perf_counter() - t_wall)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def torch_backend_info(sc: Scenario, nproc: int, *, launcher: str) -> dict:
    """The ``backend`` entry of a torch run's summary.json: the scenario's [torch] settings, the number
    of processes, the launcher ("sparsim run" or "torchrun"), torch's version and what the time columns mean."""
    t = sc.torch
    return {"name": "torch", "launcher": launcher, "dist_backend": t.dist_backend, "nproc": nproc,
            "timeout_s": t.timeout_s, "stall_timeout_s": t.stall_timeout_s, "backend_allreduce": t.backend_allreduce,
            "torch": _torch_version(),
            "time_columns": "measured wall time per rank (s), averaged over ranks; iter_time_s = the slowest rank's "
                            "step time, sim_time_s = their running sum"}


def _check_torch(what: str = "--backend torch"):
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} needs PyTorch: pip install -e '.[torch]' in the clone (torch==2.13.0)") from None


def _torch_version():
    try:
        import torch

        return torch.__version__
    except ImportError:  # pragma: no cover
        return None


def write_run_directory(tmp: Path, sc: Scenario, built: "Built", rows: list[dict], wall_s: float, *,
                        figure: bool = True, backend: dict | None = None) -> None:
    """Write metrics.csv, summary.json and the figure of a finished run into directory ``tmp``.

    rows: the metrics rows of every algorithm in order (:data:`METRIC_COLUMNS`). wall_s: the run's wall
    time (s). backend: a dict describing the backend, stored as summary["backend"] (default sim).
    """
    segments: list[list[dict]] = []
    for r in rows:  # each algorithm's rows start with its iteration-0 row
        if r["iteration"] == 0 or not segments:
            segments.append([])
        segments[-1].append(r)
    per_alg = {seg[0]["algorithm"]: _totals(seg) for seg in segments}
    write_metrics(tmp / "metrics.csv", rows, run_id(sc, (backend or {}).get("name", "sim")))
    summary = {
        "scenario": used_keys_dump(sc, (backend or {}).get("name", "sim")),
        "seed": sc.seed,
        "resolved": {
            "d": built.d, "k": built.k, "compression_ratio_c": built.d / built.k, "density": built.k / built.d,
            **_selected_per_worker(built),
            "n_samples": built.objective.n, "P": sc.cluster.P, "global_batch_B": sc.cluster.P * sc.training.batch_size,
            "network": network_summary(built.network),
            "lr_first": built.lr(1),
            "objective": type(built.objective).__name__,
            "constants": built.objective.constants(),
            "x0_loss": rows[0]["loss"],
        },
        "algorithms": [asdict(s) for s in built.specs],
        "totals": per_alg,
        "versions": _versions(),
        "wall_time_s": wall_s,
        "metrics_csv": file_record(tmp / "metrics.csv", rows),
        "provenance": provenance(),
    }
    if backend is not None and backend.get("name") != "sim":
        summary["backend"] = backend
    if built.clock is not None:
        from .run_net import net_resolved

        summary["mode"] = "network on images"
        summary["resolved"].update(net_resolved(sc, built))
        if backend is not None and backend.get("name") == "torch":  # measured times, not the network's timeline
            from .torch_run import TORCH_NET_CLOCK

            summary["resolved"]["clock"] = TORCH_NET_CLOCK
        else:
            from .run_net import write_net_trace

            write_net_trace(tmp / "trace.json", sc, built, rows)
    with open(tmp / "summary.json", "w") as fh:
        json.dump(summary, fh, indent=2, default=_json_default)
    if figure:
        from .plots import run_figure

        where = sc.cluster.network if not backend or backend.get("name") == "sim" else \
            f"torch/{backend.get('dist_backend')} measured"
        run_figure(rows, tmp, title=f"{sc.name}: P = {sc.cluster.P}, d = {built.d}, k = {built.k}, {where}")


def _selected_per_worker(built: "Built") -> dict:
    """summary.json's record of what a layer-wise run selects: with segments (compression.layer_sizes, or a [model]
    run's per-bucket / per-layer policy) each segment of d_b elements selects k_b = min(d_b, max(1, round(k d_b /
    d))) (:func:`sim.algorithms.base.segment_k`), so a worker selects sum_b k_b, not k: ``k_selected_per_worker``
    (that sum), ``n_segments`` (their count) and ``compression_ratio_c_selected`` (d over the sum). {} for whole-model
    selection."""
    spec = next((s for s in built.specs if s.segments is not None and s.algorithm.sparse), None)
    if spec is None or len(spec.segments) < 2:
        return {}
    ks = spec.segment_ks(built.d)
    return {"k_selected_per_worker": int(sum(ks)), "n_segments": len(ks),
            "compression_ratio_c_selected": built.d / sum(ks)}


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


class _RunClock:
    """Wall time of a whole run (every algorithm), estimated from the iterations done so far.

    total: iterations of the whole run (algorithms x T). :meth:`tick` counts one; :meth:`remaining_s` is
    elapsed / done x (total - done) in seconds, None before the first iteration."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def tick(self) -> None:
        self.done += 1

    def remaining_s(self) -> float | None:
        if self.done == 0:
            return None
        return (time.perf_counter() - self.t0) / self.done * (self.total - self.done)


def _fmt_wall(s: float) -> str:
    """Seconds as ``1h02m``, ``3m05s`` or ``42s``."""
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class _progress:
    """A tqdm bar over one algorithm's iterations, shown only when stderr is a terminal and the run lasts
    more than 2 s; its postfix is the whole run's remaining wall time (every algorithm), estimated from the
    iterations done so far (``clock``, a :class:`_RunClock`)."""

    def __init__(self, label, total, enabled, clock: _RunClock | None = None):
        self.bar = None
        self.clock = clock
        if enabled:
            from tqdm import tqdm

            # disable=None: no bar when stderr is not a terminal (logs, pipes, tests)
            self.bar = tqdm(total=total, desc=label, unit="it", delay=2.0, leave=False, disable=None)
            if self.bar.disable:
                self.bar = None

    @property
    def shown(self) -> bool:
        """Whether the bar is drawn (stderr is a terminal and progress was asked for)."""
        return self.bar is not None

    def on_row(self, row):
        if row["iteration"] > 0 and self.clock is not None:
            self.clock.tick()
        if self.bar is not None and row["iteration"] > 0:
            left = self.clock.remaining_s() if self.clock is not None else None
            if left is not None:
                self.bar.set_postfix_str(f"run ~{_fmt_wall(left)} left", refresh=False)
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()
