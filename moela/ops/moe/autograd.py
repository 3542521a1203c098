"""The fused MoE expert path as two custom ops (forward, backward) with autograd, for both recipes and every GEMM
provider.

Forward:  permute_align (+1x128 quant; its launch also places the rows, building the layout) -> GEMM1 -> SwiGLU
          (+1x128 quant) -> GEMM2 -> unpermute_combine.
Backward: combine backward (do = dy*w, d topk_weights, + row/column quant) -> dgrad GEMM2 -> SwiGLU backward
          (+ dh row/column quant, act column quant) -> wgrad GEMM2 -> dgrad GEMM1 -> x column quant (gathered)
          -> wgrad GEMM1 -> gather-sum of dx over k.
FP8 (DeepSeek-V3): e4m3 everywhere a GEMM reads, fp32 scales (1x128 activations, 128x128 weights), fp32 accumulate,
bf16 GEMM outputs. Saved for backward: x, h [M_pad, 2F], o [M_pad, D], the layout and the weights' copies the
forward used (fp8: scales and the transposed codes for the data gradient; bf16: the cast), which come from
moela.ops.weight_cache, computed once per optimizer step; act and permuted x are recomputed inside fused kernels.
The forward hands its copies to the backward because the cache is off while a CUDA graph is captured: a backward
looking them up again would cast or quantize every expert weight a second time in the graphed step.
GEMM providers (the `moe_experts` backends):
- `triton`: everything ours. bf16: the grouped GEMMs of kernels/gemm_grouped_triton.py; FP8: the persistent GEMMs
  of kernels/gemm_fp8_triton.py, which run the Triton or the Gluon kernel of each product (`fp8_gemm` for the
  forward and data gradient, `fp8_wgrad` for the weight gradient: "auto", "gluon" or "triton").
- `torch_triton` (bf16): forward and data gradient on `torch._grouped_mm`, the weight gradient on our Triton
  kernel. The weight gradient is k-grouped (one output tile per expert and weight block, reduced over the expert's
  rows, so a tile's work is its expert's row count): torch's CUTLASS kernel is persistent with a static tile-to-SM
  assignment, so a skewed expert load leaves SMs idle behind the busiest experts' tiles, while the Triton grid is
  handed out to SMs as they free up.
- `deep_gemm` (FP8): DeepGEMM's m-grouped GEMM for forward and data gradient, ours for the weight gradient.
- `cublas` (FP8): cuBLAS's blockwise GEMM through `torch._scaled_mm`, one per expert, for all six GEMMs (Hopper; an
  m-grouped GEMM whose K/128 is not a multiple of 4 runs on ours).
Every provider but `cublas` reads the expert bounds on the device: no host sync, every buffer sized by the static
bound M_pad, so the ops can be captured in a CUDA graph; `cublas` reads them on the host (one sync in the forward,
one in the backward).
Compiling: `moela::moe_experts_fwd` / `moela::moe_experts_bwd` are torch.library custom ops with fake
implementations (output shapes from T, K, E, D, F alone), so torch.compile keeps them as single nodes; the kernel
choices are arguments of both, so a compiled graph (and the compile caches on disk) keys on them.

Shapes: T tokens, D hidden, E experts, K top-k, F expert FFN width, M_pad padded rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moela.ops import weight_cache
from moela.ops.moe.kernels.combine import combine_bwd, unpermute_combine
from moela.ops.moe.kernels.gemm_fp8_gluon_kgrouped import experts_by_load
from moela.ops.moe.kernels.gemm_fp8_triton import kgrouped_fp8, mgrouped_fp8
from moela.ops.moe.kernels.gemm_grouped_triton import kgrouped_gemm, mgrouped_gemm
from moela.ops.moe.kernels.gemm_libraries import (
    cublas_k_blocks_ok,
    cublas_kgrouped,
    cublas_mgrouped,
    deep_gemm_mgrouped,
    torch_mgrouped,
)
from moela.ops.moe.kernels.layout import Layout, build_layout_rows
from moela.ops.moe.kernels.permute import permute_align
from moela.ops.moe.kernels.quantize_triton import quant_rows_cols, quant_weights
from moela.ops.moe.kernels.swiglu import swiglu_bwd, swiglu_fwd


class Gemms(NamedTuple):
    """Which kernels run the GEMMs: the provider (the backend's name) and the FP8 GEMM implementations of ours."""

    provider: str
    fp8_gemm: str = "auto"
    fp8_wgrad: str = "auto"


def _mgemm(g: Gemms, a, b, lay, out_dtype, a_scale=None, b_scale=None, bounds=None):
    if a_scale is None:
        if g.provider == "torch_triton":
            return torch_mgrouped(a, b, lay.offsets)
        return mgrouped_gemm(a, b, lay.m_indices, out_dtype=out_dtype)
    if g.provider == "cublas" and cublas_k_blocks_ok(a.shape[1]):
        return cublas_mgrouped(a, a_scale, b, b_scale, bounds, out_dtype)
    if g.provider == "deep_gemm":
        return deep_gemm_mgrouped(a, a_scale, b, b_scale, lay.m_indices).to(out_dtype)
    return mgrouped_fp8(a, a_scale, b, b_scale, lay.m_indices, lay.offsets, out_dtype=out_dtype, impl=g.fp8_gemm)


def _kgemm(g: Gemms, a, b, lay, out_dtype, a_scale=None, b_scale=None, bounds=None, order=None):
    if a_scale is None:
        return kgrouped_gemm(a, b, lay.offsets, out_dtype=out_dtype)
    if g.provider == "cublas":
        return cublas_kgrouped(a, a_scale, b, b_scale, bounds, out_dtype)
    return kgrouped_fp8(a, a_scale, b, b_scale, lay.offsets, out_dtype=out_dtype, impl=g.fp8_wgrad, order=order)


def _fp8_weights(w: torch.Tensor):
    """(codes [E, N, K], scales [E, N/128, K/128], transposed codes [E, K, N]), once per optimizer step."""
    return weight_cache.cached(w, "fp8_blockwise", quant_weights)


def _cast_weights(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weight_cache.cached(w, f"cast_{dtype}", lambda v: v.to(dtype))


def _backward_weights(w13, w2, recipe, dtype):
    """What the backward reads of the weights: fp8 (w13 scales, w13 transposed codes, w2 scales, w2 transposed
    codes); bf16 (w13 cast, w2 cast, None, None)."""
    if recipe == "fp8_blockwise":
        _, w13s, w13qt = _fp8_weights(w13)  # [E, 2F/128, D/128], [E, D, 2F]
        _, w2s, w2qt = _fp8_weights(w2)  # [E, D/128, F/128], [E, F, D]
        return w13s, w13qt, w2s, w2qt
    return _cast_weights(w13, dtype), _cast_weights(w2, dtype), None, None


def _as_outputs(copies, w13, w2, like):
    """The weight copies as outputs of the forward op, which may alias neither its inputs nor each other: a copy
    that is the weight itself (no cast needed) makes all four empty placeholders (the backward looks them up again,
    for free), and the cache's tensors are handed out as detached aliases (a new tensor each call that shares the
    cache's storage), so autograd never attaches a node to the cache's own objects."""
    if any(c is w13 or c is w2 for c in copies):
        return tuple(like.new_empty(0) for _ in copies)
    return tuple(c.detach() for c in copies)


def _forward(x, topk_ids, topk_weights, w13, w2, recipe, g: Gemms):
    """(y, h, o, layout, the weight copies the backward reads: `_backward_weights`'s four, from the same lookups
    the forward's GEMMs used)."""
    e = w13.shape[0]
    fp8 = recipe == "fp8_blockwise"
    # [M_pad, D] (e4m3 with scales xs [M_pad, D/128] for fp8); the layout is built by the same launches
    xp, xs, lay = permute_align(x, topk_ids, e, quant="fp8_1x128" if fp8 else None)
    bounds = lay.expert_bounds() if g.provider == "cublas" else None  # the one host sync of the forward
    if fp8:
        w13q, w13s, w13qt = _fp8_weights(w13)  # [E, 2F, D], [E, 2F/128, D/128], [E, D, 2F]
        w2q, w2s, w2qt = _fp8_weights(w2)  # [E, D, F], [E, D/128, F/128], [E, F, D]
        h = _mgemm(g, xp, w13q, lay, x.dtype, xs, w13s, bounds)  # [M_pad, 2F] bf16
        aq, as_ = swiglu_fwd(h, lay.m_indices, quant=True)  # [M_pad, F] e4m3, [M_pad, F/128]
        o = _mgemm(g, aq, w2q, lay, x.dtype, as_, w2s, bounds)  # [M_pad, D] bf16
        copies = (w13s, w13qt, w2s, w2qt)
    else:
        w13c, w2c = _cast_weights(w13, x.dtype), _cast_weights(w2, x.dtype)  # [E, 2F, D], [E, D, F]
        h = _mgemm(g, xp, w13c, lay, x.dtype)  # [M_pad, 2F]
        act, _ = swiglu_fwd(h, lay.m_indices, quant=False)  # [M_pad, F]
        o = _mgemm(g, act, w2c, lay, x.dtype)  # [M_pad, D]
        copies = (w13c, w2c, x.new_empty(0), x.new_empty(0))  # the bf16 recipe's two placeholders
    y = unpermute_combine(o, lay, topk_weights, x.dtype)  # [T, D]
    return y, h, o, lay, copies


def _backward(dy, x, topk_ids, topk_weights, w13, w2, h, o, lay, wcopies, recipe, g: Gemms):
    k = lay.topk
    dy = dy.to(x.dtype)
    bounds = lay.expert_bounds() if g.provider == "cublas" else None  # the one host sync of the backward
    if wcopies is None:
        wcopies = _backward_weights(w13, w2, recipe, x.dtype)
    if recipe == "fp8_blockwise":
        w13s, w13qt, w2s, w2qt = wcopies  # [E, 2F/128, D/128], [E, D, 2F], [E, D/128, F/128], [E, F, D]
        (doq, dos), (doqt, dost), dw = combine_bwd(dy, o, lay, topk_weights, quant=True)
        dact = _mgemm(g, doq, w2qt, lay, dy.dtype, dos, w2s.transpose(1, 2), bounds)  # [M_pad, F]
        (dhq, dhs), (dhqt, dhst), (aqt, ast) = swiglu_bwd(h, dact, lay.m_indices, quant=True)
        order = experts_by_load(lay.offsets) if g.provider != "cublas" else None  # the two weight gradients' deal
        dw2 = _kgemm(g, doqt, aqt, lay, w2.dtype, dost, ast, bounds, order)  # [E, D, F]
        dxp = _mgemm(g, dhq, w13qt, lay, dy.dtype, dhs, w13s.transpose(1, 2), bounds)  # [M_pad, D]
        _, (xqt, xst) = quant_rows_cols(x, rowwise=False, src=lay.src, gather_div=k)  # [D, M_pad]
        dw13 = _kgemm(g, dhqt, xqt, lay, w13.dtype, dhst, xst, bounds, order)  # [E, 2F, D]
    else:
        w13c, w2c = wcopies[:2]  # [E, 2F, D], [E, D, F] in x's dtype
        do, _, dw = combine_bwd(dy, o, lay, topk_weights, quant=False)  # [M_pad, D]
        dact = _mgemm(g, do, w2c.transpose(1, 2), lay, dy.dtype)  # [M_pad, F]
        dh, _, act = swiglu_bwd(h, dact, lay.m_indices, quant=False)  # [M_pad, 2F], [M_pad, F]
        dw2 = _kgemm(g, do.t(), act.t(), lay, w2.dtype)  # [E, D, F]
        dxp = _mgemm(g, dh, w13c.transpose(1, 2), lay, dy.dtype)  # [M_pad, D]
        xp, _, _ = permute_align(x, topk_ids, w13.shape[0], quant=None, layout=lay)  # [M_pad, D]
        dw13 = _kgemm(g, dh.t(), xp.t(), lay, w13.dtype)  # [E, 2F, D]
    dx = unpermute_combine(dxp, lay, None, x.dtype)  # [T, D]
    return dx, dw.to(topk_weights.dtype), dw13, dw2


@torch.library.custom_op("moela::moe_experts_fwd", mutates_args=())
def moe_experts_fwd(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, recipe: str, provider: str, fp8_gemm: str, fp8_wgrad: str
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                               torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [T, D], and for the backward: h, o, the layout's m_indices, row_map, src, counts, offsets and the four
    weight copies of `_backward_weights`)."""
    y, h, o, lay, copies = _forward(x, topk_ids, topk_weights, w13, w2, recipe, Gemms(provider, fp8_gemm, fp8_wgrad))
    return (y, h, o, lay.m_indices, lay.row_map, lay.src, lay.counts, lay.offsets, *_as_outputs(copies, w13, w2, x))


@moe_experts_fwd.register_fake
def _moe_experts_fwd_fake(x, topk_ids, topk_weights, w13, w2, recipe, provider, fp8_gemm, fp8_wgrad):
    t, k = topk_ids.shape
    e, two_f, d = w13.shape
    m = build_layout_rows(t, k, e)

    def ints(*shape, dtype=torch.int32):
        return x.new_empty(shape, dtype=dtype)

    f = two_f // 2
    if recipe == "fp8_blockwise":
        fp8 = torch.float8_e4m3fn
        f32 = torch.float32
        copies = (w13.new_empty(e, two_f // 128, d // 128, dtype=f32), w13.new_empty(e, d, two_f, dtype=fp8),
                  w2.new_empty(e, d // 128, f // 128, dtype=f32), w2.new_empty(e, f, d, dtype=fp8))
    elif w13.dtype == x.dtype:  # no cast: empty placeholders (`_as_outputs`)
        copies = tuple(x.new_empty(0) for _ in range(4))
    else:
        copies = (w13.new_empty(e, two_f, d, dtype=x.dtype), w2.new_empty(e, d, f, dtype=x.dtype), x.new_empty(0),
                  x.new_empty(0))
    return (x.new_empty(t, d), x.new_empty(m, two_f), x.new_empty(m, d), ints(m), ints(t * k), ints(m),
            ints(e, dtype=torch.int64), ints(e + 1, dtype=torch.int64), *copies)


@torch.library.custom_op("moela::moe_experts_bwd", mutates_args=())
def moe_experts_bwd(dy: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, o: torch.Tensor, m_indices: torch.Tensor,
                    row_map: torch.Tensor, src: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor,
                    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, recipe: str,
                    provider: str, fp8_gemm: str, fp8_wgrad: str
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [T, D], d topk_weights [T, K], dw13 [E, 2F, D], dw2 [E, D, F]); c0..c3 the forward's weight copies (all
    empty: look them up)."""
    lay = Layout(m_indices, row_map, src, counts, offsets, topk_ids.shape[0], topk_ids.shape[1])
    wcopies = None if c0.numel() == 0 else (c0, c1, c2, c3)
    return _backward(dy, x, topk_ids, topk_weights, w13, w2, h, o, lay, wcopies, recipe,
                     Gemms(provider, fp8_gemm, fp8_wgrad))


@moe_experts_bwd.register_fake
def _moe_experts_bwd_fake(dy, x, topk_ids, topk_weights, w13, w2, h, o, m_indices, row_map, src, counts, offsets,
                          c0, c1, c2, c3, recipe, provider, fp8_gemm, fp8_wgrad):
    return torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w13), torch.empty_like(w2)


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_weights, w13, w2, *choices = inputs
    ctx.save_for_backward(x, topk_ids, topk_weights, w13, w2, *output[1:])
    ctx.mark_non_differentiable(*output[8:])
    ctx.choices = tuple(choices)  # recipe, provider, fp8_gemm, fp8_wgrad


def _backward_rule(ctx, dy, *unused):
    dx, dw, dw13, dw2 = moe_experts_bwd(dy, *ctx.saved_tensors, *ctx.choices)
    return dx, None, dw, dw13, dw2, None, None, None, None


moe_experts_fwd.register_autograd(_backward_rule, setup_context=_setup_context)


def moe_experts_fused(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, recipe: str, gemms: Gemms) -> torch.Tensor:
    """The fused expert path: y [T, D] (differentiable in x, topk_weights, w13 and w2)."""
    return moe_experts_fwd(x, topk_ids, topk_weights, w13, w2, recipe, *gemms)[0]
