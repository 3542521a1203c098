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

import math
import os

import torch
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


@triton.jit
def _fwd_inner(acc, l_i, m_i, q1, q2, k_base, v_base, stride_kt, stride_vt, lo, hi, offs_m, diag, lk, slope,
               r0, ar, qk_scale, D_QK, D_V, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK: tl.constexpr,
               HAS_D2: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr,
               BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr):
    if _INTERP:
        start_n = lo
        while start_n < hi:
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q1, q2, k_base, v_base, stride_kt, stride_vt, start_n, offs_m,
                                      diag, lk, slope, r0, ar, qk_scale, D_QK, D_V, CAUSAL, HAS_ALIBI, MASK, HAS_D2,
                                      UPCAST, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV)
            start_n += BLOCK_N
    else:
        for start_n in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q1, q2, k_base, v_base, stride_kt, stride_vt, start_n, offs_m,
                                      diag, lk, slope, r0, ar, qk_scale, D_QK, D_V, CAUSAL, HAS_ALIBI, MASK, HAS_D2,
                                      UPCAST, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV)
    return acc, l_i, m_i


@triton.jit
def _fwd_step(acc, l_i, m_i, q1, q2, k_base, v_base, stride_kt, stride_vt, start_n, offs_m, diag, lk, slope, r0,
              ar, qk_scale, D_QK, D_V, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK: tl.constexpr,
              HAS_D2: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr,
              BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One key block [start_n, start_n + BN) of the online softmax. Causal ALiBi: the column term of key
    start_n + n is ar[n] + g; ar [BN] is the program's, the block's g is moved onto the row maximum (two adds a row).
    m_i then holds the row maxima of the scores plus their row terms."""
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k1 = _load_rows(k_base, offs_n, lk, stride_kt, offs_d1, D_QK, UPCAST)  # [BN, D1]
    k2 = k1
    if HAS_D2:
        k2 = _load_rows(k_base, offs_n, lk, stride_kt, offs_d2, D_QK, UPCAST)  # [BN, D2]
    if HAS_ALIBI and CAUSAL:
        s = _scores(q1, q2, k1, k2, HAS_D2) * qk_scale + ar[None, :]  # [BM, BN]
        s = _mask_and_bias(s, (offs_m + diag)[:, None], offs_n[None, :], lk, slope, CAUSAL, False, MASK)
        g = _alibi_term(start_n, r0, slope)
        m_new = tl.maximum(m_i, tl.max(s, 1) + g)
        p = tl.exp2(s - (m_new - g)[:, None])  # [BM, BN]
    else:
        s = _scores(q1, q2, k1, k2, HAS_D2) * qk_scale  # [BM, BN]
        s = _mask_and_bias(s, (offs_m + diag)[:, None], offs_n[None, :], lk, slope, CAUSAL, HAS_ALIBI, MASK)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])  # [BM, BN]
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_rows(v_base, offs_n, lk, stride_vt, offs_dv, D_V, UPCAST)  # [BN, Dv]
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, CU_Q, CU_K, SLOPES, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                stride_vh, stride_ot, stride_oh, stride_lh, qk_scale, D_QK: tl.constexpr, D_V: tl.constexpr,
                CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_D2: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
                BLOCK_DV: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest causal rows first
    h = tl.program_id(1)
    b = tl.program_id(2)
    q0, lq, k0, lk = _doc_span(CU_Q, CU_K, b)
    start_m = pid_m * BLOCK_M
    if start_m >= lq:
        return
    diag = lk - lq
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q_base = Q + q0 * stride_qt + h * stride_qh
    q1 = _load_rows(q_base, offs_m, lq, stride_qt, tl.arange(0, BLOCK_D1), D_QK, UPCAST)  # [BM, D1]
    q2 = q1
    if HAS_D2:
        q2 = _load_rows(q_base, offs_m, lq, stride_qt, BLOCK_D1 + tl.arange(0, BLOCK_D2), D_QK, UPCAST)
    slope = 0.0
    r0 = start_m + diag + BLOCK_M // 2  # ALiBi's split point (_alibi_term): the middle of the query block
    ar = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h) * LOG2E
        if CAUSAL:
            ar = slope * tl.arange(0, BLOCK_N).to(tl.float32)
    k_base = K + k0 * stride_kt + h * stride_kh
    v_base = V + k0 * stride_vt + h * stride_vh
    if CAUSAL:
        hi = tl.maximum(tl.minimum(lk, start_m + BLOCK_M + diag), 0)
        n_full = tl.maximum(tl.minimum(lk, start_m + diag + 1), 0) // BLOCK_N * BLOCK_N
    else:
        hi = lk
        n_full = lk // BLOCK_N * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e38, dtype=tl.float32)  # finite: a fully masked row keeps exp2(-inf - m) = 0
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q1, q2, k_base, v_base, stride_kt, stride_vt, 0, n_full, offs_m,
                               diag, lk, slope, r0, ar, qk_scale, D_QK, D_V, CAUSAL, HAS_ALIBI, False, HAS_D2, UPCAST,
                               BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q1, q2, k_base, v_base, stride_kt, stride_vt, n_full, hi, offs_m,
                               diag, lk, slope, r0, ar, qk_scale, D_QK, D_V, CAUSAL, HAS_ALIBI, True, HAS_D2, UPCAST,
                               BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]  # [BM, Dv]
    lse2 = m_i + tl.log2(tl.where(empty, 1.0, l_i))  # [BM]
    if HAS_ALIBI and CAUSAL:
        lse2 -= _alibi_term(offs_m + diag, r0, slope)  # the row term, once per row
    lse = tl.where(empty, float("-inf"), lse2 * LN2)  # [BM]
    offs_dv = tl.arange(0, BLOCK_DV)
    _store_rows(O + q0 * stride_ot + h * stride_oh, out, offs_m, lq, stride_ot, offs_dv, D_V)
    tl.store(LSE + h * stride_lh + q0 + offs_m, lse, mask=offs_m < lq)


@triton.jit
def _bwd_preprocess_kernel(O, DO, DLSE, DELTA, stride_ot, stride_oh, stride_dot, stride_doh, stride_lh, T, D_V,
                           HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """DELTA[h, t] = sum_d dO[t, h, d] * O[t, h, d] - dlse[h, t]."""
    h = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    mask = (offs_t[:, None] < T) & (offs_d[None, :] < D_V)
    o = tl.load(O + h * stride_oh + offs_t[:, None].to(tl.int64) * stride_ot + offs_d[None, :], mask=mask,
                other=0.0)
    do = tl.load(DO + h * stride_doh + offs_t[:, None].to(tl.int64) * stride_dot + offs_d[None, :], mask=mask,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # [BM]
    if HAS_DLSE:
        delta -= tl.load(DLSE + h * stride_lh + offs_t, mask=offs_t < T, other=0.0)
    tl.store(DELTA + h * stride_lh + offs_t, delta, mask=offs_t < T)


@triton.jit
def _dkdv_inner(dk1, dk2, dv, k1, k2, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, lo, hi,
                offs_n, diag, lq, slope, r0, kcol, qk_scale, D_QK, D_V, CAUSAL: tl.constexpr,
                HAS_ALIBI: tl.constexpr, MASK: tl.constexpr, HAS_D2: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Transposed formulation: rows are keys [BN], columns queries [BM]. MASK is the causal mask only: rows of keys
    past the document are computed from zero-filled loads and never stored."""
    if _INTERP:
        start_m = lo
        while start_m < hi:
            dk1, dk2, dv = _dkdv_step(dk1, dk2, dv, k1, k2, v, q_base, do_base, lse_base, delta_base, stride_qt,
                                      stride_dot, start_m, offs_n, diag, lq, slope, r0, kcol, qk_scale, D_QK, D_V,
                                      CAUSAL, HAS_ALIBI, MASK, HAS_D2, UPCAST, BLOCK_M, BLOCK_D1, BLOCK_D2, BLOCK_DV)
            start_m += BLOCK_M
    else:
        for start_m in range(lo, hi, BLOCK_M):
            dk1, dk2, dv = _dkdv_step(dk1, dk2, dv, k1, k2, v, q_base, do_base, lse_base, delta_base, stride_qt,
                                      stride_dot, start_m, offs_n, diag, lq, slope, r0, kcol, qk_scale, D_QK, D_V,
                                      CAUSAL, HAS_ALIBI, MASK, HAS_D2, UPCAST, BLOCK_M, BLOCK_D1, BLOCK_D2, BLOCK_DV)
    return dk1, dk2, dv


@triton.jit
def _dkdv_step(dk1, dk2, dv, k1, k2, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, start_m,
               offs_n, diag, lq, slope, r0, kcol, qk_scale, D_QK, D_V, CAUSAL: tl.constexpr,
               HAS_ALIBI: tl.constexpr, MASK: tl.constexpr, HAS_D2: tl.constexpr, UPCAST: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One query block [start_m, start_m + BM) of dk / dv. Causal ALiBi: kcol [BN] holds the keys' column terms
    (_alibi_term), fixed for the program; the queries' row terms join their lse."""
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q1 = _load_rows(q_base, offs_m, lq, stride_qt, offs_d1, D_QK, UPCAST)  # [BM, D1]
    q2 = q1
    if HAS_D2:
        q2 = _load_rows(q_base, offs_m, lq, stride_qt, offs_d2, D_QK, UPCAST)  # [BM, D2]
    qpos = (offs_m + diag)[None, :]
    kpos = offs_n[:, None]
    if HAS_ALIBI and CAUSAL:
        lse2 = tl.load(lse_base + offs_m, mask=offs_m < lq, other=0.0) * LOG2E  # [BM]
        lse2 += _alibi_term(offs_m + diag, r0, slope)
        st = _scores(k1, k2, q1, q2, HAS_D2) * qk_scale + kcol[:, None]  # [BN, BM]
    else:
        lse2 = tl.load(lse_base + offs_m, mask=offs_m < lq, other=0.0) * LOG2E  # [BM]
        st = _scores(k1, k2, q1, q2, HAS_D2) * qk_scale  # [BN, BM]
        if HAS_ALIBI:
            st = st - slope * tl.abs(qpos.to(tl.float32) - kpos.to(tl.float32))
    pt = tl.exp2(st - lse2[None, :])  # [BN, BM]
    if MASK:
        pt = tl.where(kpos <= qpos, pt, 0.0)
    do = _load_rows(do_base, offs_m, lq, stride_dot, offs_dv, D_V, UPCAST)  # [BM, Dv]
    dv = tl.dot(pt.to(do.dtype), do, dv)
    delta = tl.load(delta_base + offs_m, mask=offs_m < lq, other=0.0)  # [BM]
    dpt = tl.dot(v, tl.trans(do))  # [BN, BM]
    dst = (pt * (dpt - delta[None, :])).to(q1.dtype)
    dk1 = tl.dot(dst, q1, dk1)
    if HAS_D2:
        dk2 = tl.dot(dst, q2, dk2)
    return dk1, dk2, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, SLOPES, stride_qt, stride_qh, stride_kt,
                     stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt,
                     stride_dvh, stride_lh, qk_scale, sm_scale, D_QK: tl.constexpr, D_V: tl.constexpr,
                     CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_D2: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
                     BLOCK_DV: tl.constexpr):
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q0, lq, k0, lk = _doc_span(CU_Q, CU_K, b)
    start_n = pid_n * BLOCK_N
    if start_n >= lk:
        return
    diag = lk - lq
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_base = K + k0 * stride_kt + h * stride_kh
    k1 = _load_rows(k_base, offs_n, lk, stride_kt, offs_d1, D_QK, UPCAST)  # [BN, D1]
    k2 = k1
    if HAS_D2:
        k2 = _load_rows(k_base, offs_n, lk, stride_kt, offs_d2, D_QK, UPCAST)  # [BN, D2]
    v = _load_rows(V + k0 * stride_vt + h * stride_vh, offs_n, lk, stride_vt, offs_dv, D_V, UPCAST)  # [BN, Dv]
    slope = 0.0
    r0 = start_n + BLOCK_N // 2  # ALiBi's split point (_alibi_term): the middle of the key block
    kcol = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h) * LOG2E
        if CAUSAL:
            kcol = _alibi_term(offs_n, r0, slope)
    q_base = Q + q0 * stride_qt + h * stride_qh
    do_base = DO + q0 * stride_dot + h * stride_doh
    lse_base = LSE + h * stride_lh + q0
    delta_base = DELTA + h * stride_lh + q0
    if CAUSAL:
        lo = tl.maximum(start_n - diag, 0) // BLOCK_M * BLOCK_M
        mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M
        mid = tl.minimum(tl.maximum(mid, lo), lq)
    else:
        lo = 0
        mid = 0
    dk1 = tl.zeros([BLOCK_N, BLOCK_D1], dtype=tl.float32)
    dk2 = tl.zeros([BLOCK_N, BLOCK_D2], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    dk1, dk2, dv = _dkdv_inner(dk1, dk2, dv, k1, k2, v, q_base, do_base, lse_base, delta_base, stride_qt,
                               stride_dot, lo, mid, offs_n, diag, lq, slope, r0, kcol, qk_scale, D_QK, D_V,
                               CAUSAL, HAS_ALIBI, True, HAS_D2, UPCAST, BLOCK_M, BLOCK_D1, BLOCK_D2, BLOCK_DV)
    dk1, dk2, dv = _dkdv_inner(dk1, dk2, dv, k1, k2, v, q_base, do_base, lse_base, delta_base, stride_qt,
                               stride_dot, mid, lq, offs_n, diag, lq, slope, r0, kcol, qk_scale, D_QK, D_V,
                               CAUSAL, HAS_ALIBI, False, HAS_D2, UPCAST, BLOCK_M, BLOCK_D1, BLOCK_D2, BLOCK_DV)
    dk_base = DK + k0 * stride_dkt + h * stride_dkh
    _store_rows(dk_base, dk1 * sm_scale, offs_n, lk, stride_dkt, offs_d1, D_QK)
    if HAS_D2:
        _store_rows(dk_base, dk2 * sm_scale, offs_n, lk, stride_dkt, offs_d2, D_QK)
    _store_rows(DV + k0 * stride_dvt + h * stride_dvh, dv, offs_n, lk, stride_dvt, offs_dv, D_V)


@triton.jit
def _dq_inner(dq1, dq2, q1, q2, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, lo, hi, offs_m, diag, lk,
              slope, r0, ar, qk_scale, D_QK, D_V, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK: tl.constexpr,
              HAS_D2: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr,
              BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr):
    if _INTERP:
        start_n = lo
        while start_n < hi:
            dq1, dq2 = _dq_step(dq1, dq2, q1, q2, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, start_n,
                                offs_m, diag, lk, slope, r0, ar, qk_scale, D_QK, D_V, CAUSAL, HAS_ALIBI, MASK, HAS_D2,
                                UPCAST, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV)
            start_n += BLOCK_N
    else:
        for start_n in range(lo, hi, BLOCK_N):
            dq1, dq2 = _dq_step(dq1, dq2, q1, q2, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, start_n,
                                offs_m, diag, lk, slope, r0, ar, qk_scale, D_QK, D_V, CAUSAL, HAS_ALIBI, MASK, HAS_D2,
                                UPCAST, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV)
    return dq1, dq2


@triton.jit
def _dq_step(dq1, dq2, q1, q2, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, start_n, offs_m, diag, lk,
             slope, r0, ar, qk_scale, D_QK, D_V, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK: tl.constexpr,
             HAS_D2: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr,
             BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One key block [start_n, start_n + BN) of dq. Causal ALiBi: lse2 includes the row terms; the column term of key
    start_n + n is ar[n] + g, the block's g moved onto lse2 (one add a row)."""
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k1 = _load_rows(k_base, offs_n, lk, stride_kt, offs_d1, D_QK, UPCAST)  # [BN, D1]
    k2 = k1
    if HAS_D2:
        k2 = _load_rows(k_base, offs_n, lk, stride_kt, offs_d2, D_QK, UPCAST)  # [BN, D2]
    qpos = (offs_m + diag)[:, None]
    kpos = offs_n[None, :]
    if HAS_ALIBI and CAUSAL and MASK:
        s = _scores(q1, q2, k1, k2, HAS_D2) * qk_scale + _alibi_term(offs_n, r0, slope)[None, :]  # [BM, BN]
        p = tl.exp2(s - lse2[:, None])  # [BM, BN]
    elif HAS_ALIBI and CAUSAL:
        s = _scores(q1, q2, k1, k2, HAS_D2) * qk_scale + ar[None, :]  # [BM, BN]
        p = tl.exp2(s - (lse2 - _alibi_term(start_n, r0, slope))[:, None])  # [BM, BN]
    else:
        s = _scores(q1, q2, k1, k2, HAS_D2) * qk_scale  # [BM, BN]
        if HAS_ALIBI:
            s = s - slope * tl.abs(qpos.to(tl.float32) - kpos.to(tl.float32))
        p = tl.exp2(s - lse2[:, None])  # [BM, BN]
    if MASK:
        keep = kpos < lk
        if CAUSAL:
            keep = keep & (kpos <= qpos)
        p = tl.where(keep, p, 0.0)
    v = _load_rows(v_base, offs_n, lk, stride_vt, offs_dv, D_V, UPCAST)  # [BN, Dv]
    dp = tl.dot(do, tl.trans(v))  # [BM, BN]
    ds = (p * (dp - delta[:, None])).to(k1.dtype)
    dq1 = tl.dot(ds, k1, dq1)
    if HAS_D2:
        dq2 = tl.dot(ds, k2, dq2)
    return dq1, dq2


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K, SLOPES, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_vt, stride_vh, stride_dot, stride_doh, stride_dqt, stride_dqh, stride_lh, qk_scale,
                   sm_scale, D_QK: tl.constexpr, D_V: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_ALIBI: tl.constexpr, HAS_D2: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q0, lq, k0, lk = _doc_span(CU_Q, CU_K, b)
    start_m = pid_m * BLOCK_M
    if start_m >= lq:
        return
    diag = lk - lq
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
    q_base = Q + q0 * stride_qt + h * stride_qh
    q1 = _load_rows(q_base, offs_m, lq, stride_qt, offs_d1, D_QK, UPCAST)  # [BM, D1]
    q2 = q1
    if HAS_D2:
        q2 = _load_rows(q_base, offs_m, lq, stride_qt, offs_d2, D_QK, UPCAST)  # [BM, D2]
    do = _load_rows(DO + q0 * stride_dot + h * stride_doh, offs_m, lq, stride_dot, tl.arange(0, BLOCK_DV), D_V,
                    UPCAST)  # [BM, Dv]
    lse = tl.load(LSE + h * stride_lh + q0 + offs_m, mask=offs_m < lq, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # a row that sees no key gets p = 0
    delta = tl.load(DELTA + h * stride_lh + q0 + offs_m, mask=offs_m < lq, other=0.0)
    slope = 0.0
    r0 = start_m + diag + BLOCK_M // 2  # as in the forward
    ar = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h) * LOG2E
        if CAUSAL:
            ar = slope * tl.arange(0, BLOCK_N).to(tl.float32)
            lse2 += _alibi_term(offs_m + diag, r0, slope)  # the row terms (a blind row's +inf stays +inf)
    k_base = K + k0 * stride_kt + h * stride_kh
    v_base = V + k0 * stride_vt + h * stride_vh
    if CAUSAL:
        hi = tl.maximum(tl.minimum(lk, start_m + BLOCK_M + diag), 0)
        n_full = tl.maximum(tl.minimum(lk, start_m + diag + 1), 0) // BLOCK_N * BLOCK_N
    else:
        hi = lk
        n_full = lk // BLOCK_N * BLOCK_N
    dq1 = tl.zeros([BLOCK_M, BLOCK_D1], dtype=tl.float32)
    dq2 = tl.zeros([BLOCK_M, BLOCK_D2], dtype=tl.float32)
    dq1, dq2 = _dq_inner(dq1, dq2, q1, q2, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, 0, n_full, offs_m,
                         diag, lk, slope, r0, ar, qk_scale, D_QK, D_V, CAUSAL, HAS_ALIBI, False, HAS_D2, UPCAST,
                         BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV)
    dq1, dq2 = _dq_inner(dq1, dq2, q1, q2, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, n_full, hi,
                         offs_m, diag, lk, slope, r0, ar, qk_scale, D_QK, D_V, CAUSAL, HAS_ALIBI, True, HAS_D2, UPCAST,
                         BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV)
    dq_base = DQ + q0 * stride_dqt + h * stride_dqh
    _store_rows(dq_base, dq1 * sm_scale, offs_m, lq, stride_dqt, offs_d1, D_QK)
    if HAS_D2:
        _store_rows(dq_base, dq2 * sm_scale, offs_m, lq, stride_dqt, offs_d2, D_QK)


def _dims(d_qk, d_v):
    block_d1 = 1 << (d_qk.bit_length() - 1)  # largest power of two <= Dqk
    rest = d_qk - block_d1
    block_d2 = triton.next_power_of_2(rest) if rest else 16
    return dict(BLOCK_D1=block_d1, BLOCK_D2=block_d2, HAS_D2=rest > 0, BLOCK_DV=triton.next_power_of_2(d_v))


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes):
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"triton mla_attention wants q, k, v of one dtype among float16/bfloat16/float32; got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] > 256 or v.shape[-1] > 256:
        raise ValueError(f"triton mla_attention supports head dims up to 256; got Dqk={q.shape[-1]}, "
                         f"Dv={v.shape[-1]} (use backend='reference')")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"triton mla_attention needs {name} contiguous in its last dim; call .contiguous()")
        if t.device != q.device:
            raise ValueError(f"triton mla_attention wants q, k, v on one device; got {name} on {t.device}, q on "
                             f"{q.device}")
    if cu_seqlens_q.numel() - 1 > MAX_GRID_YZ or q.shape[1] > MAX_GRID_YZ:
        raise ValueError(f"triton mla_attention launches one program row per head and document, at most "
                         f"{MAX_GRID_YZ} of each; got H={q.shape[1]}, {cu_seqlens_q.numel() - 1} documents (split the "
                         f"micro-batch)")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dtype != torch.int32 or t.device != q.device or not t.is_contiguous():
            raise TypeError(f"{name} must be a contiguous int32 tensor on {q.device}; got {t.dtype} on {t.device}"
                            f"{'' if t.is_contiguous() else ', strided'}")
    if alibi_slopes is not None and (alibi_slopes.dtype != torch.float32 or alibi_slopes.device != q.device
                                     or not alibi_slopes.is_contiguous()):
        raise TypeError(f"alibi_slopes must be a contiguous float32 tensor on {q.device}; got {alibi_slopes.dtype} "
                        f"on {alibi_slopes.device}{'' if alibi_slopes.is_contiguous() else ', strided'}")


def attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, *, causal, softmax_scale,
                      alibi_slopes):
    """Launches the forward kernel. Returns (out [Tq, H, Dv] in q's dtype, lse [H, Tq] float32)."""
    tq, h, d_qk = q.shape
    d_v = v.shape[-1]
    n_docs = cu_seqlens_q.numel() - 1
    out = torch.empty(tq, h, d_v, device=q.device, dtype=q.dtype)
    lse = torch.empty(h, tq, device=q.device, dtype=torch.float32)
    if tq == 0 or n_docs == 0:
        return out, lse
    slopes = alibi_slopes if alibi_slopes is not None else lse  # placeholder pointer when no ALiBi
    cfg = launch_config("fwd", d_qk, d_v)
    _fwd_kernel[(triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]), h, n_docs)](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, slopes, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0), softmax_scale * LOG2E.value,
        d_qk, d_v, CAUSAL=causal, HAS_ALIBI=alibi_slopes is not None,
        UPCAST=INTERPRET and q.dtype == torch.bfloat16, **_dims(d_qk, d_v), **cfg)
    return out, lse


def attention_backward(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                       causal, softmax_scale, alibi_slopes):
    """Launches preprocess, dk/dv and dq kernels. dout [Tq, H, Dv], dlse [H, Tq] or None -> (dq, dk, dv)."""
    tq, h, d_qk = q.shape
    d_v = v.shape[-1]
    n_docs = cu_seqlens_q.numel() - 1
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if k.shape[0]:
        dk.zero_()  # keys outside every document (none in a well-formed batch) get zero gradient
        dv.zero_()
    if tq == 0 or n_docs == 0:
        return dq.zero_(), dk, dv
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    delta = torch.empty_like(lse)  # [H, Tq]
    if dlse is not None:
        dlse = dlse.contiguous()
    dims = _dims(d_qk, d_v)
    _bwd_preprocess_kernel[(triton.cdiv(tq, 64), h)](
        out, dout, dlse if dlse is not None else delta, delta, out.stride(0), out.stride(1), dout.stride(0),
        dout.stride(1), delta.stride(0), tq, d_v, HAS_DLSE=dlse is not None, BLOCK_M=64,
        BLOCK_DV=dims["BLOCK_DV"])
    slopes = alibi_slopes if alibi_slopes is not None else delta
    flags = dict(CAUSAL=causal, HAS_ALIBI=alibi_slopes is not None,
                 UPCAST=INTERPRET and q.dtype == torch.bfloat16, **dims)
    common = (softmax_scale * LOG2E.value, softmax_scale, d_qk, d_v)
    cfg = launch_config("dkdv", d_qk, d_v)
    _bwd_dkdv_kernel[(triton.cdiv(max_seqlen_k, cfg["BLOCK_N"]), h, n_docs)](
        q, k, v, dout, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, slopes, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0), dout.stride(1), dk.stride(0),
        dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0), *common, **flags, **cfg)
    cfg = launch_config("dq", d_qk, d_v)
    _bwd_dq_kernel[(triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]), h, n_docs)](
        q, k, v, dout, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, slopes, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
        lse.stride(0), *common, **flags, **cfg)
    return dq, dk, dv


class _FlashMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                alibi_slopes):
        out, lse = attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal=causal,
                                     softmax_scale=softmax_scale, alibi_slopes=alibi_slopes)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
        ctx.args = (max_seqlen_q, max_seqlen_k, causal, softmax_scale)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
        max_seqlen_q, max_seqlen_k, causal, softmax_scale = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = attention_backward(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                                        alibi_slopes=alibi_slopes)
        return dq, dk, dv, None, None, None, None, None, None, None


@torch.compiler.disable
def flash_mla_attention(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k, *, causal=True,
                        softmax_scale=None, alibi_slopes=None, return_lse=False):
    """The `triton` backend of `mla_attention` (same arguments). Returns (out, lse); both differentiable.
    Opaque to torch.compile (a graph break): the launchers run eagerly, so a compiled model runs these kernels."""
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    for name, t, length in (("q", q, max_seqlen_q), ("k", k, max_seqlen_k), ("v", v, max_seqlen_k)):
        if length * max(t.stride(0), t.shape[1] * t.shape[2]) >= 2 ** 31:  # (the outputs are contiguous)
            raise ValueError(f"triton mla_attention addresses a document's rows with int32 offsets: {length} tokens "
                             f"x {name}'s row stride {t.stride(0)} exceed 2^31; split long documents or use context "
                             f"parallelism")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _FlashMLA.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, float(scale),
                           alibi_slopes)


def triton_supported(q, k, v, cu_seqlens_q, cu_seqlens_k, *, explicit=False, **_):
    """CUDA tensors with head dims up to 256: fp16/bf16 under `auto`, also fp32 (tf32 dots) when asked for by
    name. On CPU only under TRITON_INTERPRET=1 and only when asked for by name (tests)."""
    if q.shape[-1] > 256 or v.shape[-1] > 256:
        return False
    if not explicit:
        return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    return q.is_cuda or INTERPRET
