"""Helpers behind the ``sparsim theory`` commands: list, show and evaluate the registered bounds.

Every function raises :class:`sim.base.errors.SparsimError` with a one-line message on bad input, which
the CLI prints and turns into exit status 2.
"""
from __future__ import annotations

import math

import re
from typing import Iterable, Mapping

from sim.base.errors import SparsimError
from theory.bounds import BOUNDS, Bound, param_range_text
from theory.symbols import DESCRIPTIONS

__all__ = ["list_bounds", "show", "evaluate", "parse_assignments", "get_bound"]

_INT_RE = re.compile(r"[+-]?\d+")


def list_bounds() -> list[str]:
    """Names of all registered bounds, sorted (keys of :data:`theory.bounds.BOUNDS`).

    Source: the registry of Shi et al., IJCAI 2019 (Lemmas 1-2, Corollaries 1-2, Theorem 1) and
    Stich et al. 2018 (Thm 2.4, Lemma 3.2) bounds. Raises nothing.
    """
    return sorted(BOUNDS)


def get_bound(name: str) -> Bound:
    """Return ``BOUNDS[name]``.

    ``name``: a registry key (see :func:`list_bounds`). Raises :class:`SparsimError` for an unknown
    name, listing the valid ones.
    """
    if not isinstance(name, str) or name not in BOUNDS:
        raise SparsimError(f"bound {name!r} is unknown: valid names are {', '.join(list_bounds())}")
    return BOUNDS[name]


def show(name: str) -> str:
    """Multi-line description of bound ``name``: bounded quantity, plain-text and LaTeX expression,
    source (paper + lemma/equation), variant and the parameters with their meaning, units and range.

    Source: :data:`theory.bounds.BOUNDS` (Shi et al., IJCAI 2019; Stich et al. 2018).
    Raises :class:`SparsimError` for an unknown name, listing the valid ones.
    """
    b = get_bound(name)
    lines = [
        f"{b.name}: {b.description}",
        f"  source:  {b.source}",
        f"  variant: {b.variant if b.variant is not None else '-'}",
        f"  bound:   {b.lhs} <= {b.text()}",
        f"  latex:   {b.latex()}",
        "  params:",
    ]
    for p in b.params:
        rng = param_range_text(p)
        if p == "k":
            rng += " and k <= d"
        elif p == "eta" and b.eta_needs_tau_lt_1:
            rng += " < k/(d-k) (tau < 1)"
        elif p in b.overrides:
            o = b.overrides[p]
            rng = f"{o.lo} {'<' if o.lo_open else '<='} {p}"
        lines.append(f"    {p:18s} {DESCRIPTIONS[p]}; valid {rng}")
    return "\n".join(lines)


def parse_assignments(items: Iterable[str]) -> dict[str, str]:
    """Split ``"key=value"`` strings into a dict of strings (the CLI's positional arguments).

    ``items``: strings of the form key=value (whitespace around key and value is ignored).
    Raises :class:`SparsimError` for an item without ``=``, an empty key, or a key given twice.
    """
    out: dict[str, str] = {}
    for item in items:
        if not isinstance(item, str) or "=" not in item:
            raise SparsimError(f"assignment {item!r} is malformed: valid form key=value, e.g. T=1000")
        key, _, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not key:
            raise SparsimError(f"assignment {item!r} has an empty key: valid form key=value, e.g. T=1000")
        if key in out:
            raise SparsimError(f"parameter {key} is given twice: {key}={out[key]} and {key}={value}")
        out[key] = value
    return out


def _parse_number(key: str, text: str) -> int | float:
    t = text.strip()
    if _INT_RE.fullmatch(t):
        return int(t)
    try:
        return float(t)
    except ValueError:
        raise SparsimError(f"{key} = {text!r} is not a number: valid {param_range_text(key)}") from None


def evaluate(name: str, assignments: Mapping[str, str] | Iterable[str]) -> float:
    """Evaluate bound ``name`` at string-valued parameters (through sympy, see :meth:`Bound.evaluate`).

    ``name``: a registry key; ``assignments``: mapping parameter name -> number as text (``"1000"``,
    ``"0.5"``, ``"1e-3"``), or an iterable of ``"key=value"`` strings. Integers are parsed as int,
    everything else as float. Units and meaning of each parameter: :func:`show`.
    Source: :data:`theory.bounds.BOUNDS` (Shi et al., IJCAI 2019; Stich et al. 2018).

    Raises :class:`SparsimError` for an unknown bound (listing the valid names), an unknown key
    (listing the bound's parameters), missing keys (listing them), a value that is not a number, or a
    value out of range (naming it and its valid range).
    """
    b = get_bound(name)
    if not isinstance(assignments, Mapping):
        assignments = parse_assignments(assignments)
    b.check_names(assignments)  # before parsing, so an unknown key is named as such
    values = {k: _parse_number(k, str(v)) for k, v in assignments.items()}
    out = b.evaluate(**values)
    if not math.isfinite(out):
        raise SparsimError(f"{name} = {out} at these constants: the value overflows a float (valid: finite); "
                           "use smaller constants")
    return out
