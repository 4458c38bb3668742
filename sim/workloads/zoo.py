"""The model zoo: stored layer tables of the gTop-k papers' models and of common reference models.

============== ============ ============= ================================================================
name           parameters   one sample    definition (plain torch.nn in :mod:`sim.workloads.torch_defs`)
============== ============ ============= ================================================================
resnet20-cifar 269,722      3x32x32       ResNet-20, CIFAR-10, option-A shortcuts (gTop-k code, He 2016)
vgg16-cifar    14,728,266   3x32x32       VGG-16 conv stack with BatchNorm + Linear(512, 10) (gTop-k code)
vgg16          138,357,544  3x224x224     torchvision ``vgg16()``
alexnet        61,100,840   3x224x224     torchvision ``alexnet()``
resnet50       25,557,032   3x224x224     torchvision ``resnet50()``
bert-base      109,482,240  128 tokens    HF ``BertModel(BertConfig())`` with pooler
gpt2-small     124,439,808  1024 tokens   HF ``GPT2Model(GPT2Config())`` (LM head tied to ``wte``: not counted)
lstm-ptb       66,034,000   35 tokens     gTop-k papers' LSTM-PTB: vocab 10000, embedding 1500, 2 x LSTM 1500,
                                          untied decoder Linear(1500, 10000), 35 unrolled steps
============== ============ ============= ================================================================

The gTop-k papers (Shi et al., ICDCS 2019 "A distributed synchronous SGD algorithm with global top-k
sparsification"; IJCAI 2019 "A convergence analysis of distributed SGD with communication-efficient
gradient sparsification") train VGG-16 and ResNet-20 on CIFAR-10 and a 2-layer LSTM with 1500 hidden
units on PTB; the definitions follow their code (``hclhkbu/gtopkssgd``). LSTM-PTB's count:
10000 x 1500 (embedding) + 2 x (4 x 1500 x (1500 + 1500) + 2 x 4 x 1500) (LSTM, two bias vectors per
layer as in ``nn.LSTM``) + 1500 x 10000 + 10000 (decoder) = 66,034,000.

Each model's table (``sim/workloads/tables/<name>.csv``, format in :mod:`sim.workloads.tables`) holds its
parameter tensors in ``module.parameters()`` order and per-layer forward/backward FLOPs per sample, made by
``python -m sim.workloads.build_tables`` with :func:`~sim.workloads.extract.from_torch` (FLOPs by the
``torch.utils.flop_counter`` formulas: a multiply-add is 2 FLOPs, so ResNet-50's 8.18 GFLOPs forward is
torchvision's 4.09 "GFLOPS", which are multiply-adds; backward attributed per autograd node). Attention
is counted in full (no causal saving for GPT-2). :func:`get_model` reads the table and needs no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from sim.base.errors import ConfigError
from sim.workloads.model import Workload
from sim.workloads.tables import load_layer_table

__all__ = ["ZOO_MODELS", "ZOO", "ZooEntry", "TABLES_DIR", "get_model", "table_path", "build_module",
           "zoo_from_torch"]

TABLES_DIR = Path(__file__).with_name("tables")
"""Folder of the stored layer tables (package data)."""


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model: input_shape (one sample, batch excluded), tokens (True: int64 token ids, False:
    float32 values), input (description of a sample), params (published parameter count), source."""

    name: str
    input_shape: tuple[int, ...]
    tokens: bool
    input: str
    params: int
    source: str


ZOO: dict[str, ZooEntry] = {e.name: e for e in (
    ZooEntry("resnet20-cifar", (3, 32, 32), False, "3x32x32", 269_722,
             "ResNet-20 for CIFAR-10 (He et al. 2016, option-A shortcuts), as trained in the gTop-k papers "
             "(Shi et al., ICDCS 2019 / IJCAI 2019); definition: hclhkbu/gtopkssgd models/resnet.py"),
    ZooEntry("vgg16-cifar", (3, 32, 32), False, "3x32x32", 14_728_266,
             "VGG-16 for CIFAR-10: 13 conv3x3+BatchNorm+ReLU layers and Linear(512, 10), as trained in the "
             "gTop-k papers; definition: hclhkbu/gtopkssgd models/vgg.py (kuangliu/pytorch-cifar)"),
    ZooEntry("vgg16", (3, 224, 224), False, "3x224x224", 138_357_544,
             "torchvision.models.vgg16 (configuration D, no BatchNorm), ImageNet 224x224"),
    ZooEntry("alexnet", (3, 224, 224), False, "3x224x224", 61_100_840,
             "torchvision.models.alexnet, ImageNet 224x224"),
    ZooEntry("resnet50", (3, 224, 224), False, "3x224x224", 25_557_032,
             "torchvision.models.resnet50 (v1.5), ImageNet 224x224"),
    ZooEntry("bert-base", (128,), True, "128 tokens", 109_482_240,
             "HuggingFace transformers BertModel(BertConfig()) with pooler, eager attention; a sample is one "
             "128-token sequence"),
    ZooEntry("gpt2-small", (1024,), True, "1024 tokens", 124_439_808,
             "HuggingFace transformers GPT2Model(GPT2Config()), LM head tied to wte (not counted), eager "
             "attention; a sample is one 1024-token sequence"),
    ZooEntry("lstm-ptb", (35,), True, "35 tokens", 66_034_000,
             "LSTM-PTB of the gTop-k papers: 2-layer LSTM, 1500 hidden, embedding 1500, vocabulary 10000, "
             "untied decoder, 35 unrolled steps; definition: hclhkbu/gtopkssgd models/lstm.py"),
)}
"""Zoo name -> ZooEntry."""

ZOO_MODELS: tuple[str, ...] = tuple(ZOO)
"""The names :func:`get_model` accepts."""


def _entry(name: str) -> ZooEntry:
    try:
        return ZOO[name]
    except (KeyError, TypeError):
        raise ConfigError(f"model = {name!r} is unknown: valid models are {', '.join(ZOO_MODELS)}") from None


def table_path(name: str) -> Path:
    """Path of the stored layer table of zoo model ``name``. Raises ConfigError for an unknown name."""
    return TABLES_DIR / f"{_entry(name).name}.csv"


@lru_cache(maxsize=None)
def get_model(name: str) -> Workload:
    """The Workload of zoo model ``name`` (one of :data:`ZOO_MODELS`) from its stored table: parameter
    tensors in ``module.parameters()`` order, FLOPs per sample per layer. Does not need torch.

    Raises ConfigError (one line listing the valid names) for an unknown name.
    """
    return load_layer_table(table_path(name))


def build_module(name: str, *, device="meta"):
    """The torch module of zoo model ``name`` (:mod:`sim.workloads.torch_defs`), built on ``device``
    (default ``meta``: shapes only, no memory; use ``"cpu"``/``"cuda"`` to run or measure it).

    Requires torch. Raises ConfigError for an unknown name.
    """
    e = _entry(name)
    import torch

    from sim.workloads.torch_defs import BUILDERS

    with torch.device(device):
        return BUILDERS[e.name]()


def zoo_from_torch(name: str) -> Workload:
    """The Workload of zoo model ``name`` computed afresh from its torch definition with
    :func:`~sim.workloads.extract.from_torch` (what ``build_tables`` stores). Requires torch."""
    e = _entry(name)
    import torch

    from sim.workloads.extract import FLOPS_NOTE, from_torch

    return from_torch(build_module(name), e.input_shape, name=e.name,
                      dtype=torch.long if e.tokens else torch.float32, source=f"{e.source}; {FLOPS_NOTE}")
