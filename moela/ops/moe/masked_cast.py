"""The bf16 weight gradient's epilogue: zero the experts that received no rows and cast to the weights' dtype, in
one pass.

`torch._grouped_mm`'s k-grouped form (the weight gradient, [E, N, K]) makes no promise about the output of a group
whose K is empty, and the master weights (and so their gradients) are fp32 while the GEMM writes bf16. Done with
torch ops that is a `where` and a cast: two passes, the second a non-vectorized copy. At `small`'s shapes (E 32,
D 1024, F 512, 11 MoE layers) they took 1.6 + 2.0 ms of a 122 ms step on an H200 (bench/notes/step.md, run 7).
The kernel reads the bf16 output once and writes the result once: 6 bytes per element instead of 10.

Shapes: E experts, N x K each; `counts` [E] rows per expert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.triton_env import INTERPRET

BLOCK = 4096  # elements per program: 32 per thread at 4 warps


def masked_cast_reference(out: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out [E, N, K] -> zeros for the experts with counts == 0, the rest as they are, in `dtype`."""
    return torch.where((counts > 0)[:, None, None], out, 0).to(dtype)


@triton.jit
def _masked_cast_kernel(x_ptr, counts_ptr, y_ptr, per_expert, BLOCK: tl.constexpr):
    """Program (block, expert): BLOCK consecutive elements of one expert's [N, K] matrix."""
    pid, e = tl.program_id(0), tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    base = e.to(tl.int64) * per_expert
    filled = tl.where(tl.load(counts_ptr + e) > 0, per_expert, 0)  # an empty expert's output is never read
    x = tl.load(x_ptr + base + offs, mask=offs < filled, other=0.0)
    tl.store(y_ptr + base + offs, x.to(y_ptr.dtype.element_ty), mask=offs < per_expert)


def masked_cast(out: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`masked_cast_reference` in one kernel on CUDA (and in Triton's interpreter); the reference elsewhere."""
    if not (out.is_cuda or INTERPRET):
        return masked_cast_reference(out, counts, dtype)
    e = out.shape[0]
    x = out.contiguous()
    y = torch.empty(x.shape, device=x.device, dtype=dtype)
    per_expert = x[0].numel() if e else 0
    if e and per_expert:
        _masked_cast_kernel[(triton.cdiv(per_expert, BLOCK), e)](x, counts, y, per_expert, BLOCK=BLOCK, num_warps=4)
    return y
