"""Every registered algorithm as a DistributedDataParallel communication hook (Top-k, gTop-k, rand-k asynchronous).

Two lines add gTop-k to an existing DDP training loop::

    from sim.distributed.ddp_hooks import register_sparse_hook
    state = register_sparse_hook(ddp_model, "gtopk", density=0.01)

or, mirroring torch's ``PowerSGDState`` + ``powerSGD_hook``::

    state = SparseState(ddp_model.process_group, algorithm="gtopk", density=0.01, start_iter=100)
    register_sparse_hook(ddp_model, state=state)      # binds parameter names, then register_comm_hook

Checkpoints: ``torch.save(state.state_dict(), path)`` and, after a restart (new processes, same model and
world size), ``state.load_state_dict(torch.load(path))``; training then continues bit for bit as if it had
not stopped (tests/test_ddp_hooks.py). ``torch.save(state)`` also works (the process group is dropped, as
``PowerSGDState`` does; load it with ``weights_only=False`` and bind it again with ``register_sparse_hook``).

What the hook computes (Shi et al., IJCAI 2019, Algorithm 1 on each selection unit; rand-k as Mem-SGD,
Stich et al. 2018): per unit of n gradient entries and rank p, ``acc_p = eps_p + lr * grad_p`` (in the
residual dtype), a selection of k entries (Top-k: the k largest magnitudes, ties to the lower index,
exact zeros never sent; rand-k: k coordinates drawn as :func:`sim.algorithms.sgd_step` draws them), then

- Top-k / rand-k: ``g = sum_q Sel(acc_q)`` (added in rank order), ``eps_p = acc_p - Sel(acc_p)``;
- gTop-k: ``g = gTopK(Sel(acc_1), ..., Sel(acc_P))`` by the binomial tree (``collective="tree"``, the
  default) or recursive doubling, ``eps_p = acc_p`` with the entries that reached g zeroed (``mask="exact"``)
  or the released code's rule (``mask="reference"``),

and the hook returns ``g / P`` for DDP to copy into the gradients (DDP expects an average). These are the
definitions of :func:`sim.algorithms.sgd_step` and :mod:`sim.comm.collectives`; the hook computes them with torch
operations on the gradient's device, and ``tests/test_ddp_hooks*.py`` check, in float64, that a model
trained through the hook equals bit for bit the one :func:`sim.distributed.backend.run_worker` and the simulator
(lock-step driver) train, for every scope and algorithm, and that the torch replay of the gTop-k merges
equals :func:`sim.comm.collectives.gtopk_tree` / :func:`~sim.comm.collectives.gtopk_rd` (values and masks).

Asynchronous (``wire="allgather"``, the default of :class:`SparseState`). Per DDP bucket the hook, on the
autograd thread, forms the accumulators in place in the residual buffers, selects (CPU:
:func:`sim.comm.compression.topk`, the exact one-pass selection, on a zero-copy view of the tensor; GPU:
:func:`sim.comm.torch_kernels.topk_torch`, ``torch.topk`` plus the tie rule), packs the values and indices
into one byte tensor and launches ONE asynchronous ``all_gather`` on the DDP model's process group
(gloo on CPU, NCCL on GPU); it returns that collective's ``torch.futures.Future`` chained (``.then``) with
the unpacking, the sum in rank order (or the local replay of the gTop-k merges, in the order of
:func:`sim.comm.collectives.gtopk_tree` / :func:`~sim.comm.collectives.gtopk_rd`, so every rank computes the same g
and its own mask, bit for bit the definitions; on the CPU the merges of all the bucket's units run at once,
one per step of the schedule, on numpy views) and the residual update. Backward continues while the
collective runs, as with DDP's allreduce and the PowerSGD hook. The wire pattern is therefore an
allgather of P x k entries per unit: for gTop-k that is the Top-k wire volume, (P - 1) k s bytes received
per rank, not the 2 k lg P of the tree (the numbers are the tree's; the messages are not). The exact wire
pattern is available as ``wire="p2p"``: the sans-I/O programs themselves (:func:`sim.algorithms.sgd_step`)
run synchronously inside the hook over :class:`sim.distributed.backend.TorchTransport` point-to-point messages
(the binomial tree really sends 2 lg P messages of k entries), blocking backward while they run.

Selection scope (``scope``):

- ``"parameter"`` (default of :class:`SparseState`): every parameter tensor is a selection unit with
  ``k_p = min(n_p, max(1, round(density n_p)))`` -- the simulator's layer-wise rule
  (:func:`sim.algorithms.segment_k` with k / d = density) -- and the units of one bucket share one
  collective launched as soon as the bucket is ready. Default because what is selected does not depend on
  ``bucket_cap_mb`` or on DDP's bucket rebuild (so a checkpoint restart is exact and the run equals the
  simulator's layer-wise run), while communication still overlaps backward. Cost: each tensor selects at
  least one entry (many small tensors select a bit more than the density).
- ``"bucket"``: each DDP bucket is one unit, ``k_b = min(n_b, max(1, round(density n_b)))``; what is
  selected changes with ``bucket_cap_mb`` and with DDP's rebuild of the buckets after the first iteration
  (:func:`settle_buckets` lets DDP rebuild them before training: the units are then the rebuilt buckets from the
  first step, as the simulator's ``workload.sparse_policy = "bucket"`` selects, bit for bit; tests/test_net_torch.py).
- ``"model"``: one selection over the whole model (parameters in ``module.parameters()`` order) after the
  last bucket, as the released gTop-k code does: no overlap with backward (the futures of the earlier
  buckets complete when the last bucket's collective does), one collective, exactly Algorithm 1.

Hybrid plan (``plan=``, a :class:`sim.engine.hybrid.HybridPlan` or its JSON file, docs/hybrid.md): scope "bucket"
with each DDP bucket as the plan says, bucket i of the plan being DDP's bucket of index i (launch order, after
:func:`settle_buckets`): a compressed bucket selects ``k_b = min(n_b, max(1, round(rho_b n_b)))`` at its own density
rho_b (``density`` and ``k`` are not used), a dense bucket is summed by an asynchronous ``all_reduce`` of
``lr x grad`` (no selection, no residual: the accumulator of a bucket never compressed is ``lr x grad``), divided by P
once it completes -- the simulator's ``workload.sparse_policy = "hybrid"`` bit for bit in float64 at P = 2
(tests/test_hybrid.py). A bucket whose size is not the plan's, a model of another size, or an algorithm other than
the plan's own (:func:`sim.engine.hybrid.check_plan_algorithm`, the simulator's rule) is a one-line ConfigError.

Warm-up: ``start_iter`` iterations of plain allreduce first (the gradient times 1/P, then ``all_reduce``,
what DDP does without a hook, bit for bit; residuals stay zero), then ``density_schedule`` (e.g.
:func:`dgc_warmup`, Lin et al., ICLR 2018: densities 0.25, 0.0625, 0.015625, 0.0039 before 0.001), each
entry for ``schedule_iters`` iterations, then ``density``.

Dtypes: float32, float16, bfloat16 and float64 gradients. Residuals (and accumulators, selected values and
the sums) are float32 for float32, float16 and bfloat16 gradients and float64 for float64 gradients; the
averaged result is rounded to the gradient dtype once, at the end. Values travel in the residual dtype
(4 bytes, 8 for float64), indices as int32 (int64 for units of 2^31 entries or more).

Step size: the error-feedback accumulator is ``eps + lr * grad`` with the hook's ``lr``. Either keep
``lr = 1`` and your optimizer's learning rate (residuals in gradient units, the usual practice), or pass the
step size as the hook's ``lr`` and use ``torch.optim.SGD(lr=1.0)`` without momentum or weight decay: that is
Algorithm 1 of Shi et al. (IJCAI 2019) exactly (tested bit-identical in float64).

Limits: NaN/Inf in an accumulator raise :class:`~sim.base.errors.NonFiniteError` on that rank (its peers then
wait for the process group's timeout): AMP's GradScaler, which expects inf gradients to pass through,
is not supported. Sparse gradients (``nn.Embedding(sparse=True)``) are not supported (DDP gives no buffer).
Every algorithm of the registry (:mod:`sim.algorithms`: PowerSGD, DGC, Ok-Topk, Gaussian-k, CLT-k, SparCML,
dense) is a hook too: ``SparseState(pg, algorithm="powersgd", options={"rank": 4})`` runs
:func:`sim.algorithms.sgd_step` per selection unit on the p2p wire (synchronous; the algorithm's own state per
unit is kept in ``algo_state`` and checkpointed). PowerSGD views each unit as the simulator does: by default one
near-square matrix per unit (``variant = "square"``, not torch's view); with ``options={"variant": "torch"}`` each
tensor as (shape[0], numel / shape[0]) (the shapes come from the model), which at ``scope="bucket"`` is torch's
``powerSGD_hook`` bit for bit where the same product kernel runs (tests/test_powersgd.py). Its Q seeds come from ONE
generator per rank shared by the units in the order they are exchanged (``algo_state[()]``), as torch's hook and the
simulator's segments draw, one seed per unit that (re)initialises its Q, also a unit with nothing to compress.
An algorithm file gets the asynchronous path by defining :meth:`sim.algorithms.Algorithm.hook_select` and
``hook_combine``; a selection function can also be plugged in
here with :func:`register_hook_algorithm` (combined by a sum or by the gTop-k merges).
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from sim.algorithms import RANDK_STREAM, REGISTRY, AlgorithmSpec, sgd_step
from sim.base.errors import DIVERGENCE_LIMIT, ConfigError, NonFiniteError, SparsimError, check_range

__all__ = ["SparseState", "SparseHookState", "sparse_hook", "register_sparse_hook", "dgc_warmup", "SCOPES",
           "WIRES", "HookAlgorithm", "HOOK_ALGORITHMS", "register_hook_algorithm", "select_topk", "select_randk",
           "merge_torch", "gtopk_replay", "STATE_FORMAT", "settle_buckets"]

#: Selection scopes: per parameter tensor (layer-wise), per DDP bucket, or the whole model after the last bucket.
SCOPES = ("parameter", "bucket", "model")
#: Wire patterns: one asynchronous all_gather per bucket (default), or the sans-I/O programs' point-to-point
#: messages run synchronously inside the hook.
WIRES = ("allgather", "p2p")
#: ``format`` key of :meth:`SparseState.state_dict`.
STATE_FORMAT = "sparsim.ddp_hooks.SparseState/1"


# ================================================================================ algorithms (plug-ins)


def select_topk(acc, k: int, state=None):
    """TopK(acc) on a torch tensor (the Top-k and gTop-k hooks' selection): :func:`sim.algorithms.topk.
    select_topk_torch` -- acc 1-D float tensor (n,), 1 <= k <= n; returns (idx int64 ascending, val), at most
    k entries, ties to the lower index, exact zeros never selected. ``state`` is unused (the plug-in signature)."""
    from sim.algorithms.topk import select_topk_torch

    return select_topk_torch(acc, k)


def select_randk(acc, k: int, state):
    """RandK(acc) on a torch tensor (the rand-k hook's selection): :meth:`sim.algorithms.randk.RandK.hook_select`
    with the draw of ``state``'s per-iteration generator. Returns (idx int64 ascending, val)."""
    return REGISTRY["randk"].hook_select(acc, k, state)


@dataclass(frozen=True)
class HookAlgorithm:
    """A sparse algorithm the hook can run.

    select: ``select(acc, k, state) -> (idx, val)``: acc a 1-D float tensor (n,) (the accumulator of one
    unit; do not modify it), k the unit's budget (1 <= k <= n); returns int64 indices ascending (at most k,
    distinct, in [0, n)) and acc at them, on acc's device. combine: ``"sum"`` (every rank's selection is
    added in rank order; eps = acc - own selection: Top-k, rand-k, any other selector) or ``"gtopk"`` (the
    gTop-k merges replayed on the gathered selections; eps keeps what did not reach g). collectives: the
    ``collective`` names valid for it (the first is the default; for the p2p wire, a collective of
    :data:`sim.algorithms.COLLECTIVES`). checks_all: True when the selection does not always contain the
    largest magnitude, so the whole accumulator is checked for NaN/Inf (one extra pass); False when checking
    the selected values suffices (top-k selections).
    """

    select: Callable
    combine: str = "sum"
    collectives: tuple = ("allgather",)
    checks_all: bool = True


#: Algorithms with the asynchronous path (``wire="allgather"``), by name: those of the registry
#: (:data:`sim.algorithms.REGISTRY`) that define one (:attr:`sim.algorithms.Algorithm.hook_combine`), plus any
#: added with :func:`register_hook_algorithm`. Every other registered algorithm runs as a hook with ``wire="p2p"``.
HOOK_ALGORITHMS: dict[str, HookAlgorithm] = {
    name: HookAlgorithm(algo.hook_select, algo.hook_combine, tuple(algo.hook_collectives), algo.hook_checks_all)
    for name, algo in REGISTRY.items() if algo.hook_combine is not None}


def register_hook_algorithm(name: str, select: Callable, combine: str = "sum", *, collectives=("allgather",),
                            checks_all: bool = True) -> HookAlgorithm:
    """Make ``name`` available to :class:`SparseState` with the selection function ``select`` (see
    :class:`HookAlgorithm` for its signature) combined by ``"sum"`` or ``"gtopk"``. The asynchronous wire
    runs it; the p2p wire runs only names that :func:`sim.algorithms.sgd_step` knows. Returns the entry.
    Raises ConfigError for a combine other than sum / gtopk or a name that is not a non-empty string."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"algorithm name = {name!r} is out of range: valid a non-empty string")
    if combine not in ("sum", "gtopk"):
        raise ConfigError(f"combine = {combine!r} is unknown: valid sum, gtopk")
    if not callable(select):
        raise ConfigError(f"select = {select!r} is not callable: valid a function (acc, k, state) -> (idx, val)")
    HOOK_ALGORITHMS[name] = entry = HookAlgorithm(select, combine, tuple(collectives), bool(checks_all))
    return entry


# ================================================================================ torch equivalents of the merges


def _topk_positions_torch(val, k: int):
    """Ascending positions of the k largest |val| (ties to the lower position) that are not exactly zero:
    :func:`sim.comm.compression.topk_positions` in torch (int64 tensor, at most k entries)."""
    import torch

    n = int(val.shape[0])
    keep = val != 0
    if n > k:
        absx = val.abs()
        thr = torch.kthvalue(absx, n - k + 1).values  # np.partition(absx, n - k)[n - k]: the k-th largest
        top = absx > thr
        need = k - int(top.sum())
        top[(absx == thr).nonzero().flatten()[:need]] = True
        keep &= top
    return keep.nonzero().flatten()


def merge_torch(a, b, k: int):
    """The gTop-k merge operator a T b = TopK(a + b) on torch tensors: :func:`sim.comm.compression.merge`, bit for bit.

    a, b: (idx, val) pairs, idx int64 (m,) strictly ascending, val float (m,); k >= 1. Returns (idx, val):
    the union of the supports ascending with the sums ``(0 + a_i) + b_i`` (``0 + a_i`` / ``0 + b_i`` where one
    holds the index), in the promoted dtype, the k largest magnitudes kept (ties to the lower index) and exact
    zeros dropped. Runs on the tensors' device.
    """
    import torch

    (ia, va), (ib, vb) = a, b
    rt = torch.promote_types(va.dtype, vb.dtype)
    idx, order = torch.sort(torch.cat((ia, ib)), stable=True)
    val = torch.cat((va.to(rt), vb.to(rt)))[order] + 0.0  # 0 + x: only -0.0 changes, to +0.0
    pair = (idx[1:] == idx[:-1]).nonzero().flatten()
    if pair.numel():
        val[pair] = val[pair] + val[pair + 1]  # (0 + a_i) + b_i: a's entry first (stable sort)
        first = torch.ones(idx.shape[0], dtype=torch.bool, device=idx.device)
        first[pair + 1] = False
        idx, val = idx[first], val[first]
    keep = _topk_positions_torch(val, int(k))
    return idx[keep], val[keep]


def gtopk_replay(sels: list, k: int, rank: int, collective: str = "tree", exact: bool = True, *,
                 impl: str | None = None):
    """The result of a gTop-k collective, computed locally from every rank's selection.

    sels: P pairs (idx int64 ascending, val float), rank q's TopK(acc_q) (exact zeros removed), as an allgather
    delivers them. Replays the merges of :func:`sim.comm.collectives.gtopk_tree` (binomial reduce to rank 0,
    ``collective="tree"``) or :func:`sim.comm.collectives.gtopk_rd` (MPICH recursive doubling with the fold for P
    not a power of two, ``"recursive_doubling"``) in their order, and tracks which of ``rank``'s entries
    survive every merge they enter (the exact mask's rule). Returns (g_idx, g_val, applied): g identical on
    every rank, applied a bool tensor over sels[rank] (exact: survived every merge; ``exact=False``: the
    released code's rule, own index in the support of g). Bit for bit what the sans-I/O collective returns
    on ``rank`` (tests/test_ddp_hooks_ops.py, both implementations).

    impl: ``"numpy"`` -- :func:`sim.comm.compression.merge` itself on zero-copy numpy views (CPU tensors only; the
    default there: about 4x faster than the torch operations for the hook's selections, which are small
    and many); ``"torch"`` -- :func:`merge_torch` on the tensors' device (the default elsewhere).
    Raises ConfigError for another collective or impl.
    """
    import torch

    if impl is None:
        impl = "numpy" if all(i.device.type == "cpu" and v.dtype in (torch.float32, torch.float64)
                              for i, v in sels) else "torch"
    if impl == "numpy":
        g_idx, g_val, alive = _replay_numpy([(i.numpy(), v.detach().numpy()) for i, v in sels], k, rank,
                                            collective, exact)
        return torch.from_numpy(g_idx), torch.from_numpy(g_val), torch.from_numpy(alive)
    if impl != "torch":
        raise ConfigError(f"impl = {impl!r} is unknown: valid numpy, torch")

    def member(a, b):
        return torch.isin(a, b)

    def ones(a):
        return torch.ones(a.shape[0], dtype=torch.bool, device=a.device)

    return _replay(sels, k, rank, collective, exact, lambda a, b: merge_torch(a, b, k), member, ones)


def _replay_numpy(sels: list, k: int, rank: int, collective: str, exact: bool):
    """:func:`gtopk_replay` on numpy (idx int64, val) pairs with :func:`sim.comm.compression.merge`; returns numpy
    (g_idx, g_val, applied)."""
    from sim.comm.collectives import in_sorted
    from sim.comm.compression import Sparse, merge

    d = max([k] + [int(i[-1]) + 1 for i, _ in sels if i.shape[0]])  # merge checks k <= d only

    def merge_np(a, b):
        m = merge(Sparse(a[0], a[1], d), Sparse(b[0], b[1], d), k)
        return m.idx, m.val

    return _replay(sels, k, rank, collective, exact, merge_np, in_sorted, lambda a: np.ones(a.shape[0], dtype=bool))


def _replay(sels: list, k: int, rank: int, collective: str, exact: bool, merge_fn, member, ones):
    """The merge order of :func:`gtopk_replay` with the operations given: merge_fn(a, b) -> merged pair,
    member(a, b) -> bool over a (a_i in b), ones(a) -> all-True over a."""
    from sim.comm.collectives import binomial_reduce_schedule, rd_schedule

    P = len(sels)
    cur = list(sels)
    own_idx = sels[rank][0]
    alive = ones(own_idx)
    holder = rank
    ranks = np.arange(P)

    def survive(at: int):
        nonlocal alive
        if exact and alive.any():
            alive &= member(own_idx, cur[at][0])

    if collective == "tree":
        for _, _, src in binomial_reduce_schedule(ranks, P):
            for r in np.flatnonzero(src >= 0):
                s = int(src[r])
                cur[r] = merge_fn(cur[r], cur[s])
                if holder in (r, s):
                    holder = int(r)
                    survive(holder)
        g = cur[0]
    elif collective == "recursive_doubling":
        for phase, dst, src in rd_schedule(ranks, P):
            if phase == "fold":
                for r in np.flatnonzero(src >= 0):
                    s = int(src[r])
                    cur[r] = merge_fn(cur[r], cur[s])
                    if holder in (r, s):
                        holder = int(r)
                        survive(holder)
            elif phase == "exchange":
                new = list(cur)
                for r in np.flatnonzero(dst >= 0):
                    q = int(dst[r])
                    if r < q:  # the merge is commutative bit for bit: once per pair
                        new[r] = new[q] = merge_fn(cur[r], cur[q])
                cur = new
                if dst[holder] >= 0:
                    survive(holder)
        g = cur[holder]
    else:
        raise ConfigError(f"collective = {collective!r} is not a gTop-k hook collective: valid tree, recursive_doubling")
    if not exact:
        alive = member(own_idx, g[0])
    return g[0], g[1], alive


# ================================================================================ schedules


def dgc_warmup(final: float = 0.001, stages: int = 4) -> tuple[float, ...]:
    """DGC's exponential warm-up densities before ``final`` (Lin et al., "Deep Gradient Compression", ICLR 2018,
    section 3.3: sparsity 75 %, 93.75 %, 98.4375 %, 99.6 %, 99.9 % over the first four epochs).

    Returns (0.25, 0.0625, ...) = 0.25^i for i = 1..stages, the entries above ``final`` only (the paper's
    99.6 % is 0.25^4 = 0.0039 rounded). Use as ``density_schedule`` with ``density=final`` and
    ``schedule_iters`` = iterations per epoch. Raises ConfigError for final outside (0, 1] or stages < 0.
    """
    check_range("final", final, 0, 1, lo_open=True, err=ConfigError)
    check_range("stages", stages, 0, err=ConfigError)
    return tuple(0.25 ** i for i in range(1, int(stages) + 1) if 0.25 ** i > final)


# ================================================================================ state


class SparseState:
    """State of :func:`sparse_hook` (the counterpart of torch's ``PowerSGDState``).

    process_group: the process group the DDP model was built with (``ddp_model.process_group``); None: the
    default group (:func:`register_sparse_hook` fills in the model's). Everything else keyword or positional:

    - algorithm: any registered algorithm (:data:`sim.algorithms.REGISTRY`, ``sparsim algorithms`` lists them;
      default "gtopk") or a name added with :func:`register_hook_algorithm`. Those of :data:`HOOK_ALGORITHMS`
      (Top-k, gTop-k, rand-k) have the asynchronous path; the others (PowerSGD, DGC, Ok-Topk, ...) run
      :func:`sim.algorithms.sgd_step` itself on the p2p wire.
    - density: fraction of each unit selected, 0 < density <= 1 (default 0.01): k = min(n, max(1, round(density n))).
    - k: a fixed k per unit instead (capped at the unit's size), integer >= 1; not with a density schedule.
    - scope: one of :data:`SCOPES` (default "parameter", "bucket" with a plan; module docstring for each and why).
    - start_iter: iterations of plain allreduce before the sparse hook starts (>= 0, default 0).
    - density_schedule: densities (each in (0, 1], never increasing, none below ``density``) for the first
      sparse iterations, each held ``schedule_iters`` (>= 1) iterations; then ``density``. See :func:`dgc_warmup`.
    - collective: gTop-k "tree" (default) or "recursive_doubling"; Top-k / rand-k "allgather"; on the p2p wire
      any of the algorithm's collectives but "hierarchical" (the first is the default).
    - mask: gTop-k "exact" (default) or "reference" (the released code's rule, which can lose mass).
    - wire: one of :data:`WIRES` (default "allgather" where the algorithm has that path, else "p2p": the sans-I/O
      programs' messages, synchronous, the exact wire pattern).
    - options: the algorithm's own options (dict, e.g. ``{"rank": 4}`` for PowerSGD; ``sparsim algorithms``
      lists them with their ranges), p2p wire only; PowerSGD's ``variant = "torch"`` takes each unit's tensor
      shapes from the model (``shapes`` is not an option here). Algorithms that compress whole matrices or keep no k
      (PowerSGD, dense) ignore density and k.
    - lr: step size folded into the accumulator (> 0, default 1.0). seed: rand-k's draw (integer >= 0).
    - timeout_s: seconds a p2p message may wait on a peer (> 0); the asynchronous wire uses the process
      group's own timeout.
    - plan: a :class:`sim.engine.hybrid.HybridPlan` or the path of its JSON file (module docstring: "Hybrid plan");
      implies scope "bucket" (another scope is an error), not with ``k`` or ``density_schedule``.

    Attributes kept across steps: ``residuals`` (dict parameter name -> 1-D tensor, eps, float32 or float64,
    on the gradient's device), ``algo_state`` (p2p wire: the algorithm's own state per selection unit), ``iteration`` (completed steps, warm-up included), ``selected`` / ``applied``
    (entries this rank sent / that reached g), ``busy`` (float64 array (3,), seconds in accumulation and
    sums / selection, packing and merges / blocked in p2p messages), ``hook_s`` and ``callback_s`` (seconds
    inside hook calls on the autograd thread and inside the asynchronous completions, which run while
    backward continues), ``hook_cpu_s`` and ``callback_cpu_s`` (the same as CPU seconds of the thread that ran
    them, ``time.thread_time``: the hook's own work, without the time other threads and processes held the
    core or the GIL). Raises ConfigError (one line naming the value and the valid range) for any bad option.
    """

    def __init__(self, process_group=None, algorithm: str = "gtopk", density: float = 0.01, *, k: int | None = None,
                 scope: str | None = None, start_iter: int = 0, density_schedule: Sequence[float] | None = None,
                 schedule_iters: int = 1, collective: str | None = None, mask: str = "exact",
                 wire: str | None = None, lr: float = 1.0, seed: int = 0, timeout_s: float = 60.0,
                 options: dict | None = None, plan=None):
        if plan is not None:
            plan = _load_plan(plan)
            if scope not in (None, "bucket"):
                raise ConfigError(f"scope = {scope!r} with a hybrid plan: valid scope = 'bucket' (the plan chooses per "
                                  "DDP bucket)")
            if k is not None or density_schedule is not None:
                raise ConfigError(f"{'k' if k is not None else 'density_schedule'} with a hybrid plan: valid one of them "
                                  "(the plan gives each bucket its density)")
            scope = "bucket"
        scope = "parameter" if scope is None else scope
        if algorithm not in HOOK_ALGORITHMS and algorithm not in REGISTRY:
            valid = sorted(set(HOOK_ALGORITHMS) | set(REGISTRY))
            raise ConfigError(f"algorithm = {algorithm!r} is not a sparse hook: valid {', '.join(valid)}")
        if plan is not None:  # the plan's own algorithm (the rule the simulator's runs hold it to)
            plan.check_algorithm(algorithm)
        if wire is None:
            wire = "allgather" if algorithm in HOOK_ALGORITHMS else "p2p"
        if wire == "allgather" and algorithm not in HOOK_ALGORITHMS:
            raise ConfigError(f"wire = 'allgather' for the {algorithm} hook: valid wire = 'p2p' (its asynchronous "
                              f"path exists for {', '.join(HOOK_ALGORITHMS)})")
        opts = dict(options or {})
        if opts and wire != "p2p":
            raise ConfigError(f"options {', '.join(sorted(opts))} for the {algorithm} hook on wire = {wire!r}: "
                              "valid options only with wire = 'p2p' (the registry's algorithm runs them)")
        algo = HOOK_ALGORITHMS.get(algorithm) if wire != "p2p" else None
        check_range("density", density, 0, 1, lo_open=True, err=ConfigError)
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
                raise ConfigError(f"k = {k!r} is out of range: valid None or an integer >= 1")
            check_range("k", int(k), 1, err=ConfigError)
        if scope not in SCOPES:
            raise ConfigError(f"scope = {scope!r} is unknown: valid {', '.join(SCOPES)}")
        if wire not in WIRES:
            raise ConfigError(f"wire = {wire!r} is unknown: valid {', '.join(WIRES)}")
        if isinstance(start_iter, bool) or not isinstance(start_iter, (int, np.integer)) or start_iter < 0:
            raise ConfigError(f"start_iter = {start_iter!r} is out of range: valid an integer >= 0")
        if isinstance(schedule_iters, bool) or not isinstance(schedule_iters, (int, np.integer)) or schedule_iters < 1:
            raise ConfigError(f"schedule_iters = {schedule_iters!r} is out of range: valid an integer >= 1")
        sched = () if density_schedule is None else tuple(density_schedule)
        for j, dj in enumerate(sched):
            check_range(f"density_schedule[{j}]", dj, 0, 1, lo_open=True, err=ConfigError)
        steps = list(sched) + [density]
        if any(b > a for a, b in zip(steps, steps[1:])):
            raise ConfigError(f"density_schedule = {sched!r} then density = {density!r} is not decreasing: valid "
                              "densities in (0, 1] that never increase, the last at or above density")
        if sched and k is not None:
            raise ConfigError(f"k = {k!r} with density_schedule = {sched!r}: valid one of them (k fixes every unit's k)")
        colls = algo.collectives if algo is not None else tuple(
            c for c in REGISTRY[algorithm].collectives if c != "hierarchical")
        coll = colls[0] if collective is None else collective
        if coll not in colls:
            raise ConfigError(f"collective = {collective!r} is not available for the {algorithm} hook: valid "
                              f"{', '.join(colls)}")
        if mask not in ("exact", "reference"):
            raise ConfigError(f"mask = {mask!r} is unknown: valid exact, reference")
        check_range("lr", lr, 0, lo_open=True, err=ConfigError)
        check_range("seed", seed, 0, err=ConfigError)
        check_range("timeout_s", timeout_s, 0, lo_open=True, err=ConfigError)
        if wire == "p2p":
            if algorithm not in REGISTRY:
                raise ConfigError(f"algorithm = {algorithm!r} with wire = 'p2p': valid a registered algorithm "
                                  f"({', '.join(REGISTRY)}; the p2p wire runs sim.algorithms.sgd_step)")
            # the p2p wire runs sgd_step: the registry checks the collective, mask and options
            # (the options of a unit, completed by the algorithm where it takes more from the model: PowerSGD's
            # torch variant, the unit's tensor shapes, here a stand-in until the model is known)
            probe = _unit_options(algorithm, opts, None)
            opts = {key: v for key, v in AlgorithmSpec(algorithm, k=1, collective=coll, mask=mask,
                                                       options=probe).options if key in opts}
            # a generator per step shared by the units is what sgd_step's segments draw from; the hook runs one
            # sgd_step per unit. DGC's exact selection draws nothing (its generator serves the sampled threshold)
            draws = not (algorithm == "dgc" and opts.get("selection") == "exact")  # algorithms: no per-spec draw flag
            if REGISTRY[algorithm].uses_seed and REGISTRY[algorithm].sparse and scope != "model" and draws:
                alt = " (or wire = 'allgather')" if algorithm in HOOK_ALGORITHMS else \
                    " (or options that draw nothing: DGC's selection = 'exact')"
                raise ConfigError(f"{algorithm} with wire = 'p2p' and scope = {scope!r}: sgd_step draws each unit "
                                  f"from the same generator; valid scope = 'model'{alt}")
        self.process_group = process_group
        self.algorithm, self.density, self.k, self.scope, self.wire = algorithm, float(density), k, scope, wire
        self.start_iter, self.density_schedule, self.schedule_iters = int(start_iter), sched, int(schedule_iters)
        self.collective, self.mask, self.lr, self.seed, self.timeout_s = coll, mask, float(lr), int(seed), float(timeout_s)
        self.options = opts
        #: the hybrid plan (:class:`sim.engine.hybrid.HybridPlan`) or None
        self.plan = plan
        self.residuals: dict = {}
        #: the p2p wire's algorithm state per selection unit (tuple of parameter names -> the dict that
        #: :func:`sim.algorithms.sgd_step` keeps: PowerSGD's Q and generator, DGC's velocity, Ok-Topk's thresholds)
        self.algo_state: dict = {}
        self.iteration = 0
        self.selected = 0
        self.applied = 0
        self.busy = np.zeros(3)
        self.hook_s = 0.0
        self.callback_s = 0.0
        self.hook_cpu_s = 0.0
        self.callback_cpu_s = 0.0
        self._names: list | None = None  # bound parameter names, in module.parameters() order
        self._sizes: dict = {}
        self._world: int | None = None
        self._pending_load: dict | None = None
        self._init_runtime()

    # -- runtime fields (not pickled) ------------------------------------------------------------------------
    def _init_runtime(self):
        self._ids: dict = {}  # id(parameter) -> name, for this process's tensors
        self._arenas: dict = {}  # tuple of names -> flat tensor whose slices are their residuals
        self._pending: list = []  # model scope: (bucket buffer, [(name, offset, n)], future) of earlier buckets
        self._grad_acc = None  # model scope, p2p wire: the model's gradient gathered bucket by bucket
        self._transport = None
        self._rng_state = None
        self._shapes: dict = {}  # parameter name -> tensor shape, as the buckets show them (PowerSGD's torch variant)
        self._lock = threading.Lock()

    def __getstate__(self):
        """Everything but the process group and the runtime fields; residuals as compact copies."""
        out = {k: v for k, v in self.__dict__.items() if not k.startswith("_") or k in
               ("_names", "_sizes", "_world", "_pending_load")}
        out["process_group"] = None
        out["residuals"] = {n: t.detach().clone() for n, t in self.residuals.items()}
        return out

    def __setstate__(self, state):
        """As ``PowerSGDState``: the process group becomes the default group; bind the state to the model again
        (:func:`register_sparse_hook` with ``state=``) before training."""
        self.__dict__.update(state)
        self.__dict__.setdefault("hook_cpu_s", 0.0)  # states pickled before these counters existed
        self.__dict__.setdefault("callback_cpu_s", 0.0)
        self.__dict__.setdefault("plan", None)  # states pickled before hybrid plans existed
        self._init_runtime()

    # -- configuration -------------------------------------------------------------------------------------
    @property
    def spec(self) -> HookAlgorithm:
        """The :class:`HookAlgorithm` of ``algorithm``."""
        return HOOK_ALGORITHMS[self.algorithm]

    def density_at(self, iteration: int) -> float:
        """Density of the 0-based ``iteration`` (>= start_iter): the schedule's entry
        ``(iteration - start_iter) // schedule_iters`` while there is one, then ``density``."""
        j = (int(iteration) - self.start_iter) // self.schedule_iters
        return self.density_schedule[j] if 0 <= j < len(self.density_schedule) else self.density

    def k_for(self, n: int, iteration: int | None = None, density: float | None = None) -> int:
        """k of a unit of n (>= 1) entries at the 0-based ``iteration`` (default: the current one):
        ``min(n, k)`` for a fixed k, else ``min(n, max(1, round(density n)))`` with Python's round, the density being
        ``density`` when given (a hybrid plan's bucket), else the schedule's."""
        if density is not None:
            return int(min(n, max(1, round(float(density) * n))))
        if self.k is not None:
            return min(int(self.k), int(n))
        dens = self.density_at(self.iteration if iteration is None else iteration)
        return int(min(n, max(1, round(dens * n))))

    def _group(self):
        import torch.distributed as dist

        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _group_rank_size(self) -> tuple[int, int]:
        import torch.distributed as dist

        g = self._group()
        return dist.get_rank(g), dist.get_world_size(g)

    # -- binding, checkpoints --------------------------------------------------------------------------------
    def bind(self, model) -> "SparseState":
        """Learn the parameter names of ``model`` (a DDP model or its module): residuals are keyed by them.

        Parameters that require gradients, in ``module.parameters()`` order (the model vector of
        ``scope="model"``). Also records the process group's size (checked by :meth:`load_state_dict`).
        Called by :func:`register_sparse_hook`. A state loaded with :meth:`load_state_dict` before binding is
        checked here. Returns self. Raises ConfigError if the state was bound to another model.
        """
        module = getattr(model, "module", model)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        names = [n for n, _ in named]
        sizes = {n: int(p.numel()) for n, p in named}
        if self._names is not None and (self._names != names or self._sizes != sizes):
            raise ConfigError(_model_mismatch(self._names, self._sizes, names, sizes, "this state was bound to"))
        if self.plan is not None and sum(sizes.values()) != self.plan.d:
            raise ConfigError(f"hybrid plan {self.plan.source or ''} is for model {self.plan.model!r} of d = "
                              f"{self.plan.d:,} parameters: this model has {sum(sizes.values()):,}: valid a plan made "
                              "for this model (sparsim workload hybrid-plan)")
        self._names, self._sizes = names, sizes
        self._ids = {id(p): n for n, p in named}
        try:
            self._world = self._group_rank_size()[1]
        except (RuntimeError, ValueError):  # no process group yet: checked at the first hook call
            self._world = None
        if self._pending_load is not None:
            sd, self._pending_load = self._pending_load, None
            self.load_state_dict(sd)
        return self

    def state_dict(self) -> dict:
        """This rank's state as plain types and CPU tensors (``torch.save`` / ``torch.load`` with the default
        ``weights_only=True`` work): format, algorithm, world_size, rank, iteration, selected, applied, params
        (list of [name, numel]), residuals (dict name -> 1-D tensor), algorithm_state (the p2p wire's per-unit
        algorithm state as plain types and tensors, :func:`_to_plain`, so that ``weights_only`` loading reads
        it without unpickling code). Raises
        ConfigError if not bound."""
        if self._names is None:
            raise ConfigError("state_dict of an unbound SparseState: valid after register_sparse_hook(ddp_model, ...) "
                              "or state.bind(ddp_model)")
        rank, P = self._group_rank_size()
        return {"format": STATE_FORMAT, "algorithm": self.algorithm, "world_size": int(P), "rank": int(rank),
                "iteration": int(self.iteration), "selected": int(self.selected), "applied": int(self.applied),
                "params": [[n, int(self._sizes[n])] for n in self._names],
                "residuals": {n: t.detach().to("cpu", copy=True) for n, t in self.residuals.items()},
                "algorithm_state": _to_plain(self.algo_state)}

    def load_state_dict(self, sd: dict) -> None:
        """Restore a :meth:`state_dict` saved by the same rank of the same model and world size.

        Residuals move to the gradients' device at their first use. Before :meth:`bind` the dict is kept and
        checked at binding. Raises ConfigError (one line) for another format, model (parameter names or
        sizes), world size or rank.
        """
        if not isinstance(sd, dict) or sd.get("format") != STATE_FORMAT:
            got = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
            raise ConfigError(f"checkpoint format = {got!r} is not a sparse-hook state: valid {STATE_FORMAT!r} "
                              "(SparseState.state_dict())")
        if self._names is None:
            self._pending_load = sd
            return
        names = [str(n) for n, _ in sd["params"]]
        sizes = {str(n): int(s) for n, s in sd["params"]}
        if names != self._names or sizes != self._sizes:
            raise ConfigError(_model_mismatch(names, sizes, self._names, self._sizes, "the checkpoint is from"))
        rank, P = self._group_rank_size()
        if int(sd["world_size"]) != P:
            raise ConfigError(f"checkpoint world_size = {sd['world_size']} does not match this process group: "
                              f"valid world_size = {P}")
        if int(sd["rank"]) != rank:
            raise ConfigError(f"checkpoint rank = {sd['rank']} loaded on rank {rank}: valid each rank its own "
                              f"state_dict (rank = {rank})")
        res = sd["residuals"]
        bad = [n for n in res if n not in self._sizes or res[n].numel() != self._sizes[n]]
        if bad:
            raise ConfigError(f"checkpoint residual {bad[0]!r} does not fit the model: valid residuals of the "
                              "model's parameters")
        self.residuals = {n: t.detach().clone().reshape(-1) for n, t in res.items()}
        self._arenas = {}
        self.algo_state = _from_plain(sd["algorithm_state"]) if "algorithm_state" in sd else {}
        self.iteration, self.selected, self.applied = int(sd["iteration"]), int(sd["selected"]), int(sd["applied"])

    # -- residual storage ------------------------------------------------------------------------------------
    def _arena(self, names: list, sizes: list, device, dtype):
        """A flat tensor (sum(sizes),) whose consecutive slices ARE the residuals of ``names`` (created as zeros
        when missing, moved to device / dtype when loaded elsewhere); ``self.residuals`` then holds views of it."""
        import torch

        key = tuple(names)
        flat = self._arenas.get(key)
        if flat is not None and flat.device == device and flat.dtype == dtype:
            return flat
        parts = []
        for n, s in zip(names, sizes):
            r = self.residuals.get(n)
            if r is None:
                r = torch.zeros(s, dtype=dtype, device=device)
            elif r.device != device or r.dtype != dtype:
                r = r.to(device=device, dtype=dtype)
            parts.append(r)
        flat = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
        off = 0
        for n, s in zip(names, sizes):
            self.residuals[n] = flat[off:off + s]
            off += s
        for other in [o for o in self._arenas if o != key and not set(o).isdisjoint(key)]:
            del self._arenas[other]
        self._arenas[key] = flat
        return flat

    def _rng(self):
        """The per-iteration rand-k generator (created at the iteration's first draw)."""
        t = self.iteration + 1
        if self._rng_state is None or self._rng_state[0] != t:
            rank = self._group_rank_size()[0]
            self._rng_state = (t, np.random.default_rng([self.seed, rank, t, RANDK_STREAM]))
        return self._rng_state[1]

    def _add(self, busy_i: int, dt: float, selected: int = 0, applied: int = 0, callback: float | None = None):
        with self._lock:
            self.busy[busy_i] += dt
            self.selected += selected
            self.applied += applied
            if callback is not None:  # the completion's thread CPU seconds
                self.callback_s += dt
                self.callback_cpu_s += callback


#: Markers of the non-plain values in :func:`_to_plain`'s output.
_RANDOM_STATE, _NP_SCALAR = "__numpy.random.RandomState__", "__numpy.scalar__"


def _to_plain(obj):
    """The algorithms' state (dicts, lists, tuples, numbers, strings, numpy arrays and scalars, numpy
    ``RandomState``) as what ``torch.load(weights_only=True)`` reads: arrays become CPU tensors (copies, same
    dtype), a RandomState ``{_RANDOM_STATE: its get_state() with the key as an int64 tensor}``, a numpy scalar
    ``{_NP_SCALAR: (dtype name, value)}`` (kept a numpy scalar on the way back: numpy's promotion treats it
    unlike a Python number). No pickled code, so loading a checkpoint executes nothing. Raises SparsimError
    naming any other type."""
    import torch

    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_plain(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, np.random.RandomState):
        name, key, pos, has_gauss, cached = obj.get_state()
        return {_RANDOM_STATE: (name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached))}
    if isinstance(obj, np.generic):
        return {_NP_SCALAR: (obj.dtype.name, obj.item())}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise SparsimError(f"algorithm state of type {type(obj).__name__} cannot be checkpointed: valid dicts, lists, "
                       "tuples, numbers, strings, numpy arrays, scalars and RandomState")


def _from_plain(obj):
    """Inverse of :func:`_to_plain` (tensors become numpy arrays). Raises ConfigError for a marker that does not
    hold what :func:`_to_plain` wrote."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numpy().copy()
    if isinstance(obj, dict):
        try:
            if set(obj) == {_RANDOM_STATE}:
                name, key, pos, has_gauss, cached = obj[_RANDOM_STATE]
                rs = np.random.RandomState()
                rs.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, cached))
                return rs
            if set(obj) == {_NP_SCALAR}:
                dtype, value = obj[_NP_SCALAR]
                return np.dtype(dtype).type(value)
        except (TypeError, ValueError, AttributeError) as err:
            raise ConfigError(f"checkpoint algorithm_state holds a malformed {next(iter(obj))} ({err}): valid "
                              "what SparseState.state_dict() wrote") from None
        return {k: _from_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_from_plain(v) for v in obj)
    return obj


def _model_mismatch(names_a, sizes_a, names_b, sizes_b, what: str) -> str:
    """One line naming the first parameter where two models differ."""
    for n in names_a:
        if n not in sizes_b:
            return (f"{what} another model: parameter {n!r} is not in this model "
                    f"({len(names_b)} parameters): valid a state of this model")
        if sizes_a[n] != sizes_b[n]:
            return (f"{what} another model: parameter {n!r} has {sizes_a[n]} elements there and {sizes_b[n]} here: "
                    "valid a state of this model")
    missing = [n for n in names_b if n not in sizes_a]
    if missing:
        return f"{what} another model: it lacks parameter {missing[0]!r}: valid a state of this model"
    return f"{what} another model: its parameters are in another order: valid a state of this model"


class SparseHookState(SparseState):
    """:class:`SparseState` with the defaults of the first version of this hook, kept for existing code
    (``benchmarks/bench_ddp_reality.py`` models exactly this hook): per-bucket selection and the synchronous
    point-to-point wire (``scope="bucket"``, ``wire="p2p"``); the first positional argument is the algorithm.
    Works without :meth:`~SparseState.bind` (residuals then keyed by the tensors' identity in this process,
    and no checkpoints). Raises ConfigError as :class:`SparseState`."""

    def __init__(self, algorithm: str = "gtopk", density: float = 0.01, k: int | None = None,
                 collective: str | None = None, mask: str = "exact", lr: float = 1.0, timeout_s: float = 60.0, *,
                 process_group=None, scope: str = "bucket", wire: str = "p2p", **kwargs):
        super().__init__(process_group, algorithm, density, k=k, collective=collective, mask=mask, lr=lr,
                         timeout_s=timeout_s, scope=scope, wire=wire, **kwargs)

    def transport(self, device: str):
        """The :class:`~sim.distributed.backend.TorchTransport` of this rank (created on first use)."""
        return _transport(self, device)


# ================================================================================ the hook


def _transport(state: SparseState, device: str):
    """The p2p wire's TorchTransport, its peers the ranks of the state's process group."""
    if state._transport is None:
        import torch.distributed as dist

        from sim.distributed.backend import TorchTransport

        rank, P = state._group_rank_size()
        tr = TorchTransport(rank, P, device=device, timeout_s=state.timeout_s)
        if state.process_group is not None and state.process_group != dist.group.WORLD:
            tr.dist = _GroupDist(state.process_group)
        state._transport = tr
    return state._transport


class _GroupDist:
    """The few ``torch.distributed`` calls of TorchTransport, with peers given as ranks of one process group."""

    def __init__(self, group):
        import torch.distributed as dist

        self._g, self._d = group, dist
        self._map = {r: dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))}

    def isend(self, t, dst):
        return self._d.isend(t, self._map[dst], group=self._g)

    def irecv(self, t, src):
        return self._d.irecv(t, self._map[src], group=self._g)

    def P2POp(self, op, t, peer):  # noqa: N802 - torch's name
        real = self._d.isend if op == self.isend else self._d.irecv
        return self._d.P2POp(real, t, self._map[peer], group=self._g)

    def batch_isend_irecv(self, ops):
        return self._d.batch_isend_irecv(ops)

    def barrier(self):
        return self._d.barrier(group=self._g)


def _residual_dtype(dtype):
    import torch

    if dtype == torch.float64:
        return torch.float64
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.float32
    raise ConfigError(f"gradient dtype = {dtype} is not supported by the sparse hook: valid float32, float16, "
                      "bfloat16, float64")


def _bucket_layout(state: SparseState, bucket, buf) -> list:
    """[(name, offset, n)] of the bucket's parameters in its buffer. Unbound states key by tensor identity."""
    out, off = [], 0
    for p in bucket.parameters():
        n = int(p.numel())
        name = state._ids.get(id(p))
        if name is None:
            if state._names is not None:
                raise ConfigError("a bucket parameter is not a parameter of the model this state is bound to: "
                                  "valid the model passed to register_sparse_hook")
            name = f"<tensor {id(p):#x}>"
            state._sizes[name] = n
        out.append((name, off, n))
        off += n
    if off != int(buf.numel()):
        raise ConfigError(f"bucket {bucket.index()} holds {int(buf.numel())} entries but its parameters "
                          f"{off}: valid dense buckets without padding")
    return out


def _accumulate(flat, grad, lr: float) -> None:
    """flat <- flat + lr * grad in flat's dtype: the bits of sgd_step's ``acc = lr * grad; acc += eps``
    (IEEE addition commutes; no fused multiply-add)."""
    if grad.dtype != flat.dtype:
        grad = grad.to(flat.dtype)
        if lr != 1.0:
            grad.mul_(lr)
    elif lr != 1.0:
        grad = grad * lr
    flat.add_(grad)


def _check_selected(state, val, acc, where: str) -> None:
    """NonFiniteError unless the accumulator is finite with |entries| <= DIVERGENCE_LIMIT: on the selected
    values for top-k selections (they hold the largest magnitude), on the whole accumulator otherwise."""

    x = acc if state.spec.checks_all else val
    if x.numel() == 0:
        return
    m = float(x.abs().max())
    if not m <= DIVERGENCE_LIMIT:  # NaN fails too
        bad = "not finite" if not math.isfinite(m) else f"{m:.4g} (beyond {DIVERGENCE_LIMIT:g}: the run diverged)"
        raise NonFiniteError(f"sparse hook, {where}: the error-feedback accumulator is {bad}: valid finite values; "
                             "lower the learning rate or check the data")


def _dense_allreduce(buf, group, P: int):
    """What DDP does without a hook: the bucket times 1/P, then an asynchronous sum allreduce."""
    import torch.distributed as dist

    buf.mul_(1.0 / P)
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda fut: buf)


def sparse_hook(state: SparseState, bucket):
    """DDP communication hook: sparse S-SGD with error feedback (see the module docstring).

    state: a :class:`SparseState` (bound to the model by :func:`register_sparse_hook`). bucket: a
    ``torch.distributed.GradBucket``; its buffer (flat float32 / float16 / bfloat16 / float64, n entries)
    holds this rank's local gradient. Returns a ``torch.futures.Future`` of a tensor like the buffer holding
    g / P (the buffer itself, overwritten): pending while the asynchronous all_gather runs (wire
    "allgather"), completed for the p2p wire. Raises ConfigError for an unsupported dtype or a parameter of
    another model, NonFiniteError for NaN/Inf accumulators, WorkerFailure when a p2p peer fails.
    """
    t0, c0 = time.perf_counter(), time.thread_time()
    buf = bucket.buffer()
    try:
        if state.iteration < state.start_iter:
            _, P = state._group_rank_size()
            return _dense_allreduce(buf, state._group(), P)
        density = None
        if state.plan is not None:
            density = _plan_density(state, bucket, buf)
            if density is None:
                return _plan_dense_hook(state, bucket, buf)
        if state.wire == "p2p":
            return _p2p_hook(state, bucket, buf, density)
        if state.scope == "model":
            return _model_hook(state, bucket, buf)
        return _unit_hook(state, bucket, buf, density)
    except BaseException as err:
        _fail_pending(state, err)
        raise
    finally:
        if bucket.is_last():
            state.iteration += 1
        state.hook_s += time.perf_counter() - t0
        state.hook_cpu_s += time.thread_time() - c0


def _fail_pending(state: SparseState, err: BaseException) -> None:
    """Complete the model scope's pending futures with ``err`` (DDP would otherwise wait on them forever)."""
    pending, state._pending = state._pending, []
    for _, _, fut in pending:
        if not fut.done():
            fut.set_exception(err)


def _where(state: SparseState, bucket, name: str | None = None) -> str:
    return f"iteration {state.iteration + 1}, bucket {bucket.index()}" + (f", parameter {name!r}" if name else "")


def _select(state: SparseState, flat, k: int, where: str):
    """Run the algorithm's selection on one unit's accumulator and check it."""
    try:
        idx, val = state.spec.select(flat, k, state)
    except NonFiniteError as err:
        raise NonFiniteError(f"sparse hook, {where}: {err}") from None
    _check_selected(state, val, flat, where)
    return idx, val


def _pack(vals, idx):
    """One uint8 tensor: the values' bytes, then the indices' (int32 below 2^31, else int64)."""
    import torch

    return torch.cat((vals.view(torch.uint8), idx.view(torch.uint8)))


def _unpack(raw, slots: int, vdtype, idtype):
    """(vals, idx int64) from a :func:`_pack` buffer of ``slots`` entries."""
    import torch

    vb = torch.empty((), dtype=vdtype).element_size()
    head, tail = raw[:slots * vb], raw[slots * vb:]
    ib = torch.empty((), dtype=idtype).element_size()
    if (slots * vb) % ib:
        tail = tail.clone()
    return head.view(vdtype), tail.view(idtype).long()


def _index_dtype(n: int):
    import torch

    return torch.int32 if n < 2 ** 31 else torch.int64


def _divide(vals, P: int):
    """vals / P by true division on any device (a scalar divisor may become a multiplication by 1/P on GPU)."""
    import torch

    return vals / torch.full((1,), float(P), dtype=vals.dtype, device=vals.device)


def _gather(state: SparseState, packed, P: int):
    """Launch the asynchronous all_gather of ``packed``; returns (future, list of P output tensors)."""
    import torch
    import torch.distributed as dist

    outs = [torch.empty_like(packed) for _ in range(P)]
    work = dist.all_gather(outs, packed, group=state._group(), async_op=True)
    return work.get_future(), outs


def _combine_into(state: SparseState, out, units, rows, P: int, rank: int):
    """Fill ``out`` (zeros, the residual dtype, the concatenated units' length) with g / P from the gathered
    rows [(vals, idx)] by rank, and update the residuals of gTop-k units. units: [(offset in out, n, k, slot
    start, flat, own (idx, val))]. Returns (selected, applied) of this rank.

    On the CPU the index operations run on zero-copy numpy views of the same tensors (``np.add.at`` for
    ``index_add_``, :func:`_replay_numpy` for the merges): torch's CPU indexing cost several times more at the
    hook's sizes; the operations and their order are the same, so are the bits."""
    import torch

    cpu = out.device.type == "cpu"
    if state.spec.combine == "sum":
        # padding slots are (index 0, +0.0): adding them changes no bit; every rank's row is added in rank order
        if cpu:
            o = out.numpy()
            for vals, idx in rows:
                np.add.at(o, idx.numpy(), vals.numpy())
        else:
            for vals, idx in rows:
                out.index_add_(0, idx, vals)
        entries = sum(int(idx.shape[0]) for _, idx in rows)
        if entries * 64 >= out.shape[0]:
            # the entries off the union are +0.0 and stay +0.0: one division of the whole buffer costs less
            # than gathering and scattering the union (the same division of each entry of it)
            out.div_(torch.full((1,), float(P), dtype=out.dtype, device=out.device))
        elif cpu:
            u = np.concatenate([idx.numpy() for _, idx in rows])
            o[u] = o[u] / o.dtype.type(P)
        else:
            u = torch.cat([idx for _, idx in rows])
            out[u] = _divide(out[u], P)
        return 0, 0
    exact = state.mask == "exact"
    applied = 0
    if cpu:
        o = out.numpy()
        rows_np = [(vals.numpy(), idx.numpy()) for vals, idx in rows]
        if len(units) > 1 and all(units[j][0] < units[j + 1][0] for j in range(len(units) - 1)):
            # all units' merges at once: one merge per step of the schedule, not one per unit
            return 0, _combine_gtopk_units(state, o, units, rows_np, P, rank)
        for off, n, k, s0, flat, own in units:
            g_idx, g_val, alive = _replay_numpy(_unit_sels(rows_np, off, k, s0), k, rank, state.collective, exact)
            flat.numpy()[own[0].numpy()[alive]] = 0
            applied += int(np.count_nonzero(alive))
            o[off + g_idx] = g_val / g_val.dtype.type(P)
        return 0, applied
    for off, n, k, s0, flat, own in units:
        g_idx, g_val, alive = gtopk_replay(_unit_sels(rows, off, k, s0), k, rank, state.collective, exact,
                                           impl="torch")
        flat[own[0][alive]] = 0
        applied += int(alive.sum())
        out[off + g_idx] = _divide(g_val, P)
    return 0, applied


def _unit_sels(rows, off: int, k: int, s0: int) -> list:
    """Every rank's selection of one unit from the gathered rows: the unit's k slots starting at slot ``s0`` of
    each row (values, global indices; numpy arrays or torch tensors), padding (exact zeros) dropped, indices made
    local by subtracting the unit's offset ``off``. Returns [(idx, val)] in rank order."""
    sels = []
    for vals, idx in rows:
        v, i = vals[s0:s0 + k], idx[s0:s0 + k]
        nz = v != 0
        sels.append((i[nz] - off, v[nz]))
    return sels


def _merge_units(a, b, starts, ks):
    """The gTop-k merge a T b of every unit at once, on numpy (idx, val) pairs of global indices (ascending).

    Unit u holds the indices [starts[u], starts[u + 1]); ks[u] is its k. The same operations as
    :func:`sim.comm.compression.merge` on each unit: the union of the supports with the sums ``(0 + a_i) + b_i``
    (``0 + a_i`` / ``0 + b_i`` where one holds the index) in the promoted dtype, then in each unit its ks[u]
    largest magnitudes (ties to the lower index), exact zeros dropped (tests/test_ddp_hooks_ops.py)."""
    from sim.comm.compression import topk_positions, sum_on_union

    idx, val = sum_on_union(a[0], a[1], b[0], b[1])
    keep = val != 0
    bounds = np.searchsorted(idx, starts)
    for u in np.flatnonzero(np.diff(bounds) > ks):  # units holding more than their k
        lo, hi = int(bounds[u]), int(bounds[u + 1])
        keep[lo:hi] = False
        keep[lo + topk_positions(val[lo:hi], int(ks[u]))] = True
    return idx[keep], val[keep]


def _combine_gtopk_units(state: SparseState, o: np.ndarray, units, rows_np, P: int, rank: int) -> int:
    """The CPU gTop-k combine of several units (``scope="parameter"``): every rank's row without its padding is
    one vector of global indices, the merges of :func:`_replay` run on all units at once
    (:func:`_merge_units`), g / P goes into ``o`` and this rank's residuals lose what reached g. Bit for bit the
    per-unit replay (units are disjoint index ranges, each merged by the same rule in the same order).
    Returns the entries applied."""
    from sim.comm.collectives import in_sorted

    starts = np.array([u[0] for u in units] + [units[-1][0] + units[-1][1]], dtype=np.int64)
    ks = np.array([u[2] for u in units], dtype=np.int64)
    sels = []
    for vals, idx in rows_np:
        nz = vals != 0  # padding slots hold +0.0; a selection never holds an exact zero
        sels.append((idx[nz].astype(np.int64), vals[nz]))
    g_idx, g_val, alive = _replay(sels, 0, rank, state.collective, state.mask == "exact",
                                  lambda a, b: _merge_units(a, b, starts, ks), in_sorted,
                                  lambda a: np.ones(a.shape[0], dtype=bool))
    o[g_idx] = g_val / g_val.dtype.type(P)
    own = sels[rank][0][alive]
    cut = np.searchsorted(own, starts)
    for j, (off, n, k, s0, flat, _) in enumerate(units):
        if cut[j + 1] > cut[j]:
            flat.numpy()[own[cut[j]:cut[j + 1]] - off] = 0
    return int(own.shape[0])


def _zero_at(flat, i) -> None:
    """flat[i] = 0 (on the CPU through numpy views: torch's CPU index_put costs several times more)."""
    if flat.device.type == "cpu":
        flat.numpy()[i.numpy()] = 0
    else:
        flat[i] = 0


def _launch(state: SparseState, units, total: int, slots: int, device, rdtype, finish, target=None):
    """Pack the units' selections (slot-padded), start the all_gather, return the future whose completion
    computes g / P into ``target`` (zeroed first; default a new tensor of ``total`` entries of the residual
    dtype) and returns ``finish(g_over_P)``."""
    import torch

    rank, P = state._group_rank_size()
    idtype = _index_dtype(total)
    vals = torch.zeros(slots, dtype=rdtype, device=device)
    idx = torch.zeros(slots, dtype=idtype, device=device)
    if vals.device.type == "cpu":
        vn, inn = vals.numpy(), idx.numpy()
        for off, n, k, s0, flat, (i, v) in units:
            m = int(i.shape[0])
            vn[s0:s0 + m] = v.numpy()
            inn[s0:s0 + m] = i.numpy() + off
    else:
        for off, n, k, s0, flat, (i, v) in units:
            m = int(i.shape[0])
            vals[s0:s0 + m] = v
            idx[s0:s0 + m] = i + off
    fut, outs = _gather(state, _pack(vals, idx), P)

    def done(f):
        t0, c0 = time.perf_counter(), time.thread_time()
        f.wait()
        rows = [_unpack(o, slots, rdtype, idtype) for o in outs]
        out = torch.zeros(total, dtype=rdtype, device=device) if target is None else target.zero_()
        _, applied = _combine_into(state, out, units, rows, P, rank)
        res = finish(out)
        state._add(0 if state.spec.combine == "sum" else 1, time.perf_counter() - t0, applied=applied,
                   callback=time.thread_time() - c0)
        return res

    return fut.then(done)


def _unit_hook(state: SparseState, bucket, buf, density: float | None = None):
    """Scopes "parameter" and "bucket": select per unit now, one all_gather for the bucket, combine on completion.
    density: the unit's density (a hybrid plan's bucket), else the state's."""
    t0 = time.perf_counter()
    rdtype = _residual_dtype(buf.dtype)
    layout = _bucket_layout(state, bucket, buf)
    if state.scope == "bucket":
        groups = [(0, int(buf.numel()), [n for n, _, _ in layout], [s for _, _, s in layout], None)]
    else:
        groups = [(off, n, [name], [n], name) for name, off, n in layout]
    units, s0, sel = [], 0, 0
    t_acc = 0.0
    for off, n, names, sizes, pname in groups:
        ta = time.perf_counter()
        flat = state._arena(names, sizes, buf.device, rdtype)
        _accumulate(flat, buf[off:off + n], state.lr)
        t_acc += time.perf_counter() - ta
        k = state.k_for(n, density=density)
        i, v = _select(state, flat, k, _where(state, bucket, pname))
        if state.spec.combine == "sum":
            _zero_at(flat, i)  # eps = acc - Sel(acc): every selected entry is applied
        units.append((off, n, k, s0, flat, (i, v)))
        s0 += k
        sel += int(i.shape[0])
    is_sum = state.spec.combine == "sum"
    state._add(0, t_acc)
    state._add(1, time.perf_counter() - t0 - t_acc, selected=sel, applied=sel if is_sum else 0)

    same = buf.dtype == rdtype

    def finish(out):
        if not same:
            buf.copy_(out)  # one rounding to the gradient dtype
        return buf

    return _launch(state, units, int(buf.numel()), s0, buf.device, rdtype, finish, target=buf if same else None)


def _model_hook(state: SparseState, bucket, buf):
    """Scope "model": accumulate each bucket into the model-order residual arena; at the last bucket select
    over the whole model, gather, and complete every bucket's future."""
    import torch

    if state._names is None:
        raise ConfigError("scope = 'model' needs the parameter order: register the hook with "
                          "register_sparse_hook(ddp_model, ...) (or call state.bind(ddp_model))")
    t0 = time.perf_counter()
    rdtype = _residual_dtype(buf.dtype)
    layout = _bucket_layout(state, bucket, buf)
    names = state._names
    flat = state._arena(names, [state._sizes[n] for n in names], buf.device, rdtype)
    offsets = _model_offsets(state)
    for name, off, n in layout:
        o = offsets[name]
        _accumulate(flat[o:o + n], buf[off:off + n], state.lr)
    if not bucket.is_last():
        fut = torch.futures.Future()
        state._pending.append((buf, layout, fut))
        state._add(0, time.perf_counter() - t0)
        return fut
    t1 = time.perf_counter()
    d = int(flat.shape[0])
    k = state.k_for(d)
    i, v = _select(state, flat, k, f"iteration {state.iteration + 1}, whole model")
    is_sum = state.spec.combine == "sum"
    if is_sum:
        _zero_at(flat, i)
    pending, state._pending = state._pending, []
    state._add(0, t1 - t0)
    state._add(1, time.perf_counter() - t1, selected=int(i.shape[0]), applied=int(i.shape[0]) if is_sum else 0)
    mine = (buf, layout, None)

    def finish(out):
        for b, lay, _ in pending + [mine]:
            for name, off, n in lay:
                o = offsets[name]
                b[off:off + n].copy_(out[o:o + n])
        for b, _, f in pending:
            f.set_result(b)
        return buf

    fut = _launch(state, [(0, d, k, 0, flat, (i, v))], d, k, buf.device, rdtype, finish)

    def on_error(f):
        try:
            return f.value()
        except BaseException as err:  # the gather or the combine failed: the earlier buckets fail too
            for _, _, pf in pending:
                if not pf.done():
                    pf.set_exception(err)
            raise

    return fut.then(on_error)


def _model_offsets(state: SparseState) -> dict:
    offs, o = {}, 0
    for n in state._names:
        offs[n] = o
        o += state._sizes[n]
    return offs


# -------------------------------------------------------------------------------- p2p wire (synchronous)


def _p2p_unit(state: SparseState, grad_np: np.ndarray, eps_np: np.ndarray, k: int, device: str, where: str,
              unit: tuple = (), shapes: tuple = ()):
    """One sgd_step over the unit ``unit`` (its parameter names, their tensor ``shapes``) through the
    TorchTransport, with the unit's algorithm state (``state.algo_state[unit]``, updated); returns its StepOutput."""
    from sim.distributed.backend import execute

    rank, P = state._group_rank_size()
    tr = _transport(state, device) if P > 1 else None
    opts = _unit_options(state.algorithm, state.options, tuple(shapes))
    spec = AlgorithmSpec(state.algorithm, k=k, collective=state.collective, mask=state.mask,
                         value_bytes=grad_np.dtype.itemsize, index_bytes=8, seed=state.seed,
                         options=tuple(opts.items()))
    if tr is not None:
        tr.where = where
    unit_state = state.algo_state.setdefault(tuple(unit), {})
    lend = getattr(REGISTRY[state.algorithm], "hook_unit_state", None)
    give_back = lend(state.algo_state.setdefault((), {}), unit_state, state.seed) if lend is not None else None
    prog = sgd_step(spec, rank, P, np.zeros_like(grad_np), eps_np, lambda v: grad_np, 1, state.lr,
                    state.iteration + 1, unit_state)
    try:
        out = execute(prog, tr, state.busy)
    except NonFiniteError as err:
        raise NonFiniteError(f"sparse hook, {where}: {err}") from None
    finally:
        if give_back is not None:
            give_back()
    with state._lock:
        state.selected += out.n_selected
        state.applied += out.n_applied
    return out


def _unit_options(algorithm: str, options: dict, shapes) -> dict:
    """The registry options of one unit's sgd_step: ``options``, completed by the algorithm's ``hook_unit_options``
    where it has one (PowerSGD's torch variant views the unit's tensors by their ``shapes``, a tuple of shapes;
    None: before the model is known). Raises what that method raises (ConfigError)."""
    complete = getattr(REGISTRY[algorithm], "hook_unit_options", None)
    return dict(options) if complete is None else complete(dict(options), shapes)


def _np(t) -> np.ndarray:
    return t.detach().cpu().numpy()


def _p2p_hook(state: SparseState, bucket, buf, density: float | None = None):
    """The wire "p2p": sgd_step itself per unit, synchronously (the exact messages of the collectives). density: the
    unit's density (a hybrid plan's bucket), else the state's."""
    import torch

    rdtype = _residual_dtype(buf.dtype)
    layout = _bucket_layout(state, bucket, buf)
    for (name, _, _), p in zip(layout, bucket.parameters()):
        state._shapes[name] = tuple(p.shape)  # PowerSGD's torch variant views each tensor by its shape
    device = "cpu" if buf.device.type == "cpu" else str(buf.device)
    P = state._group_rank_size()[1]
    grad = buf.detach().to(rdtype)
    if state.scope == "model":
        if state._names is None:
            raise ConfigError("scope = 'model' needs the parameter order: register the hook with "
                              "register_sparse_hook(ddp_model, ...) (or call state.bind(ddp_model))")
        offsets = _model_offsets(state)
        d = sum(state._sizes.values())
        if state._grad_acc is None:
            state._grad_acc = (torch.zeros(d, dtype=rdtype), [])
        gacc, lays = state._grad_acc
        for name, off, n in layout:
            gacc[offsets[name]:offsets[name] + n].copy_(grad[off:off + n].cpu())
        lays.append((buf, layout))
        fut = torch.futures.Future()
        if not bucket.is_last():
            state._pending.append((buf, layout, fut))
            return fut
        state._grad_acc = None
        flat = state._arena(state._names, [state._sizes[n] for n in state._names], torch.device("cpu"), rdtype)
        out = _p2p_unit(state, _np(gacc), _np(flat).copy(), state.k_for(d), device,
                        f"DDP step {state.iteration + 1}, whole model", tuple(state._names),
                        tuple(state._shapes[n] for n in state._names))
        flat.copy_(torch.from_numpy(out.residual))
        upd = torch.from_numpy(out.update / P)
        for b, lay in lays:
            for name, off, n in lay:
                b[off:off + n].copy_(upd[offsets[name]:offsets[name] + n])
        pending, state._pending = state._pending, []
        for b, _, f in pending:
            f.set_result(b)
        fut.set_result(buf)
        return fut
    if state.scope == "bucket":
        groups = [(0, int(buf.numel()), [n for n, _, _ in layout], [s for _, _, s in layout])]
    else:
        groups = [(off, n, [name], [n]) for name, off, n in layout]
    for off, n, names, sizes in groups:
        flat = state._arena(names, sizes, buf.device, rdtype)
        out = _p2p_unit(state, _np(grad[off:off + n]), _np(flat).copy(), state.k_for(n, density=density), device,
                        f"DDP step {state.iteration + 1}, bucket {bucket.index()}", tuple(names),
                        tuple(state._shapes[m] for m in names))
        flat.copy_(torch.from_numpy(out.residual))
        buf[off:off + n].copy_(torch.from_numpy(out.update / P))
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


# -------------------------------------------------------------------------------- hybrid plan


def _load_plan(plan):
    """A :class:`sim.engine.hybrid.HybridPlan` from a plan or the path of its JSON file (ConfigError, one line)."""
    from sim.engine.hybrid import HybridPlan, load_plan

    return plan if isinstance(plan, HybridPlan) else load_plan(plan)


def _plan_density(state: SparseState, bucket, buf):
    """The plan's density of this DDP bucket (None: dense). Raises ConfigError unless DDP's bucket of this index has
    the plan's size."""
    plan, j, n = state.plan, int(bucket.index()), int(buf.numel())
    if j >= len(plan.bucket_sizes) or plan.bucket_sizes[j] != n:
        what = f"the plan has {len(plan.bucket_sizes)} buckets" if j >= len(plan.bucket_sizes) else \
            f"the plan's bucket {j} holds {plan.bucket_sizes[j]:,}"
        raise ConfigError(f"DDP bucket {j} holds {n:,} entries but {what} (hybrid plan {plan.source or ''} for "
                          f"{plan.model!r}): valid the bucket caps the plan was made with (bucket_cap_mb = "
                          f"{plan.bucket_cap_mb}, first_bucket_mb = {plan.first_bucket_mb}) and settle_buckets before "
                          "the first step")
    return plan.densities[j]


def _plan_dense_hook(state: SparseState, bucket, buf):
    """A hybrid plan's dense bucket: acc = lr x grad (no residual: 0 + lr grad, the bits of sgd_step's accumulator of a
    segment never compressed), its finiteness checked, summed by an asynchronous ``all_reduce``, divided by P on
    completion into the bucket buffer (rounded to its dtype once). The p2p wire waits for the allreduce here."""
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    _bucket_layout(state, bucket, buf)  # its parameters are the bound model's
    rdtype = _residual_dtype(buf.dtype)
    n = int(buf.numel())
    acc = torch.zeros(n, dtype=rdtype, device=buf.device)
    _accumulate(acc, buf, state.lr)
    m = float(acc.abs().max()) if n else 0.0
    if not m <= DIVERGENCE_LIMIT:  # NaN fails too
        bad = "not finite" if not math.isfinite(m) else f"{m:.4g} (beyond {DIVERGENCE_LIMIT:g}: the run diverged)"
        raise NonFiniteError(f"sparse hook, {_where(state, bucket)} (dense in the hybrid plan): the gradient times lr "
                             f"is {bad}: valid finite values; lower the learning rate or check the data")
    _, P = state._group_rank_size()
    state._add(0, time.perf_counter() - t0, selected=n, applied=n)
    work = dist.all_reduce(acc, group=state._group(), async_op=True)

    def done(f):
        f.wait()
        buf.copy_(_divide(acc, P))
        return buf

    if state.wire == "p2p":
        work.wait()
        fut = torch.futures.Future()
        fut.set_result(done(work.get_future()))
        return fut
    return work.get_future().then(done)


# ================================================================================ registration


def settle_buckets(ddp_model, loss_fn) -> None:
    """Let DDP form its final buckets before training, so that ``scope="bucket"`` selects over the same units from
    the first step (the units of the simulator's ``workload.sparse_policy = "bucket"``, docs/networks-backends.md).

    torch 2.13's DDP (without ``find_unused_parameters`` or per-bucket caps) communicates the whole model as ONE
    bucket in its first backward and rebuilds its buckets, in the order the gradients became ready, at the next
    forward. This runs that first backward: ``loss_fn(ddp_model)`` (a callable returning a scalar loss, e.g. the loss
    of the first mini-batch) and its backward with DDP's own allreduce, no optimizer step; then drops the gradients
    (``grad = None``) and restores the module's buffers (BatchNorm running statistics and counters), so the model is
    as it was. Call it before :func:`register_sparse_hook` (every rank, collectively, as any DDP step). Raises
    ConfigError when a communication hook is already registered (it would see this backward as a training step).
    """
    import torch

    if getattr(ddp_model, "_comm_hooks", None):
        raise ConfigError("settle_buckets after a communication hook was registered: valid before "
                          "register_sparse_hook / register_comm_hook (the hook would count this backward as a step)")
    module = getattr(ddp_model, "module", ddp_model)
    saved = {k: b.detach().clone() for k, b in module.named_buffers()}
    loss_fn(ddp_model).backward()
    for p in ddp_model.parameters():
        p.grad = None
    with torch.no_grad():
        for k, b in module.named_buffers():
            b.copy_(saved[k])


def register_sparse_hook(ddp_model, algorithm: str = "gtopk", *, state: SparseState | None = None,
                         **kwargs) -> SparseState:
    """Register :func:`sparse_hook` on a ``DistributedDataParallel`` model; return its state.

    Either ``algorithm`` and the keyword options of :class:`SparseState` (density, k, scope, start_iter,
    density_schedule, schedule_iters, collective, mask, wire, lr, seed, timeout_s, plan -- a hybrid plan or its file,
    e.g. ``register_sparse_hook(ddp, "gtopk", plan="plan.json")``; process_group defaults to
    the model's ``ddp_model.process_group``), or a ready ``state`` (a state with process_group None takes the
    model's). Binds the state to the model's parameter names. Call once, before the first backward.
    Raises ConfigError for bad options, options given with ``state``, or a state whose process group is not
    the model's.
    """
    pg = getattr(ddp_model, "process_group", None)
    if state is None:
        kwargs.setdefault("process_group", pg)
        state = SparseState(algorithm=algorithm, **kwargs)
    elif kwargs:
        raise ConfigError(f"options {', '.join(sorted(kwargs))} given with state=: valid either a state or options")
    if state.process_group is None:
        state.process_group = pg
    elif pg is not None and state.process_group is not pg:
        raise ConfigError("state.process_group is not the DDP model's process group: valid "
                          "SparseState(ddp_model.process_group, ...) or process_group=None")
    state.bind(ddp_model)
    ddp_model.register_comm_hook(state, sparse_hook)
    return state
