"""What the attention tests share: an independent per-document attention (float64 as the exact answer, the
candidate's dtype as the error budget), random packed cases, and the pass rule.

Pass rule (DESIGN.md): err(candidate) <= 2 * err(naive torch attention in the candidate's dtype) + atol, errors
measured against float64. The lse gradient is exercised with a random dlse, which is what attention z-loss feeds it.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from moela.ops.attention import mla_attention
from moela.ops.triton_env import INTERPRET

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run Triton on CPU")


def naive_attention(q, k, v, cu_q, cu_k, causal, scale, alibi):
    """Per-document attention in q's dtype (matmuls in that dtype, softmax in at least float32)."""
    soft = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs, lses = [], []
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qd, kd, vd = q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1)
        s = (qd @ kd.transpose(1, 2)).to(soft) * scale  # [H, Lq, Lk]
        i = torch.arange(q1 - q0, device=q.device)[:, None] + (k1 - k0) - (q1 - q0)
        j = torch.arange(k1 - k0, device=q.device)[None, :]
        if alibi is not None:
            s = s - alibi.to(soft)[:, None, None] * (i - j).abs()
        if causal:
            s = s.masked_fill(j > i, float("-inf"))
        lse = torch.logsumexp(s, -1)  # [H, Lq]
        p = torch.exp(s - lse[..., None]).to(q.dtype)
        outs.append((p @ vd).transpose(0, 1))
        lses.append(lse.float() if soft == torch.float32 else lse)
    return torch.cat(outs, 0), torch.cat(lses, 1)


def make_case(lens_q, lens_k, heads, d_qk, d_v, dtype, device, alibi, seed):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32, device=device)
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = (torch.randn(t, heads, d, generator=g).to(device, dtype) for t, d in ((tq, d_qk), (tk, d_qk), (tk, d_v)))
    slopes = (torch.rand(heads, generator=g) * 0.3 + 0.01).to(device) if alibi else None
    dout = torch.randn(tq, heads, d_v, generator=g).to(device, dtype)
    dlse = torch.randn(heads, tq, generator=g).to(device)
    return q, k, v, cu_q, cu_k, slopes, dout, dlse


def run_with_grads(fn, q, k, v, dout, dlse):
    """fn(q, k, v) -> (out, lse), or (out,) when dlse is None. Returns [out, (lse), dq, dk, dv]."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    outs = fn(q, k, v)
    grads = [dout] if dlse is None else [dout, dlse]
    torch.autograd.backward(list(outs), [g.to(o.dtype) for g, o in zip(grads, outs)])
    return [o.detach() for o in outs] + [q.grad, k.grad, v.grad]


def check_against_float64(lens_q, lens_k, heads, d_qk, d_v, dtype, device, causal, alibi, seed, backend,
                          ulps=0.0, slope_scale=1.0, with_lse=True, attention=mla_attention, **kernels):
    """`with_lse`: the lse is returned and gets a random gradient (the z-loss path); else out alone. `attention`:
    the function under test, with mla_attention's signature; `kernels`: its kernel choices (forward_kernel, ...)."""
    q, k, v, cu_q, cu_k, slopes, dout, dlse = make_case(lens_q, lens_k, heads, d_qk, d_v, dtype, device, alibi, seed)
    if slopes is not None:
        slopes = slopes * slope_scale
    scale = 1.0 / math.sqrt(d_qk)

    def candidate(a, b, c):
        res = attention(a, b, c, cu_q, max(lens_q), cu_seqlens_k=cu_k, max_seqlen_k=max(lens_k), causal=causal,
                        alibi_slopes=slopes, return_lse=with_lse, backend=backend, **kernels)
        return res if with_lse else (res,)

    def naive(a, b, c):
        res = naive_attention(a, b, c, cu_q, cu_k, causal, scale, slopes)
        return res if with_lse else res[:1]

    if not with_lse:
        dlse = None
    got = run_with_grads(candidate, q, k, v, dout, dlse)
    exact = run_with_grads(naive, q.double(), k.double(), v.double(), dout.double(),
                           None if dlse is None else dlse.double())
    lowp = run_with_grads(naive, q, k, v, dout, dlse)
    names = ("out", "lse", "dq", "dk", "dv") if with_lse else ("out", "dq", "dk", "dv")
    for name, g, e, r in zip(names, got, exact, lowp):
        assert g.shape == e.shape, name
        assert torch.isfinite(g).all(), f"{name}: non-finite values (unwritten output?)"
        err = (g.double() - e).abs().max().item()
        err_ref = (r.double() - e).abs().max().item()
        atol = (1e-5 + ulps * torch.finfo(dtype).eps) * max(1.0, e.abs().max().item())
        assert err <= 2 * err_ref + atol, f"{name}: err {err:.3g} vs same-dtype reference {err_ref:.3g}"



# The Gluon kernels' GPU cases (d_qk, d_v, lens_q, lens_k, causal): odd lengths, single-token and empty documents,
# longer k than q (bottom-right alignment), full attention, 128/128, the `small` model's 96/64, graphed-batch padding
GLUON_CASES = [
    (192, 128, [1, 7, 129, 300, 2049], [1, 7, 129, 300, 2049], True),
    (192, 128, [1, 0, 33, 1, 700], [1, 0, 97, 1, 900], True),
    (192, 128, [1000, 3000], [3000, 4096], False),
    (128, 128, [1024, 513], [1024, 513], True),
    (96, 64, [65, 2, 1500, 190], [65, 2, 1500, 190], True),
    (192, 128, [700, 33] + [0] * 62, [700, 33] + [0] * 62, True),
    (96, 64, [700, 33] + [0] * 62, [700, 33] + [0] * 62, True),
]
