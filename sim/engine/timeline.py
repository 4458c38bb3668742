"""The iteration timeline of data-parallel training: layer-wise backward overlapped with bucketed communication.

One synchronous S-SGD iteration on P ranks, as PyTorch DDP, Horovod and the sparsifying libraries run it:

- **compute stream** (per rank): forward through the layers in order, then backward in reverse; the gradient
  of a parameter tensor is ready when its layer's backward ends; after the last bucket's result is in,
  the optimizer ``update`` (``update_coeff_s`` per parameter). A rank's compute times are the workload's
  per-layer times times the compute model's per-(rank, iteration) factor (jitter, stragglers:
  :meth:`sim.machine.compute.ComputeModel.forward_backward_factor`).
- **communication stream** (per rank): the communication operations in a fixed order. An operation is a
  *bucket* (a group of parameter tensors): the algorithm's compression of the bucket
  (:func:`compression_s`: the operations of :meth:`sim.algorithms.base.Algorithm.compression_work` -- a top-k
  selection, ``select_coeff_s`` x log2 x over the bucket's x elements, for Top-k and gTop-k; rand-k's gathers,
  Gaussian-k's and DGC's passes, PowerSGD's matrix products for the others; nothing for dense) runs on this stream
  as soon as the bucket's gradients are ready and the previous operation is over (a comm hook runs it before
  launching the collective); the collective starts
  when every rank has its input ready (it is synchronous across ranks) and lasts what the cluster simulation
  of that collective alone says (:func:`sim.engine.timing.simulate_timing`, the same engines and the same
  collectives as everything else; operations of one stream never overlap, as NCCL ops on one stream and
  gloo ops in one process group do not, so each is simulated in isolation). The compute stream does not slow the
  network and vice versa (no contention between streams is modelled).

Policies (:class:`TimelinePolicy`):

- dense ``ddp``: DDP's buckets (:func:`ddp_buckets`, equal to what ``torch.distributed`` computes), each
  allreduced when ready, in bucket order (DDP launches bucket i only after buckets 0..i-1);
- dense ``horovod``: Horovod tensor fusion: every ``cycle_time_s`` the background loop takes the tensors
  ready on every rank, packs them in ready order into fusion buffers of at most ``fusion_threshold_bytes``
  and allreduces them one after the other; the next cycle starts ``cycle_time_s`` after this one started or
  when its allreduces end, whichever is later (Horovod >= 0.21 defaults: 1 ms, 128 MiB);
- ``none`` (dense) and ``model`` (sparse): one buffer of the whole model after backward -- the released
  gTop-k code's policy and the model of :func:`sim.engine.timing.simulate_timing`, which this equals exactly;
- sparse ``bucket`` / ``layer``: selection per DDP bucket / per layer (the tensors of one layer), overlapped
  with backward, ``k_b = max(1, round(density x d_b))`` for a bucket of d_b elements.
- sparse ``hybrid`` (with ``TimelinePolicy.plan``, a :class:`sim.engine.hybrid.HybridPlan`; docs/hybrid.md): DDP's
  buckets, each as the plan says: compressed at its own density rho_b (the algorithm's selection and collective
  on ``k_b = min(d_b, max(1, round(rho_b d_b)))`` entries) or dense (no selection; the dense allreduce of the
  plan's ``dense_collective`` over the bucket). An all-compressed plan at density k / d is the ``bucket`` policy,
  an all-dense plan dense ``ddp``, both exactly (tests/test_hybrid.py).
- ``blocking=True`` (any policy but ``horovod``): each communication operation (selection + collective) runs
  synchronously on the compute stream, as a DDP comm hook that does its collective inside the hook (the
  project's :func:`sim.distributed.ddp_hooks.sparse_hook`, on the autograd thread): a rank's backward stops when the
  bucket is ready and resumes when the collective ends, so later buckets are ready later by the stalls (which
  count as exposed communication).

Metrics of an iteration (rank 0): compute (forward + backward + update), compress (selection or another
compression), comm (the sum of the collectives' durations), exposed communication = iteration time - compute
(everything rank 0 waits for after its own work: collectives and selections not hidden behind backward, and slower
ranks), overlap ratio = 1 - exposed / (comm + compress), clipped to [0, 1] (0 when nothing is communicated).

:func:`chrome_trace` writes chosen iterations in the Chrome trace event format (Perfetto, chrome://tracing).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

import numpy as np

from sim.algorithms import AlgorithmSpec, segment_k
from sim.machine.compute import ComputeModel
from sim.base.errors import ConfigError, check_int, check_real
from sim.workloads.model import DeviceModel, Workload

__all__ = ["DENSE_POLICIES", "SPARSE_POLICIES", "TimelinePolicy", "Bucket", "ddp_buckets", "layer_buckets",
           "whole_model_bucket", "horovod_fusion", "CollectiveTimer", "compression_s", "IterationTimeline",
           "TimelineResult",
           "simulate_timeline", "chrome_trace", "bucket_k", "TimelineClock", "flat_segments"]

#: Dense policies: DDP buckets overlapped with backward, Horovod tensor fusion, or one allreduce after backward.
DENSE_POLICIES = ("ddp", "horovod", "none")
#: Sparse policies: whole-model selection after backward (released gTop-k code), per DDP bucket, per layer, and the
#: hybrid per-bucket plan (dense or compressed at its own density per DDP bucket: :mod:`sim.engine.hybrid`).
SPARSE_POLICIES = ("model", "bucket", "layer", "hybrid")
MIB = 1024 * 1024
#: DDP's default bucket cap (torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB) and first bucket
#: (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES), torch 2.13.
DDP_DEFAULT_CAP_MB = 25.0
DDP_DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB


@dataclass(frozen=True)
class TimelinePolicy:
    """How gradients are grouped and when their communication starts.

    dense: one of :data:`DENSE_POLICIES`; sparse: one of :data:`SPARSE_POLICIES`.
    bucket_cap_mb: DDP's ``bucket_cap_mb`` (MiB, > 0); None = DDP's default 25 MiB. first_bucket_mb: the cap of
    the first bucket (the last layers' gradients); None = what DDP does: 1 MiB when bucket_cap_mb is left at
    its default, else bucket_cap_mb itself (torch 2.13 ``_BucketCapacityConfig``).
    fusion_threshold_mb (MiB, > 0) and cycle_time_s (s, > 0): Horovod's ``HOROVOD_FUSION_THRESHOLD`` and
    ``HOROVOD_CYCLE_TIME`` (defaults 128 MiB and 1 ms, Horovod >= 0.21).
    blocking: False (default: communication overlaps backward on its own stream) or True: each operation's
    selection and collective stall the rank's compute stream from the moment its bucket is ready until the
    collective ends (a synchronous comm hook); not valid with dense ``horovod`` (simulate_timeline raises).
    plan: the :class:`sim.engine.hybrid.HybridPlan` of sparse ``hybrid`` (required there, refused elsewhere).
    Raises ConfigError for an unknown policy, a value out of range, or a plan missing / given without ``hybrid``.
    """

    dense: str = "ddp"
    sparse: str = "model"
    bucket_cap_mb: float | None = None
    first_bucket_mb: float | None = None
    fusion_threshold_mb: float = 128.0
    cycle_time_s: float = 1e-3
    blocking: bool = False
    plan: "object | None" = None

    def __post_init__(self):
        if not isinstance(self.blocking, bool):
            raise ConfigError(f"blocking = {self.blocking!r} is not a bool: valid True, False")
        if self.dense not in DENSE_POLICIES:
            raise ConfigError(f"dense policy = {self.dense!r} is unknown: valid {', '.join(DENSE_POLICIES)}")
        if self.sparse not in SPARSE_POLICIES:
            raise ConfigError(f"sparse policy = {self.sparse!r} is unknown: valid {', '.join(SPARSE_POLICIES)}")
        if (self.sparse == "hybrid") != (self.plan is not None):
            raise ConfigError("sparse policy 'hybrid' needs a plan (sim.engine.hybrid.HybridPlan) and a plan needs "
                              f"sparse policy 'hybrid': valid both or neither (here sparse = {self.sparse!r}, plan "
                              f"{'given' if self.plan is not None else 'None'})")
        for f in ("bucket_cap_mb", "first_bucket_mb"):
            if getattr(self, f) is not None:
                check_real(f, getattr(self, f), 0, 1e6, lo_open=True, err=ConfigError)
        check_real("fusion_threshold_mb", self.fusion_threshold_mb, 0, 1e6, lo_open=True, err=ConfigError)
        check_real("cycle_time_s", self.cycle_time_s, 0, 10, lo_open=True, err=ConfigError)

    def bucket_limits_bytes(self) -> tuple[int, int]:
        """(first bucket cap, bucket cap) in bytes, as DDP computes them (``int(mb * 1024 * 1024)``)."""
        cap = int((DDP_DEFAULT_CAP_MB if self.bucket_cap_mb is None else self.bucket_cap_mb) * MIB)
        if self.first_bucket_mb is not None:
            first = int(self.first_bucket_mb * MIB)
        else:
            first = DDP_DEFAULT_FIRST_BUCKET_BYTES if self.bucket_cap_mb is None else cap
        return first, cap


@dataclass(frozen=True)
class Bucket:
    """A group of parameter tensors communicated together.

    tensors: indices into ``Workload.tensors``, in the order their gradients become ready. numel: their total
    elements. The bucket is ready when its last tensor's gradient is.
    """

    tensors: tuple[int, ...]
    numel: int


def _bucket_assignment(sizes_bytes: list[int], limits: list[int]) -> list[list[int]]:
    """DDP's ``compute_bucket_assignment_by_size`` (torch/csrc/distributed/c10d/reducer.cpp) for one dtype and
    device: walk the tensors in the given order, add each to the open bucket, close the bucket as soon as its
    size reaches the current limit and move to the next limit (the last one repeats); positions, not indices."""
    out, cur, size, li = [], [], 0, 0
    for pos, b in enumerate(sizes_bytes):
        cur.append(pos)
        size += b
        if size >= limits[li]:
            out.append(cur)
            cur, size = [], 0
            li = min(li + 1, len(limits) - 1)
    if cur:
        out.append(cur)
    return out


def ddp_buckets(workload: Workload, policy: TimelinePolicy | None = None, element_bytes: int = 4) -> list[Bucket]:
    """The buckets of PyTorch DDP (torch 2.13) after its first-iteration rebuild, in launch order.

    DDP rebuilds its buckets after the first backward from the order in which gradients became ready
    (``Reducer::rebuild_buckets``), with limits [first bucket cap, bucket cap] (:meth:`TimelinePolicy.
    bucket_limits_bytes`); here the ready order is :meth:`Workload.grad_ready_order` (layers in reverse, a
    layer's tensors in reverse definition order). element_bytes: bytes per gradient element (4: float32).
    Returns the buckets in launch order (bucket 0 holds the last layers). Tested equal to
    ``torch.distributed._compute_bucket_assignment_by_size`` and to a real DDP model's rebuilt buckets.
    """
    policy = policy or TimelinePolicy()
    check_int("element_bytes", element_bytes, 1, 16, err=ConfigError)
    order = workload.grad_ready_order()
    sizes = [workload.tensors[i].numel * element_bytes for i in order]
    first, cap = policy.bucket_limits_bytes()
    groups = _bucket_assignment(sizes, [first, cap])
    return [Bucket(tuple(order[p] for p in g), int(sum(workload.tensors[order[p]].numel for p in g))) for g in groups]


def layer_buckets(workload: Workload) -> list[Bucket]:
    """One bucket per layer with parameters (its tensors together), in backward order."""
    li = workload.layer_index()
    by_layer: dict[int, list[int]] = {}
    for i in workload.grad_ready_order():
        by_layer.setdefault(li[workload.tensors[i].layer], []).append(i)
    return [Bucket(tuple(v), int(sum(workload.tensors[i].numel for i in v)))
            for _, v in sorted(by_layer.items(), key=lambda kv: -kv[0])]


def whole_model_bucket(workload: Workload) -> list[Bucket]:
    """One bucket holding every tensor (the released gTop-k code's single buffer, DDP-less dense)."""
    return [Bucket(tuple(workload.grad_ready_order()), workload.d)]


def bucket_k(spec: AlgorithmSpec, d: int, d_b: int) -> int:
    """k of a bucket of d_b elements for a sparse spec selecting spec.k of d: ``min(d_b, max(1, round(k / d x d_b)))``
    (density x bucket size), spec.k itself when d_b = d -- the one rule of :meth:`AlgorithmSpec.segment_ks`, which
    the numerics' layer-wise selection uses too."""
    return segment_k(spec.k, d, d_b)


def horovod_fusion(ready: np.ndarray, numel: np.ndarray, threshold_bytes: int, cycle_s: float, durations,
                   element_bytes: int = 4):
    """Horovod's tensor-fusion schedule (background cycle loop; docs/tensor-fusion.rst).

    ready: float array (n,) of the times (s) each tensor is ready on every rank, in ready order; numel: int
    array (n,). durations: callable numel -> allreduce seconds. Every cycle (starting at cycle_s), the tensors
    ready by the cycle's start that are not yet reduced are packed in order into buffers of at most
    threshold_bytes (a tensor larger than the threshold goes alone) and reduced one after another from
    max(cycle start, end of the previous allreduce); the next cycle starts at max(start + cycle_s, end).
    Returns a list of (tensor positions, start s, end s) per fused allreduce.
    """
    n = len(ready)
    done = 0
    t_cycle = cycle_s
    free = 0.0
    out = []
    while done < n:
        if ready[done] > t_cycle:  # nothing ready: skip to the first cycle at or after the next ready tensor
            t_cycle += math.ceil((ready[done] - t_cycle) / cycle_s) * cycle_s
            if ready[done] > t_cycle:  # rounding
                t_cycle += cycle_s
        stop = done
        while stop < n and ready[stop] <= t_cycle:
            stop += 1
        start = max(t_cycle, free)
        pos = done
        while pos < stop:
            grp, size = [pos], int(numel[pos]) * element_bytes
            pos += 1
            while pos < stop and size + int(numel[pos]) * element_bytes <= threshold_bytes:
                size += int(numel[pos]) * element_bytes
                grp.append(pos)
                pos += 1
            dur = durations(int(sum(int(numel[p]) for p in grp)))
            out.append((grp, start, start + dur))
            start += dur
        free = start
        done = stop
        t_cycle = max(t_cycle + cycle_s, free)
    return out


class CollectiveTimer:
    """Seconds of one collective of ``spec`` over ``numel`` elements on the cluster, simulated alone and cached.

    Runs :func:`sim.engine.timing.simulate_timing` for one iteration with a compute model that keeps only the
    collective's own compute (merge and reduce coefficients) and no forward/backward, compression
    (:data:`sim.base.ops.COMPRESSION_KINDS`: select, scan, matmul; :func:`compression_s` charges them) or update,
    so the result is the collective's time on that engine. network: a NetworkSpec or ClusterSpec with P ranks.

    The cache maps a key (:meth:`key`: the spec and the element count) to (seconds, wire bytes per rank). A caller
    that knows which collectives it will ask for may simulate them elsewhere (other processes) with
    :meth:`simulate` -- the function a miss runs here, with :meth:`context`'s arguments -- and hand the results in
    with :meth:`fill`; :meth:`missing` says which keys are not cached yet. The numbers are the same wherever
    :meth:`simulate` ran (a pure function of its arguments).
    """

    def __init__(self, P: int, network, compute: ComputeModel | None, engine: str = "auto"):
        self.P, self.network, self.engine = P, network, engine
        base = compute or ComputeModel()
        self.compute = dataclasses.replace(base, forward_backward_s=0.0, select_coeff_s=0.0, update_coeff_s=0.0,
                                           scan_coeff_s=0.0, matmul_coeff_s=0.0, jitter="none", jitter_scale=0.0, straggler_prob=0.0, straggler_factor=1.0)
        self._cache: dict = {}

    @staticmethod
    def key(spec: AlgorithmSpec, numel: int) -> tuple:
        """The cache key of spec's collective over numel elements: ``(spec, int(numel))`` (spec is hashable)."""
        return (spec, int(numel))

    @staticmethod
    def simulate(spec: AlgorithmSpec, numel: int, P: int, network, compute: ComputeModel,
                 engine: str) -> tuple[float, float]:
        """One collective alone: (seconds, wire bytes per rank) of :func:`sim.engine.timing.simulate_timing` of
        ``spec`` over ``numel`` elements on P ranks of ``network`` for one iteration, with ``compute`` (the timer's
        stripped model, :attr:`compute`) on ``engine``. A static method of picklable arguments, so a worker process
        can run it (:meth:`context` gives the last four). Raises what simulate_timing raises."""
        from sim.engine.timing import simulate_timing

        r = simulate_timing(spec, P, int(numel), network=network, compute=compute, iterations=1, engine=engine)
        return (float(r.iter_s[0]), r.bytes / P)

    def context(self) -> tuple:
        """``(P, network, compute, engine)``: the arguments after (spec, numel) of :meth:`simulate` for this timer."""
        return (self.P, self.network, self.compute, self.engine)

    def missing(self, keys) -> list:
        """The keys (of :meth:`key`) among ``keys`` not in the cache, each once, in their first order."""
        return [k for k in dict.fromkeys(keys) if k not in self._cache]

    def fill(self, results) -> None:
        """Put ``results`` ({key: (seconds, wire bytes per rank)}, as :meth:`simulate` returns them for this timer's
        :meth:`context`) into the cache; a key already cached keeps its value."""
        for k, v in dict(results).items():
            self._cache.setdefault(k, tuple(v))

    def _run(self, spec: AlgorithmSpec, numel: int) -> tuple[float, float]:
        key = self.key(spec, numel)
        if key not in self._cache:
            self._cache[key] = self.simulate(spec, int(numel), *self.context())
        return self._cache[key]

    def __call__(self, spec: AlgorithmSpec, numel: int) -> float:
        """Seconds of spec's collective over numel elements (spec.k already the bucket's k)."""
        return self._run(spec, numel)[0]

    def wire_bytes(self, spec: AlgorithmSpec, numel: int) -> float:
        """Bytes the collective puts on the wire per rank (the mean over ranks, as metrics.csv's bytes_sent)."""
        return self._run(spec, numel)[1]


def compression_s(compute: ComputeModel, spec: AlgorithmSpec, numel: int, k: int | None, iteration: int = 1) -> float:
    """Seconds one rank spends compressing a bucket of ``numel`` elements to ``k`` entries (None for an algorithm
    without k) before its collective: the sum, in order, of ``compute.seconds(kind, work, 0, iteration)`` over
    ``spec.algorithm.compression_work(spec, numel, k)`` (0.0 when it is empty: dense; a top-k's one ``select`` gives
    exactly ``compute.seconds("select", numel, 0, iteration)``). The same operations the numerics and the fast
    engine charge (:meth:`sim.algorithms.base.Algorithm.compression_work`), so the timeline of one bucket agrees
    with them. Raises SparsimError as ComputeModel.seconds does."""
    return sum((compute.seconds(kind, work, 0, iteration) for kind, work in
                spec.algorithm.compression_work(spec, numel, k)), 0.0)


@dataclass
class IterationTimeline:
    """What happened in one iteration, for the trace: per rank, per stream, slices (name, start s, end s, args).

    compute: list over ranks of lists of (name, start, end, args); comm: the same for the communication stream.
    Times are seconds from the iteration's start; start_s is that start on the run's simulated clock (the sum of
    the earlier iterations' times, as metrics.csv's sim_time_s) and duration_s the iteration's time.
    """

    iteration: int
    duration_s: float = 0.0
    start_s: float = 0.0
    compute: list = field(default_factory=list)
    comm: list = field(default_factory=list)


@dataclass(frozen=True)
class TimelineResult:
    """Per-iteration times of a timeline simulation (all float arrays (iterations,), seconds, rank 0 except
    iter_s, which is the slowest rank's finish).

    compute_s: forward + backward + update; compress_s: compression time (:func:`compression_s`); comm_s: sum of the collectives'
    durations; exposed_comm_s: iter_s - compute_s; overlap_ratio: 1 - exposed / (comm + compress) in [0, 1]
    (0 when nothing is communicated). buckets: the communication operations (:class:`Bucket`) in order (Horovod: the fused buffers of the last
    iteration, which depend on the ready times), with
    ks: their k (None for dense). bytes_per_rank: bytes one rank puts on the wire per iteration (the mean over
    ranks, from the collectives' simulation; metrics.csv's bytes_sent, as in a numerics run). timelines: the
    :class:`IterationTimeline` of each traced iteration (communication slices carry ``bytes``, the wire bytes
    per rank, and ``payload_bytes``, what the rank contributes: 4 d_b dense, (value + index bytes) k_b sparse).
    """

    iter_s: np.ndarray
    compute_s: np.ndarray
    compress_s: np.ndarray
    comm_s: np.ndarray
    exposed_comm_s: np.ndarray
    overlap_ratio: np.ndarray
    buckets: list
    ks: list
    bytes_per_rank: float
    timelines: list


def _comm_ops(spec: AlgorithmSpec, workload: Workload, policy: TimelinePolicy) -> tuple[list[Bucket], str]:
    if not spec.algorithm.sparse:
        if policy.dense == "ddp":
            return ddp_buckets(workload, policy, spec.value_bytes), "ddp"
        if policy.dense == "horovod":
            return [], "horovod"
        return whole_model_bucket(workload), "none"
    if policy.sparse in ("bucket", "hybrid"):
        buckets = ddp_buckets(workload, policy, spec.value_bytes)
        if policy.sparse == "hybrid":  # the plan's own algorithm and model (sim.engine.hybrid.check_plan_algorithm)
            policy.plan.check_algorithm(spec.name)
            policy.plan.check_buckets(workload, buckets)
        return buckets, policy.sparse
    if policy.sparse == "layer":
        return layer_buckets(workload), "layer"
    return whole_model_bucket(workload), "model"


def simulate_timeline(spec: AlgorithmSpec, workload: Workload, P: int, *, network, policy: TimelinePolicy | None = None,
                      device: DeviceModel | None = None, batch_size: int = 32, compute: ComputeModel | None = None,
                      iterations: int = 1, trace_iterations=(), engine: str = "auto", trace_ranks: int = 8,
                      on_iteration=None, timer: CollectiveTimer | None = None) -> TimelineResult:
    """Simulate ``iterations`` iterations of ``spec`` training ``workload`` on P ranks (module docstring).

    spec: dense, or a sparse spec whose k is the whole model's (k / d is the density used per bucket; under the
    ``hybrid`` policy the plan's per-bucket densities replace it, and its dense buckets run dense S-SGD at the plan's
    dense collective with the spec's value bytes and ranks per node);
    network: NetworkSpec or ClusterSpec with P ranks; device: turns FLOPs into seconds (None for a measured
    workload); batch_size: samples per rank; compute: jitter, stragglers and the select / merge / reduce /
    update coefficients (its forward_backward_s is not used: the workload gives the compute).
    trace_iterations: 1-based iterations whose per-rank slices are kept for :func:`chrome_trace` (the first
    ``trace_ranks`` ranks). on_iteration: optional callable(t) after each iteration (progress). timer: a
    :class:`CollectiveTimer` of the same P, network, compute model and engine, to share its cache of collective times
    across calls (None: a fresh one).
    Returns a :class:`TimelineResult`. Raises ConfigError / SparsimError for out-of-range values.
    """
    policy = policy or TimelinePolicy()
    check_int("P", P, 1, err=ConfigError)
    check_int("iterations", iterations, 1, err=ConfigError)
    check_int("batch_size", batch_size, 1, err=ConfigError)
    check_int("trace_ranks", trace_ranks, 1, err=ConfigError)
    d = workload.d
    spec.check_dim(d)
    compute = compute or ComputeModel()
    fwd, bwd = workload.layer_times(batch_size, device)
    L = len(workload.layers)
    # backward end of layer l relative to the backward start, at factor 1 (layers run in reverse)
    bwd_end = np.empty(L)
    acc = 0.0
    for l in range(L - 1, -1, -1):
        acc += bwd[l]
        bwd_end[l] = acc
    F, B = float(fwd.sum()), float(bwd.sum())
    li = workload.layer_index()
    tensor_ready = np.array([bwd_end[li[t.layer]] for t in workload.tensors])  # after forward, at factor 1
    if timer is None:
        timer = CollectiveTimer(P, network, compute, engine)
    buckets, mode = _comm_ops(spec, workload, policy)
    if policy.blocking and mode == "horovod":
        raise ConfigError("blocking = True does not apply to dense policy 'horovod' (its background loop never "
                          "stalls backward): valid dense ddp or none, or blocking = False")
    if mode == "hybrid":  # the plan's k_b per bucket, None (and the dense allreduce) for its dense buckets
        ks = list(policy.plan.ks())
        dense_spec = AlgorithmSpec("dense", collective=policy.plan.dense_collective, value_bytes=spec.value_bytes,
                                   gpus_per_node=spec.gpus_per_node)
        bspecs = [dense_spec if k is None else dataclasses.replace(spec, k=k) for k in ks]
    else:
        ks = [bucket_k(spec, d, b.numel) if spec.algorithm.sparse else None for b in buckets]
        bspecs = [spec if (k is None or k == spec.k) else dataclasses.replace(spec, k=k) for k in ks]
    update_s = compute.seconds("update", d, 0, 0)
    trace_set = {int(t) for t in trace_iterations}
    R = min(P, trace_ranks)
    out = {k: np.empty(iterations) for k in ("iter", "compute", "compress", "comm", "exposed", "overlap")}
    timelines = []
    if mode == "horovod":
        order = workload.grad_ready_order()
        numel_o = np.array([workload.tensors[i].numel for i in order], dtype=np.int64)
    nbytes = 0
    for t in range(1, iterations + 1):
        factor = np.array([compute.forward_backward_factor(r, t) for r in range(P)]) \
            if (compute.jitter != "none" or compute.straggler_prob > 0) else np.ones(P)
        comp_end = factor * (F + B)  # (P,) backward end per rank, without stalls
        ops = []  # (name, bucket tensors, k, ready (P,), sel_s, coll_start, coll_end, bytes, trace name)
        free = 0.0
        shift = np.zeros(P)  # blocking: how much later than at factor x (F + position) each rank's compute is
        stalls = []  # blocking: (unstalled position (P,), shift from there on (P,)) per operation, for the trace
        if mode == "horovod":
            ready_all = factor.max() * (F + tensor_ready[order])  # ready on every rank: the slowest rank's time
            sched = horovod_fusion(ready_all, numel_o, int(policy.fusion_threshold_mb * MIB), policy.cycle_time_s,
                                   lambda n: compression_s(compute, spec, n, None, t) + timer(spec, n), spec.value_bytes)
            buckets = [Bucket(tuple(order[p] for p in grp), int(numel_o[grp].sum())) for grp, _, _ in sched]
            ks = [None] * len(buckets)  # the fused buffers of this iteration (they depend on the ready times)
            sel_total = 0.0
            for bi, ((grp, s, e), b) in enumerate(zip(sched, buckets)):
                sel = compression_s(compute, spec, b.numel, None, t)  # 0 for dense; PowerSGD's products
                ops.append((f"fused buffer {bi} ({len(grp)} tensors)", b, None, np.full(P, s), sel, s + sel, e,
                            (timer.wire_bytes(spec, b.numel), b.numel * spec.value_bytes), spec.algorithm.trace_name))
                sel_total += sel
            free = sched[-1][2] if sched else 0.0
        else:
            sel_total = 0.0
            for bi, (b, k, bs) in enumerate(zip(buckets, ks, bspecs)):
                base = factor * (F + float(tensor_ready[list(b.tensors)].max()))  # (P,) ready without stalls
                rdy = base + shift
                sel = compression_s(compute, bs, b.numel, k, t)  # the algorithm's compression_work (0 for dense)
                sel_end = np.maximum(rdy, free) + sel
                cs = float(sel_end.max())
                ce = cs + timer(bs, b.numel)
                ops.append((f"bucket {bi}", b, k, rdy, sel, cs, ce,
                            (timer.wire_bytes(bs, b.numel), bs.algorithm.payload_bytes(bs, b.numel, k)),
                            bs.algorithm.trace_name))
                free = ce
                sel_total += sel
                if policy.blocking:  # the compute stream, stopped at base + shift, resumes at ce
                    shift = ce - base
                    stalls.append((base, shift.copy()))
        ends = np.maximum(comp_end + shift, free) + update_s
        it_s = float(ends.max())
        comp0 = float(comp_end[0]) + update_s
        comm = float(sum(o[6] - o[5] for o in ops))
        exposed = it_s - comp0
        denom = comm + sel_total
        out["iter"][t - 1] = it_s
        out["compute"][t - 1] = comp0
        out["compress"][t - 1] = sel_total
        out["comm"][t - 1] = comm
        out["exposed"][t - 1] = exposed
        out["overlap"][t - 1] = min(1.0, max(0.0, 1.0 - exposed / denom)) if denom > 0 else 0.0
        nbytes = float(sum(o[7][0] for o in ops))
        if t in trace_set:
            tl = IterationTimeline(t, it_s, float(out["iter"][: t - 1].sum()))
            for r in range(R):
                c, fr = [], factor[r]
                s = 0.0
                for l, layer in enumerate(workload.layers):
                    e = s + fr * fwd[l]
                    c.append((f"forward {layer.name}", s, e, {"layer": layer.name}))
                    s = e
                sh, j = 0.0, 0
                for l in range(L - 1, -1, -1):
                    while j < len(stalls) and stalls[j][0][r] <= s * (1 + 1e-12):  # stalled before this layer
                        sh = float(stalls[j][1][r])
                        j += 1
                    e = s + fr * bwd[l]
                    c.append((f"backward {workload.layers[l].name}", s + sh, e + sh,
                              {"layer": workload.layers[l].name}))
                    s = e
                u0 = max(float(comp_end[r] + shift[r]), free)
                c.append(("update", u0, u0 + update_s, {"parameters": d}))
                m, prev = [], 0.0
                for name, b, k, rdy, sel, cs, ce, nb, tname in ops:
                    if sel > 0:
                        s0 = max(float(rdy[r]), prev)
                        m.append((f"select {name}", s0, s0 + sel, {"elements": b.numel, "k": k}))
                    args = {"bytes": nb[0], "payload_bytes": nb[1], "elements": b.numel}
                    if k is not None:
                        args["k"] = k
                    m.append((f"{tname} {name}", cs, ce, args))
                    prev = ce
                tl.compute.append(c)
                tl.comm.append(m)
            timelines.append(tl)
        if on_iteration is not None:
            on_iteration(t)
    return TimelineResult(out["iter"], out["compute"], out["compress"], out["comm"], out["exposed"], out["overlap"],
                          buckets, ks, nbytes, timelines)


def chrome_trace(timelines_by_label: dict, path) -> None:
    """Write a Chrome trace event JSON file (the format Perfetto and chrome://tracing open).

    timelines_by_label: {label: [IterationTimeline, ...]} (e.g. one label per algorithm). Each (label, rank)
    is a process (``pid``), named "<label> rank r"; its threads are ``compute`` (tid 0) and ``comm`` (tid 1).
    Every slice is a complete event (``ph = "X"``) with ``ts`` and ``dur`` in microseconds from the run's start
    on the simulated clock (``IterationTimeline.start_s``: the same time axis as metrics.csv's sim_time_s, so
    iterations not traced leave gaps). args carry
    the bytes, elements and k of communication slices. The file is written to ``path + ".partial"`` and
    renamed, so no half-written trace is left.
    """
    import os

    events = []
    pid = 0
    for label, tls in timelines_by_label.items():
        if not tls:
            continue
        nranks = len(tls[0].compute)
        for r in range(nranks):
            pid += 1
            events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"{label} rank {r}"}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "compute"}})
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "comm"}})
            for tl in tls:
                offset = tl.start_s
                for tid, slices in ((0, tl.compute[r]), (1, tl.comm[r])):
                    for name, s, e, args in slices:
                        events.append({"name": name, "cat": "compute" if tid == 0 else "comm", "ph": "X", "pid": pid,
                                       "tid": tid, "ts": (offset + s) * 1e6, "dur": (e - s) * 1e6,
                                       "args": {**args, "iteration": tl.iteration}})
    tmp = f"{path}.partial"
    with open(tmp, "w") as fh:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fh)
    os.replace(tmp, path)


def flat_segments(workload: Workload, buckets: list[Bucket]) -> tuple[int, ...]:
    """The sizes of ``buckets`` as consecutive segments of the flat parameter vector (tensors in
    ``workload.tensors`` order, as ``module.parameters()``), ordered by position: what the numerics' layer-wise
    selection (``AlgorithmSpec.segments``) needs to select per DDP bucket or per layer exactly as the timeline
    communicates. Raises ConfigError when a bucket's tensors are not consecutive in that order (autograd's ready
    order interleaves them), since a segment must be one contiguous range."""
    spans = []
    for b in buckets:
        idx = sorted(b.tensors)
        if idx != list(range(idx[0], idx[-1] + 1)):
            raise ConfigError(f"workload {workload.name!r}: a bucket holds tensors {idx} that are not consecutive in the "
                              "flat parameter vector, so its selection cannot be one segment: valid "
                              "workload.sparse_policy = 'model' or 'layer' for this network")
        spans.append((idx[0], sum(workload.tensors[i].numel for i in idx)))
    return tuple(n for _, n in sorted(spans))


@dataclass(frozen=True)
class TimelineClock:
    """The simulated clock of a numerics run that trains a real network (a scenario's ``[model]``).

    The numbers (gradients, selections, residuals) come from the per-rank programs on the lock-step driver; the
    time of each iteration is the same network's layer-wise timeline (:func:`simulate_timeline`) on the cluster:
    forward and backward per layer on ``device`` (FLOPs of ``workload``) at ``batch_size`` samples per rank, DDP
    buckets or the sparse policy overlapped with backward, the hierarchy of ``network``. The timing of a step does
    not depend on the values it carries (every collective's message sizes follow from k and d), so the clock of
    every iteration is known before the step runs; for the threshold schemes (DGC, Gaussian-k), whose selected
    count varies, the timeline charges k per bucket, as their timing-only form does.

    time_budget_s > 0: :meth:`iterations_within` keeps the iterations whose end on the clock -- the float64 sum
    of the iteration times in iteration order, ``np.cumsum`` -- is <= the budget, compared exactly (an iteration
    ending exactly at the budget runs; one ending a rounding step after it does not).
    """

    workload: Workload
    P: int
    network: object
    policy: "TimelinePolicy"
    device: DeviceModel | None
    batch_size: int
    compute: ComputeModel
    engine: str = "auto"
    time_budget_s: float = 0.0

    def __call__(self, spec: AlgorithmSpec, iterations: int, **trace) -> TimelineResult:
        """The timeline of ``iterations`` iterations of ``spec`` (its segments dropped: the policy gives the
        buckets and their k_b, the same rule :func:`segment_k` as the numerics' segments; under the ``hybrid`` policy
        its plan gives them, as it gives the numerics' segment densities). ``trace``:
        :func:`simulate_timeline`'s ``trace_iterations`` / ``trace_ranks``."""
        return simulate_timeline(dataclasses.replace(spec, segments=None, segment_densities=None, dense_collective=None),
                                 self.workload, self.P, network=self.network,
                                 policy=self.policy, device=self.device, batch_size=self.batch_size,
                                 compute=self.compute, iterations=iterations, engine=self.engine, **trace)

    def iterations_within(self, res: TimelineResult) -> int:
        """How many of ``res``'s iterations run: all without a budget, else those whose clock <= time_budget_s."""
        if not self.time_budget_s:
            return len(res.iter_s)
        return int(np.searchsorted(np.cumsum(res.iter_s), self.time_budget_s, side="right"))
