r"""Finite-sum objectives f(x) = (1/n) sum_i f_i(x), x a float64 (or float32, :meth:`Objective.astype`) vector (d,).

Layer: bottom (``objectives and data``); imports only ``sim.base.errors`` and ``sim.workloads.data``.

Every objective exposes the full loss and gradient, the MEAN gradient / loss over a batch of sample
indices, per-sample gradient norms, a default start point, and the constants the convergence bounds of
docs/theory.md need (section 4: L-smoothness, per-sample second-moment bound M^2, and a lower bound on
f* = inf f), each labelled ``analytic`` (a proven bound evaluated on the instance), ``estimated``
(measured, not a proof) or ``unknown``.

Objectives (see :data:`OBJECTIVES`, build with :func:`make_objective`):

- ``sines``            synthetic non-convex: f_i(x) = sum_j [lam_j x_j^2/2 + a cos x_j] + <xi_i, x>.
- ``double_well``      synthetic non-convex: f_i(x) = sum_j [lam_j x_j^2/2 - a x_j^2/(1+x_j^2)] + <xi_i, x>
                       (cheaper than ``sines`` at d = 10^6; f* known in closed form).
- ``robust_regression`` synthetic non-convex: f_i(x) = phi(a_i^T x - y_i), phi(r) = r^2/(1+r^2)
                       (Geman-McClure), a_i sparse with a fixed number of non-zeros.
- ``logistic``         binary logistic regression on a :class:`sim.workloads.data.Dataset` with the non-convex
                       regulariser lam sum_j x_j^2/(1+x_j^2) plus mu/2 ||x||^2.
- ``softmax``          multinomial logistic regression, same regularisers.

All arithmetic is float64 and deterministic (fixed-order numpy reductions, ``np.bincount``; dense data
use BLAS matrix-vector products as numpy does). :meth:`Objective.astype` gives the same objective computing
in float32 (its data rounded once to float32; the constants stay those of the float64 instance).

Batched gradients: :meth:`Objective.batch_grads` returns the P workers' mini-batch gradients of one iteration
(all at the same point x, as in synchronous S-SGD) as one ``(P, d)`` array whose row p has the same bits as
``batch_grad(x, idxs[p])``. The overrides stack the workers' samples and make per worker the same BLAS call
as the per-worker path (``np.matmul`` on a stack calls BLAS once per matrix with that matrix's shape and
strides), the same elementwise operations and the same reductions (``np.bincount`` with the workers' bins
offset by p d); the work shared by all workers (the separable objectives' g'(lam, x), the regulariser's
gradient) is done once. Sparse (CSR) data keep the per-worker loop: scipy's CSC-times-dense product has no
stacked form with the same summation order. :meth:`Objective.loss_and_grad` evaluates f and grad f sharing
their common work (scores, margins, residuals), with the bits of ``loss`` and ``full_grad``.
"""
from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING

import numpy as np

from sim.workloads.data import Dataset, issparse, load_dataset
from sim.base.errors import ConfigError, SparsimError, range_text

if TYPE_CHECKING:
    import scipy.sparse as sp

__all__ = [
    "Objective",
    "SinesObjective",
    "DoubleWellObjective",
    "RobustRegressionObjective",
    "LogisticObjective",
    "SoftmaxObjective",
    "OBJECTIVES",
    "make_objective",
    "GM_DPSI_MAX",
]

#: max_t |psi'(t)| for psi(t) = t^2/(1+t^2): psi'(t) = 2t/(1+t^2)^2 peaks at t^2 = 1/3 with 3 sqrt(3)/8.
GM_DPSI_MAX = 3.0 * math.sqrt(3.0) / 8.0
#: psi''(t) = (2 - 6t^2)/(1+t^2)^3 lies in [-1/2, 2] (min at t^2 = 1, max at t = 0), so |psi''| <= 2.
GM_D2PSI_MAX = 2.0


# ----------------------------------------------------------------------------------------------- helpers
def _psi(t):
    """Geman-McClure psi(t) = t^2/(1+t^2), elementwise, in [0, 1)."""
    t2 = t * t
    return t2 / (1.0 + t2)


def _dpsi(t):
    """psi'(t) = 2t/(1+t^2)^2, elementwise; |psi'| <= 3 sqrt(3)/8."""
    den = t * t
    den += 1.0
    np.square(den, out=den)
    return 2.0 * t / den


def constant_record(value, how: str, note: str) -> dict:
    """One entry of :meth:`Objective.constants`: ``{"value": float or None, "how": how, "note": note}``
    (how: e.g. "closed form", "measured", "unknown"; note: one line saying where the value comes from)."""
    return {"value": None if value is None else float(value), "how": how, "note": note}


def _int_param(name: str, value, lo=None, hi=None) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{name} = {value!r} must be an integer")
    try:
        v = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} = {value!r} must be an integer") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ConfigError(_range_msg(name, v, lo, hi))
    return v


def _float_param(name: str, value, lo=None, hi=None) -> float:
    if isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{name} = {value!r} must be a real number")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} = {value!r} must be a real number") from None
    if not math.isfinite(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ConfigError(_range_msg(name, value, lo, hi))
    return v


def _range_msg(name, value, lo, hi) -> str:
    return f"{name} = {value!r} is out of range: valid {range_text(name, lo, hi)}"


def _lmax_gram(X) -> tuple[float, str, str]:
    """lambda_max(X^T X / n) for a dense or CSR ``X`` (n, p); returns (value, how, note).

    Exact symmetric eigensolver on the smaller Gram matrix when cheap (value times 1 + 1e-12 to cover
    rounding: ``analytic``); otherwise Lanczos (ARPACK eigsh, deterministic start, tol 1e-10, value times
    1 + 1e-8: ``estimated``, since a Ritz value approaches lambda_max from below).
    """
    n, p = X.shape
    m = min(n, p)
    sparse = issparse(X)
    cheap = m <= 4000 and (sparse or n * p * m <= 4e9)
    if cheap:
        G = (X.T @ X) if p <= n else (X @ X.T)
        G = G.toarray() if issparse(G) else np.asarray(G)
        lmax = float(np.linalg.eigvalsh(G)[-1]) / n if m > 0 else 0.0
        return max(lmax, 0.0) * (1.0 + 1e-12), "analytic", "exact eigensolver on the Gram matrix"
    from scipy.sparse.linalg import LinearOperator, eigsh

    op = LinearOperator((p, p), matvec=lambda v: X.T @ (X @ np.ravel(v)), dtype=np.float64)
    v0 = np.random.default_rng(0).standard_normal(p)
    lmax = float(eigsh(op, k=1, which="LA", tol=1e-10, v0=v0, return_eigenvectors=False)[0]) / n
    return max(lmax, 0.0) * (1.0 + 1e-8), "estimated", "Lanczos (ARPACK) Ritz value, tol 1e-10"


def _row_sq_norms(X) -> np.ndarray:
    if issparse(X):
        return np.asarray(X.multiply(X).sum(axis=1), dtype=np.float64).ravel()
    return np.einsum("ij,ij->i", X, X)


def expit(x: np.ndarray) -> np.ndarray:
    """The logistic sigmoid 1 / (1 + exp(-x)), elementwise, same shape and dtype: ``scipy.special.expit`` (its
    bits), imported on first use so that runs without a logistic objective do not import scipy."""
    from scipy.special import expit as _expit

    return _expit(x)


# ----------------------------------------------------------------------------------------------- base


class Objective:
    """Base class of a finite sum f(x) = (1/n) sum_i f_i(x), x ndarray ``(d,)`` of :attr:`dtype` (float64 unless cast
    by :meth:`astype`; "float64" in the method docs below means that dtype).

    Attributes: ``name`` (registry name, str), ``d`` (parameters, int), ``n`` (samples, int),
    ``params`` (dict of the construction parameters).

    Subclasses implement :meth:`loss`, :meth:`full_grad`, :meth:`batch_grad`, :meth:`batch_loss`,
    :meth:`constants`, :meth:`x0` and usually a fast :meth:`sample_grad_norms`. Every method taking
    ``x`` raises :class:`SparsimError` unless ``x`` has shape ``(d,)``; every method taking ``idx``
    raises it unless ``idx`` is a non-empty 1-D integer array with entries in ``0..n-1`` (repeats
    allowed: the batch is a multiset).
    """

    name: str = "objective"
    d: int = 0
    n: int = 0
    params: dict
    #: the arithmetic dtype (float64, or float32 from :meth:`astype`): points, gradients and data use it
    dtype: np.dtype = np.dtype(np.float64)
    #: the attributes holding the float arrays the arithmetic reads; :meth:`astype` casts them
    _ARITH_ARRAYS: tuple[str, ...] = ()
    #: whether :meth:`batch_grads` and :meth:`loss_and_grad` share work at one point through a ``scratch`` dict
    shares_point_work: bool = False

    def astype(self, dtype) -> "Objective":
        """This objective computing in ``dtype`` (``"float64"`` or ``"float32"``): self for its own dtype, else a
        copy whose arithmetic arrays (:attr:`_ARITH_ARRAYS`) are rounded once to ``dtype`` and whose methods take
        and return ``dtype`` arrays (losses stay Python floats). The copy's :meth:`constants` are those of this
        float64 instance (computed here, before the cast). Raises ConfigError for another dtype."""
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.float64), np.dtype(np.float32)):
            raise ConfigError(f"dtype = {dtype!r} is unknown: valid float64, float32")
        if dt == self.dtype:
            return self
        import copy

        consts = self.constants()
        new = copy.copy(self)
        new.dtype = dt
        for name in self._ARITH_ARRAYS:
            arr = getattr(self, name)
            if issparse(arr):
                arr = arr.astype(dt)
            elif isinstance(arr, np.ndarray) and np.issubdtype(arr.dtype, np.floating):
                arr = arr.astype(dt)
            setattr(new, name, arr)
        new._consts = consts
        return new

    # -- validation
    def _check_x(self, x) -> np.ndarray:
        x = np.asarray(x, dtype=self.dtype)
        if x.shape != (self.d,):
            raise SparsimError(f"x has shape {x.shape}: valid shape is ({self.d},) for objective {self.name!r}")
        return x

    def _check_idx(self, idx) -> np.ndarray:
        idx = np.asarray(idx)
        if idx.ndim != 1 or idx.size == 0 or not np.issubdtype(idx.dtype, np.integer):
            raise SparsimError(
                f"idx has shape {idx.shape} dtype {idx.dtype}: valid is a non-empty 1-D integer array"
            )
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self.n:
            bad = lo if lo < 0 else hi
            raise SparsimError(f"sample index {bad} is out of range: valid 0 <= index <= {self.n - 1}")
        return idx.astype(np.int64, copy=False)

    def _check_idxs(self, idxs) -> np.ndarray:
        """``idxs`` (P workers' batches: a sequence of P equal-length 1-D integer arrays, or a ``(P, b)`` integer
        array) as an int64 array ``(P, b)``; SparsimError as :meth:`_check_idx` and unless P >= 1 batches of one
        length b >= 1."""
        try:
            arr = np.asarray(idxs) if isinstance(idxs, np.ndarray) else np.stack([np.asarray(i) for i in idxs])
        except ValueError:
            raise SparsimError(f"idxs holds batches of sizes {sorted({np.size(i) for i in idxs})}: valid P >= 1 "
                               "batches of one size b >= 1") from None
        if arr.ndim != 2 or arr.size == 0:
            raise SparsimError(f"idxs has shape {arr.shape}: valid (P, b) with P, b >= 1 (P workers' batches)")
        return self._check_idx(arr.ravel()).reshape(arr.shape)

    # -- interface
    def loss(self, x: np.ndarray) -> float:
        """Full objective f(x) = (1/n) sum_i f_i(x) (regularisation included); float."""
        raise NotImplementedError

    def full_grad(self, x: np.ndarray) -> np.ndarray:
        """grad f(x), float64 ndarray ``(d,)``."""
        raise NotImplementedError

    def batch_grad(self, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """MEAN of grad f_i(x) over the int64 indices ``idx`` ``(b,)``; float64 ndarray ``(d,)``.

        The mean of P equal-size batch means equals the mean over their union up to float rounding.
        """
        raise NotImplementedError

    def batch_loss(self, x: np.ndarray, idx: np.ndarray) -> float:
        """MEAN of f_i(x) over the int64 indices ``idx`` ``(b,)``; float."""
        raise NotImplementedError

    def batch_grads(self, x: np.ndarray, idxs, scratch: dict | None = None) -> np.ndarray:
        """The P workers' mini-batch gradients at one point: array ``(P, d)`` of :attr:`dtype` whose row p has
        the bits of ``batch_grad(x, idxs[p])``.

        idxs: P batches of one size b (a sequence of int arrays ``(b,)`` or an int array ``(P, b)``). scratch:
        a dict the caller keeps for this one point x (see :attr:`shares_point_work`), or None. This fallback
        calls :meth:`batch_grad` per worker; subclasses vectorise it (module docstring).
        """
        x = self._check_x(x)
        idxs = self._check_idxs(idxs)
        out = np.empty((idxs.shape[0], self.d), dtype=self.dtype)
        for p in range(idxs.shape[0]):
            out[p] = self.batch_grad(x, idxs[p])
        return out

    def loss_and_grad(self, x: np.ndarray, scratch: dict | None = None) -> tuple[float, np.ndarray]:
        """(:meth:`loss`, :meth:`full_grad`) at x with their bits, sharing their common work; scratch as in
        :meth:`batch_grads` (the gradient may then be a read-only array kept in it)."""
        return self.loss(x), self.full_grad(x)

    def constants(self) -> dict:
        """Constants for the bounds of docs/theory.md section 4, as ``{key: {"value", "how", "note"}}``.

        Keys: ``"L"`` (smoothness constant valid for f AND every f_i), ``"M"`` (bound on the per-sample
        gradient norm ||grad f_i(x)||, so M^2 bounds the second moment; ``None`` when unbounded on R^d),
        ``"f_star_lower"`` (certified lower bound on inf f), and ``"L_f"`` (a smoothness constant of f
        alone, possibly smaller than ``"L"``). ``value`` is float or None; ``how`` is ``"analytic"``,
        ``"estimated"`` or ``"unknown"``; ``note`` gives the formula and source.
        """
        raise NotImplementedError

    def x0(self, seed: int = 0) -> np.ndarray:
        """Default start point, float64 ndarray ``(d,)``."""
        raise NotImplementedError

    def sample_grad_norms(self, x: np.ndarray) -> np.ndarray:
        """||grad f_i(x)|| for every sample i, float64 ndarray ``(n,)``.

        Generic fallback: one :meth:`batch_grad` per sample (O(n * cost)); subclasses override it.
        """
        x = self._check_x(x)
        return np.array([np.linalg.norm(self.batch_grad(x, np.array([i]))) for i in range(self.n)])

    def estimate_M(self, x_samples) -> dict:
        """Estimate M = sup_{x, i} ||grad f_i(x)|| as the max per-sample gradient norm at given points.

        ``x_samples``: a float array ``(m, d)``, a single ``(d,)`` point, or a sequence of ``(d,)`` points.
        Returns ``{"value": float, "how": "estimated", "note": str}`` -- a LOWER estimate of the sup
        (it only sees the given points), not a certified bound. Raises :class:`SparsimError` on a
        wrongly shaped point or an empty sequence.
        """
        pts = [x_samples] if (isinstance(x_samples, np.ndarray) and x_samples.ndim == 1) else list(x_samples)
        if not pts:
            raise SparsimError("x_samples is empty: valid is at least one point of shape (d,)")
        best = max(float(self.sample_grad_norms(self._check_x(p)).max()) for p in pts)
        return constant_record(
            best,
            "estimated",
            f"max over {len(pts)} point(s) and all {self.n} samples of ||grad f_i(x)||; a lower estimate of sup",
        )


# ------------------------------------------------------------------------ separable synthetic objectives
class _SeparableNoisy(Objective):
    r"""f_i(x) = sum_j g(lam_j, x_j) + <xi_i, x>, with sum_i xi_i = 0, so f(x) = sum_j g(lam_j, x_j).

    Spectrum: lam = linspace(lam_min, lam_max, d), permuted by ``default_rng([seed, 11])``.
    Noise: xi_i = (sigma / sqrt(r)) * C_i G with G ``(r, d)`` i.i.d. N(0, 1) (``default_rng([seed, 12])``)
    and C ``(n, r)`` antithetic: C_{m+i} = -C_i for i < m = n // 2 (rows from ``default_rng([seed, 13])``),
    C_{2m} = 0 when n is odd. Hence sum_i xi_i = 0 in exact arithmetic and f has no linear term
    (``full_grad`` and ``loss`` use the noise-free formula); each coordinate of xi_i has variance ~sigma^2.
    A batch gradient costs one elementwise pass plus one (r, d) matrix-vector product; P of them at one point
    (:meth:`batch_grads`) one elementwise pass (shared, and with ``scratch`` shared with :meth:`loss_and_grad`
    at the same point) plus P (r, d) matrix-vector products.
    """

    _cmax = 1.0  # sup_t |d/dt of the non-convex part| / a
    _ARITH_ARRAYS = ("lam", "G", "C")
    shares_point_work = True

    def __init__(self, *, d, n, seed, a, lam_min, lam_max, sigma, r):
        self.d = _int_param("d", d, 1, 10**8)
        self.n = _int_param("n", n, 1, 10**8)
        seed = _int_param("seed", seed, 0)
        self.a = _float_param("a", a, 0.0)
        lam_min = _float_param("lam_min", lam_min, 0.0)
        lam_max = _float_param("lam_max", lam_max, lam_min)
        self.sigma = _float_param("sigma", sigma, 0.0)
        self.r = _int_param("r", r, 1, 64)
        self.params = dict(d=self.d, n=self.n, seed=seed, a=self.a, lam_min=lam_min, lam_max=lam_max,
                           sigma=self.sigma, r=self.r)
        self.lam = np.random.default_rng([seed, 11]).permutation(np.linspace(lam_min, lam_max, self.d))
        self.lam_min, self.lam_max = lam_min, lam_max
        self.G = np.random.default_rng([seed, 12]).standard_normal((self.r, self.d))
        m = self.n // 2
        half = np.random.default_rng([seed, 13]).standard_normal((m, self.r))
        C = np.zeros((self.n, self.r))
        C[:m] = half
        C[m:2 * m] = -half
        self.C = C
        self._scale = self.sigma / math.sqrt(self.r)
        gram = self.G @ self.G.T
        self._xi_sq = self._scale**2 * np.einsum("ik,kl,il->i", C, gram, C)
        self._consts = None

    # coordinate function and its derivative; subclasses
    def _g(self, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def _h(self, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def loss(self, x):
        """f(x) = sum_j g(lam_j, x_j) (the linear noise terms cancel exactly in the mean); float."""
        return float(np.sum(self._g(self._check_x(x))))

    def full_grad(self, x):
        """grad f(x) = (g'(lam_j, x_j))_j, float64 ``(d,)``."""
        return self._h(self._check_x(x))

    def _noise_coef(self, idx):
        return self.C[idx].mean(axis=0)

    def batch_grad(self, x, idx):
        """Mean of grad f_i(x) = g'(lam, x) + xi_i over ``idx``; float64 ``(d,)``."""
        x = self._check_x(x)
        idx = self._check_idx(idx)
        g = self._h(x)
        if self._scale != 0.0:
            c = self._noise_coef(idx) * self._scale
            g += c @ self.G
        return g

    def _h_at(self, x, scratch):
        """g'(lam, x), kept (read-only) in ``scratch`` for the next caller at the same point."""
        if scratch is None:
            return self._h(x)
        h = scratch.get("h")
        if h is None:
            h = scratch["h"] = self._h(x)
            h.flags.writeable = False
        return h

    def batch_grads(self, x, idxs, scratch=None):
        """The P rows ``batch_grad(x, idxs[p])`` (same bits): g'(lam, x) once, the P noise coefficient means in
        one reduction, and the P products c_p G as one ``np.matmul`` of a ``(P, 1, r)`` stack (one BLAS
        vector-matrix product per worker, as ``c @ G``); array ``(P, d)``."""
        x = self._check_x(x)
        idxs = self._check_idxs(idxs)
        h = self._h_at(x, scratch)
        P = idxs.shape[0]
        if self._scale == 0.0:
            out = np.empty((P, self.d), dtype=h.dtype)
            out[:] = h
            return out
        c = self.C[idxs].mean(axis=1)  # (P, r): row p is C[idxs[p]].mean(axis=0)
        c *= self._scale
        out = np.matmul(c[:, None, :], self.G).reshape(P, self.d)
        out += h  # h + noise, as batch_grad's g += c @ G (IEEE addition commutes)
        return out

    def loss_and_grad(self, x, scratch=None):
        """(f(x), grad f(x)) with the bits of :meth:`loss` and :meth:`full_grad`; grad f is the scratch's g'(lam, x)
        (read-only) when ``scratch`` is given."""
        x = self._check_x(x)
        return float(np.sum(self._g(x))), self._h_at(x, scratch)

    def batch_loss(self, x, idx):
        """Mean of f_i(x) over ``idx``: f(x) + <mean xi_i, x>; float."""
        x = self._check_x(x)
        idx = self._check_idx(idx)
        val = float(np.sum(self._g(x)))
        if self._scale != 0.0:
            val += float(self._scale * (self._noise_coef(idx) @ (self.G @ x)))
        return val

    def sample_grad_norms(self, x):
        """||g'(lam, x) + xi_i|| for all i via ||h||^2 + 2<h, xi_i> + ||xi_i||^2; float64 ``(n,)``."""
        h = self._h(self._check_x(x))
        sq = float(h @ h) + 2.0 * self._scale * (self.C @ (self.G @ h)) + self._xi_sq
        return np.sqrt(np.maximum(sq, 0.0))

    def x0(self, seed: int = 0):
        """x0 ~ N(0, I_d) from ``default_rng([seed, 99])`` (x = 0 is a stationary point of f); ``(d,)`` :attr:`dtype`."""
        seed = _int_param("seed", seed, 0)
        return np.random.default_rng([seed, 99]).standard_normal(self.d).astype(self.dtype, copy=False)

    def max_xi_norm(self) -> float:
        """max_i ||xi_i|| (exact, from the r x r Gram matrix of G); float."""
        return float(np.sqrt(max(self._xi_sq.max(), 0.0)))

    def M_on_box(self, R: float) -> float:
        """Analytic M on the box ||x||_inf <= R: sqrt(sum_j (lam_j R + a c)^2) + max_i ||xi_i||.

        c = sup_t |d/dt of the non-convex part| / a (1 for sines, 3 sqrt(3)/8 for double_well).
        Raises :class:`ConfigError` if R < 0.
        """
        R = _float_param("R", R, 0.0)
        return float(np.linalg.norm(self.lam * R + self.a * self._cmax)) + self.max_xi_norm()

    def _M_const(self):
        if self.lam_max == 0.0:
            val = self.a * self._cmax * math.sqrt(self.d) + self.max_xi_norm()
            return constant_record(val, "analytic", "lam = 0: ||grad f_i|| <= a c sqrt(d) + max_i ||xi_i||")
        return constant_record(
            None,
            "unknown",
            "unbounded on R^d (grad grows like lam_j x_j); on ||x||_inf <= R use M_on_box(R) = "
            "sqrt(sum_j (lam_j R + a c)^2) + max_i ||xi_i||, or estimate_M(points)",
        )


class SinesObjective(_SeparableNoisy):
    r"""``sines``: f_i(x) = sum_j [lam_j x_j^2 / 2 + a cos x_j] + <xi_i, x> (see :class:`_SeparableNoisy`).

    Parameters: d (1..1e8), n >= 1, seed >= 0, a >= 0, 0 <= lam_min <= lam_max, sigma >= 0, r in 1..64.

    Derivations (g(t) = lam t^2/2 + a cos t, the same Hessian for every f_i):
    - g''(t) = lam - a cos t in [lam - a, lam + a]; non-convex wherever cos x_j > lam_j / a, e.g. at
      x = 0 for any lam_j < a.
    - L = max_j max(|lam_j - a|, lam_j + a) = lam_max + a (lam, a >= 0); attained at x_j = pi.
      Valid for f and every f_i (the linear terms have zero Hessian).
    - f* = sum_j inf_t g(lam_j, t). Certified lower bound: g is increasing in lam, so coordinates are
      grouped into <= 256 buckets of the sorted spectrum and each bucket uses its smallest lam. For
      lam > 0 the inf lies in |t| <= R = sqrt(4a/lam) (outside, g >= 2a - a = a = g(0)); g is even and
      |g''| <= K = lam + a, so on a grid of step h over [0, R], g >= min(grid values) - K h^2/8
      (linear-interpolation error). lam = 0 gives inf = -a. A 1e-12 relative slack covers rounding.
    - M: unbounded on R^d when lam_max > 0; see :meth:`M_on_box` and :meth:`Objective.estimate_M`.
    Cost at d = 1e6: one np.sin over d entries dominates (~10 ms on a slow core); use ``double_well``
    when that matters.
    """

    name = "sines"
    _cmax = 1.0

    def _g(self, x):
        out = np.cos(x)
        out *= self.a
        q = 0.5 * self.lam  # ((0.5 lam) x) x, evaluated in place
        q *= x
        q *= x
        out += q
        return out

    def _h(self, x):
        out = np.sin(x)
        out *= -self.a
        out += self.lam * x
        return out

    def _f_star_lower(self) -> float:
        a = self.a
        lam_sorted = np.sort(self.lam)
        buckets = np.array_split(lam_sorted, min(self.d, 256))
        lo = np.array([b[0] for b in buckets])
        cnt = np.array([b.size for b in buckets], dtype=np.float64)
        bound = np.empty_like(lo)
        if a == 0.0:
            bound[:] = 0.0  # g = lam t^2/2 >= 0
        else:
            bound[:] = -a
            pos = lo > 0.0
            if pos.any():
                N = 4096
                lp = lo[pos][:, None]
                R = np.sqrt(4.0 * a / lp)
                t = np.linspace(0.0, 1.0, N + 1)[None, :] * R
                vals = 0.5 * lp * t * t + a * np.cos(t)
                h = R[:, 0] / N
                K = lp[:, 0] + a
                lb = vals.min(axis=1) - K * h * h / 8.0 - 1e-12 * (np.abs(vals).max(axis=1) + 1.0)
                bound[pos] = np.maximum(lb, -a)
        total = float(np.sum(cnt * bound))
        return total - 1e-12 * (abs(total) + 1.0)

    def constants(self):
        """L = lam_max + a, M (unknown unless lam_max = 0), certified f* lower bound; see class docstring."""
        if self._consts is None:
            L = float(self.lam.max() + self.a)
            self._consts = {
                "L": constant_record(L, "analytic", "max_j max(|lam_j - a|, lam_j + a) = lam_max + a; g'' = lam - a cos t"),
                "L_f": constant_record(L, "analytic", "f and every f_i share the Hessian diag(lam_j - a cos x_j)"),
                "M": self._M_const(),
                "f_star_lower": constant_record(
                    self._f_star_lower(),
                    "analytic",
                    "certified: sum over lam buckets of a grid minimum minus the interpolation error K h^2/8",
                ),
            }
        return self._consts


class DoubleWellObjective(_SeparableNoisy):
    r"""``double_well``: f_i(x) = sum_j [lam_j x_j^2/2 - a x_j^2/(1 + x_j^2)] + <xi_i, x>.

    Same spectrum / noise construction and parameters as :class:`SinesObjective`, but only rational
    arithmetic (no transcendental function), so a batch gradient at d = 1e6 costs a few passes over d.

    Derivations, with g(t) = lam t^2/2 - a psi(t), psi(t) = t^2/(1+t^2):
    - g'(t) = lam t - a psi'(t), psi'(t) = 2t/(1+t^2)^2, |psi'| <= 3 sqrt(3)/8 (max at t^2 = 1/3).
    - g''(t) = lam - a psi''(t), psi''(t) = (2 - 6t^2)/(1+t^2)^3 in [-1/2, 2] (t = 0 and t^2 = 1), so
      g'' in [lam - 2a, lam + a/2]: non-convex near x_j = 0 whenever lam_j < 2a.
    - L = max_j max(|lam_j - 2a|, lam_j + a/2) (valid for f and every f_i).
    - f* exactly: with s = 1 + t^2 >= 1, g = lam (s-1)/2 + a/s - a is minimised at s* = sqrt(2a/lam)
      when lam <= 2a, giving inf g = -(sqrt(a) - sqrt(lam/2))^2 (lam = 0: -a, approached as t -> inf);
      for lam >= 2a, inf g = g(0) = 0. f* = sum_j inf g_j (exact; minus a 1e-12 relative slack).
    - M: unbounded on R^d when lam_max > 0; see :meth:`M_on_box` and :meth:`Objective.estimate_M`.
    """

    name = "double_well"
    _cmax = GM_DPSI_MAX

    def _g(self, x):
        t2 = x * x
        out = 0.5 * self.lam  # (0.5 lam) t2 - a (t2 / (1 + t2)), evaluated in place (IEEE + and * commute)
        out *= t2
        q = t2 + 1.0
        np.divide(t2, q, out=q)
        q *= self.a
        out -= q
        return out

    def _h(self, x):
        t = x * x
        t += 1.0
        np.square(t, out=t)
        np.divide(x, t, out=t)
        t *= -2.0 * self.a
        t += self.lam * x
        return t

    def constants(self):
        """L = max_j max(|lam_j - 2a|, lam_j + a/2), exact f*, M unknown unless lam_max = 0."""
        if self._consts is None:
            a, lam = self.a, self.lam
            L = float(max(np.abs(lam - 2.0 * a).max(), lam.max() + 0.5 * a))
            inf_g = np.where(lam < 2.0 * a, -(math.sqrt(a) - np.sqrt(lam / 2.0)) ** 2, 0.0)
            fs = float(np.sum(inf_g))
            self._consts = {
                "L": constant_record(L, "analytic", "g'' = lam - a psi'' with psi'' in [-1/2, 2]: max(|lam-2a|, lam+a/2)"),
                "L_f": constant_record(L, "analytic", "f and every f_i share the Hessian"),
                "M": self._M_const(),
                "f_star_lower": constant_record(
                    fs - 1e-12 * (abs(fs) + 1.0),
                    "analytic",
                    "exact inf: sum_j -(sqrt(a) - sqrt(lam_j/2))^2 over lam_j < 2a (attained when all lam_j > 0)",
                ),
            }
        return self._consts


# ------------------------------------------------------------------------------- robust regression
class RobustRegressionObjective(Objective):
    r"""``robust_regression``: f_i(x) = phi(a_i^T x - y_i), phi(r) = r^2/(1+r^2) (Geman-McClure).

    Parameters: d (1..1e8), n >= 1, seed >= 0, nnz (non-zeros per row, 1..d), noise >= 0,
    outlier_frac in [0, 1], outlier_scale >= 0.

    Data (all from ``seed``): each row a_i has exactly ``nnz`` distinct column indices (uniform,
    ``default_rng([seed, 21])``) with values N(0, 1/nnz) (``[seed, 22]``, so ||a_i|| ~ 1); a planted
    x_true ~ N(0, I) (``[seed, 23]``); y_i = a_i^T x_true + noise * N(0,1) (``[seed, 24]``), and a fraction
    ``outlier_frac`` of the y_i (``[seed, 25]``) gets an extra outlier_scale * N(0, 1). Stored as dense
    (n, nnz) index/value arrays (CSR with fixed row length, see :attr:`A`), so a batch gradient costs
    O(b * nnz) plus one zero-filled length-d vector.

    Derivations (Geman & McClure 1987 loss; constants elementary):
    - phi'(r) = 2r/(1+r^2)^2, |phi'| <= 3 sqrt(3)/8; phi''(r) = (2 - 6r^2)/(1+r^2)^3 in [-1/2, 2].
    - Hessian of f_i = phi''(r_i) a_i a_i^T: L = 2 max_i ||a_i||^2 (for every f_i and for f).
    - Hessian of f = (1/n) A^T diag(phi'') A with -A^T A/2 <= . <= 2 A^T A, so L_f = 2 lambda_max(A^T A/n).
    - Non-convex: phi'' < 0 for |r| > 1/sqrt(3) (any x far from x_true).
    - M = (3 sqrt(3)/8) max_i ||a_i|| (||grad f_i|| = |phi'(r_i)| ||a_i||), valid on all of R^d.
    - f* >= 0 (phi >= 0).
    """

    name = "robust_regression"
    _ARITH_ARRAYS = ("vals", "y")

    def __init__(self, *, d, n, seed, nnz, noise, outlier_frac, outlier_scale):
        self.d = d = _int_param("d", d, 1, 10**8)
        self.n = n = _int_param("n", n, 1, 10**8)
        seed = _int_param("seed", seed, 0)
        nnz = _int_param("nnz", nnz, 1, d)
        noise = _float_param("noise", noise, 0.0)
        outlier_frac = _float_param("outlier_frac", outlier_frac, 0.0, 1.0)
        outlier_scale = _float_param("outlier_scale", outlier_scale, 0.0)
        self.params = dict(d=d, n=n, seed=seed, nnz=nnz, noise=noise, outlier_frac=outlier_frac,
                           outlier_scale=outlier_scale)
        rng = np.random.default_rng([seed, 21])
        if n * d <= 2 * 10**7:
            cols = rng.permuted(np.broadcast_to(np.arange(d, dtype=np.int64), (n, d)), axis=1)[:, :nnz]
        else:  # d >> nnz: draw with replacement and redraw rows holding a repeat
            cols = rng.integers(0, d, size=(n, nnz), dtype=np.int64)
            while True:
                s = np.sort(cols, axis=1)
                bad = np.flatnonzero((s[:, 1:] == s[:, :-1]).any(axis=1)) if nnz > 1 else np.array([], int)
                if bad.size == 0:
                    break
                cols[bad] = rng.integers(0, d, size=(bad.size, nnz), dtype=np.int64)
        self.cols = np.ascontiguousarray(np.sort(cols, axis=1))
        self.vals = np.random.default_rng([seed, 22]).standard_normal((n, nnz)) / math.sqrt(nnz)
        self.x_true = np.random.default_rng([seed, 23]).standard_normal(d)
        y = np.einsum("ij,ij->i", self.vals, self.x_true[self.cols])
        y += noise * np.random.default_rng([seed, 24]).standard_normal(n)
        r25 = np.random.default_rng([seed, 25])
        out = r25.random(n) < outlier_frac
        y += np.where(out, outlier_scale * r25.standard_normal(n), 0.0)
        self.y = y
        self.row_sq = np.einsum("ij,ij->i", self.vals, self.vals)
        self._consts = None

    @property
    def A(self) -> sp.csr_matrix:
        """The design matrix as scipy.sparse CSR float64 ``(n, d)`` (built on each access)."""
        nnz = self.cols.shape[1]
        indptr = np.arange(0, self.n * nnz + 1, nnz, dtype=np.int64)
        import scipy.sparse as sp

        return sp.csr_matrix((self.vals.ravel(), self.cols.ravel(), indptr), shape=(self.n, self.d))

    def _resid(self, x, idx=None):
        if idx is None:
            return np.einsum("ij,ij->i", self.vals, x[self.cols]) - self.y
        return np.einsum("ij,ij->i", self.vals[idx], x[self.cols[idx]]) - self.y[idx]

    def _grad(self, x, idx, resid=None):
        cols = self.cols if idx is None else self.cols[idx]
        vals = self.vals if idx is None else self.vals[idx]
        w = _dpsi(self._resid(x, idx) if resid is None else resid) / cols.shape[0]
        # np.bincount sums in float64: a float32 objective rounds the sums once
        return np.bincount(cols.ravel(), weights=(vals * w[:, None]).ravel(),
                           minlength=self.d).astype(self.dtype, copy=False)

    def loss(self, x):
        """f(x) = mean_i phi(a_i^T x - y_i); float in [0, 1)."""
        return float(np.mean(_psi(self._resid(self._check_x(x)))))

    def loss_and_grad(self, x, scratch=None):
        """(f(x), grad f(x)) from one residual vector Ax - y, with the bits of :meth:`loss` and :meth:`full_grad`."""
        x = self._check_x(x)
        r = self._resid(x)
        return float(np.mean(_psi(r))), self._grad(x, None, r)

    def batch_grads(self, x, idxs, scratch=None):
        """The P rows ``batch_grad(x, idxs[p])`` (same bits): the P b residuals in one ``einsum`` over the stacked
        rows, and one ``np.bincount`` whose bins are worker p's coordinates offset by p d, so each bin sums
        the same terms in the same order; array ``(P, d)``."""
        x = self._check_x(x)
        idxs = self._check_idxs(idxs)
        P, b = idxs.shape
        flat = idxs.ravel()
        cols, vals = self.cols[flat], self.vals[flat]  # (P b, nnz), worker by worker
        w = _dpsi(np.einsum("ij,ij->i", vals, x[cols]) - self.y[flat]) / b
        bins = (cols.reshape(P, -1) + (np.arange(P, dtype=np.int64) * self.d)[:, None]).ravel()
        out = np.bincount(bins, weights=(vals * w[:, None]).ravel(), minlength=P * self.d)
        return out.astype(self.dtype, copy=False).reshape(P, self.d)

    def full_grad(self, x):
        """grad f(x) = (1/n) A^T phi'(Ax - y); float64 ``(d,)``."""
        return self._grad(self._check_x(x), None)

    def batch_grad(self, x, idx):
        """Mean over ``idx`` of phi'(a_i^T x - y_i) a_i; float64 ``(d,)`` (non-zero on <= b*nnz coordinates)."""
        return self._grad(self._check_x(x), self._check_idx(idx))

    def batch_loss(self, x, idx):
        """Mean over ``idx`` of phi(a_i^T x - y_i); float."""
        return float(np.mean(_psi(self._resid(self._check_x(x), self._check_idx(idx)))))

    def sample_grad_norms(self, x):
        """|phi'(r_i)| ||a_i|| for all i; float64 ``(n,)``."""
        return np.abs(_dpsi(self._resid(self._check_x(x)))) * np.sqrt(self.row_sq)

    def x0(self, seed: int = 0):
        """x0 ~ N(0, I_d) from ``default_rng([seed, 99])`` (independent of x_true); ``(d,)`` of :attr:`dtype`."""
        seed = _int_param("seed", seed, 0)
        return np.random.default_rng([seed, 99]).standard_normal(self.d).astype(self.dtype, copy=False)

    def constants(self):
        """L = 2 max ||a_i||^2, L_f = 2 lambda_max(A^T A/n), M = (3 sqrt 3/8) max ||a_i||, f* >= 0."""
        if self._consts is None:
            mx = float(self.row_sq.max())
            lmax, how, note = _lmax_gram(self.A)
            self._consts = {
                "L": constant_record(2.0 * mx, "analytic", "|phi''| <= 2: L = 2 max_i ||a_i||^2 (every f_i and f)"),
                "L_f": constant_record(2.0 * lmax, how, f"2 lambda_max(A^T A / n); {note}"),
                "M": constant_record(GM_DPSI_MAX * math.sqrt(mx), "analytic", "|phi'| <= 3 sqrt(3)/8: M = 3 sqrt(3)/8 max_i ||a_i||"),
                "f_star_lower": constant_record(0.0, "analytic", "phi >= 0"),
            }
        return self._consts


# ------------------------------------------------------------------------------------ real data
def _dataset_arg(dataset, who: str) -> Dataset:
    if isinstance(dataset, str):
        return load_dataset(dataset)
    if not isinstance(dataset, Dataset):
        raise ConfigError(
            f"dataset = {type(dataset).__name__}: objective {who!r} needs a sim.workloads.data.Dataset or a data-set name"
        )
    return dataset


class _RegularisedData(Objective):
    """Shared parts of the data objectives: regulariser R(x) = lam sum_j psi(x_j) + mu/2 ||x||^2."""

    _ARITH_ARRAYS = ("X",)

    def _setup(self, dataset, lam, mu):
        self.dataset = dataset
        self.X = dataset.X
        self.sparse = issparse(self.X)
        self.lam = _float_param("lam", lam, 0.0)
        self.mu = _float_param("mu", mu, 0.0)
        self.row_sq = _row_sq_norms(self.X)
        self._consts = None

    def _rows(self, idx):
        return self.X if idx is None else self.X[idx]

    # subclasses give the data term: _data_loss(x, idx) (float) and _data_grad(x, idx) (float64 (d,)),
    # means over the samples idx (None: all n)

    def loss(self, x):
        """f(x): mean data loss + regularisers; float."""
        x = self._check_x(x)
        return self._data_loss(x, None) + self._reg_val(x)

    def batch_loss(self, x, idx):
        """Mean of f_i(x) over ``idx``; float."""
        x = self._check_x(x)
        return self._data_loss(x, self._check_idx(idx)) + self._reg_val(x)

    def full_grad(self, x):
        """grad f(x), float64 ``(d,)``."""
        x = self._check_x(x)
        return self._data_grad(x, None) + self._reg_grad(x)

    def batch_grad(self, x, idx):
        """Mean over ``idx`` of grad f_i(x) (the data term's, see the class) + grad R(x); float64 ``(d,)``."""
        x = self._check_x(x)
        return self._data_grad(x, self._check_idx(idx)) + self._reg_grad(x)

    def batch_grads(self, x, idxs, scratch=None):
        """The P rows ``batch_grad(x, idxs[p])`` (same bits): dense data stack the P batches' rows ``(P, b, p)`` and
        make each worker's BLAS products through ``np.matmul`` on the stack (subclasses' ``_data_grads``), grad R(x)
        once; CSR data keep the per-worker loop (module docstring). Array ``(P, d)``."""
        if self.sparse:
            return super().batch_grads(x, idxs, scratch)
        x = self._check_x(x)
        idxs = self._check_idxs(idxs)
        out = self._data_grads(x, idxs)
        out += self._reg_grad(x)  # data + grad R, as batch_grad's sum
        return out

    def loss_and_grad(self, x, scratch=None):
        """(f(x), grad f(x)) from one pass over the data (subclasses' ``_data_loss_grad``), with the bits of
        :meth:`loss` and :meth:`full_grad`."""
        x = self._check_x(x)
        dl, dg = self._data_loss_grad(x)
        return dl + self._reg_val(x), dg + self._reg_grad(x)

    def _reg_val(self, x):
        v = 0.0
        if self.lam:
            v += self.lam * float(np.sum(_psi(x)))
        if self.mu:
            v += 0.5 * self.mu * float(x @ x)
        return v

    def _reg_grad(self, x):
        g = np.zeros(x.shape[0], dtype=x.dtype) if not self.lam else self.lam * _dpsi(x)
        if self.mu:
            g += self.mu * x
        return g

    def x0(self, seed: int = 0):
        """x0 = 0 (``seed`` is validated and unused); ``(d,)`` of :attr:`dtype`."""
        _int_param("seed", seed, 0)
        return np.zeros(self.d, dtype=self.dtype)

    def _reg_note(self):
        return "lam psi'' in [-lam/2, 2 lam] (psi'' in [-1/2, 2]) plus mu"

    def _M_from(self, cdata: float, what: str):
        reg = self.lam * GM_DPSI_MAX * math.sqrt(self.d)
        base = cdata * math.sqrt(float(self.row_sq.max()))
        if self.mu == 0.0:
            return constant_record(base + reg, "analytic",
                          f"{what} + lam (3 sqrt(3)/8) sqrt(d) (||lam psi'(x)|| <= lam 3 sqrt(3)/8 sqrt(d))")
        return constant_record(None, "unknown",
                      f"unbounded on R^d since mu > 0; on ||x|| <= R: M <= {what} + lam (3 sqrt(3)/8) sqrt(d) "
                      f"+ mu R = {base + reg:.6g} + {self.mu:.6g} R; or estimate_M(points)")


class LogisticObjective(_RegularisedData):
    r"""``logistic``: f_i(x) = log(1 + exp(-s_i a_i^T x)) + lam sum_j x_j^2/(1+x_j^2) + (mu/2)||x||^2.

    ``dataset``: a binary :class:`sim.workloads.data.Dataset` (dense or CSR X ``(n, d)``; labels {0, 1} mapped to
    s_i = 2 y_i - 1) or a data-set name for :func:`sim.workloads.data.load_dataset`. x in R^d, d = n_features, no
    intercept. lam >= 0 (default 1e-3) weights the non-convex regulariser used in non-convex
    regularised logistic regression (e.g. Reddi et al. 2016, "Stochastic variance reduction for
    nonconvex optimization"; Antoniadis et al. 2011); mu >= 0 (default 0) the convex l2 term; with
    lam = 0, mu = 1/n this is the Mem-SGD objective (Stich et al. 2018). Raises :class:`ConfigError`
    when the data set does not have exactly 2 classes.

    Derivations: the logistic loss l(z) = log(1 + e^{-z}) has 0 < l'' = sigma(z)(1 - sigma(z)) <= 1/4
    and |l'| < 1; the regulariser has Hessian diag(lam psi''(x_j)) + mu I with psi'' in [-1/2, 2].
    - L = max_i ||a_i||^2/4 + 2 lam + mu (for every f_i, hence f).
    - L_f = lambda_max(A^T A/n)/4 + 2 lam + mu.
    - M (mu = 0) = max_i ||a_i|| + lam (3 sqrt(3)/8) sqrt(d); unbounded when mu > 0.
    - f* >= 0 (loss and both regularisers are >= 0).
    """

    name = "logistic"

    def __init__(self, *, dataset, lam, mu):
        ds = _dataset_arg(dataset, "logistic")
        if ds.n_classes != 2:
            raise ConfigError(
                f"data set {ds.name!r} has {ds.n_classes} class{'' if ds.n_classes == 1 else 'es'}: 'logistic' needs 2"
                f"{'; use softmax' if ds.n_classes > 2 else ''}"
            )
        self._setup(ds, lam, mu)
        self.n, self.d = ds.X.shape
        self.s = 2.0 * ds.y.astype(np.float64) - 1.0
        self.params = dict(dataset=ds.name, lam=self.lam, mu=self.mu)

    _ARITH_ARRAYS = ("X", "s")

    def _margins(self, x, idx):
        s = self.s if idx is None else self.s[idx]
        return s, s * (self._rows(idx) @ x)

    def _data_grad(self, x, idx, sm=None):
        """Mean over idx of -s_i sigma(-s_i a_i^T x) a_i; float64 (d,). sm: the (s, margins) of idx if known."""
        s, m = self._margins(x, idx) if sm is None else sm
        coef = -s * expit(-m) / m.shape[0]
        return np.asarray(self._rows(idx).T @ coef).ravel()

    def _data_loss(self, x, idx, sm=None):
        """Mean logistic loss log(1 + exp(-s_i a_i^T x)) over idx; float."""
        m = self._margins(x, idx)[1] if sm is None else sm[1]
        return float(np.mean(np.logaddexp(0.0, -m)))

    def _data_loss_grad(self, x):
        sm = self._margins(x, None)
        return self._data_loss(x, None, sm), self._data_grad(x, None, sm)

    def _data_grads(self, x, idxs):
        """(P, d): row p = _data_grad(x, idxs[p]); the stack's np.matmul makes worker p's two matrix-vector
        products with that worker's shapes and strides (one BLAS gemv each, as the per-worker path)."""
        P, b = idxs.shape
        Xs = self.X[idxs]  # (P, b, p)
        s = self.s[idxs]
        m = s * np.matmul(Xs, x)  # (P, b): worker p's rows @ x
        coef = -s * expit(-m) / b
        return np.matmul(Xs.transpose(0, 2, 1), coef[:, :, None]).reshape(P, self.d)

    def sample_grad_norms(self, x):
        """||c_i a_i + r|| via c_i^2 ||a_i||^2 + 2 c_i <a_i, r> + ||r||^2; float64 ``(n,)``."""
        x = self._check_x(x)
        s, m = self._margins(x, None)
        c = -s * expit(-m)
        r = self._reg_grad(x)
        sq = c * c * self.row_sq + 2.0 * c * np.asarray(self.X @ r).ravel() + float(r @ r)
        return np.sqrt(np.maximum(sq, 0.0))

    def constants(self):
        """L, L_f, M, f_star_lower as derived in the class docstring."""
        if self._consts is None:
            reg = GM_D2PSI_MAX * self.lam + self.mu  # max |psi"| = 2
            lmax, how, note = _lmax_gram(self.X)
            self._consts = {
                "L": constant_record(float(self.row_sq.max()) / 4.0 + reg, "analytic",
                            f"max_i ||a_i||^2/4 + 2 lam + mu; {self._reg_note()}"),
                "L_f": constant_record(lmax / 4.0 + reg, how, f"lambda_max(A^T A/n)/4 + 2 lam + mu; {note}"),
                "M": self._M_from(1.0, "max_i ||a_i||"),
                "f_star_lower": constant_record(0.0, "analytic", "logistic loss >= 0, regularisers >= 0"),
            }
        return self._consts


class SoftmaxObjective(_RegularisedData):
    r"""``softmax``: multinomial logistic regression with the same regularisers as ``logistic``.

    Parameters W in R^{C x p} (C = n_classes >= 2, p = n_features) flattened class-major:
    x = W.ravel(), d = C p, W = x.reshape(C, p). f_i(x) = logsumexp(W a_i) - (W a_i)_{y_i}
    + lam sum_j psi(x_j) + (mu/2)||x||^2. ``dataset``: a :class:`sim.workloads.data.Dataset` (dense or CSR) or a
    data-set name. x0 = 0.

    Derivations: with p_i = softmax(W a_i), grad_W f_i = (p_i - e_{y_i}) a_i^T + grad R and the data
    Hessian is J_i (x) a_i a_i^T with J_i = diag(p_i) - p_i p_i^T. Boehning (1992, "Multinomial
    logistic regression algorithm", Ann. Inst. Statist. Math. 44) shows 0 <= J_i <= (1/2)(I - 11^T/C);
    Gershgorin gives the same: every eigenvalue is <= max_c 2 p_c (1 - p_c) <= 1/2. Hence
    - L = max_i ||a_i||^2/2 + 2 lam + mu;
    - L_f = lambda_max(A^T A/n)/2 + 2 lam + mu (0 <= (1/n) sum_i J_i (x) a_i a_i^T <= (1/2) I (x) A^T A/n);
    - M (mu = 0) = sqrt(2) max_i ||a_i|| + lam (3 sqrt(3)/8) sqrt(d), since
      ||p - e_y||^2 = (1 - p_y)^2 + sum_{c != y} p_c^2 <= 2 (1 - p_y)^2 <= 2; unbounded when mu > 0;
    - f* >= 0 (cross-entropy and regularisers are >= 0).
    """

    name = "softmax"

    def __init__(self, *, dataset, lam, mu):
        ds = _dataset_arg(dataset, "softmax")
        if ds.n_classes < 2:
            raise ConfigError(f"data set {ds.name!r} has {ds.n_classes} class: 'softmax' needs >= 2")
        self._setup(ds, lam, mu)
        self.n, self.p = ds.X.shape
        self.C = ds.n_classes
        self.d = self.p * self.C
        self.y = ds.y
        self.params = dict(dataset=ds.name, lam=self.lam, mu=self.mu)

    def _scores(self, x, idx):
        W = x.reshape(self.C, self.p)
        return np.asarray(self._rows(idx) @ W.T)

    @staticmethod
    def _lse(Z):
        mx = Z.max(axis=1)
        return mx + np.log(np.sum(np.exp(Z - mx[:, None]), axis=1))

    def _data_loss(self, x, idx):
        """Mean cross-entropy over idx; float."""
        Z = self._scores(x, idx)
        y = self.y if idx is None else self.y[idx]
        return float(np.mean(self._lse(Z) - Z[np.arange(Z.shape[0]), y]))

    def _resid(self, x, idx):
        Z = self._scores(x, idx)
        Z -= Z.max(axis=1)[:, None]
        P = np.exp(Z)
        P /= P.sum(axis=1)[:, None]
        y = self.y if idx is None else self.y[idx]
        P[np.arange(P.shape[0]), y] -= 1.0
        return P

    def _data_grad(self, x, idx):
        """Mean over idx of (p_i - e_{y_i}) (x) a_i, class-major flattening of a C x p matrix; float64 (d,)."""
        R = self._resid(x, idx)
        G = np.asarray(self._rows(idx).T @ R)  # (p, C)
        return np.ascontiguousarray(G.T).ravel() / R.shape[0]

    def _data_loss_grad(self, x):
        """_data_loss and _data_grad over all samples from one score matrix, sharing the row max, the exponentials
        and their row sums (the same operations on the same values as _lse and _resid, so the same bits)."""
        Z = self._scores(x, None)
        rows = np.arange(Z.shape[0])
        mx = Z.max(axis=1)
        zy = Z[rows, self.y]
        Z -= mx[:, None]
        E = np.exp(Z)
        tot = np.sum(E, axis=1)
        loss = float(np.mean((mx + np.log(tot)) - zy))
        E /= tot[:, None]
        E[rows, self.y] -= 1.0
        G = np.asarray(self.X.T @ E)  # (p, C)
        return loss, np.ascontiguousarray(G.T).ravel() / E.shape[0]

    def _data_grads(self, x, idxs):
        """(P, d): row p = _data_grad(x, idxs[p]); np.matmul on the stack makes worker p's two matrix products
        with that worker's shapes and strides (one BLAS gemm each, as the per-worker path), and the softmax
        reductions run along each sample's C scores as there."""
        P, b = idxs.shape
        Xs = self.X[idxs]  # (P, b, p)
        W = x.reshape(self.C, self.p)
        Z = np.matmul(Xs, W.T)  # (P, b, C)
        Z -= Z.max(axis=2)[:, :, None]
        R = np.exp(Z)
        R /= R.sum(axis=2)[:, :, None]
        R[np.arange(P)[:, None], np.arange(b)[None, :], self.y[idxs]] -= 1.0
        G = np.matmul(Xs.transpose(0, 2, 1), R)  # (P, p, C)
        return np.ascontiguousarray(G.transpose(0, 2, 1)).reshape(P, self.d) / b


    def sample_grad_norms(self, x):
        """||q_i (x) a_i + r|| via ||q_i||^2 ||a_i||^2 + 2 q_i^T Rm a_i + ||r||^2; float64 ``(n,)``."""
        x = self._check_x(x)
        Q = self._resid(x, None)
        r = self._reg_grad(x)
        XR = np.asarray(self.X @ r.reshape(self.C, self.p).T)  # (n, C)
        sq = np.einsum("ic,ic->i", Q, Q) * self.row_sq + 2.0 * np.einsum("ic,ic->i", Q, XR) + float(r @ r)
        return np.sqrt(np.maximum(sq, 0.0))

    def constants(self):
        """L, L_f, M, f_star_lower as derived in the class docstring."""
        if self._consts is None:
            reg = GM_D2PSI_MAX * self.lam + self.mu  # max |psi"| = 2
            lmax, how, note = _lmax_gram(self.X)
            self._consts = {
                "L": constant_record(float(self.row_sq.max()) / 2.0 + reg, "analytic",
                            f"max_i ||a_i||^2/2 + 2 lam + mu (Boehning 1992: J <= I/2); {self._reg_note()}"),
                "L_f": constant_record(lmax / 2.0 + reg, how, f"lambda_max(A^T A/n)/2 + 2 lam + mu; {note}"),
                "M": self._M_from(math.sqrt(2.0), "sqrt(2) max_i ||a_i||"),
                "f_star_lower": constant_record(0.0, "analytic", "cross-entropy >= 0, regularisers >= 0"),
            }
        return self._consts


# ------------------------------------------------------------------------------------ registry
_SYNTH = dict(d=1000, n=1024, seed=0, a=1.0, lam_min=0.1, lam_max=2.0, sigma=1.0, r=4)

#: name -> {"params": defaults (None = required), "summary": one line, "factory": callable(**params)}.
OBJECTIVES: dict[str, dict] = {
    "sines": {
        "params": dict(_SYNTH),
        "summary": "sum_j [lam_j x_j^2/2 + a cos x_j] + <xi_i, x>; L = lam_max + a; non-convex if lam_min < a",
        "factory": SinesObjective,
    },
    "double_well": {
        "params": dict(_SYNTH),
        "summary": "sum_j [lam_j x_j^2/2 - a x_j^2/(1+x_j^2)] + <xi_i, x>; exact f*; cheapest at d = 1e6",
        "factory": DoubleWellObjective,
    },
    "robust_regression": {
        "params": dict(d=1000, n=1024, seed=0, nnz=8, noise=0.1, outlier_frac=0.1, outlier_scale=10.0),
        "summary": "Geman-McClure phi(a_i^T x - y_i), sparse a_i; L = 2 max ||a_i||^2, M = 3 sqrt(3)/8 max ||a_i||",
        "factory": RobustRegressionObjective,
    },
    "logistic": {
        "params": dict(dataset=None, lam=1e-3, mu=0.0),
        "summary": "binary logistic + lam sum x^2/(1+x^2) + mu/2 ||x||^2 on a Dataset; L = max||a_i||^2/4 + 2lam + mu",
        "factory": LogisticObjective,
    },
    "softmax": {
        "params": dict(dataset=None, lam=1e-3, mu=0.0),
        "summary": "multinomial logistic + same regularisers; d = n_features * n_classes; L = max||a_i||^2/2 + 2lam + mu",
        "factory": SoftmaxObjective,
    },
}


def make_objective(name: str, **params) -> Objective:
    """Build the objective ``name`` of :data:`OBJECTIVES` with ``params`` overriding its defaults.

    E.g. ``make_objective("sines", d=10**6, n=1024, seed=0)``,
    ``make_objective("logistic", dataset=load_dataset("breast_cancer"), lam=1e-3, mu=0.0)``.
    Raises :class:`ConfigError` for an unknown name or parameter (listing the valid ones), a missing
    ``dataset``, or an out-of-range value (naming the value and the valid range).
    """
    if name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {name!r}: valid {', '.join(OBJECTIVES)}")
    spec = OBJECTIVES[name]
    for key in params:
        if key not in spec["params"]:
            raise ConfigError(
                f"unknown parameter {key!r} for objective {name!r}: valid {', '.join(spec['params'])}"
            )
    kw = {**spec["params"], **params}
    if "dataset" in kw and kw["dataset"] is None:
        raise ConfigError(f"dataset = None: objective {name!r} needs dataset = a sim.workloads.data.Dataset or a data-set name")
    return spec["factory"](**kw)
