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
from pathlib import Path

from .config import SourceConfig, expand_path

BUNDLED_CORPUS = Path(__file__).resolve().parent / "corpus" / "shakespeare.jsonl"
HINT_MAX_BYTES = 1 << 30  # count jsonl lines for the progress bar's total only below this size
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

    def num_documents_hint(self) -> int | None:
        """Number of documents if known cheaply (for the progress bar; approximate), else None."""
        n = None
        if self.cfg.source == "text" and self.cfg.doc_separator is None:
            n = len(self.files)
        elif self.cfg.source in ("bundled", "jsonl") and sum(map(os.path.getsize, self.files)) < HINT_MAX_BYTES:
            n = sum(_count_lines(f) for f in self.files)
        elif self.cfg.source == "parquet":
            import pyarrow.parquet as pq

            n = sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)
        if n is not None and self.cfg.max_docs is not None:
            n = min(n, self.cfg.max_docs)
        return n

    def __iter__(self) -> Iterator[str]:
        kind = self.cfg.source
        if kind == "bundled":
            texts = _jsonl_texts(self.files[0], "text")
        elif kind == "jsonl":
            texts = (t for f in self.files for t in _jsonl_texts(f, self.cfg.text_field))
        elif kind == "text":
            texts = (t for f in self.files for t in _text_docs(f, self.cfg.doc_separator))
        elif kind == "parquet":
            texts = (t for f in self.files for t in _parquet_texts(f, self.cfg.text_field))
        elif kind == "hf":
            texts = _hf_texts(self.cfg, self.files)
        else:
            raise ValueError(f"data.source: unknown source '{kind}'; use bundled, text, jsonl, parquet or hf")
        return itertools.islice((t for t in texts if t.strip()), self.cfg.max_docs)


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _jsonl_texts(path: str, field: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                 f"{e.start + 1}); JSON lines must be UTF-8: convert the file, e.g. with "
                                 f"iconv -f latin1 -t utf-8") from None
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object") from e
            if not isinstance(record, dict) or field not in record:
                keys = list(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path}:{lineno}: no field '{field}' (has {keys}); set data.text_field")
            text = record[field]
            if not isinstance(text, str):
                raise TypeError(f"{path}:{lineno}: field '{field}' holds {type(text).__name__}, expected a string")
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


def _parquet_texts(path: str, column: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if column not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no column '{column}' (has {pf.schema_arrow.names}); set data.text_field")
    for batch in pf.iter_batches(columns=[column], batch_size=4096):
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
