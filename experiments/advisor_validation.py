"""``sparsim experiment validate-advisor``: does a short run rank the configurations as the full runs do?

The advisor (issue #22) ranks configurations (algorithm x density, per cluster) by predicted time to accuracy =
iterations to the target x simulated time per iteration. This module checks such a ranking on runs it did not see:
from the **first 20 % of each run's iterations** only it predicts the time to a target test accuracy, ranks the
configurations by it, and compares that ranking with the one by the full runs' **measured** time to accuracy
(Kendall's tau, ``scipy.stats.kendalltau``, and the top-1 agreement), beside two naive rankings that need no
prediction.

The short-run predictor (:func:`predict_iterations`), per run (one seed of a configuration on one cluster):

- window: the evaluation points with 0 < iteration <= W, W the last evaluation point at or before
  ``fraction`` x T (T: the run's last iteration; fraction 0.2). At least :data:`MIN_POINTS` points.
- observed: if a point in the window already has test accuracy >= target, the prediction is that point (the full
  run's measurement of the same run is then the same point: no extrapolation).
- otherwise the learning curve ``acc(t) = a - b t^(-c)`` (:func:`learning_curve`; the inverse power law, the
  ``pow3`` form of Domhan, Springenberg and Hutter, IJCAI 2015, the standard parametric learning curve of the survey
  by Viering and Loog, TPAMI 2022) is fitted by least squares (:func:`fit_learning_curve`: a grid over c with
  (a, b) in closed form for each c, then ``scipy.optimize.curve_fit``) with 0 <= a <= 1, b >= 0, c in
  [:data:`C_MIN`, :data:`C_MAX`]; its crossing t* = (b / (a - target))^(1/c) is rounded up to the evaluation
  grid (the first evaluation point at or after t*, and after W), as the measurement is.
- never: the fitted asymptote a <= target ("asymptote below target") or the fit fails ("fit failed"): the run is
  predicted never to reach the target; such a configuration ranks last (tied with every other "never").
- predicted time to accuracy (s) = predicted iteration x the run's simulated time per iteration in the window
  (its clock at W / W; the simulator gives every iteration's time from the first one on), or the run's own clock
  at an observed point.

The ground truth (:func:`measured_tta`): the first evaluation point of the full run whose test accuracy is >= the
target, and the run's simulated clock there (the rule of :mod:`experiments.tta`). Over the seeds of a configuration
(both sides alike): the mean when every seed reaches (is predicted to reach) the target, else "not reached" /
"never", ranked last.

Naive rankings, for comparison: by simulated time per iteration alone (as if every configuration needed the same
iterations: what a ranking without convergence evidence does), and by ``(1 - test accuracy at W) x s/iteration``
(the error left after the short run, times the cost of an iteration).

Outputs (``DIR.partial``, renamed when complete): ``cases.csv`` (:data:`CASE_COLUMNS`: per target, cluster and
configuration), ``fits.csv`` (:data:`FIT_COLUMNS`: per target, cluster, configuration and seed), ``rankings.csv``
(:data:`RANKING_COLUMNS`: per target, cluster and ranker), ``report.md``, ``validation.png`` / ``.pdf`` (predicted
against measured time to accuracy, log-log, one marker per case) and, when it ran the sweep itself, ``tta/`` (the
:mod:`experiments.tta` sweep's output, ``sparsim check`` works on each ``tta/runs/<case>/``).

Sources: Kendall, Biometrika 1938 (tau; tau-b with ties, scipy.stats.kendalltau); Domhan et al., IJCAI 2015;
Viering and Loog, TPAMI 2022 (learning-curve forms).
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.base.errors import ConfigError

from .outdir import check_out, partial_dir, publish, save_figure, write_csv

__all__ = ["learning_curve", "Fit", "fit_learning_curve", "Prediction", "predict_iterations", "measured_tta",
           "rank", "compare", "read_curves", "validate", "markdown", "run_validation", "FRACTION", "MIN_POINTS",
           "DEFAULT_TARGETS", "QUICK_TARGETS", "SWEEP", "QUICK_SWEEP", "CASE_COLUMNS", "FIT_COLUMNS",
           "RANKING_COLUMNS", "RANKERS"]

#: The share of a run's iterations the predictor sees.
FRACTION = 0.2
#: The fewest evaluation points (after iteration 0) in the window: 3 parameters and one degree of freedom.
MIN_POINTS = 4
#: The bounds of the learning curve's exponent c.
C_MIN, C_MAX = 1e-3, 10.0
#: Targets of the full validation: above what most configurations reach in the first 20 % of 1000 iterations
#: (so the predictor must extrapolate) and below what most reach in 1000 (so the truth is measured).
DEFAULT_TARGETS = (0.84, 0.86)
QUICK_TARGETS = (0.68, 0.70)
#: The time-to-accuracy sweep (:func:`experiments.tta.plan`'s options) the full validation runs: its defaults
#: (mlp-256, dense / topk / gtopk / randk at 0.001 and 0.01, 3 seeds, gtopk-icdcs and dgx-h100, P = 16, lr 0.2)
#: but 1000 iterations (8.5 epochs) evaluated every 10, so the window is 200 iterations with 20 points.
SWEEP = dict(iterations=1000, eval_every=10)
#: --quick (CI): the tta quick plan (P = 8, lr 0.1, small evaluation sets) with dense, topk, gtopk at 0.001,
#: 2 seeds, 120 iterations evaluated every 4 (a window of 24 iterations, 6 points). Small, but a validation: at
#: :data:`QUICK_TARGETS` every configuration reaches the target with both seeds and the learning curve predicts a
#: finite time for each (two of three extrapolated), so Kendall tau and the top-1 agreement are computed over the
#: 3 configurations on each cluster (with 80 iterations every 4 and targets 0.72, 0.75 some seed of every
#: configuration was predicted "never", so the learning curve ranked nothing: tau n/a).
QUICK_SWEEP = dict(algorithms="dense,topk,gtopk", seeds=2, iterations=120, eval_every=4)

CASE_COLUMNS = ("target", "cluster", "algorithm", "density", "seeds", "iterations_run", "window_iteration",
                "iter_time_s", "accuracy_at_window", "n_observed", "n_predicted", "predicted_iteration",
                "predicted_tta_s", "n_reached", "measured_iteration", "measured_tta_s", "error_x_time_s",
                "rank_predicted", "rank_measured", "rank_time_per_iteration", "rank_error_x_time")
FIT_COLUMNS = ("target", "cluster", "algorithm", "density", "seed", "iterations_run", "window_iteration", "points",
               "a", "b", "c", "rmse", "how", "t_star", "predicted_iteration", "predicted_tta_s", "iter_time_s",
               "accuracy_at_window", "measured_iteration", "measured_tta_s")
RANKING_COLUMNS = ("target", "cluster", "ranker", "configurations", "kendall_tau", "p_value", "top1", "top1_measured",
                   "top1_agree", "measured_reached", "predicted_never", "observed")
#: ranker name -> the cases.csv column it ranks by (smaller first).
RANKERS = {"learning curve (20 %)": "predicted_tta_s", "s / iteration": "iter_time_s",
           "(1 - acc at 20 %) x s / iteration": "error_x_time_s"}
_RANK_COLUMN = {"predicted_tta_s": "rank_predicted", "iter_time_s": "rank_time_per_iteration",
                "error_x_time_s": "rank_error_x_time"}
_CURVE_KEYS = ("algorithm", "density", "seed", "cluster", "iteration", "sim_time_s", "test_accuracy")


# ------------------------------------------------------------------ the predictor

def learning_curve(t, a: float, b: float, c: float):
    """The inverse power law acc(t) = a - b t^(-c) (Domhan et al., IJCAI 2015, ``pow3``): a the asymptotic test
    accuracy, b > 0 the gap at t = 1, c > 0 the rate. t: iterations > 0 (float or float64 array, any shape);
    returns the same shape."""
    return a - b * np.power(np.asarray(t, dtype=np.float64), -c)


@dataclass(frozen=True)
class Fit:
    """A fitted learning curve: a, b, c of :func:`learning_curve` (nan when the fit failed), rmse (root mean square
    residual over the points, accuracy units), ok (False: curve_fit did not converge; ``message`` says why)."""

    a: float
    b: float
    c: float
    rmse: float
    ok: bool
    message: str = ""

    def crossing(self, target: float) -> float:
        """t* where the curve reaches ``target``: (b / (a - target))^(1/c) iterations (float); inf when the fit
        failed, the asymptote a <= target or t* overflows; 0.0 when b = 0 and a > target (a flat curve above it)."""
        if not self.ok or self.a <= target:
            return math.inf
        if self.b == 0:
            return 0.0
        with np.errstate(over="ignore"):
            t = float(np.power(self.b / (self.a - target), 1.0 / self.c))
        return t if math.isfinite(t) else math.inf


def _linear_ab(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least squares y ~ a - b x for fixed x = t^(-c), with 0 <= a <= 1 and b >= 0: (a, b, sum of squares)."""
    n = x.size
    xm, ym = x.mean(), y.mean()
    sxx = float(((x - xm) ** 2).sum())
    b = max(0.0, -float(((x - xm) * (y - ym)).sum()) / sxx) if sxx > 0 else 0.0
    a = min(1.0, max(0.0, ym + b * xm))
    r = y - (a - b * x)
    return a, b, float(r @ r) if n else 0.0


def fit_learning_curve(iterations, accuracy) -> Fit:
    """Least-squares fit of :func:`learning_curve` to the points (iterations, accuracy).

    iterations: float or int array (n,), > 0; accuracy: float array (n,), test accuracy in [0, 1]; n >= 3.
    Method: for each c of a log grid of 61 values in [C_MIN, C_MAX] the best (a, b) is linear least squares; the
    best grid point starts ``scipy.optimize.curve_fit`` (trust region reflective, bounds 0 <= a <= 1, b >= 0,
    C_MIN <= c <= C_MAX, tolerances 1e-12). Noiseless points of the model are recovered to about 1e-9 relative.
    Returns a :class:`Fit`; ok = False (and a, b, c nan) when curve_fit raises (no convergence). Raises ValueError
    for fewer than 3 points, a non-positive iteration or mismatched shapes."""
    from scipy.optimize import curve_fit

    t = np.asarray(iterations, dtype=np.float64)
    y = np.asarray(accuracy, dtype=np.float64)
    if t.shape != y.shape or t.ndim != 1 or t.size < 3 or not (t > 0).all():
        raise ValueError(f"fit_learning_curve needs >= 3 points at iterations > 0 (got shapes {t.shape}, {y.shape})")
    best = None
    for c in np.geomspace(C_MIN, C_MAX, 61):
        a, b, ss = _linear_ab(np.power(t, -c), y)
        if best is None or ss < best[3]:
            best = (a, b, float(c), ss)
    eps = 1e-9  # start strictly inside the bounds
    p0 = (min(max(best[0], eps), 1 - eps), max(best[1], eps), min(max(best[2], C_MIN * (1 + eps)), C_MAX * (1 - eps)))
    try:
        (a, b, c), _cov = curve_fit(learning_curve, t, y, p0=p0, bounds=([0.0, 0.0, C_MIN], [1.0, np.inf, C_MAX]),
                                    method="trf", ftol=1e-12, xtol=1e-12, gtol=1e-12, max_nfev=20_000)
    except (RuntimeError, ValueError) as err:  # no convergence
        return Fit(math.nan, math.nan, math.nan, math.nan, False, str(err).splitlines()[0])
    r = y - learning_curve(t, a, b, c)
    return Fit(float(a), float(b), float(c), float(np.sqrt(np.mean(r * r))), True)


@dataclass(frozen=True)
class Prediction:
    """The short-run prediction for one run: ``iteration`` (the predicted first evaluation point at the target;
    inf = never), ``how`` ("observed", "extrapolated", "asymptote below target", "fit failed"), ``t_star`` (the
    fitted curve's crossing, iterations; nan when observed), ``fit`` (None when observed) and ``points`` (the
    window's evaluation points after iteration 0)."""

    iteration: float
    how: str
    t_star: float
    fit: Fit | None
    points: int

    @property
    def reached(self) -> bool:
        """Whether the target is predicted to be reached."""
        return math.isfinite(self.iteration)


def predict_iterations(iterations, accuracy, target: float, window: int, eval_every: int) -> Prediction:
    """Predict the first evaluation point at which a run's test accuracy is >= ``target`` from its points up to
    iteration ``window`` only.

    iterations: int array (n,) of evaluation points in increasing order (0, eval_every, 2 eval_every, ...); accuracy:
    float array (n,) (test accuracy there); window: the last iteration the predictor may see (points after it are
    ignored); eval_every: the evaluation grid (iterations) the prediction is rounded up to.
    Rule: fewer than :data:`MIN_POINTS` points with 0 < iteration <= window is a ConfigError; a point <= window at the target -> that point ("observed"); else :func:`fit_learning_curve` on the points
    0 < iteration <= window, t* = :meth:`Fit.crossing`, and the prediction is the first grid point >= t* and > window
    ("extrapolated"), or inf ("asymptote below target" / "fit failed"). The ConfigError names the window and
    eval_every."""
    t = np.asarray(iterations, dtype=np.int64)
    y = np.asarray(accuracy, dtype=np.float64)
    seen = t <= window
    hit = np.flatnonzero(seen & (y >= target))
    points = int((seen & (t > 0)).sum())
    if points < MIN_POINTS:
        raise ConfigError(f"the first {window} iterations hold {points} evaluation points after iteration 0 (eval every "
                          f"{eval_every}): valid >= {MIN_POINTS}; evaluate more often (tta --eval-every) or run longer")
    if hit.size:
        return Prediction(float(t[hit[0]]), "observed", math.nan, None, points)
    use = seen & (t > 0)
    fit = fit_learning_curve(t[use], y[use])
    if not fit.ok:
        return Prediction(math.inf, "fit failed", math.nan, fit, points)
    ts = fit.crossing(target)
    if not math.isfinite(ts):
        return Prediction(math.inf, "asymptote below target", ts, fit, points)
    it = max(eval_every * math.ceil(ts / eval_every), window + eval_every)
    return Prediction(float(it), "extrapolated", ts, fit, points)


def measured_tta(iterations, sim_time_s, accuracy, target: float) -> tuple[int, float] | None:
    """The measured time to ``target`` of a full run: (iteration, simulated s) of its first evaluation point whose
    test accuracy is >= target, or None when no point reaches it (the rule of :mod:`experiments.tta`).
    iterations, sim_time_s, accuracy: arrays (n,) of the run's evaluation points in iteration order (sim_time_s: the
    run's clock there, s)."""
    for t, s, a in zip(iterations, sim_time_s, accuracy):
        if a >= target:
            return int(t), float(s)
    return None


# ------------------------------------------------------------------ ranking and its comparison

def rank(values) -> np.ndarray:
    """Competition ranks (1 = smallest; equal values share the lowest rank, ``scipy.stats.rankdata`` method "min")
    of ``values`` (floats, shape (n,)); inf (never / not reached) ranks last, all infs tied. Returns int64 (n,)."""
    from scipy.stats import rankdata

    return rankdata(np.asarray(values, dtype=np.float64), method="min").astype(np.int64)


def compare(predicted, measured, names) -> dict:
    """How a ranking by ``predicted`` agrees with the ranking by ``measured`` (both floats (n,), smaller first, inf
    = never; ``names`` (n,) the configurations).

    Returns kendall_tau and p_value (``scipy.stats.kendalltau``, tau-b: ties -- the nevers -- counted as ties; nan
    when either side is constant or n < 2), top1 / top1_measured (the configuration with the smallest finite value,
    first in order on a tie; None when every value is inf) and top1_agree (both exist and are equal; None when the
    measured side has none). Without ties tau = 1 - 4 s / (n (n - 1)), s the number of discordant pairs."""
    from scipy.stats import kendalltau

    p = np.asarray(predicted, dtype=np.float64)
    m = np.asarray(measured, dtype=np.float64)
    if len(p) >= 2 and np.unique(p).size > 1 and np.unique(m).size > 1:
        res = kendalltau(rank(p), rank(m))
        tau, pv = float(res.statistic), float(res.pvalue)
    else:
        tau = pv = math.nan

    def top(v):
        fin = np.flatnonzero(np.isfinite(v))
        return None if fin.size == 0 else names[int(fin[np.argmin(v[fin])])]

    t1, t1m = top(p), top(m)
    return {"kendall_tau": tau, "p_value": pv, "top1": t1, "top1_measured": t1m,
            "top1_agree": None if t1m is None else t1 == t1m}


# ------------------------------------------------------------------ the runs

def _float(v: str) -> float | None:
    return None if v == "" else float(v)


def read_curves(runs: Path) -> list[dict]:
    """The evaluation points of a time-to-accuracy sweep: ``runs/curves.csv`` as written by ``sparsim experiment
    tta`` (:data:`experiments.tta.CURVE_COLUMNS`): dicts with algorithm (str), density (float or None), seed (int),
    cluster (str), iteration (int), sim_time_s (float, s), test_accuracy (float). Raises ConfigError (one line
    naming the path) when the directory or the file is missing, the header lacks a column, or a value is not a
    number."""
    runs = Path(runs)
    f = runs / "curves.csv"
    if not runs.is_dir():
        raise ConfigError(f"--runs {str(runs)!r} is not a directory: valid the output directory of sparsim "
                          "experiment tta (holding curves.csv)")
    if not f.is_file():
        raise ConfigError(f"--runs {str(runs)!r} holds no curves.csv: valid the output directory of sparsim experiment "
                          "tta")
    with open(f, newline="") as fh:
        rd = csv.DictReader(fh)
        missing = [k for k in _CURVE_KEYS if k not in (rd.fieldnames or [])]
        if missing:
            raise ConfigError(f"{str(f)!r} lacks the column(s) {', '.join(missing)}: valid a curves.csv of sparsim "
                              "experiment tta")
        out = []
        try:
            for r in rd:
                out.append({"algorithm": r["algorithm"], "density": _float(r["density"]), "seed": int(r["seed"]),
                            "cluster": r["cluster"], "iteration": int(r["iteration"]),
                            "sim_time_s": float(r["sim_time_s"]), "test_accuracy": float(r["test_accuracy"])})
        except ValueError as err:
            raise ConfigError(f"{str(f)!r} line {rd.line_num}: {err}: valid numbers in iteration, seed, density, "
                              "sim_time_s and test_accuracy") from None
    if not out:
        raise ConfigError(f"{str(f)!r} has no rows: valid a curves.csv of a finished sparsim experiment tta")
    return out


def _label(alg: str, dens: float | None) -> str:
    return alg if dens is None else f"{alg} {dens:g}"


def _check_targets(targets) -> tuple[float, ...]:
    items = [x.strip() for x in targets.split(",")] if isinstance(targets, str) else list(targets)
    out: list[float] = []
    for x in items:
        if x == "":
            continue
        try:
            t = float(x)
        except (TypeError, ValueError):
            raise ConfigError(f"--targets: {x!r} is not a number: valid comma-separated test accuracies in (0, 1]") \
                from None
        if not (0 < t <= 1):
            raise ConfigError(f"--targets: {x!r} is out of range: valid 0 < target <= 1 (a test accuracy)")
        if t in out:
            raise ConfigError(f"--targets names {t:g} twice: valid each once")
        out.append(t)
    if not out:
        raise ConfigError(f"--targets {targets!r} names none: valid comma-separated test accuracies in (0, 1]")
    return tuple(out)


def _check_fraction(fraction) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (0 < fraction < 1):
        raise ConfigError(f"--fraction {fraction!r} is out of range: valid 0 < fraction < 1 (the share of each run's "
                          "iterations the predictor sees)")
    return float(fraction)


def _runs_of(curves: list[dict]) -> dict:
    """(algorithm, density, cluster) -> seed -> (iterations, sim_time_s, accuracy) arrays, in first-seen order."""
    out: dict = {}
    for r in curves:
        out.setdefault((r["algorithm"], r["density"], r["cluster"]), {}).setdefault(r["seed"], []).append(r)
    res: dict = {}
    for key, seeds in out.items():
        res[key] = {}
        for s, rows in seeds.items():
            rows.sort(key=lambda r: r["iteration"])
            res[key][s] = (np.array([r["iteration"] for r in rows], dtype=np.int64),
                           np.array([r["sim_time_s"] for r in rows], dtype=np.float64),
                           np.array([r["test_accuracy"] for r in rows], dtype=np.float64))
    return res


def _check_reachable(runs: dict, targets) -> None:
    """ConfigError (one line) for a target that no configuration's full runs reach with every seed on any cluster:
    its measured ranking would be all 'not reached', so nothing is validated. The valid range names the highest
    target some configuration reaches with every seed (max over configurations of the min over seeds of the best
    test accuracy)."""
    per_config = [min(float(acc.max()) for _its, _clock, acc in seeds.values()) for seeds in runs.values() if seeds]
    if not per_config:
        return
    top = max(per_config)
    for t in targets:
        if t > top:
            raise ConfigError(f"--targets {t:g} is reached by no configuration of the runs with every seed, so no "
                              f"ranking can be validated at it (the best a configuration reaches with every seed is "
                              f"test accuracy {top:.4g}): valid 0 < target <= {top:.4g}")


def _seed_record(its, clock, acc, target: float, fraction: float) -> dict:
    """One run's prediction from its window and its measurement from the whole run (a FIT_COLUMNS row's values)."""
    T = int(its[-1])
    if its.size < 2 or its[0] != 0:
        raise ConfigError(f"a run's evaluation points start at iteration {int(its[0])} and number {its.size}: valid "
                          "iteration 0 and at least one more (a curves.csv of sparsim experiment tta)")
    e = int(its[1] - its[0])
    inside = its[its <= fraction * T]
    W = int(inside[-1])
    if W == 0:
        raise ConfigError(f"the first {fraction:g} of a {T}-iteration run ({fraction * T:g} iterations) holds no "
                          f"evaluation point after iteration 0 (eval every {e}): valid >= {MIN_POINTS}; evaluate more "
                          "often (tta --eval-every) or run longer")
    pred = predict_iterations(its, acc, target, W, e)
    s_per_it = float(clock[its == W][0]) / W
    if not pred.reached:
        p_tta = math.inf
    elif pred.iteration <= W:
        p_tta = float(clock[its == int(pred.iteration)][0])  # the run's own clock at an observed point
    else:
        p_tta = pred.iteration * s_per_it
    meas = measured_tta(its, clock, acc, target)
    f = pred.fit
    return {"iterations_run": T, "window_iteration": W, "points": pred.points,
            "a": None if f is None else f.a, "b": None if f is None else f.b, "c": None if f is None else f.c,
            "rmse": None if f is None else f.rmse, "how": pred.how, "t_star": pred.t_star,
            "predicted_iteration": pred.iteration, "predicted_tta_s": p_tta, "iter_time_s": s_per_it,
            "accuracy_at_window": float(acc[its == W][0]),
            "measured_iteration": math.inf if meas is None else float(meas[0]),
            "measured_tta_s": math.inf if meas is None else meas[1]}


def _mean_or_inf(values) -> float:
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()) if np.isfinite(v).all() else math.inf


def validate(curves: list[dict], targets, fraction: float = FRACTION) -> tuple[list[dict], list[dict], list[dict]]:
    """The validation on a sweep's evaluation points (:func:`read_curves`): returns (cases, fits, rankings), lists
    of dicts with :data:`CASE_COLUMNS`, :data:`FIT_COLUMNS`, :data:`RANKING_COLUMNS` (inf = never / not reached).

    Per target and cluster every configuration (algorithm, density) is predicted from each seed's window
    (:func:`predict_iterations`) and measured on each seed's full run (:func:`measured_tta`); the configuration's
    value is the mean over its seeds when every seed has a finite one, else inf. Each ranker of :data:`RANKERS` is
    compared with the measured ranking (:func:`compare`). Raises ConfigError for a target outside (0, 1], a target
    no configuration reaches with every seed (:func:`_check_reachable`), a fraction outside (0, 1) or a window with
    too few evaluation points."""
    targets = _check_targets(targets)
    fraction = _check_fraction(fraction)
    runs = _runs_of(curves)
    clusters = list(dict.fromkeys(k[2] for k in runs))
    configs = list(dict.fromkeys(k[:2] for k in runs))
    cases, fits, rankings = [], [], []
    for target in targets:
        for cl in clusters:
            rows = []
            for alg, dens in configs:
                seeds = runs.get((alg, dens, cl))
                if seeds is None:
                    continue
                recs = []
                for s, (its, clock, acc) in seeds.items():
                    rec = _seed_record(its, clock, acc, target, fraction)
                    recs.append(rec)
                    fits.append({"target": target, "cluster": cl, "algorithm": alg, "density": dens, "seed": s, **rec})
                it_s = float(np.mean([r["iter_time_s"] for r in recs]))
                acc_w = float(np.mean([r["accuracy_at_window"] for r in recs]))
                rows.append({
                    "target": target, "cluster": cl, "algorithm": alg, "density": dens, "seeds": len(recs),
                    "iterations_run": int(np.mean([r["iterations_run"] for r in recs])),
                    "window_iteration": int(np.mean([r["window_iteration"] for r in recs])),
                    "iter_time_s": it_s, "accuracy_at_window": acc_w,
                    "n_observed": sum(r["how"] == "observed" for r in recs),
                    "n_predicted": sum(math.isfinite(r["predicted_iteration"]) for r in recs),
                    "predicted_iteration": _mean_or_inf([r["predicted_iteration"] for r in recs]),
                    "predicted_tta_s": _mean_or_inf([r["predicted_tta_s"] for r in recs]),
                    "n_reached": sum(math.isfinite(r["measured_iteration"]) for r in recs),
                    "measured_iteration": _mean_or_inf([r["measured_iteration"] for r in recs]),
                    "measured_tta_s": _mean_or_inf([r["measured_tta_s"] for r in recs]),
                    "error_x_time_s": (1.0 - acc_w) * it_s})
            meas = [r["measured_tta_s"] for r in rows]
            rows_rank = rank(meas)
            for r, rk in zip(rows, rows_rank):
                r["rank_measured"] = int(rk)
            names = [_label(r["algorithm"], r["density"]) for r in rows]
            for ranker, col in RANKERS.items():
                vals = [r[col] for r in rows]
                for r, rk in zip(rows, rank(vals)):
                    r[_RANK_COLUMN[col]] = int(rk)
                cmp = compare(vals, meas, names)
                rankings.append({"target": target, "cluster": cl, "ranker": ranker, "configurations": len(rows), **cmp,
                                 "measured_reached": sum(math.isfinite(m) for m in meas),
                                 "predicted_never": sum(not math.isfinite(v) for v in vals),
                                 "observed": sum(r["n_observed"] == r["seeds"] for r in rows)})
            cases += rows
    _check_reachable(runs, targets)  # after the windows' checks, which name a sweep's structural fault
    return cases, fits, rankings


# ------------------------------------------------------------------ report, figure

def _g(x, spec: str = ".3g") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(x, spec)


def _tta_cell(v: float, n: int, N: int, spec: str, never: str) -> str:
    return _g(v, spec) if math.isfinite(v) else f"{never} ({n}/{N})"


def markdown(cases: list[dict], rankings: list[dict], *, fraction: float, source: str) -> str:
    """report.md: the rule, the agreement per target, cluster and ranker, and per target and cluster the table of
    configurations (predicted and measured time to accuracy, the ranks)."""
    lines = [
        "# Does a short run rank the configurations as the full runs do?",
        "",
        f"Runs: {source}. The predictor sees the first {fraction:g} of each run's iterations (the evaluation points up "
        "to W), fits acc(t) = a - b t^(-c) there, and predicts the first evaluation point at the target (rounded up "
        "to the evaluation grid) x the run's simulated s / iteration; a point of the window already at the target is "
        "taken as observed. Measured: the full run's first evaluation point at the target and its simulated clock "
        "there. Per configuration: the mean over its seeds when every seed reaches (is predicted to reach) the "
        "target, else 'never' / 'not reached', ranked last. Kendall tau-b (scipy.stats.kendalltau) between a "
        "ranking and the measured one; top-1: whether their first places agree.",
        "",
        "## Agreement with the measured ranking",
        "",
        "| target | cluster | ranked by | configurations | Kendall tau | p | top-1 | measured top-1 | top-1 agrees |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rankings:
        agree = "n/a" if r["top1_agree"] is None else ("yes" if r["top1_agree"] else "no")
        lines.append(f"| {r['target']:g} | {r['cluster']} | {r['ranker']} | {r['configurations']} | "
                     f"{_g(r['kendall_tau'], '.3f')} | {_g(r['p_value'], '.2g')} | {r['top1'] or 'none'} | "
                     f"{r['top1_measured'] or 'none'} | {agree} |")
    for target in dict.fromkeys(c["target"] for c in cases):
        for cl in dict.fromkeys(c["cluster"] for c in cases if c["target"] == target):
            rows = sorted((c for c in cases if c["target"] == target and c["cluster"] == cl),
                          key=lambda c: (c["rank_measured"], c["rank_predicted"]))
            lines += ["", f"## Target {target:g} on {cl}", "",
                      "| configuration | s / iteration | acc at W | predicted iterations | predicted TTA (s) | "
                      "measured iterations | measured TTA (s) | rank: measured | predicted | s / iteration | "
                      "(1 - acc) x s / it |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            for c in rows:
                N = c["seeds"]
                how = f" ({c['n_observed']}/{N} observed)" if c["n_observed"] else ""
                lines.append(
                    f"| {_label(c['algorithm'], c['density'])} | {c['iter_time_s']:.4g} | {c['accuracy_at_window']:.4f} | "
                    f"{_tta_cell(c['predicted_iteration'], c['n_predicted'], N, '.0f', 'never')}{how} | "
                    f"{_tta_cell(c['predicted_tta_s'], c['n_predicted'], N, '.3g', 'never')} | "
                    f"{_tta_cell(c['measured_iteration'], c['n_reached'], N, '.0f', 'not reached')} | "
                    f"{_tta_cell(c['measured_tta_s'], c['n_reached'], N, '.3g', 'not reached')} | "
                    f"{c['rank_measured']} | {c['rank_predicted']} | {c['rank_time_per_iteration']} | "
                    f"{c['rank_error_x_time']} |")
    return "\n".join(lines)


def _figure(cases: list[dict], outdir: Path) -> None:
    """validation.png / .pdf: predicted against measured time to accuracy (log-log), one panel per target (two per
    row), one marker
    per configuration and cluster (colour: cluster; marker: algorithm; filled: the larger density); 'never' and 'not
    reached' drawn on a band beyond the largest finite value; the diagonal y = x."""
    from matplotlib.lines import Line2D
    from matplotlib.transforms import blended_transform_factory

    from .plots import figure_legend, plt

    targets = list(dict.fromkeys(c["target"] for c in cases))
    clusters = list(dict.fromkeys(c["cluster"] for c in cases))
    algs = list(dict.fromkeys(c["algorithm"] for c in cases))
    dens = sorted({c["density"] for c in cases if c["density"] is not None})
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    ncol = min(len(targets), 2)
    nrow = -(-len(targets) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.6 * ncol, 5.0 * nrow + 0.8), squeeze=False)
    for ax in axes.flat[len(targets):]:
        ax.set_visible(False)
    for ax, target in zip(axes.flat, targets):
        rows = [c for c in cases if c["target"] == target]
        fin = [v for c in rows for v in (c["predicted_tta_s"], c["measured_tta_s"]) if math.isfinite(v) and v > 0]
        lo, hi = (min(fin), max(fin)) if fin else (1e-3, 1.0)
        edge = hi * 3.0
        for c in rows:
            x = c["measured_tta_s"] if math.isfinite(c["measured_tta_s"]) else edge
            y = c["predicted_tta_s"] if math.isfinite(c["predicted_tta_s"]) else edge
            filled = c["density"] is None or (len(dens) > 1 and c["density"] == dens[-1])
            col = f"C{clusters.index(c['cluster'])}"
            ax.plot([x], [y], ls="", marker=markers[algs.index(c["algorithm"]) % len(markers)], ms=8, mec=col,
                    mfc=col if filled else "none", mew=1.5)
        ax.plot([lo / 2, edge * 1.5], [lo / 2, edge * 1.5], color="0.4", ls="--", lw=0.9)
        ax.axvline(edge / 1.7, color="0.7", lw=0.8)
        ax.axhline(edge / 1.7, color="0.7", lw=0.8)
        ax.text(edge, 1.01, "not reached", transform=blended_transform_factory(ax.transData, ax.transAxes),
                ha="center", va="bottom", fontsize=8, color="0.35")
        ax.text(1.01, edge, "never", transform=blended_transform_factory(ax.transAxes, ax.transData), ha="left",
                va="center", fontsize=8, color="0.35")
        ax.set(xscale="log", yscale="log", xlim=(lo / 2, edge * 1.5), ylim=(lo / 2, edge * 1.5),
               xlabel="measured time to accuracy (simulated s, full runs)",
               ylabel="predicted from the first 20 % (simulated s)")
        ax.set_title(f"target test accuracy {target:g}", pad=14)
        ax.grid(alpha=0.3, which="both")
    handles = [Line2D([], [], ls="", marker="o", color=f"C{i}", ms=8) for i in range(len(clusters))]
    labels = list(clusters)
    handles += [Line2D([], [], ls="", marker=markers[i % len(markers)], color="0.3", ms=8) for i in range(len(algs))]
    labels += algs
    if len(dens) > 1:
        handles += [Line2D([], [], ls="", marker="o", mfc="none", mec="0.3", ms=8),
                    Line2D([], [], ls="", marker="o", color="0.3", ms=8)]
        labels += [f"density {dens[0]:g} (open)", f"density {dens[-1]:g} and dense (filled)"]
    fig.suptitle("Time to accuracy predicted from the first 20 % of each run against the full runs' (mean over seeds; "
                 "dashed: y = x)", fontsize=10)
    figure_legend(fig, handles, labels, suptitle=True)
    save_figure(fig, outdir, "validation")


def _inf_to_none(rows: list[dict]) -> list[dict]:
    return [{k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in r.items()} for r in rows]


def run_validation(out, *, runs=None, quick: bool = False, force: bool = False, jobs: int | None = None,
                   scheduler: str | None = None, progress: bool = True, targets=None,
                   fraction: float | None = None) -> tuple[Path, list[dict], str]:
    """Validate the short-run ranking into ``out`` (via ``out.partial``); return (path, rankings, Markdown).

    runs: the output directory of an ``sparsim experiment tta`` sweep to read (None: run the sweep of :data:`SWEEP`,
    or :data:`QUICK_SWEEP` with ``quick``, into ``out/tta`` with ``jobs`` local processes or a Dask ``scheduler``;
    an interrupted sweep resumes). targets: test accuracies in (0, 1] (comma-separated string or sequence; default
    :data:`DEFAULT_TARGETS`, :data:`QUICK_TARGETS` with quick); fraction: the share of each run the predictor sees
    (default 0.2). Raises ConfigError (nothing written) for a bad target or fraction, ``runs`` without tta outputs,
    ``runs`` given with quick / jobs / scheduler (options the reading does not use), an ``out`` that exists and is not
    empty (unless ``force``), or a window with fewer than :data:`MIN_POINTS` evaluation points; what
    :func:`experiments.tta.run_tta` raises when it runs the sweep."""
    targets = _check_targets(targets if targets is not None else (QUICK_TARGETS if quick else DEFAULT_TARGETS))
    fraction = _check_fraction(FRACTION if fraction is None else fraction)
    out = Path(out)
    if runs is not None:
        unused = [o for o, v in (("--quick", quick), ("--jobs", jobs), ("--scheduler", scheduler)) if v]
        if unused:
            raise ConfigError(f"{', '.join(unused)} with --runs: the runs are read, not run: valid --runs alone or "
                              "the options of the sweep without --runs")
        curves = read_curves(Path(runs))
        cases, fits, rankings = validate(curves, targets, fraction)  # errors before anything is written
        check_out(out, force)
        tmp = partial_dir(out)
        source = f"the sweep in {runs}"
    else:
        from .sweep import resolve_jobs
        from .tta import plan, run_tta

        opts = dict(QUICK_SWEEP if quick else SWEEP)
        pl = plan(quick, target=targets[0], **opts)  # checks the sweep before anything is written
        check_out(out, force)
        jobs = resolve_jobs(jobs, scheduler)
        tmp = partial_dir(out, fresh=False, resume_key=f"validate-advisor {pl.resume_key()}")
        if not (tmp / "tta" / "curves.csv").is_file():  # a finished sweep of an interrupted validation is kept
            run_tta(tmp / "tta", quick=quick, jobs=jobs, scheduler=scheduler, progress=progress,
                    target=targets[0], **opts)
        cases, fits, rankings = validate(read_curves(tmp / "tta"), targets, fraction)
        cmd = "sparsim experiment validate-advisor" + (" --quick" if quick else "")
        source = (f"`{cmd}` ran `sparsim experiment tta` into tta/: {pl.model} on Fashion-MNIST, P = {pl.P}, "
                  f"b = {pl.batch_size}, lr = {pl.lr:g}, {pl.iterations} iterations evaluated every {pl.eval_every}, "
                  f"seeds 0..{pl.seeds - 1}, clusters {', '.join(pl.clusters)}")
    write_csv(tmp / "cases.csv", CASE_COLUMNS, _inf_to_none(cases))
    write_csv(tmp / "fits.csv", FIT_COLUMNS, _inf_to_none(fits))
    write_csv(tmp / "rankings.csv", RANKING_COLUMNS, rankings)
    _figure(cases, tmp)
    report = markdown(cases, rankings, fraction=fraction, source=source)
    (tmp / "report.md").write_text(report + "\n")
    publish(tmp, out)
    return out, rankings, report
