"""The published numbers of the ICDCS 2019 scaling study (Shi et al., gTop-k S-SGD): what the paper and its
released scripts report, as transcribed in docs/costs.md, and nothing computed.

- the testbed: the 1 GbE network preset (:data:`NETWORK`), the authors' 4-GPU-node cluster preset
  (:data:`CLUSTER`), the density (:data:`DENSITY`) and the top-k selection time fit (:data:`SELECT_COEFF_S`);
- the models (:data:`MODELS`): parameters, batch, single-GPU throughput, the published scaling efficiencies at
  :data:`PUBLISHED_P`, the headline ratios and the per-iteration breakdown;
- the algorithms the paper compares (:data:`VARIANTS`, :data:`MAIN_VARIANTS`) and the zoo counterparts of its
  models (:data:`ZOO_NAMES`).

:mod:`experiments.scaling_model` simulates these cases; :mod:`experiments.scaling` compares and reports.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NETWORK", "CLUSTER", "DENSITY", "SELECT_COEFF_S", "PUBLISHED_P", "ModelSpec", "MODELS", "VARIANTS",
           "MAIN_VARIANTS", "ZOO_NAMES"]

#: The network preset of the published runs (sim.machine.network: alpha = 0.436 ms, beta = 9 ns/byte).
NETWORK = "1GbE"
#: The hierarchical model of the published runs: the gTop-k authors' cluster (sim.machine.topology preset).
CLUSTER = "gtopk-icdcs"
#: The paper's density k/d.
DENSITY = 0.001
#: Top-k selection time fit on the ICDCS GPU (P102-100): t = c x log2 x seconds (docs/costs.md).
SELECT_COEFF_S = 2.19e-10
#: P of the published efficiency arrays.
PUBLISHED_P = (4, 8, 16, 32)


@dataclass(frozen=True)
class ModelSpec:
    """One ICDCS model: parameters d, per-worker batch, single-GPU samples/s and the published numbers.

    published: {"dense" | "topk" | "gtopk": scaling efficiencies in % at P = 4, 8, 16, 32}.
    headline: (gTop-k over dense, gTop-k over Top-k) scaling-efficiency ratios at P = 32 (paper text).
    breakdown: (batch, compute s, compression s, communication s) per iteration at P = 32, or None.
    Source: the released ICDCS 2019 scripts and paper, as transcribed in docs/costs.md.
    """

    name: str
    d: int
    batch: int
    samples_per_s: float
    published: dict
    headline: tuple[float, float]
    breakdown: tuple[int, float, float, float] | None = None

    @property
    def k(self) -> int:
        """k = round(DENSITY * d) (>= 1)."""
        return max(1, round(DENSITY * self.d))

    def compute_s(self, batch: int | None = None) -> float:
        """Forward + backward seconds per iteration at ``batch`` (default: the model's batch) = batch / throughput."""
        return (self.batch if batch is None else batch) / self.samples_per_s


MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("ResNet-20", 270_000, 32, 920.6,
              {"dense": (89.3, 76.6, 56.5, 31.3), "topk": (98.7, 81.8, 80.1, 75.6), "gtopk": (99.5, 94.4, 87.8, 85.7)},  # algorithms: the paper's published series
              (2.74, 1.13), (128, 0.1460, 0.0016, 0.0247)),
    ModelSpec("VGG-16", 14_700_000, 128, 1317.3,
              {"dense": (7.9, 7.0, 3.0, 1.0), "topk": (8.4, 8.3, 7.4, 4.8), "gtopk": (9.9, 9.9, 9.6, 9.4)},  # algorithms: the paper's published series
              (9.78, 1.96), (128, 0.1395, 0.0914, 0.8118)),
    ModelSpec("AlexNet", 61_000_000, 32, 173.5,
              {"dense": (8.1, 7.0, 2.8, 0.7), "topk": (8.2, 8.0, 7.7, 5.3), "gtopk": (9.5, 9.5, 9.4, 9.1)},  # algorithms: the paper's published series
              (12.79, 1.71), (64, 0.2572, 0.3838, 3.3630)),
    ModelSpec("ResNet-50", 25_600_000, 32, 52.9,
              {"dense": (73.8, 70.0, 43.8, 20.3), "topk": (71.4, 67.5, 65.2, 57.8), "gtopk": (75.3, 75.1, 73.9, 74.0)},  # algorithms: the paper's published series
              (3.65, 1.28)),
)}


#: Simulated variants: name -> (algorithm, collective, mask, value_bytes, index_bytes).
# algorithms: the ICDCS 2019 paper's three variants and the released code's gTop-k
VARIANTS = {
    "dense": ("dense", "ring", "exact", 4, 0),
    "topk": ("topk", "allgather", "exact", 4, 4),
    "gtopk": ("gtopk", "tree", "exact", 4, 4),
    "gtopk_released": ("gtopk", "tree", "reference", 8, 8),
}
MAIN_VARIANTS = ("dense", "topk", "gtopk")  # algorithms: the paper's three series


#: ICDCS model -> zoo model (:func:`sim.workloads.get_model`): the same architectures as the gTop-k code /
#: torchvision define them, with exact parameter counts (ResNet-20 269,722; VGG-16-CIFAR 14,728,266; AlexNet
#: 61,100,840; ResNet-50 25,557,032), which differ slightly from the rounded :attr:`ModelSpec.d`.
ZOO_NAMES = {"ResNet-20": "resnet20-cifar", "VGG-16": "vgg16-cifar", "AlexNet": "alexnet", "ResNet-50": "resnet50"}
