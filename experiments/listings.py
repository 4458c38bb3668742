"""What the inspection commands print: the registered algorithms (``sparsim algorithms``), the scenario keys
(``sparsim scenario keys``), the workload zoo (``sparsim workload list``) and one workload's DDP buckets
(``sparsim workload show``, with ``--export`` of its layer table).

Each table is a sequence of lines (without newlines) made from the registries as they are; nothing here runs a
simulation.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from sim.base.errors import SparsimError

from .outdir import atomic_write_text
from .scenario import scenario_keys

__all__ = ["algorithm_table", "scenario_keys_table", "zoo_table", "workload_of", "bucket_lines", "check_export",
           "export_layer_table"]


def algorithm_table() -> Iterator[str]:
    """The registered algorithms (:data:`sim.algorithms.REGISTRY`) as a Markdown table: name and aliases, sparse
    (selects k) or not, collectives (the first is the default), options with their defaults, summary, source. A
    ``|`` inside a cell is escaped."""
    from sim.algorithms import REGISTRY

    yield "| algorithm | sparse (k) | collectives | options ([algorithm.NAME]) | what | source |"
    yield "|---|---|---|---|---|---|"
    for name, algo in REGISTRY.items():
        names = name + "".join(f", {a}" for a in algo.aliases)
        opts = "; ".join(f"`{k}` = {o.default!r} ({o.help})" for k, o in algo.options.items()) or "-"
        cells = [f"`{names}`", "yes" if algo.sparse else "no", ", ".join(algo.collectives), opts, algo.summary,
                 algo.source]
        yield "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"  # a | in a cell is escaped


def scenario_keys_table() -> Iterator[str]:
    """Every scenario key (:func:`experiments.scenario.scenario_keys`) as a Markdown table: key, type, default
    (``unset`` for none), valid values, meaning with its unit. The first line holds the header and its rule."""
    yield "| key | type | default | valid | meaning (unit) |\n|---|---|---|---|---|"
    for key, typ, default, valid, desc in scenario_keys():
        shown = "unset" if default is None else f"`{default:g}`" if isinstance(default, float) else f"`{default}`"
        yield f"| `{key}` | {typ} | {shown} | {valid} | {desc} |"


def zoo_table() -> Iterator[str]:
    """The workload zoo, one line per model: parameters, tensors, layers, forward and backward GFLOPs per
    sample, and the sample's shape."""
    from sim.workloads import ZOO, ZOO_MODELS, get_model

    yield f"{'model':<16}{'parameters':>14}{'tensors':>9}{'layers':>8}{'fwd GFLOPs':>12}{'bwd GFLOPs':>12}  sample"
    for name in ZOO_MODELS:
        w = get_model(name)
        f = sum(l.forward_flops for l in w.layers) / 1e9
        b = sum(l.backward_flops for l in w.layers) / 1e9
        yield f"{name:<16}{w.d:>14,}{len(w.tensors):>9}{len(w.layers):>8}{f:>12.4g}{b:>12.4g}  {ZOO[name].input}"


def workload_of(name: str):
    """The :class:`sim.workloads.Workload` of ``name``: a zoo model, or a layer-table file (a name with a
    suffix). Raises ConfigError for an unknown model or a bad table."""
    from sim.workloads import ZOO_MODELS, get_model, load_layer_table

    if name in ZOO_MODELS or not Path(name).suffix:
        return get_model(name)
    return load_layer_table(name)


def bucket_lines(w, bucket_cap_mb: float | None = None) -> Iterator[str]:
    """Workload ``w``'s size and the buckets PyTorch DDP would build for it, in launch order: elements, MiB of
    float32 and tensors per bucket. bucket_cap_mb: DDP's bucket_cap_mb (MiB; None: DDP's 25 with a 1 MiB first
    bucket)."""
    from sim.engine.timeline import TimelinePolicy, ddp_buckets

    pol = TimelinePolicy(bucket_cap_mb=bucket_cap_mb)
    bs = ddp_buckets(w, pol)
    first, cap = pol.bucket_limits_bytes()
    yield (f"{w.name}: d = {w.d:,} parameters, {len(w.tensors)} tensors, {len(w.layers)} layers"
           + (f", input {w.input}" if w.input else "") + (f"; {w.source}" if w.source else ""))
    yield f"DDP buckets (first cap {first / 2**20:g} MiB, cap {cap / 2**20:g} MiB, float32), in launch order:"
    for i, b in enumerate(bs):
        names = [w.tensors[j].name for j in b.tensors]
        span = names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"
        yield f"  {i:>3}  {b.numel:>12,} elements  {4 * b.numel / 2**20:>9.2f} MiB  {len(names):>4} tensors  {span}"


def check_export(export: str, force: bool = False) -> None:
    """Refuse a layer-table file name before anything is computed: SparsimError (one line) unless ``export`` ends
    in .csv or .toml, its directory exists, and it does not exist yet (or ``force``)."""
    ep = Path(export)
    if ep.suffix.lower() not in (".csv", ".toml"):
        raise SparsimError(f"--export {export!r}: valid a .csv or .toml file name")
    if not ep.parent.is_dir():
        raise SparsimError(f"--export {export!r}: the directory {str(ep.parent)!r} does not exist")
    if ep.exists() and not force:
        raise SparsimError(f"--export {export!r} exists: choose another name or pass --force")


def export_layer_table(w, export: str) -> None:
    """Write workload ``w``'s layer table to ``export`` (CSV or TOML by its suffix,
    :func:`sim.workloads.dumps_layer_table`), complete or not at all. Raises SparsimError when it cannot be
    written."""
    from sim.workloads import dumps_layer_table

    text = dumps_layer_table(w, Path(export).suffix.lower().lstrip("."))
    try:
        atomic_write_text(Path(export), text)  # complete or absent, never half written
    except OSError as err:
        raise SparsimError(f"cannot write --export {export!r}: {err.strerror}") from None
