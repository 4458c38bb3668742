"""The workload data model: parameter tensors, per-layer costs, device models.

Units: FLOPs per sample (one forward or backward pass over one input sample: an image, a sequence);
seconds (s); FLOP/s.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.base.errors import ConfigError, check_int, check_real

__all__ = ["ParamTensor", "LayerCost", "DeviceModel", "Workload", "MAX_LAYER_S", "MAX_LAYER_FLOPS"]


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


@dataclass(frozen=True)
class DeviceModel:
    """A device as peak FLOP/s times an achieved fraction: seconds = FLOPs / (peak_flops * efficiency).

    peak_flops: the device's peak (FLOP/s, > 0) for the precision it trains in. efficiency: the fraction
    of peak a training step achieves, 0 < efficiency <= 1. source: where the peak comes from.
    """

    name: str
    peak_flops: float
    efficiency: float
    source: str = ""

    def __post_init__(self):
        check_real(f"peak_flops of device {self.name!r}", self.peak_flops, 0, lo_open=True, err=ConfigError)
        check_real(f"efficiency of device {self.name!r}", self.efficiency, 0, 1, lo_open=True, err=ConfigError)

    @property
    def flops_per_s(self) -> float:
        """Achieved FLOP/s: peak_flops * efficiency."""
        return self.peak_flops * self.efficiency


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
        device must be None). Raises ConfigError for batch_size < 1, or a device given/missing wrongly.
        """
        check_int("batch_size", batch_size, 1, err=ConfigError)
        if self.measured:
            if device is not None:
                raise ConfigError(f"workload {self.name!r} has measured times: a device model does not apply")
            s = batch_size / self.measured_batch
            return (np.array([l.forward_s for l in self.layers], dtype=np.float64) * s,
                    np.array([l.backward_s for l in self.layers], dtype=np.float64) * s)
        if device is None:
            raise ConfigError(f"workload {self.name!r} gives FLOPs: a device model is needed to turn them into seconds")
        r = batch_size / device.flops_per_s
        return (np.array([l.forward_flops for l in self.layers], dtype=np.float64) * r,
                np.array([l.backward_flops for l in self.layers], dtype=np.float64) * r)

    def grad_ready_order(self) -> list[int]:
        """Indices into ``tensors`` in the order backward produces their gradients: ``ready_order`` when it was
        observed, else layers in reverse forward order and inside a layer its tensors in reverse definition
        order (DDP's reverse parameter order; autograd may order a layer's own tensors differently, e.g. a
        convolution's weight before its bias, which only matters when a bucket boundary falls inside a layer)."""
        if self.ready_order is not None:
            return list(self.ready_order)
        li = self.layer_index()
        return sorted(range(len(self.tensors)), key=lambda i: (-li[self.tensors[i].layer], -i))
