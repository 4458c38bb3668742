"""Device presets: peak FLOP/s for the precision each device trains in, times a default efficiency.

A :class:`~sim.workloads.model.DeviceModel` turns a workload's FLOPs into seconds:
``seconds = FLOPs / (peak_flops * efficiency)``. The peaks are dense (no structured sparsity) datasheet
figures:

========== ================ ===================== ==================================================
name       precision        peak (FLOP/s)         source
========== ================ ===================== ==================================================
P102-100   FP32             10.77e12              GP102, 3200 CUDA cores x 2 FLOPs x 1683 MHz boost
                                                  (TechPowerUp GPU database); the GPU of the gTop-k
                                                  papers' cluster (Shi et al., ICDCS 2019 / IJCAI 2019)
V100       FP16 tensor core 125e12                NVIDIA Tesla V100 SXM2 datasheet (mixed-precision
                                                  training; FP32 on the same datasheet: 15.7e12)
A100       BF16 tensor core 312e12                NVIDIA A100 datasheet (SXM, dense)
H100       BF16 tensor core 989e12                NVIDIA H100 SXM5 datasheet (989.4 TFLOP/s dense;
                                                  the 1979 figure assumes 2:4 sparsity)
========== ================ ===================== ==================================================

V100 is given its tensor-core peak so that the V100, A100 and H100 presets all describe mixed-precision
training; for an FP32 V100 use ``DeviceModel("V100-FP32", 15.7e12, 0.4, ...)``.

Default efficiency 0.4 for every preset: the fraction of peak a data-parallel training step reaches on
the FLOPs the zoo counts (matrix multiplies and convolutions, see :mod:`sim.workloads.zoo`) is typically
0.3-0.5 for large CNNs and transformers at per-device batches that fill the device (model FLOPs
utilisation); small models at small batches (ResNet-20 on CIFAR-10) reach much less. Change it with
``dataclasses.replace(get_device("A100"), efficiency=0.5)``.
"""
from __future__ import annotations

from sim.base.errors import ConfigError
from sim.workloads.model import DeviceModel

__all__ = ["DEVICES", "DEFAULT_EFFICIENCY", "get_device"]

DEFAULT_EFFICIENCY = 0.4
"""Default achieved fraction of peak FLOP/s for the presets (see the module docstring)."""

DEVICES: dict[str, DeviceModel] = {
    "P102-100": DeviceModel(
        "P102-100", 10.77e12, DEFAULT_EFFICIENCY,
        "NVIDIA P102-100 (GP102, 3200 CUDA cores, 1683 MHz boost): 10.77 TFLOP/s FP32, TechPowerUp GPU "
        "database; the GPU of the gTop-k papers (Shi et al., ICDCS 2019; IJCAI 2019)"),
    "V100": DeviceModel(
        "V100", 125e12, DEFAULT_EFFICIENCY,
        "NVIDIA Tesla V100 SXM2 datasheet: 125 TFLOP/s FP16 tensor core (mixed precision); FP32 is 15.7"),
    "A100": DeviceModel(
        "A100", 312e12, DEFAULT_EFFICIENCY,
        "NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOP/s BF16 tensor core, dense"),
    "H100": DeviceModel(
        "H100", 989e12, DEFAULT_EFFICIENCY,
        "NVIDIA H100 SXM5 datasheet: 989 TFLOP/s BF16 tensor core, dense (1979 with 2:4 sparsity)"),
}
"""Preset name -> DeviceModel (peak FLOP/s for the training precision, efficiency 0.4, datasheet source)."""


def get_device(name: str) -> DeviceModel:
    """The preset DeviceModel called ``name`` (one of :data:`DEVICES`: P102-100, V100, A100, H100).

    Raises ConfigError (one line naming the value and the valid names) for an unknown name.
    """
    try:
        return DEVICES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"device = {name!r} is unknown: valid devices are {', '.join(DEVICES)}") from None
