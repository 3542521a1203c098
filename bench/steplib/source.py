"""A synthetic packed-document source with a fixed seed, the one input every implementation of a row reads.

A micro-batch is `rows` rows of exactly `row_len` tokens. Each row is filled with documents whose lengths are
lognormal (median `median_len`, sigma `sigma`, at most `max_doc_len`); the document that crosses the row's end is
cut there and is simply a shorter document. Documents never span rows, so the same tokens mean the same function
whether a model reads them flat with `cu_seqlens` (moela), or as a [rows, row_len] batch whose `position_ids`
restart at every document (torchtitan's packed-document FlexAttention mask, transformers' packed-sequence mask).
Every micro-batch has the same shape, so compiled peers never see a new shape.

Token ids are uniform over the vocabulary; labels are the next token within a document, IGNORE_INDEX on each
document's last token (moela's convention). Step i's micro-batches depend only on (seed, i): two processes that
build the same source see the same tokens.

Shapes: R rows, S row length, T = R * S tokens, N documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moela.batch import IGNORE_INDEX, PackedBatch

MEDIAN_DOC_LEN = 2048  # sigma 0.8; after the cuts at 4096 and at 8192-token row ends documents average ~1.9k
DOC_LEN_SIGMA = 0.8


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [T] int64
    labels: torch.Tensor  # [T] int64, IGNORE_INDEX on each document's last token
    position_ids: torch.Tensor  # [T] int32, restarting at 0 for each document
    doc_lengths: np.ndarray  # [N] int64, in stream order
    rows: int
    row_len: int

    @property
    def num_targets(self) -> int:
        return int(self.input_ids.numel() - len(self.doc_lengths))

    def packed(self) -> PackedBatch:
        """moela's flat batch (on the CPU, with the target count known on the host)."""
        cu = torch.zeros(len(self.doc_lengths) + 1, dtype=torch.int32)  # [N+1]
        cu[1:] = torch.from_numpy(np.cumsum(self.doc_lengths)).to(torch.int32)
        return PackedBatch(self.input_ids, self.labels, self.position_ids, cu, int(self.doc_lengths.max()),
                           targets_on_host=self.num_targets)

    def grid(self, name: str) -> torch.Tensor:
        """One of input_ids / labels / position_ids as a [R, S] batch."""
        return getattr(self, name).view(self.rows, self.row_len)


def doc_lengths_for_row(rng: np.random.Generator, row_len: int, max_doc_len: int,
                        median_len: int = MEDIAN_DOC_LEN, sigma: float = DOC_LEN_SIGMA) -> np.ndarray:
    """Lognormal document lengths (each in [2, max_doc_len]) that fill exactly `row_len` tokens."""
    lengths, room = [], row_len
    while room > 0:
        n = int(np.clip(round(rng.lognormal(np.log(median_len), sigma)), 2, max_doc_len))
        lengths.append(min(n, room))
        room -= lengths[-1]
    return np.asarray(lengths, dtype=np.int64)


class PackedDocs:
    """`next_step()` -> the next optimizer step's `grad_accum` micro-batches (see the module docstring)."""

    def __init__(self, *, vocab_size: int, rows: int, row_len: int, grad_accum: int, max_doc_len: int,
                 seed: int = 0, median_len: int = MEDIAN_DOC_LEN):
        if min(rows, grad_accum) < 1 or min(row_len, max_doc_len, median_len, vocab_size) < 2:
            raise ValueError(f"PackedDocs: need rows, grad_accum >= 1 and row_len, max_doc_len, median_len, "
                             f"vocab_size >= 2, got {rows}, {grad_accum}, {row_len}, {max_doc_len}, {median_len}, "
                             f"{vocab_size}")
        self.vocab_size, self.rows, self.row_len = vocab_size, rows, row_len
        self.grad_accum, self.max_doc_len, self.seed, self.median_len = grad_accum, max_doc_len, seed, median_len
        self.step = 0
        self.reset_length_stats()

    def reset_length_stats(self) -> None:
        """Start a new window for `token_weighted_doc_len`."""
        self._sum_len, self._sum_sq, self._docs = 0.0, 0.0, 0

    def token_weighted_doc_len(self) -> float:
        """sum L^2 / sum L over the documents handed out since `reset_length_stats`: the document length that
        sets the attention FLOPs per token (the trainer's MFU uses the same)."""
        return self._sum_sq / max(self._sum_len, 1.0)

    def mean_doc_len(self) -> float:
        """Mean document length since `reset_length_stats`."""
        return self._sum_len / max(self._docs, 1)

    @property
    def tokens_per_step(self) -> int:
        return self.rows * self.row_len * self.grad_accum

    def microbatch(self, step: int, index: int) -> MicroBatch:
        rng = np.random.default_rng([self.seed, step, index])
        lengths = np.concatenate([doc_lengths_for_row(rng, self.row_len, self.max_doc_len, self.median_len)
                                  for _ in range(self.rows)])  # [N]
        t = self.rows * self.row_len
        ids = rng.integers(0, self.vocab_size, size=t, dtype=np.int64)  # [T]
        ends = np.cumsum(lengths)  # [N]
        starts = ends - lengths
        labels = np.empty(t, dtype=np.int64)
        labels[:-1] = ids[1:]
        labels[ends - 1] = IGNORE_INDEX
        positions = np.arange(t, dtype=np.int64) - np.repeat(starts, lengths)  # [T]
        return MicroBatch(torch.from_numpy(ids), torch.from_numpy(labels),
                          torch.from_numpy(positions.astype(np.int32)), lengths, self.rows, self.row_len)

    def next_step(self) -> list[MicroBatch]:
        batches = [self.microbatch(self.step, i) for i in range(self.grad_accum)]
        self.step += 1
        for b in batches:
            self._sum_len += float(b.doc_lengths.sum())
            self._sum_sq += float((b.doc_lengths.astype(np.float64) ** 2).sum())
            self._docs += len(b.doc_lengths)
        return batches


class TrainerLoader:
    """What `moela.trainer.Trainer` reads from its `train_loader`, served from a `PackedDocs`: the step's micro-batches
    and the step totals over all data-parallel ranks (one rank here)."""

    def __init__(self, source: PackedDocs):
        self.source = source
        self.epoch = 0.0
        self.last_imbalance: dict = {}
        self.last_global_counts: tuple[int, int, float] = (0, 0, 0.0)

    def next_step(self) -> list[PackedBatch]:
        batches = self.source.next_step()
        lengths = np.concatenate([b.doc_lengths for b in batches]).astype(np.float64)
        self.last_global_counts = (sum(b.num_targets for b in batches), int(lengths.sum()),
                                   float((lengths * lengths).sum()))
        return [b.packed() for b in batches]
