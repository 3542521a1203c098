"""Routed-expert computation of a Mixture-of-Experts layer: `moe_experts`.

y[t] = sum_k topk_weights[t, k] * W2_e (silu(W1_e x[t]) * W3_e x[t]),  e = topk_ids[t, k]

A negative id is an empty slot: it adds nothing, takes no row of the layout and its weight gets no gradient
(expert parallelism passes the slots whose experts live on other ranks, and padding tokens, this way).

Weights are stacked for all experts: `w13 [E, 2F, D]` (rows [0, F) are W1 (gate), rows [F, 2F) are W3 (up)) and
`w2 [E, D, F]`. Backends: `reference` (moela.ops.moe.reference: pure torch, any device, the specification; the
fp8 recipe simulated by quantize -> dequantize), and the fast backends of moela.ops.moe.providers (CUDA; on CPU only
when asked for by name, under TRITON_INTERPRET=1 for tests), which share the fused Triton layout / quantization
kernels and differ in their grouped GEMMs. `auto` falls back to the reference for a call no fast backend supports.
`DISPATCH` is the one place that chooses the backend, for eager and compiled calls alike; `fp8_gemm` and
`fp8_wgrad` choose the implementation of our FP8 GEMMs inside a fast backend (moela.ops.moe.autograd).

Shapes: T tokens, D hidden, E experts, K top-k, F expert FFN width.
"""

from __future__ import annotations

import torch

from moela.ops.backends import FP8_GEMM_IMPLS, MOE_BACKENDS, MOE_RECIPES
from moela.ops.dispatch import Dispatch
from moela.ops.moe.reference import moe_experts_reference

# fast backends: impl and predicates (x, topk_ids, topk_weights, w13, w2, *, recipe)
DISPATCH = Dispatch("moe_experts", MOE_BACKENDS, needs="CUDA and its package")


def _check_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, recipe: str, fp8_gemm: str, fp8_wgrad: str) -> None:
    if recipe not in MOE_RECIPES:
        raise ValueError(f"moe_experts: unknown recipe {recipe!r}; choose one of {', '.join(MOE_RECIPES)}")
    for name, impl in (("fp8_gemm", fp8_gemm), ("fp8_wgrad", fp8_wgrad)):
        if impl not in FP8_GEMM_IMPLS:
            raise ValueError(f"moe_experts: unknown {name} {impl!r}; choose one of {', '.join(FP8_GEMM_IMPLS)}")
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts wants x [T, D] and topk_ids [T, K]; got {tuple(x.shape)}, "
                         f"{tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    e, two_f, d = w13.shape
    if d != x.shape[1] or two_f % 2 or w2.shape != (e, d, two_f // 2):
        raise ValueError(f"moe_experts wants w13 [E, 2F, D] and w2 [E, D, F] with D={x.shape[1]}; got "
                         f"{tuple(w13.shape)} and {tuple(w2.shape)}")


def tokens_per_expert(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """topk_ids [T, K] (or flat) -> [E] int64 pairs routed to each expert, on the ids' device without a host sync
    (torch.bincount's output size needs one on CUDA)."""
    flat = topk_ids.reshape(-1).long()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x cast as autocast casts a matmul's input. Autocast does not see `moe_experts`: under autocast the residual
    stream stays fp32, and the fast backends, which run in bf16/fp16, would otherwise fall back to the fp32
    reference (expert parallelism casts before its all-to-all, which then moves half the bytes)."""
    if torch.is_autocast_enabled(x.device.type) and x.dtype == torch.float32:
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, *, recipe: str = "bf16", backend: str = "auto", fp8_gemm: str = "auto",
                fp8_wgrad: str = "auto") -> torch.Tensor:
    """Weighted sum over each token's top-k experts of SwiGLU expert FFNs. x [T, D] -> y [T, D] (x's dtype, or
    the autocast dtype when autocast is on). fp8_gemm (forward and data gradient) and fp8_wgrad (weight gradient):
    our FP8 GEMMs' implementation, "auto" (Gluon on Hopper, else Triton), "gluon" or "triton"."""
    DISPATCH.check(backend)
    _check_inputs(x, topk_ids, topk_weights, w13, w2, recipe, fp8_gemm, fp8_wgrad)
    x = autocast_input(x)
    chosen = DISPATCH.choose(backend, x, topk_ids, topk_weights, w13, w2, recipe=recipe, reason=f"recipe {recipe}")
    if chosen == "reference":
        return moe_experts_reference(x, topk_ids, topk_weights, w13, w2, recipe=recipe)
    return DISPATCH.impl(chosen)(x, topk_ids, topk_weights, w13, w2, recipe=recipe, fp8_gemm=fp8_gemm,
                                 fp8_wgrad=fp8_wgrad)


try:
    from moela.ops.moe.providers import FAST_BACKENDS
except ImportError:  # no Triton on this platform: the reference backend stays available
    pass
else:
    for _name, _auto, _impl in FAST_BACKENDS:  # torch.library custom ops with fake implementations: traceable
        DISPATCH.register(_name, _impl, auto=_auto, traceable=True)
