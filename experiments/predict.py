"""``sparsim predict``: the communication time of each collective per iteration, in closed form and simulated.

:func:`predict_lines` makes the table line by line (the simulated rows as they are simulated, each with the wall
time this machine took): the closed forms of :func:`sim.engine.timing.closed_form_comm_s` on a flat network
(a preset, alpha and bandwidth, or a calibration file's [cluster]) or a hierarchical cluster preset, and with
``simulate`` the timing-only simulation of one iteration (:func:`sim.engine.timing.simulate_timing`) next to it.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

from sim.algorithms import REGISTRY, AlgorithmSpec, predict_columns, predict_default_columns
from sim.base.errors import SparsimError, check_range
from sim.engine.timing import closed_form_comm_s, resolve_engine, simulate_timing
from sim.machine.network import PRESETS, NetworkSpec, get_preset
from sim.machine.topology import CLUSTER_PRESETS, get_cluster_preset

from .resolve import build_network
from .scenario import load_scenario

__all__ = ["predict_lines", "MESSAGE_ENGINE_MAX_P"]

#: Largest P predict simulates message by message (beyond it a ring's events exhaust memory; the fast engine
#: gives the same times).
MESSAGE_ENGINE_MAX_P = 4096


def _check_readable_file(option: str, path: str) -> None:
    """SparsimError (one line) unless ``path`` is an existing regular file: a missing path, a folder and a device
    (/dev/null) or pipe each say which."""
    import os

    if not os.path.exists(path):
        raise SparsimError(f"{option} {path!r} does not exist: valid the path of a TOML file")
    if not os.path.isfile(path):
        kind = "a directory" if os.path.isdir(path) else "not a regular file (a device, a pipe or a socket)"
        raise SparsimError(f"{option} {path!r} is {kind}: valid the path of a TOML file")


def predict_lines(P: str | None, d: int, density: float, network: str | None, simulate: bool, engine: str | None,
                  collectives: str | None, alpha_s: float | None, bandwidth_Bps: float | None,
                  calibration: str | None) -> Iterator[str]:
    """The lines of ``sparsim predict`` (without newlines), one option per argument: ``P`` comma-separated worker
    counts (1..65536; None: 4..128, or G x 1..32 for a cluster preset of G GPUs per node), ``d`` parameters,
    ``density`` k/d in (0, 1], ``network`` a flat or cluster preset name (None: 1GbE, unless the network is given
    otherwise; a named preset together with ``alpha_s`` / ``bandwidth_Bps`` / ``calibration`` is an error, 1GbE
    included), ``simulate`` whether to simulate each
    collective too (``engine`` auto, fast or message; only with it), ``collectives`` comma-separated columns
    (None: every algorithm's main collectives), or a custom star network of ``alpha_s`` seconds and
    ``bandwidth_Bps`` bytes/s, or the [cluster] of the ``calibration`` file. Closed-form times in ms; with
    ``simulate``, simulated and closed-form times in s and the wall seconds of each simulation. Raises
    SparsimError (one line) for an unknown or inconsistent option, before the first line where it can."""
    check_range("d", d, 1, 10**12)
    check_range("density", density, 0, 1, lo_open=True)
    if engine is not None and not simulate:
        raise SparsimError(f"--engine {engine} chooses the engine of --simulate: valid only with --simulate")
    engine = engine or "auto"
    custom_given = alpha_s is not None or bandwidth_Bps is not None or calibration is not None
    if network is not None and custom_given:  # one or the other: a named preset is never silently replaced
        given = ", ".join(f"--{n} {v}" for n, v in (("alpha-s", alpha_s), ("bandwidth-Bps", bandwidth_Bps),
                                                     ("calibration", calibration)) if v is not None)
        raise SparsimError(f"--network {network} and {given} each name the network: give one of them")
    if network is None and not custom_given:
        network = "1GbE"
    if P is None:
        G = CLUSTER_PRESETS[network].gpus_per_node if network in CLUSTER_PRESETS else 1
        P = ",".join(str(G * m) for m in ((1, 2, 4, 8, 16, 32) if G > 1 else (4, 8, 16, 32, 64, 128)))
    try:
        Ps = [int(x) for x in P.split(",")]
    except ValueError:
        raise SparsimError(f"--P {P!r}: expected comma-separated integers 1 <= P <= 65536") from None
    for p in Ps:
        check_range("P", p, 1, 65536)
    custom = None
    if custom_given:
        if calibration is not None:
            if alpha_s is not None or bandwidth_Bps is not None:
                raise SparsimError("--calibration and --alpha-s / --bandwidth-Bps each name the network: give one")
            _check_readable_file("--calibration", calibration)
            cal = load_scenario(calibration)
            if "cluster" not in cal.model_fields_set:  # the schema's default [cluster] is 1 GbE, not a calibration
                raise SparsimError(f"--calibration {calibration}: the file has no [cluster] table: valid a scenario or "
                                   "`sparsim calibrate` output with [cluster] network = 'custom', alpha_s, bandwidth_Bps")
            custom = build_network(cal.cluster, timing_only=True)
            if not hasattr(custom, "end_to_end_alpha_beta"):
                raise SparsimError(f"--calibration {calibration}: its [cluster] is hierarchical; predict takes a "
                                   "flat network there (use --network with a cluster preset)")
            network = f"calibration {calibration}"
        else:
            if alpha_s is None or bandwidth_Bps is None:
                raise SparsimError("--alpha-s and --bandwidth-Bps go together: give both")
            check_range("--alpha-s", alpha_s, 0, 10)
            check_range("--bandwidth-Bps", bandwidth_Bps, 1, 1e15)
            custom = NetworkSpec.from_alpha_beta(alpha_s, 1.0 / bandwidth_Bps, "star", 0.0)
            network = "custom"
    hier = network in CLUSTER_PRESETS
    if custom is None and not hier and network not in PRESETS:
        raise SparsimError(f"--network {network!r} is unknown: valid {', '.join(PRESETS)}, {', '.join(CLUSTER_PRESETS)}")
    clusters = {p: get_cluster_preset(network, p) for p in Ps} if hier else {}
    flat_net = custom if custom is not None else (None if hier else get_preset(network))
    known = predict_columns(True)
    cols = predict_default_columns(hier) if collectives is None else [
        c.strip() for c in collectives.split(",") if c.strip()]
    if not cols:
        raise SparsimError(f"--collectives {collectives!r} names none: valid a comma-separated subset of "
                           f"{', '.join(known)} or ALGORITHM[:COLLECTIVE]")
    runs = {}
    for c in cols:
        if c in known:
            runs[c] = known[c]
        else:
            name, _, coll = c.partition(":")
            if name not in REGISTRY:
                raise SparsimError(f"--collectives: {c!r} is unknown: valid {', '.join(known)} or ALGORITHM[:COLLECTIVE] "
                                   f"with ALGORITHM one of {', '.join(REGISTRY)}")
            algo = REGISTRY[name]
            coll = coll or algo.collectives[0]
            if coll not in algo.collectives or coll == "backend_allreduce":
                valid = [x for x in algo.collectives if x != "backend_allreduce"]
                raise SparsimError(f"--collectives: {c!r}: collective {coll!r} is not one of {name}'s: valid "
                                   f"{', '.join(valid)}")
            runs[c] = (name, coll)
        if runs[c][1] == "hierarchical" and not hier:
            raise SparsimError(f"--collectives: {c} needs a cluster preset (--network {', '.join(CLUSTER_PRESETS)})")
    k = max(1, round(density * d))
    if hier:
        c0 = clusters[Ps[0]]
        (ai, bi), (ae, be) = c0.intra_alpha_beta(), c0.inter_alpha_beta()
        yield (f"{network}: {c0.gpus_per_node} GPUs per node ({c0.intra}), {c0.nics_per_node} NIC(s) per node; "
               f"intra alpha = {ai:.3g} s, beta = {bi:.3g} s/byte; inter alpha = {ae:.3g} s, beta = {be:.3g} s/byte")
        yield "closed forms of the flat collectives use the inter-node alpha and beta for every message"
        alpha, beta = ae, be
    else:
        alpha, beta = flat_net.end_to_end_alpha_beta()
        yield (f"d = {d}, k = {k}, alpha = {alpha:.3g} s, beta = {beta:.3g} s/byte" +
               ("" if simulate else "; times in ms"))

    def spec_of(c, p):
        alg, coll = runs[c]
        G = clusters[p].gpus_per_node if hier else 1
        return AlgorithmSpec(alg, k=k if REGISTRY[alg].sparse else None, collective=coll, gpus_per_node=G)

    if not simulate:
        if hier:
            yield f"d = {d}, k = {k}; times in ms"
        w = max(20, max(len(c) for c in cols) + 2)
        yield f"{'P':>6}" + "".join(f"{c:>{w}}" for c in cols)
        for p in Ps:
            cl = clusters.get(p)
            yield (f"{p:>6}" + "".join(f"{1e3 * closed_form_comm_s(spec_of(c, p), p, d, alpha, beta, cl):>{w}.3f}"
                                       for c in cols))
        return
    net = flat_net
    if resolve_engine(engine, clusters.get(Ps[0], net)) == "message" and max(Ps) > MESSAGE_ENGINE_MAX_P:
        raise SparsimError(f"--P {max(Ps)} with the message-level engine (every message an event; a ring at that P "
                           f"holds tens of GB of events): valid P <= {MESSAGE_ENGINE_MAX_P} with --engine message, "
                           "or --engine auto / fast (the same times)")
    if resolve_engine(engine, clusters.get(Ps[0], net)) == "message" and max(Ps) > 256:
        import logging

        logging.getLogger("sparsim.predict").warning(
            f"the message-level engine moves every message as an event; at P = {max(Ps)} a collective can take "
            "minutes (engine auto or fast gives the same times in seconds)")
    yield (f"d = {d}, k = {k}; simulated and closed-form communication time per iteration in s, "
           f"wall = seconds this machine took to simulate it (engine {engine})")
    w = max(20, max(len(c) for c in cols) + 2)
    yield f"{'P':>6}  {'collective':<{w}}{'simulated s':>14}{'closed form s':>15}{'sim/closed':>12}{'wall s':>9}"
    for p in Ps:
        for c in cols:
            spec = spec_of(c, p)
            t0 = time.perf_counter()
            sim_s = float(simulate_timing(spec, p, d, network=clusters.get(p, net), engine=engine).iter_s[0])
            wall = time.perf_counter() - t0
            cf = closed_form_comm_s(spec, p, d, alpha, beta, clusters.get(p))
            ratio = f"{sim_s / cf:.4f}" if cf > 0 else "-"  # P = 1: nothing to send
            yield f"{p:>6}  {c:<{w}}{sim_s:>14.6g}{cf:>15.6g}{ratio:>12}{wall:>9.3f}"
