"""Gaussian-k (sim/algorithms/gaussiank.py) beside the authors' compressor, hclhkbu/GaussianK-SGD's
``compression.GaussianCompressor`` (3 threshold evaluations) and ``GaussianCompressor2`` (5), on the same
constructed inputs; writes the fixture tests/test_gaussiank.py compares against in CI (no peer code there).

Usage (the checkout is the authors' repository, e.g. from ``git clone https://github.com/hclhkbu/GaussianK-SGD``;
it is imported from its own directory, nothing of it is copied here; needs torch and scipy)::

    python benchmarks/peers/gaussiank_peer.py /work/peers/GaussianK-SGD [--out tests/fixtures/peers/gaussiank.npz]

Their ``compress`` keeps its threshold in a local variable (``right_thres``) and returns only the selected
indices and values; the thresholds it compares against are read from its frame with ``sys.settrace`` at the
comparison line ``one_indexes = abs_tensor > right_thres`` (one record per evaluation), and its mean and std
from the frame at return. Nothing of their computation is redone here.

Inputs: six float64 vectors of d = 2000 (normal, normal at scale 1e-6, Student-t with 1.5 degrees of freedom,
Laplace with mean 0.3, 90 % exact zeros, and a vector around -10 with 10 % exact zeros whose Gaussian threshold
is negative), each also as float32 (``astype``), at densities 0.001, 0.01, 0.05, 0.1, 0.3 with ratio = k / d
(k = round(density d), and the code's own k = max(int(d ratio), 1) checked equal). The fixture holds the inputs,
per case the peer's k, mean, std (float.hex), evaluated thresholds (float.hex) and the selected set as a packed
bit mask, and the versions used. The script prints the comparison with ours (same statistics: thresholds bit
for bit and index sets; our own statistics: index sets and the thresholds' relative gap).
"""
from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

D = 2000
DENSITIES = (0.001, 0.01, 0.05, 0.1, 0.3)
COMPRESSORS = (("GaussianCompressor", 3), ("GaussianCompressor2", 5))


def make_inputs(seed: int = 20191120) -> dict[str, np.ndarray]:
    """The constructed float64 inputs (name -> array (D,))."""
    rng = np.random.default_rng(seed)
    out = {
        "normal": rng.standard_normal(D),
        "normal_1e-6": rng.standard_normal(D) * 1e-6,
        "student_t1.5": rng.standard_t(1.5, D),
        "laplace_mean0.3": rng.laplace(0.3, 1.0, D),
    }
    sp = rng.standard_normal(D)
    sp[rng.random(D) < 0.9] = 0.0
    out["sparse90"] = sp
    neg = -10.0 + 0.5 * rng.standard_normal(D)
    neg[rng.random(D) < 0.1] = 0.0
    out["negmean_zeros"] = neg
    return out


def _tracer(code, line):
    """A sys.settrace hook recording ``right_thres`` at each execution of ``line`` of ``code`` and the frame's
    locals at return."""
    rec = {"thresholds": [], "locals": None}

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == line:
            rec["thresholds"].append(float(frame.f_locals["right_thres"]))
        elif event == "return":
            rec["locals"] = dict(frame.f_locals)
        return local

    def glob(frame, event, arg):
        return local if frame.f_code is code else None

    return glob, rec


def run_peer(mod, cls_name: str, x: np.ndarray, ratio: float):
    """Run ``mod.<cls_name>.compress`` on a torch copy of x; returns (indexes int64, values, record)."""
    import torch

    cls = getattr(mod, cls_name)
    fn = cls.__dict__["compress"].__func__
    src, first = inspect.getsourcelines(fn)
    line = first + next(i for i, s in enumerate(src) if "one_indexes = abs_tensor > right_thres" in s
                        and not s.strip().startswith("#"))
    mod.GaussianCompressor.clear()
    t = torch.from_numpy(x.copy())
    hook, rec = _tracer(fn.__code__, line)
    sys.settrace(hook)
    try:
        _, indexes, values = cls.compress(t, name="case", ratio=ratio)
    finally:
        sys.settrace(None)
    loc = rec["locals"]
    rec["mean"] = float(loc["mean"])
    rec["std"] = float(loc["std"])
    rec["k"] = int(loc["k"])
    return indexes.numpy().astype(np.int64), values.numpy(), rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("peer", type=Path, help="path of the hclhkbu/GaussianK-SGD checkout")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "peers" / "gaussiank.npz")
    ap.add_argument("--commit", default=None, help="the checkout's commit, when it is not a git work tree")
    args = ap.parse_args(argv)
    import scipy
    import scipy.stats
    import torch
    from scipy.special import ndtri

    from sim.algorithms.gaussiank import gaussiank_select

    sys.path.insert(0, str(args.peer.resolve()))
    import compression  # the authors' module, imported from their checkout
    import utils as peer_utils

    inputs = make_inputs()
    cases, masks = [], []
    same_thr = same_idx = own_idx = 0
    own_thr = {"float64": 0, "float32": 0}
    worst_own = 0.0
    for name, x64 in inputs.items():
        for dtype in ("float64", "float32"):
            x = x64.astype(dtype)
            for density in DENSITIES:
                k = max(1, round(density * D))
                ratio = k / D
                if max(int(D * ratio), 1) != k:
                    raise SystemExit(f"the code's k for ratio {ratio} is not {k}")
                for cls_name, loops in COMPRESSORS:
                    pidx, pval, rec = run_peer(compression, cls_name, x, ratio)
                    assert rec["k"] == k and np.array_equal(pval, x[pidx])
                    peer_thr = rec["thresholds"]
                    # the peer's threshold function gives the first evaluated threshold from its own statistics
                    assert peer_utils.gen_threshold_from_normal_distribution(1 - ratio, rec["mean"], rec["std"])[1] \
                        == peer_thr[0]
                    nz = pidx[x[pidx] != 0]  # ours never selects exact zeros
                    a = gaussiank_select(x, k, loops, stats=(rec["mean"], rec["std"]))
                    b = gaussiank_select(x, k, loops)
                    same_thr += list(a.thresholds) == peer_thr
                    same_idx += np.array_equal(a.sel.idx, nz)
                    own_idx += np.array_equal(b.sel.idx, nz)
                    own_thr[dtype] += b.threshold == peer_thr[-1]
                    gap = abs(b.threshold - peer_thr[-1]) / max(abs(peer_thr[-1]), 1e-300)
                    worst_own = max(worst_own, gap)
                    mask = np.zeros(D, bool)
                    mask[pidx] = True
                    masks.append(np.packbits(mask))
                    cases.append({"input": name, "dtype": dtype, "density": density, "k": k, "ratio": ratio,
                                  "compressor": cls_name, "loops": loops, "peer_k": rec["k"],
                                  "mean": rec["mean"].hex(), "std": rec["std"].hex(),
                                  "thresholds": [t.hex() for t in peer_thr], "n_selected": int(pidx.shape[0]),
                                  "zeros_selected": int(pidx.shape[0] - nz.shape[0])})
    commit = args.commit
    if commit is None:
        try:
            commit = subprocess.run(["git", "-C", str(args.peer), "rev-parse", "HEAD"], capture_output=True,
                                    text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    q = np.array([1e-4, 5e-4, 5e-3, 0.025, 0.05, 0.15])
    meta = {"peer": "hclhkbu/GaussianK-SGD compression.py", "peer_commit": commit, "torch": torch.__version__,
            "scipy": scipy.__version__, "numpy": np.__version__, "d": D,
            "ppf_is_ndtri": bool(np.array_equal(scipy.stats.norm.ppf(q), ndtri(q))), "cases": cases}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, meta=np.array(json.dumps(meta)), masks=np.stack(masks),
                        **{f"x_{n}": v for n, v in inputs.items()})
    n = len(cases)
    print(f"{n} cases ({len(inputs)} inputs x float64/float32 x {len(DENSITIES)} densities x 2 compressors), "
          f"peer commit {commit}, torch {torch.__version__}")
    print(f"with the peer's mean/std: thresholds bit-equal (initial, last, evaluations) {same_thr}/{n}, "
          f"index sets equal {same_idx}/{n}")
    print(f"with our own mean/std:    index sets equal {own_idx}/{n}, final threshold bit-equal "
          f"{own_thr['float64']}/{n // 2} (float64) {own_thr['float32']}/{n // 2} (float32), largest relative gap "
          f"{worst_own:.3g} (the statistics' last bits: torch's reduction order is its own)")
    print(f"exact zeros the peer selected (negative threshold; ours never): "
          f"{sum(c['zeros_selected'] for c in cases)} in {sum(c['zeros_selected'] > 0 for c in cases)} cases")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
