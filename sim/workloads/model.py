"""The workload data model: parameter tensors, per-layer costs, device models.

Units: FLOPs per sample (one forward or backward pass over one input sample: an image, a sequence);
seconds (s); FLOP/s; bytes/s (memory bandwidth).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.base.errors import ConfigError, check_int, check_real

__all__ = ["ParamTensor", "LayerCost", "DeviceModel", "KindCost", "Workload", "MAX_LAYER_S", "MAX_LAYER_FLOPS",
           "SELECT_PASSES", "REDUCE_PASSES", "UPDATE_PASSES", "DEFAULT_MEM_EFFICIENCY", "COST_KINDS"]


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor of a model.

    name: its qualified name as ``module.named_parameters()`` gives it (e.g. ``layer1.0.conv1.weight``).
    numel: number of elements, integer >= 1. layer: the name of the :class:`LayerCost` that owns it.
    """

    name: str
    numel: int
    layer: str

    def __post_init__(self):
        check_int(f"numel of tensor {self.name!r}", self.numel, 1, 10**12, err=ConfigError)


#: Upper limits of a layer's cost, where no real layer is larger (the numerics runs' limit on
#: compute.forward_backward_s is the same hour): one hour of forward or backward per layer at the measured
#: batch (s), and 1e18 FLOPs per sample (a GPT-3-sized layer is about 1e12). With them an iteration's compute
#: stays far below float64's range, so communication is not rounded away next to it (issue: 1e308 FLOPs
#: made every speed-up 1.00x and printed 300-digit cells).
MAX_LAYER_S = 3600.0
MAX_LAYER_FLOPS = 1e18
#: Upper limit of a whole step's compute, forward + backward over every layer at the run's batch size and device
#: (s): the numerics runs' limit on compute.forward_backward_s (sim.machine.compute.MAX_FORWARD_BACKWARD_S, the
#: same hour). The per-layer limits above alone let many layers (or a large batch) add up to years per step, next
#: to which communication rounds away (issue #23: two layers of 1e18 FLOPs gave 7.4e6 s and speed-up 1.00x).
MAX_STEP_S = 3600.0


@dataclass(frozen=True)
class LayerCost:
    """One layer (a leaf module, with or without parameters) and its compute cost.

    Either FLOPs per sample (``forward_flops``, ``backward_flops``: finite reals >= 0; the backward
    FLOPs include the weight-gradient and input-gradient passes) or measured seconds at the workload's
    ``measured_batch`` (``forward_s``, ``backward_s``: finite reals >= 0). Layers with measured seconds
    have ``forward_flops = backward_flops = 0`` unless both are known.
    """

    name: str
    forward_flops: float = 0.0
    backward_flops: float = 0.0
    forward_s: float | None = None
    backward_s: float | None = None

    def __post_init__(self):
        for f in ("forward_flops", "backward_flops"):
            check_real(f"{f} of layer {self.name!r}", getattr(self, f), 0, MAX_LAYER_FLOPS, err=ConfigError)
        for f in ("forward_s", "backward_s"):
            if getattr(self, f) is not None:
                check_real(f"{f} of layer {self.name!r}", getattr(self, f), 0, MAX_LAYER_S, err=ConfigError)


#: Passes over memory of one top-k selection of k of x values (a pass moves the x values' bytes once, read or
#: write): :func:`sim.comm.compression.topk`'s numpy path (sampled threshold, abs, compare, compaction, exact
#: selection among the candidates: the elementwise operations a GPU implementation built from tensor operations
#: runs) at k/d = 1e-3, float32, timed against ``np.copyto`` (2 passes) by ``benchmarks/bench_select_passes.py``:
#: 9.0, the mean over d = 1e8 and 2e8 (beyond the 300 MiB L3 of the VM it ran on; 9.05 in the committed
#: ``benchmarks/results/select_passes.csv``, 9.00 in an earlier run), rounded to two digits; docs/costs-per-device.md.
#: The same project's fused numba kernel makes 2.5 passes; ``torch.topk(x.abs())`` on a GPU, counted from
#: pytorch/pytorch#167462's figures, 6 to 8.
SELECT_PASSES = 9.0

#: Passes over memory of a dense reduction ``a += b`` per element (two reads and a write; ``np.add(b, x, out=b)``
#: measured 2.9 and 3.0 at d = 1e8 and 2e8 by the same benchmark) and of an SGD update ``w -= lr g`` per parameter
#: (read w and g, write w).
REDUCE_PASSES = 3
UPDATE_PASSES = 3

#: Fraction of a device's datasheet memory bandwidth that a streaming kernel reaches: 0.87, as a measured
#: device-to-device copy on an A100 40 GB (1355 of 1555 GB/s; PTsolvers/gpu-workshop-JuliaCon23 issue 7) and
#: cub's BabelStream kernels (87-88 % of peak; NVIDIA/cccl pull request 9881).
DEFAULT_MEM_EFFICIENCY = 0.87

#: Valid range of :attr:`DeviceModel.select_passes`: a selection reads every value at least once, and 1000 is
#: beyond the slowest selection on record here (the P102-100 fit implies about 516 passes at d = 25.6M).
MIN_SELECT_PASSES, MAX_SELECT_PASSES = 1.0, 1000.0
#: Largest memory bandwidth (bytes/s) a device may state: 1 PB/s (an H200 has 4.8e12, a B200 8e12).
MAX_MEM_BANDWIDTH_BPS = 1e15
#: Largest measured coefficient (s per element, or per x log2 x): one second, the limit of the scenario keys
#: compute.*_coeff_s (:data:`sim.machine.compute.MAX_COEFF_S`; sim.workloads does not import sim.machine).
MAX_DEVICE_COEFF_S = 1.0

#: The compute kinds a device's cost model prices (forward and backward come from FLOPs or measured seconds),
#: each with the unit of its work: ``scan``, the bytes a compressor moves through device memory (rand-k's gathers,
#: Gaussian-k's and DGC's threshold passes, PowerSGD's matrix reads); ``matmul``, a compressor's matrix-product FLOPs.
COST_KINDS = {"select": "x log2 x", "merge": "element merged", "reduce": "element added", "update": "parameter",
              "scan": "byte", "matmul": "FLOP"}


@dataclass(frozen=True)
class KindCost:
    """The cost of one compute kind on a device: ``coeff_s`` seconds per unit of work, the unit given by
    ``scaling`` (``"x log2 x"``: a selection over x elements costs coeff_s x log2 x, the gTop-k papers' fit;
    ``"x"``: coeff_s per element, the memory model); ``model``: the formula that gives it; ``source``: where its
    figures come from; ``passes``: passes over memory per element in the memory model (None for a measured
    coefficient)."""

    coeff_s: float
    scaling: str
    model: str
    source: str
    passes: float | None = None


@dataclass(frozen=True)
class DeviceModel:
    """A device: peak FLOP/s times an achieved fraction for forward and backward, and a memory model for the
    selection, merge, reduction and update costs of S-SGD.

    Compute: seconds = FLOPs / (peak_flops * efficiency). peak_flops: the device's peak (FLOP/s, > 0) for the
    precision it trains in. efficiency: the fraction of peak a training step achieves, 0 < efficiency <= 1.
    source: where the peak comes from.

    Costs (:meth:`costs`, the compute model's ``select``, ``merge``, ``reduce``, ``update``, ``scan`` and ``matmul``
    kinds), per kind either a measured coefficient or the memory model

        seconds = passes x work x value_bytes / (mem_bandwidth_Bps x mem_efficiency)

    with passes = ``select_passes`` (selection over x elements), ``2 (value_bytes + index_bytes) / value_bytes
    + select_passes`` (merge: read both sparse inputs and write their union, then select among it),
    :data:`REDUCE_PASSES` (dense add) and :data:`UPDATE_PASSES` (SGD update); a compressor's memory traffic
    (``scan``, work in bytes) costs work / (mem_bandwidth_Bps x mem_efficiency), and its matrix products
    (``matmul``, work in FLOPs) work / (peak_flops x efficiency), the datasheet peak at the fraction a training
    step reaches (the roofline's two terms, charged as two kinds and added: an upper bound of the roofline's
    max, within a factor 2 of it). Fields:

    - mem_bandwidth_Bps: datasheet memory bandwidth (bytes/s), 0 < . <= 1e15; None: no memory model (every
      kind must then have a measured coefficient for :meth:`costs`).
    - mem_efficiency: fraction of it a streaming kernel reaches, 0 < . <= 1 (default
      :data:`DEFAULT_MEM_EFFICIENCY`).
    - select_passes: passes over memory of one top-k selection, 1 <= . <= 1000 (default :data:`SELECT_PASSES`,
      measured on a CPU).
    - select_coeff_s: a measured selection cost, seconds per x log2 x (the form of the gTop-k papers' fit and of
      ``benchmarks/gpu_check.py``'s ``torch_select_coeff_s``), 0 <= . <= 1; replaces the memory model for
      selections. None: the memory model.
    - merge_coeff_s, reduce_coeff_s, update_coeff_s: measured seconds per element merged / added / parameter
      updated, 0 <= . <= 1; each replaces the memory model for its kind. None: the memory model.
    - scan_coeff_s, matmul_coeff_s: measured seconds per byte scanned / per matrix-product FLOP, 0 <= . <= 1; None
      (the presets): the memory model / the FLOP model.
    - cost_source: where mem_bandwidth_Bps and any measured coefficient come from (printed with the costs).

    Raises ConfigError (one line naming the field, the value and the valid range) for a value out of range.
    """

    name: str
    peak_flops: float
    efficiency: float
    source: str = ""
    mem_bandwidth_Bps: float | None = None
    mem_efficiency: float = DEFAULT_MEM_EFFICIENCY
    select_passes: float = SELECT_PASSES
    select_coeff_s: float | None = None
    merge_coeff_s: float | None = None
    reduce_coeff_s: float | None = None
    update_coeff_s: float | None = None
    scan_coeff_s: float | None = None
    matmul_coeff_s: float | None = None
    cost_source: str = ""

    def __post_init__(self):
        check_real(f"peak_flops of device {self.name!r}", self.peak_flops, 0, lo_open=True, err=ConfigError)
        check_real(f"efficiency of device {self.name!r}", self.efficiency, 0, 1, lo_open=True, err=ConfigError)
        if self.mem_bandwidth_Bps is not None:
            check_real(f"mem_bandwidth_Bps of device {self.name!r}", self.mem_bandwidth_Bps, 0,
                       MAX_MEM_BANDWIDTH_BPS, lo_open=True, err=ConfigError)
        check_real(f"mem_efficiency of device {self.name!r}", self.mem_efficiency, 0, 1, lo_open=True, err=ConfigError)
        check_real(f"select_passes of device {self.name!r}", self.select_passes, MIN_SELECT_PASSES, MAX_SELECT_PASSES,
                   err=ConfigError)
        for f in ("select_coeff_s", "merge_coeff_s", "reduce_coeff_s", "update_coeff_s", "scan_coeff_s",
                  "matmul_coeff_s"):
            if getattr(self, f) is not None:
                check_real(f"{f} of device {self.name!r}", getattr(self, f), 0, MAX_DEVICE_COEFF_S, err=ConfigError)

    @property
    def flops_per_s(self) -> float:
        """Achieved FLOP/s: peak_flops * efficiency."""
        return self.peak_flops * self.efficiency

    @property
    def mem_Bps(self) -> float | None:
        """Achieved memory bandwidth (bytes/s): mem_bandwidth_Bps * mem_efficiency; None without a bandwidth."""
        return None if self.mem_bandwidth_Bps is None else self.mem_bandwidth_Bps * self.mem_efficiency

    def passes(self, kind: str, value_bytes: int = 4, index_bytes: int = 4) -> float:
        """Passes over memory per unit of ``kind``'s work in the memory model (class docstring): select_passes,
        2 (value_bytes + index_bytes) / value_bytes + select_passes, REDUCE_PASSES or UPDATE_PASSES. A pass moves
        value_bytes per element. Raises ConfigError for an unknown kind or bytes outside [1, 16] (values) /
        [0, 16] (indices)."""
        vb = check_int("value_bytes", value_bytes, 1, 16, err=ConfigError)
        ib = check_int("index_bytes", index_bytes, 0, 16, err=ConfigError)
        if kind == "select":
            return self.select_passes
        if kind == "merge":
            return 2 * (vb + ib) / vb + self.select_passes
        if kind == "reduce":
            return float(REDUCE_PASSES)
        if kind == "update":
            return float(UPDATE_PASSES)
        raise ConfigError(f"kind = {kind!r} has no device cost: valid kinds are {', '.join(COST_KINDS)}")

    def costs(self, value_bytes: int = 4, index_bytes: int = 4, kinds=None) -> dict[str, KindCost]:
        """The cost of each of :data:`COST_KINDS` on this device: kind -> :class:`KindCost`.

        A kind with a measured coefficient (``select_coeff_s``: per x log2 x; the others: per unit of work) gets it;
        the others the memory model, coeff_s = passes(kind) x value_bytes / (mem_bandwidth_Bps x mem_efficiency)
        seconds per element (scaling ``"x"``); ``scan``: 1 / (mem_bandwidth_Bps x mem_efficiency) seconds per byte;
        ``matmul``: 1 / (peak_flops x efficiency) seconds per FLOP (class docstring). value_bytes: bytes per value (1..16), index_bytes: per index
        (0..16), as the scenario's compression.value_bytes / index_bytes. kinds: the kinds to price, in
        :data:`COST_KINDS` order (None: all). Raises ConfigError when a kind asked for has neither a coefficient nor
        a memory bandwidth, for an unknown kind, or for bytes out of range.
        """
        out = {}
        if kinds is not None:
            unknown = [k for k in kinds if k not in COST_KINDS]
            if unknown:
                raise ConfigError(f"kind = {unknown[0]!r} has no device cost: valid kinds are {', '.join(COST_KINDS)}")
        for kind in COST_KINDS if kinds is None else [k for k in COST_KINDS if k in kinds]:
            measured = getattr(self, f"{kind}_coeff_s")
            if measured is not None:
                scaling = "x log2 x" if kind == "select" else "x"
                out[kind] = KindCost(float(measured), scaling, f"{float(measured):.3g} s x {scaling}",
                                     f"{self.name}, measured: {self.cost_source}")
                continue
            if kind == "matmul":
                c = 1.0 / self.flops_per_s
                out[kind] = KindCost(c, "x", f"1 FLOP / ({self.peak_flops:.4g} FLOP/s x {self.efficiency:g}) = {c:.3g} "
                                             "s x FLOPs",
                                     f"{self.name} FLOP model: {self.source}; matrix products at the training "
                                     "step's fraction of peak")
                continue
            if self.mem_bandwidth_Bps is None:
                raise ConfigError(f"device {self.name!r} has no {kind}_coeff_s and no mem_bandwidth_Bps: valid a "
                                  f"measured {kind}_coeff_s or a memory bandwidth 0 < mem_bandwidth_Bps <= 1e15 bytes/s")
            if kind == "scan":
                c = 1.0 / self.mem_Bps
                out[kind] = KindCost(c, "x", f"1 B / ({self.mem_efficiency:g} x {self.mem_bandwidth_Bps:.3g} B/s) = "
                                             f"{c:.3g} s x bytes",
                                     f"{self.name} memory model: {self.cost_source}; a compressor's bytes read or "
                                     "written (per algorithm, docs/costs-per-device.md)")
                continue
            p = self.passes(kind, value_bytes, index_bytes)
            c = p * value_bytes / self.mem_Bps
            out[kind] = KindCost(c, "x", f"{p:.3g} passes x {value_bytes} B / ({self.mem_efficiency:g} x "
                                         f"{self.mem_bandwidth_Bps:.3g} B/s) = {c:.3g} s x x",
                                 f"{self.name} memory model: {self.cost_source}; passes per element: selection "
                                 f"{self.select_passes:g} (measured on a CPU, benchmarks/bench_select_passes.py), merge "
                                 f"2 (value + index bytes) / value bytes + selection, reduce {REDUCE_PASSES}, update "
                                 f"{UPDATE_PASSES}", p)
        return out


@dataclass(frozen=True)
class Workload:
    """A model as the timeline sees it.

    layers: the layers in forward execution order (backward runs them in reverse).
    tensors: the parameter tensors in definition order (``module.parameters()``), each owned by one layer.
    measured_batch: the batch (samples per worker) at which the layers' ``forward_s``/``backward_s`` were
    measured; None when the costs are FLOPs. input: a description of one sample (e.g. ``3x224x224``).
    source: where the shapes and costs come from. ready_order: indices into ``tensors`` in the order autograd
    makes their gradients ready, as observed on the torch module (``register_post_accumulate_grad_hook``);
    None = the default rule of :meth:`grad_ready_order`.

    Raises ConfigError for no tensors, duplicate layer or tensor names, a tensor whose layer is not
    listed, or layers that mix FLOPs and measured seconds inconsistently.
    """

    name: str
    layers: tuple[LayerCost, ...]
    tensors: tuple[ParamTensor, ...]
    measured_batch: int | None = None
    input: str = ""
    source: str = ""
    ready_order: tuple[int, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "tensors", tuple(self.tensors))
        if not self.tensors:
            raise ConfigError(f"workload {self.name!r} has no parameter tensors: valid at least 1")
        total = sum(int(t.numel) for t in self.tensors)
        if total > 10**12:
            raise ConfigError(f"workload {self.name!r} has d = {total} parameters: valid d <= 10^12")
        names = [l.name for l in self.layers]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})[0]
            raise ConfigError(f"workload {self.name!r}: layer {dup!r} is listed twice: valid unique layer names")
        tn = [t.name for t in self.tensors]
        if len(set(tn)) != len(tn):
            dup = sorted({n for n in tn if tn.count(n) > 1})[0]
            raise ConfigError(f"workload {self.name!r}: tensor {dup!r} is listed twice: valid unique tensor names")
        known = set(names)
        for t in self.tensors:
            if t.layer not in known:
                raise ConfigError(f"workload {self.name!r}: tensor {t.name!r} belongs to layer {t.layer!r}, which is "
                                  "not among its layers")
        measured = [l.forward_s is not None for l in self.layers]
        if any(measured) and not all(measured):
            raise ConfigError(f"workload {self.name!r}: some layers have measured seconds and some do not: valid all "
                              "or none")
        if any(measured):
            check_int("measured_batch", self.measured_batch, 1, err=ConfigError)
        if self.ready_order is not None:
            object.__setattr__(self, "ready_order", tuple(int(i) for i in self.ready_order))
            if sorted(self.ready_order) != list(range(len(self.tensors))):
                raise ConfigError(f"workload {self.name!r}: ready_order must be a permutation of the "
                                  f"{len(self.tensors)} tensor indices 0..{len(self.tensors) - 1}")

    @property
    def d(self) -> int:
        """Total parameters (elements)."""
        return int(sum(t.numel for t in self.tensors))

    @property
    def measured(self) -> bool:
        """True when the layer costs are measured seconds, False when they are FLOPs."""
        return self.layers[0].forward_s is not None if self.layers else False

    def layer_index(self) -> dict[str, int]:
        """Layer name -> its position in forward order."""
        return {l.name: i for i, l in enumerate(self.layers)}

    def layer_times(self, batch_size: int, device: DeviceModel | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer forward and backward seconds at ``batch_size`` samples per worker, float arrays (L,).

        FLOP workloads: ``flops * batch_size / device.flops_per_s`` (a device is required). Measured
        workloads: the measured seconds scaled by ``batch_size / measured_batch`` (linear in the batch;
        device must be None). Raises ConfigError for batch_size < 1, a device given/missing wrongly, or a step
        whose forward + backward seconds add up to more than :data:`MAX_STEP_S` (naming the total and the range).
        """
        check_int("batch_size", batch_size, 1, err=ConfigError)
        if self.measured:
            if device is not None:
                raise ConfigError(f"workload {self.name!r} has measured times: a device model does not apply")
            s = batch_size / self.measured_batch
            return self._within_step_limit(np.array([l.forward_s for l in self.layers], dtype=np.float64) * s,
                                           np.array([l.backward_s for l in self.layers], dtype=np.float64) * s,
                                           f"batch {batch_size} (measured at {self.measured_batch})")
        if device is None:
            raise ConfigError(f"workload {self.name!r} gives FLOPs: a device model is needed to turn them into seconds")
        r = batch_size / device.flops_per_s
        return self._within_step_limit(np.array([l.forward_flops for l in self.layers], dtype=np.float64) * r,
                                       np.array([l.backward_flops for l in self.layers], dtype=np.float64) * r,
                                       f"batch {batch_size} on {device.name} ({device.flops_per_s:.4g} FLOP/s)")

    def _within_step_limit(self, fwd: np.ndarray, bwd: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(fwd, bwd) unchanged when a step's forward + backward is at most :data:`MAX_STEP_S`; else ConfigError."""
        total = float(fwd.sum() + bwd.sum())
        if not total <= MAX_STEP_S:
            raise ConfigError(f"workload {self.name!r}: forward + backward = {total:.6g} s per step at {where}: valid "
                              f"<= {MAX_STEP_S:g} s per step (the limit of compute.forward_backward_s; smaller layer "
                              "costs or batch)")
        return fwd, bwd

    def grad_ready_order(self) -> list[int]:
        """Indices into ``tensors`` in the order backward produces their gradients: ``ready_order`` when it was
        observed, else layers in reverse forward order and inside a layer its tensors in reverse definition
        order (DDP's reverse parameter order; autograd may order a layer's own tensors differently, e.g. a
        convolution's weight before its bias, which only matters when a bucket boundary falls inside a layer)."""
        if self.ready_order is not None:
            return list(self.ready_order)
        li = self.layer_index()
        return sorted(range(len(self.tensors)), key=lambda i: (-li[self.tensors[i].layer], -i))
