"""permute + align (+ 1x128 quantize): the data pass that scatters each token's row to its K expert blocks, and that
also places the rows (the counting sort's last step, layout.py) when the layout is being built.

Math: out[row_map[t, k]] = x[t] (or its e4m3 codes with one fp32 scale per 1x128 group), zero on padding rows.
Shapes: T tokens, D hidden, K top-k, E experts, C chunks of 128 expert ids, M_pad padded rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.moe.kernels.layout import CHUNK, Layout, count_and_scan
from moela.ops.moe.kernels.triton_common import ALIGN, FP8, GROUP, LAUNCH, e4m3_codes, fp8_scale_inverse

# channels per program of the (token, channel block) grid: the fastest of 512, 1024 and 2048 (2048 reached 74% of
# the copy bandwidth, 512 50%)
PERMUTE_BLOCK_D = 2048
ZERO_ROWS = tl.constexpr(8)  # rows per zero-fill tile of the padding programs


@triton.jit
def _expert_blocks(counts_ptr, E, E_PAD: tl.constexpr):
    """(experts [E_PAD], padded [E_PAD], starts [E_PAD]): each expert block's rows rounded up to 128 and its first
    row, the exclusive prefix sum of the padded sizes."""
    experts = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + experts, mask=experts < E, other=0).to(tl.int32)
    padded = (counts + 127) // 128 * 128
    return experts, padded, tl.cumsum(padded, axis=0) - padded


@triton.jit
def _place_token(token, ids_ptr, rank_ptr, prefix_ptr, experts, starts, C, K: tl.constexpr, K_PAD: tl.constexpr,
                 CH: tl.constexpr):
    """The rows of token's K (token, k) pairs: its expert's block start + the expert's ids in earlier chunks + its
    rank in its chunk; -1 for an empty slot (a negative expert id). Returns (ks [K_PAD], k_in (k < K), routed
    (k < K and not empty), flat indices, expert ids, rows), all [K_PAD]."""
    ks = tl.arange(0, K_PAD)
    k_in = ks < K
    flat = token * K + ks
    ids = tl.load(ids_ptr + flat, mask=k_in, other=-1).to(tl.int32)
    routed = k_in & (ids >= 0)
    block_start = tl.sum(tl.where(experts[None, :] == ids[:, None], starts[None, :], 0), axis=1)  # [K_PAD]
    rows = block_start + tl.load(prefix_ptr + ids * C + flat // CH, mask=routed, other=0) + \
        tl.load(rank_ptr + flat, mask=routed, other=0)
    return ks, k_in, routed, flat, ids, tl.where(routed, rows, -1)


@triton.jit
def _zero_rows(out_ptr, scale_ptr, start, end, cols, groups, D: tl.constexpr, BLOCK_D: tl.constexpr,
               QUANT: tl.constexpr):
    """Zeros (and, when QUANT, the scales of all-zero groups) on rows [start, min(end, start + 128)), in
    [ZERO_ROWS, BLOCK_D] tiles ([128, BLOCK_D] took 254 registers)."""
    for first_row in range(0, 128, ZERO_ROWS):
        rows = start + first_row + tl.arange(0, ZERO_ROWS)
        row_ok = rows < end
        mask = row_ok[:, None] & (cols[None, :] < D)
        if QUANT:
            tl.store(out_ptr + rows[:, None] * D + cols[None, :], tl.zeros((ZERO_ROWS, BLOCK_D), tl.float8e4nv),
                     mask=mask)
            zero_scale = fp8_scale_inverse(tl.zeros((ZERO_ROWS, BLOCK_D // 128), tl.float32))[0]
            tl.store(scale_ptr + rows[:, None] * (D // 128) + groups[None, :], zero_scale,
                     mask=row_ok[:, None] & (groups[None, :] < D // 128))
        else:
            tl.store(out_ptr + rows[:, None] * D + cols[None, :],
                     tl.zeros((ZERO_ROWS, BLOCK_D), out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _permute_kernel(
    x_ptr,  # [T, D] activations (read when DATA)
    ids_ptr,  # [T*K] expert ids (read when PLACE)
    rank_ptr,  # [T*K] int32 from the count kernel (read when PLACE)
    prefix_ptr,  # [E, C] int32 from the scan kernel (read when PLACE)
    counts_ptr,  # [E] int64 rows per expert
    offsets_ptr,  # [E + 1] int64 expert block starts: written when PLACE, else read
    row_map_ptr,  # [T*K] int32 row of each (token, k): written when PLACE, else read
    m_idx_ptr,  # [M_pad] int32 expert of each row, -1 on padding: written when PLACE
    src_ptr,  # [M_pad] int32 flat (token, k) index of each row, -1 on padding: written when PLACE
    out_ptr,  # [M_pad, D] written when DATA: x's rows (e4m3 codes when QUANT), zeros on padding
    scale_ptr,  # [M_pad, D/128] fp32 written when DATA and QUANT
    T, M_pad, E, C,
    D: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_D: tl.constexpr, CH: tl.constexpr,
    E_PAD: tl.constexpr, QUANT: tl.constexpr, PLACE: tl.constexpr, DATA: tl.constexpr,
):
    """Program (p, c) covers channels [c * BLOCK_D, (c + 1) * BLOCK_D). p in [0, T): token p's K rows, read once,
    (quantized,) written to each row. p in [T, T+E): expert p-T's padding rows; p in [T+E, T+2E+1): 128 rows each
    of the tail after the last expert; zeroed. PLACE (building the layout): the rows come from the counting kernels,
    the c = 0 programs write row_map, m_indices and src, program (0, 0) the offsets; otherwise rows come from
    row_map. A negative expert id is an empty slot: no row (row_map -1), nothing written. Grid:
    (T + 2E + 1, cdiv(D, BLOCK_D))."""
    pid = tl.program_id(0)
    first_channel_block = tl.program_id(1) == 0
    col0 = tl.program_id(1) * BLOCK_D
    cols = col0 + tl.arange(0, BLOCK_D)
    groups = col0 // 128 + tl.arange(0, BLOCK_D // 128)  # 1x128 scale groups of this channel block
    if PLACE:
        experts, padded, starts = _expert_blocks(counts_ptr, E, E_PAD)
        if (pid == 0) & first_channel_block:
            tl.store(offsets_ptr + experts, starts.to(tl.int64), mask=experts < E)
            tl.store(offsets_ptr + E, tl.sum(padded, axis=0).to(tl.int64))
    if pid < T:
        # a token: find its rows, then copy (or quantize) its channels to each
        if PLACE:
            ks, k_in, routed, flat, ids, rows = _place_token(pid, ids_ptr, rank_ptr, prefix_ptr, experts, starts,
                                                             C, K, K_PAD, CH)
            if first_channel_block:
                tl.store(row_map_ptr + flat, rows, mask=k_in)  # -1 for an empty slot
                tl.store(m_idx_ptr + rows, ids, mask=routed)
                tl.store(src_ptr + rows, flat, mask=routed)
        if DATA:
            if QUANT:  # [G, 128] tile: one row per 1x128 group (explicit 2-D addressing, no reshape)
                group_cols = groups[:, None] * 128 + tl.arange(0, 128)[None, :]
                values = tl.load(x_ptr + pid.to(tl.int64) * D + group_cols, mask=group_cols < D,
                                 other=0.0).to(tl.float32)
                scale, inverse = fp8_scale_inverse(tl.max(tl.abs(values), axis=1))  # [G]
                codes = e4m3_codes(values, inverse[:, None])
            else:
                values = tl.load(x_ptr + pid.to(tl.int64) * D + cols, mask=cols < D, other=0.0)
            for k in tl.static_range(K):
                if PLACE:
                    row = tl.sum(tl.where(ks == k, rows, 0), axis=0).to(tl.int64)
                else:
                    row = tl.load(row_map_ptr + pid * K + k).to(tl.int64)
                if row >= 0:  # an empty slot has no row
                    if QUANT:
                        tl.store(out_ptr + row * D + group_cols, codes, mask=group_cols < D)
                        tl.store(scale_ptr + row * (D // 128) + groups, scale, mask=groups < D // 128)
                    else:
                        tl.store(out_ptr + row * D + cols, values.to(out_ptr.dtype.element_ty), mask=cols < D)
    else:
        # padding: an expert block's rows past its tokens, or 128 rows of the tail past the last expert
        pad_program = pid - T
        if pad_program < E:
            if PLACE:
                block_start = tl.sum(tl.where(experts < pad_program, padded, 0), axis=0)
                start = block_start + tl.load(counts_ptr + pad_program).to(tl.int32)
                end = block_start + tl.sum(tl.where(experts == pad_program, padded, 0), axis=0)
            else:
                start = tl.load(offsets_ptr + pad_program) + tl.load(counts_ptr + pad_program)
                end = tl.load(offsets_ptr + pad_program + 1)
        else:
            if PLACE:
                start = tl.sum(padded, axis=0) + (pad_program - E) * 128
            else:
                start = tl.load(offsets_ptr + E) + (pad_program - E) * 128
            end = start * 0 + M_pad
        if PLACE:
            if first_channel_block:
                pad_rows = start + tl.arange(0, 128)
                tl.store(m_idx_ptr + pad_rows, tl.full((128,), -1, tl.int32), mask=pad_rows < end)
                tl.store(src_ptr + pad_rows, tl.full((128,), -1, tl.int32), mask=pad_rows < end)
        if DATA:
            _zero_rows(out_ptr, scale_ptr, start, end, cols, groups, D, BLOCK_D, QUANT)


def _launch_permute(x: torch.Tensor, flat_ids: torch.Tensor, rank: torch.Tensor, prefix: torch.Tensor, chunks: int,
                    layout: Layout, out: torch.Tensor, scales: torch.Tensor, *, d: int, block_d: int, quant: bool,
                    place: bool, data: bool) -> None:
    num_experts = layout.counts.numel()
    _permute_kernel[(layout.num_tokens + 2 * num_experts + 1, triton.cdiv(d, block_d))](
        x,
        flat_ids,
        rank,
        prefix,
        layout.counts,
        layout.offsets,
        layout.row_map,
        layout.m_indices,
        layout.src,
        out,
        scales,
        layout.num_tokens, layout.m_pad, num_experts, chunks,
        D=d, K=layout.topk, K_PAD=triton.next_power_of_2(layout.topk), BLOCK_D=block_d, CH=CHUNK,
        E_PAD=triton.next_power_of_2(num_experts), QUANT=quant, PLACE=place, DATA=data, **LAUNCH["permute"])


def build_layout(topk_ids: torch.Tensor, num_experts: int, align: int = ALIGN) -> Layout:
    """The contiguous layout of topk_ids [T, K] (ids in [0, num_experts)) as a stable counting sort in three Triton
    launches and no host sync (M_pad is the upper bound): per-chunk ranks and expert histograms, their prefix sums
    over chunks, and the placement (the permute kernel without data; `permute_align` without a given layout places
    and moves the data in one launch). Rows keep token order inside each expert."""
    flat, rank, prefix, chunks, layout = count_and_scan(topk_ids, num_experts, align)
    _launch_permute(flat, flat, rank, prefix, chunks, layout, flat, flat, d=128, block_d=128, quant=False, place=True,
                    data=False)
    return layout


def permute_align(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, *, align: int = ALIGN,
                  quant: str | None = "fp8_1x128", layout: Layout | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, Layout]:
    """Scatter each (token, k) row of x [T, D] into its expert's 128-aligned block, optionally quantized to e4m3
    with 1x128 scales. Returns (data [M_pad, D], scales [M_pad, D/128] fp32 or None, layout); without a `layout`
    the same launch builds it."""
    if align != ALIGN:
        raise ValueError(f"permute_align: align={align} is not supported; the kernels use {ALIGN}-row blocks")
    if quant not in (None, "fp8_1x128"):
        raise ValueError(f"permute_align: quant={quant!r}; use 'fp8_1x128' or None")
    d = x.shape[1]
    if quant and d % GROUP:
        raise ValueError(f"permute_align: hidden size {d} must be a multiple of {GROUP} for 1x128 quantization")
    x = x.contiguous()
    if layout is None:  # two counting launches, then the placement fused into the data pass
        flat, rank, prefix, chunks, lay = count_and_scan(topk_ids, num_experts, align)
    else:  # the counting buffers are not read: any int32 tensor
        flat = rank = prefix = layout.row_map
        chunks, lay = 1, layout
    out = torch.empty(lay.m_pad, d, device=x.device, dtype=FP8 if quant else x.dtype)  # [M_pad, D]
    scales = torch.empty(lay.m_pad, d // GROUP, device=x.device, dtype=torch.float32) if quant else None
    _launch_permute(x, flat, rank, prefix, chunks, lay, out, scales if quant else out, d=d,
                    block_d=min(PERMUTE_BLOCK_D, triton.next_power_of_2(max(d, 128))), quant=quant is not None,
                    place=layout is None, data=True)
    return out, scales, lay
