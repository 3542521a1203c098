"""Document sources: turn the `data` section into a stream of document texts plus a fingerprint for the cache key.

Kinds: the bundled corpus (a jsonl file in the package), local text / jsonl / parquet files, and Hugging Face
`datasets` (a hub name when online, or a builder such as "json" with local data_files, which works offline).
Decisions: documents come out in a fixed order (files sorted, rows in file order), so the token cache and
everything derived from it is reproducible. The fingerprint of local files is (path, size, mtime), not their
content, so a cache check costs nothing; editing a file changes its mtime and therefore the cache key. Empty
documents (only whitespace) are skipped. A hub dataset is identified by name, config, split and revision: pin
`hf_revision` if the dataset may change upstream.

Input must be UTF-8. A jsonl line that is not is an error naming file and line (JSON has no other encoding). A text
file may hold a few undecodable bytes (a stray Latin-1 character): they become U+FFFD with a warning; when more than
MAX_REPLACED_SHARE of its characters would be replaced it is not text in UTF-8 (a binary file, or another
encoding) and is refused, naming the line of the first bad byte.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .config import SourceConfig, expand_path

BUNDLED_CORPUS = Path(__file__).resolve().parent / "corpus" / "shakespeare.jsonl"
MAX_REPLACED_SHARE = 0.01  # a text file with more undecodable characters than this share is not UTF-8 text

log = logging.getLogger(__name__)


class DocumentSource:
    """Iterable of document texts; `fingerprint()` identifies the content for the token-cache key."""

    def __init__(self, cfg: SourceConfig):
        self.cfg = cfg
        if cfg.source == "bundled":
            self.files = [str(BUNDLED_CORPUS)]
        else:
            self.files = [f for p in cfg.paths for f in expand_path(p)]
            missing = [p for p in cfg.paths if not expand_path(p)]
            if missing:
                raise FileNotFoundError(f"data.paths: {missing} match no file; check the paths or glob patterns")
            if cfg.source != "hf" and not self.files:
                raise ValueError(f"data.paths: source '{cfg.source}' needs at least one file")

    def describe(self) -> str:
        """Where the documents come from, for messages."""
        if self.cfg.source == "bundled":
            return f"the bundled corpus {self.files[0]}"
        if self.cfg.source == "hf" and not self.files:
            return f"dataset {self.cfg.hf_name!r} (config {self.cfg.hf_config}, split {self.cfg.hf_split})"
        more = f" and {len(self.files) - 3} more files" if len(self.files) > 3 else ""
        return ", ".join(self.files[:3]) + more

    def fingerprint(self) -> dict:
        c = self.cfg
        files = [[os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in self.files]
        fp = {"source": c.source, "files": files, "max_docs": c.max_docs}
        if c.source in ("jsonl", "parquet", "hf"):
            fp["text_field"] = c.text_field
        if c.source == "text":
            fp["doc_separator"] = c.doc_separator
        if c.source == "hf":
            fp.update(hf_name=c.hf_name, hf_config=c.hf_config, hf_split=c.hf_split, hf_revision=c.hf_revision,
                      hf_streaming=c.hf_streaming)
        return fp

    def slices(self, shard_bytes: int) -> list[Slice]:
        """The source cut into contiguous slices of about `shard_bytes` each, in document order (see `Slice`).
        The cut depends only on the files and `shard_bytes`, so every process and node computes the same one. The
        hf source and a source with `max_docs` are one slice (read in order by one worker)."""
        kind = self.cfg.source
        if kind == "hf":
            return [Slice((("", 0, -1),), 0)]
        if self.cfg.max_docs is not None:
            return [Slice(tuple((f, 0, -1) for f in self.files), sum(map(os.path.getsize, self.files)))]
        pieces = []  # (file, begin, end, bytes)
        for f in self.files:
            size = os.path.getsize(f)
            if kind == "parquet":
                import pyarrow.parquet as pq

                meta = pq.ParquetFile(f).metadata
                pieces += [(f, g, g + 1, meta.row_group(g).total_byte_size) for g in range(meta.num_row_groups)]
            elif kind == "text":
                pieces.append((f, 0, -1, size))
            else:
                pieces += [(f, b, min(b + shard_bytes, size), min(shard_bytes, size - b))
                           for b in range(0, size, shard_bytes)]
        out, group, group_bytes = [], [], 0
        for f, b, e, n in pieces:
            if group and group_bytes + n > shard_bytes:
                out.append(Slice(tuple(group), group_bytes))
                group, group_bytes = [], 0
            group.append((f, b, e))
            group_bytes += n
        if group or not out:
            out.append(Slice(tuple(group), group_bytes))
        return out

    def read(self, piece: Slice) -> Iterator[str]:
        """The non-empty documents of one slice, in order."""
        kind = self.cfg.source
        if kind == "hf":
            texts = _hf_texts(self.cfg, self.files)
        elif kind in ("bundled", "jsonl"):
            field = "text" if kind == "bundled" else self.cfg.text_field
            texts = (t for f, b, e in piece.parts for t in _jsonl_texts(f, field, b, e))
        elif kind == "text":
            texts = (t for f, _, _ in piece.parts for t in _text_docs(f, self.cfg.doc_separator))
        elif kind == "parquet":
            texts = (t for f, b, e in piece.parts for t in _parquet_texts(f, self.cfg.text_field, b, e))
        else:
            raise ValueError(f"data.source: unknown source '{kind}'; use bundled, text, jsonl, parquet or hf")
        return itertools.islice((t for t in texts if t.strip()), self.cfg.max_docs)

    def __iter__(self) -> Iterator[str]:
        return itertools.chain.from_iterable(self.read(s) for s in self.slices(1 << 62))


@dataclass(frozen=True)
class Slice:
    """A contiguous run of a source that one worker tokenizes into one shard: (file, begin, end) parts in order,
    each the lines starting in bytes [begin, end) of a jsonl file, row groups [begin, end) of a parquet file, or a
    whole file (end -1); `nbytes` is what the slice reads (for the progress bar)."""
    parts: tuple
    nbytes: int


def _line_number(path: str, pos: int) -> int:
    """The 1-based number of the line starting at byte `pos` (for messages; reads the file in chunks)."""
    count, done = 1, 0
    with open(path, "rb") as f:
        while done < pos:
            chunk = f.read(min(1 << 24, pos - done))
            count += chunk.count(b"\n")
            done += len(chunk)
    return count


def _jsonl_lines(path: str, begin: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(byte position, line) of each line that starts in [begin, end) (end -1: the file's end)."""
    with open(path, "rb") as f:
        if begin > 0:
            f.seek(begin - 1)
            if f.read(1) != b"\n":
                f.readline()  # the line that straddles `begin` belongs to the previous range
        while True:
            pos = f.tell()
            if 0 <= end <= pos:
                return
            raw = f.readline()
            if not raw:
                return
            yield pos, raw


def _jsonl_texts(path: str, field: str, begin: int = 0, end: int = -1) -> Iterator[str]:
    for pos, raw in _jsonl_lines(path, begin, end):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{_line_number(path, pos)}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at "
                             f"column {e.start + 1}); JSON lines must be UTF-8: convert the file, e.g. with "
                             f"iconv -f latin1 -t utf-8") from None
        del raw
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{_line_number(path, pos)}: not valid JSON ({e.msg}); each line must be one "
                             f"JSON object") from None
        del line
        if not isinstance(record, dict) or field not in record:
            keys = list(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{path}:{_line_number(path, pos)}: no field '{field}' (has {keys}); set "
                             f"data.text_field")
        text = record.pop(field)
        del record
        if not isinstance(text, str):
            raise TypeError(f"{path}:{_line_number(path, pos)}: field '{field}' holds {type(text).__name__}, "
                            f"expected a string")
        yield text


def _decode_text(path: str, data: bytes) -> str:
    """`data` as UTF-8; a few undecodable bytes become U+FFFD with a warning, many are an error (see above)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
    text = data.decode("utf-8", errors="replace")
    replaced = text.count("\ufffd")
    if replaced > MAX_REPLACED_SHARE * len(text):
        raise ValueError(f"{path}:{line}: {replaced} of {len(text)} characters ({replaced / len(text):.0%}) are not "
                         f"valid UTF-8 (the first on this line): this is a binary file or text in another encoding, "
                         f"not UTF-8 text. Remove it from data.paths, or convert it to UTF-8 (e.g. iconv -f latin1 "
                         f"-t utf-8)")
    log.warning("%s:%d: %d %s not valid UTF-8 (the first on this line); replaced by U+FFFD", path, line, replaced,
                "byte is" if replaced == 1 else "bytes are")
    return text


def _text_docs(path: str, separator: str | None) -> Iterator[str]:
    with open(path, "rb") as f:
        text = _decode_text(path, f.read())
    if separator is None:
        yield text
    else:
        yield from text.split(separator)


def _parquet_texts(path: str, column: str, first_group: int = 0, end_group: int = -1) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if column not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no column '{column}' (has {pf.schema_arrow.names}); set data.text_field")
    groups = range(first_group, pf.metadata.num_row_groups if end_group < 0 else end_group)
    if not len(groups):
        return
    for batch in pf.iter_batches(columns=[column], batch_size=4096, row_groups=list(groups)):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text


def _hf_texts(cfg: SourceConfig, files: list[str]) -> Iterator[str]:
    import datasets

    kwargs = {"split": cfg.hf_split}
    if files:
        kwargs["data_files"] = files
    if cfg.hf_revision:
        kwargs["revision"] = cfg.hf_revision
    try:
        ds = datasets.load_dataset(cfg.hf_name, cfg.hf_config, streaming=cfg.hf_streaming, **kwargs)
    except Exception as e:  # datasets raises many types (hub, builder, split errors); all mean "cannot load"
        raise ValueError(f"data.hf_name: could not load dataset '{cfg.hf_name}' (config {cfg.hf_config}, split "
                         f"{cfg.hf_split}): {e}. Check the name, config and split, the network (hub datasets need "
                         f"it unless already cached), or use local files with a builder (hf_name: json + paths)") from e
    columns = ds.column_names
    if columns is not None and cfg.text_field not in columns:
        raise ValueError(f"dataset '{cfg.hf_name}': no column '{cfg.text_field}' (has {columns}); "
                       f"set data.text_field")
    for batch in ds.iter(batch_size=1024):
        for text in batch[cfg.text_field]:
            if text is not None:
                yield text
