"""Token cross-entropy: `cross_entropy(logits, labels)` with IGNORE_INDEX labels contributing zero.

Returns the per-token loss or its sum (never a mean: the model divides by the step's labelled-token count itself so
that gradient accumulation and data parallelism reproduce the single-process objective exactly). Logits are upcast
to float32 inside the computation. Backends: `reference`, `compiled` (the reference through TorchInductor, CUDA);
further kernels register with `DISPATCH`. The model's training path uses the fused head + loss of
`moela.ops.linear_cross_entropy` instead, which never forms the [T, V] logits.

Shapes: T tokens, V vocabulary.
"""

from __future__ import annotations

from typing import Literal

import torch

from moela.ops.backends import CROSS_ENTROPY_BACKENDS
from moela.ops.compiled import compiled, on_cuda
from moela.ops.dispatch import Dispatch

IGNORE_INDEX = -100
DISPATCH = Dispatch("cross_entropy", CROSS_ENTROPY_BACKENDS)


def cross_entropy_reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token loss [T] float32, 0 where labels == IGNORE_INDEX."""
    lf = logits.float()  # [T, V]
    valid = labels != IGNORE_INDEX  # [T]
    safe = torch.where(valid, labels, torch.zeros_like(labels))  # [T]
    nll = torch.logsumexp(lf, dim=-1) - lf.gather(1, safe[:, None]).squeeze(1)  # [T]
    return torch.where(valid, nll, torch.zeros_like(nll))


DISPATCH.register("compiled", compiled(cross_entropy_reference), auto=on_cuda, traceable=True)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, reduction: Literal["sum", "none"] = "sum",
                  backend: str = "auto") -> torch.Tensor:
    """logits [T, V], labels [T] int64 -> summed loss (scalar float32) or per-token loss [T]."""
    DISPATCH.check(backend)
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy wants logits [T, V] and labels [T]; got {tuple(logits.shape)}, "
                         f"{tuple(labels.shape)}")
    if reduction not in ("sum", "none"):
        raise ValueError(f"cross_entropy: reduction must be 'sum' or 'none', got {reduction!r}")
    chosen = DISPATCH.choose(backend, logits, labels)
    if chosen == "reference":
        per_token = cross_entropy_reference(logits, labels)
    else:
        per_token = DISPATCH.impl(chosen)(logits, labels)
    return per_token.sum() if reduction == "sum" else per_token
