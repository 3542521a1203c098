"""SwiGLU between the MoE GEMMs: forward fused with rowwise quantization, backward fused with both quantizations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.moe import gluon as moe_gluon
from moela.ops.moe.kernel_common import FP8, LAUNCH, _store_rows_cols
from moela.ops.moe.quantize import _use_gluon


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
    output tile, the inputs in registers), "gluon" (moela.ops.moe.gluon: the three input tiles staged in shared
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
