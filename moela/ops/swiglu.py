"""SwiGLU activation: `swiglu(gate, up) = silu(gate) * up`, the FFN nonlinearity of dense MLPs and experts.

Computed in float32, returned in the inputs' dtype. Backends: `reference`, `compiled` (the reference through
TorchInductor, CUDA, see `moela.ops.compiled`); further kernels register in `_FAST_BACKENDS`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moela.ops.compiled import compiled, on_cuda
from moela.ops.dispatch import check_backend, resolve_backend

BACKENDS = ("auto", "reference", "compiled")

_FAST_BACKENDS: dict[str, tuple[Callable[..., bool], Callable[..., torch.Tensor]]] = {}


def register_backend(name: str, supported: Callable[..., bool], impl: Callable[..., torch.Tensor]) -> None:
    _FAST_BACKENDS[name] = (supported, impl)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


register_backend("compiled", on_cuda, compiled(swiglu_reference))


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """gate [..., F], up [..., F] -> [..., F]."""
    check_backend("swiglu", backend, BACKENDS)
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    chosen = resolve_backend("swiglu", backend, _FAST_BACKENDS, gate, up)
    if chosen == "reference":
        return swiglu_reference(gate, up)
    return _FAST_BACKENDS[chosen][1](gate, up)
