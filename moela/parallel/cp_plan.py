"""Context-parallel partitioning of a `PackedBatch`: which tokens each of the `cp` ranks keeps, and what its
attention needs to see the right keys.

Every document (never the packed row) is cut, so causal attention never crosses documents and each token keeps
its original position (RoPE stays exact):

- `dualchunk` (DualChunkSwap, as TransformerEngine): pad the document to a multiple of 2*cp, cut it into 2*cp
  equal chunks, and give rank r chunks r and 2cp-1-r. Each rank then holds one early and one late chunk, so the
  causal attention work per rank is equal.
- `striped`: pad to a multiple of cp; token j goes to rank j mod cp.

Padding tokens sit after the document's real tokens (positions continue past its end), carry label -100 and
input id 0; causal masking keeps them out of every real token's attention, so they change no loss or gradient.

Attention metadata ("passes"). Keys and values are all-gathered across the group in rank-major order (rank s's
local tokens occupy rows [s*T_loc, (s+1)*T_loc) of the gathered stream). A pass is one varlen attention call:
queries `q_index` (local rows) with their own `cu_seqlens_q`, keys `k_index` (gathered rows) with `cu_seqlens_k`,
causal with bottom-right alignment. Several passes are merged with their log-sum-exp.

- dualchunk, one pass: each of the rank's two chunks of a document is its own q segment, and its k segment is the
  document prefix ending with that chunk (so the chunk is the tail of its k side, which bottom-right alignment
  needs). The two prefixes overlap; `k_index` repeats the shared rows (index_select's backward adds them up).
- striped, cp passes: pass s pairs this rank's tokens of each document with rank s's tokens of it. Query i of
  rank r (position i*cp + r) sees key j of rank s (position j*cp + s) iff j <= i when s <= r, or j <= i - 1 when
  s > r; the latter is plain causal on queries 1.. against keys ..n-2.

Shapes: T tokens of the batch, T_loc tokens of one rank (equal on every rank), N documents.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moela.batch import IGNORE_INDEX, PackedBatch

LAYOUTS = ("dualchunk", "striped")


@dataclass
class AttentionPass:
    q_index: torch.Tensor | None  # [Tq] int64 local rows, None = all local rows in order
    cu_seqlens_q: torch.Tensor  # [S+1] int32
    max_seqlen_q: int
    k_index: torch.Tensor  # [Tk] int64 rows of the all-gathered stream
    cu_seqlens_k: torch.Tensor  # [S+1] int32
    max_seqlen_k: int


@dataclass
class CPPlan:
    """Where every token of a batch lives under context parallelism (the same on every rank)."""

    cp_size: int
    layout: str
    doc_lens: torch.Tensor  # [N] int64 true lengths
    padded_lens: torch.Tensor  # [N] int64
    local_index: list[torch.Tensor]  # per rank: [T_loc] int64 rows of the padded stream, in local order
    pad_to_orig: torch.Tensor  # [T_pad] int64 row of the original batch, -1 for padding
    pad_to_gathered: torch.Tensor  # [T_pad] int64 row of the rank-major all-gathered stream
    _sources: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def local_tokens(self) -> int:
        return int(self.local_index[0].numel())

    def local_source(self, rank: int, device) -> torch.Tensor:
        """[T_loc] int64 on `device`: the original batch row of each of rank `rank`'s tokens, -1 on padding
        (computed and copied to the device once per plan, rank and device)."""
        key = (rank, torch.device(device))
        if key not in self._sources:
            self._sources[key] = self.pad_to_orig[self.local_index[rank]].to(device)
        return self._sources[key]


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(starts[i], starts[i] + lengths[i]) -> [sum(lengths)] int64."""
    starts, lengths = starts.long(), lengths.long()
    total = int(lengths.sum())
    offsets = torch.cumsum(lengths, 0) - lengths  # [N] exclusive prefix sums
    return torch.repeat_interleave(starts - offsets, lengths, output_size=total) + torch.arange(total)


def _cu(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths.long(), 0)]).to(torch.int32)


def _max(lengths: torch.Tensor) -> int:
    return int(lengths.max()) if lengths.numel() else 0


def make_plan(cu_seqlens: torch.Tensor, cp_size: int, layout: str = "dualchunk") -> CPPlan:
    """Where each token of a batch with these document boundaries goes under `cp_size`-way CP (module docstring)."""
    if layout not in LAYOUTS:
        raise ValueError(f"context parallel layout {layout!r} is unknown; use one of {', '.join(LAYOUTS)}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    cu = cu_seqlens.detach().cpu().long()
    lens = cu[1:] - cu[:-1]  # [N]
    mult = 2 * cp_size if layout == "dualchunk" else cp_size
    padded = (lens + mult - 1) // mult * mult  # [N]
    pad_start = torch.cumsum(padded, 0) - padded  # [N]
    t_pad = int(padded.sum())
    pad_to_orig = torch.full((t_pad,), -1, dtype=torch.int64)
    pad_to_orig[_ranges(pad_start, lens)] = _ranges(cu[:-1], lens)
    local_index = []
    if layout == "dualchunk":
        c = padded // (2 * cp_size)  # [N] chunk length
        for r in range(cp_size):
            starts = torch.stack([pad_start + r * c, pad_start + (2 * cp_size - 1 - r) * c], 1).reshape(-1)  # [2N]
            local_index.append(_ranges(starts, c.repeat_interleave(2)))
    else:
        n = padded // cp_size  # [N] tokens of each document per rank
        for r in range(cp_size):
            local_index.append(_ranges(torch.zeros_like(n), n) * cp_size + r
                               + torch.repeat_interleave(pad_start, n, output_size=int(n.sum())))
    t_loc = int(local_index[0].numel())
    pad_to_gathered = torch.empty(t_pad, dtype=torch.int64)
    for r, idx in enumerate(local_index):
        pad_to_gathered[idx] = r * t_loc + torch.arange(t_loc)
    return CPPlan(cp_size, layout, lens, padded, local_index, pad_to_orig, pad_to_gathered)


def shard_tokens(x: torch.Tensor, plan: CPPlan, rank: int, fill: int | float) -> torch.Tensor:
    """Rows of any per-token tensor x [T, ...] that rank `rank` keeps, in local order; `fill` on padding."""
    if int(plan.doc_lens.sum()) != x.shape[0]:
        raise ValueError(f"the CP plan covers {int(plan.doc_lens.sum())} tokens but the tensor has {x.shape[0]}; "
                         f"make the plan from this batch's cu_seqlens")
    src = plan.local_source(rank, x.device)  # [T_loc] original rows, -1 on padding
    rows = x[src.clamp(min=0)]  # [T_loc, ...]
    real = (src >= 0).view((-1,) + (1,) * (x.dim() - 1))
    return torch.where(real, rows, torch.full_like(rows, fill))


def shard_batch(batch: PackedBatch, plan: CPPlan, rank: int) -> PackedBatch:
    """This rank's tokens with their original positions; labels -100 on padding; one segment per document."""
    if not 0 <= rank < plan.cp_size:
        raise ValueError(f"cp rank {rank} is outside the group of {plan.cp_size}")
    idx = plan.local_index[rank]  # [T_loc] padded rows
    pad_start = torch.cumsum(plan.padded_lens, 0) - plan.padded_lens  # [N]
    doc_of_row = torch.repeat_interleave(torch.arange(plan.doc_lens.numel()), plan.padded_lens)  # [T_pad]
    positions = (idx - pad_start[doc_of_row[idx]]).to(batch.position_ids.dtype)  # [T_loc] original positions
    per_doc = plan.padded_lens // plan.cp_size  # [N] local tokens of each document
    return PackedBatch(input_ids=shard_tokens(batch.input_ids, plan, rank, 0),
                       labels=shard_tokens(batch.labels, plan, rank, IGNORE_INDEX),
                       position_ids=positions.to(batch.position_ids.device),
                       cu_seqlens=_cu(per_doc).to(batch.cu_seqlens.device), max_seqlen=_max(per_doc))


def attention_passes(plan: CPPlan, rank: int) -> list[AttentionPass]:
    """The varlen attention calls that give rank `rank`'s queries exactly their causal keys (module docstring)."""
    cp, n_docs = plan.cp_size, plan.doc_lens.numel()
    pad_start = torch.cumsum(plan.padded_lens, 0) - plan.padded_lens  # [N]
    if plan.layout == "dualchunk":
        c = plan.padded_lens // (2 * cp)  # [N]
        q_lens = c.repeat_interleave(2)  # [2N]
        k_lens = torch.stack([(rank + 1) * c, (2 * cp - rank) * c], 1).reshape(-1)  # [2N]
        k_index = plan.pad_to_gathered[_ranges(pad_start.repeat_interleave(2), k_lens)]
        return [AttentionPass(None, _cu(q_lens), _max(q_lens), k_index, _cu(k_lens), _max(k_lens))]
    n = plan.padded_lens // cp  # [N] local tokens per document
    local_start = torch.cumsum(n, 0) - n  # [N]
    passes = []
    for s in range(cp):
        shift = 1 if s > rank else 0
        lens = n - shift  # [N]
        q_index = _ranges(local_start + shift, lens) if shift else None
        k_rows = _ranges(torch.zeros(n_docs, dtype=torch.int64), lens) * cp + s  # [sum lens] within-doc positions
        k_index = plan.pad_to_gathered[k_rows + torch.repeat_interleave(pad_start, lens, output_size=int(lens.sum()))]
        passes.append(AttentionPass(q_index, _cu(lens), _max(lens), k_index, _cu(lens), _max(lens)))
    return passes


def unshard(per_rank: list[torch.Tensor], plan: CPPlan) -> torch.Tensor:
    """Inverse of sharding for any per-token tensor: per-rank [T_loc, ...] -> [T, ...] in the original order
    (padding rows dropped)."""
    if len(per_rank) != plan.cp_size:
        raise ValueError(f"unshard wants one tensor per CP rank ({plan.cp_size}), got {len(per_rank)}")
    gathered = torch.cat(per_rank, 0)  # [cp*T_loc, ...] rank-major
    keep = plan.pad_to_orig >= 0  # [T_pad]
    rows = plan.pad_to_gathered[keep]  # gathered row of each original token, in padded (= original) order
    return gathered[rows.to(gathered.device)]
