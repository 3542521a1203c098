"""Context parallelism: a micro-batch's documents are split over the `cp` ranks of a group; attention all-gathers
keys and values and each rank attends with its own queries.

Decisions:
- Partitioning is `moela.data.cp` (DualChunkSwap by default, or striped); every rank builds the same plan from the
  batch, without communication.
- Attention: K and V of the local tokens are concatenated and all-gathered in one collective (rank-major); the
  backward of that gather reduce-scatters dK/dV, so each rank ends with the full gradient of its own keys and
  values. Each "pass" of the plan is one `mla_attention` call with separate cu_seqlens_q / cu_seqlens_k and
  bottom-right causal alignment; several passes (striped) are merged exactly through their log-sum-exp, which is
  also what is returned when the z-loss asks for it.
- The model is wrapped from the outside: `ContextParallel` replaces `core_attention` on every module that has it
  (the attention modules of the blocks and of the MTP heads). RoPE needs nothing: the local batch carries the
  tokens' original `position_ids`.
- Loss: each CP rank is treated like a data-parallel rank holding part of the micro-batch: the model returns the
  token-mean over this rank's labelled tokens and their count (`num_targets`), and its metrics and `expert_load`
  over this rank's tokens. Weighting by num_targets / (labelled tokens of the micro-batch) and summing over the
  group (loss, metrics, parameter gradients - e.g. FSDP over dp_shard x cp) gives the single-process values, so
  the trainer's usual weighting works unchanged as long as it counts the step's labelled tokens once per
  micro-batch (sum over the `dp` ranks: the ranks of a CP group share micro-batches). No collective runs here
  beyond the attention's (and the balance loss's, below). Padding tokens (at most 2*cp-1 per document) are
  routed through the experts like the others but left out of `expert_load` (each MoE gets this rank's real-token
  mask, `MoE.real_tokens`), so the summed load, hence the router-bias update, equals the single-process one.
- Multi-token prediction: a token's successors may sit on another rank, so the shifted MTP inputs and labels are
  computed on the whole batch and sharded like the tokens (`Transformer.forward(..., mtp_targets=)`).
- The sequence-wise balance loss needs per-document statistics (tokens routed to each expert, mean router
  probabilities, document length) over the whole document: each MoE's `balance_loss` counts real (non-padding)
  tokens only and sums the statistics over the group with a differentiable all-reduce (`MoE.reduce_balance_stats`)
  before the same formula, so that term is exact too.

Shapes: T_loc local tokens, H heads, Dqk / Dv head dims.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moela.batch import IGNORE_INDEX, PackedBatch
from moela.data.cp import AttentionPass, CPPlan, attention_passes, make_plan, shard_batch, shard_tokens
from moela.model.moe import MoE
from moela.model.transformer import shift_within_docs

# torch >= 2.13 names the single-tensor collectives *_single and deprecates the older names; same signatures
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 (rank-major) in forward; reduce-scatter (sum) of the gradient in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))  # [cp*T_loc, ...]
        _all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // world,) + tuple(grad.shape[1:]))  # [T_loc, ...]
        _reduce_scatter_single(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward is the all-reduce (sum) of the gradients: every rank's loss uses the sum."""

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


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """[T_loc, ...] on each rank -> [cp*T_loc, ...] rank-major on every rank, differentiable."""
    return _GatherTokens.apply(x, group)


def cp_attention(q, k, v, passes: list[AttentionPass], group, attention, *, causal=True, softmax_scale=None,
                 return_lse=False):
    """q [T_loc, H, Dqk], k [T_loc, H, Dqk], v [T_loc, H, Dv] (this rank's tokens) -> out [T_loc, H, Dv]
    (and lse [H, T_loc] float32). `attention` has `mla_attention`'s signature."""
    if not causal:
        raise ValueError("context parallel attention supports causal attention only (documents are cut in chunks)")
    kv = gather_tokens(torch.cat((k, v), dim=-1), group)  # [cp*T_loc, H, Dqk + Dv]
    return attend_passes(q, kv, passes, attention, softmax_scale=softmax_scale, return_lse=return_lse)


def attend_passes(q, kv, passes: list[AttentionPass], attention, *, softmax_scale=None, return_lse=False):
    """Local queries q [T_loc, H, Dqk] against the gathered keys|values kv [cp*T_loc, H, Dqk + Dv]: one
    `attention` call per pass, merged by log-sum-exp -> out [T_loc, H, Dv] (and lse [H, T_loc] float32)."""
    dqk = q.shape[-1]
    dev = q.device
    outs, lses = [], []
    for p in passes:
        kv_p = kv.index_select(0, p.k_index.to(dev))  # [Tk, H, Dqk + Dv]
        q_p = q if p.q_index is None else q.index_select(0, p.q_index.to(dev))  # [Tq, H, Dqk]
        k_p, v_p = kv_p.split([dqk, kv_p.shape[-1] - dqk], dim=-1)  # [Tk, H, Dqk], [Tk, H, Dv]
        out, lse = attention(q_p, k_p.contiguous(), v_p.contiguous(), p.cu_seqlens_q.to(dev), p.max_seqlen_q,
                             cu_seqlens_k=p.cu_seqlens_k.to(dev), max_seqlen_k=p.max_seqlen_k, causal=True,
                             softmax_scale=softmax_scale, return_lse=True)
        outs.append(out)
        lses.append(lse)
    if len(passes) == 1 and passes[0].q_index is None:
        return (outs[0], lses[0]) if return_lse else outs[0]
    t, h = q.shape[:2]
    full_out, full_lse = [], []
    for p, out, lse in zip(passes, outs, lses):
        if p.q_index is None:
            full_out.append(out.float())
            full_lse.append(lse.float())
        else:
            idx = p.q_index.to(dev)
            full_out.append(out.new_zeros((t,) + tuple(out.shape[1:]), dtype=torch.float32).index_copy(
                0, idx, out.float()))  # [T_loc, H, Dv]
            full_lse.append(lse.new_full((h, t), float("-inf"), dtype=torch.float32).index_copy(
                1, idx, lse.float()))  # [H, T_loc]
    lse_all = torch.stack(full_lse)  # [P, H, T_loc]
    lse_tot = torch.logsumexp(lse_all, dim=0)  # [H, T_loc]
    w = torch.exp(lse_all - lse_tot).permute(0, 2, 1).unsqueeze(-1)  # [P, T_loc, H, 1]
    out = (w * torch.stack(full_out)).sum(0).to(q.dtype)  # [T_loc, H, Dv]
    return (out, lse_tot) if return_lse else out


class _CPCoreAttention:
    """Drop-in for a module's `core_attention` that runs `cp_attention` with the wrapper's current plan."""

    def __init__(self, owner: "ContextParallel", attention):
        self.owner = owner
        self.attention = attention

    def __call__(self, q, k, v, cu_seqlens, max_seqlen, *, causal=True, softmax_scale=None, return_lse=False,
                 **kwargs):
        passes = self.owner.current_passes()
        if q.shape[0] != self.owner.plan.local_tokens:
            raise RuntimeError(f"context parallel attention got {q.shape[0]} tokens but the current plan gives "
                               f"this rank {self.owner.plan.local_tokens}; run the model through "
                               f"ContextParallel.forward (or shard()) with the same batch")
        return cp_attention(q, k, v, passes, self.owner.group, self.attention, causal=causal,
                            softmax_scale=softmax_scale, return_lse=return_lse)


class ContextParallel:
    """Context parallelism for `model` over process group `group` (all ranks of the group see the same batch)."""

    def __init__(self, model: torch.nn.Module, group=None, layout: str = "dualchunk"):
        self.model = model  # what `forward` calls on the local batch (a wrapper may swap in the original forward)
        self.mtp_depth = len(getattr(model, "mtp", ()))
        self.group = group if group is not None else dist.group.WORLD
        self.cp_size = dist.get_world_size(self.group)
        self.cp_rank = dist.get_rank(self.group)
        self.layout = layout
        self.plan: CPPlan | None = None
        self._passes: list[AttentionPass] | None = None
        self._real: torch.Tensor | None = None
        wrapped = 0
        for module in model.modules():
            attention = getattr(module, "core_attention", None)
            if attention is not None and not isinstance(attention, _CPCoreAttention):
                module.core_attention = _CPCoreAttention(self, attention)
                wrapped += 1
        for module in model.modules():
            if isinstance(module, MoE):  # balance statistics and expert load over real tokens, whole documents
                module.real_tokens = self.real_tokens
                module.reduce_balance_stats = self._sum_balance_stats
        if wrapped == 0:
            raise ValueError("ContextParallel found no module with a `core_attention` attribute in the model; "
                             "wrap a moela Transformer (its attention modules expose that hook)")

    def current_passes(self) -> list[AttentionPass]:
        if self._passes is None:
            raise RuntimeError("context parallel attention ran before a batch was sharded; call "
                               "ContextParallel.forward(batch) instead of model(batch)")
        return self._passes

    def shard(self, batch: PackedBatch) -> PackedBatch:
        """Plan the batch for the group and return this rank's part (also arms the attention modules)."""
        self.plan = make_plan(batch.cu_seqlens, self.cp_size, self.layout)
        self._passes = attention_passes(self.plan, self.cp_rank)
        self._real = None
        return shard_batch(batch, self.plan, self.cp_rank)

    def real_tokens(self, device) -> torch.Tensor:
        """[T_loc] bool: this rank's tokens that are not CP padding."""
        if self._real is None or self._real.device != torch.device(device):
            self._real = self.plan.local_source(self.cp_rank, device) >= 0
        return self._real

    def _sum_balance_stats(self, stats: torch.Tensor) -> torch.Tensor:
        return _SumOverGroup.apply(stats, self.group)

    def mtp_targets(self, batch: PackedBatch) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per MTP depth, this rank's (input token, label): shifted within documents on the whole batch first,
        since a token's successors may live on another rank."""
        depth = self.mtp_depth
        if depth == 0:
            return None
        doc_last = torch.zeros(batch.num_tokens, dtype=torch.bool, device=batch.input_ids.device)
        doc_last[(batch.cu_seqlens[1:] - 1).long()] = True  # [T]
        tokens, labels, out = batch.input_ids, batch.labels, []
        for _ in range(depth):
            tokens = shift_within_docs(tokens, doc_last, 0)  # [T]
            labels = shift_within_docs(labels, doc_last, IGNORE_INDEX)  # [T]
            out.append((shard_tokens(tokens, self.plan, self.cp_rank, 0),
                        shard_tokens(labels, self.plan, self.cp_rank, IGNORE_INDEX)))
        return out

    def forward(self, batch: PackedBatch, **kwargs):
        """Run the model on this rank's part of `batch`; its `ModelOutput` is the local token-mean loss with the
        local `num_targets` (see the module docstring for how the group's outputs combine)."""
        local = self.shard(batch)
        return self.model(local, mtp_targets=self.mtp_targets(batch), **kwargs)

    __call__ = forward
