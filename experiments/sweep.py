"""The sweep engine of ``sparsim experiment``: run independent jobs on local cores or on a Dask cluster.

No home-made scheduler: locally a :class:`concurrent.futures.ProcessPoolExecutor`, across machines
Dask distributed (``pip install -e '.[experiments]' (in the clone)``), started by the user::

    dask-scheduler                          # on one machine; prints tcp://HOST:8786
    dask-worker tcp://HOST:8786             # on every machine (sparsim installed, same version)
    sparsim experiment scaling --scheduler tcp://HOST:8786

Jobs must be picklable module-level functions with picklable arguments; results come back in input
order whatever the completion order.
"""
from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Callable, Sequence

from sim.base.errors import ConfigError, SparsimError

__all__ = ["map_jobs", "resolve_jobs"]


def resolve_jobs(jobs: int | None, scheduler: str | None = None) -> int | None:
    """Number of local worker processes: ``jobs``, or ``os.cpu_count()`` when None. With a Dask
    ``scheduler`` its workers decide: the scheduler is reached once (then let go) so that a bad address
    fails here, before any output is prepared, and ``jobs`` is returned unchanged.

    Raises ConfigError (one line naming --jobs) for jobs < 1 or a non-integer; SparsimError (one line)
    when the scheduler is given and Dask is missing or the scheduler cannot be reached.
    """
    if scheduler is not None:
        _dask_client(scheduler).close()
        return jobs
    if jobs is None:
        return os.cpu_count() or 1
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"--jobs {jobs!r} is out of range: valid jobs >= 1")
    return jobs


def _dask_client(scheduler: str):
    try:
        from dask.distributed import Client
    except ImportError:
        raise SparsimError("--scheduler needs Dask distributed, which is not installed: "
                           "pip install -e '.[experiments]' (in the clone)") from None
    if not str(scheduler).strip():  # an empty address is no address (Dask may then look for a default client)
        raise SparsimError(f"--scheduler {scheduler!r}: cannot connect to the Dask scheduler (missing port number in "
                           f"address {scheduler!r}): valid an address such as tcp://host:8786")
    # a malformed address is refused before any Client exists: Client(...) raising on it leaves a half-built client
    # whose finalizer, run by a later garbage collection inside another client's start, can deadlock on the loop
    # runner's lock (the full test suite hung there once, in test_sweep's malformed-address cases)
    from distributed.comm import parse_address
    from distributed.comm.addressing import parse_host_port

    try:
        proto, loc = parse_address(str(scheduler))
        if proto in ("tcp", "tls", "ws", "wss"):
            parse_host_port(loc)
    except ValueError as err:
        raise SparsimError(f"--scheduler {scheduler!r}: cannot connect to the Dask scheduler ({err}): valid an "
                           "address such as tcp://host:8786") from None
    try:
        return Client(scheduler, timeout=30)
    except (OSError, TimeoutError, ValueError) as err:
        import gc

        gc.collect()  # the failed client's finalizer runs now, not inside the next client's start (see above)
        raise SparsimError(f"--scheduler {scheduler!r}: cannot connect to the Dask scheduler ({err})") from None


def map_jobs(fn: Callable[..., Any], args_list: Sequence[tuple], *, jobs: int | None = None, scheduler: str | None = None,
             progress: bool = True, desc: str = "") -> list:
    """Return ``[fn(*args) for args in args_list]``, run in parallel, in input order.

    - ``scheduler`` given (a Dask scheduler address such as ``tcp://host:8786``): the jobs go to that
      cluster through ``dask.distributed.Client(scheduler).map`` and ``gather``; ``jobs`` is ignored
      (the cluster's workers decide the parallelism). Dask is imported only here.
    - otherwise ``jobs`` local processes (default ``os.cpu_count()``, never more than there are jobs)
      in a ProcessPoolExecutor; ``jobs = 1`` runs inline in this process (no pickling).

    progress: a tqdm bar over completed jobs labelled ``desc``, drawn only when stderr is a terminal. An exception raised by a job is re-raised
    here. Raises ConfigError for jobs < 1, SparsimError when ``scheduler`` is given and Dask is not
    installed (naming ``pip install -e '.[experiments]' (in the clone)``) or the scheduler cannot be reached.
    """
    from tqdm import tqdm

    args_list = [tuple(a) for a in args_list]
    n = len(args_list)
    if scheduler is None:
        jobs = resolve_jobs(jobs)
    if n == 0:
        return []
    if scheduler is not None:
        with _dask_client(scheduler) as client:  # connected before the progress bar appears
            from dask.distributed import as_completed as dask_completed

            with tqdm(total=n, desc=desc, unit="job", disable=None if progress else True) as bar:
                futs = client.map(fn, *zip(*args_list), pure=False)
                for _ in dask_completed(futs):
                    bar.update(1)
                return client.gather(futs)
    bar = tqdm(total=n, desc=desc, unit="job", disable=None if progress else True)
    try:
        if jobs == 1 or n == 1:
            out = []
            for a in args_list:
                out.append(fn(*a))
                bar.update(1)
            return out
        results: list = [None] * n
        with ProcessPoolExecutor(max_workers=min(jobs, n)) as ex:
            futs = {ex.submit(fn, *a): i for i, a in enumerate(args_list)}
            for f in as_completed(futs):
                results[futs[f]] = f.result()
                bar.update(1)
        return results
    finally:
        bar.close()
