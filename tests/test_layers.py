"""The layer contract of docs/design.md, checked: import-linter's contracts in pyproject.toml (``lint-imports``), no
import circle among the modules of sim/, theory/ and experiments/ (lazy imports inside functions included), and no
private name crossing a module boundary.

Without import-linter (the ``lint`` extra) the tests skip, except under CI=true, where they fail: CI installs it.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sim", "theory", "experiments")


def _need(module: str):
    try:
        return __import__(module)
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{module} is not installed: CI installs the lint extra (pip install -e '.[lint]')")
        pytest.skip(f"{module} is not installed (pip install -e '.[lint]')")


def test_import_linter_contracts_are_kept():
    _need("importlinter")
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "lint-imports is not on PATH"
    proc = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def _cycles(graph, modules) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]
    succ = {m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i in modules) for m in modules}
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter[0]
                counter[0] += 1
                stack.append(v)
                on.add(v)
            if i < len(succ[v]):
                work.append((v, i + 1))
                w = succ[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
    return out


def test_no_import_circle():
    grimp = _need("grimp")
    graph = grimp.build_graph(*PACKAGES)
    cycles = _cycles(graph, set(graph.modules))  # packages' __init__ modules included
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def _private_imports() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            mod = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            for node in ast.walk(ast.parse(f.read_text())):
                if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                        and node.module.split(".")[0] in PACKAGES):
                    continue
                out += [f"{mod}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
                parts = node.module.split(".")
                for i, part in enumerate(parts):
                    owner = ".".join(parts[:i])
                    if part.startswith("_") and not part.startswith("__") and not mod.startswith(owner + "."):
                        out.append(f"{mod}:{node.lineno} imports the private module {node.module}")
    return out


def test_no_private_name_crosses_a_module():
    """``from a.b import _x`` never appears in sim/, theory/ or experiments/; a private module (``_topk_numba``)
    is imported only from inside its own package."""
    assert _private_imports() == []


def test_the_private_name_rule_can_fail(tmp_path, monkeypatch):
    """The scanner sees a violation when there is one (a stand-in tree with one bad import)."""
    fake = tmp_path / "sim" / "engine"
    fake.mkdir(parents=True)
    (fake / "x.py").write_text("from sim.comm.collectives import _secret\nfrom sim.comm._kern import f\n")
    for pkg in ("theory", "experiments"):
        (tmp_path / pkg).mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    got = _private_imports()
    assert got == ["sim.engine.x:1 imports sim.comm.collectives._secret",
                   "sim.engine.x:2 imports the private module sim.comm._kern"]


def test_cycle_finder_finds_a_cycle():
    class G:
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

        def find_modules_directly_imported_by(self, m):
            return self.edges.get(m, set())

    assert _cycles(G(), {"a", "b", "c", "d"}) == [["a", "b", "c"]]
