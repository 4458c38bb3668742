"""The engine layer: everything that advances a simulated clock or drives per-rank programs.

:mod:`sim.engine.drivers` (lockstep, no clock), :mod:`sim.engine.cluster` (the message-level SimPy cluster),
:mod:`sim.engine.fastsim` (the fast engine: a round at a time over all ranks), :mod:`sim.engine.timing`
(timing-only iterations), :mod:`sim.engine.timeline` (the layer-wise iteration timeline with DDP buckets and
overlap), :mod:`sim.engine.replay` (a measured trace replayed), :mod:`sim.engine.runner` (the numerics run).
Imports the algorithms, the machine, the workloads and the layers below them; nothing below imports it.
"""
