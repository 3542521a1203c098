"""ALiBi for the `flash` backend: score modifiers in the CuTe DSL that flash-attn-4 compiles into its kernels.

flash-attn-4 calls `score_mod(scores, batch, head, q_idx, kv_idx, seqlen_info, aux_tensors)` on each tile of scaled
scores before masking and softmax, with document-local positions (`q_idx` on the q side, `kv_idx` on the k side)
and the document's lengths in `seqlen_info`; the backward calls `score_mod_bwd(grad, scores, ...)` for the
gradient of the modified score with respect to the scaled one. The per-head slopes travel as `aux_tensors[0]`
(float32 [H]), so one compiled kernel serves any slopes.

The bias is moela's: `-slope_h * |i' - j|` with i' = i + Lk - Lq the query's position on the k side (bottom-right
alignment). Causal attention masks every key with j > i', so there the bias is `slope_h * (j - i')` and needs no
absolute value. Positions are converted to float per row and per column (the compiler merges the conversions of
equal indices across a tile) and the difference is exact below 2^24, so the bias is rounded once, by the multiply.
The bias does not depend on q or k: its backward passes the gradient through unchanged.

flash-attn-4 keys its compiled kernels (in memory and in its optional disk cache) by a hash of the score modifier's
source; the modifiers here call a helper, so each carries a hash of this whole file instead (`__cute_hash__`), and
an edit anywhere in it compiles anew.

This module imports the CuTe DSL (`cutlass`): `moela.ops.attention.flash` imports it only when ALiBi runs there.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import cutlass
import cutlass.cute as cute


@cute.jit
def _head_slope(head_idx, aux_tensors):
    """slopes[head] as a 1-element vector (aux_tensors[0] is float32 [H])."""
    slopes = aux_tensors[0]
    head = cute.make_rmem_tensor(1, cutlass.Int32)
    head.store(head_idx)
    slope = cute.make_rmem_tensor(1, cutlass.Float32)
    slope[0] = slopes[head[0]]
    return slope.load()


@cute.jit
def alibi_causal(scores, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """scores + slope * (j - i'): the visible keys of causal attention have j <= i'."""
    q_shift = seqlen_info.seqlen_k - seqlen_info.seqlen_q
    q_pos = (q_idx + q_shift).to(cutlass.Float32)
    k_pos = kv_idx.to(cutlass.Float32)
    return scores + _head_slope(head_idx, aux_tensors) * (k_pos - q_pos)


@cute.jit
def alibi_full(scores, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """scores - slope * |i' - j| (attention without a causal mask sees keys on both sides)."""
    q_shift = seqlen_info.seqlen_k - seqlen_info.seqlen_q
    distance = (q_idx + q_shift).to(cutlass.Float32) - kv_idx.to(cutlass.Float32)
    magnitude = cute.where(distance < 0.0, -distance, distance)
    return scores - _head_slope(head_idx, aux_tensors) * magnitude


@cute.jit
def alibi_backward(grad, scores, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """d(score + bias) / d(score) = 1."""
    return grad


_SOURCE = Path(__file__).read_bytes()
for _modifier in (alibi_causal, alibi_full, alibi_backward):
    _modifier.__cute_hash__ = hashlib.sha256(_SOURCE + _modifier.__name__.encode()).hexdigest()
