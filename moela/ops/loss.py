"""Token cross-entropy: `cross_entropy(logits, labels)` with IGNORE_INDEX labels contributing zero.

Returns the per-token loss or its sum (never a mean: the model divides by the step's labelled-token count itself so
that gradient accumulation and data parallelism reproduce the single-process objective exactly). Logits are upcast
to float32 inside the computation. Backends: `reference`, `compiled` (the reference through TorchInductor, CUDA);
further kernels register in `_FAST_BACKENDS`. The model's training path uses the fused head + loss of
`moela.ops.linear_cross_entropy` instead, which never forms the [T, V] logits.

Shapes: T tokens, V vocabulary.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch

from moela.ops.compiled import compiled, on_cuda
from moela.ops.dispatch import check_backend, resolve_backend

IGNORE_INDEX = -100
BACKENDS = ("auto", "reference", "compiled")

_FAST_BACKENDS: dict[str, tuple[Callable[..., bool], Callable[..., torch.Tensor]]] = {}


def register_backend(name: str, supported: Callable[..., bool], impl: Callable[..., torch.Tensor]) -> None:
    _FAST_BACKENDS[name] = (supported, impl)


def cross_entropy_reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token loss [T] float32, 0 where labels == IGNORE_INDEX."""
    lf = logits.float()  # [T, V]
    valid = labels != IGNORE_INDEX  # [T]
    safe = torch.where(valid, labels, torch.zeros_like(labels))  # [T]
    nll = torch.logsumexp(lf, dim=-1) - lf.gather(1, safe[:, None]).squeeze(1)  # [T]
    return torch.where(valid, nll, torch.zeros_like(nll))


register_backend("compiled", on_cuda, compiled(cross_entropy_reference))


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, reduction: Literal["sum", "none"] = "sum",
                  backend: str = "auto") -> torch.Tensor:
    """logits [T, V], labels [T] int64 -> summed loss (scalar float32) or per-token loss [T]."""
    check_backend("cross_entropy", backend, BACKENDS)
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy wants logits [T, V] and labels [T]; got {tuple(logits.shape)}, "
                         f"{tuple(labels.shape)}")
    if reduction not in ("sum", "none"):
        raise ValueError(f"cross_entropy: reduction must be 'sum' or 'none', got {reduction!r}")
    chosen = resolve_backend("cross_entropy", backend, _FAST_BACKENDS, logits, labels)
    if chosen == "reference":
        per_token = cross_entropy_reference(logits, labels)
    else:
        per_token = _FAST_BACKENDS[chosen][1](logits, labels)
    return per_token.sum() if reduction == "sum" else per_token
