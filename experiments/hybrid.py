"""``sparsim workload hybrid-plan``: the hybrid per-bucket plan of a scenario's model on its cluster (docs/hybrid.md).

The scenario gives everything the timeline needs: the model (``workload.model`` / ``workload.table``, timing only, or a
``[model]`` network trained on images), the device and batch size, the cluster and P, the compute model, the DDP bucket
caps, the blocking flag, the algorithms (the plan's sparse algorithm: ``algorithm``, default the scenario's first
sparse one, with its collective and settings) and the dense collective. :func:`make_plan` turns it into the arguments
of :func:`sim.engine.hybrid.choose_hybrid` and, for the error bound, measures the errors first
(:func:`measure_errors`: a short numerics run of the scenario, so a ``[model]`` scenario only).

The plan reads only part of a scenario (:func:`unused_plan_key`): a key given with ``--set`` that it does not read is a
one-line error naming the key and the setting that would use it (the scenario file's other keys are the run's, which
trains or times the plan from the same file, and are not read here).

Other commands call :func:`make_plan` (``sparsim plan`` lists "hybrid" as a policy through it) or
:func:`sim.engine.hybrid.choose_hybrid` directly when they have the workload and network in hand.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from sim.base.errors import ConfigError
from sim.engine.hybrid import BOUNDS, DiscardTable, HybridChoice, choose_hybrid, discarded_fractions
from sim.machine.topology import ClusterSpec

from .build import build
from .resolve import (algorithm_specs, build_network, resolve_compute, resolve_device, resolve_workload,
                      timeline_policy)
from .scenario import Scenario

__all__ = ["make_plan", "measure_errors", "plan_lines", "parse_densities", "unused_plan_key", "check_plan_overrides",
           "plan_k_text", "DEFAULT_DENSITIES"]

log = logging.getLogger("sparsim")

#: The candidate densities when none are given.
DEFAULT_DENSITIES = (0.001, 0.01, 0.1)


def parse_densities(text: str) -> tuple[float, ...]:
    """``"0.001,0.01"`` as a tuple of floats, each in (0, 1], distinct, ascending. Raises ConfigError (one line)."""
    try:
        vals = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--densities {text!r}: valid comma-separated densities in (0, 1], e.g. 0.001,0.01,0.1") \
            from None
    if not vals:
        raise ConfigError(f"--densities {text!r}: valid one or more densities in (0, 1]")
    for v in vals:
        if not 0 < v <= 1:
            raise ConfigError(f"--densities: density = {v!r} is out of range: valid 0 < density <= 1")
    return tuple(sorted(set(vals)))


#: Scenario keys the plan never reads, with what reads them (phrases after "used only by").
_NEVER_READ = {
    "training.iterations": "sparsim run (the run's length): the plan times one iteration, and --measure-iterations "
                           "sets the length of --error-bound's measuring run",
    "training.eval_every": "sparsim run (its evaluations): the plan evaluates nothing",
    "training.time_budget_s": "sparsim run (a [model] run's time budget)",
    "workload.trace_iterations": "sparsim run (its trace.json): the plan writes no trace",
    "workload.trace_ranks": "sparsim run (its trace.json): the plan writes no trace",
    "workload.dense_policy": "sparsim run with dense among the algorithms: the plan's dense buckets and its uniform "
                             "'dense' are DDP's allreduce",
    "workload.fusion_threshold_mb": "sparsim run with workload.dense_policy = 'horovod': the plan's dense buckets are "
                                    "DDP's",
    "workload.cycle_time_s": "sparsim run with workload.dense_policy = 'horovod': the plan's dense buckets are DDP's",
    "workload.hybrid_plan": "sparsim run with workload.sparse_policy = 'hybrid' (it trains or times a plan): this "
                            "command writes the plan (--out)",
}
#: Scenario keys (or tables, ending in ".") only the run that measures the errors reads (--error-bound).
_ERROR_RUN_ONLY = ("compression.density", "compression.k", "training.lr", "training.schedule", "training.theta",
                   "training.inverse_a", "training.momentum", "training.weight_decay", "training.dtype",
                   "compression.gtopk_mask", "data.", "model.eval_samples", "model.test_samples", "model.gradients")


def unused_plan_key(key: str, sc: Scenario, bound: str, algorithm: str | None = None) -> str | None:
    """Why ``sparsim workload hybrid-plan`` does not read the scenario key ``key`` (dotted, e.g. ``compression.density``)
    under ``bound`` (one of :data:`sim.engine.hybrid.BOUNDS`) with the plan's sparse ``algorithm`` (None: the
    scenario's first sparse one): a phrase naming what would use it (it follows "used only by"), or None when the plan
    reads it.

    The plan reads the model (workload.model / table / device / efficiency, or model.name), training.batch_size, the
    cluster, the compute model, seed and name, the algorithms and the plan's algorithm's [algorithm.NAME] options, the
    [compression] keys that time a collective (value and index bytes, the collectives), DDP's bucket caps and
    workload.hook_blocks_backward. Never: the run's length, evaluations, time budget and trace, dense's policy, the plan
    file of a run (:data:`_NEVER_READ`), the [torch] table. Only the run that measures the errors (--error-bound) reads
    the density or k, the step size, momentum, weight decay and dtype, gTop-k's mask, the data, the [model] evaluation
    keys and workload.sparse_policy; without it ``sparse_policy = 'bucket'`` (the plan's own scope) is accepted."""
    if key in _NEVER_READ:
        return _NEVER_READ[key]
    if key.startswith("torch."):
        return "sparsim run on the torch backend: the plan is simulated"
    if key.startswith("algorithm."):
        name = key.split(".")[1]
        plan_algo = _plan_algorithm_name(sc, algorithm)
        if plan_algo is not None and name != plan_algo:
            return f"a run of {name} (sparsim run): the plan reads the options of its own algorithm, {plan_algo}"
        return None
    if bound == "error":
        return None
    if key == "workload.sparse_policy":
        if sc.workload.sparse_policy == "bucket":
            return None  # the plan's own scope: DDP's buckets
        return ("sparsim run or --error-bound's measuring run (their selection scope): the plan chooses per DDP "
                "bucket: valid here 'bucket'")
    if any(key == u or (u.endswith(".") and key.startswith(u)) for u in _ERROR_RUN_ONLY):
        why = ": the plan's candidate densities are --densities" if key in ("compression.density", "compression.k") \
            else ""
        return f"--error-bound (its short run of the scenario measures the errors){why}"
    return None


def _plan_algorithm_name(sc: Scenario, algorithm: str | None) -> str | None:
    from sim.algorithms import get, resolve

    if algorithm is not None:
        try:
            return resolve(algorithm)[0]
        except ConfigError:
            return None  # refused by make_plan with the scenario's algorithms
    return next((resolve(a)[0] for a in sc.algorithms if get(resolve(a)[0]).sparse), None)


def check_plan_overrides(sc: Scenario, overrides, bound: str, algorithm: str | None = None) -> None:
    """Raise ConfigError (one line, naming the ``--set`` and the setting that would use it) for the first override
    (``dotted.key=value``) whose key the plan does not read (:func:`unused_plan_key`). A key in the scenario file is
    not checked: the file is also the run's, which reads it."""
    for item in overrides or ():
        key = item.split("=", 1)[0].strip()
        why = unused_plan_key(key, sc, bound, algorithm)
        if why is not None:
            shown = item if len(item) <= 80 else item[:60] + f"... ({len(item)} characters)"
            opt = {"density": "--density-bound", "min_density": "--min-density", "error": "--error-bound"}[bound]
            raise ConfigError(f"--set {shown}: {key} is not read by the hybrid plan under {opt}: used only by {why}")


def _sparse_spec(sc: Scenario, algorithm: str | None, d: int, G: int, overrides=()):
    """The whole-model AlgorithmSpec of the plan's sparse algorithm (``algorithm`` or the scenario's first sparse one),
    held to the rule of the runs that will load the plan (:func:`sim.engine.hybrid.hybrid_algorithms`); a refusal names
    the ``--set`` of ``algorithms`` when one of ``overrides`` gave it."""
    from sim.engine.hybrid import hybrid_algorithms

    given = next((o for o in reversed(list(overrides or ())) if o.split("=", 1)[0].strip() == "algorithms"), None)
    where = f"--set {given}: " if given is not None else ""
    specs = algorithm_specs(sc, sc.k_for(d), G)
    if algorithm is not None:
        spec = next((s for s in specs if s.name == algorithm or s.label == algorithm), None)
        if spec is None:
            raise ConfigError(f"--algorithm {algorithm!r} is not among the scenario's algorithms: valid "
                              f"{', '.join(s.name for s in specs)}")
        if not spec.algorithm.sparse:
            raise ConfigError(f"--algorithm {algorithm!r} is dense: valid a sparse algorithm of the scenario "
                              f"({', '.join(s.name for s in specs if s.algorithm.sparse) or 'none'})")
    else:
        spec = next((s for s in specs if s.algorithm.sparse), None)
        if spec is None:
            raise ConfigError(f"{where}algorithms = {list(sc.algorithms)}: the hybrid plan needs a sparse algorithm: "
                              "valid a scenario with one (e.g. --set \"algorithms=['dense','gtopk']\")")
    if spec.name not in hybrid_algorithms():
        what = f"--algorithm {algorithm!r}" if algorithm is not None else f"{where}algorithms = {list(sc.algorithms)}"
        raise ConfigError(f"{what}: no run can train a hybrid plan of {spec.name} (dense buckets between compressed "
                          "ones need a sparse per-bucket algorithm without a local momentum): valid "
                          f"{', '.join(hybrid_algorithms())}")
    return spec


def measure_errors(sc: Scenario, algorithm: str | None, densities, iterations: int, built=None) -> DiscardTable:
    """The measured compression error of each per-bucket choice (docs/hybrid.md, "how the error is measured").

    Runs the scenario's numerics (a ``[model]`` scenario: the network on its images, P simulated workers) for
    ``iterations`` iterations of the plan's sparse algorithm exactly as the scenario sets it (density, sparse_policy,
    seed), and at every iteration and on every worker takes the error-feedback accumulator acc_p = eps_p + alpha_t G_p
    and computes, for each DDP bucket b (launch order) and candidate density rho_j, the fraction of ||acc_p||^2 that
    Top-k at k_b = min(d_b, max(1, round(rho_j d_b))) in that bucket discards (:func:`sim.engine.hybrid.
    discarded_fractions`); likewise for whole-model and per-layer selection. The table holds the means over workers and
    iterations. built: the scenario's :class:`experiments.build.Built` if already built. Raises ConfigError for a
    scenario without a [model] network, or iterations < 1."""
    from sim.engine.runner import run_algorithm
    from sim.engine.timeline import ddp_buckets, flat_segments, layer_buckets

    if not sc.model.name:
        raise ConfigError("--error-bound measures the errors on a numerics run of a network: valid a [model] scenario "
                          "(model.name = lenet5, resnet20, ...); a timing-only [workload] model takes --min-density or "
                          "--density-bound")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ConfigError(f"--measure-iterations {iterations!r} is out of range: valid an integer >= 1")
    built = built or build(sc)
    wl, d = built.workload, built.d
    dens = tuple(float(r) for r in densities)
    spec = next(s for s in built.specs if s.name == _sparse_spec(sc, algorithm, d, 1).name)
    pol = timeline_policy(sc)
    buckets = ddp_buckets(wl, dataclasses.replace(pol, sparse="bucket", plan=None), sc.compression.value_bytes)
    flat_segments(wl, buckets)  # ConfigError when a bucket is not one contiguous range
    starts = [min(b.tensors) for b in buckets]
    offs = np.concatenate([[0], np.cumsum([t.numel for t in wl.tensors])])
    order = sorted(range(len(buckets)), key=lambda i: starts[i])  # flat order -> launch index
    bucket_bounds = np.array([offs[starts[i]] for i in order] + [d], dtype=np.int64)
    try:
        layer_bounds = np.concatenate([[0], np.cumsum(flat_segments(wl, layer_buckets(wl)))]).astype(np.int64)
    except ConfigError:
        layer_bounds = None
    sums = {"bucket": np.zeros((len(buckets), len(dens))), "model": np.zeros(len(dens)),
            "layer": np.zeros(len(dens))}
    seen = [0]

    def on_step(t, outs):
        for o in outs:
            fb = discarded_fractions(o.acc, bucket_bounds, dens)
            sums["bucket"][order] += fb
            sums["model"] += discarded_fractions(o.acc, np.array([0, d]), dens)[0]
            if layer_bounds is not None:
                sums["layer"] += discarded_fractions(o.acc, layer_bounds, dens).sum(axis=0)
            seen[0] += 1

    log.info("measuring the compression error: %s, %d iterations", spec.label, iterations)
    run_algorithm(spec, built.workers, T=iterations, lr=built.lr, x0=built.x0, network=built.network,
                  compute=built.compute, eval_every=iterations, clock=built.clock, on_step=on_step)
    n = max(seen[0], 1)
    layer = sums["layer"] / n if layer_bounds is not None else np.full(len(dens), np.nan)
    how = (f"{spec.label} on {sc.model.name} / {sc.data.dataset}, P = {sc.cluster.P}, density {sc.compression.density:g}, "
           f"sparse_policy {sc.workload.sparse_policy}, seed {sc.seed}: mean over {seen[0]} (worker, iteration) "
           f"accumulators of the first {iterations} iterations")
    return DiscardTable(dens, sums["bucket"] / n, sums["model"] / n, layer, how)


def make_plan(sc: Scenario, densities, bound: str, value: float, *, algorithm: str | None = None,
              measure_iterations: int = 20, overrides=()) -> HybridChoice:
    """The hybrid plan of ``sc``'s model on its cluster (module docstring): :func:`sim.engine.hybrid.choose_hybrid` with
    the scenario's workload, device, batch size, cluster (``cluster.P`` ranks, ``cluster.engine``), compute model,
    bucket caps and blocking flag, the sparse ``algorithm`` (default the scenario's first sparse one) and dense's
    collective, under ``bound`` (one of :data:`sim.engine.hybrid.BOUNDS`) = ``value``; for "error" the errors measured
    by :func:`measure_errors` over ``measure_iterations`` iterations (a [model] scenario's data are read only then:
    overrides: the ``--set`` strings the scenario was loaded with, for messages;
    under a density bound its network's workload is built from the network alone, as a [model] run times it). Raises
    ConfigError for bad input (one line)."""
    if bound not in BOUNDS:
        raise ConfigError(f"bound = {bound!r} is unknown: valid {', '.join(BOUNDS)}")
    errors = None
    if sc.model.name and bound == "error":
        built = build(sc)
        wl, net, cm, dev = built.workload, built.network, built.compute, resolve_device(sc)
        errors = measure_errors(sc, algorithm, densities, measure_iterations, built)
    elif sc.model.name:  # the network's layer-wise workload as a [model] run times it; no data is read
        from sim.workloads.nets import build_net, net_workload

        dev = resolve_device(sc)
        wl = net_workload(build_net(sc.model.name, seed=sc.seed, dtype=sc.training.dtype), (1, 28, 28), sc.model.name)
        net = build_network(sc.cluster, timing_only=True)
        cm = resolve_compute(sc, dev)
    else:
        if not sc.workload.active:
            raise ConfigError("the scenario names no model: valid workload.model (a zoo model), workload.table or "
                              "model.name (a network on images)")
        if bound == "error":
            measure_errors(sc, algorithm, densities, measure_iterations)  # the one-line refusal
        wl, dev = resolve_workload(sc)
        net = build_network(sc.cluster, timing_only=True)
        cm = resolve_compute(sc, dev)
    G = net.gpus_per_node if isinstance(net, ClusterSpec) else 1
    spec = _sparse_spec(sc, algorithm, wl.d, G, overrides)
    spec = dataclasses.replace(spec, segments=None)
    policy = timeline_policy(sc)
    policy = dataclasses.replace(policy, sparse="bucket", plan=None)
    made = {"scenario": sc.name, "network": sc.cluster.network, "engine": sc.cluster.engine,
            "device": None if dev is None else dev.name, "seed": sc.seed}
    return choose_hybrid(wl, net, spec, sc.cluster.P, densities=densities, bound=bound, value=value, errors=errors,
                         policy=policy, device=dev, batch_size=sc.training.batch_size, compute=cm,
                         engine=sc.cluster.engine, dense_collective=sc.compression.dense_collective, made_with=made)


def plan_lines(choice: HybridChoice, sc: Scenario):
    """The report ``sparsim workload hybrid-plan`` prints: the plan per bucket, its iteration, every uniform policy
    under the same bound (fastest first) and the gain over the best feasible one."""
    import json

    plan = choice.plan
    algo = json.loads(plan.made_with).get("algorithm", "?") if plan.made_with else "?"
    what = {"density": "overall density <=", "min_density": "overall density >=", "error": "total error <="}[choice.bound]
    yield (f"{plan.model} on {sc.cluster.network}, P = {sc.cluster.P}: hybrid plan for {algo}, "
           f"{what} {choice.bound_value:g}")
    yield f"  {'bucket':>6}  {'elements':>12}  {'choice':>18}  {'k':>10}"
    for j, (n, r, k) in enumerate(zip(plan.bucket_sizes, plan.densities, plan.ks())):
        yield (f"  {j:>6}  {n:>12,}  {'dense (' + plan.dense_collective + ')' if r is None else f'density {r:g}':>18}"
               f"  {'-' if k is None else f'{k:,}':>10}")
    res = f"density {choice.resource:.4g}" if choice.bound != "error" else f"error {choice.resource:.4g}"
    yield f"hybrid: {choice.iter_s * 1e3:.3f} ms per iteration ({res}; sent density {plan.sent_density():.4g})"
    yield "uniform policies under the same bound (fastest first):"
    for u in sorted(choice.uniform, key=lambda u: u.iter_s):
        res = f"{u.resource:.4g}"
        yield f"  {u.label:<16} {u.iter_s * 1e3:>10.3f} ms  {'error' if choice.bound == 'error' else 'density'} {res:<10}" \
              f"{'' if u.feasible else '  outside the bound'}"
    if choice.best_uniform is None:
        yield "no uniform policy meets the bound"
    else:
        yield (f"gain over the best uniform policy ({choice.best_uniform.label}, {choice.best_uniform.iter_s * 1e3:.3f} "
               f"ms): {choice.gain:.4f}x")


def plan_k_text(plan: dict) -> str:
    """What a run of a hybrid plan selects, for the summary ``sparsim run`` prints (experiments/run_summary.py) in place
    of the uniform rule k_b = max(1, round(k d_b / d)), which a plan does not follow: k_b per DDP bucket in launch order
    (``dense`` for a dense bucket: all d_b entries, the allreduce), their sum and the sent density sum_b k_b / d.

    plan: summary.json's ``resolved.policy.plan`` (the :class:`sim.engine.hybrid.HybridPlan` as a dict: ``bucket_sizes``,
    ``densities``; the k_b are :meth:`sim.engine.hybrid.HybridPlan.ks`'s rule). Returns one line of text."""
    from sim.algorithms.base import density_k

    sizes, dens = [int(n) for n in plan["bucket_sizes"]], list(plan["densities"])
    ks = [n if r is None else density_k(r, n) for r, n in zip(dens, sizes)]
    shown = ", ".join("dense" if r is None else f"{k:,}" for r, k in zip(dens, ks))
    d = sum(sizes)
    algo = f" for {plan['algorithm']}" if plan.get("algorithm") else ""
    return (f"k_b per the hybrid plan{algo} (DDP buckets, launch order): {shown}; {sum(ks):,} of d = {d:,} sent "
            f"per worker, density {sum(ks) / d:.4g}")

