"""``sparsim plan``: which scheme, density and selection policy for this model on this cluster (docs/advisor.md).

For a model (a zoo model, a layer table or a measured table, or a network of the image zoo: a scenario's
[workload] or [model]), a cluster (a flat or cluster preset, or the hierarchical keys: a scenario's [cluster]) and
a list of worker counts P, the plan simulates one iteration of every configuration -- each registered algorithm
(:data:`sim.algorithms.REGISTRY`) x each of its collectives that the network can run x density x selection
policy -- on the layer-wise timeline (:func:`sim.engine.timeline.simulate_timeline`, the engine of cluster.engine:
the fast one unless the network needs the message-level one), exactly as ``sparsim run`` times a [workload]
scenario: the same workload, device, policy, compute model (:func:`experiments.resolve.resolve_compute`, the
device's selection / merge costs) and specs (:func:`experiments.resolve.algorithm_specs`).

Per configuration and P it reports (:data:`COLUMNS`):

- ``iter_s``: simulated seconds per iteration (the mean over ``iterations``; one iteration is the steady state
  when the compute model has no jitter or stragglers);
- its split, which sums to ``iter_s``: ``compute_s`` (rank 0's forward, backward and update), ``exposed_select_s``
  (selection time not hidden behind rank 0's compute: the selection slices of the timeline's trace outside the
  compute slices) and ``exposed_comm_s`` (the rest: collectives, and waits, not hidden behind compute);
- ``speedup_over_dense`` = t_dense / t and ``break_even_iteration_ratio`` = t_dense / t, the same number read two
  ways: with t_dense the iteration of dense S-SGD on DDP's buckets overlapped with backward (``dense_policy =
  "ddp"``) with the fastest of its collectives on this network at the same P (``dense_baseline``: ring, recursive
  doubling or hierarchical; a flat ring's 2(P - 1) latencies per bucket make it a weak baseline at large P), a
  scheme needing N_s iterations finishes first iff
  N_s t < N_dense t_dense, i.e. iff N_s / N_dense < t_dense / t: the break-even ratio is the largest factor of
  dense's iteration count the scheme may need and still finish first (< 1: it loses even at equal iterations);
- ``why``: the dominant term of the split (:func:`why`): ``compute-bound (85%)``, ``selection 62%`` or
  ``exposed comm 80%``.

Ranking (per P): by ``iter_s`` (equivalently by break-even ratio, largest first). With evidence
(:func:`load_evidence`: sparsim run directories, e.g. ``sparsim experiment tta``'s, or a CSV of the user's own
training), by predicted time to a target: the measured iterations to the target per seed x ``iter_s`` on the
target cluster (mean over the seeds, with the sample standard deviation, min and max). The order is then: the
configurations every seed of whose evidence reached the target (by mean predicted time), then those without
evidence at that P ("no evidence": by break-even ratio only), then those some seed did not bring to the target
("not reached n/N", by break-even ratio). See :func:`predict` for the matching rules.

Policies (:data:`PLAN_POLICIES`): ``model`` (whole-model selection after backward), ``bucket`` (per DDP bucket),
``layer`` (per layer), each overlapped with backward, and ``hybrid`` (per DDP bucket dense or compressed at its own
density, the plan of least simulated iteration under "overall density >= the row's density",
:func:`sim.engine.hybrid.choose_hybrid`); algorithms without k (dense, PowerSGD) run once per collective under the
scenario's dense policy (default DDP buckets). A new policy is one entry of :data:`PLAN_POLICIES`, a function that
turns the scenario's :class:`~sim.engine.timeline.TimelinePolicy` into the policy of one configuration.

Outputs (``--out DIR``, built in ``DIR.partial`` and renamed when complete): ``plan.csv`` (every configuration,
ranked per P), ``plan.md`` (the printed tables), ``pareto.png`` / ``pareto.pdf`` (time per iteration against
density, one panel per P, with each P's Pareto front of density against time) and ``summary.json`` (the settings,
the compute costs, the dense baseline per P, the evidence read).

Sources: the timeline's policies (PyTorch DDP, Horovod, the released gTop-k code; docs/workloads.md); break-even
by iterations: the time-to-accuracy accounting of Agarwal et al. (MLSys 2022) and of Pollux (OSDI 2021, goodput
= throughput x statistical efficiency), here with the statistical side measured instead of modelled.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import multiprocessing
import os
import signal
import time
import tomllib
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor
from concurrent.futures import wait as futures_wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sim.algorithms import REGISTRY, AlgorithmSpec, predict_columns
from sim.base.errors import ConfigError
from sim.engine.timeline import CollectiveTimer, TimelinePolicy, simulate_timeline
from sim.machine.network import PRESETS
from sim.machine.topology import CLUSTER_PRESETS, ClusterSpec

from .outdir import check_out, partial_dir, publish, save_figure, write_csv
from .resolve import (algorithm_specs, build_network, compute_costs, resolve_compute, resolve_device,
                      resolve_workload, timeline_policy)
from .scenario import DataCfg, Scenario, _validate, apply_overrides

__all__ = ["PLAN_POLICIES", "DEFAULT_DENSITIES", "DEFAULT_P", "COLUMNS", "EVIDENCE_COLUMNS", "Config", "PlanInputs",
           "resolve_plan", "simulate_plan", "rank_rows", "why", "break_even", "exposed_selection_s", "Evidence",
           "EvidenceRun", "load_evidence", "iterations_to_target", "predict", "check_target", "check_reached",
           "planned_runs", "OPTION_KEYS", "PRESET_DEVICES", "table_lines", "pareto_front",
           "pareto_figure", "run_plan", "NO_EVIDENCE_POLICIES", "BASELINE", "baseline_collectives", "agarwal_rows", "espresso_rows", "anchor_lines", "run_anchors",
           "ANCHOR_COLUMNS", "MAX_JOBS", "default_jobs", "check_plan_jobs", "plan_collective_keys",
           "prefetch_collectives"]


def _uniform(name: str):
    """The builder of a uniform sparse policy ``name`` (model, bucket, layer): the scenario's policy with that
    selection scope."""
    def build(base: TimelinePolicy, **_ctx) -> TimelinePolicy:
        return dataclasses.replace(base, sparse=name)

    build.__doc__ = f"The scenario's TimelinePolicy with sparse = {name!r}."
    return build


def _hybrid(base: TimelinePolicy, *, spec: AlgorithmSpec, P: int, inputs: "PlanInputs", timer,
            density: float) -> TimelinePolicy:
    """The hybrid per-bucket policy (:mod:`sim.engine.hybrid`, docs/hybrid.md) of one configuration: the plan of
    least simulated iteration that :func:`sim.engine.hybrid.choose_hybrid` finds for ``spec`` on P ranks, each DDP
    bucket dense or compressed at one of the plan's densities, under the floor "overall density >= ``density``" (the
    row's: it keeps at least what the uniform policies at that density keep, and the all-compressed plan at it is
    the ``bucket`` policy). Raises what choose_hybrid raises."""
    from sim.engine.hybrid import choose_hybrid

    sc = inputs.sc
    choice = choose_hybrid(inputs.workload, inputs.network_of(P), spec, P, densities=inputs.densities,
                           bound="min_density", value=density, policy=base, device=inputs.device,
                           batch_size=sc.training.batch_size, compute=inputs.compute, engine=sc.cluster.engine,
                           dense_collective=sc.compression.dense_collective, timer=timer)
    return choice.plan.policy(base)


#: The selection policies a plan compares for the algorithms with k: name -> builder(base policy, spec=, P=,
#: inputs=, timer=, density=) returning the :class:`~sim.engine.timeline.TimelinePolicy` of one configuration (``model``,
#: ``bucket``, ``layer``: the uniform ones; ``hybrid``: :func:`_hybrid`). A new policy is one entry; every other part
#: of ``sparsim plan`` reads this dict.
PLAN_POLICIES = {"model": _uniform("model"), "bucket": _uniform("bucket"), "layer": _uniform("layer"),
                 "hybrid": _hybrid}
def _policy_applies(policy: str, algorithm: str) -> bool:
    """Whether a plan builds configurations of ``algorithm`` under ``policy`` (a key of :data:`PLAN_POLICIES`): every
    algorithm with k runs the uniform policies; ``hybrid`` only those a hybrid plan can run
    (:func:`sim.engine.hybrid.hybrid_algorithms`, the one rule every loader of a plan holds: not DGC)."""
    from sim.engine.hybrid import hybrid_algorithms

    if not REGISTRY[algorithm].sparse:
        return False
    return policy != "hybrid" or algorithm in hybrid_algorithms()


#: Policies whose configurations take no convergence evidence: the hybrid plan is chosen per row (its per-bucket
#: densities differ from one row to the next), so a run of one hybrid plan says nothing about another.
NO_EVIDENCE_POLICIES = ("hybrid",)

#: Densities k/d compared when neither --densities, the scenario nor the evidence names any (log-spaced over the
#: range the papers use: gTop-k 0.001, DGC 0.001, Ok-Topk 0.01 - 0.02, Top-k studies up to 0.1).
DEFAULT_DENSITIES = (0.0001, 0.001, 0.01, 0.03, 0.1)
#: Worker counts when neither --P, the scenario nor the evidence gives them.
DEFAULT_P = (64, 256, 1024, 4096)
#: The dense baseline's algorithm: dense S-SGD on DDP's buckets overlapped with backward (what a DDP user runs), with
#: the fastest of its collectives the network runs at each P (:func:`baseline_collectives`).
BASELINE = "dense"  # algorithms: the baseline is dense S-SGD by definition
#: Largest P (as cluster.P).
MAX_P = 65536

#: plan.csv's columns (times in s; density = k/d, empty for an algorithm without k).
COLUMNS = ("P", "rank", "algorithm", "collective", "density", "k", "policy", "iter_s", "compute_s",
           "exposed_select_s", "exposed_comm_s", "select_s", "comm_s", "dense_baseline", "dense_iter_s",
           "speedup_over_dense",
           "break_even_iteration_ratio", "why", "communication_ops", "bytes_per_rank")
#: The columns added with --evidence (iterations and predicted seconds to the target over the seeds).
EVIDENCE_COLUMNS = ("evidence", "metric", "target", "seeds", "n_reached", "tta_iterations_mean", "tta_iterations_std",
                    "tta_iterations_min", "tta_iterations_max", "tta_s_mean", "tta_s_std", "tta_s_min", "tta_s_max",
                    "evidence_source")


@dataclass(frozen=True)
class Config:
    """One configuration of a plan: a registered ``algorithm``, one of its ``collective`` s, ``density`` k/d (None
    for an algorithm without k) and ``policy`` (a key of :data:`PLAN_POLICIES`, or the dense policy of an algorithm
    without k)."""

    algorithm: str
    collective: str
    density: float | None
    policy: str

    @property
    def label(self) -> str:
        """``gtopk:tree 0.001 layer`` / ``dense:ring ddp``."""
        d = "" if self.density is None else f" {self.density:g}"
        return f"{self.algorithm}:{self.collective}{d} {self.policy}"


@dataclass
class PlanInputs:
    """A resolved plan (:func:`resolve_plan`): the validated scenario ``sc`` (the model, cluster, device, compute
    and algorithm options; cluster.P is replaced by each of ``Ps``), the ``workload`` and ``device`` (None for a
    measured table), the configurations in order, the worker counts, the compute model and its costs
    (:func:`experiments.resolve.compute_costs`), the scenario's timeline policy, ``iterations`` simulated per
    configuration, the model's name and (a [model] network's) data set, ``evidence`` (or None) and ``device_from``
    (where the device came from: --device, --set, the scenario, the cluster preset (:data:`PRESET_DEVICES`) or the
    default; printed in the header)."""

    sc: Scenario
    workload: object
    device: object
    configs: list[Config]
    Ps: tuple[int, ...]
    densities: tuple[float, ...]
    policies: tuple[str, ...]
    compute: object
    costs: dict
    base_policy: TimelinePolicy
    iterations: int
    model: str
    dataset: str | None
    network: str
    evidence: "Evidence | None" = None
    device_from: str = ""
    _specs: dict = field(default_factory=dict, repr=False)

    def network_of(self, P: int):
        """The cluster with P ranks (:func:`experiments.resolve.build_network` of the scenario's [cluster]).
        Raises ConfigError when the node size does not divide P."""
        return build_network(self.sc.cluster.model_copy(update={"P": P}), timing_only=True)

    def spec(self, cfg: Config, G: int) -> AlgorithmSpec:
        """The whole-model :class:`AlgorithmSpec` of ``cfg`` with G ranks per node: the scenario's options for the
        algorithm (:func:`experiments.resolve.algorithm_specs`), its collective and k = round(density x d)."""
        key = (cfg.algorithm, G)
        if key not in self._specs:
            sc = self.sc.model_copy(update={"algorithms": [cfg.algorithm]})
            (self._specs[key],) = algorithm_specs(sc, 1, G)
        k = _k(cfg.density, self.workload.d) if REGISTRY[cfg.algorithm].sparse else None
        return dataclasses.replace(self._specs[key], collective=cfg.collective, k=k)

    def policy(self, cfg: Config, spec: AlgorithmSpec, P: int, timer) -> TimelinePolicy:
        """The timeline policy of ``cfg``: :data:`PLAN_POLICIES` [cfg.policy] for an algorithm with k, the scenario's
        (its dense policy) for one without."""
        if not REGISTRY[cfg.algorithm].sparse:
            return self.base_policy
        return PLAN_POLICIES[cfg.policy](self.base_policy, spec=spec, P=P, inputs=self, timer=timer,
                                         density=cfg.density)


def _k(density: float, d: int) -> int:
    """k of a density on d parameters: round(density x d) clamped to [1, d], as Scenario.k_for."""
    return min(d, max(1, round(density * d)))


# ------------------------------------------------------------------ options


def _no_empty_item(opt: str, text, items: list[str], valid: str) -> None:
    """ConfigError for an empty item of a comma-separated option (``64,,256``, ``64,``): valid ``valid``."""
    empty = [isinstance(x, str) and not x.strip() for x in items]
    if any(empty) and not all(empty):  # all empty: the option "names none"
        raise ConfigError(f"{opt} {text!r} has an empty item: valid {valid}, without empty items")


def _ints(opt: str, text: str, lo: int, hi: int) -> tuple[int, ...]:
    items = [x.strip() for x in str(text).split(",")]
    _no_empty_item(opt, text, items, f"comma-separated integers {lo} <= P <= {hi}")
    try:
        vals = [int(x) for x in items if x]
    except ValueError:
        raise ConfigError(f"{opt} {text!r}: expected comma-separated integers {lo} <= P <= {hi}") from None
    if not vals:
        raise ConfigError(f"{opt} {text!r} names none: valid comma-separated integers {lo} <= P <= {hi}")
    for v in vals:
        if not lo <= v <= hi:
            raise ConfigError(f"{opt} {v} is out of range: valid {lo} <= P <= {hi}")
    if len(set(vals)) < len(vals):
        raise ConfigError(f"{opt} {text!r} names a value twice: valid each once")
    return tuple(vals)


def _densities(text) -> tuple[float, ...]:
    items = [x.strip() for x in text.split(",")] if isinstance(text, str) else list(text)
    _no_empty_item("--densities", text, items, "comma-separated k/d in (0, 1]")
    out: list[float] = []
    for x in items:
        if x == "":
            continue
        try:
            d = float(x)
        except (TypeError, ValueError):
            raise ConfigError(f"--densities: {x!r} is not a number: valid comma-separated k/d in (0, 1]") from None
        if not (0 < d <= 1):
            raise ConfigError(f"--densities: {x!r} is out of range: valid 0 < density <= 1 (k/d)")
        if d in out:
            raise ConfigError(f"--densities names {d:g} twice: valid each once")
        out.append(d)
    if not out:
        raise ConfigError(f"--densities {text!r} names none: valid comma-separated k/d in (0, 1]")
    return tuple(out)


def _policies(text) -> tuple[str, ...]:
    items = [x.strip() for x in text.split(",")] if isinstance(text, str) else list(text)
    _no_empty_item("--policies", text, items, f"a comma-separated subset of {', '.join(PLAN_POLICIES)}")
    out = []
    for x in items:
        if not x:
            continue
        if x not in PLAN_POLICIES:
            raise ConfigError(f"--policies: {x!r} is unknown: valid {', '.join(PLAN_POLICIES)}")
        if x in out:
            raise ConfigError(f"--policies names {x} twice: valid each once")
        out.append(x)
    if not out:
        raise ConfigError(f"--policies {text!r} names none: valid a comma-separated subset of {', '.join(PLAN_POLICIES)}")
    return tuple(out)


def _timeable(hierarchical: bool) -> set[tuple[str, str]]:
    """(algorithm, collective) pairs the simulator times on a flat network (or, with ``hierarchical``, a cluster):
    every column of ``sparsim predict`` (:func:`sim.algorithms.predict_columns`)."""
    return set(predict_columns(hierarchical).values())


def _algorithms(text, hierarchical: bool) -> list[tuple[str, str]]:
    """(algorithm, collective) pairs of --algorithms: NAME (each of its collectives the network can run) or
    NAME:COLLECTIVE, in the given order; None: every registered algorithm."""
    ok = _timeable(hierarchical)
    if text is not None:
        raw = [str(x).strip() for x in (text.split(",") if isinstance(text, str) else text)]
        _no_empty_item("--algorithms", text, raw, f"a comma-separated subset of {', '.join(REGISTRY)} (NAME or "
                       "NAME:COLLECTIVE)")
    items = list(REGISTRY) if text is None else [x for x in raw if x]
    if not items:
        raise ConfigError(f"--algorithms {text!r} names none: valid a comma-separated subset of {', '.join(REGISTRY)} "
                          "(NAME or NAME:COLLECTIVE)")
    out: list[tuple[str, str]] = []
    for item in items:
        name, _, coll = item.partition(":")
        if name not in REGISTRY:
            raise ConfigError(f"--algorithms: {name!r} is unknown: valid {', '.join(REGISTRY)} (NAME or NAME:COLLECTIVE)")
        valid = [c for c in REGISTRY[name].collectives if (name, c) in ok]
        if coll:
            if coll not in valid:
                more = "" if hierarchical or "hierarchical" not in REGISTRY[name].collectives else \
                    " (hierarchical needs a cluster preset or cluster.network = 'hierarchical')"
                raise ConfigError(f"--algorithms: {item!r}: collective {coll!r} is not one the simulator times for {name} "
                                  f"here: valid {', '.join(valid)}{more}")
            pairs = [(name, coll)]
        else:
            pairs = [(name, c) for c in valid]
        for p in pairs:
            if p in out:
                raise ConfigError(f"--algorithms names {p[0]}:{p[1]} twice: valid each once")
            out.append(p)
    return out


def _model_overrides(model: str) -> tuple[list[str], str]:
    """The scenario overrides of --model: a zoo model (workload.model), a network of the image zoo (model.name,
    trained on images: data.dataset), or a layer-table file (workload.table); and which of the three."""
    from sim.workloads.nets import NET_ZOO
    from sim.workloads.zoo import ZOO_MODELS

    if model in ZOO_MODELS:
        return [f"workload.model={json.dumps(model)}", "workload.table=''", "model.name=''"], "zoo"
    if model in NET_ZOO:
        return [f"model.name={json.dumps(model)}", "workload.model=''", "workload.table=''"], "net"
    p = Path(model)
    if p.suffix in (".csv", ".toml") and p.is_file():
        return [f"workload.table={json.dumps(model)}", "workload.model=''", "model.name=''"], "table"
    raise ConfigError(f"--model {model!r} is unknown: valid a zoo model ({', '.join(ZOO_MODELS)}), a network of the "
                      f"image zoo ({', '.join(NET_ZOO)}) or a layer-table file (.csv or .toml) that exists")


def _read_scenario_dict(path: str) -> dict:
    """The TOML dict of scenario file ``path`` (ConfigError for a missing, unreadable or invalid file)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"scenario file {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"scenario file {str(p)!r} is not UTF-8 text (TOML must be UTF-8): {err.reason}") from None
    except OSError as err:
        raise ConfigError(f"scenario file {str(p)!r} cannot be read: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{p}: invalid TOML: {err}") from None


#: The scenario keys each option of ``sparsim plan`` sets: the same setting given both by the option and by
#: ``--set KEY=VALUE`` is an error naming both (:func:`_check_set_conflicts`); a scenario file's keys are replaced by
#: the options (documented precedence).
OPTION_KEYS = {"--model": ("workload.model", "workload.table", "model.name"), "--network": ("cluster.network",),
               "--device": ("workload.device",), "--batch-size": ("training.batch_size",), "--P": ("cluster.P",),
               "--densities": ("compression.density", "compression.k"), "--algorithms": ("algorithms",),
               "--policies": ("workload.sparse_policy",)}
#: The device of each cluster preset (:data:`sim.machine.topology.CLUSTER_PRESETS` names none): the plan prices
#: compute on it when neither --device, --set workload.device nor the scenario names a device. gtopk-icdcs: the
#: gTop-k papers' P102-100s (Shi et al., ICDCS 2019); v100-25GbE: 8 V100s per node; dgx-h100: NVIDIA DGX H100 (8 H100).
PRESET_DEVICES = {"gtopk-icdcs": "P102-100", "v100-25GbE": "V100", "dgx-h100": "H100"}


def _check_set_conflicts(overrides, given: dict) -> None:
    """ConfigError when an option of ``given`` (option name -> its value, None when not given) and a ``--set``
    override of ``overrides`` set the same scenario key (:data:`OPTION_KEYS`): one line naming both."""
    for item in overrides:
        key = str(item).split("=", 1)[0].strip()
        for opt, keys in OPTION_KEYS.items():
            if key in keys and given.get(opt) is not None:
                v = given[opt]
                shown = v if isinstance(v, str) else ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v
                raise ConfigError(f"{opt} {shown} and --set {item} both set {key}: valid one of the two (the option, "
                                  "or --set without it)")


def resolve_plan(scenario: str | None = None, overrides=(), *, model: str | None = None, network: str | None = None,
                 P=None, densities=None, algorithms=None, policies=None, device: str | None = None,
                 batch_size: int | None = None, iterations: int = 1, evidence: "Evidence | None" = None) -> PlanInputs:
    """Resolve a plan's settings into :class:`PlanInputs`; every check happens here, before any simulation.

    scenario: a scenario TOML file (None: the schema's defaults, no embedded [data] run) whose [workload] or [model],
    [cluster], [compute], [compression] and [algorithm.NAME] tables describe the model, the cluster and the costs;
    overrides: its ``--set KEY=VALUE`` strings. The options replace scenario keys: ``model`` (a zoo model, a network
    of the image zoo, or a layer-table file: workload.model / model.name / workload.table; a network is trained on
    data.dataset, fashion-mnist unless set), ``network`` (cluster.network: a flat preset, a cluster preset, custom or
    hierarchical with the cluster.* keys), ``device`` (workload.device; when neither it, ``--set workload.device``
    nor the scenario names a device, a cluster preset's own (:data:`PRESET_DEVICES`), else the schema's default
    P102-100), ``batch_size`` (training.batch_size). An option and a ``--set`` of a key it sets
    (:data:`OPTION_KEYS`) are an error, not a precedence.
    The sweep axes: ``P`` (comma-separated or a sequence; default the scenario's cluster.P when the file sets it,
    else the evidence's, else :data:`DEFAULT_P`), ``densities`` (k/d in (0, 1]; default the scenario's
    compression.density / k when set, else the evidence's, else :data:`DEFAULT_DENSITIES`), ``algorithms`` (NAME or
    NAME:COLLECTIVE; default the scenario's algorithms when set, else every registered algorithm, each with every
    collective the network can run), ``policies`` (keys of :data:`PLAN_POLICIES`; default the scenario's
    workload.sparse_policy when set, else all). iterations: iterations simulated per configuration (>= 1).
    evidence: :func:`load_evidence`'s result, whose P, batch size and densities are the defaults when nothing
    else gives them.

    Raises ConfigError (one line naming the value and the valid range): no model; an unknown model, network,
    device, algorithm, collective or policy; a density outside (0, 1]; P outside 1..65536 or not a multiple of the
    node size; an empty item in a list (``64,,256``); an option and a --set of the same key; --densities or
    --policies when no chosen algorithm has k, or a policy no chosen algorithm runs (hybrid for DGC alone); a
    scenario key the plan's model does not use; evidence of another model, data set or batch size, or evidence
    without a P or batch size when the plan has several P (:meth:`Evidence.check_against`).
    """
    from sim.base.errors import check_int

    check_int("--iterations", iterations, *OPTION_RANGES["--iterations"], err=ConfigError)
    _check_set_conflicts(overrides, {"--model": model, "--network": network, "--device": device,
                                     "--batch-size": batch_size, "--P": P, "--densities": densities,
                                     "--algorithms": algorithms, "--policies": policies})
    raw = _read_scenario_dict(scenario) if scenario is not None else {}
    where = str(scenario) if scenario is not None else "sparsim plan options"
    ov: list[str] = []
    if model is not None:
        mo, kind = _model_overrides(model)
        ov += mo
        if kind == "net" and (raw.get("data") or {}).get("dataset") not in DataCfg.IMAGES:
            ov.append("data.dataset='fashion-mnist'")  # a network trains on images; the scenario's image set stays
    if network is not None:
        if network not in PRESETS and network not in CLUSTER_PRESETS and network not in ("custom", "hierarchical"):
            raise ConfigError(f"--network {network!r} is unknown: valid {', '.join(PRESETS)}, "
                              f"{', '.join(CLUSTER_PRESETS)}, custom or hierarchical (with --set cluster.KEY=VALUE)")
        ov.append(f"cluster.network={json.dumps(network)}")
    if device is not None:
        from sim.workloads.devices import get_device

        try:
            get_device(device)
        except ConfigError as err:
            raise ConfigError(f"--device: {err}") from None
        ov.append(f"workload.device={json.dumps(device)}")
    if batch_size is not None:
        check_int("--batch-size", batch_size, *OPTION_RANGES["--batch-size"], err=ConfigError)
        ov.append(f"training.batch_size={batch_size}")
    ov += list(overrides)
    data = apply_overrides(raw, ov)
    first = _validate(data, where, list(overrides))
    if not (first.workload.active or first.model.name):
        raise ConfigError("no model to plan for: valid --model NAME (a zoo model, a network of the image zoo or a "
                          "layer-table file) or a scenario with workload.model, workload.table or model.name")
    given = lambda table, key: key in getattr(first, table).model_fields_set  # noqa: E731
    if evidence is not None and batch_size is None and not given("training", "batch_size"):
        if len(evidence.batch_sizes) == 1:
            data = apply_overrides(data, [f"training.batch_size={next(iter(evidence.batch_sizes))}"])
    cl0 = first.cluster
    hier = cl0.network in CLUSTER_PRESETS or cl0.network == "hierarchical"
    pairs = _algorithms(algorithms if algorithms is not None else
                        (first.algorithms if "algorithms" in first.model_fields_set else None), hier)
    names = list(dict.fromkeys(a for a, _ in pairs))
    with_k = [a for a in names if REGISTRY[a].sparse]
    for opt, v in (("--densities", densities), ("--policies", policies)):
        if v is not None and not with_k:
            shown = v if isinstance(v, str) else ",".join(map(str, v))
            raise ConfigError(f"{opt} {shown}: none of the plan's algorithms ({', '.join(names)}) selects k entries, so "
                              f"no configuration uses it: valid without {opt}, or with an algorithm with k "
                              f"({', '.join(a for a in REGISTRY if REGISTRY[a].sparse)})")
    data = apply_overrides(data, [f"algorithms={json.dumps(names)}"])
    sc = _validate(data, where, list(overrides))
    if P is not None:
        Ps = _ints("--P", P, 1, MAX_P) if isinstance(P, str) else _ints("--P", ",".join(map(str, P)), 1, MAX_P)
    elif given("cluster", "P"):
        Ps = (sc.cluster.P,)
    elif evidence is not None and evidence.Ps:
        Ps = tuple(sorted(evidence.Ps))
    else:
        Ps = DEFAULT_P
    if densities is not None:
        dens = _densities(densities)
    elif given("compression", "density") or given("compression", "k"):
        dens = None  # from k or density, once d is known
    elif evidence is not None and evidence.densities:
        dens = tuple(sorted(evidence.densities))
    else:
        dens = DEFAULT_DENSITIES
    if sc.workload.hybrid_plan:
        raise ConfigError(f"workload.hybrid_plan = {sc.workload.hybrid_plan!r}: sparsim plan chooses each configuration's "
                          "hybrid plan itself (policy hybrid): valid without it (sparsim run times a given plan)")
    if policies is not None:
        pols = _policies(policies)
    elif given("workload", "sparse_policy"):
        if sc.workload.sparse_policy not in PLAN_POLICIES:
            raise ConfigError(f"workload.sparse_policy = {sc.workload.sparse_policy!r}: sparsim plan compares "
                              f"{', '.join(PLAN_POLICIES)}: valid one of them, or --policies")
        pols = (sc.workload.sparse_policy,)
    else:
        pols = tuple(PLAN_POLICIES)
    # the model, the device and the compute model, as a run of this scenario resolves them
    set_keys = {str(o).split("=", 1)[0].strip() for o in overrides}
    preset_dev = False
    if device is not None:
        device_from = "--device"
    elif "workload.device" in set_keys:
        device_from = "--set workload.device"
    elif "device" in (raw.get("workload") or {}):
        device_from = f"{scenario}'s workload.device"
    elif sc.cluster.network in PRESET_DEVICES:  # the cluster preset's own GPU, not the scenario default's
        data = apply_overrides(data, [f"workload.device={json.dumps(PRESET_DEVICES[sc.cluster.network])}"])
        preset_dev = True
        device_from = f"the {sc.cluster.network} preset's device; --device to change"
    else:
        device_from = f"the default workload.device: {sc.cluster.network} names no device; --device to change"
    if sc.model.name:
        if preset_dev:
            sc = _validate(data, where, list(overrides))
        wl = _net_workload(sc.model.name)
        dev = resolve_device(sc)
        model_name, dataset = sc.model.name, sc.data.dataset
    else:
        wl, dev = resolve_workload(sc)  # a measured table (dev None) takes no device, the preset's neither
        if dev is not None and preset_dev:
            sc = _validate(data, where, list(overrides))
            dev = resolve_device(sc)
        model_name, dataset = wl.name, None
        if dev is None:
            device_from = "a measured table: no device"
    if dens is None:
        k = sc.k_for(wl.d)
        if not 1 <= k <= wl.d:
            raise ConfigError(f"compression.k = {k} is out of range: valid 1 <= k <= d = {wl.d}")
        dens = (k / wl.d,) if sc.compression.k is not None else (sc.compression.density,)
    cm = resolve_compute(sc, dev)
    costs = compute_costs(sc, dev)
    for p in Ps:  # node size against every P, before any simulation
        build_network(sc.cluster.model_copy(update={"P": p}), timing_only=True)
    for pol in pols if with_k else ():  # a policy no chosen algorithm runs is an option the plan does not use
        if not any(_policy_applies(pol, a) for a in with_k):
            src = "--policies" if policies is not None else "workload.sparse_policy"
            raise ConfigError(f"{src} {pol}: none of the plan's algorithms with k ({', '.join(with_k)}) runs policy "
                              f"{pol}: valid {pol} with one of {', '.join(a for a in REGISTRY if _policy_applies(pol, a))}"
                              f", or {src} {', '.join(p for p in PLAN_POLICIES if p != pol)}")
    configs = []
    for name, coll in pairs:
        if REGISTRY[name].sparse:
            configs += [Config(name, coll, d, pol) for d in dens for pol in pols if _policy_applies(pol, name)]
        else:
            configs.append(Config(name, coll, None, sc.workload.dense_policy))
    inp = PlanInputs(sc, wl, dev, configs, Ps, dens, pols, cm, costs, timeline_policy(sc), iterations, model_name,
                     dataset, sc.cluster.network, evidence, device_from)
    if evidence is not None:
        evidence.check_against(inp)
    return inp


def _net_workload(name: str):
    """The layer-wise workload of a network of the image zoo, as a [model] run times it
    (:func:`sim.workloads.nets.net_workload` on a 1 x 28 x 28 image; the FLOPs do not depend on the weights).
    Needs torch (ConfigError without it)."""
    from sim.workloads.nets import build_net, net_workload

    return net_workload(build_net(name, seed=0, dtype="float32"), (1, 28, 28), name)


# ------------------------------------------------------------------ simulation


def exposed_selection_s(timeline) -> float:
    """Seconds of rank 0's selections not hidden behind its compute in one traced iteration: the total length of
    the ``select`` slices of its communication stream minus their overlap with its compute slices (forward,
    backward, update). ``timeline``: a :class:`sim.engine.timeline.IterationTimeline`."""
    comp = sorted((s, e) for _n, s, e, _a in timeline.compute[0] if e > s)
    merged: list[list[float]] = []
    for s, e in comp:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    out = 0.0
    for name, s, e, _a in timeline.comm[0]:
        if not name.startswith("select ") or e <= s:
            continue
        hidden = sum(max(0.0, min(e, ce) - max(s, cs)) for cs, ce in merged)
        out += (e - s) - hidden
    return out


def why(compute_s: float, exposed_select_s: float, exposed_comm_s: float) -> str:
    """The dominant term of an iteration's split (seconds, summing to the iteration): ``compute-bound (85%)`` when
    compute is the largest, else ``selection 62%`` or ``exposed comm 80%`` (the share of the iteration, rounded to a
    percent). Ties go to compute, then selection."""
    total = compute_s + exposed_select_s + exposed_comm_s
    parts = (("compute", compute_s), ("selection", exposed_select_s), ("exposed comm", exposed_comm_s))
    name, v = max(parts, key=lambda nv: nv[1])  # max keeps the first of equal values
    share = v / total if total > 0 else 0.0
    return f"compute-bound ({share:.0%})" if name == "compute" else f"{name} {share:.0%}"


def break_even(dense_iter_s: float, iter_s: float) -> float:
    """The break-even iteration ratio t_dense / t (module docstring): the largest multiple of dense S-SGD's iteration
    count a scheme of ``iter_s`` seconds per iteration may need and still reach the target no later than dense at
    ``dense_iter_s`` (s) per iteration. inf when iter_s = 0."""
    return dense_iter_s / iter_s if iter_s > 0 else math.inf


def _simulate(inp: PlanInputs, cfg: Config, P: int, net, timer, policy: TimelinePolicy | None = None) -> dict:
    """One configuration on P ranks: the timeline's numbers (a row of :data:`COLUMNS` without rank and the dense
    columns); ``policy`` replaces the configuration's (:meth:`PlanInputs.policy`) when given."""
    G = net.gpus_per_node if isinstance(net, ClusterSpec) else 1
    spec = inp.spec(cfg, G)
    policy = policy or inp.policy(cfg, spec, P, timer)
    T = inp.iterations
    res = simulate_timeline(spec, inp.workload, P, network=net, policy=policy, device=inp.device,
                            batch_size=inp.sc.training.batch_size, compute=inp.compute, iterations=T,
                            trace_iterations=range(1, T + 1), engine=inp.sc.cluster.engine, trace_ranks=1,
                            timer=timer)
    it = float(res.iter_s.mean())
    comp = float(res.compute_s.mean())
    xsel = float(np.mean([exposed_selection_s(tl) for tl in res.timelines]))
    xsel = min(xsel, max(0.0, it - comp))
    return {"P": P, "algorithm": cfg.algorithm, "collective": cfg.collective, "density": cfg.density,
            "k": spec.k if spec.algorithm.sparse else None, "policy": cfg.policy, "iter_s": it, "compute_s": comp,
            "exposed_select_s": xsel, "exposed_comm_s": it - comp - xsel, "select_s": float(res.compress_s.mean()),
            "comm_s": float(res.comm_s.mean()), "communication_ops": len(res.buckets),
            "bytes_per_rank": float(res.bytes_per_rank), "config": cfg}


def baseline_collectives(inp: PlanInputs) -> list[str]:
    """The collectives of dense S-SGD (:data:`BASELINE`) the plan's network runs (``sparsim predict``'s columns:
    ring and recursive doubling, and hierarchical on a hierarchical cluster)."""
    net = inp.sc.cluster.network
    ok = _timeable(net in CLUSTER_PRESETS or net == "hierarchical")
    return [c for c in REGISTRY[BASELINE].collectives if (BASELINE, c) in ok]


#: The largest ``jobs`` of :func:`simulate_plan` (``sparsim plan --jobs``): more worker processes than this is a typo.
MAX_JOBS = 1024
#: The valid (lo, hi) of ``sparsim plan``'s integer options, inclusive: what :func:`resolve_plan`,
#: :func:`check_plan_jobs` and the CLI check, and what the CLI's message for a non-integer value names.
OPTION_RANGES = {"--iterations": (1, 1000), "--batch-size": (1, 10**7), "--top": (0, 10**6), "jobs": (1, MAX_JOBS)}

#: ``sparsim plan``'s default ``--jobs``: the usable cores, at most this many.
DEFAULT_JOBS_CAP = 8
#: Placeholder (seconds, wire bytes per rank) the dry pass of :func:`plan_collective_keys` returns for every collective
#: (positive, so no ratio of the pass divides by zero; the numbers of that pass are thrown away).
_PLACEHOLDER = (1.0, 1.0)


#: With ``sparsim plan``'s default --jobs (:func:`simulate_plan`'s ``jobs=None``), a P below this on a fabric without shared
#: links simulates its collectives in the plan's own process: they are cheap there (compiled paths), and the
#: prefetch's dry pass repeats the timelines' arithmetic, so two workers lost (ResNet-50, every collective, on
#: dgx-h100: 16.0 s serial against 17.3 s at P = 1024; at P = 4096, 57.8 s against 31.9 s; on gtopk-icdcs, whose
#: NICs and PCIe are shared, 29.3 s against 23.2 s already at P = 256; the 2-core VM, 2026-12-06).
AUTO_PREFETCH_MIN_P = 2048


def prefetch_jobs(jobs: int | None, P: int, network) -> int:
    """The worker processes :func:`simulate_plan` uses for P's collectives: ``jobs`` as asked; for None (the default
    --jobs) :func:`default_jobs`, or 1 where P < :data:`AUTO_PREFETCH_MIN_P` on a fabric without shared links
    (:func:`sim.engine.fastsim.unshared_fabric`)."""
    from sim.engine.fastsim import unshared_fabric

    if jobs is not None:
        return jobs
    return 1 if P < AUTO_PREFETCH_MIN_P and unshared_fabric(network) else default_jobs()


def default_jobs() -> int:
    """``sparsim plan``'s default ``--jobs``: the CPUs this process may use, at most :data:`DEFAULT_JOBS_CAP`."""
    from .algorithm_pool import usable_cpus

    return max(1, min(usable_cpus(), DEFAULT_JOBS_CAP))


def check_plan_jobs(jobs) -> int:
    """``jobs`` as an int in 1..:data:`MAX_JOBS`; ConfigError (one line naming --jobs and the range) otherwise."""
    if isinstance(jobs, bool) or not isinstance(jobs, (int, np.integer)) or not 1 <= jobs <= MAX_JOBS:
        raise ConfigError(f"--jobs {jobs!r} is out of range: valid 1 <= jobs <= {MAX_JOBS} (1: the collectives are "
                          "simulated in this process)")
    return int(jobs)


class _RecordingTimer(CollectiveTimer):
    """A :class:`CollectiveTimer` that simulates nothing: it records every key asked for (in first order) and answers
    :data:`_PLACEHOLDER`. The dry pass of :func:`plan_collective_keys`."""

    def __init__(self, P: int, network, compute, engine: str):
        super().__init__(P, network, compute, engine)
        self.keys: dict = {}

    def _run(self, spec: AlgorithmSpec, numel: int) -> tuple[float, float]:
        self.keys.setdefault(self.key(spec, numel), None)
        return _PLACEHOLDER


def _value_dependent(inp: PlanInputs, cfg: Config) -> bool:
    """Whether the collectives ``cfg`` asks the timer for depend on the times it answers: only under Horovod's tensor
    fusion (an algorithm without k under the scenario's dense policy ``horovod``), whose fused buffers are the
    tensors ready at each cycle, and a cycle starts when the previous allreduces end."""
    return not REGISTRY[cfg.algorithm].sparse and inp.base_policy.dense == "horovod"


def _plan_runs(inp: PlanInputs, configs) -> list[tuple[Config, TimelinePolicy | None]]:
    """(configuration, policy override) in the order :func:`simulate_plan` simulates them at one P: the dense baseline's
    collectives (DDP buckets, not blocking), then ``configs``."""
    ddp = dataclasses.replace(inp.base_policy, dense="ddp", blocking=False)
    return [(Config(BASELINE, c, None, "ddp"), ddp) for c in baseline_collectives(inp)] + [(c, None) for c in configs]


def plan_collective_keys(inp: PlanInputs, P: int, net=None, configs=None) -> list[tuple]:
    """The collectives (:meth:`CollectiveTimer.key`: (spec, elements)) the dense baseline and ``configs`` (default:
    all of ``inp``'s) ask their P's timer for, in first-asked order: a dry pass of the same :func:`_simulate` calls
    with a timer that records the keys and answers a placeholder (:class:`_RecordingTimer`).

    Exact because what a configuration asks for does not depend on the answers: the ``model``, ``bucket`` and
    ``layer`` policies and dense DDP ask for their buckets' collectives at k_b, fixed by the buckets; the ``hybrid``
    optimiser (:func:`sim.engine.hybrid.choose_hybrid`) asks for every bucket at dense and at every candidate density
    and for the uniform policies, all fixed, and the plan it picks (which does depend on the answers) asks only for
    some of those. The exception is Horovod's tensor fusion (:func:`_value_dependent`): those configurations are left
    out here and simulate their collectives in :func:`simulate_plan`'s own process. A configuration that raises
    (a ConfigError that the real pass raises there too) ends the pass: the keys before it are returned.
    net: the cluster with P ranks (default ``inp.network_of(P)``)."""
    net = inp.network_of(P) if net is None else net
    rec = _RecordingTimer(P, net, inp.compute, inp.sc.cluster.engine)
    for cfg, policy in _plan_runs(inp, inp.configs if configs is None else configs):
        if _value_dependent(inp, cfg):
            continue
        try:
            _simulate(inp, cfg, P, net, rec, policy)
        except Exception:  # the real pass raises it at this configuration, after the collectives before it
            break
    return list(rec.keys)


def _collectives(keys, P: int, network, compute, engine: str) -> list:
    """A worker's task: :meth:`CollectiveTimer.simulate` of each collective of ``keys`` (list of (spec, elements)),
    in order: a list of results, None for one that raises (the plan's own process then simulates it again where the
    serial run would, so the error is raised there, the same object type and message, at the same point of the
    plan)."""
    out = []
    for spec, numel in keys:
        try:
            out.append(CollectiveTimer.simulate(spec, numel, P, network, compute, engine))
        except Exception:
            out.append(None)
    return out


#: Tasks per worker in :func:`prefetch_collectives`: each task is every n-th collective (n the task count), so the
#: costly ones (a P's rings) spread over the tasks, and a task's pickling and hand-over (about 1 ms) is paid a few
#: hundred times per P instead of once per collective.
TASKS_PER_JOB = 64


def _worker_init(parent_pid: int) -> None:
    """A worker process of :func:`prefetch_collectives`: one BLAS / OpenMP thread unless the user's environment sets
    its count; Ctrl-C left to the parent (which cancels the pool and waits for the running tasks); the default SIGTERM
    action (not the CLI's unwinding handler, inherited by fork); killed with its parent
    (:func:`sim.base.process.die_with_parent`)."""
    from sim.base.process import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(parent_pid)
    unset = [v for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS") if v not in os.environ]
    for v in unset:
        os.environ[v] = "1"
    if unset:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)


def prefetch_collectives(timer: CollectiveTimer, keys, jobs: int, *, progress: bool = False) -> int:
    """Simulate the collectives among ``keys`` (:meth:`CollectiveTimer.key`) that ``timer`` has not cached on ``jobs``
    worker processes (``concurrent.futures.ProcessPoolExecutor``, fork where the OS has it) and put them in its cache
    (:meth:`CollectiveTimer.fill`); the same numbers as a miss in ``timer`` gives (the same function,
    :meth:`CollectiveTimer.simulate`, on the same arguments). Returns how many were simulated; does nothing (0)
    when jobs <= 1 or fewer than two are missing (no process is started).

    The collectives go in :data:`TASKS_PER_JOB` x jobs tasks (fewer when fewer are missing), task j taking every
    n-th collective from the j-th in first-asked order, so that a P's costly ones (its rings, hundreds of times the
    rest at P = 16384) spread over the tasks; all are submitted at once and the pool hands them out as workers free
    up, so the workers stay busy to the end but for the last task. The fast engine's process-wide memos
    (:data:`sim.engine.fastsim.PHASES`, ``ROTATION_ROUTES``) are each worker's own, so the workers together use more
    CPU than the serial run (benchmarks/bench_plan_jobs.py measures how much); one task per
    algorithm:collective would keep a memo in one worker but bound the wall time by the costliest group (CLT-k's
    rings at large P). A collective whose simulation raises is left out of the cache, so the caller's serial pass
    simulates it again and raises the error there. Ctrl-C (or any exception here) cancels the tasks not started and
    waits for the running ones; a worker that dies raises SparsimError. Raises ConfigError for jobs out of range."""
    jobs = check_plan_jobs(jobs)
    todo = timer.missing(keys)
    if jobs <= 1 or len(todo) < 2:
        return 0
    from tqdm import tqdm

    from sim.base.errors import SparsimError
    from sim.base.process import raise_if_signalled

    ctx = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
    results: dict = {}
    bar = tqdm(total=len(todo), desc=f"P = {timer.P} collectives", unit="coll", leave=False,
               disable=None if progress else True)
    try:
        with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=ctx, initializer=_worker_init,
                                 initargs=(os.getpid(),)) as ex:
            try:
                n_tasks = min(len(todo), jobs * TASKS_PER_JOB)
                chunks = [todo[j::n_tasks] for j in range(n_tasks)]
                futures = {ex.submit(_collectives, chunk, *timer.context()): chunk for chunk in chunks}
                pending = set(futures)
                while pending:
                    raise_if_signalled()  # a SIGTERM whose SystemExit a finalizer swallowed (sim.base.process)
                    done, pending = futures_wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                    for f in done:
                        try:
                            r = f.result()
                        except BrokenProcessPool:
                            raise SparsimError(f"a process simulating the collectives of P = {timer.P} ended without "
                                               "a result: run with --jobs 1 to see its error here") from None
                        for key, one in zip(futures[f], r):
                            if one is not None:
                                results[key] = one
                        bar.update(len(futures[f]))
            except BaseException:  # Ctrl-C, SIGTERM, a dead worker: drop the tasks not started and wait for the
                ex.shutdown(wait=True, cancel_futures=True)  # running ones, so no worker outlives the plan (the
                raise  # with's own shutdown is then a no-op: a second shutdown would not cancel)
    finally:
        bar.close()
    timer.fill(results)
    return len(results)


def simulate_plan(inp: PlanInputs, *, on_row=None, progress: bool = False, skip=None, jobs: int = 1,
                  on_prefetch=None) -> list[dict]:
    """Simulate every configuration of ``inp`` on every P; return the rows (dicts with :data:`COLUMNS` but
    ``rank``, plus ``config``: the :class:`Config`), P by P in configuration order, with the dense baseline of
    each P (:data:`BASELINE`: dense S-SGD on DDP's buckets overlapped with backward, not blocking, with the fastest
    of :func:`baseline_collectives`) filled in as ``dense_iter_s`` and ``dense_baseline`` (its collective), and the
    speed-up, break-even ratio and why of each row. on_row: optional callable(row,
    wall_s) after each row (the wall seconds it took); skip: optional callable(config, P) -> bool, True to leave that
    configuration out at that P (no row; a benchmark's time budget). Collective times are shared across the
    configurations of one
    P (one :class:`sim.engine.timeline.CollectiveTimer`: each distinct collective and size is simulated once).

    jobs (1 .. :data:`MAX_JOBS`): with jobs > 1, before the configurations of a P, the distinct collectives they will
    ask for (:func:`plan_collective_keys`, a dry pass; skip is asked then for each configuration, and the ones it
    leaves out are not prefetched) are simulated on ``jobs`` worker processes (:func:`prefetch_collectives`) into
    the P's timer, and the configurations then run here as with jobs = 1, mostly on cached collectives: the rows
    are the same, bit for bit (each collective is the same function of the same inputs; tests/test_plan_jobs.py).
    What is not prefetched -- the collectives of Horovod's tensor fusion, whose buffers depend on the times, those
    after a configuration that raises, one whose simulation raised in a worker -- is simulated here, where the
    serial run would, so errors are the serial run's. jobs = 1 starts no process. on_prefetch: optional
    callable(dict) after each P's prefetch (jobs > 1 only), with ``P``, ``collectives`` (the distinct ones asked
    for), ``simulated`` (by the workers), ``jobs`` (the worker processes started: 0 when fewer than two collectives
    were missing) and ``keys_s`` / ``wall_s`` (the dry pass's and the whole
    prefetch's wall seconds). jobs None: the default, each P's from :func:`prefetch_jobs` (serial where the prefetch
    does not pay).
    Raises what the timeline raises; ConfigError for jobs out of range."""
    from tqdm import tqdm

    jobs = None if jobs is None else check_plan_jobs(jobs)
    rows = []
    bar = tqdm(total=len(inp.Ps) * len(inp.configs), desc="plan", unit="config", disable=None if progress else True)
    try:
        for P in inp.Ps:
            net = inp.network_of(P)
            timer = CollectiveTimer(P, net, inp.compute, inp.sc.cluster.engine)
            jobs_P = prefetch_jobs(jobs, P, net)
            if jobs_P > 1:
                t0 = time.perf_counter()
                configs = [c for c in inp.configs if skip is None or not skip(c, P)]
                keys = plan_collective_keys(inp, P, net, configs)
                t_keys = time.perf_counter() - t0
                todo = len(timer.missing(keys))
                n = prefetch_collectives(timer, keys, jobs_P, progress=progress)
                if on_prefetch is not None:
                    on_prefetch({"P": P, "collectives": len(keys), "simulated": n,
                                 "jobs": min(jobs_P, todo) if todo >= 2 else 0, "keys_s": t_keys,
                                 "wall_s": time.perf_counter() - t0})
            t0 = time.perf_counter()
            ddp = dataclasses.replace(inp.base_policy, dense="ddp", blocking=False)
            dense = min((_simulate(inp, Config(BASELINE, c, None, "ddp"), P, net, timer, ddp)
                         for c in baseline_collectives(inp)), key=lambda r: r["iter_s"])
            if on_row is not None:
                on_row({**dense, "baseline": True}, time.perf_counter() - t0)
            td, tc = dense["iter_s"], dense["collective"]
            for cfg in inp.configs:
                if skip is not None and skip(cfg, P):
                    bar.update(1)
                    continue
                t0 = time.perf_counter()
                r = _simulate(inp, cfg, P, net, timer)
                r["dense_iter_s"], r["dense_baseline"] = td, tc
                r["speedup_over_dense"] = r["break_even_iteration_ratio"] = break_even(td, r["iter_s"])
                r["why"] = why(r["compute_s"], r["exposed_select_s"], r["exposed_comm_s"])
                rows.append(r)
                bar.update(1)
                if on_row is not None:
                    on_row(r, time.perf_counter() - t0)
    finally:
        bar.close()
    return rows


def rank_rows(rows: list[dict]) -> list[dict]:
    """``rows`` ordered P by P (in the order the Ps first appear) and, within a P, by predicted time to the target
    where every seed of the evidence reached it, then rows without evidence at that P, then rows the evidence did not
    bring to the target with every seed (module docstring); the last two groups, and every row without
    evidence, by ``iter_s`` (the break-even ratio, largest first); ties keep the configuration order. Sets
    ``rank`` (1 = best) per P. Returns a new list of the same dicts."""
    def group(r):
        ev = r.get("evidence")
        if ev == "reached":
            return 0, r["tta_s_mean"]
        return (1 if ev in (None, "none") else 2), r["iter_s"]

    out = []
    for P in dict.fromkeys(r["P"] for r in rows):
        block = sorted((r for r in rows if r["P"] == P), key=lambda r: (group(r)[0], group(r)[1]))
        for i, r in enumerate(block, 1):
            r["rank"] = i
        out += block
    return out


# ------------------------------------------------------------------ evidence


@dataclass(frozen=True)
class EvidenceRun:
    """One seed of one configuration's convergence evidence: ``algorithm``, ``collective``, ``k`` and ``density``
    (either may be None: the CSV gives one of them; both None without k), ``policy``, ``seed``, ``P`` and
    ``batch_size`` (None when the CSV does not say), ``model`` and ``dataset`` (None when not stated), the evaluated
    points (``iterations``, ints in increasing order, and ``values``, floats) and ``source`` (the run directory or
    CSV)."""

    algorithm: str
    collective: str
    k: int | None
    density: float | None
    policy: str
    seed: int
    P: int | None
    batch_size: int | None
    model: str | None
    dataset: str | None
    iterations: tuple
    values: tuple
    source: str

    def key(self, d: int) -> tuple:
        """The configuration's numerics key (:func:`_key`) on a model of d parameters (k = round(density x d)
        where only the density is given)."""
        k = self.k if self.k is not None or self.density is None else _k(self.density, d)
        return _key(self.algorithm, self.collective, k, self.policy)

    @property
    def label(self) -> str:
        """``gtopk:tree density 0.001 policy model`` (k where no density is given)."""
        size = "" if self.density is None and self.k is None else \
            (f" density {self.density:g}" if self.density is not None else f" k {self.k}")
        return f"{self.algorithm}:{self.collective}{size} policy {self.policy}"


@dataclass
class Evidence:
    """Convergence evidence (:func:`load_evidence`): the runs, the metric and whether lower is better (a loss), and
    the path read."""

    runs: list[EvidenceRun]
    metric: str
    lower_is_better: bool
    path: str

    @property
    def Ps(self) -> set[int]:
        """The worker counts the evidence was recorded at (those stated)."""
        return {r.P for r in self.runs if r.P is not None}

    @property
    def batch_sizes(self) -> set[int]:
        """The per-worker batch sizes stated."""
        return {r.batch_size for r in self.runs if r.batch_size is not None}

    @property
    def densities(self) -> set[float]:
        """The densities of the configurations with k."""
        return {r.density for r in self.runs if r.density is not None}

    def check_against(self, inp: PlanInputs) -> None:
        """ConfigError unless the evidence fits the plan: one model and one data set, the plan's (where stated);
        one per-worker batch size, the plan's (where stated); every run of a planned algorithm with its P and batch
        size stated unless the plan has one P (a CSV without the columns P and batch_size is read at that P:
        iterations to a target measured at one global batch are not reused at another); a P of the plan among the
        evidence's; some of its
        algorithms among the plan's, and every configuration of those one of the plan's (algorithm, collective,
        density, policy). Evidence of an algorithm the plan leaves out (--algorithms) is not read."""
        models = {r.model for r in self.runs if r.model is not None}
        if len(models) > 1:
            raise ConfigError(f"--evidence {self.path}: runs of several models ({', '.join(sorted(models))}): valid "
                              "evidence of one model")
        if models and models != {inp.model}:
            raise ConfigError(f"--evidence {self.path}: the evidence is for model {next(iter(models))!r}, the plan for "
                              f"{inp.model!r}: valid evidence of the plan's model (or --model {next(iter(models))})")
        sets = {r.dataset for r in self.runs if r.dataset is not None}
        if len(sets) > 1:
            raise ConfigError(f"--evidence {self.path}: runs on several data sets ({', '.join(sorted(sets))}): valid "
                              "evidence on one data set")
        if sets and inp.dataset is not None and sets != {inp.dataset}:
            raise ConfigError(f"--evidence {self.path}: the evidence was trained on {next(iter(sets))!r}, the plan's "
                              f"model on {inp.dataset!r} (data.dataset): valid evidence on the plan's data set")
        if len(self.batch_sizes) > 1:
            raise ConfigError(f"--evidence {self.path}: runs at several batch sizes per worker "
                              f"({', '.join(map(str, sorted(self.batch_sizes)))}): valid evidence at one")
        b = inp.sc.training.batch_size
        if self.batch_sizes and self.batch_sizes != {b}:
            raise ConfigError(f"--evidence {self.path}: the evidence was trained at {next(iter(self.batch_sizes))} "
                              f"samples per worker, the plan times {b}: valid --batch-size "
                              f"{next(iter(self.batch_sizes))} (iterations to a target depend on the batch)")
        if len(inp.Ps) > 1:  # evidence without its P (or batch) would be reused at every P of the plan
            for r in self.runs:
                missing = [c for c, v in (("P", r.P), ("batch_size", r.batch_size)) if v is None]
                if missing and r.algorithm in {c.algorithm for c in inp.configs}:
                    raise ConfigError(f"--evidence {self.path}: {r.label} seed {r.seed} has no {' or '.join(missing)} "
                                      f"(column {', '.join(missing)} missing or empty), and the plan has P = "
                                      f"{', '.join(map(str, inp.Ps))}: iterations to a target hold at one global batch "
                                      f"P x b: valid a CSV with columns P and batch_size, or one --P (the evidence's)")
        if self.Ps and not self.Ps & set(inp.Ps):
            raise ConfigError(f"--evidence {self.path}: recorded at P = {', '.join(map(str, sorted(self.Ps)))}, the "
                              f"plan's P are {', '.join(map(str, inp.Ps))}: valid --P including "
                              f"{', '.join(map(str, sorted(self.Ps)))} (iterations to a target depend on the global "
                              "batch P x b)")
        keys = {_key(c.algorithm, c.collective, _k(c.density, inp.workload.d) if c.density is not None else None,
                     c.policy) for c in inp.configs}
        planned = {c.algorithm for c in inp.configs}
        used = [r for r in self.runs if r.algorithm in planned]
        if not used:
            raise ConfigError(f"--evidence {self.path}: its algorithms ({', '.join(sorted({r.algorithm for r in self.runs}))}) "
                              f"are none of the plan's ({', '.join(sorted(planned))}): valid --algorithms naming them")
        for r in used:  # evidence of an algorithm left out by --algorithms is not read
            if r.policy in NO_EVIDENCE_POLICIES:
                raise ConfigError(f"--evidence {self.path}: {r.label} (from {r.source}) ran a hybrid plan: valid "
                                  "evidence of the uniform policies (the plan chooses each row's hybrid plan itself)")
            if r.key(inp.workload.d) not in keys:
                dens = ", ".join(f"{d:g}" for d in inp.densities)
                raise ConfigError(f"--evidence {self.path}: configuration {r.label} (from {r.source}) is not in the "
                                  f"plan (densities {dens}; policies {', '.join(inp.policies)}): valid evidence of the "
                                  "plan's configurations (or --algorithms / --densities / --policies naming it)")


def _key(algorithm: str, collective: str, k: int | None, policy: str) -> tuple:
    """What a configuration's convergence depends on: (algorithm, collective, k, policy), with the collective and
    the policy dropped for an exchange that is an exact sum (an algorithm without k that is not segmented: they
    change only the rounding) and k dropped for an algorithm without k."""
    algo = REGISTRY[algorithm]
    exact_sum = not algo.sparse and not algo.segmented
    return (algorithm, None if exact_sum else collective, k if algo.sparse else None, None if exact_sum else policy)


def _spec_of(d: dict) -> AlgorithmSpec:
    """An AlgorithmSpec from summary.json's ``algorithms`` entry (dataclasses.asdict of one)."""
    kw = dict(d)
    kw["options"] = tuple(tuple(x) for x in kw.get("options") or ())
    if kw.get("segments") is not None:
        kw["segments"] = tuple(kw["segments"])
    for key in ("segment_densities",):
        if kw.get(key) is not None:
            kw[key] = tuple(kw[key])
    known = {f.name for f in dataclasses.fields(AlgorithmSpec)}
    return AlgorithmSpec(**{k: v for k, v in kw.items() if k in known})


def _run_dirs(path: Path) -> list[Path]:
    """``path`` itself when it holds summary.json and metrics.csv, else every such folder below it, sorted."""
    if (path / "summary.json").is_file():
        return [path]
    return sorted(p.parent for p in path.rglob("summary.json") if (p.parent / "metrics.csv").is_file())


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _read_run(run: Path, metric: str) -> list[EvidenceRun]:
    """The evidence of one sparsim run directory: per algorithm of its metrics.csv, the evaluated rows of ``metric``
    and the configuration from summary.json."""
    from .record import read_metrics

    try:
        s = json.loads((run / "summary.json").read_text())
        scen, specs, d = s["scenario"], s["algorithms"], int(s["resolved"]["d"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"--evidence {run}: summary.json is not a sparsim run's ({type(err).__name__}: {err}): valid "
                          "a run directory of `sparsim run` or `sparsim experiment tta`") from None
    groups = read_metrics(run)
    w = scen.get("workload") or {}
    model = (scen.get("model") or {}).get("name") or w.get("model") or None
    if model is None and w.get("table"):
        model = s["resolved"].get("workload", {}).get("name")
    dataset = (scen.get("data") or {}).get("dataset") if (scen.get("model") or {}).get("name") else None
    comp = scen.get("compression") or {}
    out = []
    for label, rows in groups.items():
        spec = next((x for x in map(_spec_of, specs) if x.label == label), None)
        if spec is None:
            raise ConfigError(f"--evidence {run}: metrics.csv's algorithm {label!r} is not in summary.json's algorithms")
        if metric not in rows[0]:
            raise ConfigError(f"--evidence {run}: metrics.csv has no column {metric!r}: valid --metric one of "
                              f"{', '.join(k for k in rows[0] if k not in ('algorithm', 'run_id'))}")
        pts = [(int(r["iteration"]), float(r[metric])) for r in rows if _finite(r.get(metric))]
        if not pts:
            raise ConfigError(f"--evidence {run}: {label} has no value of {metric!r} (a timing-only run has no "
                              "accuracy): valid runs that evaluate it (a [model] run, e.g. sparsim experiment tta)")
        algo = spec.algorithm
        policy = w.get("sparse_policy", "model") if algo.sparse else w.get("dense_policy", "ddp")
        density = None
        if algo.sparse:
            density = spec.k / d if comp.get("k") is not None else float(comp.get("density", spec.k / d))
        out.append(EvidenceRun(spec.name, spec.collective, spec.k if algo.sparse else None, density, policy,
                               int(scen.get("seed", 0)), int((scen.get("cluster") or {}).get("P", 8)),
                               int((scen.get("training") or {}).get("batch_size", 16)), model, dataset,
                               tuple(p[0] for p in pts), tuple(p[1] for p in pts), str(run)))
    return out


#: The evidence CSV's required columns (besides the metric's); optional: collective, density, k, policy, P,
#: batch_size, model, dataset.
CSV_REQUIRED = ("algorithm", "seed", "iteration")


def _read_csv(path: Path, metric: str) -> list[EvidenceRun]:
    """The evidence of a CSV (one row per configuration, seed and evaluated iteration; docs/advisor.md)."""
    try:
        with open(path, newline="") as fh:
            rd = csv.DictReader(fh)
            rows = list(rd)
            cols = list(rd.fieldnames or [])
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise ConfigError(f"--evidence {path}: cannot be read as CSV: {err}") from None
    want = f"{', '.join(CSV_REQUIRED)}, {metric} (--metric)"
    if not cols:
        raise ConfigError(f"--evidence {path} is empty (no header, no rows): valid a CSV with a header ({want}) and "
                          "one row per configuration, seed and evaluated iteration")
    if not rows:
        raise ConfigError(f"--evidence {path} has a header but no rows: valid one row per configuration, seed and "
                          f"evaluated iteration under the columns {want}")
    missing = [c for c in (*CSV_REQUIRED, metric) if c not in cols]
    if missing:
        raise ConfigError(f"--evidence {path}: no column {', '.join(missing)}: valid a CSV with columns "
                          f"{', '.join(CSV_REQUIRED)}, {metric} (--metric) and optionally collective, density, k, "
                          "policy, P, batch_size, model, dataset")
    runs: dict[tuple, dict] = {}
    for i, r in enumerate(rows, 2):
        where = f"--evidence {path} line {i}"
        name = r["algorithm"].strip()
        if name not in REGISTRY:
            raise ConfigError(f"{where}: algorithm {name!r} is unknown: valid {', '.join(REGISTRY)}")
        algo = REGISTRY[name]
        coll = (r.get("collective") or "").strip() or algo.collectives[0]
        if coll not in algo.collectives:
            raise ConfigError(f"{where}: collective {coll!r} is not {name}'s: valid {', '.join(algo.collectives)}")
        policy = (r.get("policy") or "").strip() or ("model" if algo.sparse else "ddp")

        def num(col, typ, lo, hi=math.inf, optional=True):
            text = (r.get(col) or "").strip()
            if not text:
                if optional:
                    return None
                raise ConfigError(f"{where}: {col} is empty: valid {typ.__name__} in [{lo}, {hi}]")
            try:
                v = typ(float(text)) if typ is int and float(text).is_integer() else typ(text)
            except ValueError:
                raise ConfigError(f"{where}: {col} = {text!r} is not a number: valid {typ.__name__} in [{lo}, {hi}]") from None
            if not (lo <= v <= hi) or (isinstance(v, float) and not math.isfinite(v)):
                raise ConfigError(f"{where}: {col} = {text} is out of range: valid {lo} <= {col} <= {hi}")
            return v

        seed = num("seed", int, 0, optional=False)
        it = num("iteration", int, 0, optional=False)
        text = (r.get(metric) or "").strip()
        try:
            val = float(text) if text else None
        except ValueError:
            raise ConfigError(f"{where}: {metric} = {text!r} is not a number: valid a number, or empty where the "
                              "metric was not evaluated") from None
        if val is not None and not math.isfinite(val):
            val = None  # nan: not evaluated at this iteration
        k = density = None
        if algo.sparse:
            density, k = num("density", float, 0, 1), num("k", int, 1)
            if density == 0:
                raise ConfigError(f"{where}: density = 0 is out of range: valid 0 < density <= 1")
            if k is None and density is None:
                raise ConfigError(f"{where}: {name} selects k entries: give its density (or k): valid 0 < density <= 1")
        P_, b_ = num("P", int, 1, MAX_P), num("batch_size", int, 1)
        model, dataset = (r.get("model") or "").strip() or None, (r.get("dataset") or "").strip() or None
        key = (name, coll, k, density, policy, seed, P_, b_, model, dataset)
        run = runs.setdefault(key, {"pts": {}})
        if val is not None:
            if it in run["pts"] and run["pts"][it] != val:
                raise ConfigError(f"{where}: iteration {it} of {name} seed {seed} appears twice with different "
                                  f"values: valid one value per iteration")
            run["pts"][it] = val
    out = []
    for key, run in runs.items():
        pts = sorted(run["pts"].items())
        if not pts:
            continue
        out.append(EvidenceRun(*key, tuple(p[0] for p in pts), tuple(p[1] for p in pts), str(path)))
    return out


def load_evidence(path, metric: str = "test_accuracy") -> Evidence:
    """Convergence evidence from ``path``: a sparsim run directory, a folder holding run directories (e.g. the
    output of ``sparsim experiment tta``, whose runs are under runs/), or a CSV with one row per configuration, seed
    and evaluated iteration (columns :data:`CSV_REQUIRED` and ``metric``; optional collective (default the
    algorithm's first), density or k (one of them for an algorithm with k; a density stands for k = round(density x
    d) on the plan's d parameters), policy (default model, or ddp for an algorithm without k), P, batch_size, model, dataset).
    metric: the column read (a name ending in ``loss`` is lower-is-better, anything else higher-is-better, read as
    an accuracy in [0, 1]: :func:`check_target`). Rows whose metric is empty (not evaluated) are skipped. Raises
    ConfigError for a path that does not exist, holds no run, an empty CSV (no header, or a header without rows),
    no value of the metric, a missing column, or an unknown algorithm or collective or a bad number."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--evidence {str(p)!r} does not exist: valid a sparsim run directory, a folder of them "
                          "(e.g. sparsim experiment tta --out DIR) or a CSV")
    if p.is_dir():
        dirs = _run_dirs(p)
        if not dirs:
            raise ConfigError(f"--evidence {str(p)!r} holds no sparsim run (no summary.json beside a metrics.csv): "
                              "valid a run directory or a folder of them")
        runs = [r for run in dirs for r in _read_run(run, metric)]
        if not runs:
            raise ConfigError(f"--evidence {str(p)!r}: the metrics.csv of its {len(dirs)} run(s) hold no rows: valid "
                              "runs that evaluated --metric (a [model] run, e.g. sparsim experiment tta)")
    else:
        runs = _read_csv(p, metric)
        if not runs:
            raise ConfigError(f"--evidence {str(p)!r}: no row has a value of {metric!r} (the column is empty in every "
                              f"row): valid rows with a number in column {metric} where it was evaluated")
    seen = set()
    for r in runs:
        who = (r.algorithm, r.collective, r.k, r.density, r.policy, r.seed, r.P)
        if who in seen:
            raise ConfigError(f"--evidence {str(p)!r}: {r.label} seed {r.seed} appears twice (in {r.source}): valid "
                              "one run per configuration, seed and P")
        seen.add(who)
    return Evidence(runs, metric, metric.endswith("loss"), str(p))


def iterations_to_target(iterations, values, target: float, lower_is_better: bool = False) -> int | None:
    """The first evaluated iteration whose value is >= ``target`` (<= for a lower-is-better metric), None when
    none is. iterations: ints in increasing order; values: floats of the same length. The resolution is the
    evaluation interval (the true crossing lies between the previous evaluated iteration and this one)."""
    for it, v in zip(iterations, values):
        if (v <= target) if lower_is_better else (v >= target):
            return int(it)
    return None


def _spread(xs) -> dict:
    v = np.asarray(list(xs), dtype=np.float64)
    if v.size == 0:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan}
    # equal values have std 0 exactly (numpy's mean of three equal floats may differ from them in the last bit)
    std = (0.0 if v.min() == v.max() else float(v.std(ddof=1))) if v.size > 1 else math.nan
    return {"mean": float(v.mean()), "std": std,
            "min": float(v.min()), "max": float(v.max())}


def check_target(target: float, metric: str) -> float:
    """``target`` if it is in the valid range of ``metric``, else ConfigError (one line naming the value and the
    range): for a lower-is-better metric (a name ending in ``loss``, as :func:`load_evidence` decides) a finite
    target > 0; for any other (higher is better: an accuracy, a fraction) 0 < target <= 1."""
    if isinstance(target, bool) or not isinstance(target, (int, float)):
        raise ConfigError(f"--target {target!r} is not a number: valid a value of --metric {metric}")
    if metric.endswith("loss"):
        if not (math.isfinite(target) and target > 0):
            raise ConfigError(f"--target {target:g} is out of range for {metric} (lower is better, a loss): valid a "
                              "finite target > 0")
    elif not 0 < target <= 1:
        raise ConfigError(f"--target {target:g} is out of range for {metric} (higher is better, an accuracy): valid "
                          "0 < target <= 1")
    return float(target)


def planned_runs(evidence: Evidence, inp: PlanInputs) -> list[EvidenceRun]:
    """The runs of ``evidence`` that some configuration of ``inp`` takes (:func:`predict`'s matching: the same
    :func:`_key`, a policy that takes evidence, recorded at a P of the plan or at an unstated P)."""
    d = inp.workload.d
    keys = {_key(c.algorithm, c.collective, _k(c.density, d) if c.density is not None else None, c.policy)
            for c in inp.configs if c.policy not in NO_EVIDENCE_POLICIES}
    return [r for r in evidence.runs if r.key(d) in keys and (r.P is None or r.P in inp.Ps)]


def check_reached(evidence: Evidence, target: float, runs=None) -> None:
    """ConfigError (one line: the target, the number of runs, the best value reached and the valid range) when no
    run of ``runs`` (default every run of ``evidence``) reaches ``target`` at an evaluated iteration."""
    runs = evidence.runs if runs is None else runs
    lib = evidence.lower_is_better
    for r in runs:  # met by the untrained model: 0 iterations to target says nothing of the configuration
        if iterations_to_target(r.iterations, r.values, target, lib) == 0:
            v0 = r.values[list(r.iterations).index(0)]
            rel = "<" if lib else ">"
            raise ConfigError(f"--target {target:g} is met before training ({evidence.metric} {v0:.6g} at iteration 0 "
                              f"in {r.source}): valid a target {rel} {v0:.6g}, the untrained model's value")
    if any(iterations_to_target(r.iterations, r.values, target, lib) is not None for r in runs):
        return
    vals = [v for r in runs for v in r.values]
    if not vals:
        raise ConfigError(f"--target {target:g}: no run of the evidence is of a configuration of the plan: valid "
                          "--algorithms / --densities / --policies / --P naming the evidence's configurations")
    best = (min if lib else max)(vals)
    rel = ">=" if lib else "<="
    raise ConfigError(f"--target {target:g} is never reached in the evidence ({len(runs)} runs of the plan's "
                      f"configurations, best {evidence.metric} {best:.6g}): valid a target {rel} {best:.6g}")


def predict(rows: list[dict], evidence: Evidence, target: float, d: int) -> list[dict]:
    """Add the predicted time to ``target`` to each row (in place; returns ``rows``): the :data:`EVIDENCE_COLUMNS`.

    A row takes the evidence runs of its configuration (:func:`_key`: algorithm, collective, k = round(density x
    d), policy; the collective and policy of an exact-sum exchange such as dense S-SGD do not matter) recorded at
    its P (or at an unstated P). Per seed: n_s = :func:`iterations_to_target`, predicted seconds n_s x iter_s.
    evidence = ``reached`` (every seed reached the target: mean, sample std (ddof = 1, empty for one seed), min and
    max of iterations and seconds over the seeds), ``not reached`` (some seed did not: n_reached of seeds, min and
    max over those that did, no mean), or ``none`` (no run of this configuration at this P).

    Raises ConfigError when no run of the evidence reaches the target (naming the best value reached and the
    valid range of the target)."""
    lib = evidence.lower_is_better
    check_reached(evidence, target)
    hits = [iterations_to_target(r.iterations, r.values, target, lib) for r in evidence.runs]
    by_key: dict[tuple, list[tuple[EvidenceRun, int | None]]] = {}
    for r, h in zip(evidence.runs, hits):
        by_key.setdefault(r.key(d), []).append((r, h))
    for row in rows:
        cfg = row["config"]
        key = _key(cfg.algorithm, cfg.collective, _k(cfg.density, d) if cfg.density is not None else None, cfg.policy)
        runs = [(r, h) for r, h in by_key.get(key, []) if (r.P is None or r.P == row["P"])
                and cfg.policy not in NO_EVIDENCE_POLICIES]
        row.update(metric=evidence.metric, target=target)
        if not runs:
            row.update(evidence="none", seeds=0, n_reached=0)
            continue
        reached = [h for _, h in runs if h is not None]
        its = _spread(reached)
        secs = _spread([h * row["iter_s"] for h in reached])
        all_in = len(reached) == len(runs)
        row.update(evidence="reached" if all_in else "not reached", seeds=len(runs), n_reached=len(reached),
                   evidence_source=";".join(sorted({r.source for r, _ in runs})))
        for name, s in (("tta_iterations", its), ("tta_s", secs)):
            row.update({f"{name}_min": s["min"], f"{name}_max": s["max"]})
            row.update({f"{name}_mean": s["mean"] if all_in else math.nan,
                        f"{name}_std": s["std"] if all_in else math.nan})
    return rows


# ------------------------------------------------------------------ report


def _ms(x: float) -> str:
    return f"{1e3 * x:.4g}"


def _dens(x) -> str:
    return "-" if x is None else f"{x:g}"


def _tta_cell(r: dict) -> tuple[str, str]:
    ev = r.get("evidence")
    if ev == "none":
        return "no evidence", "-"
    n, N = r["n_reached"], r["seeds"]
    if ev == "not reached":
        return f"not reached ({n}/{N})", "-"
    sd = "" if math.isnan(r["tta_iterations_std"]) else f" ± {r['tta_iterations_std']:.3g}"
    ssd = "" if math.isnan(r["tta_s_std"]) else f" ± {r['tta_s_std']:.3g}"
    return f"{r['tta_iterations_mean']:.4g}{sd} ({N} seed{'' if N == 1 else 's'})", f"{r['tta_s_mean']:.4g}{ssd}"


def _cost_text(costs: dict) -> str:
    return "; ".join(f"{kind} {c['model']} ({c['from']})" for kind, c in costs.items())


def header_lines(inp: PlanInputs) -> list[str]:
    """The lines above the tables: model, cluster, device, batch, engine, the compute costs and the rules."""
    wl, sc = inp.workload, inp.sc
    dev = "measured seconds (no device)" if inp.device is None else \
        f"device {inp.device.name} ({inp.device_from or 'workload.device'}; efficiency {inp.device.efficiency:g})"
    data = f" trained on {inp.dataset}" if inp.dataset else ""
    n = len(inp.configs)
    return [f"plan: {wl.name}{data} ({wl.d:,} parameters, {len(wl.tensors)} tensors, {len(wl.layers)} layers) on "
            f"{inp.network}, {dev}, {sc.training.batch_size} samples per rank, engine {sc.cluster.engine}; "
            f"{n} configurations x P = {', '.join(map(str, inp.Ps))}",
            f"compute costs: {_cost_text(inp.costs)}",
            "times per iteration in ms; split = compute + exposed selection + exposed comm; break-even = t_dense / t "
            "= the speed-up over dense DDP (its fastest collective) = the most iterations (x dense's) the scheme may "
            "need and still finish first"]


def table_lines(rows: list[dict], inp: PlanInputs, top: int | None = 10) -> list[str]:
    """The ranked tables, one per P (rows from :func:`rank_rows`), each headed by the dense baseline's time; the
    first ``top`` rows of each (None: all). With evidence, the iterations and the predicted seconds to the target
    come first."""
    evid = any("evidence" in r for r in rows)
    lines = []
    for P in dict.fromkeys(r["P"] for r in rows):
        block = [r for r in rows if r["P"] == P]
        td = block[0]["dense_iter_s"]
        shown = block if top is None else block[:top]
        lines.append("")
        more = "" if len(shown) == len(block) else f", best {len(shown)} shown (all in plan.csv)"
        lines.append(f"P = {P}: dense DDP (the fastest dense collective, {block[0]['dense_baseline']}, on DDP's buckets, "
                     f"overlapped) {_ms(td)} ms per "
                     f"iteration; {len(block)} configurations{more}"
                     + (f"; ranked by predicted time to {rows[0]['metric']} {rows[0]['target']:g}" if evid else ""))
        head = f"{'rank':>4}  {'algorithm':<10} {'collective':<24} {'density':>8} {'policy':<7}"
        if evid:
            head += f" {'iterations to target':>24} {'time to target s':>18}"
        head += f" {'ms/iter':>9} {'compute':>8} {'select':>8} {'exp.comm':>8} {'break-even':>10}  why"
        lines.append(head)
        for r in shown:
            line = (f"{r['rank']:>4}  {r['algorithm']:<10} {r['collective']:<24} {_dens(r['density']):>8} "
                    f"{r['policy']:<7}")
            if evid:
                a, b = _tta_cell(r)
                line += f" {a:>24} {b:>18}"
            line += (f" {_ms(r['iter_s']):>9} {_ms(r['compute_s']):>8} {_ms(r['exposed_select_s']):>8} "
                     f"{_ms(r['exposed_comm_s']):>8} {r['break_even_iteration_ratio']:>9.3g}x  {r['why']}")
            lines.append(line)
    return lines


def pareto_front(points) -> list[int]:
    """Indices of the Pareto-optimal points of (density, seconds) pairs: no other point has a density at least as
    high and a time at most as long with one of the two strictly better (a higher density converges in fewer
    iterations, so both a higher density and a shorter iteration are wanted). In increasing density."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return sorted(front, key=lambda i: points[i][0])


def pareto_figure(rows: list[dict], outdir: Path, title: str) -> None:
    """pareto.png / pareto.pdf: per P (one panel each, three to a row), ms per iteration against density (log-log)
    of every configuration with k (colour: algorithm, marker: policy), the Pareto front of density against time
    (black steps), the dense baseline (dashed) and the algorithms without k (dotted); one legend on the right."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullFormatter

    from .plots import plt

    Ps = list(dict.fromkeys(r["P"] for r in rows))
    present = set(r["algorithm"] for r in rows)
    # colours in the registry's order, so that an algorithm has the same colour in every plan's figure
    algs = [a for a in REGISTRY if a in present] + sorted(present.difference(REGISTRY))
    pols = list(PLAN_POLICIES)
    markers = "os^Dvx*P"
    n = len(Ps)
    cols = min(n, 3)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols + 2.4, 3.9 * nrows + 0.5), squeeze=False)
    for j, P in enumerate(Ps):
        ax = axes[j // cols][j % cols]
        block = [r for r in rows if r["P"] == P]
        sparse = [r for r in block if r["density"] is not None]
        for r in sparse:
            ax.scatter(r["density"], 1e3 * r["iter_s"], s=16, color=f"C{algs.index(r['algorithm']) % 10}",
                       marker=markers[pols.index(r["policy"]) % len(markers)] if r["policy"] in pols else "o",
                       alpha=0.75, lw=0)
        if sparse:
            pts = [(r["density"], r["iter_s"]) for r in sparse]
            fr = pareto_front(pts)
            ax.step([pts[i][0] for i in fr], [1e3 * pts[i][1] for i in fr], where="post", color="k", lw=1.0)
        ax.axhline(1e3 * block[0]["dense_iter_s"], color="k", ls="--", lw=0.9)
        for r in block:
            if r["density"] is None and (r["algorithm"], r["collective"]) != (BASELINE, r["dense_baseline"]):
                ax.axhline(1e3 * r["iter_s"], color=f"C{algs.index(r['algorithm']) % 10}", ls=":", lw=0.9)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())  # minor labels of a short decade overlap
        ax.set(xlabel="density k/d", ylabel="ms per iteration", title=f"P = {P}")
        ax.grid(alpha=0.3, which="both")
    for j in range(n, nrows * cols):
        axes[j // cols][j % cols].set_visible(False)
    handles = [Line2D([], [], color=f"C{i % 10}", marker="o", ls="", ms=5) for i in range(len(algs))]
    handles += [Line2D([], [], color="0.4", marker=markers[i % len(markers)], ls="", ms=5) for i in range(len(pols))]
    handles += [Line2D([], [], color="k", lw=1.0), Line2D([], [], color="k", ls="--", lw=0.9),
                Line2D([], [], color="0.4", ls=":", lw=0.9)]
    labels = algs + [f"policy {p}" for p in pols] + ["Pareto front", "dense DDP (baseline)",
                                                      "without k (own colour)"]
    fig.suptitle(title, fontsize=10)
    fig.legend(handles, labels, loc="center right", fontsize=8.5, frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 2.2 / fig.get_size_inches()[0], 0.95))
    save_figure(fig, outdir, "pareto")


def _csv_rows(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "config"} for r in rows]


def run_plan(inp: PlanInputs, out, *, force: bool = False, target: float | None = None, top: int | None = 10,
             progress: bool = False, figure: bool = True, on_row=None,
             announce=None, jobs: int | None = 1) -> tuple[Path | None, list[dict], list[str]]:
    """Simulate, rank and report a plan; write ``out`` (None: nothing written). Returns (path or None, ranked rows,
    the printed lines).

    target: the metric's target with evidence (required with ``inp.evidence``, refused without; its range by
    :func:`check_target`; ConfigError when no run of the plan's configurations reaches it, :func:`check_reached`).
    top: rows printed per P (None: all). announce: optional callable(str), given one line (the number of
    configurations x P) after every check and before the simulation (the CLI prints it to stderr, also under
    --quiet: a large plan runs for minutes). jobs: worker processes for the collectives (:func:`simulate_plan`; the
    same rows whatever jobs; None: the default, :func:`prefetch_jobs`). Raises ConfigError
    for an empty or existing non-empty ``out`` (unless ``force``), jobs out of range, and what :func:`simulate_plan`
    raises; nothing is left half-written."""
    import shutil

    if jobs is not None:
        check_plan_jobs(jobs)
    if inp.evidence is not None and target is None:
        raise ConfigError("--evidence needs --target: valid a value of the metric to reach (e.g. --target 0.8)")
    if target is not None and inp.evidence is None:
        raise ConfigError(f"--target {target:g} needs --evidence: valid with the convergence evidence to read")
    if inp.evidence is not None:  # a target out of range or never reached fails before the simulation
        check_target(target, inp.evidence.metric)
        check_reached(inp.evidence, target, planned_runs(inp.evidence, inp))
    if out is not None:
        if not str(out).strip():
            raise ConfigError(f"--out {str(out)!r} is empty: valid a directory path (default runs/plan)")
        out = Path(out)
        check_out(out, force)
    if announce is not None:
        n = len(inp.configs)
        announce(f"plan: simulating {n} configuration{'s' if n != 1 else ''} x {len(inp.Ps)} P "
                 f"({', '.join(map(str, inp.Ps))}) = {n * len(inp.Ps)} timelines, plus the dense baseline per P")
    t0 = time.perf_counter()
    rows = simulate_plan(inp, progress=progress, on_row=on_row, jobs=jobs)
    if inp.evidence is not None:
        predict(rows, inp.evidence, target, inp.workload.d)
    rows = rank_rows(rows)
    lines = header_lines(inp) + table_lines(rows, inp, top)
    if out is None:
        return None, rows, lines
    tmp = partial_dir(out)
    try:
        cols = COLUMNS + (EVIDENCE_COLUMNS if inp.evidence is not None else ())
        write_csv(tmp / "plan.csv", cols, _csv_rows(rows))
        (tmp / "plan.md").write_text("```\n" + "\n".join(header_lines(inp) + table_lines(rows, inp, None)) + "\n```\n")
        summary = {
            "model": inp.model, "dataset": inp.dataset, "parameters": inp.workload.d, "network": inp.network,
            "P": list(inp.Ps), "densities": list(inp.densities), "policies": list(inp.policies),
            "configurations": len(inp.configs), "batch_size": inp.sc.training.batch_size,
            "device": None if inp.device is None else dataclasses.asdict(inp.device), "compute_costs": inp.costs,
            "engine": inp.sc.cluster.engine, "iterations": inp.iterations,
            "dense_iter_s": {str(P): next(r["dense_iter_s"] for r in rows if r["P"] == P) for P in inp.Ps},
            "dense_baseline": {str(P): next(r["dense_baseline"] for r in rows if r["P"] == P) for P in inp.Ps},
            "evidence": None if inp.evidence is None else {
                "path": inp.evidence.path, "metric": inp.evidence.metric, "target": target,
                "runs": len(inp.evidence.runs)},
            "wall_time_s": time.perf_counter() - t0,
        }
        (tmp / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        if figure:
            title = f"{inp.model} on {inp.network}, {inp.sc.training.batch_size} samples per rank: time per iteration"
            pareto_figure(rows, tmp, title)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, rows, lines


# ------------------------------------------------------------------ anchors: the papers' settings (docs/advisor.md)

#: Agarwal et al. (MLSys 2022) swept the network bandwidth for ResNet-50 and BERT between 1 and 100 Gb/s and found
#: that gradient compression shortened the iteration mainly below about 8 to 10 Gb/s. Their performance model is a
#: flat ring in which every worker has the swept bandwidth. The advisor's reading of that setting (these are this
#: project's choices, docs/advisor.md): P = 64 V100s on a flat star network (custom: 50 us end to end, the swept
#: bandwidth per worker), 32 samples per GPU, densities 0.001, 0.01 and 0.1, every registered algorithm and
#: collective, every policy; the dense baseline overlaps DDP's buckets with backward, as their model does.
AGARWAL_BANDWIDTHS_GBPS = (1, 2, 5, 10, 25, 50, 100)
AGARWAL_MODELS = ("resnet50", "bert-base")
AGARWAL_DENSITIES = (0.001, 0.01, 0.1)
#: The modelling choices the anchors vary (label, scenario overrides): the device's cost model at its default
#: efficiency; selection priced by the gTop-k authors' 2019 fit on a P102-100 (2.19e-10 s x x log2 x); a quarter of
#: the compute throughput (efficiency 0.1: FP32-like, more backward to hide communication behind); and that with 5 us
#: per message instead of 50 (Agarwal's variants; Espresso's take the first two).
ANCHOR_VARIANTS = (("device costs", ()), ("2019 selection fit", ("compute.select_coeff_s=2.19e-10",)),
                   ("efficiency 0.1", ("workload.efficiency=0.1",)),
                   ("efficiency 0.1, 5 us", ("workload.efficiency=0.1", "cluster.alpha_s=5e-6")))
#: Below this bandwidth (Gb/s) the paper found compression helped, above the next it rarely did.
AGARWAL_HELPS_BELOW_GBPS, AGARWAL_RARELY_ABOVE_GBPS = 8.0, 10.0
#: Espresso (EuroSys 2023) compresses a tensor only above a size: 2^20 elements on PCIe machines, 2^19 on NVLink
#: ones, by its own alpha-beta timeline model. Its model's constants: inside a node 0.02 us per KB on NVLink and 0.4
#: on PCIe, between nodes 0.8 us per KB (about 10 Gb/s); here 8 nodes x 8 V100s with those bandwidths, per-message
#: latencies of 5 us (NVLink) / 10 us (PCIe) inside a node and 50 us between nodes, one NIC per node, density 0.01.
ESPRESSO_THRESHOLDS = {"nvswitch": 2 ** 19, "pcie": 2 ** 20}
ESPRESSO_BANDWIDTH_BPS = {"nvswitch": 1024 / 0.02e-6, "pcie": 1024 / 0.4e-6, "inter": 1024 / 0.8e-6}
ESPRESSO_ALPHA_S = {"nvswitch": 5e-6, "pcie": 10e-6, "inter": 50e-6}
ESPRESSO_SIZES = tuple(2 ** e for e in range(10, 27))
ESPRESSO_DENSITY = 0.01
#: Espresso's variants: the device's costs, the 2019 selection fit, per-message latencies of 0.1 us (close to
#: Espresso's model, which charges a latency per collective, 2 alpha, not per message as here), and only Top-k with
#: its allgathers (flat or two-level) against dense: Espresso's sparsifiers are allgathered, none merges a global top-k.
ESPRESSO_VARIANTS = ANCHOR_VARIANTS[:2] + (("latency 0.1 us per message", ("cluster.intra_alpha_s=1e-7",
                                                                             "cluster.alpha_s=1e-7")),
                                           ("Top-k allgathered only", ("algorithms=['dense', 'topk']",)))  # algorithms: Espresso's sparsifiers are allgathered (no global top-k merge)
ANCHOR_COLUMNS = ("anchor", "model", "setting", "value", "variant", "selection_cost", "dense_s", "best", "best_s",
                  "speedup", "advisor", "paper", "agree", "fixed_cost_s")


def _compressed(cfg: Config) -> bool:
    """Whether a configuration compresses (everything but an exact-sum exchange: dense S-SGD on any collective)."""
    algo = REGISTRY[cfg.algorithm]
    return algo.sparse or algo.segmented


def agarwal_rows(models=AGARWAL_MODELS, bandwidths=AGARWAL_BANDWIDTHS_GBPS, variants=ANCHOR_VARIANTS, progress=False,
                 jobs: int = 1):
    """The advisor on Agarwal et al.'s bandwidth sweep (:data:`AGARWAL_BANDWIDTHS_GBPS`, the setting above): per
    model, modelling variant (:data:`ANCHOR_VARIANTS`) and bandwidth (Gb/s), the dense DDP iteration, the fastest
    compressing configuration and its speed-up, the advisor's verdict ("helps" when the speed-up is > 1) and the
    paper's (helps below 8 Gb/s, rarely above 10; "borderline" between). jobs: :func:`simulate_plan`'s (the same rows
    whatever jobs). Returns rows of :data:`ANCHOR_COLUMNS`."""
    out = []
    for model in models:
        for label, extra in variants:
            for gbps in bandwidths:
                ov = ["cluster.network='custom'", "cluster.alpha_s=50e-6",
                      f"cluster.bandwidth_Bps={gbps * 1e9 / 8!r}", *extra]
                inp = resolve_plan(None, ov, model=model, device="V100", batch_size=32, P="64",
                                   densities=AGARWAL_DENSITIES)
                rows = simulate_plan(inp, progress=progress, jobs=jobs)
                best = min((r for r in rows if _compressed(r["config"])), key=lambda r: r["iter_s"])
                helps = best["iter_s"] < best["dense_iter_s"]
                paper = "helps" if gbps < AGARWAL_HELPS_BELOW_GBPS else (
                    "rarely helps" if gbps > AGARWAL_RARELY_ABOVE_GBPS else "borderline")
                agree = "-" if paper == "borderline" else ("yes" if helps == (paper == "helps") else "no")
                out.append({"anchor": "Agarwal et al. MLSys 2022", "model": model,
                            "setting": "64 V100, flat, 50 us, b = 32", "value": f"{gbps:g} Gb/s", "variant": label,
                            "selection_cost": _select_text(inp.costs), "dense_s": best["dense_iter_s"],
                            "best": best["config"].label, "best_s": best["iter_s"], "speedup": best["speedup_over_dense"],
                            "advisor": "helps" if helps else "does not help", "paper": paper, "agree": agree})
    return out


def _select_text(costs: dict) -> str:
    c = costs["select"]
    return f"{c['model']} ({c['from']})"


def espresso_rows(sizes=ESPRESSO_SIZES, variants=ESPRESSO_VARIANTS):
    """The advisor on Espresso's size thresholds: per intra-node fabric (NVLink as nvswitch, PCIe), modelling variant
    (:data:`ESPRESSO_VARIANTS`: the V100's cost model, the 2019 selection fit, 0.1 us latencies) and tensor size n (elements, :data:`ESPRESSO_SIZES`),
    one exchange of an n-element tensor on 8 x 8 V100s with Espresso's bandwidths (:data:`ESPRESSO_BANDWIDTH_BPS`):
    the fastest dense allreduce against the fastest sparsifier (an algorithm with k) at density 0.01 (selection,
    collective and merge on the timing-only engine, :func:`sim.engine.timing.simulate_timing`). One row per fabric and cost: the
    advisor's threshold (the smallest swept n from which compression is faster at every larger swept n; none if
    never), the paper's (2^20 PCIe, 2^19 NVLink) and their ratio. Returns rows of :data:`ANCHOR_COLUMNS` (value: the
    threshold; dense_s / best_s / speedup at the paper's threshold size; fixed_cost_s = dense_s - best_s there: a
    fixed cost per compressed tensor (a kernel launch, an encode / decode call; none is modelled here) at least this
    large would make the paper's size the break-even, if the saving grows with the size)."""
    from sim.engine.timing import simulate_timing

    out = []
    for fabric, paper_n in ESPRESSO_THRESHOLDS.items():
        for label, extra in variants:
            ov = ["cluster.network='hierarchical'", "cluster.gpus_per_node=8", "cluster.nics_per_node=1",
                  f"cluster.intra='{fabric}'", f"cluster.intra_alpha_s={ESPRESSO_ALPHA_S[fabric]!r}",
                  f"cluster.intra_bandwidth_Bps={ESPRESSO_BANDWIDTH_BPS[fabric]!r}",
                  f"cluster.alpha_s={ESPRESSO_ALPHA_S['inter']!r}",
                  f"cluster.bandwidth_Bps={ESPRESSO_BANDWIDTH_BPS['inter']!r}", *extra]
            inp = resolve_plan(None, ov, model="resnet50", device="V100", P="64", densities=(ESPRESSO_DENSITY,),
                               policies="model")
            net = inp.network_of(64)
            cm = dataclasses.replace(inp.compute, forward_backward_s=0.0)
            verdict = {}
            for n in sizes:
                best = {}
                for cfg in inp.configs:
                    spec = inp.spec(cfg, net.gpus_per_node)
                    if spec.algorithm.sparse:
                        spec = dataclasses.replace(spec, k=_k(ESPRESSO_DENSITY, n))
                    if _compressed(cfg) and not spec.algorithm.sparse:
                        continue  # a sparsifier against dense, as Espresso's thresholds are (not PowerSGD's rank)
                    t = float(simulate_timing(spec, 64, n, network=net, compute=cm, engine="auto").iter_s[0])
                    side = "compressed" if _compressed(cfg) else "dense"
                    if side not in best or t < best[side][0]:
                        best[side] = (t, cfg)
                verdict[n] = best
            helps = [verdict[n]["compressed"][0] < verdict[n]["dense"][0] for n in sizes]
            thr = next((n for i, n in enumerate(sizes) if all(helps[i:])), None)
            low = "" if thr != sizes[0] else " (the smallest swept)"
            at = verdict.get(paper_n) or verdict[sizes[-1]]
            ratio = "-" if thr is None else f"2^{int(math.log2(thr)) - int(math.log2(paper_n))}"
            saving = at["dense"][0] - at["compressed"][0]
            out.append({"anchor": "Espresso EuroSys 2023", "model": f"one tensor, density {ESPRESSO_DENSITY:g}",
                        "setting": f"8 x 8 V100, {'NVLink' if fabric == 'nvswitch' else 'PCIe'} in the node, ~10 Gb/s "
                                   "between nodes",
                        "value": "never" if thr is None else f"2^{int(math.log2(thr))}", "variant": label,
                        "selection_cost": _select_text(inp.costs),
                        "dense_s": at["dense"][0], "best": at["compressed"][1].label, "best_s": at["compressed"][0],
                        "speedup": at["dense"][0] / at["compressed"][0],
                        "advisor": "never (at no swept size)" if thr is None else
                                   f"compress above 2^{int(math.log2(thr))}{low}",
                        "paper": f"compress above 2^{int(math.log2(paper_n))}", "agree": ratio,
                        "fixed_cost_s": saving})
    return out


def anchor_lines(rows: list[dict]) -> list[str]:
    """anchors.md: per anchor a Markdown table -- Agarwal et al.: the speed-up of the fastest compressing
    configuration over dense DDP per model, modelling variant and bandwidth (a cell <= 1x: compression does not
    help there), under the paper's verdict per bandwidth, then per model and variant the largest swept bandwidth at
    which compression helps; Espresso: the advisor's size threshold beside the paper's, per fabric and variant."""
    ag = [r for r in rows if r["anchor"].startswith("Agarwal")]
    bws = list(dict.fromkeys(r["value"] for r in ag))
    lines = ["## Agarwal et al. (MLSys 2022): does compression help, by bandwidth", "",
             "Speed-up per iteration of the fastest compressing configuration over dense DDP (every algorithm and "
             "collective, densities 0.001, 0.01, 0.1, every policy; the configuration is in anchors.csv); "
             "compression helps where it is above 1x.", "",
             "| model | variant | " + " | ".join(bws) + " |", "|---|---|" + "---|" * len(bws)]
    paper = {r["value"]: r["paper"] for r in ag}
    lines.append("| the paper | | " + " | ".join(paper[b] for b in bws) + " |")
    for key in dict.fromkeys((r["model"], r["variant"]) for r in ag):
        sub = {r["value"]: r for r in ag if (r["model"], r["variant"]) == key}
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(
            f"{sub[b]['speedup']:.3g}x" if b in sub else "" for b in bws) + " |")
    lines += [""]
    for key in dict.fromkeys((r["model"], r["variant"]) for r in ag):
        sub = [r for r in ag if (r["model"], r["variant"]) == key]
        yes = [r for r in sub if r["advisor"] == "helps"]
        top = f"up to {yes[-1]['value']} ({yes[-1]['speedup']:.3g}x there, {yes[-1]['best']})" if yes else \
            "at no swept bandwidth"
        lines.append(f"- {key[0]}, {key[1]}: compression helps {top}; dense DDP {1e3 * sub[-1]['dense_s']:.4g} ms at "
                     f"{sub[-1]['value']} (paper: helps below about {AGARWAL_HELPS_BELOW_GBPS:g}-"
                     f"{AGARWAL_RARELY_ABOVE_GBPS:g} Gb/s).")
    es = [r for r in rows if r["anchor"].startswith("Espresso")]
    lines += ["", "## Espresso (EuroSys 2023): the tensor size above which compression pays", "",
              "| setting | variant | advisor | paper | advisor / paper | at the paper's size: dense ms | "
              "fastest sparsifier | its ms | saving ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in es:
        lines.append(f"| {r['setting']} | {r['variant']} | {r['advisor']} | {r['paper']} | {r['agree']} | "
                     f"{1e3 * r['dense_s']:.4g} | {r['best']} | {1e3 * r['best_s']:.4g} | {1e3 * r['fixed_cost_s']:.4g} |")
    return lines


def run_anchors(out, *, force: bool = False, progress: bool = False, jobs: int = 1) -> tuple[Path, list[str]]:
    """``sparsim plan --anchors``: :func:`agarwal_rows` and :func:`espresso_rows` into ``out`` (anchors.csv with
    :data:`ANCHOR_COLUMNS`, anchors.md from :func:`anchor_lines`), built in ``out.partial``. jobs: worker processes
    for Agarwal's plans' collectives (:func:`simulate_plan`; Espresso's single tensors run here). Returns (path, the
    lines of anchors.md). Raises ConfigError for an existing non-empty ``out`` unless ``force``, or jobs out of
    range."""
    import shutil

    check_plan_jobs(jobs)
    out = Path(out)
    check_out(out, force)
    rows = agarwal_rows(progress=progress, jobs=jobs) + espresso_rows()
    lines = anchor_lines(rows)
    tmp = partial_dir(out)
    try:
        write_csv(tmp / "anchors.csv", ANCHOR_COLUMNS, rows)
        (tmp / "anchors.md").write_text("# The advisor against the papers' anchors\n\n" + "\n".join(lines) + "\n")
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, lines
