"""Helpers shared by several test modules (not a test module itself: pytest collects only ``test_*.py``).

- :func:`small_dataset` and :class:`ObjectiveCache`: the small classification data sets and the build-once
  objective cache of tests/test_batched.py and tests/test_objectives.py;
- :func:`peer_module` and :func:`peer_fixture`: the peer script ``benchmarks/peers/<name>_peer.py`` (its input
  generators and case tables) and the reference code's recorded behaviour ``tests/fixtures/peers/<name>.npz``,
  for tests/test_dgc.py and tests/test_oktopk.py.

Imported as ``from _shared import ...``: pytest puts tests/ on sys.path (rootdir-relative "prepend" import mode,
tests/ has no __init__.py), as for ``from test_topk_fast import ...`` in tests/test_select_device.py.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

import numpy as np
import scipy.sparse as sp

from sim.workloads.data import Dataset

__all__ = ["ROOT", "PEER_FIXTURES", "small_dataset", "ObjectiveCache", "peer_module", "peer_fixture"]

ROOT = Path(__file__).resolve().parents[1]
PEER_FIXTURES = ROOT / "tests" / "fixtures" / "peers"


def small_dataset(*, sparse: bool, C: int, n: int, p: int, seed: int = 0, name: str | None = None) -> Dataset:
    """n samples of p features, ~30 % zeros, per-feature scales in [0.5, 2), labels 0..C-1 balanced and shuffled,
    all from ``default_rng(seed)``; X as CSR when ``sparse``. name: default ``small_{dense|sparse}_{C}``."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, p)) * rng.uniform(0.5, 2.0, size=p)
    X[rng.random((n, p)) < 0.3] = 0.0
    y = np.arange(n, dtype=np.int64) % C
    rng.shuffle(y)
    if name is None:
        name = f"small_{'sparse' if sparse else 'dense'}_{C}"
    return Dataset(X=sp.csr_matrix(X) if sparse else X, y=y, n_classes=C, name=name, source="test")


class ObjectiveCache:
    """Objectives built once per test session (some load data sets or compute constants): ``cache(key)`` is
    ``build(key)``, built on the first call; ``cache(key, dtype)`` is that float64 objective's ``astype(dtype)``
    (itself for float64), also cached."""

    def __init__(self, build: Callable[[str], object]):
        self.build = build
        self._cache: dict = {}

    def __call__(self, key: str, dtype: str = "float64"):
        if (key, dtype) not in self._cache:
            base = self._cache.get((key, "float64")) or self.build(key)
            self._cache[(key, "float64")] = base
            self._cache[(key, dtype)] = base.astype(dtype)
        return self._cache[(key, dtype)]


def peer_module(name: str):
    """benchmarks/peers/<name>_peer.py loaded as module ``<name>_peer`` (its input generators and case tables;
    a peer script imports numpy only at load)."""
    spec = importlib.util.spec_from_file_location(f"{name}_peer", ROOT / "benchmarks" / "peers" / f"{name}_peer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def peer_fixture(name: str) -> dict:
    """tests/fixtures/peers/<name>.npz (written by the peer script) as {array name: array}."""
    with np.load(PEER_FIXTURES / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}
