"""Fused output head + cross-entropy: `linear_cross_entropy(h, weight, labels)` = sum over labelled tokens of
CE(h @ weight^T, label), without ever holding the [T, V] logits.

Backends:
- `reference`: logits = h @ weight^T, then `cross_entropy_reference` (float32 softmax); the specification.
- `chunked`: an autograd Function that walks the tokens in chunks of about 2^26 / V rows. For each chunk it forms
  the logits (in the matmul's dtype, as the unfused head would: h's, or autocast's), their float32 log-sum-exp,
  the loss, and right away the gradients d h = (softmax - onehot) W and d W += (softmax - onehot)^T h (float32
  accumulator, kept in the weight's dtype afterwards); backward only scales them by the incoming scalar gradient.
  Peak extra memory is one chunk of logits instead of T x V, and no logits are recomputed in backward
  (Liger-Kernel's scheme).
  Runs on any device; `auto` picks it on CUDA.

The result is a float32 scalar SUM (the model divides by the step's labelled-token count).
Shapes: T tokens, D hidden, V vocabulary, C chunk rows.
"""

from __future__ import annotations

import torch

from moela.ops.backends import LINEAR_CROSS_ENTROPY_BACKENDS
from moela.ops.dispatch import Dispatch
from moela.ops.loss import IGNORE_INDEX, cross_entropy_reference

CHUNK_ELEMENTS = 2 ** 26  # logits per chunk (256 MiB in float32)


def linear_cross_entropy_reference(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return cross_entropy_reference(h @ weight.t(), labels).sum()


DISPATCH = Dispatch("linear_cross_entropy", LINEAR_CROSS_ENTROPY_BACKENDS)


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk_rows, want_grad):
        t = h.shape[0]
        grad_h = torch.empty_like(h) if want_grad else None  # [T, D]
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if want_grad else None
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        for a in range(0, t, chunk_rows):
            hc, lab = h[a:a + chunk_rows], labels[a:a + chunk_rows]  # [C, D], [C]
            mm = hc @ weight.t()  # [C, V] in the matmul's dtype (the autocast dtype under autocast)
            logits = mm.float()  # [C, V]
            valid = lab != IGNORE_INDEX  # [C]
            safe = torch.where(valid, lab, torch.zeros_like(lab))  # [C]
            lse = torch.logsumexp(logits, dim=-1)  # [C]
            nll = lse - logits.gather(1, safe[:, None]).squeeze(1)  # [C]
            total += torch.where(valid, nll, torch.zeros_like(nll)).sum()
            if want_grad:
                g = torch.exp(logits.sub_(lse[:, None]))  # [C, V] softmax, in place of the logits
                g[torch.arange(g.shape[0], device=g.device), safe] -= 1.0
                g.mul_(valid[:, None].float())
                g = g.to(mm.dtype)  # [C, V], so that the two GEMMs below need no further cast under autocast
                grad_h[a:a + chunk_rows] = g @ weight  # [C, D]
                grad_w += g.t() @ hc  # [V, D], accumulated in float32
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None, None, None


def linear_cross_entropy_chunked(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    chunk_rows = max(1, CHUNK_ELEMENTS // weight.shape[0])
    # grad mode is always off inside Function.forward: decide here whether the gradients are needed at all (not
    # under no_grad, e.g. evaluation, where a parameter weight still has requires_grad set)
    want_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return _ChunkedLinearCE.apply(h, weight, labels, chunk_rows, want_grad)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         backend: str = "auto") -> torch.Tensor:
    """h [T, D], weight [V, D], labels [T] -> summed token cross-entropy (float32 scalar)."""
    DISPATCH.check(backend)
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1] or labels.shape != h.shape[:1]:
        raise ValueError(f"linear_cross_entropy wants h [T, D], weight [V, D], labels [T]; got {tuple(h.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(labels.shape)}")
    chosen = DISPATCH.choose(backend, h, weight, labels)
    if chosen == "reference":
        return linear_cross_entropy_reference(h, weight, labels)
    return DISPATCH.impl(chosen)(h, weight, labels)


DISPATCH.register("chunked", linear_cross_entropy_chunked, auto=lambda h, weight, labels: h.is_cuda)
