"""Progress bars of a run: one tqdm bar per algorithm, with the whole run's remaining wall time.

:func:`run_clock` counts a run's iterations (every algorithm) and estimates the wall time left from those done;
:func:`progress_bar` draws one algorithm's bar (only on a terminal) and feeds the clock. Nothing here changes a
number of the run: the bars are status on stderr.
"""
from __future__ import annotations

import time

__all__ = ["progress_bar", "run_clock"]


class _RunClock:
    """Wall time of a whole run (every algorithm), estimated from the iterations done so far.

    total: iterations of the whole run (algorithms x T). :meth:`tick` counts one; :meth:`remaining_s` is
    elapsed / done x (total - done) in seconds, None before the first iteration."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def tick(self) -> None:
        self.done += 1

    def remaining_s(self) -> float | None:
        if self.done == 0:
            return None
        return (time.perf_counter() - self.t0) / self.done * (self.total - self.done)


def _fmt_wall(s: float) -> str:
    """Seconds as ``1h02m``, ``3m05s`` or ``42s``."""
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class _progress:
    """A tqdm bar over one algorithm's iterations, shown only when stderr is a terminal and the run lasts
    more than 2 s; its postfix is the whole run's remaining wall time (every algorithm), estimated from the
    iterations done so far (``clock``, a :class:`_RunClock`)."""

    def __init__(self, label, total, enabled, clock: _RunClock | None = None):
        self.bar = None
        self.clock = clock
        if enabled:
            from tqdm import tqdm

            # disable=None: no bar when stderr is not a terminal (logs, pipes, tests)
            self.bar = tqdm(total=total, desc=label, unit="it", delay=2.0, leave=False, disable=None)
            if self.bar.disable:
                self.bar = None

    @property
    def shown(self) -> bool:
        """Whether the bar is drawn (stderr is a terminal and progress was asked for)."""
        return self.bar is not None

    def on_row(self, row):
        if row["iteration"] > 0 and self.clock is not None:
            self.clock.tick()
        if self.bar is not None and row["iteration"] > 0:
            left = self.clock.remaining_s() if self.clock is not None else None
            if left is not None:
                self.bar.set_postfix_str(f"run ~{_fmt_wall(left)} left", refresh=False)
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def run_clock(total: int) -> _RunClock:
    """The wall-time clock of a whole run of ``total`` iterations (algorithms x T, >= 0): pass it to every
    algorithm's :func:`progress_bar`; its ``remaining_s()`` is the estimated wall time left (s), None before the
    first iteration."""
    return _RunClock(total)


def progress_bar(label: str, total: int, enabled: bool, clock: _RunClock | None = None) -> _progress:
    """A bar of ``total`` iterations named ``label`` (an algorithm's label): drawn only when ``enabled`` and
    stderr is a terminal, after 2 s. Its ``on_row(row)`` counts a metrics row (dict with ``iteration``; row 0,
    the start, is not an iteration) on the bar and on ``clock`` (a :func:`run_clock`, whose remaining wall time
    the bar shows); ``close()`` removes it; ``shown`` says whether it is drawn."""
    return _progress(label, total, enabled, clock)
