"""The torchrun entry point: a scenario on the torch backend across several machines.

Local runs (``sparsim run --backend torch --nproc P``) go through :func:`experiments.run.run_scenario`. On several
machines, start one process per rank with torchrun (README, "Real backend"):

    torchrun --nnodes 2 --nproc-per-node 4 --node-rank N --master-addr HOST --master-port 29500 \\
        -m experiments.torch_run SCENARIO.toml --out DIR

Every rank builds the same scenario (deterministic from its seed) and runs each algorithm
(:func:`experiments.torch_job.scenario_job`); rank 0 writes the run directory
(:func:`experiments.run.write_run_directory`). :func:`scenario_job`, :func:`run_built` and
:data:`TORCH_NET_CLOCK` are also importable from here, where they were first defined.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from sim.base.errors import SparsimError

from .build import build
from .outdir import check_out, partial_dir, publish
from .run import write_run_directory
from .run_net import TORCH_NET_CLOCK
from .scenario import load_scenario, option_overrides
from .torch_job import run_built, scenario_job, torch_backend_info

__all__ = ["main", "scenario_job", "run_built", "TORCH_NET_CLOCK"]


def main(argv=None) -> int:
    """torchrun entry point: ``python -m experiments.torch_run [SCENARIO] --out DIR [--set K=V ...]
    [--algorithms A,B] [--timeout S] [--dist-backend auto|gloo|nccl] [--backend-allreduce] [--force]``. Rank 0 writes DIR
    (via DIR.partial). Returns the exit code: 2 and one line for user errors and for a group that cannot form
    (MASTER_PORT in use, ranks that never joined, named, a timeout too small: :func:`sim.distributed.backend.
    init_from_env`) or fails (torch's c10d errors)."""
    import argparse

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
    import torch.distributed as dist

    try:

        from sim.distributed.backend import init_from_env

        if a.algorithms is not None and not any(x.strip() for x in a.algorithms.split(",")):
            from sim.algorithms import REGISTRY  # '' used to mean every algorithm of the scenario, silently

            names = [n for name, algo in REGISTRY.items() for n in (name, *algo.aliases)]
            raise SparsimError(f"--algorithms {a.algorithms!r} names no algorithm: valid a comma-separated list of "
                               f"{', '.join(names)} (omit it for the scenario's)")
        ov = list(a.overrides) + option_overrides(algorithms=a.algorithms, timeout_s=a.timeout,
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
            try:
                write_run_directory(tmp, sc, build(sc), rows, time.perf_counter() - t0,
                                    backend=torch_backend_info(sc, ctx.P, launcher="torchrun"))
                publish(tmp, out)
            except BaseException:  # a full disk, an interrupt: no half-written DIR.partial left behind
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            print(f"wrote {out}/")
        dist.destroy_process_group()
        return 0
    except SparsimError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the machine refuses a write (a full disk, a quota, read-only): one line, as sparsim run
        where = f" {err.filename}" if err.filename else ""
        print(f"error: rank {os.environ.get('RANK', '?')}: cannot write{where}: {err.strerror or err} (nothing was "
              "published: free space or choose another --out)", file=sys.stderr)
        return 2
    except dist.DistError as err:  # torch's own c10d errors after set-up (a peer gone, a store timeout): one line
        from sim.distributed.backend import dist_failed

        print(f"error: {dist_failed(os.environ.get('RANK', '?'), err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
