"""Run the authors' SparCML sparse allreduces (C++/MPI) on constructed inputs and record what they compute, as the
fixture tests/test_sparcml.py compares sim/comm/collectives.py's ``ssar_recursive_doubling`` and
``ssar_split_allgather`` against (CI has neither the peer code nor MPI).

Usage (CHECKOUT holds the authors' ``c_common.h``, ``c_allreduce_recdoubling.h`` and ``c_allreduce_small.h``
unchanged; nothing of them is copied here; needs ``mpicxx`` and ``mpiexec``, e.g. Debian's mpich)::

    python benchmarks/peers/sparcml_peer.py /work/peers/sparcml [--out tests/fixtures/peers/sparcml.npz]

This script writes a small driver of its own (``HARNESS`` below) that includes their three headers, builds every
rank's sparse stream (their ``struct stream`` of ``s_item<IdxType, ValType>``) from an input file, calls their
``c_allreduce_recdoubling`` (SSAR_Recursive_double) or ``c_allreduce_small`` (SSAR_Split_allgather) and writes
the rank's result stream (count, dense or not, entries). It is compiled twice, -O1 (their ``items`` array sits at
offset 4 of ``struct stream``: misaligned for 8-byte indices, which x86 tolerates unless the compiler vectorises
with aligned loads):

- ``u32f32``: IdxType unsigned int, ValType float (their test's 4 + 4 byte layout);
- ``u64f64``: IdxType unsigned long, ValType double (8 + 8 bytes: with a 4-byte index and a double the struct is
  padded to 16 bytes while their ``countBytes`` counts 12 per entry, so their messages would cut the data).

Their switch to dense is the rule on the two inputs' counts ("bound"): (l1 + l2)(sizeof idx + sizeof val) >=
dim sizeof val, i.e. our ``dense_rule = "bound"``, dense_threshold 1, value_bytes / index_bytes as above.

Cases (``np.random.default_rng([seed, case])``): P = 1..9, n in {13, 40, 64, 200}, per-rank counts in [1, k], supports
drawn from a pool of ``pool`` coordinates (pool < n: overlaps; small n: streams that switch to dense). Values:
"normal" (standard normal, random signs) or "dyadic" (positive multiples of 2^-6 below 1: every partial sum is
exact, so any summation order gives the same bits). Their split variant sums a region's received pieces in
arrival order (MPI_Waitany): with more than two survivors (P >= 4) only dyadic values make the order irrelevant.

Recorded (``--out``, an .npz), per case in order: ``P``, ``n``, ``alg`` (0 recursive doubling, 1 split
allgather), ``layout`` (0 u32f32, 1 u64f64), ``dyadic``, ``nofitems`` and ``dense`` (rank 0's result stream),
``ranks_agree`` (every rank's result equal to rank 0's, bit for bit); concatenated over the cases: ``cnt`` (the
P per-rank entry counts), ``idx`` / ``val`` (the selections in rank order; values as float64, exact for the
float32 layout) and ``out`` (rank 0's result as a dense vector of n values, float64, exact likewise).
"""
from __future__ import annotations

import argparse
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "peers" / "sparcml.npz"
HEADERS = ("c_common.h", "c_allreduce_recdoubling.h", "c_allreduce_small.h")

HARNESS = r"""
#include <mpi.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
#include "c_allreduce_recdoubling.h"
#include "c_allreduce_small.h"

#ifdef LAYOUT64
typedef unsigned long IdxType;
typedef double ValType;
#else
typedef unsigned int IdxType;
typedef float ValType;
#endif
typedef s_item<IdxType, ValType> item;

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, P;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  FILE *f = fopen(argv[2], "rb");
  int32_t hdr[2];
  if (fread(hdr, 4, 2, f) != 2 || hdr[0] != P) MPI_Abort(MPI_COMM_WORLD, 3);
  unsigned dim = (unsigned)hdr[1];
  std::vector<uint64_t> idx;
  std::vector<double> val;
  for (int q = 0; q < P; ++q) {
    int32_t c;
    if (fread(&c, 4, 1, f) != 1) MPI_Abort(MPI_COMM_WORLD, 3);
    std::vector<uint64_t> ii(c);
    std::vector<double> vv(c);
    if (fread(ii.data(), 8, c, f) != (size_t)c || fread(vv.data(), 8, c, f) != (size_t)c) MPI_Abort(MPI_COMM_WORLD, 3);
    if (q == rank) { idx = ii; val = vv; }
  }
  fclose(f);
  size_t maxbytes = sizeof(unsigned) + dim * sizeof(ValType) + idx.size() * sizeof(item);
  struct stream *send = (struct stream *)calloc(1, maxbytes);
  struct stream *recv = (struct stream *)calloc(1, maxbytes);
  send->nofitems = (unsigned)idx.size();
  for (size_t i = 0; i < idx.size(); ++i) {
    ((item *)send->items)[i].idx = (IdxType)idx[i];
    ((item *)send->items)[i].val = (ValType)val[i];
  }
  if (strcmp(argv[1], "rd") == 0) {
    c_allreduce_recdoubling<IdxType, ValType>(send, recv, dim);
  } else {
    c_allreduce_small<IdxType, ValType>(send, recv, dim);
  }
  char name[4096];
  snprintf(name, sizeof name, "%s.%d", argv[3], rank);
  FILE *o = fopen(name, "wb");
  uint32_t nof = recv->nofitems;
  uint8_t dense = nof == dim;
  fwrite(&nof, 4, 1, o);
  fwrite(&dense, 1, 1, o);
  for (unsigned i = 0; i < nof; ++i) {
    uint64_t ix = dense ? i : (uint64_t)((item *)recv->items)[i].idx;
    double v = dense ? (double)((ValType *)recv->items)[i] : (double)((item *)recv->items)[i].val;
    fwrite(&ix, 8, 1, o);
    fwrite(&v, 8, 1, o);
  }
  fclose(o);
  free(send);
  free(recv);
  MPI_Finalize();
  return 0;
}
"""

LAYOUTS = {0: ("u32f32", np.float32, []), 1: ("u64f64", np.float64, ["-DLAYOUT64"])}


def make_case(seed: int, case: int, P: int, n: int, k: int, pool: int, dyadic: bool, dtype):
    """Per-rank selections: (counts (P,), idx list, val list), values exactly representable in ``dtype``."""
    rng = np.random.default_rng([seed, case])
    support = np.sort(rng.choice(n, size=pool, replace=False))
    idx, val, cnt = [], [], []
    for _ in range(P):
        c = int(rng.integers(1, min(k, pool) + 1))
        ii = np.sort(rng.choice(support, size=c, replace=False)).astype(np.int64)
        if dyadic:
            vv = rng.integers(1, 64, size=c) / 64.0
        else:
            vv = rng.standard_normal(c)
            vv = np.where(np.abs(vv) < 1e-3, 1e-3, vv)  # their split variant drops |v| <= 1e-8 from dense regions
        idx.append(ii)
        val.append(np.asarray(vv, dtype=dtype))
        cnt.append(c)
    return np.array(cnt, dtype=np.int64), idx, val


def cases(seed: int):
    """(P, n, k, pool, alg, layout, dyadic) of every recorded case."""
    out = []
    for layout in (0, 1):
        for P in range(1, 10):
            for n, k, pool in ((13, 3, 13), (40, 6, 25), (64, 12, 64), (200, 20, 120), (200, 30, 60)):
                out.append((P, n, k, pool, 0, layout, False))
                out.append((P, n, k, pool, 1, layout, P >= 4))
                if P >= 4:  # normal values in their arrival order: compared to a tolerance
                    out.append((P, n, k, pool, 1, layout, False))
    return out


def build(checkout: Path, work: Path) -> dict:
    """Compile the harness against the checkout's headers (copied into the temporary build folder only)."""
    for h in HEADERS:
        shutil.copy(checkout / h, work / h)
    (work / "harness.cpp").write_text(HARNESS)
    exe = {}
    for layout, (name, _, flags) in LAYOUTS.items():
        exe[layout] = work / f"harness_{name}"
        subprocess.run(["mpicxx", "-O1", "-w", *flags, "-o", str(exe[layout]), "harness.cpp"], cwd=work, check=True)
    return exe


def run_peer(exe: Path, alg: str, P: int, n: int, cnt, idx, val, work: Path, tag: str):
    """Their allreduce on P ranks; returns [(nofitems, dense, dense vector float64 (n,))] per rank."""
    inp = work / f"{tag}.in"
    with open(inp, "wb") as f:
        f.write(struct.pack("<ii", P, n))
        for c, ii, vv in zip(cnt, idx, val):
            f.write(struct.pack("<i", int(c)))
            f.write(np.asarray(ii, dtype="<u8").tobytes())
            f.write(np.asarray(vv, dtype="<f8").tobytes())
    out = work / f"{tag}.out"
    subprocess.run(["mpiexec", "-n", str(P), str(exe), alg, str(inp), str(out)], check=True, timeout=120,
                   stdout=subprocess.DEVNULL)
    res = []
    for r in range(P):
        b = (work / f"{tag}.out.{r}").read_bytes()
        nof, dense = struct.unpack_from("<IB", b, 0)
        rec = np.frombuffer(b[5:], dtype=[("i", "<u8"), ("v", "<f8")], count=nof)
        vec = np.zeros(n)
        vec[rec["i"].astype(np.int64)] = rec["v"]
        res.append((int(nof), bool(dense), vec))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", type=Path, help="folder with the authors' c_common.h, c_allreduce_recdoubling.h, "
                                                 "c_allreduce_small.h")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=11)
    a = ap.parse_args(argv)
    missing = [h for h in HEADERS if not (a.checkout / h).is_file()]
    if missing:
        print(f"checkout = {a.checkout}: missing {', '.join(missing)}", file=sys.stderr)
        return 2
    rec = {k: [] for k in ("P", "n", "alg", "layout", "dyadic", "nofitems", "dense", "ranks_agree")}
    arrays = {k: [] for k in ("cnt", "idx", "val", "out")}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        exe = build(a.checkout, work)
        for i, (P, n, k, pool, alg, layout, dyadic) in enumerate(cases(a.seed)):
            dtype = LAYOUTS[layout][1]
            cnt, idx, val = make_case(a.seed, i, P, n, k, pool, dyadic, dtype)
            res = run_peer(exe[layout], ("rd", "small")[alg], P, n, cnt, idx, val, work, f"c{i}")
            agree = all(r[0] == res[0][0] and r[1] == res[0][1] and np.array_equal(r[2], res[0][2]) for r in res)
            for key, v in (("P", P), ("n", n), ("alg", alg), ("layout", layout), ("dyadic", dyadic),
                           ("nofitems", res[0][0]), ("dense", res[0][1]), ("ranks_agree", agree)):
                rec[key].append(v)
            arrays["cnt"].append(cnt)
            arrays["idx"].append(np.concatenate(idx))
            arrays["val"].append(np.concatenate(val).astype(np.float64))
            arrays["out"].append(res[0][2])
    meta = {k: np.asarray(v) for k, v in rec.items()}
    arrays = {k: np.concatenate(v) for k, v in arrays.items()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(a.out, **meta, **arrays)
    print(f"{len(meta['P'])} cases; ranks agree in {int(meta['ranks_agree'].sum())}; dense results "
          f"{int(meta['dense'].sum())}; written to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
