"""A SIGKILLed ``sparsim run --backend torch`` leaves no rank process training (#23: they used to run on at 30-50 %
CPU two minutes later). The ranks ask Linux to kill them with their launcher (PR_SET_PDEATHSIG,
sim.base.process.die_with_parent), as the simulator's worker pool already did."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]' (torch==2.13.0)")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _ranks(parent: psutil.Process) -> list[psutil.Process]:
    try:
        return [c for c in parent.children(recursive=True) if "spawn" in " ".join(c.cmdline())]
    except psutil.NoSuchProcess:
        return []


def test_sigkill_of_a_torch_run_takes_its_ranks_with_it(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.cli", "run", "--backend", "torch", "--out", str(tmp_path / "r"),
         "--set", "training.iterations=1000000", "--set", "cluster.P=2", "--set", "algorithms=[\"dense\"]",
         "--yes"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    parent = psutil.Process(proc.pid)
    ranks: list[psutil.Process] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(ranks) < 2 and proc.poll() is None:
        time.sleep(0.5)
        ranks = _ranks(parent)
    try:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert len(ranks) == 2, f"expected 2 rank processes, found {len(ranks)}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        gone, alive = psutil.wait_procs(ranks, timeout=20)
        assert not alive, f"rank processes still alive 20 s after the launcher's SIGKILL: {[p.pid for p in alive]}"
    finally:
        for p in _ranks(parent) + ranks:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if proc.poll() is None:
            proc.kill()
