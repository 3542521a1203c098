"""Forward kernel of the Triton flash attention (decisions in triton_common.py) and its launcher; the `triton`
kernel of the forward phase (moela.ops.attention.phases).

Math, per document and head, with s_ij = scale * q_i . k_j (+ ALiBi, masked by causality):
  out_i = sum_j softmax_j(s_ij) v_j,   lse_i = log sum_j exp(s_ij)
computed block by block over keys with the online softmax in base 2 (scores pre-multiplied by log2(e)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.attention.kernels.triton_common import (
    LN2,
    LOG2E,
    _alibi_setup,
    _alibi_term,
    _doc_span,
    _key_range,
    _load_rows,
    _load_split_rows,
    _mask_and_bias,
    _scores,
    _store_rows,
    _work_item,
    head_dim_blocks,
    launch_config,
    launch_grid,
)
from moela.ops.triton_env import INTERPRET


@triton.jit
def _fwd_key_blocks(acc, row_sum, row_max, q_main, q_rest, k_base, stride_kt, v_base, stride_vt, lo, hi, offs_m,
                    q_shift, k_len, slope, alibi_pivot, alibi_cols, qk_scale, D_QK, D_V, CAUSAL: tl.constexpr,
                    HAS_ALIBI: tl.constexpr, MASK: tl.constexpr, HAS_D_REST: tl.constexpr, UPCAST: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D_MAIN: tl.constexpr, BLOCK_D_REST: tl.constexpr,
                    BLOCK_DV: tl.constexpr):
    """Online softmax over the key blocks [lo, hi) (MASK: they need the causal / length mask). Causal ALiBi: the
    column term of key start_n + n is alibi_cols[n] + block_term, the block's scalar moved onto the row maximum (two
    adds a row), so row_max holds the row maxima of the scores plus their row terms."""
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # scores of this key block, [BM, BN], log2 domain
        k_main, k_rest = _load_split_rows(k_base, offs_n, k_len, stride_kt, D_QK, HAS_D_REST, UPCAST, BLOCK_D_MAIN,
                                          BLOCK_D_REST)  # [BN, D_MAIN], [BN, D_REST]
        q_pos = (offs_m + q_shift)[:, None]
        if HAS_ALIBI and CAUSAL:
            scores = _scores(q_main, q_rest, k_main, k_rest, HAS_D_REST) * qk_scale + alibi_cols[None, :]
            scores = _mask_and_bias(scores, q_pos, offs_n[None, :], k_len, slope, CAUSAL, False, MASK)
            block_term = _alibi_term(start_n, alibi_pivot, slope)
            # new row maxima, then the probabilities relative to them
            max_new = tl.maximum(row_max, tl.max(scores, 1) + block_term)
            probs = tl.exp2(scores - (max_new - block_term)[:, None])  # [BM, BN]
        else:
            scores = _scores(q_main, q_rest, k_main, k_rest, HAS_D_REST) * qk_scale
            scores = _mask_and_bias(scores, q_pos, offs_n[None, :], k_len, slope, CAUSAL, HAS_ALIBI, MASK)
            max_new = tl.maximum(row_max, tl.max(scores, 1))
            probs = tl.exp2(scores - max_new[:, None])  # [BM, BN]
        # rescale what was accumulated under the old maxima, add this block
        alpha = tl.exp2(row_max - max_new)
        row_sum = row_sum * alpha + tl.sum(probs, 1)
        v = _load_rows(v_base, offs_n, k_len, stride_vt, offs_dv, D_V, UPCAST)  # [BN, Dv]
        acc = tl.dot(probs.to(v.dtype), v, acc * alpha[:, None])
        row_max = max_new
    return acc, row_sum, row_max


@triton.jit
def _fwd_kernel(
    Q, stride_qt, stride_qh,  # [Tq, H, Dqk]
    K, stride_kt, stride_kh,  # [Tk, H, Dqk]
    V, stride_vt, stride_vh,  # [Tk, H, Dv]
    Out, stride_ot, stride_oh,  # [Tq, H, Dv], written
    LSE, stride_lh,  # [H, Tq] fp32, written (natural log)
    CU_Q,  # [N + 1] int32, document starts on the q side
    CU_K,  # [N + 1] int32, document starts on the k side
    SLOPES,  # [H] fp32 ALiBi slopes (read when HAS_ALIBI)
    ITEMS, n_items, n_heads,  # the work list [2, n_items] int32 and H
    qk_scale,  # softmax scale * log2(e)
    D_QK: tl.constexpr, D_V: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_D_REST: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D_MAIN: tl.constexpr, BLOCK_D_REST: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Program (query block, head): out and lse of BM query rows. Grid: the work list's query blocks x H
    (triton_common._work_item)."""
    doc, pid_m, head = _work_item(ITEMS, n_items, n_heads)
    if doc < 0:
        return
    q_start, q_len, k_start, k_len = _doc_span(CU_Q, CU_K, doc)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    q_shift = k_len - q_len  # query i sits at key position i + q_shift
    offs_m = start_m + tl.arange(0, BLOCK_M)
    # this block's queries, the ALiBi terms, the key range
    q_main, q_rest = _load_split_rows(Q + q_start * stride_qt + head * stride_qh, offs_m, q_len, stride_qt, D_QK,
                                      HAS_D_REST, UPCAST, BLOCK_D_MAIN, BLOCK_D_REST)  # [BM, D_MAIN], [BM, D_REST]
    alibi_pivot = start_m + q_shift + BLOCK_M // 2  # the middle of the query block
    slope, alibi_cols = _alibi_setup(SLOPES, head, HAS_ALIBI, CAUSAL, BLOCK_N)
    n_full, end = _key_range(start_m, q_shift, k_len, CAUSAL, BLOCK_M, BLOCK_N)
    k_base = K + k_start * stride_kt + head * stride_kh
    v_base = V + k_start * stride_vt + head * stride_vh
    # online softmax: the unmasked key blocks, then the masked ones
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], -1.0e38, dtype=tl.float32)  # finite: a fully masked row keeps exp2(-inf - m) = 0
    for phase in tl.static_range(2):
        lo = 0 if phase == 0 else n_full
        hi = n_full if phase == 0 else end
        acc, row_sum, row_max = _fwd_key_blocks(
            acc, row_sum, row_max, q_main, q_rest, k_base, stride_kt, v_base, stride_vt, lo, hi, offs_m, q_shift,
            k_len, slope, alibi_pivot, alibi_cols, qk_scale, D_QK, D_V, CAUSAL, HAS_ALIBI, phase == 1, HAS_D_REST,
            UPCAST, BLOCK_N, BLOCK_D_MAIN, BLOCK_D_REST, BLOCK_DV)
    # normalize; lse in natural log, the causal ALiBi row term taken out once per row
    empty = row_sum == 0.0
    out = acc / tl.where(empty, 1.0, row_sum)[:, None]  # [BM, Dv]
    lse_log2 = row_max + tl.log2(tl.where(empty, 1.0, row_sum))  # [BM]
    if HAS_ALIBI and CAUSAL:
        lse_log2 -= _alibi_term(offs_m + q_shift, alibi_pivot, slope)
    lse = tl.where(empty, float("-inf"), lse_log2 * LN2)  # [BM]
    _store_rows(Out + q_start * stride_ot + head * stride_oh, out, offs_m, q_len, stride_ot, tl.arange(0, BLOCK_DV),
                D_V)
    tl.store(LSE + head * stride_lh + q_start + offs_m, lse, mask=offs_m < q_len)


def triton_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                   softmax_scale: float, alibi_slopes: torch.Tensor | None) -> None:
    """Launches the kernel into out [Tq, H, Dv] (q's dtype) and lse [H, Tq] float32 (the caller allocated them and
    checked that Tq and the document count are not zero)."""
    tq, h, d_qk = q.shape
    d_v = v.shape[-1]
    cfg = launch_config("fwd", d_qk, d_v)
    grid, schedule = launch_grid(cu_seqlens_q, cu_seqlens_k, tq, h, cfg["BLOCK_M"], key_blocks=False, causal=causal)
    _fwd_kernel[grid](
        q, q.stride(0), q.stride(1),
        k, k.stride(0), k.stride(1),
        v, v.stride(0), v.stride(1),
        out, out.stride(0), out.stride(1),
        lse, lse.stride(0),
        cu_seqlens_q,
        cu_seqlens_k,
        alibi_slopes if alibi_slopes is not None else lse,  # any pointer when there is no ALiBi
        schedule["ITEMS"], schedule["n_items"], schedule["n_heads"],
        softmax_scale * LOG2E.value,
        d_qk, d_v,
        CAUSAL=causal, HAS_ALIBI=alibi_slopes is not None, UPCAST=INTERPRET and q.dtype == torch.bfloat16,
        **head_dim_blocks(d_qk, d_v), **cfg)
