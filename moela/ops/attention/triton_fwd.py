"""Forward kernel of the Triton flash attention: online softmax over key blocks,
one program per (query block, head, document).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.attention.triton_common import (
    _INTERP,
    INTERPRET,
    LN2,
    LOG2E,
    _alibi_term,
    _dims,
    _doc_span,
    _load_rows,
    _mask_and_bias,
    _scores,
    _store_rows,
    launch_config,
)


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
