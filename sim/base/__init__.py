"""The base layer: what every other layer of :mod:`sim` may import and which imports nothing of it.

:mod:`sim.base.errors` (the error types and range checks behind "one line, exit code 2"), :mod:`sim.base.ops`
(the sans-I/O operations every collective and algorithm step yields: Send, Recv, SendRecv, AllReduce, Compute),
:mod:`sim.base.optional` (the one guard for optional imports such as torch), :mod:`sim.base.malloc` (the CLI's
heap setting).
"""
