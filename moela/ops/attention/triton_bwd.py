"""Backward kernels of the Triton flash attention: preprocess
(D = rowsum(dO * O) - dlse), dk/dv per key block, dq per query block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.attention.triton_common import (
    _INTERP,
    INTERPRET,
    LOG2E,
    _alibi_term,
    _dims,
    _doc_span,
    _load_rows,
    _scores,
    _store_rows,
    launch_config,
)


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
