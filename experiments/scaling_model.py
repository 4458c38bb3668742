"""The models of the ICDCS 2019 scaling study: the published cases (:mod:`experiments.scaling_data`) simulated.

Model of one iteration on each worker (timing-only mode, :mod:`sim.engine.timing`: message sizes without data):

- ``forward_backward`` = batch / single-GPU throughput (s), from the released ICDCS scripts (docs/costs.md);
- ``select`` (sparse algorithms) = 2.19e-10 s * d log2 d, the authors' top-k time fit (ComputeModel default);
- the collective, round by round on the fast engine (``engine="auto"``, :mod:`sim.engine.fastsim`: the same
  simulated times as the message-level SimPy engine, thousands of ranks in seconds).

One row per case: :func:`simulate_case` (flat network, :data:`SCALING_COLUMNS`), :func:`simulate_cluster_case`
(the 4-GPU-node cluster, flat and hierarchical collectives, :data:`CLUSTER_COLUMNS`), :func:`simulate_overlap_case`
(the layer-wise timeline on the zoo models, :data:`OVERLAP_COLUMNS`) and the crossover searches
(:func:`crossover_row`, :data:`CROSSOVER_COLUMNS`), closed form and simulated. Scaling efficiency (the ICDCS
scripts' definition) = t_compute / t_iter(P), in %. :mod:`experiments.scaling` runs them and writes the report.
"""
from __future__ import annotations

import math
from functools import lru_cache

from sim.algorithms import AlgorithmSpec, get
from sim.base.errors import SparsimError
from sim.comm.costs import ring_allreduce_time, topk_allgather_time
from sim.machine.compute import ComputeModel
from sim.machine.network import get_preset
from sim.machine.topology import get_cluster_preset
from sim.workloads.devices import get_device
from sim.workloads.model import Workload

from .scaling_data import (CLUSTER, DENSITY, MAIN_VARIANTS, MODELS, NETWORK, PUBLISHED_P, SELECT_COEFF_S, VARIANTS,
                           ZOO_NAMES)

__all__ = ["CROSSOVER_P_MAX", "HIER_VARIANTS", "CLUSTER_VARIANTS", "SCALING_COLUMNS", "CROSSOVER_COLUMNS",
           "CLUSTER_COLUMNS", "OVERLAP_NETWORKS", "OVERLAP_CASES", "OVERLAP_COLUMNS", "variant_spec",
           "successor_variants", "network_alpha_beta", "rel_error", "simulate_case", "simulate_cluster_case",
           "icdcs_workload", "backward_share", "overlap_k", "simulate_overlap_case", "crossover_closed_form",
           "crossover_simulated", "crossover_rows", "crossover_row"]

#: Largest P searched by the closed-form crossover.
CROSSOVER_P_MAX = 65536
#: Hierarchical collectives (on :data:`CLUSTER` only): name -> (algorithm, collective, mask, value_bytes,
#: index_bytes); ``gpus_per_node`` comes from the cluster. ``<alg>_hier`` is the hierarchy-aware counterpart of
#: ``<alg>``: dense = intra-node reduce-scatter, inter-node ring per local rank, intra-node allgather;
#: topk = intra-node gather, inter-node Bruck allgather of node blocks, intra-node broadcast; gtopk =
#: intra-node tree reduce, inter-node recursive doubling, intra-node broadcast (:mod:`sim.comm.collectives`).
HIER_VARIANTS = {
    "dense_hier": ("dense", "hierarchical", "exact", 4, 0),
    "topk_hier": ("topk", "hierarchical", "exact", 4, 4),
    "gtopk_hier": ("gtopk", "hierarchical", "exact", 4, 4),
}
#: Variants simulated on :data:`CLUSTER`: the released code's flat algorithms, then the hierarchical ones.
CLUSTER_VARIANTS = MAIN_VARIANTS + tuple(HIER_VARIANTS)
#: ``scaling.csv`` (:func:`simulate_case`): one row per (model, variant, P) on the flat network; times in s.
SCALING_COLUMNS = ("model", "variant", "algorithm", "collective", "mask", "element_bytes", "d", "k", "batch", "P",
                   "iterations", "t_iter_s", "t_compute_s", "t_select_s", "t_comm_s", "comm_closed_form_s",
                   "comm_rel_diff", "efficiency_pct", "per_worker_samples_per_s", "messages", "bytes")
#: ``crossover.csv`` (:func:`crossover_row`): one row per (model, density).
CROSSOVER_COLUMNS = ("model", "d", "density", "k", "crossover_closed_form", "crossover_simulated", "agree",
                     "sim_p_max", "sim_evaluated_P", "crossover_iter_closed_form", "note")
#: ``cluster.csv``: :data:`SCALING_COLUMNS` plus the cluster (preset name, nodes, GPUs per node). Its
#: comm_closed_form_s is the sim.comm.costs closed form: for the flat algorithms inside one node (P <= G, intra-node
#: alpha and beta, exact there) and for the hierarchical collectives (:func:`sim.engine.timing.closed_form_comm_s`
#: with the cluster: intra- and inter-node alpha and beta; for the dense allreduce with GPUs sharing a NIC a
#: bound, so comm_rel_diff shows how far the simulated queueing on the NIC is from it); empty for the flat
#: algorithms across nodes (no closed form models their NIC queueing).
CLUSTER_COLUMNS = SCALING_COLUMNS + ("cluster", "nodes", "gpus_per_node")


def variant_spec(variant: str, k: int, gpus_per_node: int = 1) -> AlgorithmSpec:
    """The :class:`AlgorithmSpec` of a :data:`VARIANTS` or :data:`HIER_VARIANTS` name with k selected
    elements per worker; ``gpus_per_node`` (G) is set on the hierarchical ones. Raises SparsimError for an
    unknown name (listing the valid ones)."""
    try:
        alg, coll, mask, vb, ib = {**VARIANTS, **HIER_VARIANTS}[variant]
    except KeyError:
        if variant not in successor_variants():
            raise SparsimError(f"variant = {variant!r} is unknown: valid "
                               f"{', '.join([*VARIANTS, *HIER_VARIANTS, *successor_variants()])}") from None
        algo = get(variant)  # a successor: its default collective and options, fp32 values and int32 indices
        alg, coll, mask, vb, ib = variant, algo.collectives[0], "exact", 4, 4
    G = gpus_per_node if coll == "hierarchical" else 1
    if not get(alg).sparse:
        return AlgorithmSpec(alg, collective=coll, value_bytes=vb, gpus_per_node=G)
    return AlgorithmSpec(alg, k=k, collective=coll, mask=mask, value_bytes=vb, index_bytes=ib, gpus_per_node=G)


def successor_variants() -> tuple[str, ...]:
    """The registered algorithms the paper did not have (every one not used by :data:`VARIANTS`), simulated as
    variants of their own name at their default collective and options on the paper's testbed (successors.csv)."""
    from sim.algorithms import REGISTRY

    used = {v[0] for v in VARIANTS.values()}
    return tuple(n for n in REGISTRY if n not in used)


def network_alpha_beta() -> tuple[float, float]:
    """(alpha in s, beta in s/byte) end to end of a message on the published runs' flat network (:data:`NETWORK`)."""
    return get_preset(NETWORK).end_to_end_alpha_beta()


def _paper_compute(**kw) -> ComputeModel:
    """The papers' compute model: their measured Top-k selection fit (:data:`SELECT_COEFF_S`), and for the compressors
    that run no Top-k (rand-k's gathers, Gaussian-k's passes, DGC's filter, PowerSGD's products) the P102-100's
    memory and FLOP models (:meth:`sim.workloads.model.DeviceModel.costs`, the papers' GPU); kw: other fields."""
    c = get_device("P102-100").costs(kinds=("scan", "matmul"))
    return ComputeModel(select_coeff_s=SELECT_COEFF_S, scan_coeff_s=c["scan"].coeff_s,
                        matmul_coeff_s=c["matmul"].coeff_s, **kw)


def rel_error(sim: float, pub: float) -> float:
    """(sim - pub) / pub: a simulated value's relative error against the published one (a fraction; pub != 0)."""
    return (sim - pub) / pub


def _simulate_row(model: str, variant: str, spec: AlgorithmSpec, P: int, network, iterations: int) -> dict:
    """Simulate ``spec`` for ``model`` on ``network`` (timing-only, engine auto) and return the row fields both
    tables share (:data:`SCALING_COLUMNS` without the closed form): times in s, efficiency in %."""
    from sim.engine.timing import simulate_timing

    m = MODELS[model]
    fb = m.compute_s()
    cm = _paper_compute(forward_backward_s=fb)
    res = simulate_timing(spec, P, m.d, network=network, compute=cm, batch_size=m.batch, iterations=iterations,
                          engine="auto")
    t_iter = float(res.iter_s.mean())
    return {"model": model, "variant": variant, "algorithm": spec.name, "collective": spec.collective,
            "mask": spec.mask if spec.algorithm.uses_mask else "",
            "element_bytes": spec.value_bytes + (spec.index_bytes if spec.algorithm.sparse else 0),
            "d": m.d, "k": m.k if spec.algorithm.sparse else m.d, "batch": m.batch, "P": P, "iterations": iterations,
            "t_iter_s": t_iter, "t_compute_s": res.compute_s, "t_select_s": res.compress_s,
            "t_comm_s": t_iter - res.compute_s - res.compress_s,
            "efficiency_pct": 100.0 * fb / t_iter, "per_worker_samples_per_s": m.batch / t_iter,
            "messages": res.messages, "bytes": res.bytes}


def _with_closed_form(row: dict, cf: float | None) -> dict:
    """``row`` plus comm_closed_form_s (s) and comm_rel_diff = (t_comm - closed form) / closed form."""
    return {**row, "comm_closed_form_s": cf, "comm_rel_diff": None if not cf else (row["t_comm_s"] - cf) / cf}


def simulate_case(model: str, variant: str, P: int, iterations: int = 1) -> dict:
    """Simulate one (model, variant, P) in timing-only mode; return its :data:`SCALING_COLUMNS` row.

    t_iter_s: simulated synchronous iteration time (s, mean over iterations; they are identical: the
    model is deterministic); t_compute_s = batch / throughput; t_select_s = 2.19e-10 d log2 d (sparse);
    t_comm_s = t_iter - t_compute - t_select (critical-path communication), compared with the sim.comm.costs
    closed form (comm_rel_diff). efficiency_pct = 100 t_compute / t_iter.
    """
    from sim.engine.timing import closed_form_comm_s

    m = MODELS[model]
    spec = variant_spec(variant, m.k)
    row = _simulate_row(model, variant, spec, P, get_preset(NETWORK), iterations)
    out = _with_closed_form(row, closed_form_comm_s(spec, P, m.d, *network_alpha_beta()))
    out["comm_rel_diff"] = out["comm_rel_diff"] or 0.0
    return out


def simulate_cluster_case(model: str, variant: str, P: int, iterations: int = 1, cluster: str = CLUSTER) -> dict:
    """Simulate one (model, variant, P) on the ``cluster`` preset with P ranks; return its :data:`CLUSTER_COLUMNS` row.

    variant: one of :data:`CLUSTER_VARIANTS` (flat algorithms running over the hierarchy, or the hierarchical
    collectives with G = the preset's GPUs per node). Same compute model and efficiency as
    :func:`simulate_case`; t_comm_s = t_iter - t_compute - t_select (s). comm_closed_form_s: see
    :data:`CLUSTER_COLUMNS` (None for the flat algorithms across nodes). Raises ConfigError when P is not a
    multiple of the preset's GPUs per node.
    """
    from sim.engine.timing import closed_form_comm_s

    m = MODELS[model]
    cl = get_cluster_preset(cluster, P)
    G = cl.gpus_per_node
    spec = variant_spec(variant, m.k, G)
    row = _simulate_row(model, variant, spec, P, cl, iterations)
    if spec.collective == "hierarchical":
        cf = closed_form_comm_s(spec, P, m.d, 0.0, 0.0, cluster=cl)
    elif cl.nodes == 1:  # one node: every message GPU to GPU on the intra-node fabric, uncontended
        cf = closed_form_comm_s(spec, P, m.d, *cl.intra_alpha_beta())
    else:
        cf = None
    return {**_with_closed_form(row, cf), "cluster": cluster, "nodes": cl.nodes, "gpus_per_node": G}


#: Network models of ``overlap.csv``: "flat" (:data:`NETWORK`, every rank on its own port) and "cluster"
#: (the plan's :mod:`sim.machine.topology` preset, :data:`CLUSTER` by default, with P ranks).
OVERLAP_NETWORKS = ("flat", "cluster")
#: (algorithm, timeline policy) pairs of ``overlap.csv``: dense with DDP's default buckets overlapped with
#: backward ("ddp") and as one allreduce after backward ("none", the model of ``scaling.csv``); Top-k and
#: gTop-k with the released code's policy ("model": one top-k over the whole gradient after backward).
OVERLAP_CASES = (("dense", "ddp"), ("dense", "none"), ("topk", "model"), ("gtopk", "model"))
#: ``overlap.csv``, one row per (model, P, network, algorithm, policy): buckets = communication operations
#: per iteration; t_iter_s and exposed_comm_s (iteration time - compute, s) and overlap_ratio (1 - exposed /
#: (comm + selection), in [0, 1]) from :func:`sim.engine.timeline.simulate_timeline`; efficiency_pct = 100
#: t_compute / t_iter; published_pct (the same algorithm's published efficiency, %) and rel_error =
#: (efficiency - published) / published, empty where nothing was published.
OVERLAP_COLUMNS = ("model", "P", "network", "algorithm", "policy", "buckets", "t_iter_s", "exposed_comm_s",
                   "overlap_ratio", "efficiency_pct", "published_pct", "rel_error")


@lru_cache(maxsize=None)
def icdcs_workload(model: str) -> Workload:
    """The zoo model of ICDCS ``model`` (:data:`ZOO_NAMES`) with per-layer seconds at the paper's batch.

    Tensors, layers and gradient-ready order are the zoo's (exact parameter counts). Each layer's forward and
    backward seconds are its share of the zoo's FLOPs per sample (forward + backward over all layers) times
    the published single-GPU compute time :meth:`ModelSpec.compute_s` (s, batch / samples per s, the released
    ICDCS scripts), so that forward + backward over all layers equals it; ``measured_batch`` = the model's
    batch. Layers with 0 FLOPs (BatchNorm, ReLU, pooling as the zoo counts them) get 0 s. Raises SparsimError
    for a model without a zoo counterpart.
    """
    try:
        zname = ZOO_NAMES[model]
    except KeyError:
        raise SparsimError(f"model = {model!r} has no zoo workload: valid {', '.join(ZOO_NAMES)}") from None
    from sim.workloads import LayerCost, get_model

    m = MODELS[model]
    z = get_model(zname)
    flops = sum(l.forward_flops + l.backward_flops for l in z.layers)
    s = m.compute_s() / flops  # seconds per FLOP-per-sample at the paper's batch
    layers = tuple(LayerCost(l.name, l.forward_flops, l.backward_flops, forward_s=l.forward_flops * s,
                             backward_s=l.backward_flops * s) for l in z.layers)
    return Workload(f"{z.name} ({model})", layers, z.tensors, measured_batch=m.batch, input=z.input,
                    source=f"{z.source}; layer seconds = FLOP share x {m.batch} / {m.samples_per_s} samples/s "
                           "(ICDCS scripts)", ready_order=z.ready_order)


def backward_share(model: str) -> float:
    """Backward seconds / (forward + backward) of :func:`icdcs_workload` (the zoo's FLOP ratio)."""
    w = icdcs_workload(model)
    b = sum(l.backward_s for l in w.layers)
    return b / (b + sum(l.forward_s for l in w.layers))


def overlap_k(model: str) -> int:
    """k of the overlap cases: round(DENSITY x the zoo model's exact d) (>= 1)."""
    return max(1, round(DENSITY * icdcs_workload(model).d))


def _overlap_network(network: str, P: int, cluster: str):
    if network == "flat":
        return get_preset(NETWORK)
    if network == "cluster":
        return get_cluster_preset(cluster, P)
    raise SparsimError(f"network = {network!r} is unknown: valid {', '.join(OVERLAP_NETWORKS)}")


def simulate_overlap_case(model: str, network: str, algorithm: str, policy: str, P: int, iterations: int = 1,
                          cluster: str = CLUSTER) -> dict:
    """Simulate one (model, network, algorithm, policy, P) on the layer-wise timeline; return its
    :data:`OVERLAP_COLUMNS` row.

    Workload :func:`icdcs_workload` (zoo tensors, FLOP-share layer seconds summing to the published compute
    time), k = :func:`overlap_k`; the released code's flat algorithms (:data:`VARIANTS` dense ring, Top-k
    Bruck allgather, gTop-k binomial tree; 4 + 4 bytes per sparse element) on ``network`` ("flat": the 1 GbE
    preset; "cluster": ``cluster`` with P ranks); selection = :data:`SELECT_COEFF_S` x log2 x seconds over the
    x elements of an operation (whole model here); :func:`sim.engine.timeline.simulate_timeline`, engine auto.
    (algorithm, policy) must be one of :data:`OVERLAP_CASES`. Times in s; efficiency_pct = 100
    :meth:`ModelSpec.compute_s` / t_iter (the ICDCS definition, as :func:`simulate_case`). Raises
    SparsimError for an unknown network or (algorithm, policy) pair, ConfigError for a P the cluster rejects.
    """
    from sim.engine.timeline import TimelinePolicy, simulate_timeline

    if (algorithm, policy) not in OVERLAP_CASES:
        raise SparsimError(f"(algorithm, policy) = ({algorithm!r}, {policy!r}) is not simulated: valid "
                           + ", ".join(f"({a}, {p})" for a, p in OVERLAP_CASES))
    m = MODELS[model]
    net = _overlap_network(network, P, cluster)
    spec = variant_spec(algorithm, overlap_k(model))
    pol = TimelinePolicy(sparse=policy) if spec.algorithm.sparse else TimelinePolicy(dense=policy)
    res = simulate_timeline(spec, icdcs_workload(model), P, network=net, policy=pol, batch_size=m.batch,
                            compute=_paper_compute(), iterations=iterations, engine="auto")
    t_iter = float(res.iter_s.mean())
    eff = 100.0 * m.compute_s() / t_iter
    pub = m.published[algorithm][PUBLISHED_P.index(P)] if P in PUBLISHED_P else None
    return {"model": model, "P": P, "network": network, "algorithm": algorithm, "policy": policy,
            "buckets": len(res.buckets), "t_iter_s": t_iter, "exposed_comm_s": float(res.exposed_comm_s.mean()),
            "overlap_ratio": float(res.overlap_ratio.mean()), "efficiency_pct": eff, "published_pct": pub,
            "rel_error": None if pub is None else rel_error(eff, pub),
            # not in overlap.csv: what the row was simulated with (s, elements)
            "t_compute_s": float(res.compute_s.mean()), "comm_s": float(res.comm_s.mean()),
            "compress_s": float(res.compress_s.mean()), "d": icdcs_workload(model).d,
            "k": spec.k if spec.algorithm.sparse else None, "cluster": cluster if network == "cluster" else ""}


def crossover_closed_form(d: int, k: int, alpha: float, beta: float, p_max: int = CROSSOVER_P_MAX,
                          select_s: float = 0.0) -> int | None:
    """Smallest integer P in [2, p_max] where Top-k allgather (+ ``select_s``) is slower than dense ring allreduce.

    Times from :mod:`sim.comm.costs` (ceil(lg P) alpha + (P-1) k 8 beta vs 2(P-1)(alpha + ceil(d/P) 4 beta), s);
    None if Top-k is never slower up to p_max. ``select_s`` > 0 compares iteration times instead (the top-k
    selection is the only other difference; forward/backward cancels).
    """
    for P in range(2, p_max + 1):
        if select_s + topk_allgather_time(P, k, alpha, beta) > ring_allreduce_time(P, d, alpha, beta):
            return P
    return None


def _sim_comm(spec: AlgorithmSpec, P: int, d: int) -> float:
    """Simulated time (s) of ``spec``'s collective alone (zero compute) on P ranks of the flat network."""
    from sim.engine.timing import simulate_timing

    return float(simulate_timing(spec, P, d, network=get_preset(NETWORK), engine="auto").iter_s[0])


def crossover_simulated(d: int, k: int, p_max: int, dense_cache: dict | None = None) -> tuple[int | None, list[int]]:
    """Smallest P <= p_max where the *simulated* Top-k allgather is slower than the simulated dense ring.

    Timing-only simulation (fast engine, exact) of the two collectives alone (zero compute) on the flat
    network. Search: the powers of two 2, 4, ... up to p_max (and p_max); then, between the last P where
    Top-k is not slower (lo) and the first where it is (hi), by simulation: the first integer at or above
    the root of the chord through (lo, f(lo)) and (hi, f(hi)), f = t_topk - t_dense, and its neighbour
    across the root (f is nearly linear inside a power-of-two bracket, so this usually closes the bracket
    in two or four simulations); a bisection step whenever a chord step fails to halve the bracket.
    Assumes one sign change in the bracket, which the closed forms show for these models.
    dense_cache: {P: simulated dense ring s} for this d, shared between searches at other densities (the
    ring does not depend on k); filled here. Returns (crossover or None, the P simulated, ascending).
    """
    dense, top = variant_spec("dense", k), variant_spec("topk", k)
    dc = {} if dense_cache is None else dense_cache
    diff: dict[int, float] = {}

    def f(P):
        if P not in diff:
            if P not in dc:
                dc[P] = _sim_comm(dense, P, d)
            diff[P] = _sim_comm(top, P, d) - dc[P]
        return diff[P]

    grid = []
    P = 2
    while P < p_max:
        grid.append(P)
        P *= 2
    grid.append(p_max)
    lo, hi = 1, None
    for P in grid:
        if f(P) > 0:
            hi = P
            break
        lo = P
    if hi is None:
        return None, sorted(diff)
    chord = lo >= 2  # f(1) is not simulated (no communication at P = 1)
    while hi - lo > 1:
        width = hi - lo
        if chord:
            flo, fhi = f(lo), f(hi)
            m = lo + math.ceil((hi - lo) * -flo / (fhi - flo)) if fhi > flo else (lo + hi) // 2
            m = min(max(m, lo + 1), hi - 1)
            probes = (m, m - 1) if f(m) > 0 else (m, m + 1)
        else:
            probes = ((lo + hi) // 2,)
        for q in probes:
            if lo < q < hi:
                if f(q) > 0:
                    hi = q
                else:
                    lo = q
        chord = 2 * (hi - lo) <= width
    return hi, sorted(diff)


def crossover_rows(model: str, densities: tuple[float, ...], sim_p_max: int) -> list[dict]:
    """The :data:`CROSSOVER_COLUMNS` rows of ``model`` at each density, the simulated dense ring shared."""
    cache: dict[int, float] = {}
    return [crossover_row(model, dens, sim_p_max, cache) for dens in densities]


def crossover_row(model: str, density: float, sim_p_max: int, dense_cache: dict | None = None) -> dict:
    """The :data:`CROSSOVER_COLUMNS` row of ``model`` at ``density`` (k = round(density d), 4 + 4 bytes).
    dense_cache: see :func:`crossover_simulated`."""
    m = MODELS[model]
    k = max(1, round(density * m.d))
    a, b = network_alpha_beta()
    cf = crossover_closed_form(m.d, k, a, b)
    sel = SELECT_COEFF_S * m.d * math.log2(m.d)
    cf_iter = crossover_closed_form(m.d, k, a, b, select_s=sel)
    sim, evaluated = crossover_simulated(m.d, k, sim_p_max, dense_cache)
    if cf is not None and cf <= sim_p_max:
        agree = sim == cf
        note = "simulated bisection and closed form"
    else:
        agree = sim is None
        note = (f"beyond the simulated range: simulation finds none up to P = {sim_p_max}"
                + ("" if cf is not None else f"; closed form none up to P = {CROSSOVER_P_MAX}"))
    return {"model": model, "d": m.d, "density": density, "k": k, "crossover_closed_form": cf,
            "crossover_simulated": sim, "agree": agree, "sim_p_max": sim_p_max,
            "sim_evaluated_P": " ".join(map(str, evaluated)), "crossover_iter_closed_form": cf_iter, "note": note}
