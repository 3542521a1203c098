"""Vocabulary-parallel output head + cross-entropy: `vocab_parallel_cross_entropy(h, weight, labels, vocab_start,
group)` = sum over labelled tokens of CE(h @ W^T, label), where each rank of `group` holds the rows
[vocab_start, vocab_start + V_local) of the head W and no rank ever holds a full row of logits.

Per chunk of tokens (as `moela.ops.linear_cross_entropy`'s chunked backend: 2^26 / V_local rows, at least 4096,
the weight cast once per call), each rank forms its logit columns [C, V_local] in float32, then two all-reduces
over the group complete the softmax statistics: the row maximum (MAX), and the sum of exponentials together with
the target's logit (SUM, [C, 2]; a label is in exactly one rank's shard, the others contribute 0). The loss is then
the same on every rank. The gradients are formed right away, as in the single-device chunked loss: d logits =
softmax - onehot on this rank's columns, d W_local = d logits^T h (complete: every token's contribution to this
rank's rows), d h = d logits W_local (this rank's share of the vocabulary only: a partial sum the caller completes,
e.g. through the backward of the all-gather that produced h). Backward only scales them by the incoming gradient.

Every rank's loss is the whole micro-batch's (replicated), and its backward contributes only its own vocabulary
shard's part of d h: summing those parts over the group, the gradients equal the single-device ones.

Shapes: T tokens, D hidden, V_local this rank's vocabulary rows, C chunk rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moela.ops.linear_cross_entropy import MIN_CHUNK_ROWS, add_product_, matmul_dtype
from moela.ops.loss import IGNORE_INDEX

CHUNK_ELEMENTS = 2 ** 26  # logits per chunk and rank (256 MiB in float32)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, vocab_start, group, chunk_rows, want_grad):
        t, v_local = h.shape[0], weight.shape[0]
        dtype = matmul_dtype(h, weight)
        w = weight.to(dtype)  # [V_local, D], cast once per call, not per chunk
        grad_h = torch.empty_like(h) if want_grad else None  # [T, D]
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if want_grad else None
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        for a in range(0, t, chunk_rows):
            hc, lab = h[a:a + chunk_rows].to(dtype), labels[a:a + chunk_rows]  # [C, D], [C]
            mm = hc @ w.t()  # [C, V_local] in the matmul's dtype (the autocast dtype under autocast)
            logits = mm.float()  # [C, V_local]
            valid = lab != IGNORE_INDEX  # [C]
            local = lab - vocab_start  # [C]
            mine = valid & (local >= 0) & (local < v_local)  # [C] label in this rank's shard
            safe = torch.where(mine, local, torch.zeros_like(local))  # [C]
            row_max = logits.max(dim=-1).values  # [C]
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            shifted = logits.sub_(row_max[:, None])  # [C, V_local], in place of the logits
            target = torch.where(mine, shifted.gather(1, safe[:, None]).squeeze(1), torch.zeros_like(row_max))
            exp = shifted.exp_()  # [C, V_local]
            stats = torch.stack((exp.sum(-1), target), dim=-1)  # [C, 2]: sum of exp, target logit - max
            dist.all_reduce(stats, group=group)
            nll = stats[:, 0].log() - stats[:, 1]  # [C] = lse - target logit
            total += torch.where(valid, nll, torch.zeros_like(nll)).sum()
            if want_grad:
                g = exp.div_(stats[:, :1])  # [C, V_local] softmax, in place
                rows = torch.arange(g.shape[0], device=g.device)
                g[rows, safe] -= mine.float()
                g.mul_(valid[:, None].float())
                g = g.to(mm.dtype)  # [C, V_local]
                grad_h[a:a + chunk_rows] = g @ w  # [C, D], this shard's share
                add_product_(grad_w, g.t(), hc)  # [V_local, D] += G^T h in float32
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                                 group) -> torch.Tensor:
    """h [T, D] (every token, the same on every rank), weight [V_local, D] (rows vocab_start.. of the head),
    labels [T] -> summed token cross-entropy (float32 scalar, the same on every rank)."""
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1] or labels.shape != h.shape[:1]:
        raise ValueError(f"vocab_parallel_cross_entropy wants h [T, D], weight [V_local, D], labels [T]; got "
                         f"{tuple(h.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}")
    chunk_rows = max(1, CHUNK_ELEMENTS // weight.shape[0], MIN_CHUNK_ROWS)  # full-size GEMMs (linear_cross_entropy)
    want_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return _VocabParallelCE.apply(h, weight, labels, vocab_start, group, chunk_rows, want_grad)
