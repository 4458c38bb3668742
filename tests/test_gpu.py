"""The NCCL path (GPU machines only) and the GPU check script (dry run on the CPU everywhere).

Without a CUDA GPU the NCCL tests are skipped, saying why; ``benchmarks/gpu_check.py`` is the prepared
script for a GPU machine. Its CPU dry run here checks that it runs end to end and writes what it
promises (selection times, per-iteration times for every algorithm), so the script a GPU session gets
is one that works.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]' (torch==2.13.0)")

from sim.algorithms import AlgorithmSpec  # noqa: E402
from sim.workloads.data import shard_indices  # noqa: E402
from sim.workloads.objectives import make_objective  # noqa: E402
from sim.engine.runner import Workers, run_algorithm  # noqa: E402
from sim.distributed.backend import launch_local, run_worker  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
N_GPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
NO_GPU = "no CUDA GPU visible: the NCCL path runs only on a GPU machine (see benchmarks/gpu_check.py)"


def _script(*args):
    """Run benchmarks/gpu_check.py as a user would (a subprocess: its ranks import it as __main__)."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args], capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)


def test_gpu_check_dry_run_on_cpu(tmp_path):
    r = _script("--device", "cpu", "--d", "3000", "--density", "0.001", "--iters", "2", "--repeats", "2",
                "--P", "2", "--out", str(tmp_path), "--timeout", "60")
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    (s,) = res["select"]
    assert s["d"] == 3000 and s["k"] == 3 and s["torch_topk_s"] > 0 and s["numpy_topk_s"] > 0
    assert s["torch_select_coeff_s"] == pytest.approx(s["torch_topk_s"] / (3000 * np.log2(3000)))
    rows = {r["algorithm"]: r for r in res["iterations"]}
    assert set(rows) == {"dense_ring", "dense_allreduce", "topk", "gtopk_tree"}
    for row in rows.values():
        assert row["P"] == 2 and row["comm_s"] > 0 and row["compute_s"] > 0 and row["iter_time_s"] > 0
    assert "| 3000 | 3 |" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.skipif(N_GPU > 0, reason="a GPU is visible: the refusal is for machines without one")
def test_gpu_check_without_gpu_says_so_in_one_line(tmp_path):
    r = _script("--out", str(tmp_path / "x"))
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "no CUDA GPU is visible" in err[0], r.stderr
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------ NCCL (GPU only)


def lr_const(t):
    return 0.2


def _workers(P):
    obj = make_objective("sines", d=40, n=16, seed=2)
    return Workers(obj, shard_indices(obj.n, P, seed=2), 4, 2), obj.x0(2)


def nccl_job(ctx, P):
    w, x0 = _workers(P)
    out = []
    for spec, fast in [(AlgorithmSpec("dense", collective="ring"), False), (AlgorithmSpec("dense", collective="ring"), True),
                       (AlgorithmSpec("topk", k=4), False), (AlgorithmSpec("gtopk", k=4, collective="tree"), False)]:
        if fast and P > 1:
            continue  # the backend's all_reduce sums in another order: not bit-identical beyond P = 1
        r = run_worker(ctx.rank, ctx.P, spec, w, T=3, lr=lr_const, x0=x0, transport=ctx.transport,
                       backend_allreduce=fast)
        out.append((spec, r.v))
    assert ctx.device.startswith("cuda")
    return out


@pytest.mark.skipif(N_GPU < 1, reason=NO_GPU)
def test_nccl_single_rank_matches_the_simulator():
    (res,) = launch_local(1, nccl_job, (1,), timeout_s=120, backend="nccl")
    w, x0 = _workers(1)
    for spec, v in res:
        rows_v = []
        run_algorithm(spec, w, T=3, lr=lr_const, x0=x0, driver="lockstep", on_step=lambda t, outs: rows_v.append(outs[0].v))
        assert np.array_equal(v, rows_v[-1])


@pytest.mark.skipif(N_GPU < 2, reason=f"NCCL needs one GPU per rank and {N_GPU} is visible" if N_GPU else NO_GPU)
def test_nccl_two_ranks_bit_identical_to_the_simulator():
    res = launch_local(2, nccl_job, (2,), timeout_s=120, backend="nccl")
    w, x0 = _workers(2)
    for i, (spec, v) in enumerate(res[0]):
        rows_v = []
        run_algorithm(spec, w, T=3, lr=lr_const, x0=x0, driver="lockstep", on_step=lambda t, outs: rows_v.append(outs[0].v))
        assert np.array_equal(v, rows_v[-1]) and np.array_equal(res[1][i][1], v)
