"""Errors the workbench raises for bad input. The CLI prints ``str(err)`` on one line and exits 2."""
from __future__ import annotations


class SparsimError(ValueError):
    """Bad input or an invalid state that a user can fix: the message names the value and the valid range."""


class ConfigError(SparsimError):
    """A scenario or command-line value is unknown, of the wrong type, or out of range."""


class DataError(SparsimError):
    """A data file is missing or malformed, or the data hold NaN/Inf."""


class NonFiniteError(SparsimError):
    """A gradient, accumulator or parameter became NaN/Inf; the message names worker and iteration."""


def check_range(name: str, value, lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False):
    """Raise :class:`SparsimError` unless ``lo <(=) value <(=) hi``; returns ``value``.

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
        left = "" if lo is None else f"{lo} {'<' if lo_open else '<='} "
        right = "" if hi is None else f" {'<' if hi_open else '<='} {hi}"
        raise SparsimError(f"{name} = {value!r} is out of range: valid {left}{name}{right}")
    return value
