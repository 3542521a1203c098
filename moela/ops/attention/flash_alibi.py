"""ALiBi for the `flash` backend: score modifiers in the CuTe DSL that flash-attn-4 compiles into its kernels.

flash-attn-4 calls `score_mod(scores, batch, head, q_idx, kv_idx, seqlen_info, aux_tensors)` on each tile of scaled
scores before masking and softmax, with document-local positions (`q_idx` on the q side, `kv_idx` on the k side)
and the document's lengths in `seqlen_info`; the backward calls `score_mod_bwd(grad, scores, ...)` for the
gradient of the modified score with respect to the scaled one.

The per-head slopes are compile-time constants of the modifier (`alibi_score_mods(slopes, causal)` builds one per
slopes and mask, cached), not an aux tensor: with an aux tensor flash-attn-4 (4.0.0b36, `apply_score_mod_inner`)
takes its bounds-safe path for every score - a fast-division wrap of q_idx and kv_idx, one score at a time instead
of two - and the modifier loaded slopes[head] per score; that made the ALiBi forward 46-49% slower than the plain
one, and 18-20% with the constants (the whole fwd+bwd 3.4-4.2% over plain). With constants the head's slope is a
chain of selects on the head index, a function of the head index alone (loop-invariant, so the compiler may hoist
it; not checked in the SASS), and nothing is read from memory. The price: a new set of slopes compiles a new kernel
(flash-attn-4 keys its compiled kernels by the modifier's `__cute_hash__`, which covers this file and the slopes),
so training with fixed slopes compiles once.

The bias is moela's: `-slope_h * |i' - j|` with i' = i + Lk - Lq the query's position on the k side (bottom-right
alignment). Causal attention masks every key with j > i', so there the bias is `slope_h * (j - i')` and needs no
absolute value. Positions are converted to float per row and per column (the compiler merges the conversions of
equal indices across a tile) and the difference is exact below 2^24, so the bias is rounded once, by the multiply.
The bias does not depend on q or k: its backward passes the gradient through unchanged.

This module imports the CuTe DSL (`cutlass`): `moela.ops.attention.flash` imports it only when ALiBi runs there.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Callable

import cutlass
import cutlass.cute as cute

_SOURCE = Path(__file__).read_bytes()


def _head_slope(scores, head_idx, slopes: tuple[float, ...]):
    """slopes[head] for every score of the tile (a chain of selects on the head index, unrolled at trace time)."""
    slope = cute.full_like(scores, cutlass.Float32(slopes[0]))
    for h in range(1, len(slopes)):
        slope = cute.where(head_idx == h, cutlass.Float32(slopes[h]), slope)
    return slope


@functools.lru_cache(maxsize=64)
def alibi_score_mods(slopes: tuple[float, ...], causal: bool) -> tuple[Callable, Callable]:
    """(score_mod, score_mod_bwd) adding moela's ALiBi bias with these per-head slopes (float32 values)."""

    @cute.jit
    def alibi_causal(scores, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        """scores + slope * (j - i'): the visible keys of causal attention have j <= i'."""
        q_shift = seqlen_info.seqlen_k - seqlen_info.seqlen_q
        q_pos = (q_idx + q_shift).to(cutlass.Float32)
        k_pos = kv_idx.to(cutlass.Float32)
        return scores + _head_slope(scores, head_idx, slopes) * (k_pos - q_pos)

    @cute.jit
    def alibi_full(scores, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        """scores - slope * |i' - j| (attention without a causal mask sees keys on both sides)."""
        q_shift = seqlen_info.seqlen_k - seqlen_info.seqlen_q
        distance = (q_idx + q_shift).to(cutlass.Float32) - kv_idx.to(cutlass.Float32)
        magnitude = cute.where(distance < 0.0, -distance, distance)
        return scores - _head_slope(scores, head_idx, slopes) * magnitude

    forward = alibi_causal if causal else alibi_full
    key = _SOURCE + forward.__name__.encode() + repr(slopes).encode()
    forward.__cute_hash__ = hashlib.sha256(key).hexdigest()
    return forward, alibi_backward


@cute.jit
def alibi_backward(grad, scores, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """d(score + bias) / d(score) = 1."""
    return grad


alibi_backward.__cute_hash__ = hashlib.sha256(_SOURCE + b"alibi_backward").hexdigest()
