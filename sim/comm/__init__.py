"""The communication layer: compressors, collectives and their costs, below the algorithms.

- :mod:`sim.comm.compression`: :class:`~sim.comm.compression.Sparse` and the top-k / threshold compressors, with
  their numba and torch kernels (:mod:`sim.comm.torch_kernels`);
- :mod:`sim.comm.collectives`: each collective's schedules (a rank or an array of ranks) and its per-rank sans-I/O
  program (the numerics);
- :mod:`sim.comm.rounds`: the same collectives for every rank at once, as data (Work and Round): the one
  timing-only definition the fast engine interprets and the message-level engine projects rank by rank;
- :mod:`sim.comm.costs`: the alpha-beta closed forms;
- :mod:`sim.comm.payloads`: timing-only payloads (right sizes, no data);
- :mod:`sim.comm.reference`: the straightforward reference operators the fast ones are tested against.

Imports only :mod:`sim.base`.
"""
