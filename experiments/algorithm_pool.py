"""Run a scenario's algorithms one after another, or at the same time in forked processes, with the same rows.

A scenario's algorithms (the default one: dense, Top-k and gTop-k on the same workers) are independent
simulations: each starts from the same x0, draws the same mini-batches (they depend only on the seed, the rank
and the iteration: :func:`sim.workloads.data.minibatch`) and shares nothing with the others. So they can run in separate
processes on separate cores and give the rows the serial run gives, bit for bit; the rows are put back in the
scenario's algorithm order. The processes are forked from the built run (objective, data, workers), so nothing
is imported or loaded again and the data pages are shared copy-on-write.

How many run at once (:func:`algorithm_jobs`): ``--jobs`` of ``sparsim run``, or by default as many as the
scenario has algorithms, at most twice the usable cores, and only while every process's share of the memory estimate
(:func:`experiments.resources.check_resources`) fits in half the available memory; 1 where fork is not
available (not Linux/macOS). Errors: an algorithm's error is raised as in the serial run, and when several fail,
the one earliest in the scenario's order is raised (the serial run's), after the later ones are stopped.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import time

from sim.base.errors import ConfigError, ResourceError, SparsimError
from sim.base.process import die_with_parent, raise_if_signalled
from sim.engine.runner import run_algorithm

log = logging.getLogger("sparsim.run")

__all__ = ["algorithm_jobs", "check_jobs", "run_algorithms"]


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else ``os.cpu_count()``), >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def check_jobs(jobs) -> None:
    """Raise ConfigError (one line naming --jobs and the valid range) unless ``jobs`` is None or an int >= 1."""
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ConfigError(f"--jobs {jobs!r} is out of range: valid jobs >= 1 (1 = one algorithm at a time)")


def algorithm_jobs(jobs: int | None, n_algorithms: int, estimate: dict | None = None) -> int:
    """How many of a run's ``n_algorithms`` algorithms to simulate at the same time (>= 1).

    jobs: ``sparsim run --jobs`` (None: automatic; 1: one after another). estimate: the run's
    :func:`~experiments.resources.check_resources` result ({"memory_bytes", "available_bytes", ...}; memory of
    one algorithm at a time, in bytes), or None when unknown. Automatic: min(n_algorithms, 2 x usable CPUs), lowered
    until ``jobs x memory_bytes <= available_bytes / 2``; 1 without fork. An explicit ``jobs`` is capped at
    n_algorithms. Raises ConfigError for jobs < 1 or not an integer, ResourceError when an explicit ``jobs``
    processes would need more than the available memory.
    """
    check_jobs(jobs)
    if n_algorithms < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    mem = (estimate or {}).get("memory_bytes")
    avail = (estimate or {}).get("available_bytes")
    if jobs is not None:
        jobs = min(jobs, n_algorithms)
        if jobs > 1 and mem and avail is not None and jobs * mem > avail:
            raise ResourceError(
                f"--jobs {jobs} would run {jobs} algorithms at once, about {jobs * mem / 2**30:.2f} GiB "
                f"({mem / 2**30:.2f} GiB each) with {avail / 2**30:.2f} GiB available: valid jobs <= "
                f"{max(1, avail // mem)}")
        return jobs
    # up to twice the cores: the OS time-slices them, so unequal algorithms end together, where a pool of one
    # process per core leaves a core idle at the end (default scenario, 2 cores: 3 at once 1.2 s, 2 at once 1.4 s)
    jobs = min(n_algorithms, 2 * usable_cpus())
    if mem and avail is not None:
        jobs = min(jobs, max(1, int(avail // (2 * mem))))
    return jobs


def run_algorithms(specs, built, *, T: int, eval_every: int, jobs: int = 1, bar_for=None) -> list[list[dict]]:
    """Simulate every AlgorithmSpec of ``specs`` on ``built`` (an :class:`experiments.build.Built`); return their rows.

    Returns one list of metric rows (dicts, :data:`sim.engine.runner.METRIC_COLUMNS`) per spec, in the order of
    ``specs``, the same whatever ``jobs``. jobs: how many run at once (:func:`algorithm_jobs`); 1 runs them here,
    one after another. bar_for: ``bar_for(spec) -> bar`` with ``on_row(row)``, ``close()`` and ``shown`` (a
    progress bar; when it is shown, the processes send it each row's iteration as they go), or None. Raises what the algorithm raises
    (the earliest one in ``specs`` order when several fail), or SparsimError when a process dies without a
    result (naming the algorithm and its exit code).
    """
    specs = list(specs)
    kw = dict(T=T, lr=built.lr, x0=built.x0, network=built.network, compute=built.compute, eval_every=eval_every,
              clock=built.clock)
    t0 = time.perf_counter()
    if jobs <= 1 or len(specs) < 2:
        out = []
        for spec in specs:
            bar = bar_for(spec) if bar_for is not None else None
            try:
                out.append(run_algorithm(spec, built.workers, on_row=bar.on_row if bar else None, **kw))
            finally:
                if bar is not None:
                    bar.close()
            log.info("%s: %d iterations simulated in %.2f s of wall time", spec.label, T, time.perf_counter() - t0)
        return out
    return _run_forked(specs, built, kw, jobs, bar_for, t0)


def _child(conn, spec, workers, kw, ticks: bool, parent_ends, parent_pid: int) -> None:
    """Body of a forked process: simulate ``spec`` and send ("rows", rows) or ("error", exception).

    The process dies with its parent (Linux: PR_SET_PDEATHSIG), SIGTERM ends it at once (the parent's handler,
    which unwinds, is reset) and SIGINT is left to the parent (a Ctrl-C reaches the whole process group; the
    parent stops the children), and it holds no read end of any result pipe, so a send to a parent that has gone
    fails instead of blocking. An Exception goes to the parent; nothing is sent for SystemExit/KeyboardInterrupt.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)
    for end in parent_ends:
        end.close()
    try:
        on_row = (lambda row: conn.send(("row", {"iteration": row["iteration"]}))) if ticks else None
        msg = ("rows", run_algorithm(spec, workers, on_row=on_row, **kw))
    except Exception as err:  # noqa: BLE001 - every failure goes to the parent, which raises it
        try:
            pickle.loads(pickle.dumps(err))  # an exception the parent cannot rebuild goes as its message
        except Exception:  # noqa: BLE001
            err = SparsimError(f"{type(err).__name__}: {err}")
        msg = ("error", err)
    try:
        conn.send(msg)
    except OSError:  # the parent has gone (its end is closed): nobody to tell
        pass
    finally:
        conn.close()


def _start_child(ctx, spec, workers, kw, ticks: bool, running):
    """Fork a process simulating ``spec``; return (the read end of its result pipe, the process). ``running``:
    the read ends of the siblings still running, closed in the child with its own."""
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, spec, workers, kw, ticks, [recv, *running], os.getpid()),
                       daemon=True, name=f"sparsim-{spec.label}")
    proc.start()
    send.close()
    return recv, proc


def _run_forked(specs, built, kw, jobs, bar_for, t0) -> list[list[dict]]:
    ctx = multiprocessing.get_context("fork")
    # the mini-batches of iterations 1..T, drawn once here (as the serial run's first algorithm draws them for the
    # next ones, up to Workers' memo limit) instead of once in every process; the same draws either way
    prefetch = getattr(built.workers, "prefetch_batches", None)
    if prefetch is not None:
        prefetch(kw["T"])
    pending = list(range(len(specs)))
    running: dict = {}  # connection -> (index, process, bar)
    results: list = [None] * len(specs)
    errors: dict = {}  # index -> exception
    try:
        while pending or running:
            while pending and len(running) < jobs and not errors:
                i = pending.pop(0)
                bar = bar_for(specs[i]) if bar_for is not None else None
                recv, proc = _start_child(ctx, specs[i], built.workers, kw, bar is not None and bar.shown, running)
                running[recv] = (i, proc, bar)
            if errors:  # the serial run would have stopped at the earliest failure: later ones need not finish
                first = min(errors)
                pending.clear()
                for conn, (i, proc, bar) in list(running.items()):
                    if i > first:
                        _stop(conn, proc, bar)
                        del running[conn]
                if not running:
                    break
            # a timeout, so that the loop comes back every WAIT_S: a SIGTERM whose SystemExit was lost (raised inside
            # a finalizer, or whose Python handler waits for a bytecode after a blocking poll) is raised again above
            # (seen twice under load: a --quiet --jobs 3 parent alive 30-60 s after SIGTERM, blocked in this wait)
            raise_if_signalled()  # a SIGTERM whose first SystemExit a finalizer swallowed
            for conn in multiprocessing.connection.wait(list(running), timeout=WAIT_S):
                i, proc, bar = running[conn]
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    kind, payload = "died", None
                if kind == "row":
                    if bar is not None:
                        bar.on_row(payload)
                    continue
                del running[conn]
                conn.close()
                proc.join()
                if bar is not None:
                    bar.close()
                if kind == "rows":
                    results[i] = payload
                    log.info("%s: %d iterations simulated in %.2f s of wall time (%d at once)", specs[i].label,
                             kw["T"], time.perf_counter() - t0, jobs)
                elif kind == "error":
                    errors[i] = payload
                else:
                    errors[i] = SparsimError(f"the process simulating {specs[i].label} ended without a result "
                                             f"(exit code {proc.exitcode}); run with --jobs 1 to see its error here")
    finally:
        for conn, (i, proc, bar) in running.items():
            _stop(conn, proc, bar)
    if errors:
        raise errors[min(errors)]
    return results


#: Longest the parent blocks waiting for its children before it looks at pending signals again (s).
WAIT_S = 0.5


def _stop(conn, proc, bar) -> None:
    """End a child that is still running (SIGTERM, then SIGKILL after 5 s), reap it, close its pipe and bar."""
    conn.close()  # a child blocked on a full pipe now gets EPIPE instead of waiting for a reader
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    proc.join()
    if bar is not None:
        bar.close()
