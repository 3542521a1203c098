"""Loaders: the training stream (one optimizer step at a time, per data-parallel rank) and the held-out set.

Decisions:
- Every rank computes the whole global step - all `dp_size * grad_accum` micro-batches' layouts - from
  (seed, position in the stream), with no communication, then keeps its share. Layouts are cheap (integers);
  only the rank's own micro-batches are read from the token memmap.
- The stream is epochs of packed micro-batches laid end to end: epoch e shuffles the training pieces with a
  generator seeded by (seed, e) and packs them (see packing.py). A step may straddle two epochs.
- Who gets which micro-batch is a pluggable `assign(costs, dp_size, grad_accum) -> per-rank index lists` function
  (moela.data.balance: `round_robin_assign`, or `balanced_assign` with `data.balance: true`). Cost of a micro-batch:
  a * sum L + b * sum L^2 over its pieces' lengths L (by default a = 1, b = 1 / data.attn_cost_len; the trainer
  may pass the model's FLOP coefficients).
- State is the number of global micro-batches consumed plus the current epoch's start, so `load_state_dict`
  resumes exactly (even with a different dp_size * grad_accum: the stream continues where it stopped), and it
  refuses a state from different data, seed or packing settings instead of silently training on other batches.
- Validation: a fixed held-out document set, packed in corpus order; every rank gets the same number of
  micro-batches (so FSDP collectives stay in lockstep), which may drop up to dp_size-1 tail micro-batches.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np

from moela.batch import PackedBatch

from .balance import imbalance_report, microbatch_cost
from .cache import TokenCache
from .packing import make_batch, num_targets, pack, split_into_pieces

Assign = Callable[[list, int, int], list]
VAL_SPLIT_SEED = 0x5EED


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


class EpochPlan:
    """One epoch's micro-batches as two flat arrays (compact for millions of pieces); `plan[i]` -> piece indices."""

    def __init__(self, order: np.ndarray, bins: list[list[int]]):
        sizes = np.fromiter(map(len, bins), dtype=np.int64, count=len(bins))  # [B]
        self.offsets = np.zeros(len(bins) + 1, dtype=np.int64)  # [B+1]
        np.cumsum(sizes, out=self.offsets[1:])
        self.pieces = order[np.fromiter(itertools.chain.from_iterable(bins), dtype=np.int64,
                                        count=int(self.offsets[-1]))]  # [P]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.pieces[self.offsets[i]:self.offsets[i + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))


class TrainLoader:
    """`next_step()` -> this rank's `grad_accum` PackedBatches for one optimizer step."""

    def __init__(self, cache: TokenCache, doc_ids: np.ndarray, *, tokens_per_microbatch: int,
                 max_doc_len: int | None, dp_rank: int, dp_size: int, grad_accum: int, seed: int, shuffle: bool,
                 assign: Assign, cost_coefficients: tuple[float, float], settings: dict):
        if len(doc_ids) == 0:
            raise ValueError("the training split has no documents; add data or lower data.val_fraction")
        self.cache = cache
        self.budget = tokens_per_microbatch
        self.dp_rank, self.dp_size, self.grad_accum = dp_rank, dp_size, grad_accum
        self.seed, self.shuffle = seed, shuffle
        self.assign, self.cost_coefficients = assign, cost_coefficients
        limit = min(max_doc_len or tokens_per_microbatch, tokens_per_microbatch)
        doc_len = cache.doc_lengths
        self.piece_doc, self.piece_start, self.piece_len = split_into_pieces(doc_ids, doc_len[doc_ids], limit)
        self.piece_doc_len = doc_len[self.piece_doc]  # [P]
        self.num_tokens = int(self.piece_len.sum())
        self.settings = {"data_key": cache.key, "seed": seed, **settings}
        self.consumed = 0  # global micro-batches handed out so far
        self.step = 0
        self._epoch, self._epoch_start, self._plan = 0, 0, None
        self.last_imbalance: dict = {}
        self.last_global_num_targets = 0
        self.last_global_num_tokens = 0

    @property
    def epoch(self) -> float:
        """Fractional epochs consumed (for logging)."""
        self._locate(self.consumed)
        return self._epoch + (self.consumed - self._epoch_start) / len(self._plan)

    def epoch_plan(self, epoch: int) -> EpochPlan:
        """The packed micro-batches of one epoch (piece indices)."""
        num_pieces = len(self.piece_len)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(num_pieces)  # [P]
        else:
            order = np.arange(num_pieces)
        return EpochPlan(order, pack(self.piece_len[order], self.budget))

    def _locate(self, g: int) -> np.ndarray:
        if self._plan is None:
            self._plan = self.epoch_plan(self._epoch)
        while g >= self._epoch_start + len(self._plan):
            self._epoch_start += len(self._plan)
            self._epoch += 1
            self._plan = self.epoch_plan(self._epoch)
        return self._plan[g - self._epoch_start]

    def next_step(self) -> list[PackedBatch]:
        m = self.dp_size * self.grad_accum
        layouts = [self._locate(self.consumed + j) for j in range(m)]
        costs = [microbatch_cost(self.piece_len[p].tolist(), *self.cost_coefficients) for p in layouts]
        groups = self.assign(costs, self.dp_size, self.grad_accum)
        _check_assignment(groups, self.dp_size, self.grad_accum)
        self.last_imbalance = imbalance_report(costs, self.dp_size, self.grad_accum, groups)
        pieces = np.concatenate(layouts)  # [pieces of the step]
        self.last_global_num_targets = num_targets(self.piece_start[pieces], self.piece_len[pieces],
                                                   self.piece_doc_len[pieces])
        self.last_global_num_tokens = int(self.piece_len[pieces].sum())
        self.consumed += m
        self.step += 1
        return [self._batch(layouts[j]) for j in groups[self.dp_rank]]

    def _batch(self, pieces: np.ndarray) -> PackedBatch:
        return make_batch(self.cache.tokens, self.cache.offsets, self.piece_doc[pieces], self.piece_start[pieces],
                          self.piece_len[pieces])

    def state_dict(self) -> dict:
        self._locate(self.consumed)
        return {"consumed": self.consumed, "step": self.step, "epoch": self._epoch,
                "epoch_start": self._epoch_start, **self.settings}

    def load_state_dict(self, state: dict) -> None:
        for key, value in self.settings.items():
            if state.get(key) != value:
                raise ValueError(
                    f"loader state does not match this run: {key} was {state.get(key)!r}, now {value!r}; resume "
                    f"with the data section, seed and tokens_per_microbatch of the checkpointed run")
        if not state["epoch_start"] <= state["consumed"]:
            raise ValueError(f"corrupt loader state: epoch_start {state['epoch_start']} > consumed "
                             f"{state['consumed']}")
        self.consumed, self.step = int(state["consumed"]), int(state["step"])
        self._epoch, self._epoch_start = int(state["epoch"]), int(state["epoch_start"])
        self._plan = None


class ValLoader:
    """Iterates this rank's share of the fixed held-out set; the same batches on every pass."""

    def __init__(self, cache: TokenCache, doc_ids: np.ndarray, token_cap: int, *, tokens_per_microbatch: int,
                 max_doc_len: int | None, dp_rank: int, dp_size: int):
        self.cache = cache
        doc_len = cache.doc_lengths
        total = int(doc_len[doc_ids].sum()) if len(doc_ids) else 0
        total = min(total, token_cap)
        # Small held-out sets on many ranks: shrink the budget so that every rank gets at least one micro-batch.
        budget = max(1, min(tokens_per_microbatch, -(-total // dp_size))) if total else tokens_per_microbatch
        limit = min(max_doc_len or budget, budget)
        pd, ps, pl = split_into_pieces(doc_ids, doc_len[doc_ids], limit)
        keep_len = np.clip(token_cap - (np.cumsum(pl) - pl), 0, pl)  # [P] truncate at the token cap
        nonempty = keep_len > 0
        pd, ps, pl = pd[nonempty], ps[nonempty], keep_len[nonempty]
        bins = pack(pl, budget) if len(pl) else []
        usable = len(bins) - len(bins) % dp_size
        self._pieces = (pd, ps, pl)
        self._mine = [np.asarray(bins[j]) for j in range(dp_rank, usable, dp_size)]
        self.num_tokens = int(sum(pl[b].sum() for b in bins[:usable]))

    def __len__(self) -> int:
        return len(self._mine)

    def __iter__(self) -> Iterator[PackedBatch]:
        pd, ps, pl = self._pieces
        for b in self._mine:
            yield make_batch(self.cache.tokens, self.cache.offsets, pd[b], ps[b], pl[b])


def _check_assignment(groups: list[list[int]], dp_size: int, grad_accum: int) -> None:
    flat = sorted(j for g in groups for j in g)
    if len(groups) != dp_size or flat != list(range(dp_size * grad_accum)) or any(
            len(g) != grad_accum for g in groups):
        raise ValueError(f"assignment must give each of {dp_size} ranks exactly {grad_accum} distinct micro-batch "
                         f"indices covering 0..{dp_size * grad_accum - 1}, got {groups}")
