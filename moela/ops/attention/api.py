"""Variable-length (packed) attention for MLA: Dqk may differ from Dv; log-sum-exp is returned and differentiable.

Public function: `mla_attention`. Backends:
- `reference`: pure torch, any device; loops over documents and materializes each document's score matrix in
  float32. Exact, slow, the specification the fast kernels are tested against. Autograd flows through `lse`.
- `triton`: moela's kernels (`moela.ops.attention.autograd`): Dqk != Dv without padding, varlen, ALiBi, and an
  lse whose gradient is fused into the backward. CUDA tensors; on CPU only under TRITON_INTERPRET=1 and only when
  asked for by name (tests). Each of its phases (forward, dQ, dK/dV) runs a Triton or a Gluon (Hopper) kernel,
  chosen by `forward_kernel`, `dq_kernel`, `dkdv_kernel` (`moela.ops.attention.phases`; "auto" by default).
- `flash`: FlashAttention-4 (`moela.ops.attention.flash`, the optional extra `[flash]`) on Hopper / Blackwell:
  varlen, Dqk != Dv, a differentiable lse, ALiBi through its score hooks.
- `sdpa`: PyTorch SDPA (cuDNN first) for the plain case only: every document of the same length on both sides,
  no ALiBi, no lse requested. Documents are reshaped to a batch, so no mask is materialized.
`auto` ranks the backends by the benchmark's measurements for the call's kind (`moela.ops.attention.auto`: head
dims, equal-length or packed documents, z-loss, ALiBi), takes the fastest one that can run the call and logs the
choice with the numbers and whatever faster backend it had to skip and why; on CPU it resolves to `reference`.

Masking: with `causal=True`, query i of a document (0-based within the q side) may see key j when
`j <= i + (Lk - Lq)`: causal alignment is bottom-right, as FlashAttention >= 2.1, so a q chunk that is the tail of
a longer k side (context parallelism) attends correctly. ALiBi adds `-slope_h * |(i + Lk - Lq) - j|` to the
scores (for causal attention that is `-slope_h * (i' - j)` with i' the query's position on the k side).

Shapes: Tq / Tk tokens, H heads, Dqk query/key head dim, Dv value head dim, N documents.
"""

from __future__ import annotations

import torch

from moela.ops.attention import auto
from moela.ops.attention.flash import flash_attention, flash_auto, flash_backward, flash_forward, flash_problem
from moela.ops.attention.reference import attention_reference
from moela.ops.attention.sdpa import sdpa_attention, sdpa_supported
from moela.ops.backends import ATTENTION_BACKENDS, ATTENTION_KERNELS
from moela.ops.dispatch import Dispatch


def _describe(q, k, v, cu_seqlens_q, cu_seqlens_k, *, return_lse, alibi_slopes, **_) -> str:
    return (f"{q.device.type} tensors, {q.dtype}, Dqk={q.shape[-1]}, Dv={v.shape[-1]}, return_lse={return_lse}, "
            f"alibi={alibi_slopes is not None}")


def _rank(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, return_lse, causal, softmax_scale,
          alibi_slopes) -> tuple[list[str], str]:
    """auto's candidates for this call, fastest first by `auto.MEASURED`, and why (none on CPU: the reference)."""
    if not q.is_cuda:
        return [], ""
    call = auto.classify(q, k, v, cu_seqlens_q, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         return_lse=return_lse, alibi_slopes=alibi_slopes)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    kwargs = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, return_lse=return_lse, causal=causal,
                  softmax_scale=softmax_scale, alibi_slopes=alibi_slopes)
    problems = {
        "flash": lambda: flash_problem(q, k, v, alibi_slopes),
        "sdpa": lambda: None if sdpa_supported(*args, **kwargs) else (
            "SDPA takes equal-length documents on both sides, without lse or ALiBi"),
    }
    if "triton" in DISPATCH.fast:
        problems["triton"] = lambda: None if DISPATCH.fast["triton"].auto(*args, **kwargs) else (
            "the Triton kernels take CUDA fp16 / bf16 tensors with head dims up to 256")
    else:
        problems["triton"] = lambda: "Triton is not importable here"
    return auto.rank(call, problems)


# fast backends: impl(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k, *, return_lse, causal,
# softmax_scale, alibi_slopes, **kernel_options) -> (out, lse or None); predicates(q, k, v, cu_seqlens_q,
# cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, return_lse, causal, softmax_scale, alibi_slopes) -> bool; phases
# (the compiled graph's op pair, graph.py): forward(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k,
# *, causal, softmax_scale, alibi_slopes, **kernel_options) -> (out, lse) and backward(dout, dlse, q, k, v, out, lse,
# cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k, *, the same) -> (dq, dk, dv)
DISPATCH = Dispatch("mla_attention", ATTENTION_BACKENDS, needs="triton", describe=_describe, rank=_rank)


def kernel_options(backend: str, forward_kernel: str, dq_kernel: str, dkdv_kernel: str) -> dict:
    """The kernel choices as keyword arguments of `backend`'s functions: the `triton` backend takes them (its phases'
    kernels); the other backends run one kernel per phase and take none. Raises ValueError for an unknown name, or
    for a choice other than auto with a backend named that has no such choice."""
    kernels = dict(forward_kernel=forward_kernel, dq_kernel=dq_kernel, dkdv_kernel=dkdv_kernel)
    for name, kernel in kernels.items():
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"mla_attention: unknown {name} {kernel!r}; choose one of {', '.join(ATTENTION_KERNELS)}")
    if backend == "triton":
        return kernels
    chosen = [f"{name}={kernel!r}" for name, kernel in kernels.items() if kernel != "auto"]
    if chosen and backend != "auto":
        raise ValueError(f"mla_attention: {', '.join(chosen)} chooses among moela's kernels, which backend "
                         f"{backend!r} does not run; use backend='triton' or 'auto'")
    return {}


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_k: torch.Tensor, alibi_slopes: torch.Tensor | None) -> None:
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


def mla_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  max_seqlen_q: int, *, cu_seqlens_k: torch.Tensor | None = None, max_seqlen_k: int | None = None,
                  causal: bool = True, softmax_scale: float | None = None, alibi_slopes: torch.Tensor | None = None,
                  return_lse: bool = False, backend: str = "auto", forward_kernel: str = "auto",
                  dq_kernel: str = "auto", dkdv_kernel: str = "auto"
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed documents. q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] -> out [Tq, H, Dv]
    (and lse [H, Tq] float32, natural log, differentiable, when `return_lse`). `forward_kernel`, `dq_kernel`,
    `dkdv_kernel`: the kernel of each phase where the `triton` backend runs (`moela.ops.attention.phases`)."""
    DISPATCH.check(backend)
    kernels = dict(forward_kernel=forward_kernel, dq_kernel=dq_kernel, dkdv_kernel=dkdv_kernel)
    kernel_options(backend, **kernels)
    if cu_seqlens_k is None:
        cu_seqlens_k, max_seqlen_k = cu_seqlens_q, max_seqlen_q
    elif max_seqlen_k is None:
        max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    options = dict(causal=causal, softmax_scale=softmax_scale, alibi_slopes=alibi_slopes)
    chosen = DISPATCH.choose(backend, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                             max_seqlen_k=max_seqlen_k, return_lse=return_lse, **options)
    if chosen == "reference":
        out, lse = attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    else:
        out, lse = DISPATCH.impl(chosen)(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k,
                                         return_lse=return_lse, **options, **kernel_options(chosen, **kernels))
    return (out, lse) if return_lse else out


DISPATCH.register("sdpa", sdpa_attention, auto=sdpa_supported, accepts=sdpa_supported)
DISPATCH.register("flash", flash_attention, auto=flash_auto, phases=(flash_forward, flash_backward))
try:
    from moela.ops.attention.autograd import (
        flash_mla_attention,
        triton_accepts,
        triton_auto,
        triton_backward_phase,
        triton_forward_phase,
    )
except ImportError:  # no triton on this platform: reference and sdpa remain
    pass
else:
    DISPATCH.register("triton", flash_mla_attention, auto=triton_auto, accepts=triton_accepts,
                      phases=(triton_forward_phase, triton_backward_phase))
