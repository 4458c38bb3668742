"""Workloads: a model's parameter tensors in order, with per-layer forward and backward cost.

A :class:`Workload` is what the iteration timeline (:mod:`sim.engine.timeline`) needs of a model: the ordered
list of its parameter tensors (name, number of elements, owning layer) and, per layer in forward order,
the forward and backward cost -- FLOPs per sample (turned into seconds by a :class:`DeviceModel`) or
measured seconds at a stated batch size.

Sources of workloads: the zoo (:func:`get_model`, stored tables, no torch needed), layer tables written
by hand (:func:`load_layer_table`, CSV or TOML), any torch module (:func:`from_torch` for FLOPs,
:func:`measure_torch` for measured seconds; both need torch). Device presets: :data:`DEVICES`,
:func:`get_device`.
"""
from __future__ import annotations

from sim.workloads.devices import DEVICES, get_device
from sim.workloads.extract import ROOT_LAYER, from_torch, measure_torch
from sim.workloads.model import DeviceModel, LayerCost, ParamTensor, Workload
from sim.workloads.tables import dumps_layer_table, load_layer_table, save_layer_table
from sim.workloads.zoo import ZOO, ZOO_MODELS, build_module, get_model, table_path, zoo_from_torch

__all__ = ["DeviceModel", "LayerCost", "ParamTensor", "Workload",
           "DEVICES", "get_device",
           "ZOO", "ZOO_MODELS", "get_model", "table_path", "build_module", "zoo_from_torch",
           "load_layer_table", "save_layer_table", "dumps_layer_table",
           "from_torch", "measure_torch", "ROOT_LAYER"]
