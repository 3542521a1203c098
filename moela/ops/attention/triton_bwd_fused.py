"""The fused backward of the Triton flash attention (SCHEDULE["backward"] == "fused"): one program per key block
computes dk and dv over the query blocks that see it, as the split dk/dv kernel does, and adds each query block's
share of dq to an fp32 buffer with atomics, so the scores are computed once instead of twice.

Why: the split backward recomputes q k^T and dO v^T in its dq kernel: per (query, key) pair it runs 8 Dqk + 6 Dv
FLOPs for the 6 Dqk + 4 Dv of the gradients (1.38x at MLA's 192/128). The fused kernel runs the 6 Dqk + 4 Dv and
pays for it with Dqk fp32 atomic adds per query row and key block (Dqk / BN per pair), an fp32 buffer of Tq x H x Dqk
zeroed first and converted to q's dtype last (FlashAttention-2/3 accumulate dq the same way). The order of the
atomic adds varies from run to run, so dq is not bitwise deterministic; dk and dv are.

Math, per document and head (p, ds as in triton_bwd.py): dq_i = scale * sum over key blocks of sum_j ds_ij k_j; the
scale is applied to each block's share before the add. Keys past the document's end are loaded as zeros and their
probabilities are masked to 0 (an unmasked zero key gives p = exp2(-lse), which may overflow, and 0 * inf in the dq
product would be NaN): causal attention masks them with the diagonal (a partial last key block has no unmasked query
block), full attention masks the last key block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.attention.triton_common import (
    LOG2E,
    _alibi_term,
    _doc_span,
    _load_rows,
    _load_split_rows,
    _scores,
    _store_rows,
    _work_item,
    launch_config,
    launch_grid,
)


@triton.jit
def _fused_query_blocks(dk_main, dk_rest, dv, k_main, k_rest, v, q_base, stride_qt, dout_base, stride_dot, lse_base,
                        delta_base, dq_base, stride_dqt, lo, hi, offs_n, k_len, q_shift, q_len, slope, alibi_pivot,
                        alibi_keys, qk_scale, sm_scale, D_QK, D_V, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr,
                        MASK: tl.constexpr, HAS_D_REST: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_D_MAIN: tl.constexpr, BLOCK_D_REST: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Accumulates dk, dv of one key block over the query blocks [lo, hi) and adds their dq shares. Transposed tiles:
    rows are keys [BN], columns queries [BM]. MASK: the causal diagonal and the keys past the document."""
    offs_d_main = tl.arange(0, BLOCK_D_MAIN)
    offs_d_rest = BLOCK_D_MAIN + tl.arange(0, BLOCK_D_REST)
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
            keep = k_pos < k_len
            if CAUSAL:
                keep = keep & (k_pos <= q_pos)
            probs_t = tl.where(keep, probs_t, 0.0)
        # dv += p^T dO;  ds^T = p^T * (v dO^T - delta);  dk += ds^T q
        dout = _load_rows(dout_base, offs_m, q_len, stride_dot, offs_dv, D_V, UPCAST)  # [BM, Dv]
        dv = tl.dot(probs_t.to(dout.dtype), dout, dv)
        delta = tl.load(delta_base + offs_m, mask=offs_m < q_len, other=0.0)  # [BM]
        dprobs_t = tl.dot(v, tl.trans(dout))  # [BN, BM]
        dscores_t = (probs_t * (dprobs_t - delta[None, :])).to(q_main.dtype)
        dk_main = tl.dot(dscores_t, q_main, dk_main)
        if HAS_D_REST:
            dk_rest = tl.dot(dscores_t, q_rest, dk_rest)
        # dq_i += scale * sum_j ds_ij k_j: this key block's share, added in fp32
        dscores = tl.trans(dscores_t)  # [BM, BN]
        rows = offs_m[:, None] < q_len
        dq_main = tl.dot(dscores, k_main) * sm_scale  # [BM, D_MAIN]
        tl.atomic_add(dq_base + offs_m[:, None] * stride_dqt + offs_d_main[None, :], dq_main,
                      mask=rows & (offs_d_main[None, :] < D_QK), sem="relaxed")
        if HAS_D_REST:
            dq_rest = tl.dot(dscores, k_rest) * sm_scale  # [BM, D_REST]
            tl.atomic_add(dq_base + offs_m[:, None] * stride_dqt + offs_d_rest[None, :], dq_rest,
                          mask=rows & (offs_d_rest[None, :] < D_QK), sem="relaxed")
    return dk_main, dk_rest, dv


@triton.jit
def _bwd_fused_kernel(
    Q, stride_qt, stride_qh,  # [Tq, H, Dqk]
    K, stride_kt, stride_kh,  # [Tk, H, Dqk]
    V, stride_vt, stride_vh,  # [Tk, H, Dv]
    DOut, stride_dot, stride_doh,  # [Tq, H, Dv]
    LSE,  # [H, Tq] fp32 (natural log)
    DELTA,  # [H, Tq] fp32
    stride_lh,  # head stride of LSE and DELTA
    DK, stride_dkt, stride_dkh,  # [Tk, H, Dqk], written
    DV, stride_dvt, stride_dvh,  # [Tk, H, Dv], written
    DQACC, stride_dqt, stride_dqh,  # [Tq, H, Dqk] fp32, zeroed before, added to
    CU_Q,  # [N + 1] int32
    CU_K,  # [N + 1] int32
    SLOPES,  # [H] fp32 ALiBi slopes (read when HAS_ALIBI)
    ITEMS, n_items, n_heads,  # the work list [2, n_items] int32 (WORKLIST) and H
    qk_scale,  # softmax scale * log2(e)
    sm_scale,  # softmax scale
    D_QK: tl.constexpr, D_V: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_D_REST: tl.constexpr, UPCAST: tl.constexpr,
    WORKLIST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D_MAIN: tl.constexpr, BLOCK_D_REST: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Program (key block, head, document): dk and dv of BN keys, and their dq shares. Grid: the work list's key
    blocks x H, or (cdiv(max Lk, BN), H, N)."""
    doc, pid_n, head = _work_item(ITEMS, n_items, n_heads, WORKLIST, False)
    if doc < 0:
        return
    q_start, q_len, k_start, k_len = _doc_span(CU_Q, CU_K, doc)
    start_n = pid_n * BLOCK_N
    if start_n >= k_len:
        return
    q_shift = k_len - q_len
    offs_n = start_n + tl.arange(0, BLOCK_N)
    # this block's keys and values, the keys' ALiBi column terms (as in the split dk/dv kernel)
    k_main, k_rest = _load_split_rows(K + k_start * stride_kt + head * stride_kh, offs_n, k_len, stride_kt, D_QK,
                                      HAS_D_REST, UPCAST, BLOCK_D_MAIN, BLOCK_D_REST)  # [BN, D_MAIN], [BN, D_REST]
    v = _load_rows(V + k_start * stride_vt + head * stride_vh, offs_n, k_len, stride_vt, tl.arange(0, BLOCK_DV), D_V,
                   UPCAST)  # [BN, Dv]
    alibi_pivot = start_n + BLOCK_N // 2
    slope = 0.0
    alibi_keys = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + head) * LOG2E
        if CAUSAL:
            alibi_keys = _alibi_term(offs_n, alibi_pivot, slope)
    # query blocks that see this key block: [lo, mid) masked (the causal diagonal, or every query block of a partial
    # key block without a causal mask), [mid, Lq) not
    if CAUSAL:
        lo = tl.maximum(start_n - q_shift, 0) // BLOCK_M * BLOCK_M
        mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - q_shift, 0), BLOCK_M) * BLOCK_M
        mid = tl.minimum(tl.maximum(mid, lo), q_len)
    else:
        lo = 0
        mid = tl.where(start_n + BLOCK_N > k_len, q_len, 0)
    q_base = Q + q_start * stride_qt + head * stride_qh
    dout_base = DOut + q_start * stride_dot + head * stride_doh
    lse_base = LSE + head * stride_lh + q_start
    delta_base = DELTA + head * stride_lh + q_start
    dq_base = DQACC + q_start * stride_dqt + head * stride_dqh
    dk_main = tl.zeros([BLOCK_N, BLOCK_D_MAIN], dtype=tl.float32)
    dk_rest = tl.zeros([BLOCK_N, BLOCK_D_REST], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for phase in tl.static_range(2):
        first = lo if phase == 0 else mid
        last = mid if phase == 0 else q_len
        dk_main, dk_rest, dv = _fused_query_blocks(
            dk_main, dk_rest, dv, k_main, k_rest, v, q_base, stride_qt, dout_base, stride_dot, lse_base, delta_base,
            dq_base, stride_dqt, first, last, offs_n, k_len, q_shift, q_len, slope, alibi_pivot, alibi_keys, qk_scale,
            sm_scale, D_QK, D_V, CAUSAL, HAS_ALIBI, phase == 0, HAS_D_REST, UPCAST, BLOCK_M, BLOCK_D_MAIN,
            BLOCK_D_REST, BLOCK_DV)
    dk_base = DK + k_start * stride_dkt + head * stride_dkh
    _store_rows(dk_base, dk_main * sm_scale, offs_n, k_len, stride_dkt, tl.arange(0, BLOCK_D_MAIN), D_QK)
    if HAS_D_REST:
        _store_rows(dk_base, dk_rest * sm_scale, offs_n, k_len, stride_dkt,
                    BLOCK_D_MAIN + tl.arange(0, BLOCK_D_REST), D_QK)
    _store_rows(DV + k_start * stride_dvt + head * stride_dvh, dv, offs_n, k_len, stride_dvt, tl.arange(0, BLOCK_DV),
                D_V)


def fused_backward(inputs: tuple, dk: torch.Tensor, dv: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, slopes: torch.Tensor, scales: tuple, flags: dict, max_seqlen_k: int,
                   n_keys: int, heads: int, causal: bool) -> torch.Tensor:
    """Launches the fused kernel with attention_backward's prepared arguments (inputs: q, k, v, dout, lse, delta
    and their strides; scales: qk_scale, sm_scale, Dqk, Dv); writes dk, dv and returns dq in q's dtype."""
    q = inputs[0]
    dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)  # [Tq, H, Dqk]
    cfg = launch_config("fused", scales[2], scales[3])
    grid, schedule = launch_grid(cu_seqlens_q, cu_seqlens_k, n_keys, max_seqlen_k, heads, cfg["BLOCK_N"],
                                 key_blocks=True, causal=causal)
    _bwd_fused_kernel[grid](
        *inputs,
        dk, dk.stride(0), dk.stride(1),
        dv, dv.stride(0), dv.stride(1),
        dq_acc, dq_acc.stride(0), dq_acc.stride(1),
        cu_seqlens_q, cu_seqlens_k, slopes, schedule["ITEMS"], schedule["n_items"], schedule["n_heads"],
        *scales, WORKLIST=schedule["WORKLIST"], **flags, **cfg)
    return dq_acc.to(q.dtype)
