"""permute + align (+ 1x128 quantize): the data pass that also places the rows when the layout is being built.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.moe.kernel_common import _ZERO_ROWS, ALIGN, FP8, GROUP, LAUNCH, _quant, _scale_inv
from moela.ops.moe.layout import _CHUNK, Layout, _count_and_scan

# channels per permute program (a (token, channel chunk) grid): 2048 moved the V3 permute+align+quant from 70% to
# 74% of the copy bandwidth on the H200, 512 ran at 50% (bench/moe.py --sections permute_cfg, moe_notes.md run 13)
PERMUTE_BLOCK_D = 2048


def build_layout(topk_ids: torch.Tensor, num_experts: int, align: int = ALIGN) -> Layout:
    """The contiguous layout of topk_ids [T, K] (ids in [0, num_experts)) as a stable counting sort in three Triton
    launches and no host sync (M_pad is the upper bound): per-chunk ranks and expert histograms, their prefix sums
    over chunks, and the placement (the permute kernel without data; `permute_align` without a given layout places
    and moves the data in one launch). Rows keep token order inside each expert."""
    t, k = topk_ids.shape
    flat, rank, prefix, chunks, row_map, m_indices, src, counts, offsets = _count_and_scan(topk_ids, num_experts,
                                                                                          align)
    _permute_kernel[(t + 2 * num_experts + 1, 1)](
        flat, flat, row_map, flat, rank, prefix, counts, offsets, m_indices, src, flat, flat, t, m_indices.numel(),
        num_experts, chunks, D=128, K=k, K_PAD=triton.next_power_of_2(k), BLOCK_D=128, CH=_CHUNK,
        E_PAD=triton.next_power_of_2(num_experts), QUANT=False, PLACE=True, DATA=False, **LAUNCH["permute"])
    return Layout(m_indices, row_map, src, counts, offsets, t, k)


@triton.jit
def _permute_kernel(x_ptr, ids_ptr, row_map_ptr, lrow_ptr, rank_ptr, prefix_ptr, counts_ptr, offsets_ptr, m_idx_ptr,
                    src_ptr, out_ptr, s_ptr, T, M_pad, E, C, D: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                    BLOCK_D: tl.constexpr, CH: tl.constexpr, E_PAD: tl.constexpr, QUANT: tl.constexpr,
                    PLACE: tl.constexpr, DATA: tl.constexpr):
    """Program (p, c) covers channels [c * BLOCK_D, (c + 1) * BLOCK_D). p in [0, T): token p's K rows; with DATA
    read that chunk of token p once, (quantize,) and write it to those rows. p in [T, T+E): expert p-T's padding
    rows; p in [T+E, T+2E+1): 128 rows each of the tail after the last expert; with DATA zero them.
    PLACE (the layout is being built): token p's rows come from the counting kernels (its expert's padded start +
    ids of that expert in earlier chunks + its rank in its chunk) and the c = 0 programs write row_map, m_indices
    and src (-1 on padding rows), program (0, 0) the offsets; otherwise rows come from row_map (lrow_ptr). A
    negative expert id is an empty slot: it gets no row (row_map -1) and its data is not written."""
    pid = tl.program_id(0)
    first = tl.program_id(1) == 0
    c0 = tl.program_id(1) * BLOCK_D
    cols = c0 + tl.arange(0, BLOCK_D)
    groups = c0 // 128 + tl.arange(0, BLOCK_D // 128)
    if PLACE:  # each expert block's first row: the exclusive prefix sum of the counts rounded up to 128
        ex = tl.arange(0, E_PAD)
        cnt = tl.load(counts_ptr + ex, mask=ex < E, other=0).to(tl.int32)
        padded = (cnt + 127) // 128 * 128
        starts = tl.cumsum(padded, axis=0) - padded  # [E_PAD]
        if (pid == 0) & first:
            tl.store(offsets_ptr + ex, starts.to(tl.int64), mask=ex < E)
            tl.store(offsets_ptr + E, tl.sum(padded, axis=0).to(tl.int64))
    if pid < T:
        if PLACE:
            kk = tl.arange(0, K_PAD)
            i = pid * K + kk  # flat (token, k) indices
            ids = tl.load(ids_ptr + i, mask=kk < K, other=-1).to(tl.int32)
            kok = (kk < K) & (ids >= 0)  # a negative id is an empty slot: no row
            block = tl.sum(tl.where(ex[None, :] == ids[:, None], starts[None, :], 0), axis=1)  # [K]
            rows = block + tl.load(prefix_ptr + ids * C + i // CH, mask=kok, other=0) + \
                tl.load(rank_ptr + i, mask=kok, other=0)
            rows = tl.where(kok, rows, -1)
            if first:
                tl.store(row_map_ptr + i, rows, mask=kk < K)
                tl.store(m_idx_ptr + rows, ids, mask=kok)
                tl.store(src_ptr + rows, i, mask=kok)
        if DATA:
            if QUANT:  # [G, 128] tile: one row per 1x128 group (explicit 2-D addressing, no reshape)
                c2 = groups[:, None] * 128 + tl.arange(0, 128)[None, :]
                xv = tl.load(x_ptr + pid.to(tl.int64) * D + c2, mask=c2 < D, other=0.0).to(tl.float32)
                sc, inv = _scale_inv(tl.max(tl.abs(xv), axis=1))  # [G]
                q = _quant(xv, inv[:, None])
            else:
                xv = tl.load(x_ptr + pid.to(tl.int64) * D + cols, mask=cols < D, other=0.0)
            for k_ in tl.static_range(K):
                if PLACE:
                    row = tl.sum(tl.where(kk == k_, rows, 0), axis=0).to(tl.int64)
                else:
                    row = tl.load(lrow_ptr + pid * K + k_).to(tl.int64)
                if row >= 0:  # not an empty slot
                    if QUANT:
                        tl.store(out_ptr + row * D + c2, q, mask=c2 < D)
                        tl.store(s_ptr + row * (D // 128) + groups, sc, mask=groups < D // 128)
                    else:
                        tl.store(out_ptr + row * D + cols, xv.to(out_ptr.dtype.element_ty), mask=cols < D)
    else:
        p = pid - T
        if p < E:
            if PLACE:
                begin = tl.sum(tl.where(ex < p, padded, 0), axis=0)
                start = begin + tl.load(counts_ptr + p).to(tl.int32)
                end = begin + tl.sum(tl.where(ex == p, padded, 0), axis=0)
            else:
                start = tl.load(offsets_ptr + p) + tl.load(counts_ptr + p)
                end = tl.load(offsets_ptr + p + 1)
        else:
            if PLACE:
                start = tl.sum(padded, axis=0) + (p - E) * 128
            else:
                start = tl.load(offsets_ptr + E) + (p - E) * 128
            end = start * 0 + M_pad
        if PLACE:
            if first:
                pad = start + tl.arange(0, 128)
                tl.store(m_idx_ptr + pad, tl.full((128,), -1, tl.int32), mask=pad < end)
                tl.store(src_ptr + pad, tl.full((128,), -1, tl.int32), mask=pad < end)
        if DATA:
            for r0 in range(0, 128, _ZERO_ROWS):  # [_ZERO_ROWS, BLOCK_D] tiles: [128, BLOCK_D] took 254 registers
                r = start + r0 + tl.arange(0, _ZERO_ROWS)
                ok = r < end
                m = ok[:, None] & (cols[None, :] < D)
                if QUANT:
                    tl.store(out_ptr + r[:, None] * D + cols[None, :],
                             tl.zeros((_ZERO_ROWS, BLOCK_D), tl.float8e4nv), mask=m)
                    sz = _scale_inv(tl.zeros((_ZERO_ROWS, BLOCK_D // 128), tl.float32))[0]
                    tl.store(s_ptr + r[:, None] * (D // 128) + groups[None, :], sz,
                             mask=ok[:, None] & (groups[None, :] < D // 128))
                else:
                    tl.store(out_ptr + r[:, None] * D + cols[None, :],
                             tl.zeros((_ZERO_ROWS, BLOCK_D), out_ptr.dtype.element_ty), mask=m)


def permute_align(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, *, align: int = ALIGN,
                  quant: str | None = "fp8_1x128", layout: Layout | None = None):
    """Scatter each (token, k) row of x [T, D] into its expert's 128-aligned block, optionally quantized to e4m3
    with 1x128 scales. Returns (data [M_pad, D], scales [M_pad, D/128] fp32 or None, layout)."""
    if align != ALIGN:
        raise ValueError(f"permute_align: align={align} is not supported; the kernels use {ALIGN}-row blocks")
    if quant not in (None, "fp8_1x128"):
        raise ValueError(f"permute_align: quant={quant!r}; use 'fp8_1x128' or None")
    t, d = x.shape
    if quant and d % GROUP:
        raise ValueError(f"permute_align: hidden size {d} must be a multiple of {GROUP} for 1x128 quantization")
    x = x.contiguous()
    k = topk_ids.shape[1]
    if layout is None:  # build the layout: two counting launches, then placement fused into the data pass
        flat, rank, prefix, chunks, row_map, m_indices, src, counts, offsets = _count_and_scan(topk_ids, num_experts,
                                                                                              align)
        lay = Layout(m_indices, row_map, src, counts, offsets, t, k)
    else:
        flat = rank = prefix = layout.row_map
        chunks, lay = 1, layout
    out = torch.empty(lay.m_pad, d, device=x.device, dtype=FP8 if quant else x.dtype)  # [M_pad, D]
    scales = torch.empty(lay.m_pad, d // GROUP, device=x.device, dtype=torch.float32) if quant else None
    block_d = min(PERMUTE_BLOCK_D, triton.next_power_of_2(max(d, 128)))
    grid = (t + 2 * num_experts + 1, triton.cdiv(d, block_d))
    _permute_kernel[grid](x, flat, lay.row_map, lay.row_map, rank, prefix, lay.counts, lay.offsets, lay.m_indices,
                          lay.src, out, scales if quant else out, t, lay.m_pad, num_experts, chunks, D=d, K=k,
                          K_PAD=triton.next_power_of_2(k), BLOCK_D=block_d, CH=_CHUNK,
                          E_PAD=triton.next_power_of_2(num_experts), QUANT=quant is not None, PLACE=layout is None,
                          DATA=True, **LAUNCH["permute"])
    return out, scales, lay
