"""Triton flash attention for MLA over packed documents: Dqk != Dv, bottom-right causal, ALiBi, differentiable lse.

Forward: one program per (query block, head, document); online softmax in base 2 with fp32 accumulation; writes
out [Tq, H, Dv] and lse [H, Tq] (natural log, -inf for a query that sees no key). Backward: a preprocess kernel
computes `D = rowsum(dO * O) - dlse` (the lse gradient enters here and nowhere else), then one kernel per key
block accumulates dk and dv over query blocks and one kernel per query block accumulates dq over key blocks.
Recomputing the scores in both kernels costs one extra QK^T and dO V^T but needs no atomics: gradients are
deterministic.

Decisions:
- Dqk is split into a power-of-two part and a remainder (192 = 128 + 64), each its own `tl.dot`, so MLA pays no
  padding in QK^T; Dv (a power of two in practice) is padded to the next power of two with masked loads only.
- Each loop over blocks runs in two phases: blocks that need no mask (fully inside the document and below the
  causal diagonal) and the few that do; the mask costs nothing on the former.
- Causal alignment is bottom-right: query i of a document sees key j when j <= i + (Lk - Lq).
- ALiBi bias `-slope * |i' - j|`, i' = i + Lk - Lq the query's position on the k side, is computed from indices in
  the kernel, never materialized. Causal: every visible key has j <= i', so the bias splits, for any r0, into a
  column and a row term, `slope * (j - r0) - slope * (i' - r0)`. The row term moves all scores of a row by one
  constant, which softmax ignores: the scores get only the column term, folded into the scale multiply (an FMA
  instead of a multiply, so no extra op per score in the forward; one add per score in the backward kernels, whose
  bias and lse are then two terms), and the row term is applied once per row: the forward subtracts it from the lse
  it writes (still the true log-sum-exp of the biased scores), the backward adds it to the lse it loads. r0 is the
  middle of the program's query block (key block in dk/dv); a key block's column terms are the program's
  `slope * n` (n < BLOCK_N) plus one scalar that goes onto the row maxima / lse (two adds a row). Masked elements
  of diagonal blocks get the linear value and are masked as before. Position differences are exact (int32, then
  float below 2^24) and rounded once; scores near the diagonal carry an offset of up to `slope * BLOCK / 2`
  (log2), about 2^-24 of which is added error (~5e-6 at slope 1: fp32 softmax rounding, far below bf16).
  Full attention keeps the exact `|i' - j|` per score (not linear across the diagonal): positions are converted to
  float per row / column, then one subtract and one FMA per score (an int -> float conversion per score ran the
  forward at a third of its speed).
- Under TRITON_INTERPRET=1 bf16 tiles are upcast to fp32 (the interpreter's bf16 `tl.dot` returns garbage), small
  blocks are used, and the block loops, whose bounds are loaded from cu_seqlens, run as `while` loops (Triton 3.6's
  interpreter converts `range()` bounds with `int(array)`, which numpy >= 2.3 rejects); the compiled GPU code
  keeps `range()` loops, which Triton software-pipelines (tests/test_kernels_sm90.py checks for the async copies).
  On GPU the block shapes are a fixed table (`CONFIGS`) chosen by the benchmark's sweep, not
  autotuned at run time: no first-step stall, and every rank runs the same kernels.
- The public entry is opaque to torch.compile (`torch.compiler.disable`): a compiled model breaks its graph around
  attention and runs these kernels eagerly, rather than depending on Dynamo tracing user Triton kernels.

Shapes: Tq / Tk tokens, H heads, Dqk query/key head dim, Dv value head dim, N documents; BM / BN block rows.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERP = tl.constexpr(INTERPRET)
MAX_GRID_YZ = 65535  # CUDA's limit on grid dims y and z: heads go on y, documents on z


# Launch configuration per kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages) by head-dim class: "narrow"
# (Dqk + Dv <= 256, e.g. 128/128), "wide" (<= 320: MLA's 192/128, tuned), "xwide" (up to 256/256: smaller
# tiles so the shared memory fits). Chosen by bench/attention.py's sweep on the H200 (see bench/results/).
CONFIGS = {
    "fwd": {"narrow": (128, 64, 8, 3), "wide": (128, 64, 8, 3), "xwide": (64, 64, 4, 2)},
    "dkdv": {"narrow": (32, 128, 8, 3), "wide": (32, 128, 8, 3), "xwide": (32, 64, 4, 2)},
    "dq": {"narrow": (128, 64, 8, 3), "wide": (128, 64, 8, 3), "xwide": (64, 64, 4, 2)},
}
# Under the interpreter: small unequal blocks, so documents of a few hundred tokens cross several block edges.
INTERPRET_CONFIGS = {"fwd": (64, 32, 4, 1), "dkdv": (32, 64, 4, 1), "dq": (64, 32, 4, 1)}


def head_class(d_qk: int, d_v: int) -> str:
    return "narrow" if d_qk + d_v <= 256 else "wide" if d_qk + d_v <= 320 else "xwide"


def launch_config(kernel: str, d_qk: int, d_v: int) -> dict:
    bm, bn, warps, stages = INTERPRET_CONFIGS[kernel] if INTERPRET else CONFIGS[kernel][head_class(d_qk, d_v)]
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)


@triton.jit
def _load_rows(ptr, offs_t, n_rows, stride_t, offs_d, n_cols, UPCAST: tl.constexpr):
    """Loads a [rows, cols] tile of a [T, H, D] tensor (ptr already offset to the head); zero outside."""
    x = tl.load(ptr + offs_t[:, None] * stride_t + offs_d[None, :],
                mask=(offs_t[:, None] < n_rows) & (offs_d[None, :] < n_cols), other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _store_rows(ptr, x, offs_t, n_rows, stride_t, offs_d, n_cols):
    """Stores a [rows, cols] fp32 tile into a [T, H, D] tensor (ptr offset to the head) in its dtype; the inverse
    of _load_rows."""
    tl.store(ptr + offs_t[:, None] * stride_t + offs_d[None, :], x.to(ptr.dtype.element_ty),
             mask=(offs_t[:, None] < n_rows) & (offs_d[None, :] < n_cols))


@triton.jit
def _doc_span(CU_Q, CU_K, b):
    """Document b's first row and length on the q side and on the k side."""
    q0 = tl.load(CU_Q + b).to(tl.int64)
    lq = tl.load(CU_Q + b + 1) - q0
    k0 = tl.load(CU_K + b).to(tl.int64)
    lk = tl.load(CU_K + b + 1) - k0
    return q0, lq, k0, lk


@triton.jit
def _scores(a1, a2, b1, b2, HAS_D2: tl.constexpr):
    """a [R, Dqk] @ b [C, Dqk]^T with Dqk split into two dots."""
    s = tl.dot(a1, tl.trans(b1))
    if HAS_D2:
        s = tl.dot(a2, tl.trans(b2), s)
    return s


@triton.jit
def _mask_and_bias(s, qpos, kpos, lk, slope, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr,
                   MASK: tl.constexpr):
    """s [R, C] log2-domain scores; qpos [R, 1] query positions on the k side, kpos [1, C] key positions."""
    if HAS_ALIBI:
        s = s - slope * tl.abs(qpos.to(tl.float32) - kpos.to(tl.float32))
    if MASK:
        keep = kpos < lk
        if CAUSAL:
            keep = keep & (kpos <= qpos)
        s = tl.where(keep, s, float("-inf"))
    return s


@triton.jit
def _alibi_term(pos, r0, slope):
    """slope * (pos - r0) for integer positions pos (< 2^31): a column or row term of causal ALiBi's bias, split at
    the program's r0 (module docstring). The difference is exact in int32 and in float (below 2^24), rounded once
    by the multiply."""
    return slope * (pos.to(tl.int32) - r0.to(tl.int32)).to(tl.float32)


def _dims(d_qk, d_v):
    block_d1 = 1 << (d_qk.bit_length() - 1)  # largest power of two <= Dqk
    rest = d_qk - block_d1
    block_d2 = triton.next_power_of_2(rest) if rest else 16
    return dict(BLOCK_D1=block_d1, BLOCK_D2=block_d2, HAS_D2=rest > 0, BLOCK_DV=triton.next_power_of_2(d_v))
