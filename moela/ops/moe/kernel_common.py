"""Constants, launch options and @triton.jit helpers shared by the MoE path's Triton kernels (FP8 scale math,
e4m3 codes, row/column tile quantization).

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
one `div_rn` per group, so results match `moela.ops.moe.quant` (the spec) bit for bit.

Shapes: T tokens, D hidden, E experts, K top-k, F expert FFN width, M_pad padded rows.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moela.ops.moe.quant import AMAX_EPS, FP8_MAX

ALIGN = 128
GROUP = 128
FP8 = torch.float8_e4m3fn
# Triton 3.6's interpreter converts fp32 -> e4m3 without carrying the rounding into the exponent; under it the
# kernels round to e4m3's grid in fp32 first (exactly what the hardware conversion does), so the cast is exact.
_EPS = tl.constexpr(AMAX_EPS)
_FMAX = tl.constexpr(FP8_MAX)
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
_ZERO_ROWS = tl.constexpr(8)  # rows per zero-fill tile of the permute kernel's padding programs
# Launch options per kernel, shared with tests/sm90_compile.py (which reports registers and spills for sm_90). One
# 128x128 tile per program; 4 warps (128 values per thread, up to 255 registers without spills) keep three or more
# blocks and their loads in flight per SM: a transposed column quantization ran at 82% of the copy bandwidth with
# 4 warps, 59% with 8, 35% persistent with one block per SM (bench/results/quant_transpose.md). The SwiGLU
# backward (three output tiles per input tile) stays at 16 warps: 1.58 ms there (run 11), 2.73 ms at 4 (run 9;
# bench/results/moe_notes.md). The tile kernels' grids put the column blocks on the fastest axis, so the blocks in
# flight read long contiguous stretches of each row: the row+column quantization ran at 65% of the copy bandwidth
# in that order, 56% with row blocks fastest (256-byte pieces of many rows; quant_transpose.md). On Hopper (sm_90),
# for bf16 inputs, quant_rows_cols, swiglu_bwd(quant=True) and quant_weights run moela.ops.moe.gluon's kernels
# instead (tiles staged in shared memory; the row+column quantization at 79-83%).
LAUNCH = dict(layout=dict(num_warps=4), permute=dict(num_warps=4), quant_rows_cols=dict(num_warps=4),
              quant_rows_or_cols=dict(num_warps=4), weight_quant=dict(num_warps=4), swiglu_fwd=dict(num_warps=4),
              swiglu_bwd=dict(num_warps=16), combine=dict(num_warps=4), combine_bwd=dict(num_warps=4))


@triton.jit
def _scale_inv(amax):
    """(scale, inverse) of a group with this amax: amax / 448 and (1 / amax) * 448, as moela.ops.moe.quant rounds them
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
