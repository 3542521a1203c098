"""Variable-length (packed) attention for MLA: Dqk may differ from Dv; log-sum-exp is returned and differentiable.

Public function: `mla_attention`. Backends:
- `reference`: pure torch, any device; loops over documents and materializes each document's score matrix in
  float32. Exact, slow, the specification the fast kernels are tested against. Autograd flows through `lse`.
- `triton`: our flash kernels (`moela.ops.attention.autograd`): Dqk != Dv without padding, varlen, ALiBi, and an
  lse whose gradient is fused into the backward. CUDA tensors; on CPU only under TRITON_INTERPRET=1 and only when
  asked for by name (tests).
- `sdpa`: PyTorch SDPA (cuDNN first) for the plain case only: every document of the same length on both sides,
  no ALiBi, no lse requested. Documents are reshaped to a batch, so no mask is materialized.
`auto` tries the fast backends in registration order (`_FAST_BACKENDS`: sdpa, then triton) and falls back to
`reference`; on CPU it always resolves to `reference`. sdpa comes first because cuDNN was measured faster where it
applies (H200, 192/128 causal, S=8192: fwd+bwd 1.31x ours; bench/results/attention_run3.md); everything else (packed
documents, lse / z-loss, ALiBi, a longer k side) goes to triton.

Masking: with `causal=True`, query i of a document (0-based within the q side) may see key j when
`j <= i + (Lk - Lq)`: causal alignment is bottom-right, as FlashAttention >= 2.1, so a q chunk that is the tail of
a longer k side (context parallelism) attends correctly. ALiBi adds `-slope_h * |(i + Lk - Lq) - j|` to the
scores (for causal attention that is `-slope_h * (i' - j)` with i' the query's position on the k side).

Shapes: Tq / Tk tokens, H heads, Dqk query/key head dim, Dv value head dim, N documents.
"""

from __future__ import annotations

from typing import Callable

from moela.ops.attention.reference import attention_reference
from moela.ops.attention.sdpa import sdpa_attention, sdpa_supported
from moela.ops.dispatch import check_backend, log_choice

BACKENDS = ("auto", "reference", "triton", "sdpa")

# name -> (supported(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, return_lse, causal,
#          softmax_scale, alibi_slopes, explicit) -> bool,
#          impl(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k, *, return_lse, causal,
#               softmax_scale, alibi_slopes) -> (out, lse or None))
_FAST_BACKENDS: dict[str, tuple[Callable[..., bool], Callable[..., object]]] = {}


def register_backend(name: str, supported: Callable[..., bool], impl: Callable[..., object]) -> None:
    _FAST_BACKENDS[name] = (supported, impl)


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"mla_attention wants q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1:] != q.shape[1:] or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"mla_attention: shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} (heads and Dqk must match between q and k; Tk between k and v)")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError("mla_attention: cu_seqlens_q and cu_seqlens_k must describe the same number of documents")
    if alibi_slopes is not None and alibi_slopes.shape != (q.shape[1],):
        raise ValueError(f"alibi_slopes must be [H]={q.shape[1]}, got {tuple(alibi_slopes.shape)}")


def mla_attention(q, k, v, cu_seqlens_q, max_seqlen_q, *, cu_seqlens_k=None, max_seqlen_k=None, causal=True,
                  softmax_scale=None, alibi_slopes=None, return_lse=False, backend="auto"):
    """Attention over packed documents. q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] -> out [Tq, H, Dv]
    (and lse [H, Tq] float32, natural log, differentiable, when `return_lse`)."""
    check_backend("mla_attention", backend, BACKENDS)
    if cu_seqlens_k is None:
        cu_seqlens_k, max_seqlen_k = cu_seqlens_q, max_seqlen_q
    elif max_seqlen_k is None:
        max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    kw = dict(causal=causal, softmax_scale=softmax_scale, alibi_slopes=alibi_slopes)
    query = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, return_lse=return_lse, **kw)
    chosen = backend
    if backend == "auto":
        chosen = "reference"
        for name, (supported, _) in _FAST_BACKENDS.items():
            if supported(q, k, v, cu_seqlens_q, cu_seqlens_k, explicit=False, **query):
                chosen = name
                break
        log_choice("mla_attention", chosen)
    elif backend != "reference":
        if backend not in _FAST_BACKENDS:
            raise RuntimeError(f"mla_attention: backend {backend!r} is not available here (needs triton); use "
                               f"backend='auto' or 'reference'")
        if not _FAST_BACKENDS[backend][0](q, k, v, cu_seqlens_q, cu_seqlens_k, explicit=True, **query):
            raise ValueError(f"mla_attention: backend {backend!r} does not support this call ({q.device.type} "
                             f"tensors, Dqk={q.shape[-1]}, Dv={v.shape[-1]}, return_lse={return_lse}, "
                             f"alibi={alibi_slopes is not None}); use backend='auto'")
    if chosen == "reference":
        out, lse = attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)
    else:
        out, lse = _FAST_BACKENDS[chosen][1](q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k,
                                             return_lse=return_lse, **kw)
    return (out, lse) if return_lse else out


register_backend("sdpa", sdpa_supported, sdpa_attention)
try:
    from moela.ops.attention.autograd import flash_mla_attention, triton_supported
except ImportError:  # no triton on this platform: reference and sdpa remain
    pass
else:
    register_backend("triton", triton_supported, flash_mla_attention)
