"""The one-pass divergence/NaN check (sim.algorithms.base._check_finite) decides exactly as the two-reduction rule.

Rule (README, "Nothing silently wrong"): raise NonFiniteError iff some entry is NaN/Inf or |x_i| > 1e100. The fast
path accepts a vector when its computed sum of squares is <= 1e200 / 2; these tests put entries at and next to the
limit, among many small ones (whose rounding could hide a just-too-large entry if the margin were missing), in
float32 and float64.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.algorithms.base import _check_finite
from sim.base.errors import DIVERGENCE_LIMIT, NonFiniteError


def _reference_ok(arr: np.ndarray) -> bool:
    a = arr.astype(np.float64)
    return bool(np.all(np.isfinite(a)) and np.all(np.abs(a) <= DIVERGENCE_LIMIT))


def _decides(arr: np.ndarray) -> bool:
    try:
        _check_finite(arr, "gradient", rank=0, iteration=0)
        return True
    except NonFiniteError:
        return False


_L = DIVERGENCE_LIMIT
_EDGE = [_L, np.nextafter(_L, 0), np.nextafter(_L, np.inf), -np.nextafter(_L, np.inf), _L * (1 + 1e-9),
         _L / np.sqrt(2), _L * 0.7072, np.nan, np.inf, -np.inf, 0.0, 5e-324, 1e-300, 3.0e38, 1e39]


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 3000), pos=st.integers(0, 10**6), edge=st.sampled_from(_EDGE),
       small=st.floats(0, 1e90, allow_nan=False), dtype=st.sampled_from([np.float32, np.float64]),
       seed=st.integers(0, 2**32 - 1))
def test_check_finite_equals_reference(n, pos, edge, small, dtype, seed):
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):
        arr = (rng.standard_normal(n) * small).astype(dtype)
        arr[pos % n] = dtype(edge)
    assert _decides(arr) == _reference_ok(arr)


def test_many_entries_just_below_the_limit_pass_just_above_raise():
    # 1000 entries at LIMIT / 40: the sum of squares (6.25e197) is under the fast bound; one entry at nextafter(LIMIT)
    # pushes the max over the limit while the sum (~1.0006e200) goes to the exact test
    arr = np.full(1000, _L / 40)
    assert _decides(arr)
    arr[17] = np.nextafter(_L, np.inf)
    assert not _decides(arr)
    arr[17] = _L
    assert _decides(arr)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_message_names_the_coordinate(dtype):
    arr = np.zeros(100, dtype=dtype)
    arr[42] = np.nan
    with pytest.raises(NonFiniteError, match="42"):
        _check_finite(arr, "gradient", rank=3, iteration=5)
