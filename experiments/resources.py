"""What a scenario run needs before it allocates: a memory estimate held against this machine's available
memory, and an estimate of its work held against a documented limit (``sparsim run --yes`` lifts that one).

Memory (bytes; w = 8 for training.dtype float64, 4 for float32):

- simulator: w d (ARRAYS_PER_RANK P + ARRAYS_SHARED) (:data:`sim.engine.runner.ARRAYS_PER_RANK` = 12 vectors of d
  per simulated worker, :data:`sim.engine.runner.ARRAYS_SHARED` = 8 shared, rounded up from tracemalloc measurements)
  plus the data and the objective's arrays (:func:`data_bytes_synthetic`, :func:`data_bytes_dataset`);
- torch backend: every one of the P processes builds the whole objective and holds its own vectors
  (:data:`TORCH_ARRAYS_PER_RANK`) and the torch runtime (:data:`TORCH_PROCESS_BYTES`); rank 0 also gathers
  3 vectors of d from every rank per step; the launching process holds the data once more.

Available memory: ``psutil.virtual_memory().available`` (MemAvailable on Linux: free memory plus what the
kernel can reclaim without swapping).

Work, in units of one parameter of one worker in one iteration (about 1e-7 s of this project's reference
2-core VM), summed over the algorithms: ``iterations x P x (d + MESSAGE_UNITS m + STEP_UNITS)``, m = messages a
worker sends per step, on average, counted from the algorithm's own rounds (:func:`messages_per_step`: 2(P-1) for
the dense ring, P - 1 + 2 ceil(lg P) for Ok-Topk, both allreduces of PowerSGD, ..., times the segments of
layer-wise selection): measured, a message costs about
3e-5 s of simulation and a worker's step about 3e-4 s besides its vector work. Above :data:`MAX_WORK` (1e11
units, about 3 hours there) a run is refused unless ``yes``.
"""
from __future__ import annotations

import math

from sim.base.errors import ResourceError
from sim.engine.runner import ARRAYS_PER_RANK, ARRAYS_SHARED

from .resolve import algorithm_specs

__all__ = ["MAX_WORK", "SECONDS_PER_UNIT", "MESSAGE_UNITS", "STEP_UNITS", "TORCH_ARRAYS_PER_RANK",
           "TORCH_PROCESS_BYTES", "available_memory_bytes", "messages_per_step", "estimate_work",
           "estimate_memory", "data_bytes_synthetic", "data_bytes_dataset", "check_resources", "format_bytes"]

#: Largest estimated work (units) a run starts without ``--yes``: about 3 hours on the reference VM.
MAX_WORK = 1e11
#: Seconds one unit of work takes on the reference VM (2 cores), for the time shown with the estimate.
SECONDS_PER_UNIT = 1e-7
#: Work units of one message (about 3e-5 s of event simulation, collective bookkeeping included).
MESSAGE_UNITS = 300
#: Work units of one worker's step besides its vectors (gradient call, program set-up, metrics), ~3e-4 s.
STEP_UNITS = 3000
#: Vectors of d each torch rank holds at its peak (parameters, residual, the step's arrays, the collective's).
TORCH_ARRAYS_PER_RANK = 10
#: Private memory of one torch rank process before any data (measured USS of torch + torch.distributed: 166 MiB).
TORCH_PROCESS_BYTES = 256 * 2**20


def available_memory_bytes() -> int | None:
    """Memory this machine can give a new allocation without swapping (bytes): psutil's
    ``virtual_memory().available``, else MemAvailable of /proc/meminfo; None when neither can be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - psutil missing or unsupported here: fall back
        pass
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def format_bytes(n: float) -> str:
    """``n`` bytes as text in binary units, e.g. ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.3g} PiB"  # pragma: no cover


def _gpus_per_node(cl) -> int:
    from sim.machine.topology import CLUSTER_PRESETS

    if cl.network in CLUSTER_PRESETS:
        return CLUSTER_PRESETS[cl.network].gpus_per_node
    return cl.gpus_per_node if cl.network == "hierarchical" else 1


#: Largest P at which :func:`messages_per_step` enumerates the algorithm's rounds (a second at most); above it the
#: per-rank count at this P is scaled by (P - 1) / (MESSAGES_EXACT_MAX_P - 1): exact for the ring's 2(P - 1), an
#: upper bound for the logarithmic collectives and Ok-Topk's P - 1 + 2 ceil(lg P) (their counts grow slower).
MESSAGES_EXACT_MAX_P = 4096


def messages_per_step(spec, P: int, d: int, segments: int = 1) -> float:
    """Messages one worker sends per step on average (total over the P ranks / P), an estimate for
    :func:`estimate_work`, counted from the algorithm's own exchange (:meth:`sim.algorithms.Algorithm.fast_rounds`,
    the one timing-only definition both engines run: PowerSGD's two allreduces, Ok-Topk's P - 1 pairwise rounds
    and two allgathers, ...), times ``segments`` for a segmented algorithm with layer-wise selection; 0 when P = 1.
    spec: an :class:`~sim.algorithms.AlgorithmSpec`; d: parameters. Exact for P <= :data:`MESSAGES_EXACT_MAX_P`,
    an upper bound above it. Raises ConfigError as the algorithm's fast_rounds does."""
    from sim.comm.rounds import count_messages

    if P <= 1:
        return 0.0
    Pc = min(P, MESSAGES_EXACT_MAX_P)
    G = spec.gpus_per_node if spec.collective == "hierarchical" else 1
    if Pc % G:
        Pc = P  # a hierarchical collective needs whole nodes (P = 4096 is a multiple of every preset's G)
    m = count_messages(spec.algorithm.fast_rounds(spec, Pc, d, 1, G)) / Pc * ((P - 1) / (Pc - 1))
    return m * (max(segments, 1) if spec.algorithm.segmented else 1)


def estimate_work(sc, d: int) -> float:
    """Estimated work of running scenario ``sc`` with d parameters (units, see the module docstring)."""
    cl, c = sc.cluster, sc.compression
    P, T, G = cl.P, sc.training.iterations, _gpus_per_node(sc.cluster)
    segments = len(c.layer_sizes) or 1
    k = max(1, min(d, round(c.density * d))) if c.k is None else min(int(c.k), d)
    total = 0.0
    for spec in algorithm_specs(sc, k, G):
        m = messages_per_step(spec, P, d, segments)
        total += float(T) * P * (d + MESSAGE_UNITS * m + STEP_UNITS)
    return total


def data_bytes_synthetic(objective: str, d: int, n: int) -> int:
    """Bytes a synthetic objective allocates (:mod:`sim.workloads.objectives`, default parameters r = 4, nnz = 8):
    sines / double_well about 8 vectors of d (spectrum, the r x d noise basis, x0, build temporaries) and 6 of
    n; robust_regression 3 of d and 20 of n, plus the n x d int64 column permutation it draws while
    n d <= 2 x 10^7."""
    if objective == "robust_regression":
        return 8 * (3 * d + 20 * n) + (16 * n * d if n * d <= 2 * 10**7 else 0)
    return 8 * (8 * d + 6 * n)


def data_bytes_dataset(ds, objective: str) -> int:
    """Bytes of a loaded :class:`sim.workloads.data.Dataset` (X dense or CSR, y) plus what a data objective adds on n
    samples (row norms, the full evaluation's n x C scores and their temporaries, C = classes or 1)."""
    X = ds.X
    if ds.is_sparse:
        xb = X.data.nbytes + X.indices.nbytes + X.indptr.nbytes
    else:
        xb = X.nbytes
    C = ds.n_classes if objective == "softmax" else 1
    return int(xb + ds.y.nbytes + 8 * ds.n * (3 * C + 4))


def estimate_memory(sc, d: int, data_bytes: int, backend: str = "sim") -> tuple[int, str]:
    """(bytes, how) a run of ``sc`` with d parameters and ``data_bytes`` of data and objective needs at its
    peak on ``backend`` ("sim" or "torch"); ``how`` spells the estimate out for the error message."""
    P = sc.cluster.P
    dtype = getattr(sc.training, "dtype", "float64")
    w = 4 if dtype == "float32" else 8  # bytes of one vector entry
    if backend == "torch":
        per_rank = TORCH_PROCESS_BYTES + data_bytes + w * d * TORCH_ARRAYS_PER_RANK
        total = data_bytes + P * per_rank + w * d * 3 * P
        how = (f"{P} processes x ({format_bytes(TORCH_PROCESS_BYTES)} of torch + {format_bytes(data_bytes)} of data "
               f"+ {TORCH_ARRAYS_PER_RANK} {dtype} vectors of d = {d:,}) + rank 0's gathered vectors")
        return int(total), how
    arrays = w * d * (ARRAYS_PER_RANK * P + ARRAYS_SHARED)
    how = (f"P = {P} workers x {ARRAYS_PER_RANK} {dtype} vectors of d = {d:,} parameters + "
           f"{format_bytes(data_bytes)} of data and objective")
    return int(arrays + data_bytes), how


def check_resources(sc, d: int, data_bytes: int, *, backend: str = "sim", yes: bool = False,
                    available: int | None = None) -> dict:
    """Refuse a run that cannot fit or would run too long, before it allocates.

    sc: the :class:`~experiments.scenario.Scenario`; d: its parameters; data_bytes: bytes of its data and
    objective (:func:`data_bytes_synthetic` / :func:`data_bytes_dataset`); backend: "sim" or "torch";
    yes: run even when the estimated work exceeds :data:`MAX_WORK`; available: bytes of free memory (default
    :func:`available_memory_bytes`). Returns {"memory_bytes", "available_bytes", "work_units", "work_s_reference"}.
    Raises ResourceError naming the memory estimate and the available memory when the run does not fit
    (whatever ``yes``), or naming the work estimate and the limit when it exceeds :data:`MAX_WORK` without ``yes``.
    """
    mem, how = estimate_memory(sc, d, data_bytes, backend)
    avail = available_memory_bytes() if available is None else available
    if avail is not None and mem > avail:
        raise ResourceError(
            f"the run needs about {format_bytes(mem)} of memory ({how}) but this machine has "
            f"{format_bytes(avail)} available: valid estimate <= available memory; lower cluster.P or the model "
            + ("(model.name, training.dtype, training.batch_size)" if sc.model.name else "size (data.d, the data set)"))
    work = estimate_work(sc, d)
    secs = work * SECONDS_PER_UNIT
    if work > MAX_WORK and not yes:
        raise ResourceError(
            f"the run's estimated work is {work:.3g} units (algorithms x iterations x P x (d + {MESSAGE_UNITS} "
            f"x messages + {STEP_UNITS}) with P = {sc.cluster.P}, d = {d:,}, {sc.training.iterations:,} "
            f"iterations, {len(sc.algorithms)} algorithm(s); about {_duration(secs)} on the reference 2-core "
            f"machine): valid work <= {MAX_WORK:g} units; pass --yes to run it anyway, or lower "
            "training.iterations, cluster.P or the model size")
    return {"memory_bytes": mem, "available_bytes": avail, "work_units": work, "work_s_reference": secs}


def _duration(s: float) -> str:
    """Seconds as a short human text: ``45 s``, ``12 min``, ``3.2 h``, ``4.1 days``."""
    if s < 120:
        return f"{s:.0f} s"
    if s < 2 * 3600:
        return f"{s / 60:.0f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.3g} days"
