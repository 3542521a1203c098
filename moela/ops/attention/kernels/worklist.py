"""The work list of the Triton attention kernels: every (document, block) of a packed batch, the costliest first,
built on the device without a host sync.

Why: the per-document grid (blocks of the longest document x H x N) launches, for every document, as many
programs as the longest document has blocks; with many short documents most of them exit at once (185 documents
whose longest has 8192 tokens, 128-row blocks: 189k programs for ~8k blocks of work, each empty one still a
scheduling slot on an SM that holds one program at a time). The work list has `cdiv(T, B) + N` entries, a bound on
`sum_d cdiv(L_d, B)` known from the shapes alone, so the grid size needs no device value: the real blocks come
first, sorted by cost, then unused entries (document -1) whose programs return at once.

Order: longest-processing-time first. A block's cost is the number of (query, key) pairs it computes (a causal
query block near the start of its document sees few keys; a causal key block near the end is seen by few queries),
so the longest blocks start first and the launch's tail holds short ones. The sort is stable: equal costs keep
document order, and the list is the same on every rank for the same batch.

Every layer of a model attends over the same cu_seqlens tensors, so `cached_worklist` keeps the last lists it built,
keyed by those tensors' identity and version (a weak reference proves it is the same live tensor, the version
counter that it was not modified in place): a micro-batch builds its lists once (~15 small kernels each), not once
per layer and pass.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

_CACHE: OrderedDict = OrderedDict()  # key -> (weakref to cu_seqlens_q, weakref to cu_seqlens_k, items)
_CACHE_SIZE = 16


def build_worklist(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, n_tokens: int, block: int, *,
                   key_blocks: bool, causal: bool) -> torch.Tensor:
    """int32 [2, W], W = cdiv(n_tokens, block) + N: row 0 the document, row 1 the block index within it (its rows
    [index * block, (index + 1) * block) on the k side when `key_blocks`, else on the q side); -1 past the real
    blocks. n_tokens: Tk for key blocks, else Tq."""
    n_docs = cu_seqlens_q.numel() - 1
    width = -(-n_tokens // block) + n_docs
    device = cu_seqlens_q.device
    len_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)  # [N]
    len_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int64)  # [N]
    blocks = (len_k if key_blocks else len_q).add(block - 1).div(block, rounding_mode="floor")  # [N]
    ends = torch.cumsum(blocks, 0)  # [N] one past each document's last entry
    slot = torch.arange(width, device=device, dtype=torch.int64)  # [W]
    doc = torch.searchsorted(ends, slot, right=True)  # [W]; N past the real blocks
    real = doc < n_docs
    doc = doc.clamp(max=max(n_docs - 1, 0))
    index = slot - (ends[doc] - blocks[doc])  # [W]
    lq, lk = len_q[doc], len_k[doc]
    if key_blocks:  # queries that see the block's first key: i + (Lk - Lq) >= index * block
        seen_by = (lq - (index * block - (lk - lq)).clamp(min=0)).clamp(min=0) if causal else lq
        cost = seen_by * torch.minimum(lk - index * block, torch.full_like(lk, block))
    else:  # keys the block's last query sees
        sees = ((index + 1) * block + lk - lq).clamp(min=0).minimum(lk) if causal else lk
        cost = sees * torch.minimum(lq - index * block, torch.full_like(lq, block))
    cost = torch.where(real, cost, torch.full_like(cost, -1))
    order = torch.argsort(cost, descending=True, stable=True)
    items = torch.stack((torch.where(real, doc, -1), index))[:, order]  # [2, W]
    return items.to(torch.int32)


def cached_worklist(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, n_tokens: int, block: int, *,
                    key_blocks: bool, causal: bool) -> torch.Tensor:
    """build_worklist's list, reused while cu_seqlens_q and cu_seqlens_k are the same unmodified tensors."""
    key = (id(cu_seqlens_q), id(cu_seqlens_k), cu_seqlens_q._version, cu_seqlens_k._version, n_tokens, block,
           key_blocks, causal)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is cu_seqlens_q and hit[1]() is cu_seqlens_k:
        _CACHE.move_to_end(key)
        return hit[2]
    items = build_worklist(cu_seqlens_q, cu_seqlens_k, n_tokens, block, key_blocks=key_blocks, causal=causal)
    _CACHE[key] = (weakref.ref(cu_seqlens_q), weakref.ref(cu_seqlens_k), items)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return items
