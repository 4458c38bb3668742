"""Example: train an MLP on scikit-learn's digits with DDP and the gTop-k hook on P local processes.

    python -m experiments.ddp_example --nproc 2 --iters 100 --density 0.01 [--scope parameter] [--start-iter 10]
    python -m experiments.ddp_example --algorithm powersgd --iters 50     # any registered algorithm

The two lines that add gTop-k to the DDP loop are marked below. Each rank trains on its own iid shard
(batch 16); rank 0 prints the full-data loss and accuracy every --every iterations, the hook's time per
step on the autograd thread (accumulate, select, pack) and in the asynchronous completions (unpack, sum or
gTop-k merges), and the fraction of the selected entries that reached the update. Bad options (an unknown
algorithm, a density outside (0, 1], ...) give one line ``error: ...`` and exit code 2, a failed rank one line
and exit code 1.
"""
from __future__ import annotations

import argparse
import sys


class _OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line ``error: ... (see '... --help')``, exit code 2 (as sparsim's)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see '{self.prog} --help')\n")


def train_job(ctx, iters: int, density: float, algorithm: str, lr: float, every: int, scope: str = "parameter",
              start_iter: int = 0):
    """Per-rank body: DDP training with the sparse hook; rank 0 returns [(iteration, loss, accuracy)]."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sim.workloads.data import load_dataset, minibatch, shard_indices
    from sim.distributed.ddp_hooks import register_sparse_hook
    from sim.workloads.torch_models import mlp

    ds = load_dataset("digits")
    X, y = torch.as_tensor(ds.X), torch.as_tensor(ds.y)
    shard = shard_indices(len(ds.y), ctx.P, seed=0)[ctx.rank]
    model = DDP(mlp(64, 32, 10, seed=0))
    state = register_sparse_hook(model, algorithm, density=density, scope=scope,  # <- gTop-k with error feedback
                                 start_iter=start_iter)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    log = []
    for t in range(1, iters + 1):
        idx = torch.as_tensor(minibatch(shard, 16, 0, ctx.rank, t))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()
        if ctx.rank == 0 and (t % every == 0 or t == iters):
            with torch.no_grad():
                out = model.module(X)
                log.append((t, torch.nn.functional.cross_entropy(out, y).item(),
                            (out.argmax(1) == y).double().mean().item()))
    steps = max(state.iteration - start_iter, 1)
    return (log, (state.hook_s / steps, state.callback_s / steps), state.applied / max(state.selected, 1)) \
        if ctx.rank == 0 else None


def main(argv=None):
    """Command-line entry point (see the module docstring)."""
    from sim.algorithms import names
    from sim.distributed.backend import launch_local

    ap = _OneLineParser(description="DDP + gTop-k hook on digits (any registered algorithm as the hook)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--algorithm", default="gtopk", choices=list(names()),
                    help="any registered algorithm (Top-k, gTop-k and rand-k asynchronous; the others on the p2p wire)")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--scope", default="parameter", choices=["parameter", "bucket", "model"])
    ap.add_argument("--start-iter", type=int, default=0, help="iterations of plain allreduce first")
    a = ap.parse_args(argv)
    if a.nproc < 1 or a.iters < 1 or a.every < 1 or not 0 < a.density <= 1 or not a.lr > 0 or a.start_iter < 0:
        bad = [f"{name} = {v} is out of range: valid {rng}" for name, v, rng, ok in (
            ("--nproc", a.nproc, ">= 1", a.nproc >= 1), ("--iters", a.iters, ">= 1", a.iters >= 1),
            ("--every", a.every, ">= 1", a.every >= 1), ("--density", a.density, "in (0, 1]", 0 < a.density <= 1),
            ("--lr", a.lr, "> 0", a.lr > 0), ("--start-iter", a.start_iter, ">= 0", a.start_iter >= 0)) if not ok]
        ap.error(bad[0])
    from sim.base.errors import ConfigError, SparsimError

    from experiments.torch_job import check_torch

    try:  # torch and the options checked here, before any process starts: one line, exit 2
        check_torch("experiments/ddp_example.py")
        from sim.distributed.ddp_hooks import SparseState

        SparseState(None, a.algorithm, a.density, scope=a.scope, start_iter=a.start_iter)
    except ConfigError as err:
        ap.error(str(err))
    from sim.distributed.backend import WorkerFailure

    try:
        log, (hook_s, callback_s), applied = launch_local(
            a.nproc, train_job, (a.iters, a.density, a.algorithm, a.lr, a.every, a.scope, a.start_iter),
            timeout_s=60.0)[0]
    except (WorkerFailure, SparsimError) as err:  # a rank failed: its first line (the ranks' logs are in err.log)
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        sys.exit(1)
    for t, loss, acc in log:
        print(f"iteration {t:>5}: loss {loss:.4f}, accuracy {100 * acc:.1f} %")
    print(f"hook time per sparse step: {hook_s:.2e} s in the hook, {callback_s:.2e} s in its completions; "
          f"applied fraction {applied:.3f}")


if __name__ == "__main__":
    main()
