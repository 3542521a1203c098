"""SwiGLU activation: `swiglu(gate, up) = silu(gate) * up`, the FFN nonlinearity of dense MLPs and experts.

Computed in float32, returned in the inputs' dtype. Backends: `reference`, `compiled` (the reference through
TorchInductor, CUDA, see `moela.ops.compiled`); further kernels register with `DISPATCH`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moela.ops.backends import SWIGLU_BACKENDS
from moela.ops.compiled import compiled, on_cuda
from moela.ops.dispatch import Dispatch

DISPATCH = Dispatch("swiglu", SWIGLU_BACKENDS)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


DISPATCH.register("compiled", compiled(swiglu_reference), auto=on_cuda, traceable=True)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """gate [..., F], up [..., F] -> [..., F]."""
    DISPATCH.check(backend)
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    chosen = DISPATCH.choose(backend, gate, up)
    if chosen == "reference":
        return swiglu_reference(gate, up)
    return DISPATCH.impl(chosen)(gate, up)
