"""Context parallelism: a micro-batch's documents are split over the `cp` ranks of a group; attention all-gathers
keys and values and each rank attends with its own queries.

Decisions:
- Partitioning is `moela.parallel.cp_plan` (DualChunkSwap by default, or striped); every rank builds the same plan
  from the batch, without communication.
- Attention: K and V of the local tokens are concatenated and all-gathered in one collective (rank-major); the
  backward of that gather reduce-scatters dK/dV, so each rank ends with the full gradient of its own keys and
  values. Each "pass" of the plan is one call of the layer's attention op (`mla_attention`) with separate
  cu_seqlens_q / cu_seqlens_k and bottom-right causal alignment; several passes (striped) are merged exactly
  through their log-sum-exp, which is also what is returned when the z-loss asks for it.
- The model is changed from the outside only through its declared seam: `apply_context_parallel` attaches a
  `ContextParallel` module as `model.context_parallel`, and the model hands it every batch
  (`split(batch, mtp_targets) -> BatchPart`): this rank's tokens plus the `PackedContext` seams (the all-gather
  attention, the real-token mask, the sum of per-document statistics over the group). RoPE needs nothing: the
  local batch carries the tokens' original `position_ids`.
- Loss: each CP rank is treated like a data-parallel rank holding part of the micro-batch: the model returns the
  token-mean over this rank's labelled tokens and their count (`num_targets`), and its metrics and `expert_load`
  over this rank's tokens. Weighting by num_targets / (labelled tokens of the micro-batch) and summing over the
  group (loss, metrics, parameter gradients - e.g. FSDP over dp_shard x cp) gives the single-process values, so
  the trainer's usual weighting works unchanged as long as it counts the step's labelled tokens once per
  micro-batch (sum over the `dp` ranks: the ranks of a CP group share micro-batches). No collective runs here
  beyond the attention's (and the balance loss's, below). Padding tokens (at most 2*cp-1 per document) are
  routed through the experts like the others but left out of `expert_load` (`PackedContext.real_tokens`), so
  the summed load, hence the router-bias update, equals the single-process one.
- Multi-token prediction: a token's successors may sit on another rank, so the model computes the shifted MTP
  inputs and labels on the whole batch (`moela.model.transformer.mtp_targets`) and they are sharded like the
  tokens.
- The sequence-wise balance loss needs per-document statistics (tokens routed to each expert, mean router
  probabilities, document length) over the whole document: each MoE's `balance_loss` counts real (non-padding)
  tokens only and sums the statistics over the group with a differentiable all-reduce
  (`PackedContext.reduce_doc_stats`) before the same formula, so that term is exact too.

Shapes: T_loc local tokens, H heads, Dqk / Dv head dims.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from moela.batch import IGNORE_INDEX, PackedBatch
from moela.model.layers import BatchPart
from moela.ops.collectives import gather_tokens
from moela.ops.small_all_reduce import sum_over_ranks
from moela.parallel.cp_plan import AttentionPass, attention_passes, make_plan, shard_batch, shard_tokens


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


class CPAttention:
    """`PackedContext.attend` of one rank's part of a batch: `cp_attention` with the batch's passes."""

    def __init__(self, passes: list[AttentionPass], group, local_tokens: int):
        self.passes, self.group, self.local_tokens = passes, group, local_tokens

    def __call__(self, attention, q, k, v, cu_seqlens, max_seqlen, *, causal=True, softmax_scale=None,
                 return_lse=False):
        if q.shape[0] != self.local_tokens:
            raise RuntimeError(f"context parallel attention got {q.shape[0]} tokens but the batch's plan gives "
                               f"this rank {self.local_tokens}; call it through the model's forward, which "
                               f"splits the batch")
        return cp_attention(q, k, v, self.passes, self.group, attention, causal=causal, softmax_scale=softmax_scale,
                            return_lse=return_lse)


class ContextParallel(nn.Module):
    """Splits every batch of the model it is attached to over the ranks of `group` (all ranks of the group see
    the same batch); holds no parameters."""

    def __init__(self, group=None, layout: str = "dualchunk"):
        super().__init__()
        self.group = group if group is not None else dist.group.WORLD
        self.cp_size = dist.get_world_size(self.group)
        self.cp_rank = dist.get_rank(self.group)
        self.layout = layout

    def extra_repr(self) -> str:
        return f"cp={self.cp_size}, rank={self.cp_rank}, layout={self.layout}"

    def split(self, batch: PackedBatch, mtp_targets: list[tuple[torch.Tensor, torch.Tensor]]) -> BatchPart:
        """This rank's part of `batch`, of its MTP targets (per depth, computed on the whole batch) and the
        context seams that make its layers compute what they would on the whole batch."""
        plan = make_plan(batch.cu_seqlens, self.cp_size, self.layout)
        rank = self.cp_rank
        targets = [(shard_tokens(tokens, plan, rank, 0), shard_tokens(labels, plan, rank, IGNORE_INDEX))
                   for tokens, labels in mtp_targets]
        return BatchPart(batch=shard_batch(batch, plan, rank), mtp_targets=targets,
                         attend=CPAttention(attention_passes(plan, rank), self.group, plan.local_tokens),
                         real_tokens=plan.local_source(rank, batch.input_ids.device) >= 0,
                         reduce_doc_stats=self.sum_over_group)

    def sum_over_group(self, stats: torch.Tensor) -> torch.Tensor:
        """Differentiable sum of per-document statistics over the group."""
        return sum_over_ranks(stats, self.group)


def apply_context_parallel(model: nn.Module, group=None, layout: str = "dualchunk") -> ContextParallel:
    """Attach context parallelism over `group` to `model`: from then on `model(batch)` runs on this rank's part
    of the batch (module docstring). Returns the attached module."""
    if not hasattr(model, "context_parallel"):
        raise ValueError(f"{type(model).__name__} has no `context_parallel` seam; context parallelism wraps a "
                         f"moela Transformer")
    model.context_parallel = ContextParallel(group, layout)
    return model.context_parallel
