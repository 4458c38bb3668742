"""Registry of the convergence bounds of gTop-k S-SGD and Mem-SGD, in sympy and in plain floats.

Sources (see ``docs/theory.md``, which restates both papers because the seed text lost its
displayed equations):

- [gTopk] S. Shi, K. Zhao, Q. Wang, Z. Tang, X. Chu, "A Convergence Analysis of Distributed SGD with
  Communication-Efficient Gradient Sparsification", IJCAI 2019: Assumption 1, Lemma 1, Lemma 2,
  Corollary 1, Theorem 1 with condition (18), Corollary 2 (eq. (25)) and its c-form (eq. (27)).
- [MemSGD] S. U. Stich, J.-B. Cordonnier, M. Jaggi, "Sparsified SGD with Memory", NeurIPS 2018:
  Theorem 2.4 (eq. (9)), Lemma 3.2, Lemma 3.3.

Where the paper's second-moment step E||G_t||^2 <= M^2/B does not follow from its assumptions
(docs/theory.md section 4), every bound it enters comes in two variants: ``"published"`` (m2 = M^2/B)
and ``"corrected"`` (m2 = M^2).

Index convention (fixed here, the seed is ambiguous): iterations t = 1..T use steps alpha_1..alpha_T;
eps_0 = 0; eps_t is the averaged residual after iteration t. Lemma 2's one step is
||eps_t||^2 <= delta gamma [(1+eta)||eps_{t-1}||^2 + (1+1/eta) alpha_t^2 ||G_t||^2], so after n steps
||eps_n||^2 <= (1+1/eta) gamma sum_{i=1}^{n} tau^(n-i) alpha_i^2 ||G_i||^2 (n terms; the paper's
"eps_{t+1}, i <= t" form with t+1 = n). In Theorem 1 iteration t evaluates the gradient at v_{t-1},
whose distance to the auxiliary x_{t-1} is eps_{t-1}; condition (18) is
(1/alpha_t) sum_{i<t} tau^(t-i) alpha_i^2 <= D for t = 1..T.

Public API: :class:`Bound`, :data:`BOUNDS`, :data:`DERIVED_NAMES`, :func:`derive`,
:func:`lemma2_unrolled_schedule`, :func:`condition18_D`, :func:`theorem1_on_schedule`,
:func:`optimal_eta`, :class:`OptimalEta`, :func:`param_range_text`.
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Sequence

import sympy as sp

from sim.base.errors import SparsimError, check_range
from theory import symbols as sy
from theory.symbols import DEFINITIONS, LATEX_NAMES, SYMBOLS, expand_definitions

__all__ = [
    "Bound",
    "BOUNDS",
    "DERIVED_NAMES",
    "VARIANTS",
    "derive",
    "lemma2_unrolled_schedule",
    "condition18_D",
    "theorem1_on_schedule",
    "optimal_eta",
    "OptimalEta",
    "param_range_text",
    "memsgd_S_T_closed_form",
    "memsgd_S_T_summation",
    "RATIO_TAU",
    "RATIO_C",
    "RATIO_OPT",
    "ETA_STAR",
]

VARIANTS = ("published", "corrected")

# ---------------------------------------------------------------------------------------------------
# Parameter validation
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    integer: bool
    lo: float | None
    lo_open: bool = False
    hi: float | None = None
    hi_open: bool = False


#: Default valid range of each primary parameter. Cross-parameter rules (k <= d, eta < k/(d-k),
#: the Mem-SGD condition on a) are checked by :meth:`Bound.validate`.
_SPECS: dict[str, _Spec] = {
    "P": _Spec(True, 1),
    "d": _Spec(True, 1),
    "k": _Spec(True, 1),
    "c": _Spec(False, 1),
    "eta": _Spec(False, 0, True),
    "L": _Spec(False, 0, True),
    "M": _Spec(False, 0),
    "B": _Spec(True, 1),
    "T": _Spec(True, 1),
    "t": _Spec(True, 0),
    "theta": _Spec(False, 0, True),
    "delta": _Spec(False, 0),
    "f0_minus_fstar": _Spec(False, 0),
    "D": _Spec(False, 0),
    "alpha": _Spec(False, 0, True),
    "S": _Spec(False, 0),
    "E_t": _Spec(False, 0),
    "G2": _Spec(False, 0),
    "m2": _Spec(False, 0),
    "S1": _Spec(False, 0, True),
    "S2": _Spec(False, 0, True),
    "mu": _Spec(False, 0, True),
    "G": _Spec(False, 0),
    "a": _Spec(False, 1, True),
    "alpha_m": _Spec(False, 4, True),
    "x0_minus_xstar_sq": _Spec(False, 0),
}


def _range_text(name: str, spec: _Spec) -> str:
    left = "" if spec.lo is None else f"{spec.lo} {'<' if spec.lo_open else '<='} "
    right = "" if spec.hi is None else f" {'<' if spec.hi_open else '<='} {spec.hi}"
    return f"{left}{name}{right}"


def _fail(name: str, value, valid: str):
    raise SparsimError(f"{name} = {value!r} is out of range: valid {valid}")


def param_range_text(name: str) -> str:
    """Return the default valid range of parameter ``name`` as text, e.g. ``"0 < eta"``.

    Source: docs/theory.md sections 4-6 (ranges of the constants of the gTop-k paper, IJCAI 2019, and of
    Stich et al. 2018, Thm 2.4). ``integer`` is prefixed for integer parameters (d, k, P, B, T, t).
    Bound-specific rules (k <= d, eta < k/(d-k), c > 1, the Mem-SGD condition on a) come on top.

    Raises :class:`SparsimError` if ``name`` is not a parameter.
    """
    if name not in _SPECS:
        raise SparsimError(f"parameter {name!r} is unknown: valid names are {', '.join(sorted(_SPECS))}")
    spec = _SPECS[name]
    return ("integer " if spec.integer else "") + _range_text(name, spec)


def _coerce(name: str, value, spec: _Spec):
    """Return ``value`` as int (integer parameters) or float, or raise SparsimError."""
    kind = "integer " if spec.integer else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(name, value, f"{kind or 'real number '}{_range_text(name, spec)}")
    if spec.integer:
        if isinstance(value, numbers.Integral):
            v = int(value)
        else:
            fv = float(value)
            if not (math.isfinite(fv) and fv.is_integer()):
                _fail(name, float(value), f"integer {_range_text(name, spec)}")
            v = int(fv)
    else:
        v = float(value)
        if not math.isfinite(v):
            _fail(name, v, f"finite {_range_text(name, spec)}")
    check_range(name, v, spec.lo, spec.hi, lo_open=spec.lo_open, hi_open=spec.hi_open)
    return v


def _check_k_le_d(v: Mapping[str, float], strict: bool) -> None:
    d_, k_ = v["d"], v["k"]
    if k_ > d_ or (strict and k_ == d_):
        _fail("k", k_, f"1 <= k {'<' if strict else '<='} d = {d_}")


def _check_eta_tau(v: Mapping[str, float]) -> None:
    """eta < k/(d-k), i.e. tau = gamma (1+eta) < 1.

    Checked as eta * (d-k) < k in float arithmetic: this implies the exact inequality (rounding is
    monotone and k is exact) and guarantees 1 - tau = (k - eta (d-k))/d > 0 in the float formulas too.
    """
    d_, k_, eta_ = v["d"], v["k"], v["eta"]
    if k_ == d_:
        return  # gamma = 0, tau = 0 for every eta > 0
    if not eta_ * (d_ - k_) < k_:
        hi = k_ / (d_ - k_)
        _fail(
            "eta",
            eta_,
            f"0 < eta < k/(d-k) = {hi:.6g} (d = {d_}, k = {k_}; needs tau = gamma*(1+eta) < 1)",
        )


def _check_memsgd(v: Mapping[str, float]) -> None:
    """Stich et al. 2018, Thm 2.4: (alpha_m + 1) d/k + rho/(rho+1) <= a (alpha_m > 4, a > 1 already)."""
    am, a_, d_, k_ = v["alpha_m"], v["a"], v["d"], v["k"]
    rho_ = 4 * am / ((am - 4) * (am + 1) ** 2)
    need = (am + 1) * d_ / k_ + rho_ / (rho_ + 1)
    if not a_ >= need:
        _fail(
            "a",
            a_,
            f"(alpha_m+1)*d/k + rho/(rho+1) <= a, here {need:.6g} (alpha_m = {am!r}, d = {d_}, "
            f"k = {k_}, rho = {rho_:.6g})",
        )
    if "L" in v and "mu" in v and v["L"] < v["mu"]:
        _fail("L", v["L"], f"mu <= L (mu = {v['mu']!r}; an L-smooth mu-strongly convex f has L >= mu)")


# ---------------------------------------------------------------------------------------------------
# The Bound dataclass
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bound:
    """One upper bound from a paper, as a sympy expression and as an independent float formula.

    Fields: ``name`` (registry key); ``source`` (paper + lemma/equation); ``description`` (what is
    bounded, in words); ``expr`` (sympy right-hand side, may use the derived symbols gamma, tau,
    rho, eta_t, S_T of :mod:`theory.symbols`); ``params`` (names of the primary symbols it needs,
    the keyword arguments of :meth:`evaluate`); ``variant`` ("published" = second moment M^2/B,
    "corrected" = M^2, None where the second-moment bound does not enter).
    """

    name: str
    source: str
    description: str
    expr: sp.Expr
    params: tuple[str, ...]
    variant: str | None
    lhs: str = ""
    eta_needs_tau_lt_1: bool = False
    k_lt_d: bool = False
    overrides: Mapping[str, _Spec] = field(default_factory=dict, repr=False, compare=False)
    extra_check: Callable[[Mapping[str, float]], None] | None = field(default=None, repr=False, compare=False)
    float_impl: Callable[[Mapping[str, float]], float] | None = field(default=None, repr=False, compare=False)

    # -- presentation -------------------------------------------------------------------------------
    def latex(self) -> str:
        """LaTeX of :attr:`expr` (sympy.latex with the names of :data:`theory.symbols.LATEX_NAMES`)."""
        return sp.latex(self.expr, symbol_names=LATEX_NAMES)

    def text(self) -> str:
        """Plain-text (sympy ``sstr``) form of :attr:`expr`."""
        return sp.sstr(self.expr)

    @functools.cached_property
    def expanded(self) -> sp.Expr:
        """:attr:`expr` with every derived symbol that is not a parameter replaced by its definition."""
        names = tuple(s.name for s in DEFINITIONS if s.name not in self.params)
        return expand_definitions(self.expr, names)

    # -- validation and evaluation ------------------------------------------------------------------
    def check_names(self, names) -> None:
        """Raise :class:`SparsimError` if ``names`` (an iterable of parameter names) holds an unknown one
        (listing the valid parameters) or lacks one of :attr:`params` (listing the missing ones)."""
        names = set(names)
        unknown = sorted(names - set(self.params))
        if unknown:
            raise SparsimError(
                f"{self.name}: unknown parameter(s) {', '.join(unknown)}; valid parameters: {', '.join(self.params)}"
            )
        missing = [p for p in self.params if p not in names]
        if missing:
            raise SparsimError(
                f"{self.name}: missing parameter(s) {', '.join(missing)}; needs {', '.join(self.params)}"
            )

    def validate(self, values: Mapping[str, object]) -> dict[str, int | float]:
        """Check ``values`` against :attr:`params` and their ranges; return them as ints/floats.

        Rules (docs/theory.md sections 4-6): integers d >= 1, 1 <= k <= d (k < d where the bound needs
        gamma > 0), P >= 1, B >= 1, T >= 1, t >= 0; eta > 0, and 0 < eta < k/(d-k) (tau < 1) where the
        bound needs it; theta, L, alpha, mu, S1, S2 > 0; M, delta, D, G, ... >= 0; c >= 1 (> 1 where
        noted); Mem-SGD: alpha_m > 4, a > 1, (alpha_m+1) d/k + rho/(rho+1) <= a, L >= mu.

        Raises :class:`SparsimError` naming an unknown or missing parameter (with the valid ones) or
        the first value out of range (with its valid range).
        """
        self.check_names(values)
        out: dict[str, int | float] = {}
        for p in self.params:
            out[p] = _coerce(p, values[p], self.overrides.get(p, _SPECS[p]))
        if "d" in out and "k" in out:
            _check_k_le_d(out, self.k_lt_d)
            if self.eta_needs_tau_lt_1 and "eta" in out:
                _check_eta_tau(out)
        if self.extra_check is not None:
            self.extra_check(out)
        return out

    def evaluate(self, **values) -> float:
        """Evaluate :attr:`expr` numerically through sympy (30 significant digits, then float).

        Keyword arguments: exactly :attr:`params` (meaning and units in
        :data:`theory.symbols.DESCRIPTIONS`). Floats are substituted as their exact binary value, so
        the result is the correctly rounded value of the bound at the given inputs.

        Raises :class:`SparsimError` for unknown/missing parameters or values out of range
        (see :meth:`validate`).
        """
        v = self.validate(values)
        subs = {SYMBOLS[n]: (sp.Integer(x) if isinstance(x, int) else sp.Float(x, 50)) for n, x in v.items()}
        val = self.expanded.xreplace(subs).evalf(30)
        if not val.is_number or not val.is_real:
            raise SparsimError(f"{self.name}: the bound is not a real number at {v}: got {val}")
        return float(val)

    def evaluate_float(self, **values) -> float:
        """Evaluate the bound with an independent plain-Python float formula (cross-check of :meth:`evaluate`).

        Same arguments, validation and errors as :meth:`evaluate`; written by hand (not lambdified),
        with numerically stable forms (1 - tau = (k - eta (d-k))/d, 1 - tau^n via expm1/log1p).
        """
        v = self.validate(values)
        assert self.float_impl is not None
        return float(self.float_impl(v))


# ---------------------------------------------------------------------------------------------------
# Independent float formulas
# ---------------------------------------------------------------------------------------------------


def _gamma_f(v) -> float:
    return (v["d"] - v["k"]) / v["d"]


def _tau_f(v) -> float:
    return _gamma_f(v) * (1.0 + v["eta"])


def _one_minus_tau_f(v) -> float:
    # 1 - (1 - k/d)(1 + eta) = (k - eta (d - k)) / d, without cancellation against 1.
    return (v["k"] - v["eta"] * (v["d"] - v["k"])) / v["d"]


def _one_minus_pow(tau_: float, one_minus_tau: float, n: int) -> float:
    """1 - tau^n for 0 <= tau < 1, accurate when tau is close to 1."""
    if tau_ == 0.0:
        return 1.0 if n > 0 else 0.0
    return -math.expm1(n * math.log1p(-one_minus_tau))


def _m2_f(v, variant: str) -> float:
    return v["M"] ** 2 / v["B"] if variant == "published" else v["M"] ** 2


def _f_lemma1(v):
    return _gamma_f(v) * v["S"]


def _f_lemma2_step(v):
    eta_ = v["eta"]
    return v["delta"] * _gamma_f(v) * ((1 + eta_) * v["E_t"] + (1 + 1 / eta_) * v["alpha"] ** 2 * v["G2"])


def _unrolled_f(v, m2_: float, n: int | None) -> float:
    """(1+1/eta) gamma alpha^2 m2 (1 - tau^n)/(1 - tau); n = None is the n -> inf limit."""
    g_ = _gamma_f(v)
    if g_ == 0.0:
        return 0.0
    omt = _one_minus_tau_f(v)
    geo = 1.0 / omt if n is None else _one_minus_pow(_tau_f(v), omt, n) / omt
    return (1 + 1 / v["eta"]) * g_ * v["alpha"] ** 2 * m2_ * geo


def _f_lemma2_unrolled(v):
    return _unrolled_f(v, v["m2"], v["t"] + 1)


def _make_f_cor1(variant: str, limit: bool):
    def f(v):
        return _unrolled_f(v, _m2_f(v, variant), None if limit else v["t"] + 1)

    return f


def _make_f_thm1(variant: str):
    def f(v):
        m2_ = _m2_f(v, variant)
        num = 2 * v["f0_minus_fstar"] + v["L"] * m2_ * (1 + v["L"] * v["D"] / v["eta"]) * v["S2"]
        return num / v["S1"]

    return f


def _cor2_f(v, variant: str, ratio: float) -> float:
    """Corollary 2 with ratio = tau/(eta (1 - tau))."""
    F, L_, M_, B_, th, T_ = v["f0_minus_fstar"], v["L"], v["M"], v["B"], v["theta"], v["T"]
    first = 2 * F / (th * math.sqrt(B_ * T_))
    if variant == "published":
        return first + L_ * M_**2 * th / math.sqrt(B_ * T_) + L_**2 * M_**2 * th**2 * ratio / T_
    return first + L_ * M_**2 * th * math.sqrt(B_ / T_) + B_ * L_**2 * M_**2 * th**2 * ratio / T_


def _make_f_cor2(variant: str):
    def f(v):
        return _cor2_f(v, variant, _tau_f(v) / (v["eta"] * _one_minus_tau_f(v)))

    return f


def _make_f_cor2_c(variant: str):
    def f(v):
        c_ = v["c"]
        return _cor2_f(v, variant, c_ * (c_ - 1) * (c_ + 1))

    return f


def _opt_ratio_f(c_: float) -> float:
    """min over eta of tau/(eta (1-tau)) at gamma = 1 - 1/c: (c - 1 + sqrt(c (c-1)))^2."""
    return (c_ - 1 + math.sqrt(c_ * (c_ - 1))) ** 2


def _make_f_cor2_opt(variant: str):
    def f(v):
        return _cor2_f(v, variant, _opt_ratio_f(v["c"]))

    return f


def _memsgd_S_T_f(T_: int, a_: float) -> float:
    # sum_{t=0}^{T-1} (a+t)^2 = T a^2 + a T (T-1) + (T-1) T (2T-1)/6   (all terms >= 0)
    return T_ * a_**2 + a_ * T_ * (T_ - 1) + (T_ - 1) * T_ * (2 * T_ - 1) / 6


def _f_memsgd_thm24(v):
    T_, a_, G_, mu_, L_ = v["T"], v["a"], v["G"], v["mu"], v["L"]
    am, r2 = v["alpha_m"], v["x0_minus_xstar_sq"]
    ST = _memsgd_S_T_f(T_, a_)
    ratio2 = (v["d"] / v["k"]) ** 2
    return (
        4 * T_ * (T_ + 2 * a_) * G_**2 / (mu_ * ST)
        + mu_ * a_**3 * r2 / (8 * ST)
        + 64 * T_ * (1 + 2 * L_ / mu_) * (4 * am / (am - 4)) * ratio2 * G_**2 / (mu_ * ST)
    )


def _f_memsgd_lemma32(v):
    step = 8 / (v["mu"] * (v["a"] + v["t"]))
    am = v["alpha_m"]
    return step**2 * (4 * am / (am - 4)) * (v["d"] / v["k"]) ** 2 * v["G"] ** 2


# ---------------------------------------------------------------------------------------------------
# Sympy expressions of the registry
# ---------------------------------------------------------------------------------------------------

_g, _tau, _eta = sy.gamma, sy.tau, sy.eta


def _m2_expr(variant: str) -> sp.Expr:
    return sy.M**2 / sy.B if variant == "published" else sy.M**2


def _unrolled_expr(m2_: sp.Expr) -> sp.Expr:
    return (1 + 1 / _eta) * _g * sy.alpha**2 * m2_ * (1 - _tau ** (sy.t + 1)) / (1 - _tau)


def _unrolled_limit_expr(m2_: sp.Expr) -> sp.Expr:
    return (1 + 1 / _eta) * _g * sy.alpha**2 * m2_ / (1 - _tau)


def _thm1_expr(variant: str) -> sp.Expr:
    m2_ = _m2_expr(variant)
    return (2 * sy.f0_minus_fstar + sy.L * m2_ * (1 + sy.L * sy.D / _eta) * sy.S2) / sy.S1


def _cor2_expr(variant: str, ratio: sp.Expr) -> sp.Expr:
    """Closed form of Corollary 2 with ratio standing for tau/(eta (1 - tau))."""
    F, L_, M_, B_, th, T_ = sy.f0_minus_fstar, sy.L, sy.M, sy.B, sy.theta, sy.T
    if variant == "published":
        return (2 * F / th + L_ * M_**2 * th) / sp.sqrt(B_ * T_) + L_**2 * M_**2 * th**2 * ratio / T_
    return (
        2 * F / (th * sp.sqrt(B_ * T_))
        + L_ * M_**2 * th * sp.sqrt(B_) / sp.sqrt(T_)
        + B_ * L_**2 * M_**2 * th**2 * ratio / T_
    )


#: tau/(eta (1 - tau)) in tau and eta (Corollary 2), in c at eta = 1/c (eq. (27)), and its minimum
#: over eta at gamma = 1 - 1/c (attained at eta* = sqrt(c/(c-1)) - 1, see :func:`optimal_eta`).
RATIO_TAU = _tau / (_eta * (1 - _tau))
RATIO_C = sy.c * (sy.c**2 - 1)
RATIO_OPT = (sy.c - 1 + sp.sqrt(sy.c * (sy.c - 1))) ** 2
ETA_STAR = sp.sqrt(sy.c / (sy.c - 1)) - 1

_MEMSGD_THM24_EXPR = (
    4 * sy.T * (sy.T + 2 * sy.a) * sy.G**2 / (sy.mu * sy.S_T)
    + sy.mu * sy.a**3 * sy.x0_minus_xstar_sq / (8 * sy.S_T)
    + 64 * sy.T * (1 + 2 * sy.L / sy.mu) * (4 * sy.alpha_m / (sy.alpha_m - 4)) * (sy.d**2 / sy.k**2) * sy.G**2
    / (sy.mu * sy.S_T)
)
_MEMSGD_L32_EXPR = sy.eta_t**2 * (4 * sy.alpha_m / (sy.alpha_m - 4)) * (sy.d**2 / sy.k**2) * sy.G**2

_GT = "Shi et al., IJCAI 2019"
_MS = "Stich, Cordonnier & Jaggi, NeurIPS 2018 (Sparsified SGD with Memory)"
_M2_TEXT = {
    "published": "second moment E||G_t||^2 <= M^2/B as printed (eq. (12)), which does not follow from the assumptions",
    "corrected": "second moment E||G_t||^2 <= M^2 (corrected; docs/theory.md section 4)",
}
_OPT_C = {"c": _Spec(False, 1, True)}


def _build() -> dict[str, Bound]:
    b: dict[str, Bound] = {}

    def add(bound: Bound) -> None:
        b[bound.name] = bound

    add(Bound(
        name="lemma1",
        source=f"{_GT}, Assumption 1 and Lemma 1 (RandK identity of Stich et al. 2018); docs/theory.md sec. 5",
        description="||sum_p x_p - gTopK(x_1..x_P)||^2 <= (1 - k/d) ||sum_p x_p||^2 under Assumption 1",
        expr=_g * sy.S,
        params=("d", "k", "S"),
        variant=None,
        lhs="||sum_p x_p - gTopK(x)||^2",
        float_impl=_f_lemma1,
    ))
    add(Bound(
        name="lemma2_step",
        source=f"{_GT}, Lemma 2, one step (Young's inequality); docs/theory.md sec. 5",
        description="one step of the averaged residual: ||eps_{t+1}||^2 with measured Assumption-1 ratio delta_t",
        expr=sy.delta * _g * ((1 + _eta) * sy.E_t + (1 + 1 / _eta) * sy.alpha**2 * sy.G2),
        params=("d", "k", "eta", "delta", "E_t", "alpha", "G2"),
        variant=None,
        lhs="||eps_{t+1}||^2",
        float_impl=_f_lemma2_step,
    ))
    add(Bound(
        name="lemma2_unrolled",
        source=f"{_GT}, Lemma 2 unrolled from eps_0 = 0; constant step alpha and second moment m2",
        description="E||eps_{t+1}||^2 after t+1 constant steps (geometric sum of the unrolled Lemma 2)",
        expr=_unrolled_expr(sy.m2),
        params=("d", "k", "eta", "alpha", "m2", "t"),
        variant=None,
        lhs="E||eps_{t+1}||^2",
        eta_needs_tau_lt_1=True,
        float_impl=_f_lemma2_unrolled,
    ))
    for v in VARIANTS:
        bp = ("B",) if v == "published" else ()
        add(Bound(
            name=f"corollary1_{v}",
            source=f"{_GT}, Corollary 1 (Lemma 2 + {_M2_TEXT[v]}), constant step",
            description=f"E||eps_{{t+1}}||^2 with m2 = {'M^2/B' if v == 'published' else 'M^2'}, constant step alpha",
            expr=_unrolled_expr(_m2_expr(v)),
            params=("d", "k", "eta", "alpha", "M", *bp, "t"),
            variant=v,
            lhs="E||eps_{t+1}||^2",
            eta_needs_tau_lt_1=True,
            float_impl=_make_f_cor1(v, limit=False),
        ))
        add(Bound(
            name=f"corollary1_limit_{v}",
            source=f"{_GT}, Corollary 1, t -> infinity limit ({_M2_TEXT[v]})",
            description="sup_t E||eps_t||^2 for a constant step alpha (limit t -> inf of corollary1)",
            expr=_unrolled_limit_expr(_m2_expr(v)),
            params=("d", "k", "eta", "alpha", "M", *bp),
            variant=v,
            lhs="lim_t E||eps_t||^2",
            eta_needs_tau_lt_1=True,
            float_impl=_make_f_cor1(v, limit=True),
        ))
        add(Bound(
            name=f"theorem1_{v}",
            source=f"{_GT}, Theorem 1 with condition (18) (constant D); {_M2_TEXT[v]}; docs/theory.md sec. 5",
            description="(sum_t alpha_t E||grad f(v_{t-1})||^2) / (sum_t alpha_t) for a schedule satisfying (18)",
            expr=_thm1_expr(v),
            params=("d", "k", "eta", "L", "M", *bp, "f0_minus_fstar", "D", "S1", "S2"),
            variant=v,
            lhs="sum_t alpha_t E||grad f(v_{t-1})||^2 / sum_t alpha_t",
            eta_needs_tau_lt_1=True,
            float_impl=_make_f_thm1(v),
        ))
        add(Bound(
            name=f"corollary2_{v}",
            source=f"{_GT}, Corollary 2, eq. (25): alpha = theta sqrt(B/T), D = alpha tau/(1-tau); {_M2_TEXT[v]}",
            description="average squared gradient norm after T constant steps alpha = theta sqrt(B/T)",
            expr=_cor2_expr(v, RATIO_TAU),
            params=("d", "k", "eta", "L", "M", "B", "f0_minus_fstar", "theta", "T"),
            variant=v,
            lhs="(1/T) sum_t E||grad f(v_{t-1})||^2",
            eta_needs_tau_lt_1=True,
            float_impl=_make_f_cor2(v),
        ))
        add(Bound(
            name=f"corollary2_c_{v}",
            source=f"{_GT}, Corollary 2 in the compression ratio c = d/k with eta = 1/c, eq. (27); {_M2_TEXT[v]}",
            description="Corollary 2 at eta = 1/c: tau = 1 - 1/c^2, tau/(eta(1-tau)) = c(c^2-1)",
            expr=_cor2_expr(v, RATIO_C),
            params=("c", "L", "M", "B", "f0_minus_fstar", "theta", "T"),
            variant=v,
            lhs="(1/T) sum_t E||grad f(v_{t-1})||^2",
            float_impl=_make_f_cor2_c(v),
        ))
        add(Bound(
            name=f"corollary2_opt_eta_{v}",
            source=f"{_GT}, Corollary 2 at the eta minimising tau/(eta(1-tau)) (this workbench; see optimal_eta); {_M2_TEXT[v]}",
            description="Corollary 2 at eta* = sqrt(c/(c-1)) - 1: tau/(eta(1-tau)) = (c - 1 + sqrt(c(c-1)))^2 ~ 4c^2",
            expr=_cor2_expr(v, RATIO_OPT),
            params=("c", "L", "M", "B", "f0_minus_fstar", "theta", "T"),
            variant=v,
            lhs="(1/T) sum_t E||grad f(v_{t-1})||^2",
            overrides=_OPT_C,
            float_impl=_make_f_cor2_opt(v),
        ))
    add(Bound(
        name="memsgd_theorem24",
        source=f"{_MS}, Theorem 2.4, eq. (9), with S_T of Lemma 3.3; docs/theory.md sec. 6",
        description="E f(x_bar_T) - f* for Mem-SGD, eta_t = 8/(mu(a+t)), weights w_t = (a+t)^2, t = 0..T-1",
        expr=_MEMSGD_THM24_EXPR,
        params=("d", "k", "T", "a", "G", "mu", "L", "x0_minus_xstar_sq", "alpha_m"),
        variant=None,
        lhs="E f(x_bar_T) - f*",
        extra_check=_check_memsgd,
        float_impl=_f_memsgd_thm24,
    ))
    add(Bound(
        name="memsgd_lemma32",
        source=f"{_MS}, Lemma 3.2 (memory bound), eta_t = 8/(mu(a+t)); docs/theory.md sec. 6",
        description="E||m_t||^2, the Mem-SGD memory at iteration t",
        expr=_MEMSGD_L32_EXPR,
        params=("d", "k", "t", "a", "G", "mu", "alpha_m"),
        variant=None,
        lhs="E||m_t||^2",
        extra_check=_check_memsgd,
        float_impl=_f_memsgd_lemma32,
    ))
    return b


#: The registry: name -> :class:`Bound`.
BOUNDS: dict[str, Bound] = _build()

# ---------------------------------------------------------------------------------------------------
# Bounds on an actual step schedule
# ---------------------------------------------------------------------------------------------------


def _seq(name: str, xs, lo_open: bool) -> list[float]:
    try:
        out = [x for x in xs]
    except TypeError:
        raise SparsimError(f"{name} = {xs!r} is out of range: valid a sequence of numbers") from None
    res = []
    for i, x in enumerate(out):
        nm = f"{name}[{i}]"
        res.append(_coerce(nm, x, _Spec(False, 0, lo_open)))
    return res


def _real(name: str, x, lo=None, lo_open=False, hi=None, hi_open=False) -> float:
    return _coerce(name, x, _Spec(False, lo, lo_open, hi, hi_open))


def lemma2_unrolled_schedule(alphas: Sequence[float], G2s: Sequence[float], gamma: float, eta: float) -> float:
    """Unrolled Lemma 2 on an actual schedule: bound on ||eps_n||^2 after n = len(alphas) steps.

    Source: Shi et al., IJCAI 2019, Lemma 2 (unrolled from eps_0 = 0), docs/theory.md section 5:
    ||eps_n||^2 <= (1 + 1/eta) gamma sum_{i=1}^{n} tau^(n-i) alpha_i^2 ||G_i||^2, tau = gamma (1+eta)
    (pathwise when every delta_i <= 1; in expectation with E||G_i||^2 in place of ||G_i||^2).

    ``alphas``: step sizes alpha_1..alpha_n ([x]/[g], each > 0); ``G2s``: ||G_i||^2 (or E||G_i||^2,
    or a second-moment bound m2) for the same steps ([g]^2, each >= 0); ``gamma``: 1 - k/d
    (0 <= gamma < 1); ``eta``: Young parameter (> 0; any eta > 0 is valid on a finite schedule).
    Returns the bound in [x]^2; 0.0 for an empty schedule.

    Raises :class:`SparsimError` for sequences of different lengths, a non-positive step, a negative
    G2, gamma outside [0, 1) or eta <= 0.
    """
    al = _seq("alphas", alphas, True)
    g2 = _seq("G2s", G2s, False)
    if len(al) != len(g2):
        _fail("len(G2s)", len(g2), f"len(G2s) = len(alphas) = {len(al)}")
    gamma_ = _real("gamma", gamma, 0, False, 1, True)
    eta_ = _real("eta", eta, 0, True)
    tau_ = gamma_ * (1 + eta_)
    r = 0.0
    for a_i, g_i in zip(al, g2):
        r = tau_ * r + a_i * a_i * g_i
    return (1 + 1 / eta_) * gamma_ * r


def condition18_D(alphas: Sequence[float], tau: float) -> float:
    """Smallest D of condition (18) for a given schedule: max_t (1/alpha_t) sum_{i<t} tau^(t-i) alpha_i^2.

    Source: Shi et al., IJCAI 2019, Theorem 1, condition (18); docs/theory.md section 5. For a constant
    step alpha this is alpha tau (1 - tau^(T-1))/(1 - tau) < alpha tau/(1 - tau) (Corollary 2's D).

    ``alphas``: alpha_1..alpha_T ([x]/[g], each > 0, T >= 1); ``tau``: gamma (1 + eta) (>= 0; tau < 1
    is needed for D to stay bounded as T grows, not for a finite schedule). Returns D in [x]/[g]
    (0.0 when T = 1).

    Raises :class:`SparsimError` for an empty schedule, a non-positive step or tau < 0.
    """
    al = _seq("alphas", alphas, True)
    if not al:
        _fail("len(alphas)", 0, "1 <= len(alphas)")
    tau_ = _real("tau", tau, 0, False)
    q = 0.0  # q_t = sum_{i<t} tau^(t-i) alpha_i^2
    best = 0.0
    for t_idx, a_t in enumerate(al):
        if t_idx > 0:
            best = max(best, q / a_t)
        q = tau_ * (q + a_t * a_t)
    return best


def theorem1_on_schedule(
    alphas: Sequence[float],
    L: float,
    M: float,
    B: int,
    f0_minus_fstar: float,
    gamma: float,
    eta: float,
    variant: str = "corrected",
) -> float:
    """Theorem 1's bound evaluated on an actual step schedule (no constant D).

    Source: Shi et al., IJCAI 2019, Theorem 1 (proof before condition (18) is applied), docs/theory.md
    section 5:
    (sum_t alpha_t E||grad f(v_{t-1})||^2) / (sum_t alpha_t)
      <= [2 (f(x_0) - f*) + L^2 sum_t alpha_t E||eps_{t-1}||^2 + L m2 sum_t alpha_t^2] / sum_t alpha_t,
    with E||eps_{t-1}||^2 <= (1+1/eta) gamma m2 sum_{i<t} tau^(t-1-i) alpha_i^2 (unrolled Lemma 2,
    eps_0 = 0) and m2 = M^2/B ("published") or M^2 ("corrected"). Never larger than
    ``BOUNDS["theorem1_<variant>"]`` with D = :func:`condition18_D` (alphas, tau).

    ``alphas``: alpha_1..alpha_T ([x]/[g], each > 0, T >= 1); ``L``: smoothness ([g]/[x], > 0);
    ``M``: per-sample gradient-norm bound ([g], >= 0); ``B``: global batch (integer >= 1);
    ``f0_minus_fstar``: f(x_0) - f* ([f], >= 0); ``gamma``: 1 - k/d (0 <= gamma < 1); ``eta``: Young
    parameter (> 0); ``variant``: "published" or "corrected". Returns the bound in [g]^2.

    Raises :class:`SparsimError` for an empty schedule or any value out of range.
    """
    if variant not in VARIANTS:
        _fail("variant", variant, "one of 'published', 'corrected'")
    al = _seq("alphas", alphas, True)
    if not al:
        _fail("len(alphas)", 0, "1 <= len(alphas)")
    L_ = _real("L", L, 0, True)
    M_ = _real("M", M, 0)
    B_ = _coerce("B", B, _SPECS["B"])
    F_ = _real("f0_minus_fstar", f0_minus_fstar, 0)
    gamma_ = _real("gamma", gamma, 0, False, 1, True)
    eta_ = _real("eta", eta, 0, True)
    m2_ = M_ * M_ / B_ if variant == "published" else M_ * M_
    tau_ = gamma_ * (1 + eta_)
    pref = (1 + 1 / eta_) * gamma_ * m2_
    r = 0.0  # sum_{i<t} tau^(t-1-i) alpha_i^2
    eps_term = 0.0
    s1 = 0.0
    s2 = 0.0
    for a_t in al:
        eps_term += a_t * pref * r
        s1 += a_t
        s2 += a_t * a_t
        r = tau_ * r + a_t * a_t
    return (2 * F_ + L_ * L_ * eps_term + L_ * m2_ * s2) / s1


# ---------------------------------------------------------------------------------------------------
# Optimal eta
# ---------------------------------------------------------------------------------------------------


class OptimalEta(NamedTuple):
    """Result of :func:`optimal_eta`: ``expr`` exact sympy value at the given c, ``value`` its float,
    ``general`` the minimiser as a sympy expression in the symbol c, ``ratio`` the minimum of
    tau/(eta(1-tau)) as a float."""

    expr: sp.Expr
    value: float
    general: sp.Expr
    ratio: float


def _ratio_in_c_eta() -> sp.Expr:
    g_c = 1 - 1 / sy.c
    return RATIO_TAU.xreplace({_tau: g_c * (1 + _eta)})


@functools.cache
def _eta_star_general() -> sp.Expr:
    """Solve d/d eta [tau/(eta(1-tau))] = 0 with tau = (1-1/c)(1+eta); keep the root in (0, 1/(c-1))."""
    h = _ratio_in_c_eta()
    roots = sp.solve(sp.diff(h, _eta), _eta)
    good = []
    for r in roots:
        ok = True
        for cv in (sp.Rational(3, 2), sp.Integer(3), sp.Integer(1000)):
            x = r.subs(sy.c, cv)
            if not (x.is_real and 0 < x < 1 / (cv - 1)):
                ok = False
        if ok:
            good.append(r)
    if len(good) != 1:  # pragma: no cover - a sympy regression
        raise RuntimeError(f"optimal eta: expected one root in range, got {roots}")
    return good[0]


def optimal_eta(c: float) -> OptimalEta:
    """The Young parameter eta minimising tau/(eta(1-tau)), the factor of Corollary 2's second term.

    Source: Shi et al., IJCAI 2019, Corollary 2 and Section 4.3 (the paper picks eta = 1/c, giving
    c(c^2-1)); docs/theory.md section 5. With gamma = 1 - 1/c and tau = gamma (1 + eta), the derivative's
    root in 0 < eta < 1/(c-1) (solved with sympy) is eta* = sqrt(c/(c-1)) - 1, where tau = 1/sqrt(c/(c-1))
    and tau/(eta(1-tau)) = (c - 1 + sqrt(c(c-1)))^2 ~ 4c^2 (instead of ~c^3 at eta = 1/c).

    ``c``: compression ratio d/k (real, c > 1; at c = 1 every eta gives 0). Returns
    :class:`OptimalEta` (exact sympy value, float, general expression in c, minimal ratio).

    Raises :class:`SparsimError` if c <= 1 or c is not a finite real number.
    """
    c_f = _coerce("c", c, _Spec(False, 1, True))
    c_exact = sp.Integer(int(c_f)) if float(c_f).is_integer() else sp.Rational(repr(c_f))
    general = _eta_star_general()
    expr = general.subs(sy.c, c_exact)
    value = float(expr.evalf(30))
    ratio = float(RATIO_OPT.subs(sy.c, c_exact).evalf(30))
    return OptimalEta(expr=expr, value=value, general=general, ratio=ratio)


# ---------------------------------------------------------------------------------------------------
# Symbolic derivation chain: Lemma 2 -> Corollary 1 -> Theorem 1 -> Corollary 2
# ---------------------------------------------------------------------------------------------------

_j = sp.Symbol("j", integer=True, nonnegative=True)
_s = sp.Symbol("s", positive=True)  # tau = 1/(1+s), so 0 < tau < 1


def _generic_branch(expr: sp.Expr) -> sp.Expr:
    """Drop sympy's Piecewise special case (tau == 1) of a geometric sum, keeping the generic branch."""
    if isinstance(expr, sp.Piecewise):
        for e, cond in expr.args:
            if cond == sp.true:
                return e
    return expr


def _limit_t_inf(expr: sp.Expr, var: sp.Symbol) -> sp.Expr:
    """lim_{var -> inf} for 0 < tau < 1, via tau = 1/(1+s) with s > 0, then back to tau."""
    e = expr.xreplace({_tau: 1 / (1 + _s)})
    lim = sp.limit(e, var, sp.oo)
    return sp.simplify(lim.xreplace({_s: 1 / _tau - 1}))


def _derive_lemma1() -> sp.Expr:
    # E||x - RandK(x)||^2 = sum_i P(i dropped) x_i^2, P(i kept) = C(d-1, k-1)/C(d, k) = k/d.
    p_kept = sp.combsimp(sp.binomial(sy.d - 1, sy.k - 1) / sp.binomial(sy.d, sy.k))
    return sp.simplify(1 - p_kept) * sy.S  # (d - k)/d * S, i.e. gamma * S


def _derive_lemma2_step() -> sp.Expr:
    # eps_{t+1} = (1/P)(sum_p acc_p - g), ||.||^2 = delta gamma ||eps_t + alpha G||^2 (definition of delta);
    # Young: ||u + w||^2 <= (1+eta)||u||^2 + (1+1/eta)||w||^2 with ||u||^2 = E_t, ||w||^2 = alpha^2 G2.
    young = (1 + _eta) * sy.E_t + (1 + 1 / _eta) * sy.alpha**2 * sy.G2
    return sy.delta * _g * young


def _derive_lemma2_unrolled() -> sp.Expr:
    step = _derive_lemma2_step().xreplace({sy.delta: 1, sy.G2: sy.m2})
    A = sp.expand(step).coeff(sy.E_t)  # gamma (1 + eta)
    b0 = step.xreplace({sy.E_t: 0})  # gamma (1 + 1/eta) alpha^2 m2
    A_tau = sp.simplify(A.xreplace({_g: _tau / (1 + _eta)}))
    assert A_tau == _tau, A_tau
    # e_0 = 0, e_{n} = tau e_{n-1} + b0  =>  e_{t+1} = b0 sum_{j=0}^{t} tau^j
    return b0 * _generic_branch(sp.summation(A_tau**_j, (_j, 0, sy.t)))


def _derive_corollary1(variant: str) -> sp.Expr:
    return _derive_lemma2_unrolled().xreplace({sy.m2: _m2_expr(variant)})


def _derive_corollary1_limit(variant: str) -> sp.Expr:
    return _limit_t_inf(_derive_corollary1(variant), sy.t)


def _derive_theorem1(variant: str) -> sp.Expr:
    Q = sp.Symbol("Q", nonnegative=True)  # sum_{i<t} tau^(t-i) alpha_i^2
    a_t = sp.Symbol("alpha_t", positive=True)
    # Unrolled Lemma 2 for eps_{t-1}: (1+1/eta) gamma m2 sum_{i<t} tau^(t-1-i) alpha_i^2 = ... Q / tau
    e_prev = (1 + 1 / _eta) * _g * sy.m2 * Q / _tau
    e_prev = sp.simplify(e_prev.xreplace({_g: _tau / (1 + _eta)}))  # = m2 Q / eta
    e_prev = e_prev.xreplace({Q: sy.D * a_t})  # condition (18): Q <= D alpha_t
    # L-smoothness at the auxiliary sequence, summed over t, times 2:
    # sum_t alpha_t E||grad f(v_{t-1})||^2 <= 2(f0 - f*) + sum_t [L^2 alpha_t E||eps_{t-1}||^2 + L m2 alpha_t^2]
    per_step = sp.expand(sy.L**2 * a_t * e_prev + sy.L * sy.m2 * a_t**2)
    poly = sp.Poly(per_step, a_t)
    assert poly.monoms() == [(2,)], poly
    coeff = poly.coeff_monomial(a_t**2)
    num = 2 * sy.f0_minus_fstar + coeff * sy.S2
    return sp.factor_terms((num / sy.S1).xreplace({sy.m2: _m2_expr(variant)}))


def _derive_constant_step_D() -> sp.Expr:
    # (1/alpha) sum_{i=1}^{t-1} tau^(t-i) alpha^2 = alpha sum_{j=1}^{t-1} tau^j, increasing in t: sup = limit.
    part = sy.alpha * _generic_branch(sp.summation(_tau**_j, (_j, 1, sy.t - 1)))
    return _limit_t_inf(part, sy.t)


def _derive_corollary2(variant: str) -> sp.Expr:
    th = _derive_theorem1(variant)
    Dc = _derive_constant_step_D()  # alpha tau / (1 - tau)
    e = th.xreplace({sy.D: Dc}).xreplace({sy.S1: sy.T * sy.alpha, sy.S2: sy.T * sy.alpha**2})
    e = e.xreplace({sy.alpha: sy.theta * sp.sqrt(sy.B / sy.T)})
    return sp.simplify(e)


def _derive_corollary2_c(variant: str) -> sp.Expr:
    e = expand_definitions(_derive_corollary2(variant), ("tau",))
    return sp.simplify(e.xreplace({_g: 1 - 1 / sy.c}).xreplace({_eta: 1 / sy.c}))


def _derive_corollary2_opt_eta(variant: str) -> sp.Expr:
    e = expand_definitions(_derive_corollary2(variant), ("tau",))
    return sp.simplify(e.xreplace({_g: 1 - 1 / sy.c}).xreplace({_eta: _eta_star_general()}))


def _memsgd_S_T_sum() -> sp.Expr:
    return sp.summation((sy.a + _j) ** 2, (_j, 0, sy.T - 1))


def _derive_memsgd_theorem24() -> sp.Expr:
    # Lemma 3.3 with a_0 = ||x_0 - x*||^2, A = G^2, B = (mu + 2L)(4 alpha/(alpha-4))(d^2/k^2) G^2
    ST = _memsgd_S_T_sum()
    A = sy.G**2
    Bc = (sy.mu + 2 * sy.L) * (4 * sy.alpha_m / (sy.alpha_m - 4)) * sy.d**2 / sy.k**2 * sy.G**2
    return (
        sy.mu * sy.a**3 / (8 * ST) * sy.x0_minus_xstar_sq
        + 4 * sy.T * (sy.T + 2 * sy.a) / (sy.mu * ST) * A
        + 64 * sy.T / (sy.mu**2 * ST) * Bc
    )


_DERIVERS: dict[str, Callable[[], sp.Expr]] = {
    "lemma1": _derive_lemma1,
    "lemma2_step": _derive_lemma2_step,
    "lemma2_unrolled": _derive_lemma2_unrolled,
    "memsgd_theorem24": _derive_memsgd_theorem24,
}
for _v in VARIANTS:
    _DERIVERS[f"corollary1_{_v}"] = functools.partial(_derive_corollary1, _v)
    _DERIVERS[f"corollary1_limit_{_v}"] = functools.partial(_derive_corollary1_limit, _v)
    _DERIVERS[f"theorem1_{_v}"] = functools.partial(_derive_theorem1, _v)
    _DERIVERS[f"corollary2_{_v}"] = functools.partial(_derive_corollary2, _v)
    _DERIVERS[f"corollary2_c_{_v}"] = functools.partial(_derive_corollary2_c, _v)
    _DERIVERS[f"corollary2_opt_eta_{_v}"] = functools.partial(_derive_corollary2_opt_eta, _v)

#: Registry names that :func:`derive` rebuilds symbolically.
DERIVED_NAMES: tuple[str, ...] = tuple(_DERIVERS)


def derive(name: str) -> sp.Expr:
    """Rebuild ``BOUNDS[name].expr`` symbolically from the step before it in the proof.

    Source: Shi et al., IJCAI 2019, Lemma 1 (RandK identity), Lemma 2 (Young's inequality, unrolled by
    a geometric sum), Corollary 1 (second-moment substitution and t -> inf limit), Theorem 1 (smoothness
    at the auxiliary sequence + condition (18)), Corollary 2 (S1 = theta sqrt(BT), S2 = theta^2 B,
    D = alpha tau/(1-tau) derived as the sup of condition (18) for a constant step), eq. (27)
    (gamma = 1 - 1/c, eta = 1/c) and the optimal eta of :func:`optimal_eta`; Stich et al. 2018,
    Lemma 3.3 with S_T = sympy.summation((a+t)^2, (t, 0, T-1)) and the constants of the proof of
    Thm 2.4. Each step uses sympy substitution/summation/limit on the previous step's result, so
    ``sympy.simplify(expand_definitions(derive(name) - BOUNDS[name].expr)) == 0`` checks the chain.

    ``name``: one of :data:`DERIVED_NAMES`. Returns a sympy expression in the symbols of
    :mod:`theory.symbols` (may use gamma and tau like the registry entry).

    Raises :class:`SparsimError` for a name that is not derivable (listing the valid ones).
    """
    if name not in _DERIVERS:
        raise SparsimError(f"bound {name!r} has no derivation: valid names are {', '.join(DERIVED_NAMES)}")
    return _DERIVERS[name]()


def memsgd_S_T_closed_form() -> sp.Expr:
    """Closed form of Mem-SGD's S_T = sum_{t=0}^{T-1} (a+t)^2 = (T/6)(2T^2 + 6aT - 3T + 6a^2 - 6a + 1).

    Source: Stich et al. 2018, Lemma 3.3 (weights w_t = (a+t)^2, t = 0..T-1; S_T >= T^3/3). Symbols:
    T iterations (integer >= 1), a the step shift (> 1). Raises nothing.
    """
    return DEFINITIONS[sy.S_T]


def memsgd_S_T_summation() -> sp.Expr:
    """S_T computed by ``sympy.summation((a+t)^2, (t, 0, T-1))`` (Stich et al. 2018, Lemma 3.3). Raises nothing."""
    return _memsgd_S_T_sum()
