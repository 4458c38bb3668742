"""The model zoo and workload sources (sim.workloads): stored tables against the torch definitions and the
published parameter counts, FLOP counts against FlopCounterMode, layer tables (CSV/TOML) and their errors,
from_torch / measure_torch, device presets."""
from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sim.base.errors import ConfigError
from sim.workloads import (DEVICES, ZOO, ZOO_MODELS, LayerCost, ParamTensor, Workload, dumps_layer_table,
                           get_device, get_model, load_layer_table, save_layer_table)

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

PUBLISHED = {  # parameter counts: torchvision, HuggingFace, the gTop-k papers' models
    "resnet20-cifar": 269_722,
    "vgg16-cifar": 14_728_266,
    "vgg16": 138_357_544,
    "alexnet": 61_100_840,
    "resnet50": 25_557_032,
    "bert-base": 109_482_240,
    "gpt2-small": 124_439_808,
    "lstm-ptb": 66_034_000,
}


def one_line_error(fn, *needles):
    """Call fn, expect a ConfigError with a one-line message containing every needle; return it."""
    with pytest.raises(ConfigError) as ei:
        fn()
    msg = str(ei.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert str(n) in msg, (n, msg)
    return msg


# ---------------------------------------------------------------------------------------------------
# zoo: parameter counts, tensors, FLOPs
# ---------------------------------------------------------------------------------------------------

def test_zoo_names_and_published_totals():
    assert set(ZOO_MODELS) == set(PUBLISHED)
    for name in ZOO_MODELS:
        w = get_model(name)
        assert w.d == PUBLISHED[name] == ZOO[name].params, name
        assert w.name == name and not w.measured and w.input == ZOO[name].input
        assert all(l.forward_flops >= 0 and l.backward_flops >= 0 for l in w.layers)
        assert sorted(w.grad_ready_order()) == list(range(len(w.tensors)))
        assert {t.layer for t in w.tensors} <= {l.name for l in w.layers}


def test_lstm_ptb_count_by_hand():
    emb, hid, vocab = 1500, 1500, 10000
    lstm = 2 * (4 * hid * (emb + hid) + 2 * 4 * hid)
    assert vocab * emb + lstm + hid * vocab + vocab == 66_034_000 == get_model("lstm-ptb").d


def test_unknown_model_is_one_line_error():
    one_line_error(lambda: get_model("resnet-50"), "'resnet-50'", "resnet50", "lstm-ptb")


@needs_torch
@pytest.mark.parametrize("name", ZOO_MODELS)
def test_stored_tensors_equal_torch_definitions(name):
    from sim.workloads import build_module

    m = build_module(name)
    w = get_model(name)
    assert [(t.name, t.numel) for t in w.tensors] == [(n, p.numel()) for n, p in m.named_parameters()]


@needs_torch
@pytest.mark.parametrize("name", ZOO_MODELS)
def test_stored_flops_equal_fresh_flop_counter(name):
    """Totals equal a fresh FlopCounterMode count of forward (and forward+backward) on 2 samples, halved;
    the whole table equals a fresh from_torch of the definition (what build_tables writes)."""
    from torch.utils.flop_counter import FlopCounterMode

    from sim.workloads import build_module, zoo_from_torch

    e, w = ZOO[name], get_model(name)
    m = build_module(name)
    shape = (2,) + e.input_shape
    x = torch.zeros(shape, dtype=torch.long, device="meta") if e.tokens else torch.empty(shape, device="meta")
    with FlopCounterMode(display=False) as fc:
        out = m(x)
    fwd = fc.get_total_flops() / 2
    with FlopCounterMode(display=False) as fc:
        out = m(x)
        out = out if isinstance(out, tuple) else (out,)
        sum(o.sum() for o in out).backward()
    total = fc.get_total_flops() / 2
    f = sum(l.forward_flops for l in w.layers)
    b = sum(l.backward_flops for l in w.layers)
    assert f == pytest.approx(fwd, rel=1e-9)
    assert f + b == pytest.approx(total, rel=1e-9)
    assert zoo_from_torch(name) == w


def test_flop_sanity_against_published_and_hand_counts():
    # torchvision documents multiply-adds ("GFLOPS" 4.09, 15.47, 0.71); FlopCounterMode counts 2 per multiply-add
    fwd = {n: sum(l.forward_flops for l in get_model(n).layers) for n in ZOO_MODELS}
    assert fwd["resnet50"] == pytest.approx(2 * 4.09e9, rel=0.01)
    assert fwd["vgg16"] == pytest.approx(2 * 15.47e9, rel=0.01)
    assert fwd["alexnet"] == pytest.approx(2 * 0.714e9, rel=0.01)
    assert fwd["resnet20-cifar"] == pytest.approx(2 * 40.55e6, rel=0.01)
    # transformers and LSTM by hand: 2 FLOPs per multiply-add of every matmul
    t, h, ff = 128, 768, 3072
    layer = 2 * t * (4 * h * h + 2 * h * ff) + 2 * 2 * t * t * h
    assert fwd["bert-base"] == 12 * layer + 2 * h * h  # + pooler on the first token
    t = 1024
    assert fwd["gpt2-small"] == 12 * (2 * t * (4 * h * h + 2 * h * ff) + 2 * 2 * t * t * h)  # full T x T attention
    assert fwd["lstm-ptb"] == 35 * (2 * 2 * 4 * 1500 * 3000 + 2 * 1500 * 10000)
    for n in ZOO_MODELS:
        w = get_model(n)
        ratio = sum(l.backward_flops for l in w.layers) / fwd[n]
        assert 1.85 < ratio <= 2.0, (n, ratio)


def test_backward_attribution_per_layer():
    """Backward FLOPs are attributed per autograd node: the first convolution (input needs no gradient) has
    backward = forward, every other weighted layer 2 x forward."""
    w = get_model("resnet50")
    conv1 = w.layers[0]
    assert conv1.name == "conv1" and conv1.backward_flops == conv1.forward_flops > 0
    for l in w.layers[1:]:
        assert l.backward_flops == 2 * l.forward_flops, l
    # a single conv: 2 FLOPs per multiply-add, 224x224 -> 112x112, 64 x 3 x 7 x 7 weights
    assert conv1.forward_flops == 2 * 112 * 112 * 64 * 3 * 7 * 7


def test_layer_order_follows_forward_execution():
    w = get_model("resnet50")
    names = [l.name for l in w.layers]
    assert names[:4] == ["conv1", "bn1", "layer1.0.conv1", "layer1.0.bn1"]
    assert names.index("layer1.0.bn3") < names.index("layer1.0.downsample.0") < names.index("layer1.1.conv1")
    assert names[-1] == "fc"
    b = [l.name for l in get_model("bert-base").layers]
    pre = "encoder.layer.0.attention."
    # HF executes word, token-type, then position embeddings; the attention core (own work of the
    # self-attention module) runs after the Q/K/V projections and before the output projection
    assert b[:3] == ["embeddings.word_embeddings", "embeddings.token_type_embeddings",
                     "embeddings.position_embeddings"]
    assert b.index(pre + "self.value") + 1 == b.index(pre + "self") == b.index(pre + "output.dense") - 1
    assert b[-1] == "pooler.dense"
    g = get_model("gpt2-small")
    # tensors stay in module.parameters() order (position embeddings defined before token types)
    assert [t.name for t in get_model("bert-base").tensors[:3]] == [
        "embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight"]
    assert [l.name for l in g.layers[:5]] == ["wte", "wpe", "h.0.ln_1", "h.0.attn.c_attn", "h.0.attn"]
    assert [l.name for l in get_model("lstm-ptb").layers] == ["word_embeddings", "lstm", "sm_fc"]


def test_ready_order_observed():
    """Stored tables carry the gradient-ready order the traced backward produced: last layer first."""
    w = get_model("alexnet")
    order = [w.tensors[i].name for i in w.grad_ready_order()]
    assert order[:2] == ["classifier.6.bias", "classifier.6.weight"]
    assert set(order[-2:]) == {"features.0.weight", "features.0.bias"}
    li = w.layer_index()
    layers = [li[w.tensors[i].layer] for i in w.grad_ready_order()]
    assert layers == sorted(layers, reverse=True)


@needs_torch
def test_build_tables_check_passes():
    from sim.workloads.build_tables import main

    assert main(["--check", "alexnet", "resnet20-cifar"]) == 0


def test_zoo_loads_without_torch():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch blocked")
        sys.meta_path.insert(0, Block())
        from sim.workloads import get_model, get_device
        w = get_model("resnet50")
        f, b = w.layer_times(32, get_device("V100"))
        print(w.d, len(w.layers), "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["25557032", str(len(get_model("resnet50").layers)), "False"]


@pytest.mark.skipif(torch is None, reason="torch is not installed")
@pytest.mark.parametrize("name", ["bert-base", "gpt2-small"])
def test_against_huggingface_when_available(name):
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        if name == "bert-base":
            m = transformers.BertModel(transformers.BertConfig())
        else:
            m = transformers.GPT2Model(transformers.GPT2Config())
    hf = [(n, p.numel()) for n, p in m.named_parameters()]
    assert [(t.name, t.numel) for t in get_model(name).tensors] == hf


# ---------------------------------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------------------------------

def test_device_presets():
    assert set(DEVICES) == {"P102-100", "V100", "A100", "H100"}
    assert get_device("P102-100").peak_flops == pytest.approx(10.77e12)
    assert get_device("V100").peak_flops == 125e12
    assert get_device("A100").peak_flops == 312e12
    assert get_device("H100").peak_flops == 989e12
    for d in DEVICES.values():
        assert 0 < d.efficiency <= 1 and d.source and d.flops_per_s == d.peak_flops * d.efficiency
    f, b = get_model("resnet50").layer_times(32, get_device("A100"))
    assert f.sum() == pytest.approx(32 * 8.178e9 / (312e12 * 0.4), rel=1e-3)
    one_line_error(lambda: get_device("v100"), "'v100'", "P102-100", "V100", "A100", "H100")


# ---------------------------------------------------------------------------------------------------
# layer tables: round trips and errors
# ---------------------------------------------------------------------------------------------------

HAND_CSV = """\
# a hand-written table
# name = tiny
# input = 3x32x32
layer,tensor,numel,forward_flops,backward_flops
conv1,conv1.weight,432,884736,884736
conv1,conv1.bias,16,0,0
pool,,0,16384,16384
fc,fc.weight,40960,81920,100000
fc,fc.bias,10,0,63840
"""

HAND_TOML = """\
name = "tiny"
input = "3x32x32"

[[layer]]
name = "conv1"
forward_flops = 884736
backward_flops = 884736
tensors = [{name = "conv1.weight", numel = 432}, {name = "conv1.bias", numel = 16}]

[[layer]]
name = "pool"
forward_flops = 16384
backward_flops = 16384.0

[[layer]]
name = "fc"
forward_flops = 81920
backward_flops = 163840
tensors = [{name = "fc.weight", numel = 40960}, {name = "fc.bias", numel = 10}]
"""


def test_hand_written_csv_and_toml_agree(tmp_path):
    a = tmp_path / "tiny.csv"
    a.write_text(HAND_CSV)
    b = tmp_path / "tiny.toml"
    b.write_text(HAND_TOML)
    wa, wb = load_layer_table(a), load_layer_table(b)
    assert wa == wb
    assert [l.name for l in wa.layers] == ["conv1", "pool", "fc"]
    assert wa.layers[2] == LayerCost("fc", 81920, 163840)  # the sum of the layer's rows
    assert wa.d == 432 + 16 + 40960 + 10 and wa.input == "3x32x32" and wa.name == "tiny"
    assert [t.layer for t in wa.tensors] == ["conv1", "conv1", "fc", "fc"]


def _measured_workload():
    return Workload(
        "m", layers=(LayerCost("a", 1.5, 3.0, forward_s=1e-3 / 3, backward_s=2.5e-3),
                     LayerCost("relu", 0.0, 0.0, forward_s=1e-5, backward_s=0.0),
                     LayerCost("b", 7.0, 14.0, forward_s=0.1, backward_s=0.2)),
        tensors=(ParamTensor("b.w", 5, "b"), ParamTensor("a.w", 3, "a"), ParamTensor("a.b", 2, "a")),
        measured_batch=16, input="7", source="hand, with, commas = and equals", ready_order=(0, 2, 1))


@pytest.mark.parametrize("ext", ["csv", "toml"])
@pytest.mark.parametrize("which", ["bert-base", "resnet20-cifar", "measured", "tiny"])
def test_round_trip(tmp_path, ext, which):
    if which == "measured":
        w = _measured_workload()
    elif which == "tiny":
        (tmp_path / "tiny.csv").write_text(HAND_CSV)
        w = load_layer_table(tmp_path / "tiny.csv")
    else:
        w = get_model(which)
    p = tmp_path / f"out.{ext}"
    save_layer_table(w, p)
    back = load_layer_table(p)
    assert back == w
    assert back.grad_ready_order() == w.grad_ready_order()
    assert dumps_layer_table(back, ext) == p.read_text()


def _csv_cases():
    H = "layer,tensor,numel,forward_flops,backward_flops\n"
    return [
        ("header only", H, ["no layers"]),
        ("comments only", "# nothing\n", ["empty"]),
        ("missing numel", "layer,tensor,forward_flops,backward_flops\na,a.w,1,1\n", ["line 1", "'numel'"]),
        ("missing backward", "layer,tensor,numel,forward_flops\na,a.w,1,1\n", ["line 1", "'backward_flops'"]),
        ("no cost columns", "layer,tensor,numel\na,a.w,1\n", ["line 1", "forward_flops"]),
        ("unknown column", "layer,tensor,numel,forward_flops,backward_flop\n", ["line 1", "'backward_flop'"]),
        ("negative numel", H + "a,a.w,-3,1,1\n", ["line 2", "numel = '-3'", "1 <= numel"]),
        ("fractional numel", H + "a,a.w,1.5,1,1\n", ["line 2", "numel = '1.5'", "integer"]),
        ("text numel", H + "a,a.w,many,1,1\n", ["line 2", "numel = 'many'"]),
        ("zero numel", H + "a,a.w,0,1,1\n", ["line 2", "numel = '0'"]),
        ("numel without tensor", H + "a,a.w,3,1,1\nr,,5,1,1\n", ["line 3", "numel = '5'", "valid 0"]),
        ("negative cost", H + "a,a.w,3,-1,1\n", ["line 2", "forward_flops = '-1'", "0 <= forward_flops"]),
        ("nan cost", H + "a,a.w,3,1,nan\n", ["line 2", "backward_flops = 'nan'", "finite"]),
        ("inf cost", H + "a,a.w,3,inf,1\n", ["line 2", "forward_flops = 'inf'"]),
        ("text cost", H + "a,a.w,3,fast,1\n", ["line 2", "forward_flops = 'fast'"]),
        ("empty cost", H + "a,a.w,3,,1\n", ["line 2", "forward_flops = ''"]),
        ("duplicate tensor", H + "a,a.w,3,1,1\nb,a.w,3,1,1\n", ["line 3", "'a.w'", "twice", "line 2"]),
        ("layer not contiguous", H + "a,a.w,3,1,1\nb,b.w,3,1,1\na,a.b,3,1,1\n", ["line 4", "'a'", "contiguous"]),
        ("empty layer name", H + ",a.w,3,1,1\n", ["line 2", "layer = ''"]),
        ("field count", H + "a,a.w,3,1\n", ["line 2", "4 fields", "valid 5"]),
        ("seconds without batch", "layer,tensor,numel,forward_s,backward_s\na,a.w,3,0.1,0.2\n", ["measured_batch"]),
        ("batch zero", "# measured_batch = 0\nlayer,tensor,numel,forward_s,backward_s\na,a.w,3,0.1,0.2\n",
         ["line 1", "measured_batch = '0'", "1 <= measured_batch"]),
        ("no tensors", H + "a,,0,1,1\n", ["no parameter tensors"]),
        ("param_index repeated", "layer,tensor,numel,forward_flops,backward_flops,param_index\n"
         "a,a.w,3,1,1,0\nb,b.w,3,1,1,0\n", ["line 3", "param_index = 0", "twice"]),
        ("param_index range", "layer,tensor,numel,forward_flops,backward_flops,param_index\n"
         "a,a.w,3,1,1,0\nb,b.w,3,1,1,7\n", ["line 3", "param_index = 7", "<= 1"]),
        ("ready_index missing", "layer,tensor,numel,forward_flops,backward_flops,ready_index\n"
         "a,a.w,3,1,1,0\nb,b.w,3,1,1,\n", ["line 3", "ready_index", "'b.w'"]),
    ]


@pytest.mark.parametrize("label,text,needles", _csv_cases(), ids=[c[0] for c in _csv_cases()])
def test_bad_csv_is_one_line_error(tmp_path, label, text, needles):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    one_line_error(lambda: load_layer_table(p), str(p), *needles)


def _toml_cases():
    L = '[[layer]]\nname = "a"\nforward_flops = 1\nbackward_flops = 1\n'
    return [
        ("syntax", "name = \n", ["not valid TOML"]),
        ("empty", 'name = "x"\n', ["empty"]),
        ("negative numel", L + 'tensors = [{name = "a.w", numel = -3}]\n', ["layer #1 ('a')", "numel = -3"]),
        ("float numel", L + 'tensors = [{name = "a.w", numel = 2.5}]\n', ["numel = 2.5", "integer"]),
        ("nan cost", '[[layer]]\nname = "a"\nforward_flops = nan\nbackward_flops = 1\n'
         'tensors = [{name = "a.w", numel = 3}]\n', ["layer #1", "forward_flops = nan"]),
        ("negative cost", '[[layer]]\nname = "a"\nforward_flops = 1\nbackward_flops = -2\n'
         'tensors = [{name = "a.w", numel = 3}]\n', ["backward_flops = -2", "0 <= backward_flops"]),
        ("missing cost", '[[layer]]\nname = "a"\nforward_flops = 1\ntensors = [{name = "a.w", numel = 3}]\n',
         ["'backward_flops'"]),
        ("unknown key", L + 'tensors = [{name = "a.w", numel = 3}]\nfoo = 1\n', ["layer #1", "'foo'"]),
        ("unknown top key", 'nme = "x"\n' + L, ["'nme'"]),
        ("duplicate tensor", L + 'tensors = [{name = "a.w", numel = 3}]\n' + L.replace('"a"', '"b"')
         + 'tensors = [{name = "a.w", numel = 3}]\n', ["layer #2 ('b')", "'a.w'", "twice"]),
        ("duplicate layer", L + 'tensors = [{name = "a.w", numel = 3}]\n' + L, ["layer #2", "'a'"]),
        ("mixed costs", L + 'tensors = [{name = "a.w", numel = 3}]\n[[layer]]\nname = "b"\nforward_s = 1\n'
         "backward_s = 1\n", ["layer #2", "forward_flops"]),
    ]


@pytest.mark.parametrize("label,text,needles", _toml_cases(), ids=[c[0] for c in _toml_cases()])
def test_bad_toml_is_one_line_error(tmp_path, label, text, needles):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    one_line_error(lambda: load_layer_table(p), str(p), *needles)


def test_missing_file_and_extension(tmp_path):
    one_line_error(lambda: load_layer_table(tmp_path / "nope.csv"), "nope.csv", "does not exist")
    p = tmp_path / "t.json"
    p.write_text("{}")
    one_line_error(lambda: load_layer_table(p), "t.json", "'.json'", ".csv, .toml")
    one_line_error(lambda: save_layer_table(get_model("alexnet"), tmp_path / "t.txt"), "'.txt'")


# ---------------------------------------------------------------------------------------------------
# from_torch / measure_torch
# ---------------------------------------------------------------------------------------------------

def _tiny():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10))


@needs_torch
def test_from_torch_counts_and_leaves_module_untouched():
    from sim.workloads import from_torch

    torch.manual_seed(0)
    m = _tiny().eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    w = from_torch(m, (3, 8, 8), name="tiny")
    assert [l.name for l in w.layers] == ["0", "1", "4"]  # ReLU/Flatten: no parameters, no FLOPs
    conv = 2 * 6 * 6 * 8 * 3 * 3 * 3
    assert w.layers[0] == LayerCost("0", conv, conv)  # first layer: weight gradient only
    assert w.layers[2] == LayerCost("4", 2 * 288 * 10, 2 * 2 * 288 * 10)
    assert [t.name for t in w.tensors] == [n for n, _ in m.named_parameters()] and w.d == 224 + 16 + 2890
    assert w.input == "3x8x8" and w.name == "tiny" and not w.measured
    assert all(p.grad is None for p in m.parameters()) and not m.training
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    with torch.device("meta"):
        mm = _tiny()
    assert from_torch(mm, (3, 8, 8), name="tiny") == w


@needs_torch
def test_from_torch_root_work_and_functional_children():
    """Work in a non-leaf forward is its own layer; parameters of a child that never runs (used functionally
    by its parent) belong to the parent's layer; the root's own layer is '(root)'."""
    from sim.workloads import ROOT_LAYER, from_torch

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(4, 4)
            self.out = torch.nn.Linear(4, 4)  # never called: used through F.linear

        def forward(self, x):
            h = self.inp(x)
            s = torch.matmul(h, h.transpose(-1, -2))
            return torch.nn.functional.linear(torch.matmul(s, h), self.out.weight, self.out.bias)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4, 4))
            self.attn = Attn()

        def forward(self, x):
            return self.attn(x @ self.scale)

    w = from_torch(Net(), (5, 4))
    assert [l.name for l in w.layers] == [ROOT_LAYER, "attn.inp", "attn"]
    assert {t.name: t.layer for t in w.tensors} == {"scale": ROOT_LAYER, "attn.inp.weight": "attn.inp",
                                                    "attn.inp.bias": "attn.inp", "attn.out.weight": "attn",
                                                    "attn.out.bias": "attn"}
    layers = {l.name: l for l in w.layers}
    assert layers[ROOT_LAYER].forward_flops == 2 * 5 * 4 * 4
    assert layers["attn"].forward_flops == 2 * (5 * 5 * 4 + 5 * 4 * 5 + 5 * 4 * 4)


@needs_torch
def test_from_torch_rejected_shape_is_one_line_config_error():
    from sim.workloads import build_module, from_torch

    one_line_error(lambda: from_torch(_tiny(), (3, 8)), "(3, 8)", "rejected")
    one_line_error(lambda: from_torch(build_module("resnet50"), (1, 224, 224)), "(1, 224, 224)", "rejected")
    for bad in [(), (0, 3), (3.5,), "abc", None]:
        one_line_error(lambda bad=bad: from_torch(_tiny(), bad), "input_shape")


@needs_torch
def test_measure_torch_times_and_layers():
    from sim.workloads import from_torch, measure_torch

    torch.manual_seed(0)
    m = _tiny().eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    w = measure_torch(m, (3, 8, 8), batch_size=4, repeats=2, warmup=1, device="cpu")
    assert [l.name for l in w.layers] == ["0", "1", "2", "3", "4"]  # ReLU and Flatten run: kept here
    assert w.measured and w.measured_batch == 4 and w.input == "3x8x8"
    for l in w.layers:
        assert math.isfinite(l.forward_s) and l.forward_s >= 0 and math.isfinite(l.backward_s) and l.backward_s >= 0
    lay = {l.name: l for l in w.layers}
    assert lay["0"].forward_s > 0 and lay["0"].backward_s > 0 and lay["4"].backward_s > 0
    ref = from_torch(m, (3, 8, 8))
    assert w.tensors == ref.tensors
    assert lay["0"].forward_flops == ref.layers[0].forward_flops  # FLOPs carried along
    f, b = w.layer_times(8)
    assert list(f) == pytest.approx([2 * l.forward_s for l in w.layers])
    assert list(b) == pytest.approx([2 * l.backward_s for l in w.layers])
    assert all(p.grad is None for p in m.parameters()) and not m.training
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # BN statistics restored


@needs_torch
def test_measure_torch_tokens_and_errors():
    from sim.workloads import build_module, measure_torch

    class Tok(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 6)
            self.fc = torch.nn.Linear(6, 3)

        def forward(self, x):
            return self.fc(self.emb(x))

    w = measure_torch(Tok(), (7,), batch_size=2, repeats=1, warmup=0, dtype=torch.long, device="cpu")
    assert [l.name for l in w.layers] == ["emb", "fc"] and w.input == "7 tokens"
    assert w.layers[0].backward_s > 0  # an embedding's backward is timed (its input needs no gradient)
    one_line_error(lambda: measure_torch(build_module("alexnet"), (3, 224, 224), batch_size=1), "meta")
    one_line_error(lambda: measure_torch(_tiny(), (3, 8, 8), batch_size=0), "batch_size = 0")
    one_line_error(lambda: measure_torch(_tiny(), (3, 8, 8), batch_size=1, repeats=0), "repeats = 0")
    one_line_error(lambda: measure_torch(_tiny(), (3, 9), batch_size=1, device="cpu"), "(3, 9)", "rejected")
