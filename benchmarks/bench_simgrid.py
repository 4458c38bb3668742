"""Cross-check of the closed forms in :mod:`sim.comm.costs` against SimGrid, an established simulator.

For each collective in --collectives and each P in --P, run the collective in SimGrid on a star
platform of P hosts and compare SimGrid's simulated time with our closed form:

- ``ring``: ring allreduce of d float32 values, 2(P-1) steps; in each step every rank sends a chunk of
  ceil(d/P)*4 bytes to rank+1 and receives one from rank-1 with sendrecv semantics (put_async +
  get_async; a rank starts step s+1 once both its send and its receive of step s are done).
  Closed form: ``ring_allreduce_time(P, d, alpha, beta)``.
- ``bruck``: Bruck allgather of one m = k*8-byte block per rank (Top-k: k values + k indices), ceil(lg P)
  rounds; in round i (dist = 2^i) each rank sends min(dist, P-dist)*m bytes to rank-dist mod P and
  receives from rank+dist mod P (sendrecv). Closed form: ``bruck_allgather_time(P, k*8, alpha, beta)``.
- ``tree``: gTop-k binomial-tree reduce then broadcast. Reduce: for mask = 1, 2, 4, ...: a rank with bit
  ``mask`` set sends k*8 bytes to rank-mask and stops; otherwise it receives from rank+mask if < P.
  Broadcast in reverse: each parent sends k*8 + ceil(k/8) bytes (result + survival bitmask) to each of
  its children, in reverse order of how they were received (blocking sends).
  Closed form: ``gtopk_tree_time(P, k, alpha, beta)``.

Platform (the same link model as ours): ``--cfg=network/model:raw`` (time = latency
+ size/bandwidth, fair sharing, no TCP gamma, no cross traffic, latency and bandwidth factors 1), a star
zone where each host has a private split-duplex link of latency alpha/2 and bandwidth 1/beta. A message
crosses the sender's UP link and the receiver's DOWN link at once (SimGrid's flow model), so alone it
costs alpha + bytes*beta, as in our network. Defaults: the 1GbE preset (alpha = 0.436e-3 s,
beta = 9e-9 s/byte), d = 25,000,000, k = 25,000.

A SimGrid Engine can be created only once per process, so every (collective, P) case runs in a
subprocess of this script (``--_case`` is that internal entry point); --timeout bounds each case.
Reported per case: SimGrid simulated time, the closed form, their relative difference
(simgrid - closed) / closed, and SimGrid's wall time (platform construction + Engine.run, measured in the
subprocess). --csv writes the table (to PATH.tmp, then renamed). Bad input: one line ``error: ...``, exit 2;
exit 1 if any case failed or timed out (its row then has an empty simulated time and a status).

SimGrid is NOT a dependency of this project (not in pyproject.toml, not in CI). Build its Python
bindings outside the repository, e.g. in /work/simgrid-venv (no wheel exists; ~15 minutes):

    apt-get update && apt-get install -y libboost-dev cmake g++
    python3 -m venv /work/simgrid-venv
    /work/simgrid-venv/bin/pip install 'pybind11==2.13.6' wheel numpy
    mkdir -p /work/simgrid-src && cd /work/simgrid-src
    /work/simgrid-venv/bin/pip download --no-deps --no-binary :all: simgrid -d .
    tar xzf simgrid-*.tar.gz && cd simgrid-4.1
    /work/simgrid-venv/bin/pip install --no-build-isolation .
    /work/simgrid-venv/bin/pip install --no-deps -e /work/main
    /work/simgrid-venv/bin/pip install numpy scipy simpy click pydantic tqdm threadpoolctl sympy \
        scikit-learn matplotlib

The installed module has no RPATH to its library, so this script loads ``libsimgrid.so.4.1`` (searched
under sys.prefix, or the path in $SIMGRID_LIB) with ctypes.CDLL(..., RTLD_GLOBAL) before ``import simgrid``.

This is a benchmark, not a test: nothing asserts on time.

Example:
    /work/simgrid-venv/bin/python benchmarks/bench_simgrid.py --P 16,64 --collectives ring,tree
    /work/simgrid-venv/bin/python benchmarks/bench_simgrid.py --csv benchmarks/results/simgrid.csv
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ALPHA_1GBE = 0.436e-3
BETA_1GBE = 9e-9
COLLECTIVES = ("ring", "bruck", "tree")
CASE_MARKER = "SIMGRID_CASE_RESULT "
HEADER = ["collective", "P", "simgrid_time_s", "closed_form_s", "rel_diff", "simgrid_wall_s", "messages",
          "d", "k", "alpha_s", "beta_s_per_byte", "network_model", "status"]


class InputError(ValueError):
    """A bad command-line value (reported as one ``error: ...`` line, exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise InputError(message)


# --------------------------------------------------------------------------------------------- SimGrid side

def load_simgrid():
    """Preload libsimgrid (no RPATH in the extension module) and return the imported ``simgrid`` module."""
    import ctypes

    cands = [os.environ["SIMGRID_LIB"]] if os.environ.get("SIMGRID_LIB") else []
    for root in dict.fromkeys([sys.prefix, sys.base_prefix]):
        cands += sorted(glob.glob(os.path.join(root, "lib*", "**", "libsimgrid.so.4*"), recursive=True))
        cands += sorted(glob.glob(os.path.join(root, "lib*", "libsimgrid.so.4*")))
    for c in cands:
        if os.path.isfile(c):
            ctypes.CDLL(c, mode=ctypes.RTLD_GLOBAL)
            break
    import simgrid  # noqa: PLC0415
    return simgrid


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def run_case(collective: str, P: int, d: int, k: int, alpha: float, beta: float, model: str) -> dict:
    """Build the star platform, run one collective in a fresh SimGrid Engine; return its results."""
    sg = load_simgrid()
    t0 = time.perf_counter()
    cfgs = [f"network/model:{model}"]
    if model != "raw":  # CM02: turn every correction off by hand ("raw" has them off by default)
        cfgs += ["network/TCP-gamma:0", "network/crosstraffic:0", "network/latency-factor:1",
                 "network/bandwidth-factor:1", "network/weight-S:0"]
    e = sg.Engine(["bench_simgrid"] + [f"--cfg={c}" for c in cfgs] + ["--log=root.thresh:warning"])
    zone = e.netzone_root.add_netzone_star("star")
    hosts = []
    for r in range(P):
        h = zone.add_host(f"h{r}", 1e9).seal()
        link = zone.add_split_duplex_link(f"l{r}", 1.0 / beta)
        link.set_latency(alpha / 2).seal()
        zone.add_route(h, None, [sg.LinkInRoute(link, sg.LinkInRoute.Direction.UP)], True)
        hosts.append(h)
    zone.seal()

    mbox = sg.Mailbox.by_name
    finish = [0.0] * P
    msgs = [0]

    def ring(rank):
        chunk = _ceil_div(d, P) * 4
        out, inbox = mbox(f"r{(rank + 1) % P}"), mbox(f"r{rank}")  # one sender per mailbox: FIFO per step
        for _ in range(2 * (P - 1)):
            s = out.put_async(None, chunk)
            g = inbox.get_async()
            s.wait()
            g.wait()
        msgs[0] += 2 * (P - 1)
        finish[rank] = sg.Engine.clock

    def bruck(rank):
        m = k * 8
        dist, rnd = 1, 0
        while dist < P:
            s = mbox(f"b{(rank - dist) % P}_{rnd}").put_async(None, min(dist, P - dist) * m)
            g = mbox(f"b{rank}_{rnd}").get_async()
            s.wait()
            g.wait()
            msgs[0] += 1
            dist, rnd = dist << 1, rnd + 1
        finish[rank] = sg.Engine.clock

    def tree(rank):
        ks, b = k * 8, _ceil_div(k, 8)
        children, parent, mask = [], None, 1
        while mask < P:
            if rank & mask:
                parent = rank - mask
                mbox(f"u{parent}_{rank}").put(None, ks)  # reduce: my running top-k to the parent
                msgs[0] += 1
                break
            if rank + mask < P:
                mbox(f"u{rank}_{rank + mask}").get()
                children.append(rank + mask)
            mask <<= 1
        if parent is not None:
            mbox(f"d{rank}").get()  # broadcast: result + survival bitmask from the parent
        for c in reversed(children):
            mbox(f"d{c}").put(None, ks + b)
            msgs[0] += 1
        finish[rank] = sg.Engine.clock

    body = {"ring": ring, "bruck": bruck, "tree": tree}[collective]
    for r, h in enumerate(hosts):
        h.add_actor(f"rank{r}", body, r)
    e.run()
    wall = time.perf_counter() - t0
    return {"simgrid_time_s": max(finish) if P > 1 else 0.0, "engine_clock_s": sg.Engine.clock,
            "simgrid_wall_s": wall, "messages": msgs[0], "simgrid_version": getattr(sg, "__version__", "")}


# --------------------------------------------------------------------------------------------- driver side

def closed_form(collective: str, P: int, d: int, k: int, alpha: float, beta: float) -> float:
    try:
        import sim.comm.costs  # noqa: F401, PLC0415
    except ImportError:  # not installed in this interpreter: use the checkout this script lives in
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from sim.comm.costs import bruck_allgather_time, gtopk_tree_time, ring_allreduce_time  # noqa: PLC0415

    if collective == "ring":
        return ring_allreduce_time(P, d, alpha, beta)
    if collective == "bruck":
        return bruck_allgather_time(P, k * 8, alpha, beta)
    return gtopk_tree_time(P, k, alpha, beta)


def rel_diff(x: float, ref: float) -> float:
    if ref == 0:
        return 0.0 if x == 0 else math.inf
    return (x - ref) / ref


def _int_list(text: str, what: str) -> list[int]:
    out = []
    for tok in text.split(","):
        tok = tok.strip()
        if not tok:
            continue
        try:
            v = int(tok)
        except ValueError:
            raise InputError(f"{what}: {tok!r} is not an integer") from None
        if v < 1:
            raise InputError(f"{what}: {v} must be >= 1")
        out.append(v)
    if not out:
        raise InputError(f"{what}: empty list")
    return out


def parse_args(argv=None):
    """The command-line options (see --help); raises InputError on bad input."""
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--P", default="16,64,256,1024", help="comma list of host counts (default 16,64,256,1024)")
    p.add_argument("--collectives", default=",".join(COLLECTIVES), help="comma list from ring,bruck,tree")
    p.add_argument("--d", type=int, default=25_000_000, help="dense values for ring (default 25,000,000)")
    p.add_argument("--k", type=int, default=25_000, help="sparse entries for bruck/tree (default 25,000)")
    p.add_argument("--alpha", type=float, default=ALPHA_1GBE, help="latency per message, s (default 0.436e-3)")
    p.add_argument("--beta", type=float, default=BETA_1GBE, help="s per byte (default 9e-9)")
    p.add_argument("--model", default="raw", choices=("raw", "CM02"),
                   help="SimGrid network model (CM02 is run with gamma, cross traffic and factors off)")
    p.add_argument("--timeout", type=float, default=900.0, help="wall seconds per case (default 900)")
    p.add_argument("--csv", default=None, help="write the table to this CSV path")
    p.add_argument("--_case", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.Ps = _int_list(a.P, "--P")
    a.colls = [c.strip() for c in a.collectives.split(",") if c.strip()]
    if not a.colls:
        raise InputError("--collectives: empty list")
    for c in a.colls:
        if c not in COLLECTIVES:
            raise InputError(f"--collectives: unknown {c!r}; valid: {', '.join(COLLECTIVES)}")
    for name in ("d", "k"):
        if getattr(a, name) < 1:
            raise InputError(f"--{name} = {getattr(a, name)} must be >= 1")
    for name in ("alpha", "beta", "timeout"):
        v = getattr(a, name)
        if not (math.isfinite(v) and v > 0):
            raise InputError(f"--{name} = {v} must be a positive finite number")
    return a


def run_subprocess(collective: str, P: int, a) -> dict:
    """Run one case in a fresh interpreter; return its result dict (with 'status')."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_case", f"{collective}:{P}", "--d", str(a.d),
           "--k", str(a.k), "--alpha", repr(a.alpha), "--beta", repr(a.beta), "--model", a.model]
    t0 = time.perf_counter()
    try:
        cp = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {a.timeout:g} s"}
    for line in reversed(cp.stdout.splitlines()):
        if line.startswith(CASE_MARKER):
            res = json.loads(line[len(CASE_MARKER):])
            res["status"] = "ok"
            res["process_wall_s"] = time.perf_counter() - t0
            return res
    tail = (cp.stderr.strip().splitlines() or ["no output"])[-1]
    return {"status": f"failed (rc {cp.returncode}): {tail[:200]}"}


def main(argv=None) -> int:
    try:
        a = parse_args(argv)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    if a._case:  # internal: one case in this (fresh) process
        collective, P = a._case.split(":")
        res = run_case(collective, int(P), a.d, a.k, a.alpha, a.beta, a.model)
        print(CASE_MARKER + json.dumps(res), flush=True)
        return 0

    try:  # fail early and clearly when the bindings are not usable here
        chk = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                              "import bench_simgrid as b; b.load_simgrid()", str(Path(__file__).parent)],
                             capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        chk = None
    if chk is None or chk.returncode != 0:
        why = "timed out" if chk is None else (chk.stderr.strip().splitlines() or ["?"])[-1]
        print(f"error: SimGrid's Python bindings are not importable with {sys.executable} ({why}); "
              "see this script's docstring for how to build them", file=sys.stderr)
        return 2

    print(f"# SimGrid vs closed forms (network/model:{a.model}, star, link latency alpha/2, bandwidth 1/beta)\n")
    print(f"alpha = {a.alpha:g} s, beta = {a.beta:g} s/B, d = {a.d}, k = {a.k}, P = {a.Ps}, "
          f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs\n")
    print("| collective | P | SimGrid (s) | closed form (s) | rel. diff | SimGrid wall (s) | status |")
    print("|---|---|---|---|---|---|---|", flush=True)
    rows, bad = [], 0
    for coll in a.colls:
        for P in a.Ps:
            cf = closed_form(coll, P, a.d, a.k, a.alpha, a.beta)
            res = run_subprocess(coll, P, a)
            ok = res["status"] == "ok"
            bad += not ok
            t = res.get("simgrid_time_s")
            rd = rel_diff(t, cf) if ok else None
            wall = res.get("simgrid_wall_s")
            rows.append([coll, P, repr(t) if ok else "", repr(cf), repr(rd) if ok else "",
                         f"{wall:.3f}" if ok else "", res.get("messages", ""), a.d, a.k, a.alpha, a.beta, a.model,
                         res["status"]])
            if ok:
                print(f"| {coll} | {P} | {t:.10g} | {cf:.10g} | {rd:.2e} | {wall:.2f} | ok |", flush=True)
            else:
                print(f"| {coll} | {P} |  | {cf:.10g} |  |  | {res['status']} |", flush=True)
    if a.csv:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _common import write_csv  # written whole, then renamed

        write_csv(a.csv, HEADER, rows)
        print(f"\nwrote {a.csv}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
