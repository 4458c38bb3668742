"""Helpers shared by the benchmark scripts (not a test module; nothing here asserts on time).

- :func:`tune_malloc`: make glibc keep freed memory in the heap instead of returning every large
  (> 128 KiB) numpy buffer to the kernel with munmap (the CLI's own setting, ``sim.base.malloc``). The simulator
  allocates many 8 MB arrays per step at d = 10^6; on this VM each fresh page costs a (slow) page fault, which roughly doubles the
  numerics' wall time and adds noise. Both drivers run under the same setting, so the simpy/lockstep
  ratio stays a fair comparison (and, because the shared numerics get cheaper, a stricter one).
- :func:`markdown_table`, :func:`write_csv` (with its ``<name>.meta.json`` sidecar: when, on what machine, by
  which command), :func:`median`, :func:`profile_by_module`.
- For scripts that time the ``sparsim`` command as a user runs it: :func:`check_out` (a bad ``--out`` refused before
  the run), :func:`run_sparsim` (the command in a subprocess, its wall seconds and its own rusage) and
  :func:`save_results` (the CSV, or one line and exit 2).
"""
from __future__ import annotations

import cProfile
import csv
import io
import json
import os
import platform
import pstats
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import simpy

def tune_malloc() -> str:
    """Make glibc keep freed memory in the heap: :func:`sim.base.malloc.keep_freed_memory` (what the CLI does at
    start-up); returns its one-line note."""
    from sim.base.malloc import keep_freed_memory

    return keep_freed_memory()


def median(xs) -> float:
    """Median of a non-empty sequence of numbers, as float (statistics.median); raises StatisticsError if empty."""
    return float(statistics.median(xs))


def fmt(x, spec: str = ".3g") -> str:
    """Table cell text: "" for None, "nan" for NaN, floats with ``spec``, anything else with str()."""
    if x is None:
        return ""
    if isinstance(x, float):
        if x != x:
            return "nan"
        return format(x, spec)
    return str(x)


def markdown_table(header: list[str], rows: list[list]) -> str:
    """Render ``rows`` (lists of already formatted strings or values) as a GitHub Markdown table."""
    cells = [[str(c) for c in header]] + [[c if isinstance(c, str) else fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for r in cells[1:]:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    return "\n".join(lines)


def out_problem(path: str | os.PathLike) -> str | None:
    """Why a results CSV could not be written at ``path`` (it is a folder, or its nearest existing ancestor is not a
    writable folder), or None: checked before a benchmark runs, so a bad ``--out`` is refused at once instead of
    after the run (:func:`write_csv` creates the missing folders)."""
    path = Path(path)
    if path.is_dir():
        return f"--out {str(path)!r} is a folder: valid a file path"
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"--out {str(path)!r}: {str(parent)!r} is not a writable folder"
    return None


def check_out(ap, path: str | os.PathLike) -> None:
    """``ap.error`` (one line, exit 2) when :func:`out_problem` finds ``path`` unwritable; ap: the script's
    argparse.ArgumentParser."""
    problem = out_problem(path)
    if problem:
        ap.error(problem)


def save_results(path: str | os.PathLike, header: list[str], rows: list[list]) -> int:
    """:func:`write_csv` and print where; returns the script's exit code: 0, or 2 with one line on stderr when the
    file could not be written after :func:`check_out` passed (no file is left half-written)."""
    try:
        print(f"wrote {write_csv(path, header, rows)}")
    except OSError as e:
        print(f"{Path(sys.argv[0]).name}: --out {str(path)!r} could not be written: {e.strerror or e}",
              file=sys.stderr)
        return 2
    return 0


ROOT = Path(__file__).resolve().parents[1]


def run_sparsim(args: list[str]) -> tuple[list[str], float, "os.struct_rusage"]:
    """Run ``sparsim ARGS`` as a user would (``python -c "from experiments.cli import main; main()"``, the console
    script's entry point, this interpreter, in the repository root, so this checkout's code): (its stdout lines, its
    wall seconds, its rusage from ``os.wait4``: the child's own, with the children it waited for, e.g. ``--jobs``
    workers; ru_maxrss in KB). Raises RuntimeError("sparsim CMD exited N: <its stderr's last line>") when it fails."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-c", "from experiments.cli import main; main()", *args], cwd=ROOT,
                             stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        code = os.waitstatus_to_exitcode(status)
        p.returncode = code  # reaped here: Popen must not wait for it again
        out.seek(0)
        err.seek(0)
        if code != 0:
            raise RuntimeError(f"sparsim {args[0]} exited {code}: {(err.read().strip().splitlines() or ['?'])[-1]}")
        return out.read().splitlines(), wall, usage


def write_csv(path: str | os.PathLike, header: list[str], rows: list[list]) -> Path:
    """Write ``rows`` under ``header`` to ``path`` (parent folders created); return the path.
    Written to ``path.tmp`` and renamed, so an interrupted write leaves no half-written file. Beside it goes the
    sidecar ``<stem>.meta.json`` (:func:`write_meta`): the UTC date, :func:`environment_line`, the machine and the
    command line, which ``benchmarks/tables.py`` prints above every table made from the CSV."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            w.writerows(rows)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    write_meta(path)
    return path


def meta_path(csv_path: str | os.PathLike) -> Path:
    """The sidecar of a results CSV: ``x.csv`` -> ``x.meta.json`` in the same folder."""
    p = Path(csv_path)
    return p.with_name(p.stem + ".meta.json")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere; "unknown CPU" if neither)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def write_meta(csv_path: str | os.PathLike) -> Path:
    """Write ``csv_path``'s sidecar (:func:`meta_path`): when (UTC), on what machine and by which command the CSV
    was measured. Keys: ``date_utc``, ``environment`` (:func:`environment_line` now), ``machine`` (CPU model and
    count), ``platform``, ``command``."""
    out = meta_path(csv_path)
    meta = {
        "csv": Path(csv_path).name,
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "environment": environment_line(),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs",
        "platform": platform.platform(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
    }
    tmp = out.with_name(out.name + ".tmp")
    try:
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def environment_line() -> str:
    """One line for benchmark reports: Python, numpy and simpy versions, CPU count, load average, OPENBLAS_NUM_THREADS."""
    return (f"python {platform.python_version()}, numpy {np.__version__}, simpy {simpy.__version__}, "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, "
            f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}")


def closed_form_messages(name: str, P: int) -> int:
    """Messages per iteration summed over ranks (src != dst) of one S-SGD step, from the collectives.

    name: "topk" (Bruck allgather: P ceil(lg P)), "gtopk_tree" (binomial reduce + broadcast: 2(P-1)),
    "gtopk_rd" (recursive doubling: pof2 lg(pof2) + 2 rem), "dense_ring" (ring allreduce: 2(P-1) P),
    "dense_rd" (recursive doubling allreduce: pof2 lg(pof2) + 2 rem).
    """
    ceil_lg = (int(P) - 1).bit_length()
    pof2 = 1 << (int(P).bit_length() - 1)
    rem = P - pof2
    if name == "topk":
        return P * ceil_lg
    if name == "gtopk_tree":
        return 2 * (P - 1)
    if name in ("gtopk_rd", "dense_rd"):
        return pof2 * (pof2.bit_length() - 1) + 2 * rem
    if name == "dense_ring":
        return 2 * (P - 1) * P if P > 1 else 0
    raise KeyError(name)



def module_of(filename: str) -> str:
    """Group a profiled function's file name: "simpy", "torch", "sim/<file>.py", "numpy", "builtins/C" or "other"."""
    if "/simpy/" in filename:
        return "simpy"
    if "/torch/" in filename:
        return "torch"
    if "/sim/" in filename:
        return "sim/" + filename.rsplit("/sim/", 1)[1]
    if "numpy" in filename:
        return "numpy"
    return "builtins/C" if filename == "~" else "other"


def profile_by_module(fn, label: str, top: int = 15, modules: int = 8) -> str:
    """Run ``fn()`` under cProfile; return "self time by module (<label>): ..." (seconds, the ``modules``
    largest groups of :func:`module_of`) followed by the ``top`` functions by self time."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    by_mod: dict[str, float] = {}
    for (filename, _, _), (_, _, tt, _, _) in st.stats.items():
        key = module_of(filename)
        by_mod[key] = by_mod.get(key, 0.0) + tt
    total = sum(by_mod.values())
    s.write(f"total {total:.2f} s; self time by module ({label}): "
            + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(by_mod.items(), key=lambda kv: -kv[1])[:modules]) + "\n")
    st.sort_stats("tottime").print_stats(top)
    return s.getvalue()
