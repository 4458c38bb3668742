"""Output directories that never look complete when they are not: build in ``DIR.partial``, then rename.

Every command that writes a directory (``sparsim run``, the torchrun entry point, ``sparsim experiment``)
uses these three steps: :func:`check_out` before any work, :func:`partial_dir` to build into, and
:func:`publish` once everything is written.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from sim.errors import ConfigError

__all__ = ["check_out", "partial_dir", "publish"]


def check_out(out: Path, force: bool) -> None:
    """Raise ConfigError if ``out`` exists and is a file or a non-empty directory, unless ``force``."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ConfigError(f"output directory {str(out)!r} exists and is not empty: choose another --out or pass --force")


def partial_dir(out: Path, *, fresh: bool = True) -> Path:
    """Create and return ``out.partial`` (emptied first when ``fresh``; kept to resume otherwise)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    if fresh and tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def publish(tmp: Path, out: Path) -> Path:
    """Replace ``out`` (file or directory, if any) by the finished directory ``tmp``; return ``out``."""
    out = Path(out)
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    Path(tmp).rename(out)
    return out
