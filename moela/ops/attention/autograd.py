"""The `triton` backend of `mla_attention` (moela's kernels): its preconditions, and the autograd Function around
its forward and backward phases (`phases.py`, which chooses the Triton or Gluon kernel of each).

The eager entry is opaque to torch.compile (`torch.compiler.disable`), rather than depending on Dynamo tracing user
Triton kernels; a compiled block holds the same phases in its graph through the op pair of `graph.py`
(`triton_prepare` checks their preconditions for both).
"""

from __future__ import annotations

import math

import torch

from moela.ops.attention.phases import attention_backward, attention_forward
from moela.ops.triton_env import INTERPRET


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
           alibi_slopes: torch.Tensor | None) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"triton mla_attention wants q, k, v of one dtype among float16/bfloat16/float32; got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] > 256 or v.shape[-1] > 256:
        raise ValueError(f"triton mla_attention supports head dims up to 256; got Dqk={q.shape[-1]}, "
                         f"Dv={v.shape[-1]} (use backend='reference')")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"triton mla_attention needs {name} contiguous in its last dim; call .contiguous()")
        if t.device != q.device:
            raise ValueError(f"triton mla_attention wants q, k, v on one device; got {name} on {t.device}, q on "
                             f"{q.device}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dtype != torch.int32 or t.device != q.device or not t.is_contiguous():
            raise TypeError(f"{name} must be a contiguous int32 tensor on {q.device}; got {t.dtype} on {t.device}"
                            f"{'' if t.is_contiguous() else ', strided'}")
    if alibi_slopes is not None and (alibi_slopes.dtype != torch.float32 or alibi_slopes.device != q.device
                                     or not alibi_slopes.is_contiguous()):
        raise TypeError(f"alibi_slopes must be a contiguous float32 tensor on {q.device}; got {alibi_slopes.dtype} "
                        f"on {alibi_slopes.device}{'' if alibi_slopes.is_contiguous() else ', strided'}")


class _FlashMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, alibi_slopes, forward_kernel,
                dq_kernel, dkdv_kernel):
        out, lse = attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, softmax_scale=softmax_scale,
                                     alibi_slopes=alibi_slopes, kernel=forward_kernel)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
        ctx.args = (causal, softmax_scale, dq_kernel, dkdv_kernel)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
        causal, softmax_scale, dq_kernel, dkdv_kernel = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = attention_backward(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal=causal,
                                        softmax_scale=softmax_scale, alibi_slopes=alibi_slopes, dq_kernel=dq_kernel,
                                        dkdv_kernel=dkdv_kernel)
        return dq, dk, dv, None, None, None, None, None, None, None, None


@torch.compiler.disable
def flash_mla_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        max_seqlen_q: int, cu_seqlens_k: torch.Tensor, max_seqlen_k: int, *, causal: bool = True,
                        softmax_scale: float | None = None, alibi_slopes: torch.Tensor | None = None,
                        return_lse: bool = False, forward_kernel: str = "auto", dq_kernel: str = "auto",
                        dkdv_kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The `triton` backend of `mla_attention` (same arguments, and the kernel of each phase: `phases.py`). Returns
    (out, lse); both differentiable. Opaque to torch.compile (a graph break): the kernels run eagerly, so a compiled
    model runs these kernels."""
    scale = triton_prepare(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k, softmax_scale,
                           alibi_slopes)
    return _FlashMLA.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, alibi_slopes, forward_kernel, dq_kernel,
                           dkdv_kernel)


def triton_forward_phase(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         max_seqlen_q: int, cu_seqlens_k: torch.Tensor, max_seqlen_k: int, *, causal: bool,
                         softmax_scale: float, alibi_slopes: torch.Tensor | None, forward_kernel: str = "auto",
                         dq_kernel: str = "auto", dkdv_kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The forward as the compiled graph's op runs it (`graph.py`) -> (out, lse)."""
    triton_prepare(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k, softmax_scale, alibi_slopes)
    return attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, softmax_scale=softmax_scale,
                             alibi_slopes=alibi_slopes, kernel=forward_kernel)


def triton_backward_phase(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          max_seqlen_q: int, cu_seqlens_k: torch.Tensor, max_seqlen_k: int, *, causal: bool,
                          softmax_scale: float, alibi_slopes: torch.Tensor | None, forward_kernel: str = "auto",
                          dq_kernel: str = "auto", dkdv_kernel: str = "auto"
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward as the compiled graph's op runs it -> (dq, dk, dv)."""
    return attention_backward(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal=causal,
                              softmax_scale=softmax_scale, alibi_slopes=alibi_slopes, dq_kernel=dq_kernel,
                              dkdv_kernel=dkdv_kernel)


def triton_prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                   cu_seqlens_k: torch.Tensor, max_seqlen_k: int, softmax_scale: float | None,
                   alibi_slopes: torch.Tensor | None) -> float:
    """The kernels' preconditions, checked with a clear error -> the softmax scale. Shared by the autograd Function
    above and the compiled-graph op (`graph.py`)."""
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    for name, t, length in (("q", q, int(max_seqlen_q)), ("k", k, int(max_seqlen_k)), ("v", v, int(max_seqlen_k))):
        if length * max(t.stride(0), t.shape[1] * t.shape[2]) >= 2 ** 31:  # (the outputs are contiguous)
            raise ValueError(f"triton mla_attention addresses a document's rows with int32 offsets: {length} tokens "
                             f"x {name}'s row stride {t.stride(0)} exceed 2^31; split long documents or use context "
                             f"parallelism")
    return float(softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1]))


def triton_auto(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_, **__) -> bool:
    """`auto` takes the kernels for CUDA fp16/bf16 tensors with head dims up to 256."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and v.shape[-1] <= 256


def triton_accepts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_, **__) -> bool:
    """Asked for by name the kernels also take fp32 (tf32 dots), and CPU tensors under TRITON_INTERPRET=1 (tests)."""
    return (q.is_cuda or INTERPRET) and q.shape[-1] <= 256 and v.shape[-1] <= 256
