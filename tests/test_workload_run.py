"""``sparsim run`` on a scenario naming a real model: metrics with the compute / exposed-communication split,
a Chrome trace whose slices sum to the metrics, the summary, and bad input -> one line, exit code 2."""
from __future__ import annotations

import csv
import json

import pytest
from click.testing import CliRunner

from experiments.cli import main
from sim.algorithms import AlgorithmSpec
from sim.machine.compute import ComputeModel
from sim.machine.network import get_preset
from sim.engine.timing import simulate_timing
from sim.workloads.devices import get_device
from sim.workloads.zoo import get_model

RESNET20 = ["--set", 'workload.model="resnet20-cifar"', "--set", "training.iterations=3", "--set", "cluster.P=4",
            "--quiet"]


def _run(args):
    return CliRunner().invoke(main, args)


def test_zoo_run_writes_metrics_trace_and_summary(tmp_path):
    out = tmp_path / "r"
    r = _run(["run", "--out", str(out), *RESNET20, "--set", "workload.trace_iterations=[1, 3]",
              "--set", "workload.trace_ranks=2"])
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert {x["algorithm"] for x in rows} == {"dense", "topk", "gtopk"} and len(rows) == 9
    # Closed forms of the default scenario (1GbE, P = 4, batch 16 on the P102-100, density 0.01, update and merge
    # free, select 2.19e-10 s per x log2 x), from the zoo's layer times and sim.comm.costs, not from the timeline:
    # F, B = forward, backward; compute = F + B on every rank (no jitter), every iteration alike.
    import math

    from sim.comm.costs import gtopk_tree_time, ring_allreduce_time, topk_allgather_time
    from sim.engine.timeline import ddp_buckets

    wl = get_model("resnet20-cifar")
    fwd, bwd = wl.layer_times(16, get_device("P102-100"))
    F, B, d, P = float(fwd.sum()), float(bwd.sum()), wl.d, 4
    k = round(0.01 * d)
    alpha, beta = get_preset("1GbE").end_to_end_alpha_beta()
    sel = 2.19e-10 * d * math.log2(d)
    # sparse_policy = "model": compute, then one selection over d, then the whole-model collective, no overlap
    coll = {"topk": topk_allgather_time(P, k, alpha, beta), "gtopk": gtopk_tree_time(P, k, alpha, beta)}
    want = {a: (F + B + sel + c, sel, c) for a, c in coll.items()}  # (iter_time_s, compress_s, comm_s)
    # dense_policy = "ddp": DDP's buckets (25 MiB cap, 1 MiB first bucket; ddp_buckets is tested equal to torch's
    # in tests/test_timeline.py) in launch order, each ring-allreduced once the backward of its first layer l is
    # done (F + backward of layers l..L-1) and the previous bucket's allreduce is over; update, then the end
    li = wl.layer_index()
    free = comm = 0.0
    for bk in ddp_buckets(wl):
        first_layer = min(li[wl.tensors[i].layer] for i in bk.tensors)
        ready = F + float(bwd[first_layer:].sum())
        dur = ring_allreduce_time(P, bk.numel, alpha, beta)
        free, comm = max(ready, free) + dur, comm + dur
    want["dense"] = (max(F + B, free), 0.0, comm)
    assert want["dense"][0] > F + B  # on 1GbE the last bucket's allreduce is exposed
    for x in rows:
        it, compress, comm_ = want[x["algorithm"]]
        assert float(x["iter_time_s"]) == pytest.approx(it, rel=1e-12), x["algorithm"]
        assert float(x["compute_s"]) == pytest.approx(F + B, rel=1e-12)
        assert float(x["compress_s"]) == pytest.approx(compress, rel=1e-12)
        assert float(x["comm_s"]) == pytest.approx(comm_, rel=1e-12)
        assert float(x["exposed_comm_s"]) == pytest.approx(it - (F + B), rel=1e-12)
        assert 0.0 <= float(x["overlap_ratio"]) <= 1.0 and x["loss"] == ""
    s = json.loads((out / "summary.json").read_text())
    assert s["resolved"]["workload"]["parameters"] == get_model("resnet20-cifar").d
    assert s["totals"]["dense"]["speedup_over_dense"] == 1.0
    trace = json.loads((out / "trace.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(procs.values()) == sorted(f"{a} rank {r_}" for a in ("dense", "topk", "gtopk") for r_ in (0, 1))
    for alg in ("dense", "topk", "gtopk"):
        pid = [p for p, n in procs.items() if n == f"{alg} rank 0"][0]
        for it in (1, 3):
            row = [x for x in rows if x["algorithm"] == alg and int(x["iteration"]) == it][0]
            comp = sum(e["dur"] for e in slices if e["pid"] == pid and e["tid"] == 0 and e["args"]["iteration"] == it)
            coll = sum(e["dur"] for e in slices if e["pid"] == pid and e["tid"] == 1 and e["args"]["iteration"] == it
                       and not e["name"].startswith("select"))
            assert comp / 1e6 == pytest.approx(float(row["compute_s"]), rel=1e-9)
            assert coll / 1e6 == pytest.approx(float(row["comm_s"]), rel=1e-9)
    assert (out / "figure.png").stat().st_size > 0 and not (tmp_path / "r.partial").exists()


def test_no_overlap_run_equals_timing_only_model(tmp_path):
    """dense_policy = none and sparse_policy = model are today's non-overlapped model: compute, then select,
    then the collective, then update -- simulate_timing with forward_backward_s = the zoo's compute."""
    out = tmp_path / "r"
    r = _run(["run", "--out", str(out), *RESNET20, "--set", 'workload.dense_policy="none"',
              "--set", "compression.density=0.01"])
    assert r.exit_code == 0, r.output
    wl, dev = get_model("resnet20-cifar"), get_device("P102-100")
    f, b = wl.layer_times(16, dev)
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    k = round(0.01 * wl.d)
    for spec in (AlgorithmSpec("dense"), AlgorithmSpec("gtopk", k=k), AlgorithmSpec("topk", k=k)):
        ref = simulate_timing(spec, 4, wl.d, network=get_preset("1GbE"),
                              compute=ComputeModel(forward_backward_s=float(f.sum() + b.sum())))
        row = [x for x in rows if x["algorithm"] == spec.name][0]
        assert float(row["iter_time_s"]) == pytest.approx(ref.iter_s[0], rel=1e-12)
        # bytes_sent means what it means in a numerics run: wire bytes per worker (mean over workers)
        assert float(row["bytes_sent"]) == pytest.approx(ref.bytes / 4, rel=1e-12)
        if spec.name == "dense":  # ring: every chunk crosses P - 1 links twice
            assert float(row["bytes_sent"]) == pytest.approx(2 * 3 / 4 * 4 * wl.d, rel=1e-12)


def test_layer_table_run(tmp_path):
    table = tmp_path / "m.csv"
    table.write_text("layer,tensor,numel,forward_flops,backward_flops\n"
                     "fc1,fc1.weight,100000,2e8,4e8\nfc1,fc1.bias,100,0,0\nact,,0,1e6,1e6\n"
                     "fc2,fc2.weight,50000,1e8,2e8\n")
    out = tmp_path / "r"
    r = _run(["run", "--out", str(out), "--set", f'workload.table="{table}"', "--set", "training.iterations=2",
              "--quiet", "--set", 'workload.sparse_policy="layer"', "--set", "compression.density=0.01"])
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["resolved"]["workload"]["parameters"] == 150_100
    assert s["totals"]["gtopk"]["bucket_k"] == [500, 1001]  # per layer: round(0.01 x 50000), round(0.01 x 100100)


@pytest.mark.parametrize("args,msg", [
    (["--set", 'workload.model="resnet51"'], "resnet51"),
    (["--set", 'workload.model="resnet50"', "--set", "workload.bucket_cap_mb=0"], "bucket_cap_mb = 0"),
    (["--set", 'workload.model="resnet50"', "--set", 'workload.device="K80"'], "K80"),
    (["--set", 'workload.model="resnet50"', "--set", "workload.trace_iterations=[5]"], "trace_iterations"),
    (["--set", 'workload.model="resnet50"', "--set", "data.lam=0.1"], "data.lam"),
    (["--set", 'workload.dense_policy="horovod"'], "used only with workload.model"),
    (["--set", 'workload.model="resnet50"', "--backend", "torch"], "valid --backend sim"),
])
def test_bad_workload_input(tmp_path, args, msg):
    out = tmp_path / "r"
    r = _run(["run", "--out", str(out), "--quiet", "--set", "training.iterations=2", *args])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and msg in line and "Traceback" not in line
    assert not out.exists() and not (tmp_path / "r.partial").exists()


@pytest.mark.parametrize("text,msg", [
    ("layer,tensor,numel,forward_flops,backward_flops\nfc,fc.w,-5,1,1\n", "-5"),
    ("layer,tensor,forward_flops,backward_flops\nfc,fc.w,1,1\n", "numel"),
])
def test_bad_layer_table(tmp_path, text, msg):
    table = tmp_path / "bad.csv"
    table.write_text(text)
    out = tmp_path / "r"
    r = _run(["run", "--out", str(out), "--quiet", "--set", f'workload.table="{table}"', "--set", "training.iterations=2"])
    assert r.exit_code == 2, r.output
    assert "\n" not in r.output.strip() and msg in r.output and str(table) in r.output
    assert not out.exists()


def test_workload_list_and_show(tmp_path):
    from sim.engine.timeline import TimelinePolicy, ddp_buckets
    from sim.workloads import ZOO_MODELS, load_layer_table

    r = _run(["workload", "list"])
    assert r.exit_code == 0
    for name in ZOO_MODELS:
        assert name in r.output and f"{get_model(name).d:,}" in r.output
    out = tmp_path / "r50.csv"
    r = _run(["workload", "show", "resnet50", "--bucket-cap-mb", "5", "--export", str(out)])
    assert r.exit_code == 0, r.output
    bs = ddp_buckets(get_model("resnet50"), TimelinePolicy(bucket_cap_mb=5))
    lines = [ln for ln in r.output.splitlines() if "elements" in ln]
    assert len(lines) == len(bs) and f"{bs[0].numel:,} elements" in lines[0]
    back = load_layer_table(out)
    assert back.d == 25_557_032 and [t.numel for t in back.tensors] == [t.numel for t in get_model("resnet50").tensors]
    r = _run(["workload", "show", str(out)])
    assert r.exit_code == 0 and "d = 25,557,032" in r.output
    r = _run(["workload", "show", "resnet51"])
    assert r.exit_code == 2 and "resnet51" in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("args,msg", [
    (["--set", 'workload.model="resnet50"', "--set", "workload.fusion_threshold_mb=64"], "dense_policy = 'horovod'"),
    (["--set", 'workload.model="resnet50"', "--set", 'workload.dense_policy="none"', "--set", "workload.bucket_cap_mb=5"],
     "DDP buckets"),
    (["--set", 'workload.model="resnet50"', "--set", 'algorithms=["topk"]', "--set", 'workload.dense_policy="horovod"'],
     "dense among the algorithms"),
    (["--set", 'workload.model="resnet50"', "--set", 'algorithms=["dense"]', "--set", 'workload.sparse_policy="layer"'],
     "a sparse algorithm"),
    (["--set", 'workload.model="resnet50"', "--set", 'workload.dense_policy="horovod"',
      "--set", "workload.hook_blocks_backward=true"], "does not apply to dense_policy = 'horovod'"),
])
def test_workload_keys_a_run_would_ignore_are_errors(tmp_path, args, msg):
    out = tmp_path / "r"
    r = _run(["run", "--out", str(out), "--quiet", "--set", "training.iterations=2", *args])
    assert r.exit_code == 2 and msg in r.output and len(r.output.strip().splitlines()) == 1
    assert not out.exists()


def test_measured_table_refuses_a_device_and_huge_or_string_numbers(tmp_path):
    measured = tmp_path / "m.csv"
    measured.write_text("# measured_batch = 8\nlayer,tensor,numel,forward_s,backward_s\nfc,fc.w,100,0.001,0.002\n")
    r = _run(["run", "--out", str(tmp_path / "a"), "--quiet", "--set", f'workload.table="{measured}"',
              "--set", 'workload.device="H100"'])
    assert r.exit_code == 2 and "measured seconds" in r.output
    huge = tmp_path / "h.csv"
    huge.write_text("layer,tensor,numel,forward_flops,backward_flops\nfc,fc.w,99999999999999999999,1,1\n")
    r = _run(["run", "--out", str(tmp_path / "b"), "--quiet", "--set", f'workload.table="{huge}"'])
    assert r.exit_code == 2 and "numel = '99999999999999999999' is out of range" in r.output
    toml = tmp_path / "s.toml"
    toml.write_text('[[layer]]\nname = "fc"\nforward_flops = 1.0\nbackward_flops = 2.0\n'
                    'tensors = [{name = "fc.w", numel = "5"}]\n')
    r = _run(["run", "--out", str(tmp_path / "c"), "--quiet", "--set", f'workload.table="{toml}"'])
    assert r.exit_code == 2 and "numel = '5'" in r.output


def test_blocking_hook_key_is_the_timeline_option(tmp_path):
    out = tmp_path / "r"
    r = _run(["run", "--out", str(out), *RESNET20, "--set", 'workload.sparse_policy="bucket"',
              "--set", "workload.hook_blocks_backward=true", "--set", 'algorithms=["gtopk"]'])
    assert r.exit_code == 0, r.output
    row = list(csv.DictReader(open(out / "metrics.csv")))[0]
    # a blocking hook hides nothing: the iteration is compute + every selection + every collective
    assert float(row["iter_time_s"]) == pytest.approx(
        float(row["compute_s"]) + float(row["compress_s"]) + float(row["comm_s"]), rel=1e-12)


def test_a_huge_workload_run_needs_yes(tmp_path):
    r = _run(["run", "--out", str(tmp_path / "r"), "--quiet", "--set", 'workload.model="resnet20-cifar"',
              "--set", "training.iterations=10000000"])
    assert r.exit_code == 2 and "30000000 metrics rows" in r.output and "--yes" in r.output
    assert not (tmp_path / "r").exists()
