"""PowerSGD: rank-r power-iteration compression of each segment viewed as a matrix (one near-square matrix per
segment, or, with ``variant = "torch"``, each tensor as torch's hook views it), with error feedback and warm start,
operation for operation as PyTorch's ``powerSGD_hook``.

Source: Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019, Algorithm 1 (rank-r PowerSGD compression with error feedback, Q reused across steps:
"warm start", section 3), as shipped in ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``
(``PowerSGDState`` + ``powerSGD_hook``, torch 2.13), which this module reproduces bit for bit in float64 on the
same views of the same tensors (``tests/test_powersgd.py`` runs torch's hook beside it; docs/algorithms/powersgd.md).

Per iteration t and worker p, for one segment (a layer / DDP bucket; the whole model without segments) of n
elements: acc_p = eps_p + alpha_t G_p (error feedback, :meth:`Algorithm.accumulate`), viewed as the matrix
M_p (rows x cols, :func:`matrix_shape`), and with r = min(rank, rows, cols):

1. Q (cols x r): at the first compressed step (and at every step without warm start) drawn N(0, 1) exactly as
   torch does (:class:`TorchNormal`, seeded by ``rng.randint(10**9)`` from ONE ``RandomState(seed)`` per worker,
   one draw per segment in segment order -- also for a segment with nothing to compress, as torch draws for a
   bucket of biases only: every later segment's Q depends on it), else the previous step's Q; orthogonalised
   (:func:`orthogonalize`);
2. P = allreduce_sum(M_p Q) (rows x r; not divided: the orthogonalisation normalises it), orthogonalised;
3. Q = allreduce_sum(M_p^T P) / W (W = the number of workers P);
4. D = P Q^T (rows x cols), the decompressed average every worker applies; eps_p <- acc_p - D.

The exchange returns g = W D (the sum convention of :class:`Exchange`: every worker applies g / W, which is D bit
for bit when W is a power of two and within one ulp of it otherwise) and eps_p = acc_p - D, so
sum_p acc_p = g + sum_p eps_p up to rounding.

A segment that is not worth compressing (torch's ``_should_compress``: r (rows + cols) min_compression_rate >=
rows cols, or rows = 1 or cols = 1) is allreduced uncompressed as torch does: g = sum_p acc_p, the applied
average D = g / W and eps_p = acc_p - D (torch keeps that local-minus-average difference as the error). The first
``start_iter`` iterations (torch's ``start_powerSGD_iter``) are a plain allreduce: g = sum_p acc_p, eps_p = 0.

Matrix view, option ``variant``:

- ``"square"`` (default; our rule, not torch's: a segment of the model vector has no shapes): the segment is ONE
  matrix. ``matrix_rows`` = 0 views n elements as rows x cols with rows the largest divisor of n not above sqrt(n)
  when that is at least isqrt(n) / 2, else as the near-square ceil(sqrt(n)) x ceil(n / ceil(sqrt(n))) with zero
  padding at the end (:func:`matrix_shape`); ``matrix_rows`` = R > 0 views them as min(R, n) x ceil(n / min(R, n)),
  zero-padded. The padding's decompressed values are dropped. Equal to torch's view only where a segment is one 2-D
  tensor of R rows.
- ``"torch"``: torch's hook's view, bit for bit: option ``shapes`` gives the model vector's tensor shapes in order
  (:func:`parse_shapes`; the DDP hook fills them in per unit from the model), each segment must hold whole tensors,
  and each tensor is viewed as (shape[0], numel / shape[0]) (a bias as a column, never worth compressing at the
  default rate), the compressed ones grouped by shape as torch orders them, the others allreduced together
  (:func:`tensor_plan`, :func:`bucket_plan`). Timing-only calls know a size, not a position: they price the whole
  model only (:meth:`PowerSGD.plan`; the layer-wise timeline's DDP buckets are refused).

Both views run :func:`powersgd_bucket`, the same code on a :class:`Plan`.

Arithmetic (float64, bit for bit as torch 2.13's CPU kernels with ATEN_CPU_CAPABILITY=default, see
docs/algorithms/powersgd.md): matrix products sum the inner dimension in order (torch's ``bmm`` below 400
multiply-adds per product, :func:`matmul`); Gram-Schmidt is torch's ``_orthogonalize_gram_schmidt`` with torch's
reduction orders (:func:`orthogonalize`, :func:`torch_sum`). torch orthogonalises with ``torch.linalg.qr`` (LAPACK
Householder) for r > 2, multiplies larger matrices with MKL's dgemm, and on AVX-512 builds fuses multiply-adds in
the rank-1 column norm: there this module keeps Gram-Schmidt and the ordered sums, and agrees with torch up to
rounding (and, for the stored Q at r > 2, column signs) only. The ordered products cost far more than BLAS (a
1000 x 1000 segment: about 0.1 s per worker-step at rank 1, 0.3 s at rank 4); the timing-only mode does not run them.

Collectives: ``ring`` (default) or ``recursive_doubling`` allreduces (:func:`sim.comm.collectives.ring_allreduce`,
``rd_allreduce``) of the flattened P and Q (and of an uncompressed segment). Cost of a compressed segment
(contention-free, zero compute; :func:`sim.comm.costs.powersgd_time`): two allreduces of rows r and cols r values
(torch's view: one allreduce of the uncompressed tensors, if any, then the P and Q of all compressed tensors).
Compute (:func:`stage_work`, :meth:`PowerSGD.compression_work`): each of the three products M Q, M^T P and P Q^T
of a rows x cols matrix is ``matmul`` work of 2 rows cols r FLOPs, the orthogonalisations of Q and of P
2 cols r^2 and 2 rows r^2 FLOPs, each charged where powersgd_bucket runs it; with each, its memory traffic as
``scan`` bytes (every product reads M or writes P Q^T, rows cols values, and its r-column operands; Gram-Schmidt
reads and writes n r (5 r + 1) / 2 values): the roofline's two terms, added. At rank 1 a product makes 2 FLOPs per
4-byte value read, so the bytes dominate on every device (an H100: 1.4 ps per value read against 5 fs of FLOPs). The
timing-only mode, the fast engine and the closed form model a compressed iteration (t > start_iter).

State (``ctx.state["powersgd"]``, per worker): ``rng`` (numpy ``RandomState(spec.seed)``, torch's ``state.rng``) and
``q``: segment index -> the list of Q matrices (warm start; an empty list for a segment with nothing to compress).
The DDP hook keeps a state per unit and lends each unit the rank's one generator (:meth:`PowerSGD.hook_unit_state`),
so its units draw as the simulator's segments and as torch's buckets do. Everything is deterministic per seed and
identical on every rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from sim.comm import collectives as C
from sim.comm import rounds as V
from sim.base.errors import ConfigError
from sim.base.ops import Compute
from sim.algorithms.base import Algorithm, Exchange, Option, register

__all__ = ["PowerSGD", "stage_work", "matrix_shape", "effective_rank", "should_compress", "Entry", "Plan", "bucket_plan",
           "segment_plan", "tensor_plan", "parse_shapes", "VARIANTS", "powersgd_bucket", "matmul", "orthogonalize",
           "torch_sum", "TorchNormal", "SEED_BOUND"]

#: torch's hook seeds the Q draw with ``state.rng.randint(1_000_000_000)``.
SEED_BOUND = 1_000_000_000
#: elements of one block of products in :func:`matmul` (memory bound, not a numerical choice)
_BLOCK = 1 << 20


# ----------------------------------------------------------------------------- torch's arithmetic, in numpy


def matmul(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """A @ B with each output summed over the inner dimension in order, starting from 0:
    out[i, j] = ((0 + A[i, 0] B[0, j]) + A[i, 1] B[1, j]) + ... (torch's CPU ``bmm`` kernel below 400
    multiply-adds, ``baddbmm_cpu_kernel``; no fused multiply-add). A: (n, m), B: (m, r), same float dtype;
    returns a fresh (n, r) array. Memory O(n r + 2^20)."""
    n, m = A.shape
    r = B.shape[1]
    dt = np.result_type(A, B)
    acc = np.zeros((1, n, r), dtype=dt)
    kb = max(1, _BLOCK // max(1, n * r))
    At = A.T
    for k0 in range(0, m, kb):
        k1 = min(m, k0 + kb)
        block = np.empty((k1 - k0 + 1, n, r), dtype=dt)
        block[0] = acc[0]
        np.multiply(At[k0:k1, :, None], B[k0:k1, None, :], out=block[1:])  # products k, contiguous per k
        # add.accumulate is sequential along its axis (no pairwise summation): the carry, then each product
        acc = np.cumsum(block, axis=0)[-1:]
    return acc[0]


def _seq_sum(x: np.ndarray) -> np.ndarray:
    """Sum along axis 0 in order, starting from 0: ((0 + x[0]) + x[1]) + ... (shape x.shape[1:])."""
    zero = np.zeros((1,) + x.shape[1:], dtype=x.dtype)
    return np.cumsum(np.concatenate([zero, x]), axis=0)[-1]


def _ceil_log2(x: int) -> int:
    """torch's ``at::native::utils::CeilLog2``: 1 for x <= 2, else ceil(log2 x)."""
    return 1 if x <= 2 else (int(x) - 1).bit_length()


def _multi_row_sum(rows: np.ndarray) -> np.ndarray:
    """torch's ``multi_row_sum`` (aten/src/ATen/native/cpu/SumKernel.cpp) over axis 0 of ``rows``
    (size, ...): 4 levels of partial sums, a level flushed every 2^level_power rows."""
    size = rows.shape[0]
    zero = np.zeros(rows.shape[1:], dtype=rows.dtype)
    lp = max(4, _ceil_log2(size) // 4)
    step, mask = 1 << lp, (1 << lp) - 1
    full = size // step
    acc1, acc2, acc3 = zero, zero, zero
    if full:
        chunks = _seq_sum(rows[:full * step].reshape((full, step) + rows.shape[1:]).swapaxes(0, 1))
        for c in range(full):
            i = (c + 1) * step
            acc1 = acc1 + chunks[c]  # acc[1] += acc[0]; acc[0] = 0
            if i & (mask << lp):
                continue
            acc2 = acc2 + acc1
            acc1 = zero
            if i & (mask << (2 * lp)):
                continue
            acc3 = acc3 + acc2
            acc2 = zero
    acc0 = _seq_sum(rows[full * step:])
    return ((acc0 + acc1) + acc2) + acc3


def _row_sum(x: np.ndarray) -> np.ndarray:
    """torch's ``row_sum`` over axis 0 of x (size, ...): 4 interleaved accumulators (ilp_factor 4)."""
    size = x.shape[0]
    n4 = size // 4
    part = _multi_row_sum(x[:n4 * 4].reshape((n4, 4) + x.shape[1:]))  # (4, ...)
    p0 = part[0]
    for i in range(n4 * 4, size):
        p0 = p0 + x[i]
    for k in range(1, 4):
        p0 = p0 + part[k]
    return p0


def torch_sum(x: np.ndarray):
    """torch.sum of a contiguous 1-D float array on the CPU (``cascade_sum``: 4-lane vectors, 4 accumulators,
    4 levels, then the scalar tail and the lanes; the kernel of the default and AVX2 builds, which AVX-512
    machines also run). Returns a numpy scalar of x's dtype. Below 2^15 elements (torch splits larger sums
    across threads)."""
    n = x.shape[0]
    zero = x.dtype.type(0)
    if n < 4:
        return zero + _row_sum(x)
    nv = n // 4
    lanes = _row_sum(x[:nv * 4].reshape(nv, 4))
    final = zero
    for k in range(nv * 4, n):
        final = final + x[k]
    for k in range(4):
        final = final + lanes[k]
    return zero + final


def _norm(col: np.ndarray, contiguous: bool):
    """torch.norm(col) of a column: its vectorised last-dimension kernel (4 lanes, default build) when the column
    is contiguous (rank 1), else the plain ordered sum of squares; then sqrt. A numpy scalar of col's dtype."""
    sq = col * col
    if not contiguous:
        return np.sqrt(_seq_sum(sq))
    n = sq.shape[0]
    m = n - n % 4
    lanes = _seq_sum(sq[:m].reshape(-1, 4))
    b = ((lanes[0] + lanes[1]) + lanes[2]) + lanes[3]
    for d in range(m, n):
        b = b + sq[d]
    return np.sqrt(b)


def orthogonalize(M: np.ndarray, epsilon: float = 0.0) -> np.ndarray:
    """Gram-Schmidt on the columns of M (n, r), in place, as torch's ``_orthogonalize_gram_schmidt``: for each
    column i, col /= norm(col) (+ epsilon when epsilon > 0), then every later column
    rest -= sum(col * rest) col. A zero column with epsilon = 0 becomes zeros (torch's stated intent; its
    tensor division gives NaNs there instead). Returns M."""
    r = M.shape[1]
    for i in range(r):
        col = M[:, i]
        nrm = _norm(col, contiguous=r == 1)
        if epsilon:
            col /= nrm + M.dtype.type(epsilon)
        elif nrm == 0:
            col[:] = 0.0
        else:
            col /= nrm
        for j in range(i + 1, r):
            rest = M[:, j]
            rest -= torch_sum(col * rest) * col
    return M


class TorchNormal:
    """torch's CPU generator after ``torch.manual_seed(seed)`` (mt19937, 0 <= seed < 2^32), drawing
    ``torch.randn(n, dtype=torch.float64)`` bit for bit in numpy: uniforms u = (53 low bits of two 32-bit draws,
    high word first) / 2^53; n >= 16: all n uniforms, then Box-Muller on blocks of 16 (u1 = 1 - data[j],
    u2 = data[j + 8], the last block redrawn when 16 does not divide n); n < 16: one normal at a time
    (r = sqrt(-2 log1p(-u2)), theta = 2 pi u1: r cos(theta), with r sin(theta) kept for the next draw, across
    calls). sqrt / log / log1p / sin / cos are the C library's (Python's math), as torch's."""

    def __init__(self, seed: int):
        self._bits = np.random.MT19937(0)
        self._bits._legacy_seeding(int(seed))
        self._cached = None

    def _uniform(self, n: int) -> np.ndarray:
        w = self._bits.random_raw(2 * n).astype(np.uint64).reshape(n, 2)
        v = ((w[:, 0] << np.uint64(32)) | w[:, 1]) & np.uint64((1 << 53) - 1)
        return v.astype(np.float64) * (1.0 / (1 << 53))  # exact: v < 2^53

    def randn(self, n: int) -> np.ndarray:
        """n standard normal float64 values (a fresh array)."""
        if n >= 16:
            data = self._uniform(n).tolist()
            for i in range(0, n - 15, 16):
                _fill16(data, i)
            if n % 16:
                data[n - 16:] = self._uniform(16).tolist()
                _fill16(data, n - 16)
            return np.array(data, dtype=np.float64)
        out = np.empty(n, dtype=np.float64)
        for i in range(n):
            if self._cached is not None:
                out[i], self._cached = self._cached, None
                continue
            u1, u2 = self._uniform(2).tolist()
            r = math.sqrt(-2.0 * math.log1p(-u2))
            theta = 2.0 * math.pi * u1
            self._cached = r * math.sin(theta) * 1.0 + 0.0
            out[i] = r * math.cos(theta) * 1.0 + 0.0
        return out


def _fill16(data: list, off: int) -> None:
    """torch's ``normal_fill_16`` on data[off:off + 16] (Python floats, in place)."""
    for j in range(8):
        u1 = 1.0 - data[off + j]
        u2 = data[off + j + 8]
        radius = math.sqrt(-2.0 * math.log(u1))
        theta = 2.0 * math.pi * u2
        data[off + j] = radius * math.cos(theta) * 1.0 + 0.0
        data[off + j + 8] = radius * math.sin(theta) * 1.0 + 0.0


# ----------------------------------------------------------------------------- the matrix view


@lru_cache(maxsize=4096)
def matrix_shape(n: int, matrix_rows: int = 0) -> tuple[int, int]:
    """(rows, cols) of the matrix that n >= 1 elements are viewed as (row-major, zero padding at the end when
    rows cols > n). ``matrix_rows`` = 0 (auto): rows = the largest divisor of n not above sqrt(n) and cols = n / rows
    when that divisor is at least isqrt(n) / 2 (an exact near-square factorisation, no padding), else
    rows = ceil(sqrt(n)), cols = ceil(n / rows) (fewer than rows zeros of padding; a prime n, or ResNet-50's
    25,557,032 = 8 x 3,194,629, would otherwise be a thin matrix that compresses badly or not at all);
    R > 0: rows = min(R, n), cols = ceil(n / rows)."""
    n = int(n)
    if matrix_rows:
        rows = min(int(matrix_rows), n)
        return rows, -(-n // rows)
    root = math.isqrt(n)
    rows = root
    while n % rows:
        rows -= 1
    if 2 * rows >= root:
        return rows, n // rows
    rows = root + (root * root < n)  # ceil(sqrt(n)), as torch's batched_powerSGD_hook's square side
    return rows, -(-n // rows)


def effective_rank(rows: int, cols: int, rank: int) -> int:
    """r = min(rank, rows, cols), torch's ``matrix_approximation_rank`` per tensor."""
    return min(int(rank), int(rows), int(cols))


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """torch's ``_should_compress``: r (rows + cols) min_compression_rate < rows cols with r = min(rank, rows, cols)."""
    r = effective_rank(rows, cols, rank)
    return (rows + cols) * r * min_compression_rate < rows * cols


@dataclass(frozen=True)
class Entry:
    """One tensor of a bucket: elements [offset, offset + numel) of the bucket's vector, viewed as rows x cols
    (rows cols >= numel; zeros pad the rest), compressed at rank ``r`` (0: allreduced uncompressed)."""

    offset: int
    numel: int
    rows: int
    cols: int
    r: int


@dataclass(frozen=True)
class Plan:
    """A bucket's tensors: ``uncompressed`` in bucket order, ``compressed`` in torch's order (grouped by matrix
    shape, shapes in order of first appearance, tensors in bucket order within a shape: the order of the Q draws
    and of the P / Q memories)."""

    uncompressed: tuple[Entry, ...]
    compressed: tuple[Entry, ...]

    @property
    def p_size(self) -> int:
        return sum(e.rows * e.r for e in self.compressed)

    @property
    def q_size(self) -> int:
        return sum(e.cols * e.r for e in self.compressed)

    @property
    def u_size(self) -> int:
        return sum(e.numel for e in self.uncompressed)


def _group(entries) -> tuple[Entry, ...]:
    groups: dict[tuple[int, int], list[Entry]] = {}
    for e in entries:
        groups.setdefault((e.rows, e.cols), []).append(e)
    return tuple(e for g in groups.values() for e in g)


def bucket_plan(shapes, rank: int, min_compression_rate: float = 2.0) -> Plan:
    """The plan of torch's ``powerSGD_hook`` for a bucket whose tensors have the torch ``shapes`` (tuples, in
    bucket order, consecutive in the bucket's vector): each tensor viewed as (shape[0], numel / shape[0])
    (a 1-D tensor as (n, 1)), compressed when :func:`should_compress`. Raises ConfigError for a 0-d shape."""
    comp, unc = [], []
    off = 0
    for shape in shapes:
        shape = tuple(int(s) for s in shape)
        if not shape:
            raise ConfigError("a 0-d tensor has no matrix view: valid shapes have at least one dimension")
        numel = int(np.prod(shape))
        rows = shape[0]
        cols = numel // rows if rows else 0
        if numel and should_compress(rows, cols, rank, min_compression_rate):
            comp.append(Entry(off, numel, rows, cols, effective_rank(rows, cols, rank)))
        else:
            unc.append(Entry(off, numel, numel, 1, 0))
        off += numel
    return Plan(tuple(unc), _group(comp))


def segment_plan(n: int, rank: int, min_compression_rate: float = 2.0, matrix_rows: int = 0) -> Plan:
    """The plan of a simulator segment of n elements (one matrix, :func:`matrix_shape`): compressed when rows > 1,
    cols > 1 and :func:`should_compress`, else one uncompressed tensor of n elements."""
    rows, cols = matrix_shape(n, matrix_rows)
    if rows > 1 and cols > 1 and should_compress(rows, cols, rank, min_compression_rate):
        return Plan((), (Entry(0, n, rows, cols, effective_rank(rows, cols, rank)),))
    return Plan((Entry(0, n, n, 1, 0),), ())


def tensor_plan(shapes, lo: int, n: int, rank: int, min_compression_rate: float = 2.0) -> Plan:
    """The plan of the ``variant = "torch"`` view of the elements [lo, lo + n) of a model vector made of tensors of
    ``shapes`` (tuples, in vector order): the tensors covering exactly that range, as torch's hook sees a bucket
    of them (:func:`bucket_plan`). Raises ConfigError when lo or lo + n is not a tensor boundary (a segment that
    cuts a tensor has no per-tensor view)."""
    offs = _offsets(tuple(shapes))
    if lo + n > offs[-1]:
        raise ConfigError(f"powersgd.shapes hold {int(offs[-1])} elements but the vector has at least {lo + n}: valid "
                          "the shapes of the model's tensors")
    i = int(np.searchsorted(offs, lo))
    j = int(np.searchsorted(offs, lo + n))
    if i >= len(offs) or j >= len(offs) or offs[i] != lo or offs[j] != lo + n or j <= i:
        raise ConfigError(f"powersgd.variant = 'torch': elements [{lo}, {lo + n}) do not start and end on tensor "
                          f"boundaries of powersgd.shapes ({len(offs) - 1} tensors, {int(offs[-1])} elements): valid "
                          "segments made of whole tensors")
    return bucket_plan(shapes[i:j], rank, min_compression_rate)


@lru_cache(maxsize=64)
def _offsets(shapes: tuple) -> np.ndarray:
    """Start offsets of the tensors of ``shapes`` in the vector, plus the total: int64 (len(shapes) + 1,)."""
    return np.concatenate([[0], np.cumsum([int(np.prod(s)) for s in shapes], dtype=np.int64)]).astype(np.int64)


def parse_shapes(value, label: str = "powersgd.shapes") -> tuple[tuple[int, ...], ...]:
    """Tensor shapes from a sequence of shapes (each a sequence of integers >= 1, or one integer for a 1-D tensor)
    or a string of comma-separated shapes with ``x`` between dimensions (what a scenario's table holds, e.g.
    ``"37x19, 37, 23x37, 23"``). Returns a tuple of tuples of ints; () for an empty value. Raises ConfigError
    (one line naming ``label``) for anything else, a dimension < 1 or a 0-d shape (torch's hook views a tensor as
    (shape[0], numel / shape[0]): a 0-d tensor has no shape[0])."""
    valid = 'valid tensor shapes with dimensions >= 1, e.g. "37x19, 37, 23x37, 23" or ((37, 19), (37,))'
    try:
        if isinstance(value, str):
            items = [t.strip() for t in value.split(",")] if value.strip() else []
            shapes = [tuple(int(x) for x in t.lower().split("x")) for t in items]
        else:
            shapes = [(x,) if isinstance(x, (int, np.integer)) and not isinstance(x, bool) else tuple(x) for x in value]
            if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for sh in shapes for v in sh):
                raise TypeError
    except (TypeError, ValueError):
        raise ConfigError(f"{label} = {_cut(value)} is not a list of shapes: {valid}") from None
    if any(not sh or min(sh) < 1 for sh in shapes):
        raise ConfigError(f"{label} = {_cut(value)} holds an empty shape or a dimension below 1: {valid}")
    return tuple(tuple(int(v) for v in sh) for sh in shapes)


def _cut(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ----------------------------------------------------------------------------- the exchange of one bucket


def _matrix(acc: np.ndarray, e: Entry) -> np.ndarray:
    """The rows x cols view of entry e of acc (a zero-padded copy when rows cols > numel)."""
    x = acc[e.offset:e.offset + e.numel]
    if e.rows * e.cols != e.numel:
        pad = np.zeros(e.rows * e.cols, dtype=acc.dtype)
        pad[:e.numel] = x
        x = pad
    return x.reshape(e.rows, e.cols)


def _gram_schmidt_values(n: int, r: int) -> int:
    """Values Gram-Schmidt on an (n, r) matrix reads or writes (:func:`orthogonalize`): per column its norm (read)
    and scaling (read, write), per pair of columns a dot product (two reads) and an update (two reads, a write):
    n r (5 r + 1) / 2 (an integer: r (5 r + 1) is even)."""
    return n * r * (5 * r + 1) // 2


def stage_work(plan: Plan, value_bytes: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """The compute of :func:`powersgd_bucket` on ``plan`` at ``value_bytes`` per value, as its three stages of
    (kind, work) operations: before the P allreduce (orthogonalise Q, P = M Q), before the Q allreduce
    (orthogonalise P, Q = M^T P) and after it (D = P Q^T). Each stage is ``(("matmul", FLOPs), ("scan", bytes))``
    summed over the compressed entries (rows m, cols n, rank r):

    - stage 1: 2 n r^2 + 2 m n r FLOPs; (n r (5 r + 1) / 2 + m n + n r + m r) value_bytes bytes;
    - stage 2: 2 m r^2 + 2 m n r FLOPs; (m r (5 r + 1) / 2 + m n + m r + n r) value_bytes bytes;
    - stage 3: 2 m n r FLOPs; (m r + n r + m n) value_bytes bytes.

    A product of an (m, n) by an (n, r) matrix is m n r multiply-adds, 2 FLOPs each; its bytes read both operands
    and write the result once. Empty stages (no compressed entry): ``((), (), ())``."""
    comp = plan.compressed
    if not comp:
        return (), (), ()
    vb = int(value_bytes)
    gs = _gram_schmidt_values
    s1 = (("matmul", sum(2 * e.cols * e.r * e.r + 2 * e.rows * e.cols * e.r for e in comp)),
          ("scan", vb * sum(gs(e.cols, e.r) + e.rows * e.cols + e.cols * e.r + e.rows * e.r for e in comp)))
    s2 = (("matmul", sum(2 * e.rows * e.r * e.r + 2 * e.rows * e.cols * e.r for e in comp)),
          ("scan", vb * sum(gs(e.rows, e.r) + e.rows * e.cols + e.rows * e.r + e.cols * e.r for e in comp)))
    s3 = (("matmul", sum(2 * e.rows * e.cols * e.r for e in comp)),
          ("scan", vb * sum(e.rows * e.r + e.cols * e.r + e.rows * e.cols for e in comp)))
    return s1, s2, s3


def powersgd_bucket(rank: int, P: int, acc: np.ndarray, plan: Plan, memory: dict, key, rng, *,
                    epsilon: float = 0.0, warm_start: bool = True, allreduce=None, value_bytes: int = 8):
    """Sans-I/O program: one PowerSGD exchange of a bucket (torch's ``powerSGD_hook`` after
    ``start_powerSGD_iter``) on worker ``rank`` of P.

    acc: float array (n,), the error-feedback accumulator of the bucket (not modified); plan: :func:`bucket_plan`
    or :func:`segment_plan`; memory: this worker's dict of warm-start Q lists, entry ``key`` (read and written; an
    empty list for a bucket with nothing to compress); rng: this worker's ``numpy.random.RandomState`` (torch's
    ``state.rng``): one seed ``randint(SEED_BOUND)`` drawn whenever the bucket's Q memory is (re)initialised -- its
    first call, and every call without warm start -- whether or not it has a tensor to compress, as torch's hook
    draws (``need_randomize_qs``);
    allreduce: callable x -> sans-I/O program returning the sum over ranks of x (default: ring allreduce of
    ``value_bytes`` per value); value_bytes also sizes the compute's memory traffic (:func:`stage_work`, yielded
    as Compute operations between the messages). Order: the products M Q, the uncompressed allreduce, the P allreduce, M^T P, the
    Q allreduce, P Q^T (torch's future chain).

    Returns (avg, g): avg (n,), the decompressed average D every worker applies (torch's output bucket);
    g (n,), the sum convention: the allreduced sum on uncompressed tensors, W D on compressed ones (W = P).
    The error feedback is acc - avg.
    """
    if allreduce is None:
        allreduce = lambda x: C.ring_allreduce(rank, P, x, value_bytes)  # noqa: E731
    dt = acc.dtype
    avg = np.empty_like(acc)
    g = np.empty_like(acc)
    comp = plan.compressed
    stages = stage_work(plan, value_bytes)
    mats = [_matrix(acc, e) for e in comp]
    if not warm_start or memory.get(key) is None:
        # torch draws the bucket's seed whenever it (re)initialises the bucket's Q memory, also for a bucket with
        # nothing to compress (only biases): every later bucket's Q depends on this draw
        gen = TorchNormal(int(rng.randint(SEED_BOUND)))
        qs = [gen.randn(e.cols * e.r).reshape(e.cols, e.r).astype(dt, copy=False) for e in comp]
    else:
        qs = [q.copy() for q in memory[key]]
    if comp:
        for q in qs:
            orthogonalize(q, epsilon)
        for kind, work in stages[0]:
            yield Compute(kind, work)
        ps = [matmul(M, q) for M, q in zip(mats, qs)]
    if plan.uncompressed:
        u = np.concatenate([acc[e.offset:e.offset + e.numel] for e in plan.uncompressed])
        s = yield from allreduce(u)
        a = s / dt.type(P)
        i = 0
        for e in plan.uncompressed:
            g[e.offset:e.offset + e.numel] = s[i:i + e.numel]
            avg[e.offset:e.offset + e.numel] = a[i:i + e.numel]
            i += e.numel
    if comp:
        p_all = yield from allreduce(np.concatenate([p.ravel() for p in ps]))
        ps, i = [], 0
        for e in comp:
            ps.append(orthogonalize(p_all[i:i + e.rows * e.r].reshape(e.rows, e.r).copy(), epsilon))
            i += e.rows * e.r
        for kind, work in stages[1]:
            yield Compute(kind, work)
        qs = [matmul(M.T, p) for M, p in zip(mats, ps)]
        q_all = yield from allreduce(np.concatenate([q.ravel() for q in qs]))
        q_all = q_all / dt.type(P)
        qs, i = [], 0
        for e in comp:
            qs.append(q_all[i:i + e.cols * e.r].reshape(e.cols, e.r).copy())
            i += e.cols * e.r
        for kind, work in stages[2]:
            yield Compute(kind, work)
        for e, p, q in zip(comp, ps, qs):
            D = matmul(p, q.T).ravel()[:e.numel]
            avg[e.offset:e.offset + e.numel] = D
            g[e.offset:e.offset + e.numel] = D * dt.type(P)
    memory[key] = qs if warm_start else None  # [] for a bucket with nothing to compress: no new draw next step
    return avg, g


def _ring_size(n: int, P: int) -> int:
    """Values a ring allreduce of n values moves here: n rounded up to a multiple of P (see :func:`_allreduce`)."""
    return -(-int(n) // P) * P


def _padded_ring(rank: int, P: int, x: np.ndarray, value_bytes: int):
    """Ring allreduce (sum) of x zero-padded to a multiple of P values; returns the sum of the first len(x)."""
    n = x.shape[0]
    m = _ring_size(n, P)
    if m != n:
        x = np.concatenate([x, np.zeros((m - n,) + x.shape[1:], dtype=x.dtype)])
    out = yield from C.ring_allreduce(rank, P, x, value_bytes)
    return out[:n]


def _allreduce(spec, rank: int, P: int):
    """x -> the sans-I/O allreduce (sum) of ``spec.collective`` on x. The ring pads x with zeros to a multiple of P
    values: every chunk then has ceil(n / P) values and every rank ends the allreduce at the same time. That costs
    no time (each ring step is paced by its largest chunk, ceil(n / P) values, either way) and makes two allreduces
    in a row take exactly the sum of their times (unpadded, ranks that finish the first one early start the second
    early and save up to about 1e-5 of it), so the closed form stays exact; bytes on the wire grow by < P values
    per chunk round."""
    vb = spec.value_bytes
    if spec.collective == "recursive_doubling":
        return lambda x: C.rd_allreduce(rank, P, x, vb)
    return lambda x: _padded_ring(rank, P, x, vb)


class _BoolOption(Option):
    """An on/off option held as a bool: true / false, on / off or 1 / 0, as every on/off option of the registry
    (:func:`sim.algorithms.base.parse_switch`); anything else is a one-line ConfigError."""

    def check(self, algorithm, name, value):
        from sim.algorithms.base import parse_switch

        return parse_switch(value, f"{algorithm}.{name}")


class _ShapesOption(Option):
    """Tensor shapes (:func:`parse_shapes`): a sequence of shapes or a string such as "37x19, 37, 23x37, 23"."""

    def check(self, algorithm, name, value):
        return parse_shapes(value, f"{algorithm}.{name}")


#: PowerSGD's matrix views: one near-square matrix per segment (the simulator's default) or torch's hook's view of
#: every tensor as (shape[0], numel / shape[0]).
VARIANTS = ("square", "torch")


@register
class PowerSGD(Algorithm):
    """PowerSGD (Vogels et al. NeurIPS 2019, Algorithm 1) with error feedback and warm start, as torch's
    ``powerSGD_hook``: each segment's accumulator as one near-square rows x cols matrix (``variant = "square"``) or
    each of its tensors as (shape[0], numel / shape[0]) (``variant = "torch"``, torch's hook), compressed to
    P (rows x r) and Q (cols x r) by one power iteration, both allreduced (ring or recursive doubling);
    eps_p = acc_p - P Q^T."""

    name = "powersgd"
    collectives = ("ring", "recursive_doubling")
    sparse = False
    uses_seed = True
    cost_kinds = ("matmul", "scan", "reduce")  # the products' FLOPs and bytes (stage_work), the allreduces' additions
    summary = ("PowerSGD: rank-r power-iteration compression per segment matrix (near-square, or per tensor as torch's "
               "hook: variant), P and Q allreduced")
    source = ("Vogels, Karimireddy and Jaggi, NeurIPS 2019, Algorithm 1 (error feedback, warm start); "
              "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    options = {
        "rank": Option(1, "matrix approximation rank r (torch's matrix_approximation_rank)", int, lo=1),
        "start_iter": Option(0, "leading iterations of plain allreduce (torch's start_powerSGD_iter)", int, lo=0),
        "warm_start": _BoolOption(True, "reuse Q across steps (torch's warm_start)", bool),
        "orthogonalization_epsilon": Option(0.0, "added to each column norm in Gram-Schmidt", float, lo=0),
        "min_compression_rate": Option(2.0, "compress when r (rows + cols) rate < rows cols (torch's)", float, lo=0),
        "matrix_rows": Option(0, "rows of a segment's matrix view; 0: near-square (an exact divisor or padding)", int,
                              lo=0),
        "variant": Option("square", "square: each segment one near-square matrix; torch: each tensor as "
                                    "(shape[0], numel / shape[0]), torch's hook (needs shapes)", str, choices=VARIANTS),
        "shapes": _ShapesOption((), "variant torch: the model vector's tensor shapes in order, e.g. "
                                    "\"37x19, 37, 23x37, 23\" (the DDP hook fills them in)", tuple),
    }

    def check_spec(self, spec) -> None:
        """variant = "torch" needs ``shapes`` (and, with ``segments``, segments of whole tensors); ``shapes`` is used
        only by it and ``matrix_rows`` only by variant = "square". ConfigError (one line) otherwise."""
        given = dict(spec.options)
        torch_view = spec.opt("variant") == "torch"
        if torch_view and not spec.opt("shapes"):
            raise ConfigError("powersgd.variant = 'torch' needs powersgd.shapes, the model's tensor shapes in vector "
                              "order (e.g. \"37x19, 37, 23x37, 23\"; the DDP hook takes them from the model): valid "
                              "shapes, or variant = 'square'")
        if not torch_view and "shapes" in given:
            raise ConfigError(f"powersgd.shapes is set but powersgd.variant = {spec.opt('variant')!r} does not use it: "
                              "valid shapes only with variant = 'torch'")
        if torch_view and "matrix_rows" in given:
            raise ConfigError(f"powersgd.matrix_rows = {given['matrix_rows']} is set but powersgd.variant = 'torch' "
                              "views each tensor as (shape[0], numel / shape[0]): valid matrix_rows only with variant "
                              "= 'square'")
        if torch_view and spec.segments is not None:
            offs = set(_offsets(spec.opt("shapes")).tolist())
            ends = np.cumsum(spec.segments).tolist()
            if ends[-1] != max(offs):
                raise ConfigError(f"segments sum to {ends[-1]} but powersgd.shapes hold {max(offs)} elements: valid "
                                  "the shapes of the model's tensors")
            bad = [e for e in ends if e not in offs]
            if bad:
                raise ConfigError(f"segments end at element {bad[0]}, inside a tensor of powersgd.shapes "
                                  f"({len(offs) - 1} tensors, {max(offs)} elements): valid segments of whole tensors "
                                  "with variant = 'torch'")

    def plan(self, spec, n: int, lo: int | None = None) -> Plan:
        """The plan of the segment of n elements starting at element ``lo`` of the model vector under ``spec``'s
        options: variant "square", :func:`segment_plan` (one matrix; ``lo`` unused); variant "torch",
        :func:`tensor_plan` of the tensors of ``shapes`` covering [lo, lo + n) (ConfigError when they do not).
        ``lo`` None (the timing-only calls, which know a size, not a position): the whole model; with variant "torch"
        a size other than the shapes' total is a ConfigError (which tensors it holds is unknown: the layer-wise
        timeline prices DDP buckets by size)."""
        if spec.opt("variant") == "torch":
            shapes = spec.opt("shapes")
            total = int(_offsets(shapes)[-1])
            if lo is None and int(n) != total:
                raise ConfigError(f"powersgd.variant = 'torch' cannot price {int(n)} elements by size alone (its "
                                  f"shapes hold {total}; the layer-wise timeline prices each DDP bucket by its size): "
                                  "valid one DDP bucket for the whole model (a larger workload.bucket_cap_mb), "
                                  "workload.dense_policy = 'none', or variant = 'square'")
            return tensor_plan(shapes, 0 if lo is None else int(lo), int(n), spec.opt("rank"),
                               spec.opt("min_compression_rate"))
        return segment_plan(n, spec.opt("rank"), spec.opt("min_compression_rate"), spec.opt("matrix_rows"))

    def label_tags(self, spec):
        tags = [f"r{spec.opt('rank')}"] if spec.opt("rank") != 1 else []
        return tags + (["torch"] if spec.opt("variant") == "torch" else [])

    # ------------------------------------------------------------------ the DDP hook (sim.distributed.ddp_hooks)
    def hook_unit_options(self, options: dict, shapes) -> dict:
        """The options of one DDP-hook unit (its sgd_step): ``options`` (the hook's, a dict) with, for
        variant = "torch", ``shapes`` = the unit's tensor shapes (a tuple of shapes in the unit's order; None before
        the model is known: a one-tensor stand-in, to check the other options). Raises ConfigError when ``options``
        hold ``shapes`` themselves (the hook takes them from the model)."""
        if "shapes" in options:
            raise ConfigError("options shapes for the powersgd hook: valid none (the hook views each unit's tensors "
                              "by their own shapes)")
        if options.get("variant") == "torch":
            options["shapes"] = ((1,),) if shapes is None else tuple(shapes)
        return options

    def hook_unit_state(self, shared: dict, unit_state: dict, seed: int):
        """Lend the rank's ONE generator to a DDP-hook unit for its sgd_step: torch's hook draws every bucket's Q seed
        from its one ``state.rng`` in bucket order, as the simulator's segments share ``ctx.state["powersgd"]["rng"]``;
        the hook keeps a state per unit (its Q memory), so the generator lives in ``shared["rng"]`` (the hook's
        rank-wide state, checkpointed once; ``RandomState(seed)`` at first) and is put into ``unit_state`` here.
        Returns the function that takes it back out (call it after the step)."""
        rng = shared.get("rng")
        if rng is None:
            rng = shared["rng"] = np.random.RandomState(int(seed))
        mine = unit_state.setdefault("powersgd", {"q": {}})
        mine["rng"] = rng
        return lambda: mine.pop("rng", None)

    def unused_options(self, options, *, iterations, momentum):
        """start_iter >= iterations leaves no compressed iteration: every step is the plain allreduce, a dense run
        labelled powersgd (its rank, warm start and the other options unused)."""
        start = options.get("start_iter", 0)
        if start >= iterations:
            return {"start_iter": f"no iteration of the {iterations} would be compressed (each would be a plain "
                                  f"allreduce: a dense run labelled powersgd): valid start_iter < training.iterations "
                                  f"= {iterations}"}
        return {}

    # ------------------------------------------------------------------ numerics
    def exchange(self, spec, acc, k, ctx):
        n = acc.shape[0]
        allreduce = _allreduce(spec, ctx.rank, ctx.P)
        if ctx.iteration <= spec.opt("start_iter"):
            s = yield from allreduce(acc)
            return Exchange(s, np.zeros_like(acc), n, n)
        st = ctx.state.get("powersgd")
        if st is None:
            st = ctx.state["powersgd"] = {"rng": np.random.RandomState(spec.seed), "q": {}}
        if spec.opt("variant") == "torch" and int(_offsets(spec.opt("shapes"))[-1]) != ctx.d:
            raise ConfigError(f"powersgd.shapes hold {int(_offsets(spec.opt('shapes'))[-1])} elements but the model "
                              f"vector has d = {ctx.d}: valid the shapes of the model's tensors")
        plan = self.plan(spec, n, ctx.lo)
        avg, g = yield from powersgd_bucket(
            ctx.rank, ctx.P, acc, plan, st["q"], ctx.segment, st["rng"],
            epsilon=spec.opt("orthogonalization_epsilon"), warm_start=spec.opt("warm_start"), allreduce=allreduce,
            value_bytes=spec.value_bytes)
        sent = plan.u_size + plan.p_size + plan.q_size
        return Exchange(g, acc - avg, sent, sent)

    # ------------------------------------------------------------------ timing only (vectorised)
    def fast_rounds(self, spec, P, d, it, G):
        from sim.algorithms.base import AlgorithmSpec, get

        dense = get("dense")
        dspec = AlgorithmSpec(dense.name, collective=spec.collective, value_bytes=spec.value_bytes)
        ring = spec.collective == "ring"

        def allreduce(n):
            return dense.fast_rounds(dspec, P, _ring_size(n, P) if ring else n, it, G)

        plan = self.plan(spec, d)
        comp = plan.compressed  # the operations of powersgd_bucket, in its order
        stages = stage_work(plan, spec.value_bytes)
        for kind, work in stages[0]:
            yield V.Work(kind, work)
        if plan.uncompressed:
            yield from allreduce(plan.u_size)
        if comp:
            yield from allreduce(plan.p_size)
            for kind, work in stages[1]:
                yield V.Work(kind, work)
            yield from allreduce(plan.q_size)
            for kind, work in stages[2]:
                yield V.Work(kind, work)

    def compression_work(self, spec, d_b, k_b):
        """The three stages of :func:`stage_work` on the plan of a d_b-element segment (:meth:`plan`), in order:
        matmul FLOPs and scan bytes of the orthogonalisations and the products M Q, M^T P, P Q^T (k_b unused:
        PowerSGD has no k). The numerics and :meth:`fast_rounds` charge the stages between the allreduces; the
        iteration timeline charges their sum before the bucket's collective (one stream: the same total)."""
        return tuple(op for stage in stage_work(self.plan(spec, d_b), spec.value_bytes) for op in stage)

    def closed_form_s(self, spec, P, d, alpha, beta, cluster=None):
        from sim.comm import costs

        plan = self.plan(spec, d)
        t = 0.0
        if plan.uncompressed:  # one allreduce of the uncompressed values (r = 0)
            t += costs.powersgd_time(P, plan.u_size, plan.u_size, 1, 0, alpha, beta, spec.value_bytes, spec.collective)
        if plan.compressed:  # the P and Q allreduces of all compressed tensors together
            t += costs.powersgd_time(P, d, plan.p_size, plan.q_size, 1, alpha, beta, spec.value_bytes, spec.collective)
        return t

    def payload_bytes(self, spec, numel, k):
        plan = self.plan(spec, numel)
        return (plan.u_size + plan.p_size + plan.q_size) * spec.value_bytes
