"""Data sets, sharding over workers and order-independent mini-batch draws.

Layer: bottom (``objectives and data``); imports nothing from the rest of ``sim`` but ``sim.base.errors``.

- :func:`load_dataset` -- a :class:`Dataset` from scikit-learn's bundled sets, a LIBSVM file, or a
  deterministic epsilon-like synthetic set.
- :func:`shard_indices` -- split sample indices ``0..n-1`` over ``P`` workers (iid or by label).
- :func:`minibatch` -- ``b`` indices of one worker's shard for one iteration, drawn from a generator
  seeded with ``(seed, rank, iteration)`` so the draw never depends on call order.
"""
from __future__ import annotations

import operator
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import scipy.sparse as sp

from sim.base.errors import ConfigError, DataError, SparsimError, check_range

__all__ = ["issparse", "Dataset", "DATASETS", "load_dataset", "check_finite", "shard_indices", "minibatch",
           "SHARD_MODES", "DATA_ABS_MAX"]

#: Largest magnitude of a data entry (feature value). A value's square must stay finite, and so must the sums
#: of squares the objectives form (row norms for L and M, margins, the full gradient): squares of up to 1e100
#: are at most 1e200, so summed over up to 10^7 features and 10^7 samples they stay far below float64's max
#: (1.8e308). Larger values are data errors (a feature of 1e300 would overflow in the first product and be
#: blamed on the step size), reported as such before any training.
DATA_ABS_MAX = 1e100

#: Names accepted by :func:`load_dataset`, with a one-line description each.
DATASETS = {
    "breast_cancer": "sklearn.datasets.load_breast_cancer: n=569, d=30, 2 classes; features standardised "
    "(zero mean, unit variance, population std over all 569 rows)",
    "digits": "sklearn.datasets.load_digits: n=1797, d=64, 10 classes; pixels scaled to [0, 1] by /16",
    "libsvm": "a LIBSVM/SVMlight text file given by path (sklearn.datasets.load_svmlight_file), "
    "X as scipy.sparse CSR float64, labels mapped to 0..C-1 in sorted order",
    "synthetic_epsilon": "epsilon-like dense set (d=2000, n=10000 by default): Gaussian features, rows "
    "normalised to unit length, binary labels from a seeded random hyperplane with label noise",
}

#: Modes accepted by :func:`shard_indices`.
SHARD_MODES = ("iid", "label")


def issparse(x) -> bool:
    """Whether ``x`` is a scipy.sparse matrix (``scipy.sparse.issparse``), without importing scipy.sparse: a sparse
    matrix can exist only once that module is imported, so a process that never loads LIBSVM data never pays for
    the import (0.1 s of the default scenario's start-up)."""
    mod = sys.modules.get("scipy.sparse")
    return mod is not None and mod.issparse(x)


def _as_int(name: str, value, error=ConfigError) -> int:
    """``operator.index(value)`` (bools rejected) or ``error`` naming the value."""
    if isinstance(value, (bool, np.bool_)):
        raise error(f"{name} = {value!r} must be an integer")
    try:
        return operator.index(value)
    except TypeError:
        raise error(f"{name} = {value!r} must be an integer") from None


def _range(name: str, value, lo=None, hi=None, error=ConfigError):
    """:func:`sim.base.errors.check_range` raising ``error``."""
    return check_range(name, value, lo, hi, err=error)


def _first_bad(X) -> tuple[int, int, float] | None:
    """The first ``(row, column, value)`` in row-major order of ``X`` (ndarray or scipy.sparse; stored entries)
    that is NaN, +-Inf or beyond :data:`DATA_ABS_MAX` in magnitude; None when every entry is in range."""
    if issparse(X):
        A = X.tocsr()
        data = A.data
        if data.size == 0 or (-DATA_ABS_MAX <= float(data.min()) and float(data.max()) <= DATA_ABS_MAX):  # NaN fails
            return None
        bad = np.flatnonzero(~(np.abs(data) <= DATA_ABS_MAX))
        rows = np.searchsorted(A.indptr, bad, side="right") - 1
        cols = A.indices[bad]
        first = np.lexsort((cols, rows))[0]
        return int(rows[first]), int(cols[first]), float(data[bad[first]])
    A = np.asarray(X)
    if A.size == 0 or (-DATA_ABS_MAX <= float(A.min()) and float(A.max()) <= DATA_ABS_MAX):
        return None
    r, c = (int(t) for t in np.argwhere(~(np.abs(A) <= DATA_ABS_MAX))[0])
    return r, c, float(A[r, c])


def _bad_value_text(v: float) -> str:
    """Why a data value is out of range (the part of the message after the value)."""
    if not np.isfinite(v):
        return "all entries must be finite"
    return (f"valid |value| <= {DATA_ABS_MAX:g} (larger values overflow float64 once squared and summed; "
            "fix or rescale the data)")


def check_finite(X, name: str) -> None:
    """Raise :class:`DataError` if ``X`` holds NaN, +-Inf or a value beyond :data:`DATA_ABS_MAX` (1e100) in magnitude.

    ``X``: float ndarray ``(n, d)`` or scipy.sparse matrix (only stored entries are checked).
    The message names the data set and the first bad ``(row, column)`` in row-major order, e.g.
    ``data set 'x' holds a non-finite value (nan) at (row, column) = (3, 7): all entries must be finite`` or
    ``data set 'x' holds the value 1e+300 at (row, column) = (0, 1): valid |value| <= 1e+100 (...)``.
    Reads ``X`` only (two reductions when every entry is in range).
    """
    bad = _first_bad(X)
    if bad is None:
        return
    r, c, v = bad
    what = f"a non-finite value ({v})" if not np.isfinite(v) else f"the value {v:g}"
    raise DataError(f"data set {name!r} holds {what} at (row, column) = ({r}, {c}): {_bad_value_text(v)}")


def _libsvm_line(path: str, row: int) -> tuple[int, str] | None:
    """(1-based line number, text) of sample ``row`` (0-based) of a LIBSVM file, counting as
    sklearn.datasets.load_svmlight_file does (text after '#' is a comment; lines empty without it hold no
    sample); None when the file cannot be read back."""
    try:
        with open(path, "rb") as fh:
            k = -1
            for lineno, raw in enumerate(fh, 1):
                text = raw.split(b"#", 1)[0].strip()
                if text:
                    k += 1
                    if k == row:
                        return lineno, text.decode("utf-8", "replace")
    except OSError:
        return None
    return None


def _check_libsvm_values(path: str, X) -> None:
    """Raise DataError naming the file, its line, the feature index as written there and the value when
    ``X`` (loaded from ``path``) holds NaN, +-Inf or a value beyond :data:`DATA_ABS_MAX`."""
    bad = _first_bad(X)
    if bad is None:
        return
    r, c, v = bad
    where = f"sample {r} (row {r}), column {c} of the loaded matrix"
    found = _libsvm_line(path, r)
    if found is not None:
        lineno, text = found
        feature = None
        for tok in text.split()[1:]:
            idx, sep, val = tok.partition(":")
            if sep and idx != "qid":
                try:
                    fv = float(val)
                except ValueError:
                    continue
                if fv == v or (np.isnan(v) and np.isnan(fv)):
                    feature = idx
                    break
        where = f"line {lineno} (sample {r}), " + (f"feature {feature}" if feature is not None else f"column {c}")
    what = f"a non-finite value ({v})" if not np.isfinite(v) else f"the value {v:g}"
    raise DataError(f"LIBSVM file {path!r}, {where}: holds {what} at (row, column) = ({r}, {c}): "
                    f"{_bad_value_text(v)}")


@dataclass(frozen=True, eq=False)
class Dataset:
    """A labelled data set (immutable container; the arrays themselves are not copied).

    Fields
    - ``X``: float64 ndarray ``(n, d)`` (dense) or scipy.sparse CSR float64 ``(n, d)`` (LIBSVM files).
    - ``y``: int64 ndarray ``(n,)``, labels in ``0..n_classes-1`` (not every label need occur, e.g.
      after ``n_max`` truncation).
    - ``n_classes``: int >= 1, the number of classes of the full set.
    - ``name``: the data-set name (``"breast_cancer"``, ``"digits"``, ``"libsvm"``, ...).
    - ``source``: a human-readable provenance string (loader, file path, generator parameters).

    Construction validates shapes, dtypes, label range and values: a bad field raises
    :class:`DataError` naming it (NaN/Inf or a value beyond :data:`DATA_ABS_MAX`: the first bad ``(row, column)``).
    """

    X: np.ndarray | sp.csr_matrix
    y: np.ndarray
    n_classes: int
    name: str
    source: str = ""

    def __post_init__(self):
        X = self.X
        if issparse(X):
            if X.format != "csr" or X.dtype != np.float64:
                raise DataError(
                    f"data set {self.name!r}: sparse X must be CSR float64, got {X.format} {X.dtype}"
                )
        elif not (isinstance(X, np.ndarray) and X.ndim == 2 and X.dtype == np.float64):
            shape = getattr(X, "shape", None)
            dtype = getattr(X, "dtype", type(X).__name__)
            raise DataError(
                f"data set {self.name!r}: X must be a 2-D float64 ndarray or CSR matrix, got shape {shape} dtype {dtype}"
            )
        n = X.shape[0]
        y = self.y
        if not (isinstance(y, np.ndarray) and y.dtype == np.int64 and y.shape == (n,)):
            raise DataError(
                f"data set {self.name!r}: y must be an int64 ndarray of shape ({n},), got "
                f"shape {getattr(y, 'shape', None)} dtype {getattr(y, 'dtype', type(y).__name__)}"
            )
        C = _as_int("n_classes", self.n_classes, DataError)
        _range("n_classes", C, 1, None, DataError)
        if n and (y.min() < 0 or y.max() >= C):
            bad = int(y[(y < 0) | (y >= C)][0])
            raise DataError(
                f"data set {self.name!r}: label {bad} is out of range: valid 0 <= label <= {C - 1}"
            )
        check_finite(X, self.name)

    @property
    def n(self) -> int:
        """Number of samples (rows of ``X``)."""
        return int(self.X.shape[0])

    @property
    def d(self) -> int:
        """Number of features (columns of ``X``)."""
        return int(self.X.shape[1])

    @property
    def is_sparse(self) -> bool:
        """True when ``X`` is a scipy.sparse CSR matrix."""
        return issparse(self.X)


def _libsvm_lines(path: str) -> list[bytes]:
    """The lines of a LIBSVM file as sklearn.datasets.load_svmlight_file reads it (``.gz`` / ``.bz2`` decompressed)."""
    if path.endswith(".gz"):
        import gzip

        opener = gzip.open
    elif path.endswith(".bz2"):
        import bz2

        opener = bz2.open
    else:
        opener = open
    with opener(path, "rb") as fh:
        return fh.read().splitlines(keepends=True)


def _libsvm_bad_line(path: str, load) -> tuple[int, str, str] | None:
    """The first line of a LIBSVM file that ``load`` (load_svmlight_file on a file object) refuses: (1-based line
    number, the line's text cut to 80 characters, the loader's message on one line); None when no prefix of whole
    lines fails (an error of the file as a whole). A binary search over prefixes of whole lines: each line is read
    on its own, so the first prefix that fails ends at the bad line."""
    import io

    try:
        lines = _libsvm_lines(path)
    except OSError:
        return None

    def fails(m: int) -> str | None:
        try:
            load(io.BytesIO(b"".join(lines[:m])))
        except Exception as exc:  # noqa: BLE001 - the loader raises ValueError/IndexError/...
            return " ".join(str(exc).split()) or type(exc).__name__
        return None

    lo, hi = 0, len(lines)  # the first hi lines fail (once found), the first lo lines do not
    if fails(hi) is None:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fails(mid) is not None:
            hi = mid
        else:
            lo = mid
    text = lines[hi - 1].decode("utf-8", "replace").strip()
    return hi, (text if len(text) <= 80 else text[:77] + "..."), fails(hi)


def _load_libsvm(path) -> tuple[sp.csr_matrix, np.ndarray, int, str]:
    if path is None:
        raise ConfigError("path = None: the 'libsvm' data set needs path = a LIBSVM file")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"LIBSVM file not found: {path!r}")
    if not os.path.isfile(path):
        kind = "a directory" if os.path.isdir(path) else "not a regular file (a device, a pipe or a socket)"
        raise DataError(f"LIBSVM path {path!r} is {kind}: valid the path of a LIBSVM text file")
    try:
        with open(path, "rb") as fh:  # a file that cannot be read is not a malformed one
            fh.read(1)
    except OSError as err:
        raise DataError(f"cannot read LIBSVM file {path!r}: {err.strerror or err}") from None
    from sklearn.datasets import load_svmlight_file

    def load(src):
        return load_svmlight_file(src, dtype=np.float64)

    try:
        X, y_raw = load(path)
    except OSError as err:
        raise DataError(f"cannot read LIBSVM file {path!r}: {err.strerror or err}") from None
    except Exception as exc:  # noqa: BLE001 - the loader raises ValueError/IndexError/...; report in one line
        msg = " ".join(str(exc).split()) or type(exc).__name__
        bad = _libsvm_bad_line(path, load)
        if bad is not None:
            lineno, text, msg = bad
            raise DataError(f"malformed LIBSVM file {path!r}, line {lineno} ({text!r}): {msg}") from None
        raise DataError(f"malformed LIBSVM file {path!r}: {msg}") from None
    if X.shape[0] == 0:
        raise DataError(f"LIBSVM file {path!r} holds no samples: valid files have >= 1 line")
    bad_label = ~np.isfinite(y_raw) | (y_raw != np.round(y_raw))
    if np.any(bad_label):
        row = int(np.flatnonzero(bad_label)[0])
        found = _libsvm_line(path, row)
        where = f"line {found[0]} (sample {row})" if found is not None else f"sample {row}"
        why = ("is not finite" if not np.isfinite(y_raw[row]) else
               "is not a whole number: labels are classes, valid integers such as 0/1, -1/+1 or 1..C")
        raise DataError(f"LIBSVM file {path!r}, {where}: label {float(y_raw[row])!r} {why}")
    classes, y = np.unique(y_raw, return_inverse=True)
    import scipy.sparse as sp

    X = sp.csr_matrix(X, dtype=np.float64)
    X.sort_indices()
    _check_libsvm_values(path, X)
    return X, y.astype(np.int64).ravel(), int(classes.size), (
        f"LIBSVM file {path} via sklearn.datasets.load_svmlight_file; labels {classes.tolist()[:10]}"
        f"{'...' if classes.size > 10 else ''} -> 0..{classes.size - 1}"
    )


def _synthetic_epsilon(n: int, d: int, seed: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """First ``rows`` rows of the (n, d) set; identical to slicing the full set (independent streams)."""
    w = np.random.default_rng([seed, 0]).standard_normal(d)
    w /= np.linalg.norm(w)
    X = np.random.default_rng([seed, 1]).standard_normal((rows, d))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    noise = np.random.default_rng([seed, 2]).standard_normal(n)[:rows]
    margin = (X @ w) * np.sqrt(d)  # ~ N(0, 1): cosine to the hyperplane normal times sqrt(d)
    y = (margin + 0.5 * noise > 0).astype(np.int64)
    return X, y


def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``sklearn.datasets.load_digits`` returns them: ``(data, target)``, data float64
    ``(1797, 64)`` (pixel counts 0..16), target int ``(1797,)`` (0..9).

    Read from the file load_digits reads (``sklearn/datasets/data/digits.csv.gz``) the way it reads it
    (``np.loadtxt`` with ``delimiter=","``, the last column the target), so the same bits, but without importing
    scikit-learn, whose import (about 1 s here, scipy.stats included) was the largest part of the default
    scenario's start-up. Where the file is not at that place, load_digits itself is called.
    """
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with open(path, "rb") as fh, gzip.open(fh, mode="rt", encoding="utf-8") as text:
                data = np.loadtxt(text, delimiter=",")
            return data[:, :-1], data[:, -1].astype(int, copy=False)
    from sklearn.datasets import load_digits

    raw = load_digits()
    return raw.data, raw.target


def load_dataset(
    name: str,
    path: str | os.PathLike | None = None,
    *,
    n_max: int | None = None,
    d: int = 2000,
    n: int = 10000,
    seed: int = 0,
) -> Dataset:
    """Load a data set by name.

    - ``"breast_cancer"``: ``sklearn.datasets.load_breast_cancer`` (UCI Wisconsin Diagnostic Breast
      Cancer, bundled with scikit-learn), X dense ``(569, 30)`` standardised per feature to zero mean,
      unit variance (population std, statistics from all 569 rows), y in {0, 1}.
    - ``"digits"``: ``sklearn.datasets.load_digits`` (UCI optical digits 8x8), X dense ``(1797, 64)``
      scaled to [0, 1] by /16, y in 0..9.
    - ``"libsvm"``: the file ``path`` read by ``sklearn.datasets.load_svmlight_file``; X is scipy.sparse
      CSR float64, labels (whole numbers: classes) mapped to ``0..C-1`` in sorted order (e.g. {-1, +1} -> {0, 1}).
    - ``"synthetic_epsilon"``: an epsilon-like (PASCAL 2008 epsilon: d = 2000, rows of unit norm)
      dense set of ``n`` samples, ``d`` features: X_ij ~ N(0, 1) then each row normalised to unit
      length; y = 1[sqrt(d) <a_i, w> + 0.5 e_i > 0] with w a unit Gaussian direction and e_i ~ N(0, 1)
      (about 15% of labels disagree with the hyperplane). Generated from ``seed`` by three independent
      streams ``default_rng([seed, 0|1|2])``, so ``n_max=m`` returns exactly the first m rows of the
      full set. ``d``, ``n``, ``seed`` are used only by this set.

    ``n_max`` (int >= 1 or None): keep only the first ``n_max`` rows (after standardisation, which
    uses the full set). ``Dataset.n_classes`` stays that of the full set.

    Returns a :class:`Dataset`. Raises :class:`ConfigError` for an unknown name or out-of-range
    ``n_max``/``d``/``n``/``seed``, :class:`DataError` for a missing, unreadable (says so) or malformed file (the
    message names the path and, for a malformed one, the first bad line, its text and the loader's message on one
    line), a label that is not a whole number or not finite (naming its line), and for NaN/Inf
    or a value beyond :data:`DATA_ABS_MAX` (1e100) in X (naming the data set and the first bad
    ``(row, column)``; for a LIBSVM file also its line and the feature index as written there).
    """
    if name not in DATASETS:
        raise ConfigError(f"unknown data set {name!r}: valid {', '.join(DATASETS)}")
    if n_max is not None:
        n_max = _range("n_max", _as_int("n_max", n_max), 1)
    if name != "libsvm" and path is not None:
        raise ConfigError(f"path = {os.fspath(path)!r} is only used by the 'libsvm' data set, not {name!r}")

    if name == "breast_cancer":
        from sklearn.datasets import load_breast_cancer

        raw = load_breast_cancer()
        X = np.asarray(raw.data, dtype=np.float64)
        mean = X.mean(axis=0)
        std = X.std(axis=0)
        std[std == 0] = 1.0
        X = (X - mean) / std
        y, C = np.asarray(raw.target, dtype=np.int64), 2
        source = "sklearn.datasets.load_breast_cancer (UCI WDBC), features standardised"
    elif name == "digits":
        data, target = _digits_raw()
        X = np.asarray(data, dtype=np.float64) / 16.0
        y, C = np.asarray(target, dtype=np.int64), 10
        source = "sklearn.datasets.load_digits (UCI optical digits 8x8), pixels / 16"
    elif name == "libsvm":
        X, y, C, source = _load_libsvm(path)
    else:  # synthetic_epsilon
        d = _range("d", _as_int("d", d), 1)
        n = _range("n", _as_int("n", n), 1)
        seed = _range("seed", _as_int("seed", seed), 0)
        rows = n if n_max is None else min(n, n_max)
        X, y = _synthetic_epsilon(n, d, seed, rows)
        C = 2
        source = f"synthetic epsilon-like: n={n}, d={d}, seed={seed}, unit-norm Gaussian rows, hyperplane labels + N(0, 0.5^2) noise"
    if n_max is not None and X.shape[0] > n_max:
        X, y = X[:n_max], y[:n_max]
        if issparse(X):
            import scipy.sparse as sp

            X = sp.csr_matrix(X)
        else:
            X = np.ascontiguousarray(X)
        source += f"; first {n_max} rows"
    label = f"libsvm:{path}" if name == "libsvm" else name
    return Dataset(X=X, y=np.ascontiguousarray(y, dtype=np.int64), n_classes=int(C), name=label, source=source)


def shard_indices(
    n: int, P: int, *, mode: str = "iid", labels: np.ndarray | None = None, seed: int = 0
) -> list[np.ndarray]:
    """Split sample indices ``0..n-1`` over ``P`` workers.

    - ``mode="iid"``: ``np.random.default_rng(seed).permutation(n)`` split by ``np.array_split`` into
      ``P`` contiguous parts of near-equal size (sizes differ by at most one); each part is then sorted
      ascending (the set of a part is what matters; sorting makes it independent of the order inside).
    - ``mode="label"``: indices sorted by ``(label, index)`` (stable sort of ``labels``) and split into
      ``P`` contiguous near-equal parts, so each worker sees few labels (non-iid). ``seed`` is unused.

    Returns a list of ``P`` int64 arrays, together holding every index exactly once.
    Raises :class:`SparsimError` if ``n < 1``, ``P < 1`` or ``P > n`` (message names the value and the
    range) or ``labels`` is missing / not of shape ``(n,)`` in label mode; :class:`ConfigError` for an
    unknown mode.
    """
    n = _range("n", _as_int("n", n, SparsimError), 1, None, SparsimError)
    P = _range("P", _as_int("P", P, SparsimError), 1, n, SparsimError)
    if mode == "iid":
        seed = _range("seed", _as_int("seed", seed, SparsimError), 0, None, SparsimError)
        perm = np.random.default_rng(seed).permutation(n).astype(np.int64)
        return [np.sort(part) for part in np.array_split(perm, P)]
    if mode == "label":
        if labels is None:
            raise SparsimError("labels = None: mode='label' needs labels of shape (n,)")
        labels = np.asarray(labels)
        if labels.shape != (n,):
            raise SparsimError(f"labels have shape {labels.shape}: mode='label' needs shape ({n},)")
        order = np.argsort(labels, kind="stable").astype(np.int64)
        return [np.ascontiguousarray(part) for part in np.array_split(order, P)]
    raise ConfigError(f"unknown shard mode {mode!r}: valid {', '.join(SHARD_MODES)}")


def minibatch(shard: np.ndarray, b: int, seed: int, rank: int, iteration: int) -> np.ndarray:
    """Draw ``b`` sample indices uniformly WITHOUT replacement from ``shard``.

    ``shard``: 1-D integer array (a worker's indices, from :func:`shard_indices`). The generator is
    ``np.random.default_rng([seed, rank, iteration])``, so the draw depends only on these three
    non-negative integers and never on call order. Returns an int64 array ``(b,)`` sorted ascending.
    Raises :class:`SparsimError` if ``b < 1`` or ``b > len(shard)`` (message names the value and the
    range), if ``shard`` is not a non-empty 1-D integer array, or if seed/rank/iteration are negative.
    """
    shard = np.asarray(shard)
    if shard.ndim != 1 or shard.size == 0 or not np.issubdtype(shard.dtype, np.integer):
        raise SparsimError(
            f"shard has shape {shard.shape} dtype {shard.dtype}: valid is a non-empty 1-D integer array"
        )
    b = _range("b", _as_int("b", b, SparsimError), 1, shard.size, SparsimError)
    key = [
        _range(nm, _as_int(nm, v, SparsimError), 0, None, SparsimError)
        for nm, v in (("seed", seed), ("rank", rank), ("iteration", iteration))
    ]
    rng = np.random.default_rng(key)
    pos = rng.choice(shard.size, size=b, replace=False)
    return np.sort(shard[pos].astype(np.int64))
