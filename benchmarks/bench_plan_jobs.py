"""``sparsim plan --jobs 1`` against ``--jobs 2``: wall and CPU seconds of the whole command, and the same plan.csv.

Runs ``sparsim plan --model resnet50 --network gtopk-icdcs --P 1024`` (every registered algorithm with every
collective the cluster runs x 5 densities x 4 policies, the hybrid included; the cluster preset's P102-100 device)
as a user would, in a subprocess (``python -c "from experiments.cli import main; main()" plan ...``, the
``sparsim`` entry point), with ``--jobs 1`` and then ``--jobs 2``, each into a fresh output folder. Per run: the
whole command's wall seconds, the CPU seconds (user + system) of the command and its worker processes (``os.wait4``
of the child, whose own rusage includes its waited-for children), the configurations in its plan.csv, and whether
its plan.csv equals the ``--jobs 1`` one byte for byte. On a shared fabric (``gtopk-icdcs``'s NICs and PCIe) the
workers each build their own memo of repeated phases (``sim.engine.fastsim.PHASES``), so together they use more
CPU than the serial run.

Results: ``benchmarks/results/plan_jobs.csv`` (``--out``) with its meta.json sidecar; docs/advisor.md shows the
table (``python benchmarks/tables.py``). A benchmark: nothing asserts on time.

Example:
    .venv/bin/python benchmarks/bench_plan_jobs.py            # a few minutes
"""
from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import check_out, environment_line, markdown_table, run_sparsim, save_results  # noqa: E402

HEADER = ["jobs", "model", "network", "P", "configurations", "wall_s", "cpu_s", "same_plan_csv"]


def run(out: Path, a, jobs: int) -> tuple[float, float]:
    """Run the plan with ``jobs`` into ``out`` (:func:`_common.run_sparsim`): (wall s, CPU s of the command and its
    workers). Raises RuntimeError with its stderr's last line when it fails."""
    _, wall, usage = run_sparsim(["plan", "--model", a.model, "--network", a.network, "--P", a.P, "--jobs", str(jobs),
                                  "--quiet", "--out", str(out)])
    return wall, usage.ru_utime + usage.ru_stime


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50", help="zoo model (default resnet50)")
    ap.add_argument("--network", default="gtopk-icdcs", help="cluster preset (default gtopk-icdcs)")
    ap.add_argument("--P", default="1024", help="comma list of worker counts (default 1024)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "plan_jobs.csv")
    a = ap.parse_args(argv)
    check_out(ap, a.out)
    print(environment_line(), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        first = None
        for jobs in (1, 2):
            out = Path(tmp) / f"jobs{jobs}"
            try:
                wall, cpu = run(out, a, jobs)
            except RuntimeError as e:  # the command's own one-line error (a bad --model, --network, --P): exit 2
                print(f"bench_plan_jobs: {e}", file=sys.stderr)
                return 2
            text = (out / "plan.csv").read_bytes()
            first = text if first is None else first
            with (out / "plan.csv").open(newline="") as fh:
                n = sum(1 for _ in csv.DictReader(fh))
            rows.append([jobs, a.model, a.network, a.P, n, round(wall, 1), round(cpu, 1), text == first])
            print(f"  --jobs {jobs}: {wall:.1f} s wall, {cpu:.1f} s CPU, {n} rows", flush=True)
    print(markdown_table(HEADER, rows))
    return save_results(a.out, HEADER, rows)


if __name__ == "__main__":
    sys.exit(main())
