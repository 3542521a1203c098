"""`ReplicateReducer`: the gradient reduction over `dp_replicate` that `parallel.replicate_compression: powersgd`
takes over from HSDP, with PowerSGD compression (`moela.parallel.powersgd`) and error feedback.

Why FSDP2 shards over the shard group only under compression: in torch 2.11 and 2.13 FSDP2's HSDP all-reduce
cannot be replaced by a compressed one. `set_requires_all_reduce(False)` skips it but keeps the reduce-scatter's
output inside FSDP (summed into its private partial-gradient buffer for the next backward) and writes no
`.grad`; `set_all_reduce_hook` runs after HSDP's all-reduce, not instead of it. So under compression every FSDP
unit is sharded over `dp_shard_cp` alone (one 1-D mesh per replica group: the reduce-scatter inside it stays
FSDP's, exact), and this reducer averages the sharded gradients over `dp_replicate` after the backward of the
step's last micro-batch, before clipping: clipping and the non-finite check see the decompressed gradient, and
gradient accumulation compresses once per step. The replicas start from replica 0's weights (broadcast here) and
stay equal because they apply the same averaged gradient.

Decisions:
- Per step: one all-reduce of every P together with the uncompressed tensors (1-D, small matrices), one of every
  Q; a warmup step (`powersgd_warmup_steps`) all-reduces every gradient whole. Collectives go in buckets of at
  most BUCKET_BYTES, so the flat copies stay small next to the gradients. The reduction runs after the backward,
  not overlapped with it as HSDP's all-reduce is: compression pays where the link between nodes is slow enough
  that its bytes, not the backward, bound the step.
- The vocabulary matrices (embedding tables and the output head, `vocabulary_parameters`) are sent whole. Their
  gradients are sums of one independent row per token of the step (the embedding's is row-sparse: only the rows
  of the step's tokens are nonzero), so a rank-r approximation sends a small, dense share of them and the error
  feedback holds the rest back for many steps; AdamW normalizes every element by its own history, so the held-back
  rows train late rather than slowly: on a small model about half of the loss gap compression opens. Whole, they
  cost 2 V D / dp_shard numbers a step: a large share on a tiny model, under 3% of DeepSeek-V2-Lite's gradient
  and 0.3% of V3's.
- Exact warmup: AdamW's second moment is built from the first steps' gradients, which are the largest and change
  fastest; by default the first `schedule.warmup_steps` steps all-reduce exactly, so it starts from exact ones.
- Routed experts under expert parallelism are sharded over `efsdp` and reduced here over the same `dp_replicate`
  ranks, compressed per expert (see `moela.parallel.powersgd`): they are most of an MoE's gradient bytes.
- State, per rank: the error feedback of each compressed tensor (fp32, the local shard's size) and its Q (the
  mean over the replicate group, so equal across it), plus the step count; `state_dict` holds plain tensors keyed
  by the global rank (the error feedback is this rank's own), saved with the model through DCP.
- A column of P that Gram-Schmidt drops (dependent on the others: the gradient's rank was below r this step)
  leaves a zero column in Q, which would stay zero at every later step; it restarts from the first Q's column
  (the same on every rank of the group, as the dropped columns are).
- A non-finite value in one replica's gradient of a tensor makes that tensor's reduced gradient non-finite on
  every rank of the replicate group (the trainer then skips the step): its Q keeps its previous value and its
  error feedback is zeroed (restoring it exactly would need a second copy of every compressed gradient; the
  unsent residual is dropped once instead).
- A parameter without a gradient on this rank (unused by all its micro-batches) is reduced as zeros, since every
  replica must hand in the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from moela.parallel.config import ParallelConfig
from moela.parallel.mesh import ParallelMesh, local_shard
from moela.parallel.powersgd import MIN_COMPRESSION, initial_q, matrix_shape, orthogonalize_

BUCKET_BYTES = 64 << 20


def _all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    """Sum each tensor over `group` in place, through flat buckets of at most BUCKET_BYTES (a larger tensor alone)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors + [None]:
        if bucket and (t is None or size + t.numel() * t.element_size() > BUCKET_BYTES):
            if len(bucket) == 1 and bucket[0].is_contiguous():
                dist.all_reduce(bucket[0], group=group)
            else:
                flat = torch.cat([b.reshape(-1) for b in bucket])
                dist.all_reduce(flat, group=group)
                torch._foreach_copy_(bucket, [f.view_as(b) for f, b in zip(flat.split([b.numel() for b in bucket]),
                                                                             bucket)])
            bucket, size = [], 0
        if t is not None:
            bucket.append(t)
            size += t.numel() * t.element_size()


def vocabulary_parameters(model: nn.Module) -> set[int]:
    """The ids of the parameters PowerSGD sends whole although they are large matrices: the embedding tables' and
    the output head's weights, one row per vocabulary entry (see the module docstring)."""
    head = getattr(model, "head", None)
    tables = [m for m in model.modules() if isinstance(m, nn.Embedding)] + ([head] if head is not None else [])
    return {id(m.weight) for m in tables}


@dataclass
class _ShapeGroup:
    """The compressed tensors whose matrices share (n, m, r), stacked along the batch: one bmm, one Gram-Schmidt for
    all of them (a model repeats its shapes in every layer), so the work per step is a few kernels per shape and
    one per tensor, not dozens per tensor."""

    n: int
    m: int
    r: int
    members: list[tuple[int, int, int]]  # (parameter index, first matrix, matrices) in the stacks below
    error: torch.Tensor  # [B, n, m] fp32: error feedback; during reduce() the error-fed gradient M
    q: torch.Tensor  # [B, m, r] fp32
    first_q: torch.Tensor  # [B, m, r] fp32: refills Q's dead columns

    @property
    def key(self) -> str:
        return f"{self.n}x{self.m}r{self.r}"


class ReplicateReducer:
    """Averages the gradients of `model` over `mesh`'s dp_replicate ranks with PowerSGD of rank `rank` after
    `warmup_steps` exact steps (module docstring). `reduce()` once per optimizer step, after the backward of its
    last micro-batch; its return is the step's byte counts for the metrics. `errors`, `qs`, `first_qs`: each
    compressed parameter's [B, n, m] / [B, m, r] views into its shape group's stacks."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, *, rank: int, warmup_steps: int,
                 min_compression: float = MIN_COMPRESSION, seed: int = 0):
        self.group = mesh.group("dp_replicate")
        self.size = mesh.size("dp_replicate")
        self.global_rank = dist.get_rank()
        self.warmup_steps = warmup_steps
        self.steps = torch.zeros((), dtype=torch.int64)  # on the host: read each step without a device sync
        self.params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.views: list[tuple[int, int, int, int] | None] = []
        layout: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
        vocabulary = vocabulary_parameters(model)
        with torch.no_grad():
            for i, (_, p) in enumerate(self.params):
                local = local_shard(p)
                dist.broadcast(local, group=self.group, group_src=0)
                view = None if id(p) in vocabulary else matrix_shape(local.shape, rank, min_compression)
                self.views.append(view)
                if view is not None:
                    members = layout.setdefault(view[1:], [])
                    members.append((i, sum(b for _, _, b in members), view[0]))
        device = local_shard(self.params[0][1]).device if self.params else torch.device("cpu")
        self.groups = []
        for g, ((n, m, r), members) in enumerate(sorted(layout.items())):
            batch = sum(b for _, _, b in members)
            first_q = initial_q(batch, m, r, seed + g, device)
            self.groups.append(_ShapeGroup(n, m, r, members, torch.zeros(batch, n, m, device=device),
                                           first_q.clone(), first_q))
        self.errors, self.qs, self.first_qs = {}, {}, {}
        for grp in self.groups:
            for i, first, count in grp.members:
                name = self.params[i][0]
                self.errors[name] = grp.error[first:first + count]
                self.qs[name] = grp.q[first:first + count]
                self.first_qs[name] = grp.first_q[first:first + count]
        sizes = [local_shard(p).numel() * p.element_size() for _, p in self.params]
        self.uncompressed_bytes = sum(sizes)
        self.compressed_bytes = sum(size if v is None else v[0] * (v[1] + v[2]) * v[3] * 4  # fp32 P and Q
                                    for size, v in zip(sizes, self.views))

    def _grads(self) -> list[torch.Tensor]:
        """This rank's gradient shard of every parameter (zeros created where there is none)."""
        grads = []
        for _, p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(local_shard(p.grad))
        return grads

    @torch.no_grad()
    def reduce(self) -> dict[str, float]:
        """Replace every gradient shard by its mean over the replicate group (PowerSGD's approximation for the
        compressed ones); returns {replicate_bytes, replicate_bytes_uncompressed, replicate_compression}."""
        grads = self._grads()
        compress = int(self.steps) >= self.warmup_steps
        self.steps += 1
        if not compress:
            _all_reduce_flat(grads, self.group)
            torch._foreach_div_(grads, float(self.size))
            return self._stats(self.uncompressed_bytes)
        exact = [g for g, v in zip(grads, self.views) if v is None]
        errors, shards = [], []  # per compressed parameter: its error-feedback view [B, n, m], its gradient shard
        for grp in self.groups:
            for i, first, count in grp.members:
                errors.append(grp.error[first:first + count])
                shards.append(grads[i].view(count, grp.n, grp.m))
        torch._foreach_add_(errors, shards)  # M = gradient + error feedback, in the error stacks
        ps = [torch.bmm(grp.error, grp.q) for grp in self.groups]  # [B, n, r] each
        _all_reduce_flat(ps + exact, self.group)
        if exact:
            torch._foreach_div_(exact, float(self.size))
        new_qs = [torch.bmm(grp.error.transpose(1, 2), orthogonalize_(p)) for grp, p in zip(self.groups, ps)]
        _all_reduce_flat(new_qs, self.group)
        torch._foreach_div_(new_qs, float(self.size))  # [B, m, r] each: mean(M)^T P^
        k = 0
        for grp, p, q in zip(self.groups, ps, new_qs):
            for _, first, count in grp.members:
                torch.bmm(p[first:first + count], q[first:first + count].transpose(1, 2), out=shards[k])
                k += 1
            dead = q.abs().amax(dim=1, keepdim=True) == 0  # [B, 1, r]
            q = torch.where(dead, grp.first_q, q)
            grp.q.copy_(torch.where(torch.isfinite(q).all(dim=(1, 2), keepdim=True), q, grp.q))
        torch._foreach_sub_(errors, shards)  # the error feedback: M - P^ Q^T
        for grp in self.groups:
            grp.error.nan_to_num_(0.0, 0.0, 0.0)  # zeroed where the step is non-finite
        return self._stats(self.compressed_bytes)

    def _stats(self, sent: int) -> dict[str, float]:
        return {"replicate_bytes": sent, "replicate_bytes_uncompressed": self.uncompressed_bytes,
                "replicate_compression": self.uncompressed_bytes / max(sent, 1)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's error feedback and Q of every shape group and the step count, under keys holding the global
        rank: the live tensors, so that loading a checkpoint into them (DCP loads in place) restores the state."""
        prefix = f"rank{self.global_rank}."
        state = {prefix + "steps": self.steps}
        for grp in self.groups:
            state[f"{prefix}{grp.key}.error"] = grp.error
            state[f"{prefix}{grp.key}.q"] = grp.q
        return state


def build_replicate_reducer(model: nn.Module, mesh: ParallelMesh, cfg: ParallelConfig, seed: int,
                            lr_warmup_steps: int) -> ReplicateReducer | None:
    """The reducer `parallel.replicate_compression` asks for, or None where HSDP all-reduces (none, or no
    replicate dimension). Its exact warmup is `powersgd_warmup_steps`, or the learning rate's `lr_warmup_steps`
    where that is null."""
    if cfg.replicate_compression == "none" or mesh.size("dp_replicate") == 1:
        return None
    warmup = lr_warmup_steps if cfg.powersgd_warmup_steps is None else cfg.powersgd_warmup_steps
    return ReplicateReducer(model, mesh, rank=cfg.powersgd_rank, warmup_steps=warmup, seed=seed)
