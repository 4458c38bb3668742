"""Scenarios: TOML files validated against a schema (pydantic), with ``--set dotted.key=value`` overrides.

Every key, its unit and default is listed in the README (generated from this schema by
``sparsim scenario keys``). Unknown keys, wrong types and out-of-range values raise
:class:`~sim.base.errors.ConfigError` with a one-line message naming the key, the value and the valid range.
"""
from __future__ import annotations

import os
import tomllib
from importlib import resources
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sim.machine.compute import MAX_COEFF_S, MAX_FORWARD_BACKWARD_S, MAX_JITTER_SCALE, MAX_STRAGGLER_FACTOR
from sim.base.errors import ConfigError
from sim.machine.network import MAX_QUANTUM_S

__all__ = ["Scenario", "used_keys_dump", "cost_device", "load_scenario", "apply_overrides", "DEFAULT_SCENARIO_TEXT", "scenario_keys", "option_overrides",
           "MAX_REGULARISER"]

#: Largest weight of data.lam and data.mu: a regulariser 10^6 times the data term (whose per-sample losses are
#: O(1) on the bundled objectives) leaves nothing of the data to fit, and lam psi'' and mu enter the
#: smoothness constant L, so a step size stable for it would be below 1e-6.
MAX_REGULARISER = 1e6


class _Strict(BaseModel):
    # no unknown keys, no inf/nan, and no silent bool -> int/float coercion (P = true is an error, not P = 1)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bools(cls, v, info):
        ann = cls.model_fields[info.field_name].annotation
        if isinstance(v, bool) and ann in (int, float, int | None):
            # a type error (not a ValueError), so the message says what the key takes with its range
            from pydantic_core import PydanticCustomError

            kind = "int_type" if ann in (int, int | None) else "float_type"
            raise PydanticCustomError(kind, "expected a number, got the boolean {v}", {"v": v})
        return v

    def changed_keys(self, keys) -> list[str]:
        """Those of ``keys`` given a value other than their default (a dumped and reloaded scenario has every
        key set, at its default where the user gave none)."""
        return [k for k in keys if k in self.model_fields_set and getattr(self, k) != type(self).model_fields[k].default]


class ClusterCfg(_Strict):
    """The simulated cluster."""

    P: int = Field(8, ge=1, le=65536, description="workers (ranks); with a hierarchical cluster, nodes = P / gpus_per_node")
    network: str = Field("1GbE", description="flat presets 1GbE, 10GbE, IB100; custom (alpha_s, bandwidth_Bps, topology); "
                                             "cluster presets gtopk-icdcs, v100-25GbE, dgx-h100; hierarchical (the keys below)")
    topology: Literal["star", "ring", "direct"] = Field("star", description="topology when network = custom")
    alpha_s: float = Field(0.436e-3, ge=0, le=10, description="custom: end-to-end latency alpha (s); hierarchical: NIC-to-NIC latency (s)")
    bandwidth_Bps: float = Field(1 / 9e-9, ge=1, le=1e15, description="custom: end-to-end bandwidth (bytes/s), beta = 1/bandwidth s/byte; "
                                                             "hierarchical: bandwidth of one NIC (bytes/s)")
    quantum_s: float = Field(0.0, ge=0, le=MAX_QUANTUM_S, description="time quantum (s); 0 = exact float time, 1e-9 = ASTRA-sim integer ns (flat networks, message-level engine); "
                                                                  "a hop whose time it would truncate to 0 is an error")
    gpus_per_node: int = Field(1, ge=1, le=1024, description="hierarchical: ranks per node G (divides P)")
    nics_per_node: int = Field(1, ge=1, le=1024, description="hierarchical: NICs per node, a divisor of G (1 = one shared NIC, G = rail-optimised)")
    intra: Literal["nvswitch", "pcie"] = Field("nvswitch", description="hierarchical: intra-node fabric (nvswitch: a switch; pcie: through the host, shared with inter-node traffic)")
    intra_alpha_s: float = Field(5e-6, ge=0, le=10, description="hierarchical: GPU-to-GPU latency inside a node (s)")
    intra_bandwidth_Bps: float = Field(150e9, ge=1, le=1e15, description="hierarchical: GPU-to-GPU bandwidth inside a node (bytes/s)")
    nodes_per_leaf: int = Field(0, ge=0, le=65536, description="hierarchical: nodes per leaf switch of a leaf/spine fat tree; 0 = one non-blocking switch")
    oversubscription: float = Field(1.0, ge=1, le=1000, description="hierarchical: fat-tree leaf oversubscription (downlink / uplink capacity)")
    spine_alpha_s: float = Field(0.0, ge=0, le=10, description="hierarchical: extra latency of a leaf-spine-leaf crossing (s)")
    engine: Literal["auto", "message", "fast"] = Field("auto", description="timing engine: message (SimPy, every message an event), fast (vectorised rounds; timing-only), auto")

    #: keys that describe a hierarchical cluster: only meaningful with network = "hierarchical"
    HIERARCHY_KEYS: ClassVar[tuple[str, ...]] = ("gpus_per_node", "nics_per_node", "intra", "intra_alpha_s",
                                                 "intra_bandwidth_Bps", "nodes_per_leaf", "oversubscription",
                                                 "spine_alpha_s")

    @model_validator(mode="after")
    def _keys_in_use(self):
        for keys, where in ((("alpha_s", "bandwidth_Bps"), ("custom", "hierarchical")), (("topology",), ("custom",))):
            unused = self.changed_keys(keys)
            if unused and self.network not in where:
                raise ValueError(f"{', '.join('cluster.' + k for k in unused)}: used only with network = "
                                 f"{' or '.join(repr(w) for w in where)} (here network = {self.network!r}, whose "
                                 "preset fixes its own)")
        if self.network != "hierarchical":
            unused = self.changed_keys(self.HIERARCHY_KEYS)
            if unused:
                raise ValueError(f"{', '.join('cluster.' + k for k in unused)}: "
                                 f"{'describes' if len(unused) == 1 else 'describe'} a hierarchical cluster, used only "
                                 f"with network = 'hierarchical' (here network = {self.network!r}; the cluster presets "
                                 "fix their own)")
        return self


class ComputeCfg(_Strict):
    """Per-worker compute model."""

    forward_backward_s: float = Field(0.005, ge=0, le=MAX_FORWARD_BACKWARD_S, description="forward+backward time per iteration per worker (s)")
    jitter: Literal["none", "lognormal", "exponential"] = Field("none", description="random variation of forward_backward_s")
    jitter_scale: float = Field(0.0, ge=0, le=MAX_JITTER_SCALE, description="lognormal sigma, or exponential mean extra as a fraction")
    straggler_prob: float = Field(0.0, ge=0, le=1, description="probability a worker straggles in an iteration")
    straggler_factor: float = Field(1.0, ge=1, le=MAX_STRAGGLER_FACTOR, description="compute-time multiplier of a straggler")
    select_coeff_s: float | None = Field(None, ge=0, le=MAX_COEFF_S, description="top-k selection: seconds per x*log2(x), x = elements scanned; "
                                                                             "unset: the device's cost model (workload.device) in a workload or [model] run, "
                                                                             "else 2.19e-10 (the gTop-k authors' P102-100 fit)")
    merge_coeff_s: float | None = Field(None, ge=0, le=MAX_COEFF_S, description="gTop-k merge: seconds per element merged; unset: the device's cost model, else 0")
    reduce_coeff_s: float | None = Field(None, ge=0, le=MAX_COEFF_S, description="dense reduction: seconds per element added; unset: the device's cost model, else 0")
    update_coeff_s: float | None = Field(None, ge=0, le=MAX_COEFF_S, description="parameter update: seconds per parameter; unset: the device's cost model, else 0")
    scan_coeff_s: float | None = Field(None, ge=0, le=MAX_COEFF_S, description="a compressor's memory traffic (rand-k, Gaussian-k, DGC, PowerSGD): seconds per byte; "
                                                                           "unset: the device's memory model, else the P102-100's")
    matmul_coeff_s: float | None = Field(None, ge=0, le=MAX_COEFF_S, description="a compressor's matrix products (PowerSGD): seconds per FLOP; "
                                                                             "unset: the device's peak x efficiency, else the P102-100's")

    #: compute kind -> the key that sets its cost (docs/costs-per-device.md)
    COST_KEYS: ClassVar[dict[str, str]] = {"select": "select_coeff_s", "merge": "merge_coeff_s",
                                           "reduce": "reduce_coeff_s", "update": "update_coeff_s",
                                           "scan": "scan_coeff_s", "matmul": "matmul_coeff_s"}
    #: the kinds every run prices (and summary.json records); the others (scan, matmul) only where an algorithm of
    #: the run charges them (:attr:`sim.algorithms.Algorithm.cost_kinds`) or their key is set
    ALWAYS_PRICED: ClassVar[tuple[str, ...]] = ("select", "merge", "reduce", "update")
    #: a cost key's value where neither the scenario nor a device gives one: the gTop-k papers' model (their
    #: P102-100 selection fit, Shi et al., ICDCS 2019; no merge, reduction or update charged), and for a
    #: compressor's memory traffic and matrix products, which their model does not price, the P102-100 preset's
    #: memory model (1 / (0.87 x 440.3 GB/s) per byte) and FLOP model (1 / (10.77 TFLOP/s x 0.4) per FLOP)
    DEFAULT_COSTS: ClassVar[dict[str, float]] = {"select_coeff_s": 2.19e-10, "merge_coeff_s": 0.0,
                                                 "reduce_coeff_s": 0.0, "update_coeff_s": 0.0,
                                                 "scan_coeff_s": 1.0 / (0.87 * 440.3e9),
                                                 "matmul_coeff_s": 1.0 / (10.77e12 * 0.4)}

    @model_validator(mode="after")
    def _variation_keys_in_use(self):
        if self.jitter == "none" and self.changed_keys(("jitter_scale",)):
            raise ValueError(f"compute.jitter_scale = {self.jitter_scale:g}: unused with jitter = 'none' (no variation "
                             "drawn): used only with compute.jitter = 'lognormal' or 'exponential'")
        if self.straggler_prob == 0 and self.changed_keys(("straggler_factor",)):
            raise ValueError(f"compute.straggler_factor = {self.straggler_factor:g}: unused with straggler_prob = 0 (no "
                             "worker straggles): used only with compute.straggler_prob > 0")
        return self

    def costs(self, device=None, value_bytes: int = 4, index_bytes: int = 4, kinds=()) -> dict[str, dict]:
        """The cost of each compute kind a run uses, kind (select, merge, reduce, update, and of scan and matmul
        those in ``kinds`` or whose key is set) -> {"coeff_s": seconds per unit, "scaling": "x log2 x" or "x" (the
        unit: per x log2 x, or per unit of work), for scan and matmul "unit": "byte" or "FLOP" (the unit of their
        work; the others' is the element or x log2 x), "model": the formula, "source": where its figures come from,
        "passes": passes over memory per element (the device's memory model, else None), "from": "scenario",
        "device" or "default"}.

        The rule: a key given in the scenario (not None) wins; else ``device``'s cost model
        (:meth:`sim.workloads.model.DeviceModel.costs` at ``value_bytes`` / ``index_bytes`` per value / index, the
        scenario's compression.value_bytes / index_bytes); else, with no device (a [data] objective run, a measured
        layer table), :data:`DEFAULT_COSTS`. Raises ConfigError when the device has no cost for a kind the scenario
        leaves unset."""
        priced = [kind for kind, key in self.COST_KEYS.items()
                  if kind in self.ALWAYS_PRICED or kind in kinds or getattr(self, key) is not None]
        unset = [kind for kind in priced if getattr(self, self.COST_KEYS[kind]) is None]
        dev = device.costs(value_bytes, index_bytes, kinds=unset) if device is not None and unset else None
        units = {"scan": "byte", "matmul": "FLOP"}
        out = {}
        for kind in priced:
            key = self.COST_KEYS[kind]
            v = getattr(self, key)
            scaling = "x log2 x" if kind == "select" else "x"
            if v is not None:
                out[kind] = {"coeff_s": v, "scaling": scaling, "model": f"{v:.3g} s x {scaling}",
                             "source": f"compute.{key} (the scenario)", "passes": None, "from": "scenario"}
            elif dev is not None:
                c = dev[kind]
                out[kind] = {"coeff_s": c.coeff_s, "scaling": c.scaling, "model": c.model, "source": c.source,
                             "passes": c.passes, "from": "device"}
            else:
                v = self.DEFAULT_COSTS[key]
                src = ("compute.*_coeff_s unset and no device: the P102-100 preset's memory model (0.87 x 440.3 GB/s)"
                       if kind == "scan" else
                       "compute.*_coeff_s unset and no device: the P102-100 preset's FLOP model (10.77 TFLOP/s x 0.4)"
                       if kind == "matmul" else
                       "compute.*_coeff_s unset and no device: the gTop-k papers' model (their P102-100 selection fit, "
                       "Shi et al. 2019; nothing else charged)")
                out[kind] = {"coeff_s": v, "scaling": scaling, "model": f"{v:.3g} s x {scaling}", "passes": None,
                             "source": src, "from": "default"}
            if kind in units and out[kind]["scaling"] == "x":
                out[kind]["unit"] = units[kind]  # per byte, per FLOP (the others: per x log2 x or element)
        return out


class DataCfg(_Strict):
    """Objective and data."""

    objective: str = Field("softmax", description="softmax, logistic (real data); sines, double_well, robust_regression (synthetic)")
    dataset: str = Field("digits", description="real-data objectives: digits, breast_cancer, libsvm, synthetic_epsilon; "
                                               "a [model] network: fashion-mnist, mnist (IDX image files)")
    path: str = Field("", description="LIBSVM-format file when dataset = libsvm; the folder of the four IDX files when "
                                      "dataset = fashion-mnist (default /usr/share/datasets/fashion-mnist) or mnist")
    sharding: Literal["iid", "label"] = Field("iid", description="how samples are split over workers")
    lam: float = Field(1e-3, ge=0, le=MAX_REGULARISER, description="weight of the non-convex regulariser sum x^2/(1+x^2)")
    mu: float = Field(0.0, ge=0, le=MAX_REGULARISER, description="weight of the convex l2 term mu/2 ||x||^2")
    d: int = Field(10_000, ge=10, le=10_000_000, description="synthetic objectives: dimension")
    n: int = Field(1024, ge=1, le=10_000_000, description="synthetic objectives / synthetic_epsilon: samples")

    #: objectives that train on a data set (the others generate their own data of dimension d and n samples)
    REAL: ClassVar[tuple[str, ...]] = ("softmax", "logistic")
    #: image data sets in the IDX format, trained by a [model] network (sim.workloads.idx)
    IMAGES: ClassVar[tuple[str, ...]] = ("fashion-mnist", "mnist")

    @model_validator(mode="after")
    def _path_in_use(self):
        real = self.objective in self.REAL
        unused = [k for k in self.changed_keys(("d",)) if real]
        unused += [k for k in self.changed_keys(("n",)) if real and self.dataset != "synthetic_epsilon"]
        synth_unused = [k for k in self.changed_keys(("dataset", "lam", "mu")) if not real]
        if synth_unused:
            raise ValueError(f"{', '.join('data.' + k for k in synth_unused)}: used only by the objectives that train "
                             f"on a data set ({', '.join(self.REAL)}); objective = {self.objective!r} generates its own "
                             "data and has its own regulariser")
        if unused:
            raise ValueError(f"{', '.join('data.' + k for k in unused)}: used only by the synthetic objectives "
                             f"(and n by dataset = 'synthetic_epsilon'); objective = {self.objective!r} on dataset = "
                             f"{self.dataset!r} takes its size from the data")
        if self.path and self.dataset not in ("libsvm", *self.IMAGES):
            raise ValueError(f"data.path = {self.path!r}: used only with dataset = 'libsvm', 'fashion-mnist' or 'mnist' "
                             f"(here dataset = {self.dataset!r}, which ignores it)")
        return self


class TrainingCfg(_Strict):
    """Optimisation."""

    iterations: int = Field(300, ge=1, le=10_000_000, description="iterations T")
    batch_size: int = Field(16, ge=1, description="per-worker mini-batch b (samples); B = P*b")
    schedule: Literal["constant", "corollary2", "inverse"] = Field(
        "constant", description="constant: lr; corollary2: theta*sqrt(B/T); inverse: lr*a/(a+t)")
    lr: float = Field(0.5, gt=0, description="step size alpha (constant, and numerator of inverse)")
    theta: float = Field(0.05, gt=0, description="Corollary 2 step constant")
    inverse_a: float = Field(100.0, gt=0, description="inverse schedule offset a")
    eval_every: int = Field(1, ge=1, description="evaluate loss and full gradient every this many iterations")
    dtype: Literal["float64", "float32"] = Field(
        "float64", description="arithmetic of the data, parameters, gradients, accumulators, residuals and messages "
                               "(float32: the float64 problem rounded once; needs compression.value_bytes <= 4)")
    momentum: float = Field(0.0, ge=0, lt=1, description="heavy-ball momentum m on the synchronised update "
                                                         "(DGC: its local momentum correction); 0 = plain SGD as in the theory")
    weight_decay: float = Field(0.0, ge=0, description="weight decay w, added to the local gradient before error feedback")
    time_budget_s: float = Field(0.0, ge=0, le=1e9, description="a [model] run: stop at this simulated time (s) instead of "
                                                                "after training.iterations, which stays the cap: an iteration runs "
                                                                "when the clock after it (the float64 sum of the iteration times "
                                                                "before it and its own) is <= the budget; 0 = off")

    #: keys each schedule reads besides ``schedule`` itself (the others are unused by it)
    SCHEDULE_KEYS: ClassVar[dict[str, tuple[str, ...]]] = {"constant": ("lr",), "corollary2": ("theta",),
                                                          "inverse": ("lr", "inverse_a")}

    @model_validator(mode="after")
    def _schedule_keys_in_use(self):
        unused = self.changed_keys([k for k in ("lr", "theta", "inverse_a") if k not in self.SCHEDULE_KEYS[self.schedule]])
        if unused:
            users = {k: [n for n, ks in self.SCHEDULE_KEYS.items() if k in ks] for k in unused}
            raise ValueError(f"{', '.join('training.' + k for k in unused)}: unused by schedule = {self.schedule!r} "
                             f"(which steps with {', '.join(self.SCHEDULE_KEYS[self.schedule])}); "
                             + "; ".join(f"training.{k} is used by schedule = {' or '.join(map(repr, u))}"
                                         for k, u in users.items()))
        return self


class CompressionCfg(_Strict):
    """Sparsification and the collectives."""

    density: float = Field(0.01, gt=0, le=1, description="k/d when k is unset; compression ratio c = d/k")
    k: int | None = Field(None, ge=1, description="selected coordinates per worker (1 <= k <= d); unset: round(density*d), at least 1")
    value_bytes: int = Field(4, ge=1, le=16, description="bytes per transmitted value")
    index_bytes: int = Field(4, ge=0, le=16, description="bytes per transmitted index")
    dense_collective: Literal["ring", "recursive_doubling", "hierarchical"] = Field(
        "ring", description="dense allreduce (hierarchical: intra reduce-scatter, inter ring, intra allgather)")
    topk_collective: Literal["allgather", "hierarchical"] = Field(
        "allgather", description="Top-k and rand-k allgather (hierarchical: node gather, inter-node Bruck, node broadcast)")
    gtopk_collective: Literal["tree", "recursive_doubling", "hierarchical"] = Field(
        "tree", description="gTop-k collective (hierarchical: node tree, inter-node recursive doubling, node broadcast)")
    gtopk_mask: Literal["exact", "reference"] = Field("exact", description="gTop-k residual mask rule")
    layer_sizes: list[int] = Field([], description="layer-wise selection in a numerics run: the model vector as consecutive "
                                                   "layers of these sizes (>= 1, summing to d), k_b = min(d_b, max(1, round(k/d x d_b))) "
                                                   "per layer (at least one each), one collective each; empty = whole-model "
                                                   "selection")

    #: keys only an algorithm that selects k coordinates reads (AlgorithmSpec.k, index_bytes)
    SPARSE_KEYS: ClassVar[tuple[str, ...]] = ("density", "k", "index_bytes")

    @model_validator(mode="after")
    def _density_or_k(self):
        if self.k is not None and self.changed_keys(("density",)):
            raise ValueError(f"compression.density = {self.density:g}: unused when compression.k is set (k = {self.k} "
                             "fixes the selected count; density gives k = round(density x d) only when k is unset)")
        return self


class WorkloadCfg(_Strict):
    """[workload]: a real model's layer-wise iteration (timing only: the zoo models have no objective to train)."""

    model: str = Field("", description="zoo model (resnet20-cifar, vgg16-cifar, vgg16, alexnet, resnet50, bert-base, gpt2-small, "
                                       "lstm-ptb); empty = train the [data] objective instead")
    table: str = Field("", description="layer table (CSV or TOML) of a model profiled elsewhere, instead of a zoo model")
    device: str = Field("P102-100", description="device model turning FLOPs into seconds (FLOP workloads only) and pricing selection, merge, "
                                                "reduction and update (compute.*_coeff_s unset): P102-100, V100, A100, H100")
    efficiency: float | None = Field(None, gt=0, le=1, description="fraction of the device's peak FLOP/s a step achieves; unset: the preset's")
    dense_policy: Literal["ddp", "horovod", "none"] = Field(
        "ddp", description="dense: DDP buckets overlapped with backward, Horovod tensor fusion, or one allreduce after backward")
    sparse_policy: Literal["model", "bucket", "layer", "hybrid"] = Field(
        "model", description="sparse: whole-model selection after backward (released gTop-k code), per DDP bucket or per layer, overlapped; "
                             "hybrid: per DDP bucket dense or compressed at its own density, as workload.hybrid_plan says")
    hybrid_plan: str = Field("", description="sparse_policy = 'hybrid': the plan file (JSON, `sparsim workload hybrid-plan`; docs/hybrid.md), "
                                             "for this model and bucket caps")
    bucket_cap_mb: float | None = Field(None, gt=0, le=1e6, description="DDP bucket_cap_mb (MiB); unset: DDP's default 25 with a 1 MiB first bucket")
    first_bucket_mb: float | None = Field(None, gt=0, le=1e6, description="cap of DDP's first bucket (MiB); unset: as DDP (1 MiB with the default cap, else bucket_cap_mb)")
    fusion_threshold_mb: float = Field(128.0, gt=0, le=1e6, description="horovod: HOROVOD_FUSION_THRESHOLD (MiB)")
    cycle_time_s: float = Field(1e-3, gt=0, le=10, description="horovod: HOROVOD_CYCLE_TIME (s)")
    hook_blocks_backward: bool = Field(False, description="a communication operation stalls its rank's backward until its collective ends "
                                                          "(a comm hook that runs its selection and collective inside the autograd hook, as this "
                                                          "project's DDP hook does); false: selection and collective overlap backward on their own stream")
    trace_iterations: list[int] = Field([1], description="iterations written to trace.json (Chrome trace format; empty: none)")
    trace_ranks: int = Field(4, ge=1, le=1024, description="ranks per algorithm written to trace.json")

    @property
    def active(self) -> bool:
        """True when a zoo model or a layer table is named (the run is a layer-wise timeline)."""
        return bool(self.model or self.table)

    @model_validator(mode="after")
    def _one_source(self):
        if self.model and self.table:
            raise ValueError(f"workload.model = {self.model!r} and workload.table = {self.table!r}: give one of them")
        if any(t < 1 for t in self.trace_iterations):
            raise ValueError(f"workload.trace_iterations = {self.trace_iterations}: valid iterations >= 1")
        if self.sparse_policy == "hybrid" and not self.hybrid_plan:
            raise ValueError("workload.sparse_policy = 'hybrid' needs workload.hybrid_plan: valid the path of a plan file "
                             "(sparsim workload hybrid-plan)")
        if self.hybrid_plan and self.sparse_policy != "hybrid":
            raise ValueError(f"workload.hybrid_plan = {self.hybrid_plan!r}: used only with sparse_policy = 'hybrid' (here "
                             f"{self.sparse_policy!r})")
        return self


class ModelCfg(_Strict):
    """[model]: a torch network trained on real images inside the simulator (numerics on P simulated workers, the
    clock from the same network's layer-wise timeline on the scenario's cluster)."""

    name: str = Field("", description="network trained on data.dataset = fashion-mnist or mnist: mlp-256, mlp-1024, mlp-3000, "
                                      "lenet5, resnet20 (`sparsim workload list` has the timing-only zoo); empty = the [data] "
                                      "objective")
    eval_samples: int = Field(2048, ge=0, le=10_000_000, description="training images in an evaluation's loss, ||grad f||^2 and "
                                                                     "train accuracy (a fixed subset; 0 = all)")
    test_samples: int = Field(0, ge=0, le=10_000_000, description="test images in test_loss and test_accuracy (the first ones; 0 = all)")
    gradients: Literal["auto", "vmap", "loop"] = Field(
        "auto", description="how the P workers' gradients are computed: vmap (one torch.func call over the workers), loop "
                            "(the per-worker reference, one backward each), auto (vmap without convolutions, else loop: "
                            "the faster on CPU)")


class TorchCfg(_Strict):
    """[torch]: the real backend (``--backend torch``); the simulator ignores this section."""

    timeout_s: float = Field(60.0, gt=0, le=604_800, description="seconds a rank may wait on a peer before the run fails naming the rank")
    stall_timeout_s: float = Field(0.0, ge=0, le=604_800, description="seconds without progress on every rank (all stuck in local computation) before the run fails naming them; 0 = off. Also bounds any local computation between two messages or steps (a gradient, rank 0's metrics evaluation)")
    dist_backend: Literal["gloo", "nccl", "auto"] = Field("gloo", description="process-group backend (auto: nccl when a GPU is visible)")
    backend_allreduce: bool = Field(False, description="dense uses torch.distributed.all_reduce (collective backend_allreduce) instead of the shared ring")
    select_device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where each rank makes its Top-k selections of vectors of d >= 2^15: cuda (its GPU), cpu (numpy/numba), auto (cuda when a GPU is visible); the same indices either way")


def cost_device(sc: "Scenario"):
    """The device whose cost model prices a run's selections, merges, reductions and updates
    (:meth:`ComputeCfg.costs`): ``workload.device``'s preset in a workload run (a zoo model or a layer table) or a
    [model] run, None in a [data] objective run. A measured layer table takes no device (it is refused there), and
    the default device's costs are the defaults' values. Raises ConfigError for an unknown device."""
    if not (sc.workload.active or sc.model.name):
        return None
    from sim.workloads.devices import get_device

    return get_device(sc.workload.device)


def used_keys_dump(sc: "Scenario", backend: str = "sim") -> dict:
    """The scenario as a dict without the keys this run does not use (summary.json records what was used): the
    [torch] table unless backend = torch, [workload] unless a model or table is named, data.d / data.n / data.path
    where the objective or data set ignores them, the custom-network and hierarchy keys of [cluster] where the
    network ignores them, and [data], the step size and forward_backward_s for a workload run. The compute cost keys
    (select/merge/reduce/update_coeff_s) hold the values the run used (:meth:`ComputeCfg.costs` with
    :func:`cost_device`); select_coeff_s is left out where the device's memory model prices selections per element.
    Reloading the dump gives the same run (what is left out takes its default, which nothing reads)."""
    out = sc.model_dump()
    cl, data = out["cluster"], out["data"]
    if backend != "torch":
        out.pop("torch")
    if not sc.model.name:
        out.pop("model")
        out["training"].pop("time_budget_s")
    if sc.model.name:  # the network's timeline: [workload] minus its model / table; the network replaces [data]'s objective
        out["workload"].pop("model")
        out["workload"].pop("table")
        for k in ("objective", "lam", "mu", "d", "n"):
            out["data"].pop(k)
        out["compute"].pop("forward_backward_s")
        out["compression"].pop("layer_sizes")
    elif not sc.workload.active:
        out.pop("workload")
    else:
        out.pop("data")
        for k in ("schedule", "lr", "theta", "inverse_a", "eval_every", "dtype"):
            out["training"].pop(k)
        out["compute"].pop("forward_backward_s")
        out["compression"].pop("layer_sizes")
    for k in ("lr", "theta", "inverse_a"):  # the keys the schedule does not step with
        if k not in TrainingCfg.SCHEDULE_KEYS[sc.training.schedule]:
            out["training"].pop(k, None)
    if "data" in out and not sc.model.name:
        if sc.data.objective in DataCfg.REAL:
            data.pop("d")
            if sc.data.dataset != "synthetic_epsilon":
                data.pop("n")
        else:
            for k in ("dataset", "lam", "mu"):
                data.pop(k)
        if sc.data.dataset != "libsvm" or sc.data.objective not in DataCfg.REAL:
            data.pop("path", None)
    if sc.cluster.network not in ("custom", "hierarchical"):
        cl.pop("alpha_s")
        cl.pop("bandwidth_Bps")
    if sc.cluster.network != "custom":
        cl.pop("topology")
    comp = out["compute"]  # the cost keys as the run used them (ComputeCfg.costs), so that reloading gives the same run
    priced = sc.compute.costs(cost_device(sc), sc.compression.value_bytes, sc.compression.index_bytes,
                              sc.charged_kinds())
    for kind, key in ComputeCfg.COST_KEYS.items():
        if kind not in priced:  # scan / matmul where no algorithm of the run charges them: not recorded
            comp.pop(key)
    for kind, c in priced.items():
        key = ComputeCfg.COST_KEYS[kind]
        if c["scaling"] == "x log2 x" or kind != "select":
            comp[key] = c["coeff_s"]
        else:  # a per-element selection (a device's memory model) has no value of select_coeff_s (per x log2 x)
            comp.pop(key)
    if sc.cluster.network != "hierarchical":
        for k in ClusterCfg.HIERARCHY_KEYS:
            cl.pop(k)
    if "workload" in out and sc.workload.sparse_policy != "hybrid":
        out["workload"].pop("hybrid_plan")  # the hybrid policy's plan file
    return out


#: Longest scenario name: it titles the figure and names the run in summary.json (a 1 MB name made the figure
#: take minutes and gigabytes).
MAX_NAME_CHARS = 200


class Scenario(_Strict):
    """A whole scenario: what to run, on what cluster, with which data."""

    name: str = Field("scenario", description="label used in outputs (one line, plain text, 1 to 200 characters)")
    seed: int = Field(0, ge=0, description="seed of data sharding, mini-batches, jitter and initial point")
    algorithms: list[str] = Field(
        ["dense", "topk", "gtopk"], min_length=1,  # algorithms: the default comparison
        description="algorithms compared with identical data and seeds (`sparsim algorithms` lists them)")
    algorithm: dict[str, dict[str, bool | int | float | str | list[float]]] = Field(
        {}, description="per-algorithm options, e.g. [algorithm.powersgd] rank = 4 (`sparsim algorithms` lists them)")
    cluster: ClusterCfg = ClusterCfg()
    compute: ComputeCfg = ComputeCfg()
    data: DataCfg = DataCfg()
    training: TrainingCfg = TrainingCfg()
    compression: CompressionCfg = CompressionCfg()
    torch: TorchCfg = TorchCfg()
    workload: WorkloadCfg = WorkloadCfg()
    model: ModelCfg = ModelCfg()

    @field_validator("name")
    @classmethod
    def _one_line_name(cls, v: str) -> str:
        if not 1 <= len(v) <= MAX_NAME_CHARS or any(ord(ch) < 32 or ord(ch) == 127 for ch in v):
            raise ValueError(f"valid one line of text without control characters, 1 to {MAX_NAME_CHARS} characters "
                             f"(this one: {len(v)} characters)")
        return v

    @field_validator("algorithms")
    @classmethod
    def _known_algorithms(cls, v):
        from sim.algorithms import resolve

        for name in v:
            resolve(name)  # ConfigError (a ValueError) naming the valid names
        return v

    @model_validator(mode="after")
    def _algorithm_options(self):
        from sim.algorithms import check_options, get, resolve

        running = {resolve(a)[0] for a in self.algorithms}
        for name, opts in self.algorithm.items():
            check_options(name, opts)
            algo = get(name)
            given = _given_options(algo, opts)
            if name not in running:
                if given:
                    entries = " or ".join([name, *algo.aliases])
                    raise ValueError(f"{', '.join(f'algorithm.{name}.{k}' for k in given)}: [algorithm.{name}] is used "
                                     f"only with {entries} among the algorithms (here {', '.join(self.algorithms)})")
                continue
            options = {k: v for k, v in given.items() if k != "collective"}
            unused = algo.unused_options(options, iterations=self.training.iterations,
                                         momentum=self.training.momentum) if options else {}
            if unused:
                key, why = next(iter(unused.items()))
                raise ValueError(f"algorithm.{name}.{key} = {_shown(opts[key])}: {why}")
        return self

    def running_algorithms(self) -> list[tuple]:
        """Each entry of ``algorithms`` as (entry, registered name, preset AlgorithmSpec fields (dict), its
        :class:`sim.algorithms.Algorithm`), in order (:func:`sim.algorithms.resolve`: an alias such as
        gtopk_reference gives its algorithm and preset)."""
        from sim.algorithms import get, resolve

        return [(entry, *resolve(entry), get(resolve(entry)[0])) for entry in self.algorithms]

    @model_validator(mode="after")
    def _compression_keys_in_use(self):
        from sim.algorithms import REGISTRY

        c, running = self.compression, self.running_algorithms()
        here = f"here algorithms = {', '.join(self.algorithms)}"
        readers: dict[str, list[str]] = {}  # [compression] key -> the registered algorithms that read it
        for name, algo in REGISTRY.items():
            for key in algo.compression_keys().values():
                readers.setdefault(key, []).append(name)
        used, overridden = set(), {}
        for entry, name, preset, algo in running:
            for field, key in algo.compression_keys().items():
                if field in preset:  # an alias fixes it (gtopk_reference: the mask)
                    overridden.setdefault(key, f"{entry} fixes its own {field}")
                elif field == "collective" and "collective" in self.algorithm.get(name, {}):
                    overridden.setdefault(key, f"[algorithm.{name}] collective overrides it")
                else:
                    used.add(key)
        for key in c.changed_keys(readers):
            if key not in used:
                why = f"; {overridden[key]}" if key in overridden else ""
                raise ValueError(f"compression.{key} = {_shown(getattr(c, key))}: used only with "
                                 f"{' or '.join(readers[key])} among the algorithms ({here}{why})")
        if not any(algo.sparse for *_, algo in running):
            unused = c.changed_keys(CompressionCfg.SPARSE_KEYS)
            if unused:
                sparse = ", ".join(n for n, a in REGISTRY.items() if a.sparse)
                raise ValueError(f"{', '.join('compression.' + k for k in unused)}: used only with an algorithm that "
                                 f"selects k coordinates among the algorithms ({sparse}; {here})")
        if not any(algo.segmented for *_, algo in running) and c.changed_keys(("layer_sizes",)):
            seg = ", ".join(n for n, a in REGISTRY.items() if a.segmented)
            raise ValueError(f"compression.layer_sizes: used only with an algorithm that exchanges per layer among the "
                             f"algorithms ({seg}; {here}: one exchange of the whole vector)")
        return self

    def charged_kinds(self) -> set[str]:
        """The compute kinds this run charges besides forward_backward: ``update`` (every step ends with it), each
        running algorithm's :attr:`sim.algorithms.Algorithm.cost_kinds`, and ``reduce`` under a hybrid plan (its
        dense buckets' allreduce)."""
        running = self.running_algorithms()
        kinds = {"update"}  # every algorithm's step ends with the update (sgd_step)
        for *_, algo in running:
            kinds.update(algo.cost_kinds)
        w = self.workload
        if w.sparse_policy == "hybrid" and (w.active or self.model.name) and any(a.sparse for *_, a in running):
            kinds.add("reduce")  # the plan's dense buckets: the dense allreduce
        return kinds

    @model_validator(mode="after")
    def _cost_keys_in_use(self):
        from sim.algorithms import REGISTRY

        kinds = self.charged_kinds()
        for kind, key in ComputeCfg.COST_KEYS.items():
            v = getattr(self.compute, key)
            if v is None or kind in kinds or v == self._unset_cost(kind):
                continue
            users = ", ".join(n for n, a in REGISTRY.items() if kind in a.cost_kinds)
            raise ValueError(f"compute.{key} = {v:g}: no algorithm of this run charges a {kind} (here algorithms = "
                             f"{', '.join(self.algorithms)}): used only with {users} among the algorithms")
        return self

    def _unset_cost(self, kind: str) -> float | None:
        """The cost coefficient of ``kind`` the run takes when its compute.*_coeff_s key is unset (what summary.json
        records for it, so a reloaded summary is not refused; None where that has no value of the key's unit)."""
        key = ComputeCfg.COST_KEYS[kind]
        try:
            c = self.compute.model_copy(update={key: None}).costs(cost_device(self), self.compression.value_bytes,
                                                                   self.compression.index_bytes, (kind,))[kind]
        except ConfigError:
            return None
        return c["coeff_s"] if c["scaling"] == ("x log2 x" if kind == "select" else "x") else None

    @model_validator(mode="after")
    def _hook_blocks_in_use(self):
        w = self.workload
        if not (w.active or self.model.name) or not w.hook_blocks_backward:
            return self
        sparse_of = [algo.sparse for *_, algo in self.running_algorithms()]
        dense, sparse = not all(sparse_of), any(sparse_of)
        if dense and w.dense_policy == "horovod":
            return self  # refused with its own reason (its background loop never stalls backward)
        if not ((dense and w.dense_policy == "ddp") or (sparse and w.sparse_policy != "model")):
            raise ValueError(f"workload.hook_blocks_backward = true: unused here (dense_policy = {w.dense_policy!r}, "
                             f"sparse_policy = {w.sparse_policy!r}, algorithms = {', '.join(self.algorithms)}: one "
                             "exchange after backward, which stalls nothing): used only with dense_policy = 'ddp' and a "
                             "dense algorithm, or sparse_policy = 'bucket', 'layer' or 'hybrid' and a sparse one")
        return self

    @model_validator(mode="after")
    def _workload_keys_in_use(self):
        w = self.workload
        if w.active:
            unused = [f"data.{k}" for k in self.data.changed_keys(DataCfg.model_fields)]
            unused += [f"training.{k}" for k in self.training.changed_keys(("schedule", "lr", "theta", "inverse_a", "eval_every",
                                                                         "dtype"))]
            unused += [f"compute.{k}" for k in self.compute.changed_keys(("forward_backward_s",))]
            unused += [f"compression.{k}" for k in self.compression.changed_keys(("layer_sizes",))]
            if unused:
                raise ValueError(f"{', '.join(unused)}: the objective, step size, lumped compute time and layer split of a numerics run, unused "
                                 f"when workload.{'model' if w.model else 'table'} is set (a timing-only timeline of a real model, "
                                 "whose layers give the compute; its selection scope is workload.sparse_policy)")
            from sim.algorithms import get, resolve

            sparse_of = [get(resolve(a)[0]).sparse for a in self.algorithms]
            dense = not all(sparse_of)
            sparse = any(sparse_of)
            rules = [(("fusion_threshold_mb", "cycle_time_s"), dense and w.dense_policy == "horovod",
                      "workload.dense_policy = 'horovod' with dense among the algorithms"),
                     (("bucket_cap_mb", "first_bucket_mb"),
                      (dense and w.dense_policy == "ddp") or (sparse and w.sparse_policy in ("bucket", "hybrid")),
                      "DDP buckets: dense_policy = 'ddp' with dense, or sparse_policy = 'bucket' or 'hybrid' with a sparse algorithm"),
                     (("dense_policy",), dense, "dense among the algorithms"),
                     (("sparse_policy", "hybrid_plan"), sparse, "a sparse algorithm among the algorithms")]
            for keys, used, needs in rules:
                unused = w.changed_keys(keys)
                if unused and not used:
                    raise ValueError(f"{', '.join('workload.' + k for k in unused)}: used only with {needs}")
            if w.hook_blocks_backward and w.dense_policy == "horovod" and dense:
                raise ValueError("workload.hook_blocks_backward = true does not apply to dense_policy = 'horovod' (its "
                                 "background loop never stalls backward): valid dense_policy ddp or none")
        elif not self.model.name:
            unused = w.changed_keys([k for k in WorkloadCfg.model_fields if k not in ("model", "table")])
            if unused:
                raise ValueError(f"{', '.join('workload.' + k for k in unused)}: used only with workload.model or "
                                 "workload.table (a real model's timeline) or model.name (a network trained on images); "
                                 "this scenario trains the [data] objective")
        return self

    @model_validator(mode="after")
    def _model_keys_in_use(self):
        m, data = self.model, self.data
        if not m.name:
            unused = m.changed_keys([k for k in ModelCfg.model_fields if k != "name"])
            if unused:
                raise ValueError(f"{', '.join('model.' + k for k in unused)}: used only with model.name (a network "
                                 "trained on images)")
            if data.dataset in DataCfg.IMAGES:
                raise ValueError(f"data.dataset = {data.dataset!r} holds images: it is trained by a network, valid with "
                                 "model.name = mlp-256, mlp-1024, mlp-3000, lenet5 or resnet20")
            if self.training.time_budget_s:
                raise ValueError(f"training.time_budget_s = {self.training.time_budget_s}: used only with model.name "
                                 "(a [model] run, whose clock is the network's timeline, known before each step)")
            return self
        if self.workload.model or self.workload.table:
            raise ValueError(f"model.name = {m.name!r} with workload.{'model' if self.workload.model else 'table'} set: "
                             "give one (model.name trains a network and times it; workload.* alone is timing only)")
        if data.dataset not in DataCfg.IMAGES:
            raise ValueError(f"data.dataset = {data.dataset!r} with model.name = {m.name!r}: valid fashion-mnist or mnist "
                             "(the networks take 1 x 28 x 28 images)")
        unused = [f"data.{k}" for k in data.changed_keys(("objective", "lam", "mu", "d", "n"))]
        unused += [f"compute.{k}" for k in self.compute.changed_keys(("forward_backward_s",))]
        unused += [f"compression.{k}" for k in self.compression.changed_keys(("layer_sizes",))]
        if unused:
            raise ValueError(f"{', '.join(unused)}: unused when model.name is set (the network is the objective, its "
                             "layers on workload.device give the compute, and workload.sparse_policy its selection scope)")
        return self

    @model_validator(mode="after")
    def _dtype_fits_value_bytes(self):
        if self.training.dtype == "float32" and self.compression.value_bytes > 4:
            raise ValueError(f"compression.value_bytes = {self.compression.value_bytes} with training.dtype = 'float32': "
                             "a float32 value is 4 bytes on the wire: valid value_bytes <= 4 (or training.dtype = "
                             "'float64')")
        return self

    @field_validator("algorithms")
    @classmethod
    def _unique(cls, v):
        dup = sorted({a for a in v if v.count(a) > 1})
        if dup:
            raise ValueError(f"each algorithm at most once; repeated: {', '.join(dup)}")
        return v

    def k_for(self, d: int) -> int:
        """k for dimension d: the explicit k, else round(density * d) clamped to [1, d]."""
        if self.compression.k is not None:
            return self.compression.k
        return min(d, max(1, round(self.compression.density * d)))


def _given_options(algo, opts: dict) -> dict:
    """The keys of an [algorithm.NAME] table (already checked) set away from their defaults, key -> checked value
    (``collective``: away from the algorithm's first collective)."""
    out = {}
    for key, value in opts.items():
        if key == "collective":
            if value != algo.collectives[0]:
                out[key] = value
            continue
        v = algo.options[key].check(algo.name, key, value)
        if v != algo.options[key].default:
            out[key] = v
    return out


def _shown(value) -> str:
    """``repr(value)`` for an error line, cut to its first 60 characters when longer than 80 (a 1 MB value would
    otherwise be the whole message)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _format_error(err: ValidationError, where: str) -> str:
    e = err.errors()[0]
    key = ".".join(str(p) for p in e["loc"])
    if e["type"] == "extra_forbidden":  # name the keys of that table, as a --set of an unknown key does
        table = Scenario if len(e["loc"]) == 1 else getattr(_field_of(e["loc"][:-1]), "annotation", None)
        if isinstance(table, type) and issubclass(table, BaseModel):
            return f"{where}: unknown key {key!r}; valid keys here: {', '.join(table.model_fields)}"
        return f"{where}: unknown key {key!r}"
    if e["type"] in ("model_type", "model_attributes_type", "dict_type"):  # cluster = 5: a table was expected
        table = getattr(_field_of(e["loc"]), "annotation", None)
        valid = f": valid keys {', '.join(table.model_fields)}" if isinstance(table, type) and \
            issubclass(table, BaseModel) else ""
        return f"{where}: {key} = {_shown(e.get('input'))}: [{key}] must be a table of keys{valid}"
    if e["type"] == "value_error" and isinstance(e.get("input"), dict):  # a rule across the keys of a table
        return f"{where}: {e['msg'].removeprefix('Value error, ')}"
    bound = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}.get(e["type"])
    if bound is not None:  # say the valid range the way every other error does, with both ends of the key's range
        name = e["loc"][-1]
        f = _field_of(e["loc"])
        rng = _valid_range(str(name), f) if f is not None else f"{name} {bound} {list(e['ctx'].values())[0]}"
        return f"{where}: {key} = {_shown(e.get('input'))} is out of range: valid {rng}"
    kind = {"int_parsing": "an integer", "int_from_float": "an integer", "int_type": "an integer",
            "float_parsing": "a number", "float_type": "a number", "finite_number": "a finite number",
            "bool_parsing": "true or false", "bool_type": "true or false", "string_type": "a string"}.get(e["type"])
    if kind is not None:  # a wrong type: say what the key takes, with its range
        f = _field_of(e["loc"])
        rng = _valid_range(str(e["loc"][-1]), f) if f is not None else ""
        return f"{where}: {key} = {_shown(e.get('input'))} must be {kind}" + (f": valid {rng}" if rng else "")
    return f"{where}: {key} = {_shown(e.get('input'))}: {e['msg'].removeprefix('Value error, ')}"


def _field_of(loc):
    """The pydantic FieldInfo at a validation error's location (None when it is not a plain field)."""
    model = Scenario
    f = None
    for p in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or p not in model.model_fields:
            return f if isinstance(p, int) else None
        f = model.model_fields[p]
        model = f.annotation
    return f


def _validate(data: dict, where: str, overrides: list[str] | None = None) -> Scenario:
    """``data`` as a Scenario; a ConfigError blames the ``--set`` override (or the command-line option,
    :func:`option_overrides`) that gave the bad key, else ``where`` (the scenario file, or "default scenario").

    A rule over a whole table (its location is the table, e.g. ``compute``) or across tables names the keys it
    refuses before its first colon ("compute.jitter_scale = 2: ..."): the override of such a key is blamed (none:
    the file that gave it); when the message names no key of the table, every override of that table is named;
    an ``[algorithm.NAME]`` option's message names it as ``NAME.KEY``."""
    try:
        return Scenario.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        key = ".".join(str(p) for p in e["loc"])
        table_rule = not key or (e["type"] == "value_error" and isinstance(e.get("input"), dict))
        named = _named_keys(str(e.get("msg", "")), key) if table_rule else set()
        given = _last_overrides(overrides or [])
        blamed = [item for k, item in given if any(_same_key(k, n) for n in named)] if table_rule else \
            [item for k, item in given if key == k or key.startswith(k + ".") or k.startswith(key + ".")][-1:]
        if not blamed and table_rule and key and not any(n.startswith(key + ".") and _field_of(n.split("."))
                                                         for n in named):
            blamed = [item for k, item in given if k.startswith(key + ".")]  # no key named: each of the table's
        if blamed:
            where = ", ".join(_override_label(item) for item in blamed)
        raise ConfigError(_format_error(err, where)) from None


def _named_keys(msg: str, table: str) -> set[str]:
    """The dotted keys a rule's message names before its first colon ("a.b = v, c.d: why" -> {a.b, c.d}); a key
    without its table's prefix (inside ``table``) gets it."""
    head = msg.removeprefix("Value error, ").split(":")[0]
    names = {part.strip().split(" ")[0] for part in head.split(",") if part.strip()}
    return {n if not table or n.startswith(table + ".") else f"{table}.{n}" for n in names if n} | names


def _same_key(override_key: str, named: str) -> bool:
    """True when an override of ``override_key`` sets the key a message names (``algorithm.NAME.KEY`` is named
    ``NAME.KEY`` by the algorithm's option checks)."""
    return override_key in (named, f"algorithm.{named}") or named.startswith(override_key + ".")


def _last_overrides(overrides: list[str]) -> list[tuple[str, str]]:
    """(dotted key, override) of the overrides that count: the last one of each key, in order."""
    last = {}
    for item in overrides:
        last[item.split("=", 1)[0].strip()] = item
    return [(k, item) for k, item in last.items()]


def _override_label(item: str) -> str:
    """How an error names an override: the command-line option it stands for (``--algorithms foo``), else
    ``--set KEY=VALUE`` (a long one cut to its first 60 characters)."""
    shown = getattr(item, "option", None)
    if shown is not None:
        return shown
    return f"--set {item if len(item) <= 80 else item[:60] + f'... ({len(item)} characters)'}"


class _OptionOverride(str):
    """An override that a command-line option stands for (``algorithms=foo`` for ``--algorithms foo``): a str, with
    ``option`` the text an error names it by."""

    option: str

    def __new__(cls, text: str, option: str):
        self = super().__new__(cls, text)
        self.option = option
        return self


def _parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``dotted.key=value`` strings to a scenario dict (values parsed as TOML, else as strings).

    Raises ConfigError for a malformed override or an unknown key (naming it).
    """
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    if isinstance(out.get("algorithm"), dict):
        out["algorithm"] = {n: dict(t) if isinstance(t, dict) else t for n, t in out["algorithm"].items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected dotted.key=value")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if parts[0] == "algorithm":  # [algorithm.NAME] KEY = value: a table per algorithm (checked by the model)
            if len(parts) != 3 or not all(parts):
                raise ConfigError(f"--set {key}: expected algorithm.NAME.KEY=value (e.g. algorithm.powersgd.rank=4)")
            table = out.setdefault("algorithm", {})
            table[parts[1]] = dict(table.get(parts[1], {}))
            table[parts[1]][parts[2]] = _parse_value(text.strip())
            continue
        node, model = out, Scenario
        for i, p in enumerate(parts):
            fields = model.model_fields
            if p not in fields:
                raise ConfigError(f"--set {key}: unknown key {p!r}; valid keys here: {', '.join(fields)}")
            ann = fields[p].annotation
            if i < len(parts) - 1:
                if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
                    raise ConfigError(f"--set {key}: {p!r} is not a table")
                node = node.setdefault(p, {})
                model = ann
            else:
                val = _parse_value(text.strip())
                if p == "algorithms" and isinstance(val, str):
                    val = [a.strip() for a in val.split(",") if a.strip()]
                node[p] = val
    return out


DEFAULT_SCENARIO_TEXT = resources.files("experiments").joinpath("scenarios/default.toml").read_text()


#: The scenario keys that name a file or folder (table, key): a relative path in a scenario file is relative to the
#: file's folder (:func:`load_scenario`).
FILE_RELATIVE_KEYS = (("data", "path"), ("workload", "table"), ("workload", "hybrid_plan"))


def load_scenario(path: str | None = None, overrides: list[str] | None = None) -> Scenario:
    """Load a scenario TOML file (or the embedded default when ``path`` is None) and apply overrides.

    A relative path in the file (``data.path``, ``workload.table``, ``workload.hybrid_plan``: :data:`FILE_RELATIVE_KEYS`)
    is taken relative to the file's folder and recorded as an absolute path (an absolute one is kept as it is; one
    given by an override, ``--set data.path=...``, is relative to the working directory). Raises ConfigError for a
    missing file (a folder or a device said as such), invalid TOML, unknown keys (listing the valid keys of that
    table), wrong types or values out of range.
    """
    if path is None:
        text, where = DEFAULT_SCENARIO_TEXT, "default scenario"
    else:
        p = Path(path)
        if not p.is_file():
            what = ("does not exist" if not p.exists() else "is a directory" if p.is_dir() else
                    "is not a regular file (a device, a pipe or a socket)")
            raise ConfigError(f"scenario file {str(p)!r} {what}: valid the path of a TOML file")
        try:
            text, where = p.read_text(encoding="utf-8"), str(p)
        except UnicodeDecodeError as err:
            raise ConfigError(f"scenario file {str(p)!r} is not UTF-8 text (TOML must be UTF-8): {err.reason} "
                              f"at byte {err.start}") from None
        except OSError as err:
            raise ConfigError(f"scenario file {str(p)!r} cannot be read: {err.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{where}: invalid TOML: {err}") from None
    if path is not None:  # a relative path in a file is relative to the file's folder (a --set one: to the cwd)
        for tname, key in FILE_RELATIVE_KEYS:
            table = data.get(tname)
            if isinstance(table, dict) and isinstance(table.get(key), str) and table[key] \
                    and not os.path.isabs(os.path.expanduser(table[key])):
                data = {**data, tname: {**table, key: os.path.abspath(os.path.join(p.parent, table[key]))}}
    data = apply_overrides(data, overrides or [])
    return _validate(data, where, overrides)


def _valid_range(name: str, f) -> str:
    lo = hi = ""
    for m in f.metadata:
        for attr, sym, side in (("ge", "<=", "lo"), ("gt", "<", "lo"), ("le", "<=", "hi"), ("lt", "<", "hi")):
            v = getattr(m, attr, None)
            if v is not None:
                if side == "lo":
                    lo = f"{v:g} {sym} " if isinstance(v, float) else f"{v} {sym} "
                else:
                    hi = f" {sym} {v:g}" if isinstance(v, float) else f" {sym} {v:_}"
    return f"{lo}{name}{hi}" if (lo or hi) else ""


def scenario_keys() -> list[tuple[str, str, object, str, str]]:
    """Every scenario key as (dotted key, type, default, valid range, description), for the README table."""
    rows = []

    def walk(model, prefix):
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, prefix + name + ".")
            else:
                import typing

                if typing.get_origin(ann) is typing.Literal:
                    tname = " / ".join(map(str, typing.get_args(ann)))
                elif typing.get_origin(ann) is list and typing.get_origin(typing.get_args(ann)[0]) is typing.Literal:
                    tname = "list of " + " / ".join(map(str, typing.get_args(typing.get_args(ann)[0])))
                else:
                    tname = str(ann).replace("typing.", "") if typing.get_origin(ann) else getattr(ann, "__name__", str(ann))
                tname = tname.replace(" | None", " (optional)").replace("|", "or")
                rows.append((prefix + name, tname, f.default, _valid_range(name, f), f.description or ""))

    walk(Scenario, "")
    return rows


def option_overrides(*, algorithms: str | None = None, timeout_s: float | None = None,
                     backend_allreduce: bool = False, dist_backend: str | None = None) -> list[str]:
    """The ``dotted.key=value`` overrides that command-line options stand for (``sparsim run`` and the
    torchrun entry point): --algorithms, --timeout (torch.timeout_s), --backend-allreduce and
    --dist-backend; an option left unset (None / False) adds nothing. Returns a list of strings, each with an
    ``option`` attribute, the option as typed (``--timeout 0``), which a validation error names instead of a
    ``--set`` the user never gave."""
    ov = [_OptionOverride(f"algorithms={algorithms}", f"--algorithms {_shown_option(algorithms)}")] \
        if algorithms is not None else []
    if timeout_s is not None:
        ov.append(_OptionOverride(f"torch.timeout_s={timeout_s!r}", f"--timeout {timeout_s:g}"))
    if backend_allreduce:
        ov.append(_OptionOverride("torch.backend_allreduce=true", "--backend-allreduce"))
    if dist_backend is not None:
        ov.append(_OptionOverride(f'torch.dist_backend="{dist_backend}"', f"--dist-backend {dist_backend}"))
    return ov


def _shown_option(text: str) -> str:
    """An option's value in an error line, cut to its first 60 characters when longer than 80."""
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"
