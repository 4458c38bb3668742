"""Layer tables: a workload as a CSV or TOML file (the zoo's stored format and the user-facing one).

CSV (``.csv``)
--------------
Comment lines start with ``#``; a comment ``# key = value`` with key ``name``, ``input``, ``source`` or
``measured_batch`` sets that field of the workload (other comments are ignored). The first other line is
the header; then one row per parameter tensor::

    # name = tiny
    # input = 3x32x32
    layer,tensor,numel,forward_flops,backward_flops
    conv1,conv1.weight,432,884736,884736
    conv1,conv1.bias,16,0,0
    pool,,0,16384,16384
    fc,fc.weight,40960,81920,163840

Columns: ``layer`` (name), ``tensor`` (qualified parameter name; empty for a row of a layer without
parameters, whose ``numel`` is then 0), ``numel`` (elements, integer >= 1 for a tensor), and the cost
columns, either ``forward_flops,backward_flops`` (FLOPs per sample, finite reals >= 0) or
``forward_s,backward_s`` (measured seconds at the batch given by the required ``# measured_batch = B``
comment), or all four. A layer's cost is the sum of its rows' cost columns. Rows of one layer are
contiguous and layers appear in forward execution order. Optional columns, each a permutation of
0..n-1 over the n tensor rows (empty on parameterless rows): ``param_index``, the tensor's position in
``module.parameters()`` (without it the tensors are in row order), and ``ready_index``, its position in
the order autograd makes the gradients ready (the workload's ``ready_order``; without it the default
rule of :meth:`~sim.workloads.model.Workload.grad_ready_order`).

TOML (``.toml``)
----------------
The same content: top-level ``name``, ``input``, ``source``, ``measured_batch`` (all optional), then::

    [[layer]]
    name = "conv1"
    forward_flops = 884736
    backward_flops = 884736
    tensors = [{name = "conv1.weight", numel = 432}, {name = "conv1.bias", numel = 16}]

(``forward_s``/``backward_s`` instead of or beside the FLOPs; ``param_index`` and ``ready_index``
optional in each tensor.)

Every malformed input raises :class:`~sim.base.errors.ConfigError` with one line naming the file, the line
(CSV) or layer (TOML), the value and the valid range.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import tomllib
from pathlib import Path

from sim.base.errors import ConfigError
from sim.workloads.model import LayerCost, ParamTensor, Workload

__all__ = ["load_layer_table", "save_layer_table", "dumps_layer_table", "TABLE_COLUMNS"]

_FLOP_COLS = ("forward_flops", "backward_flops")
_SEC_COLS = ("forward_s", "backward_s")
_INDEX_COLS = ("param_index", "ready_index")
TABLE_COLUMNS = ("layer", "tensor", "numel") + _FLOP_COLS + _SEC_COLS + _INDEX_COLS
"""Every column a CSV layer table may have (``layer``, ``tensor``, ``numel`` and one cost pair required)."""
_META_KEYS = ("name", "input", "source", "measured_batch")
_EXTS = (".csv", ".toml")


def _cost(where: str, col: str, text, typed: bool = False) -> float:
    """A cost cell as a finite real >= 0, or ConfigError naming where, the value and the range. typed (TOML):
    the value must already be a number, not a string holding one."""
    if isinstance(text, bool) or (typed and isinstance(text, str)):
        v = None
    elif isinstance(text, (int, float)):
        v = float(text)
    else:
        try:
            v = float(str(text).strip())
        except ValueError:
            v = None
    if v is None or not math.isfinite(v) or v < 0:
        raise ConfigError(f"{where}: {col} = {text!r} is out of range: valid finite real 0 <= {col}")
    return v


_INT_RE = re.compile(r"[+-]?\d+")


#: Largest parameter tensor accepted (elements): 10^12, the largest d any command takes.
MAX_NUMEL = 10**12


def _int(where: str, col: str, text, lo: int, what: str = "", typed: bool = False) -> int:
    """An integer cell in [lo, MAX_NUMEL], or ConfigError naming where, the value and the range. typed (TOML): the
    value must already be an integer, not a string holding one."""
    if isinstance(text, bool) or (typed and isinstance(text, str)):
        v = None
    elif isinstance(text, int):
        v = text
    elif isinstance(text, str) and _INT_RE.fullmatch(text.strip()):
        v = int(text.strip())
    else:
        v = None
    if v is None or v < lo or v > MAX_NUMEL:
        raise ConfigError(f"{where}: {col} = {text!r} is out of range: valid integer {lo} <= {col} <= {MAX_NUMEL}{what}")
    return v


class _Builder:
    """Collects rows (layer, tensor, numel, costs, optional indices) and checks them as they come."""

    def __init__(self, path: str, costs: tuple[str, ...]):
        self.path = path
        self.costs = costs
        self.layers: dict[str, dict[str, float]] = {}
        self.order: list[str] = []
        self.tensors: list[tuple[str, int, str, dict[str, int | None], str]] = []  # name, numel, layer, idx, where
        self.seen_tensor: dict[str, str] = {}
        self.last_layer: str | None = None

    def add(self, where: str, layer: str, tensor: str, numel: int, costs: dict[str, float],
            index: dict[str, int | None]):
        if not layer:
            raise ConfigError(f"{where}: layer = '' is out of range: valid a non-empty layer name")
        if layer in self.layers and layer != self.last_layer:
            raise ConfigError(f"{where}: layer {layer!r} appears again after other layers: valid the rows of a "
                              "layer are contiguous, layers in forward order")
        if layer not in self.layers:
            self.layers[layer] = {c: 0.0 for c in self.costs}
            self.order.append(layer)
        self.last_layer = layer
        for c, v in costs.items():
            self.layers[layer][c] += v
        if tensor:
            if tensor in self.seen_tensor:
                raise ConfigError(f"{where}: tensor {tensor!r} is listed twice (first at {self.seen_tensor[tensor]}): "
                                  "valid unique tensor names")
            self.seen_tensor[tensor] = where
            self.tensors.append((tensor, numel, layer, index, where))

    def _permutation(self, col: str) -> list[int] | None:
        """The values of index column ``col`` over the tensors (checked to be a permutation), or None."""
        tensors = self.tensors
        if all(t[3].get(col) is None for t in tensors):
            return None
        n = len(tensors)
        seen: dict[int, str] = {}
        for t in tensors:
            v = t[3].get(col)
            if v is None:
                raise ConfigError(f"{t[4]}: {col} is missing for tensor {t[0]!r}: valid integer 0 <= {col} <= {n - 1} "
                                  "on every tensor when one has it")
            if v >= n:
                raise ConfigError(f"{t[4]}: {col} = {v} is out of range: valid integer 0 <= {col} <= {n - 1}")
            if v in seen:
                raise ConfigError(f"{t[4]}: {col} = {v} is used twice (first at {seen[v]}): valid each index once")
            seen[v] = t[4]
        return [t[3][col] for t in tensors]

    def workload(self, meta: dict) -> Workload:
        p = self.path
        if not self.order:
            raise ConfigError(f"{p}: the table has no layers: valid at least one row")
        if not self.tensors:
            raise ConfigError(f"{p}: the table has no parameter tensors: valid at least one row with a tensor")
        pidx = self._permutation("param_index")
        ridx = self._permutation("ready_index")
        rows = list(range(len(self.tensors)))
        if pidx is not None:
            rows.sort(key=lambda r: pidx[r])  # rows in module.parameters() order
        tensors = [self.tensors[r] for r in rows]
        ready = None
        if ridx is not None:
            pos = {r: i for i, r in enumerate(rows)}  # row -> index in the workload's tensors
            ready = tuple(pos[r] for r in sorted(range(len(rows)), key=lambda r: ridx[r]))
        measured = "forward_s" in self.costs
        mb = meta.get("measured_batch")
        if measured and mb is None:
            raise ConfigError(f"{p}: measured seconds need measured_batch: valid integer 1 <= measured_batch "
                              "(CSV: a line '# measured_batch = 32'; TOML: measured_batch = 32)")
        try:
            layers = [LayerCost(name, **{c: v for c, v in self.layers[name].items()}) for name in self.order]
            return Workload(name=meta.get("name") or Path(p).stem, layers=tuple(layers),
                            tensors=tuple(ParamTensor(t[0], t[1], t[2]) for t in tensors),
                            measured_batch=mb if measured else None,
                            input=meta.get("input", ""), source=meta.get("source", ""), ready_order=ready)
        except ConfigError as err:
            raise ConfigError(f"{p}: {err}") from None


def _cost_columns(where: str, cols) -> tuple[str, ...]:
    has_f = [c in cols for c in _FLOP_COLS]
    has_s = [c in cols for c in _SEC_COLS]
    if any(has_f) and not all(has_f):
        miss = _FLOP_COLS[has_f.index(False)]
        raise ConfigError(f"{where}: column {miss!r} is missing: valid forward_flops and backward_flops together")
    if any(has_s) and not all(has_s):
        miss = _SEC_COLS[has_s.index(False)]
        raise ConfigError(f"{where}: column {miss!r} is missing: valid forward_s and backward_s together")
    if not any(has_f) and not any(has_s):
        raise ConfigError(f"{where}: no cost columns: valid forward_flops,backward_flops (FLOPs per sample) or "
                          "forward_s,backward_s (seconds at measured_batch)")
    return (_FLOP_COLS if all(has_f) else ()) + (_SEC_COLS if all(has_s) else ())


def _meta_value(where: str, key: str, value):
    if key == "measured_batch":
        return _int(where, "measured_batch", value, 1)
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {key} = {value!r} is out of range: valid a string")
    return value


def _load_csv(path: str, text: str) -> Workload:
    meta: dict = {}
    header: list[str] | None = None
    builder: _Builder | None = None
    for lineno, line in enumerate(text.splitlines(), 1):
        where = f"{path}: line {lineno}"
        s = line.strip()
        if not s:
            continue
        if s.startswith("#"):
            body = s.lstrip("#").strip()
            if "=" in body:
                key, value = (x.strip() for x in body.split("=", 1))
                if key in _META_KEYS:
                    meta[key] = _meta_value(where, key, value)
            continue
        row = next(csv.reader([line]))
        row = [c.strip() for c in row]
        if header is None:
            header = row
            for c in header:
                if c not in TABLE_COLUMNS:
                    raise ConfigError(f"{where}: column {c!r} is unknown: valid {', '.join(TABLE_COLUMNS)}")
            dup = [c for c in header if header.count(c) > 1]
            if dup:
                raise ConfigError(f"{where}: column {dup[0]!r} appears twice: valid each column once")
            for c in ("layer", "tensor", "numel"):
                if c not in header:
                    raise ConfigError(f"{where}: column {c!r} is missing: valid header with layer, tensor, numel and "
                                      "forward_flops,backward_flops or forward_s,backward_s")
            builder = _Builder(path, _cost_columns(where, header))
            continue
        if len(row) != len(header):
            raise ConfigError(f"{where}: {len(row)} fields: valid {len(header)} fields ({','.join(header)})")
        cell = dict(zip(header, row))
        tensor = cell["tensor"]
        if tensor:
            numel = _int(where, "numel", cell["numel"], 1, f" for tensor {tensor!r}")
        else:
            if cell["numel"] not in ("", "0"):
                raise ConfigError(f"{where}: numel = {cell['numel']!r} on a row without tensor: valid 0 (or empty)")
            numel = 0
        costs = {c: _cost(where, c, cell[c]) for c in builder.costs}
        index = {}
        for col in _INDEX_COLS:
            v = cell.get(col, "")
            if v != "" and not tensor:
                raise ConfigError(f"{where}: {col} = {v!r} on a row without tensor: valid empty")
            index[col] = _int(where, col, v, 0) if v != "" else None
        builder.add(where, cell["layer"], tensor, numel, costs, index)
    if builder is None:
        raise ConfigError(f"{path}: the table is empty: valid a header line and at least one row")
    return builder.workload(meta)


_TOML_TOP = ("layer",) + _META_KEYS
_TOML_LAYER = ("name", "tensors") + _FLOP_COLS + _SEC_COLS
_TOML_TENSOR = ("name", "numel") + _INDEX_COLS


def _load_toml(path: str, text: str) -> Workload:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML ({str(err).splitlines()[0]}): valid the layer-table TOML "
                          "format") from None
    for k in doc:
        if k not in _TOML_TOP:
            raise ConfigError(f"{path}: key {k!r} is unknown: valid {', '.join(_TOML_TOP)}")
    meta = {k: _meta_value(f"{path}", k, doc[k]) for k in _META_KEYS if k in doc}
    layers = doc.get("layer")
    if not layers:
        raise ConfigError(f"{path}: the table is empty: valid at least one [[layer]]")
    if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
        raise ConfigError(f"{path}: layer = {layers!r} is out of range: valid an array of tables [[layer]]")
    first = layers[0]
    builder = _Builder(path, _cost_columns(f"{path}: layer #1 ({first.get('name', '')!r})", first))
    for i, lay in enumerate(layers, 1):
        where = f"{path}: layer #{i} ({lay.get('name', '')!r})"
        for k in lay:
            if k not in _TOML_LAYER:
                raise ConfigError(f"{where}: key {k!r} is unknown: valid {', '.join(_TOML_LAYER)}")
        if _cost_columns(where, lay) != builder.costs:
            raise ConfigError(f"{where}: cost keys {sorted(k for k in lay if k in _FLOP_COLS + _SEC_COLS)} differ "
                              f"from layer #1: valid {', '.join(builder.costs)} on every layer")
        name = lay.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: name = {name!r} is out of range: valid a non-empty string")
        if name in builder.layers:
            raise ConfigError(f"{where}: layer {name!r} is listed twice: valid unique layer names")
        costs = {c: _cost(where, c, lay[c], typed=True) for c in builder.costs}
        tensors = lay.get("tensors", [])
        if not isinstance(tensors, list):
            raise ConfigError(f"{where}: tensors = {tensors!r} is out of range: valid an array of "
                              "{name = ..., numel = ...}")
        builder.add(where, name, "", 0, costs, {})
        for j, t in enumerate(tensors, 1):
            tw = f"{where}: tensor #{j}"
            if not isinstance(t, dict):
                raise ConfigError(f"{tw}: {t!r} is out of range: valid {{name = ..., numel = ...}}")
            for k in t:
                if k not in _TOML_TENSOR:
                    raise ConfigError(f"{tw}: key {k!r} is unknown: valid {', '.join(_TOML_TENSOR)}")
            tname = t.get("name")
            if not isinstance(tname, str) or not tname:
                raise ConfigError(f"{tw}: name = {tname!r} is out of range: valid a non-empty string")
            numel = _int(tw, "numel", t.get("numel"), 1, f" for tensor {tname!r}", typed=True)
            index = {c: _int(tw, c, t[c], 0, typed=True) for c in _INDEX_COLS if c in t}
            builder.add(tw, name, tname, numel, {}, index)
    return builder.workload(meta)


def load_layer_table(path) -> Workload:
    """Read a layer table (``.csv`` or ``.toml``, format in the module docstring) into a Workload.

    path: str or os.PathLike. Returns a Workload whose layers carry FLOPs per sample, or measured seconds
    at ``measured_batch`` samples, or both. Raises ConfigError, one line naming the file, the line or
    layer, the value and the valid range, for: a missing file, an unknown extension, an empty table, a
    missing or unknown column, a negative or non-integer numel, a negative or non-finite cost, a
    duplicate tensor, a layer whose rows are not contiguous, measured seconds without measured_batch.
    """
    p = os.fspath(path)
    ext = Path(p).suffix.lower()
    if ext not in _EXTS:
        raise ConfigError(f"layer table {p!r}: extension {ext!r} is unknown: valid {', '.join(_EXTS)}")
    try:
        text = Path(p).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"layer table {p!r} does not exist: valid the path of an existing {ext} file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"layer table {p!r} cannot be read ({type(err).__name__}): valid a readable UTF-8 "
                          f"{ext} file") from None
    return _load_csv(p, text) if ext == ".csv" else _load_toml(p, text)


def _num(v: float) -> str:
    """A cost as text: an integer when it is one (FLOP counts), else repr (exact round trip)."""
    v = float(v)
    return str(int(v)) if v.is_integer() and abs(v) < 2 ** 63 else repr(v)


def _indices(w: Workload) -> dict[str, dict[int, int]]:
    """Index columns to write: column -> {tensor position in w.tensors: value}. ``param_index`` only when
    grouping the rows by layer changes the tensor order, ``ready_index`` only when w has a ready_order."""
    out: dict[str, dict[int, int]] = {}
    li = w.layer_index()
    grouped = sorted(range(len(w.tensors)), key=lambda i: (li[w.tensors[i].layer], i))
    if grouped != list(range(len(w.tensors))):
        out["param_index"] = {i: i for i in range(len(w.tensors))}
    if w.ready_order is not None:
        out["ready_index"] = {i: pos for pos, i in enumerate(w.ready_order)}
    return out


def dumps_layer_table(w: Workload, fmt: str = "csv") -> str:
    """The text of ``w`` as a layer table, ``fmt`` "csv" or "toml" (format in the module docstring).

    Cost columns: FLOPs if any layer has them or the workload is not measured, seconds if measured. Each
    layer's cost is written on its first row (zeros on its other rows). A ``param_index`` column/key is
    written only when grouping rows by layer changes the tensor order, ``ready_index`` only when the
    workload has a ``ready_order``. Raises ConfigError for another fmt.
    """
    if fmt not in ("csv", "toml"):
        raise ConfigError(f"format = {fmt!r} is unknown: valid csv, toml")
    has_flops = (not w.measured) or any(l.forward_flops or l.backward_flops for l in w.layers)
    costs = (_FLOP_COLS if has_flops else ()) + (_SEC_COLS if w.measured else ())
    idx = _indices(w)
    by_layer: dict[str, list[tuple[int, ParamTensor]]] = {l.name: [] for l in w.layers}
    for i, t in enumerate(w.tensors):
        by_layer[t.layer].append((i, t))
    meta = [("name", w.name), ("input", w.input), ("source", w.source)]
    if w.measured:
        meta.append(("measured_batch", w.measured_batch))
    head = "# sparsim layer table: FLOPs per sample / seconds at measured_batch (sim.workloads.tables)"
    if fmt == "csv":
        buf = io.StringIO()
        buf.write(head + "\n")
        for k, v in meta:
            if v not in ("", None):
                buf.write(f"# {k} = {' '.join(str(v).split())}\n")
        wr = csv.writer(buf, lineterminator="\n")
        wr.writerow(["layer", "tensor", "numel", *costs, *idx])
        for l in w.layers:
            rows = by_layer[l.name] or [(None, None)]
            for j, (i, t) in enumerate(rows):
                vals = [_num(getattr(l, c) if j == 0 else 0.0) for c in costs]
                wr.writerow([l.name, t.name if t else "", t.numel if t else 0, *vals,
                             *(idx[c][i] if t else "" for c in idx)])
        return buf.getvalue()
    out = [head]
    for k, v in meta:
        if v not in ("", None):
            out.append(f"{k} = {v}" if k == "measured_batch" else f"{k} = {json.dumps(v)}")
    for l in w.layers:
        out += ["", "[[layer]]", f"name = {json.dumps(l.name)}"]
        out += [f"{c} = {_num(getattr(l, c))}" for c in costs]
        ts = []
        for i, t in by_layer[l.name]:
            extra = "".join(f", {c} = {idx[c][i]}" for c in idx)
            ts.append(f"{{name = {json.dumps(t.name)}, numel = {t.numel}{extra}}}")
        out.append("tensors = [" + ", ".join(ts) + "]")
    return "\n".join(out) + "\n"


def save_layer_table(w: Workload, path) -> None:
    """Write ``w`` to ``path`` as a layer table, CSV or TOML by the extension (``.csv``, ``.toml``).

    ``load_layer_table(path)`` gives back an equal Workload (exact: costs are written as integers or
    Python reprs). Raises ConfigError for another extension.
    """
    p = os.fspath(path)
    ext = Path(p).suffix.lower()
    if ext not in _EXTS:
        raise ConfigError(f"layer table {p!r}: extension {ext!r} is unknown: valid {', '.join(_EXTS)}")
    Path(p).write_text(dumps_layer_table(w, ext[1:]), encoding="utf-8")
