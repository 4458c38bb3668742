"""A scenario's parts that need no data: the algorithms, the network, the timeline policy, the device, the workload.

Each function reads a validated :class:`~experiments.scenario.Scenario` (or one of its tables) and returns the
simulator's object for it, raising ConfigError (one line, naming the key and the valid values) for a combination
the schema alone cannot refuse. Nothing here loads a data set or allocates a model: :mod:`experiments.build` does,
from these parts; :mod:`experiments.resources` estimates a run from them before anything is allocated; the run
kinds (:mod:`experiments.workload_run`, :mod:`experiments.run`) and the experiments build on them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict

from sim.algorithms import AlgorithmSpec
from sim.base.errors import ConfigError
from sim.machine.network import PRESETS, NetworkSpec, get_preset
from sim.machine.topology import CLUSTER_PRESETS, ClusterSpec, get_cluster_preset

from .scenario import Scenario

__all__ = ["algorithm_specs", "build_network", "network_summary", "timeline_policy", "resolve_device",
           "resolve_workload", "timeline_clock", "compute_costs", "resolve_compute", "measured_selection"]


def algorithm_specs(sc: Scenario, k: int, G: int) -> list[AlgorithmSpec]:
    """The scenario's algorithms as :class:`~sim.algorithms.AlgorithmSpec`, in order: k selected coordinates
    per worker (sparse algorithms), the collectives and settings each algorithm reads from [compression]
    (:meth:`~sim.algorithms.Algorithm.scenario_settings`), its [algorithm.NAME] options, the training
    momentum and weight decay, the byte sizes, G ranks per node for the hierarchical collectives.
    Whole-model selection (a numerics run adds its layer split afterwards). Raises ConfigError as
    AlgorithmSpec does."""
    from sim.algorithms import get, resolve

    c, tr = sc.compression, sc.training
    out = []
    for entry in sc.algorithms:
        name, preset = resolve(entry)
        algo = get(name)
        opts = dict(sc.algorithm.get(name, {}))
        kw = dict(value_bytes=c.value_bytes, gpus_per_node=G)
        kw.update(algo.scenario_settings(c))
        if "collective" in opts:
            kw["collective"] = opts.pop("collective")
        if algo.sparse:
            kw.update(k=k, index_bytes=c.index_bytes)
        if algo.uses_seed:
            kw["seed"] = sc.seed
        if tr.momentum:
            kw["momentum"] = tr.momentum
        if tr.weight_decay:
            kw["weight_decay"] = tr.weight_decay
        kw.update(preset)
        out.append(AlgorithmSpec(name, options=tuple(opts.items()), **kw))
    return out


def build_network(cl, timing_only: bool = False) -> "NetworkSpec | ClusterSpec":
    """The network of a scenario's [cluster] table: a flat :class:`NetworkSpec` (presets 1GbE, 10GbE, IB100,
    or custom) or a hierarchical :class:`ClusterSpec` (a cluster preset, or ``hierarchical`` from the keys).
    Raises ConfigError when gpus_per_node does not divide P, for quantum_s > 0 on a hierarchical cluster, and
    for engine = fast unless ``timing_only`` (a run with numerics is simulated message by message; a workload
    timeline is timing only)."""
    if cl.engine == "fast" and not timing_only:
        raise ConfigError("cluster.engine = 'fast' simulates timing-only iterations (sparsim predict --simulate, "
                          "sparsim experiment scaling, a [workload] run); a run with numerics uses the message-level engine: valid "
                          "engine = auto or message here")
    if cl.network == "custom":
        return NetworkSpec.from_alpha_beta(cl.alpha_s, 1.0 / cl.bandwidth_Bps, cl.topology, cl.quantum_s)
    if cl.network in CLUSTER_PRESETS or cl.network == "hierarchical":
        if cl.quantum_s > 0:
            raise ConfigError(f"cluster.quantum_s = {cl.quantum_s} applies to flat networks only: valid 0 with "
                              f"network = {cl.network!r}")
        G = CLUSTER_PRESETS[cl.network].gpus_per_node if cl.network in CLUSTER_PRESETS else cl.gpus_per_node
        if cl.P % G:
            raise ConfigError(f"cluster.P = {cl.P} is not a multiple of gpus_per_node = {G} (network = {cl.network!r}): "
                              f"valid P = {G}, {2 * G}, {3 * G}, ...")
        if cl.network in CLUSTER_PRESETS:
            return get_cluster_preset(cl.network, cl.P)
        return ClusterSpec(cl.P // G, G, cl.intra, cl.intra_alpha_s, cl.intra_bandwidth_Bps, cl.alpha_s,
                           cl.bandwidth_Bps, cl.nics_per_node, cl.nodes_per_leaf, cl.oversubscription,
                           cl.spine_alpha_s, name="hierarchical")
    if cl.network not in PRESETS:
        raise ConfigError(f"cluster.network = {cl.network!r} is unknown: valid {', '.join(PRESETS)}, custom, "
                          f"{', '.join(CLUSTER_PRESETS)}, hierarchical")
    base = get_preset(cl.network)
    return NetworkSpec(base.topology, base.link_latency_s, base.link_bandwidth_Bps, cl.quantum_s)


def network_summary(net) -> dict:
    """summary.json's description of the network: its fields, and the end-to-end alpha (s) and beta (s/byte)
    of a message between nodes (``alpha_s``, ``beta_s_per_byte``) and, for a hierarchical cluster, inside one
    (``intra_alpha_s``, ``intra_beta_s_per_byte``), plus the engine the run used."""
    if isinstance(net, ClusterSpec):
        (ai, bi), (ae, be) = net.intra_alpha_beta(), net.inter_alpha_beta()
        return {**asdict(net), "P": net.P, "alpha_s": ae, "beta_s_per_byte": be, "intra_alpha_s": ai,
                "intra_beta_s_per_byte": bi, "engine": "message"}
    a, b = net.end_to_end_alpha_beta()
    return {**asdict(net), "alpha_s": a, "beta_s_per_byte": b, "engine": "message"}


def timeline_policy(sc: Scenario):
    """The :class:`sim.engine.timeline.TimelinePolicy` of the scenario's [workload] table: dense and sparse
    policies, DDP's bucket caps and Horovod's fusion threshold (MiB), its cycle time (s), whether the hook
    blocks backward, and for sparse_policy = "hybrid" the plan of ``workload.hybrid_plan``
    (:func:`sim.engine.hybrid.load_plan`; ConfigError for a missing or bad file, or a sparse algorithm of the scenario
    other than the plan's own or one no plan can run, :func:`sim.engine.hybrid.check_plan_algorithm` -- here, before a
    timing run's timeline or a [model] run's numerics is built, so both refuse the same runs in the same words; the
    model and buckets are checked when the timeline or the numerics meet the model)."""
    from sim.engine.timeline import TimelinePolicy

    w = sc.workload
    plan = None
    if w.sparse_policy == "hybrid":
        from sim.engine.hybrid import load_plan

        plan = load_plan(w.hybrid_plan)
        for entry, _name, _preset, algo in sc.running_algorithms():
            if algo.sparse:  # dense runs its dense_policy; every sparse algorithm runs the plan
                plan.check_algorithm(entry)
    return TimelinePolicy(dense=w.dense_policy, sparse=w.sparse_policy, bucket_cap_mb=w.bucket_cap_mb,
                          first_bucket_mb=w.first_bucket_mb, fusion_threshold_mb=w.fusion_threshold_mb,
                          cycle_time_s=w.cycle_time_s, blocking=w.hook_blocks_backward, plan=plan)


def resolve_device(sc: Scenario):
    """The DeviceModel of ``workload.device`` with ``workload.efficiency`` applied. Raises ConfigError for an
    unknown device."""
    from sim.workloads.devices import get_device

    w = sc.workload
    dev = get_device(w.device)
    if w.efficiency is not None:
        dev = dataclasses.replace(dev, efficiency=w.efficiency)
    return dev


def compute_costs(sc: Scenario, dev) -> dict:
    """The selection, merge, reduction and update costs of a run on device ``dev`` (its DeviceModel, or None: a
    [data] objective run, a measured layer table), and the compression kinds ``scan`` (bytes) and ``matmul``
    (FLOPs) where an algorithm of the run charges them (:meth:`experiments.scenario.Scenario.charged_kinds`):
    :meth:`experiments.scenario.ComputeCfg.costs` at the scenario's compression.value_bytes / index_bytes. A
    compute.*_coeff_s key set in the scenario wins over the device's model; with no device the unset keys take the
    gTop-k papers' model (2.19e-10 s x x log2 x, no merge, reduction or update), scan and matmul the P102-100
    preset's memory and FLOP models. Returns kind -> {"coeff_s", "scaling", "model", "source", "passes", "from",
    and "unit" for scan and matmul} (summary.json's ``resolved.compute_costs``; the run's summary prints one line per
    source naming the kinds it priced). Raises ConfigError when the device prices no cost for a kind the scenario
    leaves unset."""
    c = sc.compression
    return sc.compute.costs(dev, c.value_bytes, c.index_bytes, sc.charged_kinds())


def resolve_compute(sc: Scenario, dev):
    """The run's :class:`sim.machine.compute.ComputeModel`: the scenario's [compute] keys (forward_backward_s,
    jitter, stragglers) and seed, with the selection, merge, reduction and update costs of :func:`compute_costs` on
    ``dev`` (a DeviceModel, or None), and the scan (per byte) and matmul (per FLOP) costs where the run's
    algorithms charge them (elsewhere ComputeModel's 0: nothing of the run charges them). Every run kind builds its
    compute model here, so no cost key is read one way by one run and another way by another. Raises ConfigError
    as ComputeModel and compute_costs do."""
    from sim.machine.compute import ComputeModel

    costs = compute_costs(sc, dev)
    keys = type(sc.compute).COST_KEYS
    kw = {k: v for k, v in sc.compute.model_dump().items() if k not in keys.values()}
    kw.update({keys[kind]: c["coeff_s"] for kind, c in costs.items()})
    return ComputeModel(seed=sc.seed, select_scaling=costs["select"]["scaling"], **kw)


def resolve_workload(sc: Scenario):
    """The scenario's workload and device: (Workload, DeviceModel or None). Raises ConfigError for an unknown
    zoo model or device, a bad layer table, or a step whose forward + backward at training.batch_size on the device
    exceeds :data:`sim.workloads.model.MAX_STEP_S` (naming the table, the total and the range)."""
    from sim.workloads.tables import load_layer_table
    from sim.workloads.zoo import get_model

    w = sc.workload
    wl = get_model(w.model) if w.model else load_layer_table(w.table)
    if wl.measured:
        given = [f"workload.{k}" for k in w.changed_keys(("device", "efficiency"))]
        if given:
            raise ConfigError(f"{', '.join(given)}: the layer table {w.table!r} gives measured seconds, which no device "
                              "model rescales: valid only with a FLOP table or a zoo model")
        dev = None
    else:
        dev = resolve_device(sc)
    try:  # a step's compute within the numerics runs' limit at this batch and device (sim.workloads.model.MAX_STEP_S)
        wl.layer_times(sc.training.batch_size, dev)
    except ConfigError as err:
        raise ConfigError(f"workload.table = {w.table!r}: {err}" if w.table else str(err)) from None
    return wl, dev


def timeline_clock(sc: Scenario, workload, network, compute, time_budget_s: float):
    """The :class:`sim.engine.timeline.TimelineClock` of a [model] run: ``workload`` (the network's layer-wise
    :class:`sim.workloads.Workload`) on cluster.P ranks of ``network`` under the scenario's
    :func:`timeline_policy`, on ``workload.device`` (:func:`resolve_device`) with training.batch_size images per
    rank, the ``compute`` model (:class:`sim.machine.compute.ComputeModel`), cluster.engine, and a simulated time
    budget of ``time_budget_s`` seconds (0: none)."""
    from sim.engine.timeline import TimelineClock

    return TimelineClock(workload, sc.cluster.P, network, timeline_policy(sc), resolve_device(sc),
                         sc.training.batch_size, compute, sc.cluster.engine, time_budget_s)


def measured_selection(rows) -> dict | None:
    """What one algorithm's workers actually selected, from its metrics rows (dicts with ``iteration`` and
    ``selected_per_worker``, entries per worker per step, a float: the mean over the P workers): ``{"mean", "min",
    "max", "steps"}`` over the steps (iteration >= 1) that have a count, or None when none has one (a workload run,
    an empty run). It can be below the nominal sum of k_b (:func:`sim.algorithms.base.segment_k`): exact zeros of
    the error-feedback vector are never selected."""
    import math

    sel = [float(r["selected_per_worker"]) for r in rows if r.get("iteration", 0) >= 1
           and r.get("selected_per_worker") is not None and not math.isnan(float(r["selected_per_worker"]))]
    if not sel:
        return None
    return {"mean": sum(sel) / len(sel), "min": min(sel), "max": max(sel), "steps": len(sel)}
