"""Build a scenario: load the data, make the objective and the workers, resolve the algorithms, network, compute
model, x0 and step-size schedule into one :class:`Built`, the input of every numerics run (the simulator's
:mod:`experiments.run`, the torch backend's :mod:`experiments.torch_run`) and of ``sparsim check``.

The parts that need no data come from :mod:`experiments.resolve`; the data-size estimates that the resource
check holds against this machine come from :mod:`experiments.resources` and, for a [model] run,
:mod:`experiments.run_net`.
"""
from __future__ import annotations

import dataclasses
import math

from sim.workloads.data import load_dataset, shard_indices
from sim.base.errors import ConfigError
from sim.machine.topology import CLUSTER_PRESETS, ClusterSpec
from sim.workloads.objectives import make_objective
from sim.engine.runner import Workers

from .resolve import algorithm_specs, build_network, resolve_compute, resolve_device, timeline_clock, timeline_policy
from .resources import data_bytes_dataset, data_bytes_synthetic
from .run_net import net_data_bytes
from .scenario import Scenario

__all__ = ["Built", "build", "REAL_OBJECTIVES", "MAX_PARAMETERS", "MAX_DENSE_ELEMENTS"]

#: The objectives trained on a data set (data.dataset); the others are synthetic (data.d, data.n).
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
                check(d, data_bytes_dataset(ds, data.objective))
            self.objective = make_objective(data.objective, dataset=ds, lam=data.lam, mu=data.mu).astype(
                sc.training.dtype)
            labels = ds.y
        else:
            if check is not None:
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
        self.compute = resolve_compute(sc, resolve_device(sc) if sc.model.name else None)
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
            self.specs = [dataclasses.replace(s, segments=sizes) if s.algorithm.segmented else s for s in self.specs]
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
        buckets the timeline communicates) for the segmented algorithms; under sparse_policy = "hybrid" the plan's
        buckets with their densities, dense buckets exchanged by the dense allreduce (AlgorithmSpec.segment_densities).
        Raises ConfigError for a dense-like segmented algorithm (PowerSGD) under Horovod's fusion, for buckets that are
        not consecutive in the flat vector, and for a plan of another model or buckets, or a sparse algorithm the
        hybrid policy cannot run (a local momentum: DGC)."""
        from sim.engine.timeline import ddp_buckets, flat_segments, layer_buckets

        policy = timeline_policy(sc)
        self.clock = timeline_clock(sc, self.workload, self.network, self.compute, sc.training.time_budget_s)
        # the numerics exchange per segment exactly as the timeline communicates: sparse algorithms per the sparse
        # policy's buckets or layers; dense-like segmented ones (PowerSGD: one matrix per DDP bucket, as torch's hook)
        # per DDP bucket under dense_policy = "ddp"; dense itself sums the same vector either way (not segmented)
        vb = sc.compression.value_bytes
        hybrid = None  # sparse_policy = "hybrid": the plan's segment densities (flat order), None for dense buckets
        if policy.sparse == "hybrid":
            from sim.engine.hybrid import plan_segments

            sparse_sizes, hybrid = plan_segments(policy.plan, self.workload, policy, vb)
        else:
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
        if hybrid is None:
            sparse_sizes = None if sparse_sizes is None or len(sparse_sizes) < 2 else sparse_sizes
        dense_sizes = None if dense_sizes is None or len(dense_sizes) < 2 else dense_sizes
        hyb = {} if hybrid is None else {"segment_densities": hybrid, "dense_collective": policy.plan.dense_collective}
        self.specs = [s if not s.algorithm.segmented else
                      dataclasses.replace(s, segments=sparse_sizes, **hyb) if s.algorithm.sparse and sparse_sizes is not None else
                      dataclasses.replace(s, segments=dense_sizes) if not s.algorithm.sparse and dense_sizes is not None else s
                      for s in self.specs]


def build(sc: Scenario, check=None) -> Built:
    """Resolve a validated scenario into runnable parts. Raises SparsimError for inconsistent values, and
    whatever ``check(d, data_bytes)`` raises before the run's arrays are allocated (see :class:`Built`)."""
    return Built(sc, check)


