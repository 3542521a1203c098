"""Token cache: every document tokenized once into a flat memmap, reused by later runs.

Layout of one cache (a directory named by the sha256 of the source fingerprint and the tokenizer): `tokens.bin`
(all documents back to back, each ending with EOS and starting with BOS if one is configured; uint16 when the
vocabulary fits, else uint32), `offsets.npy` (int64 [N+1], document i is tokens[offsets[i]:offsets[i+1]]) and
`meta.json` (counts, dtype, the key's inputs). Decisions: the cache is written into a private temporary directory
and renamed into place only when complete, so a crash never leaves a half cache that looks finished, and
concurrent builders (several ranks, several nodes on a shared filesystem) can never corrupt each other. An
advisory file lock makes the other processes on a machine wait for the first builder instead of duplicating its
work (whichever process takes the lock first builds, the others then open its cache); the lock is an empty
`<name>.lock` file beside the cache. A process killed mid-build may leave a `.<name>.tmp-*` directory behind; it
is never read and can be deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from array import array
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .tokenizer import Tokenizer

FORMAT_VERSION = 1
ENCODE_BATCH_DOCS = 256


class TokenCache:
    """Read-only view of a built cache: `tokens` memmap [total], `offsets` int64 [N+1]."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.meta = json.loads((self.path / "meta.json").read_text())
        self.offsets = np.load(self.path / "offsets.npy")  # [N+1] int64
        n = int(self.offsets[-1])
        size = (self.path / "tokens.bin").stat().st_size
        if size != n * np.dtype(self.meta["dtype"]).itemsize:
            raise ValueError(f"token cache {self.path} is corrupt: tokens.bin has {size} bytes, the offsets need "
                             f"{n} {self.meta['dtype']} tokens; delete the directory to rebuild it")
        self.tokens = (np.memmap(self.path / "tokens.bin", dtype=self.meta["dtype"], mode="r", shape=(n,))
                       if n else np.zeros(0, dtype=self.meta["dtype"]))  # [total]
        self.key: str = self.meta["key"]

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)  # [N] int64

    def doc(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[i]:self.offsets[i + 1]])


def cache_key(source_fingerprint: dict, tokenizer: Tokenizer) -> str:
    blob = json.dumps({"v": FORMAT_VERSION, "source": source_fingerprint, "tokenizer": tokenizer.fingerprint()},
                      sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def build_or_load_cache(documents: Iterable[str], source_fingerprint: dict, tokenizer: Tokenizer,
                        cache_dir: str | os.PathLike, *, num_docs_hint: int | None = None,
                        show_progress: bool = True) -> TokenCache:
    """Return the cache for (source, tokenizer), tokenizing `documents` first if no complete cache exists."""
    key = cache_key(source_fingerprint, tokenizer)
    root = Path(os.path.expanduser(str(cache_dir)))
    root.mkdir(parents=True, exist_ok=True)
    final = root / key[:20]
    if not (final / "meta.json").is_file():
        with _file_lock(root / f"{key[:20]}.lock"):
            if not (final / "meta.json").is_file():
                _build(documents, source_fingerprint, tokenizer, key, final, num_docs_hint, show_progress)
    cache = TokenCache(final)
    if cache.key != key:
        raise ValueError(f"token cache {final} belongs to other data (key {cache.key[:20]}...); delete it to rebuild")
    return cache


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(documents: Iterable[str], source_fingerprint: dict, tokenizer: Tokenizer, key: str, final: Path,
           num_docs_hint: int | None, show_progress: bool) -> None:
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        offsets = array("q", [0])  # int64, compact for many documents
        bar = tqdm(total=num_docs_hint, unit="doc", desc=f"tokenizing into {final}", disable=not show_progress,
                   dynamic_ncols=True)
        with open(tmp / "tokens.bin", "wb") as out:
            batch: list[str] = []
            for text in documents:
                batch.append(text)
                if len(batch) == ENCODE_BATCH_DOCS:
                    _write_batch(batch, tokenizer, dtype, out, offsets, bar)
                    batch = []
            if batch:
                _write_batch(batch, tokenizer, dtype, out, offsets, bar)
        bar.close()
        np.save(tmp / "offsets.npy", np.frombuffer(offsets, dtype=np.int64))
        meta = {"key": key, "format_version": FORMAT_VERSION, "dtype": np.dtype(dtype).name,
                "num_docs": len(offsets) - 1, "num_tokens": offsets[-1], "vocab_size": tokenizer.vocab_size,
                "eos_id": tokenizer.eos_id, "tokenizer": tokenizer.name, "source": source_fingerprint}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "meta.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _write_batch(texts: list[str], tokenizer: Tokenizer, dtype, out, offsets: array, bar) -> None:
    prefix = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    for ids in tokenizer.encode_batch(texts):
        ids = prefix + ids
        ids.append(tokenizer.eos_id)
        out.write(np.asarray(ids, dtype=dtype).tobytes())
        offsets.append(offsets[-1] + len(ids))
    bar.update(len(texts))
