"""What ``sparsim run`` prints when a run is finished: a few lines read back from the run directory's summary.json.

The numbers are those of summary.json (times in ms, losses and accuracies as recorded); nothing is recomputed.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from sim.base.errors import SparsimError

__all__ = ["summary_lines", "costs_lines"]


def summary_lines(path: Path) -> Iterator[str]:
    """The lines ``sparsim run`` prints after a run (without newlines): what was written to ``path`` (the run
    directory), the resolved sizes and network, and one row per algorithm of its summary.json totals (times in
    ms, simulated or measured). A workload run ([workload]) and a network run ([model]) get their own tables.
    Raises OSError when summary.json cannot be read."""
    s = json.loads((path / "summary.json").read_text())
    r = s["resolved"]
    if s.get("mode", "").startswith("workload"):
        yield from _workload_lines(path, s)
        return
    yield (f"wrote {path}/ (metrics.csv, summary.json, figure.png, figure.pdf"
           + (", trace.json" if (Path(path) / "trace.json").is_file() else "") + ")")
    be = s.get("backend") or {"name": "sim"}
    if be.get("name") == "torch":  # measured: the scenario's network model was not used
        where = f"torch backend ({be.get('dist_backend')}, {be.get('nproc')} processes), measured wall times"
        clock = "wall s"
    else:
        net = r["network"]
        if "gpus_per_node" in net:
            where = (f"cluster {net['name']} {net['nodes']} x {net['gpus_per_node']} ({net['intra']}, "
                     f"{net['nics_per_node']} NIC/node): intra alpha = {net['intra_alpha_s']:.3g} s, "
                     f"beta = {net['intra_beta_s_per_byte']:.3g} s/byte; inter alpha = {net['alpha_s']:.3g} s, "
                     f"beta = {net['beta_s_per_byte']:.3g} s/byte")
        else:
            where = f"network alpha = {net['alpha_s']:.3g} s, beta = {net['beta_s_per_byte']:.3g} s/byte"
        where += f"; engine {net.get('engine', 'message')}"
        clock = "sim time s"
    plan = _hybrid_plan(r)
    sel = (f"; nominal {r['k_selected_per_worker']} selected per worker over {r['n_segments']} segments, k_b = "
           f"min(d_b, max(1, round(k d_b / d))), c = {r['compression_ratio_c_selected']:.4g}") \
        if "k_selected_per_worker" in r else ""
    if plan is not None:  # each bucket has its own density: the plan's k_b, not the uniform rule
        from .hybrid import plan_k_text

        yield f"P = {r['P']}, d = {r['d']}, {plan_k_text(plan)}, B = {r['global_batch_B']}, {where}"
    else:
        yield (f"P = {r['P']}, d = {r['d']}, k = {r['k']} (c = {r['compression_ratio_c']:.4g}{sel}), "
               f"B = {r['global_batch_B']}, {where}")
    if sel:
        yield from _measured_selection_lines(path, s)
    if "workload" in r:  # a [model] run: a network on images, timed by its layer-wise timeline
        yield from _net_lines(r, s)
        return
    yield (f"{'algorithm':<20}{'iter time ms':>13}{'compute':>9}{'compress':>9}{'comm':>9}"
           f"{clock:>11}{'final loss':>12}{'||grad||^2':>12}{'max delta':>10}")
    for name, t in s["totals"].items():
        md = "" if t["max_delta"] is None else f"{t['max_delta']:.3f}"
        yield (f"{name:<20}{_fixed(1e3 * t['mean_iter_time_s'], 13, 3)}{_fixed(1e3 * t['mean_compute_s'], 9, 3)}"
               f"{_fixed(1e3 * t['mean_compress_s'], 9, 3)}{_fixed(1e3 * t['mean_comm_s'], 9, 3)}"
               f"{_fixed(t['sim_time_s'], 11, 3)}{_fixed(t['final_loss'], 12, 5)}{t['final_grad_norm_sq']:>12.3e}{md:>10}")


def _measured_selection_lines(path: Path, s: dict) -> Iterator[str]:
    """Beside a layer-wise run's nominal sum of k_b: what each sparse algorithm's workers selected per step, from
    summary.json's totals (``selected_per_worker``) where recorded, else from metrics.csv (the same column). The
    measured count can be lower (exact zeros are never selected)."""
    from .record import read_metrics
    from .resolve import measured_selection

    nominal = s["resolved"]["k_selected_per_worker"]
    got = {name: t["selected_per_worker"] for name, t in s["totals"].items() if t.get("selected_per_worker")}
    if not got:
        try:
            got = {name: measured_selection(rows) for name, rows in read_metrics(path).items()}
        except (OSError, SparsimError, ValueError, KeyError):
            return
    parts = [f"{name} mean {m['mean']:.6g}, min {m['min']:.6g}, max {m['max']:.6g}" for name, m in got.items()
             if m is not None and name in s["totals"] and not _dense_label(name)]
    if parts:
        yield (f"selected per worker per step, measured (nominal {nominal}; exact zeros are never selected): "
               + "; ".join(parts))


def _dense_label(name: str) -> bool:
    """True for the label of an algorithm without k (registry: ``sparse`` False; dense sends everything, its count
    is d, not a selection)."""
    from sim.algorithms import REGISTRY

    algo = REGISTRY.get(name.split("[")[0])
    return algo is not None and not algo.sparse


def _net_lines(r: dict, s: dict) -> Iterator[str]:
    """The table of a [model] run: per algorithm the simulated iteration and its split, the simulated time of the
    run, and the final train loss and test accuracy."""
    w = r["workload"]
    dev = w["device"]
    yield (f"{w['name']}: d = {w['parameters']:,} parameters; forward {1e3 * w['forward_s']:.3g} ms + backward "
           f"{1e3 * w['backward_s']:.3g} ms per iteration" + (f" on {dev['name']}" if dev else "")
           + f"; data {r['data']['name']} ({r['data']['n_train']:,} train / {r['data']['n_test']:,} test images)")
    if "compute_costs" in r:
        yield from costs_lines(r["compute_costs"])
    yield (f"{'algorithm':<20}{'iter ms':>10}{'compute':>9}{'exposed':>9}{'select':>9}{'overlap':>8}{'iters':>7}"
           f"{'sim time s':>11}{'train loss':>11}{'test acc':>9}{'max delta':>10}")
    for name, t in s["totals"].items():
        md = "" if t["max_delta"] is None else f"{t['max_delta']:.3f}"
        exposed = t["mean_iter_time_s"] - t["mean_compute_s"]
        overlap = 1 - exposed / (t["mean_comm_s"] + t["mean_compress_s"]) if t["mean_comm_s"] + t["mean_compress_s"] > 0 \
            else 0.0
        acc = t.get("final_test_accuracy")
        yield (f"{name:<20}{_fixed(1e3 * t['mean_iter_time_s'], 10, 3)}{_fixed(1e3 * t['mean_compute_s'], 9, 3)}"
               f"{_fixed(1e3 * exposed, 9, 3)}{_fixed(1e3 * t['mean_compress_s'], 9, 3)}"
               f"{min(1.0, max(0.0, overlap)):>8.0%}{t['iterations']:>7}{_fixed(t['sim_time_s'], 11, 3)}"
               f"{_fixed(t['final_loss'], 11, 4)}{'' if acc is None else f'{acc:.4f}':>9}{md:>10}")


def costs_lines(costs: dict) -> list[str]:
    """The lines saying which cost model priced a run's selections, merges, reductions and updates, from
    summary.json's ``resolved.compute_costs`` (:func:`experiments.resolve.compute_costs`): ``costs: select <coeff>,
    merge ..., reduce ..., update ...`` and, where the run charges them, ``scan`` and ``matmul`` (seconds per
    x log2 x, per element, per byte or per FLOP, each cost's ``unit``; with the memory model's passes),
    then one line per source naming the kinds it priced (the scenario's key, the device's memory model or measured
    fit, or the default). Returns the lines (without newlines)."""
    def one(c):
        per = c.get("unit") or ("x log2 x" if c["scaling"] == "x log2 x" else "element")  # no unit: before scan/matmul
        return f"{c['coeff_s']:.3g} s/{per}" + (f" ({c['passes']:.3g} passes)" if c.get("passes") is not None else "")

    head = "costs: " + ", ".join(f"{kind} {one(c)}" for kind, c in costs.items())
    by_source = {}
    for kind, c in costs.items():
        by_source.setdefault(c["source"], []).append(kind)
    return [head, *(f"  {', '.join(kinds)}: {src}" for src, kinds in by_source.items())]


def _hybrid_plan(r: dict) -> dict | None:
    """summary.json's hybrid plan (``resolved.policy.plan``) of a run with workload.sparse_policy = "hybrid", else None."""
    pol = r.get("policy") or {}
    return pol.get("plan") if pol.get("sparse") == "hybrid" else None


def _fixed(x: float, width: int, prec: int) -> str:
    """``x`` right-aligned in ``width`` columns with ``prec`` decimals, or in exponent notation when the
    fixed form would not leave a blank column before it (a huge loss or time is shown as 1.234e+21, not as 22
    digits, and -37021.71045 in 12 columns as -3.702e+04, not run together with the column on its left)."""
    text = f"{x:.{prec}f}"
    return f"{text:>{width}}" if len(text) < width else f"{x:>{width}.{max(prec - 2, 2)}e}"


def _workload_lines(path: Path, s: dict) -> Iterator[str]:
    """The table of a workload run: the model and its compute per iteration, the network and policies, and per
    algorithm the mean iteration and its split (ms), the overlap and the speedup over dense."""
    r, w = s["resolved"], s["resolved"]["workload"]
    files = "metrics.csv, summary.json, " + ("trace.json, " if (path / "trace.json").exists() else "") + "figure.png, figure.pdf"
    yield f"wrote {path}/ ({files})"
    dev = w["device"]
    yield (f"{w['name']}: d = {w['parameters']:,} parameters in {w['tensors']} tensors, {w['layers']} layers; "
           f"forward {1e3 * w['forward_s']:.2f} ms + backward {1e3 * w['backward_s']:.2f} ms per iteration"
           + (f" on {dev['name']} ({dev['peak_flops'] / 1e12:g} TFLOP/s x {dev['efficiency']:g})" if dev else " (measured)"))
    if "compute_costs" in r:
        yield from costs_lines(r["compute_costs"])
    pol = r["policy"]
    net = r["network"]
    plan = _hybrid_plan(r)
    if plan is not None:  # each bucket has its own density: the plan's k_b, not k / d per bucket
        from .hybrid import plan_k_text

        ks = plan_k_text(plan)
    else:
        ks = f"k = {r['k']} (c = {r['compression_ratio_c']:.4g})"
    yield (f"P = {r['P']}, {ks}, network {s['scenario']['cluster']['network']}: "
           f"alpha = {net['alpha_s']:.3g} s, beta = {net['beta_s_per_byte']:.3g} s/byte; dense policy "
           f"{pol['dense']}, sparse policy {pol['sparse']}")
    head = ("algorithm", "iter ms", "compute", "exposed", "comm", "select", "overlap", "speedup", "ops")
    rows = []
    for name, t in s["totals"].items():
        sp = t.get("speedup_over_dense")
        rows.append((name, f"{1e3 * t['mean_iter_time_s']:.2f}", f"{1e3 * t['mean_compute_s']:.2f}",
                     f"{1e3 * t['mean_exposed_comm_s']:.2f}", f"{1e3 * t['mean_comm_s']:.2f}",
                     f"{1e3 * t['mean_compress_s']:.2f}", f"{t['mean_overlap_ratio']:.0%}",
                     "" if sp is None else f"{sp:.2f}x", str(t["communication_ops"] or "")))
    # each column at least its usual width, wider where a value needs it: one blank before every number
    widths = [max(w, *(len(r[i]) + (0 if i == 0 else 1) for r in rows)) if rows else w
              for i, w in enumerate((18, 10, 10, 10, 10, 9, 9, 9, 6))]
    yield (f"{head[0]:<{widths[0]}}" + "".join(f"{h:>{w}}" for h, w in zip(head[1:], widths[1:]))
           + "   (ms per iteration, means; comm = sum of collectives)")
    for r in rows:
        yield f"{r[0]:<{widths[0]}}" + "".join(f"{c:>{w}}" for c, w in zip(r[1:], widths[1:]))
