"""Tensor parallelism with sequence parallelism over the mesh's `tp` ranks, applied from outside the model.

`apply_tensor_parallel(model, tp_mesh)` shards the projections with torch's DTensor parallel styles and fills the
model's declared seams. What each rank holds and computes (T tokens of the micro-batch, padded to a multiple of
tp; "rows" = this rank's T / tp consecutive tokens):
- Residual stream, norms, MoE router and routed experts: this rank's rows only (sequence parallelism). Their
  weights are replicated over tp; each rank's weight gradient covers its rows, and the FSDP unit holding them
  all-reduces those gradients over tp once per step (`moela.parallel.fsdp`).
- MLA split by heads (Megatron-Core's scheme): `wq_a` / `q_norm`, `wkv_a` / `kv_norm` run on this rank's rows
  and the small latents [q input | c_kv | k_pe] are all-gathered in ONE collective (not the hidden states, except
  for the q input of models without q compression, which is the hidden state); `wq`/`wq_b` and `wkv_b` are
  column-parallel (this rank's heads), attention runs on all tokens with those heads, `wo` is row-parallel and
  returns a partial sum. Layer-wise QK-Norm normalizes over all heads by exchanging per-token scalars only
  (`moela.ops.qk_norm`); its weights are sharded with the heads.
- Dense MLP and shared experts: input all-gathered, `w1` / `w3` column-parallel, `w2` row-parallel (partial sum).
  Routed experts keep expert parallelism (expert-TP = 1): they see this rank's rows, and their output enters the
  block's partial sum on those rows (zeros elsewhere).
- Each block completes its partial sums with a reduce-scatter back to rows (`Block.sum_partials`): two per
  standard or FAL+ block, ONE per FAL block (attention and MLP summed first).
- Embedding and output head split by vocabulary: the embedding's partial lookups are reduce-scattered to rows; the
  loss all-gathers the final hidden states and runs the vocabulary-parallel cross-entropy
  (`moela.parallel.vocab_parallel`): no rank holds a full row of logits.
Communication per block and micro-batch, forward (the backward mirrors it: all-gather <-> reduce-scatter):
all-gather of the latents, all-gather of the MLP input, and one reduce-scatter per partial sum; layer QK-Norm adds
one all-reduce of T x 2 float32 each way.

The batch: `TensorParallel.split` pads the (context-parallel part of the) batch to a multiple of tp with tokens
appended to its last document (input 0, no label, not counted by the MoE statistics, never attended by a real token
under causal attention; under context parallelism they are stripped before the context-parallel attention), and
tells the model which rows are this rank's. Every rank of a tp group holds the same micro-batch and computes the
same loss; the sums of MoE statistics and the z-loss's mean over heads go through all-reduces whose backward is
the identity (the loss is replicated, so each rank's copy already carries the full upstream gradient).

Parameter names never change and sharded parameters are DTensors, so checkpoints stay layout-free.

Shapes: T tokens (padded), D hidden, H heads, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from moela.batch import IGNORE_INDEX, PackedBatch
from moela.model.layers import BatchPart, attend_locally
from moela.model.moe import MoE
from moela.ops.collectives import gather_tokens, reduce_scatter_single
from moela.ops.loss import cross_entropy
from moela.ops.qk_norm import qk_rms_norm, qk_rms_norm_allgather
from moela.parallel.config import tensor_parallel_errors
from moela.parallel.fsdp import transformer_blocks
from moela.parallel.mesh import local_shard
from moela.parallel.vocab_parallel import vocab_parallel_cross_entropy


class _SumFromGroup(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward: for values every rank of the group then uses alike in
    its (replicated) loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


# ----- the seams each module gets ---------------------------------------------------------------------------------
class GatherLatents:
    """`MLA.gather_latents`: this rank's rows of (q input, c_kv, k_pe) -> all rows, in one all-gather. q input and
    c_kv come back as replicated DTensors (the column-parallel projections' inputs; the backward reduce-scatters
    their partial gradients), k_pe as a plain tensor whose gradient is marked partial (this rank's heads only)."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh

    def __call__(self, q_in: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor):
        parts = (q_in, c_kv, k_pe)
        rows = torch.cat([p.to(torch.result_type(q_in, c_kv)) for p in parts], dim=-1)  # [T/tp, Q + C + R]
        full = DTensor.from_local(rows, self.mesh, [Shard(0)], run_check=False).redistribute(self.mesh,
                                                                                           [Replicate()])
        q_in, c_kv, k_pe = (piece.to(p.dtype) for piece, p in zip(full.split([p.shape[-1] for p in parts], -1),
                                                                   parts))  # [T, Q], [T, C], [T, R]
        return q_in, c_kv, k_pe.to_local(grad_placements=[Partial()])


class _ReduceScatterRows(torch.autograd.Function):
    """Partial sums [T, ...] -> the total's rows of this rank [T / tp, ...] (reduce-scatter); backward: all-gather
    of the rows' gradients (every rank's partial sum receives the whole gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((x.shape[0] // dist.get_world_size(group),) + tuple(x.shape[1:]))
        reduce_scatter_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_tokens(grad, ctx.group), None


class SumPartials:
    """`Block.sum_partials`: the sublayers' partial sums [T, D] (DTensors, Partial) -> their total on this rank's
    rows [T / tp, D]: one reduce-scatter however many sublayers are summed."""

    def __init__(self, mesh: DeviceMesh):
        self.group = mesh.get_group()

    def __call__(self, *outputs: DTensor) -> torch.Tensor:
        total = outputs[0].to_local(grad_placements=[Replicate()])  # [T, D]
        for out in outputs[1:]:
            total = total + out.to_local(grad_placements=[Replicate()])
        return _ReduceScatterRows.apply(total, self.group)  # [T / tp, D]


class GroupQKNorm:
    """`MLA.layer_qk_norm` over the heads of the whole tp group: per-token statistics exchanged, not q / k (or,
    with `allgather`, the standard formulation that gathers q and k, kept for comparisons)."""

    def __init__(self, group, allgather: bool = False):
        self.group, self.allgather = group, allgather

    def __call__(self, q, k, q_weight, k_weight, eps):
        if self.allgather:
            return qk_rms_norm_allgather(q, k, local_shard(q_weight), local_shard(k_weight), eps, self.group)
        return qk_rms_norm(q, k, local_shard(q_weight), local_shard(k_weight), eps, group=self.group)


class RowsToPartial(ParallelStyle):
    """For the routed experts (`experts(x, topk_ids, topk_weights, shared=)` -> routed + shared(x)): the routed
    output, computed on this rank's rows [T / tp, D], becomes this rank's term of a partial sum [T, D] (zeros on
    the other ranks' rows), and the shared experts' output - a partial sum already (column/row-parallel) - is added
    to it, so the block completes both with its one reduction. The module gets `shared=None` and the hooks add
    the shared experts after it (their overlap with expert-parallel collectives is given up under tp > 1)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        pending: dict[str, nn.Module | None] = {}

        def take_shared(mod, args, kwargs):
            pending["shared"] = kwargs.pop("shared", None) if len(args) < 4 else args[3]
            return args[:3], kwargs

        def to_partial(mod, args, kwargs, output):
            tp, rank, rows = device_mesh.size(), device_mesh.get_local_rank(), output.shape[0]
            full = F.pad(output, (0, 0, rank * rows, (tp - 1 - rank) * rows))  # [T, D]
            partial = DTensor.from_local(full, device_mesh, [Partial()], run_check=False)
            shared = pending.pop("shared", None)
            return partial if shared is None else partial + shared(args[0])

        module.register_forward_pre_hook(take_shared, with_kwargs=True)
        module.register_forward_hook(to_partial, with_kwargs=True)
        return module


class ShardParameters(ParallelStyle):
    """Parameters sharded on `dim` (no hooks: the module's owner reads them), e.g. layer QK-Norm weights."""

    def __init__(self, dim: int = 0):
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param, device_mesh, [Shard(self.dim)]),
                                   requires_grad=param.requires_grad)
            module.register_parameter(name, sharded)
        return module


def _mlp_plan(prefix: str) -> dict[str, ParallelStyle]:
    return {prefix: PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)),
            f"{prefix}.w1": ColwiseParallel(), f"{prefix}.w3": ColwiseParallel(),
            f"{prefix}.w2": RowwiseParallel(output_layouts=Partial(), use_local_output=False)}


def block_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    attn = block.attn
    plan: dict[str, ParallelStyle] = {
        "attn.wq" if attn.q_lora_rank is None else "attn.wq_b": ColwiseParallel(),
        "attn.wkv_b": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
    }
    if attn.qk_norm_kind == "layer":
        plan.update({"attn.q_qk_norm": ShardParameters(), "attn.k_qk_norm": ShardParameters()})
    if isinstance(block.ffn, MoE):
        plan["ffn.experts"] = RowsToPartial()
        if block.ffn.shared_experts is not None:
            plan.update(_mlp_plan("ffn.shared_experts"))
    else:
        plan.update(_mlp_plan("ffn"))
    return plan


# ----- the model-level seam ---------------------------------------------------------------------------------------
class _StripPadding:
    """`PackedContext.attend` of a padded batch whose attention another wrapper (context parallelism) applies to
    the unpadded tokens: it sees those, the padding rows get zeros."""

    def __init__(self, attend, tokens: int):
        self.attend, self.tokens = attend, tokens

    def __call__(self, attention, q, k, v, cu_seqlens, max_seqlen, **kwargs):
        t, pad = self.tokens, q.shape[0] - self.tokens
        res = self.attend(attention, q[:t], k[:t], v[:t], cu_seqlens, max_seqlen, **kwargs)
        if kwargs.get("return_lse"):
            out, lse = res  # [T, H, Dv], [H, T]
            return F.pad(out, (0, 0, 0, 0, 0, pad)), F.pad(lse, (0, pad))
        return F.pad(res, (0, 0, 0, 0, 0, pad))


def pad_batch(batch: PackedBatch, pad: int) -> PackedBatch:
    """`batch` with `pad` tokens appended to its last document: input 0, label IGNORE_INDEX, positions continuing.
    `max_seqlen` grows by `pad` (an upper bound of the last document's new length, known without a device read)."""
    dev = batch.input_ids.device
    position_ids = torch.cat((batch.position_ids, batch.position_ids[-1:] + 1 + torch.arange(
        pad, device=dev, dtype=batch.position_ids.dtype)))  # [T + pad]
    cu = batch.cu_seqlens.clone()
    cu[-1] += pad
    return PackedBatch(input_ids=F.pad(batch.input_ids, (0, pad)),
                       labels=F.pad(batch.labels, (0, pad), value=IGNORE_INDEX), position_ids=position_ids,
                       cu_seqlens=cu, max_seqlen=batch.max_seqlen + pad, targets_on_host=batch.targets_on_host)


class TensorParallel(nn.Module):
    """`Transformer.tensor_parallel`: pads and sequence-shards every batch, the vocabulary-parallel loss and the
    z-loss's mean over heads (module docstring). Holds no parameters."""

    def __init__(self, mesh: DeviceMesh, vocab_size: int):
        super().__init__()
        self.mesh, self.group = mesh, mesh.get_group()
        self.size, self.rank = mesh.size(), mesh.get_local_rank()
        self.vocab_start = self.rank * vocab_size // self.size
        self._tokens = 0  # unpadded tokens of the batch being processed (to return its logits unpadded)

    def extra_repr(self) -> str:
        return f"tp={self.size}, rank={self.rank}"

    def split(self, batch: PackedBatch, mtp_targets: list[tuple[torch.Tensor, torch.Tensor]],
              part: BatchPart | None) -> BatchPart:
        t = batch.num_tokens
        pad = -t % self.size
        self._tokens = t
        real = (torch.ones(t, dtype=torch.bool, device=batch.input_ids.device) if part is None
                else part.real_tokens)  # [T]
        attend = attend_locally if part is None else part.attend
        if pad:
            batch = pad_batch(batch, pad)
            mtp_targets = [(F.pad(tok, (0, pad)), F.pad(lab, (0, pad), value=IGNORE_INDEX)) for tok, lab in mtp_targets]
            real = F.pad(real, (0, pad), value=False)
            if part is not None:
                attend = _StripPadding(attend, t)
        rows = (t + pad) // self.size
        mine = slice(self.rank * rows, (self.rank + 1) * rows)
        outer = None if part is None else part.reduce_doc_stats

        def reduce_doc_stats(stats: torch.Tensor) -> torch.Tensor:
            stats = _SumFromGroup.apply(stats, self.group)
            return stats if outer is None else outer(stats)

        return BatchPart(batch=batch, mtp_targets=mtp_targets, attend=attend, real_tokens=real[mine],
                         reduce_doc_stats=reduce_doc_stats, rows=mine)

    def ce_sum(self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, want_logits: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's rows of the normalized hidden states h [T / tp, D] and its rows of the head (a DTensor)
        -> (summed CE over every token, and the full logits [T_unpadded, V] if asked)."""
        full = gather_tokens(h, self.group)  # [T, D]
        w = local_shard(weight)  # [V / tp, D]
        if want_logits:
            local = full @ w.t()  # [T, V / tp]
            logits = DTensor.from_local(local, self.mesh, [Shard(1)], run_check=False).full_tensor()  # [T, V]
            return cross_entropy(logits, labels), logits[:self._tokens]
        return vocab_parallel_cross_entropy(full, w, labels, self.vocab_start, self.group), None

    def head_mean(self, z: torch.Tensor) -> torch.Tensor:
        """A mean over this rank's heads -> the mean over all heads (every rank holds as many)."""
        return _SumFromGroup.apply(z, self.group) / self.size


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> TensorParallel:
    """Shard `model` (meta or materialized) over `tp_mesh` and attach the seams (module docstring); returns the
    attached `TensorParallel`."""
    if not hasattr(model, "tensor_parallel"):
        raise ValueError(f"{type(model).__name__} has no `tensor_parallel` seam; tensor parallelism wraps a moela "
                         f"Transformer")
    tp = tp_mesh.size()
    errors = tensor_parallel_errors(model.cfg, tp)
    if errors:
        raise ValueError("tensor parallelism cannot split this model:\n  " + "\n  ".join(errors))
    group = tp_mesh.get_group()
    root = {}
    if model.embed is not None:  # a pipeline stage holds the embedding or not (moela.parallel.pp_stage)
        root["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    if model.head is not None:
        root["head"] = ColwiseParallel(input_layouts=Shard(0), output_layouts=Replicate())
    parallelize_module(model, tp_mesh, root)
    for block in transformer_blocks(model):
        parallelize_module(block, tp_mesh, block_plan(block))
        block.attn.n_heads = block.attn.n_heads // tp
        block.attn.gather_latents = GatherLatents(tp_mesh)
        block.attn.layer_qk_norm = GroupQKNorm(group)
        block.sum_partials = SumPartials(tp_mesh)
    model.tensor_parallel = TensorParallel(tp_mesh, model.cfg.vocab_size)
    return model.tensor_parallel
