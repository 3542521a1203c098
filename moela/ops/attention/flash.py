"""The `flash` backend of `mla_attention`: FlashAttention-4 (PyPI `flash-attn-4`, the optional extra `[flash]`), its
CuTe DSL kernels for Hopper (sm90) and Blackwell (sm100), compiled on first use.

What it covers, and how it meets moela's contract:
- Every call goes through `flash_attn_varlen_func` (cu_seqlens_q / cu_seqlens_k, max_seqlen), equal-length batches
  included: one set of compiled kernels per head dims and mask serves them all. Dqk != Dv (MLA's 192/128), causal
  or full attention.
- Causal alignment: flash-attn-4 lets query i see key j when j <= i + Lk - Lq, moela's bottom-right rule, so a q
  chunk that is the tail of a longer k side (context parallelism) needs nothing extra. A query that sees no key gets
  out 0 and lse -inf, as in the reference.
- lse [H, Tq] float32 (natural log) is differentiable: flash-attn-4's autograd hands the lse gradient to its backward,
  whose preprocess folds it into the row term (`Delta = rowsum(dO * O) - dlse`), exactly as moela's Triton kernel
  does; the attention z-loss costs one subtract per row there.
- ALiBi runs inside its kernels through `score_mod` / `score_mod_bwd` (moela.ops.attention.flash_alibi), the
  slopes compiled in as constants: the first call with a slopes tensor reads it to the host once (one device
  synchronization; `host_slopes`), later calls with the same, unmodified tensor do not, and a new set of slopes
  compiles new kernels.
- Not deterministic: its dq is accumulated with float32 atomics across key blocks (the Triton backend is
  deterministic).

flash-attn-4 is imported on first use (it imports the CuTe DSL, seconds), never at `import moela`. Asked for by
name where it cannot run (not installed, not a Hopper/Blackwell GPU, unsupported head dims or dtype), the backend
raises an error naming the problem and the fix; `auto` skips it and says why in its log line.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch

INSTALL = 'pip install -e ".[flash]"'


@functools.lru_cache(maxsize=1)
def _flash_module() -> tuple[object | None, str]:
    """(flash_attn.cute, "") or (None, why the import failed)."""
    try:
        import flash_attn.cute as flash_cute
    except Exception as e:  # ImportError, or the CuTe DSL failing to load its libraries
        first_line = str(e).splitlines()[0] if str(e) else ""
        return None, f"{type(e).__name__}: {first_line}"
    if not hasattr(flash_cute, "flash_attn_varlen_func"):
        return None, f"flash_attn.cute at {getattr(flash_cute, '__file__', '?')} has no flash_attn_varlen_func"
    return flash_cute, ""


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _head_dims_problem(major: int, d_qk: int, d_v: int) -> str | None:
    """flash-attn-4's head-dim rules: sm90 any multiple of 8 in [8, 256]; sm100 up to 128, or 192/128, or 256/256."""
    if d_qk % 8 or d_v % 8:
        return f"head dims must be multiples of 8 (got Dqk={d_qk}, Dv={d_v})"
    if major == 9 and not (8 <= d_qk <= 256 and 8 <= d_v <= 256):
        return f"on sm90 head dims must lie in [8, 256] (got Dqk={d_qk}, Dv={d_v})"
    if major == 10 and not ((d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))):
        return f"on sm100 head dims must be <= 128, or 192/128, or 256/256 (got Dqk={d_qk}, Dv={d_v})"
    return None


def flash_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: torch.Tensor | None = None
                  ) -> str | None:
    """Why the flash backend cannot run this call, or None when it can. Checks the cheap things first and imports
    flash-attn-4 only for a CUDA call it could run."""
    if not q.is_cuda:
        return f"flash-attn-4 runs on CUDA tensors (got {q.device.type})"
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"flash-attn-4 takes float16 / bfloat16 q, k, v of one dtype (got {q.dtype}, {k.dtype}, {v.dtype})"
    major, minor = _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if major not in (9, 10):
        return f"flash-attn-4 runs on Hopper (sm90) and Blackwell (sm100) GPUs; this one is sm{major}{minor}"
    dims = _head_dims_problem(major, q.shape[-1], v.shape[-1])
    if dims is not None:
        return f"flash-attn-4: {dims}"
    if alibi_slopes is not None and (alibi_slopes.dtype != torch.float32 or alibi_slopes.device != q.device):
        return (f"alibi_slopes must be float32 on {q.device} for flash-attn-4 (got {alibi_slopes.dtype} on "
                f"{alibi_slopes.device})")
    module, why = _flash_module()
    if module is None:
        return f"flash-attn-4 is not importable ({why}); install it with {INSTALL}"
    return None


def flash_auto(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_, alibi_slopes: torch.Tensor | None = None,
               **__) -> bool:
    return flash_problem(q, k, v, alibi_slopes) is None


_HOST_SLOPES: dict[int, tuple[weakref.ref, int, tuple[float, ...]]] = {}  # id(tensor) -> (ref, version, values)


def host_slopes(slopes: torch.Tensor) -> tuple[float, ...]:
    """The values of `slopes` ([H] float32) as Python floats, read from the device once per tensor and in-place
    version. Entries are keyed by the tensor object (held weakly, dropped when it dies), never by its address, so a
    new tensor where a freed one lived is read anew."""
    entry = _HOST_SLOPES.get(id(slopes))
    if entry is not None and entry[0]() is slopes and entry[1] == slopes._version:
        return entry[2]
    values = tuple(slopes.detach().float().cpu().tolist())  # Python floats
    key = id(slopes)
    ref = weakref.ref(slopes, lambda _, key=key: _HOST_SLOPES.pop(key, None))
    _HOST_SLOPES[key] = (ref, slopes._version, values)
    return values


def _score_mods(causal: bool, slopes: torch.Tensor) -> tuple[Callable, Callable]:
    from moela.ops.attention.flash_alibi import alibi_score_mods

    return alibi_score_mods(host_slopes(slopes), causal)


def _check_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, alibi_slopes: torch.Tensor | None) -> None:
    problem = flash_problem(q, k, v, alibi_slopes)
    if problem is not None:
        raise RuntimeError(f"mla_attention backend 'flash': {problem} (or use backend='auto')")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dtype != torch.int32 or t.device != q.device:
            raise TypeError(f"{name} must be an int32 tensor on {q.device}; got {t.dtype} on {t.device}")


@torch.compiler.disable
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                    cu_seqlens_k: torch.Tensor, max_seqlen_k: int, *, return_lse: bool, causal: bool,
                    softmax_scale: float | None, alibi_slopes: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The `flash` backend (mla_attention's arguments) -> (out [Tq, H, Dv], lse [H, Tq] float32 or None); both
    differentiable. Opaque to torch.compile (a graph break), as the Triton backend; a compiled block calls
    `flash_forward` / `flash_backward` through the op pair of `graph.py` instead."""
    _check_call(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    module, _ = _flash_module()
    tq = q.shape[0]
    n_docs = cu_seqlens_q.numel() - 1
    if tq == 0 or k.shape[0] == 0 or n_docs == 0:  # nothing to launch; the reference's loop is empty or trivial
        from moela.ops.attention.reference import attention_reference

        out, lse = attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal,
                                       softmax_scale=softmax_scale, alibi_slopes=alibi_slopes)
        return out, (lse if return_lse else None)
    options = dict(softmax_scale=softmax_scale, causal=causal, return_lse=return_lse)
    if alibi_slopes is not None:
        score_mod, score_mod_bwd = _score_mods(causal, alibi_slopes)
        options.update(score_mod=score_mod, score_mod_bwd=score_mod_bwd)
    out, lse = module.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                             max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
                                             **options)  # [Tq, H, Dv], [H, Tq]
    return out, (lse if return_lse else None)


# The forward and backward as two calls, for the compiled-graph op (`moela.ops.attention.graph`): flash-attn-4's own
# `_flash_attn_fwd` / `_flash_attn_bwd`, called with the arguments its autograd Function (`FlashAttnVarlenFunc`)
# passes them, so the kernels, tiles and numerics are the ones `flash_attention` runs. They are private to
# flash-attn-4, hence the pinned version of the `[flash]` extra and the error below if they move.
def _interface_function(name: str) -> Callable:
    from flash_attn.cute import interface

    fn = getattr(interface, name, None)
    if fn is None:
        raise RuntimeError(f"flash_attn.cute.interface at {interface.__file__} has no {name}, which the flash "
                           f"backend calls inside compiled blocks; install the tested version with {INSTALL}")
    return fn


def _score_mod_options(causal: bool, alibi_slopes: torch.Tensor | None) -> dict:
    if alibi_slopes is None:
        return {}
    score_mod, score_mod_bwd = _score_mods(causal, alibi_slopes)
    return dict(score_mod=score_mod, score_mod_bwd=score_mod_bwd)


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                  cu_seqlens_k: torch.Tensor, max_seqlen_k: int, *, causal: bool, softmax_scale: float,
                  alibi_slopes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn-4's forward kernel -> (out [Tq, H, Dv], lse [H, Tq] float32); no autograd. Tq and Tk > 0."""
    _check_call(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    out, lse, *_ = _interface_function("_flash_attn_fwd")(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=int(max_seqlen_q),
        max_seqlen_k=int(max_seqlen_k), softmax_scale=softmax_scale, causal=causal, softcap=0.0, return_lse=True,
        **_score_mod_options(causal, alibi_slopes))
    return out, lse


def flash_backward(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   max_seqlen_q: int, cu_seqlens_k: torch.Tensor, max_seqlen_k: int, *, causal: bool,
                   softmax_scale: float, alibi_slopes: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash-attn-4's backward kernels (dlse folded into its preprocess) -> (dq, dk, dv). Tq and Tk > 0."""
    dq, dk, dv = _interface_function("_flash_attn_bwd")(
        q, k, v, out, dout, lse, softmax_scale, causal, 0.0, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k), dlse=dlse,
        **_score_mod_options(causal, alibi_slopes))
    return dq, dk, dv
