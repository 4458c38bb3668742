"""The communication layer: compressors, collectives and their costs, below the algorithms.

- :mod:`sim.comm.compression`: :class:`~sim.comm.compression.Sparse` and the top-k / threshold compressors, with
  their numba and torch kernels (:mod:`sim.comm.torch_kernels`);
- :mod:`sim.comm.collectives`: each collective's schedules (a rank or an array of ranks), its per-rank sans-I/O
  program (the numerics) and its phase plan (:mod:`sim.comm.plans`: the sequence of rounds as data, which the
  fast engine interprets over all ranks);
- :mod:`sim.comm.costs`: the alpha-beta closed forms;
- :mod:`sim.comm.payloads`: timing-only payloads (right sizes, no data);
- :mod:`sim.comm.reference`: the straightforward reference operators the fast ones are tested against.

Imports only :mod:`sim.base`.
"""
