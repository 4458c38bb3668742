"""Tests of the ``theory`` package: symbolic derivations, sympy vs float evaluation, validation,
Lemma 2 along simulated trajectories, schedule bounds, optimal eta and the CLI helpers.

References: Shi et al., IJCAI 2019 (gTop-k convergence) and Stich et al. 2018 (Mem-SGD), as restated
in docs/theory.md.
"""
from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import sympy as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.base.errors import SparsimError
from theory import bounds as tb
from theory import cli_support
from theory import symbols as sy
from theory.bounds import (
    BOUNDS,
    DERIVED_NAMES,
    condition18_D,
    derive,
    lemma2_unrolled_schedule,
    optimal_eta,
    theorem1_on_schedule,
)
from theory.symbols import DESCRIPTIONS, SYMBOLS, expand_definitions

REQUIRED = [
    "lemma1",
    "lemma2_step",
    "lemma2_unrolled",
    "corollary1_published",
    "corollary1_corrected",
    "theorem1_published",
    "theorem1_corrected",
    "corollary2_published",
    "corollary2_corrected",
    "corollary2_c_published",
    "corollary2_c_corrected",
    "corollary2_opt_eta_published",
    "corollary2_opt_eta_corrected",
    "memsgd_theorem24",
    "memsgd_lemma32",
]


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------


def topk(x: np.ndarray, k: int) -> np.ndarray:
    """Exact Top-k with a fixed tie rule (lower index wins)."""
    idx = np.argsort(-np.abs(x), kind="stable")[:k]
    out = np.zeros_like(x)
    out[idx] = x[idx]
    return out


def _memsgd_need(alpha_m: float, d: int, k: int) -> float:
    rho = 4 * alpha_m / ((alpha_m - 4) * (alpha_m + 1) ** 2)
    return (alpha_m + 1) * d / k + rho / (rho + 1)


pos = lambda lo, hi: st.floats(lo, hi, allow_nan=False, allow_infinity=False, allow_subnormal=False)  # noqa: E731


@st.composite
def valid_values(draw, bound: tb.Bound) -> dict:
    p = set(bound.params)
    v: dict = {}
    if "d" in p:
        if bound.name.startswith("memsgd"):
            d = draw(st.integers(1, 10_000))
        else:
            d = draw(st.integers(2, 10**6))
        k = draw(st.one_of(st.integers(1, max(1, d - 1)), st.just(d)))
        v["d"], v["k"] = d, k
        if "eta" in p:
            if bound.eta_needs_tau_lt_1 and k < d:
                v["eta"] = draw(pos(0.01, 0.99)) * k / (d - k)
            else:
                v["eta"] = draw(pos(1e-3, 100.0))
    if "c" in p:
        lo = 1.0 + 1e-6 if "c" in bound.overrides else 1.0
        v["c"] = draw(st.one_of(pos(lo, 10.0), pos(lo, 1e4)))
    simple = {
        "L": pos(1e-3, 1e3),
        "M": pos(0.0, 1e3),
        "B": st.integers(1, 100_000),
        "T": st.integers(1, 10**7),
        "t": st.integers(0, 10**6),
        "theta": pos(1e-3, 1e2),
        "f0_minus_fstar": pos(0.0, 1e3),
        "D": pos(0.0, 1e3),
        "alpha": pos(1e-4, 10.0),
        "S": pos(0.0, 1e6),
        "E_t": pos(0.0, 1e6),
        "G2": pos(0.0, 1e6),
        "m2": pos(0.0, 1e6),
        "S1": pos(1e-3, 1e6),
        "S2": pos(1e-3, 1e6),
        "delta": pos(0.0, 2.0),
        "G": pos(0.0, 100.0),
        "x0_minus_xstar_sq": pos(0.0, 100.0),
    }
    for name, strat in simple.items():
        if name in p:
            v[name] = draw(strat)
    if "alpha_m" in p:
        v["alpha_m"] = draw(pos(4.01, 50.0))
        v["a"] = _memsgd_need(v["alpha_m"], v["d"], v["k"]) * (1 + draw(pos(1e-6, 10.0)))
        v["mu"] = draw(pos(1e-3, 10.0))
        if "L" in p:
            v["L"] = v["mu"] * (1 + draw(pos(0.0, 1e3)))
    assert set(v) == p, (bound.name, set(v) ^ p)
    return v


# ---------------------------------------------------------------------------------------------------
# registry structure and documentation
# ---------------------------------------------------------------------------------------------------


def test_registry_has_required_entries():
    for name in REQUIRED:
        assert name in BOUNDS, name
        assert BOUNDS[name].name == name
    for name, b in BOUNDS.items():
        assert b.variant in ("published", "corrected", None)
        if name.endswith("_published"):
            assert b.variant == "published"
        if name.endswith("_corrected"):
            assert b.variant == "corrected"
        assert b.source and ("IJCAI 2019" in b.source or "NeurIPS 2018" in b.source)
        assert b.description


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_params_cover_expression(name):
    b = BOUNDS[name]
    for p in b.params:
        assert p in SYMBOLS and p in DESCRIPTIONS
    free = {s.name for s in b.expanded.free_symbols}
    assert free <= set(b.params), (name, free - set(b.params))
    assert isinstance(b.latex(), str) and b.latex()
    assert isinstance(b.text(), str) and b.text()


def test_public_functions_have_docstrings():
    for mod in (tb, cli_support):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if callable(obj):
                assert inspect.getdoc(obj), f"{mod.__name__}.{name} has no docstring"
    for meth in ("latex", "text", "evaluate", "evaluate_float", "validate"):
        assert inspect.getdoc(getattr(tb.Bound, meth))
    assert inspect.getdoc(expand_definitions)


# ---------------------------------------------------------------------------------------------------
# sympy evaluation == independent float evaluation
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BOUNDS))
@settings(deadline=None)
@given(data=st.data())
def test_sympy_and_float_evaluation_agree(name, data):
    b = BOUNDS[name]
    values = data.draw(valid_values(b))
    x = b.evaluate(**values)
    y = b.evaluate_float(**values)
    assert math.isfinite(x) and x >= 0
    assert math.isclose(x, y, rel_tol=1e-10, abs_tol=1e-300), (name, values, x, y)


# ---------------------------------------------------------------------------------------------------
# symbolic derivation checks
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DERIVED_NAMES)
def test_derivation_matches_registry(name):
    derived = derive(name)
    target = BOUNDS[name].expr
    assert sp.simplify(expand_definitions(derived - target)) == 0
    if name not in ("lemma1", "memsgd_theorem24"):  # these two are derived in k/d resp. a summed S_T
        assert sp.simplify(derived - target) == 0


def test_derivation_chain_covers_the_corollaries():
    for v in ("published", "corrected"):
        for stem in ("corollary1", "corollary1_limit", "theorem1", "corollary2", "corollary2_c", "corollary2_opt_eta"):
            assert f"{stem}_{v}" in DERIVED_NAMES
    assert "lemma2_unrolled" in DERIVED_NAMES
    with pytest.raises(SparsimError, match="memsgd_lemma32"):
        derive("memsgd_lemma32")


@pytest.mark.parametrize("variant", ["published", "corrected"])
def test_corollary2_c_is_corollary2_at_eta_one_over_c(variant):
    cor2 = expand_definitions(BOUNDS[f"corollary2_{variant}"].expr, ("tau",))
    sub = cor2.subs({sy.gamma: 1 - 1 / sy.c}).subs({sy.eta: 1 / sy.c})
    assert sp.simplify(sub - BOUNDS[f"corollary2_c_{variant}"].expr) == 0


def test_ratio_at_eta_one_over_c():
    r = expand_definitions(tb.RATIO_TAU, ("tau",)).subs({sy.gamma: 1 - 1 / sy.c}).subs({sy.eta: 1 / sy.c})
    assert sp.simplify(r - sy.c * (sy.c**2 - 1)) == 0
    tau_c = expand_definitions(sy.tau, ("tau",)).subs({sy.gamma: 1 - 1 / sy.c, sy.eta: 1 / sy.c})
    assert sp.simplify(tau_c - (1 - 1 / sy.c**2)) == 0


def test_corrected_corollary2_first_term_is_LM2theta_sqrtB_over_sqrtT():
    # docs/theory.md sec. 5: with m2 = M^2 the first term becomes L M^2 theta sqrt(B)/sqrt(T).
    e = BOUNDS["corollary2_corrected"].expr.subs({sy.f0_minus_fstar: 0, sy.tau: 0})
    assert sp.simplify(e - sy.L * sy.M**2 * sy.theta * sp.sqrt(sy.B) / sp.sqrt(sy.T)) == 0


def test_memsgd_S_T_closed_form_equals_summation():
    t_ = sp.Symbol("t", integer=True, nonnegative=True)
    summed = sp.summation((sy.a + t_) ** 2, (t_, 0, sy.T - 1))  # w_t = (a+t)^2, t = 0..T-1
    assert sp.simplify(summed - tb.memsgd_S_T_closed_form()) == 0
    assert sp.simplify(tb.memsgd_S_T_summation() - tb.memsgd_S_T_closed_form()) == 0


@settings(deadline=None)
@given(T=st.integers(1, 10**5), a=pos(1.0 + 1e-9, 1e4))
def test_memsgd_S_T_at_least_T_cubed_over_3(T, a):
    ST = float(tb.memsgd_S_T_closed_form().subs({sy.T: T, sy.a: sp.Float(a, 40)}).evalf(30))
    assert ST >= T**3 / 3
    assert math.isclose(ST, tb._memsgd_S_T_f(T, a), rel_tol=1e-12)


def test_young_inequality_gap_is_a_square():
    # (1+eta) u^2 + (1+1/eta) w^2 - (u + w)^2 = (sqrt(eta) u - w/sqrt(eta))^2 >= 0
    u, w = sp.symbols("u w", real=True)
    gap = (1 + sy.eta) * u**2 + (1 + 1 / sy.eta) * w**2 - (u + w) ** 2
    assert sp.simplify(gap - (sp.sqrt(sy.eta) * u - w / sp.sqrt(sy.eta)) ** 2) == 0


def test_lemma1_randk_probability():
    p_kept = sp.combsimp(sp.binomial(sy.d - 1, sy.k - 1) / sp.binomial(sy.d, sy.k))
    assert sp.simplify(p_kept - sy.k / sy.d) == 0


# ---------------------------------------------------------------------------------------------------
# optimal eta
# ---------------------------------------------------------------------------------------------------


def test_optimal_eta_closed_form_symbolically():
    u = sp.Symbol("u", positive=True)  # c = 1 + u > 1
    general = optimal_eta(2.0).general
    assert sp.simplify((general - tb.ETA_STAR).subs(sy.c, 1 + u)) == 0
    h = expand_definitions(tb.RATIO_TAU, ("tau",)).subs(sy.gamma, 1 - 1 / sy.c)
    at_star = h.subs(sy.eta, tb.ETA_STAR)
    assert sp.simplify((at_star - tb.RATIO_OPT).subs(sy.c, 1 + u)) == 0
    # derivative vanishes there
    assert sp.simplify(sp.diff(h, sy.eta).subs(sy.eta, tb.ETA_STAR).subs(sy.c, 1 + u)) == 0


@settings(deadline=None, max_examples=60)
@given(c=st.one_of(pos(1.01, 10.0), pos(10.0, 1e4)))
def test_optimal_eta_matches_scipy(c):
    from scipy.optimize import minimize_scalar

    gamma = 1 - 1 / c

    def h(eta):
        tau = gamma * (1 + eta)
        one_minus_tau = (1 - eta * (c - 1)) / c  # = 1 - (1 - 1/c)(1 + eta), without cancellation
        return tau / (eta * one_minus_tau)

    hi = 1 / (c - 1)
    res = minimize_scalar(lambda u: h(u * hi), bounds=(1e-12, 1 - 1e-12), method="bounded",
                          options={"xatol": 1e-10})
    opt = optimal_eta(c)
    assert 0 < opt.value < hi
    assert math.isclose(opt.value, math.sqrt(c / (c - 1)) - 1, rel_tol=1e-9)
    assert h(opt.value) <= res.fun * (1 + 1e-10)
    assert opt.ratio <= res.fun * (1 + 1e-10)
    assert math.isclose(res.x * hi, opt.value, rel_tol=1e-3)
    assert math.isclose(opt.ratio, h(opt.value), rel_tol=1e-8)
    # the paper's eta = 1/c is never better
    assert opt.ratio <= c * (c * c - 1) * (1 + 1e-12)


def test_optimal_eta_rejects_c_at_most_one():
    for bad in (1.0, 0.5, -3.0):
        with pytest.raises(SparsimError, match=repr(bad)):
            optimal_eta(bad)


# ---------------------------------------------------------------------------------------------------
# Lemma 2 along simulated trajectories
# ---------------------------------------------------------------------------------------------------


def _gradient(rng: np.random.Generator, d: int, kind: int) -> np.ndarray:
    if kind == 0:
        return rng.standard_normal(d)
    if kind == 1:
        return rng.standard_cauchy(d)
    if kind == 2:
        return rng.integers(-2, 3, size=d).astype(float)  # many ties
    return rng.standard_normal(d) * 10.0 ** rng.integers(-3, 4, size=d)


@settings(deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    d=st.integers(2, 64),
    kfrac=pos(0.0, 1.0),
    eta=st.one_of(pos(1e-3, 1.0), pos(1.0, 1e3)),
    steps=st.integers(1, 25),
    kind=st.integers(0, 3),
)
def test_lemma2_one_step_pathwise_single_worker(seed, d, kfrac, eta, steps, kind):
    rng = np.random.default_rng(seed)
    k = 1 + int(kfrac * (d - 2))  # 1 <= k < d
    gamma = 1 - k / d
    eps = np.zeros(d) if rng.random() < 0.5 else rng.standard_normal(d)
    eps0 = float(eps @ eps)
    alphas, G2s = [], []
    step = BOUNDS["lemma2_step"]
    for _ in range(steps):
        G = _gradient(rng, d, kind)
        alpha = float(rng.uniform(1e-3, 1.0))
        acc = eps + alpha * G
        new = acc - topk(acc, k)
        e_new, e_old, g2 = float(new @ new), float(eps @ eps), float(G @ G)
        n_acc = float(acc @ acc)
        delta = e_new / (gamma * n_acc) if n_acc > 0 else 0.0
        assert delta <= 1 + 1e-12  # TopK is a k-contraction: Assumption 1 holds for P = 1
        rhs = step.evaluate_float(d=d, k=k, eta=eta, delta=1.0, E_t=e_old, alpha=alpha, G2=g2)
        assert e_new <= rhs * (1 + 1e-12) + 1e-300
        rhs_measured = step.evaluate_float(d=d, k=k, eta=eta, delta=min(delta, 1.0), E_t=e_old, alpha=alpha, G2=g2)
        assert e_new <= rhs_measured * (1 + 1e-9) + 1e-300
        alphas.append(alpha)
        G2s.append(g2)
        if eps0 == 0.0:  # unrolled bound from eps_0 = 0 holds pathwise too
            assert e_new <= lemma2_unrolled_schedule(alphas, G2s, gamma, eta) * (1 + 1e-9) + 1e-300
        eps = new


@settings(deadline=None, max_examples=50)
@given(seed=st.integers(0, 2**32 - 1), P=st.integers(2, 5), d=st.integers(2, 40), kfrac=pos(0.0, 1.0),
       eta=pos(1e-3, 1e3))
def test_lemma2_step_with_measured_delta_multi_worker(seed, P, d, kfrac, eta):
    # Top-k S-SGD with P workers: the one-step bound holds with the measured delta (which may exceed 1).
    rng = np.random.default_rng(seed)
    k = 1 + int(kfrac * (d - 2))
    gamma = 1 - k / d
    eps_p = [rng.standard_normal(d) for _ in range(P)]
    Gs = [rng.standard_normal(d) for _ in range(P)]
    alpha = float(rng.uniform(1e-3, 1.0))
    acc = [e + alpha * g for e, g in zip(eps_p, Gs)]
    g_sum = sum(topk(x, k) for x in acc)
    new = [x - topk(x, k) for x in acc]
    eps_old = sum(eps_p) / P
    eps_new = sum(new) / P
    G = sum(Gs) / P
    s = sum(acc)
    delta = float((s - g_sum) @ (s - g_sum)) / (gamma * float(s @ s))
    rhs = BOUNDS["lemma2_step"].evaluate_float(
        d=d, k=k, eta=eta, delta=delta, E_t=float(eps_old @ eps_old), alpha=alpha, G2=float(G @ G)
    )
    assert float(eps_new @ eps_new) <= rhs * (1 + 1e-9)


# ---------------------------------------------------------------------------------------------------
# schedule functions
# ---------------------------------------------------------------------------------------------------


@settings(deadline=None)
@given(d=st.integers(2, 10**5), data=st.data(), alpha=pos(1e-4, 10.0), m2=pos(0.0, 1e3), n=st.integers(1, 300))
def test_lemma2_unrolled_schedule_constant_step_matches_closed_form(d, data, alpha, m2, n):
    k = data.draw(st.integers(1, d - 1))
    eta = data.draw(pos(0.01, 0.99)) * k / (d - k)
    gamma = 1 - k / d
    sched = lemma2_unrolled_schedule([alpha] * n, [m2] * n, gamma, eta)
    closed = BOUNDS["lemma2_unrolled"].evaluate_float(d=d, k=k, eta=eta, alpha=alpha, m2=m2, t=n - 1)
    assert math.isclose(sched, closed, rel_tol=1e-9, abs_tol=1e-300)


@settings(deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 50), gamma=pos(0.0, 0.999), eta=pos(1e-3, 10.0))
def test_lemma2_unrolled_schedule_is_the_explicit_sum(seed, n, gamma, eta):
    rng = np.random.default_rng(seed)
    alphas = rng.uniform(1e-3, 1.0, n)
    G2s = rng.uniform(0.0, 5.0, n)
    tau = gamma * (1 + eta)
    explicit = (1 + 1 / eta) * gamma * sum(tau ** (n - 1 - i) * alphas[i] ** 2 * G2s[i] for i in range(n))
    assert math.isclose(lemma2_unrolled_schedule(alphas, G2s, gamma, eta), explicit, rel_tol=1e-10, abs_tol=1e-300)


def _schedule(kind: int, T: int, alpha0: float) -> np.ndarray:
    t = np.arange(1, T + 1, dtype=float)
    if kind == 0:
        return np.full(T, alpha0)
    if kind == 1:
        return alpha0 / np.sqrt(t)
    if kind == 2:
        return alpha0 / t
    return alpha0 * np.where(t <= T // 2, 1.0, 0.1)  # step decay


@settings(deadline=None)
@given(d=st.integers(2, 10**4), data=st.data(), T=st.integers(1, 400), kind=st.integers(0, 3),
       alpha0=pos(1e-3, 1.0), L=pos(1e-2, 10.0), M=pos(0.0, 10.0), B=st.integers(1, 512), F=pos(0.0, 10.0))
def test_theorem1_on_schedule_never_exceeds_theorem1_with_D(d, data, T, kind, alpha0, L, M, B, F):
    k = data.draw(st.integers(1, d - 1))
    eta = data.draw(pos(0.01, 0.99)) * k / (d - k)
    gamma = 1 - k / d
    tau = gamma * (1 + eta)
    alphas = _schedule(kind, T, alpha0)
    D = condition18_D(alphas, tau)
    for variant in ("published", "corrected"):
        on = theorem1_on_schedule(alphas, L, M, B, F, gamma, eta, variant)
        kw = dict(d=d, k=k, eta=eta, L=L, M=M, f0_minus_fstar=F, D=D,
                  S1=float(np.sum(alphas)), S2=float(np.sum(alphas**2)))
        if variant == "published":
            kw["B"] = B
        with_D = BOUNDS[f"theorem1_{variant}"].evaluate_float(**kw)
        assert on <= with_D * (1 + 1e-9) + 1e-300


@settings(deadline=None)
@given(tau=pos(0.0, 0.999), alpha=pos(1e-3, 10.0), T=st.integers(1, 2000))
def test_condition18_constant_step(tau, alpha, T):
    D = condition18_D([alpha] * T, tau)
    expected = alpha * tau * (1 - tau ** (T - 1)) / (1 - tau) if T > 1 else 0.0
    assert math.isclose(D, expected, rel_tol=1e-9, abs_tol=1e-300)
    assert D <= alpha * tau / (1 - tau) * (1 + 1e-12)


@settings(deadline=None)
@given(d=st.integers(2, 10**4), data=st.data(), T=st.integers(1, 2000), theta=pos(1e-2, 10.0),
       L=pos(1e-2, 10.0), M=pos(0.0, 10.0), B=st.integers(1, 512), F=pos(0.0, 10.0))
def test_theorem1_on_constant_schedule_below_corollary2(d, data, T, theta, L, M, B, F):
    k = data.draw(st.integers(1, d - 1))
    eta = data.draw(pos(0.01, 0.99)) * k / (d - k)
    gamma = 1 - k / d
    alpha = theta * math.sqrt(B / T)
    for variant in ("published", "corrected"):
        on = theorem1_on_schedule([alpha] * T, L, M, B, F, gamma, eta, variant)
        cor2 = BOUNDS[f"corollary2_{variant}"].evaluate_float(
            d=d, k=k, eta=eta, L=L, M=M, B=B, f0_minus_fstar=F, theta=theta, T=T)
        assert on <= cor2 * (1 + 1e-9) + 1e-300


def test_schedule_functions_reject_bad_input():
    with pytest.raises(SparsimError, match="variant"):
        theorem1_on_schedule([0.1], 1.0, 1.0, 1, 1.0, 0.5, 0.1, variant="paper")
    with pytest.raises(SparsimError, match=r"alphas\[1\] = -0.1"):
        theorem1_on_schedule([0.1, -0.1], 1.0, 1.0, 1, 1.0, 0.5, 0.1)
    with pytest.raises(SparsimError, match="len"):
        theorem1_on_schedule([], 1.0, 1.0, 1, 1.0, 0.5, 0.1)
    with pytest.raises(SparsimError, match="gamma = 1.0"):
        lemma2_unrolled_schedule([0.1], [1.0], 1.0, 0.1)
    with pytest.raises(SparsimError, match="eta = 0.0"):
        lemma2_unrolled_schedule([0.1], [1.0], 0.5, 0.0)
    with pytest.raises(SparsimError, match="len"):
        lemma2_unrolled_schedule([0.1, 0.2], [1.0], 0.5, 0.1)
    with pytest.raises(SparsimError, match="tau = -0.5"):
        condition18_D([0.1], -0.5)
    assert lemma2_unrolled_schedule([], [], 0.5, 0.1) == 0.0


# ---------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------

_COR2_BASE = dict(d=1000, k=10, eta=0.005, L=1.0, M=1.0, B=64, f0_minus_fstar=1.0, theta=0.5, T=1000)


@settings(deadline=None)
@given(d=st.integers(1, 10**6), extra=st.integers(1, 10**6))
def test_k_greater_than_d_rejected(d, extra):
    k = d + extra
    with pytest.raises(SparsimError, match=rf"k = {k} is out of range"):
        BOUNDS["corollary2_published"].evaluate(**{**_COR2_BASE, "d": d, "k": k})


@settings(deadline=None)
@given(d=st.integers(2, 10**6), data=st.data())
def test_eta_outside_range_rejected(d, data):
    k = data.draw(st.integers(1, d - 1))
    hi = k / (d - k)
    edge = hi  # smallest float with eta * (d-k) >= k: the first eta the float check rejects
    while edge * (d - k) < k:
        edge = math.nextafter(edge, math.inf)
    eta = data.draw(st.one_of(st.just(0.0), pos(-1e3, 0.0), st.just(edge), pos(hi * 1.000001, hi * 1e3 + 1)))
    for name in ("corollary2_published", "corollary2_corrected", "theorem1_corrected", "corollary1_published"):
        b = BOUNDS[name]
        base = {"d": d, "k": k, "eta": eta, "L": 1.0, "M": 1.0, "B": 4, "f0_minus_fstar": 1.0, "theta": 1.0,
                "T": 10, "D": 1.0, "S1": 1.0, "S2": 1.0, "alpha": 0.1, "t": 3}
        with pytest.raises(SparsimError) as ei:
            b.evaluate(**{p: base[p] for p in b.params})
        msg = str(ei.value)
        assert f"eta = {float(eta)!r}" in msg
        assert "\n" not in msg


@settings(deadline=None)
@given(theta=st.one_of(st.just(0.0), pos(-1e6, 0.0)))
def test_theta_not_positive_rejected(theta):
    for name in ("corollary2_published", "corollary2_c_corrected", "corollary2_opt_eta_published"):
        b = BOUNDS[name]
        base = {**_COR2_BASE, "c": 100.0, "theta": theta}
        with pytest.raises(SparsimError, match=f"theta = {float(theta)!r} is out of range"):
            b.evaluate_float(**{p: base[p] for p in b.params})


@settings(deadline=None)
@given(T=st.integers(-10**6, 0))
def test_T_below_one_rejected(T):
    for name in ("corollary2_corrected", "memsgd_theorem24"):
        b = BOUNDS[name]
        base = {**_COR2_BASE, "T": T, "a": 700.0, "G": 1.0, "mu": 0.1, "x0_minus_xstar_sq": 1.0, "alpha_m": 5.0,
                "d": 100, "k": 1}
        with pytest.raises(SparsimError, match=f"T = {T} is out of range"):
            b.evaluate(**{p: base[p] for p in b.params})


def test_other_validation_messages():
    b = BOUNDS["corollary2_published"]
    for key, bad in [("T", 2.5), ("L", 0.0), ("L", float("inf")), ("M", -1.0), ("B", 0), ("theta", float("nan")),
                     ("d", True)]:
        with pytest.raises(SparsimError, match=f"{key} = "):
            b.evaluate(**{**_COR2_BASE, key: bad})
    with pytest.raises(SparsimError, match="unknown parameter.*valid parameters: d, k, eta"):
        b.evaluate(**_COR2_BASE, foo=1)
    with pytest.raises(SparsimError, match="missing parameter.*theta"):
        b.evaluate(**{k_: v for k_, v in _COR2_BASE.items() if k_ != "theta"})
    with pytest.raises(SparsimError, match="c = 1.0"):
        BOUNDS["corollary2_opt_eta_corrected"].evaluate(c=1.0, L=1.0, M=1.0, B=1, f0_minus_fstar=1.0, theta=1.0, T=1)
    # k = d is allowed where gamma = 0 makes sense: the compression terms vanish
    e = BOUNDS["corollary2_published"].evaluate(**{**_COR2_BASE, "k": 1000, "eta": 5.0})
    e0 = BOUNDS["corollary2_c_published"].evaluate(c=1.0, L=1.0, M=1.0, B=64, f0_minus_fstar=1.0, theta=0.5, T=1000)
    assert math.isclose(e, e0, rel_tol=1e-12)


def test_memsgd_validation():
    base = dict(d=100, k=10, T=100, a=70.0, G=1.0, mu=0.1, L=1.0, x0_minus_xstar_sq=1.0, alpha_m=5.0)
    b = BOUNDS["memsgd_theorem24"]
    assert b.evaluate(**base) > 0
    with pytest.raises(SparsimError, match="alpha_m = 4.0 is out of range: valid 4 < alpha_m"):
        b.evaluate(**{**base, "alpha_m": 4.0})
    with pytest.raises(SparsimError, match="a = 1.0 is out of range"):
        b.evaluate(**{**base, "a": 1.0})
    with pytest.raises(SparsimError, match=r"a = 50.0 is out of range: valid \(alpha_m\+1\)\*d/k.*alpha_m = 5.0, d = 100, k = 10"):
        b.evaluate(**{**base, "a": 50.0})
    with pytest.raises(SparsimError, match="L = 0.05 is out of range: valid mu <= L"):
        b.evaluate(**{**base, "L": 0.05})
    lem = BOUNDS["memsgd_lemma32"]
    v = lem.evaluate(d=100, k=10, t=0, a=70.0, G=1.0, mu=0.1, alpha_m=5.0)
    assert math.isclose(v, (8 / (0.1 * 70.0)) ** 2 * 20 * 100, rel_tol=1e-12)  # = 20 eta_t^2 d^2 G^2/k^2


# ---------------------------------------------------------------------------------------------------
# ordering: published < corrected
# ---------------------------------------------------------------------------------------------------


@settings(deadline=None)
@given(d=st.integers(2, 10**6), data=st.data(), B=st.integers(2, 100_000), M=pos(1e-3, 1e3), L=pos(1e-3, 1e3),
       theta=pos(1e-3, 1e2), T=st.integers(1, 10**7), F=pos(0.0, 1e3), c=pos(1.0 + 1e-6, 1e4))
def test_corollary2_published_below_corrected(d, data, B, M, L, theta, T, F, c):
    k = data.draw(st.integers(1, d - 1))
    eta = data.draw(pos(0.01, 0.99)) * k / (d - k)
    common = dict(L=L, M=M, B=B, f0_minus_fstar=F, theta=theta, T=T)
    pairs = [("corollary2", dict(d=d, k=k, eta=eta, **common)),
             ("corollary2_c", dict(c=c, **common)),
             ("corollary2_opt_eta", dict(c=c, **common))]
    for stem, kw in pairs:
        pub, cor = BOUNDS[f"{stem}_published"], BOUNDS[f"{stem}_corrected"]
        assert pub.evaluate(**kw) <= cor.evaluate(**kw)
        # strict, in exact arithmetic (float rounding may hide a tiny difference)
        v = pub.validate(kw)
        subs = {SYMBOLS[n]: (sp.Integer(x) if isinstance(x, int) else sp.Float(x, 60)) for n, x in v.items()}
        diff = (cor.expanded - pub.expanded).xreplace(subs).evalf(50)
        assert diff > 0


def test_corollary2_difference_has_factor_B_minus_1():
    diff = sp.factor(sp.simplify(BOUNDS["corollary2_corrected"].expr - BOUNDS["corollary2_published"].expr))
    assert sp.simplify(diff.subs(sy.B, 1)) == 0


# ---------------------------------------------------------------------------------------------------
# CLI helpers
# ---------------------------------------------------------------------------------------------------


def test_cli_list_and_show():
    names = cli_support.list_bounds()
    assert names == sorted(BOUNDS)
    for name in names:
        text = cli_support.show(name)
        b = BOUNDS[name]
        assert text.startswith(name)
        assert b.source in text and b.latex() in text and b.text() in text
        for p in b.params:
            assert p in text
    with pytest.raises(SparsimError, match="valid names are .*lemma1"):
        cli_support.show("lemma3")


def test_cli_evaluate():
    got = cli_support.evaluate("corollary2_c_published",
                               {"c": "100", "L": "1", "M": "2.5", "B": "64", "f0_minus_fstar": "1e-1",
                                "theta": "0.5", "T": "1000"})
    want = BOUNDS["corollary2_c_published"].evaluate(c=100, L=1, M=2.5, B=64, f0_minus_fstar=0.1, theta=0.5, T=1000)
    assert got == want
    got2 = cli_support.evaluate("lemma1", ["d=10", "k = 3", "S=2"])
    assert math.isclose(got2, 0.7 * 2, rel_tol=1e-15)
    with pytest.raises(SparsimError, match="unknown parameter.*zeta.*valid parameters: d, k, S"):
        cli_support.evaluate("lemma1", {"d": "10", "k": "3", "S": "2", "zeta": "1"})
    with pytest.raises(SparsimError, match="missing parameter.*k, S"):
        cli_support.evaluate("lemma1", {"d": "10"})
    with pytest.raises(SparsimError, match="d = 'ten' is not a number"):
        cli_support.evaluate("lemma1", {"d": "ten", "k": "3", "S": "2"})
    with pytest.raises(SparsimError, match="k = 11 is out of range"):
        cli_support.evaluate("lemma1", {"d": "10", "k": "11", "S": "2"})
    with pytest.raises(SparsimError, match="valid names are"):
        cli_support.evaluate("nope", {})
    with pytest.raises(SparsimError, match="malformed"):
        cli_support.parse_assignments(["d10"])
    with pytest.raises(SparsimError, match="twice"):
        cli_support.parse_assignments(["d=10", "d=11"])
