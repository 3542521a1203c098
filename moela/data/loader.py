"""Loaders: the training stream (one optimizer step at a time, per data-parallel rank) and the held-out set.

Shapes: P pieces (documents, or cuts of long ones) of the training split, B micro-batches of one epoch.

Decisions:
- Every rank computes the whole global step - all `dp_size * grad_accum` micro-batches' layouts - from
  (seed, position in the stream), with no communication, then keeps its share. Layouts are cheap (integers);
  only the rank's own micro-batches are read from the token memmaps.
- The stream is epochs of packed micro-batches laid end to end; a step may straddle two epochs. Epoch e takes a
  window of each source's pieces (one source: all of them), shuffles them with a generator seeded by (seed, e)
  and packs them (see packing.py). With a mixture, source i contributes weight_i x (all training tokens) tokens
  per epoch, read as consecutive windows of its own endless sequence of reshuffled passes, so a small source is
  repeated and a large one is walked through across epochs; the window depends only on e, never on history.
- Who gets which micro-batch is a pluggable `assign(costs, dp_size, grad_accum) -> per-rank index lists` function
  (moela.data.balance: `round_robin_assign`, or `balanced_assign` with `data.balance: true`). Cost of a micro-batch:
  a * sum L + b * sum L^2 over its pieces' lengths L (the trainer passes the model's FLOP coefficients unless the
  recipe sets data.attn_cost_len: then a = 1, b = 1 / attn_cost_len).
- State is the number of global micro-batches consumed plus the current epoch's start, so `load_state_dict`
  resumes exactly (even with a different dp_size * grad_accum: the stream continues where it stopped), and it
  refuses a state from different data, seed or packing settings instead of silently training on other batches.
- Validation: a fixed held-out document set, packed in corpus order; every rank gets the same number of
  micro-batches (so FSDP collectives stay in lockstep), which may drop up to dp_size-1 tail micro-batches.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from moela.batch import PackedBatch

from .balance import imbalance_report, microbatch_cost
from .cache import TokenCache
from .packing import make_batch, num_targets, pack, split_into_pieces

Assign = Callable[[list, int, int], list]
VAL_SPLIT_SEED = 0x5EED


@dataclass
class Part:
    """One source's share of a split: its token cache, which of its documents, and its sampling weight."""
    cache: TokenCache
    doc_ids: np.ndarray  # [D] sorted document indices into the cache
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
        self.part_sizes = [len(c[0]) for c in cols]
        self.part_first = np.concatenate([[0], np.cumsum(self.part_sizes)[:-1]]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.len)

    def batch(self, idx: np.ndarray) -> PackedBatch:
        return make_batch(self.stores, self.part[idx], self.doc[idx], self.start[idx], self.len[idx])


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

    def __init__(self, parts: list[Part], *, tokens_per_microbatch: int, max_doc_len: int | None, dp_rank: int,
                 dp_size: int, grad_accum: int, seed: int, shuffle: bool, assign: Assign,
                 cost_coefficients: tuple[float, float], settings: dict):
        empty = [i for i, p in enumerate(parts) if len(p.doc_ids) == 0]
        if empty:
            raise ValueError(f"the training split of source(s) {empty} has no documents; add data or lower "
                             f"data.val_fraction")
        self.caches = [p.cache for p in parts]
        self.budget = tokens_per_microbatch
        self.dp_rank, self.dp_size, self.grad_accum = dp_rank, dp_size, grad_accum
        self.seed, self.shuffle = seed, shuffle
        self.assign, self.cost_coefficients = assign, cost_coefficients
        self.pieces = Pieces(parts, min(max_doc_len or tokens_per_microbatch, tokens_per_microbatch))
        self.num_tokens = int(self.pieces.len.sum())
        self.take = self._pieces_per_epoch([p.weight for p in parts])
        self.settings = {"data_key": "+".join(c.key for c in self.caches), "weights": [p.weight for p in parts],
                         "seed": seed, **settings}
        self.consumed = 0  # global micro-batches handed out so far
        self.step = 0
        self._epoch, self._epoch_start, self._plan = 0, 0, None
        self.last_imbalance: dict = {}
        # (labelled tokens, tokens, sum of squared segment lengths) of the last step over every data-parallel rank
        self.last_global_counts: tuple[int, int, float] = (0, 0, 0.0)

    def _pieces_per_epoch(self, weights: list[float]) -> list[int]:
        """Pieces each part contributes per epoch: its weight's share of all training tokens."""
        sizes = self.pieces.part_sizes
        if len(sizes) == 1:
            return sizes
        part_tokens = np.bincount(self.pieces.part, weights=self.pieces.len, minlength=len(sizes))  # [parts]
        mean_len = part_tokens / np.asarray(sizes)
        return [max(1, int(round(w * self.num_tokens / m))) for w, m in zip(weights, mean_len)]

    def describe(self) -> str:
        """One line on the training split and how epoch 0 packs (for `python -m moela prepare`)."""
        plan = self.epoch_plan(0)
        tokens = int(self.pieces.len[plan.pieces].sum())
        return (f"{self.num_tokens} tokens in {len(self.pieces)} pieces; an epoch packs {tokens} tokens into "
                f"{len(plan)} micro-batches of <= {self.budget} tokens ({tokens / (len(plan) * self.budget):.1%} full)")

    @property
    def epoch(self) -> float:
        """Fractional epochs consumed (for logging)."""
        self._locate(self.consumed)
        return self._epoch + (self.consumed - self._epoch_start) / len(self._plan)

    def epoch_plan(self, epoch: int) -> EpochPlan:
        """The packed micro-batches of one epoch (piece indices)."""
        chosen = np.concatenate([first + self._window(i, epoch * take, take)
                                 for i, (first, take) in enumerate(zip(self.pieces.part_first, self.take))])  # [P_e]
        if self.shuffle:
            chosen = chosen[np.random.default_rng([self.seed, epoch]).permutation(len(chosen))]
        return EpochPlan(chosen, pack(self.pieces.len[chosen], self.budget))

    def _window(self, part: int, begin: int, count: int) -> np.ndarray:
        """Positions [begin, begin + count) of part's endless sequence of passes (each reshuffled if shuffling)."""
        size = self.pieces.part_sizes[part]
        out = []
        for k in range(begin // size, (begin + count - 1) // size + 1):
            order = (np.random.default_rng([self.seed, part, k]).permutation(size) if self.shuffle
                     else np.arange(size))
            out.append(order[max(begin - k * size, 0):begin + count - k * size])
        return np.concatenate(out)

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
        p = self.pieces
        layouts = [self._locate(self.consumed + j) for j in range(m)]
        costs = [microbatch_cost(p.len[idx].tolist(), *self.cost_coefficients) for idx in layouts]
        groups = self.assign(costs, self.dp_size, self.grad_accum)
        _check_assignment(groups, self.dp_size, self.grad_accum)
        self.last_imbalance = imbalance_report(costs, self.dp_size, self.grad_accum, groups)
        step = np.concatenate(layouts)  # [pieces of the step]
        lens = p.len[step].astype(np.float64)
        self.last_global_counts = (num_targets(p.start[step], p.len[step], p.doc_len[step]), int(lens.sum()),
                                   float((lens * lens).sum()))
        self.consumed += m
        self.step += 1
        return [p.batch(layouts[j]) for j in groups[self.dp_rank]]

    def state_dict(self) -> dict:
        self._locate(self.consumed)
        return {"consumed": self.consumed, "step": self.step, "epoch": self._epoch,
                "epoch_start": self._epoch_start, **self.settings}

    def load_state_dict(self, state: dict) -> None:
        missing = [key for key in self.settings if key not in state]
        if missing:
            raise ValueError(f"the loader state lacks {', '.join(missing)} (written by an older moela)")
        if state["data_key"] != self.settings["data_key"]:
            raise ValueError("the training data changed since the checkpoint was written (its token cache "
                             f"{state['data_key']} is now {self.settings['data_key']}: a data file's size or "
                             "modification time, or the tokenizer, differs); restore the data the run trained on")
        for key, value in self.settings.items():
            if state[key] != value:
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
