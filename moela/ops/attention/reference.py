"""The reference of `mla_attention`: pure torch, any device, one document at a time with its full score matrix in
float32. Exact and slow; the specification the fast kernels are tested against. Autograd flows through lse too.
"""

from __future__ import annotations

import math

import torch


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
