"""`compiled(fn)`: an op's pure-torch reference compiled by TorchInductor, the fast CUDA backend of the small ops.

For elementwise and row-reduction ops (rms_norm, rope, swiglu, cross_entropy) Inductor's generated Triton kernels
fuse the float32 upcast, the math and the backward into a few memory-bound passes, which is what a hand-written
kernel would do; the reference stays the single source of truth. Decisions:
- compiled lazily on first use (importing moela never compiles) with `dynamic=True`, since the token count of a
  packed micro-batch changes every step and must not trigger recompilation;
- one op legitimately meets many variants (rms_norm: fp32 residual stream or bf16 q/k, fp32 or FSDP-gathered bf16
  weights, 2-D or 3-D input, training or no-grad evaluation), more than dynamo's default limit of 8 graphs per
  function, past which it silently runs the op eagerly; the limit is raised to `RECOMPILE_LIMIT` on first use;
- offered only for CUDA tensors (`on_cuda`); on CPU `auto` keeps the plain reference;
- called inside a region that torch.compile is already tracing (e.g. a compiled transformer block), the reference
  is traced into that region, where Inductor fuses it with its neighbours;
- if compilation itself fails (e.g. no working C compiler or Triton on the machine), the reference runs instead
  and a warning names the op and the error, once.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger("moela.ops")

RECOMPILE_LIMIT = 64


def raise_recompile_limit() -> None:
    """Let Dynamo keep up to `RECOMPILE_LIMIT` graphs per function (see the module docstring)."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the newer name first
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
            return


def on_cuda(x: torch.Tensor, *args, **kwargs) -> bool:
    return x.is_cuda


def compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    holder: list[Callable[..., torch.Tensor]] = []

    def run(*args, **kwargs):
        if torch.compiler.is_compiling():  # already inside a compiled region: Inductor fuses the reference there
            return fn(*args, **kwargs)
        if holder:
            return holder[0](*args, **kwargs)
        raise_recompile_limit()
        fast = torch.compile(fn, dynamic=True)
        try:
            out = fast(*args, **kwargs)
        except torch.OutOfMemoryError:  # not a compilation failure: the caller must see it
            raise
        except Exception as err:  # compilation failure: keep training on the reference, say so once
            log.warning("%s: torch.compile failed (%s: %s); using the reference implementation", fn.__name__,
                        type(err).__name__, err)
            holder.append(fn)
            return fn(*args, **kwargs)
        holder.append(fast)
        return out

    run.__name__ = f"compiled_{fn.__name__}"
    return run
