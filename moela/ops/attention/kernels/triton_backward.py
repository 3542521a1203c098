"""Backward kernels of the Triton flash attention (decisions in triton_common.py) and their launchers: the
preprocess, and the `triton` kernels of the dK/dV and dQ phases (moela.ops.attention.phases).

Math, per document and head, with p_ij = exp(s_ij - lse_i) recomputed from q, k and the saved lse:
  delta_i = sum_d dO_id O_id - dlse_i           (preprocess; the lse gradient enters here only)
  dv_j = sum_i p_ij dO_i,   ds_ij = p_ij (dO_i . v_j - delta_i)
  dk_j = scale * sum_i ds_ij q_i,   dq_i = scale * sum_j ds_ij k_j
dk / dv: one program per key block looping over query blocks; dq: one program per query block looping over key
blocks. Both work in base 2 like the forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.attention.kernels.triton_common import (
    LOG2E,
    _alibi_setup,
    _alibi_term,
    _doc_span,
    _key_range,
    _load_rows,
    _load_split_rows,
    _scores,
    _store_rows,
    _work_item,
    head_dim_blocks,
    launch_config,
    launch_grid,
)
from moela.ops.triton_env import INTERPRET


@triton.jit
def _bwd_preprocess_kernel(
    Out, stride_ot, stride_oh,  # [Tq, H, Dv]
    DOut, stride_dot, stride_doh,  # [Tq, H, Dv]
    DLSE,  # [H, Tq] fp32 (read when HAS_DLSE)
    DELTA,  # [H, Tq] fp32, written
    stride_lh,  # head stride of DLSE and DELTA
    T, D_V,
    HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """DELTA[h, t] = sum_d dO[t, h, d] * O[t, h, d] - dlse[h, t]. Program (token block, head)."""
    head = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    mask = (offs_t[:, None] < T) & (offs_d[None, :] < D_V)
    rows = offs_t[:, None].to(tl.int64)
    out = tl.load(Out + head * stride_oh + rows * stride_ot + offs_d[None, :], mask=mask, other=0.0)
    dout = tl.load(DOut + head * stride_doh + rows * stride_dot + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(out.to(tl.float32) * dout.to(tl.float32), 1)  # [BM]
    if HAS_DLSE:
        delta -= tl.load(DLSE + head * stride_lh + offs_t, mask=offs_t < T, other=0.0)
    tl.store(DELTA + head * stride_lh + offs_t, delta, mask=offs_t < T)


@triton.jit
def _dkdv_query_blocks(dk_main, dk_rest, dv, k_main, k_rest, v, q_base, stride_qt, dout_base, stride_dot, lse_base,
                       delta_base, lo, hi, offs_n, q_shift, q_len, slope, alibi_pivot, alibi_keys, qk_scale, D_QK,
                       D_V, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK: tl.constexpr,
                       HAS_D_REST: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_D_MAIN: tl.constexpr, BLOCK_D_REST: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Accumulates dk, dv of one key block over the query blocks [lo, hi). Transposed tiles: rows are keys [BN],
    columns queries [BM]. MASK is the causal mask only: keys past the document are computed from zero-filled loads
    and never stored. Causal ALiBi: alibi_keys [BN] are the keys' column terms; the queries' row terms join their
    lse."""
    offs_dv = tl.arange(0, BLOCK_DV)
    k_pos = offs_n[:, None]
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_main, q_rest = _load_split_rows(q_base, offs_m, q_len, stride_qt, D_QK, HAS_D_REST, UPCAST, BLOCK_D_MAIN,
                                          BLOCK_D_REST)  # [BM, D_MAIN], [BM, D_REST]
        q_pos = (offs_m + q_shift)[None, :]
        # probabilities p^T [BN, BM] from the recomputed scores and the saved lse
        lse_log2 = tl.load(lse_base + offs_m, mask=offs_m < q_len, other=0.0) * LOG2E  # [BM]
        if HAS_ALIBI and CAUSAL:
            lse_log2 += _alibi_term(offs_m + q_shift, alibi_pivot, slope)
            scores_t = _scores(k_main, k_rest, q_main, q_rest, HAS_D_REST) * qk_scale + alibi_keys[:, None]
        else:
            scores_t = _scores(k_main, k_rest, q_main, q_rest, HAS_D_REST) * qk_scale
            if HAS_ALIBI:
                scores_t = scores_t - slope * tl.abs(q_pos.to(tl.float32) - k_pos.to(tl.float32))
        probs_t = tl.exp2(scores_t - lse_log2[None, :])
        if MASK:
            probs_t = tl.where(k_pos <= q_pos, probs_t, 0.0)
        # dv += p^T dO;  ds^T = p^T * (v dO^T - delta);  dk += ds^T q
        dout = _load_rows(dout_base, offs_m, q_len, stride_dot, offs_dv, D_V, UPCAST)  # [BM, Dv]
        dv = tl.dot(probs_t.to(dout.dtype), dout, dv)
        delta = tl.load(delta_base + offs_m, mask=offs_m < q_len, other=0.0)  # [BM]
        dprobs_t = tl.dot(v, tl.trans(dout))  # [BN, BM]
        dscores_t = (probs_t * (dprobs_t - delta[None, :])).to(q_main.dtype)
        dk_main = tl.dot(dscores_t, q_main, dk_main)
        if HAS_D_REST:
            dk_rest = tl.dot(dscores_t, q_rest, dk_rest)
    return dk_main, dk_rest, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, stride_qt, stride_qh,  # [Tq, H, Dqk]
    K, stride_kt, stride_kh,  # [Tk, H, Dqk]
    V, stride_vt, stride_vh,  # [Tk, H, Dv]
    DOut, stride_dot, stride_doh,  # [Tq, H, Dv]
    LSE,  # [H, Tq] fp32 (natural log)
    DELTA,  # [H, Tq] fp32
    stride_lh,  # head stride of LSE and DELTA
    DK, stride_dkt, stride_dkh,  # [Tk, H, Dqk], written
    DV, stride_dvt, stride_dvh,  # [Tk, H, Dv], written
    CU_Q,  # [N + 1] int32
    CU_K,  # [N + 1] int32
    SLOPES,  # [H] fp32 ALiBi slopes (read when HAS_ALIBI)
    ITEMS, n_items, n_heads,  # the work list [2, n_items] int32 and H
    qk_scale,  # softmax scale * log2(e)
    sm_scale,  # softmax scale
    D_QK: tl.constexpr, D_V: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_D_REST: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D_MAIN: tl.constexpr, BLOCK_D_REST: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Program (key block, head): dk and dv of BN keys. Grid: the work list's key blocks x H."""
    doc, pid_n, head = _work_item(ITEMS, n_items, n_heads)
    if doc < 0:
        return
    q_start, q_len, k_start, k_len = _doc_span(CU_Q, CU_K, doc)
    start_n = pid_n * BLOCK_N
    if start_n >= k_len:
        return
    q_shift = k_len - q_len
    offs_n = start_n + tl.arange(0, BLOCK_N)
    # this block's keys and values, the keys' ALiBi column terms
    k_main, k_rest = _load_split_rows(K + k_start * stride_kt + head * stride_kh, offs_n, k_len, stride_kt, D_QK,
                                      HAS_D_REST, UPCAST, BLOCK_D_MAIN, BLOCK_D_REST)  # [BN, D_MAIN], [BN, D_REST]
    v = _load_rows(V + k_start * stride_vt + head * stride_vh, offs_n, k_len, stride_vt, tl.arange(0, BLOCK_DV), D_V,
                   UPCAST)  # [BN, Dv]
    alibi_pivot = start_n + BLOCK_N // 2  # the middle of the key block
    slope = 0.0
    alibi_keys = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + head) * LOG2E
        if CAUSAL:
            alibi_keys = _alibi_term(offs_n, alibi_pivot, slope)
    # query blocks that see this key block: [lo, mid) cross the causal diagonal (masked), [mid, Lq) do not
    if CAUSAL:
        lo = tl.maximum(start_n - q_shift, 0) // BLOCK_M * BLOCK_M
        mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - q_shift, 0), BLOCK_M) * BLOCK_M
        mid = tl.minimum(tl.maximum(mid, lo), q_len)
    else:
        lo = 0
        mid = 0
    q_base = Q + q_start * stride_qt + head * stride_qh
    dout_base = DOut + q_start * stride_dot + head * stride_doh
    lse_base = LSE + head * stride_lh + q_start
    delta_base = DELTA + head * stride_lh + q_start
    dk_main = tl.zeros([BLOCK_N, BLOCK_D_MAIN], dtype=tl.float32)
    dk_rest = tl.zeros([BLOCK_N, BLOCK_D_REST], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for phase in tl.static_range(2):
        first = lo if phase == 0 else mid
        last = mid if phase == 0 else q_len
        dk_main, dk_rest, dv = _dkdv_query_blocks(
            dk_main, dk_rest, dv, k_main, k_rest, v, q_base, stride_qt, dout_base, stride_dot, lse_base, delta_base,
            first, last, offs_n, q_shift, q_len, slope, alibi_pivot, alibi_keys, qk_scale, D_QK, D_V, CAUSAL,
            HAS_ALIBI, phase == 0, HAS_D_REST, UPCAST, BLOCK_M, BLOCK_D_MAIN, BLOCK_D_REST, BLOCK_DV)
    dk_base = DK + k_start * stride_dkt + head * stride_dkh
    _store_rows(dk_base, dk_main * sm_scale, offs_n, k_len, stride_dkt, tl.arange(0, BLOCK_D_MAIN), D_QK)
    if HAS_D_REST:
        _store_rows(dk_base, dk_rest * sm_scale, offs_n, k_len, stride_dkt,
                    BLOCK_D_MAIN + tl.arange(0, BLOCK_D_REST), D_QK)
    _store_rows(DV + k_start * stride_dvt + head * stride_dvh, dv, offs_n, k_len, stride_dvt, tl.arange(0, BLOCK_DV),
                D_V)


@triton.jit
def _dq_key_blocks(dq_main, dq_rest, q_main, q_rest, dout, lse_log2, delta, k_base, stride_kt, v_base, stride_vt,
                   lo, hi, offs_m, q_shift, k_len, slope, alibi_pivot, alibi_cols, qk_scale, D_QK, D_V,
                   CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK: tl.constexpr, HAS_D_REST: tl.constexpr,
                   UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D_MAIN: tl.constexpr,
                   BLOCK_D_REST: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Accumulates dq of one query block over the key blocks [lo, hi). Causal ALiBi: lse_log2 includes the row terms;
    the column term of key start_n + n is alibi_cols[n] + the block's scalar, moved onto lse_log2 (one add a row)
    except in masked blocks, which take the keys' exact terms."""
    offs_dv = tl.arange(0, BLOCK_DV)
    q_pos = (offs_m + q_shift)[:, None]
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_main, k_rest = _load_split_rows(k_base, offs_n, k_len, stride_kt, D_QK, HAS_D_REST, UPCAST, BLOCK_D_MAIN,
                                          BLOCK_D_REST)  # [BN, D_MAIN], [BN, D_REST]
        k_pos = offs_n[None, :]
        # probabilities p [BM, BN] from the recomputed scores and the saved lse
        if HAS_ALIBI and CAUSAL and MASK:
            scores = _scores(q_main, q_rest, k_main, k_rest, HAS_D_REST) * qk_scale + \
                _alibi_term(offs_n, alibi_pivot, slope)[None, :]
            probs = tl.exp2(scores - lse_log2[:, None])
        elif HAS_ALIBI and CAUSAL:
            scores = _scores(q_main, q_rest, k_main, k_rest, HAS_D_REST) * qk_scale + alibi_cols[None, :]
            probs = tl.exp2(scores - (lse_log2 - _alibi_term(start_n, alibi_pivot, slope))[:, None])
        else:
            scores = _scores(q_main, q_rest, k_main, k_rest, HAS_D_REST) * qk_scale
            if HAS_ALIBI:
                scores = scores - slope * tl.abs(q_pos.to(tl.float32) - k_pos.to(tl.float32))
            probs = tl.exp2(scores - lse_log2[:, None])
        if MASK:
            keep = k_pos < k_len
            if CAUSAL:
                keep = keep & (k_pos <= q_pos)
            probs = tl.where(keep, probs, 0.0)
        # ds = p * (dO v^T - delta);  dq += ds k
        v = _load_rows(v_base, offs_n, k_len, stride_vt, offs_dv, D_V, UPCAST)  # [BN, Dv]
        dprobs = tl.dot(dout, tl.trans(v))  # [BM, BN]
        dscores = (probs * (dprobs - delta[:, None])).to(k_main.dtype)
        dq_main = tl.dot(dscores, k_main, dq_main)
        if HAS_D_REST:
            dq_rest = tl.dot(dscores, k_rest, dq_rest)
    return dq_main, dq_rest


@triton.jit
def _bwd_dq_kernel(
    Q, stride_qt, stride_qh,  # [Tq, H, Dqk]
    K, stride_kt, stride_kh,  # [Tk, H, Dqk]
    V, stride_vt, stride_vh,  # [Tk, H, Dv]
    DOut, stride_dot, stride_doh,  # [Tq, H, Dv]
    LSE,  # [H, Tq] fp32 (natural log)
    DELTA,  # [H, Tq] fp32
    stride_lh,  # head stride of LSE and DELTA
    DQ, stride_dqt, stride_dqh,  # [Tq, H, Dqk], written
    CU_Q,  # [N + 1] int32
    CU_K,  # [N + 1] int32
    SLOPES,  # [H] fp32 ALiBi slopes (read when HAS_ALIBI)
    ITEMS, n_items, n_heads,  # the work list [2, n_items] int32 and H
    qk_scale,  # softmax scale * log2(e)
    sm_scale,  # softmax scale
    D_QK: tl.constexpr, D_V: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_D_REST: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D_MAIN: tl.constexpr, BLOCK_D_REST: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Program (query block, head): dq of BM queries. Grid: the work list's query blocks x H."""
    doc, pid_m, head = _work_item(ITEMS, n_items, n_heads)
    if doc < 0:
        return
    q_start, q_len, k_start, k_len = _doc_span(CU_Q, CU_K, doc)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    q_shift = k_len - q_len
    offs_m = start_m + tl.arange(0, BLOCK_M)
    # this block's queries, output gradients, lse (log2, +inf for a row that sees no key: p = 0) and delta
    q_main, q_rest = _load_split_rows(Q + q_start * stride_qt + head * stride_qh, offs_m, q_len, stride_qt, D_QK,
                                      HAS_D_REST, UPCAST, BLOCK_D_MAIN, BLOCK_D_REST)  # [BM, D_MAIN], [BM, D_REST]
    dout = _load_rows(DOut + q_start * stride_dot + head * stride_doh, offs_m, q_len, stride_dot,
                      tl.arange(0, BLOCK_DV), D_V, UPCAST)  # [BM, Dv]
    lse = tl.load(LSE + head * stride_lh + q_start + offs_m, mask=offs_m < q_len, other=0.0)
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    delta = tl.load(DELTA + head * stride_lh + q_start + offs_m, mask=offs_m < q_len, other=0.0)
    # the ALiBi terms as in the forward; the row terms join the lse (a blind row's +inf stays +inf)
    alibi_pivot = start_m + q_shift + BLOCK_M // 2
    slope, alibi_cols = _alibi_setup(SLOPES, head, HAS_ALIBI, CAUSAL, BLOCK_N)
    if HAS_ALIBI and CAUSAL:
        lse_log2 += _alibi_term(offs_m + q_shift, alibi_pivot, slope)
    n_full, end = _key_range(start_m, q_shift, k_len, CAUSAL, BLOCK_M, BLOCK_N)
    k_base = K + k_start * stride_kt + head * stride_kh
    v_base = V + k_start * stride_vt + head * stride_vh
    dq_main = tl.zeros([BLOCK_M, BLOCK_D_MAIN], dtype=tl.float32)
    dq_rest = tl.zeros([BLOCK_M, BLOCK_D_REST], dtype=tl.float32)
    for phase in tl.static_range(2):
        first = 0 if phase == 0 else n_full
        last = n_full if phase == 0 else end
        dq_main, dq_rest = _dq_key_blocks(
            dq_main, dq_rest, q_main, q_rest, dout, lse_log2, delta, k_base, stride_kt, v_base, stride_vt, first,
            last, offs_m, q_shift, k_len, slope, alibi_pivot, alibi_cols, qk_scale, D_QK, D_V, CAUSAL, HAS_ALIBI,
            phase == 1, HAS_D_REST, UPCAST, BLOCK_N, BLOCK_D_MAIN, BLOCK_D_REST, BLOCK_DV)
    dq_base = DQ + q_start * stride_dqt + head * stride_dqh
    _store_rows(dq_base, dq_main * sm_scale, offs_m, q_len, stride_dqt, tl.arange(0, BLOCK_D_MAIN), D_QK)
    if HAS_D_REST:
        _store_rows(dq_base, dq_rest * sm_scale, offs_m, q_len, stride_dqt, BLOCK_D_MAIN + tl.arange(0, BLOCK_D_REST),
                    D_QK)


def triton_delta(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """delta [H, Tq] fp32 = rowsum(dO * O) - dlse (the preprocess) from out, dout [Tq, H, Dv] and dlse [H, Tq] or
    None (Tq > 0)."""
    tq, h, d_v = out.shape
    delta = torch.empty(h, tq, device=out.device, dtype=torch.float32)
    _bwd_preprocess_kernel[(triton.cdiv(tq, 64), h)](
        out, out.stride(0), out.stride(1),
        dout, dout.stride(0), dout.stride(1),
        dlse if dlse is not None else delta,
        delta,
        delta.stride(0),
        tq, d_v,
        HAS_DLSE=dlse is not None, BLOCK_M=64, BLOCK_DV=triton.next_power_of_2(d_v))
    return delta


def _common_args(q, k, v, dout, lse, delta, alibi_slopes, softmax_scale, causal) -> tuple[tuple, dict]:
    """The inputs both backward kernels take first (pointers and strides through stride_lh), the scalars and
    constexprs they take last."""
    d_qk, d_v = q.shape[-1], v.shape[-1]
    inputs = (q, q.stride(0), q.stride(1),
              k, k.stride(0), k.stride(1),
              v, v.stride(0), v.stride(1),
              dout, dout.stride(0), dout.stride(1),
              lse,
              delta,
              lse.stride(0))
    flags = dict(qk_scale=softmax_scale * LOG2E.value, sm_scale=softmax_scale, D_QK=d_qk, D_V=d_v, CAUSAL=causal,
                 HAS_ALIBI=alibi_slopes is not None, UPCAST=INTERPRET and q.dtype == torch.bfloat16,
                 **head_dim_blocks(d_qk, d_v))
    return inputs, flags


def triton_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                delta: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, dk: torch.Tensor,
                dv: torch.Tensor, *, causal: bool, softmax_scale: float, alibi_slopes: torch.Tensor | None) -> None:
    """Launches _bwd_dkdv_kernel into dk [Tk, H, Dqk] and dv [Tk, H, Dv] (zeroed by the caller: keys outside every
    document keep 0), from dout [Tq, H, Dv], the forward's lse and the preprocess's delta [H, Tq]."""
    inputs, flags = _common_args(q, k, v, dout, lse, delta, alibi_slopes, softmax_scale, causal)
    cfg = launch_config("dkdv", q.shape[-1], v.shape[-1])
    grid, schedule = launch_grid(cu_seqlens_q, cu_seqlens_k, k.shape[0], q.shape[1], cfg["BLOCK_N"], key_blocks=True,
                                 causal=causal)
    _bwd_dkdv_kernel[grid](
        *inputs,
        dk, dk.stride(0), dk.stride(1),
        dv, dv.stride(0), dv.stride(1),
        cu_seqlens_q, cu_seqlens_k,
        alibi_slopes if alibi_slopes is not None else delta,  # any pointer when there is no ALiBi
        schedule["ITEMS"], schedule["n_items"], schedule["n_heads"],
        **flags, **cfg)


def triton_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
              delta: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, dq: torch.Tensor, *,
              causal: bool, softmax_scale: float, alibi_slopes: torch.Tensor | None) -> None:
    """Launches _bwd_dq_kernel into dq [Tq, H, Dqk] from dout [Tq, H, Dv], the forward's lse and the preprocess's
    delta [H, Tq]."""
    inputs, flags = _common_args(q, k, v, dout, lse, delta, alibi_slopes, softmax_scale, causal)
    cfg = launch_config("dq", q.shape[-1], v.shape[-1])
    grid, schedule = launch_grid(cu_seqlens_q, cu_seqlens_k, q.shape[0], q.shape[1], cfg["BLOCK_M"],
                                 key_blocks=False, causal=causal)
    _bwd_dq_kernel[grid](
        *inputs,
        dq, dq.stride(0), dq.stride(1),
        cu_seqlens_q, cu_seqlens_k,
        alibi_slopes if alibi_slopes is not None else delta,  # any pointer when there is no ALiBi
        schedule["ITEMS"], schedule["n_items"], schedule["n_heads"],
        **flags, **cfg)
