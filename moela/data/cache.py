"""Token cache on disk: an ordered list of shards, each a flat token file, checked when opened and when used.

Layout of one cache, a directory `<cache_dir>/<key[:20]>/` (key: sha256 of the source fingerprint, the shard
size and the tokenizer):

- `NNNNN.bin`: shard N's tokens, documents back to back (each ending with EOS, starting with BOS if one is
  configured); uint16 when the vocabulary fits, else uint32. The concatenation of the shards in order is the whole
  corpus, so the cache does not depend on how many workers built it.
- `NNNNN.npy`: int64 [n+1], the shard's document offsets (document i is tokens[offsets[i]:offsets[i+1]]).
- `NNNNN.json`: the shard's counts, largest id and integrity record; written last, so it marks the shard done.
- `offsets.npy`: int64 [N+1], the global document offsets over the concatenated shards (memory-mapped by readers).
- `meta.json`: written last of all, when every shard exists: the cache is complete exactly when it exists.

Integrity: every shard records the CRC-32 of each `BLOCK_BYTES` block of its token file and of its offsets file.
Opening a cache checks what is cheap for any corpus size: meta and every shard record parse, file sizes agree
with the offsets, the largest recorded id fits the vocabulary. A shard's first use (its first document read, or
its opening by the stream loader) checks its content: `SAMPLED_BLOCKS` pseudo-random blocks plus the first and the
last against their CRCs and the vocabulary, and that its offsets rise (a zeroed or overwritten file fails then,
before any of its tokens reaches a batch). `verify()` (`python -m moela prepare --verify`) checks every block.
Each problem is one line naming the file and the directory to delete to rebuild (`CacheError`, an OSError: the
state on disk is wrong, not the recipe).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np

FORMAT_VERSION = 2
BLOCK_BYTES = 1 << 20  # integrity block of a shard's token file
SAMPLED_BLOCKS = 4  # blocks per shard checked at its first use (besides the first and the last)


class CacheError(OSError):
    """A token cache on disk is damaged or belongs to other data; the message names the file and the fix."""


def shard_name(i: int) -> str:
    return f"{i:05d}"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)


def _damaged(path: Path, cache_dir: Path, problem: str) -> CacheError:
    return CacheError(f"token cache file {path} {problem}; delete {cache_dir} to rebuild it")


def read_json(path: Path, cache_dir: Path) -> dict:
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError):
        raise _damaged(path, cache_dir, "is not valid JSON") from None
    if not isinstance(value, dict):
        raise _damaged(path, cache_dir, "does not hold a JSON object")
    return value


def load_offsets(path: Path, cache_dir: Path, mmap: bool = True) -> np.ndarray:
    """A document offsets file as int64 [n+1] (memory-mapped), or a CacheError naming it."""
    try:
        offsets = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise _damaged(path, cache_dir, "is missing") from None
        raise _damaged(path, cache_dir, "is truncated or not an offsets array") from None
    if offsets.dtype != np.int64 or offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0:
        raise _damaged(path, cache_dir, "is not an offsets array (int64, starting at 0)")
    return offsets


def block_crcs(data: bytes | memoryview | np.ndarray) -> list[int]:
    view = memoryview(data).cast("B")
    return [zlib.crc32(view[i:i + BLOCK_BYTES]) for i in range(0, len(view), BLOCK_BYTES)]


class ShardWriter:
    """Writes one shard into temporary files beside the cache, then renames them into place (`commit`)."""

    def __init__(self, cache_dir: Path, index: int, dtype: np.dtype):
        self.dir, self.name, self.dtype = cache_dir, shard_name(index), np.dtype(dtype)
        self.tmp = f".{self.name}.tmp-{os.getpid()}"
        self.out = open(cache_dir / f"{self.tmp}.bin", "wb")
        self.offsets = [0]
        self.max_id = -1
        self.crcs: list[int] = []
        self._block = bytearray()

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    def write(self, tokens: np.ndarray) -> None:
        """Append tokens [n] of this shard's dtype; `end_docs` then says where documents end."""
        if len(tokens):
            self.max_id = max(self.max_id, int(tokens.max()))
        data = tokens.tobytes()
        self.out.write(data)
        self._block += data
        if len(self._block) >= BLOCK_BYTES:
            full = len(self._block) // BLOCK_BYTES * BLOCK_BYTES
            self.crcs += block_crcs(memoryview(self._block)[:full])
            del self._block[:full]

    def end_docs(self, doc_lengths) -> None:
        """Documents of these lengths (in tokens, in order) end the tokens written so far."""
        for n in doc_lengths:
            self.offsets.append(self.offsets[-1] + int(n))

    def commit(self) -> dict:
        """Close, rename into place, return the shard's record (also written as NNNNN.json, last)."""
        if self._block:
            self.crcs.append(zlib.crc32(self._block))
        self.out.close()
        offsets = np.asarray(self.offsets, dtype=np.int64)
        np.save(self.dir / f"{self.tmp}.npy", offsets)
        record = {"num_docs": len(offsets) - 1, "num_tokens": int(offsets[-1]), "max_id": self.max_id,
                  "dtype": self.dtype.name, "crc32": self.crcs, "offsets_crc32": zlib.crc32(offsets.tobytes())}
        (self.dir / f"{self.tmp}.json").write_text(json.dumps(record))
        for ext in ("bin", "npy", "json"):  # the .json last: a shard is done once its record exists
            os.replace(self.dir / f"{self.tmp}.{ext}", self.dir / f"{self.name}.{ext}")
        return record

    def abort(self) -> None:
        self.out.close()
        for ext in ("bin", "npy", "json"):
            (self.dir / f"{self.tmp}.{ext}").unlink(missing_ok=True)


def finish_cache(cache_dir: Path, key: str, num_shards: int, info: dict) -> None:
    """Complete a cache whose shards all exist: the global offsets, then meta.json (with `info` added)."""
    records = [read_json(cache_dir / f"{shard_name(i)}.json", cache_dir) for i in range(num_shards)]
    counts = [r["num_docs"] for r in records]
    tmp = cache_dir / f".offsets.tmp-{os.getpid()}.npy"
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int64, shape=(sum(counts) + 1,))  # [N+1]
    out[0], doc, base = 0, 0, 0
    for i, n in enumerate(counts):
        local = load_offsets(cache_dir / f"{shard_name(i)}.npy", cache_dir)  # [n+1]
        out[doc + 1:doc + n + 1] = local[1:] + base
        doc, base = doc + n, base + int(local[-1])
    out.flush()
    del out
    os.replace(tmp, cache_dir / "offsets.npy")
    meta = {"key": key, "format_version": FORMAT_VERSION, "num_shards": num_shards, "num_docs": doc,
            "num_tokens": base, "dtype": records[0]["dtype"] if records else "uint16",
            "max_id": max([r["max_id"] for r in records] + [-1]), **info}
    tmp = cache_dir / f".meta.tmp-{os.getpid()}.json"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, cache_dir / "meta.json")


class Shard:
    """One finished shard, memory-mapped: `tokens` [n_tokens], `offsets` int64 [n_docs+1]."""

    def __init__(self, cache_dir: Path, index: int, vocab_size: int | None = None, check: bool = True):
        self.dir, self.name, self.vocab_size = cache_dir, shard_name(index), vocab_size
        self.path = cache_dir
        self.record = read_json(cache_dir / f"{self.name}.json", cache_dir)
        self.offsets = load_offsets(cache_dir / f"{self.name}.npy", cache_dir)  # [n+1]
        try:
            self.dtype = np.dtype(self.record["dtype"])
            self.num_docs, self.num_tokens = int(self.record["num_docs"]), int(self.record["num_tokens"])
            self.max_id, self.crcs = int(self.record["max_id"]), [int(c) for c in self.record["crc32"]]
        except (KeyError, TypeError, ValueError):
            raise _damaged(cache_dir / f"{self.name}.json", cache_dir, "lacks the shard's counts") from None
        path = cache_dir / f"{self.name}.bin"
        if len(self.offsets) != self.num_docs + 1 or int(self.offsets[-1]) != self.num_tokens:
            raise _damaged(cache_dir / f"{self.name}.npy", cache_dir, f"does not hold the {self.num_docs} "
                           f"documents of {self.num_tokens} tokens that {self.name}.json records")
        size = path.stat().st_size if path.is_file() else -1
        if size != self.num_tokens * self.dtype.itemsize:
            raise _damaged(path, cache_dir, f"has {max(size, 0)} bytes, its offsets need "
                           f"{self.num_tokens * self.dtype.itemsize} ({self.num_tokens} {self.dtype.name} tokens)")
        if len(self.crcs) != -(-size // BLOCK_BYTES):
            raise _damaged(cache_dir / f"{self.name}.json", cache_dir, "has a block checksum list of the wrong size")
        self.tokens = (np.memmap(path, dtype=self.dtype, mode="r", shape=(self.num_tokens,)) if self.num_tokens
                       else np.zeros(0, dtype=self.dtype))  # [n_tokens]
        if vocab_size is not None and self.max_id >= vocab_size:
            raise _damaged(path, cache_dir, f"holds token id {self.max_id}, beyond the tokenizer's {vocab_size} "
                           f"tokens (built with another tokenizer?)")
        self.checked = False
        if check:
            self.check_sampled()

    def check_sampled(self) -> None:
        """The sampled blocks against their checksums and the vocabulary, and the offsets' steps (see above)."""
        self.check_blocks(_sampled(len(self.crcs), self.name), self.vocab_size)
        if bool(np.any(np.diff(self.offsets) <= 0)):
            raise _damaged(self.dir / f"{self.name}.npy", self.dir, "has documents of no tokens")
        self.checked = True

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)  # [n] int64

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[int(self.offsets[i]):int(self.offsets[i + 1])]

    def check_blocks(self, blocks, vocab_size: int | None = None) -> None:
        raw = self.tokens.view(np.uint8) if self.num_tokens else np.zeros(0, np.uint8)
        for b in blocks:
            chunk = raw[b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES]
            if zlib.crc32(memoryview(np.ascontiguousarray(chunk))) != self.crcs[b]:
                raise _damaged(self.dir / f"{self.name}.bin", self.dir,
                               f"does not match its checksum (block {b}: bytes {b * BLOCK_BYTES}-"
                               f"{b * BLOCK_BYTES + len(chunk)})")
            if vocab_size is not None and len(chunk) and int(chunk.view(self.dtype).max()) >= vocab_size:
                raise _damaged(self.dir / f"{self.name}.bin", self.dir,
                               f"holds a token id beyond the tokenizer's {vocab_size} tokens (block {b})")

    def verify(self, vocab_size: int | None = None) -> None:
        """Every block of the token file and the offsets against the checksums recorded when built."""
        self.check_blocks(range(len(self.crcs)), vocab_size)
        if zlib.crc32(np.ascontiguousarray(self.offsets).tobytes()) != self.record.get("offsets_crc32"):
            raise _damaged(self.dir / f"{self.name}.npy", self.dir, "does not match its checksum")


def _sampled(num_blocks: int, name: str) -> list[int]:
    """The first, the last and a few fixed pseudo-random blocks (the same ones on every open)."""
    if num_blocks <= SAMPLED_BLOCKS + 2:
        return list(range(num_blocks))
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return sorted({0, num_blocks - 1, *rng.choice(num_blocks, SAMPLED_BLOCKS, replace=False).tolist()})


class TokenCache:
    """Read-only view of a complete cache: `doc(i)` -> tokens, `offsets` int64 [N+1] (memory-mapped), shards."""

    def __init__(self, path: Path, vocab_size: int | None = None):
        self.path = Path(path)
        self.vocab_size = vocab_size
        self.meta = read_json(self.path / "meta.json", self.path)
        try:
            self.key: str = self.meta["key"]
            num_shards = int(self.meta["num_shards"])
            version = self.meta["format_version"]
        except (KeyError, TypeError, ValueError):
            raise _damaged(self.path / "meta.json", self.path, "lacks the cache's key or shard count") from None
        if version != FORMAT_VERSION:
            raise _damaged(self.path / "meta.json", self.path, f"is format {version}, this moela reads "
                           f"{FORMAT_VERSION}")
        self.shards = [Shard(self.path, i, vocab_size, check=False) for i in range(num_shards)]  # checked at use
        self.offsets = load_offsets(self.path / "offsets.npy", self.path)  # [N+1]
        counts = [s.num_docs for s in self.shards]
        self.shard_first_doc = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # [S+1]
        self.shard_first_token = np.concatenate([[0], np.cumsum([s.num_tokens for s in self.shards])]
                                                ).astype(np.int64)  # [S+1]
        if len(self.offsets) != self.shard_first_doc[-1] + 1 or int(self.offsets[-1]) != self.shard_first_token[-1]:
            raise _damaged(self.path / "offsets.npy", self.path, "does not agree with the shards' counts")
        self.dtype = self.shards[0].dtype if self.shards else np.dtype(np.uint16)

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def get(self, i: int) -> Shard:
        """Shard i, its content checked at its first use (the training stream reads a cache shard by shard)."""
        shard = self.shards[i]
        if not shard.checked:
            shard.check_sampled()
        return shard

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)  # [N] int64

    def doc(self, i: int) -> np.ndarray:
        """Document i's tokens (a memory-mapped view)."""
        s = int(np.searchsorted(self.shard_first_doc, i, side="right")) - 1
        shard, base = self.shards[s], self.shard_first_token[s]
        if not shard.checked:
            shard.check_sampled()
        return shard.tokens[int(self.offsets[i]) - base:int(self.offsets[i + 1]) - base]

    def verify(self, vocab_size: int | None = None, progress=None) -> None:
        for shard in self.shards:
            shard.verify(vocab_size)
            if progress is not None:
                progress(shard)
