"""``sparsim run``: run a scenario and write its run directory; the dispatcher of the run kinds.

A scenario goes one way through these modules: :mod:`experiments.scenario` (the schema) ->
:mod:`experiments.resolve` (algorithms, network, policy: no data) -> :mod:`experiments.build` (data, objective,
workers: a :class:`~experiments.build.Built`) -> a run kind -> the run directory (:func:`write_run_directory`;
:mod:`experiments.record` holds what every run kind writes alike). The run kinds: the simulator's numerics (here,
the algorithms in forked processes by :mod:`experiments.algorithm_pool`), the torch backend
(:mod:`experiments.torch_job`; :mod:`experiments.torch_run` is its torchrun entry point, above this module), and
the timing-only workload timeline (:mod:`experiments.workload_run`, a scenario with [workload] model or table).

Run directory (written to ``DIR.partial`` and renamed to ``DIR`` only when complete, so a failed or
interrupted run never leaves a directory that looks finished):

- ``metrics.csv``: one row per (algorithm, iteration); columns in :data:`sim.engine.runner.METRIC_COLUMNS`.
- ``summary.json``: the fully resolved scenario, seed, package versions, derived constants and totals.
- ``figure.png`` / ``figure.pdf``: loss and grad_norm_sq against iteration and simulated time, the
  per-iteration time breakdown and delta over training, one line per algorithm;
- ``trace.json`` for a [model] run on the simulator (:func:`experiments.run_net.write_net_trace`).

:func:`write_run_directory` writes them for both numerics backends (the torchrun entry point
:mod:`experiments.torch_run` too); the metrics file, run id, versions and provenance are
:mod:`experiments.record`'s, shared with the workload run.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from sim.base.errors import ConfigError

from .algorithm_pool import algorithm_jobs, check_jobs, run_algorithms
from .build import Built, build
from .outdir import check_out, file_record, partial_dir, publish
from .progress import progress_bar, run_clock
from .record import provenance, run_id, versions, write_metrics
from .resolve import measured_selection, network_summary
from .resources import check_resources
from .run_net import net_resolved, write_net_trace
from .scenario import Scenario, used_keys_dump
from .torch_job import check_backend_keys, check_torch_settings, launch_scenario, torch_backend_info
from .workload_run import run_workload

log = logging.getLogger("sparsim.run")

__all__ = ["run_scenario", "write_run_directory"]


def run_scenario(sc: Scenario, out: str | os.PathLike, *, force: bool = False, progress: bool = True,
                 figure: bool = True, backend: str = "sim", nproc: int | None = None, yes: bool = False,
                 jobs: int | None = None) -> Path:
    """Run every algorithm of ``sc`` and write the run directory ``out``; return its path.

    The directory is built as ``out.partial`` and renamed when complete. Raises ConfigError if ``out``
    exists and is not empty (unless ``force``), and any SparsimError of the run (the partial directory
    is removed).

    Before anything large is allocated, :func:`experiments.resources.check_resources` holds the run's memory
    estimate against the machine's available memory and its estimated work against
    :data:`experiments.resources.MAX_WORK`; it raises ResourceError (one line, naming the estimate and the
    limit) when the run does not fit, or when the work is above the limit and ``yes`` is false (``--yes``).
    progress: tqdm bars (on a terminal only) with the whole run's remaining wall time, estimated from the
    iterations done so far.

    backend: "sim" (the SimPy cluster; simulated times) or "torch" (``nproc`` local processes over
    torch.distributed on loopback, :mod:`sim.distributed.backend`; the time columns are measured wall times
    iter_time_s is the slowest rank's step time and sim_time_s their running sum). nproc: must equal cluster.P (None: cluster.P).
    The torch settings come from the scenario's ``[torch]`` section (:class:`~experiments.scenario.TorchCfg`):
    timeout_s (seconds a rank may wait on a peer before the run fails), stall_timeout_s (seconds every
    rank may go without progress; 0 = no limit), dist_backend ("gloo", "nccl" or "auto") and backend_allreduce (dense uses
    torch.distributed.all_reduce). When a torch rank fails, :class:`sim.distributed.backend.WorkerFailure` is raised naming the
    rank and ``out.partial/error.txt`` records it (``out`` is not created).

    jobs (backend "sim"): how many algorithms are simulated at the same time, each in a forked process
    (:mod:`experiments.algorithm_pool`; the same rows in the same order); None: as many as there are algorithms,
    at most twice the usable cores and what half the available memory holds; 1: one after another. Raises ConfigError
    for jobs < 1 and ResourceError when an explicit jobs does not fit in memory.
    """
    out = Path(out)
    if backend not in ("sim", "torch"):
        raise ConfigError(f"backend = {backend!r} is unknown: valid sim, torch")
    check_jobs(jobs)  # a bad --jobs fails before anything is built
    if backend == "sim":
        check_backend_keys(sc, backend)  # a [torch] key set for a simulated run: one line, exit 2
    if jobs is not None and (backend != "sim" or sc.workload.active):
        raise ConfigError("--jobs runs the simulator's algorithms in parallel: valid with --backend sim and without "
                          "workload.model / workload.table (a workload run is one timeline)")
    if jobs is not None and jobs > 1 and sc.model.name:
        raise ConfigError(f"--jobs {jobs} with model.name = {sc.model.name!r}: torch cannot run in a forked process "
                          "once its thread pool has started, and the per-worker gradients spread over the cores already "
                          "(sim.workloads.nets), so its algorithms run one after another: valid --jobs 1 or none")
    if sc.workload.active:
        if backend != "sim" or nproc is not None:
            raise ConfigError("workload.model / workload.table simulate a real model's iteration timeline: valid "
                              "--backend sim (without --nproc)")
        return run_workload(sc, out, force=force, progress=progress, figure=figure, yes=yes)
    if backend == "sim" and (nproc is not None or sc.torch.backend_allreduce):
        raise ConfigError("--nproc and --backend-allreduce (torch.backend_allreduce) need --backend torch")
    if nproc is not None and nproc != sc.cluster.P:
        raise ConfigError(f"--nproc {nproc} differs from cluster.P = {sc.cluster.P}: they must be equal")
    check_out(out, force)
    if backend == "torch":
        check_torch_settings(sc)
    estimate: dict = {}

    def check(d, data_bytes):
        estimate.update(check_resources(sc, d, data_bytes, backend=backend, yes=yes))

    built = build(sc, check)
    tmp = partial_dir(out)
    try:
        t_wall = time.perf_counter()
        if backend == "sim":
            clock = run_clock(sc.training.iterations * len(built.specs))
            # a [model] run: torch does not survive fork, and its per-worker gradients spread over the cores already
            n_jobs = 1 if sc.model.name else algorithm_jobs(jobs, len(built.specs), estimate or None)
            per_spec = run_algorithms(built.specs, built, T=sc.training.iterations,
                                      eval_every=sc.training.eval_every, jobs=n_jobs,
                                      bar_for=lambda spec: progress_bar(spec.label, sc.training.iterations, progress,
                                                                        clock))
            rows = [row for r in per_spec for row in r]
            info = {"name": "sim"}
        else:
            from sim.distributed.backend import WorkerFailure

            try:
                rows = launch_scenario(sc, tmp)
            except WorkerFailure:  # launch_scenario wrote DIR.partial/error.txt: keep it as the record of the failure
                tmp = None
                raise
            info = torch_backend_info(sc, sc.cluster.P, launcher="sparsim run")
        write_run_directory(tmp, sc, built, rows, time.perf_counter() - t_wall, figure=figure, backend=info)
        publish(tmp, out)
        log.info("published %s (%.2f s of wall time)", out, time.perf_counter() - t_wall)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _totals(rows: list[dict]) -> dict:
    """summary.json's ``totals`` of one algorithm from its metrics rows (iteration 0 first, dicts with
    :data:`METRIC_COLUMNS`): iterations, simulated time (s) and mean per-iteration times (s), bytes sent per
    worker, first / final / smallest loss and squared gradient norm (of the evaluated rows), largest and mean
    delta (None when no row has one), largest mass error, the entries each worker selected per step as measured
    (``selected_per_worker``: mean / min / max / steps, :func:`experiments.resolve.measured_selection`; None
    without a count), and a [model] run's accuracies."""
    last = rows[-1]
    it = [r for r in rows if r["iteration"] > 0]
    n = max(len(it), 1)
    evald = [r for r in rows if not math.isnan(r["loss"])]
    deltas = [r["delta"] for r in it if r["delta"] is not None and not math.isnan(r["delta"])]
    return {
        "iterations": len(it),
        "sim_time_s": last["sim_time_s"],
        "mean_iter_time_s": sum(r["iter_time_s"] for r in it) / n,
        "mean_compute_s": sum(r["compute_s"] for r in it) / n,
        "mean_compress_s": sum(r["compress_s"] for r in it) / n,
        "mean_comm_s": sum(r["comm_s"] for r in it) / n,
        "bytes_sent_per_worker": sum(r["bytes_sent"] for r in it),
        "initial_loss": rows[0]["loss"],
        "final_loss": evald[-1]["loss"],
        "final_grad_norm_sq": evald[-1]["grad_norm_sq"],
        "min_grad_norm_sq": min(r["grad_norm_sq"] for r in evald),
        "max_delta": max(deltas) if deltas else None,
        "mean_delta": (sum(deltas) / len(deltas)) if deltas else None,
        "max_mass_error": max(r["mass_error"] for r in rows),
        "selected_per_worker": measured_selection(rows),
        **_accuracy_totals(evald),
    }


def _accuracy_totals(evald: list[dict]) -> dict:
    """A [model] run's accuracy totals from its evaluated rows: the final train / test accuracy and test loss,
    and the best test accuracy with its iteration and simulated time; {} for an objective without them."""
    acc = [r for r in evald if not math.isnan(r.get("test_accuracy", math.nan))]
    if not acc:
        return {}
    best = max(acc, key=lambda r: r["test_accuracy"])
    return {"final_train_accuracy": acc[-1]["train_accuracy"], "final_test_loss": acc[-1]["test_loss"],
            "final_test_accuracy": acc[-1]["test_accuracy"], "best_test_accuracy": best["test_accuracy"],
            "best_test_iteration": best["iteration"], "best_test_sim_time_s": best["sim_time_s"]}


def write_run_directory(tmp: Path, sc: Scenario, built: Built, rows: list[dict], wall_s: float, *,
                        figure: bool = True, backend: dict | None = None) -> None:
    """Write metrics.csv, summary.json and the figure of a finished run into directory ``tmp``.

    built: the :class:`~experiments.build.Built` the rows were computed on. rows: the metrics rows of every
    algorithm in order (:data:`METRIC_COLUMNS`). wall_s: the run's wall time (s). backend: a dict describing the
    backend, stored as summary["backend"] (default sim; :func:`experiments.torch_job.torch_backend_info`).
    """
    segments: list[list[dict]] = []
    for r in rows:  # each algorithm's rows start with its iteration-0 row
        if r["iteration"] == 0 or not segments:
            segments.append([])
        segments[-1].append(r)
    per_alg = {seg[0]["algorithm"]: _totals(seg) for seg in segments}
    write_metrics(tmp / "metrics.csv", rows, run_id(sc, (backend or {}).get("name", "sim")))
    summary = {
        "scenario": used_keys_dump(sc, (backend or {}).get("name", "sim")),
        "seed": sc.seed,
        "resolved": {
            "d": built.d, "k": built.k, "compression_ratio_c": built.d / built.k, "density": built.k / built.d,
            **_selected_per_worker(built),
            "n_samples": built.objective.n, "P": sc.cluster.P, "global_batch_B": sc.cluster.P * sc.training.batch_size,
            "network": network_summary(built.network),
            "lr_first": built.lr(1),
            "objective": type(built.objective).__name__,
            "constants": built.objective.constants(),
            "x0_loss": rows[0]["loss"],
        },
        "algorithms": [asdict(s) for s in built.specs],
        "totals": per_alg,
        "versions": versions(),
        "wall_time_s": wall_s,
        "metrics_csv": file_record(tmp / "metrics.csv", rows),
        "provenance": provenance(),
    }
    if backend is not None and backend.get("name") != "sim":
        summary["backend"] = backend
    if built.clock is not None:
        name = (backend or {}).get("name", "sim")
        summary["mode"] = "network on images"
        summary["resolved"].update(net_resolved(sc, built, name))
        if name != "torch":  # the torch backend's times are measured, not the network's timeline
            write_net_trace(tmp / "trace.json", sc, built, rows)
    with open(tmp / "summary.json", "w") as fh:
        json.dump(summary, fh, indent=2, default=_json_default)
    if figure:
        from .plots import run_figure

        where = sc.cluster.network if not backend or backend.get("name") == "sim" else \
            f"torch/{backend.get('dist_backend')} measured"
        run_figure(rows, tmp, title=f"{sc.name}: P = {sc.cluster.P}, d = {built.d}, k = {built.k}, {where}")


def _selected_per_worker(built: Built) -> dict:
    """summary.json's record of what a layer-wise run selects: with segments (compression.layer_sizes, or a [model]
    run's per-bucket / per-layer policy) each segment of d_b elements selects k_b = min(d_b, max(1, round(k d_b /
    d))) (:func:`sim.algorithms.base.segment_k`), so a worker selects sum_b k_b, not k: ``k_selected_per_worker``
    (that sum), ``n_segments`` (their count) and ``compression_ratio_c_selected`` (d over the sum). {} for whole-model
    selection."""
    spec = next((s for s in built.specs if s.segments is not None and s.algorithm.sparse), None)
    if spec is None or len(spec.segments) < 2:
        return {}
    ks = spec.segment_ks(built.d)
    return {"k_selected_per_worker": int(sum(ks)), "n_segments": len(ks),
            "compression_ratio_c_selected": built.d / sum(ks)}


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)
