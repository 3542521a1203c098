"""Packing: documents -> pieces -> micro-batches of at most `budget` tokens -> `PackedBatch`.

Shapes: T tokens of a micro-batch, N documents (pieces) in it, P pieces in the whole split.

Decisions:
- A document (which ends with EOS in the cache) longer than the piece limit (min(max_doc_len, budget)) is cut into
  consecutive pieces of exactly the limit plus a shorter last one. Each piece is its own sequence for attention
  (own `cu_seqlens` segment, `position_ids` from 0), but its labels are the document's next tokens: the last token of
  a non-final piece still predicts the first token of the next piece. Only the document's own last token (EOS)
  has label -100, so no target ever crosses a document boundary and cutting loses no targets.
- Packing is best-fit over a bounded set of open micro-batches (default 16), in the given (shuffled) order: each
  piece goes into the open micro-batch with the least room that still fits it; when none fits, a new one opens,
  and if too many are open, the fullest is emitted. Pieces are never cut to fill a micro-batch, so micro-batches
  hold at most `budget` tokens (usually 97-100% of it) and every token of the split appears exactly once.
- Everything is plain integer/numpy work, deterministic given its inputs.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np
import torch

from moela.batch import IGNORE_INDEX, PackedBatch

from .cache import CacheError

MAX_OPEN_MICROBATCHES = 16


def split_into_pieces(doc_ids: np.ndarray, doc_lengths: np.ndarray, max_len: int):
    """Cut documents into pieces of at most `max_len` tokens.

    doc_ids [D] (which cache documents), doc_lengths [D]. Returns (piece_doc [P], piece_start [P], piece_len [P]):
    the cache document of each piece, its first token's offset within the document, and its length.
    """
    if max_len < 1:
        raise ValueError(f"piece length limit must be >= 1, got {max_len}")
    doc_ids = np.asarray(doc_ids, dtype=np.int64)
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    n_pieces = -(-lengths // max_len)  # [D] ceil
    piece_doc = np.repeat(doc_ids, n_pieces)  # [P]
    first_piece = np.cumsum(n_pieces) - n_pieces  # [D]
    within = np.arange(int(n_pieces.sum()), dtype=np.int64) - np.repeat(first_piece, n_pieces)  # [P]
    piece_start = within * max_len  # [P]
    piece_len = np.minimum(max_len, np.repeat(lengths, n_pieces) - piece_start)  # [P]
    return piece_doc, piece_start, piece_len


def pack(lengths, budget: int, max_open: int = MAX_OPEN_MICROBATCHES) -> list[list[int]]:
    """Group items (by position in `lengths`) into bins of total length <= budget; see the module docstring."""
    bins: list[list[int]] = []
    open_bins: list[tuple[int, int]] = []  # sorted (room left, bin id)
    emitted: list[int] = []
    for i, n in enumerate(lengths.tolist() if isinstance(lengths, np.ndarray) else lengths):
        if not 0 < n <= budget:
            raise ValueError(f"item {i} has length {n}, outside [1, budget={budget}]")
        j = bisect_left(open_bins, (n, -1))
        if j < len(open_bins):
            room, b = open_bins.pop(j)
            bins[b].append(i)
        else:
            if len(open_bins) == max_open:
                emitted.append(open_bins.pop(0)[1])
            b, room = len(bins), budget
            bins.append([i])
        room -= n
        if room == 0:
            emitted.append(b)
        else:
            insort(open_bins, (room, b))
    emitted.extend(sorted(b for _, b in open_bins))
    return [bins[b] for b in emitted]


def num_targets(piece_start: np.ndarray, piece_len: np.ndarray, doc_len: np.ndarray) -> int:
    """Labelled tokens of a set of pieces: all but the last token of each piece that ends its document."""
    ends_doc = (np.asarray(piece_start) + np.asarray(piece_len)) == np.asarray(doc_len)
    return int(np.sum(piece_len) - np.sum(ends_doc))


def make_batch(stores, piece_part, piece_doc, piece_start, piece_len) -> PackedBatch:
    """Materialize one micro-batch. `stores[i]` has `.doc(d)` -> document d's tokens (a TokenCache or a
    MegatronSource) and `.vocab_size` (None: unchecked); piece j is tokens [start, start + len) of document
    `piece_doc[j]` of store `piece_part[j]`. An id beyond the vocabulary is a damaged store (CacheError)."""
    inputs, labels, doc_ends = [], [], 0
    for part, d, s, n in zip(piece_part.tolist(), piece_doc.tolist(), piece_start.tolist(), piece_len.tolist()):
        store = stores[part]
        doc = store.doc(d)
        piece = np.asarray(doc[s:s + n + 1], dtype=np.int64)  # [n or n+1]: the piece and the next token if any
        if store.vocab_size is not None and int(piece.max()) >= store.vocab_size:
            raise CacheError(f"token cache {store.path}: document {d} holds token id {int(piece.max())}, beyond the "
                             f"tokenizer's {store.vocab_size} tokens; delete {store.path} to rebuild it")
        inputs.append(piece[:n])
        if s + n < len(doc):
            labels.append(piece[1:])  # [n]
        else:
            labels.append(piece[1:n])  # [n-1]
            labels.append(np.full(1, IGNORE_INDEX, dtype=np.int64))
            doc_ends += 1
    lens = np.asarray(piece_len, dtype=np.int64)  # [N]
    cu = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    positions = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), lens)  # [T]
    return PackedBatch(
        input_ids=torch.from_numpy(np.concatenate(inputs)),  # [T] int64
        labels=torch.from_numpy(np.concatenate(labels)),  # [T] int64
        position_ids=torch.from_numpy(positions.astype(np.int32)),  # [T] int32
        cu_seqlens=torch.from_numpy(cu),  # [N+1] int32
        max_seqlen=int(lens.max()),
        targets_on_host=int(lens.sum()) - doc_ends,  # every token but each document's last has a label
    )
