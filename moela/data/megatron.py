"""Megatron-LM indexed datasets (`.bin/.idx`, the MMIDIDX format) read in place as a token source.

The `.idx` file (little-endian): the magic `MMIDIDX\\x00\\x00` (9 bytes), version uint64 (1), the token dtype code
uint8 (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), the sequence count S uint64,
the document-index count D uint64, then int32 [S] sequence lengths (tokens), int64 [S] sequence pointers (byte
offsets into `.bin`), int64 [D] document indices (the first sequence of each document, from 0 up to S) and, in a
multimodal dataset only, int8 [S] modes. The `.bin` file holds the sequences' tokens back to back, each document's
sequences consecutive (what Megatron-LM's IndexedDatasetBuilder writes).

Decisions: a moela document is one Megatron document (its sequences concatenated: a single sequence unless the
corpus was split into sentences). Nothing is copied or re-tokenized: `.bin` is memory-mapped and the index arrays
are views of the memory-mapped `.idx`, so host memory does not grow with the corpus. Several prefixes in one source
are concatenated in order (blend several with weights through `data.mixture`). The training stream reads the
source in units of `UNIT_DOCS` consecutive documents, as it reads a token cache shard by shard. Megatron's
preprocessing appends the end-of-document token only with `--append-eod`; the loader treats each document's last
token as its end (no target after it), so a corpus without it loses one target per document but never predicts
across documents.
Opening checks the header, the file sizes, the index's bounds and a sample of documents' ids against the
vocabulary; `verify()` checks every sequence pointer and every id.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from .cache import CacheError

MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
SAMPLED_DOCS = 8
CHUNK = 1 << 22  # index entries checked per step in verify()
UNIT_DOCS = 1 << 16  # documents per unit of the training stream (the loader packs one unit at a time)


def resolve_prefixes(pattern: str) -> list[str]:
    """Dataset prefixes named by one `paths` entry: a prefix, a .bin/.idx file, a directory, or a glob."""
    p = os.path.expandvars(os.path.expanduser(pattern))
    if p.endswith((".bin", ".idx")):
        p = p[:-4]
    if os.path.isfile(p + ".idx"):
        return [p]
    if os.path.isdir(p):
        return sorted(str(f)[:-4] for f in Path(p).rglob("*.idx"))
    return sorted({f[:-4] for f in glob.glob(p, recursive=True) if f.endswith((".bin", ".idx"))})


def prefix_errors(paths: list[str]) -> list[str]:
    errors = []
    for pattern in paths:
        prefixes = resolve_prefixes(pattern)
        if not prefixes:
            errors.append(f"paths: '{pattern}' names no Megatron dataset (no {pattern}.idx); give a prefix as "
                          f"Megatron's --data-path, a .bin/.idx file, a directory or a glob")
        errors += [f"paths: {p}.bin is missing beside {p}.idx" for p in prefixes if not os.path.isfile(p + ".bin")]
    return errors


class IndexedFile:
    """One `.bin/.idx` pair: `doc(i)` -> tokens, `doc_lengths` [N]."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.idx_path, self.bin_path = Path(prefix + ".idx"), Path(prefix + ".bin")
        with open(self.idx_path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:9] != MAGIC:
            raise self._bad(self.idx_path, "is not a Megatron MMIDIDX index (bad header)")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
        if version != 1:
            raise self._bad(self.idx_path, f"is index version {version}; moela reads version 1")
        if code not in DTYPES or not np.issubdtype(DTYPES[code], np.integer):
            raise self._bad(self.idx_path, f"has token dtype code {code}, not an integer token type")
        self.dtype = np.dtype(DTYPES[code])
        size = self.idx_path.stat().st_size
        plain = HEADER_BYTES + n_seq * 12 + n_doc * 8
        if size not in (plain, plain + n_seq):
            raise self._bad(self.idx_path, f"has {size} bytes; its header ({n_seq} sequences, {n_doc} document "
                            f"indices) needs {plain} (or {plain + n_seq} with modes): truncated or damaged")
        raw = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        self.seq_lengths = np.frombuffer(raw, np.int32, n_seq, HEADER_BYTES)  # [S]
        self.seq_pointers = np.frombuffer(raw, np.int64, n_seq, HEADER_BYTES + 4 * n_seq)  # [S]
        self.doc_index = np.frombuffer(raw, np.int64, n_doc, HEADER_BYTES + 12 * n_seq)  # [D]
        if n_doc < 1 or self.doc_index[0] != 0 or self.doc_index[-1] != n_seq:
            raise self._bad(self.idx_path, f"has document indices that do not run from 0 to its {n_seq} sequences")
        need = int(self.seq_pointers[-1]) + int(self.seq_lengths[-1]) * self.dtype.itemsize if n_seq else 0
        have = self.bin_path.stat().st_size
        if have != need:
            raise self._bad(self.bin_path, f"has {have} bytes, its index needs {need}: truncated or not its pair")
        self.tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r") if have
                       else np.zeros(0, self.dtype))  # [total]
        self.one_per_doc = n_doc == n_seq + 1 and all(  # the usual layout: document i is sequence i
            np.array_equal(self.doc_index[a:a + CHUNK], np.arange(a, min(a + CHUNK, n_doc)))
            for a in range(0, n_doc, CHUNK))
        self.num_docs = n_doc - 1
        self.num_tokens = have // self.dtype.itemsize

    def _bad(self, path: Path, problem: str) -> CacheError:
        return CacheError(f"Megatron dataset file {path} {problem}; rewrite it with Megatron-LM's preprocessing "
                          f"or remove {self.prefix} from data.paths")

    @property
    def doc_lengths(self) -> np.ndarray:
        """[N] tokens per document."""
        return self.lengths(0, self.num_docs)

    def lengths(self, a: int, b: int) -> np.ndarray:
        """[b - a] tokens of documents a .. b - 1 (a view of the index when each document is one sequence)."""
        if self.one_per_doc:
            return self.seq_lengths[a:b]
        seqs = self.doc_index[a:b + 1]  # [b - a + 1]
        sums = np.concatenate([[0], np.cumsum(self.seq_lengths[seqs[0]:seqs[-1]], dtype=np.int64)])
        return sums[seqs[1:] - seqs[0]] - sums[seqs[:-1] - seqs[0]]

    def doc(self, i: int) -> np.ndarray:
        first, end = int(self.doc_index[i]), int(self.doc_index[i + 1])
        if first == end:
            return self.tokens[:0]
        start = int(self.seq_pointers[first]) // self.dtype.itemsize
        n = int(self.seq_lengths[first:end].sum())
        return self.tokens[start:start + n]

    def check_ids(self, docs, vocab_size: int) -> None:
        for d in docs:
            tokens = self.doc(int(d))
            if len(tokens) and (int(tokens.max()) >= vocab_size or int(tokens.min()) < 0):
                raise self._bad(self.bin_path, f"holds token ids outside the tokenizer's {vocab_size} tokens "
                                f"(document {int(d)}): tokenized with another tokenizer? Set data.tokenizer to it")

    def verify(self, vocab_size: int | None) -> None:
        """Every sequence back to back in .bin, every id within the vocabulary."""
        n = len(self.seq_lengths)
        isz = self.dtype.itemsize
        for a in range(0, n, CHUNK):
            b = min(n, a + CHUNK + 1)
            p, ln = self.seq_pointers[a:b], self.seq_lengths[a:b]
            if np.any(ln < 0) or np.any(p[1:] != p[:-1] + ln[:-1].astype(np.int64) * isz) or (a == 0 and n and
                                                                                             p[0] != 0):
                raise self._bad(self.idx_path, f"has sequence pointers that are not back to back (near sequence "
                                f"{a})")
        if np.any(np.diff(self.doc_index) < 0):
            raise self._bad(self.idx_path, "has decreasing document indices")
        if vocab_size is not None:
            for a in range(0, self.num_tokens, CHUNK):
                chunk = self.tokens[a:a + CHUNK]
                if int(chunk.max()) >= vocab_size or int(chunk.min()) < 0:
                    raise self._bad(self.bin_path, f"holds token ids outside the tokenizer's {vocab_size} tokens "
                                    f"(near token {a})")


class MegatronSource:
    """Several indexed files as one token store, with the TokenCache interface the loaders use."""

    def __init__(self, paths: list[str], vocab_size: int | None = None):
        self.vocab_size = vocab_size
        prefixes = [p for pattern in paths for p in resolve_prefixes(pattern)]
        errors = prefix_errors(paths)
        if errors:
            raise FileNotFoundError("; ".join(errors))
        self.files = [IndexedFile(p) for p in prefixes]
        self.path = Path(prefixes[0]).parent
        counts = [f.num_docs for f in self.files]
        self.file_first_doc = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # [F+1]
        self.num_docs = int(self.file_first_doc[-1])
        self.num_tokens = sum(f.num_tokens for f in self.files)
        self.dtype = self.files[0].dtype
        stats = [[os.path.abspath(p + ext), os.path.getsize(p + ext), os.stat(p + ext).st_mtime_ns]
                 for p in prefixes for ext in (".idx", ".bin")]
        self.key = hashlib.sha256(json.dumps({"megatron": stats}).encode()).hexdigest()
        if vocab_size is not None:
            for f in self.files:
                if f.num_docs:
                    rng = np.random.default_rng(0)
                    f.check_ids({0, f.num_docs - 1, *rng.integers(0, f.num_docs, SAMPLED_DOCS).tolist()},
                                vocab_size)

    def describe(self) -> str:
        return ", ".join(f.prefix for f in self.files[:3]) + (f" and {len(self.files) - 3} more" if len(
            self.files) > 3 else "")

    @property
    def doc_lengths(self) -> np.ndarray:
        return self.lengths(0, self.num_docs)  # [N]

    def lengths(self, a: int, b: int) -> np.ndarray:
        """[b - a] tokens of documents a .. b - 1 (across files)."""
        first = self.file_first_doc
        out = [f.lengths(max(a - int(s), 0), min(b - int(s), f.num_docs))
               for f, s in zip(self.files, first[:-1]) if a < s + f.num_docs and b > s]
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    @property
    def num_shards(self) -> int:
        return -(-self.num_docs // UNIT_DOCS)

    def get(self, i: int) -> DocRange:
        """Unit i of the training stream: documents i * UNIT_DOCS onwards (the Megatron counterpart of a shard)."""
        return DocRange(self, i * UNIT_DOCS, min(UNIT_DOCS, self.num_docs - i * UNIT_DOCS))

    def doc(self, i: int) -> np.ndarray:
        f = int(np.searchsorted(self.file_first_doc, i, side="right")) - 1
        return self.files[f].doc(i - int(self.file_first_doc[f]))

    def verify(self, vocab_size: int | None = None, progress=None) -> None:
        for f in self.files:
            f.verify(vocab_size)
            if progress is not None:
                progress(f)


class DocRange:
    """Documents first .. first + count - 1 of a MegatronSource, numbered from 0 (the loader's view of a unit)."""

    def __init__(self, source: MegatronSource, first: int, count: int):
        self.source, self.first, self.count = source, first, count
        self.vocab_size, self.path = source.vocab_size, source.path

    @property
    def doc_lengths(self) -> np.ndarray:
        return self.source.lengths(self.first, self.first + self.count)  # [count]

    def doc(self, i: int) -> np.ndarray:
        return self.source.doc(self.first + i)
