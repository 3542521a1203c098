"""The fast backends of `moe_experts`: one per GEMM provider (moela.ops.moe.autograd says which kernel runs each
GEMM), all running the fused custom ops of moela.ops.moe.autograd.

`auto` prefers, for a call it supports: `deep_gemm` (fp8, when `import deep_gemm` works), `torch_triton` (bf16,
`torch._grouped_mm` forward and data gradient, our Triton weight gradient, compute capability >= 9), `triton` (both
recipes; for fp8 the persistent one-launch GEMMs, no host sync). `cublas` (fp8, cuBLAS blockwise `torch._scaled_mm`
per expert, compute capability 9.x, torch >= 2.10) is never picked by `auto`: it reads the expert bounds on the host
(a sync per forward and backward) and issues one GEMM per expert; it stays as a measured fallback, by name. All
need D and F multiples of 128 and x in bf16/fp16. A backend asked for by name checks its preconditions itself and
says what is missing. `fp8_gemm` / `fp8_wgrad` (the recipe's `model.kernels.moe_fp8_gemm` / `moe_fp8_wgrad`) choose
the implementation of our FP8 GEMMs wherever a backend runs them.

Shapes: T tokens, D hidden, E experts, K top-k, F expert FFN width.
"""

from __future__ import annotations

import torch

from moela.ops.backends import moe_backend_problems
from moela.ops.fp8_device import fp8_device_problem
from moela.ops.moe.autograd import Gemms, moe_experts_fused
from moela.ops.moe.kernels.gemm_libraries import cublas_blockwise_available, deep_gemm_available
from moela.ops.moe.kernels.layout import build_layout_rows


def _shapes_ok(x, w13):
    return not moe_backend_problems("triton", "bf16", x.shape[1], w13.shape[1] // 2) and \
        x.dtype in (torch.bfloat16, torch.float16)


def _supported_triton(x, topk_ids, topk_weights, w13, w2, *, recipe):
    return x.is_cuda and _shapes_ok(x, w13) and (recipe == "bf16" or fp8_device_problem(x.device) is None)


def _supported_torch_triton(x, topk_ids, topk_weights, w13, w2, *, recipe):
    return (recipe == "bf16" and x.is_cuda and x.dtype == torch.bfloat16 and _shapes_ok(x, w13)
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def _never(x, topk_ids, topk_weights, w13, w2, *, recipe):
    return False


def _supported_deep_gemm(x, topk_ids, topk_weights, w13, w2, *, recipe):
    return recipe == "fp8_blockwise" and _supported_triton(x, topk_ids, topk_weights, w13, w2, recipe=recipe) \
        and deep_gemm_available()


def _impl(provider):
    def run(x, topk_ids, topk_weights, w13, w2, *, recipe, fp8_gemm="auto", fp8_wgrad="auto"):
        problems = moe_backend_problems(provider, recipe, x.shape[1], w13.shape[1] // 2)
        if problems:
            raise ValueError(f"moe_experts backend {provider!r} {problems[0]}")
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"moe_experts backend {provider!r} needs x in bf16/fp16, got {x.dtype}; use "
                             f"backend='reference'")
        if recipe == "fp8_blockwise" and (problem := fp8_device_problem(x.device)):
            raise RuntimeError(f"moe_experts backend {provider!r}, recipe 'fp8_blockwise': {problem}; use "
                               f"recipe='bf16', or backend='reference' (FP8 simulated in torch, slow)")
        if provider == "cublas" and not cublas_blockwise_available(x.device if x.is_cuda else None):
            raise RuntimeError("moe_experts backend 'cublas' needs a Hopper GPU (compute capability 9.x) and torch "
                               ">= 2.10 (cuBLAS blockwise FP8); use backend='triton'")
        t, k = topk_ids.shape
        m_pad = build_layout_rows(t, k, w13.shape[0])
        if m_pad * max(x.shape[1], w13.shape[1]) >= 2 ** 31:
            raise ValueError(f"moe_experts backend {provider!r}: {m_pad} padded rows x width "
                             f"{max(x.shape[1], w13.shape[1])} overflow the kernels' int32 offsets; use fewer tokens "
                             f"per micro-batch (or per expert-parallel rank)")
        if provider == "deep_gemm" and not deep_gemm_available():
            raise RuntimeError("moe_experts backend 'deep_gemm' needs `import deep_gemm` to work on a CUDA device; "
                               "use backend='triton'")
        return moe_experts_fused(x.contiguous(), topk_ids, topk_weights.float(), w13, w2, recipe,
                                 Gemms(provider, fp8_gemm, fp8_wgrad))

    return run


# (name, auto predicate, implementation) in `auto` preference order
FAST_BACKENDS = (
    ("deep_gemm", _supported_deep_gemm, _impl("deep_gemm")),
    ("torch_triton", _supported_torch_triton, _impl("torch_triton")),
    ("triton", _supported_triton, _impl("triton")),
    ("cublas", _never, _impl("cublas")),
)
