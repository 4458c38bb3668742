"""Figures of a run (matplotlib, Agg backend; PNG and PDF).

:func:`run_figure` builds its figure as a bare ``matplotlib.figure.Figure`` (no pyplot: nothing is imported
for a GUI, nothing is registered with a notebook's pyplot state, and ``savefig`` renders PNG with Agg and PDF
with the PDF backend whatever the backend chosen). ``plt`` (matplotlib.pyplot, for the experiments' figures) is
imported on first use: the CLI chooses the Agg backend (experiments.cli.main); a notebook keeps its own.
"""
from __future__ import annotations

import math
from pathlib import Path

__all__ = ["run_figure", "figure_legend"]


def __getattr__(name):
    if name == "plt":  # matplotlib.pyplot, imported when an experiment first asks for it
        import matplotlib.pyplot as plt

        globals()["plt"] = plt
        return plt
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def figure_legend(fig, handles, labels, fontsize: float = 9.5, suptitle: bool = False) -> None:
    """One legend for the whole figure, below its panels, in as many columns as its width holds (about 2.6
    inches per entry), then tight_layout leaving room for it (and for a suptitle when ``suptitle``)."""
    w, h = fig.get_size_inches()
    ncol = max(1, min(len(labels), int(w // 2.6)))
    rows = -(-len(labels) // ncol)
    bottom = min(0.45, (0.3 + rows * fontsize * 1.9 / 72) / h)  # inches of legend / figure height
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=fontsize, frameon=False)
    fig.tight_layout(rect=(0, bottom, 1, 0.96 if suptitle else 1))


def _by_alg(rows):
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["algorithm"], []).append(r)
    return out


def _num(v):
    return math.nan if v in (None, "") else float(v)


def run_figure(rows: list[dict], outdir: Path, title: str = "") -> list[Path]:
    """Write ``figure.png`` and ``figure.pdf`` in ``outdir``; returns their paths.

    Panels: loss and grad_norm_sq (test accuracy instead, for a network on images) against iteration and
    against simulated time (s); mean simulated
    time per iteration split into compute and exposed communication (the part not hidden behind compute),
    beside the total selection and collective times; delta (Assumption 1
    ratio) over training for the sparse algorithms, with the delta = 1 line.
    """
    from matplotlib.figure import Figure

    algs = _by_alg(rows)
    fig = Figure(figsize=(15, 8.5))
    ax = fig.subplots(2, 3)
    colors = {name: f"C{i}" for i, name in enumerate(algs)}
    # a network on images (test_accuracy filled): test accuracy replaces the gradient norm in the lower panels
    acc = any(not math.isnan(_num(r.get("test_accuracy"))) for r in rows)
    for name, rs in algs.items():
        kw = {"label": name, "color": colors[name]}
        ev = [r for r in rs if not math.isnan(_num(r["loss"]))]
        it = [r["iteration"] for r in ev]
        tm = [_num(r["sim_time_s"]) for r in ev]
        ls = [_num(r["loss"]) for r in ev]
        ax[0, 0].plot(it, ls, **kw)
        ax[0, 1].plot(tm, ls, **kw)
        if acc:
            ea = [r for r in rs if not math.isnan(_num(r.get("test_accuracy")))]
            ax[1, 0].plot([r["iteration"] for r in ea], [_num(r["test_accuracy"]) for r in ea], **kw)
            ax[1, 1].plot([_num(r["sim_time_s"]) for r in ea], [_num(r["test_accuracy"]) for r in ea], **kw)
        else:
            gn = [_num(r["grad_norm_sq"]) for r in ev]
            ax[1, 0].semilogy(it, gn, **kw)
            ax[1, 1].semilogy(tm, gn, **kw)
        dl = [(r["iteration"], _num(r["delta"])) for r in rs if r["iteration"] > 0 and r["delta"] not in (None, "")]
        if dl:
            ax[1, 2].plot([a for a, _ in dl], [b for _, b in dl], lw=0.8, **kw)
    ax[0, 0].set(xlabel="iteration", ylabel="loss f(v_t)", title="loss vs iteration")
    ax[0, 1].set(xlabel="simulated time (s)", ylabel="loss f(v_t)", title="loss vs simulated time")
    if acc:
        ax[1, 0].set(xlabel="iteration", ylabel="test accuracy", title="test accuracy vs iteration")
        ax[1, 1].set(xlabel="simulated time (s)", ylabel="test accuracy", title="test accuracy vs simulated time")
    else:
        ax[1, 0].set(xlabel="iteration", ylabel="||grad f(v_t)||^2", title="gradient norm vs iteration")
        ax[1, 1].set(xlabel="simulated time (s)", ylabel="||grad f(v_t)||^2", title="gradient norm vs simulated time")
    ax[1, 2].axhline(1.0, color="k", ls="--", lw=0.8)
    ax[1, 2].set(xlabel="iteration", ylabel="delta_t", title="Assumption 1 ratio delta (<= 1 holds)")
    names = list(algs)
    parts = {"compute": [], "compress": [], "comm": [], "exposed": []}
    for name in names:
        it = [r for r in algs[name] if r["iteration"] > 0]
        n = max(len(it), 1)
        for key in ("compute", "compress", "comm"):
            parts[key].append(1e3 * sum(_num(r[f"{key}_s"]) for r in it) / n)
        exposed = [_num(r.get("exposed_comm_s")) for r in it]
        if any(math.isnan(e) for e in exposed):  # rows without the column: iteration time not spent computing
            exposed = [max(0.0, _num(r["iter_time_s"]) - _num(r["compute_s"])) for r in it]
        parts["exposed"].append(1e3 * sum(exposed) / n)
    # the iteration = compute + exposed communication (what is not hidden behind compute); beside it, the
    # selection and collective times it contains (they equal the exposed part when nothing overlaps)
    x = list(range(len(names)))
    w = 0.38
    ax[0, 2].bar([i - w / 2 for i in x], parts["compute"], w, label="compute", color="C0")
    ax[0, 2].bar([i - w / 2 for i in x], parts["exposed"], w, bottom=parts["compute"], label="exposed communication",
                 color="C3")
    ax[0, 2].bar([i + w / 2 for i in x], parts["compress"], w, label="selection (total)", color="C1", alpha=0.6)
    ax[0, 2].bar([i + w / 2 for i in x], parts["comm"], w, bottom=parts["compress"], label="collectives (total)",
                 color="C2", alpha=0.6)
    ax[0, 2].set_xticks(x, names)
    for i in x:
        b = parts["compute"][i] + parts["exposed"][i]
        ax[0, 2].text(i - w / 2, b, f"{b:.2f} ms", ha="center", va="bottom", fontsize=8)
    ax[0, 2].set(ylabel="mean simulated time per iteration (ms)", title="where an iteration's time goes")
    for a in ax.flat:
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:  # a dense-only run has nothing to label in some panels
            a.legend(fontsize=8)
    if title:
        fig.suptitle(title, parse_math=False)  # a user's text ($x^$ is not mathtext): drawn as written
    fig.tight_layout()
    from .outdir import save_figure

    save_figure(fig, outdir, "figure")
    return [Path(outdir) / "figure.png", Path(outdir) / "figure.pdf"]
