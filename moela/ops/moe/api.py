"""Routed-expert computation of a Mixture-of-Experts layer: `moe_experts`.

y[t] = sum_k topk_weights[t, k] * W2_e (silu(W1_e x[t]) * W3_e x[t]),  e = topk_ids[t, k]

Weights are stacked for all experts: `w13 [E, 2F, D]` (rows [0, F) are W1 (gate), rows [F, 2F) are W3 (up)) and
`w2 [E, D, F]`. Backends:
- `reference`: pure torch, any device, loops over experts; the specification. With `recipe="fp8_blockwise"` it
  simulates DeepSeek-V3's FP8 recipe (e4m3, activations 1x128 groups, weights 128x128 blocks) by quantize ->
  dequantize around each GEMM, so fast kernels can be compared against it with the same scales.
- fast backends (CUDA; on CPU only when asked for by name, under TRITON_INTERPRET=1 for tests) register in
  `_FAST_BACKENDS` from `moela.ops.moe.autograd`, in `auto` preference order: `deep_gemm` (fp8, when `import deep_gemm`
  works), `cublas` (fp8, cuBLAS blockwise `torch._scaled_mm` per expert, compute capability 9.x, torch >= 2.10),
  `torch` (bf16, `torch._grouped_mm`, compute capability >= 9), `triton` (both recipes). All four share
  the fused Triton layout/quantization kernels of `moela.ops.moe kernels` and need D and F multiples of 128 and x in
  bf16/fp16; `auto` falls back to the reference otherwise.

Shapes: T tokens, D hidden, E experts, K top-k, F expert FFN width.
"""

from __future__ import annotations

from typing import Callable

import torch

from moela.ops.dispatch import check_backend, resolve_backend
from moela.ops.moe.reference import RECIPES, moe_experts_reference

BACKENDS = ("auto", "reference", "triton", "torch", "cublas", "deep_gemm")

_FAST_BACKENDS: dict[str, tuple[Callable[..., bool], Callable[..., torch.Tensor]]] = {}


def register_backend(name: str, supported: Callable[..., bool], impl: Callable[..., torch.Tensor]) -> None:
    _FAST_BACKENDS[name] = (supported, impl)


def _check_inputs(x, topk_ids, topk_weights, w13, w2, recipe):
    if recipe not in RECIPES:
        raise ValueError(f"moe_experts: unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
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


def moe_experts(x, topk_ids, topk_weights, w13, w2, *, recipe="bf16", backend="auto"):
    """Weighted sum over each token's top-k experts of SwiGLU expert FFNs. x [T, D] -> y [T, D] (x's dtype, or
    the autocast dtype when autocast is on)."""
    check_backend("moe_experts", backend, BACKENDS)
    _check_inputs(x, topk_ids, topk_weights, w13, w2, recipe)
    x = autocast_input(x)
    chosen = resolve_backend("moe_experts", backend, _FAST_BACKENDS, x, topk_ids, topk_weights, w13, w2,
                             recipe=recipe, reason=recipe, needs="CUDA and its package")
    if chosen == "reference":
        return moe_experts_reference(x, topk_ids, topk_weights, w13, w2, recipe=recipe)
    return _FAST_BACKENDS[chosen][1](x, topk_ids, topk_weights, w13, w2, recipe=recipe)


def _register_fast_backends() -> None:
    try:
        from moela.ops.moe.autograd import BACKENDS as fused
    except ImportError:  # no Triton on this platform: the reference backend stays available
        return
    for name, (supported, impl) in fused.items():
        register_backend(name, supported, impl)


_register_fast_backends()
