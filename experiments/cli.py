"""The ``sparsim`` command line (click).

Every user error (bad scenario value, missing file, NaN in data or gradients, ...) is printed as one
line ``error: ...`` on stderr with exit code 2; no traceback.
"""
from __future__ import annotations

import errno
import functools
import os
import signal
import sys
from pathlib import Path

import click

from sim.base.process import exit_on_signal
from sim.base.errors import SparsimError

__all__ = ["main"]


def _user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except SparsimError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(2)
        except OSError as err:  # the machine refuses a write: disk full, quota, read-only, permissions
            if err.errno not in _WRITE_ERRNOS:
                raise
            where = f" {err.filename}" if err.filename else ""
            if err.errno in (errno.EACCES, errno.EPERM):  # a read as well as a write: do not call it a write
                click.echo(f"error: no permission to access{where}: {err.strerror or os.strerror(err.errno)} "
                           "(nothing was published)", err=True)
                sys.exit(2)
            click.echo(f"error: cannot write{where}: {err.strerror or os.strerror(err.errno)} (nothing was "
                       "published: free space or choose another --out)", err=True)
            sys.exit(2)

    return wrapper


def _check_algorithm_list(algorithms: str | None) -> None:
    """SparsimError (one line, the valid names) when ``--algorithms`` is given but names no algorithm ('' or ',')."""
    if algorithms is not None and not any(a.strip() for a in algorithms.split(",")):
        from sim.algorithms import REGISTRY

        names = [n for name, algo in REGISTRY.items() for n in (name, *algo.aliases)]
        raise SparsimError(f"--algorithms {algorithms!r} names no algorithm: valid a comma-separated list of "
                           f"{', '.join(names)} (omit it for the scenario's)")


#: Largest ``sparsim run --jobs``: a run never starts more processes than it has algorithms (the value is clamped to
#: their number), so a larger one is a typo, not a request (--jobs 1000000 was accepted without a word).
MAX_RUN_JOBS = 1024

_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2


class _IntIn(click.ParamType):
    """An integer option of ``sparsim plan`` whose "not an integer" error names the valid range too (click's own says
    only that the value is not a valid integer), so that every bad value is one line with the value and the range.
    ``option``: its key in :data:`experiments.plan.OPTION_RANGES` (read only on that error: the plan module is not
    imported for every command)."""

    name = "integer"

    def __init__(self, option: str):
        self.option = option

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return int(str(value).strip(), 10)
        except ValueError:
            from sim.base.errors import range_text

            from . import plan as pl

            self.fail(f"{value!r} is not an integer: valid {range_text(self.option, *pl.OPTION_RANGES[self.option])}",
                      param, ctx)


class _OneLineErrors(click.Group):
    """A click group whose usage errors (unknown option, bad choice, missing argument) are one line
    ``error: ... (see 'sparsim COMMAND --help')`` with exit code 2, like every other user error."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Run the command; exit with its code (2 and one line for a usage error, 130 and one line for Ctrl-C).

        Called as the whole process (``args`` None: the ``sparsim`` script, ``python -m experiments.cli``), SIGINT is
        ignored once the command is over: Python gives SIGINT back its default action while it shuts down (an
        ignored signal it leaves ignored; a blocked one would still reach another thread, OpenBLAS's or torch's), so
        a Ctrl-C landing after "wrote DIR" killed the process by the signal (status -2, no message). A Ctrl-C up to
        then says "interrupted after 'DIR' was written (complete; it stays)" and exits 130, also where it lands
        outside click's own handling; one later is ignored (the command had finished: its code stands).
        In-process callers (``args`` given, click's test runner) keep their SIGINT handler."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        whole_process = args is None
        code = 0
        try:
            try:
                self._standalone(args, prog_name, complete_var, **extra)
            except SystemExit as exit_:
                code = exit_.code
            except KeyboardInterrupt:  # landed outside click's handling (after the command returned)
                code = _interrupted()
            if whole_process:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
        except KeyboardInterrupt:  # between the command's end and ignoring it
            code = _interrupted()
            if whole_process:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.exit(code)

    def _standalone(self, args, prog_name, complete_var, **extra):
        """The command run by click with one-line errors; ends with sys.exit (SystemExit) of its exit code."""
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NO_ARGS_IS_HELP as err:  # a group called alone: its help, as --help would
            click.echo(err.ctx.get_help() if err.ctx is not None else err.format_message())
            sys.exit(0)
        except click.UsageError as err:
            cmd = err.ctx.command_path if err.ctx is not None else "sparsim"
            click.echo(f"error: {err.format_message()} (see '{cmd} --help')", err=True)
            sys.exit(2)
        except click.ClickException as err:
            click.echo(f"error: {err.format_message()}", err=True)
            sys.exit(err.exit_code)
        except click.exceptions.Abort as err:
            if isinstance(err.__cause__, KeyboardInterrupt):  # Ctrl-C: the shell convention, 128 + SIGINT
                sys.exit(_interrupted())
            click.echo("aborted", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def _interrupted() -> int:
    """Say what an interrupt (Ctrl-C) left: the directories this process published, complete, or nothing; return
    130 (the shell convention, 128 + SIGINT)."""
    from .outdir import PUBLISHED

    done = f" after {', '.join(repr(str(d)) for d in PUBLISHED)} was written (complete; it stays)" \
        if PUBLISHED else "; nothing was written"
    click.echo(f"interrupted{done}", err=True)
    return 130


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sparsim")
@click.option("-v", "--verbose", count=True, help="more status on stderr (-v: info, -vv: debug)")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None,
              help="status messages on stderr at this level and above [default: warning]")
def main(verbose, log_level):
    """sparsim: simulate dense, Top-k and gTop-k S-SGD on a P-worker cluster; check the papers' bounds.

    Results go to stdout and the output directory; status goes through the standard logging module (logger
    ``sparsim``) to stderr, so library users can silence or capture it."""
    import logging

    level = getattr(logging, log_level.upper()) if log_level else \
        (logging.DEBUG if verbose >= 2 else logging.INFO if verbose == 1 else logging.WARNING)
    logger = logging.getLogger("sparsim")
    logger.setLevel(level)
    for old in [h for h in logger.handlers if getattr(h, "_sparsim_cli", False)]:
        logger.removeHandler(old)
    h = logging.StreamHandler(sys.stderr)  # this call's stderr (click's test runner swaps it per invocation)
    h.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    h._sparsim_cli = True
    logger.addHandler(h)
    logger.propagate = False
    # SIGTERM (e.g. from `timeout` or a batch system) unwinds like Ctrl-C, so no DIR.partial is left behind
    signal.signal(signal.SIGTERM, exit_on_signal)
    # one BLAS thread for the whole command: a multi-threaded OpenBLAS splits a product (the full gradient's
    # X^T R) by its thread count, whose partial sums change the last bits, so results would depend on the
    # machine's core count (as the torch backend's ranks and the experiments already do; restored on exit for
    # callers that run the CLI in-process)
    from threadpoolctl import threadpool_limits

    limiter = threadpool_limits(1, user_api="blas")
    click.get_current_context().call_on_close(limiter.restore_original_limits)
    # freed vectors stay in the heap, so a step's fresh arrays reuse warm pages instead of page-faulting new ones
    # (a third of a d = 10^7 run was system time); process-wide, not restored (sim/base/malloc.py)
    from sim.base.malloc import keep_freed_memory

    keep_freed_memory()
    import matplotlib

    matplotlib.use("Agg")  # the CLI only writes figure files; importing experiments.plots elsewhere keeps the backend


@main.command()
@click.argument("scenario", required=False, type=click.Path(dir_okay=False))
@click.option("--out", "out", default="runs/default", show_default=True, help="run directory to write")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a scenario key, e.g. --set cluster.P=16 (repeatable)")
@click.option("--algorithms", default=None, help="comma-separated subset/order, e.g. dense,topk,gtopk")
@click.option("--force", is_flag=True, help="overwrite a non-empty output directory")
@click.option("--quiet", is_flag=True, help="no progress bar or summary table")
@click.option("--check", "do_check", is_flag=True, help="run the theory checks on the finished run")
@click.option("--backend", type=click.Choice(["sim", "torch"]), default="sim", show_default=True,
              help="sim: simulated cluster; torch: real processes over torch.distributed (measured times)")
@click.option("--nproc", type=int, default=None,
              help="torch: local processes to start (sets cluster.P; must agree with a --set cluster.P)")
@click.option("--timeout", "timeout_s", type=float, default=None,
              help="torch: seconds a rank may wait on a peer before the run fails naming the rank "
                   "(sets torch.timeout_s; scenario default 60)")
@click.option("--backend-allreduce", is_flag=True,
              help="torch: dense uses torch.distributed.all_reduce (sets torch.backend_allreduce = true)")
@click.option("--dist-backend", type=click.Choice(["gloo", "nccl", "auto"]), default=None,
              help="torch: process-group backend, auto = nccl when a GPU is visible (sets torch.dist_backend; "
                   "scenario default gloo)")
@click.option("--yes", is_flag=True,
              help="run even when the estimated work (algorithms x iterations x P x (d + message and step costs)) "
                   "is above the limit of 1e11 units, about 3 hours (README: resources)")
@click.option("--jobs", type=int, default=None,
              help="sim: algorithms simulated at the same time, each in its own process (same rows; default: as "
                   "many as there are algorithms, at most 2 x the cores and half the free memory; 1: one at a time; "
                   f"valid 1 to {MAX_RUN_JOBS}, more than the run's algorithms runs one process per algorithm)")
@_user_errors
def run(scenario, out, overrides, algorithms, force, quiet, do_check, backend, nproc, timeout_s, backend_allreduce,
        dist_backend, yes, jobs):
    """Run SCENARIO (a TOML file; default: the embedded default scenario) and write --out.

    Before allocating, a run whose memory estimate exceeds the available memory is refused, and so is one
    whose estimated work exceeds the documented limit unless --yes is given (one line, exit code 2)."""
    from .run import run_scenario
    from .scenario import _OptionOverride, load_scenario, option_overrides

    _check_algorithm_list(algorithms)
    if jobs is not None and jobs > MAX_RUN_JOBS:  # jobs < 1: run_scenario's check_jobs says the same range
        raise SparsimError(f"--jobs {jobs} is out of range: valid 1 <= jobs <= {MAX_RUN_JOBS} (a run starts at most one "
                           "process per algorithm)")
    ov = list(overrides) + option_overrides(algorithms=algorithms, timeout_s=timeout_s,
                                            backend_allreduce=backend_allreduce, dist_backend=dist_backend)
    if backend != "torch" and (timeout_s is not None or dist_backend is not None):
        given = [o for o, v in (("--timeout", timeout_s), ("--dist-backend", dist_backend)) if v is not None]
        raise SparsimError(f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to the torch backend "
                           "only: valid with --backend torch "
                           "(the simulator's network is cluster.network)")
    if nproc is not None:
        if backend != "torch":
            raise SparsimError("--nproc needs --backend torch")
        if nproc < 1:
            raise SparsimError(f"--nproc {nproc} is out of range: valid --nproc >= 1")
        sc0 = load_scenario(scenario, ov)
        given = [o for o in ov if o.split("=", 1)[0].strip() == "cluster.P"]
        if given and sc0.cluster.P != nproc:
            raise SparsimError(f"--nproc {nproc} differs from --set cluster.P={sc0.cluster.P}: they must be equal")
        ov.append(_OptionOverride(f"cluster.P={nproc}", f"--nproc {nproc}"))
    sc = load_scenario(scenario, ov)
    path = run_scenario(sc, out, force=force, progress=not quiet, backend=backend, nproc=nproc, yes=yes, jobs=jobs)
    if not quiet:
        from .run_summary import summary_lines

        for line in summary_lines(path):
            click.echo(line)
    if do_check:
        from .check import check_run

        click.echo(check_run(path).render())


@main.command("algorithms")
@_user_errors
def algorithms_cmd():
    """The registered algorithms (sim/algorithms/, one file each): name, k or not, collectives (the first is the
    default), options ([algorithm.NAME] in a scenario) and source."""
    from .listings import algorithm_table

    for line in algorithm_table():
        click.echo(line)


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@_user_errors
def check(run_dir):
    """Hold a finished run against Assumption 1, Lemma 2, Theorem 1 and Corollary 2 (both variants)."""
    from .check import check_run

    click.echo(check_run(run_dir).render())


@main.command()
@click.option("--nproc", type=int, default=2, show_default=True,
              help="local processes (exchange / pingpong: ranks 0 and 1 do the timing; allreduce: all, P = nproc)")
@click.option("--out", "out", default="calibration.toml", show_default=True, help="TOML file to write")
@click.option("--min-bytes", type=int, default=1, show_default=True, help="smallest message (bytes)")
@click.option("--max-bytes", type=int, default=1 << 24, show_default=True, help="largest message (bytes)")
@click.option("--repeats", type=int, default=20, show_default=True, help="timings per size and pattern (10 % trimmed mean taken)")
@click.option("--timeout", "timeout_s", type=float, default=60.0, show_default=True, help="seconds before a stuck rank fails")
@click.option("--pattern", type=click.Choice(["exchange", "pingpong", "allreduce"]), default="exchange",
              show_default=True,
              help="which fit the preset takes: pairwise exchange (what the collectives do) or ping-pong one-way, "
                   "both through the project's transport; or allreduce: gloo's torch.distributed.all_reduce on "
                   "--nproc ranks (what DDP's dense buckets use), fitted as the simulator's ring allreduce "
                   "2(P-1) alpha + 2(P-1)/P n beta")
@click.option("--busy-s", type=float, default=0.0, show_default=True,
              help="seconds each rank computes before each timed message or allreduce (a step's compute between "
                   "its messages)")
@click.option("--force", is_flag=True, help="overwrite --out")
@_user_errors
def calibrate(nproc, out, min_bytes, max_bytes, repeats, timeout_s, pattern, busy_s, force):
    """Measure the torch (gloo, loopback) transport over message sizes and fit alpha and beta.

    Times a ping-pong and a pairwise exchange, fits t(n) = alpha + n beta to each (both fits and their
    residuals are in the output) and writes a TOML [cluster] table (network = "custom", alpha_s,
    bandwidth_Bps) from the --pattern fit, to paste into a scenario. --pattern allreduce times gloo's
    all_reduce of float32 tensors on all --nproc ranks instead and fits the star network on which the
    simulator's ring allreduce takes those times (for DDP's dense buckets).
    """
    from sim.base.errors import check_range

    from .calibrate import calibrate_to_file
    from .torch_job import check_torch

    check_torch("sparsim calibrate")  # one line, not a traceback, without the torch extra
    check_range("--nproc", nproc, 2, 64)
    check_range("--min-bytes", min_bytes, 1)
    check_range("--max-bytes", max_bytes, min_bytes + 1, 1 << 30)
    check_range("--repeats", repeats, 1, 10_000)
    check_range("--timeout", timeout_s, 0, 86_400, lo_open=True)
    check_range("--busy-s", busy_s, 0, 10)
    from .outdir import check_path_fits

    # the file and its temporary probe (".NAME.XXXXXXXX.probe") must be nameable, else ENAMETOOLONG after timing
    check_path_fits(Path(out), "--out", suffix="..XXXXXXXX.probe")
    text = calibrate_to_file(out, force=force, nproc=nproc, min_bytes=min_bytes, max_bytes=max_bytes, repeats=repeats,
                             timeout_s=timeout_s, pattern=pattern, busy_s=busy_s)
    click.echo(text, nl=False)
    click.echo(f"wrote {Path(out)}")


@main.group()
def scenario():
    """Inspect scenarios."""


@scenario.command("show")
def scenario_show():
    """Print the embedded default scenario (TOML)."""
    from .scenario import DEFAULT_SCENARIO_TEXT

    click.echo(DEFAULT_SCENARIO_TEXT, nl=False)


@scenario.command("keys")
def scenario_keys_cmd():
    """Print every scenario key with type, default and meaning (Markdown table)."""
    from .listings import scenario_keys_table

    for line in scenario_keys_table():
        click.echo(line)


@main.command()
@click.option("--P", "P", default=None,
              help="comma-separated worker counts (<= 65536) [default: 4,8,16,32,64,128; for a cluster preset of G "
                   "GPUs per node G x 1, 2, 4, ..., 32]")
@click.option("--d", "d", type=int, default=25_000_000, show_default=True, help="parameters")
@click.option("--density", type=float, default=0.001, show_default=True, help="k/d")
@click.option("--network", default=None,
              help="flat preset (1GbE, 10GbE, IB100) or cluster preset (gtopk-icdcs, v100-25GbE, dgx-h100) [default: "
                   "1GbE; not with --alpha-s / --bandwidth-Bps / --calibration]")
@click.option("--simulate", is_flag=True, help="also simulate each collective and print it next to the closed form")
@click.option("--engine", type=click.Choice(["auto", "fast", "message"]), default=None,
              help="engine of --simulate [default: auto] (message: every message an event; slow beyond P ~ 256)")
@click.option("--collectives", default=None,
              help="comma-separated columns: ring, recursive_doubling, allgather, gtopk_tree, gtopk_rd, hier_dense, "
                   "hier_topk, hier_gtopk, or any ALGORITHM[:COLLECTIVE] of `sparsim algorithms` [default: every "
                   "algorithm's main collectives]")
@click.option("--alpha-s", "alpha_s", type=float, default=None,
              help="a flat star network of this end-to-end latency (s) instead of a preset (with --bandwidth-Bps)")
@click.option("--bandwidth-Bps", "bandwidth_Bps", type=float, default=None,
              help="its bandwidth (bytes/s); beta = 1 / bandwidth")
@click.option("--calibration", type=click.Path(dir_okay=False), default=None,
              help="a scenario or `sparsim calibrate` output whose [cluster] table gives the network")
@_user_errors
def predict(P, d, density, network, simulate, engine, collectives, alpha_s, bandwidth_Bps, calibration):
    """Communication time per iteration of each collective: closed form (ms), and with --simulate the
    simulated time (s) next to it, on a flat network or a hierarchical cluster preset."""
    from .predict import predict_lines

    if calibration is not None and alpha_s is None and bandwidth_Bps is None and network is None:
        _check_calibration_network(calibration)
    for line in predict_lines(P, d, density, network, simulate, engine, collectives, alpha_s, bandwidth_Bps,
                              calibration):
        click.echo(line)


def _check_calibration_network(calibration: str) -> None:
    """SparsimError (one line naming the missing keys) when ``predict --calibration FILE``'s [cluster] table does
    not give the network: ``network`` (a flat preset, or "custom" with ``alpha_s`` and ``bandwidth_Bps``, as
    ``sparsim calibrate`` writes). Without them the schema's defaults, 1 GbE, would be predicted without a word. A
    file that cannot be read or parsed is left to :func:`experiments.predict.predict_lines`, which says so."""
    import tomllib

    try:
        data = tomllib.loads(Path(calibration).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return
    cl = data.get("cluster")
    if not isinstance(cl, dict):
        return  # no [cluster] table: predict_lines's own error
    need = ["network"] + (["alpha_s", "bandwidth_Bps"] if cl.get("network", "custom") == "custom" else [])
    missing = [k for k in need if k not in cl]
    if missing:
        has = ", ".join(cl) or "nothing"
        raise SparsimError(f"--calibration {calibration}: its [cluster] has no {', '.join(missing)} (it gives {has}), "
                           "so it names no network: valid a `sparsim calibrate` output or a scenario whose [cluster] "
                           "has network = 'custom' with alpha_s and bandwidth_Bps, or a flat preset network")


@main.command("plan")
@click.option("--scenario", type=click.Path(dir_okay=False), default=None,
              help="a scenario whose [workload] / [model], [cluster], [compute] and [algorithm.NAME] tables give the "
                   "model, cluster, device and costs (the options below replace its keys)")
@click.option("--model", default=None, help="zoo model (resnet50, bert-base, ...), image-zoo network (mlp-256, lenet5, "
                                            "...) or layer-table file (.csv / .toml)")
@click.option("--network", default=None, help="flat preset (1GbE, 10GbE, IB100), cluster preset (gtopk-icdcs, "
                                              "v100-25GbE, dgx-h100), custom or hierarchical (with --set cluster.KEY=V)")
@click.option("--P", "P", default=None, help="comma-separated worker counts [default: the scenario's cluster.P, else "
                                             "the evidence's, else 64,256,1024,4096]")
@click.option("--densities", default=None, help="comma-separated k/d in (0, 1] [default: the scenario's, else the "
                                                "evidence's, else 0.0001,0.001,0.01,0.03,0.1]")
@click.option("--algorithms", default=None, help="comma-separated NAME or NAME:COLLECTIVE [default: every registered "
                                                 "algorithm with every collective the network runs]")
@click.option("--policies", default=None, help="comma-separated selection policies: model, bucket, layer, hybrid "
                                               "[default: all]")
@click.option("--device", default=None, help="device model (workload.device): P102-100, V100, A100, H100 [default: the "
                                             "scenario's, else the cluster preset's GPU (gtopk-icdcs P102-100, "
                                             "v100-25GbE V100, dgx-h100 H100), else P102-100]")
@click.option("--batch-size", type=_IntIn("--batch-size"), default=None,
              help="samples per rank (training.batch_size)")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a scenario key (repeatable); a key that an option here also sets (--device and "
                   "workload.device, --P and cluster.P, ...) is an error")
@click.option("--iterations", type=_IntIn("--iterations"), default=1, show_default=True,
              help="iterations simulated per configuration (more only matter with jitter or stragglers)")
@click.option("--evidence", type=click.Path(), default=None,
              help="convergence evidence: a sparsim run directory, a folder of them (sparsim experiment tta --out DIR) "
                   "or a CSV (algorithm, seed, iteration, METRIC, ...); ranks by predicted time to --target")
@click.option("--target", type=float, default=None, help="the value of --metric to reach (with --evidence): "
                                                         "0 < target <= 1 for an accuracy, > 0 for a loss")
@click.option("--metric", default="test_accuracy", show_default=True,
              help="the evidence's metric (a name ending in 'loss' is lower-is-better)")
@click.option("--top", type=_IntIn("--top"), default=10, show_default=True,
              help="rows printed per P (0: all; plan.csv has all)")
@click.option("--anchors", is_flag=True, help="instead: the advisor's verdicts on the settings of Agarwal et al. "
                                              "(MLSys 2022) and Espresso (EuroSys 2023), written to --out")
@click.option("--out", "out", default=None, help="output directory [default: runs/plan, or runs/plan-anchors]")
@click.option("--force", is_flag=True, help="overwrite a non-empty output directory")
@click.option("--quiet", is_flag=True, help="no progress bar (the line with the number of configurations x P, on "
                                            "stderr, stays)")
@click.option("--jobs", type=_IntIn("jobs"), default=None,
              help="worker processes that simulate each P's distinct collectives before its configurations run (the "
                   "same plan.csv, bit for bit; 1: all in this process) [default: the usable cores, at most 8, for "
                   "P >= 2048 or a fabric with shared links, else 1; valid 1 to 1024]")
@_user_errors
def plan_cmd(scenario, model, network, P, densities, algorithms, policies, device, batch_size, overrides, iterations,
             evidence, target, metric, top, anchors, out, force, quiet, jobs):
    """Rank every registered algorithm x collective x density x selection policy for a model on a cluster at each P:
    simulated time per iteration on the layer-wise timeline, its compute / selection / exposed-communication split,
    the break-even iteration ratio against dense DDP, why; with --evidence, predicted time to --target (docs/advisor.md)."""
    from sim.base.errors import check_range

    from . import plan as pl

    src = click.get_current_context().get_parameter_source
    if out is not None and not out.strip():
        raise SparsimError(f"--out {out!r} is empty: valid a directory path (default runs/plan, or runs/plan-anchors)")
    if anchors:
        given = [o for o, v in (("--scenario", scenario), ("--model", model), ("--network", network), ("--P", P),
                                ("--densities", densities), ("--algorithms", algorithms), ("--policies", policies),
                                ("--device", device), ("--batch-size", batch_size), ("--evidence", evidence),
                                ("--target", target), ("--jobs", jobs)) if v is not None]
        given += ["--set"] if overrides else []
        given += [o for o, name in (("--iterations", "iterations"), ("--metric", "metric"), ("--top", "top"))
                  if src(name) == click.core.ParameterSource.COMMANDLINE]
        if given:
            raise SparsimError(f"{', '.join(given)}: --anchors runs the papers' settings, which fix these: valid "
                               "--anchors with --out, --force, --quiet only")
        click.echo(f"plan --anchors: Agarwal et al.'s sweep ({len(pl.AGARWAL_MODELS)} models x {len(pl.ANCHOR_VARIANTS)} "
                   f"variants x {len(pl.AGARWAL_BANDWIDTHS_GBPS)} bandwidths, each a plan at P = 64) and Espresso's "
                   f"{len(pl.ESPRESSO_SIZES)} tensor sizes x {len(pl.ESPRESSO_THRESHOLDS)} fabrics x {len(pl.ESPRESSO_VARIANTS)} "
                   "variants: about "
                   "2 minutes on 2 cores", err=True)
        path, lines = pl.run_anchors(out or "runs/plan-anchors", force=force, progress=not quiet)
        for line in lines:
            click.echo(line)
        click.echo(f"wrote {path}/ (anchors.csv, anchors.md)")
        return
    check_range("--top", top, *pl.OPTION_RANGES["--top"])
    jobs = None if jobs is None else pl.check_plan_jobs(jobs)  # None: each P's default (pl.prefetch_jobs)
    if target is not None and evidence is None:
        raise SparsimError(f"--target {target:g} needs --evidence: valid with the convergence evidence to read")
    if evidence is None and src("metric") == click.core.ParameterSource.COMMANDLINE:
        raise SparsimError(f"--metric {metric} is the evidence's metric: valid with --evidence")
    if target is not None:
        pl.check_target(target, metric)
    ev = pl.load_evidence(evidence, metric) if evidence is not None else None
    inp = pl.resolve_plan(scenario, list(overrides), model=model, network=network, P=P, densities=densities,
                          algorithms=algorithms, policies=policies, device=device, batch_size=batch_size,
                          iterations=iterations, evidence=ev)
    path, _rows, lines = pl.run_plan(inp, out or "runs/plan", force=force, target=target, top=top or None,
                                     progress=not quiet, announce=lambda line: click.echo(line, err=True),
                                     jobs=jobs)
    for line in lines:
        click.echo(line)
    click.echo(f"wrote {path}/ (plan.csv, plan.md, pareto.png, pareto.pdf, summary.json)")


@main.group()
def workload():
    """Real models for the layer-wise timeline: the zoo, layer tables, DDP's buckets."""


@workload.command("list")
@_user_errors
def workload_list():
    """The zoo: parameters, tensors, layers and FLOPs per sample of each model."""
    from .listings import zoo_table

    for line in zoo_table():
        click.echo(line)


@workload.command("show")
@click.argument("model")
@click.option("--bucket-cap-mb", type=float, default=None, help="DDP bucket_cap_mb (MiB); default DDP's 25 with a 1 MiB first bucket")
@click.option("--export", "export", default=None, type=click.Path(dir_okay=False),
              help="write the model's layer table to this .csv or .toml file")
@click.option("--force", is_flag=True, help="overwrite an existing --export file")
@_user_errors
def workload_show(model, bucket_cap_mb, export, force):
    """MODEL (a zoo name or a layer-table file): its size and the buckets DDP would build (launch order)."""
    from .listings import bucket_lines, check_export, export_layer_table, workload_of

    if export:  # checked before anything is printed
        check_export(export, force)
    w = workload_of(model)
    for line in bucket_lines(w, bucket_cap_mb):
        click.echo(line)
    if export:
        export_layer_table(w, export)
        click.echo(f"wrote {export}")


@workload.command("hybrid-plan")
@click.argument("scenario", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a scenario key, e.g. --set cluster.P=64 (repeatable)")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="the plan file to write (JSON)")
@click.option("--algorithm", default=None, help="the sparse algorithm of the plan [default: the scenario's first sparse one]")
@click.option("--densities", default="0.001,0.01,0.1", show_default=True,
              help="comma-separated candidate densities of a compressed bucket")
@click.option("--min-density", type=float, default=None,
              help="bound: overall density sum_b rho_b d_b / d >= this (a dense bucket counts 1)")
@click.option("--density-bound", type=float, default=None,
              help="bound: overall density <= this (under a cap the smallest density is nearly always fastest)")
@click.option("--error-bound", type=float, default=None,
              help="bound: total measured compression error <= this ([model] scenarios: measured on a short run)")
@click.option("--measure-iterations", type=int, default=None,
              help="iterations of the run that measures the errors (--error-bound only) [default: 20]")
@click.option("--force", is_flag=True, help="overwrite an existing --out")
@_user_errors
def workload_hybrid_plan(scenario, overrides, out, algorithm, densities, min_density, density_bound, error_bound,
                         measure_iterations, force):
    """Choose per DDP bucket dense or compressed (and its density) for SCENARIO's model on its cluster, minimising the
    simulated iteration under one bound; print the plan, the uniform policies and the gain; write --out (docs/hybrid.md).

    Train or time the plan with workload.sparse_policy = "hybrid" and workload.hybrid_plan = FILE, or give it to the
    DDP hook (register_sparse_hook(ddp, "gtopk", plan=FILE)); the plan names its algorithm and only that algorithm
    runs it. A --set key the plan does not read (e.g. training.iterations; compression.density without
    --error-bound) is an error."""
    from pathlib import Path as _P

    from sim.engine.hybrid import save_plan

    from .hybrid import check_plan_overrides, make_plan, parse_densities, plan_lines
    from .scenario import load_scenario

    given = [(b, v) for b, v in (("min_density", min_density), ("density", density_bound), ("error", error_bound))
             if v is not None]
    if len(given) != 1:
        raise SparsimError("give one bound: valid --min-density, --density-bound or --error-bound")
    if measure_iterations is not None and error_bound is None:
        raise SparsimError(f"--measure-iterations {measure_iterations}: used only with --error-bound (the run that "
                           "measures the errors)")
    if _P(out).exists() and not force:  # refused before anything is computed
        raise SparsimError(f"--out {out!r} exists: choose another name or pass --force")
    if not _P(out).resolve().parent.is_dir():
        raise SparsimError(f"--out {out!r}: the directory {str(_P(out).parent)!r} does not exist")
    sc = load_scenario(scenario, list(overrides))  # a bad --set value is blamed on the --set
    check_plan_overrides(sc, overrides, given[0][0], algorithm)  # a --set key the plan does not read: one line
    choice = make_plan(sc, parse_densities(densities), given[0][0], given[0][1], algorithm=algorithm,
                       measure_iterations=20 if measure_iterations is None else measure_iterations,
                       overrides=list(overrides))
    for line in plan_lines(choice, sc):
        click.echo(line)
    save_plan(choice.plan, out, force=force)
    click.echo(f"wrote {out}")


@main.group()
def theory():
    """The papers' bounds as sympy expressions (gTop-k IJCAI 2019; Mem-SGD NeurIPS 2018)."""


@theory.command("list")
def theory_list():
    """List the bound names."""
    from theory.cli_support import list_bounds

    for name in list_bounds():
        click.echo(name)


@theory.command("show")
@click.argument("name")
@_user_errors
def theory_show(name):
    """Print bound NAME as plain text and LaTeX, with its source, parameters and variant."""
    from theory.cli_support import show

    click.echo(show(name))


@theory.command("eval")
@click.argument("name")
@click.argument("assignments", nargs=-1)
@_user_errors
def theory_eval(name, assignments):
    """Evaluate bound NAME for constants given as key=value (e.g. d=1000 k=10 eta=0.001 ...)."""
    from theory.cli_support import evaluate

    click.echo(repr(evaluate(name, list(assignments))))


@main.group()
def experiment():
    """One-command experiments that write a CSV, a figure (PNG and PDF) and a Markdown table."""


def _experiment_options(name, quick_help):
    """The options every experiment (bounds, scaling, delta, compression, memsgd) shares."""
    def deco(fn):
        for opt in reversed([
            click.option("--out", "out", default=f"runs/{name}", show_default=True, help="output directory to write"),
            click.option("--quick", is_flag=True, help=quick_help),
            click.option("--force", is_flag=True, help="overwrite a non-empty output directory"),
            click.option("--jobs", type=int, default=None, help="parallel runs (default: all local cores)"),
            click.option("--scheduler", default=None, metavar="ADDRESS",
                         help="run on a Dask cluster, e.g. tcp://host:8786 (needs the experiments extra); "
                              "--out must be on a shared file system"),
            click.option("--quiet", is_flag=True, help="no progress bar"),
        ]):
            fn = opt(fn)
        return fn
    return deco


@experiment.command("bounds")
@_experiment_options("bounds", "CI size: digits softmax only, c in {10, 100}, one B, 2 seeds, T = 30")
@_user_errors
def experiment_bounds(out, quick, force, jobs, scheduler, quiet):
    """Corollary 2 (published M^2/B vs corrected M^2) against measured runs over c, B and seeds."""
    from .bounds_sweep import run_sweep

    path, _rows, report = run_sweep(out, quick=quick, force=force, jobs=jobs, scheduler=scheduler, progress=not quiet)
    click.echo(f"wrote {path}/ (results.csv, results.md, bounds.png, bounds.pdf, runs/)")
    click.echo(report)


@experiment.command("scaling")
@_experiment_options("scaling", "CI size: ResNet-50 only, P = 4..32, crossover at density 0.05")
@_user_errors
def experiment_scaling(out, quick, force, jobs, scheduler, quiet):
    """ICDCS 2019: iteration time and scaling efficiency vs P for dense, Top-k and gTop-k on 1 GbE, vs the published."""
    from .scaling import run_scaling

    path, report = run_scaling(out, quick=quick, force=force, jobs=jobs, scheduler=scheduler, progress=not quiet)
    click.echo(f"wrote {path}/ (scaling.csv, ratios.csv, crossover.csv, breakdown.csv, cluster.csv, hierarchy.csv, overlap.csv, "
               "successors.csv, report.md, scaling.png/.pdf, hierarchy.png/.pdf, cases/)")
    click.echo(report)





@experiment.command("crossover")
@click.option("--out", "out", default="runs/crossover", show_default=True, help="output directory to write")
@click.option("--force", is_flag=True, help="overwrite a non-empty output directory")
@_user_errors
def experiment_crossover(out, force):
    """gTop-k's tree vs Ok-Topk's O(P)-latency allreduce: the boundary in (P, alpha, k) from the registry's closed forms."""
    from .crossover import run_crossover

    path, report = run_crossover(out, force=force)
    click.echo(f"wrote {path}/ (crossover.csv, boundary.csv, check.csv, report.md, crossover.png/.pdf)")
    click.echo(report)


@experiment.command("delta")
@_experiment_options("delta", "CI size: T = 150 instead of 2000")
@_user_errors
def experiment_delta(out, quick, force, jobs, scheduler, quiet):
    """gTop-k paper Figure 1: delta_t of Top-k and gTop-k at c = 1000, P = 4 (digits: c = 640, its largest)."""
    from .delta import run_delta

    path, _rows, report = run_delta(out, quick=quick, force=force, jobs=jobs, scheduler=scheduler,
                                    progress=not quiet)
    click.echo(f"wrote {path}/ (delta.csv, summary.csv, results.md, delta.png, delta.pdf, runs/)")
    click.echo(report)


@experiment.command("compression")
@_experiment_options("compression", "CI size: T = 60 instead of 1500")
@click.option("--algorithms", default="gtopk", show_default=True,
              help="comma-separated sparse algorithms compared with dense (`sparsim algorithms`; the paper: gtopk)")
@_user_errors
def experiment_compression(out, quick, force, jobs, scheduler, quiet, algorithms):
    """gTop-k paper Figure 2: loss and ||grad f||^2 for dense and c = 1000..20000, with Corollary 2 (both variants)."""
    from .compression import run_compression

    algs = tuple(a.strip() for a in algorithms.split(",") if a.strip())
    path, _rows, report = run_compression(out, quick=quick, force=force, jobs=jobs, scheduler=scheduler,
                                          progress=not quiet, algorithms=algs)
    click.echo(f"wrote {path}/ (compression.csv, bounds.csv, results.md, compression.png, compression.pdf, runs/)")
    click.echo(report)


@experiment.command("memsgd")
@_experiment_options("memsgd", "CI size: epsilon-like d = 200, n = 1000, T = 3000, gamma = 2 schedule only")
@click.option("--libsvm", "libsvm", type=click.Path(dir_okay=False), default=None,
              help="also run on this binary LIBSVM-format file")
@_user_errors
def experiment_memsgd(out, quick, force, jobs, scheduler, quiet, libsvm):
    """Mem-SGD: top-k vs rand-k (with memory) vs SGD on logistic regression, lambda = 1/n, P = 1."""
    from .memsgd import run_memsgd

    path, _rows, report = run_memsgd(out, quick=quick, force=force, jobs=jobs, scheduler=scheduler,
                                     progress=not quiet, libsvm=libsvm)
    click.echo(f"wrote {path}/ (memsgd.csv, summary.csv, fstar.json, results.md, memsgd.png, memsgd.pdf, runs/)")
    click.echo(report)


@experiment.command("tta")
@_experiment_options("tta", "CI size: mlp-256, dense and gtopk at density 0.001, 3 seeds, P = 8, lr = 0.1, 30 "
                            "iterations, small evaluation subsets, target 0.65")
@click.option("--model", default=None, help="network trained on Fashion-MNIST: mlp-256, mlp-1024, mlp-3000, lenet5, "
                                            "resnet20 [default: mlp-256]")
@click.option("--algorithms", default=None, help="comma-separated registered algorithms [default: dense,topk,gtopk,randk]")
@click.option("--densities", default=None, help="comma-separated k/d of the sparse algorithms (dense runs once per seed) "
                                                "[default: 0.001,0.01; --quick: 0.001]")
@click.option("--seeds", type=int, default=None, help="seeds 0..N-1 per case [default: 3]")
@click.option("--target", type=float, default=None, help="test accuracy to reach, 0 < target <= 1 [default: 0.8; "
                                                         "--quick: 0.65]")
@click.option("--clusters", default=None, help="comma-separated cluster.network presets; each one times the same "
                                               "trained runs [default: gtopk-icdcs,dgx-h100]")
@click.option("--P", "P", type=int, default=None, help="workers [default: 16; --quick: 8]")
@click.option("--iterations", type=int, default=None, help="iterations per run (the cap with --time-budget-s) "
                                                           "[default: 300; --quick: 30]")
@click.option("--time-budget-s", type=float, default=None,
              help="stop every run at this simulated time (s) on each cluster, for a comparison at equal time")
@click.option("--eval-every", type=int, default=None, help="iterations between test evaluations: the resolution of the "
                                                           "time to target [default: 25; --quick: 10]")
@click.option("--lr", type=float, default=None, help="constant SGD step size [default: 0.2; --quick: 0.1]")
@click.option("--momentum", type=float, default=None, help="heavy-ball momentum [default: 0]")
@click.option("--batch-size", type=int, default=None, help="images per worker per iteration [default: 32]")
@_user_errors
def experiment_tta(out, quick, force, jobs, scheduler, quiet, model, algorithms, densities, seeds, target, clusters, P,
                   iterations, time_budget_s, eval_every, lr, momentum, batch_size):
    """Time to accuracy: iterations and simulated time to a test accuracy, per algorithm, density and cluster."""
    from .tta import run_tta

    path, _rows, report = run_tta(out, quick=quick, force=force, jobs=jobs, scheduler=scheduler, progress=not quiet,
                                  model=model, algorithms=algorithms, densities=densities, seeds=seeds, target=target,
                                  clusters=clusters, P=P, iterations=iterations, time_budget_s=time_budget_s,
                                  eval_every=eval_every, lr=lr, momentum=momentum, batch_size=batch_size)
    click.echo(f"wrote {path}/ (tta.csv, summary.csv, curves.csv, clocks.csv, results.md, tta.png, tta.pdf, runs/)")
    click.echo(report)


@experiment.command("validate-advisor")
@_experiment_options("validate-advisor", "CI size: the tta quick plan with dense, topk, gtopk at 0.001, 2 seeds, 120 "
                                         "iterations evaluated every 4, targets 0.68,0.7 (tau and top-1 over 3 "
                                         "configurations per cluster)")
@click.option("--runs", type=click.Path(file_okay=False), default=None,
              help="read this sparsim experiment tta output directory instead of running the sweep (its evaluation "
                   "points must put >= 4 in each run's first --fraction)")
@click.option("--targets", default=None, help="comma-separated test accuracies in (0, 1] [default: 0.84,0.86; "
                                              "--quick: 0.68,0.7]")
@click.option("--fraction", type=float, default=None, help="share of each run's iterations the predictor sees, in "
                                                            "(0, 1) [default: 0.2]")
@_user_errors
def experiment_validate_advisor(out, quick, force, jobs, scheduler, quiet, runs, targets, fraction):
    """Time to accuracy predicted from the first 20 % of each run against the full runs: Kendall tau and top-1."""
    from .advisor_validation import run_validation

    path, _rows, report = run_validation(out, runs=runs, quick=quick, force=force, jobs=jobs, scheduler=scheduler,
                                         progress=not quiet, targets=targets, fraction=fraction)
    click.echo(f"wrote {path}/ (cases.csv, fits.csv, rankings.csv, report.md, validation.png, validation.pdf"
               + ("" if runs else ", tta/") + ")")
    click.echo(report)


if __name__ == "__main__":  # pragma: no cover
    main()
