"""experiments/ddp_example.py: bad options give one line and exit code 2, before any process starts."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]' (torch==2.13.0)")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("args, says", [
    (["--algorithm", "foo"], "invalid choice: 'foo'"),
    (["--density", "0"], "--density = 0.0 is out of range: valid in (0, 1]"),
    (["--density", "1.5"], "--density = 1.5 is out of range: valid in (0, 1]"),
    (["--nproc", "0"], "--nproc = 0 is out of range: valid >= 1"),
    (["--algorithm", "randk", "--scope", "model", "--density", "abc"], "invalid float value: 'abc'"),
])
def test_bad_options_one_line_exit_2(args, says):
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "ddp_example.py"), *args], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], r.stderr


def test_without_torch_one_line_exit_2():
    """Where torch is missing (an optional extra), one line naming the extra, not a traceback."""
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['ddp_example.py', '--iters', '1']; "
            f"runpy.run_path({str(ROOT / 'experiments' / 'ddp_example.py')!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: experiments/ddp_example.py needs PyTorch: pip install -e '.[torch]'")
