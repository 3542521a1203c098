"""`compiled(fn)`: an op's pure-torch reference compiled by TorchInductor, the fast CUDA backend of the small ops.

For elementwise and row-reduction ops (rms_norm, rope, swiglu, cross_entropy) Inductor's generated Triton kernels
fuse the float32 upcast, the math and the backward into a few memory-bound passes, which is what a hand-written
kernel would do; the reference stays the single source of truth. Decisions:
- compiled lazily on first use (importing moela never compiles) with `dynamic=True`, since the token count of a
  packed micro-batch changes every step and must not trigger recompilation;
- offered only for CUDA tensors (`on_cuda`); on CPU `auto` keeps the plain reference.
"""

from __future__ import annotations

from typing import Callable

import torch


def on_cuda(x: torch.Tensor, *args, **kwargs) -> bool:
    return x.is_cuda


def compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    holder: list[Callable[..., torch.Tensor]] = []

    def run(*args, **kwargs):
        if not holder:
            holder.append(torch.compile(fn, dynamic=True))
        return holder[0](*args, **kwargs)

    run.__name__ = f"compiled_{fn.__name__}"
    return run
