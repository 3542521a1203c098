"""The three phases of the `triton` backend of `mla_attention` (the forward, the backward's dK/dV and its dQ), each
run by moela's Triton kernel or its Gluon kernel, and the one place that chooses between them: a `Dispatch` per
phase (`FORWARD`, `DKDV`, `DQ`), which eager calls (`autograd.py`) and a compiled graph's op pair (`graph.py`) ask
alike, and which logs the kernel that runs and why, once per reason.

The choice reaches the dispatch as `mla_attention`'s keyword arguments `forward_kernel`, `dq_kernel`, `dkdv_kernel`
(the recipe's `model.kernels.attention_forward`, `attention_dq`, `attention_dkdv`), each one of
`moela.ops.backends.ATTENTION_KERNELS`:
- `auto` (the default): the Gluon kernel wherever its rule (`_gluon_problem`) accepts the call, except the dK/dV
  kernel at head dims whose accumulators leave it too few registers (`gluon_dkdv.auto_problem`: Dqk + Dv > 160,
  e.g. MLA's 192/128, where the Triton kernel measured faster); the Triton kernel for every other call;
- `triton`: the Triton kernel (any CUDA GPU, any dtype, head dims up to 256, ALiBi);
- `gluon`: the Gluon kernel (Hopper, bf16, the head dims of `gluon_common.supports`, no ALiBi, its shared memory
  fitting); a call it cannot run is an error that says why.
Each Gluon kernel is measured faster than the Triton one where `auto` takes it; both read and write the same
tensors (the forward's out and natural-log lse, the preprocess's delta), so the phases mix freely.

Shapes: Tq / Tk tokens, H heads, Dqk query/key head dim, Dv value head dim, N documents.
"""

from __future__ import annotations

from typing import Callable

import torch

from moela.ops.attention.kernels import gluon_dkdv, gluon_dq
from moela.ops.attention.kernels.gluon_common import supports
from moela.ops.attention.kernels.gluon_forward import gluon_forward
from moela.ops.attention.kernels.triton_backward import triton_delta, triton_dkdv, triton_dq
from moela.ops.attention.kernels.triton_forward import triton_forward
from moela.ops.backends import ATTENTION_KERNELS
from moela.ops.dispatch import Dispatch


def _any_call(*_, **__) -> bool:
    return True


def _gluon_problem(fits: Callable[[int, int], str | None] | None = None) -> Callable[..., str | None]:
    """A Gluon kernel's rule: None when it can run the call (q, k, v, alibi_slopes), else why not."""
    def problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: torch.Tensor | None) -> str | None:
        return supports(q, k, v, alibi_slopes) or (fits(q.shape[-1], v.shape[-1]) if fits is not None else None)
    return problem


def _phase(name: str, gluon_impl: Callable[..., None], triton_impl: Callable[..., None],
           problem: Callable[..., str | None], auto_problem: Callable[[int, int], str | None] | None = None
           ) -> Dispatch:
    """A phase's dispatch: `auto` ranks the Gluon kernel first where `problem` (and `auto_problem`, for auto only)
    accept the call, else the Triton kernel, and says why in the log."""
    def rank(q, k, v, alibi_slopes) -> tuple[list[str], str]:
        why = problem(q, k, v, alibi_slopes) or (auto_problem(q.shape[-1], v.shape[-1]) if auto_problem else None)
        return (["gluon", "triton"], "") if why is None else (["triton"], f"not the Gluon kernel: {why}")

    dispatch = Dispatch(f"mla_attention {name}", ATTENTION_KERNELS, rank=rank,
                        describe=lambda q, k, v, alibi_slopes: problem(q, k, v, alibi_slopes) or "")
    dispatch.register("gluon", gluon_impl, auto=_any_call, accepts=lambda *args: problem(*args) is None)
    dispatch.register("triton", triton_impl, auto=_any_call)
    return dispatch


# impl(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, *, causal, softmax_scale, alibi_slopes)
FORWARD = _phase("forward", gluon_forward, triton_forward, _gluon_problem())
# impl(q, k, v, dout, lse, delta, cu_seqlens_q, cu_seqlens_k, dk, dv, *, causal, softmax_scale, alibi_slopes)
DKDV = _phase("dK/dV", gluon_dkdv.gluon_dkdv, triton_dkdv, _gluon_problem(gluon_dkdv.fits), gluon_dkdv.auto_problem)
# impl(q, k, v, dout, lse, delta, cu_seqlens_q, cu_seqlens_k, dq, *, causal, softmax_scale, alibi_slopes)
DQ = _phase("dQ", gluon_dq.gluon_dq, triton_dq, _gluon_problem(gluon_dq.fits))


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, *, causal: bool, softmax_scale: float,
                      alibi_slopes: torch.Tensor | None, kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The forward phase on the kernel `FORWARD` chooses -> (out [Tq, H, Dv] in q's dtype, lse [H, Tq] float32)."""
    tq, h, _ = q.shape
    out = torch.empty(tq, h, v.shape[-1], device=q.device, dtype=q.dtype)
    lse = torch.empty(h, tq, device=q.device, dtype=torch.float32)
    if tq == 0 or cu_seqlens_q.numel() < 2:
        return out, lse
    chosen = FORWARD.choose(kernel, q, k, v, alibi_slopes)
    FORWARD.impl(chosen)(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, causal=causal, softmax_scale=softmax_scale,
                         alibi_slopes=alibi_slopes)
    return out, lse


def attention_backward(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, *, causal: bool, softmax_scale: float,
                       alibi_slopes: torch.Tensor | None, dq_kernel: str = "auto", dkdv_kernel: str = "auto"
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The preprocess (delta = rowsum(dO * O) - dlse), then the dK/dV and dQ phases on the kernels `DKDV` and `DQ`
    choose. dout [Tq, H, Dv], dlse [H, Tq] or None -> (dq, dk, dv)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if k.shape[0]:
        dk.zero_()  # keys outside every document (none in a well-formed batch) get zero gradient
        dv.zero_()
    if q.shape[0] == 0 or cu_seqlens_q.numel() < 2:
        return dq.zero_(), dk, dv
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    delta = triton_delta(out, dout, dlse.contiguous() if dlse is not None else None)  # [H, Tq]
    options = dict(causal=causal, softmax_scale=softmax_scale, alibi_slopes=alibi_slopes)
    chosen = DKDV.choose(dkdv_kernel, q, k, v, alibi_slopes)
    DKDV.impl(chosen)(q, k, v, dout, lse, delta, cu_seqlens_q, cu_seqlens_k, dk, dv, **options)
    chosen = DQ.choose(dq_kernel, q, k, v, alibi_slopes)
    DQ.impl(chosen)(q, k, v, dout, lse, delta, cu_seqlens_q, cu_seqlens_k, dq, **options)
    return dq, dk, dv
