"""The hybrid per-bucket plan against the best uniform policy: ResNet-50 on two cluster presets at two P (#22 item 3).

For each cluster preset (gtopk-icdcs with the P102-100 device, dgx-h100 with the H100), each P in --P, each sparse
algorithm (Top-k, gTop-k) and each bound (--min-density: overall density >= 0.01, the informative one;
--density-bound: overall density <= 0.01, a cap), it runs what ``sparsim workload hybrid-plan
experiments/scenarios/resnet50-1gbe.toml --set cluster.network=... --set cluster.P=... --set workload.device=...
--set "algorithms=['dense','gtopk']" --set "workload.sparse_policy='bucket'" --densities 0.001,0.01,0.1
--min-density 0.01`` runs (:func:`experiments.hybrid.make_plan`: the dynamic programme over DDP's 5 buckets, then every uniform
policy under the same bound on the same timeline) and writes one row per case: the plan (D = dense, else the density,
bucket 0 first = the last layers), its simulated iteration, the best uniform policy and its iteration, the gain
(best uniform / hybrid), dense DDP's iteration, and the planner's wall seconds.

These are simulated times (deterministic; the compute model of the device presets: docs/costs.md); the wall seconds
are this machine's. ``python benchmarks/tables.py`` puts the table into docs/hybrid.md. Example:

    .venv/bin/python benchmarks/bench_hybrid.py     # 2 clusters x 2 P x 2 algorithms x 2 bounds, about 20 s
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import write_csv  # noqa: E402

from experiments.hybrid import make_plan  # noqa: E402
from experiments.scenario import load_scenario  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "experiments" / "scenarios" / "resnet50-1gbe.toml"
CLUSTERS = (("gtopk-icdcs", "P102-100"), ("dgx-h100", "H100"))
ALGORITHMS = ("topk", "gtopk")
DENSITIES = (0.001, 0.01, 0.1)
HEADER = ["model", "network", "device", "P", "algorithm", "bound", "bound_value", "plan", "hybrid_ms", "plan_density",
          "best_uniform", "best_uniform_ms", "gain", "dense_ms", "wall_s"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--P", default="64,256", help="comma-separated P (multiples of 8)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hybrid.csv"))
    a = ap.parse_args(argv)
    rows = []
    for net, dev in CLUSTERS:
        for P in (int(x) for x in a.P.split(",")):
            for algo in ALGORITHMS:
                sc = load_scenario(str(SCENARIO), [f"cluster.network='{net}'", f"cluster.P={P}",
                                                   f"workload.device='{dev}'", f"algorithms=['dense','{algo}']",
                                                   "workload.sparse_policy='bucket'"])
                for bound in ("min_density", "density"):
                    t0 = time.perf_counter()
                    ch = make_plan(sc, DENSITIES, bound, 0.01)
                    wall = time.perf_counter() - t0
                    dense = next(u for u in ch.uniform if u.label == "dense")
                    plan = ",".join("D" if r is None else f"{r:g}" for r in ch.plan.densities)
                    bu = ch.best_uniform
                    rows.append(["resnet50", net, dev, P, algo, bound, 0.01, plan, ch.iter_s * 1e3,
                                 ch.plan.nominal_density(), bu.label if bu else "", bu.iter_s * 1e3 if bu else "",
                                 ch.gain if bu else "", dense.iter_s * 1e3, round(wall, 2)])
                    print(f"{net:12} P={P:<5} {algo:6} {bound:12} plan {plan:28} {ch.iter_s * 1e3:9.3f} ms  best "
                          f"uniform {bu.label if bu else '-':14} {bu.iter_s * 1e3 if bu else float('nan'):9.3f} ms  "
                          f"gain {ch.gain:.4f}  ({wall:.1f} s)", flush=True)
    write_csv(a.out, HEADER, rows)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
