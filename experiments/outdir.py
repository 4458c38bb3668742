"""Output files: directories that never look complete when they are not, CSV tables and figures.

Directories are built in ``DIR.partial``, then renamed.

Every command that writes a directory (``sparsim run``, the torchrun entry point, ``sparsim experiment``)
uses these three steps: :func:`check_out` before any work, :func:`partial_dir` to build into, and
:func:`publish` once everything is written.
"""
from __future__ import annotations

import csv
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

from sim.errors import ConfigError

__all__ = ["MARKER", "check_out", "partial_dir", "publish", "write_csv", "csv_cell", "save_figure",
           "atomic_write_text"]


#: Written into every directory this project publishes; ``--force`` replaces only such directories.
MARKER = ".sparsim-output"


def check_out(out: Path, force: bool) -> None:
    """Check that ``out`` may be written: it does not exist, is an empty directory, or ``force`` is given
    and it is a directory this project wrote (it holds :data:`MARKER`). Raises ConfigError otherwise,
    and for an empty path or one whose parent cannot be created."""
    if str(out).strip() in ("", ".", ".."):
        raise ConfigError(f"--out {str(out)!r} is not a usable output directory: name a new directory")
    out = Path(out)
    if out.exists():
        if not out.is_dir():
            raise ConfigError(f"--out {str(out)!r} is an existing file: choose a directory path")
        if any(out.iterdir()):
            if not force:
                raise ConfigError(f"output directory {str(out)!r} exists and is not empty: choose another --out "
                                  "or pass --force")
            if not (out / MARKER).exists():
                raise ConfigError(f"output directory {str(out)!r} was not written by sparsim: --force replaces "
                                  "only sparsim's own output directories; choose another --out")


def partial_dir(out: Path, *, fresh: bool = True) -> Path:
    """Create and return ``out.partial`` holding :data:`MARKER` (emptied first when ``fresh``; kept to resume
    otherwise). Raises ConfigError naming the path when it cannot be created (permissions, read-only) or
    when it exists, is not empty and was not written by sparsim (no :data:`MARKER`): it is never removed then."""
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    if tmp.is_dir() and any(tmp.iterdir()) and not (tmp / MARKER).exists():
        raise ConfigError(f"{str(tmp)!r} exists and was not written by sparsim: move it away or choose another --out")
    if tmp.exists() and not tmp.is_dir():
        raise ConfigError(f"{str(tmp)!r} is an existing file: move it away or choose another --out")
    try:
        if fresh and tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / MARKER).write_text("written by sparsim; --force may replace this directory\n")
    except OSError as err:
        raise ConfigError(f"cannot create the output directory {str(tmp)!r}: {err.strerror}") from None
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


def csv_cell(v) -> str:
    """One CSV cell: floats in repr (round-trip) form, None and nan as empty, anything else as str()."""
    if v is None:
        return ""
    if isinstance(v, float):
        return "" if math.isnan(v) else repr(v)
    return str(v)


def write_csv(path: Path, columns: Sequence[str], rows: list[dict]) -> None:
    """Write ``rows`` (dicts; a missing key is an empty cell) to CSV ``path`` with a header of ``columns``."""
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(columns)
        for r in rows:
            w.writerow([csv_cell(r.get(c)) for c in columns])


def save_figure(fig, outdir: Path, stem: str) -> None:
    """Save a matplotlib ``fig`` as ``outdir/stem.png`` (110 dpi) and ``outdir/stem.pdf``, then close it."""
    from .plots import plt

    fig.savefig(Path(outdir) / f"{stem}.png", dpi=110)
    fig.savefig(Path(outdir) / f"{stem}.pdf")
    plt.close(fig)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename, so the
    file is either absent, the old one, or complete -- never half written. Raises OSError."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
