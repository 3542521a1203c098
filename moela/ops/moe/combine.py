"""unpermute + combine (each token's K rows gathered and summed, weighted), and its backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.moe.kernel_common import FP8, LAUNCH, _store_rows_cols
from moela.ops.moe.layout import Layout


@triton.jit
def _combine_kernel(o_ptr, row_map_ptr, w_ptr, y_ptr, D, K: tl.constexpr, BLOCK_D: tl.constexpr,
                    WEIGHTED: tl.constexpr):
    """y[t] = sum_k w[t, k] * o[row_map[t, k]] (w = 1 when not WEIGHTED); empty slots (row -1) add nothing."""
    t, pd = tl.program_id(0), tl.program_id(1)
    c = pd * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for kk in tl.static_range(K):
        row = tl.load(row_map_ptr + t * K + kk).to(tl.int64)
        v = tl.load(o_ptr + tl.maximum(row, 0) * D + c, mask=c < D, other=0.0).to(tl.float32)
        v = tl.where(row >= 0, v, 0.0)
        if WEIGHTED:
            v = v * tl.load(w_ptr + t * K + kk).to(tl.float32)
        acc += v
    tl.store(y_ptr + t.to(tl.int64) * D + c, acc.to(y_ptr.dtype.element_ty), mask=c < D)


def unpermute_combine(o: torch.Tensor, layout: Layout, topk_weights: torch.Tensor | None, out_dtype: torch.dtype):
    """o [M_pad, D] -> y [T, D]: gather each token's K rows and sum them, weighted by topk_weights [T, K] if given."""
    d = o.shape[1]
    t, k = layout.num_tokens, layout.topk
    y = torch.empty(t, d, device=o.device, dtype=out_dtype)
    block_d = min(1024, triton.next_power_of_2(d))
    w = topk_weights.contiguous() if topk_weights is not None else o
    _combine_kernel[(t, triton.cdiv(d, block_d))](o, layout.row_map, w, y, d, K=k, BLOCK_D=block_d,
                                                  WEIGHTED=topk_weights is not None, **LAUNCH["combine"])
    return y


@triton.jit
def _combine_bwd_kernel(dy_ptr, o_ptr, src_ptr, w_ptr, do_ptr, dos_ptr, dot_ptr, dost_ptr, part_ptr, M, D,
                        K: tl.constexpr, QUANT: tl.constexpr):
    """Per 128x128 tile of padded rows: do = dy[t] * w[t,k] (0 on padding), its row/column quantization, and the
    partial dot <dy[t], o[row]> over these 128 channels (summed on the host side into d topk_weights)."""
    pid_d, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m * 128 + tl.arange(0, 128)
    cols = pid_d * 128 + tl.arange(0, 128)
    s = tl.load(src_ptr + rows)
    ok = s >= 0
    sf = tl.where(ok, s, 0)
    tok = (sf // K).to(tl.int64)
    r64 = rows.to(tl.int64)
    dy = tl.load(dy_ptr + tok[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    o = tl.load(o_ptr + r64[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + sf, mask=ok, other=0.0).to(tl.float32)
    tl.store(part_ptr + r64 * (D // 128) + pid_d, tl.sum(dy * o, axis=1))
    do = dy * w[:, None]
    if QUANT:
        _store_rows_cols(do, rows, cols, rows < M, cols < D, do_ptr, dos_ptr, dot_ptr, dost_ptr, D, D // 128, M,
                         M // 128, True, True)
    else:
        tl.store(do_ptr + r64[:, None] * D + cols[None, :], do.to(do_ptr.dtype.element_ty))


def combine_bwd(dy: torch.Tensor, o: torch.Tensor, layout: Layout, topk_weights: torch.Tensor, *, quant: bool):
    """Backward of unpermute_combine: returns (do rowwise, do colwise, d topk_weights [T, K] fp32); with quant the
    first two are (q, s) pairs, else do [M_pad, D] in dy's dtype and None."""
    m, d = o.shape
    dev = o.device
    part = torch.empty(m, d // 128, device=dev, dtype=torch.float32)
    grid = (d // 128, m // 128)
    dy = dy.contiguous()
    w = topk_weights.contiguous()
    if quant:
        doq = torch.empty(m, d, device=dev, dtype=FP8)
        dos = torch.empty(m, d // 128, device=dev, dtype=torch.float32)
        doqt = torch.empty(d, m, device=dev, dtype=FP8)
        dost = torch.empty(d, m // 128, device=dev, dtype=torch.float32)
        _combine_bwd_kernel[grid](dy, o, layout.src, w, doq, dos, doqt, dost, part, m, d, K=layout.topk, QUANT=True,
                                  **LAUNCH["combine_bwd"])
        rowwise, colwise = (doq, dos), (doqt, dost)
    else:
        do = torch.empty(m, d, device=dev, dtype=dy.dtype)
        _combine_bwd_kernel[grid](dy, o, layout.src, w, do, do, do, do, part, m, d, K=layout.topk, QUANT=False,
                                  **LAUNCH["combine_bwd"])
        rowwise, colwise = do, None
    rows = layout.row_map.long()  # [T*K], -1 on empty slots (their weight gets no gradient)
    dw = torch.where(rows >= 0, part.sum(1)[rows.clamp_min(0)], 0.0).view(layout.num_tokens, layout.topk)  # [T, K]
    return rowwise, colwise, dw
