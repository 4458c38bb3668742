"""The machine layer: what a cluster is, independent of any algorithm.

:mod:`sim.machine.network` (flat alpha-beta networks and presets), :mod:`sim.machine.topology` (hierarchical
clusters: nodes, NICs, rails, leaf / spine, oversubscription, and their presets), :mod:`sim.machine.compute`
(the compute model: forward / backward, selection, merge and reduction costs, stragglers). Imports only
:mod:`sim.base`.
"""
