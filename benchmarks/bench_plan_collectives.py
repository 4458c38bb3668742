"""Where the plan benchmark's time goes at one P: its distinct collectives, simulated one by one, per algorithm.

``benchmarks/bench_plan.py`` times the issue's plan (ResNet-50 on ``dgx-h100``, every registered algorithm at its
default collective x 5 densities x 3 policies); almost all of it, at large P, is simulating the distinct
collectives the configurations ask for (:func:`experiments.plan.plan_collective_keys`: one (algorithm spec,
elements) per bucket or layer size and density). This script lists them for one P and simulates each alone, in
this process (:meth:`sim.engine.timeline.CollectiveTimer.simulate`, what a ``--jobs`` worker runs), then reports
per algorithm:collective: how many distinct collectives, their summed and largest wall seconds and their share of
the total. The sum is the CPU time the plan's prefetch needs at that P on one core; ``--jobs 2`` divides it by at
most 2.

Results: ``benchmarks/results/plan_collectives.csv`` (``--out``) with its meta.json sidecar; docs/advisor.md shows
the table (``python benchmarks/tables.py``). A benchmark: nothing asserts on time.

Example:
    .venv/bin/python benchmarks/bench_plan_collectives.py                 # P = 16384, about 2 min
    .venv/bin/python benchmarks/bench_plan_collectives.py --P 4096 --out /tmp/pc.csv
"""
from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment_line, markdown_table, tune_malloc, write_csv  # noqa: E402
from bench_plan import issue_plan  # noqa: E402

from experiments import plan as pl  # noqa: E402
from sim.engine.timeline import CollectiveTimer  # noqa: E402

HEADER = ["P", "collective", "distinct", "wall_s", "max_s", "share"]


def parse_args(argv=None):
    """The command-line options (see --help); argv: list of strings, default sys.argv[1:]."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--P", type=int, default=16384, help="worker count (default 16384; a multiple of 8)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "plan_collectives.csv"),
                   help="results CSV")
    a = p.parse_args(argv)
    if not (8 <= a.P <= 65536 and a.P % 8 == 0):
        p.error(f"--P {a.P} is out of range: valid a multiple of 8 in [8, 65536] (dgx-h100 has 8 GPUs per node)")
    return a


def main(argv=None) -> int:
    """Run the benchmark; print the table and write the CSV; return 0."""
    a = parse_args(argv)
    print(tune_malloc())
    print(environment_line())
    inp = issue_plan(str(a.P))  # bench_plan.py's plan
    net = inp.network_of(a.P)
    keys = pl.plan_collective_keys(inp, a.P, net)
    print(f"P = {a.P}: {len(keys)} distinct collectives", flush=True)
    groups: dict[str, list[float]] = {}
    for spec, n in keys:
        t = time.perf_counter()
        CollectiveTimer.simulate(spec, n, a.P, net, inp.compute, inp.sc.cluster.engine)
        groups.setdefault(f"{spec.name}:{spec.collective}", []).append(time.perf_counter() - t)
    total = sum(sum(w) for w in groups.values())
    out = [[a.P, name, len(w), round(sum(w), 3), round(max(w), 4), round(sum(w) / total, 4)]
           for name, w in sorted(groups.items(), key=lambda kv: -sum(kv[1]))]
    out.append([a.P, "all", len(keys), round(total, 3), round(max(max(w) for w in groups.values()), 4), 1.0])
    path = write_csv(a.out, HEADER, out)
    print(markdown_table(HEADER, out))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
