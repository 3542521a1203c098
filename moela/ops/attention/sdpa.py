"""The `sdpa` backend of `mla_attention`: PyTorch's scaled_dot_product_attention (cuDNN first) for the plain case
only: every document of the same length on both sides, no ALiBi, no lse requested. Documents are reshaped to a
batch, so no mask is materialized.
"""

from __future__ import annotations

import torch


def sdpa_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, *, max_seqlen_q: int, max_seqlen_k: int, return_lse: bool, causal: bool,
                   softmax_scale: float | None, alibi_slopes: torch.Tensor | None) -> bool:
    """Equal-length documents (checked without a device sync: T == N * max_seqlen on both sides)."""
    n_docs = cu_seqlens_q.numel() - 1
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not return_lse and alibi_slopes is None
            and n_docs > 0 and max_seqlen_q == max_seqlen_k and q.shape[0] == n_docs * max_seqlen_q
            and k.shape[0] == n_docs * max_seqlen_k)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                   cu_seqlens_k: torch.Tensor, max_seqlen_k: int, *, return_lse: bool, causal: bool,
                   softmax_scale: float | None, alibi_slopes: torch.Tensor | None) -> tuple[torch.Tensor, None]:
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
