"""Variable-length (packed) attention for MLA: Dqk may differ from Dv; log-sum-exp is returned and differentiable.

Public function: `mla_attention`. Backends:
- `reference`: pure torch, any device; loops over documents and materializes each document's score matrix in
  float32. Exact, slow, the specification the fast kernels are tested against. Autograd flows through `lse`.
- `triton`: our flash kernels (`moela.ops.attention_triton`): Dqk != Dv without padding, varlen, ALiBi, and an
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

import math
from typing import Callable

import torch

from moela.ops.dispatch import check_backend, log_choice

BACKENDS = ("auto", "reference", "triton", "sdpa")

# name -> (supported(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, return_lse, causal,
#          softmax_scale, alibi_slopes, explicit) -> bool,
#          impl(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k, *, return_lse, causal,
#               softmax_scale, alibi_slopes) -> (out, lse or None))
_FAST_BACKENDS: dict[str, tuple[Callable[..., bool], Callable[..., object]]] = {}


def register_backend(name: str, supported: Callable[..., bool], impl: Callable[..., object]) -> None:
    _FAST_BACKENDS[name] = (supported, impl)


def attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=True, softmax_scale=None,
                        alibi_slopes=None):
    """Returns (out [Tq, H, Dv] in q's dtype, lse [H, Tq] float32); differentiable in q, k, v (through lse too)."""
    tq, h, dqk = q.shape
    dv = v.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dqk)
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(cq[:-1], cq[1:]), zip(ck[:-1], ck[1:])):
        lq, lk = q1 - q0, k1 - k0
        qd = q[q0:q1].float().transpose(0, 1)  # [H, Lq, Dqk]
        kd = k[k0:k1].float().transpose(0, 1)  # [H, Lk, Dqk]
        vd = v[k0:k1].float().transpose(0, 1)  # [H, Lk, Dv]
        s = torch.matmul(qd, kd.transpose(1, 2)) * scale  # [H, Lq, Lk]
        qpos = torch.arange(lq, device=q.device)[:, None] + (lk - lq)  # query position on the k side
        kpos = torch.arange(lk, device=q.device)[None, :]
        if alibi_slopes is not None:
            s = s - alibi_slopes.float()[:, None, None] * (qpos - kpos).abs()
        if causal:
            s = s.masked_fill(kpos > qpos, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [H, Lq]; -inf for a query that sees no key
        p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
        outs.append(torch.matmul(p, vd).transpose(0, 1))  # [Lq, H, Dv]
        lses.append(lse)
    out = torch.cat(outs, 0) if outs else q.new_zeros(0, h, dv, dtype=torch.float32)
    lse = torch.cat(lses, 1) if lses else q.new_zeros(h, 0, dtype=torch.float32)
    return out.to(q.dtype), lse


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


def _sdpa_supported(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, return_lse, causal,
                    softmax_scale, alibi_slopes, explicit):
    """Equal-length documents (checked without a device sync: T == N * max_seqlen on both sides)."""
    n_docs = cu_seqlens_q.numel() - 1
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not return_lse and alibi_slopes is None
            and n_docs > 0 and max_seqlen_q == max_seqlen_k and q.shape[0] == n_docs * max_seqlen_q
            and k.shape[0] == n_docs * max_seqlen_k)


def _sdpa_attention(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k, *, return_lse, causal,
                    softmax_scale, alibi_slopes):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    tq, h, _ = q.shape
    n_docs = cu_seqlens_q.numel() - 1
    qb = q.reshape(n_docs, max_seqlen_q, h, -1).transpose(1, 2)  # [N, H, L, Dqk]
    kb = k.reshape(n_docs, max_seqlen_k, h, -1).transpose(1, 2)  # [N, H, L, Dqk]
    vb = v.reshape(n_docs, max_seqlen_k, h, -1).transpose(1, 2)  # [N, H, L, Dv]
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(order, set_priority=True):
        out = scaled_dot_product_attention(qb, kb, vb, is_causal=causal, scale=softmax_scale)  # [N, H, L, Dv]
    return out.transpose(1, 2).reshape(tq, h, -1), None


register_backend("sdpa", _sdpa_supported, _sdpa_attention)
try:
    from moela.ops.attention_triton import flash_mla_attention, triton_supported
except ImportError:  # no triton on this platform: reference and sdpa remain
    pass
else:
    register_backend("triton", triton_supported, flash_mla_attention)
