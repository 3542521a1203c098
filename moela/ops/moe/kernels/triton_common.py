"""What the MoE path's Triton kernels share: block sizes, launch options, and the @triton.jit helpers of the FP8
recipe (scale math, e4m3 codes, a tile's row and column quantization).

FP8 scales follow DeepGEMM's SM90 format: fp32, `scale = amax / 448`, activations rowwise 1x128 ([M, N/128]);
"columnwise" 128x1 groups along tokens are stored as the 1x128 quantization of the transposed matrix
(qT [N, M_pad], sT [N, M_pad/128]) because the weight-gradient GEMM reduces over tokens; weights 128x128
([E, N/128, K/128]) plus a transposed fp8 copy for the data-gradient GEMM. codes = e4m3(x * ((1 / amax) * 448))
with one `div_rn` per group, so results match `moela.ops.moe.quant_spec` (the specification) bit for bit.

Shapes: M rows (M_pad in the layout), N columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.moe.quant_spec import AMAX_EPS, FP8_MAX
from moela.ops.triton_env import INTERPRET, require_interpreter_support

require_interpreter_support()

ALIGN = 128  # rows per expert block of the layout
GROUP = 128  # values per quantization group
FP8 = torch.float8_e4m3fn
_EPS = tl.constexpr(AMAX_EPS)
_FMAX = tl.constexpr(FP8_MAX)
_INTERPRET = tl.constexpr(INTERPRET)
# Launch options per kernel, shared with tests/sm90_compile.py (which reports registers and spills for sm_90). One
# 128x128 tile per program at 4 warps (128 values per thread, no spills) keeps three or more blocks and their loads
# in flight per SM; the quantized SwiGLU backward (three output tiles per input tile) is faster at 16 warps, the
# unquantized one (all three outputs of a 64 x 128 tile in one program) runs at 4. The tile
# kernels' grids put the column blocks on the fastest axis, so the blocks in flight read long contiguous stretches
# of each row. On Hopper, for bf16 inputs, the quantizations that read a tile by rows and by columns run the Gluon
# kernels of quantize_gluon.py instead.
LAUNCH = dict(layout=dict(num_warps=4), permute=dict(num_warps=4), quant_rows_cols=dict(num_warps=4),
              quant_rows_or_cols=dict(num_warps=4), weight_quant=dict(num_warps=4), swiglu_fwd=dict(num_warps=4),
              swiglu_bwd=dict(num_warps=16), swiglu_bwd_plain=dict(num_warps=4), combine=dict(num_warps=4),
              combine_bwd=dict(num_warps=4))


@triton.jit
def fp8_scale_inverse(amax):
    """(scale, inverse) of groups with this amax: amax / 448 and (1 / amax) * 448, rounded as moela.ops.moe.quant_spec
    rounds them (the codes are x * inverse)."""
    clamped = tl.maximum(amax, _EPS)
    return tl.math.div_rn(clamped, _FMAX), tl.math.div_rn(1.0, clamped) * _FMAX


@triton.jit
def round_to_e4m3(x):
    """Round fp32 values in [-448, 448] to the nearest e4m3 value (ties to even), staying in fp32: the hardware
    conversion, which Triton's interpreter (3.6 and 3.9) gets wrong when the rounding carries into the exponent."""
    magnitude = tl.abs(x)
    bits = magnitude.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # round the mantissa to 3 bits, ties to even
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = (magnitude + 24576.0) - 24576.0  # multiples of 2^-9 below 2^-6
    rounded = tl.where(magnitude >= 0.015625, normal, subnormal)
    return tl.where(x < 0, -rounded, rounded)


@triton.jit
def e4m3_codes(x, inverse):
    """e4m3 codes of x * inverse (|x * inverse| <= 448 up to rounding). On the GPU the conversion saturates
    (cvt.rn.satfinite), which is the clamp to +-448; the interpreter clamps and rounds explicitly."""
    if _INTERPRET:
        return round_to_e4m3(tl.clamp(x * inverse, -_FMAX, _FMAX)).to(tl.float8e4nv)
    return (x * inverse).to(tl.float8e4nv)


@triton.jit
def store_e4m3_bytes(ptrs, codes, mask):
    """Store e4m3 codes at ptrs (any addressing, e.g. a tile's transposed places) as bytes. No fp8 tile is
    transposed (tl.trans of fp8 tiles is reported to corrupt them on Hopper) and the store is an 8-bit integer one
    (triton-lang/triton#11111: an fp8 store through a layout conversion next to a second store is reported
    corrupted). Storing the same codes twice, row-major and transposed, gave wrong transposed bytes on the H200,
    hence quant_weights' second launch."""
    tl.store(ptrs.to(tl.pointer_type(tl.uint8)), codes.to(tl.uint8, bitcast=True), mask=mask)


@triton.jit
def store_tile_quantized(
    tile,  # [128, 128] fp32 values at (rows, cols)
    rows, cols,  # [128] each: one aligned 128-group of rows and of columns
    row_ok, col_ok,  # [128] each: which rows / columns exist
    q_ptr, ld_q,  # rowwise codes [M, N] e4m3 and their row stride (ROWWISE)
    s_ptr, ld_s,  # rowwise scales [M, N/128] fp32 and their row stride (ROWWISE)
    qt_ptr, ld_qt,  # columnwise codes, transposed [N, M] e4m3, and their row stride (COLWISE)
    st_ptr, ld_st,  # columnwise scales, transposed [N, M/128] fp32, and their row stride (COLWISE)
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
):
    """A tile's rowwise 1x128 quantization (one scale per row) and/or its columnwise 128x1 quantization (one scale
    per column, stored transposed)."""
    if ROWWISE:
        row_scale, row_inverse = fp8_scale_inverse(tl.max(tl.abs(tile), axis=1))  # [128]
        codes = e4m3_codes(tile, row_inverse[:, None])
        tl.store(q_ptr + rows[:, None] * ld_q + cols[None, :], codes, mask=row_ok[:, None] & col_ok[None, :])
        tl.store(s_ptr + rows * ld_s + tl.min(cols, axis=0) // 128, row_scale, mask=row_ok)
    if COLWISE:
        col_scale, col_inverse = fp8_scale_inverse(tl.max(tl.abs(tile), axis=0))  # [128]
        codes = e4m3_codes(tile, col_inverse[None, :])
        store_e4m3_bytes(qt_ptr + cols[None, :] * ld_qt + rows[:, None], codes, row_ok[:, None] & col_ok[None, :])
        tl.store(st_ptr + cols * ld_st + tl.min(rows, axis=0) // 128, col_scale, mask=col_ok)
