"""Sympy symbols of the convergence bounds, with their meaning, units and defining relations.

Two papers share one namespace here:

- gTop-k paper: S. Shi, K. Zhao, Q. Wang, Z. Tang, X. Chu, "A Convergence Analysis of Distributed SGD
  with Communication-Efficient Gradient Sparsification", IJCAI 2019 (seed ``000``; restated in
  ``docs/theory.md`` sections 4-5). Symbols: ``P, d, k, c, gamma, eta, tau, L, M, B, T, theta, delta,
  f0_minus_fstar, D, alpha, S, E_t, G2, m2, S1, S2, t``.
- Mem-SGD: S. U. Stich, J.-B. Cordonnier, M. Jaggi, "Sparsified SGD with Memory", NeurIPS 2018
  (seed ``002``; docs/theory.md section 6). Symbols: ``mu, G, a, alpha_m, rho, eta_t, S_T,
  x0_minus_xstar_sq`` (plus ``d, k, L, T, t`` shared with the above). ``alpha_m`` is Mem-SGD's
  alpha (> 4), not a step size; ``eta_t`` is Mem-SGD's step size, not the Young parameter ``eta``.

Derived symbols (``c, gamma, tau, rho, eta_t, S_T``) appear in displayed expressions for
readability; :data:`DEFINITIONS` gives their definition in terms of primary symbols and
:func:`expand_definitions` substitutes them.
"""
from __future__ import annotations

import sympy as sp

# --- gTop-k paper (Shi et al., IJCAI 2019) -------------------------------------------------------
P = sp.Symbol("P", positive=True, integer=True)
d = sp.Symbol("d", positive=True, integer=True)
k = sp.Symbol("k", positive=True, integer=True)
c = sp.Symbol("c", positive=True)
gamma = sp.Symbol("gamma", nonnegative=True)
eta = sp.Symbol("eta", positive=True)
tau = sp.Symbol("tau", nonnegative=True)
L = sp.Symbol("L", positive=True)
M = sp.Symbol("M", nonnegative=True)
B = sp.Symbol("B", positive=True, integer=True)
T = sp.Symbol("T", positive=True, integer=True)
t = sp.Symbol("t", nonnegative=True, integer=True)
theta = sp.Symbol("theta", positive=True)
delta = sp.Symbol("delta", nonnegative=True)
f0_minus_fstar = sp.Symbol("f0_minus_fstar", nonnegative=True)
D = sp.Symbol("D", nonnegative=True)
alpha = sp.Symbol("alpha", positive=True)
S = sp.Symbol("S", nonnegative=True)
E_t = sp.Symbol("E_t", nonnegative=True)
G2 = sp.Symbol("G2", nonnegative=True)
m2 = sp.Symbol("m2", nonnegative=True)
S1 = sp.Symbol("S1", positive=True)
S2 = sp.Symbol("S2", positive=True)

# --- Mem-SGD (Stich et al., 2018) -----------------------------------------------------------------
mu = sp.Symbol("mu", positive=True)
G = sp.Symbol("G", nonnegative=True)
a = sp.Symbol("a", positive=True)
alpha_m = sp.Symbol("alpha_m", positive=True)
rho = sp.Symbol("rho", positive=True)
eta_t = sp.Symbol("eta_t", positive=True)
S_T = sp.Symbol("S_T", positive=True)
x0_minus_xstar_sq = sp.Symbol("x0_minus_xstar_sq", nonnegative=True)

#: Every symbol by name.
SYMBOLS: dict[str, sp.Symbol] = {
    s.name: s
    for s in (
        P, d, k, c, gamma, eta, tau, L, M, B, T, t, theta, delta, f0_minus_fstar, D, alpha, S, E_t,
        G2, m2, S1, S2, mu, G, a, alpha_m, rho, eta_t, S_T, x0_minus_xstar_sq,
    )
}

#: Meaning and unit of each symbol ("1" = dimensionless; [f] = unit of the objective value,
#: [x] = unit of a parameter coordinate, [g] = unit of a gradient coordinate = [f]/[x]).
DESCRIPTIONS: dict[str, str] = {
    "P": "number of workers (integer >= 1)",
    "d": "number of model parameters, the vector dimension (integer >= 1)",
    "k": "number of coordinates kept by Top-k / gTop-k / comp_k (integer, 1 <= k <= d)",
    "c": "compression ratio d/k (1, >= 1)",
    "gamma": "contraction factor 1 - k/d = 1 - 1/c (1, in [0, 1))",
    "eta": "Young's-inequality parameter of Lemma 2 (1, > 0; Theorem 1 needs eta < k/(d-k))",
    "tau": "gamma*(1+eta), decay rate of the residual recursion (1; < 1 needed by Theorem 1)",
    "L": "smoothness constant of f ([g]/[x], > 0)",
    "M": "bound on the per-sample gradient norm, E||G^(i)(x)||^2 <= M^2 ([g], >= 0)",
    "B": "global mini-batch size P*b (samples, integer >= 1)",
    "T": "number of iterations (integer >= 1)",
    "t": "iteration index (integer >= 0)",
    "theta": "step-size constant of Corollary 2, alpha = theta*sqrt(B/T) ([x]/[g], > 0)",
    "delta": "measured Assumption-1 ratio ||sum x_p - gTopK(x)||^2 / (gamma ||sum x_p||^2) (1, >= 0)",
    "f0_minus_fstar": "initial sub-optimality f(x_0) - f* ([f], >= 0)",
    "D": "constant of condition (18) on the step schedule ([x]/[g], >= 0)",
    "alpha": "step size (learning rate) alpha_t of gTop-k S-SGD ([x]/[g], > 0)",
    "S": "||sum_p x_p||^2, squared norm of the summed accumulators ([x]^2, >= 0)",
    "E_t": "||eps_t||^2, squared norm of the averaged residual ([x]^2, >= 0)",
    "G2": "||G_{t+1}||^2, squared norm of the averaged stochastic gradient ([g]^2, >= 0)",
    "m2": "bound on the second moment E||G_t||^2 of the averaged gradient ([g]^2, >= 0)",
    "S1": "sum_t alpha_t over the T steps ([x]/[g], > 0)",
    "S2": "sum_t alpha_t^2 over the T steps (([x]/[g])^2, > 0)",
    "mu": "strong-convexity constant of f (Mem-SGD) ([g]/[x], > 0)",
    "G": "Mem-SGD gradient bound, E||grad f_i(x_t)||^2 <= G^2 ([g], >= 0)",
    "a": "Mem-SGD step-size shift, eta_t = 8/(mu (a+t)) (iterations, > 1)",
    "alpha_m": "Mem-SGD's alpha of Theorem 2.4 / Lemma 3.2 (1, > 4)",
    "rho": "Mem-SGD's rho = 4 alpha_m / ((alpha_m-4)(alpha_m+1)^2) (1, > 0)",
    "eta_t": "Mem-SGD step size 8/(mu (a+t)) ([x]/[g])",
    "S_T": "Mem-SGD weight sum sum_{t=0}^{T-1} (a+t)^2 (iterations^2)",
    "x0_minus_xstar_sq": "||x_0 - x*||^2, squared initial distance to the minimiser ([x]^2, >= 0)",
}

#: LaTeX names used by :func:`sympy.latex` (``symbol_names=LATEX_NAMES``).
LATEX_NAMES: dict[sp.Symbol, str] = {
    f0_minus_fstar: r"\left(f(x_0) - f^{*}\right)",
    S: r"\left\|\textstyle\sum_p x_p\right\|^2",
    E_t: r"\|\epsilon_t\|^2",
    G2: r"\|G_{t+1}\|^2",
    m2: r"m_2",
    S1: r"\textstyle\sum_t \alpha_t",
    S2: r"\textstyle\sum_t \alpha_t^2",
    alpha_m: r"\alpha_{\mathrm{m}}",
    eta_t: r"\eta_t",
    S_T: r"S_T",
    x0_minus_xstar_sq: r"\|x_0 - x^{*}\|^2",
}

#: Definitions of the derived symbols, in the order :func:`expand_definitions` applies them.
DEFINITIONS: dict[sp.Symbol, sp.Expr] = {
    tau: gamma * (1 + eta),
    gamma: 1 - k / d,
    c: d / k,
    eta_t: 8 / (mu * (a + t)),
    S_T: T / 6 * (2 * T**2 + 6 * a * T - 3 * T + 6 * a**2 - 6 * a + 1),
    rho: 4 * alpha_m / ((alpha_m - 4) * (alpha_m + 1) ** 2),
}


def expand_definitions(expr: sp.Expr, names: tuple[str, ...] | None = None) -> sp.Expr:
    """Substitute the derived symbols of :data:`DEFINITIONS` by their definitions.

    Source: docs/theory.md sections 4-6 (gamma = 1 - k/d and tau = gamma(1+eta) from Lemma 2 of the
    gTop-k paper, IJCAI 2019; eta_t, S_T and rho from Theorem 2.4 of Stich et al. 2018).

    ``expr``: a sympy expression. ``names``: the derived symbols to expand (e.g. ``("tau",)`` to
    replace only tau by gamma*(1+eta)); None expands all of them, in dependency order, so the result
    contains only primary symbols.

    Raises :class:`sim.base.errors.SparsimError` for a name that is not a derived symbol.
    """
    from sim.base.errors import SparsimError

    valid = [s.name for s in DEFINITIONS]
    if names is None:
        chosen = list(DEFINITIONS)
    else:
        for n in names:
            if n not in valid:
                raise SparsimError(f"derived symbol {n!r} is unknown: valid names are {', '.join(valid)}")
        chosen = [s for s in DEFINITIONS if s.name in names]
    out = sp.sympify(expr)
    for sym in chosen:
        out = out.xreplace({sym: DEFINITIONS[sym]})
    return out
