"""RMSNorm: `rms_norm(x, weight, eps)`, normalizing over the last dimension.

y = x / sqrt(mean(x**2) + eps) * weight, computed in float32 and returned in x's dtype. The weight multiplies the
float32 normalized value before the cast back (DeepSeek's reference order); HF's T5-style norm casts first, which
is identical in float32. Backends: `reference` (pure torch), `compiled` (the reference through TorchInductor,
CUDA, see `moela.ops.compiled`); further kernels register with `DISPATCH`.
"""

from __future__ import annotations

import torch

from moela.ops.backends import RMS_NORM_BACKENDS
from moela.ops.compiled import compiled, on_cuda
from moela.ops.dispatch import Dispatch

DISPATCH = Dispatch("rms_norm", RMS_NORM_BACKENDS)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()  # [..., C]
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., C]
    return (y * weight.float()).to(x.dtype)


DISPATCH.register("compiled", compiled(rms_norm_reference), auto=on_cuda, traceable=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, backend: str = "auto") -> torch.Tensor:
    """x [..., C], weight [C] -> [..., C] in x's dtype."""
    DISPATCH.check(backend)
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: weight must be [C] with C = x.shape[-1]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    chosen = DISPATCH.choose(backend, x, weight)
    if chosen == "reference":
        return rms_norm_reference(x, weight, eps)
    return DISPATCH.impl(chosen)(x, weight, eps)
