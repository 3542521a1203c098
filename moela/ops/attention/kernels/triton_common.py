"""What the Triton flash-attention kernels share: launch table, head-dim split, and the @triton.jit helpers for tile
loads, scores, masks, ALiBi terms and the per-program prologue.

Kernels (triton_forward.py, triton_backward.py): the forward runs one program per (query block, head) of the
work list, an online softmax in base 2 with fp32 accumulation, and writes out [Tq, H, Dv] and lse [H, Tq] (natural
log, -inf for a query that sees no key). The backward's preprocess computes `delta = rowsum(dO * O) - dlse` (the
only place the lse gradient enters); then one program per key block accumulates dk and dv over query blocks and one
per query block accumulates dq over key blocks. Recomputing the scores in both costs one extra QK^T and dO V^T but
needs no atomics: gradients are deterministic (a fused backward with fp32 dq atomics measured slower and was
removed).

Programs are launched over a work list (worklist.py): every document's blocks, costliest first, heads fastest, so
packed batches of short documents launch no empty programs and the longest blocks start first.

Decisions:
- Dqk is split into a power-of-two main part and a remainder (192 = 128 + 64), each its own `tl.dot`, so MLA pays no
  padding in QK^T; Dv (a power of two in practice) is padded to the next power of two with masked loads only.
- Each block loop runs in two phases: blocks that need no mask (inside the document and below the causal diagonal)
  and the few that do; the mask costs nothing on the former.
- Causal alignment is bottom-right: query i of a document sits at key position i + q_shift, q_shift = Lk - Lq, and
  sees key j when j <= i + q_shift.
- ALiBi bias `-slope * |i' - j|` (i' = i + q_shift) is computed from indices, never materialized. Causal: every
  visible key has j <= i', so for any pivot the bias splits into a column and a row term,
  `slope * (j - pivot) - slope * (i' - pivot)`. Softmax ignores a constant per row: the scores get only the column
  term, folded into the scale multiply (an FMA, no extra op per score in the forward; one add per score in the
  backward), and the row term is applied once per row: the forward subtracts it from the lse it writes (still the
  true log-sum-exp of the biased scores), the backward adds it to the lse it loads. The pivot is the middle of the
  program's query block (key block in dk/dv); a key block's column terms are the program's `slope * n` (n < BLOCK_N)
  plus one scalar that goes onto the row maxima / lse. Position differences are exact (int32, then float below
  2^24) and rounded once; scores near the diagonal carry an offset of at most `slope * BLOCK / 2` (log2), i.e. ~2^-24
  relative error, far below bf16. Full attention keeps the exact `|i' - j|` per score, positions converted to float
  per row / column (an int -> float conversion per score costs the forward two thirds of its speed).
- Under TRITON_INTERPRET=1 bf16 tiles are upcast to fp32 (the interpreter's bf16 `tl.dot` returns garbage) and small
  blocks are used. On GPU the block shapes are a fixed table (`CONFIGS`) from bench/attention.py's sweep, not
  autotuned at run time: no first-step stall, and every rank runs the same kernels.

Shapes: Tq / Tk tokens, H heads, Dqk query/key head dim, Dv value head dim, N documents; BM / BN block rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.attention.kernels.worklist import cached_worklist
from moela.ops.triton_env import INTERPRET, require_interpreter_support

require_interpreter_support()

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# Launch configuration per kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages) by head-dim class: "narrow"
# (Dqk + Dv <= 256, e.g. 128/128), "wide" (<= 320: MLA's 192/128, tuned), "xwide" (up to 256/256: smaller
# tiles so the shared memory fits).
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


def launch_grid(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, n_tokens: int, heads: int, block: int, *,
                key_blocks: bool, causal: bool) -> tuple[tuple[int], dict]:
    """(grid, the kernel's work-list arguments ITEMS, n_items, n_heads): one program per (work-list entry, head);
    the list covers the k side's blocks when `key_blocks`, else the q side's (n_tokens: Tk or Tq)."""
    items = cached_worklist(cu_seqlens_q, cu_seqlens_k, n_tokens, block, key_blocks=key_blocks, causal=causal)
    n_items = items.shape[1]
    return (n_items * heads,), dict(ITEMS=items, n_items=n_items, n_heads=heads)


def head_dim_blocks(d_qk: int, d_v: int) -> dict:
    """Dqk as a power-of-two main block plus a remainder block (HAS_D_REST), and Dv padded to a power of two."""
    block_d_main = 1 << (d_qk.bit_length() - 1)  # largest power of two <= Dqk
    rest = d_qk - block_d_main
    block_d_rest = triton.next_power_of_2(rest) if rest else 16
    return dict(BLOCK_D_MAIN=block_d_main, BLOCK_D_REST=block_d_rest, HAS_D_REST=rest > 0,
                BLOCK_DV=triton.next_power_of_2(d_v))


@triton.jit
def _load_rows(ptr, offs_t, n_rows, stride_t, offs_d, n_cols, UPCAST: tl.constexpr):
    """A [rows, cols] tile of a [T, H, D] tensor (ptr already offset to the document and head); zero outside."""
    x = tl.load(ptr + offs_t[:, None] * stride_t + offs_d[None, :],
                mask=(offs_t[:, None] < n_rows) & (offs_d[None, :] < n_cols), other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _load_split_rows(ptr, offs_t, n_rows, stride_t, D_QK, HAS_D_REST: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_D_MAIN: tl.constexpr, BLOCK_D_REST: tl.constexpr):
    """A q or k tile as (main [rows, D_MAIN], rest [rows, D_REST]); rest is main when Dqk has no remainder."""
    main = _load_rows(ptr, offs_t, n_rows, stride_t, tl.arange(0, BLOCK_D_MAIN), D_QK, UPCAST)
    rest = main
    if HAS_D_REST:
        rest = _load_rows(ptr, offs_t, n_rows, stride_t, BLOCK_D_MAIN + tl.arange(0, BLOCK_D_REST), D_QK, UPCAST)
    return main, rest


@triton.jit
def _store_rows(ptr, x, offs_t, n_rows, stride_t, offs_d, n_cols):
    """Stores a [rows, cols] fp32 tile into a [T, H, D] tensor (ptr offset to the document and head) in its dtype."""
    tl.store(ptr + offs_t[:, None] * stride_t + offs_d[None, :], x.to(ptr.dtype.element_ty),
             mask=(offs_t[:, None] < n_rows) & (offs_d[None, :] < n_cols))


@triton.jit
def _work_item(ITEMS, n_items, n_heads):
    """(document, block index, head) of this program; document -1: nothing to do. The grid is n_items * H programs
    over the work list ITEMS [2, n_items] (worklist.py), heads fastest, so the costliest block starts on every head
    first."""
    pid = tl.program_id(0)
    head = pid % n_heads
    item = pid // n_heads
    doc = tl.load(ITEMS + item)
    block = tl.load(ITEMS + n_items + item)
    return doc, block, head


@triton.jit
def _doc_span(CU_Q, CU_K, doc):
    """Document doc's first row and length on the q side and on the k side."""
    q_start = tl.load(CU_Q + doc).to(tl.int64)
    q_len = tl.load(CU_Q + doc + 1) - q_start
    k_start = tl.load(CU_K + doc).to(tl.int64)
    k_len = tl.load(CU_K + doc + 1) - k_start
    return q_start, q_len, k_start, k_len


@triton.jit
def _scores(a_main, a_rest, b_main, b_rest, HAS_D_REST: tl.constexpr):
    """a [R, Dqk] @ b [C, Dqk]^T, Dqk split into two dots."""
    scores = tl.dot(a_main, tl.trans(b_main))
    if HAS_D_REST:
        scores = tl.dot(a_rest, tl.trans(b_rest), scores)
    return scores


@triton.jit
def _mask_and_bias(scores, q_pos, k_pos, k_len, slope, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr,
                   MASK: tl.constexpr):
    """scores [R, C] in the log2 domain; q_pos [R, 1] query positions on the k side, k_pos [1, C] key positions."""
    if HAS_ALIBI:
        scores = scores - slope * tl.abs(q_pos.to(tl.float32) - k_pos.to(tl.float32))
    if MASK:
        keep = k_pos < k_len
        if CAUSAL:
            keep = keep & (k_pos <= q_pos)
        scores = tl.where(keep, scores, float("-inf"))
    return scores


@triton.jit
def _alibi_term(pos, pivot, slope):
    """slope * (pos - pivot) for integer positions pos (< 2^31): a column or row term of causal ALiBi's bias (module
    docstring). The difference is exact in int32 and in float (below 2^24), rounded once by the multiply."""
    return slope * (tl.cast(pos, tl.int32) - tl.cast(pivot, tl.int32)).to(tl.float32)


@triton.jit
def _alibi_setup(SLOPES, head, HAS_ALIBI: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """(slope in log2 units, alibi_cols [BN]): causal ALiBi's column terms `slope * n` of a key block's n-th key
    relative to the block's first key; zeros without causal ALiBi."""
    slope = 0.0
    alibi_cols = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + head) * LOG2E
        if CAUSAL:
            alibi_cols = slope * tl.arange(0, BLOCK_N).to(tl.float32)
    return slope, alibi_cols


@triton.jit
def _key_range(start_m, q_shift, k_len, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keys a query block [start_m, start_m + BM) sees: [0, n_full) in whole blocks that need no mask, then
    [n_full, end) the blocks that do (the causal diagonal and the document's last partial block)."""
    if CAUSAL:
        end = tl.maximum(tl.minimum(k_len, start_m + BLOCK_M + q_shift), 0)
        n_full = tl.maximum(tl.minimum(k_len, start_m + q_shift + 1), 0) // BLOCK_N * BLOCK_N
    else:
        end = k_len
        n_full = k_len // BLOCK_N * BLOCK_N
    return n_full, end
