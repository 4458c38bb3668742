"""Seconds per iteration of DDP communication hooks on 2 gloo ranks over loopback (issue #14's table).

Per model, one :func:`sim.distributed.backend.launch_local` group of 2 processes (one thread each, as launch_local
sets it) builds one ``torch.nn.parallel.DistributedDataParallel`` per configuration (fresh seeded model,
DDP's default buckets: 25 MiB, 1 MiB first; SGD with momentum 0.9, cross-entropy) and runs their steps
interleaved -- step s of every configuration, then step s + 1 -- so that all of them see the same
background load: --warmup untimed steps, then --iters timed ones. A step is timed from ``zero_grad`` to the
end of ``optimizer.step``; a configuration's s/iteration is the median over its timed steps of the slower
rank. Configurations:

- ``no-comm``: a hook that returns the bucket unchanged (no communication at all): the compute floor;
- ``allreduce``: DDP without a hook (its own bucketed allreduce);
- ``fp16``: torch's ``fp16_compress_hook``;
- ``powersgd-r1`` / ``powersgd-r4``: torch's ``PowerSGDState(matrix_approximation_rank=r, start_powerSGD_iter=2)``
  + ``powerSGD_hook`` (error feedback and warm start on, torch's defaults), with ONE bucket: torch's PowerSGD
  hook launches collectives from the completion callbacks of several buckets at once, and on gloo these
  reached the two ranks in different orders here (gloo aborted with "Received data size doesn't match
  expected size", or the ranks hung) in every try with DDP's default buckets; --powersgd-default-buckets
  tries them anyway (the issue saw it crash in 10 of 16 launches);
- ``topk-<density>`` / ``gtopk-<density>``: this project's hook (:func:`sim.distributed.ddp_hooks.register_sparse_hook`,
  its defaults: asynchronous allgather, per-parameter selection) at densities 0.01 and 0.001;
  ``gtopk-0.01-model``: the same with whole-model selection after the last bucket.

Models: ``resnet18``: torchvision's ResNet-18 (BasicBlock, defined below in plain torch because torchvision is
not installed here) with 10 classes, 11,181,642 parameters, on random --image x --image inputs, --batch per
rank; ``mlp``: 64-1024-1024-10 ReLU MLP (1,126,410 parameters) on scikit-learn's digits, batch 64 per rank.

Also reported: the backward time (``loss.backward()``, which includes waiting for the futures) in wall and
in CPU seconds of the thread that runs it (on the CPU autograd runs on the calling thread), the hook's own
time per step -- on the autograd thread (accumulate, select, pack: ``SparseState.hook_cpu_s``) and in its
asynchronous completions (unpack, sum or gTop-k merges, residual update: ``callback_cpu_s``) -- in CPU
seconds (``time.thread_time``: the work itself, without the time other threads and processes held the core
or the GIL) and in wall seconds (``hook_s``, ``callback_s``), the CPU sum as a fraction of the compute floor's
backward CPU time (issue #14's "hook's own time under 5 % of backward"), and the machine's 1-minute load
average before and after each model (other processes share the cores: compare only numbers measured in the
same run). Nothing here asserts on time.

Beside the measurement: what the iteration timeline (:func:`sim.engine.timeline.simulate_timeline`) predicts on
1 GbE (preset ``1GbE``) for P = 2 with the per-layer compute measured here (:func:`sim.workloads.measure_torch`,
one process): dense DDP buckets (allreduce; fp16 as 2-byte values in the same buckets), and the sparse hooks
as what they send (an allgather of the selections per DDP bucket, ``sparse="bucket"``, or one after backward
for the model scope; the gTop-k hook's wire is an allgather too, its merges are local), PowerSGD as the simulator's
``powersgd`` algorithm on one buffer after backward (the single bucket it runs with here). Selections and
PowerSGD's products are costed by the compute model's default coefficients, not measured.

    python benchmarks/bench_ddp_hooks.py --iters 12      # both models, ~12 minutes on 2 shared cores
    python benchmarks/bench_ddp_hooks.py --models mlp --iters 3
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIGS = ["no-comm", "allreduce", "fp16", "powersgd-r1", "powersgd-r4", "topk-0.01", "topk-0.001", "gtopk-0.01",
           "gtopk-0.001", "gtopk-0.01-model"]
MODELS = ["resnet18", "mlp"]
CSV_COLUMNS = ["model", "d", "config", "status", "s_per_iter", "vs_allreduce_pct", "backward_s", "hook_s",
               "callback_s", "hook_own_frac_backward", "backward_cpu_s", "hook_cpu_s", "callback_cpu_s",
               "hook_own_cpu_frac_backward", "predicted_1gbe_s", "batch", "iters", "load_avg"]


# ------------------------------------------------------------------------------------------------ models


def resnet18(num_classes: int = 10):
    """torchvision's ``resnet18(num_classes=...)`` (BasicBlock, [2, 2, 2, 2]) in plain torch: 11,181,642
    parameters for 10 classes; input (B, 3, H, W) float."""
    import torch
    from torch import nn

    def conv3x3(cin, cout, stride=1):
        return nn.Conv2d(cin, cout, 3, stride, 1, bias=False)

    class BasicBlock(nn.Module):
        def __init__(self, cin, cout, stride=1, downsample=None):
            super().__init__()
            self.conv1, self.bn1 = conv3x3(cin, cout, stride), nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.conv2, self.bn2 = conv3x3(cout, cout), nn.BatchNorm2d(cout)
            self.downsample = downsample

        def forward(self, x):
            idt = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            return self.relu(self.bn2(self.conv2(out)) + idt)

    class ResNet18(nn.Module):
        def __init__(self):
            super().__init__()
            self.inplanes = 64
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1, self.relu, self.maxpool = nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
            self.layer1, self.layer2 = self._layer(64, 1), self._layer(128, 2)
            self.layer3, self.layer4 = self._layer(256, 2), self._layer(512, 2)
            self.avgpool, self.fc = nn.AdaptiveAvgPool2d((1, 1)), nn.Linear(512, num_classes)

        def _layer(self, planes, stride):
            down = None
            if stride != 1 or self.inplanes != planes:
                down = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
            blocks = [BasicBlock(self.inplanes, planes, stride, down), BasicBlock(planes, planes)]
            self.inplanes = planes
            return nn.Sequential(*blocks)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    return ResNet18()


def mlp_digits():
    """64-1024-1024-10 ReLU MLP, float32."""
    from torch import nn

    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def build(model: str, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    return resnet18() if model == "resnet18" else mlp_digits()


def batches(model: str, rank: int, batch: int, image: int, steps: int):
    """Per-step (x, y) of one rank: random images for ResNet-18, digits mini-batches for the MLP."""
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    if model == "resnet18":
        x, y = torch.randn(batch, 3, image, image, generator=g), torch.randint(0, 10, (batch,), generator=g)
        return [(x, y)] * steps
    from sim.workloads.data import load_dataset

    ds = load_dataset("digits")
    X, y = torch.as_tensor(ds.X, dtype=torch.float32), torch.as_tensor(ds.y)
    rng = np.random.default_rng(rank)
    return [(X[i], y[i]) for i in (torch.as_tensor(rng.choice(len(ds.y), 64, replace=False)) for _ in range(steps))]


# ------------------------------------------------------------------------------------------------ per rank


def _noop_hook(_, bucket):
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _setup(model_name: str, config: str, one_bucket: bool):
    """(ddp, optimizer, sparse state or None) of one configuration, on a fresh seeded model."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sim.distributed.ddp_hooks import register_sparse_hook

    model = build(model_name)
    size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20
    ddp = DDP(model, bucket_cap_mb=math.ceil(size_mb) + 1 if one_bucket else None)
    state = None
    if config == "no-comm":
        ddp.register_comm_hook(None, _noop_hook)
    elif config == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif config.startswith("powersgd-r"):
        ps = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=int(config[-1]),
                                         start_powerSGD_iter=2)
        ddp.register_comm_hook(ps, powerSGD_hook.powerSGD_hook)
    elif config != "allreduce":
        parts = config.split("-")
        state = register_sparse_hook(ddp, parts[0], density=float(parts[1]),
                                     scope="model" if parts[-1] == "model" else "parameter")
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9), state


def bench_job(ctx, model_name: str, configs: list, batch: int, image: int, warmup: int, iters: int,
              one_bucket: bool = False) -> list[dict]:
    """Per rank: every configuration on its own fresh model and DDP, their steps interleaved (step s of every
    configuration, then step s + 1, ...) so that all of them see the same background load; warmup + iters
    steps each. Returns per configuration this rank's step and backward times (s) and the sparse hook's own
    time per timed step. one_bucket: the PowerSGD configurations get a DDP with a single bucket (bucket_cap_mb just
above the model's size)."""
    import torch.nn.functional as F

    runs = [_setup(model_name, c, one_bucket and c.startswith("powersgd")) for c in configs]
    data = batches(model_name, ctx.rank, batch, image, warmup + iters)
    out = [{"step_s": [], "backward_s": [], "backward_cpu_s": [], "d": sum(p.numel() for p in ddp.module.parameters()),
            "hook0": (0.0, 0.0, 0.0, 0.0)} for ddp, _, _ in runs]
    for s, (x, y) in enumerate(data):
        for (ddp, opt, state), o in zip(runs, out):
            if s == warmup and state is not None:
                o["hook0"] = (state.hook_s, state.callback_s, state.hook_cpu_s, state.callback_cpu_s)
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            t1, c1 = time.perf_counter(), time.thread_time()
            loss.backward()  # on the CPU autograd runs on this thread: its CPU time is backward's own work
            t2, c2 = time.perf_counter(), time.thread_time()
            opt.step()
            t3 = time.perf_counter()
            if s >= warmup:
                o["step_s"].append(t3 - t0)
                o["backward_s"].append(t2 - t1)
                o["backward_cpu_s"].append(c2 - c1)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"loss is {loss.item()} at step {s + 1}")
    for (_, _, state), o in zip(runs, out):
        h0, c0, hc0, cc0 = o.pop("hook0")
        o["hook_s"] = (state.hook_s - h0) / iters if state is not None else math.nan
        o["callback_s"] = (state.callback_s - c0) / iters if state is not None else math.nan
        o["hook_cpu_s"] = (state.hook_cpu_s - hc0) / iters if state is not None else math.nan
        o["callback_cpu_s"] = (state.callback_cpu_s - cc0) / iters if state is not None else math.nan
    return out


# ------------------------------------------------------------------------------------------------ prediction


def predict_1gbe(model_name: str, batch: int, image: int, configs: list[str]) -> dict:
    """config -> predicted s/iteration on 1 GbE for P = 2 (iteration timeline, per-layer compute measured
    here in one process); {} with the reason printed when the simulator cannot say."""
    import torch

    from sim.algorithms import AlgorithmSpec
    from sim.machine.network import get_preset
    from sim.engine.timeline import TimelinePolicy, simulate_timeline
    from sim.workloads import measure_torch

    torch.set_num_threads(1)
    shape = (3, image, image) if model_name == "resnet18" else (64,)
    wl = measure_torch(build(model_name), shape, batch_size=batch, repeats=3, warmup=1, device="cpu")
    d = wl.d
    net = get_preset("1GbE")
    out = {}
    for cfg in configs:
        if cfg == "no-comm":
            spec, pol = AlgorithmSpec("dense"), TimelinePolicy(dense="none")
        elif cfg == "allreduce":
            spec, pol = AlgorithmSpec("dense", value_bytes=4), TimelinePolicy(dense="ddp")
        elif cfg == "fp16":
            # fp16_compress_hook: DDP's float32 buckets (25 MiB, first 1 MiB), sent as 2-byte values; the
            # timeline sizes buckets in wire bytes, so half the caps give the float32 buckets' elements
            spec = AlgorithmSpec("dense", value_bytes=2)
            pol = TimelinePolicy(dense="ddp", bucket_cap_mb=12.5, first_bucket_mb=0.5)
        elif cfg.startswith("powersgd"):
            # the simulator's PowerSGD (sim/algorithms/powersgd.py, torch's hook as a registered algorithm) on
            # one buffer after backward: the single bucket it is measured with here
            spec, pol = AlgorithmSpec("powersgd", options=(("rank", int(cfg[-1])),)), TimelinePolicy(dense="none")
        elif cfg.startswith(("topk", "gtopk")):
            dens = float(cfg.split("-")[1])
            # what the hook sends: an allgather of (value, index) per DDP bucket (gTop-k's merges are local)
            spec = AlgorithmSpec("topk", k=max(1, round(dens * d)), value_bytes=4, index_bytes=4)
            pol = TimelinePolicy(sparse="model" if cfg.endswith("model") else "bucket")
        else:
            continue
        try:
            res = simulate_timeline(spec, wl, 1 if cfg == "no-comm" else 2, network=net, policy=pol, batch_size=batch)
            out[cfg] = float(res.iter_s[0])
        except Exception as err:  # noqa: BLE001 - a prediction is a side column: say why and go on
            print(f"  prediction for {model_name} {cfg} failed: {type(err).__name__}: {err}", file=sys.stderr)
    return out


# ------------------------------------------------------------------------------------------------ driver


def _measure(m: str, configs: list, args: tuple, one: bool, kw: dict, log) -> dict:
    """config -> (per-rank results or None, error text): one launch for all ``configs``; if it fails, one
    launch per config."""
    from sim.distributed.backend import WorkerFailure, launch_local

    try:
        res = launch_local(2, bench_job, (m, configs, *args, one), **kw)
        return {c: ([r[i] for r in res], "") for i, c in enumerate(configs)}
    except WorkerFailure as e:
        log(f"  {m} {', '.join(configs)}: {str(e).splitlines()[0][:160]}")
        if len(configs) == 1:
            return {configs[0]: (None, str(e).splitlines()[0][:160])}
    out = {}
    for c in configs:
        out.update(_measure(m, [c], args, one, kw, log))
    return out


def run(models, configs, *, batch: int, image: int, warmup: int, iters: int, timeout_s: float, predict: bool,
        ps_default: bool = False, log=print) -> list[dict]:
    """Measure every (model, config); returns the CSV rows (see CSV_COLUMNS). One launch of 2 processes per
    model, its configurations interleaved step by step (:func:`bench_job`)."""
    rows = []
    for m in models:
        b = batch if m == "resnet18" else 64
        args = (b, image, warmup, iters)
        load0 = os.getloadavg()[0]
        # torch's PowerSGD hook on gloo launches collectives from the completion callbacks of several buckets
        # at once, which can reach the two ranks in different orders: with DDP's default buckets it aborted
        # ("Received data size doesn't match expected size") or hung on this machine in every try. So it runs
        # with one bucket (one chain of callbacks) unless --powersgd-default-buckets.
        got = {c: (*v, " (one bucket)" if c.startswith("powersgd") and not ps_default else "")
               for c, v in _measure(m, configs, args, not ps_default, dict(timeout_s=timeout_s), log).items()}
        load = f"{load0:.1f} -> {os.getloadavg()[0]:.1f}"
        log(f"  {m}: load average {load}")
        for c in configs:
            if got[c][0] is not None:
                log(f"  {m} {c}: {max(statistics.median(r['step_s']) for r in got[c][0]):.3f} s/iteration")
        pred = {}
        if predict:
            try:
                pred = predict_1gbe(m, b, image, configs)
            except Exception as e:  # noqa: BLE001
                log(f"  prediction for {m} unavailable: {type(e).__name__}: {e}")
        floor_bwd = floor_cpu = None
        if got.get("no-comm", (None,))[0]:
            floor_bwd = max(statistics.median(r["backward_s"]) for r in got["no-comm"][0])
            floor_cpu = max(statistics.median(r["backward_cpu_s"]) for r in got["no-comm"][0])
        ref = None
        if got.get("allreduce", (None,))[0]:
            ref = max(statistics.median(r["step_s"]) for r in got["allreduce"][0])
        for cfg in configs:
            res, err, note = got[cfg]
            row = {"model": m, "config": cfg, "batch": b, "iters": iters, "predicted_1gbe_s": pred.get(cfg, ""),
                   "load_avg": load}
            if res is None:
                rows.append({**row, "status": f"failed: {err}"})
                continue
            s = max(statistics.median(r["step_s"]) for r in res)
            hook = statistics.mean(r["hook_s"] for r in res)
            cb = statistics.mean(r["callback_s"] for r in res)
            hook_c = statistics.mean(r["hook_cpu_s"] for r in res)
            cb_c = statistics.mean(r["callback_cpu_s"] for r in res)
            rows.append({**row, "status": "ok" + note, "d": res[0]["d"], "s_per_iter": s,
                         "vs_allreduce_pct": 100 * (s / ref - 1) if ref else "",
                         "backward_s": max(statistics.median(r["backward_s"]) for r in res),
                         "hook_s": "" if math.isnan(hook) else hook, "callback_s": "" if math.isnan(cb) else cb,
                         "hook_own_frac_backward": "" if (math.isnan(hook) or not floor_bwd)
                         else (hook + cb) / floor_bwd,
                         "backward_cpu_s": max(statistics.median(r["backward_cpu_s"]) for r in res),
                         "hook_cpu_s": "" if math.isnan(hook_c) else hook_c,
                         "callback_cpu_s": "" if math.isnan(cb_c) else cb_c,
                         "hook_own_cpu_frac_backward": "" if (math.isnan(hook_c) or not floor_cpu)
                         else (hook_c + cb_c) / floor_cpu})
    return rows


def write_csv(rows, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as fh:
        w = csv.DictWriter(fh, CSV_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})
    os.replace(tmp, path)


def report(rows) -> str:
    """The README's markdown table and the goals of issue #14, met or not, with the numbers."""
    def f(v, fmt):
        return "" if v in ("", None) else format(v, fmt)

    lines = ["| model | config | s/iter | vs allreduce | backward s (wall / CPU) | hook's own CPU s: autograd thread "
             "+ completions | own CPU / floor's backward CPU | hook wall s: autograd + completions | "
             "1 GbE predicted s/iter |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["status"].startswith("ok"):
            lines.append(f"| {r['model']} | {r['config']} | {r['status']} | | | | | | |")
            continue
        cfg = r["config"] + r["status"][2:]
        own = "" if r["hook_cpu_s"] == "" else f"{r['hook_cpu_s']:.4f} + {r['callback_cpu_s']:.4f}"
        wall = "" if r["hook_s"] == "" else f"{r['hook_s']:.4f} + {r['callback_s']:.4f}"
        lines.append(f"| {r['model']} | {cfg} | {r['s_per_iter']:.3f} | {f(r['vs_allreduce_pct'], '+.1f')}"
                     f"{'%' if r['vs_allreduce_pct'] != '' else ''} | {r['backward_s']:.3f} / "
                     f"{r['backward_cpu_s']:.3f} | {own} | {f(r['hook_own_cpu_frac_backward'], '.1%')} | {wall} | "
                     f"{f(r['predicted_1gbe_s'], '.3f')} |")
    loads = sorted({f"{r['model']}: {r['load_avg']}" for r in rows})
    out = ["\n".join(lines), "", "1-minute load average before -> after: " + "; ".join(loads), ""]
    for m in sorted({r["model"] for r in rows}):
        by = {r["config"]: r for r in rows if r["model"] == m and r["status"].startswith("ok")}
        if "allreduce" not in by:
            continue
        ar = by["allreduce"]["s_per_iter"]
        ps = [by[c]["s_per_iter"] for c in ("powersgd-r1", "powersgd-r4") if c in by]
        for c, r in by.items():
            if not c.startswith(("topk", "gtopk")):
                continue
            within = r["s_per_iter"] <= 1.10 * ar
            vs_ps = ("" if not ps else f"; {'no slower' if r['s_per_iter'] <= min(ps) else 'slower'} than the faster "
                     f"PowerSGD ({min(ps):.3f} s)")
            frac = r["hook_own_cpu_frac_backward"]
            out.append(f"- {m} {c}: {r['s_per_iter']:.3f} s vs allreduce {ar:.3f} s "
                       f"({'within' if within else 'NOT within'} 10 %){vs_ps}; hook's own CPU time "
                       f"{'' if frac == '' else f'{frac:.1%}'} of the floor's backward CPU time"
                       f"{'' if frac == '' else (' (under 5 %)' if frac < 0.05 else ' (NOT under 5 %)')}")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated: {', '.join(CONFIGS)}")
    ap.add_argument("--batch", type=int, default=16, help="ResNet-18 images per rank (the MLP uses 64)")
    ap.add_argument("--image", type=int, default=112, help="ResNet-18 input height and width")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (PowerSGD compresses from step 3 on)")
    ap.add_argument("--iters", type=int, default=5, help="timed steps")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--no-predict", action="store_true", help="skip the simulator's 1 GbE prediction")
    ap.add_argument("--powersgd-default-buckets", action="store_true",
                    help="try torch's PowerSGD with DDP's default buckets first (aborted or hung here on gloo)")
    ap.add_argument("--csv", default=str(ROOT / "benchmarks" / "results" / "ddp_hooks.csv"))
    a = ap.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    configs = [c for c in a.configs.split(",") if c]
    bad = [m for m in models if m not in MODELS] + [c for c in configs if c not in CONFIGS]
    if bad or a.batch < 1 or a.image < 32 or a.warmup < 3 or a.iters < 1:
        ap.error(f"unknown {bad} (valid models {MODELS}, configs {CONFIGS}) or --batch < 1, --image < 32, "
                 "--warmup < 3 (PowerSGD starts at step 3), --iters < 1")
    t0 = time.perf_counter()
    rows = run(models, configs, batch=a.batch, image=a.image, warmup=a.warmup, iters=a.iters,
               timeout_s=a.timeout_s, predict=not a.no_predict, ps_default=a.powersgd_default_buckets)
    write_csv(rows, a.csv)
    print(report(rows))
    print(f"\nwrote {a.csv} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
