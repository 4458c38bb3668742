"""``sparsim calibrate``: measure the real transport's latency and bandwidth and write a network preset.

Ranks 0 and 1 of ``nproc`` local processes (gloo on loopback) time messages of sizes spaced
geometrically between ``min_bytes`` and ``max_bytes`` through :class:`sim.torch_backend.TorchTransport`
(the same length header and codec the collectives use), in two patterns: a ping-pong (one-way time =
half the round trip) and an exchange (both ranks send and receive at once, as in every step of
the ring and recursive-doubling collectives). :func:`sim.torch_backend.fit_alpha_beta` fits
t(n) = alpha + n beta to the 10 % trimmed mean times of each by least squares on the relative error. On a full-duplex network the two
agree; on loopback they need not (both directions share one kernel and the same CPUs), and the
exchange fit is the one that predicts the collectives. The result is a TOML ``[cluster]`` table
(network = "custom") for a scenario.
"""
from __future__ import annotations

import datetime

import numpy as np

__all__ = ["calibrate", "message_sizes"]


def message_sizes(min_bytes: int, max_bytes: int, per_decade: int = 3) -> list[int]:
    """Distinct integer sizes (bytes) spaced geometrically from min_bytes to max_bytes, both included."""
    n = max(2, int(round(np.log10(max_bytes / min_bytes) * per_decade)) + 1)
    return sorted({int(round(x)) for x in np.geomspace(min_bytes, max_bytes, n)})


def calibrate(nproc: int = 2, min_bytes: int = 1, max_bytes: int = 1 << 24, repeats: int = 20,
              timeout_s: float = 60.0, pattern: str = "exchange", busy_s: float = 0.0) -> tuple[str, dict]:
    """Run both timing patterns and fit each; the preset takes the fit of ``pattern``.

    pattern: "exchange" (default: both ranks send and receive at once, the step the collectives are
    made of) or "pingpong" (half a round trip); see :func:`sim.torch_backend.pingpong_job`. Both fits
    are reported in the TOML's comments, so their difference (the duplex penalty of the transport)
    is on record. busy_s: seconds (>= 0) of busy computation before each timed message, as between
    the messages of a training step (0: back to back; on hosts whose idle CPUs sleep deeply the
    latency after a busy spell is much higher, so calibrate with the run's compute time per step to
    predict a run). Returns (TOML text, fit dict of ``pattern`` with alpha_s, beta_s_per_byte,
    bandwidth_Bps, rms_rel_residual, max_rel_residual, rms_abs_residual_s, ``points``: list of
    (bytes, seconds), and ``other``: the other pattern's fit). Raises WorkerFailure if a rank fails,
    SparsimError for a bad fit or an unknown pattern.
    """
    import torch
    from scipy.stats import trim_mean

    from sim.errors import SparsimError, check_range
    from sim.torch_backend import PATTERNS, fit_alpha_beta, launch_local, pingpong_job

    if pattern not in PATTERNS:
        raise SparsimError(f"--pattern {pattern!r} is unknown: valid {', '.join(PATTERNS)}")
    check_range("busy_s", busy_s, 0)
    sizes = message_sizes(min_bytes, max_bytes)
    fits = {}
    for pat in PATTERNS:
        res = launch_local(nproc, pingpong_job, (sizes, repeats, 2, pat, busy_s), timeout_s=timeout_s)[0]
        # the mean, not the median: a collective's time is a sum of message times, and on a loaded or
        # virtualised host those are bimodal (a thread wake-up that waits for the next scheduler tick);
        # the 10 % trimmed mean keeps that while dropping one-off stalls
        pts = [(n, float(trim_mean(times, 0.1))) for n, _, times in res]
        try:
            fits[pat] = fit_alpha_beta([p[0] for p in pts], [p[1] for p in pts])
        except SparsimError as err:
            if pat == pattern:
                raise
            fits[pat] = {"error": str(err)}  # the other pattern's fit is for the record only
        fits[pat]["points"] = pts
    fit = fits[pattern]
    other = fits[next(p for p in PATTERNS if p != pattern)]
    fit["other"] = {k: v for k, v in other.items() if k != "points"}
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# sparsim calibrate, {now}: gloo over loopback, {nproc} processes, torch {torch.__version__}",
        f"# {len(sizes)} sizes {sizes[0]} B .. {sizes[-1]} B, "
        f"{'10 % trimmed mean' if repeats >= 10 else 'mean'} of {repeats} repeats each, "
        f"{busy_s:g} s busy before each;",
        "# least-squares fit t(n) = alpha + n * beta (relative error) of each pattern:",
    ]
    for pat in PATTERNS:
        f = fits[pat]
        if "error" in f:
            lines.append(f"#   {pat:8s}: no fit ({f['error']})")
            continue
        lines.append(f"#   {pat:8s}: alpha = {f['alpha_s']:.4g} s, beta = {f['beta_s_per_byte']:.4g} s/byte "
                     f"(bandwidth {f['bandwidth_Bps'] / 1e9:.4g} GB/s), residual rms {100 * f['rms_rel_residual']:.3g} % "
                     f"(max {100 * f['max_rel_residual']:.3g} %), rms {f['rms_abs_residual_s']:.3g} s absolute"
                     + ("   <- this preset" if pat == pattern else ""))
    lines.append("#   " + f"{'bytes':>9s}  " + "  ".join(f"{p + '_s':>10s} {'fit_s':>10s}" for p in PATTERNS))
    for i, n in enumerate(sizes):
        cols = []
        for pat in PATTERNS:
            f = fits[pat]
            fitted = f"{f['alpha_s'] + n * f['beta_s_per_byte']:.4e}" if "error" not in f else f"{'-':>10s}"
            cols.append(f"{f['points'][i][1]:.4e} {fitted}")
        lines.append(f"#   {n:>9d}  " + "  ".join(cols))
    lines += [
        "[cluster]",
        'network = "custom"',
        'topology = "star"',
        f"alpha_s = {fit['alpha_s']!r}",
        f"bandwidth_Bps = {fit['bandwidth_Bps']!r}",
        "",
    ]
    return "\n".join(lines), fit
