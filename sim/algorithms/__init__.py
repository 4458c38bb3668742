"""The algorithm layer: one file per S-SGD variant, one registry (:data:`REGISTRY`) that every engine,
backend, closed form and CLI list reads. See :mod:`sim.algorithms.base` for the interface and
``docs/algorithms.md`` for how to add one."""
from __future__ import annotations

import importlib

from sim.algorithms.base import (REGISTRY, Algorithm, AlgorithmSpec, Exchange, Option, StepContext, StepOutput, check_options, get,
                   names, predict_columns, predict_default_columns, register, resolve, segment_k,
                   sgd_step)

#: The algorithm files, in registration order (the order of the CLI's lists). Adding an algorithm is one new
#: file that defines and registers an :class:`Algorithm` subclass, plus its name here.
MODULES = ("dense", "topk", "gtopk", "randk", "dgc", "gaussiank", "cltk", "oktopk", "sparcml", "powersgd")
for _m in MODULES:
    importlib.import_module(f"{__name__}.{_m}")

from sim.algorithms.randk import RANDK_STREAM  # noqa: E402

#: Registered algorithm names, in registration order.
ALGORITHMS = names()
#: name -> the collectives each may use (the first is the default).
COLLECTIVES = {name: algo.collectives for name, algo in REGISTRY.items()}

__all__ = ["REGISTRY", "Algorithm", "AlgorithmSpec", "Exchange", "Option", "StepContext", "StepOutput", "get",
           "names", "register", "resolve", "check_options", "predict_columns", "predict_default_columns", "segment_k", "sgd_step", "ALGORITHMS", "COLLECTIVES", "RANDK_STREAM"]
