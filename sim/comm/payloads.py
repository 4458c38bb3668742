"""Timing-only payloads: the right sizes, (almost) no data.

The per-rank collectives of :mod:`sim.comm.collectives` run unchanged on these payloads, which have the right
sizes but no data: the tests hold a collective's messages on them to its closed form and to its vectorised
twin (:mod:`sim.comm.rounds`), and the merge benchmark merges them. (The timing-only mode itself runs the
vectorised form, :mod:`sim.engine.timing`.)

- dense: :func:`phantom_dense` -- a float32 array of shape (d, 0): no bytes, but ``shape[0] == d`` and every
  operation the dense collectives perform on it (copy, slicing along axis 0, ``+``, slice assignment) keeps
  the length bookkeeping exact, so their messages carry ``rows * value_bytes`` bytes as with a real (d,) array;
- sparse: :func:`random_selection` -- a real :class:`~sim.comm.compression.Sparse` of k distinct random
  indices with positive values, so gTop-k's merges and survival masks run for real and keep exactly k.
"""
from __future__ import annotations

import numpy as np

from sim.base.errors import check_range
from sim.comm.compression import Sparse

__all__ = ["phantom_dense", "random_selection"]


def phantom_dense(d: int) -> np.ndarray:
    """A dense payload of d float32 values without the values: an empty float32 array of shape (d, 0).

    ``len(x) == x.shape[0] == d``, ``x.nbytes == 0``. Slices, copies and sums keep shape (rows, 0), so
    :func:`sim.comm.collectives.ring_allreduce` / ``rd_allreduce`` run on it unchanged and put
    ``rows * value_bytes`` bytes on the wire per message. Raises SparsimError for d < 1.
    """
    check_range("d", d, 1)
    return np.empty((int(d), 0), dtype=np.float32)


def random_selection(k: int, d: int, rng: np.random.Generator) -> Sparse:
    """k distinct random indices in [0, d) with random values in [0.5, 1.5): a stand-in for TopK(acc_p).

    Returns a :class:`Sparse` (idx int64 (k,) strictly increasing, val float64 (k,), dimension d); memory
    O(k) whatever d. All values are positive, so no merge cancels an entry: a merge of two k-entry
    vectors keeps exactly k. Raises SparsimError unless 1 <= k <= d.
    """
    check_range("d", d, 1)
    check_range("k", k, 1, d)
    idx = np.sort(rng.choice(int(d), size=int(k), replace=False)).astype(np.int64)
    val = rng.uniform(0.5, 1.5, size=int(k))
    return Sparse(idx, val, int(d))
