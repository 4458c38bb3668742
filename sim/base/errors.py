"""Errors the workbench raises for bad input. The CLI prints ``str(err)`` on one line and exits 2."""
from __future__ import annotations

import math
from numbers import Integral, Real


class SparsimError(ValueError):
    """Bad input or an invalid state that a user can fix: the message names the value and the valid range."""


class ConfigError(SparsimError):
    """A scenario or command-line value is unknown, of the wrong type, or out of range."""


class DataError(SparsimError):
    """A data file is missing or malformed, or the data hold NaN/Inf."""


class NonFiniteError(SparsimError):
    """A gradient, accumulator or parameter became NaN/Inf, or a run diverged (a value beyond
    :data:`DIVERGENCE_LIMIT`); the message names the iteration, the algorithm (and the worker where one is to blame)."""


class ResourceError(SparsimError):
    """A run would not fit this machine: its memory estimate exceeds the available memory, or its estimated
    work exceeds the documented limit without ``--yes``; the message names the estimate and the limit."""


#: Largest magnitude a run lets a loss, a norm (||grad f||, ||G_t||, ||residual||) or one coordinate of a
#: gradient or error-feedback accumulator reach before it stops as diverged: squares of values beyond about
#: 1.3e154 overflow float64 (max 1.8e308), and at 1e100 a norm squared (<= 1e200) summed over up to 10^7
#: coordinates and 65,536 workers still stays finite, so no overflow warning or inf can precede the error.
DIVERGENCE_LIMIT = 1e100


def range_text(name: str, lo=None, hi=None, lo_open: bool = False, hi_open: bool = False) -> str:
    """The valid range of ``name`` as text, e.g. ``1 <= k <= 100`` or ``0 < alpha``."""
    left = "" if lo is None else f"{lo} {'<' if lo_open else '<='} "
    right = "" if hi is None else f" {'<' if hi_open else '<='} {hi}"
    return f"{left}{name}{right}"


def check_range(name: str, value, lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False,
                err: type[SparsimError] = SparsimError):
    """Raise ``err`` (default :class:`SparsimError`) unless ``lo <(=) value <(=) hi``; returns ``value``.

    The message names the value and the valid range, e.g. ``k = 0 is out of range: valid 1 <= k <= 100``.
    NaN and +-inf are always out of range (every quantity of this project is finite), as are bools.
    """
    ok = not isinstance(value, bool)
    try:
        if value != value or value in (float("inf"), float("-inf")):  # NaN, inf
            ok = False
        if lo is not None and (value <= lo if lo_open else value < lo):
            ok = False
        if hi is not None and (value >= hi if hi_open else value > hi):
            ok = False
    except TypeError:
        ok = False
    if not ok:
        raise err(f"{name} = {value!r} is out of range: valid {range_text(name, lo, hi, lo_open, hi_open)}")
    return value


def check_real(name: str, value, lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False,
               err: type[SparsimError] = SparsimError) -> float:
    """:func:`check_range` for a finite real number (Python or numpy, not bool); returns it as float.
    Raises ``err`` naming the value and the valid range, e.g. ``x = 'a' is out of range: valid finite real 0 <= x``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise err(f"{name} = {value!r} is out of range: valid finite real {range_text(name, lo, hi, lo_open, hi_open)}")
    check_range(name, value, lo, hi, lo_open=lo_open, hi_open=hi_open, err=err)
    return float(value)


def check_int(name: str, value, lo=None, hi=None, *, err: type[SparsimError] = SparsimError) -> int:
    """:func:`check_range` for an integer (Python or numpy, not bool) in ``[lo, hi]``; returns it as int.
    Raises ``err`` naming the value and the valid range, e.g. ``P = 1.5 is out of range: valid integer 1 <= P``."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise err(f"{name} = {value!r} is out of range: valid integer {range_text(name, lo, hi, False, False)}")
    return check_range(name, int(value), lo, hi, err=err)
