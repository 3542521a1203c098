"""The held-out set and what the loaders share: the held-out split, parts, pieces, the assignment check.

Shapes: P pieces (documents, or cuts of long ones) of a split.

Decisions:
- The held-out documents of a set of documents are chosen by a fixed permutation (independent of the training
  seed); the training stream (stream.py) applies it to each source's first unit.
- Validation: the fixed held-out document set, packed in corpus order; every rank gets the same number of
  micro-batches (so FSDP collectives stay in lockstep), which may drop up to dp_size-1 tail micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from moela.batch import PackedBatch

from .cache import TokenCache
from .packing import make_batch, pack, split_into_pieces

Assign = Callable[[list, int, int], list]
VAL_SPLIT_SEED = 0x5EED


@dataclass
class Part:
    """One source's share of a split: its documents' store (a token cache, or one unit of a source: a cache shard,
    a block of Megatron documents), which of its documents, and its sampling weight."""
    cache: TokenCache
    doc_ids: np.ndarray  # [D] sorted document indices into the store
    weight: float = 1.0


def split_train_val(doc_lengths: np.ndarray, val_fraction: float, val_max_tokens: int):
    """Held-out documents chosen by a fixed permutation of document indices (independent of the training seed).

    Returns (train_doc_ids, val_doc_ids), both sorted. At least one document is held out when val_fraction > 0,
    val_max_tokens > 0 and there are two or more documents; whole documents are taken while their total stays
    within val_max_tokens (one document at least: the validation loader truncates it to the cap).
    """
    n = len(doc_lengths)
    n_val = 0 if val_fraction <= 0 or n < 2 or val_max_tokens <= 0 else max(1, int(round(val_fraction * n)))
    perm = np.random.default_rng(VAL_SPLIT_SEED).permutation(n)
    chosen = perm[:n_val]
    within_cap = np.cumsum(doc_lengths[chosen]) <= val_max_tokens
    keep = chosen[:max(int(within_cap.sum()), min(1, n_val))]
    mask = np.zeros(n, dtype=bool)
    mask[keep] = True
    return np.flatnonzero(~mask), np.flatnonzero(mask)


class Pieces:
    """The pieces of several parts in one index space: part, document, start, length (and document length)."""

    def __init__(self, parts: list[Part], limit: int, token_caps: list[int] | None = None):
        self.stores = [p.cache for p in parts]
        cols = []
        for i, p in enumerate(parts):
            doc_len = p.cache.doc_lengths
            pd, ps, pl = split_into_pieces(p.doc_ids, doc_len[p.doc_ids], limit)
            if token_caps is not None:  # truncate the part's pieces (in order) at its token cap
                pl = np.clip(token_caps[i] - (np.cumsum(pl) - pl), 0, pl)
                pd, ps, pl = pd[pl > 0], ps[pl > 0], pl[pl > 0]
            cols.append((np.full(len(pd), i, dtype=np.int64), pd, ps, pl, doc_len[pd]))
        self.part, self.doc, self.start, self.len, self.doc_len = (np.concatenate(c) for c in zip(*cols))  # [P]

    def __len__(self) -> int:
        return len(self.len)

    def batch(self, idx: np.ndarray) -> PackedBatch:
        return make_batch(self.stores, self.part[idx], self.doc[idx], self.start[idx], self.len[idx])


class ValLoader:
    """Iterates this rank's share of the fixed held-out set; the same batches on every pass."""

    def __init__(self, parts: list[Part], token_cap: int, *, tokens_per_microbatch: int, max_doc_len: int | None,
                 dp_rank: int, dp_size: int):
        total_weight = sum(p.weight for p in parts)
        caps = [int(token_cap * p.weight / total_weight) for p in parts]
        sizes = [min(int(p.cache.doc_lengths[p.doc_ids].sum()), cap) for p, cap in zip(parts, caps)]
        total = sum(sizes)
        # Small held-out sets on many ranks: shrink the budget so that every rank gets at least one micro-batch.
        budget = max(1, min(tokens_per_microbatch, -(-total // dp_size))) if total else tokens_per_microbatch
        self.pieces = Pieces(parts, min(max_doc_len or budget, budget), caps)
        bins = pack(self.pieces.len, budget)
        usable = len(bins) - len(bins) % dp_size
        self._mine = [np.asarray(bins[j]) for j in range(dp_rank, usable, dp_size)]
        self.num_tokens = int(sum(self.pieces.len[b].sum() for b in bins[:usable]))

    def __len__(self) -> int:
        return len(self._mine)

    def __iter__(self) -> Iterator[PackedBatch]:
        return (self.pieces.batch(b) for b in self._mine)


def _check_assignment(groups: list[list[int]], dp_size: int, grad_accum: int) -> None:
    flat = sorted(j for g in groups for j in g)
    if len(groups) != dp_size or flat != list(range(dp_size * grad_accum)) or any(
            len(g) != grad_accum for g in groups):
        raise ValueError(f"assignment must give each of {dp_size} ranks exactly {grad_accum} distinct micro-batch "
                         f"indices covering 0..{dp_size * grad_accum - 1}, got {groups}")
