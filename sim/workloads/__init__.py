"""Workloads: a model's parameter tensors in order, with per-layer forward and backward cost.

A :class:`Workload` is what the iteration timeline (:mod:`sim.timeline`) needs of a model: the ordered
list of its parameter tensors (name, number of elements, owning layer) and, per layer in forward order,
the forward and backward cost -- FLOPs per sample (turned into seconds by a :class:`DeviceModel`) or
measured seconds at a stated batch size.
"""
from __future__ import annotations

from .model import DeviceModel, LayerCost, ParamTensor, Workload

__all__ = ["DeviceModel", "LayerCost", "ParamTensor", "Workload"]
