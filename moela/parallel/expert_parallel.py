"""Expert parallelism: routed experts partitioned over the EP group, tokens brought to them by collectives.

`ExpertParallelExperts` keeps the model's experts contract, `forward(x [T, D], topk_ids [T, K], topk_weights
[T, K], shared=None) -> y [T, D]` (plus `shared(x)` when given), while holding only this rank's `E_local = E / ep`
experts. Its params `w13 [E, 2F, D]` and `w2 [E, D, F]` are DTensors sharded on dim 0 over the EP mesh (local
`[E_local, 2F, D]` / `[E_local, D, F]`), so state dicts and DCP checkpoints see the global expert tensors and
convert between layouts. Rank r owns experts [r*E_local, (r+1)*E_local).

Two dispatches (`parallel.ep_dispatch`; `auto` takes `gather` when ep <= K and its static bound fits the expert
kernels' int32 offsets, else `alltoall`):

- `gather`: no host sync, static shapes, dropless by construction. A token needs at most one copy of its hidden
  state on each rank, so with a static bound per destination the tightest dropless buffer is all T tokens for
  every rank: the dispatch is an all-gather of x (and of the K ids and gate weights, one [T, 2K] fp32 tensor) over
  the EP group, and the combine a sum reduce-scatter of each rank's partial outputs. Each rank runs
  `moela.ops.moe.moe_experts` on all ep*T gathered tokens with the ids of other ranks' experts set to -1 (an
  empty slot: no row, no work), weighting by the gate there, so its rows of [ep*T, D] hold its experts' share of
  every token's output; the reduce-scatter adds the ep shares and returns each rank its own tokens. Bytes per
  rank and direction: (ep-1)*T*D, against (ep-1)/ep*T*K*D for the exact all-to-all of (token, expert) pairs, i.e.
  ep/K times as many: half at ep=2 and equal at ep=4 for K=4. An all-to-all with equal static splits would need
  the same T rows per destination to stay dropless (a smaller capacity either drops tokens or needs a host-sized
  second round), so it would move the same bytes plus a gather; a capacity factor is therefore not offered.
  Collectives need equal sizes: every rank pads its tokens to the largest T in the group (rounded up to 256),
  agreed through a gloo twin of the EP group from host integers (`ep_comm.agree_max`), so no value is read back
  from the device. Memory: the expert op sizes its layout by the static bound ep*T*K rows, ep times the
  single-GPU layout.
- `alltoall`: the exact-size dispatch, for ep > K where the gather would move ep/K times the bytes: the (token,
  expert) pairs sorted by expert go to their ranks with `all_to_all_single` and uneven splits, which the host must
  know (one sync per MoE layer); the receiving rank computes top-1 rows, and the gate weights are applied on the
  sending side in float32, so d(topk_weights) never crosses the network.

Overlap (`gather` only): the collectives are started asynchronously (`ep_comm.gather_start` / `finish`) and the
shared experts, which the MoE layer passes in (`shared=`), run while the gathers are in flight; in backward their
gradient runs while the reduce-scatter of the input gradient is in flight. `parallel.ep_chunks: 2` splits the
padded tokens into two chunks: the second chunk's gather overlaps the first chunk's expert GEMMs, and the first
chunk's reduce-scatter the second's (and the reverse in backward).

- Gradient scale: a local expert's weight gradient sums the tokens of all `ep` ranks of its EP group, but FSDP
  averages it only over the ranks holding the same experts (`efsdp`, times `dp_replicate` under HSDP), a group
  `ep` times smaller than the `dp_cp` group every dense gradient is averaged over. `apply_fsdp` therefore sets
  `grad_scale = 1 / ep`, applied to the local weights in backward, so expert and dense gradients are the same
  average in every layout (tested in tests/test_parallel_fsdp.py). Used on its own, without FSDP, the module
  leaves gradients as they are (`grad_scale = 1`): each local expert's gradient is then the sum over its EP
  group's tokens.
- Every rank runs the same collectives whatever its routing (a rank with no tokens, or whose experts receive
  nothing, still gathers, computes on empty slots and reduce-scatters), and its expert weights stay in the graph,
  so every rank runs the same backward collectives and FSDP gradient reduce-scatters.
- `apply_expert_parallel` swaps every `experts` child of the model for this module (meta or materialized);
  `reduce_expert_load` sums the per-layer expert load over all data ranks, so the sign-based router-bias update
  is identical everywhere (the router itself runs locally on each rank's tokens, over all E experts).

Shapes: T tokens, D hidden, E experts (global), K top-k, F expert FFN width, R rows received by this rank,
P padded tokens per rank.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.profiler import record_function

from moela.ops.moe import autocast_input, moe_experts, tokens_per_expert
from moela.parallel.ep_comm import (
    PROFILE_PREFIX,
    agree_max,
    all_to_all,
    finish,
    gather_start,
    host_group,
    scatter_start,
)
from moela.parallel.mesh import local_shard

DISPATCHES = ("auto", "gather", "alltoall")
PAD_TO = 256  # padded token counts are multiples of this: few distinct shapes, and two chunks of 128-row blocks


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by `scale` in backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _in_graph(y: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """y, still connected to `inputs` in autograd when the expert op left it out of the graph (the reference
    backend with no row for this rank's experts): every rank must run the same backward collectives, and give its
    expert weights a (zero) gradient for FSDP's reduce-scatter. A host-side check of autograd metadata only."""
    if y.requires_grad or not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs):
        return y
    return y + sum(t.sum() for t in inputs).to(y.dtype) * 0


class ExpertParallelExperts(nn.Module):
    """Routed experts of one MoE layer, E / ep of them on each rank of `ep_mesh`; global routing in, y out."""

    def __init__(self, num_experts: int, dim: int, ffn_dim: int, ep_mesh: DeviceMesh, *, recipe: str = "bf16",
                 backend: str = "auto", kernels: dict | None = None, dispatch: str = "auto", chunks: int = 1,
                 cpu_group=None, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        ep = ep_mesh.size()
        if num_experts % ep:
            raise ValueError(f"expert parallelism: {num_experts} routed experts cannot be split evenly over ep={ep} "
                             f"ranks; choose parallel.ep among the divisors of {num_experts}")
        if dispatch not in DISPATCHES:
            raise ValueError(f"parallel.ep_dispatch: unknown {dispatch!r}; choose one of {', '.join(DISPATCHES)}")
        if chunks not in (1, 2):
            raise ValueError(f"parallel.ep_chunks: {chunks} is not supported; use 1, or 2 to pipeline the expert "
                             f"GEMMs of one half of the tokens with the collectives of the other")
        self.num_experts, self.ep_mesh, self.recipe, self.backend = num_experts, ep_mesh, recipe, backend
        self.kernels = dict(kernels or {})  # moe_experts' kernel choices (fp8_gemm, fp8_wgrad), as the model's
        self.dispatch, self.chunks, self._cpu_group = dispatch, chunks, cpu_group
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
    def from_module(cls, experts: nn.Module, ep_mesh: DeviceMesh, **options) -> "ExpertParallelExperts":
        """Replacement for a single-process experts module (stacked `w13`, `w2`): same recipe, backend and kernels;
        this rank's slice of its weights is copied when they are materialized (left uninitialized on the meta device).
        `options`: dispatch, chunks, cpu_group."""
        w13, w2 = experts.w13, experts.w2
        e, two_f, d = w13.shape
        new = cls(e, d, two_f // 2, ep_mesh, recipe=getattr(experts, "recipe", "bf16"),
                  backend=getattr(experts, "backend", "auto"), kernels=getattr(experts, "kernels", None),
                  device=w13.device, dtype=w13.dtype, **options)
        if w13.device.type != "meta":
            lo = ep_mesh.get_local_rank() * new.num_local
            with torch.no_grad():
                local_shard(new.w13).copy_(w13[lo:lo + new.num_local])
                local_shard(new.w2).copy_(w2[lo:lo + new.num_local])
        return new

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """N(0, std) for this rank's experts (the model calls this instead of its own rule for experts), drawn
        from the current seed (the model seeds each part: `Transformer.init_weights`) mixed with this rank's shard
        coordinates, so that the ranks' experts differ from each other."""
        for w in (self.w13, self.w2):
            seed = torch.initial_seed()
            for coordinate, placement in zip(w.device_mesh.get_coordinate(), w.placements):
                if placement.is_shard():  # shards differ; replicas (HSDP) draw the same values
                    seed = seed * 65537 + coordinate + 1
            g = torch.Generator(device=w.device).manual_seed(seed % 2**63)
            w.to_local().normal_(mean=0.0, std=std, generator=g)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, local={self.num_local}, ep={self.ep_mesh.size()}, "
                f"recipe={self.recipe}, dispatch={self.dispatch}, chunks={self.chunks}")

    @property
    def cpu_group(self):
        """The gloo twin of the EP group, for the host-side token count agreement (made on first use if
        `apply_expert_parallel` did not pass one)."""
        if self._cpu_group is None:
            self._cpu_group = host_group(self.ep_mesh.get_group())
        return self._cpu_group

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        w13, w2 = local_shard(self.w13), local_shard(self.w2)  # [E_local, 2F, D], [E_local, D, F]
        if self.grad_scale != 1.0:
            w13, w2 = _ScaleGrad.apply(w13, self.grad_scale), _ScaleGrad.apply(w2, self.grad_scale)
        return w13, w2

    def gather_fits(self, padded: int, topk: int) -> bool:
        """Whether `auto` gathers P = `padded` tokens per rank: ep <= K (no more bytes than the exact exchange),
        and the expert layout's static bound (ep*P*K rows, as moela.ops.moe bounds it) within its int32 offsets."""
        ep = self.ep_mesh.size()
        rows = ep * padded * topk + self.num_local * 128
        return ep <= topk and rows * max(self.w13.shape[1], self.w13.shape[2]) < 2**31

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                shared: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Routed experts' output for x [T, D] (in moe_experts' dtype), plus `shared(x)` when given."""
        if self.dispatch != "alltoall":
            # P: the largest token count of the group rounded up, the same on every rank (host integers only)
            padded = -(-agree_max(topk_ids.shape[0], self.cpu_group) // PAD_TO) * PAD_TO
            if self.dispatch == "gather" or self.gather_fits(padded, topk_ids.shape[1]):
                return self._forward_gather(x, topk_ids, topk_weights, shared, padded)
        y = self._forward_alltoall(x, topk_ids, topk_weights)
        return y if shared is None else y + shared(x)

    def _forward_gather(self, x, topk_ids, topk_weights, shared, padded):
        t, k = topk_ids.shape
        group = self.ep_mesh.get_group()
        lo = self.ep_mesh.get_local_rank() * self.num_local
        w13, w2 = self._weights()
        rows = F.pad(autocast_input(x), (0, 0, 0, padded - t))  # [P, D] zero rows past T
        # ids ride in fp32 beside the weights (exact below 2^24): one gather; padding rows get id -1, weight 0
        meta = torch.cat([F.pad(topk_ids.float(), (0, 0, 0, padded - t), value=-1.0),
                          F.pad(topk_weights.float(), (0, 0, 0, padded - t))], 1)  # [P, 2K]
        gathers = [(gather_start(x_c, group), gather_start(m_c, group))  # every chunk's gathers issued at once
                   for x_c, m_c in zip(rows.chunk(self.chunks), meta.chunk(self.chunks))]
        extra = shared(x) if shared is not None else None  # runs while the gathers are in flight
        scatters = []
        for (xg, hx), (mg, hm) in gathers:  # chunk c's experts run while chunk c+1 gathers and chunk c-1 scatters
            xg, mg = finish(xg, hx), finish(mg, hm)  # [R, D], [R, 2K]: R = ep*P/chunks
            ids = mg[:, :k].long() - lo  # [R, K] local expert ids
            mine = (ids >= 0) & (ids < self.num_local)
            y_part = moe_experts(xg, torch.where(mine, ids, -1), torch.where(mine, mg[:, k:], 0.0), w13, w2,
                                 recipe=self.recipe, backend=self.backend, **self.kernels)  # [R, D] this rank's share
            scatters.append(scatter_start(_in_graph(y_part, xg, mg, w13, w2), group))
        done = [finish(out, handle) for out, handle in scatters]  # [P/chunks, D] each
        y = (done[0] if len(done) == 1 else torch.cat(done))[:t]  # [T, D]
        return y if extra is None else y + extra

    def _forward_alltoall(self, x, topk_ids, topk_weights):
        t, k = topk_ids.shape
        ep, e_local = self.ep_mesh.size(), self.num_local
        group = self.ep_mesh.get_group()
        w13, w2 = self._weights()
        flat_ids = topk_ids.reshape(-1)  # [T*K]
        order = torch.argsort(flat_ids, stable=True)  # [T*K] pair index, sorted by expert
        counts = tokens_per_expert(flat_ids, self.num_experts)  # [E] pairs per global expert
        recv_counts = torch.empty_like(counts)  # [ep * E_local] pairs from each source rank for each local expert
        with record_function(f"{PROFILE_PREFIX}counts"):
            dist.all_to_all_single(recv_counts, counts, group=group)
        counts_host = torch.stack([counts, recv_counts]).view(2, ep, e_local).sum(2).tolist()  # the host sync
        in_splits, out_splits = counts_host[0], counts_host[1]

        x_send = autocast_input(x)[order // k]  # [T*K, D] rows grouped by destination rank, then by expert
        x_recv = all_to_all(x_send, out_splits, in_splits, group)  # [R, D]
        local_ids = torch.arange(e_local, device=x.device).repeat(ep)  # [ep * E_local]
        local_ids = local_ids.repeat_interleave(recv_counts, output_size=x_recv.shape[0])  # [R]
        ones = torch.ones(x_recv.shape[0], 1, device=x.device, dtype=torch.float32)  # [R, 1]
        y_recv = moe_experts(x_recv, local_ids[:, None], ones, w13, w2, recipe=self.recipe, backend=self.backend,
                             **self.kernels)  # [R, D]
        y_recv = _in_graph(y_recv, x_recv, w13, w2)
        y_back = all_to_all(y_recv, in_splits, out_splits, group)  # [T*K, D] in `order`
        gate = topk_weights.reshape(-1)[order].float()  # [T*K]
        y = torch.zeros(t, x.shape[1], device=x.device, dtype=torch.float32)  # [T, D]
        y = y.index_add(0, order // k, y_back.float() * gate[:, None])
        return y.to(y_recv.dtype)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, *, dispatch: str = "auto", chunks: int = 1) -> int:
    """Replace every routed-experts module (a child named `experts` with stacked `w13` and `w2`) by its
    expert-parallel version over `ep_mesh`; returns how many were replaced. Works on meta or materialized models.
    Collective over the world when the EP group is not gloo (it makes the gloo twin for the host-side agreement)."""
    targets = [(parent, child) for parent in model.modules()
               for name, child in parent.named_children()
               if name == "experts" and isinstance(getattr(child, "w13", None), torch.Tensor)
               and isinstance(getattr(child, "w2", None), torch.Tensor)
               and not isinstance(child, ExpertParallelExperts)]
    cpu_group = host_group(ep_mesh.get_group()) if targets and dispatch != "alltoall" else None
    for parent, child in targets:
        parent.experts = ExpertParallelExperts.from_module(child, ep_mesh, dispatch=dispatch, chunks=chunks,
                                                           cpu_group=cpu_group)
    return len(targets)


def reduce_expert_load(expert_load: torch.Tensor, mesh) -> torch.Tensor:
    """Sum `expert_load [L_moe, E]` (tokens per expert, this rank's micro-batches) over every rank that routes a
    share of the global batch: the `dp_cp` view, and with tensor (sequence) parallelism, whose ranks route
    different rows of one micro-batch, every rank of the pipeline stage. Each rank then applies the same
    router-bias update. In place; returns it."""
    if mesh.size("tp") > 1:  # every rank of the pipeline stage (the world without pipeline parallelism)
        dist.all_reduce(expert_load, group=mesh.group("stage"))
    elif (group := mesh.group("dp_cp")) is not None:
        dist.all_reduce(expert_load, group=group)
    return expert_load
