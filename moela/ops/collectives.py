"""Collectives the ops and the parallel layouts share.

- `all_gather_single` / `reduce_scatter_single`: the single-tensor collectives under the names of the running
  torch (torch >= 2.13 calls them so and deprecates `all_gather_into_tensor` / `reduce_scatter_tensor`; the
  signatures are the same).
- `gather_tokens(x, group)`: a differentiable all-gather along dim 0 (rank-major), whose backward is the
  reduce-scatter (sum) of the gradient: context parallelism's keys, sequence parallelism's rows, the all-gather
  QK-Norm's columns (gathered as rows, then transposed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 (rank-major) in forward; reduce-scatter (sum) of the gradient in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))  # [world*T_loc, ...]
        all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // world,) + tuple(grad.shape[1:]))  # [T_loc, ...]
        reduce_scatter_single(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """[T_loc, ...] on each rank -> [world*T_loc, ...] rank-major on every rank, differentiable."""
    return _GatherTokens.apply(x, group)
