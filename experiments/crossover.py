"""``sparsim experiment crossover``: where gTop-k's tree beats Ok-Topk's O(P)-latency sparse allreduce and where
Ok-Topk wins, in (P, alpha, k), from the closed forms the registry gives (checked on the simulator).

The two communication times per iteration are read from the registry (:func:`sim.engine.timing.closed_form_comm_s` of
``AlgorithmSpec("gtopk", k)``, its default binomial-tree collective with the exact mask, and of
``AlgorithmSpec("oktopk", k)``, its steady-state iteration under the balanced-region timing assumption,
:func:`sim.comm.costs.oktopk_time`), both with 4-byte values and 4-byte indices:

- gTop-k (Shi et al., ICDCS 2019): 2 ceil(lg P) alpha + ceil(lg P)(2 k s + ceil(k/8)) beta, s = 8 bytes;
- Ok-Topk (Li and Hoefler, PPoPP 2022): (P - 1 + 2 ceil(lg P)) alpha + 2 (P-1) ceil(k/P) s beta + 4 (P-1) beta.

Ok-Topk sends O(k) bytes per rank but O(P) messages; gTop-k sends O(k lg P) bytes in O(lg P) messages. Both
times are affine in alpha at fixed (P, k, beta): T = A alpha + B, with A = T(alpha = 1, beta = 0) and
B = T(alpha = 0, beta), exact in floating point. Ok-Topk's A is larger by P - 1, so at fixed (P, k, beta) gTop-k
wins exactly when alpha > alpha* = (B_gtopk - B_oktopk) / (A_oktopk - A_gtopk) (:func:`alpha_star`). At fixed
(P, alpha, beta), the difference T_ok - T_gt falls with k by steps (a sawtooth of period P from ceil(k/P) on a
falling line), and :func:`k_star` finds exactly the smallest k from which Ok-Topk is never slower. Only alpha / beta
matters (both times scale with beta at fixed alpha / beta), so the figure fixes beta at the 1 GbE preset's
9 ns/byte and moves alpha.

Outputs (built in ``DIR.partial``, renamed when complete): ``crossover.csv`` (:data:`GRID_COLUMNS`: both times
and the winner on a grid of P, k and alpha, with alpha*), ``boundary.csv`` (:data:`BOUNDARY_COLUMNS`: alpha*(P, k)
and k*(P, alpha) per grid line), ``check.csv`` (:data:`CHECK_COLUMNS`: a few points simulated round by round on
the fast engine, :func:`sim.engine.timing.simulate_timing`, against the closed forms), ``crossover.png`` / ``.pdf`` and
``report.md`` (also printed).
"""
from __future__ import annotations

from pathlib import Path

from sim.algorithms import AlgorithmSpec
from sim.machine.network import PRESETS, NetworkSpec
from sim.engine.timing import closed_form_comm_s, simulate_timing

from .outdir import check_out, partial_dir, publish, save_figure, write_csv

__all__ = ["comm_time", "alpha_star", "k_star", "grid_rows", "boundary_rows", "check_rows", "run_crossover",
           "GTOPK", "OKTOPK", "ALPHA_1GBE", "LOW_ALPHA", "BETA", "K_PAPER", "PS", "KS", "ALPHAS", "CHECK_POINTS"]

GTOPK = "gtopk"    # gTop-k S-SGD at its default collective (binomial tree)
OKTOPK = "oktopk"  # Ok-Topk's sparse allreduce
#: the 1 GbE preset (alpha = 0.436 ms, beta = 9 ns/byte), the gTop-k paper's testbed fit
ALPHA_1GBE, BETA = PRESETS["1GbE"].end_to_end_alpha_beta()
#: k of the issue's claim: about 26,000 (ResNet-50's 25.6M parameters at density 0.001)
K_PAPER = 26_000
#: a low-latency fabric's per-message latency (s), e.g. RDMA over InfiniBand (the IB100 preset's alpha)
LOW_ALPHA = 2e-6
#: the grid: workers, selected entries per worker, per-message latency (s)
PS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
KS = (1_000, 2_600, 10_000, K_PAPER, 100_000, 260_000, 1_000_000, 2_600_000)
ALPHAS = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, ALPHA_1GBE, 1e-3, 2e-3, 5e-3, 1e-2)
#: (P, alpha, k) simulated on the fast engine: both sides of the 1 GbE boundary at k = 26,000, a low-latency
#: fabric, large k, small k
CHECK_POINTS = ((16, ALPHA_1GBE, K_PAPER), (32, ALPHA_1GBE, K_PAPER), (64, ALPHA_1GBE, K_PAPER),
                (256, ALPHA_1GBE, K_PAPER), (256, LOW_ALPHA, K_PAPER), (256, ALPHA_1GBE, 2_600_000),
                (8, ALPHA_1GBE, 2_600), (1024, 1e-5, 260_000))

GRID_COLUMNS = ("P", "k", "alpha_s", "beta_s_per_byte", "gtopk_s", "oktopk_s", "winner", "alpha_star_s")
BOUNDARY_COLUMNS = ("kind", "P", "k", "alpha_s", "beta_s_per_byte", "alpha_star_s", "k_star", "gtopk_s", "oktopk_s")
CHECK_COLUMNS = ("P", "k", "alpha_s", "beta_s_per_byte", "gtopk_sim_s", "gtopk_closed_s", "oktopk_sim_s",
                 "oktopk_closed_s", "winner_sim", "winner_closed", "max_rel_error")


def comm_time(name: str, P: int, k: int, alpha: float, beta: float = BETA) -> float:
    """The registry's closed form (s) of algorithm ``name`` (GTOPK or OKTOPK) at its default collective with k
    entries per worker on P workers (alpha s, beta s/byte)."""
    return closed_form_comm_s(AlgorithmSpec(name, k=int(k)), int(P), int(k), alpha, beta)


def _affine(name: str, P: int, k: int, beta: float) -> tuple[float, float]:
    """(A, B) of T(alpha) = A alpha + B at fixed (P, k, beta)."""
    return comm_time(name, P, k, 1.0, 0.0), comm_time(name, P, k, 0.0, beta)


def alpha_star(P: int, k: int, beta: float = BETA) -> float | None:
    """The latency alpha* (s) at which the two closed forms are equal for P workers and k entries: gTop-k is faster
    for alpha > alpha*, Ok-Topk for alpha < alpha* (negative: gTop-k at every alpha). None for P = 1 (no message)."""
    ag, bg = _affine(GTOPK, P, k, beta)
    ao, bo = _affine(OKTOPK, P, k, beta)
    if ao == ag:
        return None
    return (bg - bo) / (ao - ag)


def k_star(P: int, alpha: float, beta: float = BETA, k_max: int = 10**9) -> int | None:
    """The smallest k (1 <= k <= k_max) from which Ok-Topk is never slower than gTop-k (T_ok <= T_gt for every
    k' >= k) at P workers; None if that does not happen by k_max.

    f(k) = T_ok - T_gt is a sawtooth: inside a block of P values of k with the same q = ceil(k/P) it falls (gTop-k
    grows with k, Ok-Topk does not), and from one block to the next its value at the block's start falls too
    (Ok-Topk adds 2 (P-1) s beta per block, gTop-k at least 2 P ceil(lg P) s beta). So the first block whose first
    value is <= 0 and every later one lie below 0, and inside the block before it the values <= 0 form a suffix:
    both found by bisection."""
    P = int(P)

    def f(k):
        return comm_time(OKTOPK, P, k, alpha, beta) - comm_time(GTOPK, P, k, alpha, beta)

    q_max = -(-k_max // P)

    def start(q):
        return (q - 1) * P + 1

    if f(min(start(q_max), k_max)) > 0:
        return None
    lo, hi = 1, q_max  # smallest q with f(start(q)) <= 0
    while lo < hi:
        mid = (lo + hi) // 2
        if f(start(mid)) <= 0:
            hi = mid
        else:
            lo = mid + 1
    q = lo
    if q == 1:
        return 1
    a, b = start(q - 1), start(q) - 1  # block q - 1: f falls inside it; its last value
    if f(b) > 0:
        return start(q)
    while a < b:  # smallest k in [a, b] with f(k) <= 0
        mid = (a + b) // 2
        if f(mid) <= 0:
            b = mid
        else:
            a = mid + 1
    return a


def grid_rows(Ps=PS, Ks=KS, alphas=ALPHAS, beta: float = BETA) -> list[dict]:
    """One row per (P, k, alpha): both closed forms (s), the winner (the faster; ``tie`` when equal) and alpha*."""
    rows = []
    for P in Ps:
        for k in Ks:
            a_star = alpha_star(P, k, beta)
            for alpha in alphas:
                tg, to = comm_time(GTOPK, P, k, alpha, beta), comm_time(OKTOPK, P, k, alpha, beta)
                rows.append({"P": P, "k": k, "alpha_s": alpha, "beta_s_per_byte": beta, "gtopk_s": tg, "oktopk_s": to,
                             "winner": GTOPK if tg < to else OKTOPK if to < tg else "tie", "alpha_star_s": a_star})
    return rows


def boundary_rows(Ps=PS, Ks=KS, alphas=ALPHAS, beta: float = BETA) -> list[dict]:
    """alpha*(P, k) for every (P, k) (kind ``alpha_star``, with both times there, equal) and k*(P, alpha) for every
    (P, alpha) (kind ``k_star``, with both times at k*)."""
    rows = []
    for P in Ps:
        for k in Ks:
            a = alpha_star(P, k, beta)
            rows.append({"kind": "alpha_star", "P": P, "k": k, "alpha_s": a, "beta_s_per_byte": beta, "alpha_star_s": a,
                         "gtopk_s": comm_time(GTOPK, P, k, a, beta), "oktopk_s": comm_time(OKTOPK, P, k, a, beta)})
        for alpha in alphas:
            ks = k_star(P, alpha, beta)
            row = {"kind": "k_star", "P": P, "alpha_s": alpha, "beta_s_per_byte": beta, "k_star": ks, "k": ks}
            if ks is not None:
                row.update(gtopk_s=comm_time(GTOPK, P, ks, alpha, beta), oktopk_s=comm_time(OKTOPK, P, ks, alpha, beta))
            rows.append(row)
    return rows


def check_rows(points=CHECK_POINTS, beta: float = BETA) -> list[dict]:
    """Each (P, alpha, k) simulated round by round on the fast engine (a star network whose uncontended message
    costs alpha + n beta; no compute) for both algorithms, beside the closed forms."""
    rows = []
    for P, alpha, k in points:
        net = NetworkSpec.from_alpha_beta(alpha, beta)
        row = {"P": P, "k": k, "alpha_s": alpha, "beta_s_per_byte": beta}
        err = 0.0
        for name in (GTOPK, OKTOPK):  # algorithms: the two sides of the crossover
            sim = float(simulate_timing(AlgorithmSpec(name, k=k), P, 100 * k, network=net, engine="fast").iter_s[0])
            closed = comm_time(name, P, k, alpha, beta)
            row[f"{name}_sim_s"], row[f"{name}_closed_s"] = sim, closed
            err = max(err, abs(sim - closed) / closed)
        row["max_rel_error"] = err
        for kind in ("sim", "closed"):
            g, o = row[f"{GTOPK}_{kind}_s"], row[f"{OKTOPK}_{kind}_s"]
            row[f"winner_{kind}"] = GTOPK if g < o else OKTOPK if o < g else "tie"
        rows.append(row)
    return rows


def _figure(outdir: Path, beta: float) -> None:
    import numpy as np

    from .plots import plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 5.2))
    Ps = np.array([P for P in range(2, 1025)])
    # (a) alpha*(P) per k: above a curve gTop-k wins, below Ok-Topk
    for i, k in enumerate(KS):
        a = np.array([alpha_star(P, k, beta) for P in Ps])
        ax[0].plot(Ps, a * 1e3, color=f"C{i}", lw=2.2 if k == K_PAPER else 1.2, label=f"k = {k:,}")
    ax[0].axhline(ALPHA_1GBE * 1e3, color="k", ls="--", lw=1)
    ax[0].text(2.2, ALPHA_1GBE * 1e3 * 1.15, "1 GbE: alpha = 0.436 ms", fontsize=8)
    ax[0].axhline(LOW_ALPHA * 1e3, color="k", ls=":", lw=1)
    ax[0].text(2.2, LOW_ALPHA * 1e3 * 1.15, "low latency: alpha = 2 us", fontsize=8)
    ax[0].set(xscale="log", yscale="log", xlabel="workers P", ylabel="alpha* (ms)", ylim=(1e-4, 1e3),
              title=f"boundary alpha*(P, k), beta = {beta * 1e9:g} ns/B\nabove: gTop-k faster; below: Ok-Topk faster")
    ax[0].legend(fontsize=7.5, ncol=2, loc="upper right")
    # (b), (c): winner maps in (P, k) at 1 GbE's alpha and at a low-latency alpha, with k*(P)
    kgrid = np.unique(np.round(np.logspace(1, 6.5, 150)).astype(int))
    for j, alpha in ((1, ALPHA_1GBE), (2, LOW_ALPHA)):
        Pm = np.unique(np.round(np.logspace(np.log10(2), np.log10(1024), 90)).astype(int))
        ratio = np.array([[comm_time(GTOPK, P, k, alpha, beta) / comm_time(OKTOPK, P, k, alpha, beta) for P in Pm]
                          for k in kgrid])
        m = ax[j].pcolormesh(Pm, kgrid, np.log2(ratio), cmap="RdBu", vmin=-3, vmax=3, shading="nearest")
        ks = [k_star(P, alpha, beta) for P in Pm]
        ax[j].plot(Pm, [np.nan if x is None else x for x in ks], color="k", lw=1.8, label="k*(P): the boundary")
        ax[j].axhline(K_PAPER, color="k", ls=":", lw=1, label=f"k = {K_PAPER:,}")
        ax[j].set(xscale="log", yscale="log", xlabel="workers P", ylabel="k (entries per worker)",
                  ylim=(kgrid[0], kgrid[-1]),
                  title=f"alpha = {alpha * 1e3:g} ms: red = gTop-k faster, blue = Ok-Topk\n"
                        "(colour: log2 of T_gtopk / T_oktopk)")
        ax[j].legend(fontsize=8, loc="lower right")
        fig.colorbar(m, ax=ax[j], fraction=0.046, pad=0.02)
    for a in ax:
        a.grid(alpha=0.3, which="both")
    fig.suptitle("gTop-k (binomial tree, O(lg P) messages) vs Ok-Topk (O(k) bytes, O(P) messages): registry closed "
                 "forms, 4-byte values and indices", fontsize=11)
    fig.tight_layout()
    save_figure(fig, outdir, "crossover")


def _fmt(x, unit=1e3, prec=3):
    return "" if x is None else f"{x * unit:.{prec}f}"


def _report(grid, bounds, checks) -> str:
    lines = ["# gTop-k vs Ok-Topk: the crossover", "",
             f"Closed forms from the registry (4 + 4 bytes per entry), beta = {BETA * 1e9:g} ns/byte. At 1 GbE "
             f"(alpha = {ALPHA_1GBE * 1e3:g} ms) and k = {K_PAPER:,}:", "",
             "| P | gTop-k (ms) | Ok-Topk (ms) | faster | alpha* (ms) |", "|---:|---:|---:|:---|---:|"]
    for r in grid:
        if r["k"] == K_PAPER and r["alpha_s"] == ALPHA_1GBE:
            lines.append(f"| {r['P']} | {_fmt(r['gtopk_s'])} | {_fmt(r['oktopk_s'])} | {r['winner']} | "
                         f"{_fmt(r['alpha_star_s'], prec=4)} |")
    lines += ["", "k*(P): the smallest k from which Ok-Topk is never slower:", "",
              "| P | k* at 1 GbE | k* at alpha = 2 us |", "|---:|---:|---:|"]
    ks = {(r["P"], r["alpha_s"]): r["k_star"] for r in bounds if r["kind"] == "k_star"}
    for P in PS:
        a, b = ks.get((P, ALPHA_1GBE)), ks.get((P, LOW_ALPHA))
        lines.append(f"| {P} | {'-' if a is None else f'{a:,}'} | {'-' if b is None else f'{b:,}'} |")
    lines += ["", "Simulated on the fast engine (round by round) against the closed forms:", "",
              "| P | alpha (ms) | k | gTop-k sim (ms) | Ok-Topk sim (ms) | faster (sim) | faster (closed) | max rel. error |",
              "|---:|---:|---:|---:|---:|:---|:---|---:|"]
    for r in checks:
        lines.append(f"| {r['P']} | {r['alpha_s'] * 1e3:g} | {r['k']:,} | {_fmt(r[f'{GTOPK}_sim_s'])} | "
                     f"{_fmt(r[f'{OKTOPK}_sim_s'])} | {r['winner_sim']} | {r['winner_closed']} | {r['max_rel_error']:.1e} |")
    return "\n".join(lines) + "\n"


def run_crossover(out, *, force: bool = False) -> tuple[Path, str]:
    """Write the crossover experiment into ``out`` (via ``out.partial``); return (path, Markdown report).
    Raises ConfigError if ``out`` exists and is not empty (unless ``force``)."""
    out = Path(out)
    check_out(out, force)
    tmp = partial_dir(out)
    grid = grid_rows()
    bounds = boundary_rows()
    checks = check_rows()
    write_csv(tmp / "crossover.csv", GRID_COLUMNS, grid)
    write_csv(tmp / "boundary.csv", BOUNDARY_COLUMNS, bounds)
    write_csv(tmp / "check.csv", CHECK_COLUMNS, checks)
    _figure(tmp, BETA)
    report = _report(grid, bounds, checks)
    (tmp / "report.md").write_text(report)
    return publish(tmp, out), report
