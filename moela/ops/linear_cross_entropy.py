"""Fused output head + cross-entropy: `linear_cross_entropy(h, weight, labels)` = sum over labelled tokens of
CE(h @ weight^T, label), without ever holding the [T, V] logits.

Backends:
- `reference`: logits = h @ weight^T, then `cross_entropy_reference` (float32 softmax); the specification.
- `chunked`: an autograd Function that walks the tokens in chunks of about 2^26 / V rows. For each chunk it forms
  the logits (in the matmul's dtype, as the unfused head would: h's, or autocast's), and from them in one fused
  pass (`chunk_loss_and_grad`, through Inductor on CUDA) the loss and the logit gradient softmax - onehot in the
  logits' dtype, without ever writing float32 logits; right away it forms d h = G W and d W += G^T h (float32
  accumulator, kept in the weight's dtype afterwards); backward only scales them by the incoming scalar gradient.
  Peak extra memory is one chunk of logits and one of their gradient instead of T x V, and no logits are
  recomputed in backward (Liger-Kernel's scheme).
  Runs on any device; `auto` picks it on CUDA.

The result is a float32 scalar SUM (the model divides by the step's labelled-token count).
Shapes: T tokens, D hidden, V vocabulary, C chunk rows.
"""

from __future__ import annotations

import torch

from moela.ops.backends import LINEAR_CROSS_ENTROPY_BACKENDS
from moela.ops.compiled import compiled
from moela.ops.dispatch import Dispatch
from moela.ops.loss import IGNORE_INDEX, cross_entropy_reference

CHUNK_ELEMENTS = 2 ** 26  # logits per chunk (256 MiB in float32)


def linear_cross_entropy_reference(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return cross_entropy_reference(h @ weight.t(), labels).sum()


DISPATCH = Dispatch("linear_cross_entropy", LINEAR_CROSS_ENTROPY_BACKENDS)


def chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's summed CE and its logit gradient (softmax - onehot, 0 on unlabelled rows) in the logits' dtype.
    logits [C, V] (the matmul's dtype), labels [C] -> (loss [] float32, grad [C, V]). The float32 math is written
    once here; on CUDA it runs through Inductor (`chunk_loss_and_grad_fused`), which reads the logits twice and
    writes the gradient once, never holding float32 logits."""
    lf = logits.float()  # [C, V]
    valid = labels != IGNORE_INDEX  # [C]
    safe = torch.where(valid, labels, torch.zeros_like(labels))  # [C]
    lse = torch.logsumexp(lf, dim=-1)  # [C]
    onehot = torch.arange(lf.shape[1], device=lf.device)[None, :] == safe[:, None]  # [C, V]
    target = (lf * onehot).sum(-1)  # [C]
    loss = torch.where(valid, lse - target, torch.zeros_like(lse)).sum()
    grad = (torch.exp(lf - lse[:, None]) - onehot.float()) * valid[:, None].float()  # [C, V]
    return loss, grad.to(logits.dtype)


def chunk_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`chunk_loss_and_grad`'s loss alone (no gradient wanted: evaluation)."""
    lf = logits.float()  # [C, V]
    valid = labels != IGNORE_INDEX  # [C]
    safe = torch.where(valid, labels, torch.zeros_like(labels))  # [C]
    nll = torch.logsumexp(lf, dim=-1) - lf.gather(1, safe[:, None]).squeeze(1)  # [C]
    return torch.where(valid, nll, torch.zeros_like(nll)).sum()


chunk_loss_and_grad_fused = compiled(chunk_loss_and_grad)
chunk_loss_fused = compiled(chunk_loss)


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk_rows, want_grad):
        t = h.shape[0]
        grad_h = torch.empty_like(h) if want_grad else None  # [T, D]
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if want_grad else None
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        fused = h.is_cuda
        for a in range(0, t, chunk_rows):
            hc, lab = h[a:a + chunk_rows], labels[a:a + chunk_rows]  # [C, D], [C]
            mm = hc @ weight.t()  # [C, V] in the matmul's dtype (the autocast dtype under autocast)
            if not want_grad:
                total += (chunk_loss_fused if fused else chunk_loss)(mm, lab)
                continue
            loss, g = (chunk_loss_and_grad_fused if fused else chunk_loss_and_grad)(mm, lab)  # [], [C, V]
            total += loss
            grad_h[a:a + chunk_rows] = g @ weight.to(g.dtype)  # [C, D]
            grad_w += g.t() @ hc.to(g.dtype)  # [V, D], accumulated in float32
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
