"""The default scenario's wall time, this checkout against an older one, runs alternating in one session.

Issue #12 asks the default scenario (``sparsim run --out DIR --quiet``: 8 workers, softmax on digits, 400
iterations of dense, Top-k and gTop-k, metrics.csv, summary.json and the figure) to run at least 2x faster than
the code before #12 (26c66ac). Check that older code out once in a git worktree::

    git worktree add /tmp/pre12 26c66ac
    .venv/bin/python benchmarks/bench_default_run.py --before /tmp/pre12            # 5 runs each
    .venv/bin/python benchmarks/bench_default_run.py --before /tmp/pre12 --blas-threads 1

Each run is a fresh ``python -c 'from experiments.cli import main; main()' run --out TMP --quiet`` (what the
``sparsim`` console script does) with ``PYTHONPATH`` and the working directory set to the checkout, so both
use this virtual environment's packages. Runs alternate (before, after, before, ...). For each run: wall
seconds, CPU seconds of the process and its threads (user + system, from ``RUSAGE_CHILDREN``), the 1-minute
load average before and after, and the sha256 of its metrics.csv (every run of one checkout must give the same
bytes: the script stops otherwise). Reported: the median wall and CPU seconds of each side and their ratios.

``--blas-threads`` (default: unset, OpenBLAS's own choice, 2 threads on a 2-core VM) sets
OPENBLAS_NUM_THREADS for both sides. Code before 2f00b72 follows it (its metrics' bits depend on it: the full
evaluation's ``X^T R`` is summed in another order with 2 threads than with 1); since 2f00b72 ``sparsim run``
uses one BLAS thread whatever the setting, so the default compares what each side's ``sparsim run`` does. On
a machine that other work keeps busy, every 2-thread BLAS call waits for its second thread, which makes wall
and CPU seconds grow with the load, and ``--blas-threads 1`` measures the older code without that wait.

Outputs: --out (default benchmarks/results/default_run.csv, one row per run) and a Markdown table on stdout.
This is a benchmark, not a test: nothing asserts on time.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment_line, markdown_table, write_csv  # noqa: E402

HERE = Path(__file__).resolve().parent.parent
CLI = "import sys; from experiments.cli import main; sys.argv[0] = 'sparsim'; main()"


def parse_args(argv=None):
    """The command-line options (see --help); argv: list of strings, default sys.argv[1:]."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="checkout of the older code (e.g. a git worktree of 26c66ac)")
    p.add_argument("--after", default=str(HERE), help="checkout of the newer code (default: this one)")
    p.add_argument("--runs", type=int, default=5, help="runs of each side (default 5)")
    p.add_argument("--blas-threads", default=None, help="OPENBLAS_NUM_THREADS for both sides (default: unset)")
    p.add_argument("--out", default="benchmarks/results/default_run.csv", help="CSV path")
    return p.parse_args(argv)


def one_run(checkout: Path, blas_threads: str | None) -> dict:
    """Run the default scenario once with the code of ``checkout``; return wall s, CPU s, loads and the sha256."""
    out = Path(tempfile.mkdtemp(prefix="bench_default_")) / "run"
    env = dict(os.environ, PYTHONPATH=str(checkout))
    env.pop("OPENBLAS_NUM_THREADS", None)
    if blas_threads is not None:
        env["OPENBLAS_NUM_THREADS"] = str(blas_threads)
    load0 = os.getloadavg()[0]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", CLI, "run", "--out", str(out), "--quiet"], cwd=checkout, env=env,
                   check=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    sha = hashlib.sha256((out / "metrics.csv").read_bytes()).hexdigest()
    shutil.rmtree(out.parent, ignore_errors=True)
    return {"wall_s": wall, "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
            "load_before": load0, "load_after": os.getloadavg()[0], "metrics_sha256": sha}


def main(argv=None):
    """Run the comparison with the options of :func:`parse_args` and print its Markdown report."""
    args = parse_args(argv)
    if args.blas_threads is not None:  # the children's setting, also in the environment line below
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    sides = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    for name, path in sides.items():
        if not (path / "experiments" / "cli.py").is_file():
            raise SystemExit(f"--{name} {path}: not a sparsim checkout (no experiments/cli.py)")
    print(f"# The default scenario: {sides['before']} (before) vs {sides['after']} (after)\n")
    print(f"{args.runs} runs each, alternating; OPENBLAS_NUM_THREADS={args.blas_threads or 'unset'}  ")
    print(f"{environment_line()}\n", flush=True)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    rows = []
    for i in range(args.runs):
        for name, path in sides.items():
            r = one_run(path, args.blas_threads)
            shas = {x["metrics_sha256"] for x in runs[name]} | {r["metrics_sha256"]}
            if len(shas) > 1:
                raise SystemExit(f"{name}: metrics.csv differs between runs ({', '.join(sorted(shas))})")
            runs[name].append(r)
            rows.append([name, i + 1, f"{r['wall_s']:.3f}", f"{r['cpu_s']:.3f}", f"{r['load_before']:.2f}",
                         f"{r['load_after']:.2f}", r["metrics_sha256"], args.blas_threads or "unset"])
            print(f"  {name} run {i + 1}: {r['wall_s']:.2f} s wall, {r['cpu_s']:.2f} s CPU, load "
                  f"{r['load_before']:.2f} -> {r['load_after']:.2f}, metrics.csv {r['metrics_sha256'][:16]}",
                  file=sys.stderr, flush=True)
    write_csv(args.out, ["side", "run", "wall_s", "cpu_s", "load_before", "load_after", "metrics_sha256",
                         "openblas_num_threads"], rows)
    med = {n: (statistics.median(x["wall_s"] for x in rs), statistics.median(x["cpu_s"] for x in rs))
           for n, rs in runs.items()}
    loads = [x[k] for rs in runs.values() for x in rs for k in ("load_before", "load_after")]
    table = [[n, f"{med[n][0]:.2f}", f"{min(x['wall_s'] for x in rs):.2f}", f"{max(x['wall_s'] for x in rs):.2f}",
              f"{med[n][1]:.2f}", rs[0]["metrics_sha256"][:16]] for n, rs in runs.items()]
    print(markdown_table(["side", "median wall s", "min wall s", "max wall s", "median CPU s", "metrics.csv sha256"],
                         table))
    print(f"\nbefore / after: {med['before'][0] / med['after'][0]:.2f}x wall (medians), "
          f"{med['before'][1] / med['after'][1]:.2f}x CPU; load average {min(loads):.2f} to {max(loads):.2f}; "
          f"CSV {args.out}")


if __name__ == "__main__":
    main()
