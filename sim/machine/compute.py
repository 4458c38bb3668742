"""Compute model: turns a :class:`sim.base.ops.Compute` operation into simulated seconds.

Units: seconds (s); ``work`` is in the unit :data:`sim.base.ops.COMPUTE_KINDS` gives for each kind.
Random draws (jitter, stragglers) come from ``np.random.default_rng([seed, rank, iteration])``,
so a draw depends only on ``(seed, rank, iteration)``: never on the order in which ranks ask, on
how many other draws happened, or on the machine.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from sim.base.errors import ConfigError, SparsimError, check_int, check_real
from sim.base.ops import COMPUTE_KINDS

__all__ = ["JITTERS", "SELECT_SCALINGS", "ComputeModel", "MAX_FORWARD_BACKWARD_S", "MAX_COEFF_S",
           "MAX_STRAGGLER_FACTOR", "MAX_JITTER_SCALE"]

#: Valid values of :attr:`ComputeModel.jitter`.
JITTERS = ("none", "lognormal", "exponential")

#: Valid values of :attr:`ComputeModel.select_scaling`: how a selection's seconds grow with the x elements it
#: scans. ``"x log2 x"``: ``select_coeff_s * x * log2(x)`` (the gTop-k authors' fit on a P102-100);
#: ``"x"``: ``select_coeff_s * x`` (a memory-bound selection: passes over the x values at the device's memory
#: bandwidth, :meth:`sim.workloads.model.DeviceModel.costs`).
SELECT_SCALINGS = ("x log2 x", "x")

#: Upper limits of the model's parameters, where no physical value is larger (the scenario keys
#: compute.* state the same limits): one hour of forward + backward per step and worker (s); one second
#: per element selected, merged, added or updated, per byte scanned or per FLOP (measured costs are nanoseconds
#: per element); a straggler 1000 times slower than its peers; a jitter scale of 3 (a lognormal sigma of 3 has a coefficient of
#: variation of 90, an exponential mean extra of 300 %: measured step times vary by a few percent). With
#: these, one iteration's compute is finite and far below float64's range, so the simulated clock stays exact.
MAX_FORWARD_BACKWARD_S = 3600.0
MAX_COEFF_S = 1.0
MAX_STRAGGLER_FACTOR = 1000.0
MAX_JITTER_SCALE = 3.0


_check_real = functools.partial(check_real, err=ConfigError)  # model parameters are configuration


def _check_nonneg_int(name, value, err=SparsimError) -> int:
    """Check ``value`` is an integer (Python or numpy, not bool) >= 0; return it as int."""
    return check_int(name, value, 0, err=err)


@dataclass(frozen=True)
class ComputeModel:
    """Per-worker compute times for the :data:`sim.base.ops.COMPUTE_KINDS` operations.

    Attributes:
        forward_backward_s: seconds of forward + backward pass per iteration per worker at the
            configured batch size, finite, 0 <= forward_backward_s <= 3600 (:data:`MAX_FORWARD_BACKWARD_S`).
        jitter: ``"none"``, ``"lognormal"`` (time multiplied by ``exp(s Z - s**2 / 2)``,
            ``Z ~ N(0, 1)``, ``s = jitter_scale``: mean factor 1) or ``"exponential"`` (time
            plus ``forward_backward_s * E``, ``E`` exponential with mean ``jitter_scale``).
        jitter_scale: lognormal sigma, or the exponential mean extra as a fraction of
            ``forward_backward_s``; finite, 0 <= jitter_scale <= 3 (:data:`MAX_JITTER_SCALE`).
        straggler_prob: probability in [0, 1] that a worker straggles in an iteration.
        straggler_factor: multiplier of a straggler's forward/backward time, 1 <= factor <= 1000
            (:data:`MAX_STRAGGLER_FACTOR`).
        select_coeff_s: the cost of a top-k selection over ``x`` elements: ``t = c x log2 x`` (seconds per
            ``x log2 x``) with ``select_scaling = "x log2 x"``, ``t = c x`` (seconds per element) with ``"x"``;
            default 2.19e-10 s per x log2 x, the gTop-k authors' fit on a P102-100 GPU (ICDCS 2019 released
            scripts, see docs/costs.md). Finite, 0 <= select_coeff_s <= 1 (:data:`MAX_COEFF_S`); 0 makes
            selections free in either scaling (the timeline's collective timer relies on it).
        select_scaling: ``"x log2 x"`` (default) or ``"x"`` (:data:`SELECT_SCALINGS`); a device's cost model
            chooses it (:meth:`sim.workloads.model.DeviceModel.costs`, docs/costs-per-device.md).
        merge_coeff_s: seconds per element merged (sparse add + top-k over the union), 0 <= . <= 1.
        reduce_coeff_s: seconds per element added in a dense reduction, 0 <= . <= 1.
        update_coeff_s: seconds per parameter updated, 0 <= . <= 1.
        scan_coeff_s: seconds per byte a compressor reads or writes in device memory (the ``scan`` kind: rand-k's
            gathers, Gaussian-k's statistics and threshold passes, DGC's threshold filter, PowerSGD's reads of its
            matrices), 0 <= . <= 1. A device's memory model gives 1 / (mem_efficiency x mem_bandwidth_Bps): 0.87 of
            the datasheet bandwidth (:meth:`sim.workloads.model.DeviceModel.costs`, docs/costs-per-device.md).
            Default 0 (not charged).
        matmul_coeff_s: seconds per floating-point operation of a compressor's dense matrix products (the
            ``matmul`` kind: PowerSGD's M Q, M^T P, P Q^T and orthogonalisations), 0 <= . <= 1. A device gives
            1 / (peak_flops x efficiency), its datasheet peak at the fraction a training step reaches. Default 0.
        seed: integer >= 0 seeding the jitter/straggler draws.

    Raises:
        ConfigError: a value out of range or an unknown jitter kind (the message names it).
    """

    forward_backward_s: float = 0.0
    jitter: str = "none"
    jitter_scale: float = 0.0
    straggler_prob: float = 0.0
    straggler_factor: float = 1.0
    select_coeff_s: float = 2.19e-10
    select_scaling: str = "x log2 x"
    merge_coeff_s: float = 0.0
    reduce_coeff_s: float = 0.0
    update_coeff_s: float = 0.0
    scan_coeff_s: float = 0.0
    matmul_coeff_s: float = 0.0
    seed: int = 0

    def __post_init__(self):
        _check_real("forward_backward_s", self.forward_backward_s, 0, MAX_FORWARD_BACKWARD_S)
        if self.jitter not in JITTERS:
            raise ConfigError(f"jitter = {self.jitter!r} is unknown: valid jitters are {', '.join(JITTERS)}")
        _check_real("jitter_scale", self.jitter_scale, 0, MAX_JITTER_SCALE)
        _check_real("straggler_prob", self.straggler_prob, 0, 1)
        _check_real("straggler_factor", self.straggler_factor, 1, MAX_STRAGGLER_FACTOR)
        for name in ("select_coeff_s", "merge_coeff_s", "reduce_coeff_s", "update_coeff_s", "scan_coeff_s",
                     "matmul_coeff_s"):
            _check_real(name, getattr(self, name), 0, MAX_COEFF_S)
        if self.select_scaling not in SELECT_SCALINGS:
            raise ConfigError(f"select_scaling = {self.select_scaling!r} is unknown: valid "
                              f"{' or '.join(repr(s) for s in SELECT_SCALINGS)}")
        _check_nonneg_int("seed", self.seed, err=ConfigError)

    def forward_backward_factor(self, rank: int, iteration: int) -> float:
        """Return the multiplier (> 0) of ``forward_backward_s`` for ``rank`` at ``iteration``.

        Draws, always in this order and all three whatever the configuration (so changing the
        jitter kind never changes which workers straggle): ``u ~ U[0, 1)`` for the straggler,
        ``Z ~ N(0, 1)`` and ``E ~ Exp(1)`` for the jitter, from
        ``np.random.default_rng([seed, rank, iteration])``.

        Raises:
            SparsimError: ``rank`` or ``iteration`` not an integer >= 0.
        """
        rank = _check_nonneg_int("rank", rank)
        iteration = _check_nonneg_int("iteration", iteration)
        if self.jitter == "none" and self.straggler_prob == 0.0:
            return 1.0  # no randomness configured; a draw depends only on its own key, so none is skipped
        rng = np.random.default_rng([self.seed, rank, iteration])
        u = rng.random()
        z = rng.standard_normal()
        e = rng.standard_exponential()
        if self.jitter == "lognormal":
            s = self.jitter_scale
            factor = math.exp(s * z - 0.5 * s * s)
        elif self.jitter == "exponential":
            factor = 1.0 + self.jitter_scale * e
        else:
            factor = 1.0
        if u < self.straggler_prob:
            factor *= self.straggler_factor
        return factor

    def seconds(self, kind: str, work: float, rank: int, iteration: int) -> float:
        """Return the simulated duration in seconds of ``work`` of ``kind`` on ``rank`` at ``iteration``.

        - ``"forward_backward"``: ``forward_backward_s * forward_backward_factor(rank, iteration)``
          (``work``, the local batch in samples, is validated but not used: ``forward_backward_s``
          is already the time at the configured batch).
        - ``"select"``: ``select_coeff_s * x * log2(x)`` (``select_scaling = "x log2 x"``) or
          ``select_coeff_s * x`` (``"x"``) with ``x = work`` elements; 0 for x <= 1 (nothing to choose from).
        - ``"merge"``: ``merge_coeff_s * work``; ``"reduce"``: ``reduce_coeff_s * work``;
          ``"update"``: ``update_coeff_s * work``; ``"scan"``: ``scan_coeff_s * work`` (work in bytes);
          ``"matmul"``: ``matmul_coeff_s * work`` (work in FLOPs).

        Deterministic: depends only on the arguments and the model.

        Raises:
            SparsimError: unknown ``kind`` (the message lists :data:`sim.base.ops.COMPUTE_KINDS`),
                ``work`` not a finite real >= 0, or ``rank``/``iteration`` not integers >= 0.
        """
        if kind not in COMPUTE_KINDS:
            raise SparsimError(f"kind = {kind!r} is unknown: valid kinds are {', '.join(COMPUTE_KINDS)}")
        x = _check_real("work", work, 0, err=SparsimError)
        if kind == "forward_backward":
            return self.forward_backward_s * self.forward_backward_factor(rank, iteration)
        _check_nonneg_int("rank", rank)
        _check_nonneg_int("iteration", iteration)
        if kind == "select":
            if x <= 1:
                return 0.0
            return self.select_coeff_s * x * math.log2(x) if self.select_scaling == "x log2 x" else self.select_coeff_s * x
        if kind == "merge":
            return self.merge_coeff_s * x
        if kind == "reduce":
            return self.reduce_coeff_s * x
        if kind == "scan":
            return self.scan_coeff_s * x
        if kind == "matmul":
            return self.matmul_coeff_s * x
        return self.update_coeff_s * x

    def seconds_all(self, kind: str, work, P: int, iteration: int):
        """:meth:`seconds` for ranks 0..P-1 at once (the fast engine, :mod:`sim.engine.fastsim`).

        work: a real >= 0 or a float/int array (P,) of per-rank work. Returns a float (every rank the same)
        or a float array (P,) in seconds, equal to ``[seconds(kind, work[r], r, iteration) for r in range(P)]``
        up to the last bit of ``log2`` (``select_scaling = "x log2 x"``; bit for bit for every other kind and
        for ``"x"``). Raises SparsimError for an unknown kind.
        """
        if kind not in COMPUTE_KINDS:
            raise SparsimError(f"kind = {kind!r} is unknown: valid kinds are {', '.join(COMPUTE_KINDS)}")
        if kind == "forward_backward":
            if self.jitter == "none" and self.straggler_prob == 0.0:
                return self.forward_backward_s
            return self.forward_backward_s * np.array([self.forward_backward_factor(r, iteration) for r in range(P)])
        if kind == "select":
            if np.ndim(work) == 0:
                return self.seconds(kind, work, 0, iteration)
            x = np.asarray(work, dtype=np.float64)
            if self.select_scaling == "x":
                out = np.where(x > 1, self.select_coeff_s * x, 0.0)
            else:
                with np.errstate(divide="ignore", invalid="ignore"):
                    out = np.where(x > 1, self.select_coeff_s * x * np.log2(np.maximum(x, 1.0)), 0.0)
            return float(out) if out.ndim == 0 else out
        coeff = {"merge": self.merge_coeff_s, "reduce": self.reduce_coeff_s, "update": self.update_coeff_s,
                 "scan": self.scan_coeff_s, "matmul": self.matmul_coeff_s}[kind]
        return coeff * work
