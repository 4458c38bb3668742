"""Wall time of ``sparsim plan`` and of each of its parts: every registered algorithm x 5 densities x 3 policies x P.

The issue's plan: ResNet-50 (zoo) on ``dgx-h100`` (8 H100 per node, device H100, 32 samples per rank), every
registered algorithm at its default collective (:data:`sim.algorithms.REGISTRY`, the first of its collectives;
``--all-collectives``: every collective the cluster runs), densities 0.0001, 0.001, 0.01, 0.03, 0.1, policies
model, bucket and layer (algorithms without k: once, on DDP's buckets), P in 64, 256, 1024, 4096, 16384, one
iteration each on the fast engine (:func:`experiments.plan.simulate_plan`, one shared collective cache per P).

A part is one (P, algorithm, policy) over its densities (the dense baseline of each P, dense DDP with each of its
collectives, is a part of its own).
Reported per part: configurations, how many were simulated, the wall seconds they took, and, where the part's
first configuration took more than ``--max-part-s`` (the slow collectives of the fast engine at large P: its time
grows as P^2 for Ok-Topk's P - 1 rounds), the rest of the part is skipped and its wall time estimated as the
measured mean x the configurations left (the ``estimated`` column; the time a collective's simulation takes does
not depend on its message sizes, only on its rounds). Per P and overall: the sums. Also the set-up
(:func:`experiments.plan.resolve_plan`) and the wall time of the whole run.

``--jobs N`` (default: ``sparsim plan``'s, the usable cores, at most 8): with N > 1 each P's distinct collectives
are simulated first on N worker processes (:func:`experiments.plan.simulate_plan`'s prefetch), which is then most of
that P's time: it is reported as a part of its own, ``prefetch (C collectives, J jobs)`` (its wall seconds include
the dry pass that lists the collectives; ``simulated`` is C), and the per-configuration parts that follow are mostly
cache hits (the timeline's own arithmetic, the hybrid optimiser, and the collectives the prefetch leaves to the
serial pass). ``--max-part-s`` needs a part's first configuration to pay for its collectives, which the prefetch has
already paid: with N > 1 it defaults to 0 (everything is simulated) and a positive value is refused; with ``--jobs
1`` the serial path above is unchanged (default 60 s).

Results: ``benchmarks/results/plan.csv`` (``--out``) via ``_common.write_csv`` with its meta.json sidecar;
docs/advisor.md shows the table (``python benchmarks/tables.py``). This is a benchmark: nothing asserts on time.

Example:
    .venv/bin/python benchmarks/bench_plan.py                       # the issue's plan (P up to 16384)
    .venv/bin/python benchmarks/bench_plan.py --P 64,256 --out /tmp/plan.csv
    .venv/bin/python benchmarks/bench_plan.py --jobs 1 --max-part-s 10   # serial, as before --jobs
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

from experiments import plan as pl  # noqa: E402
from sim.algorithms import REGISTRY  # noqa: E402

HEADER = ["P", "part", "configurations", "simulated", "wall_s", "estimated_wall_s", "slowest_config_s"]


def parse_args(argv=None):
    """The command-line options (see --help); argv: list of strings, default sys.argv[1:]."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50", help="zoo model (default resnet50)")
    p.add_argument("--network", default="dgx-h100", help="cluster preset (default dgx-h100)")
    p.add_argument("--device", default="H100", help="device model (default H100)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank (default 32)")
    p.add_argument("--P", default="64,256,1024,4096,16384", help="comma list of worker counts")
    p.add_argument("--densities", default=",".join(f"{d:g}" for d in pl.DEFAULT_DENSITIES), help="comma list of k/d")
    p.add_argument("--policies", default="model,bucket,layer",
                   help="comma list of selection policies (default the issue's three; hybrid is the fourth)")
    p.add_argument("--all-collectives", action="store_true", help="every collective of each algorithm, not its default")
    p.add_argument("--max-part-s", type=float, default=None,
                   help="--jobs 1 only: skip the rest of a part whose first configuration took longer than this (wall "
                        "s; its time is then estimated); 0: simulate everything (default 60 with --jobs 1, 0 with more)")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes for each P's collectives (default: the usable cores, at most 8; 1: serial)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "plan.csv"), help="results CSV")
    a = p.parse_args(argv)
    if a.jobs is None:
        a.jobs = pl.default_jobs()
    if not 1 <= a.jobs <= pl.MAX_JOBS:
        p.error(f"--jobs {a.jobs} is out of range: valid 1 <= jobs <= {pl.MAX_JOBS}")
    if a.max_part_s is None:
        a.max_part_s = 60.0 if a.jobs == 1 else 0.0
    if a.max_part_s < 0:
        p.error(f"--max-part-s {a.max_part_s:g} is out of range: valid >= 0 (0: simulate everything)")
    if a.jobs > 1 and a.max_part_s:
        p.error(f"--max-part-s {a.max_part_s:g} needs --jobs 1: with --jobs {a.jobs} each P's collectives are "
                "simulated before its configurations, so a part's first configuration no longer measures its cost "
                "(valid --max-part-s 0, or --jobs 1)")
    return a


def issue_plan(P: str, *, model: str = "resnet50", network: str = "dgx-h100", device: str = "H100",
               batch_size: int = 32, densities: str | None = None, policies: str = "model,bucket,layer",
               all_collectives: bool = False):
    """The issue's plan (:func:`experiments.plan.resolve_plan`): every registered algorithm at its default collective
    (``all_collectives``: every collective the cluster runs) x densities (default
    :data:`experiments.plan.DEFAULT_DENSITIES`) x policies, on ``model`` / ``network`` at the worker counts ``P``
    (comma list). Returns its PlanInputs; raises ConfigError as resolve_plan does."""
    algs = None if all_collectives else ",".join(f"{n}:{algo.collectives[0]}" for n, algo in REGISTRY.items())
    if densities is None:
        densities = ",".join(f"{d:g}" for d in pl.DEFAULT_DENSITIES)
    return pl.resolve_plan(model=model, network=network, device=device, batch_size=batch_size, P=P,
                           densities=densities, algorithms=algs, policies=policies)


def main(argv=None) -> int:
    """Run the benchmark; print the table and write the CSV; return 0."""
    a = parse_args(argv)
    print(tune_malloc())
    print(environment_line())
    t_all = time.perf_counter()
    inp = issue_plan(a.P, model=a.model, network=a.network, device=a.device, batch_size=a.batch_size,
                     densities=a.densities, policies=a.policies, all_collectives=a.all_collectives)
    t_resolve = time.perf_counter() - t_all
    print(f"plan: {a.model} on {a.network}, {len(inp.configs)} configurations + the dense baseline x P = {a.P}; "
          f"set-up {t_resolve:.2f} s; "
          f"--jobs {a.jobs}")
    parts: dict[tuple, dict] = {}

    def part_of(cfg, P):
        return P, f"{cfg.algorithm}:{cfg.collective} {cfg.policy}"

    for P in inp.Ps:
        for cfg in inp.configs:
            parts.setdefault(part_of(cfg, P), {"n": 0, "done": 0, "wall": 0.0, "max": 0.0})["n"] += 1

    def on_row(row, wall):
        if row.get("baseline"):
            key = (row["P"], "dense baseline (each dense collective, DDP buckets)")
            parts[key] = {"n": 1, "done": 1, "wall": wall, "max": wall}
            print(f"  P = {row['P']:>6}  {'baseline':<36} {wall:8.2f} s", flush=True)
            return
        p = parts[part_of(row["config"], row["P"])]
        p["done"] += 1
        p["wall"] += wall
        p["max"] = max(p["max"], wall)
        if p["done"] == p["n"] or (a.max_part_s and p["max"] > a.max_part_s):
            print(f"  P = {row['P']:>6}  {part_of(row['config'], row['P'])[1]:<36} {p['wall']:8.2f} s "
                  f"({p['done']}/{p['n']})", flush=True)

    def skip(cfg, P):
        p = parts[part_of(cfg, P)]
        return bool(a.max_part_s) and p["done"] > 0 and p["max"] > a.max_part_s

    prefetch = {}  # P -> simulate_plan's on_prefetch record

    def on_prefetch(info):
        prefetch[info["P"]] = info
        print(f"  P = {info['P']:>6}  {_prefetch_name(info):<36} {info['wall_s']:8.2f} s (listing them "
              f"{info['keys_s']:.2f} s)", flush=True)

    rows = pl.simulate_plan(inp, on_row=on_row, skip=skip if a.jobs == 1 else None, jobs=a.jobs,
                            on_prefetch=on_prefetch)
    t_total = time.perf_counter() - t_all
    out_rows = []
    for P in inp.Ps:
        mine = {k: v for k, v in parts.items() if k[0] == P}
        pre = prefetch.get(P)
        if pre is not None:
            out_rows.append([P, _prefetch_name(pre), "", pre["simulated"], round(pre["wall_s"], 4),
                             round(pre["wall_s"], 4), ""])
        for (_, name), p in mine.items():
            est = p["wall"] + (p["n"] - p["done"]) * (p["wall"] / p["done"] if p["done"] else 0.0)
            out_rows.append([P, name, p["n"], p["done"], round(p["wall"], 4), round(est, 4), round(p["max"], 4)])
        n = sum(p["n"] for p in mine.values())
        done = sum(p["done"] for p in mine.values())
        wall = sum(p["wall"] for p in mine.values()) + (pre["wall_s"] if pre else 0.0)
        est = sum(r[5] for r in out_rows if r[0] == P)
        out_rows.append([P, "all parts", n, done, round(wall, 4), round(est, 4), round(max(p["max"] for p in mine.values()), 4)])
    n = sum(p["n"] for p in parts.values())
    done = sum(p["done"] for p in parts.values())
    est = sum(r[5] for r in out_rows if r[1] == "all parts")
    out_rows.append(["all", "set-up (resolve_plan)", "", "", round(t_resolve, 4), round(t_resolve, 4), ""])
    out_rows.append(["all", "whole run", n, done, round(t_total, 4), round(est + t_resolve, 4), ""])
    path = write_csv(a.out, HEADER, out_rows)
    slow = sorted((r for r in out_rows if r[1] not in ("all parts", "whole run", "set-up (resolve_plan)")),
                  key=lambda r: -r[5])[:12]
    print(markdown_table(HEADER, slow))
    print(f"rows simulated: {len(rows)} + {len(inp.Ps)} dense baselines (the CSV counts both); whole run {t_total:.1f} s wall; estimated with the skipped configurations: "
          f"{est + t_resolve:.1f} s; wrote {path}")
    return 0


def _prefetch_name(info: dict) -> str:
    """The part name of a P's prefetch: ``prefetch (C collectives, J jobs)``."""
    return f"prefetch ({info['simulated']} collectives, {info['jobs']} jobs)"


if __name__ == "__main__":
    sys.exit(main())
