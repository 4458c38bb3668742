"""Output files: directories that never look complete when they are not, CSV tables and figures.

Directories are built in ``DIR.partial``, then renamed.

Every command that writes a directory (``sparsim run``, the torchrun entry point, ``sparsim experiment``)
uses these three steps: :func:`check_out` before any work, :func:`partial_dir` to build into, and
:func:`publish` once everything is written.

Two runs on one ``--out``: :func:`check_out` takes an exclusive lock (``filelock``, an OS file lock released
when the process ends, whatever the way) keyed by the directory's absolute path, in the system's temporary
directory (so nothing is left beside ``DIR``; runs on one machine see each other, runs on two machines
sharing a file system do not), and holds it until :func:`publish` (or the process's exit); a second run finds the
lock held and stops at once with a one-line error, before it touches ``DIR.partial`` or ``DIR``. The lock file is
removed as the lock is released (:class:`_DirLock`), so none pile up in the temporary directory.
"""
from __future__ import annotations

import atexit
import csv
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

from filelock import FileLock, Timeout

from sim.base.errors import ConfigError

__all__ = ["MARKER", "file_record", "verify_record", "check_out", "check_path_fits", "lock_path", "release", "partial_dir", "publish", "write_csv", "csv_cell", "save_figure",
           "atomic_write_text"]


#: Written into every directory this project publishes; ``--force`` replaces only such directories.
MARKER = ".sparsim-output"


#: Directories this process has published (:func:`publish`), in order: an interrupt after one of them says it
#: is complete (the CLI's exit 130 message) instead of implying that nothing was written.
PUBLISHED: list[Path] = []

#: Locks this process holds, by output directory (absolute path); released by :func:`publish` (or at exit).
_LOCKS: dict = {}

try:
    import fcntl  # noqa: F401

    _HAVE_FCNTL = True
except ImportError:  # pragma: no cover - Windows
    _HAVE_FCNTL = False


def lock_path(out: Path) -> Path:
    """The lock file of output directory ``out``: ``<tmp>/sparsim-locks/<sha256 of its absolute path>.lock``."""
    import hashlib

    key = hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:32]
    return Path(tempfile.gettempdir()) / "sparsim-locks" / f"{key}.lock"


class _DirLock:
    """An exclusive, non-blocking ``flock`` on a lock file that its holder removes as it releases it, so lock files do
    not pile up in the temporary directory (one per --out ever written, before #23).

    Safe to remove: the file is unlinked while still locked, and a process that locked a file no longer at the path
    (it opened the file before its holder removed it) lets it go and locks the file there now. The kernel drops the
    lock when the process ends, whatever the way; a file left by a killed process is removed by the next release of
    the same --out. Interoperates with ``filelock.FileLock`` on the same path (both use ``flock``)."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.fd: int | None = None
        self.pid = 0

    def acquire(self) -> bool:
        """Lock the file (created if absent); False when another process holds it. Raises OSError."""
        import errno
        import fcntl

        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    return False
                raise
            try:
                now = os.stat(self.path)
            except FileNotFoundError:
                now = None
            if now is not None and os.path.samestat(now, os.fstat(fd)):
                self.fd, self.pid = fd, os.getpid()
                return True
            os.close(fd)  # its holder removed this file as it released it: lock the one at the path now
        return False

    def release(self) -> None:
        """Remove the lock file, then unlock it (no-op when not held; in a forked child, which shares the parent's
        lock, only its own descriptor is closed)."""
        if self.fd is None:
            return
        if os.getpid() == self.pid:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        os.close(self.fd)
        self.fd = None


class _PortableLock:
    """Where there is no ``fcntl`` (Windows): ``filelock.FileLock``, whose file stays after release."""

    def __init__(self, path: Path):
        self.lock = FileLock(str(path), timeout=0, is_singleton=False)

    def acquire(self) -> bool:
        try:
            self.lock.acquire()
        except Timeout:
            return False
        return True

    def release(self) -> None:
        self.lock.release()


def _lock(out: Path) -> None:
    key = str(Path(out).resolve())
    if key in _LOCKS:  # this process already writes it (a run resumed in the same process)
        return
    lp = lock_path(out)
    try:
        lp.parent.mkdir(parents=True, exist_ok=True)
        lock = _DirLock(lp) if _HAVE_FCNTL else _PortableLock(lp)
        held = lock.acquire()
    except OSError as err:
        raise ConfigError(f"cannot create the lock file {str(lp)!r} of {str(out)!r}: {err.strerror}") from None
    if not held:
        raise ConfigError(f"another sparsim run is writing {str(out)!r} (lock {str(lp)!r} is held): wait for it to "
                          "finish or choose another --out")
    if not _LOCKS:
        atexit.register(_release_all)
    _LOCKS[key] = lock


def release(out: Path) -> None:
    """Release this process's lock on ``out`` and remove its lock file (no-op when it holds none)."""
    lock = _LOCKS.pop(str(Path(out).resolve()), None)
    if lock is not None:
        lock.release()


def _release_all() -> None:
    """At exit: release every lock still held (a run that failed after :func:`check_out`), removing its file."""
    for key in list(_LOCKS):
        lock = _LOCKS.pop(key)
        try:
            lock.release()
        except OSError:
            pass


def check_out(out: Path, force: bool) -> None:
    """Check that ``out`` may be written and lock it for this process: it does not exist, is an empty
    directory, or ``force`` is given and it is a directory this project wrote (it holds :data:`MARKER`), and
    no other run holds its lock. Raises ConfigError otherwise, and for an empty path or one whose parent
    cannot be created. The lock is held until :func:`publish` (or the process's end)."""
    if str(out).strip() in ("", ".", ".."):
        raise ConfigError(f"--out {str(out)!r} is not a usable output directory: name a new directory")
    out = Path(out)
    check_path_fits(out, "--out", suffix=".partial")
    if out.is_symlink():  # live, dangling or a loop: publish would replace the link, rmtree refuses it
        try:
            target = os.readlink(out)
        except OSError:
            target = "?"
        raise ConfigError(f"--out {str(out)!r} is a symbolic link (to {target!r}): valid a directory path that is "
                          "not a link; name the target itself")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is an existing file: choose a directory path")
    _lock(out)
    try:
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
    except ConfigError:
        release(out)
        raise


def _shown_path(p) -> str:
    """``repr`` of a path for an error line, cut to its first 60 characters when longer than 80."""
    text = repr(str(p))
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def check_path_fits(path, what: str = "--out", suffix: str = "") -> None:
    """Raise ConfigError (one line, before any work) unless the file system can name ``path`` with ``suffix``
    appended to its last name (``.partial``, a temporary file's): every name in it at most the file system's
    ``PC_NAME_MAX`` bytes (255 on most) and its absolute form shorter than ``PC_PATH_MAX`` bytes (4096 on Linux).
    Otherwise every call on it (``is_symlink``, ``mkdir``, ``open``) raises OSError ENAMETOOLONG."""
    p = Path(path)
    name_max = _name_max(p)
    parts = p.parts
    for i, part in enumerate(parts):
        extra = suffix if i == len(parts) - 1 else ""
        n = len(os.fsencode(part + extra))
        if part not in ("/", "") and n > name_max:
            which = "its last name" if i == len(parts) - 1 else f"the name {_shown_path(part)} in it"
            raise ConfigError(f"{what} {_shown_path(p)}: {which} is {len(os.fsencode(part))} bytes: valid at most "
                              f"{name_max - len(os.fsencode(extra))} bytes (the file system's {name_max}"
                              + (f", less {len(os.fsencode(extra))} for {extra!r})" if extra else ")"))
    path_max = _path_max(p)
    n = len(os.fsencode(os.path.abspath(p)))
    total = n + len(os.fsencode(suffix))
    if total >= path_max:
        raise ConfigError(f"{what} {_shown_path(p)}: its absolute path is {n} bytes"
                          + (f" ({total} with {suffix!r})" if suffix else "")
                          + f": valid fewer than {path_max} bytes (the system's PATH_MAX)")


def _path_max(out: Path) -> int:
    """Longest path (bytes, with its terminating NUL) in ``out``'s nearest existing parent (``PC_PATH_MAX``; 4096
    when the system does not say)."""
    parent = _existing_parent(out)
    try:
        return int(os.pathconf(parent, "PC_PATH_MAX"))
    except (OSError, ValueError, AttributeError):
        return 4096


def _existing_parent(out: Path) -> Path:
    """The nearest existing directory above ``out`` (its absolute form); a name too long to look up counts as absent."""
    parent = Path(os.path.abspath(out)).parent
    while parent != parent.parent:
        try:
            if parent.exists():
                break
        except OSError:  # ENAMETOOLONG on the way up
            pass
        parent = parent.parent
    return parent


def _name_max(out: Path) -> int:
    """Longest file name (bytes) in ``out``'s nearest existing parent directory (``pathconf PC_NAME_MAX``; 255 when
    the system does not say)."""
    parent = _existing_parent(out)
    try:
        return int(os.pathconf(parent, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):
        return 255


#: File in ``DIR.partial`` holding the settings of the sweep that may be resumed from it (:func:`partial_dir`).
RESUME_KEY = ".sparsim-resume-key"


def partial_dir(out: Path, *, fresh: bool = True, resume_key: str | None = None) -> Path:
    """Create and return ``out.partial`` holding :data:`MARKER` (emptied first when ``fresh``; kept to resume
    otherwise). Raises ConfigError naming the path when it cannot be created (permissions, read-only, a full disk:
    a ``DIR.partial`` made by this call is removed again, one kept to resume is left as it was) or
    when it exists, is not empty and was not written by sparsim (no :data:`MARKER`): it is never removed then.

    resume_key (with ``fresh=False``): the settings that the kept runs depend on (an experiment's --quick and
    options); a partial directory left by a sweep with another key (or none) is emptied instead of resumed, so
    that an interrupted --quick sweep's runs never stand in for a full sweep's (its run folders are named by
    configuration, not by iteration count). Stored in :data:`RESUME_KEY`."""
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    if tmp.is_dir() and any(tmp.iterdir()) and not (tmp / MARKER).exists():
        raise ConfigError(f"{str(tmp)!r} exists and was not written by sparsim: move it away or choose another --out")
    if tmp.exists() and not tmp.is_dir():
        raise ConfigError(f"{str(tmp)!r} is an existing file: move it away or choose another --out")
    if not fresh and resume_key is not None and tmp.is_dir():
        try:
            kept = (tmp / RESUME_KEY).read_text()
        except OSError:
            kept = None
        fresh = kept != resume_key
    ours = fresh or not tmp.exists()  # made here, so removed here if it cannot be completed
    try:
        if fresh and tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / MARKER).write_text("written by sparsim; --force may replace this directory\n")
        if resume_key is not None:
            (tmp / RESUME_KEY).write_text(resume_key)
    except OSError as err:
        if ours:  # a full disk or a quota: no empty DIR.partial left behind (it would look like a run in progress)
            shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"cannot create the output directory {str(out)!r} (written first as {tmp.name!r}): "
                          f"{err.strerror}") from None
    return tmp


def publish(tmp: Path, out: Path) -> Path:
    """Replace ``out`` (file or directory, if any) by the finished directory ``tmp``, release this process's
    lock on ``out``; return ``out``."""
    out = Path(out)
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    Path(tmp).rename(out)
    PUBLISHED.append(out)
    release(out)
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


def file_record(path: Path, rows: list[dict], iterations_of=lambda r: r["iteration"]) -> dict:
    """What summary.json records of a finished metrics.csv so a reader can verify it (``sparsim check``):
    its sha256, its number of data rows, the algorithms in order and each one's number of rows."""
    import hashlib

    algs: dict[str, int] = {}
    for r in rows:
        algs[r["algorithm"]] = algs.get(r["algorithm"], 0) + 1
    return {"file": Path(path).name, "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(), "rows": len(rows),
            "rows_per_algorithm": algs}


def verify_record(run_dir: Path, record: dict | None) -> None:
    """Raise ConfigError unless ``run_dir``'s file named in ``record`` (:func:`file_record`) is the one its run
    finished writing (same sha256). A record missing (a run from before the checksum) is an error too."""
    import hashlib

    if not record:
        raise ConfigError(f"{str(run_dir)!r}: summary.json records no checksum of metrics.csv (written by an older "
                          "sparsim, or edited): rerun it to check it")
    p = Path(run_dir) / record["file"]
    if not p.is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a finished run directory: {record['file']} is missing")
    got = hashlib.sha256(p.read_bytes()).hexdigest()
    if got != record["sha256"]:
        raise ConfigError(f"{str(p)!r} is not the file its run wrote (sha256 {got[:12]}... != {record['sha256'][:12]}... "
                          f"recorded in summary.json for {record['rows']} rows of "
                          f"{', '.join(f'{a} ({n})' for a, n in record['rows_per_algorithm'].items())}): it was "
                          "truncated or edited; rerun the scenario")


def save_figure(fig, outdir: Path, stem: str) -> None:
    """Save a matplotlib ``fig`` as ``outdir/stem.png`` (110 dpi) and ``outdir/stem.pdf``, then close it (in
    pyplot, where it was made there).

    ``fig.tight_layout()`` leaves a placeholder layout engine on the figure, for which every ``savefig`` draws
    the whole figure once more (with rendering disabled) before drawing it into the file; the placeholder lays
    nothing out, so it is removed first: the same files, two draws fewer.

    A write that fails (a full disk, a quota) raises OSError with its errno and the file's path, also where the
    backend hides it under its own error (the PDF backend's ``zlib.error: Error -2 while flushing``, raised while
    it cleans up after the OSError): the CLI says "cannot write FILE: No space left on device", exit 2."""
    import sys

    import matplotlib
    from matplotlib.layout_engine import PlaceHolderLayoutEngine

    if isinstance(fig.get_layout_engine(), PlaceHolderLayoutEngine):
        with matplotlib.rc_context({"figure.autolayout": False, "figure.constrained_layout.use": False}):
            fig.set_layout_engine(None)
    for path, kw in ((Path(outdir) / f"{stem}.png", {"dpi": 110}), (Path(outdir) / f"{stem}.pdf", {})):
        try:
            fig.savefig(path, **kw)
        except Exception as err:  # noqa: BLE001 - re-raised unless a write error lies under it
            cause = _write_error(err)
            if cause is None:
                raise
            raise OSError(cause.errno, cause.strerror or os.strerror(cause.errno), str(path)) from None
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None:
        plt.close(fig)


def _write_error(err: BaseException) -> OSError | None:
    """The OSError with an errno in ``err`` or in the exceptions it was raised while handling (``__context__``,
    ``__cause__``), nearest first; None when there is none."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno is not None:
            return err
        err = err.__cause__ or err.__context__
    return None


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
