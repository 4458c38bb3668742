"""Device presets: peak FLOP/s for the precision each device trains in, times a default efficiency, and a memory
model for the selection, merge, reduction and update costs of S-SGD.

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

Selection, merge, reduction and update costs, and the other compressors' memory traffic and matrix products
(:meth:`~sim.workloads.model.DeviceModel.costs`, the compute model's ``select``, ``merge``, ``reduce``, ``update``,
``scan`` and ``matmul`` kinds; docs/costs-per-device.md):

========== ============== ================================================ ===================================
name       memory (B/s)   source                                           costs
========== ============== ================================================ ===================================
P102-100   440.3e9        GDDR5X, 320 bit, 11 Gbps (TechPowerUp GPU         the gTop-k papers' model: selection
                          database)                                        2.19e-10 s x x log2 x (their fit on
                                                                           this GPU), merge, reduce, update 0;
                                                                           scan and matmul: memory and FLOP
                                                                           model
V100       900e9          HBM2, NVIDIA Tesla V100 SXM2 datasheet           memory model
A100       1555e9         HBM2, NVIDIA A100 datasheet (40 GB SXM; the      memory model
                          80 GB SXM has 2039e9)
H100       3.35e12        HBM3, NVIDIA H100 SXM5 datasheet                 memory model
========== ============== ================================================ ===================================

The memory model: ``seconds = passes x work x value_bytes / (memory bandwidth x 0.87)``, with
:data:`~sim.workloads.model.SELECT_PASSES` passes per element scanned by a selection (measured on a CPU by
``benchmarks/bench_select_passes.py``), 2 (value_bytes + index_bytes) / value_bytes + SELECT_PASSES per element
merged, 3 per element added and per parameter updated, and 0.87 the fraction of datasheet bandwidth a streaming
kernel reaches (:data:`~sim.workloads.model.DEFAULT_MEM_EFFICIENCY`). The P102-100 keeps the papers' measured
numbers; in this model their selection fit is about 516 passes at ResNet-50's d = 25.6M (0.138 s against
0.267 ms per pass at 0.87 x 440.3 GB/s): the torch.topk of 2018-19, which ran a long 1-D selection in one thread
block, not a memory-bound kernel. Where ``benchmarks/gpu_check.py`` has measured a GPU's ``torch.topk``, its
``torch_select_coeff_s`` replaces the selection model: ``dataclasses.replace(get_device("H100"),
select_coeff_s=..., cost_source="gpu_check.py on ...")``, or in a scenario ``compute.select_coeff_s``, which wins
over any device.

The compressors that run no top-k over the whole vector (rand-k, Gaussian-k, DGC's sampled selection, PowerSGD;
:meth:`sim.algorithms.base.Algorithm.compression_work`) are charged what they do: ``scan``, bytes moved through
memory at ``1 / (0.87 x memory bandwidth)`` seconds per byte, and ``matmul``, matrix-product FLOPs at
``1 / (peak x efficiency)`` seconds per FLOP -- on every preset, the P102-100 included (its papers measured only
Top-k's selection).
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
        "database; the GPU of the gTop-k papers (Shi et al., ICDCS 2019; IJCAI 2019)",
        mem_bandwidth_Bps=440.3e9, select_coeff_s=2.19e-10, merge_coeff_s=0.0, reduce_coeff_s=0.0, update_coeff_s=0.0,
        cost_source="the gTop-k papers' model: their selection fit on this GPU, 2.19e-10 s x d log2 d (Shi et al., "
                    "ICDCS 2019, released scripts); merge, reduction and update not charged; memory GDDR5X 320 bit "
                    "11 Gbps, 440.3 GB/s (TechPowerUp GPU database) for the other compressors' bytes"),
    "V100": DeviceModel(
        "V100", 125e12, DEFAULT_EFFICIENCY,
        "NVIDIA Tesla V100 SXM2 datasheet: 125 TFLOP/s FP16 tensor core (mixed precision); FP32 is 15.7",
        mem_bandwidth_Bps=900e9,
        cost_source="V100 SXM2 HBM2 900 GB/s, datasheet"),
    "A100": DeviceModel(
        "A100", 312e12, DEFAULT_EFFICIENCY,
        "NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOP/s BF16 tensor core, dense",
        mem_bandwidth_Bps=1555e9,
        cost_source="A100 40 GB SXM HBM2 1555 GB/s, datasheet"),
    "H100": DeviceModel(
        "H100", 989e12, DEFAULT_EFFICIENCY,
        "NVIDIA H100 SXM5 datasheet: 989 TFLOP/s BF16 tensor core, dense (1979 with 2:4 sparsity)",
        mem_bandwidth_Bps=3.35e12,
        cost_source="H100 SXM5 HBM3 3.35 TB/s, datasheet"),
}
"""Preset name -> DeviceModel (peak FLOP/s for the training precision, efficiency 0.4, datasheet source; memory
bandwidth and costs as the module docstring's second table: the P102-100 with the papers' measured fit, the others
with the memory model at SELECT_PASSES and DEFAULT_MEM_EFFICIENCY)."""


def get_device(name: str) -> DeviceModel:
    """The preset DeviceModel called ``name`` (one of :data:`DEVICES`: P102-100, V100, A100, H100).

    Raises ConfigError (one line naming the value and the valid names) for an unknown name.
    """
    try:
        return DEVICES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"device = {name!r} is unknown: valid devices are {', '.join(DEVICES)}") from None
