"""``sparsim experiment tta``: time to accuracy of dense, Top-k, gTop-k and rand-k on a network trained on images.

A sweep of algorithms x densities x seeds on one network of the image zoo (:data:`sim.workloads.nets.NET_ZOO`) trained on
Fashion-MNIST by P simulated workers with error feedback (a ``[model]`` run, :mod:`experiments.run_net`), timed on
one or more clusters. For each case (algorithm, density, seed) and cluster it reports the iterations and the
simulated time (s) to first reach a target test accuracy, the final and the best test accuracy; then the mean and
the spread over the seeds.

Train once, time on every cluster. The numbers of a case (gradients, selections, residuals, accuracies) do not
depend on the cluster: the cluster only times the iterations. Each iteration's time is the network's layer-wise
timeline on that cluster (:class:`sim.engine.timeline.TimelineClock`, the clock of a ``[model]`` run), which follows from
k, d, the policies and the device, never from the values. So each case is trained once (a ``sparsim run`` folder
under ``runs/``, timed on the first cluster), and its clock on every cluster is the float64 ``np.cumsum`` of that
cluster's iteration times (:func:`cluster_iteration_times`, built as :class:`experiments.build.Built` builds it); on
the first cluster it is checked to equal, bit for bit, the ``sim_time_s`` the training run wrote.

Rules (results.md states them):

- time to target: the first *evaluation point* (iteration 0 and every ``eval_every`` iterations, and the run's
  last) whose ``test_accuracy`` is >= the target; its iteration and the cluster's clock at it (s). The resolution
  is eval_every iterations: the true first crossing lies within the eval_every iterations before the reported one.
- a case that never reaches the target is "not reached" (empty cells in the CSVs). Over the N seeds: n reached; the
  mean and the sample standard deviation (ddof = 1) of the time to target only when all N reached it (else they are
  not a number, and results.md says "not reached"); min and max over the seeds that reached it.
- final test accuracy: at the last evaluation point of the run (with a time budget: the last one within the budget
  on that cluster); best: the largest at any evaluation point (within the budget).
- time budget (``time_budget_s``): on each cluster a case keeps the iterations whose clock is <= the budget (the
  rule of :meth:`sim.engine.timeline.TimelineClock.iterations_within`); the case is trained for the most iterations any
  cluster keeps (at most ``iterations``), so every cluster's runs stop at the same simulated time.

Parallel cases: local processes are *spawned*, not forked (a forked child of a process whose torch thread pool has
started can deadlock in torch), and every case runs with one torch thread and one BLAS thread, so the numbers do not
depend on ``--jobs``; or a Dask cluster (``--scheduler``).

Outputs (built in ``DIR.partial``, renamed when complete; the finished case folders of an interrupted sweep are
reused when it is resumed with the same settings): ``tta.csv`` (:data:`TTA_COLUMNS`: per case, seed and cluster),
``summary.csv`` (:data:`SUMMARY_COLUMNS`: per algorithm x density x cluster), ``curves.csv`` (:data:`CURVE_COLUMNS`:
every evaluation point on every cluster), ``clocks.csv`` (:data:`CLOCK_COLUMNS`: every iteration's time on every
cluster), ``results.md``, ``tta.png`` / ``tta.pdf`` and ``runs/<case>/`` (sparsim run folders).

Sources: gTop-k S-SGD, Shi et al., IJCAI 2019 (gTop-k at density 0.001 converges as dense S-SGD) and ICDCS 2019
(its cluster); Top-k S-SGD with error feedback, Aji and Heafield 2017; Mem-SGD (top-k and rand-k with memory),
Stich, Cordonnier and Jaggi, NeurIPS 2018; Fashion-MNIST, Xiao et al. 2017.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.base.errors import ConfigError, SparsimError

from .outdir import check_out, partial_dir, publish, save_figure, write_csv
from .sweep import map_jobs, resolve_jobs

__all__ = ["Plan", "Case", "plan", "cluster_iteration_times", "run_case", "time_to_target", "spread", "summarise",
           "markdown", "run_tta", "TTA_COLUMNS", "SUMMARY_COLUMNS", "CURVE_COLUMNS", "CLOCK_COLUMNS",
           "DEFAULT_TARGET", "CLAIM_TOL"]

DATASET = "fashion-mnist"
TRAIN_IMAGES = 60_000  # Fashion-MNIST's training images (sim.workloads.idx checks the files' counts)
DEVICE = "P102-100"  # the gTop-k papers' GPU (their cluster, ICDCS 2019 / IJCAI 2019)
DEFAULT_TARGET = 0.80
#: Tolerance on the test accuracy of the gTop-k claim "reaches dense's accuracy": 1 percentage point.
CLAIM_TOL = 0.01

TTA_COLUMNS = ("model", "algorithm", "density", "k", "seed", "cluster", "P", "target", "iterations_run",
               "sim_time_end_s", "iter_time_s", "reached", "tta_iteration", "tta_sim_time_s", "final_iteration",
               "final_sim_time_s", "final_test_accuracy", "best_test_accuracy", "best_iteration", "best_sim_time_s",
               "run_dir")
SUMMARY_COLUMNS = ("model", "algorithm", "density", "k", "cluster", "P", "target", "seeds", "n_reached",
                   "tta_iteration_mean", "tta_iteration_std", "tta_iteration_min", "tta_iteration_max",
                   "tta_sim_time_s_mean", "tta_sim_time_s_std", "tta_sim_time_s_min", "tta_sim_time_s_max",
                   "final_test_accuracy_mean", "final_test_accuracy_std", "final_test_accuracy_min",
                   "final_test_accuracy_max", "best_test_accuracy_mean", "best_test_accuracy_std",
                   "iterations_run", "iter_time_s")
CURVE_COLUMNS = ("algorithm", "density", "seed", "cluster", "iteration", "sim_time_s", "test_accuracy",
                 "train_accuracy", "test_loss", "loss")
CLOCK_COLUMNS = ("algorithm", "density", "seed", "cluster", "iteration", "iter_time_s", "sim_time_s")
#: The columns of a training run's evaluated rows that the sweep keeps.
ROW_KEYS = ("iteration", "sim_time_s", "test_accuracy", "train_accuracy", "test_loss", "loss")


@dataclass(frozen=True)
class Case:
    """One training run: ``algorithm`` (a registered name), ``density`` (k/d; None for an algorithm without k, such
    as dense) and ``seed`` (data sharding, mini-batches and the network's initial weights)."""

    algorithm: str
    density: float | None
    seed: int

    @property
    def name(self) -> str:
        """The case folder's name under ``runs/``: ``dense_s0``, ``gtopk_d0.001_s2``."""
        d = "" if self.density is None else f"_d{self.density:g}"
        return f"{self.algorithm}{d}_s{self.seed}"

    @property
    def group(self) -> tuple[str, float | None]:
        """(algorithm, density): the case without its seed."""
        return self.algorithm, self.density


def _group_label(group) -> str:
    alg, dens = group
    return alg if dens is None else f"{alg} {dens:g}"


@dataclass(frozen=True)
class Plan:
    """The sweep's settings (:func:`plan` fills and checks them).

    model: a network of :data:`sim.workloads.nets.NET_ZOO`; algorithms: registered names; densities: k/d in (0, 1] (for the
    algorithms with k); seeds: seeds 0 .. seeds-1; clusters: ``cluster.network`` presets (the first one times the
    training runs); P workers of ``batch_size`` images each; constant step ``lr``; heavy-ball ``momentum``;
    ``iterations`` (the cap); ``eval_every`` (iterations between evaluations); ``time_budget_s`` (simulated s;
    0 = none); ``target`` test accuracy in (0, 1]; eval_samples / test_samples: images of the training / test
    evaluation (model.eval_samples / model.test_samples); dtype: the arithmetic; quick: the CI size."""

    model: str
    algorithms: tuple[str, ...]
    densities: tuple[float, ...]
    seeds: int
    clusters: tuple[str, ...]
    P: int
    iterations: int
    eval_every: int
    time_budget_s: float
    target: float
    batch_size: int
    lr: float
    momentum: float
    eval_samples: int
    test_samples: int
    dtype: str = "float32"
    quick: bool = False

    def cases(self) -> list[Case]:
        """Every case in order: per algorithm, per density (one case with density None for an algorithm without k),
        per seed."""
        out = []
        for a in self.algorithms:
            dens = self.densities if _sparse(a) else (None,)
            out += [Case(a, d, s) for d in dens for s in range(self.seeds)]
        return out

    def groups(self) -> list[tuple[str, float | None]]:
        """The (algorithm, density) groups in order (a case without its seed)."""
        return list(dict.fromkeys(c.group for c in self.cases()))

    def resume_key(self) -> str:
        """What the case folders depend on: every setting but the algorithms, densities and seeds (which name the
        folders) and the target (which only the report reads)."""
        return (f"tta quick={self.quick} model={self.model} clusters={','.join(self.clusters)} P={self.P} "
                f"iterations={self.iterations} eval_every={self.eval_every} budget={self.time_budget_s!r} "
                f"batch={self.batch_size} lr={self.lr!r} momentum={self.momentum!r} eval={self.eval_samples} "
                f"test={self.test_samples} dtype={self.dtype}")

    def overrides(self, case: Case, cluster: str, iterations: int | None = None) -> list[str]:
        """The ``--set`` overrides of the embedded default scenario that make ``case`` on ``cluster`` with
        ``iterations`` iterations (default the plan's) and no time budget (the sweep applies it per cluster)."""
        T = self.iterations if iterations is None else iterations
        ov = [f"name='tta-{case.name}'", f"seed={case.seed}", f"algorithms=['{case.algorithm}']",
              f"model.name='{self.model}'", f"data.dataset='{DATASET}'", f"cluster.P={self.P}",
              f"cluster.network='{cluster}'", f"training.iterations={T}",
              f"training.batch_size={self.batch_size}", f"training.lr={self.lr!r}",
              f"training.momentum={self.momentum!r}", f"training.eval_every={self.eval_every}",
              f"training.dtype='{self.dtype}'", f"model.eval_samples={self.eval_samples}",
              f"model.test_samples={self.test_samples}", f"workload.device='{DEVICE}'"]
        if case.density is not None:
            ov.append(f"compression.density={case.density!r}")
        return ov

    def scenario(self, case: Case, cluster: str, iterations: int | None = None):
        """The :class:`experiments.scenario.Scenario` of ``case`` on ``cluster`` (ConfigError for a bad value)."""
        from .scenario import load_scenario

        return load_scenario(None, self.overrides(case, cluster, iterations))

    def k(self, density: float | None) -> int | None:
        """Coordinates selected per worker at ``density`` on the plan's network (None for density None)."""
        from sim.workloads.nets import NET_PARAMS

        if density is None:
            return None
        d = NET_PARAMS[self.model]
        return min(d, max(1, round(density * d)))


def _sparse(algorithm: str) -> bool:
    from sim.algorithms import get, resolve

    return get(resolve(algorithm)[0]).sparse


def plan(quick: bool = False, *, model: str | None = None, algorithms=None, densities=None, seeds: int | None = None,
         target: float | None = None, clusters=None, P: int | None = None, iterations: int | None = None,
         time_budget_s: float | None = None, eval_every: int | None = None, lr: float | None = None,
         momentum: float | None = None, batch_size: int | None = None) -> Plan:
    """The sweep's :class:`Plan`: every argument left None takes its default (full, or ``quick``); then the whole
    plan is checked. algorithms, densities and clusters: sequences or comma-separated strings.

    Full: mlp-256 (203,530 parameters); dense, and topk, gtopk and randk at densities 0.001 and 0.01 (k = 204 and
    2035); 3 seeds; clusters gtopk-icdcs (the gTop-k papers' cluster: 4 nodes x 4 P102-100 on PCIe, 1 GbE between
    nodes) and dgx-h100 (8 H100 per node on NVSwitch, 8 x 400 Gb/s); P = 16 workers of b = 32 images; plain SGD
    (momentum 0) at lr = 0.2; 300 iterations (2.6 epochs); an evaluation every 25 on 2048 training and 2000 test
    images; target 0.80. Quick (CI): dense and gtopk at 0.001 only, 3 seeds, P = 8, lr = 0.1, 30 iterations, an
    evaluation every 10 on 256 / 500 images, target 0.65.

    Raises ConfigError (one line naming the option and the valid range): a target not in (0, 1]; an unknown or
    repeated algorithm or cluster; a density not in (0, 1] or repeated; seeds, iterations, eval_every, P or
    batch_size < 1; a time budget <= 0 or not finite; a non-finite lr or momentum; P x batch_size above the 60,000
    training images; and whatever the scenario of a case refuses (an unknown model, a P that the cluster's node size
    does not divide, lr <= 0, momentum outside [0, 1), ...).
    """
    defaults = dict(model="mlp-256", algorithms=("dense", "topk", "gtopk", "randk"), densities=(0.001, 0.01), seeds=3,  # algorithms: the papers' comparison
                    target=DEFAULT_TARGET, clusters=("gtopk-icdcs", "dgx-h100"), P=16, iterations=300,
                    time_budget_s=0.0, eval_every=25, lr=0.2, momentum=0.0, batch_size=32)
    sizes = dict(eval_samples=2048, test_samples=2000)
    if quick:
        defaults.update(algorithms=("dense", "gtopk"), densities=(0.001,), P=8, iterations=30, eval_every=10,  # algorithms: the papers' comparison
                        target=0.65, lr=0.1)
        sizes = dict(eval_samples=256, test_samples=500)
    given = dict(model=model, algorithms=algorithms, densities=densities, seeds=seeds, target=target,
                 clusters=clusters, P=P, iterations=iterations, time_budget_s=time_budget_s, eval_every=eval_every,
                 lr=lr, momentum=momentum, batch_size=batch_size)
    kw = {k: (defaults[k] if v is None else v) for k, v in given.items()}
    t = kw["target"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t <= 1):
        raise ConfigError(f"--target {t!r} is out of range: valid 0 < target <= 1 (a test accuracy)")
    kw["algorithms"] = _names("--algorithms", kw["algorithms"])
    kw["clusters"] = _names("--clusters", kw["clusters"])
    kw["densities"] = _densities(kw["densities"])
    for opt, key in (("--seeds", "seeds"), ("--iterations", "iterations"), ("--eval-every", "eval_every"),
                     ("--P", "P"), ("--batch-size", "batch_size")):
        v = kw[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{opt} {v!r} is out of range: valid {key} >= 1")
    b = kw["time_budget_s"]
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b < 0 or \
            (time_budget_s is not None and b <= 0):
        raise ConfigError(f"--time-budget-s {b!r} is out of range: valid a simulated time > 0 (s)")
    for opt, key in (("--lr", "lr"), ("--momentum", "momentum")):
        if isinstance(kw[key], bool) or not isinstance(kw[key], (int, float)) or not math.isfinite(kw[key]):
            raise ConfigError(f"{opt} {kw[key]!r} is out of range: valid a finite number")
    kw.update(time_budget_s=float(b), lr=float(kw["lr"]), momentum=float(kw["momentum"]), target=float(t))
    pl = Plan(**kw, **sizes, quick=quick)
    _check_plan(pl)
    return pl


def _names(opt: str, v) -> tuple[str, ...]:
    names = tuple(x.strip() for x in (v.split(",") if isinstance(v, str) else v) if str(x).strip())
    if not names:
        raise ConfigError(f"{opt} {v!r} names none: valid a comma-separated list")
    dup = next((a for i, a in enumerate(names) if a in names[:i]), None)
    if dup is not None:
        raise ConfigError(f"{opt} {','.join(names)} names {dup} twice: valid each once")
    return names


def _densities(v) -> tuple[float, ...]:
    items = [x.strip() for x in v.split(",")] if isinstance(v, str) else list(v)
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
        raise ConfigError(f"--densities {v!r} names none: valid comma-separated k/d in (0, 1]")
    return tuple(out)


def _check_plan(pl: Plan) -> None:
    """ConfigError unless the model, every algorithm and cluster are known and one case per algorithm makes a valid
    scenario on every cluster (P against the node size included)."""
    from sim.algorithms import REGISTRY, resolve
    from sim.machine.network import PRESETS
    from sim.workloads.nets import NET_ZOO
    from sim.machine.topology import CLUSTER_PRESETS

    from .resolve import build_network

    if pl.model not in NET_ZOO:
        raise ConfigError(f"--model {pl.model!r} is unknown: valid {', '.join(NET_ZOO)}")
    for a in pl.algorithms:
        try:
            resolve(a)
        except ValueError:
            raise ConfigError(f"--algorithms: {a!r} is unknown: valid {', '.join(REGISTRY)}") from None
    for c in pl.clusters:
        if c not in PRESETS and c not in CLUSTER_PRESETS:
            raise ConfigError(f"--clusters: {c!r} is unknown: valid {', '.join(PRESETS)}, {', '.join(CLUSTER_PRESETS)}")
    if pl.P * pl.batch_size > TRAIN_IMAGES:
        raise ConfigError(f"--P x --batch-size = {pl.P} x {pl.batch_size} = {pl.P * pl.batch_size} images per step is "
                          f"out of range: valid <= {TRAIN_IMAGES} training images of {DATASET}")
    firsts = list({c.algorithm: c for c in reversed(pl.cases())}.values())
    for cl in pl.clusters:
        for case in firsts:
            build_network(pl.scenario(case, cl).cluster, timing_only=True)  # P against the node size


@functools.lru_cache(maxsize=4)
def _workload(model: str):
    """The network's :class:`sim.workloads.Workload` as a [model] run builds it (:meth:`sim.workloads.nets.NetObjective.workload`:
    :func:`sim.workloads.extract.from_torch` on a 1 x 28 x 28 image, tensors in the flat vector's order)."""
    from sim.workloads.nets import NET_PARAMS, build_net, net_workload

    wl = net_workload(build_net(model, seed=0, dtype="float32"), (1, 28, 28), model)
    if wl.d != NET_PARAMS[model]:  # pragma: no cover - a zoo inconsistency
        raise SparsimError(f"the workload of {model} has d = {wl.d}, the network {NET_PARAMS[model]}")
    return wl


def cluster_iteration_times(pl: Plan, case: Case, cluster: str, iterations: int) -> tuple[np.ndarray, int]:
    """(iter_s, n): the simulated time (s) of each of ``iterations`` iterations of ``case`` on ``cluster`` -- float64
    array of shape (iterations,), from the network's layer-wise timeline (:class:`sim.engine.timeline.TimelineClock`,
    :func:`experiments.resolve.timeline_clock` as a [model] run's :class:`experiments.build.Built` builds it: the
    cluster, workload.device, the DDP / sparse policies, the compute model, b images per worker) -- and n, how many of them the plan's time budget keeps
    (:meth:`~sim.engine.timeline.TimelineClock.iterations_within`; all without a budget). Imports torch (the network's
    FLOPs). Raises ConfigError as the scenario does."""
    from sim.machine.topology import ClusterSpec

    from .resolve import algorithm_specs, build_network, resolve_compute, resolve_device, timeline_clock

    sc = pl.scenario(case, cluster, iterations)
    wl = _workload(pl.model)
    net = build_network(sc.cluster, timing_only=True)
    G = net.gpus_per_node if isinstance(net, ClusterSpec) else 1
    (spec,) = algorithm_specs(sc, sc.k_for(wl.d), G)
    clock = timeline_clock(sc, wl, net, resolve_compute(sc, resolve_device(sc)), pl.time_budget_s)
    res = clock(spec, iterations)
    return np.asarray(res.iter_s, dtype=np.float64), clock.iterations_within(res)


def run_case(pl: Plan, case: Case, iterations: int, run_dir: str, threads: int = 1) -> list[dict]:
    """Train ``case`` for ``iterations`` iterations on the plan's first cluster into ``run_dir`` (a ``sparsim run``
    folder: metrics.csv, summary.json; built as run_dir.partial and renamed when complete) -- or reuse ``run_dir``
    when it holds a finished run -- and return its evaluated rows (dicts with :data:`ROW_KEYS`; sim_time_s in s on
    the first cluster). The run uses ``threads`` torch threads and one BLAS thread (both restored afterwards), so its
    numbers do not depend on how many cases run at once. Raises what :func:`experiments.run.run_scenario` raises (a
    SparsimError with the case's name and folder in front of its message)."""
    from threadpoolctl import threadpool_limits

    from .record import read_metrics
    from .run import run_scenario

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.csv").is_file():
        import torch

        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with threadpool_limits(1):
                run_scenario(pl.scenario(case, pl.clusters[0], iterations), run_dir, progress=False, figure=False,
                             yes=True)
        except SparsimError as err:  # the same error, naming the case
            raise type(err)(f"case {case.name} ({run_dir}): {err}") from None
        finally:
            torch.set_num_threads(old)
    groups = read_metrics(run_dir)
    (rows,) = groups.values()
    return [{k: r[k] for k in ROW_KEYS} for r in rows if not math.isnan(r["test_accuracy"])]


def _map_cases(args: list[tuple], jobs: int | None, scheduler: str | None, progress: bool) -> list:
    """``[run_case(*a) for a in args]`` in input order: inline (jobs = 1), on a Dask cluster (:func:`map_jobs`), or
    in ``jobs`` local processes that are *spawned* (a forked child of a process that has used torch's thread pool
    can deadlock in torch). An error in a case, Ctrl-C or SIGTERM stops the other processes at once (the
    finished case folders stay for a resume) and is raised here."""
    if scheduler is not None or jobs == 1 or len(args) <= 1:
        return map_jobs(run_case, args, jobs=jobs, scheduler=scheduler, progress=progress, desc="tta")
    import multiprocessing

    from tqdm import tqdm

    results: list = [None] * len(args)
    pool = multiprocessing.get_context("spawn").Pool(processes=min(jobs, len(args)))
    try:
        with tqdm(total=len(args), desc="tta", unit="case", disable=None if progress else True) as bar:
            for i, rows in pool.imap_unordered(_indexed_case, list(enumerate(args))):
                results[i] = rows
                bar.update(1)
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()
    return results


def _indexed_case(item: tuple[int, tuple]) -> tuple[int, list[dict]]:
    """(i, run_case(*args)) for item = (i, args): a case of :func:`_map_cases` with its position."""
    i, a = item
    return i, run_case(*a)


def time_to_target(rows: list[dict], cum: np.ndarray, n: int, target: float) -> dict:
    """Time to ``target`` of one case on one cluster.

    rows: the case's evaluated rows (dicts with ``iteration`` and ``test_accuracy``, iteration order, iteration 0
    first); cum: float64 array (T,), the cluster's clock after each iteration (s), ``np.cumsum`` of its iteration
    times; n: iterations kept on that cluster (the time budget; evaluated rows past n are ignored).
    Returns reached (bool), tta_iteration / tta_sim_time_s (the first evaluated iteration with test_accuracy >=
    target and the clock there, s; None when not reached), final_iteration / final_sim_time_s /
    final_test_accuracy (the last evaluated row within n), best_test_accuracy / best_iteration / best_sim_time_s
    (the first evaluated row with the largest test accuracy), iterations_run (n), sim_time_end_s (the clock after
    n iterations, s)."""
    def clock(t):
        return 0.0 if t == 0 else float(cum[t - 1])

    kept = [r for r in rows if int(r["iteration"]) <= n]
    hit = next((r for r in kept if r["test_accuracy"] >= target), None)
    best = max(kept, key=lambda r: r["test_accuracy"])
    last = kept[-1]
    return {"reached": hit is not None,
            "tta_iteration": None if hit is None else int(hit["iteration"]),
            "tta_sim_time_s": None if hit is None else clock(int(hit["iteration"])),
            "final_iteration": int(last["iteration"]), "final_sim_time_s": clock(int(last["iteration"])),
            "final_test_accuracy": float(last["test_accuracy"]), "best_test_accuracy": float(best["test_accuracy"]),
            "best_iteration": int(best["iteration"]), "best_sim_time_s": clock(int(best["iteration"])),
            "iterations_run": int(n), "sim_time_end_s": clock(int(n))}


def spread(values) -> dict:
    """mean, std (sample, ddof = 1; nan for one value), min and max of ``values`` (floats); all nan when empty."""
    v = np.asarray([x for x in values], dtype=np.float64)
    if v.size == 0:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan}
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if v.size > 1 else math.nan,
            "min": float(v.min()), "max": float(v.max())}


def summarise(tta_rows: list[dict]) -> dict:
    """The summary of one (algorithm, density, cluster) over its seeds' :data:`TTA_COLUMNS` rows: seeds, n_reached,
    time to target in iterations and simulated s (mean and std only when every seed reached the target, else nan;
    min and max over the seeds that reached it), final test accuracy (mean, std, min, max), best test accuracy (mean,
    std), iterations run and s per iteration (means over the seeds)."""
    reached = [r for r in tta_rows if r["reached"]]
    out = {"seeds": len(tta_rows), "n_reached": len(reached)}
    for key in ("tta_iteration", "tta_sim_time_s"):
        s = spread([r[key] for r in reached])
        if len(reached) < len(tta_rows):
            s["mean"] = s["std"] = math.nan
        out.update({f"{key}_{k}": v for k, v in s.items()})
    s = spread([r["final_test_accuracy"] for r in tta_rows])
    out.update({f"final_test_accuracy_{k}": v for k, v in s.items()})
    s = spread([r["best_test_accuracy"] for r in tta_rows])
    out.update(best_test_accuracy_mean=s["mean"], best_test_accuracy_std=s["std"])
    out["iterations_run"] = float(np.mean([r["iterations_run"] for r in tta_rows]))
    out["final_iteration_min"] = min(int(r["final_iteration"]) for r in tta_rows)  # 0: never evaluated after training
    out["iter_time_s"] = float(np.mean([r["iter_time_s"] for r in tta_rows]))
    return out


def _case_records(pl: Plan, case: Case, rows: list[dict], clocks: dict, run_dir: str):
    """(tta rows, curve rows, clock rows) of one trained case on every cluster; checks the first cluster's clock
    against the training run's sim_time_s (SparsimError if they differ)."""
    tta, curves, clock_rows = [], [], []
    cum0 = np.cumsum(clocks[pl.clusters[0]][0])
    for r in rows:
        t = int(r["iteration"])
        want = 0.0 if t == 0 else float(cum0[t - 1])
        if t <= len(cum0) and r["sim_time_s"] != want:
            raise SparsimError(f"case {case.name}: the clock of {pl.clusters[0]} recomputed from the timeline "
                               f"({want!r} s at iteration {t}) differs from the training run's sim_time_s "
                               f"({r['sim_time_s']!r} s): the timeline's settings differ from the run's")
    T = int(rows[-1]["iteration"])
    for cl in pl.clusters:
        iter_s, n = clocks[cl]
        iter_s = iter_s[:T]
        n = min(n, T)
        cum = np.cumsum(iter_s)
        res = time_to_target(rows, cum, n, pl.target)
        tta.append({"model": pl.model, "algorithm": case.algorithm, "density": case.density, "k": pl.k(case.density),
                    "seed": case.seed, "cluster": cl, "P": pl.P, "target": pl.target,
                    "iter_time_s": float(iter_s[:n].mean()), **res, "run_dir": f"runs/{Path(run_dir).name}"})
        base = {"algorithm": case.algorithm, "density": case.density, "seed": case.seed, "cluster": cl}
        for r in rows:
            t = int(r["iteration"])
            if t <= n:
                curves.append({**base, "iteration": t, "sim_time_s": 0.0 if t == 0 else float(cum[t - 1]),
                               **{k: r[k] for k in ("test_accuracy", "train_accuracy", "test_loss", "loss")}})
        clock_rows += [{**base, "iteration": i + 1, "iter_time_s": float(iter_s[i]), "sim_time_s": float(cum[i])}
                       for i in range(n)]
    return tta, curves, clock_rows


def _fmt(x, spec: str) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _cell_tta(s: dict, key: str, spec: str) -> str:
    """A results.md cell of the time to target: 'mean ± std [min, max]' when every seed reached it, else 'not
    reached (n/N)' with the reaching seeds' range."""
    n, N = s["n_reached"], s["seeds"]
    if n == N:
        sd = "" if math.isnan(s[f"{key}_std"]) else f" ± {_fmt(s[f'{key}_std'], spec)}"
        return f"{_fmt(s[f'{key}_mean'], spec)}{sd} [{_fmt(s[f'{key}_min'], spec)}, {_fmt(s[f'{key}_max'], spec)}]"
    if n == 0:
        return f"not reached (0/{N})"
    return f"not reached ({n}/{N}; those: [{_fmt(s[f'{key}_min'], spec)}, {_fmt(s[f'{key}_max'], spec)}])"


def _reach(s: dict) -> str:
    """'3/3 seeds (in 108 ± 14 [100, 125] iterations)', '1/3 seeds (in [150, 150] iterations)' or '0/3 seeds'."""
    n, N = s["n_reached"], s["seeds"]
    if n == 0:
        return f"0/{N} seeds"
    cell = _cell_tta(s, "tta_iteration", ".0f") if n == N else \
        f"[{_fmt(s['tta_iteration_min'], '.0f')}, {_fmt(s['tta_iteration_max'], '.0f')}]"
    return f"{n}/{N} seeds (in {cell} iterations)"


def _acc(s: dict, key: str) -> str:
    sd = s.get(f"{key}_std", math.nan)
    return f"{s[f'{key}_mean']:.4f}" + ("" if math.isnan(sd) else f" ± {sd:.4f}")


def markdown(pl: Plan, summary: list[dict]) -> str:
    """results.md: the settings, the rules, the table per algorithm x density x cluster, the fastest to the target on
    each cluster, and whether the papers' claims are reproduced (:func:`claims`)."""
    budget = f"a simulated-time budget of {pl.time_budget_s:g} s per cluster (cap {pl.iterations} iterations)" \
        if pl.time_budget_s else f"{pl.iterations} iterations"
    lines = [
        f"# Time to accuracy: {pl.model} on {DATASET}, P = {pl.P}",
        "",
        f"Settings: {pl.model}, P = {pl.P} workers x b = {pl.batch_size} images, SGD lr = {pl.lr:g}, momentum "
        f"{pl.momentum:g}, {pl.dtype}, error feedback for the sparse algorithms, {budget}; evaluation every "
        f"{pl.eval_every} iterations on {pl.eval_samples} training / {pl.test_samples} test images; "
        f"target test accuracy {pl.target:g}; seeds 0..{pl.seeds - 1}; clusters {', '.join(pl.clusters)} "
        f"(workload.device {DEVICE}, DDP buckets for dense, whole-model selection for the sparse algorithms).",
        "",
        f"Rules: time to target = the first evaluation point with test accuracy >= {pl.target:g} (resolution "
        f"{pl.eval_every} iterations: the true crossing is up to {pl.eval_every} iterations earlier); its simulated "
        "time is the cluster's clock there (the float64 cumulative sum of the cluster's iteration times; every cluster "
        "times the same trained numbers). Cells: mean ± sample std [min, max] over the seeds when every seed reached "
        "the target; otherwise 'not reached (n/N)' with the range of the n that did. Final = the last evaluation point"
        + (" within the budget" if pl.time_budget_s else "") + "; best = the largest at any evaluation point.",
        "",
        "| algorithm | density | k | cluster | s / iteration | reached | iterations to target | sim time to target (s) "
        "| final test acc | best test acc |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        dens = "" if s["density"] is None else f"{s['density']:g}"
        k = "" if s["k"] is None else str(s["k"])
        lines.append(f"| {s['algorithm']} | {dens} | {k} | {s['cluster']} | {s['iter_time_s']:.4g} | "
                     f"{s['n_reached']}/{s['seeds']} | {_cell_tta(s, 'tta_iteration', '.0f')} | "
                     f"{_cell_tta(s, 'tta_sim_time_s', '.3g')} | {_acc(s, 'final_test_accuracy')} | "
                     f"{_acc(s, 'best_test_accuracy')} |")
    lines += ["", "## Fastest to the target", ""]
    for cl in pl.clusters:
        done = [s for s in summary if s["cluster"] == cl and s["n_reached"] == s["seeds"]]
        if not done:
            lines.append(f"- {cl}: no algorithm reached {pl.target:g} with every seed.")
            continue
        best = min(done, key=lambda s: s["tta_sim_time_s_mean"])
        line = (f"- {cl}: {_group_label((best['algorithm'], best['density']))} in {best['tta_sim_time_s_mean']:.3g} s "
                f"of simulated time (mean of {best['seeds']} seeds)")
        dense = next((s for s in done if s["algorithm"] == "dense"), None)  # algorithms: the papers' comparison
        if dense is not None and best is not dense:
            line += (f", {dense['tta_sim_time_s_mean'] / best['tta_sim_time_s_mean']:.3g}x sooner than dense "
                     f"({dense['tta_sim_time_s_mean']:.3g} s)")
        lines.append(line + ".")
    lines += ["", "## The papers' claims", ""] + [f"- {c}" for c in claims(pl, summary)]
    return "\n".join(lines)


def claims(pl: Plan, summary: list[dict]) -> list[str]:
    """Sentences on whether this sweep reproduces (1) the gTop-k paper's claim (Shi et al., IJCAI 2019): gTop-k
    S-SGD at density 0.001 reaches the accuracy of dense S-SGD -- here: its mean final test accuracy within
    :data:`CLAIM_TOL` of dense's, per cluster when a time budget makes the clusters differ; and (2) Mem-SGD's
    (Stich et al., NeurIPS 2018): with memory, rand-k converges slower than top-k -- here: at each density Top-k
    reaches the target with at least as many seeds, no later on average in iterations, and ends at a higher mean test
    accuracy. A claim whose algorithms were not run says so."""
    out = []
    clusters = pl.clusters if pl.time_budget_s else pl.clusters[:1]
    where = (lambda cl: f" on {cl} (equal simulated time)") if pl.time_budget_s else (lambda cl: "")
    at = f"after {pl.iterations} iterations" if not pl.time_budget_s else f"within {pl.time_budget_s:g} s"

    def get(alg, dens, cl):
        return next((s for s in summary if s["algorithm"] == alg and s["density"] == dens and s["cluster"] == cl), None)

    if "dense" in pl.algorithms and "gtopk" in pl.algorithms and 0.001 in pl.densities:
        for cl in clusters:
            g, d = get("gtopk", 0.001, cl), get("dense", None, cl)
            untrained = [n for n, x in (("dense", d), ("gTop-k", g)) if x["final_iteration_min"] == 0]
            if untrained:  # a budget that ends before a side's first evaluation after iteration 0
                out.append(f"gTop-k at density 0.001 against dense (Shi et al., IJCAI 2019){where(cl)}: no verdict -- "
                           f"{' and '.join(untrained)} has no evaluation after iteration 0 {at} (evaluations every "
                           f"{pl.eval_every} iterations): raise the budget or lower --eval-every.")
                continue
            gap = d["final_test_accuracy_mean"] - g["final_test_accuracy_mean"]
            tta = ""
            if g["n_reached"] == g["seeds"] and d["n_reached"] == d["seeds"]:
                tta = (f"; it needs {g['tta_iteration_mean'] / d['tta_iteration_mean']:.3g}x dense's iterations to "
                       f"reach {pl.target:g}")
            elif g["n_reached"] < g["seeds"]:
                tta = f"; it reaches {pl.target:g} with {_reach(g)} (dense {_reach(d)})"
            epochs = g["iterations_run"] * pl.P * pl.batch_size / TRAIN_IMAGES
            out.append(
                f"gTop-k at density 0.001 reaches dense's accuracy (Shi et al., IJCAI 2019){where(cl)}: "
                + ("reproduced" if gap <= CLAIM_TOL else "NOT reproduced")
                + f" {at} -- final test accuracy {g['final_test_accuracy_mean']:.4f} against dense's "
                f"{d['final_test_accuracy_mean']:.4f} ({100 * abs(gap):.2f} points {'below' if gap > 0 else 'above'}; "
                f"tolerance {100 * CLAIM_TOL:g} point; best {g['best_test_accuracy_mean']:.4f} against "
                f"{d['best_test_accuracy_mean']:.4f}){tta}. The paper trains for many epochs; here gTop-k ran "
                f"{epochs:.2g} epochs.")
            for dens in (x for x in pl.densities if x != 0.001):
                o = get("gtopk", dens, cl)
                out.append(f"(Beside the claim) gTop-k at density {dens:g}{where(cl)}: final test accuracy "
                           f"{o['final_test_accuracy_mean']:.4f} against dense's {d['final_test_accuracy_mean']:.4f}; "
                           f"reached {pl.target:g} with {_reach(o)}.")
    else:
        out.append("gTop-k at density 0.001 against dense (Shi et al., IJCAI 2019): not checked (needs dense, gtopk "
                   "and density 0.001 in the sweep).")
    if "topk" in pl.algorithms and "randk" in pl.algorithms:
        for dens in pl.densities:
            for cl in clusters:
                t, r = get("topk", dens, cl), get("randk", dens, cl)
                faster = t["n_reached"] >= r["n_reached"] and not (
                    t["n_reached"] == t["seeds"] and r["n_reached"] == r["seeds"]
                    and t["tta_iteration_mean"] > r["tta_iteration_mean"])
                higher = t["final_test_accuracy_mean"] > r["final_test_accuracy_mean"]
                ok = faster and higher
                out.append(
                    f"rand-k with memory converges slower than top-k (Stich et al., NeurIPS 2018) at density "
                    f"{dens:g}{where(cl)}: " + ("reproduced" if ok else "NOT reproduced")
                    + f" -- reached {pl.target:g}: top-k {_reach(t)}, rand-k {_reach(r)}; final test accuracy "
                    f"{t['final_test_accuracy_mean']:.4f} against {r['final_test_accuracy_mean']:.4f}. Mem-SGD shows "
                    "it for convex logistic regression; here the objective is a ReLU network.")
    else:
        out.append("top-k against rand-k with memory (Stich et al., NeurIPS 2018): not checked (needs topk and randk "
                   "in the sweep).")
    return out


def _figure(pl: Plan, curves: list[dict], outdir: Path) -> None:
    """tta.png / tta.pdf: test accuracy against simulated time (top, log scale, one panel per cluster) and against
    iterations (bottom), the mean over the seeds with the min-max band, the target as a dashed line."""
    from matplotlib.ticker import NullFormatter

    from .plots import figure_legend, plt

    groups = pl.groups()
    algs = list(dict.fromkeys(a for a, _ in groups))
    styles = ["-", "--", ":", "-."]
    C = len(pl.clusters)
    fig, axes = plt.subplots(2, C, figsize=(5.6 * C, 8.2), squeeze=False)
    handles, labels = [], []
    for j, cl in enumerate(pl.clusters):
        for g in groups:
            rs = [r for r in curves if r["cluster"] == cl and (r["algorithm"], r["density"]) == g]
            its = sorted({r["iteration"] for r in rs})
            per = {t: [r for r in rs if r["iteration"] == t] for t in its}
            its = [t for t in its if len(per[t]) == pl.seeds]  # points every seed has
            if not its:
                continue
            acc = np.array([[r["test_accuracy"] for r in per[t]] for t in its])
            tm = np.array([np.mean([r["sim_time_s"] for r in per[t]]) for t in its])
            mean, lo, hi = acc.mean(axis=1), acc.min(axis=1), acc.max(axis=1)
            kw = dict(color=f"C{algs.index(g[0])}",
                      ls=styles[(pl.densities.index(g[1]) if g[1] is not None else 0) % len(styles)], lw=1.4)
            pos = tm > 0  # the log time axis leaves out iteration 0
            (h,) = axes[0][j].plot(tm[pos], mean[pos], marker=".", ms=4, **kw)
            axes[0][j].fill_between(tm[pos], lo[pos], hi[pos], color=kw["color"], alpha=0.15, lw=0)
            axes[1][j].plot(its, mean, marker=".", ms=4, **kw)
            axes[1][j].fill_between(its, lo, hi, color=kw["color"], alpha=0.15, lw=0)
            if j == 0:
                handles.append(h)
                labels.append(_group_label(g))
        axes[0][j].set_xscale("log")
        axes[0][j].xaxis.set_minor_formatter(NullFormatter())  # minor labels of a short decade overlap
        axes[0][j].set(xlabel="simulated time (s, log scale)", ylabel="test accuracy",
                       title=f"{cl}: test accuracy vs simulated time")
        axes[1][j].set(xlabel="iteration", ylabel="test accuracy", title=f"{cl}: test accuracy vs iteration")
        for ax in (axes[0][j], axes[1][j]):
            ax.axhline(pl.target, color="0.3", ls="--", lw=0.9)
            ax.grid(alpha=0.3, which="both")
    fig.suptitle(f"{pl.model} on {DATASET}, P = {pl.P}, b = {pl.batch_size}, lr = {pl.lr:g}: mean of {pl.seeds} seeds "
                 f"(band: min-max), target {pl.target:g} (dashed)", fontsize=10)
    figure_legend(fig, handles, labels, suptitle=True)
    save_figure(fig, outdir, "tta")


def run_tta(out, *, quick: bool = False, force: bool = False, jobs: int | None = None, scheduler: str | None = None,
            progress: bool = True, **options) -> tuple[Path, list[dict], str]:
    """Run the time-to-accuracy sweep into ``out`` (via ``out.partial``); return (path, summary rows, Markdown).

    options: :func:`plan`'s keyword arguments (model, algorithms, densities, seeds, target, clusters, P, iterations,
    time_budget_s, eval_every, lr, momentum, batch_size); None or absent = the default (full or quick). jobs: local
    processes (spawned; default all cores), or ``scheduler``: a Dask scheduler address. Every case runs with one
    torch thread. Raises ConfigError for a bad option (before anything is written), when ``out`` exists and is not
    empty (unless ``force``), and when the time budget is shorter than a case's first iteration on a cluster;
    DataError when the Fashion-MNIST files are missing; SparsimError as the runs do. Finished case folders of an
    interrupted sweep with the same settings (:meth:`Plan.resume_key`) in ``out.partial/runs`` are reused.
    """
    pl = plan(quick, **options)
    out = Path(out)
    cases = pl.cases()
    clocks: dict[tuple[Case, str], tuple[np.ndarray, int]] = {}
    train_T = {}
    for case in cases:  # the timeline on every cluster: cheap, and a budget below one iteration fails before any run
        for cl in pl.clusters:
            iter_s, n = cluster_iteration_times(pl, case, cl, pl.iterations)
            if n < 1:
                raise ConfigError(f"--time-budget-s {pl.time_budget_s:g} is out of range for {case.algorithm} on "
                                  f"{cl}: its first iteration alone takes {iter_s[0]:.6g} s of simulated time: valid a "
                                  "budget of at least that")
            clocks[case, cl] = (iter_s, n)
        train_T[case] = max(clocks[case, cl][1] for cl in pl.clusters)
    check_out(out, force)
    jobs = resolve_jobs(jobs, scheduler)  # checked (and the scheduler reached) before any output
    tmp = partial_dir(out, fresh=False, resume_key=pl.resume_key())
    args = [(pl, case, train_T[case], str(tmp / "runs" / case.name)) for case in cases]
    results = _map_cases(args, jobs, scheduler, progress)
    tta, curves, clock_rows = [], [], []
    for (_pl, case, _T, run_dir), rows in zip(args, results):
        a, b, c = _case_records(pl, case, rows, {cl: clocks[case, cl] for cl in pl.clusters}, run_dir)
        tta += a
        curves += b
        clock_rows += c
    summary = []
    for g in pl.groups():
        for cl in pl.clusters:
            rs = [r for r in tta if (r["algorithm"], r["density"]) == g and r["cluster"] == cl]
            summary.append({"model": pl.model, "algorithm": g[0], "density": g[1], "k": pl.k(g[1]), "cluster": cl,
                            "P": pl.P, "target": pl.target, **summarise(rs)})
    write_csv(tmp / "tta.csv", TTA_COLUMNS, tta)
    write_csv(tmp / "summary.csv", SUMMARY_COLUMNS, summary)
    write_csv(tmp / "curves.csv", CURVE_COLUMNS, curves)
    write_csv(tmp / "clocks.csv", CLOCK_COLUMNS, clock_rows)
    _figure(pl, curves, tmp)
    report = markdown(pl, summary)
    (tmp / "results.md").write_text(report + "\n")
    publish(tmp, out)
    return out, summary, report
