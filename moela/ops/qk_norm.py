"""Layer-wise QK-Norm: `qk_rms_norm(q, k, q_weight, k_weight, eps, group=)` normalizes every token's q and k by the
RMS over ALL heads (OLMo2 style), when each rank holds only some of the heads (tensor parallelism).

    y = x * rsqrt(mean_over_all_heads(x^2) + eps) * w          for x = q and x = k, per token

Under tensor parallelism a rank holds the columns of its heads: x [T, N] of a full width W = N * group size. The
standard formulation all-gathers q and k (2 * T * W values, plus a reduce-scatter of their gradients) to compute
a row statistic. Here each rank computes per-token partial sums of squares over its own columns, the ranks add
up only those scalars - q's and k's together, one float32 [T, 2] message, 8 bytes a token - and every rank
normalizes its columns locally. The backward needs one more per-token sum over the full width,
S = sum(g * w * x) (dx = rstd * g * w - x * rstd^3 * S / W), exchanged the same way; the weight gradient
sum_t g * x * rstd is local (each rank owns its columns' weights). Without a group the op is a plain RMSNorm of q
and of k.

Implementations:
- `reference`: pure torch; the statistics cross the ranks through a differentiable all-reduce (forward: sum,
  backward: sum), so autograd derives the backward above. The specification.
- `triton` (`moela.ops.qk_norm_triton`): q and k in one launch per pass, float32 statistics; the forward is
  statistics -> exchange -> normalize, the backward statistics -> exchange started asynchronously -> the weight
  gradients (independent of the exchange, computed while it is in flight) -> wait -> input gradients. Picked by
  `auto` on CUDA; on CPU only under TRITON_INTERPRET=1 and when asked for by name (tests).
- `qk_rms_norm_allgather`: the all-gather formulation, for tests and benchmarks to compare against.
The triton path's exchange is `moela.ops.small_all_reduce.sum_small`: at 8 bytes a token it is latency-bound, so
it is a one-shot all-reduce through symmetric memory where the ranks are NVLink peers (verified on first use) and
the group's all-reduce (NCCL, gloo) otherwise.

Shapes: T tokens, N this rank's columns (heads x head dim), W = N x group size the full width.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moela.ops.backends import QK_NORM_BACKENDS
from moela.ops.collectives import gather_tokens
from moela.ops.dispatch import Dispatch
from moela.ops.small_all_reduce import sum_over_ranks, sum_small

DISPATCH = Dispatch("qk_rms_norm", QK_NORM_BACKENDS, needs="triton")


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def qk_rms_norm_reference(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                          eps: float, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    world = _world(group)
    qf, kf = q.float(), k.float()  # [T, N]
    ss = torch.stack((qf.pow(2).sum(-1), kf.pow(2).sum(-1)), dim=-1)  # [T, 2] this rank's columns
    if world > 1:
        ss = sum_over_ranks(ss, group)  # [T, 2] all columns
    rq = torch.rsqrt(ss[:, :1] / (q.shape[-1] * world) + eps)  # [T, 1]
    rk = torch.rsqrt(ss[:, 1:] / (k.shape[-1] * world) + eps)  # [T, 1]
    return (qf * rq * q_weight.float()).to(q.dtype), (kf * rk * k_weight.float()).to(k.dtype)


def _gather_columns(x: torch.Tensor, group) -> torch.Tensor:
    """[T, N] per rank -> [T, N * world] (rank-major column blocks), differentiable (backward: reduce-scatter)."""
    world, t = dist.get_world_size(group), x.shape[0]
    return gather_tokens(x, group).view(world, t, -1).permute(1, 0, 2).reshape(t, -1)


def qk_rms_norm_allgather(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                          eps: float, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard formulation: all-gather q and k over the heads, RMSNorm the full rows (the weights gathered
    too), keep this rank's columns."""
    rank, n_q, n_k = dist.get_rank(group), q.shape[-1], k.shape[-1]
    both = _gather_columns(torch.cat((q, k), dim=-1), group)  # [T, world * (Nq + Nk)]
    weights = _gather_columns(torch.cat((q_weight, k_weight))[None], group)[0]  # [world * (Nq + Nk)]
    t, world = q.shape[0], _world(group)
    both = both.view(t, world, n_q + n_k)
    weights = weights.view(world, n_q + n_k)
    full_q, full_k = both[..., :n_q].reshape(t, -1), both[..., n_q:].reshape(t, -1)  # [T, W]
    yq, yk = qk_rms_norm_reference(full_q, full_k, weights[:, :n_q].reshape(-1), weights[:, n_q:].reshape(-1), eps)
    return yq[:, rank * n_q:(rank + 1) * n_q], yk[:, rank * n_k:(rank + 1) * n_k]


class _TritonQKNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, eps, group):
        from moela.ops import qk_norm_triton as kernels

        world = _world(group)
        ctx.widths = (q.shape[-1] * world, k.shape[-1] * world)
        ctx.group = group
        ss = kernels.sum_squares(q, k)  # [T, 2]
        if world > 1:
            sum_small(ss, group)
        yq, yk, rstd = kernels.normalize(q, k, q_weight, k_weight, ss, eps, *ctx.widths)
        ctx.save_for_backward(q, k, q_weight, k_weight, rstd)
        return yq, yk

    @staticmethod
    def backward(ctx, gq, gk):
        from moela.ops import qk_norm_triton as kernels

        q, k, q_weight, k_weight, rstd = ctx.saved_tensors
        gq, gk = gq.contiguous(), gk.contiguous()
        s = kernels.grad_dot(gq, q, q_weight, gk, k, k_weight)  # [T, 2] this rank's columns
        work = sum_small(s, ctx.group, async_op=True) if ctx.group is not None else None
        dwq = kernels.grad_weight(gq, q, rstd, 0).to(q_weight.dtype)  # [Nq], while the exchange is in flight
        dwk = kernels.grad_weight(gk, k, rstd, 1).to(k_weight.dtype)  # [Nk]
        if work is not None:
            work.wait()
        dq, dk = kernels.grad_input(gq, q, q_weight, gk, k, k_weight, rstd, s, *ctx.widths)
        return dq, dk, dwq, dwk, None, None


@torch.compiler.disable
def _triton_qk_norm(q, k, q_weight, k_weight, eps, group):
    return _TritonQKNorm.apply(q.contiguous(), k.contiguous(), q_weight, k_weight, eps, group)


DISPATCH.register("triton", _triton_qk_norm, auto=lambda q, *args, **kwargs: q.is_cuda)


def qk_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float = 1e-6,
                *, group=None, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Nq], k [T, Nk] (this rank's columns), q_weight [Nq], k_weight [Nk] -> normalized (q, k) in their
    dtypes; each row's statistic spans the columns of every rank of `group` (None: this rank's only)."""
    DISPATCH.check(backend)
    if q.dim() != 2 or k.dim() != 2 or q.shape[0] != k.shape[0]:
        raise ValueError(f"qk_rms_norm wants q [T, Nq] and k [T, Nk] with the same T; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}")
    if q_weight.shape != q.shape[-1:] or k_weight.shape != k.shape[-1:]:
        raise ValueError(f"qk_rms_norm: q_weight must be [Nq]={q.shape[-1]} and k_weight [Nk]={k.shape[-1]}, got "
                         f"{tuple(q_weight.shape)}, {tuple(k_weight.shape)}")
    chosen = DISPATCH.choose(backend, q, k, q_weight, k_weight)
    if chosen == "reference":
        return qk_rms_norm_reference(q, k, q_weight, k_weight, eps, group)
    return DISPATCH.impl(chosen)(q, k, q_weight, k_weight, eps, group)
