"""`mla_attention` as an op a compiled graph holds: `moela::mla_attention_fwd` and `moela::mla_attention_bwd`,
torch.library custom ops with fake implementations and an autograd formula, so a compiled block traces its attention
instead of breaking its graph around it (`mla_attention_in_graph`, used by `MLA` while torch.compile traces).

Why: a graph break splits a compiled block into pieces that Dynamo, AOTAutograd and Inductor compile one by one,
forward and backward, for every variant of the block. With the attention and the query's in-place RoPE as breaks a
block was five pieces; as ops of its graph it is one (`small`: 4 graphs to compile instead of 10), and a block's
input no longer crosses pieces, so autograd adds the two gradients of a block's input inside the block's compiled
backward rather than in a kernel of its own between pieces.

Decisions:
- The backend is chosen when the op runs, on real tensors, by the same `DISPATCH.choose` an eager call makes (and
  logged the same way). Choosing while tracing would make Dynamo guard on the document count (the choice reads the
  tokens per document), recompiling as it changes from batch to batch.
- Only backends registered with separate forward and backward functions (`phases` in the dispatch) run inside the
  op: `flash` (flash-attn-4's forward and backward functions, called as its own autograd calls them) and `triton`
  (moela's phases, whose kernels `phases.py` chooses as for an eager call). The backward op makes the same choice
  from the same arguments, so both passes run one backend. Where auto would take `sdpa`
  (documents of one length on a GPU without flash-attn-4), the op takes the next backend of the ranking and the log
  says so. Whether a call is traced at all is decided from what cannot change between calls of a layer (device,
  dtype, head dims, ALiBi or not, the backend asked for; `traces_in_graph`): a call that names `reference` or
  `sdpa`, or that no kernel backend can run (the CPU under `auto`), stays a graph break (`moela.model.layers.call_op`).
- The lse is always computed (the backward reads it); `mla_attention_in_graph` drops it when it was not asked for.
  An unused lse gets no gradient: the backward receives None and passes none to the kernels.
- Outputs are contiguous (the fake implementations say so and the real ones make it so): Inductor plans the
  buffers after the op from the fake strides.
- No tokens on either side: out 0 and lse -inf, gradients 0, as the reference, without a launch.

Shapes: Tq / Tk tokens, H heads, Dqk query/key head dim, Dv value head dim, N documents.
"""

from __future__ import annotations

import math

import torch

from moela.ops.attention.api import DISPATCH, check_inputs, kernel_options
from moela.ops.attention.flash import flash_problem


def _choose(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, alibi_slopes, return_lse, backend) -> str:
    return DISPATCH.choose(backend, q, k, v, cu_q, cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                           return_lse=return_lse, causal=causal, softmax_scale=softmax_scale,
                           alibi_slopes=alibi_slopes, reason="inside a compiled graph", among=DISPATCH.with_phases())


@torch.library.custom_op("moela::mla_attention_fwd", mutates_args=())
def mla_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                      softmax_scale: float, alibi_slopes: torch.Tensor | None, return_lse: bool, backend: str,
                      forward_kernel: str, dq_kernel: str, dkdv_kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [Tq, H, Dv] in q's dtype, lse [H, Tq] float32), both contiguous. `return_lse` only informs the choice
    of backend (z-loss rows of the measured table); the lse is always returned."""
    tq, h, _ = q.shape
    if tq == 0 or k.shape[0] == 0:
        return q.new_zeros(tq, h, v.shape[-1]), q.new_full((h, tq), -math.inf, dtype=torch.float32)
    chosen = _choose(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                     alibi_slopes, return_lse, backend)
    forward, _ = DISPATCH.fast[chosen].phases
    out, lse = forward(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k, causal=causal,
                       softmax_scale=softmax_scale, alibi_slopes=alibi_slopes,
                       **kernel_options(chosen, forward_kernel, dq_kernel, dkdv_kernel))
    return out.contiguous(), lse.contiguous()


@mla_attention_fwd.register_fake
def _mla_attention_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                            alibi_slopes, return_lse, backend, forward_kernel, dq_kernel, dkdv_kernel):
    tq, h, _ = q.shape
    return q.new_empty(tq, h, v.shape[-1]), q.new_empty(h, tq, dtype=torch.float32)


@torch.library.custom_op("moela::mla_attention_bwd", mutates_args=())
def mla_attention_bwd(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                      softmax_scale: float, alibi_slopes: torch.Tensor | None, return_lse: bool, backend: str,
                      forward_kernel: str, dq_kernel: str, dkdv_kernel: str
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), contiguous, from the backend the forward ran (the same choice from the same arguments)."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    chosen = _choose(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                     alibi_slopes, return_lse, backend)
    _, backward = DISPATCH.fast[chosen].phases
    dq, dk, dv = backward(dout.contiguous(), dlse, q, k, v, out, lse, cu_seqlens_q, max_seqlen_q, cu_seqlens_k,
                          max_seqlen_k, causal=causal, softmax_scale=softmax_scale, alibi_slopes=alibi_slopes,
                          **kernel_options(chosen, forward_kernel, dq_kernel, dkdv_kernel))
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@mla_attention_bwd.register_fake
def _mla_attention_bwd_fake(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            causal, softmax_scale, alibi_slopes, return_lse, backend, forward_kernel, dq_kernel,
                            dkdv_kernel):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, alibi, *choices = inputs  # choices: return_lse ... dkdv_kernel
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, alibi)
    ctx.args = (max_q, max_k, causal, scale, *choices)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, alibi = ctx.saved_tensors
    max_q, max_k, causal, scale, *choices = ctx.args
    if dout is None:  # only the lse was used
        dout = torch.zeros_like(out)
    dq, dk, dv = mla_attention_bwd(dout, dlse, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, alibi,
                                   *choices)
    return (dq, dk, dv, None, None, None, None, None, None, None) + (None,) * len(choices)


mla_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


_TRACES: dict[tuple, bool] = {}  # traces_in_graph's answers: the registered backends are fixed at import


@torch.compiler.assume_constant_result
def traces_in_graph(device_type: str, device_index: int | None, dtype: torch.dtype, d_qk: int, d_v: int,
                    alibi: bool, backend: str) -> bool:
    """Whether a compiled graph traces this layer's attention as the op above (else it is a graph break), from the
    call's constant facts: a backend with separate kernels was asked for, or `auto` has one that can run it. Called
    while Dynamo traces, which takes the answer as a constant (these facts are fixed for a layer); the answers are
    kept."""
    key = (device_type, device_index, dtype, d_qk, d_v, alibi, backend)
    if key not in _TRACES:
        _TRACES[key] = _traces_in_graph(*key)
    return _TRACES[key]


def _traces_in_graph(device_type: str, device_index: int | None, dtype: torch.dtype, d_qk: int, d_v: int,
                     alibi: bool, backend: str) -> bool:
    if backend in ("reference", "sdpa"):
        return False
    device = torch.device(device_type, device_index)
    q = torch.empty(0, 1, d_qk, dtype=dtype, device=device)
    v = torch.empty(0, 1, d_v, dtype=dtype, device=device)
    slopes = torch.empty(1, dtype=torch.float32, device=device) if alibi else None
    names = DISPATCH.with_phases() if backend == "auto" else (backend,)
    for name in names:
        fast = DISPATCH.fast.get(name)
        if fast is None:
            continue
        predicate = fast.auto if backend == "auto" else (fast.accepts or (lambda *_, **__: True))
        if name == "flash" and flash_problem(q, q, v, slopes) is not None:
            continue
        if predicate(q, q, v, None, None, alibi_slopes=slopes):
            return True
    return False


def mla_attention_in_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           max_seqlen_q: int, *, cu_seqlens_k: torch.Tensor | None = None,
                           max_seqlen_k: int | None = None, causal: bool = True, softmax_scale: float | None = None,
                           alibi_slopes: torch.Tensor | None = None, return_lse: bool = False,
                           backend: str = "auto", forward_kernel: str = "auto", dq_kernel: str = "auto",
                           dkdv_kernel: str = "auto") -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`mla_attention` (same arguments and results) through the op pair; for calls `traces_in_graph` accepts, with
    `max_seqlen_k` given whenever `cu_seqlens_k` is (it is not read from the device here)."""
    DISPATCH.check(backend)
    kernel_options(backend, forward_kernel, dq_kernel, dkdv_kernel)
    if cu_seqlens_k is None:
        cu_seqlens_k, max_seqlen_k = cu_seqlens_q, max_seqlen_q
    elif max_seqlen_k is None:
        raise ValueError("mla_attention_in_graph needs max_seqlen_k with cu_seqlens_k (a compiled graph does not "
                         "read it from the device)")
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = mla_attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                 float(scale), alibi_slopes, return_lse, backend, forward_kernel, dq_kernel,
                                 dkdv_kernel)
    return (out, lse) if return_lse else out
