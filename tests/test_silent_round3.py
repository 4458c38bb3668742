"""Issue #23, third round: what a reviewer still broke after the second round (each test fails on the code before it).

Items: check on a layer-wise run without compression, the eta note's c, the k_b rule in the key table, a layer
table's compute per step, --set errors blamed on the wrong source, --out too long, a disk that fills during the
figure, a tiny torch --timeout, predict --calibration without the network, a SIGINT as the process exits,
``cluster = 5``, --jobs without a cap."""
from __future__ import annotations

import csv
import errno
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]


def _cli(args):
    from experiments.cli import main

    return CliRunner().invoke(main, args)


def _one_error_line(r) -> str:
    """The run failed with exit 2 and one line ``error: ...`` (no traceback); return it."""
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output
    return lines[0]


# --- item 1 and 2: check on layer-wise runs ---------------------------------------------------------------------

def _selected(out: Path) -> list[float]:
    with open(out / "metrics.csv") as fh:
        return [float(r["selected_per_worker"]) for r in csv.DictReader(fh) if int(r["iteration"]) >= 1]


def test_check_of_a_layerwise_run_where_every_segment_sends_everything_is_a_note_not_an_error(tmp_path):
    """640 segments of 1: every k_b = d_b = 1, gamma = 0 (no compression). check said "c = 1.0 is out of range";
    now a note says there is nothing to check for the compression bounds, and the measured selection (exact zeros
    are never selected: below 640) is reported beside the nominal 640, in check and in the run's header."""
    from experiments.check import check_run

    out = tmp_path / "o1b"
    r = _cli(["run", "--out", str(out), "--set", "training.iterations=2", "--algorithms", "topk",
              "--set", "compression.layer_sizes=[" + ",".join(["1"] * 640) + "]"])
    assert r.exit_code == 0, r.output
    sel = _selected(out)
    assert len(sel) == 2 and max(sel) < 640  # the run selected fewer than the nominal sum of k_b
    rep = check_run(out, write=False)
    assert rep.verdicts == [] or all("Theorem" not in v.check for v in rep.verdicts)
    assert any(n.startswith("gamma = 0: every segment selects all its entries (k_b = d_b)") and
               "nothing to check for the compression bounds" in n for n in rep.notes), rep.notes
    m = next(n for n in rep.notes if n.startswith("topk[layerwise]: selected per worker per step, measured"))
    assert (f"mean {sum(sel) / len(sel):.6g}, min {min(sel):.6g}, max {max(sel):.6g} over 2 steps; nominal 640 "
            "(the bounds use the nominal k)") in m
    assert "nominal 640 selected per worker over 640 segments" in r.output
    assert (f"selected per worker per step, measured (nominal 640; exact zeros are never selected): topk[layerwise] "
            f"mean {sum(sel) / len(sel):.6g}, min {min(sel):.6g}, max {max(sel):.6g}") in r.output
    r2 = _cli(["check", str(out)])
    assert r2.exit_code == 0, r2.output
    import json
    tot = json.loads((out / "summary.json").read_text())["totals"]["topk[layerwise]"]
    assert tot["selected_per_worker"] == {"mean": sum(sel) / len(sel), "min": min(sel), "max": max(sel), "steps": 2}


def test_check_eta_note_names_the_c_it_used(tmp_path):
    """64 segments of 10 (k = 6 of d = 640): gamma and eta are at the worst segment's c = 10 / 1; the note said
    "minimises ... at c = 106.667" (d / k) while eta was computed at c = 10."""
    from experiments.check import check_run
    from theory.bounds import optimal_eta

    out = tmp_path / "ls"
    r = _cli(["run", "--out", str(out), "--set", "training.iterations=2", "--algorithms", "topk",
              "--set", "compression.layer_sizes=[" + ",".join(["10"] * 64) + "]"])
    assert r.exit_code == 0, r.output
    rep = check_run(out, write=False)
    note = next(n for n in rep.notes if n.startswith("eta = "))
    assert note.startswith(f"eta = {optimal_eta(10.0).value:.6g} (minimises tau/(eta(1-tau)) at c = 10, the worst "
                           "segment's d_b/k_b = 10/1)"), note
    assert "106.667" not in note


# --- item 3: the k_b rule in the key table -------------------------------------------------------------------------

def test_layer_sizes_key_says_at_least_one_per_segment():
    from experiments.scenario import scenario_keys

    row = next(r for r in scenario_keys() if r[0] == "compression.layer_sizes")
    assert "k_b = min(d_b, max(1, round(k/d x d_b)))" in row[4]
    doc = (ROOT / "docs" / "scenarios.md").read_text()
    assert f"| `compression.layer_sizes` | list[int] | `[]` |  | {row[4]} |" in doc


# --- item 4: a layer table's compute per step -----------------------------------------------------------------------

def _table_run(tmp_path, table: str, batch: int | None = None):
    (tmp_path / "t.csv").write_text(table)
    sc = tmp_path / "s.toml"
    sc.write_text('[workload]\ntable = "t.csv"\n[training]\niterations = 2\n'
                  + (f"batch_size = {batch}\n" if batch else ""))
    return _cli(["run", str(sc), "--out", str(tmp_path / "o")])


def test_flop_table_whose_step_exceeds_the_hour_is_one_line(tmp_path):
    """Two layers of 1e18 FLOPs forward and backward (each within the per-layer limit): 1.49e7 s per step at batch
    16 on the P102-100 (4.308e12 FLOP/s); it ran (exit 0, speed-up 1.00x) with cells run together."""
    r = _table_run(tmp_path, "layer,tensor,numel,forward_flops,backward_flops\nl1,w,1000,1e18,1e18\n"
                             "l2,w2,2000,1e18,1e18\n")
    line = _one_error_line(r)
    total = 4e18 * 16 / (10.77e12 * 0.4)
    assert line == (f"error: workload.table = {str(tmp_path / 't.csv')!r}: workload 't': forward + backward = "
                    f"{total:.6g} s per step at batch 16 on P102-100 (4.308e+12 FLOP/s): valid <= 3600 s per step (the "
                    "limit of compute.forward_backward_s; smaller layer costs or batch)")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_measured_table_limit_is_per_step_at_the_runs_batch(tmp_path):
    """3600 s in each cell at measured_batch 32: 7200 s per step at batch 32 (an error), 3600 s at batch 16 (the
    limit itself, as compute.forward_backward_s = 3600 is valid)."""
    table = "# measured_batch = 32\nlayer,tensor,numel,forward_s,backward_s\nl1,w,1000,3600,3600\n"
    line = _one_error_line(_table_run(tmp_path, table, batch=32))
    assert "forward + backward = 7200 s per step at batch 32 (measured at 32): valid <= 3600 s per step" in line
    from sim.base.errors import ConfigError
    from sim.workloads.model import LayerCost, ParamTensor, Workload

    wl = Workload("w", (LayerCost("l1", forward_s=3600.0, backward_s=3600.0),), (ParamTensor("w", 10, "l1"),),
                  measured_batch=32)
    fwd, bwd = wl.layer_times(16)
    assert float(fwd.sum() + bwd.sum()) == 3600.0
    with pytest.raises(ConfigError, match=r"forward \+ backward = 3601.88 s per step at batch 17"):
        Workload("w", (LayerCost("l1", forward_s=3400.0, backward_s=3380.0),), (ParamTensor("w", 10, "l1"),),
                 measured_batch=32).layer_times(17)


def test_workload_table_columns_never_run_together(tmp_path):
    """1800 s of compute per step: 1800006.17 ms in a 10-wide column ran into the next cell (1800006.171800000.00)."""
    r = _table_run(tmp_path, "# measured_batch = 32\nlayer,tensor,numel,forward_s,backward_s\nl1,w,1000,1800,1800\n")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    i = next(j for j, ln in enumerate(lines) if ln.startswith("algorithm "))
    head = lines[i].split("(")[0].split()
    assert head == ["algorithm", "iter", "ms", "compute", "exposed", "comm", "select", "overlap", "speedup", "ops"]
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    for ln in lines[i + 1:]:
        cells = ln.split()
        assert len(cells) == 9, ln
        t = summary["totals"][cells[0]]
        assert float(cells[1]) == round(1e3 * t["mean_iter_time_s"], 2)
        assert float(cells[2]) == round(1e3 * t["mean_compute_s"], 2) == 1800000.0


# --- item 5: --set errors blamed on the source that gave the key ----------------------------------------------------

@pytest.mark.parametrize("args, prefix", [
    (["--set", "compute.jitter_scale=2", "--set", "compute.forward_backward_s=0.01"],
     "error: --set compute.jitter_scale=2: compute.jitter_scale = 2: unused with jitter = 'none'"),
    (["--set", "training.schedule=\"corollary2\"", "--set", "training.lr=0.1", "--set", "training.iterations=3"],
     "error: --set training.lr=0.1: training.lr: unused by schedule = 'corollary2'"),
    (["--set", "cluster.alpha_s=1e-3", "--set", "cluster.P=4"],
     "error: --set cluster.alpha_s=1e-3: cluster.alpha_s: used only with network = 'custom' or 'hierarchical'"),
    (["--algorithms", "powersgd", "--set", "algorithm.powersgd.rank=0", "--set", "training.iterations=2"],
     "error: --set algorithm.powersgd.rank=0: powersgd.rank = 0 is out of range: valid 1 <= powersgd.rank"),
    (["--algorithms", "dgc", "--set", "algorithm.dgc.sample_ratio=5"],
     "error: --set algorithm.dgc.sample_ratio=5: dgc.sample_ratio = 5 is out of range"),
    (["--algorithms", "dgc", "--set", "algorithm.dgc.bogus=1"],
     "error: --set algorithm.dgc.bogus=1: algorithm.dgc.bogus is unknown: valid keys are collective,"),
    (["--algorithms", "foo"], "error: --algorithms foo: algorithms = ['foo']: algorithm = 'foo' is unknown"),
    (["--backend", "torch", "--timeout", "0"],
     "error: --timeout 0: torch.timeout_s = 0.0 is out of range: valid 0 < timeout_s <= 604_800"),
])
def test_set_error_names_the_override_or_option_that_gave_the_key(tmp_path, args, prefix):
    line = _one_error_line(_cli(["run", *args, "--out", str(tmp_path / "x")]))
    assert line.startswith(prefix), line


def test_file_key_refused_by_a_table_rule_blames_the_file_not_another_set(tmp_path):
    """training.lr comes from the file; --set training.iterations=3 only shares its table."""
    f = tmp_path / "c2.toml"
    f.write_text('[training]\nschedule = "corollary2"\nlr = 0.1\n')
    line = _one_error_line(_cli(["run", str(f), "--set", "training.iterations=3", "--out", str(tmp_path / "x")]))
    assert line.startswith(f"error: {f}: training.lr: unused by schedule = 'corollary2'"), line


def test_table_rule_naming_no_key_blames_every_set_of_the_table():
    from experiments.scenario import _named_keys

    assert _named_keys("Value error, compute.jitter_scale = 2: unused", "compute") == {"compute.jitter_scale"}
    assert _named_keys("jitter_scale = 2: unused", "compute") == {"compute.jitter_scale", "jitter_scale"}
    assert _named_keys("a.b = 1, c.d: why", "") == {"a.b", "c.d"}


# --- item 6: --out too long for the file system -------------------------------------------------------------------

def test_out_name_over_255_bytes_is_one_line_before_the_run(tmp_path):
    r = _cli(["run", "--set", "training.iterations=2", "--out", str(tmp_path / ("c" * 256))])
    line = _one_error_line(r)
    assert "its last name is 256 bytes: valid at most 247 bytes (the file system's 255, less 8 for '.partial')" in line


def test_out_over_path_max_is_one_line_before_the_run(tmp_path):
    out = tmp_path / "/".join(["d" * 200] * 25)
    line = _one_error_line(_cli(["run", "--set", "training.iterations=2", "--out", str(out)]))
    n = len(os.fsencode(str(out)))
    assert f"its absolute path is {n} bytes ({n + 8} with '.partial'): valid fewer than 4096 bytes" in line


def test_calibrate_out_in_a_folder_name_over_255_bytes_is_one_line(tmp_path):
    pytest.importorskip("torch")
    r = _cli(["calibrate", "--out", str(tmp_path / ("c" * 256) / "x.toml")])
    line = _one_error_line(r)
    assert "is 256 bytes: valid at most 255 bytes (the file system's 255)" in line


# --- item 7: a disk that fills while the figure is written ----------------------------------------------------------

def _pdf_fails_like_a_full_disk(monkeypatch):
    """matplotlib's PDF backend on a full disk: its write raises ENOSPC, then its clean-up flushes a finished zlib
    stream and raises zlib.error, with the OSError as its __context__."""
    import matplotlib.figure

    real = matplotlib.figure.Figure.savefig

    def savefig(self, fname, *a, **kw):
        if str(fname).endswith(".pdf"):
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise zlib.error("Error -2 while flushing: inconsistent stream state")  # noqa: B904
        return real(self, fname, *a, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)


def test_full_disk_during_the_pdf_is_the_write_error_and_leaves_nothing(tmp_path, monkeypatch):
    _pdf_fails_like_a_full_disk(monkeypatch)
    out = tmp_path / "run"
    line = _one_error_line(_cli(["run", "--set", "training.iterations=2", "--out", str(out)]))
    assert line == (f"error: cannot write {out}.partial/figure.pdf: No space left on device (nothing was published: "
                    "free space or choose another --out)")
    assert list(tmp_path.iterdir()) == []


def test_save_figure_reraises_an_error_without_a_write_error_under_it(tmp_path):
    from experiments.outdir import save_figure

    class Fig:
        def get_layout_engine(self):
            return None

        def savefig(self, path, **kw):
            raise zlib.error("Error -2 while flushing")

    with pytest.raises(zlib.error):
        save_figure(Fig(), tmp_path, "f")


# --- item 8: a torch timeout too small to connect the ranks ---------------------------------------------------------

def test_local_torch_run_with_a_tiny_timeout_says_it_is_too_small(tmp_path):
    """--timeout 0.01 showed the raw c10d errors (DistStoreError: wait timeout after 10ms ... Connect timeout); 10 ms
    is sometimes enough on an idle machine, so the run uses 1 us, which no store connection meets (its client times
    out "after 0ms"); the line is the one the torchrun entry point gives."""
    pytest.importorskip("torch")
    r = _cli(["run", "--backend", "torch", "--nproc", "2", "--set", "training.iterations=2", "--timeout", "1e-6",
              "--out", str(tmp_path / "x")])
    line = _one_error_line(r)
    assert line.startswith("error: torch backend failed: rank "), line
    assert "process group of P = 2 did not form" in line
    assert "--timeout / torch.timeout_s = 1e-06 s (too small to start and connect the ranks: raise it); valid 0 < " \
           "timeout_s <= 604_800 s, default 60" in line


def test_group_failed_line_for_the_store_timeout_of_a_10_ms_timeout():
    pytest.importorskip("torch")
    from sim.distributed.backend import group_failed

    err = RuntimeError("wait timeout after 10ms, keys: /0//cpu//0/1\nException raised from wait at ...")
    assert group_failed(0, "gloo", 2, err, 0.01) == (
        "rank 0: the gloo process group of P = 2 did not form (RuntimeError: wait timeout after 10ms, keys: "
        "/0//cpu//0/1); --timeout / torch.timeout_s = 0.01 s (too small to start and connect the ranks: raise it); "
        "valid 0 < timeout_s <= 604_800 s, default 60")


# --- item 9: predict --calibration without the network keys ---------------------------------------------------------

def test_predict_calibration_without_network_keys_names_them(tmp_path):
    cal = tmp_path / "cal.toml"
    cal.write_text("[cluster]\nP = 8\n")
    line = _one_error_line(_cli(["predict", "--calibration", str(cal), "--P", "8"]))
    assert line.startswith(f"error: --calibration {cal}: its [cluster] has no network, alpha_s, bandwidth_Bps (it "
                           "gives P), so it names no network"), line
    cal.write_text('[cluster]\nnetwork = "custom"\nalpha_s = 1e-5\n')
    line = _one_error_line(_cli(["predict", "--calibration", str(cal), "--P", "8"]))
    assert "its [cluster] has no bandwidth_Bps (it gives network, alpha_s)" in line
    cal.write_text('[cluster]\nnetwork = "custom"\nalpha_s = 1e-5\nbandwidth_Bps = 1e9\n')
    r = _cli(["predict", "--calibration", str(cal), "--P", "8", "--d", "1000"])
    assert r.exit_code == 0, r.output
    assert "alpha = 1e-05 s, beta = 1e-09 s/byte" in r.output


# --- item 10: a SIGINT as the process exits -------------------------------------------------------------------------

def test_sigint_while_the_process_exits_after_the_run_does_not_kill_it_by_the_signal(tmp_path):
    """Python restores SIGINT's default action while it shuts down: a Ctrl-C landing after "wrote DIR" killed the
    process (status -2, no message). Here a shell sends SIGINT every 2 ms from the moment the run's last atexit
    handler runs until the process is gone (at most 500 of them): the process must end by its own exit code (0: the run had finished,
    the directory is complete), never by the signal."""
    out = tmp_path / "run"
    script = (
        "import atexit, os, subprocess, sys\n"
        "pid = os.getpid()\n"
        "atexit.register(lambda: subprocess.Popen(['sh', '-c', f'for i in $(seq 500); do kill -INT {pid} || exit 0; "
        "sleep 0.002; done'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))\n"
        f"sys.argv = ['sparsim', 'run', '--quiet', '--set', 'training.iterations=2', '--out', {str(out)!r}]\n"
        "from experiments.cli import main\n"
        "main()\n")
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 130), (p.returncode, p.stderr[-2000:])
    if p.returncode == 130:
        assert p.stderr.strip().endswith(f"interrupted after {str(out)!r} was written (complete; it stays)")
    assert (out / "summary.json").is_file() and not (tmp_path / "run.partial").exists()


# --- item 11: a table given as a value ------------------------------------------------------------------------------

def test_table_given_a_value_says_it_must_be_a_table(tmp_path):
    f = tmp_path / "c5.toml"
    f.write_text("cluster = 5\n")
    line = _one_error_line(_cli(["run", str(f), "--out", str(tmp_path / "x")]))
    assert line == (f"error: {f}: cluster = 5: [cluster] must be a table of keys: valid keys P, network, topology, "
                    "alpha_s, bandwidth_Bps, quantum_s, gpus_per_node, nics_per_node, intra, intra_alpha_s, "
                    "intra_bandwidth_Bps, nodes_per_leaf, oversubscription, spine_alpha_s, engine")


# --- item 12: --jobs has a range ------------------------------------------------------------------------------------

def test_jobs_beyond_the_cap_is_out_of_range(tmp_path):
    line = _one_error_line(_cli(["run", "--jobs", "1000000", "--out", str(tmp_path / "x")]))
    assert line == ("error: --jobs 1000000 is out of range: valid 1 <= jobs <= 1024 (a run starts at most one process "
                    "per algorithm)")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("kv, line", [
    ("cluster.P=true", "cluster.P = True must be an integer: valid 1 <= P <= 65_536"),
    ("compression.density=true", "compression.density = True must be a number: valid 0 < density <= 1"),
])
def test_a_boolean_where_a_number_goes_names_the_range(tmp_path, kv, line):
    """Before: 'expected a number, got the boolean True' with no valid range (a fresh-clone review)."""
    r = _cli(["run", "--out", str(tmp_path / "b"), "--set", kv])
    assert r.exit_code == 2 and r.output.strip() == f"error: --set {kv}: {line}", r.output
