"""The fused MoE expert path as one autograd function, for both recipes and every GEMM provider.

Forward:  permute_align (+1x128 quant; its launch also places the rows, building the layout) -> GEMM1 -> SwiGLU
          (+1x128 quant) -> GEMM2 -> unpermute_combine.
Backward: combine backward (do = dy*w, d topk_weights, + row/column quant) -> dgrad GEMM2 -> SwiGLU backward
          (+ dh row/column quant, act column quant) -> wgrad GEMM2 -> dgrad GEMM1 -> x column quant (gathered)
          -> wgrad GEMM1 -> gather-sum of dx over k.
FP8 (DeepSeek-V3): e4m3 everywhere a GEMM reads, fp32 scales (1x128 activations, 128x128 weights), fp32 accumulate,
bf16 GEMM outputs. Saved for backward: x, h [M_pad, 2F], o [M_pad, D], the layout, and the transposed fp8 weights
(bf16 recipe: the weights in the compute dtype); act and permuted x are recomputed inside fused kernels.
GEMM providers: `triton` (everything ours), `torch` (bf16 `torch._grouped_mm`), `cublas` (FP8: cuBLAS's blockwise
GEMM through `torch._scaled_mm`, one per expert, for all six GEMMs; Hopper), `deep_gemm` (DeepGEMM's m-grouped
FP8 GEMM for forward and data gradient, ours for the weight gradient). `cublas` reads the expert bounds on the
host once per forward (one sync) and keeps them for the backward; an m-grouped GEMM whose K/128 is not a multiple
of 4 (cuBLASLt's 128x128 scale layout; e.g. V2-Lite's F = 1408) runs on the Triton kernel instead.

Shapes: T tokens, D hidden, E experts, K top-k, F expert FFN width, M_pad padded rows.
"""

from __future__ import annotations

import torch

from moela.ops.moe.activation import swiglu_bwd, swiglu_fwd
from moela.ops.moe.combine import combine_bwd, unpermute_combine
from moela.ops.moe.gemm_library import (
    cublas_k_blocks_ok,
    cublas_kgrouped,
    cublas_mgrouped,
    deep_gemm_mgrouped,
    torch_kgrouped,
    torch_mgrouped,
)
from moela.ops.moe.gemm_triton import kgrouped_gemm, mgrouped_gemm
from moela.ops.moe.layout import Layout
from moela.ops.moe.permute import permute_align
from moela.ops.moe.quantize import quant_rows_cols, quant_weights


def _mgemm(provider, a, b, lay, out_dtype, a_scale=None, b_scale=None, bounds=None):
    if provider == "cublas" and a_scale is not None and cublas_k_blocks_ok(a.shape[1]):
        return cublas_mgrouped(a, a_scale, b, b_scale, bounds, out_dtype)
    if provider == "torch":
        return torch_mgrouped(a, b, lay.offsets)
    if provider == "deep_gemm" and a_scale is not None:
        return deep_gemm_mgrouped(a, a_scale, b, b_scale, lay.m_indices).to(out_dtype)
    return mgrouped_gemm(a, b, lay.m_indices, a_scale=a_scale, b_scale=b_scale, out_dtype=out_dtype)


def _kgemm(provider, a, b, lay, out_dtype, a_scale=None, b_scale=None, bounds=None):
    if provider == "cublas" and a_scale is not None:
        return cublas_kgrouped(a, a_scale, b, b_scale, bounds, out_dtype)
    if provider == "torch":
        return torch_kgrouped(a, b, lay.offsets, lay.counts, out_dtype)
    return kgrouped_gemm(a, b, lay.offsets, a_scale=a_scale, b_scale=b_scale, out_dtype=out_dtype)


class MoEExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, w13, w2, recipe, provider):
        e = w13.shape[0]
        fp8 = recipe == "fp8_blockwise"
        # [M_pad, D] (e4m3 with scales xs [M_pad, D/128] for fp8); the layout is built by the same launches
        xp, xs, lay = permute_align(x, topk_ids, e, quant="fp8_1x128" if fp8 else None)
        bounds = lay.expert_bounds() if provider == "cublas" else None  # the one host sync
        if fp8:
            w13q, w13s, w13qt = quant_weights(w13)  # [E, 2F, D], [E, 2F/128, D/128], [E, D, 2F]
            w2q, w2s, w2qt = quant_weights(w2)  # [E, D, F], [E, D/128, F/128], [E, F, D]
            h = _mgemm(provider, xp, w13q, lay, x.dtype, xs, w13s, bounds)  # [M_pad, 2F] bf16
            aq, as_ = swiglu_fwd(h, lay.m_indices, quant=True)  # [M_pad, F] e4m3, [M_pad, F/128]
            o = _mgemm(provider, aq, w2q, lay, x.dtype, as_, w2s, bounds)  # [M_pad, D] bf16
            ctx.save_for_backward(x, topk_weights, h, o, w13qt, w13s, w2qt, w2s, *_lay_tensors(lay))
        else:
            w13c, w2c = w13.to(x.dtype), w2.to(x.dtype)
            h = _mgemm(provider, xp, w13c, lay, x.dtype)  # [M_pad, 2F]
            act, _ = swiglu_fwd(h, lay.m_indices, quant=False)  # [M_pad, F]
            o = _mgemm(provider, act, w2c, lay, x.dtype)  # [M_pad, D]
            ctx.save_for_backward(x, topk_weights, h, o, w13c, w2c, *_lay_tensors(lay))
        ctx.meta = (recipe, provider, lay.num_tokens, lay.topk, w13.dtype, w2.dtype, topk_ids, bounds)
        return unpermute_combine(o, lay, topk_weights, x.dtype)  # [T, D]

    @staticmethod
    def backward(ctx, dy):
        recipe, provider, t, k, w13_dtype, w2_dtype, topk_ids, bounds = ctx.meta
        if recipe == "fp8_blockwise":
            x, w, h, o, w13qt, w13s, w2qt, w2s, *lt = ctx.saved_tensors
            lay = Layout(*lt, num_tokens=t, topk=k)
            (doq, dos), (doqt, dost), dw = combine_bwd(dy, o, lay, w, quant=True)
            dact = _mgemm(provider, doq, w2qt, lay, dy.dtype, dos, w2s.transpose(1, 2), bounds)  # [M_pad, F]
            (dhq, dhs), (dhqt, dhst), (aqt, ast) = swiglu_bwd(h, dact, lay.m_indices, quant=True)
            dw2 = _kgemm(provider, doqt, aqt, lay, w2_dtype, dost, ast, bounds)  # [E, D, F]
            dxp = _mgemm(provider, dhq, w13qt, lay, dy.dtype, dhs, w13s.transpose(1, 2), bounds)  # [M_pad, D]
            _, (xqt, xst) = quant_rows_cols(x, rowwise=False, src=lay.src, gather_div=k)  # [D, M_pad]
            dw13 = _kgemm(provider, dhqt, xqt, lay, w13_dtype, dhst, xst, bounds)  # [E, 2F, D]
        else:
            x, w, h, o, w13c, w2c, *lt = ctx.saved_tensors
            lay = Layout(*lt, num_tokens=t, topk=k)
            do, _, dw = combine_bwd(dy, o, lay, w, quant=False)  # [M_pad, D]
            dact = _mgemm(provider, do, w2c.transpose(1, 2), lay, dy.dtype)  # [M_pad, F]
            dh, _, act = swiglu_bwd(h, dact, lay.m_indices, quant=False)  # [M_pad, 2F], [M_pad, F]
            dw2 = _kgemm(provider, do.t(), act.t(), lay, w2_dtype)  # [E, D, F]
            dxp = _mgemm(provider, dh, w13c.transpose(1, 2), lay, dy.dtype)  # [M_pad, D]
            xp, _, _ = permute_align(x, topk_ids, w13c.shape[0], quant=None, layout=lay)  # [M_pad, D]
            dw13 = _kgemm(provider, dh.t(), xp.t(), lay, w13_dtype)  # [E, 2F, D]
        dx = unpermute_combine(dxp, lay, None, x.dtype)  # [T, D]
        return dx, None, dw.to(w.dtype), dw13, dw2, None, None


def _lay_tensors(lay: Layout):
    return lay.m_indices, lay.row_map, lay.src, lay.counts, lay.offsets
