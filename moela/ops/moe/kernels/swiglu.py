"""SwiGLU between the MoE GEMMs: the forward fused with the rowwise quantization GEMM2 reads, the backward fused
with the row and column quantizations the two backward GEMMs read.

Math, per padded row (h = [g | u], g and u [F] each; padding rows give zeros):
  act = silu(g) * u,   dg = dact * u * sigma(g) * (1 + g * (1 - sigma(g))),   du = dact * silu(g)
Shapes: M_pad padded rows, F expert FFN width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.moe.kernels import quantize_gluon
from moela.ops.moe.kernels.quantize_triton import use_gluon
from moela.ops.moe.kernels.triton_common import FP8, LAUNCH, store_tile_quantized

SWIGLU_BWD_PLAIN_ROWS = 64  # rows per program of the unquantized backward (M_pad is a multiple of 128)


@triton.jit
def _swiglu_fwd_kernel(
    h_ptr,  # [M_pad, 2F] GEMM1 output: g in columns [0, F), u in [F, 2F)
    m_idx_ptr,  # [M_pad] int32 expert of each row, -1 on padding
    out_ptr,  # [M_pad, F] act, written (e4m3 codes when QUANT, else h's dtype)
    s_ptr,  # [M_pad, F/128] fp32 scales, written (QUANT)
    M, F,
    QUANT: tl.constexpr,
):
    """Program (f block, m block): act over one 128x128 tile. Grid: (F/128, M_pad/128)."""
    pid_f, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m * 128 + tl.arange(0, 128)
    cols = pid_f * 128 + tl.arange(0, 128)
    valid = tl.load(m_idx_ptr + rows) >= 0
    rows64 = rows.to(tl.int64)
    gate = tl.load(h_ptr + rows64[:, None] * (2 * F) + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    up = tl.load(h_ptr + rows64[:, None] * (2 * F) + F + cols[None, :], mask=valid[:, None],
                 other=0.0).to(tl.float32)
    act = gate * tl.sigmoid(gate) * up  # [128, 128]
    if QUANT:
        store_tile_quantized(act, rows, cols, rows < M, cols < F, out_ptr, F, s_ptr, F // 128, out_ptr, 0, s_ptr, 0,
                             True, False)
    else:
        tl.store(out_ptr + rows64[:, None] * F + cols[None, :], act.to(out_ptr.dtype.element_ty))


def swiglu_fwd(h: torch.Tensor, m_indices: torch.Tensor, *, quant: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [M_pad, 2F] -> act [M_pad, F] (e4m3 + 1x128 scales when quant, else h's dtype); padding rows -> 0."""
    m, two_f = h.shape
    f = two_f // 2
    if quant:
        out = torch.empty(m, f, device=h.device, dtype=FP8)
        s = torch.empty(m, f // 128, device=h.device, dtype=torch.float32)
    else:
        out, s = torch.empty(m, f, device=h.device, dtype=h.dtype), None
    _swiglu_fwd_kernel[(f // 128, m // 128)](
        h,
        m_indices,
        out,
        s if quant else out,
        m, f,
        QUANT=quant, **LAUNCH["swiglu_fwd"])
    return out, s


@triton.jit
def _swiglu_bwd_part(h_ptr, dact_ptr, m_idx_ptr, dh_ptr, dh_s_ptr, dht_ptr, dht_s_ptr, actt_ptr, actt_s_ptr, M, F,
                     pid_m, pid_f, PART: tl.constexpr):
    """Output PART of tile (pid_m, pid_f), quantized: 0 dg and 1 du (into dh's columns [0, F) and [F, 2F)), by rows
    and by columns; 2 act, by columns."""
    rows = pid_m * 128 + tl.arange(0, 128)
    cols = pid_f * 128 + tl.arange(0, 128)
    valid = tl.load(m_idx_ptr + rows) >= 0
    rows64 = rows.to(tl.int64)
    # the inputs this output needs
    gate = tl.load(h_ptr + rows64[:, None] * (2 * F) + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    if PART != 1:
        up = tl.load(h_ptr + rows64[:, None] * (2 * F) + F + cols[None, :], mask=valid[:, None], other=0.0)
        up = up.to(tl.float32)
    if PART != 2:
        dact = tl.load(dact_ptr + rows64[:, None] * F + cols[None, :], mask=valid[:, None],
                       other=0.0).to(tl.float32)
    # the output tile, quantized
    if PART == 0:
        out = dact * up * (sig + silu * (1.0 - sig))
    elif PART == 1:
        out = dact * silu
    else:
        out = silu * up
    if PART == 2:
        store_tile_quantized(out, rows, cols, rows < M, cols < F, actt_ptr, 0, actt_s_ptr, 0, actt_ptr, M,
                             actt_s_ptr, M // 128, False, True)
    else:
        store_tile_quantized(out, rows, cols + PART * F, rows < M, cols < F, dh_ptr, 2 * F, dh_s_ptr, 2 * F // 128,
                             dht_ptr, M, dht_s_ptr, M // 128, True, True)


@triton.jit
def _swiglu_bwd_kernel(
    h_ptr,  # [M_pad, 2F] GEMM1 output
    dact_ptr,  # [M_pad, F] gradient of act
    m_idx_ptr,  # [M_pad] int32 expert of each row, -1 on padding
    dh_ptr,  # [M_pad, 2F] e4m3 dh's rowwise codes, written
    dh_s_ptr,  # [M_pad, 2F/128] fp32 rowwise scales, written
    dht_ptr,  # [2F, M_pad] e4m3 dh's columnwise codes, transposed, written
    dht_s_ptr,  # [2F, M_pad/128] fp32, written
    actt_ptr,  # [F, M_pad] e4m3 act's columnwise codes, transposed, written
    actt_s_ptr,  # [F, M_pad/128] fp32, written
    M, F,
):
    """The quantized backward. Program (part, f block, m block) writes one output of the 128x128 tile: part 0 dg,
    1 du, 2 act, each its own code, so only one fp32 result tile and its quantization are live (all three in one
    program spilled at 255 registers). The three programs of a tile are neighbours in launch order: their shared
    inputs come from L2. Grid: (3, F/128, M_pad/128)."""
    part, pid_f, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if part == 0:
        _swiglu_bwd_part(h_ptr, dact_ptr, m_idx_ptr, dh_ptr, dh_s_ptr, dht_ptr, dht_s_ptr, actt_ptr, actt_s_ptr, M, F,
                         pid_m, pid_f, 0)
    elif part == 1:
        _swiglu_bwd_part(h_ptr, dact_ptr, m_idx_ptr, dh_ptr, dh_s_ptr, dht_ptr, dht_s_ptr, actt_ptr, actt_s_ptr, M, F,
                         pid_m, pid_f, 1)
    else:
        _swiglu_bwd_part(h_ptr, dact_ptr, m_idx_ptr, dh_ptr, dh_s_ptr, dht_ptr, dht_s_ptr, actt_ptr, actt_s_ptr, M, F,
                         pid_m, pid_f, 2)


@triton.jit
def _swiglu_bwd_plain_kernel(
    h_ptr,  # [M_pad, 2F] GEMM1 output
    dact_ptr,  # [M_pad, F] gradient of act
    m_idx_ptr,  # [M_pad] int32 expert of each row, -1 on padding
    dh_ptr,  # [M_pad, 2F] dh in h's dtype, written
    act_ptr,  # [M_pad, F] act in h's dtype, written
    F,
    BLOCK_M: tl.constexpr,
):
    """The unquantized backward: program (f block, m block) reads the three input tiles once and writes dg, du
    and act, so every input byte crosses DRAM once (the quantized kernel above gives each output its own program
    because three quantizations do not fit the registers; unquantized, a 64 x 128 tile at 4 warps holds 64 values
    per thread of each input; three programs per tile were slower). Grid: (F/128, M_pad/BLOCK_M)."""
    pid_f, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_f * 128 + tl.arange(0, 128)
    valid = (tl.load(m_idx_ptr + rows) >= 0)[:, None]
    h_off = rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
    f_off = rows.to(tl.int64)[:, None] * F + cols[None, :]
    gate = tl.load(h_ptr + h_off, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + h_off + F, mask=valid, other=0.0).to(tl.float32)
    dact = tl.load(dact_ptr + f_off, mask=valid, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    ty = dh_ptr.dtype.element_ty
    tl.store(dh_ptr + h_off, (dact * up * (sig + silu * (1.0 - sig))).to(ty))
    tl.store(dh_ptr + h_off + F, (dact * silu).to(ty))
    tl.store(act_ptr + f_off, (silu * up).to(ty))


def swiglu_bwd(h: torch.Tensor, dact: torch.Tensor, m_indices: torch.Tensor, *, quant: bool, impl: str = "auto"
               ) -> tuple:
    """Returns (dh_rowwise, dh_colwise, act_colwise) as (q, s) pairs when quant; else (dh, None, act) in h's dtype
    with act recomputed (the bf16 weight gradient reads it row-major). impl, quantized: "triton" (one program per
    output tile, the inputs in registers), "gluon" (quantize_gluon.py: the three input tiles staged in shared
    memory, every output from one read; bf16 on sm_90), "auto" (gluon where it can run); same bytes either way."""
    m, two_f = h.shape
    f = two_f // 2
    dev = h.device
    if not quant:
        dh = torch.empty(m, two_f, device=dev, dtype=h.dtype)
        act = torch.empty(m, f, device=dev, dtype=h.dtype)
        _swiglu_bwd_plain_kernel[(f // 128, m // SWIGLU_BWD_PLAIN_ROWS)](
            h,
            dact,
            m_indices,
            dh,
            act,
            f,
            BLOCK_M=SWIGLU_BWD_PLAIN_ROWS, **LAUNCH["swiglu_bwd_plain"])
        return dh, None, act
    h, dact = h.contiguous(), dact.contiguous()
    dh = torch.empty(m, two_f, device=dev, dtype=FP8)
    dh_s = torch.empty(m, two_f // 128, device=dev, dtype=torch.float32)
    dht = torch.empty(two_f, m, device=dev, dtype=FP8)
    dht_s = torch.empty(two_f, m // 128, device=dev, dtype=torch.float32)
    actt = torch.empty(f, m, device=dev, dtype=FP8)
    actt_s = torch.empty(f, m // 128, device=dev, dtype=torch.float32)
    if use_gluon("swiglu_bwd", impl, h, dact):
        quantize_gluon.swiglu_bwd(h, dact, m_indices, dh, dh_s, dht, dht_s, actt, actt_s)
    else:
        _swiglu_bwd_kernel[(3, f // 128, m // 128)](  # (part, f, m): the parts of a tile run side by side
            h,
            dact,
            m_indices,
            dh,
            dh_s,
            dht,
            dht_s,
            actt,
            actt_s,
            m, f,
            **LAUNCH["swiglu_bwd"])
    return (dh, dh_s), (dht, dht_s), (actt, actt_s)
