"""Selection, merge, reduction and update costs per device (issue 22, item 0): the memory model's closed form for
each preset, the P102-100 keeping the gTop-k papers' fit bit for bit, seconds == seconds_all with the per-element
selection, the scenario's explicit compute.*_coeff_s winning over the device, the summary naming the cost model,
and bad values as one-line errors."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.cli import main
from experiments.resolve import compute_costs, resolve_compute, resolve_device
from experiments.scenario import Scenario, load_scenario, used_keys_dump
from sim.base.errors import ConfigError
from sim.machine.compute import ComputeModel
from sim.workloads.devices import DEVICES, get_device
from sim.workloads.model import DeviceModel

R50_D = 25_557_032  # ResNet-50's parameters (torchvision)
R50 = ["workload.model='resnet50'", "training.iterations=1"]


# ------------------------------------------------------------------ the model's closed form per preset

@pytest.mark.parametrize("name, bw", [("V100", 900e9), ("A100", 1555e9), ("H100", 3.35e12)])
def test_memory_model_closed_form_per_preset(name, bw):
    """seconds per element = passes x 4 B / (datasheet bandwidth x 0.87): select 9 passes (measured on a CPU),
    merge 2 (4 + 4) / 4 + 9 = 13, reduce and update 3; the literals here, not the module's constants."""
    c = get_device(name).costs(4, 4)
    ach = bw * 0.87
    assert c["select"].coeff_s == 9.0 * 4 / ach and c["select"].scaling == "x"
    assert c["merge"].coeff_s == (2 * (4 + 4) / 4 + 9.0) * 4 / ach
    assert c["reduce"].coeff_s == 3.0 * 4 / ach and c["update"].coeff_s == 3.0 * 4 / ach
    assert c["select"].passes == 9.0 and c["merge"].passes == 13.0
    assert all(k.scaling == "x" and f"{bw:.3g} B/s" in k.model and "datasheet" in k.source for kind, k in c.items()
               if kind != "matmul")  # matmul: the FLOP model (tests/test_compression_costs.py)


def test_h100_selection_of_resnet50_is_a_third_of_a_millisecond_not_138_ms():
    """The issue's case: ResNet-50 (d = 25,557,032) on an H100: 9 x 102.2 MB / (0.87 x 3.35 TB/s) = 0.316 ms per
    whole-model selection, against the P102-100 fit's 0.1377 s."""
    sc = load_scenario(None, [*R50, "workload.device='H100'"])
    cm = resolve_compute(sc, resolve_device(sc))
    assert cm.select_scaling == "x"
    assert cm.seconds("select", R50_D, 0, 0) == pytest.approx(9.0 * 4 * R50_D / (3.35e12 * 0.87), rel=1e-15)
    assert cm.seconds("select", R50_D, 0, 0) == pytest.approx(3.157e-4, rel=1e-3)
    assert ComputeModel().seconds("select", R50_D, 0, 0) == pytest.approx(0.13773, rel=1e-4)


@pytest.mark.parametrize("vb, ib", [(2, 4), (4, 8), (8, 0)])
def test_bytes_per_value_and_index_enter_the_model(vb, ib):
    c = get_device("A100").costs(vb, ib)
    ach = 1555e9 * 0.87
    assert c["select"].coeff_s == 9.0 * vb / ach
    assert c["merge"].coeff_s == (2 * (vb + ib) / vb + 9.0) * vb / ach
    assert c["reduce"].coeff_s == 3.0 * vb / ach


# ------------------------------------------------------------------ the P102-100 unchanged

def test_p102_100_keeps_the_papers_fit_exactly():
    c = get_device("P102-100").costs(4, 4)
    assert (c["select"].coeff_s, c["select"].scaling) == (2.19e-10, "x log2 x")
    assert [c[k].coeff_s for k in ("merge", "reduce", "update")] == [0.0, 0.0, 0.0]
    assert "Shi et al., ICDCS 2019" in c["select"].source
    sc = load_scenario("experiments/scenarios/resnet50-1gbe.toml")
    cm = resolve_compute(sc, resolve_device(sc))
    # the compute model the workload run built before device costs existed: the scenario keys' old defaults
    assert cm == ComputeModel(seed=0, forward_backward_s=0.005, select_coeff_s=2.19e-10, merge_coeff_s=0.0,
                              reduce_coeff_s=0.0, update_coeff_s=0.0)
    assert cm.seconds("select", R50_D, 0, 0) == 2.19e-10 * R50_D * math.log2(R50_D)


def test_dumps_of_the_shipped_and_default_scenarios_keep_their_compute_keys():
    """run_id (metrics.csv) hashes the dump: the P102-100 workload scenario and the [data] default record the same
    cost keys as before (the values used, equal to the old defaults)."""
    want = {"jitter": "none", "jitter_scale": 0.0, "straggler_prob": 0.0, "straggler_factor": 1.0,
            "select_coeff_s": 2.19e-10, "merge_coeff_s": 0.0, "reduce_coeff_s": 0.0, "update_coeff_s": 0.0}
    assert used_keys_dump(load_scenario("experiments/scenarios/resnet50-1gbe.toml"))["compute"] == want
    assert used_keys_dump(load_scenario(None))["compute"] == {"forward_backward_s": 0.005, **want}


def test_a_data_run_without_device_takes_the_papers_model():
    sc = load_scenario(None)
    costs = compute_costs(sc, None)
    assert {k: (c["coeff_s"], c["from"]) for k, c in costs.items()} == {
        "select": (2.19e-10, "default"), "merge": (0.0, "default"), "reduce": (0.0, "default"), "update": (0.0, "default")}
    assert resolve_compute(sc, None) == ComputeModel(seed=0, forward_backward_s=0.005)


# ------------------------------------------------------------------ seconds == seconds_all, bit for bit

@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**10), min_size=1, max_size=40), st.sampled_from(sorted(DEVICES)),
       st.sampled_from(["select", "merge", "reduce", "update"]), st.integers(1, 8), st.integers(0, 8))
def test_seconds_all_equals_seconds_bit_for_bit_with_device_costs(work, dev, kind, vb, ib):
    sc = load_scenario(None, [*R50, f"workload.device='{dev}'", f"compression.value_bytes={vb}",
                              f"compression.index_bytes={ib}"])
    cm = resolve_compute(sc, resolve_device(sc))
    w = np.array(work, dtype=np.int64)
    got = cm.seconds_all(kind, w, len(work), 3)
    want = [cm.seconds(kind, int(x), r, 3) for r, x in enumerate(work)]
    if cm.select_scaling == "x log2 x" and kind == "select":  # numpy's log2 and math.log2 may differ in the last bit
        assert np.allclose(got, want, rtol=1e-15, atol=0)
    else:
        assert np.array_equal(np.asarray(got, dtype=np.float64), np.array(want, dtype=np.float64))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e12, allow_nan=False), min_size=1, max_size=30), st.floats(0, 1.0, allow_nan=False))
def test_linear_selection_seconds_all_equals_seconds(work, c):
    cm = ComputeModel(select_coeff_s=c, select_scaling="x")
    got = cm.seconds_all("select", np.array(work), len(work), 0)
    want = np.array([cm.seconds("select", x, r, 0) for r, x in enumerate(work)])
    assert np.array_equal(got, want)
    assert all(w == (0.0 if x <= 1 else c * x) for w, x in zip(want, work))


# ------------------------------------------------------------------ the scenario's keys win over the device

def test_explicit_select_coeff_overrides_the_device_and_is_kept_in_the_dump():
    sc = load_scenario(None, [*R50, "workload.device='H100'", "compute.select_coeff_s=2.19e-10"])
    costs = compute_costs(sc, resolve_device(sc))
    assert (costs["select"]["coeff_s"], costs["select"]["scaling"], costs["select"]["from"]) == (2.19e-10, "x log2 x",
                                                                                                 "scenario")
    assert costs["merge"]["from"] == "device" and costs["merge"]["coeff_s"] == 13.0 * 4 / (3.35e12 * 0.87)
    cm = resolve_compute(sc, resolve_device(sc))
    assert cm.select_scaling == "x log2 x" and cm.seconds("select", R50_D, 0, 0) == 2.19e-10 * R50_D * math.log2(R50_D)
    assert used_keys_dump(sc)["compute"]["select_coeff_s"] == 2.19e-10


@pytest.mark.parametrize("key, kind", [("merge_coeff_s", "merge"), ("reduce_coeff_s", "reduce"),
                                       ("update_coeff_s", "update")])
def test_explicit_per_element_keys_override_the_device(key, kind):
    sc = load_scenario(None, [*R50, "workload.device='V100'", f"compute.{key}=0.0"])
    costs = compute_costs(sc, resolve_device(sc))
    assert costs[kind] == {"coeff_s": 0.0, "scaling": "x", "model": "0 s x x", "source": f"compute.{key} (the scenario)",
                           "passes": None, "from": "scenario"}
    assert getattr(resolve_compute(sc, resolve_device(sc)), key) == 0.0
    assert costs["select"]["from"] == "device"


def test_the_dump_of_a_device_run_reloads_to_the_same_compute_model():
    """summary.json's scenario reloaded gives the same run: the per-element selection leaves select_coeff_s out
    (it has no x log2 x value), the other cost keys hold the device's values."""
    sc = load_scenario(None, [*R50, "workload.device='H100'"])
    dump = used_keys_dump(sc)
    assert "select_coeff_s" not in dump["compute"]
    assert dump["compute"]["reduce_coeff_s"] == 3.0 * 4 / (3.35e12 * 0.87)
    again = Scenario.model_validate(json.loads(json.dumps(dump)))
    assert resolve_compute(again, resolve_device(again)) == resolve_compute(sc, resolve_device(sc))


def test_a_device_without_bandwidth_needs_every_cost_from_the_scenario():
    dev = DeviceModel("flops-only", 1e12, 0.5)
    sc = load_scenario(None, [*R50])
    with pytest.raises(ConfigError, match=r"device 'flops-only' has no select_coeff_s and no mem_bandwidth_Bps"):
        compute_costs(sc, dev)
    full = load_scenario(None, [*R50, "compute.select_coeff_s=1e-12", "compute.merge_coeff_s=0.0",
                                "compute.reduce_coeff_s=0.0", "compute.update_coeff_s=0.0"])
    assert {c["from"] for c in compute_costs(full, dev).values()} == {"scenario"}


def test_a_measured_selection_replaces_the_memory_model():
    """gpu_check.py's torch_select_coeff_s (seconds per d log2 d) on a device, as its docstring says."""
    import dataclasses

    dev = dataclasses.replace(get_device("H100"), select_coeff_s=1.5e-13, cost_source="gpu_check.py on an H100")
    c = dev.costs()
    assert (c["select"].coeff_s, c["select"].scaling) == (1.5e-13, "x log2 x")
    assert c["select"].source == "H100, measured: gpu_check.py on an H100"
    assert c["reduce"].scaling == "x" and c["reduce"].passes == 3.0


# ------------------------------------------------------------------ bad values: one line

@pytest.mark.parametrize("kw, match", [
    ({"mem_bandwidth_Bps": -1.0}, r"mem_bandwidth_Bps of device 'x' = -1.0 is out of range: valid 0 < "),
    ({"mem_bandwidth_Bps": 0.0}, r"mem_bandwidth_Bps of device 'x' = 0.0 is out of range"),
    ({"mem_bandwidth_Bps": 1e16}, r"mem_bandwidth_Bps of device 'x' = 1e\+16 is out of range: valid 0 < .* <= 1000000000000000.0"),
    ({"mem_bandwidth_Bps": 1e12, "select_passes": 0.5}, r"select_passes of device 'x' = 0.5 is out of range: valid 1"),
    ({"mem_bandwidth_Bps": 1e12, "select_passes": 2000.0}, r"select_passes .* = 2000.0 is out of range: valid .*1000"),
    ({"mem_bandwidth_Bps": 1e12, "select_passes": float("nan")}, r"select_passes of device 'x' = nan"),
    ({"mem_bandwidth_Bps": 1e12, "mem_efficiency": 1.5}, r"mem_efficiency of device 'x' = 1.5 is out of range"),
    ({"mem_bandwidth_Bps": 1e12, "select_coeff_s": -1e-12}, r"select_coeff_s of device 'x' = -1e-12 is out of range"),
    ({"mem_bandwidth_Bps": 1e12, "merge_coeff_s": 2.0}, r"merge_coeff_s of device 'x' = 2.0 is out of range"),
])
def test_bad_device_values_are_one_line_errors(kw, match):
    with pytest.raises(ConfigError, match=match) as e:
        DeviceModel("x", 1e12, 0.5, **kw)
    assert "\n" not in str(e.value)


def test_bad_bytes_and_scaling_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"value_bytes = 0 is out of range: valid 1 <= value_bytes <= 16"):
        get_device("H100").costs(0, 4)
    with pytest.raises(ConfigError, match=r"select_scaling = 'n' is unknown: valid 'x log2 x' or 'x'"):
        ComputeModel(select_scaling="n")


@pytest.mark.parametrize("arg, needle", [("compute.merge_coeff_s=-1.0", "compute.merge_coeff_s = -1.0 is out of range"),
                                         ("compute.select_coeff_s=true", "compute.select_coeff_s = True"),
                                         ("workload.device='K80'", "device = 'K80' is unknown")])
def test_bad_cost_keys_exit_2_with_one_line(tmp_path, arg, needle):
    r = CliRunner().invoke(main, ["run", "--out", str(tmp_path / "r"), "--quiet", "--set", "workload.model='resnet20-cifar'",
                                  "--set", arg])
    assert r.exit_code == 2 and needle in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------ the summary names the cost model

def _summary(tmp_path, *sets):
    out = tmp_path / "r"
    args = ["run", "--out", str(out), "--set", "workload.model='resnet20-cifar'", "--set", "training.iterations=2",
            "--set", "cluster.P=4", "--set", "algorithms=['dense', 'gtopk']"]
    for s in sets:
        args += ["--set", s]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    return r.output, json.loads((out / "summary.json").read_text()), out


def test_summary_prints_and_records_the_memory_model_on_h100(tmp_path):
    import csv

    text, s, out = _summary(tmp_path, "workload.device='H100'")
    costs = s["resolved"]["compute_costs"]
    sel = 9.0 * 4 / (3.35e12 * 0.87)
    assert costs["select"]["coeff_s"] == sel and costs["select"]["from"] == "device"
    assert "costs: select 1.24e-11 s/element (9 passes), merge 1.78e-11 s/element (13 passes)" in text
    assert "H100 memory model: H100 SXM5 HBM3 3.35 TB/s, datasheet" in text
    assert s["resolved"]["workload"]["device"]["mem_bandwidth_Bps"] == 3.35e12
    d = s["resolved"]["d"]
    rows = [r for r in csv.DictReader(open(out / "metrics.csv")) if r["algorithm"] == "gtopk"]
    assert float(rows[0]["compress_s"]) == sel * d  # whole-model selection over d, per element


def test_summary_names_the_papers_fit_on_p102_100_and_the_scenario_key(tmp_path):
    text, s, _ = _summary(tmp_path)
    assert "costs: select 2.19e-10 s/x log2 x, merge 0 s/element" in text and "Shi et al., ICDCS 2019" in text
    assert s["resolved"]["compute_costs"]["select"]["from"] == "device"
    text, s, _ = _summary(tmp_path / "b", "workload.device='A100'", "compute.select_coeff_s=1e-11")
    assert "  select: compute.select_coeff_s (the scenario)" in text and "merge, reduce, update: A100 memory model" in text
