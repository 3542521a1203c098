"""Expert parallelism: routed experts partitioned over the EP group, tokens moved to them with all-to-all.

`ExpertParallelExperts` keeps the model's experts contract, `forward(x [T, D], topk_ids [T, K], topk_weights
[T, K]) -> y [T, D]`, while holding only this rank's `E_local = E / ep` experts. Its params `w13 [E, 2F, D]` and
`w2 [E, D, F]` are DTensors sharded on dim 0 over the EP mesh (local `[E_local, 2F, D]` / `[E_local, D, F]`), so
state dicts and DCP checkpoints see the global expert tensors and convert between layouts. Decisions:

- Dispatch: the T*K (token, expert) pairs are sorted by expert id (stable), which groups them by destination rank
  (rank r owns experts [r*E_local, (r+1)*E_local)). Per-expert counts are exchanged first with one small
  all-to-all, then token rows go with `all_to_all_single` using the resulting uneven splits (one host sync).
- Local compute: `moela.ops.moe.moe_experts` on the received rows with top-1 routing to the local expert and gate
  1.0, so any backend and either recipe (bf16, fp8_blockwise) runs unchanged.
- Combine: outputs return by the inverse all-to-all; the gate weights are applied on the sending side in float32
  and pairs summed per token, so d(topk_weights) never crosses the network.
- Both all-to-alls are autograd functions whose backward is the all-to-all with the splits swapped.
- Gradient scale: a local expert's weight gradient sums the tokens of all `ep` ranks of its EP group, but FSDP
  averages it only over the ranks holding the same experts (`efsdp`, times `dp_replicate` under HSDP), a group
  `ep` times smaller than the `dp_cp` group every dense gradient is averaged over. `apply_fsdp` therefore sets
  `grad_scale = 1 / ep`, applied to the local weights in backward, so expert and dense gradients are the same
  average in every layout (`efsdp` of one rank or several, with or without HSDP; tested in
  tests/test_parallel_fsdp.py). Used on its own, without FSDP, the module leaves gradients as they are
  (`grad_scale = 1`): each local expert's gradient is then the sum over its EP group's tokens.
- A rank that receives no rows still builds a graph from the received rows and its expert weights (zero
  gradients), so every rank runs the same backward all-to-alls and FSDP gradient reduce-scatters.
- `apply_expert_parallel` swaps every `experts` child of the model for this module (meta or materialized);
  `reduce_expert_load` sums the per-layer expert load over all data ranks, so the sign-based router-bias update
  is identical everywhere (the router itself runs locally on each rank's tokens, over all E experts).

Shapes: T tokens, D hidden, E experts (global), K top-k, F expert FFN width, R rows received by this rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from moela.ops.moe import autocast_input, moe_experts, tokens_per_expert


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split by `in_splits` go to each rank; `out_splits` rows arrive from each rank."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))  # [R, D]
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by `scale` in backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all over dim 0."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ExpertParallelExperts(nn.Module):
    """Routed experts of one MoE layer, E / ep of them on each rank of `ep_mesh`; global routing in, y out."""

    def __init__(self, num_experts: int, dim: int, ffn_dim: int, ep_mesh: DeviceMesh, *, recipe: str = "bf16",
                 backend: str = "auto", device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        ep = ep_mesh.size()
        if num_experts % ep:
            raise ValueError(f"expert parallelism: {num_experts} routed experts cannot be split evenly over ep={ep} "
                             f"ranks; choose parallel.ep among the divisors of {num_experts}")
        self.num_experts, self.ep_mesh, self.recipe, self.backend = num_experts, ep_mesh, recipe, backend
        self.num_local = num_experts // ep
        self.grad_scale = 1.0  # 1/ep under FSDP (set by apply_fsdp; see the module docstring)
        local13 = torch.empty(self.num_local, 2 * ffn_dim, dim, device=device, dtype=dtype)  # [E_local, 2F, D]
        local2 = torch.empty(self.num_local, dim, ffn_dim, device=device, dtype=dtype)  # [E_local, D, F]
        self.w13 = nn.Parameter(self._distribute(local13, (num_experts, 2 * ffn_dim, dim)))
        self.w2 = nn.Parameter(self._distribute(local2, (num_experts, dim, ffn_dim)))

    def _distribute(self, local: torch.Tensor, shape: tuple[int, ...]) -> DTensor:
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, self.ep_mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=stride)

    @classmethod
    def from_module(cls, experts: nn.Module, ep_mesh: DeviceMesh) -> "ExpertParallelExperts":
        """Replacement for a single-process experts module (stacked `w13`, `w2`): same recipe/backend; this rank's
        slice of its weights is copied when they are materialized (left uninitialized on the meta device)."""
        w13, w2 = experts.w13, experts.w2
        e, two_f, d = w13.shape
        new = cls(e, d, two_f // 2, ep_mesh, recipe=getattr(experts, "recipe", "bf16"),
                  backend=getattr(experts, "backend", "auto"), device=w13.device, dtype=w13.dtype)
        if w13.device.type != "meta":
            lo = ep_mesh.get_local_rank() * new.num_local
            with torch.no_grad():
                _local(new.w13).copy_(w13[lo:lo + new.num_local])
                _local(new.w2).copy_(w2[lo:lo + new.num_local])
        return new

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """N(0, std) for this rank's experts (the model calls this instead of its own rule for experts)."""
        nn.init.normal_(self.w13, mean=0.0, std=std)
        nn.init.normal_(self.w2, mean=0.0, std=std)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, local={self.num_local}, ep={self.ep_mesh.size()}, "
                f"recipe={self.recipe}")

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        t, k = topk_ids.shape
        ep, e_local = self.ep_mesh.size(), self.num_local
        group = self.ep_mesh.get_group()
        w13, w2 = _local(self.w13), _local(self.w2)  # [E_local, 2F, D], [E_local, D, F]
        if self.grad_scale != 1.0:
            w13, w2 = _ScaleGrad.apply(w13, self.grad_scale), _ScaleGrad.apply(w2, self.grad_scale)

        flat_ids = topk_ids.reshape(-1)  # [T*K]
        order = torch.argsort(flat_ids, stable=True)  # [T*K] pair index, sorted by expert
        counts = tokens_per_expert(flat_ids, self.num_experts)  # [E] pairs per global expert
        recv_counts = torch.empty_like(counts)  # [ep * E_local] pairs from each source rank for each local expert
        dist.all_to_all_single(recv_counts, counts, group=group)
        counts_host = torch.stack([counts, recv_counts]).view(2, ep, e_local).sum(2).tolist()  # one host sync
        in_splits, out_splits = counts_host[0], counts_host[1]

        x_send = autocast_input(x)[order // k]  # [T*K, D] rows grouped by destination rank, then by expert
        x_recv = all_to_all(x_send, out_splits, in_splits, group)  # [R, D]
        local_ids = torch.arange(e_local, device=x.device).repeat(ep)  # [ep * E_local]
        local_ids = local_ids.repeat_interleave(recv_counts, output_size=x_recv.shape[0])  # [R]
        ones = torch.ones(x_recv.shape[0], 1, device=x.device, dtype=torch.float32)  # [R, 1]
        if x_recv.shape[0] == 0:  # keep x_recv and the weights in the graph: every rank runs the backward a2a
            y_recv = x_recv * 0 + 0 * (w13.sum() + w2.sum()).to(x_recv.dtype)  # [0, D]
        else:
            y_recv = moe_experts(x_recv, local_ids[:, None], ones, w13, w2, recipe=self.recipe,
                                 backend=self.backend)  # [R, D]
        y_back = all_to_all(y_recv, in_splits, out_splits, group)  # [T*K, D] in `order`
        gate = topk_weights.reshape(-1)[order].float()  # [T*K]
        y = torch.zeros(t, x.shape[1], device=x.device, dtype=torch.float32)  # [T, D]
        y = y.index_add(0, order // k, y_back.float() * gate[:, None])
        return y.to(x.dtype)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Replace every routed-experts module (a child named `experts` with stacked `w13` and `w2`) by its
    expert-parallel version over `ep_mesh`; returns how many were replaced. Works on meta or materialized models."""
    targets = [(parent, child) for parent in model.modules()
               for name, child in parent.named_children()
               if name == "experts" and isinstance(getattr(child, "w13", None), torch.Tensor)
               and isinstance(getattr(child, "w2", None), torch.Tensor)
               and not isinstance(child, ExpertParallelExperts)]
    for parent, child in targets:
        parent.experts = ExpertParallelExperts.from_module(child, ep_mesh)
    return len(targets)


def reduce_expert_load(expert_load: torch.Tensor, mesh) -> torch.Tensor:
    """Sum `expert_load [L_moe, E]` (tokens per expert, this rank's micro-batches) over every rank that holds a
    share of the global batch (`dp_cp` view), so each rank applies the same router-bias update. In place; returns
    it."""
    group = mesh.group("dp_cp")
    if group is not None:
        dist.all_reduce(expert_load, group=group)
    return expert_load
