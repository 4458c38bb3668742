"""Wall time and peak memory of ``sparsim predict --simulate`` at P = 4096 and 16384, row by row, on three presets.

Runs the command as a user would, in a subprocess (``python -c "from experiments.cli import main; main()" predict
...``, the ``sparsim`` entry point), once per variant: on ``dgx-h100`` with the eight flat and hierarchical
collectives of the cluster-scale page (``--collectives ring,recursive_doubling,allgather,gtopk_tree,gtopk_rd,
hier_dense,hier_topk,hier_gtopk``) and without ``--collectives`` (every registered algorithm's main collectives
too), and on the shared-link presets ``v100-25GbE`` (a NIC shared per node) and ``gtopk-icdcs`` (NIC and PCIe
shared) with ``--collectives ring,hier_dense`` (the fast engine's exact FIFO arithmetic on shared links). Each table
row of the command's
output (P, collective, simulated s, closed-form s, their ratio, the wall seconds the row took) becomes a CSV row,
and each run gets a ``total`` row: the command's whole wall seconds (the interpreter's start and imports included)
and the child's peak resident memory (MB, ``ru_maxrss``). The simulated and closed-form seconds are deterministic;
the wall seconds are this machine's.

Results: ``benchmarks/results/predict.csv`` (``--out``) with its meta.json sidecar; docs/cluster-scale.md
shows the output block and the totals (``python benchmarks/tables.py``). A benchmark: nothing asserts on time.

Example:
    .venv/bin/python benchmarks/bench_predict.py              # about a minute
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import check_out, environment_line, markdown_table, run_sparsim, save_results  # noqa: E402

HEADER = ["variant", "network", "P", "collective", "simulated_s", "closed_form_s", "sim_over_closed", "wall_s",
          "peak_rss_mb", "line"]
#: The cluster-scale page's eight columns (flat collectives and the hierarchical ones).
EIGHT = "ring,recursive_doubling,allgather,gtopk_tree,gtopk_rd,hier_dense,hier_topk,hier_gtopk"
#: (variant, network, extra options)
VARIANTS = [("eight collectives", "dgx-h100", ["--collectives", EIGHT]), ("every algorithm", "dgx-h100", []),
            ("shared NIC", "v100-25GbE", ["--collectives", "ring,hier_dense"]),
            ("shared NIC and PCIe", "gtopk-icdcs", ["--collectives", "ring,hier_dense"])]


def run(P: str, network: str, extra: list[str]) -> tuple[list[str], float, float]:
    """Run one variant (:func:`_common.run_sparsim`): (its stdout lines, wall seconds, the child's own peak RSS in
    MB). Raises RuntimeError with the child's last stderr line when it fails."""
    lines, wall, usage = run_sparsim(["predict", "--simulate", "--network", network, "--P", P, *extra])
    return lines, wall, usage.ru_maxrss / 1024.0


def rows_of(variant: str, network: str, lines: list[str], wall: float, rss: float) -> list[list]:
    """CSV rows of one run: a row per table line (its fields parsed, the line kept verbatim), the header lines
    (collective empty, the line kept) and the total."""
    out = []
    for line in lines:
        f = line.split()
        if len(f) == 6 and f[0].isdigit():
            out.append([variant, network, int(f[0]), f[1], f[2], f[3], f[4], f[5], "", line])
        else:
            out.append([variant, network, "", "", "", "", "", "", "", line])
    out.append([variant, network, "", "total", "", "", "", round(wall, 2), round(rss), ""])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--P", default="4096,16384", help="comma list of worker counts (default 4096,16384)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "predict.csv")
    a = ap.parse_args(argv)
    check_out(ap, a.out)
    print(environment_line(), flush=True)
    rows = []
    for variant, network, extra in VARIANTS:
        try:
            lines, wall, rss = run(a.P, network, extra)
        except RuntimeError as e:  # the command's own one-line error (a bad --P): said once, exit 2
            print(f"bench_predict: {e}", file=sys.stderr)
            return 2
        rows += rows_of(variant, network, lines, wall, rss)
        print(f"  {variant} ({network}): {wall:.2f} s, {rss:.0f} MB peak", flush=True)
    print(markdown_table(["variant", "network", "wall_s", "peak_rss_mb"],
                         [[r[0], r[1], r[7], r[8]] for r in rows if r[3] == "total"]))
    return save_results(a.out, HEADER, rows)


if __name__ == "__main__":
    sys.exit(main())
