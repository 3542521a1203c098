"""Triton kernels for everything in the MoE expert path that is not a GEMM: layout, quantization, SwiGLU, combine.

Layout (DeepGEMM's m-grouped contiguous layout): the T*K (token, k) rows are grouped by expert, expert e's rows
start at a multiple of `align` (128) and its block is padded with zero rows up to the next multiple. `m_indices
[M_pad]` holds each row's expert (-1 on padding rows), `row_map [T*K]` the row of (t, k), `src [M_pad]` the flat
index t*K+k of each row (-1 on padding). M_pad is an upper bound computed on the host from T, K and E
(round_up(T*K, align) + E*align), so building the layout needs no host sync; rows past the last expert are
padding. The index math is a stable counting sort of the T*K expert ids in Triton: ranks and expert histograms per
128-id chunk, their prefix sums over chunks, then each row's placement, which `permute_align` does inside its data
pass (three launches for the whole permute; no torch index ops, no sort). Every pass over activations is one
Triton kernel.

FP8 scales follow DeepGEMM's SM90 format: fp32, `scale = amax / 448`, activations rowwise 1x128 ([M, N/128]);
"columnwise" 128x1 groups along tokens are stored as the 1x128 quantization of the transposed matrix
(qT [N, M_pad], sT [N, M_pad/128]) because the weight-gradient GEMM reduces over tokens; weights 128x128
([E, N/128, K/128]) plus a transposed fp8 copy for the data-gradient GEMM. codes = e4m3(x * ((1 / amax) * 448)) with
one `div_rn` per group, so results match `moela.ops.quant` (the spec) bit for bit.

Shapes: T tokens, D hidden, E experts, K top-k, F expert FFN width, M_pad padded rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moela.ops import moe_gluon
from moela.ops.quant import AMAX_EPS, FP8_MAX

ALIGN = 128
GROUP = 128
FP8 = torch.float8_e4m3fn
# Triton 3.6's interpreter converts fp32 -> e4m3 without carrying the rounding into the exponent; under it the
# kernels round to e4m3's grid in fp32 first (exactly what the hardware conversion does), so the cast is exact.
_EPS = tl.constexpr(AMAX_EPS)
_FMAX = tl.constexpr(FP8_MAX)
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
# channels per permute program (a (token, channel chunk) grid): 2048 moved the V3 permute+align+quant from 70% to
# 74% of the copy bandwidth on the H200, 512 ran at 50% (bench/moe.py --sections permute_cfg, moe_notes.md run 13)
PERMUTE_BLOCK_D = 2048
_ZERO_ROWS = tl.constexpr(8)  # rows per zero-fill tile of the permute kernel's padding programs
# Launch options per kernel, shared with tests/sm90_compile.py (which reports registers and spills for sm_90). One
# 128x128 tile per program; 4 warps (128 values per thread, up to 255 registers without spills) keep three or more
# blocks and their loads in flight per SM: a transposed column quantization ran at 82% of the copy bandwidth with
# 4 warps, 59% with 8, 35% persistent with one block per SM (bench/results/quant_transpose.md). The SwiGLU
# backward (three output tiles per input tile) stays at 16 warps: 1.58 ms there (run 11), 2.73 ms at 4 (run 9;
# bench/results/moe_notes.md). The tile kernels' grids put the column blocks on the fastest axis, so the blocks in
# flight read long contiguous stretches of each row: the row+column quantization ran at 65% of the copy bandwidth
# in that order, 56% with row blocks fastest (256-byte pieces of many rows; quant_transpose.md). On Hopper (sm_90),
# for bf16 inputs, quant_rows_cols, swiglu_bwd(quant=True) and quant_weights run moela.ops.moe_gluon's kernels
# instead (tiles staged in shared memory; the row+column quantization at 79-83%).
LAUNCH = dict(layout=dict(num_warps=4), permute=dict(num_warps=4), quant_rows_cols=dict(num_warps=4),
              quant_rows_or_cols=dict(num_warps=4), weight_quant=dict(num_warps=4), swiglu_fwd=dict(num_warps=4),
              swiglu_bwd=dict(num_warps=16), combine=dict(num_warps=4), combine_bwd=dict(num_warps=4))


@dataclass
class Layout:
    """Where each (token, k) row lives in the padded expert-grouped layout."""

    m_indices: torch.Tensor  # [M_pad] int32, expert per row, -1 on padding rows
    row_map: torch.Tensor  # [T*K] int32, padded row of flat index t*K+k
    src: torch.Tensor  # [M_pad] int32, flat index t*K+k of each row, -1 on padding rows
    counts: torch.Tensor  # [E] int64 real rows per expert
    offsets: torch.Tensor  # [E+1] int64 padded start of each expert's block (offsets[E] = end of the last)
    num_tokens: int
    topk: int

    @property
    def m_pad(self) -> int:
        return self.m_indices.numel()

    def expert_bounds(self) -> list[tuple[int, int]]:
        """Each expert's padded row range [s, t) as host integers (reads the offsets: one device sync)."""
        off = self.offsets.tolist()
        return list(zip(off[:-1], off[1:]))


def build_layout_rows(num_tokens: int, topk: int, num_experts: int, align: int = ALIGN) -> int:
    """M_pad: the rows of the layout, an upper bound on the padded total known without looking at the routing."""
    return triton.cdiv(num_tokens * topk, align) * align + num_experts * align


_CHUNK = 128  # expert ids per program of the layout's counting kernel (a [128, 128] comparison ranks them)


@triton.jit
def _layout_count_kernel(ids_ptr, rank_ptr, hist_ptr, n, C, E, CH: tl.constexpr, E_BLOCK: tl.constexpr,
                         E_BLOCKS: tl.constexpr):
    """Chunk c of the flat expert ids [c * CH, (c + 1) * CH): rank[i] = how many earlier ids of the chunk equal
    id_i; hist[e, c] = how many ids of the chunk are e."""
    c = tl.program_id(0)
    j = tl.arange(0, CH)
    i = c * CH + j
    ok = i < n
    ids = tl.load(ids_ptr + i, mask=ok, other=-1).to(tl.int32)
    before = (ids[None, :] == ids[:, None]) & (j[None, :] < j[:, None])  # [CH (i), CH (earlier)]
    tl.store(rank_ptr + i, tl.sum(before.to(tl.int32), axis=1), mask=ok)
    for b in tl.static_range(E_BLOCKS):
        ex = b * E_BLOCK + tl.arange(0, E_BLOCK)
        hist = tl.sum((ids[:, None] == ex[None, :]).to(tl.int32), axis=0)  # [E_BLOCK]
        tl.store(hist_ptr + ex * C + c, hist, mask=ex < E)


@triton.jit
def _layout_scan_kernel(hist_ptr, prefix_ptr, counts_ptr, C, BLOCK_C: tl.constexpr):
    """Expert e: prefix[e, c] = its ids in chunks before c (exclusive scan of hist[e, :]); counts[e] = all of them.
    BLOCK_C >= C (one vector: 32 values per thread at 4096 chunks, i.e. T*K = 512k)."""
    e = tl.program_id(0)
    cc = tl.arange(0, BLOCK_C)
    h = tl.load(hist_ptr + e * C + cc, mask=cc < C, other=0)
    tl.store(prefix_ptr + e * C + cc, tl.cumsum(h, axis=0) - h, mask=cc < C)
    tl.store(counts_ptr + e, tl.sum(h, axis=0).to(tl.int64))


def _count_and_scan(topk_ids: torch.Tensor, num_experts: int, align: int):
    """The layout's first two launches (ranks and histograms per chunk; counts and per-chunk prefix sums per expert)
    and every index buffer of it, in one int32 and one int64 allocation. Returns (flat ids, rank, prefix, chunks,
    row_map, m_indices, src, counts, offsets); the permute kernel in PLACE mode then writes row_map, m_indices, src
    and offsets."""
    if align != ALIGN:
        raise ValueError(f"build_layout: align={align} is not supported; the kernels use {ALIGN}-row blocks")
    if topk_ids.dim() != 2:
        raise ValueError(f"build_layout wants topk_ids [T, K]; got shape {tuple(topk_ids.shape)}")
    t, k = topk_ids.shape
    e, tk, dev = num_experts, topk_ids.numel(), topk_ids.device
    flat = topk_ids.reshape(-1).contiguous()  # [T*K], int32 or int64
    m_pad = build_layout_rows(t, k, e, align)
    chunks = max(1, triton.cdiv(tk, _CHUNK))
    ints = torch.empty(2 * tk + 2 * e * chunks + 2 * m_pad, dtype=torch.int32, device=dev)
    rank, row_map, hist, prefix, m_indices, src = ints.split([tk, tk, e * chunks, e * chunks, m_pad, m_pad])
    longs = torch.empty(2 * e + 1, dtype=torch.int64, device=dev)
    counts, offsets = longs[:e], longs[e:]
    e_block = min(64, triton.next_power_of_2(e))
    _layout_count_kernel[(chunks,)](flat, rank, hist, tk, chunks, e, CH=_CHUNK, E_BLOCK=e_block,
                                    E_BLOCKS=triton.cdiv(e, e_block), **LAUNCH["layout"])
    _layout_scan_kernel[(e,)](hist, prefix, counts, chunks, BLOCK_C=triton.next_power_of_2(chunks),
                              **LAUNCH["layout"])
    return flat, rank, prefix, chunks, row_map, m_indices, src, counts, offsets


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


# ----------------------------------------------------------------------------------------------------------------
# shared jit helpers


@triton.jit
def _scale_inv(amax):
    """(scale, inverse) of a group with this amax: amax / 448 and (1 / amax) * 448, as moela.ops.quant rounds them
    (the codes are x * inverse)."""
    a = tl.maximum(amax, _EPS)
    return tl.math.div_rn(a, _FMAX), tl.math.div_rn(1.0, a) * _FMAX


@triton.jit
def _round_e4m3(x):
    """Round fp32 values in [-448, 448] to the nearest e4m3 value (ties to even), staying in fp32."""
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    normal = bits.to(tl.float32, bitcast=True)
    sub = (a + 24576.0) - 24576.0
    r = tl.where(a >= 0.015625, normal, sub)
    return tl.where(x < 0, -r, r)


@triton.jit
def _quant(x, inv):
    """e4m3 codes of x * inv (|x * inv| <= 448 up to rounding). On the GPU the conversion saturates
    (cvt.rn.satfinite), which is the clamp to +-448; the interpreter clamps and rounds explicitly."""
    if INTERPRET:
        return _round_e4m3(tl.clamp(x * inv, -_FMAX, _FMAX)).to(tl.float8e4nv)
    return (x * inv).to(tl.float8e4nv)


@triton.jit
def _store_codes(ptrs, q, mask):
    """Store e4m3 codes q at ptrs (any addressing, e.g. a tile's transposed places) as bytes. No fp8 tile is
    transposed (tl.trans of fp8 tiles is reported to corrupt them on Hopper) and the store is an 8-bit integer one
    (triton-lang/triton#11111: an fp8 store through a layout conversion next to a second store is reported
    corrupted). Used for the column-quantized outputs, whose values differ from the row-quantized ones (both
    checked on the H200 by `bench/moe.py --sections check`). Storing the *same* codes twice, once row-major and
    once transposed, still gave wrong transposed bytes on the H200, hence quant_weights' second launch."""
    tl.store(ptrs.to(tl.pointer_type(tl.uint8)), q.to(tl.uint8, bitcast=True), mask=mask)


@triton.jit
def _store_rows_cols(tile, rows, cols, row_ok, col_ok, q_ptr, s_ptr, qt_ptr, st_ptr, ld_q, ld_s, ld_qt, ld_st,
                     ROWWISE: tl.constexpr, COLWISE: tl.constexpr):
    """tile [128, 128] fp32 at (rows, cols): rowwise 1x128 quant (one scale per row) and/or columnwise 128x1 quant
    (one scale per column), the latter stored transposed. Rows/cols are one aligned 128-group each."""
    if ROWWISE:
        rs, ri = _scale_inv(tl.max(tl.abs(tile), axis=1))  # [128]
        q = _quant(tile, ri[:, None])
        tl.store(q_ptr + rows[:, None] * ld_q + cols[None, :], q, mask=row_ok[:, None] & col_ok[None, :])
        tl.store(s_ptr + rows * ld_s + tl.min(cols, axis=0) // 128, rs, mask=row_ok)
    if COLWISE:
        cs, ci = _scale_inv(tl.max(tl.abs(tile), axis=0))  # [128]
        qc = _quant(tile, ci[None, :])
        _store_codes(qt_ptr + cols[None, :] * ld_qt + rows[:, None], qc, row_ok[:, None] & col_ok[None, :])
        tl.store(st_ptr + cols * ld_st + tl.min(rows, axis=0) // 128, cs, mask=col_ok)


# ----------------------------------------------------------------------------------------------------------------
# permute + align (+ quantize)


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
    and src (-1 on padding rows), program (0, 0) the offsets; otherwise rows come from row_map (lrow_ptr)."""
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
            kok = kk < K
            i = pid * K + kk  # flat (token, k) indices
            ids = tl.load(ids_ptr + i, mask=kok, other=0).to(tl.int32)
            block = tl.sum(tl.where(ex[None, :] == ids[:, None], starts[None, :], 0), axis=1)  # [K]
            rows = block + tl.load(prefix_ptr + ids * C + i // CH, mask=kok, other=0) + \
                tl.load(rank_ptr + i, mask=kok, other=0)
            if first:
                tl.store(row_map_ptr + i, rows, mask=kok)
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


# ----------------------------------------------------------------------------------------------------------------
# grouped rowwise + columnwise quantization from one read (optionally gathering rows)


@triton.jit
def _rowcol_quant_kernel(x_ptr, src_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, N, ld_x, gather_div,
                         GATHER: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr):
    if GATHER:  # rows gathered from x: row blocks fastest (0.45 ms for the V3 layer's x, 0.56 the other way)
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    else:  # column blocks fastest: see LAUNCH
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m * 128 + tl.arange(0, 128)
    cols = pid_n * 128 + tl.arange(0, 128)
    row_ok, col_ok = rows < M, cols < N
    if GATHER:
        s = tl.load(src_ptr + rows, mask=row_ok, other=-1)
        ok = s >= 0
        srow = tl.where(ok, s // gather_div, 0).to(tl.int64)
    else:
        ok = row_ok
        srow = rows.to(tl.int64)
    tile = tl.load(x_ptr + srow[:, None] * ld_x + cols[None, :], mask=ok[:, None] & col_ok[None, :],
                   other=0.0).to(tl.float32)
    _store_rows_cols(tile, rows, cols, row_ok, col_ok, q_ptr, s_ptr, qt_ptr, st_ptr, N, N // 128, M, M // 128,
                     ROWWISE, COLWISE)


def _use_gluon(op: str, impl: str, *tensors: torch.Tensor) -> bool:
    """Whether `op` runs its Gluon kernel (moela.ops.moe_gluon): impl "gluon" demands it, "auto" takes it where it
    can run (never under the interpreter), "triton" never."""
    if impl not in ("auto", "triton", "gluon"):
        raise ValueError(f"{op}: impl={impl!r}; use 'auto', 'triton' or 'gluon'")
    ok = all(moe_gluon.available(t) for t in tensors)
    if impl == "gluon" and not ok:
        got = ", ".join(f"{t.dtype} on {t.device}" for t in tensors)
        raise ValueError(f"{op}: impl='gluon' needs bf16 CUDA tensors on a Hopper (sm_90) GPU and a Triton with Gluon "
                         f"(got {got}); use impl='triton'")
    return impl == "gluon" or (impl == "auto" and ok and not INTERPRET)


def quant_rows_cols(x: torch.Tensor, *, rowwise: bool = True, colwise: bool = True, src: torch.Tensor | None = None,
                    gather_div: int = 1, impl: str = "auto"):
    """One read of x [M, N] (or of rows x[src // gather_div], zero where src < 0, M = len(src)); returns
    (q [M, N] e4m3, s [M, N/128]) rowwise and (qT [N, M] e4m3, sT [N, M/128]) columnwise (None where not asked).
    M and N must be multiples of 128 (the padded layout guarantees M). impl: "triton" (the tile in registers; runs
    everywhere, the interpreter included), "gluon" (the tile staged in shared memory, moela.ops.moe_gluon: bf16 on
    sm_90), "auto" (gluon where it can run, else triton). Both give the same bytes."""
    m = src.numel() if src is not None else x.shape[0]
    n = x.shape[1]
    if m % 128 or n % 128:
        raise ValueError(f"quant_rows_cols: shape ({m}, {n}) must be multiples of 128 in both dims")
    use_gluon = _use_gluon("quant_rows_cols", impl, x)
    dev = x.device
    q = torch.empty(m, n, device=dev, dtype=FP8) if rowwise else None
    s = torch.empty(m, n // 128, device=dev, dtype=torch.float32) if rowwise else None
    qt = torch.empty(n, m, device=dev, dtype=FP8) if colwise else None
    st = torch.empty(n, m // 128, device=dev, dtype=torch.float32) if colwise else None
    if use_gluon:
        moe_gluon.quant_rows_cols(x, rowwise, colwise, src, gather_div, q, s, qt, st)
        return (q, s), (qt, st)
    dummy = x
    _rowcol_quant_kernel[(m // 128, n // 128) if src is not None else (n // 128, m // 128)](
        x, src if src is not None else dummy, q if rowwise else dummy, s if rowwise else dummy,
        qt if colwise else dummy, st if colwise else dummy, m, n, x.stride(0), gather_div,
        GATHER=src is not None, ROWWISE=rowwise, COLWISE=colwise,
        **LAUNCH["quant_rows_cols" if rowwise and colwise else "quant_rows_or_cols"])
    return (q, s), (qt, st)


# ----------------------------------------------------------------------------------------------------------------
# 128x128 weight quantization for all experts at once, plus the transposed copy


@triton.jit
def _weight_quant_kernel(w_ptr, q_ptr, s_ptr, s_we, s_wn, s_wk, N, K):
    """One 128x128 block of expert e of a strided view [E, N, K] -> contiguous q [E, N, K] and its scale."""
    bk, bn, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = bn * 128 + tl.arange(0, 128)
    rk = bk * 128 + tl.arange(0, 128)
    src = w_ptr + e.to(tl.int64) * s_we + rn[:, None].to(tl.int64) * s_wn + rk[None, :].to(tl.int64) * s_wk
    blk = tl.load(src).to(tl.float32)  # [128, 128]
    sc, inv = _scale_inv(tl.max(tl.max(tl.abs(blk), axis=1), axis=0))
    tl.store(q_ptr + e.to(tl.int64) * N * K + rn[:, None] * K + rk[None, :], _quant(blk, inv))
    tl.store(s_ptr + (e * (N // 128) + bn) * (K // 128) + bk, sc)


def _weight_quant_launch(w: torch.Tensor):
    e, n, k = w.shape
    q = torch.empty(e, n, k, device=w.device, dtype=FP8)
    s = torch.empty(e, n // 128, k // 128, device=w.device, dtype=torch.float32)
    _weight_quant_kernel[(k // 128, n // 128, e)](w, q, s, w.stride(0), w.stride(1), w.stride(2), n, k,
                                                  **LAUNCH["weight_quant"])
    return q, s


def quant_weights(w: torch.Tensor, *, transposed: bool = True, transpose_by: str = "quant", impl: str = "auto"):
    """w [E, N, K] -> q [E, N, K] e4m3, s [E, N/128, K/128] fp32, and qT [E, K, N] (whose scales are
    s.transpose(1, 2)) when `transposed`. N and K must be multiples of 128. impl "gluon" (moela.ops.moe_gluon;
    contiguous bf16 on sm_90, "auto" takes it where it can run): one read of w, each 128x128 block staged in shared
    memory and its codes written to q and, read back by columns, to qT. impl "triton": transpose_by="quant" runs
    the kernel again on the transposed view of w: every 128x128 block has the same amax, hence the same scale and
    codes, so qT is exactly q's transpose, written with coalesced row stores (2.24 ms for both launches on w13 + w2
    of the V3 E32 layer on the H200, bench/results/moe.md run 11); "torch" copies q.transpose(1, 2) byte by byte
    (9.6 ms, run 4). Writing qT from the same Triton kernel gave wrong bytes on the H200 (triton 3.6) in three
    designs, though bit-exact in the interpreter: codes stored at transposed addresses (fp8 and uint8 stores) and
    the bf16 block transposed on chip (tl.trans) and quantized again; only that transpose inside a persistent,
    software-pipelined loop (the block read back from shared memory transposed) was right, and it was no faster
    (3.5 ms). The Gluon kernel's bytes are checked against the Triton launches on the GPU
    (tests/test_quant.py::test_gluon_weight_quant_equals_the_triton_kernel)."""
    e, n, k = w.shape
    if n % 128 or k % 128:
        raise ValueError(f"quant_weights: expert weight shape ({n}, {k}) must be multiples of 128")
    if transpose_by not in ("quant", "torch"):
        raise ValueError(f"quant_weights: transpose_by={transpose_by!r}; use 'quant' or 'torch'")
    if impl == "gluon" and transpose_by != "quant":
        raise ValueError("quant_weights: transpose_by='torch' is a way of the Triton kernel; use impl='triton'")
    if impl == "auto" and (not w.is_contiguous() or transpose_by != "quant"):
        impl = "triton"
    if _use_gluon("quant_weights", impl, w):
        w = w.contiguous()
        q = torch.empty(e, n, k, device=w.device, dtype=FP8)
        s = torch.empty(e, n // 128, k // 128, device=w.device, dtype=torch.float32)
        qt = torch.empty(e, k, n, device=w.device, dtype=FP8) if transposed else None
        moe_gluon.quant_weights(w, q, s, qt)
        return q, s, qt
    q, s = _weight_quant_launch(w)
    if not transposed:
        return q, s, None
    qt = _weight_quant_launch(w.transpose(1, 2))[0] if transpose_by == "quant" else q.transpose(1, 2).contiguous()
    return q, s, qt  # qt [E, K, N]


# ----------------------------------------------------------------------------------------------------------------
# SwiGLU between the GEMMs: forward fused with rowwise quantization, backward fused with both quantizations


@triton.jit
def _swiglu_fwd_kernel(h_ptr, m_idx_ptr, out_ptr, s_ptr, M, F, QUANT: tl.constexpr):
    pid_f, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m * 128 + tl.arange(0, 128)
    cols = pid_f * 128 + tl.arange(0, 128)
    valid = tl.load(m_idx_ptr + rows) >= 0
    r64 = rows.to(tl.int64)
    g = tl.load(h_ptr + r64[:, None] * (2 * F) + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    u = tl.load(h_ptr + r64[:, None] * (2 * F) + F + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    act = g * tl.sigmoid(g) * u  # [128, 128]
    if QUANT:
        _store_rows_cols(act, rows, cols, rows < M, cols < F, out_ptr, s_ptr, out_ptr, s_ptr, F, F // 128, 0, 0,
                         True, False)
    else:
        tl.store(out_ptr + r64[:, None] * F + cols[None, :], act.to(out_ptr.dtype.element_ty))


def swiglu_fwd(h: torch.Tensor, m_indices: torch.Tensor, *, quant: bool):
    """h [M_pad, 2F] -> act [M_pad, F] (e4m3 + 1x128 scales when quant, else h's dtype); padding rows -> 0."""
    m, two_f = h.shape
    f = two_f // 2
    if quant:
        out = torch.empty(m, f, device=h.device, dtype=FP8)
        s = torch.empty(m, f // 128, device=h.device, dtype=torch.float32)
    else:
        out, s = torch.empty(m, f, device=h.device, dtype=h.dtype), None
    _swiglu_fwd_kernel[(f // 128, m // 128)](h, m_indices, out, s if quant else out, m, f, QUANT=quant,
                                             **LAUNCH["swiglu_fwd"])
    return out, s


@triton.jit
def _swiglu_bwd_part(h_ptr, da_ptr, m_idx_ptr, dh_ptr, dhs_ptr, dht_ptr, dhst_ptr, at_ptr, ast_ptr, M, F, pid_m,
                     pid_f, QUANT: tl.constexpr, PART: tl.constexpr):
    """Output PART of tile (pid_m, pid_f): 0 dg, 1 du (both into dh), 2 act."""
    rows = pid_m * 128 + tl.arange(0, 128)
    cols = pid_f * 128 + tl.arange(0, 128)
    valid = tl.load(m_idx_ptr + rows) >= 0
    r64 = rows.to(tl.int64)
    g = tl.load(h_ptr + r64[:, None] * (2 * F) + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    if PART != 1:
        u = tl.load(h_ptr + r64[:, None] * (2 * F) + F + cols[None, :], mask=valid[:, None], other=0.0)
        u = u.to(tl.float32)
    if PART != 2:
        da = tl.load(da_ptr + r64[:, None] * F + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    if PART == 0:
        out = da * u * (sig + silu * (1.0 - sig))
    elif PART == 1:
        out = da * silu
    else:
        out = silu * u
    if PART == 2:
        if QUANT:
            _store_rows_cols(out, rows, cols, rows < M, cols < F, at_ptr, ast_ptr, at_ptr, ast_ptr, 0, 0, M,
                             M // 128, False, True)
        else:
            tl.store(at_ptr + r64[:, None] * F + cols[None, :], out.to(at_ptr.dtype.element_ty))
    else:
        c_out = cols + PART * F
        if QUANT:
            _store_rows_cols(out, rows, c_out, rows < M, cols < F, dh_ptr, dhs_ptr, dht_ptr, dhst_ptr, 2 * F,
                             2 * F // 128, M, M // 128, True, True)
        else:
            tl.store(dh_ptr + r64[:, None] * (2 * F) + c_out[None, :], out.to(dh_ptr.dtype.element_ty))


@triton.jit
def _swiglu_bwd_kernel(h_ptr, da_ptr, m_idx_ptr, dh_ptr, dhs_ptr, dht_ptr, dhst_ptr, at_ptr, ast_ptr, M, F,
                       QUANT: tl.constexpr):
    """dact [M, F], h [M, 2F] -> dh [M, 2F] (+ its row and column quantization) and act's column quantization.
    Program (part, f, m) writes one output of the 128x128 tile (m, f): part 0 dg, 1 du, 2 act, each branch its own
    code, so only one fp32 result tile and its quantization are live (all three in one program spilled at 255
    registers). The three programs of a tile are neighbours in launch order: the inputs they share come from L2."""
    part, pid_f, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if part == 0:
        _swiglu_bwd_part(h_ptr, da_ptr, m_idx_ptr, dh_ptr, dhs_ptr, dht_ptr, dhst_ptr, at_ptr, ast_ptr, M, F, pid_m,
                         pid_f, QUANT, 0)
    elif part == 1:
        _swiglu_bwd_part(h_ptr, da_ptr, m_idx_ptr, dh_ptr, dhs_ptr, dht_ptr, dhst_ptr, at_ptr, ast_ptr, M, F, pid_m,
                         pid_f, QUANT, 1)
    else:
        _swiglu_bwd_part(h_ptr, da_ptr, m_idx_ptr, dh_ptr, dhs_ptr, dht_ptr, dhst_ptr, at_ptr, ast_ptr, M, F, pid_m,
                         pid_f, QUANT, 2)


def swiglu_bwd(h: torch.Tensor, dact: torch.Tensor, m_indices: torch.Tensor, *, quant: bool, impl: str = "auto"):
    """Returns (dh_rowwise, dh_colwise, act_colwise) as (q, s) pairs when quant; else (dh, None, act) in h's dtype
    with act recomputed (the bf16 weight gradient reads it row-major). impl (quant only): "triton" (one program per
    output tile, the inputs in registers), "gluon" (moela.ops.moe_gluon: the three input tiles staged in shared
    memory, every output from one read; bf16 on sm_90), "auto" (gluon where it can run). Same bytes."""
    m, two_f = h.shape
    f = two_f // 2
    dev = h.device
    grid = (3, f // 128, m // 128)  # (part, f, m): the parts of a tile run side by side
    if not quant:
        dh = torch.empty(m, two_f, device=dev, dtype=h.dtype)
        act = torch.empty(m, f, device=dev, dtype=h.dtype)
        _swiglu_bwd_kernel[grid](h, dact, m_indices, dh, dh, dh, dh, act, act, m, f, QUANT=False,
                                 **LAUNCH["swiglu_bwd"])
        return dh, None, act
    h, dact = h.contiguous(), dact.contiguous()
    use_gluon = _use_gluon("swiglu_bwd", impl, h, dact)
    dhq = torch.empty(m, two_f, device=dev, dtype=FP8)
    dhs = torch.empty(m, two_f // 128, device=dev, dtype=torch.float32)
    dhqt = torch.empty(two_f, m, device=dev, dtype=FP8)
    dhst = torch.empty(two_f, m // 128, device=dev, dtype=torch.float32)
    aqt = torch.empty(f, m, device=dev, dtype=FP8)
    ast = torch.empty(f, m // 128, device=dev, dtype=torch.float32)
    if use_gluon:
        moe_gluon.swiglu_bwd(h, dact, m_indices, dhq, dhs, dhqt, dhst, aqt, ast)
    else:
        _swiglu_bwd_kernel[grid](h, dact, m_indices, dhq, dhs, dhqt, dhst, aqt, ast, m, f, QUANT=True,
                                 **LAUNCH["swiglu_bwd"])
    return (dhq, dhs), (dhqt, dhst), (aqt, ast)


# ----------------------------------------------------------------------------------------------------------------
# unpermute + combine, and its backward


@triton.jit
def _combine_kernel(o_ptr, row_map_ptr, w_ptr, y_ptr, D, K: tl.constexpr, BLOCK_D: tl.constexpr,
                    WEIGHTED: tl.constexpr):
    """y[t] = sum_k w[t, k] * o[row_map[t, k]] (w = 1 when not WEIGHTED)."""
    t, pd = tl.program_id(0), tl.program_id(1)
    c = pd * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for kk in tl.static_range(K):
        row = tl.load(row_map_ptr + t * K + kk).to(tl.int64)
        v = tl.load(o_ptr + row * D + c, mask=c < D, other=0.0).to(tl.float32)
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
    dw = part.sum(1)[layout.row_map.long()].view(layout.num_tokens, layout.topk)  # [T, K]
    return rowwise, colwise, dw
