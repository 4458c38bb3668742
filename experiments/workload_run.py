"""``sparsim run`` on a scenario naming a real model: layer-wise iteration timelines, timing only.

A scenario whose ``[workload]`` names a zoo model (``workload.model``) or a layer table (``workload.table``)
simulates each algorithm's iterations with :func:`sim.engine.timeline.simulate_timeline`: forward and backward
layer by layer on the device model, gradients bucketed (DDP buckets, Horovod fusion, per layer, or the whole
model) and communicated on the simulated cluster, overlapped with backward. There is no objective to train (the
zoo models have no data here), so the loss columns are empty. The run directory (built as ``DIR.partial``,
renamed when complete) holds:

- ``metrics.csv``: one row per (algorithm, iteration) with :data:`sim.engine.runner.METRIC_COLUMNS`; the time
  columns compute_s, compress_s, comm_s, exposed_comm_s, overlap_ratio are rank 0's, iter_time_s the slowest rank's;
- ``summary.json``: the scenario, the resolved workload (parameters, layers, buckets, compute per iteration),
  the network, and per-algorithm means with the speedup over dense;
- ``trace.json``: the iterations ``workload.trace_iterations`` of the first ``workload.trace_ranks`` ranks of
  every algorithm in the Chrome trace event format (open it in https://ui.perfetto.dev or chrome://tracing);
- ``figure.png`` / ``figure.pdf``: per algorithm, the mean iteration split into compute and exposed communication.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np

from sim.algorithms import AlgorithmSpec
from sim.base.errors import ConfigError
from sim.engine.timeline import chrome_trace, simulate_timeline
from sim.machine.topology import ClusterSpec

from .outdir import check_out, file_record, partial_dir, publish, save_figure
from .progress import progress_bar
from .record import provenance, run_id, versions, write_metrics
from .resolve import (algorithm_specs, build_network, compute_costs, network_summary, resolve_compute, resolve_workload,
                      timeline_policy)
from .scenario import Scenario, used_keys_dump

__all__ = ["run_workload", "MAX_ROWS_WITHOUT_YES"]


def _specs(sc: Scenario, d: int, G: int) -> list[AlgorithmSpec]:
    """The scenario's algorithms for a workload of d parameters (k = the scenario's k for d), G ranks per node.
    Raises ConfigError for k > d."""
    k = sc.k_for(d)
    if k > d:
        raise ConfigError(f"compression.k = {k} is out of range: valid 1 <= k <= d = {d} (the model's parameters)")
    return algorithm_specs(sc, k, G)


#: Most metrics rows (iterations x algorithms) a workload run writes without ``--yes``: 10^6 rows is about 0.5 GB
#: of metrics.csv and minutes of wall time; beyond it the timing of a steady state is better read from fewer.
MAX_ROWS_WITHOUT_YES = 1_000_000


def run_workload(sc: Scenario, out, *, force: bool = False, progress: bool = True, figure: bool = True,
                 yes: bool = False) -> Path:
    """Simulate every algorithm of ``sc`` on its workload and write the run directory ``out`` (module docstring).

    Returns the directory's path. Raises ConfigError for bad settings (an existing non-empty ``out`` unless
    ``force``, an unknown model or device, a bad layer table, trace iterations beyond training.iterations), and
    any SparsimError of the simulation; the partial directory is then removed.
    """
    out = Path(out)
    w, T = sc.workload, sc.training.iterations
    late = [t for t in w.trace_iterations if t > T]
    if late:
        raise ConfigError(f"workload.trace_iterations = {w.trace_iterations}: valid 1 <= iteration <= "
                          f"training.iterations = {T}")
    rows_n = T * len(sc.algorithms)
    if rows_n > MAX_ROWS_WITHOUT_YES and not yes:
        raise ConfigError(f"training.iterations = {T} x {len(sc.algorithms)} algorithms = {rows_n} metrics rows (about "
                          f"{rows_n * 500 / 1e9:.1f} GB of metrics.csv): valid <= {MAX_ROWS_WITHOUT_YES} rows, or pass --yes")
    check_out(out, force)
    wl, dev = resolve_workload(sc)
    net = build_network(sc.cluster, timing_only=True)
    G = net.gpus_per_node if isinstance(net, ClusterSpec) else 1
    specs = _specs(sc, wl.d, G)
    policy = timeline_policy(sc)
    cm = resolve_compute(sc, dev)
    P, b = sc.cluster.P, sc.training.batch_size
    fwd, bwd = wl.layer_times(b, dev)
    tmp = partial_dir(out)
    try:
        t_wall = time.perf_counter()
        rows, totals, traces, resolved_algs = [], {}, {}, []
        for spec in specs:
            bar = progress_bar(spec.label, T, progress)
            try:
                res = simulate_timeline(spec, wl, P, network=net, policy=policy, device=dev, batch_size=b, compute=cm,
                                        iterations=T, trace_iterations=w.trace_iterations, engine=sc.cluster.engine,
                                        trace_ranks=w.trace_ranks, on_iteration=lambda t: bar.on_row({"iteration": t}))
            finally:
                bar.close()
            clock = np.cumsum(res.iter_s)
            for t in range(T):
                rows.append({"algorithm": spec.label, "iteration": t + 1, "lr": math.nan, "sim_time_s": float(clock[t]),
                             "iter_time_s": float(res.iter_s[t]), "compute_s": float(res.compute_s[t]),
                             "compress_s": float(res.compress_s[t]), "comm_s": float(res.comm_s[t]),
                             "loss": math.nan, "grad_norm_sq": math.nan, "stoch_grad_norm_sq": math.nan,
                             "residual_norm_sq": math.nan, "delta": None, "bytes_sent": res.bytes_per_rank,
                             "applied_fraction": math.nan, "selected_per_worker": math.nan, "mass_error": math.nan, "aux_gap": math.nan,
                             "exposed_comm_s": float(res.exposed_comm_s[t]), "overlap_ratio": float(res.overlap_ratio[t])})
            totals[spec.label] = {
                "iterations": T, "sim_time_s": float(clock[-1]), "mean_iter_time_s": float(res.iter_s.mean()),
                "mean_compute_s": float(res.compute_s.mean()), "mean_compress_s": float(res.compress_s.mean()),
                "mean_comm_s": float(res.comm_s.mean()), "mean_exposed_comm_s": float(res.exposed_comm_s.mean()),
                "mean_overlap_ratio": float(res.overlap_ratio.mean()), "bytes_sent_per_iteration": res.bytes_per_rank,
                "communication_ops": len(res.buckets) if res.buckets else None,
                "bucket_elements": [bk.numel for bk in res.buckets], "bucket_k": res.ks,
            }
            traces[spec.label] = res.timelines
            resolved_algs.append(dataclasses.asdict(spec))
        if "dense" in totals:
            for lab, tt in totals.items():
                tt["speedup_over_dense"] = totals["dense"]["mean_iter_time_s"] / tt["mean_iter_time_s"]
        write_metrics(tmp / "metrics.csv", rows, run_id(sc, "timeline"))
        if any(traces.values()):
            chrome_trace(traces, tmp / "trace.json")
        k = sc.k_for(wl.d)
        summary = {
            "scenario": used_keys_dump(sc),
            "seed": sc.seed,
            "mode": "workload timeline (timing only)",
            "resolved": {
                "d": wl.d, "k": k, "compression_ratio_c": wl.d / k, "density": k / wl.d, "P": P,
                "global_batch_B": P * b, "network": {**network_summary(net), "engine": sc.cluster.engine},
                "workload": {"name": wl.name, "parameters": wl.d, "tensors": len(wl.tensors), "layers": len(wl.layers),
                             "input": wl.input, "source": wl.source, "measured": wl.measured,
                             "forward_s": float(fwd.sum()), "backward_s": float(bwd.sum()),
                             "device": None if dev is None else dataclasses.asdict(dev)},
                "compute_costs": compute_costs(sc, dev),
                "policy": dataclasses.asdict(policy),
            },
            "algorithms": resolved_algs,
            "totals": totals,
            "versions": versions(),
            "wall_time_s": time.perf_counter() - t_wall,
            "metrics_csv": file_record(tmp / "metrics.csv", rows),
            "provenance": provenance(),
        }
        with open(tmp / "summary.json", "w") as fh:
            json.dump(summary, fh, indent=2)
        if figure:
            _figure(totals, tmp, f"{wl.name} on {sc.cluster.network}, P = {P}, batch {b}/rank")
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _figure(totals: dict, outdir: Path, title: str) -> None:
    """Stacked bars: per algorithm, mean compute and exposed communication per iteration (ms), with the overlap
    ratio (share of communication hidden behind backward) above each bar."""
    from .plots import plt

    labels = list(totals)
    comp = [1e3 * totals[a]["mean_compute_s"] for a in labels]
    exp_ = [1e3 * totals[a]["mean_exposed_comm_s"] for a in labels]
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(labels), 4))
    x = np.arange(len(labels))
    ax.bar(x, comp, label="compute (forward + backward + update)", color="#4c72b0")
    ax.bar(x, exp_, bottom=comp, label="exposed communication", color="#dd8452")
    for i, a in enumerate(labels):
        ax.annotate(f"overlap {totals[a]['mean_overlap_ratio']:.0%}", (x[i], comp[i] + exp_[i]), ha="center",
                    va="bottom", fontsize=7)
    ax.set_xticks(x, labels)
    ax.set_ylabel("ms per iteration")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, outdir, "figure")
    plt.close(fig)
