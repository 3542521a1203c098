"""unpermute + combine: each token's K expert outputs gathered from the layout and summed with the routing weights,
and its backward fused with the row and column quantizations of do that GEMM2's backward reads.

Math: y[t] = sum_k w[t, k] o[row_map[t, k]];  do[r] = w[t, k] dy[t] and dw[t, k] = <dy[t], o[r]> for the row
r = row_map[t, k] (do = 0 on padding rows).
Shapes: T tokens, D hidden, K top-k, M_pad padded rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.moe.kernels.layout import Layout
from moela.ops.moe.kernels.triton_common import FP8, LAUNCH, store_tile_quantized


@triton.jit
def _combine_kernel(
    o_ptr,  # [M_pad, D] expert outputs in the layout
    row_map_ptr,  # [T*K] int32 row of each (token, k)
    w_ptr,  # [T, K] routing weights (read when WEIGHTED)
    y_ptr,  # [T, D], written
    D,
    K: tl.constexpr, BLOCK_D: tl.constexpr, WEIGHTED: tl.constexpr,
):
    """Program (token, channel block): y[t] = sum_k w[t, k] * o[row_map[t, k]] (w = 1 when not WEIGHTED); empty
    slots (row -1) add nothing. Grid: (T, cdiv(D, BLOCK_D))."""
    token, pid_d = tl.program_id(0), tl.program_id(1)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for k in tl.static_range(K):
        row = tl.load(row_map_ptr + token * K + k).to(tl.int64)  # -1: an empty slot, which adds nothing
        value = tl.load(o_ptr + tl.maximum(row, 0) * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        value = tl.where(row >= 0, value, 0.0)
        if WEIGHTED:
            value = value * tl.load(w_ptr + token * K + k).to(tl.float32)
        acc += value
    tl.store(y_ptr + token.to(tl.int64) * D + cols, acc.to(y_ptr.dtype.element_ty), mask=cols < D)


def unpermute_combine(o: torch.Tensor, layout: Layout, topk_weights: torch.Tensor | None,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """o [M_pad, D] -> y [T, D]: gather each token's K rows and sum them, weighted by topk_weights [T, K] if given."""
    d = o.shape[1]
    t, k = layout.num_tokens, layout.topk
    y = torch.empty(t, d, device=o.device, dtype=out_dtype)
    block_d = min(1024, triton.next_power_of_2(d))
    _combine_kernel[(t, triton.cdiv(d, block_d))](
        o,
        layout.row_map,
        topk_weights.contiguous() if topk_weights is not None else o,
        y,
        d,
        K=k, BLOCK_D=block_d, WEIGHTED=topk_weights is not None, **LAUNCH["combine"])
    return y


@triton.jit
def _combine_bwd_kernel(
    dy_ptr,  # [T, D] gradient of y
    o_ptr,  # [M_pad, D] expert outputs in the layout
    src_ptr,  # [M_pad] int32 flat (token, k) index of each row, -1 on padding
    w_ptr,  # [T*K] fp32 routing weights
    do_ptr,  # [M_pad, D] do, written (rowwise e4m3 codes when QUANT, else dy's dtype)
    do_s_ptr,  # [M_pad, D/128] fp32 rowwise scales, written (QUANT)
    dot_ptr,  # [D, M_pad] e4m3 columnwise codes, transposed, written (QUANT)
    dot_s_ptr,  # [D, M_pad/128] fp32, written (QUANT)
    partial_ptr,  # [M_pad, D/128] fp32, written: <dy[t], o[row]> over each 128 channels
    M, D,
    K: tl.constexpr, QUANT: tl.constexpr,
):
    """Program (d block, m block), one 128x128 tile of padded rows: do = dy[t] * w[t, k] (0 on padding), its row and
    column quantization, and the partial dots that the launcher sums into d topk_weights. Grid: (D/128, M_pad/128)."""
    pid_d, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m * 128 + tl.arange(0, 128)
    cols = pid_d * 128 + tl.arange(0, 128)
    # each row's (token, k)
    src = tl.load(src_ptr + rows)
    real = src >= 0
    flat = tl.where(real, src, 0)
    token = (flat // K).to(tl.int64)
    rows64 = rows.to(tl.int64)
    dy = tl.load(dy_ptr + token[:, None] * D + cols[None, :], mask=real[:, None], other=0.0).to(tl.float32)
    o = tl.load(o_ptr + rows64[:, None] * D + cols[None, :], mask=real[:, None], other=0.0).to(tl.float32)
    weight = tl.load(w_ptr + flat, mask=real, other=0.0).to(tl.float32)
    # the routing weights' gradient, partial over this tile's channels; then do
    tl.store(partial_ptr + rows64 * (D // 128) + pid_d, tl.sum(dy * o, axis=1))
    do = dy * weight[:, None]
    if QUANT:
        store_tile_quantized(do, rows, cols, rows < M, cols < D, do_ptr, D, do_s_ptr, D // 128, dot_ptr, M,
                             dot_s_ptr, M // 128, True, True)
    else:
        tl.store(do_ptr + rows64[:, None] * D + cols[None, :], do.to(do_ptr.dtype.element_ty))


def combine_bwd(dy: torch.Tensor, o: torch.Tensor, layout: Layout, topk_weights: torch.Tensor, *, quant: bool
                ) -> tuple:
    """Backward of unpermute_combine: returns (do rowwise, do colwise, d topk_weights [T, K] fp32); with quant the
    first two are (q, s) pairs, else do [M_pad, D] in dy's dtype and None."""
    m, d = o.shape
    dev = o.device
    partial = torch.empty(m, d // 128, device=dev, dtype=torch.float32)
    dy = dy.contiguous()
    if quant:
        do = torch.empty(m, d, device=dev, dtype=FP8)
        do_s = torch.empty(m, d // 128, device=dev, dtype=torch.float32)
        dot = torch.empty(d, m, device=dev, dtype=FP8)
        dot_s = torch.empty(d, m // 128, device=dev, dtype=torch.float32)
    else:
        do = torch.empty(m, d, device=dev, dtype=dy.dtype)
        do_s = dot = dot_s = do  # not written
    _combine_bwd_kernel[(d // 128, m // 128)](
        dy,
        o,
        layout.src,
        topk_weights.contiguous(),
        do,
        do_s,
        dot,
        dot_s,
        partial,
        m, d,
        K=layout.topk, QUANT=quant, **LAUNCH["combine_bwd"])
    rows = layout.row_map.long()  # [T*K], -1 on empty slots (their weight gets no gradient)
    dw = torch.where(rows >= 0, partial.sum(1)[rows.clamp_min(0)], 0.0).view(layout.num_tokens, layout.topk)  # [T, K]
    if quant:
        return (do, do_s), (dot, dot_s), dw
    return do, None, dw
