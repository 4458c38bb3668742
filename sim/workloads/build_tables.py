"""Regenerate the zoo's stored layer tables from the torch definitions (needs torch).

Usage::

    python -m sim.workloads.build_tables            # write sim/workloads/tables/<name>.csv for every model
    python -m sim.workloads.build_tables resnet50   # only these models
    python -m sim.workloads.build_tables --check    # compare, write nothing; exit 1 when a table differs

Each table is :func:`sim.workloads.zoo.zoo_from_torch` written by :func:`sim.workloads.tables.save_layer_table`
(parameter counts from the modules, FLOPs per sample from ``torch.utils.flop_counter`` formulas on the
meta device). Prints one line per model: parameters, layers, forward and backward GFLOPs per sample.
"""
from __future__ import annotations

import argparse
import sys

from sim.base.errors import ConfigError
from sim.workloads.tables import dumps_layer_table
from sim.workloads.zoo import TABLES_DIR, ZOO_MODELS, table_path, zoo_from_torch


def main(argv=None) -> int:
    """Command-line entry point; returns the exit status (0 ok, 1 a table differs under --check, 2 bad input)."""
    ap = argparse.ArgumentParser(prog="python -m sim.workloads.build_tables", description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help=f"zoo models (default all: {', '.join(ZOO_MODELS)})")
    ap.add_argument("--check", action="store_true", help="compare with the stored tables, write nothing")
    args = ap.parse_args(argv)
    status = 0
    try:
        TABLES_DIR.mkdir(exist_ok=True)
        for name in args.models or ZOO_MODELS:
            path = table_path(name)
            w = zoo_from_torch(name)
            text = dumps_layer_table(w, "csv")
            fwd = sum(l.forward_flops for l in w.layers) / 1e9
            bwd = sum(l.backward_flops for l in w.layers) / 1e9
            line = (f"{name:15s} d = {w.d:>11,}  layers = {len(w.layers):3d}  forward {fwd:9.4f} GFLOPs  "
                    f"backward {bwd:9.4f}")
            if args.check:
                same = path.exists() and path.read_text(encoding="utf-8") == text
                status |= 0 if same else 1
                print(f"{line}  {'ok' if same else 'DIFFERS'}")
            else:
                path.write_text(text, encoding="utf-8")
                print(f"{line}  -> {path}")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
