"""Wall time of one fast-engine collective at large P: every registered collective the ``dgx-h100`` cluster runs.

Issue #22's condition: the plan over every algorithm x 5 densities x 3 policies x P up to 16384 needs every registered
collective on the fast engine (:mod:`sim.engine.fastsim`) at P = 16,384 in at most 10 s. This benchmark times, for
each (algorithm, collective) of ``sparsim predict``'s columns on a hierarchical cluster
(:func:`sim.algorithms.predict_columns`), one :class:`sim.engine.timeline.CollectiveTimer` call (a fresh timer: one
simulated collective, nothing cached) on ``dgx-h100`` with P ranks (default 4096 and 16384), ResNet-50's d =
25,557,032 values, density 0.001 (k = 25,557) for the algorithms with k, the H100 device's compute model (the
collective's own merge and reduce costs), as :func:`experiments.plan.simulate_plan` builds them.

``--baseline TREE`` also times the same calls on another checkout of the project (for example the commit before a
change: ``git worktree add --detach /tmp/wt_old HEAD``), in a second worker process whose ``PYTHONPATH`` is that
tree. The two workers run each call alternately (old, new, old, new, ...) so that both see the same load on a
shared machine (``--tree`` picks the checkout timed as "new", default this one); the CSV gets the ratio and whether the simulated seconds are bit-identical. A call that runs past
``--timeout`` seconds is abandoned (SIGALRM) and reported as a lower bound (``timed_out``).

Results: ``benchmarks/results/fast_p16k.csv`` (``--out``) via ``_common.write_csv`` with its meta.json sidecar.
This is a benchmark: nothing asserts on time.

Example:
    .venv/bin/python benchmarks/bench_fast_p16k.py                                  # this tree, P = 4096, 16384
    .venv/bin/python benchmarks/bench_fast_p16k.py --baseline /tmp/wt_old --P 4096  # before/after
"""
from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
D = 25_557_032  # ResNet-50's parameters (sim.workloads zoo)
DENSITY = 0.001


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


def worker(P: int, timeout: float) -> None:
    """Serve timing requests on stdin ("algorithm collective" per line), one JSON line each on stdout: the wall
    seconds of one fresh CollectiveTimer call, the simulated seconds (repr, for a bitwise comparison), timed_out."""
    from experiments import plan as pl
    from sim.engine.timeline import CollectiveTimer
    from sim.algorithms import REGISTRY

    inp = pl.resolve_plan(model="resnet50", network="dgx-h100", device="H100", batch_size=32, P=str(P),
                          algorithms="dense")
    if inp.workload.d != D:
        raise SystemExit(f"ResNet-50 has d = {inp.workload.d} here, expected {D}")
    net = inp.network_of(P)
    signal.signal(signal.SIGALRM, _alarm)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        name, coll = line.split()
        sparse = REGISTRY[name].sparse
        spec = inp.spec(pl.Config(name, coll, DENSITY if sparse else None, "bucket"), net.gpus_per_node)
        timer = CollectiveTimer(P, net, inp.compute, "fast")
        signal.setitimer(signal.ITIMER_REAL, timeout)
        t0 = time.perf_counter()
        try:
            sim = repr(timer(spec, D))
            out = False
        except _Timeout:
            sim, out = None, True
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        print(json.dumps({"wall_s": time.perf_counter() - t0, "sim_s": sim, "timed_out": out,
                          "k": spec.k if sparse else None}), flush=True)


class Worker:
    """A worker process on the project tree ``tree`` for P ranks."""

    def __init__(self, tree: Path, P: int, timeout: float):
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", "--P", str(P),
                                      "--timeout", str(timeout)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=str(tree))
        self.ask_line()

    def ask_line(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"worker {self.proc.args} ended (exit {self.proc.wait()})")
        return json.loads(line)

    def time(self, name: str, coll: str) -> dict:
        self.proc.stdin.write(f"{name} {coll}\n")
        self.proc.stdin.flush()
        return self.ask_line()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--P", default="4096,16384", help="comma-separated rank counts (multiples of 8)")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout to time (default: this one)")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout of the project to compare with")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds after which one call is abandoned")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "fast_p16k.csv")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    Ps = [int(x) for x in a.P.split(",") if x.strip()]
    if a.worker:
        worker(Ps[0], a.timeout)
        return 0
    sys.path.insert(0, str(HERE))
    from _common import environment_line, markdown_table, tune_malloc, write_csv
    from sim.algorithms import predict_columns

    print(tune_malloc())
    print(environment_line())
    pairs = list(dict.fromkeys(predict_columns(True).values()))
    header = ["P", "algorithm", "collective", "k", "sim_s", "wall_s", "timed_out", "baseline_wall_s",
              "baseline_timed_out", "speedup", "identical"]
    rows = []
    for P in Ps:
        new = Worker(a.tree.resolve(), P, a.timeout)
        old = Worker(a.baseline.resolve(), P, a.timeout) if a.baseline else None
        try:
            for name, coll in pairs:
                b = old.time(name, coll) if old else None
                r = new.time(name, coll)
                row = [P, name, coll, r["k"], r["sim_s"], round(r["wall_s"], 4), r["timed_out"]]
                if b is None:
                    row += [None, None, None, None]
                else:
                    ratio = b["wall_s"] / r["wall_s"] if r["wall_s"] > 0 else None
                    same = None if (b["sim_s"] is None or r["sim_s"] is None) else b["sim_s"] == r["sim_s"]
                    row += [round(b["wall_s"], 4), b["timed_out"], None if ratio is None else round(ratio, 2), same]
                rows.append(row)
                print(" ".join("" if x is None else str(x) for x in row), flush=True)
        finally:
            new.close()
            if old:
                old.close()
    path = write_csv(a.out, header, rows)
    print(markdown_table(header, rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
