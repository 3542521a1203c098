"""Fused output head + cross-entropy: `linear_cross_entropy(h, weight, labels)` = sum over labelled tokens of
CE(h @ weight^T, label), without ever holding the [T, V] logits.

Backends:
- `reference`: logits = h @ weight^T, then `cross_entropy_reference` (float32 softmax); the specification.
- `chunked`: an autograd Function that walks the tokens in chunks of 2^26 / V rows, but at least 4096
  (`chunk_rows`). For each chunk it forms the logits (in the matmul's dtype, as the unfused head would: h's, or
  autocast's; the weight cast to it once per call, not per chunk), and from them in one fused pass
  (`chunk_loss_and_grad`, through Inductor on CUDA) the loss and the logit gradient softmax - onehot in the
  logits' dtype, without ever writing float32 logits; right away it forms d h = G W and d W += G^T h into a
  float32 accumulator (`add_product_`: on CUDA the GEMM adds into it itself), kept in the weight's dtype
  afterwards; backward only scales them by the incoming scalar gradient. Peak extra memory is one chunk of logits
  and one of their gradient instead of T x V, and no logits are recomputed in backward (Liger-Kernel's scheme).
  Why at least 4096 rows and the in-GEMM accumulation: with V = 102,400 (DeepSeek-V2-Lite) 2^26 / V is 655 rows,
  so 64k tokens made 100 chunks, each with three 655-row GEMMs, a [V, D] product written in bf16 and a second
  pass adding it into the float32 accumulator, and a cast of the [V, D] weight: the non-GEMM kernels of the loss
  took 24% of V2-Lite-6L's step.
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

CHUNK_ELEMENTS = 2 ** 26  # logits per chunk (128 MiB in bf16)
MIN_CHUNK_ROWS = 4096  # a large vocabulary's chunks still make full-size GEMMs (4096 x 102,400 bf16 logits: 800 MiB)
_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")  # bf16 x bf16 -> float32 output (CUDA only)


def linear_cross_entropy_reference(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return cross_entropy_reference(h @ weight.t(), labels).sum()


def chunk_rows(vocab: int) -> int:
    """Token rows per chunk for a vocabulary of `vocab`: CHUNK_ELEMENTS logits, but at least MIN_CHUNK_ROWS."""
    return max(1, CHUNK_ELEMENTS // vocab, MIN_CHUNK_ROWS)


def matmul_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of `h @ weight.t()` as the unfused head computes it: autocast's where autocast is on for h's device
    (it leaves float64 alone), else the promoted dtype."""
    device = h.device.type
    if torch.is_autocast_enabled(device) and torch.float64 not in (h.dtype, weight.dtype):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(h.dtype, weight.dtype)


def add_product_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc += a @ b for a float32 accumulator and operands of a lower precision (a and b of one dtype): on CUDA the
    GEMM adds its float32 result into acc itself (`addmm` with out_dtype), so the product is never rounded to the
    operands' dtype nor written and read again by a second pass; elsewhere the product is formed in the operands'
    dtype and added (CPU has no mixed-dtype addmm)."""
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b)
    if acc.is_cuda and _ADDMM_OUT_DTYPE:
        return torch.ops.aten.addmm.dtype_out(acc, a, b, acc.dtype, out=acc)
    return acc.add_(a @ b)


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
        dtype = matmul_dtype(h, weight)
        w = weight.to(dtype)  # [V, D], cast once (a no-op when it has the dtype)
        grad_h = torch.empty_like(h) if want_grad else None  # [T, D]
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if want_grad else None
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        fused = h.is_cuda
        for a in range(0, t, chunk_rows):
            hc, lab = h[a:a + chunk_rows].to(dtype), labels[a:a + chunk_rows]  # [C, D], [C]
            mm = hc @ w.t()  # [C, V] in the matmul's dtype
            if not want_grad:
                total += (chunk_loss_fused if fused else chunk_loss)(mm, lab)
                continue
            loss, g = (chunk_loss_and_grad_fused if fused else chunk_loss_and_grad)(mm, lab)  # [], [C, V]
            total += loss
            grad_h[a:a + chunk_rows] = g @ w  # [C, D]
            add_product_(grad_w, g.t(), hc)  # [V, D] += G^T h in float32
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None, None, None


def linear_cross_entropy_chunked(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    rows = chunk_rows(weight.shape[0])
    # grad mode is always off inside Function.forward: decide here whether the gradients are needed at all (not
    # under no_grad, e.g. evaluation, where a parameter weight still has requires_grad set)
    want_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return _ChunkedLinearCE.apply(h, weight, labels, rows, want_grad)


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
