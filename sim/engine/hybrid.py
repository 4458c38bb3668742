"""The hybrid per-bucket policy: per DDP bucket, dense or compressed at its own density (docs/hybrid.md).

A :class:`HybridPlan` says, for each DDP bucket of one model in launch order (:func:`sim.engine.timeline.ddp_buckets`:
bucket 0 holds the last layers), whether the bucket is exchanged **dense** (the dense allreduce of the bucket, no
selection, no residual) or **compressed** at a density rho_b in (0, 1] (the algorithm's selection and collective on
``k_b = min(d_b, max(1, round(rho_b d_b)))`` entries, with error feedback). The same plan file is loaded by

- the iteration timeline (``TimelinePolicy(sparse="hybrid", plan=...)``; scenarios: ``workload.sparse_policy =
  "hybrid"`` with ``workload.hybrid_plan = "plan.json"``), for timing runs and the [model] runs' clock;
- the numerics (:class:`sim.algorithms.AlgorithmSpec` with the buckets as ``segments`` in flat-vector order and
  their ``segment_densities``, None for a dense segment: :func:`plan_segments`);
- the DDP hook (:func:`sim.distributed.ddp_hooks.register_sparse_hook` with ``plan=``), where dense buckets go
  through ``all_reduce`` and compressed ones through the sparse hook with their k_b,

so the choice the optimiser makes is trained and measured as it was timed (tests/test_hybrid.py holds the three
against each other).

:func:`choose_hybrid` is the optimiser: it minimises the simulated iteration (the timeline's, on the workload, the
cluster and the compute model given) over every per-bucket choice (dense or a candidate density), subject to a bound
on the overall nominal density (sum_b rho_b d_b / d, a dense bucket counting rho_b = 1: a cap rho_max, or a floor
rho_min, the informative one -- under a cap the smallest density is nearly always fastest) or on the total
compression error (sum_b of the discarded fraction of the accumulator's squared norm, a :class:`DiscardTable`
measured on a run, a dense bucket counting 0), by dynamic programming over the buckets in launch order on the Pareto frontier of
(end of the bucket's collective, resource used) -- exact, because the rest of the iteration depends on the earlier
buckets only through the end of the last collective (module docstring of :mod:`sim.engine.timeline`: collectives of
one stream run one after another, each from max(ready, previous end)) and is non-decreasing in it. It reports the
gain over the best uniform policy under the same bound (dense DDP, and the ``bucket``, ``model`` and ``layer``
policies at each candidate density).

One rule says which runs may load a plan (:func:`check_plan_algorithm`, called by the timeline, the scenario runs'
:func:`experiments.resolve.timeline_policy` before the numerics are built, the DDP hook and :func:`choose_hybrid`): the
plan's own algorithm, which must be one that can compress per bucket with dense buckets between
(:func:`hybrid_algorithms`: sparse, segmented, no local momentum -- not DGC).

Plan file (JSON, ``format = "sparsim.hybrid_plan/2"``): ``model`` (the workload's name), ``algorithm`` (the registered
sparse algorithm it was chosen for), ``d``, ``element_bytes``,
``bucket_cap_mb`` / ``first_bucket_mb`` (None: DDP's defaults), ``dense_collective``, ``buckets`` (a list, launch
order, of ``{"elements": d_b, "mode": "dense" | "compressed", "density": rho_b or null, "k": k_b or null}``; ``k``
is derived and checked on load), and ``made_with`` (how it was chosen: P, network, algorithm, bound, the simulated
iteration, the uniform policies and the gain; informational, not read back into any run).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sim.algorithms import REGISTRY, AlgorithmSpec
from sim.algorithms.base import density_k
from sim.base.errors import ConfigError, check_int, check_real
from sim.machine.compute import ComputeModel
from sim.workloads.model import DeviceModel, Workload

from .timeline import (CollectiveTimer, TimelinePolicy, compression_s, ddp_buckets, flat_segments, layer_buckets,
                       simulate_timeline)

__all__ = ["PLAN_FORMAT", "HybridPlan", "hybrid_algorithms", "check_plan_algorithm", "load_plan", "save_plan", "plan_segments", "DiscardTable", "discarded_fractions",
           "UniformResult", "HybridChoice", "choose_hybrid", "plan_iteration_s", "resource_table", "BOUNDS",
           "DENSITY_RTOL", "ERROR_ATOL", "MODES"]

#: ``format`` of a plan file (/1, before plans named their algorithm, is refused with a one-line message).
PLAN_FORMAT = "sparsim.hybrid_plan/2"
#: Relative slack of the density bound: sum_b rho_b d_b <= rho_max d (1 + DENSITY_RTOL), so a uniform plan at
#: rho_max (whose float sum may exceed rho_max d by rounding) meets the bound rho_max.
DENSITY_RTOL = 1e-9
#: Absolute slack of the error bound (a sum of fractions in [0, 1]).
ERROR_ATOL = 1e-12
#: A bucket's ``mode`` in the plan file: exchanged densely (the allreduce), or compressed at its density.
MODES = ("dense", "compressed")


def hybrid_algorithms() -> tuple:
    """The registered algorithms a hybrid plan can run: sparse (a k per bucket), segmented (one exchange per bucket)
    and without a local momentum (DGC's momentum masking has no meaning for a dense bucket) -- the rule
    :class:`sim.algorithms.AlgorithmSpec` holds ``segment_densities`` to. Names in registry order."""
    return tuple(n for n, a in REGISTRY.items() if a.sparse and a.segmented and not a.local_momentum)


def check_plan_algorithm(plan: "HybridPlan", algorithm: str) -> None:
    """The one rule for which algorithm may run ``plan`` (the timeline, the scenario runs before their numerics, the
    DDP hook and the optimiser all call it). algorithm: a registered name or alias (``gtopk_reference`` is gtopk).
    Raises ConfigError (one line naming the value and the valid range) for an unknown algorithm, one no plan can run
    (:func:`hybrid_algorithms`), or one other than the plan's own (``plan.algorithm``; a plan made in code without
    one takes any algorithm that can run a plan)."""
    from sim.algorithms import resolve

    name = resolve(algorithm)[0] if isinstance(algorithm, str) else algorithm
    valid = hybrid_algorithms()
    where = f"hybrid plan {plan.source}" if plan.source else "hybrid plan"
    if name not in valid:
        raise ConfigError(f"algorithm = {algorithm!r} with a {where}: the plan compresses per DDP bucket with dense "
                          f"buckets between, which needs a sparse per-bucket algorithm without a local momentum: valid "
                          f"{', '.join(valid)}")
    if plan.algorithm is not None and name != plan.algorithm:
        raise ConfigError(f"{where} is for algorithm {plan.algorithm!r}: this run's algorithm is {algorithm!r}: valid "
                          f"{plan.algorithm} (and dense) among the algorithms, or a plan made for {name} (sparsim "
                          f"workload hybrid-plan --algorithm {name})")


@dataclass(frozen=True)
class HybridPlan:
    """Per DDP bucket (launch order): dense, or compressed at a density.

    model: the workload's name (:attr:`sim.workloads.Workload.name`) the plan was made for. d: its parameters.
    bucket_sizes: d_b per bucket, launch order (ints >= 1 summing to d). densities: per bucket None (dense) or a
    float in (0, 1]. dense_collective: the dense buckets' allreduce (one of dense's collectives; default ring).
    element_bytes: bytes per gradient element the buckets were formed with (DDP's caps count bytes: 4 float32,
    8 float64). bucket_cap_mb, first_bucket_mb: the DDP caps (MiB; None: DDP's defaults). algorithm: the registered
    sparse algorithm the plan was chosen for (one of :func:`hybrid_algorithms`; every run of the plan must be it,
    :func:`check_plan_algorithm`); None only for a plan made in code (it cannot be saved). made_with: JSON text of how
    the plan was chosen (informational; not compared). source: the file it was read from (for messages; not compared).
    Raises ConfigError (one line naming the value and the valid range) for anything out of range.
    """

    model: str
    d: int
    bucket_sizes: tuple
    densities: tuple
    dense_collective: str = "ring"
    element_bytes: int = 4
    bucket_cap_mb: float | None = None
    first_bucket_mb: float | None = None
    algorithm: str | None = None
    made_with: str = field(default="", compare=False, repr=False)
    source: str = field(default="", compare=False, repr=False)

    def __post_init__(self):
        where = f"hybrid plan {self.source}: " if self.source else "hybrid plan: "
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"{where}model = {self.model!r}: valid a non-empty model name")
        check_int("d", self.d, 1, err=ConfigError)
        sizes, dens = _as_tuple(self.bucket_sizes, "bucket_sizes", where), _as_tuple(self.densities, "densities", where)
        if not sizes:
            raise ConfigError(f"{where}no buckets: valid one entry per DDP bucket")
        for j, n in enumerate(sizes):
            if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 1:
                raise ConfigError(f"{where}bucket {j} elements = {n!r} is out of range: valid an integer >= 1")
        if sum(int(n) for n in sizes) != self.d:
            raise ConfigError(f"{where}bucket sizes sum to {sum(int(n) for n in sizes)}: valid a sum of d = {self.d}")
        if len(dens) != len(sizes):
            raise ConfigError(f"{where}{len(dens)} densities for {len(sizes)} buckets: valid one per bucket")
        out = []
        for j, r in enumerate(dens):
            if r is None:
                out.append(None)
                continue
            if isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, float, np.integer, np.floating)) \
                    or not (0 < float(r) <= 1):
                raise ConfigError(f"{where}bucket {j} density = {r!r} is out of range: valid 0 < density <= 1, or "
                                  "mode = 'dense'")
            out.append(float(r))
        if self.dense_collective not in REGISTRY["dense"].collectives:
            raise ConfigError(f"{where}dense_collective = {self.dense_collective!r} is unknown: valid "
                              f"{', '.join(REGISTRY['dense'].collectives)}")
        check_int("element_bytes", self.element_bytes, 1, 16, err=ConfigError)
        for f in ("bucket_cap_mb", "first_bucket_mb"):
            if getattr(self, f) is not None:
                check_real(f, getattr(self, f), 0, 1e6, lo_open=True, err=ConfigError)
        if self.algorithm is not None and self.algorithm not in hybrid_algorithms():
            raise ConfigError(f"{where}algorithm = {self.algorithm!r}: valid {', '.join(hybrid_algorithms())} (a "
                              "registered sparse algorithm that can compress per bucket)")
        object.__setattr__(self, "bucket_sizes", tuple(int(n) for n in sizes))
        object.__setattr__(self, "densities", tuple(out))
        object.__setattr__(self, "d", int(self.d))

    # -- derived -------------------------------------------------------------------------------------------------
    def ks(self) -> tuple:
        """k_b per bucket (launch order): ``min(d_b, max(1, round(rho_b d_b)))`` (:func:`sim.algorithms.base.
        density_k`) for a compressed bucket, None for a dense one."""
        return tuple(None if r is None else density_k(r, n) for r, n in zip(self.densities, self.bucket_sizes))

    def nominal_density(self) -> float:
        """sum_b rho_b d_b / d with rho_b = 1 for a dense bucket: the overall density the bound holds."""
        return float(sum(n if r is None else r * n for r, n in zip(self.densities, self.bucket_sizes))) / self.d

    def sent_density(self) -> float:
        """sum_b k_b / d with k_b = d_b for a dense bucket: the fraction of the entries each rank contributes."""
        return float(sum(n if k is None else k for k, n in zip(self.ks(), self.bucket_sizes))) / self.d

    def policy(self, base: TimelinePolicy | None = None) -> TimelinePolicy:
        """The :class:`TimelinePolicy` that runs this plan: ``base``'s dense policy, blocking flag and Horovod
        settings, this plan's bucket caps, sparse policy ``hybrid``."""
        base = base or TimelinePolicy()
        return dataclasses.replace(base, sparse="hybrid", plan=self, bucket_cap_mb=self.bucket_cap_mb,
                                   first_bucket_mb=self.first_bucket_mb)

    def check_algorithm(self, algorithm: str) -> None:
        """:func:`check_plan_algorithm` of this plan (ConfigError, one line)."""
        check_plan_algorithm(self, algorithm)

    def describe(self) -> str:
        """One line: model, buckets, how many dense, the densities, the nominal and sent densities."""
        nd = sum(r is None for r in self.densities)
        used = sorted({r for r in self.densities if r is not None})
        return (f"hybrid plan for {self.model} (d = {self.d:,}, {len(self.bucket_sizes)} buckets): {nd} dense, "
                f"{len(self.bucket_sizes) - nd} compressed at {', '.join(f'{r:g}' for r in used) or '-'}; density "
                f"{self.nominal_density():.4g} nominal, {self.sent_density():.4g} sent")

    # -- checks --------------------------------------------------------------------------------------------------
    def check_buckets(self, workload: Workload, buckets) -> None:
        """Raise ConfigError (one line) unless ``workload`` is the plan's model and ``buckets`` (the run's DDP buckets,
        launch order, :class:`sim.engine.timeline.Bucket`) have the plan's sizes."""
        where = f"hybrid plan {self.source}" if self.source else "hybrid plan"
        if workload.name != self.model or workload.d != self.d:
            raise ConfigError(f"{where} is for model {self.model!r} (d = {self.d:,}): this run's model is "
                              f"{workload.name!r} (d = {workload.d:,}): valid a plan made for it (sparsim workload "
                              "hybrid-plan)")
        self.check_sizes([b.numel for b in buckets], "this run's DDP buckets")

    def check_sizes(self, sizes, what: str) -> None:
        """Raise ConfigError (one line) unless ``sizes`` (elements per bucket, launch order) are the plan's."""
        where = f"hybrid plan {self.source}" if self.source else "hybrid plan"
        sizes = [int(n) for n in sizes]
        if sizes != list(self.bucket_sizes):
            if len(sizes) != len(self.bucket_sizes):
                diff = f"{len(sizes)} buckets, the plan {len(self.bucket_sizes)}"
            else:
                j = next(i for i, (a, b) in enumerate(zip(sizes, self.bucket_sizes)) if a != b)
                diff = f"bucket {j} holds {sizes[j]:,} elements, the plan's {self.bucket_sizes[j]:,}"
            raise ConfigError(f"{where} does not fit {what}: {diff}: valid the bucket caps the plan was made with "
                              f"(bucket_cap_mb = {self.bucket_cap_mb}, first_bucket_mb = {self.first_bucket_mb}, "
                              f"{self.element_bytes}-byte elements)")

    # -- file ----------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The plan file's content (module docstring), JSON types only."""
        return {"format": PLAN_FORMAT, "model": self.model, "algorithm": self.algorithm, "d": self.d,
                "element_bytes": self.element_bytes,
                "bucket_cap_mb": self.bucket_cap_mb, "first_bucket_mb": self.first_bucket_mb,
                "dense_collective": self.dense_collective,
                "buckets": [{"elements": n, "mode": MODES[0] if r is None else MODES[1], "density": r, "k": k}
                            for n, r, k in zip(self.bucket_sizes, self.densities, self.ks())],
                "made_with": json.loads(self.made_with) if self.made_with else {}}


def _as_tuple(x, name: str, where: str) -> tuple:
    if isinstance(x, (str, bytes, dict)):
        raise ConfigError(f"{where}{name} = {x!r}: valid a list")
    try:
        return tuple(x)
    except TypeError:
        raise ConfigError(f"{where}{name} = {x!r}: valid a list") from None


def save_plan(plan: HybridPlan, path, force: bool = False) -> Path:
    """Write ``plan`` as JSON to ``path`` (``path.partial`` first, then renamed: no half-written file). Raises
    ConfigError if the file exists and not ``force``, its directory does not exist, or the plan names no algorithm.
    Returns the path."""
    path = Path(path)
    if plan.algorithm is None:
        raise ConfigError("a hybrid plan file names its algorithm: valid HybridPlan(..., algorithm=NAME) with NAME one "
                          f"of {', '.join(hybrid_algorithms())}")
    if path.exists() and not force:
        raise ConfigError(f"plan file {str(path)!r} exists: choose another name or pass --force")
    if not path.parent.is_dir():
        raise ConfigError(f"plan file {str(path)!r}: the directory {str(path.parent)!r} does not exist")
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(plan.to_dict(), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load_plan(path) -> HybridPlan:
    """Read a plan file (module docstring). Raises ConfigError (one line naming the file and what is wrong) for a
    missing or unreadable file, bad JSON, another format, a missing or unknown key, a bucket whose mode is not
    dense / compressed, a k that is not the one its density gives, or a value out of range (:class:`HybridPlan`)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise ConfigError(f"hybrid plan {str(p)!r} cannot be read ({err.strerror or err}): valid a file written by "
                          "sparsim workload hybrid-plan") from None
    try:
        raw = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"hybrid plan {str(p)!r} is not JSON ({err}): valid a file written by sparsim workload "
                          "hybrid-plan") from None
    if not isinstance(raw, dict) or raw.get("format") != PLAN_FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        old = " (written before plans named their algorithm: make it again with sparsim workload hybrid-plan)" \
            if got == "sparsim.hybrid_plan/1" else ""
        raise ConfigError(f"hybrid plan {str(p)!r} has format = {got!r}{old}: valid {PLAN_FORMAT!r}")
    keys = {"format", "model", "algorithm", "d", "element_bytes", "bucket_cap_mb", "first_bucket_mb", "dense_collective", "buckets",
            "made_with"}
    unknown = sorted(set(raw) - keys)
    missing = sorted(keys - {"made_with"} - set(raw))
    if unknown or missing:
        what = f"unknown key {unknown[0]!r}" if unknown else f"missing key {missing[0]!r}"
        raise ConfigError(f"hybrid plan {str(p)!r}: {what}: valid keys {', '.join(sorted(keys))}")
    buckets = raw["buckets"]
    if not isinstance(buckets, list):
        raise ConfigError(f"hybrid plan {str(p)!r}: buckets = {buckets!r}: valid a list of buckets")
    sizes, dens = [], []
    for j, b in enumerate(buckets):
        if not isinstance(b, dict) or set(b) - {"elements", "mode", "density", "k"} or "elements" not in b \
                or "mode" not in b:
            raise ConfigError(f"hybrid plan {str(p)!r}: bucket {j} = {b!r}: valid {{elements, mode, density, k}}")
        if b["mode"] not in MODES:
            raise ConfigError(f"hybrid plan {str(p)!r}: bucket {j} mode = {b['mode']!r} is unknown: valid dense, "
                              "compressed")
        if b["mode"] == MODES[0] and b.get("density") is not None:
            raise ConfigError(f"hybrid plan {str(p)!r}: bucket {j} is dense with density = {b['density']!r}: valid "
                              "density null for a dense bucket")
        if b["mode"] == MODES[1] and b.get("density") is None:
            raise ConfigError(f"hybrid plan {str(p)!r}: bucket {j} is compressed without a density: valid 0 < density "
                              "<= 1")
        sizes.append(b["elements"])
        dens.append(b.get("density"))
    made = raw.get("made_with", {})
    if not isinstance(raw["algorithm"], str):
        raise ConfigError(f"hybrid plan {str(p)!r}: algorithm = {raw['algorithm']!r}: valid "
                          f"{', '.join(hybrid_algorithms())}")
    plan = HybridPlan(raw["model"], raw["d"], tuple(sizes), tuple(dens), raw["dense_collective"],
                      raw["element_bytes"], raw["bucket_cap_mb"], raw["first_bucket_mb"], raw["algorithm"],
                      json.dumps(made, sort_keys=True) if made else "", str(p))
    for j, (b, k) in enumerate(zip(buckets, plan.ks())):
        if b.get("k") is not None and b["k"] != k:
            raise ConfigError(f"hybrid plan {str(p)!r}: bucket {j} k = {b['k']!r} but its density gives {k}: valid "
                              "k = min(elements, max(1, round(density x elements))) or no k")
    return plan


def plan_segments(plan: HybridPlan, workload: Workload, policy: TimelinePolicy | None = None,
                  element_bytes: int | None = None, algorithm: str | None = None) -> tuple[tuple, tuple]:
    """The numerics' view of ``plan`` on ``workload``: (segment sizes, segment densities) in flat-vector order
    (``AlgorithmSpec.segments`` / ``segment_densities``), from the DDP buckets of ``policy``'s caps (default the
    plan's) at ``element_bytes`` (default the plan's). algorithm: when given, held to :func:`check_plan_algorithm`
    (the scenario runs check their algorithms when they load the plan). Raises ConfigError for another model or
    algorithm, buckets that differ from the plan's, or buckets not consecutive in the flat vector
    (:func:`sim.engine.timeline.flat_segments`)."""
    if algorithm is not None:
        check_plan_algorithm(plan, algorithm)
    pol = policy or plan.policy()
    buckets = ddp_buckets(workload, pol, plan.element_bytes if element_bytes is None else element_bytes)
    plan.check_buckets(workload, buckets)
    flat_segments(workload, buckets)  # ConfigError when a bucket is not one contiguous range
    order = sorted(range(len(buckets)), key=lambda i: min(buckets[i].tensors))
    return tuple(buckets[i].numel for i in order), tuple(plan.densities[i] for i in order)


# ==================================================================================== measured compression error


def discarded_fractions(acc: np.ndarray, bounds, densities) -> np.ndarray:
    """The squared norm a per-segment Top-k discards, as a fraction of the whole accumulator's.

    acc: float array (d,) (one rank's error-feedback accumulator eps + alpha G). bounds: int array (S + 1,), segment s
    is ``acc[bounds[s]:bounds[s + 1]]``. densities: J floats in (0, 1]. Returns float64 (S, J): entry (s, j) =
    ||a_s - TopK_{k}(a_s)||^2 / ||acc||^2 with k = min(d_s, max(1, round(rho_j d_s))) -- the sum of the d_s - k
    smallest squares of the segment (so the sum over segments is the fraction of ||acc||^2 the whole selection
    discards, in [0, 1]). Zeros when acc is zero."""
    a = np.asarray(acc, dtype=np.float64)
    total = float(np.dot(a, a))
    b = np.asarray(bounds, dtype=np.int64)
    out = np.zeros((len(b) - 1, len(densities)))
    if total == 0:
        return out
    for s in range(len(b) - 1):
        seg = a[b[s]:b[s + 1]]
        n = seg.shape[0]
        sq = np.sort(seg * seg)  # ascending: the first n - k are what Top-k discards
        cs = np.cumsum(sq)
        for j, r in enumerate(densities):
            m = n - density_k(r, n)
            out[s, j] = cs[m - 1] / total if m > 0 else 0.0
    return out


@dataclass(frozen=True)
class DiscardTable:
    """The measured compression error of each per-bucket choice (docs/hybrid.md, "how the error is measured").

    densities: the J candidate densities. bucket: float array (B, J), launch order: the mean over the run's ranks
    and iterations of the fraction of the accumulator's squared norm that Top-k at density rho_j in bucket b discards
    (:func:`discarded_fractions`); a dense bucket discards 0. model, layer: float arrays (J,), the same for
    whole-model selection and for per-layer selection at rho_j (the uniform policies). how: one line saying what run
    measured it (informational).
    """

    densities: tuple
    bucket: np.ndarray
    model: np.ndarray
    layer: np.ndarray
    how: str = ""

    def to_dict(self) -> dict:
        """JSON types (for the plan's made_with)."""
        return {"densities": list(self.densities), "bucket": np.asarray(self.bucket).tolist(),
                "model": np.asarray(self.model).tolist(), "layer": np.asarray(self.layer).tolist(), "how": self.how}


# ==================================================================================== the optimiser

#: The bounds :func:`choose_hybrid` takes: ``density`` (a cap: sum_b rho_b d_b <= rho_max d), ``min_density`` (a
#: floor: sum_b rho_b d_b >= rho_min d, a dense bucket counting rho_b = 1) and ``error`` (a cap on the total measured
#: error sum_b e_b(rho_b), a dense bucket counting 0).
BOUNDS = ("density", "min_density", "error")


@dataclass(frozen=True)
class UniformResult:
    """One uniform policy under the same bound: label (``dense``, ``bucket@0.01``, ...), sparse policy (None for dense
    DDP), density (None for dense), iter_s (s, the timeline's first iteration), resource (its nominal density, or its
    measured error under the error bound), feasible (within the bound)."""

    label: str
    policy: str | None
    density: float | None
    iter_s: float
    resource: float
    feasible: bool


@dataclass(frozen=True)
class HybridChoice:
    """What :func:`choose_hybrid` found.

    plan: the :class:`HybridPlan`. iter_s: its simulated iteration (s; :func:`simulate_timeline`, iteration 1).
    resource: its nominal density (bounds "density" and "min_density") or its total measured error (bound "error").
    bound, bound_value: the constraint (:data:`BOUNDS`). uniform: every uniform policy evaluated
    (:class:`UniformResult`); best_uniform: the fastest feasible one (None if none is). frontier_max: the largest
    Pareto frontier the dynamic programme held (its cost: stages x choices x frontier points).
    """

    plan: HybridPlan
    iter_s: float
    resource: float
    bound: str
    bound_value: float
    uniform: tuple
    best_uniform: UniformResult | None
    frontier_max: int

    @property
    def gain(self) -> float:
        """best uniform iteration / hybrid iteration (> 1: the plan is faster); nan without a feasible uniform."""
        return self.best_uniform.iter_s / self.iter_s if self.best_uniform is not None else math.nan


def resource_table(bound: str, value: float, sizes, densities, errors: DiscardTable | None = None):
    """Every bound as a cap on a sum of non-negative per-bucket costs: returns (cost, cap), cost a float64 array
    (B, 1 + J) -- column 0 the dense choice, column 1 + j density rho_j -- and cap a float, such that a choice c_b per
    bucket meets the bound iff ``sum_b cost[b, c_b] <= cap`` (summed in bucket order):

    - "density" (rho_max): cost d_b (dense) or rho_j d_b; cap rho_max d (1 + :data:`DENSITY_RTOL`);
    - "min_density" (rho_min): the entries left out, cost 0 (dense) or (1 - rho_j) d_b; cap (1 - rho_min) d +
      DENSITY_RTOL d, i.e. sum_b rho_b d_b >= rho_min d;
    - "error" (E_max): cost 0 (dense) or ``errors.bucket[b, j]``; cap E_max + :data:`ERROR_ATOL`.

    sizes: d_b per bucket (launch order); densities: the J candidates. The slack lets a uniform plan at the bound's
    own density meet it despite float rounding. Raises ConfigError for an unknown bound, a value out of range, or
    errors missing / not of shape (B, J) at these densities."""
    sizes = np.asarray([float(n) for n in sizes])
    dens = np.asarray([float(r) for r in densities])
    B, J, d = sizes.shape[0], dens.shape[0], float(sizes.sum())
    if bound == "density":
        check_real("density_bound", value, 0, 1, lo_open=True, err=ConfigError)
        return np.concatenate([sizes[:, None], sizes[:, None] * dens[None, :]], axis=1), value * d * (1 + DENSITY_RTOL)
    if bound == "min_density":
        check_real("min_density", value, 0, 1, lo_open=True, err=ConfigError)
        return (np.concatenate([np.zeros((B, 1)), sizes[:, None] * (1.0 - dens[None, :])], axis=1),
                (1.0 - value) * d + DENSITY_RTOL * d)
    if bound == "error":
        check_real("error_bound", value, 0, err=ConfigError)
        if errors is None:
            raise ConfigError("error_bound needs the measured errors (a DiscardTable): valid a [model] scenario, whose "
                              "run measures them (sparsim workload hybrid-plan --error-bound)")
        tab = np.asarray(errors.bucket, dtype=np.float64)
        if tuple(float(r) for r in errors.densities) != tuple(dens) or tab.shape != (B, J):
            raise ConfigError(f"the measured errors cover {tab.shape} (buckets, densities) at "
                              f"{list(errors.densities)}: valid ({B}, {J}) at {list(dens)}")
        return np.concatenate([np.zeros((B, 1)), tab], axis=1), value + ERROR_ATOL
    raise ConfigError(f"bound = {bound!r} is unknown: valid {', '.join(BOUNDS)}")


def plan_iteration_s(plan: HybridPlan, workload: Workload, spec: AlgorithmSpec, P: int, *, network,
                     policy: TimelinePolicy | None = None, device: DeviceModel | None = None, batch_size: int = 32,
                     compute: ComputeModel | None = None, engine: str = "auto",
                     timer: CollectiveTimer | None = None) -> float:
    """The simulated first iteration (s) of ``plan`` (:func:`simulate_timeline` with ``plan.policy(policy)``; timer:
    a shared :class:`CollectiveTimer`, as :func:`simulate_timeline`)."""
    return float(simulate_timeline(spec, workload, P, network=network, policy=plan.policy(policy), device=device,
                                   batch_size=batch_size, compute=compute, engine=engine, timer=timer).iter_s[0])


def choose_hybrid(workload: Workload, network, spec: AlgorithmSpec, P: int, *, densities, bound: str = "density",
                  value: float, errors: DiscardTable | None = None, policy: TimelinePolicy | None = None,
                  device: DeviceModel | None = None, batch_size: int = 32, compute: ComputeModel | None = None,
                  engine: str = "auto", dense_collective: str = "ring", timer: CollectiveTimer | None = None,
                  made_with: dict | None = None) -> HybridChoice:
    """The per-bucket plan of least simulated iteration time under a bound (module docstring; docs/hybrid.md).

    workload: the model (a zoo model, a layer table or a [model] network's); network: NetworkSpec or ClusterSpec with
    P ranks; spec: the sparse algorithm and its collective (its k is not used; segments and segment densities must be
    None). densities: the J candidate densities (each in (0, 1]). bound, value: one of :data:`BOUNDS` --
    "density" with rho_max in (0, 1], "min_density" with rho_min in (0, 1], "error" with E_max >= 0 and ``errors``, a
    :class:`DiscardTable` over the same densities and buckets (:func:`resource_table` says how each is held).
    policy: the DDP bucket caps and the blocking flag (its sparse policy is not used); device, batch_size, compute,
    engine: as :func:`simulate_timeline`. dense_collective: the dense buckets' allreduce. timer: a
    :class:`CollectiveTimer` to share its cache across calls (same P, network, compute and engine). made_with: extra
    entries for the plan's ``made_with`` record (e.g. the network's name, the command).

    Dynamic programming over the buckets in launch order, on the Pareto frontier of (end of the bucket's collective,
    resource used): exact (tests/test_hybrid.py holds it against every one of the (1 + J)^B plans). Optimises the
    timeline's first iteration (every iteration when the compute model has no jitter or stragglers, the default);
    ties go to the plan of least resource. Also times the uniform policies under the same bound: dense DDP (an
    all-dense plan) and the ``bucket``, ``model`` and ``layer`` policies at each candidate density rho (k = max(1,
    round(rho d))), their error under the error bound from ``errors`` (``errors.bucket`` summed over the buckets,
    ``errors.model``, ``errors.layer``; a nan entry leaves that policy out).

    Returns a :class:`HybridChoice` whose ``iter_s`` is :func:`simulate_timeline`'s for the plan and whose plan names
    ``spec.name`` as its algorithm. Raises ConfigError for a dense or segmented spec, an algorithm no run can train a
    plan of (:func:`hybrid_algorithms`: DGC), densities or a bound out of range, a table that does not fit, or a bound no plan
    meets.
    """
    if not spec.algorithm.sparse:
        raise ConfigError(f"algorithm = {spec.name!r} is dense: the hybrid plan chooses per bucket between dense and a "
                          "sparse algorithm: valid a sparse algorithm")
    if spec.segments is not None or spec.segment_densities is not None:
        raise ConfigError("the hybrid optimiser takes a whole-model spec: valid segments = None (the plan gives the "
                          "buckets)")
    if spec.name not in hybrid_algorithms():  # the rule every loader of the plan holds it to
        raise ConfigError(f"algorithm = {spec.name!r}: no run can train a hybrid plan of it (dense buckets between "
                          "compressed ones need a sparse per-bucket algorithm without a local momentum): valid "
                          f"{', '.join(hybrid_algorithms())}")
    dens = tuple(float(r) for r in _as_tuple(densities, "densities", ""))
    if not dens:
        raise ConfigError("densities = (): valid one or more candidate densities in (0, 1]")
    for r in dens:
        check_real("density", r, 0, 1, lo_open=True, err=ConfigError)
    d = workload.d
    policy = dataclasses.replace(policy or TimelinePolicy(), sparse="bucket", plan=None)
    compute = compute or ComputeModel()
    check_int("P", P, 1, err=ConfigError)
    buckets = ddp_buckets(workload, policy, spec.value_bytes)
    B, J = len(buckets), len(dens)
    cost, cap = resource_table(bound, value, [b.numel for b in buckets], dens, errors)
    value = float(value)
    dense_spec = AlgorithmSpec("dense", collective=dense_collective, value_bytes=spec.value_bytes,
                               gpus_per_node=spec.gpus_per_node)
    timer = timer or CollectiveTimer(P, network, compute, engine)

    # the timeline's arithmetic for one iteration (simulate_timeline at t = 1), per bucket and choice
    fwd, bwd = workload.layer_times(batch_size, device)
    L = len(workload.layers)
    bwd_end = np.empty(L)
    acc = 0.0
    for l in range(L - 1, -1, -1):
        acc += bwd[l]
        bwd_end[l] = acc
    F, Bk = float(fwd.sum()), float(bwd.sum())
    li = workload.layer_index()
    tensor_ready = np.array([bwd_end[li[t.layer]] for t in workload.tensors])
    factor = np.array([compute.forward_backward_factor(r, 1) for r in range(P)]) \
        if (compute.jitter != "none" or compute.straggler_prob > 0) else np.ones(P)
    if np.all(factor == factor[0]):
        factor = factor[:1]  # every rank the same: one stands for all (the same floats)
    comp_end = factor * (F + Bk)
    update_s = compute.seconds("update", d, 0, 0)
    base = [factor * (F + float(tensor_ready[list(b.tensors)].max())) for b in buckets]
    # each bucket's compression at each candidate density, as the timeline charges it (it depends on k for rand-k,
    # Gaussian-k, DGC and PowerSGD: Algorithm.compression_work); column 0 (dense) compresses nothing
    sel = [[0.0] + [compression_s(compute, dataclasses.replace(spec, k=density_k(r, b.numel)), b.numel,
                                  density_k(r, b.numel), 1) for r in dens] for b in buckets]
    coll = np.array([[timer(dense_spec, b.numel)] + [timer(dataclasses.replace(spec, k=density_k(r, b.numel)), b.numel)
                                                     for r in dens] for b in buckets])
    # the frontier after bucket b: end of its collective (free) and resource used, no point dominated by another
    # (earlier or equal end with no more resource); the rest of the iteration depends on the buckets so far only
    # through free, and does not decrease with it
    free, used = np.zeros(1), np.zeros(1)
    back, fmax = [], 1
    for b in range(B):
        shift = free[:, None] - base[b - 1][None, :] if policy.blocking and b > 0 else np.zeros((1, 1))
        rdy = base[b][None, :] + shift  # (points or 1, ranks): simulate_timeline's base + shift
        n = free.shape[0]
        nf = np.concatenate([(np.maximum(rdy, free[:, None]) + sel[b][c]).max(axis=1) + coll[b, c]
                             for c in range(1 + J)])
        nu = np.concatenate([used + cost[b, c] for c in range(1 + J)])
        npar = np.tile(np.arange(n), 1 + J)
        nch = np.repeat(np.arange(1 + J), n)
        ok = nu <= cap
        if not ok.any():
            raise ConfigError(_infeasible(bound, value, dens))
        nf, nu, npar, nch = nf[ok], nu[ok], npar[ok], nch[ok]
        order = np.lexsort((nf, nu))  # by resource, then by end
        nf, nu, npar, nch = nf[order], nu[order], npar[order], nch[order]
        keep = np.ones(nf.shape[0], dtype=bool)
        keep[1:] = nf[1:] < np.minimum.accumulate(nf)[:-1]  # strictly earlier than every point of no more resource
        free, used = nf[keep], nu[keep]
        back.append((npar[keep], nch[keep]))
        fmax = max(fmax, int(free.shape[0]))
    shift = free[:, None] - base[B - 1][None, :] if policy.blocking else np.zeros((1, 1))
    ends = (np.maximum(comp_end[None, :] + shift, free[:, None]) + update_s).max(axis=1)
    i = int(np.lexsort((used, ends))[0])
    choice = []
    for b in range(B - 1, -1, -1):
        par, ch = back[b]
        choice.append(int(ch[i]))
        i = int(par[i])
    choice.reverse()
    plan = HybridPlan(workload.name, d, tuple(b.numel for b in buckets),
                      tuple(None if c == 0 else dens[c - 1] for c in choice), dense_collective, spec.value_bytes,
                      policy.bucket_cap_mb, policy.first_bucket_mb, spec.name)
    kw = dict(network=network, device=device, batch_size=batch_size, compute=compute, engine=engine, timer=timer)
    it_s = plan_iteration_s(plan, workload, spec, P, policy=policy, **kw)
    resource = plan.nominal_density() if bound != "error" else \
        float(sum(cost[b, c] for b, c in enumerate(choice)))
    uniform = _uniform(workload, spec, P, dens, policy, dense_spec, bound, value, errors, kw)
    feas = [u for u in uniform if u.feasible]
    best_u = min(feas, key=lambda u: (u.iter_s, u.resource)) if feas else None
    made = {**(made_with or {}), "P": P, "algorithm": spec.label, "collective": spec.collective,
            "candidate_densities": list(dens), "bound": bound, "bound_value": value, "iter_s": it_s,
            "resource": resource, "sent_density": plan.sent_density(), "batch_size": batch_size,
            "blocking": policy.blocking, "best_uniform": None if best_u is None else dataclasses.asdict(best_u),
            "gain_over_best_uniform": None if best_u is None else best_u.iter_s / it_s,
            "uniform": [dataclasses.asdict(u) for u in uniform]}
    if errors is not None:
        made["errors"] = errors.to_dict()
    plan = dataclasses.replace(plan, made_with=json.dumps(made, sort_keys=True))
    return HybridChoice(plan, it_s, resource, bound, value, tuple(uniform), best_u, fmax)


def _infeasible(bound: str, value: float, dens: tuple) -> str:
    if bound == "density":
        return (f"density_bound = {value:g}: no plan meets it (the smallest candidate density is {min(dens):g}): valid "
                f"density_bound >= {min(dens):g}, or a smaller candidate density")
    return f"{bound} = {value:g}: no plan meets it"  # min_density and error: the all-dense plan always does


def _uniform(workload, spec, P, dens, policy, dense_spec, bound, value, errors, kw) -> list:
    """Dense DDP and the bucket, model and layer policies at each candidate density, each with its resource."""
    d = workload.d
    r = simulate_timeline(dense_spec, workload, P, policy=dataclasses.replace(policy, dense="ddp"), **kw)
    out = [UniformResult("dense", None, None, float(r.iter_s[0]), 0.0 if bound == "error" else 1.0,
                         bound != "density" or value * (1 + DENSITY_RTOL) >= 1.0)]
    for j, rho in enumerate(dens):
        k = max(1, round(rho * d))
        for pol in ("bucket", "model", "layer"):
            if bound == "error":
                tab = {"bucket": None, "model": errors.model, "layer": errors.layer}[pol]
                resource = float(np.asarray(errors.bucket)[:, j].sum()) if tab is None else float(np.asarray(tab)[j])
                if not math.isfinite(resource):
                    continue  # not measured (layers that are not one contiguous range each)
                ok = resource <= value + ERROR_ATOL
            else:
                resource = rho
                ok = rho <= value * (1 + DENSITY_RTOL) if bound == "density" else rho >= value - DENSITY_RTOL
            t = simulate_timeline(dataclasses.replace(spec, k=k), workload, P,
                                  policy=dataclasses.replace(policy, sparse=pol), **kw)
            out.append(UniformResult(f"{pol}@{rho:g}", pol, rho, float(t.iter_s[0]), resource, ok))
    return out
