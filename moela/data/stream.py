"""The training stream, shard by shard: one design for every source and mixture, whether the caches are complete
or still being tokenized (`data.stream_start: true`, training starts while they are built), with host memory
flat in the corpus size.

Shapes: S units of a source (cache shards, or blocks of `megatron.UNIT_DOCS` documents); P_s pieces of unit s;
M micro-batches of one step (dp_size x grad_accum).

Decisions:
- A source is a sequence of units (`num_shards`, `get(i)`): a `TokenCache` (complete), a `ShardFeed` (being built)
  or a `MegatronSource`. Order of one source, fixed by the seed over the unit list and nothing else: epoch e visits
  the units in a permutation seeded by (seed, source, e); inside unit s it shuffles the unit's pieces with a
  generator seeded by (seed, source, e, s) and packs them (packing.py; micro-batches never span units). The
  source's stream is these micro-batches end to end, epoch after epoch, so the batches are the same whether the
  cache was prebuilt or not, and never depend on how fast tokenization runs: a step whose shard is not built yet
  waits for it (`ShardFeed`, logging that it waits) while the background workers build the shards in the order
  the stream needs them (shard 0 first: it holds the held-out split).
- Mixture: global micro-batch g comes from the source whose slice of [0, 1) (widths: the normalized weights, in
  mixture order) holds frac(g x golden ratio), a low-discrepancy sequence, so every window of consecutive
  micro-batches holds each source's share up to a few micro-batches, and the choice depends only on g. A source
  contributes its weight's share of micro-batches (of tokens too, up to packing: micro-batches are 97-100% full),
  repeating a small source and walking through a large one. Each source keeps its own position in its own stream.
- Held-out split: `split_train_val` applied to each source's unit 0 (every shard is the same slice of the source
  whatever the speed, so this is fixed too), capped at the source's share of `val_max_tokens`.
- Memory: only each source's current unit's pieces and packing are in memory; document offsets and tokens stay
  memory-mapped, so a rank's host memory does not grow with the number of documents. The state is the
  micro-batches consumed plus, per source, its own count and cursor (epoch, position in the epoch's unit order,
  first micro-batch of that unit), so resuming, also with another dp_size x grad_accum, continues the same global
  stream without replaying an epoch.
- Every rank computes each step's M micro-batches' layouts from the same (seed, position), with no communication,
  then keeps its share: who gets which is a pluggable `assign(costs, dp_size, grad_accum)` (moela.data.balance:
  round robin, or balanced with `data.balance: true`) over the costs a * sum L + b * sum L^2 of the micro-batches'
  piece lengths L. Only the rank's own micro-batches are read from the token memmaps.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from moela.batch import PackedBatch

from .balance import imbalance_report, microbatch_cost
from .build import Plan, build
from .cache import Shard
from .loader import Assign, _check_assignment, split_train_val
from .packing import make_batch, num_targets, pack, split_into_pieces

log = logging.getLogger(__name__)
WAIT_LOG_S = 30.0  # repeat the "waiting for shard" line this often
GOLDEN_64 = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: g * GOLDEN_64 mod 2^64 / 2^64 = frac(g / golden ratio)


class Units(Protocol):
    """A source as the stream reads it: `num_shards` units, `get(i)` -> unit i (`doc_lengths`, `doc(d)`,
    `vocab_size`, `path`), `key` naming its content, `path` for messages."""
    num_shards: int
    key: str

    def get(self, i: int): ...


def shard_order(seed: int, source: int, epoch: int, num_shards: int, shuffle: bool) -> np.ndarray:
    return (np.random.default_rng([seed, source, epoch]).permutation(num_shards) if shuffle
            else np.arange(num_shards))


def mixture_sources(first: int, count: int, weights: list[float]) -> np.ndarray:
    """The source of global micro-batches first .. first + count - 1 (see the module docstring) -> int [count]."""
    if len(weights) == 1:
        return np.zeros(count, dtype=np.int64)
    u = np.asarray([(g * GOLDEN_64) % (1 << 64) for g in range(first, first + count)], dtype=np.float64) / 2.0 ** 64
    edges = np.cumsum(weights)[:-1] / sum(weights)  # [sources - 1]
    return np.searchsorted(edges, u, side="right")


class ShardFeed:
    """Shards of a cache being built: `get(i)` returns shard i, waiting for it if the background build has not
    finished it yet (and raising the build's error if it failed)."""

    def __init__(self, plan: Plan, vocab_size: int, workers: int, seed: int, shuffle: bool, source: int = 0):
        self.plan, self.vocab_size = plan, vocab_size
        self.num_shards = len(plan.slices)
        first_epoch = shard_order(seed, source, 0, self.num_shards, shuffle).tolist()
        plan.order = [0] + [i for i in first_epoch if i != 0]  # shard 0 holds the held-out split
        self._open: dict[int, Shard] = {}
        self.error: BaseException | None = None
        self.thread = None
        if not plan.complete():
            self.thread = threading.Thread(target=self._build, args=(workers,), daemon=True,
                                           name="moela-tokenize")
            self.thread.start()

    def _build(self, workers: int) -> None:
        try:
            build(self.plan, workers, show_progress=False)
        except BaseException as e:  # handed to the training thread by `get`
            self.error = e

    @property
    def key(self) -> str:
        return self.plan.key

    @property
    def path(self):
        return self.plan.dir

    def get(self, i: int) -> Shard:
        if i not in self._open:
            waited, last_log = 0.0, -WAIT_LOG_S
            while not self.plan.done(i):
                if self.error is not None:
                    raise self.error
                if waited - last_log >= WAIT_LOG_S:
                    log.info("waiting for shard %d of %d of %s (tokenizing in the background)", i, self.num_shards,
                             self.plan.dir)
                    last_log = waited
                time.sleep(0.1)
                waited += 0.1
            self._open[i] = Shard(self.plan.dir, i, self.vocab_size)
        return self._open[i]


@dataclass
class _ShardBins:
    """The packed micro-batches of one shard in one epoch: piece indices per micro-batch."""
    shard: int
    first: int  # index of its first micro-batch in its source's stream
    bins: list[np.ndarray]
    start: np.ndarray  # [P_s] piece start within its document
    length: np.ndarray  # [P_s]
    doc: np.ndarray  # [P_s] document (shard-local)
    doc_len: np.ndarray  # [P_s]


class SourceStream:
    """One source's endless stream of packed micro-batches, unit by unit; `locate(i)` -> its micro-batch i."""

    def __init__(self, feed: Units, index: int, *, budget: int, limit: int, seed: int, shuffle: bool,
                 val_fraction: float, val_max_tokens: int):
        self.feed, self.index = feed, index
        self.budget, self.limit, self.seed, self.shuffle = budget, limit, seed, shuffle
        _, self.val_docs = split_train_val(feed.get(0).doc_lengths, val_fraction, val_max_tokens)
        self.consumed = 0  # micro-batches of this source handed out so far
        self.cursor = (0, 0, 0)  # (epoch, position in the epoch's shard order, first micro-batch of that shard)
        self._bins: _ShardBins | None = None

    @property
    def num_shards(self) -> int:
        return self.feed.num_shards

    def _pack(self, epoch: int, k: int, first: int) -> _ShardBins:
        s = int(shard_order(self.seed, self.index, epoch, self.num_shards, self.shuffle)[k])
        shard = self.feed.get(s)
        lengths = shard.doc_lengths  # [n]
        docs = np.arange(len(lengths))
        if s == 0 and len(self.val_docs):
            docs = np.setdiff1d(docs, self.val_docs)
        doc, start, length = split_into_pieces(docs, lengths[docs], self.limit)  # [P_s]
        if self.shuffle:
            perm = np.random.default_rng([self.seed, self.index, epoch, s]).permutation(len(doc))
            doc, start, length = doc[perm], start[perm], length[perm]
        bins = [np.asarray(b, dtype=np.int64) for b in pack(length, self.budget)] if len(length) else []
        return _ShardBins(s, first, bins, start, length, doc, lengths[doc])

    def locate(self, i: int) -> tuple[_ShardBins, np.ndarray]:
        """The shard and piece indices of this source's micro-batch i (i >= the cursor's first micro-batch)."""
        epoch, k, first = self.cursor
        if self._bins is None:
            self._bins = self._pack(epoch, k, first)
        empty = 0
        while i >= self._bins.first + len(self._bins.bins):
            empty = 0 if self._bins.bins else empty + 1
            if empty > self.num_shards:
                raise ValueError(f"{self.feed.path}: no shard holds a training document (all held out?); add "
                                 f"data or lower data.val_fraction")
            first = self._bins.first + len(self._bins.bins)
            epoch, k = (epoch, k + 1) if k + 1 < self.num_shards else (epoch + 1, 0)
            self.cursor = (epoch, k, first)
            self._bins = self._pack(epoch, k, first)
        return self._bins, self._bins.bins[i - self._bins.first]

    @property
    def epoch(self) -> float:
        """Fractional epochs consumed: whole units, plus the share of the current unit's micro-batches."""
        epoch, k, first = self.cursor
        bins = len(self._bins.bins) if self._bins is not None else 0
        within = min((self.consumed - first) / bins, 1.0) if bins else 0.0
        return epoch + (k + within) / self.num_shards

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "cursor": list(self.cursor)}

    def load_state_dict(self, state: dict) -> None:
        epoch, k, first = (int(v) for v in state["cursor"])
        if not (0 <= k < self.num_shards and 0 <= first <= int(state["consumed"])):
            raise ValueError(f"corrupt loader state: cursor {state['cursor']} with {state['consumed']} consumed")
        self.consumed, self.cursor, self._bins = int(state["consumed"]), (epoch, k, first), None


class TrainLoader:
    """`next_step()` -> this rank's `grad_accum` PackedBatches, over the unit-by-unit stream of each source."""

    def __init__(self, feeds: list[Units], weights: list[float], *, tokens_per_microbatch: int,
                 max_doc_len: int | None, dp_rank: int, dp_size: int, grad_accum: int, seed: int, shuffle: bool,
                 assign: Assign, cost_coefficients: tuple[float, float], settings: dict, val_fraction: float,
                 val_max_tokens: int):
        self.budget = tokens_per_microbatch
        limit = min(max_doc_len or tokens_per_microbatch, tokens_per_microbatch)
        total = sum(weights)
        self.weights = [w / total for w in weights]
        self.sources = [SourceStream(feed, i, budget=tokens_per_microbatch, limit=limit, seed=seed, shuffle=shuffle,
                                     val_fraction=val_fraction, val_max_tokens=int(val_max_tokens * w))
                        for i, (feed, w) in enumerate(zip(feeds, self.weights))]
        self.dp_rank, self.dp_size, self.grad_accum = dp_rank, dp_size, grad_accum
        self.assign, self.cost_coefficients = assign, cost_coefficients
        self.settings = {"data_key": "+".join(f.key for f in feeds), "weights": self.weights, "seed": seed,
                         **settings}
        self.consumed, self.step = 0, 0
        self.last_imbalance: dict = {}
        self.last_global_counts: tuple[int, int, float] = (0, 0, 0.0)

    @property
    def feed(self) -> Units:
        """The first source's units (the only source's, without a mixture)."""
        return self.sources[0].feed

    @property
    def stores(self) -> list[Units]:
        """Per source, what it reads: a TokenCache, a ShardFeed (stream_start) or a MegatronSource."""
        return [s.feed for s in self.sources]

    @property
    def val_docs(self) -> np.ndarray:
        return self.sources[0].val_docs

    @property
    def epoch(self) -> float:
        """Fractional epochs of the first source consumed (for logging)."""
        return self.sources[0].epoch

    def describe(self) -> str:
        """One line on the sources' units and how the first one packs (for `python -m moela prepare`)."""
        first = self.sources[0]._pack(0, 0, 0)
        tokens = int(first.length.sum())
        fill = tokens / max(len(first.bins) * self.budget, 1)
        units = " + ".join(str(s.num_shards) for s in self.sources)
        held = sum(len(s.val_docs) for s in self.sources)
        return (f"{units} units (shards) read unit by unit; the first packs {tokens} tokens into {len(first.bins)} "
                f"micro-batches of <= {self.budget} tokens ({fill:.1%} full); {held} held-out documents from unit 0"
                + (" of each source" if len(self.sources) > 1 else ""))

    def held_out(self) -> list[tuple[Shard, np.ndarray, float]]:
        """(shard 0, its held-out documents, the source's weight) per source: the validation split."""
        return [(s.feed.get(0), s.val_docs, w) for s, w in zip(self.sources, self.weights)]

    def next_step(self) -> list[PackedBatch]:
        m = self.dp_size * self.grad_accum
        taken = [0] * len(self.sources)
        layouts = []  # [M] (source, shard bins, piece indices)
        for i in mixture_sources(self.consumed, m, self.weights).tolist():
            layouts.append((i, *self.sources[i].locate(self.sources[i].consumed + taken[i])))
            taken[i] += 1
        costs = [microbatch_cost(sb.length[idx].tolist(), *self.cost_coefficients) for _, sb, idx in layouts]
        groups = self.assign(costs, self.dp_size, self.grad_accum)
        _check_assignment(groups, self.dp_size, self.grad_accum)
        self.last_imbalance = imbalance_report(costs, self.dp_size, self.grad_accum, groups)
        start = np.concatenate([sb.start[idx] for _, sb, idx in layouts])
        length = np.concatenate([sb.length[idx] for _, sb, idx in layouts])
        doc_len = np.concatenate([sb.doc_len[idx] for _, sb, idx in layouts])
        lens = length.astype(np.float64)
        self.last_global_counts = (num_targets(start, length, doc_len), int(lens.sum()), float((lens * lens).sum()))
        for source, n in zip(self.sources, taken):
            source.consumed += n
        self.consumed += m
        self.step += 1
        out = []
        for j in groups[self.dp_rank]:
            i, sb, idx = layouts[j]
            out.append(make_batch([self.sources[i].feed.get(sb.shard)], np.zeros(len(idx), dtype=np.int64),
                                  sb.doc[idx], sb.start[idx], sb.length[idx]))
        return out

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "step": self.step, "sources": [s.state_dict() for s in self.sources],
                **self.settings}

    def load_state_dict(self, state: dict) -> None:
        missing = [key for key in [*self.settings, "sources"] if key not in state]
        if missing:
            raise ValueError(f"the loader state lacks {', '.join(missing)} (written by an older moela)")
        if len(state["sources"]) != len(self.sources):
            raise ValueError(f"loader state does not match this run: the checkpoint read {len(state['sources'])} data "
                             f"source(s), this run reads {len(self.sources)}; resume with the data section of the "
                             "checkpointed run")
        if state["data_key"] != self.settings["data_key"]:
            raise ValueError("the training data changed since the checkpoint was written (its token cache "
                             f"{state['data_key']} is now {self.settings['data_key']}: a data file's size or "
                             "modification time, or the tokenizer, differs); restore the data the run trained on")
        for key, value in self.settings.items():
            if state[key] != value:
                raise ValueError(
                    f"loader state does not match this run: {key} was {state.get(key)!r}, now {value!r}; resume "
                    f"with the data section, seed and tokens_per_microbatch of the checkpointed run")
        if len(state["sources"]) != len(self.sources) or sum(int(s["consumed"]) for s in state["sources"]) != int(
                state["consumed"]):
            raise ValueError(f"corrupt loader state: per-source counts {state['sources']} with {state['consumed']} "
                             f"consumed")
        for source, s in zip(self.sources, state["sources"]):
            source.load_state_dict(s)
        self.consumed, self.step = int(state["consumed"]), int(state["step"])
