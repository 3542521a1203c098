"""`sum_small(x, group)`: sum a small float32 tensor over a process group, in place, with the lowest latency
available - a one-shot all-reduce through symmetric memory where the ranks are NVLink peers, the group's own
all-reduce (NCCL, gloo) otherwise.

For a few kilobytes (QK-Norm's [T, 2] statistics) an NCCL all-reduce costs its launch and protocol latency, tens of
microseconds, far more than moving the bytes. With symmetric memory every rank copies its values into a buffer the
peers can read, and one kernel reads all the peers' copies and sums them (`torch.ops.symm_mem.one_shot_all_reduce`).

Decisions:
- One buffer per group, grown (a collective rendezvous) when a larger tensor comes; every rank of a tensor-parallel
  group sees the same sizes in the same order, so they grow together.
- `auto` is verified, not assumed: the first call on a group tries symmetric memory and compares its sum with the
  group's all-reduce of the same values; if symmetric memory is missing (CPU, a torch without the op, ranks that
  are not peers) or disagrees, the group uses the all-reduce from then on, and the choice is logged once.
- `async_op` returns a handle to wait on: the all-reduce's own; the one-shot kernel is ordered on the current
  stream, so its handle is already complete.

`sum_over_ranks(x, group)` is the differentiable all-reduce (sum) for statistics that every rank's loss uses in full
(QK-Norm's sums of squares, context parallelism's per-document statistics): its backward is the all-reduce of the
gradients.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

log = logging.getLogger("moela.ops")

EXCHANGES = ("auto", "all_reduce", "symm_mem")
_CHOSEN: dict[str, str] = {}  # group name -> "all_reduce" | "symm_mem" (auto's verified choice)
_BUFFERS: dict[str, torch.Tensor] = {}  # group name -> symmetric float32 buffer


class _Done:
    def wait(self) -> None:
        pass


def _symm_sum(x: torch.Tensor, group) -> None:
    import torch.distributed._symmetric_memory as symm_mem

    name = group.group_name
    buf = _BUFFERS.get(name)
    if buf is None or buf.numel() < x.numel():
        if buf is None and hasattr(symm_mem, "enable_symm_mem_for_group"):
            with warnings.catch_warnings():  # needed by older torch, deprecated (and a no-op need) in newer
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(name)
        buf = symm_mem.empty(max(x.numel(), 2 * (0 if buf is None else buf.numel())), dtype=torch.float32,
                             device=x.device)
        symm_mem.rendezvous(buf, name)
        _BUFFERS[name] = buf
    view = buf[:x.numel()]
    view.copy_(x.reshape(-1))
    x.copy_(torch.ops.symm_mem.one_shot_all_reduce(view, "sum", name).view_as(x))


def _verified(x: torch.Tensor, group) -> str:
    """auto's choice for `group`, decided on its first call (module docstring)."""
    name = group.group_name
    if name in _CHOSEN:
        return _CHOSEN[name]
    reason = "CPU tensors" if not x.is_cuda else ""
    if not reason:
        try:
            probe = x.clone()
            _symm_sum(probe, group)
            expected = x.clone()
            dist.all_reduce(expected, group=group)
            agree = torch.tensor(float(torch.allclose(probe, expected, rtol=1e-6, atol=0.0)), device=x.device)
            dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=group)
            reason = "" if agree.item() == 1.0 else "its sum differed from the all-reduce's"
        except (RuntimeError, AttributeError, ImportError, NotImplementedError) as err:
            reason = f"{type(err).__name__}: {err}"
    _CHOSEN[name] = "all_reduce" if reason else "symm_mem"
    log.info("small all-reduce on group %s: %s%s", name, _CHOSEN[name],
             f" (symmetric memory unavailable: {reason})" if reason else "")
    return _CHOSEN[name]


def sum_small(x: torch.Tensor, group, *, exchange: str = "auto", async_op: bool = False):
    """x (float32, contiguous) <- its sum over `group`; returns a handle with `wait()` when `async_op`."""
    if exchange not in EXCHANGES:
        raise ValueError(f"sum_small: unknown exchange {exchange!r}; choose one of {', '.join(EXCHANGES)}")
    how = _verified(x, group) if exchange == "auto" else exchange
    if how == "symm_mem":
        _symm_sum(x, group)
        return _Done() if async_op else None
    return dist.all_reduce(x, group=group, async_op=async_op)


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) in forward and in backward: each rank's output feeds that rank's own loss term."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """x summed over `group`'s ranks, differentiably (a new tensor; x is not changed)."""
    return _SumOverRanks.apply(x, group)
