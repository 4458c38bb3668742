"""A scenario on the torch backend: the checks before it starts, the per-rank job, the local launch and the
summary's backend entry.

Local runs (``sparsim run --backend torch --nproc P``, :func:`experiments.run.run_scenario`) spawn P processes
through :func:`launch_scenario` (:func:`sim.distributed.backend.launch_local`), each running
:func:`scenario_job`; on several machines torchrun starts one process per rank (:mod:`experiments.torch_run`),
each running the same job. Every rank builds the same scenario (deterministic from its seed) and runs each
algorithm with :func:`sim.distributed.backend.run_worker`; rank 0 returns the metrics rows.
"""
from __future__ import annotations

from sim.base.errors import ConfigError, SparsimError

from .build import build
from .scenario import Scenario

__all__ = ["check_torch", "torch_version", "torch_backend_info", "check_torch_settings", "launch_scenario",
           "scenario_job", "run_built", "torch_unused_keys", "check_backend_keys", "TORCH_UNUSED_WHY"]

#: Why a torch run records keys as unused (summary.json ``backend.unused_keys``; docs/scenarios.md).
TORCH_UNUSED_WHY = ("the torch backend measures its own network and compute (wall time of real processes), so the "
                    "simulator's network and compute model time nothing; kept in summary.json's scenario so that the "
                    "same scenario reruns on the simulator")


def check_torch(what: str = "--backend torch") -> None:
    """Raise ConfigError (one line: ``WHAT needs PyTorch`` and the extra that installs it) when torch cannot be
    imported; ``what`` names the command or option that needs it."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} needs PyTorch: pip install -e '.[torch]' in the clone (torch==2.13.0)") from None


def torch_version() -> str | None:
    """torch's version string, None when torch is not installed."""
    try:
        import torch

        return torch.__version__
    except ImportError:  # pragma: no cover
        return None


def torch_backend_info(sc: Scenario, nproc: int, *, launcher: str) -> dict:
    """The ``backend`` entry of a torch run's summary.json: the scenario's [torch] settings, the number
    of processes, the launcher ("sparsim run" or "torchrun"), torch's version, the scenario keys this backend does
    not read (``unused_keys``, dotted key -> value, :func:`torch_unused_keys`, and ``unused_why``) and what the time
    columns mean."""
    t = sc.torch
    return {"name": "torch", "launcher": launcher, "dist_backend": t.dist_backend, "nproc": nproc,
            "timeout_s": t.timeout_s, "stall_timeout_s": t.stall_timeout_s, "backend_allreduce": t.backend_allreduce,
            "torch": torch_version(), "unused_keys": torch_unused_keys(sc), "unused_why": TORCH_UNUSED_WHY,
            "time_columns": "measured wall time per rank (s), averaged over ranks; iter_time_s = the slowest rank's "
                            "step time, sim_time_s = their running sum"}


def torch_unused_keys(sc: Scenario) -> dict[str, object]:
    """The keys of a torch run's summary.json scenario (:func:`experiments.scenario.used_keys_dump` with backend
    "torch") that the torch backend does not read, dotted key -> value: the simulator's network (every [cluster] key
    but P; cluster.network and gpus_per_node stay used where an algorithm runs a hierarchical collective, whose
    ranks per node they give) and its compute model (every [compute] key); in a [model] run also the timeline-only
    [workload] keys (device, efficiency, Horovod's fusion, hook_blocks_backward, the trace). None of them in a
    [model] run with training.time_budget_s, whose simulated clock (that network, compute model and device) sets
    each algorithm's iterations. The documented rule for keys shared between the backends (docs/scenarios.md)."""
    from .scenario import used_keys_dump

    if sc.model.name and sc.training.time_budget_s:
        return {}
    dump = used_keys_dump(sc, "torch")
    hier = False
    for entry, name, preset, algo in sc.running_algorithms():
        coll = sc.algorithm.get(name, {}).get("collective") or algo.scenario_settings(sc.compression).get(
            "collective", algo.collectives[0])
        hier = hier or coll == "hierarchical"
    keep = {"P", "network", "gpus_per_node"} if hier else {"P"}
    out = {f"cluster.{k}": v for k, v in dump.get("cluster", {}).items() if k not in keep}
    out.update({f"compute.{k}": v for k, v in dump.get("compute", {}).items()})
    if sc.model.name:
        out.update({f"workload.{k}": v for k, v in dump.get("workload", {}).items()
                    if k in ("device", "efficiency", "fusion_threshold_mb", "cycle_time_s", "hook_blocks_backward",
                             "trace_iterations", "trace_ranks")})
    return out


def check_backend_keys(sc: Scenario, backend: str) -> None:
    """The keys one backend does not read: on ``backend`` "sim" a [torch] key set away from its default is a
    ConfigError (one line naming it and --backend torch, which reads it); on "torch" the simulator's network and
    compute keys that the scenario sets away from their defaults are logged (a warning naming them) and recorded
    as unused (:func:`torch_unused_keys`, summary.json ``backend.unused_keys``), since one scenario serves both."""
    if backend != "torch":
        given = sc.torch.changed_keys(type(sc.torch).model_fields)
        if given:
            flags = {"timeout_s": " (--timeout)", "dist_backend": " (--dist-backend)",
                     "backend_allreduce": " (--backend-allreduce)"}
            raise ConfigError(f"{', '.join('torch.' + k + flags.get(k, '') for k in given)}: used only with --backend "
                              "torch (the [torch] table sets up the real backend's processes; this run is simulated)")
        return
    unused = torch_unused_keys(sc)
    given = []  # those the scenario sets: a cost key when not unset, the others away from their defaults
    for dotted in unused:
        table, key = dotted.split(".", 1)
        cfg = getattr(sc, table)
        cost_key = table == "compute" and key in type(cfg).COST_KEYS.values()
        if (getattr(cfg, key) is not None) if cost_key else bool(cfg.changed_keys((key,))):
            given.append(dotted)
    if given:
        import logging

        logging.getLogger("sparsim").warning(
            "%s: unused by --backend torch, which measures its own network and compute; recorded in summary.json "
            "as backend.unused_keys", ", ".join(given))


def check_torch_settings(sc: Scenario) -> None:
    """Refuse, before any rank starts, a torch run this machine cannot do: ConfigError (one line) when torch is
    missing, for torch.dist_backend = "nccl" or torch.select_device = "cuda" without a visible CUDA GPU, and for
    torch.backend_allreduce without dense among the algorithms; logs the simulator's keys the scenario sets that
    this backend does not read (:func:`check_backend_keys`)."""
    check_torch()
    check_backend_keys(sc, "torch")
    if sc.torch.dist_backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("torch.dist_backend = 'nccl' (--dist-backend) needs a CUDA GPU and none is "
                              "visible: use gloo")
    if sc.torch.select_device == "cuda":
        from sim.distributed.backend import resolve_select_device

        resolve_select_device("cuda")  # ConfigError now, before any rank starts, when no GPU is visible
    if sc.torch.backend_allreduce and "dense" not in sc.algorithms:
        raise ConfigError("torch.backend_allreduce (--backend-allreduce) needs dense among the algorithms")


def launch_scenario(sc: Scenario, tmp) -> list[dict]:
    """Run ``sc`` on cluster.P local torch processes (:func:`sim.distributed.backend.launch_local`, each running
    :func:`scenario_job`, with the scenario's [torch] timeout_s, stall_timeout_s and dist_backend) and return rank
    0's metrics rows (every algorithm in order). When a rank fails, writes ``tmp/error.txt`` (the error and the
    ranks' logs; ``tmp`` is the run's partial directory) and raises :class:`sim.distributed.backend.WorkerFailure`."""
    from sim.distributed.backend import WorkerFailure, launch_local

    try:
        results = launch_local(sc.cluster.P, scenario_job, (sc.model_dump(),),
                               timeout_s=sc.torch.timeout_s, backend=sc.torch.dist_backend,
                               stall_timeout_s=sc.torch.stall_timeout_s or None)
    except WorkerFailure as err:  # the terminal gets one line; error.txt also keeps the ranks' logs
        (tmp / "error.txt").write_text(f"{err}\n" + (f"\n{err.log}" if err.log else ""))
        raise
    return results[0]


def scenario_job(ctx, scenario_dump: dict) -> list | None:
    """Run every algorithm of a scenario as rank ``ctx.rank`` (a :class:`sim.distributed.backend.DistContext`).

    scenario_dump: ``Scenario.model_dump()`` (validated again here); dense uses
    torch.distributed.all_reduce when its ``torch.backend_allreduce`` is true; each rank makes its Top-k selections
    where ``torch.select_device`` says (its GPU or the CPU, the same indices). Returns on rank 0 the metrics rows of all algorithms in order
    (list of dicts), None on the other ranks. Raises ConfigError if cluster.P differs from the world size.
    """
    sc = Scenario.model_validate(scenario_dump)
    if sc.cluster.P != ctx.P:
        raise ConfigError(f"cluster.P = {sc.cluster.P} differs from the {ctx.P} launched processes: they must be equal")
    return run_built(ctx, sc, build(sc))


def run_built(ctx, sc, built) -> list | None:
    """:func:`scenario_job`'s body once the scenario is built: every algorithm of ``built.specs`` as rank
    ``ctx.rank``, each for ``training.iterations`` iterations or, with a [model] run's ``training.time_budget_s``,
    for the iterations the simulator runs within that budget on its clock (the network's layer-wise timeline). Returns
    rank 0's metrics rows (list of dicts), None on the other ranks."""
    from sim.distributed.backend import resolve_select_device, run_worker

    rows = []
    for spec in built.specs:
        T = sc.training.iterations
        if built.clock is not None and built.clock.time_budget_s:  # the simulator's iterations within the budget
            timeline = built.clock(spec, T)
            T = built.clock.iterations_within(timeline)
            if T < 1:  # the simulator's own refusal (sim.engine.runner.run_algorithm), on every rank
                raise SparsimError(f"training.time_budget_s = {built.clock.time_budget_s:g} s is out of range for "
                                   f"{spec.label}: its first iteration alone takes {timeline.iter_s[0]:.6g} s of "
                                   "simulated time: valid budget >= that")
        res = run_worker(ctx.rank, ctx.P, spec, built.workers, T=T, lr=built.lr, x0=built.x0,
                         transport=ctx.transport, eval_every=sc.training.eval_every,
                         backend_allreduce=sc.torch.backend_allreduce
                         and "backend_allreduce" in spec.algorithm.collectives,
                         select_device=resolve_select_device(sc.torch.select_device, ctx.rank))
        if ctx.rank == 0:
            rows.extend(res.rows)
    return rows if ctx.rank == 0 else None
