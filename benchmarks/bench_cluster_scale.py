"""Wall seconds per simulated iteration at P = 64 ... 65536: fast engine vs message-level engine (vs SimGrid).

For each collective and P, one timing-only iteration (``sim.engine.timing.simulate_timing``, zero compute, so the
simulated time is the communication alone), after a warm-up iteration of the same collective on 64 ranks (16 nodes
on a cluster preset: rings long enough for the compiled loop; it loads the fast engine's numba kernels, about half a
second per process), is run in a fresh subprocess, once on the fast engine
(:mod:`sim.engine.fastsim`) and, where it finishes within ``--message-budget`` seconds (estimated from the previous
P with the growth of the message count), on the message-level SimPy engine. Per case: wall seconds, the
simulated seconds of both engines and their relative difference, the speed-up, the peak resident memory of
the subprocess (MB, ``ru_maxrss``; a bare interpreter with numpy and the project imported is about 90 MB)
and, per collective and engine, the growth exponent b of a least-squares fit wall ~ a P^b over the P
where wall > 5 ms.

Collectives: dense ring, Top-k (Bruck), gTop-k tree and recursive doubling on the 1GbE preset (flat star,
alpha = 0.436 ms, beta = 9 ns/byte), and dense hierarchical and hierarchical gTop-k on the DGX-H100-class
preset (8 GPUs per node); d = 25,000,000, k = 25,000 (density 0.001), the ResNet-50-scale setting of the gTop-k papers.
With ``--simgrid CSV`` (the output of ``benchmarks/bench_simgrid.py``, which needs SimGrid built outside the
project) SimGrid's wall time on the same star platform is shown beside ours for ring, Bruck and tree.

This is a benchmark, not a test: nothing asserts on time. Example (about 10 minutes):
    .venv/bin/python benchmarks/bench_cluster_scale.py --csv benchmarks/results/cluster_scale.csv \\
        --simgrid benchmarks/results/simgrid.csv
"""
from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import csv
import json
import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import environment_line, markdown_table, write_csv  # noqa: E402

D, K = 25_000_000, 25_000
#: name -> (algorithm, collective, network: "1GbE" or "dgx-h100", SimGrid's name for it or None)
CASES = {
    "dense ring": ("dense", "ring", "1GbE", "ring"),
    "dense hierarchical": ("dense", "hierarchical", "dgx-h100", None),
    "Top-k (Bruck)": ("topk", "allgather", "1GbE", "bruck"),
    "gTop-k tree": ("gtopk", "tree", "1GbE", "tree"),
    "gTop-k recursive doubling": ("gtopk", "recursive_doubling", "1GbE", None),
    "hierarchical gTop-k": ("gtopk", "hierarchical", "dgx-h100", None),
}
COLUMNS = ["collective", "P", "engine", "wall_s", "sim_s", "fast_sim_s", "rel_diff", "speedup", "peak_rss_mb",
           "messages", "simgrid_wall_s", "status"]


def one_case(name: str, P: int, engine: str) -> dict:
    """Run one case in this process; return wall and simulated seconds, messages and peak RSS."""
    import resource
    import time

    from sim.algorithms import AlgorithmSpec
    from sim.machine.network import get_preset
    from sim.engine.timing import simulate_timing
    from sim.machine.topology import get_cluster_preset

    alg, coll, net_name, _ = CASES[name]
    net = get_preset(net_name) if net_name == "1GbE" else get_cluster_preset(net_name, P)
    G = 1 if net_name == "1GbE" else net.gpus_per_node
    spec = AlgorithmSpec(alg, k=None if alg == "dense" else K, collective=coll, gpus_per_node=G)
    # warm-up on 64 ranks (16 nodes of a cluster: rings of 30 rounds, compiled): numba loads the fast engine's
    # kernels once per process (about half a second from its cache), a cost of the process, not of the iteration
    warm = 16 * G if net_name != "1GbE" else 64
    simulate_timing(spec, warm, D, network=net if net_name == "1GbE" else get_cluster_preset(net_name, warm),
                    engine=engine)
    t0 = time.perf_counter()
    res = simulate_timing(spec, P, D, network=net, engine=engine)
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return {"wall_s": wall, "sim_s": float(res.iter_s[0]), "messages": res.messages, "peak_rss_mb": rss}


def run_sub(name: str, P: int, engine: str, timeout: float) -> dict:
    """:func:`one_case` in a fresh interpreter (its own peak memory), or a status when it failed or timed out."""
    cmd = [sys.executable, __file__, "--_case", json.dumps([name, P, engine])]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout > {timeout:.0f} s"}
    if out.returncode != 0:
        return {"status": "failed: " + (out.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "status": "ok"}


def growth_exponent(Ps, walls) -> float:
    """b of a least-squares fit log wall = log a + b log P over the points with wall > 5 ms (nan if < 2)."""
    pts = [(math.log(p), math.log(w)) for p, w in zip(Ps, walls) if w and w > 5e-3]
    if len(pts) < 2:
        return math.nan
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else math.nan


def load_simgrid(path: str | None) -> dict:
    """{(simgrid collective, P): wall s} from bench_simgrid.py's CSV ({} without one)."""
    if not path:
        return {}
    with open(path, newline="") as fh:
        return {(r["collective"], int(r["P"])): float(r["simgrid_wall_s"]) for r in csv.DictReader(fh)
                if r.get("status", "ok") == "ok"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--P", default="64,256,1024,4096,16384,65536", help="comma-separated P")
    ap.add_argument("--collectives", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    ap.add_argument("--message-budget", type=float, default=150.0,
                    help="skip the message-level engine where its estimated wall time exceeds this (s)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per case before it is abandoned")
    ap.add_argument("--ring-max-P", type=int, default=16384,
                    help="largest P for the dense ring (2P(P-1) messages, O(P^2) work even when vectorised)")
    ap.add_argument("--csv", default=None, help="write the rows here (written whole, then renamed)")
    ap.add_argument("--simgrid", default=None, help="bench_simgrid.py's CSV, for SimGrid's wall times")
    ap.add_argument("--_case", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._case:
        name, P, engine = json.loads(a._case)
        print(json.dumps(one_case(name, P, engine)))
        return 0
    try:
        Ps = [int(x) for x in a.P.split(",")]
        if any(p < 1 or p > 65536 for p in Ps):
            raise ValueError
    except ValueError:
        print(f"error: --P {a.P!r}: valid comma-separated integers 1 <= P <= 65536", file=sys.stderr)
        return 2
    names = [c.strip() for c in a.collectives.split(",") if c.strip()]
    bad = [c for c in names if c not in CASES]
    if bad or not names:
        print(f"error: --collectives {bad or a.collectives!r}: valid {', '.join(CASES)}", file=sys.stderr)
        return 2
    if a.message_budget <= 0 or a.timeout <= 0:
        print("error: --message-budget and --timeout: valid > 0 seconds", file=sys.stderr)
        return 2
    try:
        simgrid = load_simgrid(a.simgrid)
    except (OSError, KeyError, ValueError) as err:
        print(f"error: --simgrid {a.simgrid!r} cannot be read as bench_simgrid.py's CSV: {err}", file=sys.stderr)
        return 2
    print(environment_line())
    rows = []
    fits = []
    for name in names:
        sg_name = CASES[name][3]
        if CASES[name][2] == "dgx-h100":
            Pn = [p for p in Ps if p % 8 == 0]
        else:
            Pn = [p for p in Ps if CASES[name][1] != "ring" or p <= a.ring_max_P]
        walls = {"fast": [], "message": []}
        prev = None  # (P, wall, messages) of the message-level engine's last run
        for P in Pn:
            fast = run_sub(name, P, "fast", a.timeout)
            msg = {"status": "skipped (over --message-budget)"}
            if fast["status"] == "ok":
                est = 0.0 if prev is None else prev[1] * fast["messages"] / max(prev[2], 1)
                if est <= a.message_budget:
                    msg = run_sub(name, P, "message", a.timeout)
                    if msg["status"] == "ok":
                        prev = (P, msg["wall_s"], msg["messages"])
            sgw = simgrid.get((sg_name, P)) if sg_name else None
            for eng, r in (("fast", fast), ("message", msg)):
                ok = r["status"] == "ok"
                rel = (r["sim_s"] / fast["sim_s"] - 1) if ok and fast["status"] == "ok" and eng == "message" else None
                spd = (msg["wall_s"] / fast["wall_s"]) if eng == "fast" and ok and msg["status"] == "ok" else None
                rows.append([name, P, eng, r.get("wall_s"), r.get("sim_s"), fast.get("sim_s"), rel, spd,
                             r.get("peak_rss_mb"), r.get("messages"), sgw if eng == "fast" else None, r["status"]])
                walls[eng].append(r.get("wall_s") if ok else None)
            print(f"{name:<28} P = {P:>6}: fast {fast.get('wall_s', float('nan')):9.4f} s"
                  f"  message {msg.get('wall_s', float('nan')):9.3f} s  ({msg['status']})", flush=True)
        for eng in ("fast", "message"):
            fits.append([name, eng, growth_exponent(Pn, walls[eng])])
    if a.csv:
        write_csv(a.csv, COLUMNS, rows)
    print()
    print(markdown_table(COLUMNS, rows))
    print()
    print(markdown_table(["collective", "engine", "growth exponent b (wall ~ P^b)"], fits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
