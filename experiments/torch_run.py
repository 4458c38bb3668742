"""Scenario runs on the torch backend: the per-rank job, and the torchrun entry point for several machines.

Local runs (``sparsim run --backend torch --nproc P``) spawn P processes through
:func:`sim.distributed.backend.launch_local`, each running :func:`scenario_job`. On several machines, start
one process per rank with torchrun (README, "Real backend"):

    torchrun --nnodes 2 --nproc-per-node 4 --node-rank N --master-addr HOST --master-port 29500 \\
        -m experiments.torch_run SCENARIO.toml --out DIR

Every rank builds the same scenario (deterministic from its seed), runs each algorithm with
:func:`sim.distributed.backend.run_worker`, and rank 0 writes the run directory.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

__all__ = ["scenario_job", "run_built", "TORCH_NET_CLOCK", "main"]

#: summary.json's ``resolved.clock`` of a [model] run on the torch backend (experiments.run.write_run_directory):
#: the time columns are measured, so the network's simulated timeline times nothing there.
TORCH_NET_CLOCK = ("measured wall time of the P torch processes (the backend's time columns); the [cluster] "
                   "network, the [compute] model and the [workload] device of the network's layer-wise timeline "
                   "time nothing on this backend: only training.time_budget_s uses that simulated clock, to run "
                   "each algorithm for the simulator's number of iterations; workload.sparse_policy still sets the "
                   "selection segments (numerics)")


def scenario_job(ctx, scenario_dump: dict) -> list | None:
    """Run every algorithm of a scenario as rank ``ctx.rank`` (a :class:`sim.distributed.backend.DistContext`).

    scenario_dump: ``Scenario.model_dump()`` (validated again here); dense uses
    torch.distributed.all_reduce when its ``torch.backend_allreduce`` is true; each rank makes its Top-k selections
    where ``torch.select_device`` says (its GPU or the CPU, the same indices). Returns on rank 0 the metrics rows of all algorithms in order
    (list of dicts), None on the other ranks. Raises ConfigError if cluster.P differs from the world size.
    """
    from sim.base.errors import ConfigError

    from .run import build
    from .scenario import Scenario

    sc = Scenario.model_validate(scenario_dump)
    if sc.cluster.P != ctx.P:
        raise ConfigError(f"cluster.P = {sc.cluster.P} differs from the {ctx.P} launched processes: they must be equal")
    return run_built(ctx, sc, build(sc))


def run_built(ctx, sc, built) -> list | None:
    """:func:`scenario_job`'s body once the scenario is built: every algorithm of ``built.specs`` as rank
    ``ctx.rank``, each for ``training.iterations`` iterations or, with a [model] run's ``training.time_budget_s``,
    for the iterations the simulator runs within that budget on its clock (the network's layer-wise timeline). Returns
    rank 0's metrics rows (list of dicts), None on the other ranks."""
    from sim.base.errors import SparsimError
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


def main(argv=None) -> int:
    """torchrun entry point: ``python -m experiments.torch_run [SCENARIO] --out DIR [--set K=V ...]
    [--algorithms A,B] [--timeout S] [--dist-backend auto|gloo|nccl] [--backend-allreduce] [--force]``. Rank 0 writes DIR
    (via DIR.partial). Returns the exit code (2 and one line for user errors)."""
    import argparse

    from sim.base.errors import SparsimError

    ap = argparse.ArgumentParser(prog="python -m experiments.torch_run")
    ap.add_argument("scenario", nargs="?")
    ap.add_argument("--out", default="runs/torch")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--algorithms", default=None)
    ap.add_argument("--timeout", type=float, default=None, help="sets torch.timeout_s (scenario default 60)")
    ap.add_argument("--dist-backend", default="auto", choices=["gloo", "nccl", "auto"],
                    help="process-group backend (default auto here: nccl when a GPU is visible)")
    ap.add_argument("--backend-allreduce", action="store_true", help="sets torch.backend_allreduce = true")
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)
    try:
        import torch.distributed as dist

        from sim.distributed.backend import init_from_env

        from .outdir import check_out, partial_dir, publish
        from .run import build, torch_backend_info, write_run_directory
        from .scenario import load_scenario, option_overrides

        ov = list(a.overrides) + option_overrides(algorithms=a.algorithms or None, timeout_s=a.timeout,
                                                  backend_allreduce=a.backend_allreduce, dist_backend=a.dist_backend)
        sc = load_scenario(a.scenario, ov)
        ctx = init_from_env(backend=sc.torch.dist_backend, timeout_s=sc.torch.timeout_s)
        if ctx.rank == 0:
            check_out(Path(a.out), a.force)
        t0 = time.perf_counter()
        rows = scenario_job(ctx, sc.model_dump())
        if ctx.rank == 0:
            out = Path(a.out)
            tmp = partial_dir(out)
            write_run_directory(tmp, sc, build(sc), rows, time.perf_counter() - t0,
                                backend=torch_backend_info(sc, ctx.P, launcher="torchrun"))
            publish(tmp, out)
            print(f"wrote {out}/")
        dist.destroy_process_group()
        return 0
    except SparsimError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
