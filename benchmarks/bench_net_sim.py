"""Cost of simulating S-SGD on a torch network (sim.workloads.nets): seconds per simulated iteration against one plain
forward + backward of the global batch, one Fashion-MNIST epoch, and the run's memory against its estimate.

(a) Per iteration. For each network (--nets, default mlp-1024, lenet5, resnet20) and P (--P, default 4, 16, 64)
the script builds what ``sparsim run`` builds for the shipped scenario
experiments/scenarios/fmnist-resnet20-gtopk-icdcs.toml with ``model.name``, ``cluster.P``,
``training.batch_size`` (--b, default 32) and ``training.dtype`` (--dtype, default float32) set
(``experiments.run.build``: the Fashion-MNIST images, the NetObjective, the workers' shards, momentum 0.9, the
layer-wise timeline clock), and times, interleaved in each of --repeats rounds (default 3; medians reported):

- floor: one plain ``loss.backward()`` of a copy of the network on the global batch (the P x b images of
  iteration 1, already normalised) in this process -- what one real worker with P x b images would compute;
- grads: ``NetObjective.batch_grads`` of the P workers at x_0, per gradient mode (--modes, default vmap, loop);
- step: a full simulated S-SGD iteration, per mode and algorithm (--algorithms, default dense, gtopk; density
  --density, default 0.001): ``sim.engine.runner.run_algorithm`` on the lock-step driver with the scenario's timeline
  clock for 1 + --iterations iterations (default 1 + 1), evaluated only at the first and last (eval_every = T),
  timed from the metrics row of iteration 0 to that of iteration T - 1 (on_row), so it holds the P gradients, the
  P workers' programs (selection, collective, error feedback, momentum) and the metrics row, and no evaluation.

Reported: wall and process-CPU seconds, and step / floor and grads / floor ratios (the goal: step <= 1.25 x floor at
P = 16). The machine this project is measured on has 2 cores shared with other work, so wall time is noisy;
the CPU ratios are the steadier ones. torch runs at one intra-op thread (--threads; NetObjective always computes
at one, sim/workloads/nets.py) and BLAS at one thread (as ``sparsim run``); glibc malloc keeps freed memory (_common).

(b) One epoch: 60000 / (P x b) iterations at P = --epoch-P (default 16), extrapolated from (a)'s median seconds
per step of each network and algorithm in the mode ``model.gradients = "auto"`` picks (said so in the table), or,
with --full-epoch, measured: one run_algorithm call of floor(60000 / (P b)) iterations per network and algorithm.

(c) Memory (measured first, while this process is small): for each NET:P of --memory (default mlp-3000:64) a child
process runs ``sparsim run`` on the same scenario with that network and P, --dtype, 2 iterations of each algorithm,
and the script reports the child's peak resident set size (VmHWM of /proc/self/status at its exit; ``ru_maxrss``
would start from this process's resident set at the fork) against the estimate the run's own resource check
holds against the free memory (``experiments.resources.estimate_memory`` with
``experiments.run_net.net_data_bytes``): measured / estimate. A configuration whose estimate exceeds this machine's
available memory is refused by that check: the row says so (nothing is run).

(d) Threads (--loop-threads, default 1,2): in the same rounds as (a), the loop's P gradients and the floor with
torch at each thread count (NetObjective runs each operator at one thread and the loop's workers on that many
Python threads; the floor's operators use that many OpenMP threads).

--profile NET:P:MODE:ALGO (repeatable) prints a cProfile of one such step (self time grouped: torch's C
operators, sim/*.py, numpy, ...). --json PATH writes every measurement. Output: Markdown tables on stdout.

This is a benchmark, not a test: nothing asserts on time.

Examples:
    .venv/bin/python benchmarks/bench_net_sim.py                                   # everything (long)
    .venv/bin/python benchmarks/bench_net_sim.py --nets mlp-1024,resnet20 --P 4,16 --memory mlp-3000:8
    .venv/bin/python benchmarks/bench_net_sim.py --nets resnet20 --P 16 --memory '' --profile resnet20:16:loop:gtopk
"""
from __future__ import annotations

import os

# single-threaded BLAS (set before numpy is imported; an explicit environment setting wins), as sparsim run
for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import cProfile
import io
import json
import math
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment_line, markdown_table, median, module_of, tune_malloc  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "experiments" / "scenarios" / "fmnist-resnet20-gtopk-icdcs.toml"
GOAL = 1.25
N_TRAIN = 60000


def parse_args(argv=None):
    """The command-line options (see --help); argv: list of strings, default sys.argv[1:]."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nets", default="mlp-1024,lenet5,resnet20", help="comma list of zoo networks")
    p.add_argument("--P", default="4,16,64", help="comma list of worker counts (multiples of 4: the scenario's "
                                                  "cluster has 4 GPUs per node)")
    p.add_argument("--b", type=int, default=32, help="per-worker batch size (default 32)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--algorithms", default="dense,gtopk", help="comma list (default dense,gtopk)")
    p.add_argument("--density", type=float, default=0.001, help="k / d of the sparse algorithms (default 0.001)")
    p.add_argument("--modes", default="vmap,loop", help="gradient modes to time (default vmap,loop)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians reported (default 3)")
    p.add_argument("--iterations", type=int, default=1, help="timed iterations per step measurement (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the floor (default 1, as "
                                                          "NetObjective)")
    p.add_argument("--loop-threads", default="1,2", help="torch thread counts at which the loop's gradients and "
                                                         "the floor are also timed, table (d) (default 1,2; '' = none)")
    p.add_argument("--epoch-P", type=int, default=16, help="P of the epoch table (default 16)")
    p.add_argument("--full-epoch", action="store_true", help="run the epoch instead of extrapolating it")
    p.add_argument("--memory", default="mlp-3000:64", help="comma list of NET:P for the memory table ('' = none)")
    p.add_argument("--profile", action="append", default=[], metavar="NET:P:MODE:ALGO",
                   help="cProfile one step of this configuration (repeatable)")
    p.add_argument("--data", default="", help="Fashion-MNIST folder (default: the scenario's default path)")
    p.add_argument("--json", default=None, help="write all measurements to this JSON file")
    return p.parse_args(argv)


def _csv(s, conv=str):
    return [conv(x.strip()) for x in s.split(",") if x.strip()]


def _overrides(args, net, P, extra=()):
    sets = [f"model.name='{net}'", f"cluster.P={P}", f"training.batch_size={args.b}",
            f"training.dtype='{args.dtype}'", f"compression.density={args.density}"]
    if args.data:
        sets.append(f"data.path='{args.data}'")
    return sets + list(extra)


def _build(args, net, P):
    """experiments.run.build of the scenario with this network and P; (built, algorithm specs by name)."""
    from experiments.run import build
    from experiments.scenario import load_scenario

    algos = _csv(args.algorithms)
    sc = load_scenario(str(SCENARIO), _overrides(args, net, P, [f"algorithms={json.dumps(algos)}"]))
    built = build(sc)
    return built, {s.name: s for s in built.specs}


class Config:
    """One (network, P): the built run, the floor's module and global batch, and its measurements."""

    def __init__(self, args, net, P):
        import numpy as np
        import torch

        from sim.workloads.nets import build_net

        self.args, self.net, self.P = args, net, P
        self.built, self.specs = _build(args, net, P)
        obj = self.built.objective
        self.obj = obj
        self.auto_mode = obj.gradients
        idxs = self.built.workers.batch_indices(1)
        self.idxs = idxs
        it = torch.as_tensor(np.array(idxs).ravel())
        self.X, self.y = obj._X[it].clone(), obj._y[it].clone()
        self.plain = build_net(net, seed=0, dtype=args.dtype).train()
        self.x0 = self.built.x0
        self.times: dict[str, list] = {}

    def _record(self, key, wall, cpu):
        self.times.setdefault(key, []).append((wall, cpu))

    def floor(self):
        import torch

        t, c = time.perf_counter(), time.process_time()
        self.plain.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(self.plain(self.X), self.y).backward()
        self._record("floor", time.perf_counter() - t, time.process_time() - c)

    def grads(self, mode):
        self.obj.gradients = mode
        t, c = time.perf_counter(), time.process_time()
        self.obj.batch_grads(self.x0, self.idxs)
        self._record(f"grads:{mode}", time.perf_counter() - t, time.process_time() - c)

    def run(self, mode, algo, T):
        """run_algorithm of T iterations; per-iteration (wall, cpu) from row 0's emission to row T-1's (or T's
        when T = 1: then the final evaluation is included)."""
        from sim.engine.runner import run_algorithm

        self.obj.gradients = mode
        marks = []
        b = self.built
        run_algorithm(self.specs[algo], b.workers, T=T, lr=b.lr, x0=b.x0, clock=b.clock, eval_every=T,
                      on_row=lambda row: marks.append((time.perf_counter(), time.process_time())))
        last = T - 1 if T > 1 else T
        (w0, c0), (w1, c1) = marks[0], marks[last]
        return (w1 - w0) / last, (c1 - c0) / last, len(marks) - 1

    def at_threads(self, t):
        """The loop's P gradients and the floor with torch at t intra-op threads (NetObjective runs the loop's
        workers on t Python threads, each operator at one thread; the floor's operators use t OpenMP threads)."""
        import torch

        torch.set_num_threads(t)
        try:
            self.obj.gradients = "loop"
            w, c = time.perf_counter(), time.process_time()
            self.obj.batch_grads(self.x0, self.idxs)
            self._record(f"loop@{t}", time.perf_counter() - w, time.process_time() - c)
            self.floor()
            self.times[f"floor@{t}"] = self.times.setdefault(f"floor@{t}", []) + [self.times["floor"].pop()]
        finally:
            torch.set_num_threads(self.args.threads)

    def step(self, mode, algo):
        w, c, _ = self.run(mode, algo, 1 + self.args.iterations)
        self._record(f"step:{mode}:{algo}", w, c)

    def medians(self, key):
        ts = self.times.get(key)
        if not ts:
            return math.nan, math.nan
        return median([t[0] for t in ts]), median([t[1] for t in ts])


def per_iteration(args, threads: list) -> list[dict]:
    """Part (a): the interleaved rounds of every (network, P); one result dict per (network, P, mode, algo); appends
    to ``threads`` the medians of the --loop-threads timings per (network, P)."""
    modes, algos = _csv(args.modes), _csv(args.algorithms)
    out = []
    for net in _csv(args.nets):
        for P in _csv(args.P, int):
            t_build = time.perf_counter()
            cfg = Config(args, net, P)
            build_s = time.perf_counter() - t_build
            for mode in modes:  # untimed warm-up: first calls (numba kernels, torch's allocator)
                for algo in algos:
                    cfg.run(mode, algo, 1)
            for _ in range(args.repeats):
                cfg.floor()
                for mode in modes:
                    cfg.grads(mode)
                    for algo in algos:
                        cfg.step(mode, algo)
                for t in _csv(args.loop_threads, int):
                    cfg.at_threads(t)
            fw, fc = cfg.medians("floor")
            threads.append({"net": net, "P": P, **{f"{k}_wall_s": cfg.medians(k)[0] for k in cfg.times
                                                   if "@" in k}, "vmap@1_wall_s": cfg.medians("grads:vmap")[0]})
            for mode in modes:
                gw, gc = cfg.medians(f"grads:{mode}")
                for algo in algos:
                    sw, sc = cfg.medians(f"step:{mode}:{algo}")
                    out.append({"net": net, "P": P, "b": args.b, "dtype": args.dtype, "mode": mode, "algorithm": algo,
                                "auto_mode": cfg.auto_mode, "d": cfg.obj.d, "k": cfg.specs[algo].k,
                                "floor_wall_s": fw, "floor_cpu_s": fc, "grads_wall_s": gw, "grads_cpu_s": gc,
                                "step_wall_s": sw, "step_cpu_s": sc, "step_over_floor_wall": sw / fw,
                                "step_over_floor_cpu": sc / fc, "grads_over_floor_cpu": gc / fc,
                                "repeats": args.repeats, "build_s": build_s,
                                "raw": {k: v for k, v in cfg.times.items()
                                        if k in ("floor", f"grads:{mode}", f"step:{mode}:{algo}")}})
            print(f"  {net} P={P}: floor {fw:.3f} s wall / {fc:.3f} s CPU; "
                  + "; ".join(f"{r['mode']} {r['algorithm']} {r['step_wall_s']:.3f} s ({r['step_over_floor_cpu']:.2f}x "
                              "CPU)" for r in out if r["net"] == net and r["P"] == P),
                  file=sys.stderr, flush=True)
            del cfg
    return out


def epoch(args, results) -> list[dict]:
    """Part (b): one epoch at P = args.epoch_P per network and algorithm, in the mode auto picks."""
    P, b = args.epoch_P, args.b
    iters = N_TRAIN / (P * b)
    out = []
    for net in _csv(args.nets):
        for algo in _csv(args.algorithms):
            row = {"net": net, "algorithm": algo, "P": P, "iterations": iters}
            if args.full_epoch:
                cfg = Config(args, net, P)
                T = int(iters)
                t0 = time.perf_counter()
                w, c, n = cfg.run(cfg.auto_mode, algo, T + 1)  # T timed iterations (+ the final evaluation's)
                row.update(mode=cfg.auto_mode, how=f"measured ({T} iterations, scaled to {iters:.1f})",
                           epoch_wall_s=w * iters, epoch_cpu_s=c * iters, total_wall_s=time.perf_counter() - t0)
                for _ in range(args.repeats):
                    cfg.floor()
                fw, fc = cfg.medians("floor")
                del cfg
            else:
                rs = [r for r in results if r["net"] == net and r["P"] == P and r["algorithm"] == algo]
                r = next((r for r in rs if r["mode"] == r["auto_mode"]), None)
                if r is None:
                    row.update(how=f"not measured (no P = {P} run of the auto mode in part (a))")
                    out.append(row)
                    continue
                row.update(mode=r["mode"], how="extrapolated from (a)", epoch_wall_s=r["step_wall_s"] * iters,
                           epoch_cpu_s=r["step_cpu_s"] * iters)
                fw, fc = r["floor_wall_s"], r["floor_cpu_s"]
            row.update(floor_epoch_wall_s=fw * iters, floor_epoch_cpu_s=fc * iters)
            out.append(row)
    return out


#: ``python -c`` program of the memory child: ``sparsim run`` with the given arguments, then (at exit) the process's
#: peak resident set ``VmHWM`` of /proc/self/status on stderr. VmHWM belongs to the process's own address space
#: since its exec; ``ru_maxrss`` (os.wait4) would start from the benchmark's resident set at the fork.
_PEAK_WRAPPER = """
import atexit, sys
def _peak():
    with open('/proc/self/status') as fh:
        for line in fh:
            if line.startswith('VmHWM:'):
                sys.stderr.write('VMHWM_KB ' + line.split()[1] + chr(10))
atexit.register(_peak)
from experiments.cli import main
sys.argv[0] = 'sparsim'
main()
"""


def memory(args) -> list[dict]:
    """Part (c): peak RSS of `sparsim run` (a child process) against the run's own memory estimate."""
    from experiments.resources import available_memory_bytes, estimate_memory
    from experiments.run_net import net_data_bytes
    from experiments.scenario import load_scenario
    from sim.workloads.idx import load_image_dataset
    from sim.workloads.nets import NET_PARAMS

    out = []
    for item in _csv(args.memory):
        net, P = item.split(":")
        P = int(P)
        sets = _overrides(args, net, P, ["training.iterations=2", "training.eval_every=2"])
        sc = load_scenario(str(SCENARIO), sets)
        ds = load_image_dataset(sc.data.dataset, sc.data.path)
        d = NET_PARAMS[net]
        est, how = estimate_memory(sc, d, net_data_bytes(ds, sc))
        avail = available_memory_bytes()
        row = {"net": net, "P": P, "d": d, "dtype": args.dtype, "estimate_bytes": est, "estimate_how": how,
               "available_bytes": avail, "algorithms": args.algorithms}
        if avail is not None and est > avail:
            row["status"] = "refused by the run's memory check (estimate > available)"
            out.append(row)
            print(f"  memory {net} P={P}: estimate {est / 2**30:.1f} GiB > available {avail / 2**30:.1f} GiB: "
                  "not run", file=sys.stderr, flush=True)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-c", _PEAK_WRAPPER, "run", str(SCENARIO), "--out", str(Path(tmp) / "run"),
                   "--quiet", "--algorithms", args.algorithms]
            for s in sets:
                cmd += ["--set", s]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        peak = next((int(ln.split()[1]) * 1024 for ln in proc.stderr.splitlines() if ln.startswith("VMHWM_KB ")), None)
        err = "\n".join(ln for ln in proc.stderr.splitlines() if not ln.startswith("VMHWM_KB "))
        row.update(status="ran" if proc.returncode == 0 else f"exit {proc.returncode}: {err.strip()[-300:]}",
                   peak_rss_bytes=peak, wall_s=time.perf_counter() - t0)
        if peak is None:
            row["status"] += " (no peak reported)"
            out.append(row)
            continue
        row["measured_over_estimate"] = peak / est
        print(f"  memory {net} P={P}: peak RSS {peak / 2**30:.2f} GiB, estimate "
              f"{est / 2**30:.2f} GiB ({row['status']})", file=sys.stderr, flush=True)
        out.append(row)
    return out


def profile(args, spec: str) -> str:
    """cProfile of one step (1 + --iterations iterations of run_algorithm) of NET:P:MODE:ALGO; self time grouped."""
    net, P, mode, algo = spec.split(":")
    cfg = Config(args, net, int(P))
    cfg.run(mode, algo, 1)  # warm-up
    prof = cProfile.Profile()
    prof.enable()
    cfg.run(mode, algo, 1 + args.iterations)
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    groups: dict[str, float] = {}
    for (filename, _, _), (_, _, tt, _, _) in st.stats.items():
        groups[module_of(filename)] = groups.get(module_of(filename), 0.0) + tt
    total = sum(groups.values())
    s.write(f"total {total:.2f} s (includes the run's set-up and its evaluation at iterations 0 and T); self time: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(groups.items(), key=lambda kv: -kv[1])[:8]) + "\n")
    st.sort_stats("tottime").print_stats(18)
    return s.getvalue()


def _f(x, spec=".3f"):
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def main(argv=None):
    """Run the benchmark with the options of :func:`parse_args` and print its Markdown report."""
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    note = tune_malloc()
    print("# Simulating S-SGD on a network: cost per iteration, epoch, memory\n")
    print(f"b = {args.b} per worker, {args.dtype}, algorithms {args.algorithms} (density {args.density:g}), "
          f"{args.repeats} interleaved rounds (medians), torch {torch.__version__} at {torch.get_num_threads()} "
          f"intra-op thread(s); {note}  ")
    print(f"{environment_line()}\n", flush=True)
    report: dict = {"args": vars(args), "environment": environment_line()}

    # (c) first: the children's memory is then measured while this process is still small (the available memory
    # the run's check reads is this machine's, less what this benchmark holds)
    mem = memory(args) if args.memory else []
    threads: list = []
    results = per_iteration(args, threads) if args.nets and args.P else []
    report["per_iteration"] = results
    report["threads"] = threads
    if results:
        print("## (a) Seconds per simulated iteration against the floor (one plain forward + backward of P x b "
              "images)\n")
        rows = []
        for r in results:
            ok = r["step_over_floor_cpu"] <= GOAL
            rows.append([r["net"], r["P"], r["mode"] + (" (auto)" if r["mode"] == r["auto_mode"] else ""),
                         r["algorithm"], _f(r["floor_wall_s"]), _f(r["grads_wall_s"]), _f(r["step_wall_s"]),
                         _f(r["floor_cpu_s"]), _f(r["grads_cpu_s"]), _f(r["step_cpu_s"]),
                         _f(r["grads_over_floor_cpu"], ".2f"), _f(r["step_over_floor_cpu"], ".2f"),
                         _f(r["step_over_floor_wall"], ".2f"), "yes" if ok else "no"])
        print(markdown_table(["net", "P", "gradients", "algorithm", "floor wall s", "grads wall s", "step wall s",
                              "floor CPU s", "grads CPU s", "step CPU s", "grads/floor CPU", "step/floor CPU",
                              "step/floor wall", f"step <= {GOAL:g} floor (CPU)"], rows))
        print()

    tcs = _csv(args.loop_threads, int)
    if threads and tcs:
        print("## (d) The per-worker loop's P gradients and the floor at 1 and more torch threads (wall s)\n")
        rows = [[t["net"], t["P"], _f(t.get("vmap@1_wall_s")), *[_f(t.get(f"loop@{c}_wall_s")) for c in tcs],
                 *[_f(t.get(f"floor@{c}_wall_s")) for c in tcs],
                 _f(t.get(f"loop@{tcs[0]}_wall_s", math.nan) / t.get(f"loop@{tcs[-1]}_wall_s", math.nan), ".2f")]
                for t in threads]
        print(markdown_table(["net", "P", "vmap (1 thread)", *[f"loop, {c} thread(s)" for c in tcs],
                              *[f"floor, {c} thread(s)" for c in tcs], f"loop {tcs[0]} / {tcs[-1]}"], rows))
        print()

    if args.nets:
        ep = epoch(args, results)
        report["epoch"] = ep
        print(f"## (b) One Fashion-MNIST epoch at P = {args.epoch_P} ({N_TRAIN} / ({args.epoch_P} x {args.b}) = "
              f"{N_TRAIN / (args.epoch_P * args.b):.1f} iterations)\n")
        rows = [[e["net"], e["algorithm"], e.get("mode", ""), e["how"], _f(e.get("epoch_wall_s"), ".0f"),
                 _f(e.get("epoch_cpu_s"), ".0f"), _f(e.get("floor_epoch_wall_s"), ".0f"),
                 _f(e.get("floor_epoch_cpu_s"), ".0f")] for e in ep]
        print(markdown_table(["net", "algorithm", "gradients", "how", "epoch wall s", "epoch CPU s",
                              "floor epoch wall s", "floor epoch CPU s"], rows))
        print()

    report["memory"] = mem
    if mem:
        gib = 2.0 ** 30
        print("## (c) Peak resident set of `sparsim run` against the run's memory estimate\n")
        rows = [[m["net"], m["P"], m["dtype"], _f(m["estimate_bytes"] / gib, ".2f"),
                 _f(m["available_bytes"] / gib if m["available_bytes"] else None, ".1f"),
                 _f((m.get("peak_rss_bytes") or math.nan) / gib, ".2f"), _f(m.get("measured_over_estimate"), ".2f"),
                 m["status"]] for m in mem]
        print(markdown_table(["net", "P", "dtype", "estimate GiB", "available GiB", "peak RSS GiB",
                              "measured / estimate", "status"], rows))
        print("\nestimate: " + "; ".join(f"{m['net']} P={m['P']}: {m['estimate_how']}" for m in mem))
        print()

    for spec in args.profile:
        text = profile(args, spec)
        report.setdefault("profiles", {})[spec] = text
        print(f"## cProfile: {spec}\n\n```\n{text.rstrip()}\n```\n")

    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
