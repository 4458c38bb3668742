"""``sparsim calibrate``: measure the real transport's latency and bandwidth and write a network preset.

Ranks 0 and 1 of ``nproc`` local processes (gloo on loopback) bounce messages of sizes spaced
geometrically between ``min_bytes`` and ``max_bytes`` through :class:`sim.torch_backend.TorchTransport`
(the same length header and codec the collectives use). The one-way time of a size is half the median
round trip; :func:`sim.torch_backend.fit_alpha_beta` fits t(n) = alpha + n beta by least squares on the
relative error. The result is a TOML ``[cluster]`` table (network = "custom") for a scenario.
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
              timeout_s: float = 60.0) -> tuple[str, dict]:
    """Run the ping-pong and the fit. Returns (TOML text, fit dict with alpha_s, beta_s_per_byte,
    bandwidth_Bps, rms_rel_residual, max_rel_residual, rms_abs_residual_s, and ``points``: list of
    (bytes, one-way seconds)). Raises WorkerFailure if a rank fails, SparsimError for a bad fit."""
    import torch

    from sim.torch_backend import fit_alpha_beta, launch_local, pingpong_job

    sizes = message_sizes(min_bytes, max_bytes)
    res = launch_local(nproc, pingpong_job, (sizes, repeats), timeout_s=timeout_s)[0]
    pts = [(n, med) for n, med, _ in res]
    fit = fit_alpha_beta([p[0] for p in pts], [p[1] for p in pts])
    fit["points"] = pts
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# sparsim calibrate, {now}: gloo over loopback, {nproc} processes, torch {torch.__version__}",
        f"# ping-pong, {len(sizes)} sizes {sizes[0]} B .. {sizes[-1]} B, median of {repeats} round trips each;",
        "# least-squares fit of the one-way time t(n) = alpha + n * beta (relative error):",
        f"#   alpha = {fit['alpha_s']:.4g} s, beta = {fit['beta_s_per_byte']:.4g} s/byte "
        f"(bandwidth {fit['bandwidth_Bps'] / 1e9:.4g} GB/s)",
        f"#   residual: rms {100 * fit['rms_rel_residual']:.3g} % relative (max {100 * fit['max_rel_residual']:.3g} %), "
        f"rms {fit['rms_abs_residual_s']:.3g} s absolute",
        "#   bytes  measured_s  fitted_s",
    ]
    for n, t in pts:
        lines.append(f"#   {n:>9d}  {t:.4e}  {fit['alpha_s'] + n * fit['beta_s_per_byte']:.4e}")
    lines += [
        "[cluster]",
        'network = "custom"',
        'topology = "star"',
        f"alpha_s = {fit['alpha_s']!r}",
        f"bandwidth_Bps = {fit['bandwidth_Bps']!r}",
        "",
    ]
    return "\n".join(lines), fit
