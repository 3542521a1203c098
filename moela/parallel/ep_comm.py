"""The collectives of expert parallelism: all-gather and reduce-scatter split into a start and a finish, so that
independent compute runs while they are in flight, in forward and in backward; the uneven all-to-all of the
exact-size dispatch; and the host-side agreement on a padded token count.

Decisions:
- `gather_start(x, group) -> (out, handle)` issues the all-gather with `async_op=True` and returns its output
  buffer at once; `finish(out, handle)` waits (on CUDA a stream dependency, the host does not block) and returns
  the same values. Both are autograd functions: the finish node's backward starts the backward collective (a
  reduce-scatter of the gradient for a gather, an all-gather for a reduce-scatter) and the start node's backward
  waits for it. Autograd runs ready nodes latest-created first, so the nodes created between a start and its
  finish in forward (e.g. the shared experts) also run between the two halves of the backward collective, and
  overlap it there too. The gradient that autograd passes from the finish node to the start node is a stand-in
  of the right shape (the finish node's incoming gradient); the real one is the backward collective's output.
- A handle holds the work objects until `wait`: that keeps the buffers of an in-flight collective alive and is
  when NCCL's stream is joined, so no `record_stream` is needed.
- `agree_max(value, group)`: the largest of one host integer over the ranks of a CPU (gloo) group. It exchanges
  host values only, so it never waits for the device; expert parallelism uses it to pad every rank's tokens to
  one count (collectives need equal sizes) without reading anything back from the GPU. `host_group` gives the
  gloo twin of a device group (the group itself when it is already gloo).
- Each collective is launched inside a profiler range (`PROFILE_PREFIX` + kind), which a profile attributes its
  NCCL kernels to.

Shapes: T rows of this rank, ep ranks of the group, R rows received.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from moela.ops.collectives import all_gather_single, reduce_scatter_single

# every expert-parallel collective is launched inside a profiler range named PROFILE_PREFIX + kind, so a profile
# can tell its kernels from FSDP's (bench/scaling.py's `ep` share)
PROFILE_PREFIX = "moela.ep."


class Handle:
    """The forward and backward collective of one start/finish pair: output buffers and work objects."""

    __slots__ = ("kind", "group", "work", "back", "back_work")

    def __init__(self, kind: str, group):
        self.kind, self.group = kind, group
        self.work = self.back = self.back_work = None


def _issue(kind: str, x: torch.Tensor, group) -> tuple[torch.Tensor, object]:
    """Start an all-gather ("gather", [T, ...] -> [ep*T, ...]) or a sum reduce-scatter ("scatter", [ep*T, ...] ->
    [T, ...]) of dim 0; returns (output buffer, work)."""
    ep = dist.get_world_size(group)
    x = x.contiguous()
    with record_function(f"{PROFILE_PREFIX}{kind}"):
        if kind == "gather":
            out = x.new_empty((ep * x.shape[0],) + tuple(x.shape[1:]))
            return out, all_gather_single(out, x, group=group, async_op=True)
        out = x.new_empty((x.shape[0] // ep,) + tuple(x.shape[1:]))
        return out, reduce_scatter_single(out, x, group=group, async_op=True)


_BACKWARD = {"gather": "scatter", "scatter": "gather"}


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle):
        ctx.handle = handle
        out, handle.work = _issue(handle.kind, x, handle.group)
        return out

    @staticmethod
    def backward(ctx, stand_in):
        handle = ctx.handle
        handle.back_work.wait()
        grad, handle.back, handle.back_work = handle.back, None, None
        return grad, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, handle):
        ctx.handle = handle
        handle.work.wait()
        handle.work = None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        handle = ctx.handle
        handle.back, handle.back_work = _issue(_BACKWARD[handle.kind], grad, handle.group)
        return grad, None


def gather_start(x: torch.Tensor, group) -> tuple[torch.Tensor, Handle]:
    """All-gather x [T, ...] over `group` (rank-major [ep*T, ...]); read the output only after `finish`."""
    handle = Handle("gather", group)
    return _Start.apply(x, handle), handle


def scatter_start(x: torch.Tensor, group) -> tuple[torch.Tensor, Handle]:
    """Sum-reduce-scatter x [ep*T, ...] over `group` (rank r keeps rows [r*T, (r+1)*T) of the sum); read the output
    only after `finish`."""
    handle = Handle("scatter", group)
    return _Start.apply(x, handle), handle


def finish(out: torch.Tensor, handle: Handle) -> torch.Tensor:
    """Wait for a started collective; returns its output (differentiable)."""
    return _Finish.apply(out, handle)


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split by `in_splits` go to each rank; `out_splits` rows arrive from each rank."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))  # [R, D]
        with record_function(f"{PROFILE_PREFIX}all_to_all"):
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        with record_function(f"{PROFILE_PREFIX}all_to_all"):
            dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all over dim 0 (host split sizes)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _is_gloo(group) -> bool:
    backend = str(dist.get_backend(group))
    return backend == "gloo" or "cpu:gloo" in backend


def host_group(group):
    """A gloo group over the same ranks as `group` (itself when it already takes CPU tensors). Collective over the
    whole world: every rank must call it, in the same order, for the groups of one mesh dimension."""
    if _is_gloo(group):
        return group
    mine = dist.get_process_group_ranks(group)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    groups = sorted({tuple(ranks) for ranks in every})
    own, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups], backend="gloo")
    return own


def agree_max(value: int, group) -> int:
    """max(value) over the ranks of the gloo `group`: host integers only, no device work."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t[0])
