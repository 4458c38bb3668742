"""The algorithm layer's core: the :class:`Algorithm` interface, the registry, :class:`AlgorithmSpec` and the one
per-worker step :func:`sgd_step` that every backend runs.

An S-SGD variant is one :class:`Algorithm` subclass in one file of this package (``dense.py``, ``topk.py``,
``gtopk.py``, ...), registered with :func:`register`. It holds everything about the algorithm:

- its **compressor and memory**: :meth:`Algorithm.accumulate` (error feedback by default:
  acc_p = eps_p + alpha_t G_p) and :meth:`Algorithm.exchange`, a sans-I/O program (:mod:`sim.base.ops`) that
  selects / compresses one segment of acc_p, runs the collective and returns the summed update g and the new
  residual eps_p; explicit per-worker state (momentum, low-rank factors, thresholds) lives in the dict
  ``state`` that :func:`sgd_step` receives and returns (:attr:`StepOutput.state`), in the spirit of optax's
  ``init`` / ``update`` pairs and GRACE's compressor / memory / communicator roles;
- its **timing-only form** (:meth:`Algorithm.fast_rounds`): the exchange on every rank at once as Work / Round
  data, usually one collective of :mod:`sim.comm.rounds` after the selection. The fast engine
  (:mod:`sim.engine.fastsim`) interprets it over all ranks; the message-level timing-only mode
  (:mod:`sim.engine.timing`) derives each rank's program from it (:func:`sim.engine.timing.rank_program`). No
  algorithm imports an engine;
- its **closed-form cost** (:meth:`Algorithm.closed_form_s`, alpha-beta, :mod:`sim.comm.costs`);
- its names: :attr:`Algorithm.name`, :attr:`Algorithm.collectives` (the first is the default), options
  (:attr:`Algorithm.options`, e.g. PowerSGD's rank) with defaults and ranges.

:data:`REGISTRY` maps each name to its algorithm object; :func:`get` looks one up with a one-line error.
``sgd_step``, the timing mode, the fast engine, the closed forms, the iteration timeline, the torch backend,
``sparsim predict`` and the CLI's lists read the registry and nothing else names an algorithm.

Per iteration t and worker p (docs/theory.md section 2; Shi et al. IJCAI 2019, Algorithm 1), with the
algorithm's exchange E: acc_p = eps_p + alpha_t G_p; (g, eps_p') = E(acc_1..acc_P); every worker applies
v_t = v_{t-1} - g / P. With ``momentum`` m > 0 (heavy ball on the synchronised update, as torch's SGD on the
averaged gradient: u_t = m u_{t-1} + g / P, v_t = v_{t-1} - u_t; with a constant step this is torch.optim.SGD's
momentum with the step folded into g) and ``weight_decay`` w > 0 (applied locally before error feedback:
G_p <- G_p + w v_{t-1}, the placement PaddlePaddle's DGC fix found right). Algorithms with their own local
momentum (DGC's momentum correction) set :attr:`Algorithm.local_momentum` and consume m themselves.

Mass accounting: every step sum_p acc_p = g + sum_p eps_p up to rounding, unless an algorithm drops mass by
design (gTop-k's ``reference`` mask rule), which metrics.csv's mass_error column measures.

Whole-model versus layer-wise selection. By default (``AlgorithmSpec.segments = None``) the exchange runs
once over the whole model vector, as the released gTop-k code does. With ``segments = (d_1, ..., d_B)`` the
vector is cut into B consecutive segments (layers or buckets) and the exchange runs on each with
k_b = min(d_b, max(1, round(k / d * d_b))) (:func:`segment_k`), one collective per segment, in segment
order (GRACE, Horovod compression, DDP hooks). A single segment reproduces whole-model selection bit for bit.
The hybrid per-bucket policy (``AlgorithmSpec.segment_densities``, docs/hybrid.md) gives each segment its own density,
or exchanges it densely with the dense allreduce (residual 0: nothing is left behind in a dense segment).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from sim.base.errors import DIVERGENCE_LIMIT, ConfigError, NonFiniteError, SparsimError, check_range
from sim.base.ops import Compute

__all__ = ["Algorithm", "Option", "Exchange", "StepContext", "REGISTRY", "register", "get", "names", "resolve",
           "check_options", "predict_columns", "predict_default_columns",
           "AlgorithmSpec", "StepOutput", "sgd_step", "segment_k", "density_k"]

#: name -> :class:`Algorithm` instance, in registration order (dense, topk, gtopk, randk, then the successors).
REGISTRY: dict[str, "Algorithm"] = {}


def register(cls):
    """Class decorator: instantiate ``cls`` (an :class:`Algorithm` subclass) and add it to :data:`REGISTRY`
    under ``cls.name``. Raises ValueError if the name is taken or ``cls.collectives`` is empty."""
    if not cls.trace_name:
        cls.trace_name = cls.name
    if cls.name in REGISTRY:
        raise ValueError(f"algorithm {cls.name!r} registered twice")
    if not cls.collectives:
        raise ValueError(f"algorithm {cls.name!r} has no collective")
    REGISTRY[cls.name] = cls()
    return cls


def names() -> tuple[str, ...]:
    """The registered algorithm names, in registration order."""
    return tuple(REGISTRY)


def get(name: str) -> "Algorithm":
    """The registered :class:`Algorithm` called ``name``. Raises ConfigError naming the valid names."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ConfigError(f"algorithm = {name!r} is unknown: valid algorithms are {', '.join(REGISTRY)}") from None


def resolve(entry: str) -> tuple[str, dict]:
    """A scenario's algorithm entry as (registered name, preset AlgorithmSpec fields): a registered name gives
    (name, {}), an alias (e.g. ``gtopk_reference``) its algorithm and preset. Raises ConfigError naming the
    valid entries."""
    if isinstance(entry, str):
        if entry in REGISTRY:
            return entry, {}
        for name, algo in REGISTRY.items():
            if entry in algo.aliases:
                return name, dict(algo.aliases[entry])
    valid = [n for name, algo in REGISTRY.items() for n in (name, *algo.aliases)]
    raise ConfigError(f"algorithm = {entry!r} is unknown: valid algorithms are {', '.join(valid)}")


def check_options(name: str, opts: dict) -> None:
    """Validate a scenario's [algorithm.NAME] table: NAME registered, every key ``collective`` (one of the
    algorithm's collectives) or one of its options, each value in range. Raises ConfigError naming the key, the
    value and the valid range."""
    algo = get(name)
    for key, value in opts.items():
        if key == "collective":
            if value not in algo.collectives:
                raise ConfigError(f"algorithm.{name}.collective = {value!r} is unknown: valid "
                                  f"{', '.join(algo.collectives)}")
        elif key not in algo.options:
            valid = ", ".join(["collective", *algo.options])
            raise ConfigError(f"algorithm.{name}.{key} is unknown: valid keys are {valid}")
        else:
            algo.options[key].check(name, key, value)


def predict_columns(hierarchical: bool) -> dict[str, tuple[str, str]]:
    """``sparsim predict``'s columns: label -> (algorithm, collective), every registered algorithm's
    :attr:`Algorithm.predict_columns` (or ``name`` at its default collective) in registration order, flat collectives
    first; with ``hierarchical`` (a cluster preset) also each algorithm's ``hierarchical`` collective. All columns,
    shown or not by default: :func:`predict_default_columns` gives the default subset."""
    flat, hier = {}, {}
    for name, algo in REGISTRY.items():
        cols = algo.predict_columns or {name: algo.collectives[0]}
        for label, coll in cols.items():
            (hier if coll == "hierarchical" else flat)[label] = (name, coll)
        if "hierarchical" in algo.collectives and "hierarchical" not in cols.values():
            hier[f"{name}:hierarchical"] = (name, "hierarchical")
        for coll in algo.collectives:
            if coll not in cols.values() and coll not in ("hierarchical", "backend_allreduce"):
                flat.setdefault(f"{name}:{coll}", (name, coll))
    return {**flat, **hier} if hierarchical else flat


def predict_default_columns(hierarchical: bool) -> list[str]:
    """The columns ``sparsim predict`` shows without --collectives: each :attr:`Algorithm.predict_default`
    algorithm's :attr:`Algorithm.predict_columns` (or its default collective), plus their hierarchical ones on a
    cluster preset."""
    out = []
    for name, algo in REGISTRY.items():
        if not algo.predict_default:
            continue
        cols = algo.predict_columns or {name: algo.collectives[0]}
        out += [label for label, coll in cols.items() if coll != "hierarchical"]
    if hierarchical:
        out += [label for label, (name, coll) in predict_columns(True).items()
                if coll == "hierarchical" and REGISTRY[name].predict_default]
    return out


def segment_k(k: int, d: int, d_b: int) -> int:
    """Coordinates selected in a segment (bucket, layer) of d_b elements when the whole model of d selects k:
    ``min(d_b, max(1, round(k / d * d_b)))`` in float64 with Python's round (halves to even), and k itself when
    d_b = d. The one rule of layer-wise selection, for the numerics (:meth:`AlgorithmSpec.segment_ks`) and the
    iteration timeline (:func:`sim.engine.timeline.bucket_k`). 1 <= result <= d_b for 1 <= d_b <= d."""
    return int(k) if d_b == d else int(min(d_b, max(1, round(k / d * d_b))))


@dataclass(frozen=True)
class Option:
    """An algorithm-specific option: its default, its valid range ``lo <= value <= hi`` (open ends with
    ``lo_open`` / ``hi_open``), ``kind`` (int, float or str), ``choices`` for a str, and a one-line help."""

    default: Any
    help: str
    kind: type = float
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple = ()

    def check(self, algorithm: str, name: str, value):
        """``value`` as ``kind`` if valid; ConfigError naming ``algorithm.name``, the value and the valid range."""
        label = f"{algorithm}.{name}"
        if self.kind is str:
            if set(self.choices) == {"on", "off"}:  # a switch: also TOML's true / false and 1 / 0, as every switch
                value = parse_switch(value, label)
                return "on" if value else "off"
            if value not in self.choices:
                raise ConfigError(f"{label} = {value!r} is unknown: valid {', '.join(map(str, self.choices))}")
            return value
        if self.kind is int and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
            raise ConfigError(f"{label} = {value!r} must be an integer: valid "
                              f"{_range(label, self)}")
        if self.kind is float and (isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))):
            raise ConfigError(f"{label} = {value!r} must be a number: valid {_range(label, self)}")
        check_range(label, value, self.lo, self.hi, lo_open=self.lo_open, hi_open=self.hi_open, err=ConfigError)
        return self.kind(value)


def parse_switch(value, label: str) -> bool:
    """An on/off option's value as a bool: True / False, 1 / 0, or the strings on / off / true / false (any case).
    Raises ConfigError naming ``label``, the value and the valid spellings."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("on", "off", "true", "false"):
        return value.strip().lower() in ("on", "true")
    raise ConfigError(f"{label} = {value!r} is not a switch: valid on, off, true, false, 1, 0")


def _range(label: str, o: Option) -> str:
    from sim.base.errors import range_text

    return range_text(label, o.lo, o.hi, o.lo_open, o.hi_open)


@dataclass
class StepContext:
    """What :meth:`Algorithm.exchange` knows besides the segment: rank, P, iteration t (>= 1), the segment's
    index b and bounds [lo, hi) in the model vector (d elements), the worker's mutable algorithm ``state``
    (a dict the algorithm owns; it persists across iterations) and ``scratch``, a dict that lives for this one
    step (shared by the step's segments, e.g. rand-k's generator)."""

    rank: int
    P: int
    iteration: int
    d: int
    segment: int = 0
    lo: int = 0
    hi: int = 0
    state: dict = field(default_factory=dict)
    scratch: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Exchange:
    """What an exchange of one segment (d_b elements) produced on this worker.

    g: float array (d_b,), the update summed over workers (identical on every rank). residual: float array
    (d_b,), eps_p for the segment after the step (a fresh array). n_selected: entries this worker contributed
    (d_b for dense); n_applied: how many of them reached g (or were represented in it).
    """

    g: np.ndarray
    residual: np.ndarray
    n_selected: int
    n_applied: int


class Algorithm:
    """One S-SGD variant (subclass it in its own file of :mod:`sim.algorithms` and :func:`register` it).

    Class attributes: ``name`` (the scenario / CLI name), ``collectives`` (valid collective names, the first the
    default), ``sparse`` (needs k, selects per step; False for dense-like algorithms), ``local_momentum`` (the
    algorithm consumes ``AlgorithmSpec.momentum`` itself), ``segmented`` (exchanges per segment when
    ``AlgorithmSpec.segments`` is set; False: one exchange over the whole vector whatever the segments, as dense
    S-SGD, whose sum is the same vector), ``options`` (name -> :class:`Option`), ``summary``
    (one line for the CLI's lists), ``trace_name`` (the communication slices' name in a Chrome trace; default
    ``name``) and ``source`` (paper, algorithm or equation).
    """

    name: ClassVar[str] = ""
    collectives: ClassVar[tuple[str, ...]] = ()
    sparse: ClassVar[bool] = True
    local_momentum: ClassVar[bool] = False
    segmented: ClassVar[bool] = True
    options: ClassVar[dict[str, Option]] = {}
    trace_name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    source: ClassVar[str] = ""

    #: other scenario names for this algorithm with preset AlgorithmSpec fields, e.g. gtopk_reference -> mask
    aliases: ClassVar[dict[str, dict]] = {}
    #: the algorithm reads ``AlgorithmSpec.mask`` (gTop-k's residual mask rule)
    uses_mask: ClassVar[bool] = False
    #: the algorithm draws random numbers from ``AlgorithmSpec.seed`` (the scenario's seed is passed)
    uses_seed: ClassVar[bool] = False
    #: ``sparsim predict``'s column labels for this algorithm: label -> collective. Empty: one column
    #: ``name`` at the default collective (a hierarchical collective's column is added on cluster presets).
    predict_columns: ClassVar[dict[str, str]] = {}
    #: shown by ``sparsim predict`` by default (rand-k costs what Top-k costs: False there)
    predict_default: ClassVar[bool] = True
    #: The DDP hook's asynchronous path (:mod:`sim.distributed.ddp_hooks`, ``wire="allgather"``): None where the algorithm
    #: has none (the hook then runs :func:`sgd_step` itself over point-to-point messages, ``wire="p2p"``), else
    #: how the allgathered selections of :meth:`hook_select` are combined: ``"sum"`` (added in rank order,
    #: eps = acc - own selection) or ``"gtopk"`` (the gTop-k merges replayed locally).
    hook_combine: ClassVar[str | None] = None
    #: collectives the asynchronous hook path accepts (the first is its default)
    hook_collectives: ClassVar[tuple[str, ...]] = ("allgather",)
    #: the asynchronous hook checks the whole accumulator for NaN/Inf (False: its selection always holds the
    #: largest magnitude, so checking the selected values suffices)
    hook_checks_all: ClassVar[bool] = True
    #: the compute kinds its exchange charges (:class:`sim.base.ops.Compute` in the numerics, :class:`sim.comm.rounds.Work`
    #: in :meth:`fast_rounds`), a subset of ``select``, ``merge``, ``reduce``, ``scan``, ``matmul`` (the last two from
    #: :meth:`compression_work`); every algorithm is also charged
    #: ``forward_backward`` and ``update`` by :func:`sgd_step`. A scenario's compute.*_coeff_s key of a kind that no
    #: algorithm of the run charges is an error (experiments.scenario). Default: all three (never a false refusal);
    #: tests/test_unused_keys.py checks each declaration against what the numerics charge.
    cost_kinds: ClassVar[tuple[str, ...]] = ("select", "merge", "reduce")

    def hook_select(self, acc, k: int, hook_state):
        """The asynchronous DDP hook's selection (only where :attr:`hook_combine` is set): ``acc`` a 1-D float
        torch tensor (n,) (the unit's accumulator; not modified), ``k`` its budget (1 <= k <= n), ``hook_state``
        the :class:`sim.distributed.ddp_hooks.SparseState`. Returns (idx, val): int64 indices ascending (at most k,
        distinct) and acc at them, on acc's device -- the same entries as :meth:`exchange`'s selection."""
        raise NotImplementedError(f"{self.name} has no asynchronous DDP hook path (use wire='p2p')")

    # ------------------------------------------------------------------ naming and checks
    def scenario_settings(self, compression) -> dict:
        """AlgorithmSpec fields this algorithm takes from a scenario's [compression] table (e.g. its collective),
        field -> ``compression.KEY`` passed through unchanged (:meth:`compression_keys` relies on it); none by
        default (a successor sets its collective in [algorithm.NAME])."""
        return {}

    def compression_keys(self) -> dict[str, str]:
        """AlgorithmSpec field -> the [compression] key :meth:`scenario_settings` takes it from, e.g.
        ``{"collective": "topk_collective"}`` (found by calling it on a table whose every key reads as its own
        name). The scenario refuses a [compression] key that no algorithm of the run reads."""

        class _KeyNames:
            def __getattr__(self, key: str) -> str:
                return key

        return {field: str(key) for field, key in self.scenario_settings(_KeyNames()).items()}

    def unused_options(self, options: dict, *, iterations: int, momentum: float) -> dict[str, str]:
        """The options of ``options`` (name -> value as :meth:`Option.check` returns it; those a scenario sets away
        from their defaults) that a run of ``iterations`` iterations with training momentum ``momentum`` would not
        use because another setting switches them off: name -> why, one phrase naming the setting that would use
        it (e.g. "unused with selection = 'exact': used only with selection = 'sampled'"). The scenario refuses
        each (one line, exit 2). None by default."""
        return {}

    def label_tags(self, spec: "AlgorithmSpec") -> list[str]:
        """Tags of the display label (``name[tag,...]``) besides ``layerwise``; none by default."""
        return []

    def drops_mass(self, spec: "AlgorithmSpec") -> bool:
        """Whether ``spec`` may lose mass by design (sum_p acc_p != g + sum_p eps_p; metrics.csv's mass_error
        measures it): False by default."""
        return False

    def check_spec(self, spec: "AlgorithmSpec") -> None:
        """Extra validation of ``spec`` beyond collective and options (ConfigError); nothing by default."""

    # ------------------------------------------------------------------ numerics (sans-I/O)
    def accumulate(self, spec: "AlgorithmSpec", grad: np.ndarray, lr: float, residual: np.ndarray,
                   ctx: StepContext) -> np.ndarray:
        """The accumulator the exchange compresses, float array (d,): error feedback eps_p + alpha_t G_p by
        default (Shi et al. IJCAI 2019, Algorithm 1 line 6; Stich et al. 2018). ``grad`` already holds the
        weight decay. Returns a fresh array (``grad`` may be overwritten)."""
        with np.errstate(over="ignore", invalid="ignore"):
            acc = np.multiply(grad, lr)  # residual + lr * grad with one array instead of two (addition commutes)
            if acc.dtype == np.result_type(acc, residual):
                acc += residual
            else:
                acc = residual + acc
        return acc

    def exchange(self, spec: "AlgorithmSpec", acc: np.ndarray, k: int | None, ctx: StepContext):
        """Sans-I/O program: compress the segment ``acc`` (float array (d_b,), a view of this worker's
        accumulator; do not modify it), run the collective, return an :class:`Exchange`. k: the segment's k
        (None for non-sparse algorithms). Must yield the same operation sequence on every rank."""
        raise NotImplementedError

    def after_step(self, spec: "AlgorithmSpec", acc: np.ndarray, residual: np.ndarray, ctx: StepContext) -> None:
        """Called once per step after every segment's exchange, with the whole accumulator and the new residual
        (float arrays (d,)); updates ``ctx.state`` (e.g. DGC's momentum masking). Nothing by default."""

    # ------------------------------------------------------------------ timing only (sim.engine.timing, sim.engine.fastsim)
    def fast_rounds(self, spec: "AlgorithmSpec", P: int, d: int, it: int, G: int):
        """One whole-model exchange of d elements (selection included) on every rank at once, in timing-only sizes,
        as data: an iterable of
        :class:`sim.comm.rounds.Work` and :class:`sim.comm.rounds.Round` (usually one of the vectorised collectives
        of :mod:`sim.comm.rounds`, after the selection's Work) that an engine interprets
        (:meth:`sim.engine.fastsim.FastCluster.run`). P: ranks; d: elements; it: iteration (1-based; e.g. CLT-k's
        leader); G: ranks per node (hierarchical collectives). Raises ConfigError if the algorithm has none."""
        raise ConfigError(f"algorithm {self.name} has no timing-only form (fast_rounds): valid a numerics run")

    # ------------------------------------------------------------------ closed forms (sim.comm.costs)
    def closed_form_s(self, spec: "AlgorithmSpec", P: int, d: int, alpha: float, beta: float, cluster=None) -> float:
        """The alpha-beta time (s) of one whole-model exchange on a contention-free network with zero compute
        (alpha s, beta s/byte); ``cluster`` (a ClusterSpec) for hierarchical collectives."""
        raise NotImplementedError

    # ------------------------------------------------------------------ compression cost
    def compression_work(self, spec: "AlgorithmSpec", d_b: int, k_b: int | None) -> tuple[tuple[str, float], ...]:
        """What compressing a segment of ``d_b`` elements to ``k_b`` entries (None for an algorithm without k)
        costs, as the compute operations it charges before (or, for PowerSGD, between) its collective's messages:
        a tuple of (kind, work), kind one of :data:`sim.base.ops.COMPRESSION_KINDS` (``select``: elements scanned by
        a top-k selection; ``scan``: bytes moved through device memory; ``matmul``: matrix-product FLOPs), in the
        order they are charged. One definition for every engine: the numerics' :meth:`exchange` and the
        timing-only :meth:`fast_rounds` yield these operations, and the iteration timeline charges their seconds
        before each bucket's collective (sim/engine/timeline.py, every policy), so the three agree.

        Default: a top-k selection over the segment, ``(("select", d_b),)`` (Top-k, gTop-k, and the successors
        that run one), and nothing for an algorithm without k (dense). Overridden by the algorithms that do not run
        a top-k over the whole segment: rand-k, Gaussian-k, DGC (sampled selection), PowerSGD (docs/costs-per-device.md,
        "Compression per algorithm"). Work depends only on (spec, d_b, k_b), never on the values: a data-dependent
        count (Gaussian-k's threshold evaluations, DGC's adaptation) is charged at its stated bound."""
        return (("select", d_b),) if self.sparse else ()

    # ------------------------------------------------------------------ timeline
    def payload_bytes(self, spec: "AlgorithmSpec", numel: int, k: int | None) -> int:
        """Bytes one rank contributes to an exchange of ``numel`` elements (trace annotation): k (value + index)
        bytes for a sparse algorithm by default."""
        return int(k) * (spec.value_bytes + spec.index_bytes)


#: Bytes a GPU moves to read or write one value at a random position: one 32-byte DRAM sector (the memory
#: transaction granularity of NVIDIA GPUs since Maxwell: CUDA C++ Best Practices Guide, "Coalesced Access to Global
#: Memory"; Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", 2018). The gathers of
#: :meth:`Algorithm.compression_work` (rand-k's k values, DGC's sample) are priced at it.
GATHER_SECTOR_BYTES = 32



@dataclass(frozen=True)
class AlgorithmSpec:
    """What one S-SGD variant does each step: the registered algorithm ``name`` and its settings.

    name: a key of :data:`REGISTRY` or one of its aliases (``sparsim algorithms`` lists both; an alias such as
    ``gtopk_reference`` becomes its algorithm, ``name = "gtopk"``, with its preset fields, ``mask = "reference"``,
    as in a scenario; a preset field set to another value is a ConfigError). k: selected coordinates per worker
    (1 <= k <= d; sparse algorithms only, ignored otherwise). collective: one of the algorithm's
    ``collectives`` (default its first). mask: gTop-k only, "exact" (gMask_p = entries that reached g) or
    "reference" (the released code's rule, which can lose mass). value_bytes, index_bytes: bytes per
    transmitted value / index (default 4 + 4: fp32 values, int32 indices).
    gpus_per_node: ranks per node G (integer >= 1) for the ``"hierarchical"`` collectives; it must divide P.
    seed: seeds an algorithm's own random draws (rand-k's coordinates: worker p at iteration t uses
    ``np.random.default_rng([seed, p, t, RANDK_STREAM])``), independent of the mini-batch draw.
    segments: None (whole-model exchange, the default) or the sizes (d_1, ..., d_B) of consecutive segments of
    the model vector (layers or buckets): a non-empty tuple of integers >= 1 summing to d (checked by
    :meth:`check_dim`); segmented algorithms then exchange per segment with k_b = :func:`segment_k` (k, d, d_b).
    momentum: m in [0, 1), heavy-ball momentum on the synchronised update (or the algorithm's own local
    momentum, DGC); weight_decay: w >= 0, added to the local gradient before error feedback (module docstring).
    options: the algorithm's own options as a tuple of (name, value) pairs (e.g. ``(("rank", 4),)`` for PowerSGD);
    unset ones take :attr:`Algorithm.options` defaults (:meth:`opt`).
    segment_densities: None, or (with ``segments``, one entry per segment) the hybrid per-bucket policy
    (docs/hybrid.md, :class:`sim.engine.hybrid.HybridPlan`): a float rho_b in (0, 1] compresses segment b with
    k_b = min(d_b, max(1, round(rho_b d_b))) (the whole model's k is then unused), None exchanges it densely with
    the dense algorithm's allreduce (``dense_collective``; residual 0, nothing selected). Sparse, segmented
    algorithms without a local momentum only. dense_collective: the dense segments' collective (one of dense's
    ring, recursive_doubling, hierarchical, backend_allreduce; None: ring); only with segment_densities.
    Raises ConfigError for an unknown name, collective, mask or option, an option or momentum / weight decay
    out of range, a negative seed, segments that are not a non-empty sequence of integers >= 1, or
    segment_densities / dense_collective that do not fit (above).
    """

    name: str
    k: int | None = None
    collective: str | None = None
    mask: str = "exact"
    value_bytes: int = 4
    index_bytes: int = 4
    seed: int = 0
    gpus_per_node: int = 1
    segments: tuple[int, ...] | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    options: tuple = ()
    segment_densities: tuple | None = None
    dense_collective: str | None = None

    def __post_init__(self):
        if isinstance(self.name, str) and self.name not in REGISTRY:  # an alias: its algorithm and preset fields
            self._apply_alias()
        algo = get(self.name)
        if self.collective is None:
            object.__setattr__(self, "collective", algo.collectives[0])
        if self.collective not in algo.collectives:
            raise ConfigError(
                f"collective = {self.collective!r} is not available for {self.name}: valid {', '.join(algo.collectives)}")
        if self.mask not in ("exact", "reference"):
            raise ConfigError(f"mask = {self.mask!r} is unknown: valid exact, reference")
        check_range("value_bytes", self.value_bytes, 1, 16)
        check_range("index_bytes", self.index_bytes, 0, 16)
        check_range("seed", self.seed, 0)
        check_range("gpus_per_node", self.gpus_per_node, 1)
        check_range("momentum", self.momentum, 0, 1, hi_open=True, err=ConfigError)
        check_range("weight_decay", self.weight_decay, 0, err=ConfigError)
        if algo.sparse and self.k is None:
            raise ConfigError(f"{self.name} needs k (1 <= k <= d)")
        if self.segments is not None:
            object.__setattr__(self, "segments", _check_segments(self.segments))
        opts = dict(self.options.items() if isinstance(self.options, dict) else self.options)
        for key in opts:
            if key not in algo.options:
                valid = ", ".join(algo.options) or "none"
                raise ConfigError(f"option {key!r} is unknown for {self.name}: valid {valid}")
        checked = tuple((key, algo.options[key].check(self.name, key, opts[key])) for key in algo.options if key in opts)
        object.__setattr__(self, "options", checked)
        if self.segment_densities is not None or self.dense_collective is not None:
            object.__setattr__(self, "segment_densities", _check_segment_densities(self))
        algo.check_spec(self)

    def _apply_alias(self) -> None:
        """``name`` an alias (e.g. ``gtopk_reference``): the registered name and the alias's preset fields, as a
        scenario's algorithm entry resolves (:func:`resolve`); a preset field given another value than its
        default and the preset's is a ConfigError. An unknown name is left to :func:`get`'s error."""
        try:
            name, preset = resolve(self.name)
        except ConfigError:
            return
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for field, value in preset.items():
            given = getattr(self, field)
            if given != value and given != defaults[field]:
                raise ConfigError(f"{field} = {given!r} contradicts algorithm {self.name!r}, which is {name} with "
                                  f"{field} = {value!r}: valid {field} = {value!r}, or name = {name!r}")
            object.__setattr__(self, field, value)
        object.__setattr__(self, "name", name)

    @property
    def algorithm(self) -> Algorithm:
        """The registered :class:`Algorithm` of ``name``."""
        return REGISTRY[self.name]

    def opt(self, key: str):
        """The value of the algorithm option ``key`` (set in ``options`` or its default). KeyError if unknown."""
        for name, value in self.options:
            if name == key:
                return value
        return self.algorithm.options[key].default

    @property
    def label(self) -> str:
        """Short display name, e.g. ``gtopk``, ``gtopk[reference]``, ``dense[backend_allreduce]`` or, with more than one
        segment, ``topk[layerwise]`` / ``gtopk[reference,layerwise]``."""
        algo = self.algorithm
        tags = list(algo.label_tags(self))
        if self.segment_densities is not None:
            tags.append("hybrid")
        elif self.segments is not None and algo.segmented and len(self.segments) > 1:
            tags.append("layerwise")
        return f"{self.name}[{','.join(tags)}]" if tags else self.name

    def check_dim(self, d: int) -> None:
        """Raise SparsimError unless 1 <= k <= d (sparse algorithms) and, when ``segments`` is set, the
        segment sizes sum to d (the message names the sizes, their sum and the valid value)."""
        if self.algorithm.sparse:
            if isinstance(self.k, bool) or not isinstance(self.k, (int, np.integer)):
                raise SparsimError(f"k = {self.k!r} must be an integer: valid 1 <= k <= d = {d}")
            check_range("k", int(self.k), 1, d)
        if self.segments is not None and sum(self.segments) != d:
            raise SparsimError(f"segments = {_segments_text(self.segments)} sum to {sum(self.segments)}: valid "
                               f"segment sizes (integers >= 1) that sum to d = {d}")

    def segment_bounds(self, d: int) -> np.ndarray:
        """Start offsets of the segments plus d: int64 array (B + 1,), segment b being ``[out[b], out[b + 1])``
        in vector coordinates. ``[0, d]`` (one segment) when ``segments`` is None. Raises SparsimError as
        :meth:`check_dim`."""
        self.check_dim(d)
        sizes = (d,) if self.segments is None else self.segments
        return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)

    def segment_ks(self, d: int) -> tuple[int, ...]:
        """Coordinates each worker selects per segment, (k_1, ..., k_B), for a model of d parameters.

        The rule (layer-wise selection at the whole model's density k / d, at least one per segment):
        ``k_b = min(d_b, max(1, round(k / d * d_b)))`` (:func:`segment_k`), the same expression as the iteration
        timeline's per-bucket k, so the timeline's times and these numerics select the same counts. One segment
        gives (k,). Non-sparse algorithms: (d_1, ..., d_B), everything is sent. With ``segment_densities`` (the
        hybrid policy): k_b = min(d_b, max(1, round(rho_b d_b))) for a compressed segment (:func:`density_k`), d_b for
        a dense one. Raises SparsimError as :meth:`check_dim`.
        """
        self.check_dim(d)
        sizes = (d,) if self.segments is None else self.segments
        if not self.algorithm.sparse:
            return tuple(int(n) for n in sizes)
        if self.segment_densities is not None:
            return tuple(int(n) if r is None else density_k(r, n) for r, n in zip(self.segment_densities, sizes))
        return tuple(segment_k(int(self.k), d, n) for n in sizes)

    def dense_spec(self) -> "AlgorithmSpec":
        """The dense S-SGD spec that exchanges this spec's dense segments (``segment_densities`` entries None): dense
        at ``dense_collective`` (None: ring) with this spec's value bytes and ranks per node."""
        return AlgorithmSpec("dense", collective=self.dense_collective or "ring", value_bytes=self.value_bytes,
                             gpus_per_node=self.gpus_per_node)

    def total_k(self, d: int) -> int:
        """Coordinates each worker selects per step: sum of :meth:`segment_ks` (k for whole-model
        selection, d for dense). Raises SparsimError as :meth:`check_dim`."""
        return sum(self.segment_ks(d))

    def require_whole_model(self, where: str) -> None:
        """Raise ConfigError if ``segments`` is set: ``where`` (e.g. "the fast engine") models whole-model
        selection only, and layer-wise timing is done by the iteration timeline (sim/engine/timeline.py)."""
        if self.segments is not None:
            raise ConfigError(
                f"segments = {_segments_text(self.segments)} ({self.name}): {where} models whole-model selection "
                "only; layer-wise timing is done by the iteration timeline (sim/engine/timeline.py): "
                "valid here segments = None")


def density_k(density: float, n: int) -> int:
    """Coordinates a unit of n elements selects at ``density``: ``min(n, max(1, round(density x n)))`` in float64 with
    Python's round (halves to even) -- the DDP hook's rule (:meth:`sim.distributed.ddp_hooks.SparseState.k_for`) and
    the hybrid plan's (:class:`sim.engine.hybrid.HybridPlan`). 1 <= result <= n for n >= 1."""
    return int(min(n, max(1, round(float(density) * n))))


def _check_segment_densities(spec: "AlgorithmSpec"):
    """``spec.segment_densities`` as a tuple of floats and None; ConfigError (one line) unless ``segments`` is set with
    as many entries, each None or in (0, 1], the algorithm is sparse, segmented and keeps no local momentum, and
    ``dense_collective`` is None or one of dense's collectives (and set only with segment_densities)."""
    algo, dens = spec.algorithm, spec.segment_densities
    if dens is None:
        raise ConfigError(f"dense_collective = {spec.dense_collective!r} without segment_densities: valid only with "
                          "the hybrid policy's segment_densities (dense segments)")
    if not algo.sparse or not algo.segmented or algo.local_momentum:
        raise ConfigError(f"segment_densities with {spec.name}: the hybrid policy compresses per segment with a sparse "
                          "algorithm that keeps no local momentum: valid "
                          + ", ".join(n for n, a in REGISTRY.items() if a.sparse and a.segmented and not a.local_momentum))
    try:
        seq = tuple(dens)
    except TypeError:
        seq = None
    if seq is None or isinstance(dens, (str, bytes)) or spec.segments is None or len(seq) != len(spec.segments):
        n = "no segments" if spec.segments is None else f"{len(spec.segments)} segments"
        raise ConfigError(f"segment_densities = {dens!r} does not fit {n}: valid one entry (a density in (0, 1] or "
                          "None for a dense segment) per segment")
    out = []
    for j, r in enumerate(seq):
        if r is None:
            out.append(None)
            continue
        if isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, float, np.integer, np.floating)):
            raise ConfigError(f"segment_densities[{j}] = {r!r} is not a density: valid 0 < density <= 1 or None (dense)")
        check_range(f"segment_densities[{j}]", float(r), 0, 1, lo_open=True, err=ConfigError)
        out.append(float(r))
    coll = spec.dense_collective
    if coll is not None and coll not in REGISTRY["dense"].collectives:
        raise ConfigError(f"dense_collective = {coll!r} is unknown: valid {', '.join(REGISTRY['dense'].collectives)}")
    return tuple(out)


def _segments_text(segments) -> str:
    """A short text of a segment-size tuple for error messages (long tuples abbreviated, with their length)."""
    seq = tuple(segments)
    if len(seq) <= 8:
        return repr(seq)
    return f"({', '.join(map(repr, seq[:3]))}, ..., {', '.join(map(repr, seq[-2:]))}) ({len(seq)} segments)"


def _check_segments(segments) -> tuple[int, ...]:
    """``segments`` as a tuple of Python ints; ConfigError unless a non-empty sequence of integers >= 1."""
    try:
        seq = tuple(segments)
    except TypeError:
        seq = None
    if seq is None or isinstance(segments, (str, bytes)) or not seq or any(
            isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 1 for n in seq):
        shown = _segments_text(seq) if seq and not isinstance(segments, (str, bytes)) else repr(segments)
        raise ConfigError(f"segments = {shown} is out of range: valid None or a non-empty sequence of integers "
                          ">= 1 (segment sizes summing to d)")
    return tuple(int(n) for n in seq)



@dataclass(frozen=True)
class StepOutput:
    """What one worker's step produced (all float arrays have shape (d,)).

    v: parameters after the update. residual: eps_p after the step. acc: the accumulator
    eps_p + alpha_t G_p that was compressed. grad: the local stochastic gradient G_p.
    update: g, the summed update every worker applied (v_new = v - g/P). n_selected: entries this
    worker sent in its own selection (d for dense; summed over segments with layer-wise selection);
    n_applied: how many of them reached g. state: the worker's algorithm state (dict; pass it to the
    next :func:`sgd_step`).
    """

    v: np.ndarray
    residual: np.ndarray
    acc: np.ndarray
    grad: np.ndarray
    update: np.ndarray
    n_selected: int
    n_applied: int
    state: dict = field(default_factory=dict)


# half of LIMIT^2: a computed sum of squares carries a relative rounding error of at most n * 2^-53 (n entries), so
# a computed sum <= LIMIT^2 / 2 proves the exact one < LIMIT^2 for any n below 4e15, hence every |x_i| < LIMIT
_LIMIT_SQ_SAFE = 0.5 * DIVERGENCE_LIMIT * DIVERGENCE_LIMIT  # 5e199, a float64


def _check_finite(arr: np.ndarray, what: str, rank: int, iteration: int, label: str = "") -> None:
    """Raise NonFiniteError unless every entry of ``arr`` is finite with |value| <= DIVERGENCE_LIMIT (1e100).

    NaN/Inf: the message names the worker, the iteration and the first bad coordinate. A finite entry beyond
    the limit: the run diverged; the message names the iteration, the algorithm ``label``, the worker, the
    coordinate and the value, and suggests a smaller step size. Only reads ``arr``: one pass (a dot product) in the
    usual case, two reductions when the sum of squares is large or not finite."""
    if arr.size == 0:
        return
    # sum of squares <= LIMIT^2 / 2 implies every |x_i| <= LIMIT and no NaN/Inf (NaN fails every comparison): one BLAS
    # pass at memory speed instead of min and max; where it does not hold (it may overflow before any entry passes
    # the limit, e.g. in float32) the exact test decides, so the outcome is the same
    if arr.ndim == 1 and arr.dtype.kind == "f":
        with np.errstate(over="ignore"):
            if float(np.dot(arr, arr)) <= _LIMIT_SQ_SAFE:
                return
    # as Python floats: compared with a float32 scalar the limit would be cast to float32 (inf)
    if -DIVERGENCE_LIMIT <= float(arr.min()) and float(arr.max()) <= DIVERGENCE_LIMIT:  # NaN fails
        return
    finite = np.isfinite(arr)
    if not finite.all():
        bad = int(np.flatnonzero(~finite)[0])
        raise NonFiniteError(
            f"{what} of worker {rank} at iteration {iteration} is not finite (coordinate {bad} = {arr[bad]}): "
            "valid values are finite; lower the learning rate or check the data")
    bad = int(np.argmax(np.abs(arr)))
    raise NonFiniteError(
        f"the run diverged at iteration {iteration}{f' of {label}' if label else ''}: the {what} of worker {rank} "
        f"is {arr[bad]:.4g} at coordinate {bad} (valid |value| <= {DIVERGENCE_LIMIT:g}, beyond which float64 "
        "squares and sums overflow); lower training.lr")



def sgd_step(spec: AlgorithmSpec, rank: int, P: int, v: np.ndarray, residual: np.ndarray, grad_fn,
             batch_size: int, lr: float, iteration: int, state: dict | None = None):
    """One S-SGD iteration of worker ``rank`` (a sans-I/O program; returns :class:`StepOutput`).

    v: float array (d,), the current parameters v_{t-1} (identical on all workers).
    residual: float array (d,), eps_p (zeros at the start). grad_fn: callable v -> float array (d,), this
    worker's mini-batch stochastic gradient G_p(v) (numerics; costed as ``forward_backward`` work of
    ``batch_size`` samples). lr: alpha_t > 0. iteration: t (>= 1), used in error messages, by seeded draws and
    by the compute model's seeded jitter. state: the worker's algorithm state from the previous step's
    :attr:`StepOutput.state` (None at the start); it is updated in place and returned.
    Raises NonFiniteError naming worker and iteration if the gradient or the accumulator is NaN/Inf, or,
    naming the algorithm too, if one of their entries exceeds :data:`sim.base.errors.DIVERGENCE_LIMIT` in magnitude
    (the run diverged: lower the step size).

    Yields ``forward_backward``, then the algorithm's exchange (:meth:`Algorithm.exchange`) once over the whole
    vector or, with ``spec.segments`` and a segmented algorithm, once per segment in segment order with k_b
    (:meth:`AlgorithmSpec.segment_ks`; a dense segment of ``segment_densities`` through dense S-SGD's exchange,
    :meth:`AlgorithmSpec.dense_spec`), then ``update`` of d parameters. Raises SparsimError if the segments do
    not sum to d.
    """
    algo = spec.algorithm
    d = v.shape[0]
    with np.errstate(over="ignore", invalid="ignore"):
        grad = np.asarray(grad_fn(v), dtype=v.dtype)
    yield Compute("forward_backward", batch_size)
    _check_finite(grad, "gradient", rank, iteration, spec.label)
    state = {} if state is None else state
    ctx = StepContext(rank, P, iteration, d, 0, 0, d, state)
    g_in = grad
    if spec.weight_decay:
        g_in = grad + np.asarray(spec.weight_decay, dtype=v.dtype) * v
    acc = algo.accumulate(spec, g_in, lr, residual, ctx)
    _check_finite(acc, "error-feedback accumulator", rank, iteration, spec.label)
    if spec.segments is None or not algo.segmented:
        ex = yield from algo.exchange(spec, acc, int(spec.k) if algo.sparse else None, ctx)
        g, new_res, n_sel, n_app = ex.g, ex.residual, ex.n_selected, ex.n_applied
    else:
        bounds = spec.segment_bounds(d)
        ks = spec.segment_ks(d)
        dens = spec.segment_densities
        dense_spec = spec.dense_spec() if dens is not None and None in dens else None
        parts, res_parts = [], []
        n_sel = n_app = 0
        for b, k_b in enumerate(ks):
            ctx.segment, ctx.lo, ctx.hi = b, int(bounds[b]), int(bounds[b + 1])
            if dens is not None and dens[b] is None:  # a dense segment (hybrid): the allreduce, residual 0
                ex = yield from dense_spec.algorithm.exchange(dense_spec, acc[ctx.lo:ctx.hi], None, ctx)
            else:
                ex = yield from algo.exchange(spec, acc[ctx.lo:ctx.hi], k_b if algo.sparse else None, ctx)
            parts.append(ex.g)
            res_parts.append(ex.residual)
            n_sel += ex.n_selected
            n_app += ex.n_applied
        g, new_res = np.concatenate(parts), np.concatenate(res_parts)
        ctx.segment, ctx.lo, ctx.hi = 0, 0, d
    algo.after_step(spec, acc, new_res, ctx)
    yield Compute("update", d)
    v_new = g / P  # v - g / P with one array instead of two
    if spec.momentum and not algo.local_momentum:
        u = state.get("momentum_buffer")
        if u is not None:
            v_new += np.asarray(spec.momentum, dtype=u.dtype) * u
        state["momentum_buffer"] = v_new.copy()
    if v_new.dtype == np.result_type(v, v_new):
        np.subtract(v, v_new, out=v_new)
    else:
        v_new = v - v_new
    return StepOutput(v_new, new_res, acc, grad, g, n_sel, n_app, state)
