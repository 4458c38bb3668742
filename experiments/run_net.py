"""The parts of ``sparsim run`` particular to a ``[model]`` scenario: a torch network trained on images.

The run itself is the ordinary numerics run (:mod:`experiments.build`, :mod:`experiments.run`): the network is the objective
(:class:`sim.workloads.nets.NetObjective`), the P workers' programs run on the lock-step driver, and each iteration's time
comes from the same network's layer-wise timeline on the scenario's cluster (:class:`sim.engine.timeline.TimelineClock`).
This module holds what only such a run needs: its data-size estimate and its summary.json section.
"""
from __future__ import annotations

import dataclasses

from .resolve import compute_costs
from .scenario import Scenario

__all__ = ["net_data_bytes", "net_resolved", "write_net_trace", "activation_bytes", "TORCH_NET_CLOCK"]

#: summary.json's ``resolved.clock`` of a [model] run on the torch backend (:func:`net_resolved`): the time columns
#: are measured, so the network's simulated timeline times nothing there.
TORCH_NET_CLOCK = ("measured wall time of the P torch processes (the backend's time columns); the [cluster] "
                   "network, the [compute] model and the [workload] device of the network's layer-wise timeline "
                   "time nothing on this backend: only training.time_budget_s uses that simulated clock, to run "
                   "each algorithm for the simulator's number of iterations; workload.sparse_policy still sets the "
                   "selection segments (numerics)")

#: Bytes of the torch runtime and the network's activations besides the data: ResNet-20 at P = 16 peaked at 1.29 GiB
#: against an estimate of 0.99 GiB with 512 MiB here (activations of the evaluation's 1000-image forwards and of two
#: workers' backward passes at once; docs/networks-benchmarks.md), so 1 GiB keeps the estimate an upper bound.
TORCH_RUNTIME_BYTES = 2**30


def net_data_bytes(ds, sc: Scenario) -> int:
    """Bytes a [model] run holds besides the workers' vectors: the images as uint8 and once in the training
    dtype (float32 or float64; train and test), the batched step's P x d gradient block (twice: the block and
    its copy), and the torch runtime with the networks' activations (:data:`TORCH_RUNTIME_BYTES`, measured)."""
    from sim.workloads.nets import NET_PARAMS

    w = 4 if sc.training.dtype == "float32" else 8
    pixels = ds.X_train.size + ds.X_test.size
    d = NET_PARAMS[sc.model.name]
    return int(pixels * (1 + w) + 2 * sc.cluster.P * d * w + activation_bytes(sc) + TORCH_RUNTIME_BYTES)


#: Elements autograd keeps per leaf-module output element of a training forward (the outputs, the inputs their
#: backward needs, the gradients flowing back, allocator slack). Measured on ResNet-20 in float64 at P = 2 (two loop
#: workers in flight on 2 cores): b = 200 peaked at 6.2 GB, b = 1000 at 23.9 GB; 5 x the leaf outputs (293,226 per
#: image) x 8 bytes x 2 x b gives 4.7 and 23.5 GB, plus the runtime allowance and the data 6.3 and 25.1 GB.
ACTIVATION_FACTOR = 5


def activation_bytes(sc: Scenario) -> int:
    """Bytes of the network's activations at the peak of a [model] run's gradient step: ACTIVATION_FACTOR x the
    elements all leaf modules output for one 1 x 28 x 28 image (one forward with hooks on the zoo network) x the
    dtype's size x the images in flight: P x b with ``model.gradients = "vmap"`` (one batched call), the loop's
    concurrent workers (:meth:`sim.workloads.nets.NetObjective._n_threads`: up to the cores, P and LOOP_MAX_THREADS) x b
    otherwise, and at least the evaluation's 1000-image forwards (no saved tensors: a quarter of the factor)."""
    import os

    from sim.workloads.nets import LOOP_MAX_THREADS, build_net, torch_or_error

    torch = torch_or_error()
    m = build_net(sc.model.name, dtype="float32")
    outs = []
    hooks = [mod.register_forward_hook(lambda _m, _i, o: outs.append(o.numel() if hasattr(o, "numel") else 0))
             for mod in m.modules() if not list(mod.children())]
    try:
        with torch.no_grad():
            m.eval()
            m(torch.zeros(1, 1, 28, 28))
    finally:
        for h in hooks:
            h.remove()
    w = 4 if sc.training.dtype == "float32" else 8
    P, b = sc.cluster.P, sc.training.batch_size
    conv = any(isinstance(x, torch.nn.modules.conv._ConvNd) for x in m.modules())
    vmap = sc.model.gradients == "vmap" or (sc.model.gradients == "auto" and not conv)
    in_flight = P * b if vmap else min(os.cpu_count() or 1, P, LOOP_MAX_THREADS) * b
    return int(ACTIVATION_FACTOR * sum(outs) * w * max(in_flight, 1000 / ACTIVATION_FACTOR))


def net_resolved(sc: Scenario, built, backend: str = "sim") -> dict:
    """summary.json's ``resolved`` additions for a [model] run: what times it (``clock``: the network's layer-wise
    timeline, or on ``backend`` "torch" :data:`TORCH_NET_CLOCK`), the network (parameters, tensors, layers,
    forward / backward seconds per iteration on the device), the data set, the timeline policy, the segments
    (per-bucket or per-layer selection; with the hybrid plan also their densities) and the time budget. built: the
    run's :class:`experiments.build.Built`."""
    wl, clock = built.workload, built.clock
    fwd, bwd = wl.layer_times(sc.training.batch_size, clock.device)
    ds = built.dataset
    segs = next((s.segments for s in built.specs if s.segments is not None), None)
    hyb = next((s.segment_densities for s in built.specs if s.segment_densities is not None), None)
    return {
        "clock": TORCH_NET_CLOCK if backend == "torch" else
                 "layer-wise timeline of the network on the cluster (sim.engine.timeline.TimelineClock); numerics on the "
                 "lock-step driver",
        "workload": {"name": wl.name, "parameters": wl.d, "tensors": len(wl.tensors), "layers": len(wl.layers),
                     "input": wl.input, "source": wl.source, "forward_s": float(fwd.sum()),
                     "backward_s": float(bwd.sum()),
                     "device": None if clock.device is None else dataclasses.asdict(clock.device)},
        "compute_costs": compute_costs(sc, clock.device),
        "data": {"name": ds.name, "path": ds.path, "n_train": int(ds.y_train.shape[0]),
                 "n_test": int(ds.y_test.shape[0]), "source": ds.source},
        "policy": dataclasses.asdict(clock.policy),
        "segments": list(segs) if segs is not None else None,
        # sparse_policy = "hybrid": each segment's density (null: a dense segment, the dense allreduce), flat order
        **({"segment_densities": list(hyb)} if hyb is not None else {}),
        # what the objective used: eval / test images (clamped to the data, eval rounded down to a multiple of b)
        # and the gradient mode that "auto" resolved to
        "objective_params": dict(built.objective.params),
        "time_budget_s": clock.time_budget_s or None,
    }


def write_net_trace(path, sc: Scenario, built, rows: list[dict]) -> bool:
    """Write the Chrome trace (``trace.json``, :func:`sim.engine.timeline.chrome_trace`) of a [model] run: iterations
    ``workload.trace_iterations`` of the first ``workload.trace_ranks`` ranks of every algorithm, on the same simulated
    clock as metrics.csv (the timeline is recomputed: it depends only on the spec, never on the values). Iterations
    after the run's last (a time budget can stop it early) are left out. Returns whether a file was written."""
    from sim.engine.timeline import chrome_trace

    w, clock = sc.workload, built.clock
    traces = {}
    for spec in built.specs:
        T = max((r["iteration"] for r in rows if r["algorithm"] == spec.label), default=0)
        its = [t for t in w.trace_iterations if t <= T]
        if not its:
            continue
        res = clock(spec, max(its), trace_iterations=its, trace_ranks=min(w.trace_ranks, clock.P))
        traces[spec.label] = res.timelines
    if not any(traces.values()):
        return False
    chrome_trace(traces, path)
    return True
