"""Building a token cache: worker processes tokenize slices of the source into shards, in parallel, on any number
of machines that share the cache directory.

Decisions:
- The source is cut into slices (`DocumentSource.slices`: byte ranges of jsonl files, row groups, whole text
  files) of about `data.shard_bytes` each; slice i becomes shard i. The cut depends only on the files and the
  shard size, and every shard holds exactly the documents of its slice, so the cache (the shards in order) is
  byte-identical whatever the number of workers or machines, and equal to tokenizing the documents one by one.
- Work is shared through the cache directory: a worker takes the next shard without a `.json` record and without
  a live claim, under the cache's advisory lock, and leaves a `NNNNN.claim` file (host and pid) while it works.
  Every process that needs the cache (each rank, each node, `python -m moela prepare`) runs its own
  `data.tokenize_workers` workers, so they all split the shards instead of waiting for one builder. A claim whose
  process has died (same host), or that has not been refreshed for `CLAIM_STALE_S` (another host), is taken over;
  the dead worker's temporary files are removed then. The first process to find every shard done writes the global
  `offsets.npy` and `meta.json` (cache.py), under the lock.
- Workers are forked processes (one core each: the Rust tokenizer's own thread pool is switched off in them), so N
  workers use N cores. Shards are claimed in an order the caller chooses (the stream loader asks for the shards its
  first steps need first).
- Memory stays bounded per document: a document longer than `LONG_DOC_CHARS` characters is encoded in pieces cut
  just before a space that follows a non-space character. Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen,
  DeepSeek-V3 and the bundled one) never merge across that point (their pre-tokenizer splits there), so the ids
  equal those of encoding the document whole; a document with no such space in a piece's last half is cut at the
  piece length.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .cache import FORMAT_VERSION, CacheError, ShardWriter, TokenCache, finish_cache, shard_name, token_dtype
from .sources import DocumentSource, Slice
from .tokenizer import Tokenizer

DEFAULT_SHARD_BYTES = 64 << 20  # data.shard_bytes' default
BATCH_CHARS = 1 << 20  # characters per encode call
LONG_DOC_CHARS = 1 << 16  # a document longer than this is encoded in pieces (see the module docstring): the
# tokenizer's time per character grows with the text's length (3x slower at 1M characters than at 64k)
CLAIM_STALE_S = 600.0  # a claim from another host not refreshed for this long is taken over
HEARTBEAT_S = 30.0
POLL_S = 0.5


def default_workers() -> int:
    """The cores available to this process, divided among the node's ranks (torchrun's LOCAL_WORLD_SIZE)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        ranks = 1
    return max(1, cores // ranks)


@contextlib.contextmanager
def file_lock(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Plan:
    """What to build: the cache directory, its slices, the tokenizer and the shard order to claim in."""

    def __init__(self, source: DocumentSource, tokenizer: Tokenizer, cache_dir: Path, key: str, shard_bytes: int,
                 order: list[int] | None = None):
        self.source, self.tokenizer, self.dir, self.key = source, tokenizer, cache_dir, key
        self.lock = cache_dir.parent / f"{cache_dir.name}.lock"
        self.slices: list[Slice] = source.slices(shard_bytes)
        self.order = list(range(len(self.slices))) if order is None else order
        self.dtype = token_dtype(tokenizer.vocab_size)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.slices)

    def done(self, i: int) -> bool:
        return (self.dir / f"{shard_name(i)}.json").is_file()

    def complete(self) -> bool:
        return (self.dir / "meta.json").is_file()

    def claim(self) -> int | None:
        """Under the lock: take the first shard in `order` that is neither done nor claimed by a live worker."""
        with file_lock(self.lock):
            for i in self.order:
                claim = self.dir / f"{shard_name(i)}.claim"
                # the claim before the record: a worker writes its record, then drops its claim (not under the lock)
                if (claim.is_file() and _claim_alive(claim)) or self.done(i):
                    continue
                for tmp in self.dir.glob(f".{shard_name(i)}.tmp-*"):
                    tmp.unlink(missing_ok=True)
                claim.write_text(f"{socket.gethostname()} {os.getpid()}")
                return i
        return None

    def all_claimed(self) -> bool:
        """Whether every unfinished shard is claimed by a live worker (here or on another host): nothing is left for
        another process's workers until one finishes or dies."""
        return all(self.done(i) or _claim_alive(self.dir / f"{shard_name(i)}.claim") for i in self.order)

    def finalize(self) -> None:
        """Under the lock, once: the global offsets over all shards, then meta.json (the cache is complete)."""
        with file_lock(self.lock):
            if self.complete():
                return
            t = self.tokenizer
            finish_cache(self.dir, self.key, len(self.slices), {
                "vocab_size": t.vocab_size, "eos_id": t.eos_id, "bos_id": t.bos_id, "tokenizer": t.name,
                "source": self.source.fingerprint(), "slices": [[list(p) for p in s.parts] for s in self.slices]})
            for claim in self.dir.glob("*.claim"):
                claim.unlink(missing_ok=True)


def _claim_alive(path: Path) -> bool:
    try:
        host, pid = path.read_text().split()
        age = time.time() - path.stat().st_mtime
    except (OSError, ValueError):
        return False
    if host != socket.gethostname():
        return age < CLAIM_STALE_S
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def work(plan: Plan, report) -> None:
    """Claim and build shards until none is left; `report(kind, *values)` sees progress."""
    while (i := plan.claim()) is not None:
        try:
            build_shard(plan, i, report)
        finally:
            (plan.dir / f"{shard_name(i)}.claim").unlink(missing_ok=True)


def build_shard(plan: Plan, i: int, report) -> dict:
    """Tokenize slice i into shard i (see the module docstring); returns the shard's record."""
    t = plan.tokenizer
    writer = ShardWriter(plan.dir, i, plan.dtype)
    claim = plan.dir / f"{shard_name(i)}.claim"
    beat = time.monotonic()
    reported = 0
    batch: list[str] = []
    chars = 0

    def flush():
        nonlocal batch, chars, reported, beat
        if batch:
            tokens, lengths = encode_documents(t, batch, plan.dtype)
            writer.write(tokens)
            writer.end_docs(lengths)
            report("tokens", chars, len(tokens))
            reported += chars
        batch, chars = [], 0
        if time.monotonic() - beat > HEARTBEAT_S:
            os.utime(claim)
            beat = time.monotonic()

    try:
        for text in plan.source.read(plan.slices[i]):
            if len(text) > LONG_DOC_CHARS:
                flush()
                n = write_long_document(t, text, plan.dtype, writer)
                report("tokens", len(text), n)
                reported += len(text)
                continue
            batch.append(text)
            chars += len(text)
            if chars >= BATCH_CHARS:
                flush()
        flush()
        record = writer.commit()
    except BaseException:
        writer.abort()
        raise
    report("shard", i, plan.slices[i].nbytes - reported)
    return record


def encode_documents(t: Tokenizer, texts: list[str], dtype) -> tuple[np.ndarray, np.ndarray]:
    """Tokens [sum of lengths] of the documents back to back (BOS, ids, EOS each) and their lengths [n]."""
    ids = t.encode_batch(texts)
    lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))  # [n]
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lens.sum()))  # [sum lens]
    bos = 0 if t.bos_id is None else 1
    doc_lens = lens + bos + 1  # [n]
    ends = np.cumsum(doc_lens)  # [n]
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=dtype)
    shift = np.arange(len(ids), dtype=np.int64) * (bos + 1) + bos  # [n]: the specials before document i's ids
    out[np.arange(len(flat)) + np.repeat(shift, lens)] = flat
    out[ends - 1] = t.eos_id
    if bos:
        out[ends - doc_lens] = t.bos_id
    return out, doc_lens


def cut_points(text: str, piece: int) -> list[int]:
    """Where to cut a long text: before a space that follows a non-space and precedes one (module docstring)."""
    cuts, pos = [0], 0
    while len(text) - pos > piece:
        j = text.rfind(" ", pos + piece // 2, pos + piece)
        while j > pos and (text[j - 1].isspace() or j + 1 >= len(text) or text[j + 1].isspace()):
            j = text.rfind(" ", pos + piece // 2, j)
        pos = j if j > pos else pos + piece
        cuts.append(pos)
    return cuts + [len(text)]


def write_long_document(t: Tokenizer, text: str, dtype, writer: ShardWriter) -> int:
    """Encode one long document piece by piece straight into the shard; returns its length in tokens."""
    n = 0
    if t.bos_id is not None:
        writer.write(np.asarray([t.bos_id], dtype=dtype))
        n += 1
    cuts = cut_points(text, LONG_DOC_CHARS)
    for a, b in zip(cuts[:-1], cuts[1:]):
        ids = np.asarray(t.encode(text[a:b]), dtype=dtype)
        writer.write(ids)
        n += len(ids)
    writer.write(np.asarray([t.eos_id], dtype=dtype))
    writer.end_docs([n + 1])
    return n + 1


STOP_GRACE_S = 5.0  # how long stopped workers get to exit before they are killed


class Builder:
    """Runs `workers` forked worker processes on a plan and collects their progress and errors (`poll`)."""

    def __init__(self, plan: Plan, workers: int):
        ctx = mp.get_context("fork")
        self.plan = plan
        self.queue = ctx.Queue()
        self.procs = [ctx.Process(target=_worker_main, args=(plan, self.queue), daemon=True)
                      for _ in range(max(1, min(workers, len(plan.slices))))]
        for p in self.procs:
            p.start()

    def poll(self, timeout: float, on_progress) -> bool:
        """Handle the workers' messages for up to `timeout` s; False once every worker has exited (their last
        messages handled: a worker flushes its queue before it exits)."""
        finished = all(not p.is_alive() for p in self.procs)
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self.queue.get(timeout=0.05 if finished else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if message[0] == "error":
                self.stop()
                raise _rebuilt_error(*message[1:])
            if message[0] == "log":  # a worker's warning (an undecodable byte), logged here where handlers are
                logging.getLogger(message[1]).log(message[2], "%s", message[3])
                continue
            on_progress(*message)
        if not finished:
            return True
        for p in self.procs:
            p.join()
        bad = [p.exitcode for p in self.procs if p.exitcode]
        if bad:
            raise RuntimeError(f"a tokenizer worker died (exit code {bad[0]}) while building {self.plan.dir}")
        return False

    def stop(self) -> None:
        """Terminate the workers. A worker blocks at exit until its queued messages reach the pipe, so the queue is
        drained while they exit; one that has not exited after `STOP_GRACE_S` is killed."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        while any(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
            try:
                self.queue.get(timeout=0.05)
            except queue.Empty:
                pass
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()


class _LogToParent(logging.Handler):
    """A worker's log records, sent to the parent (which logs them through its own handlers)."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        self.out.put(("log", record.name, record.levelno, record.getMessage()))


def _worker_main(plan: Plan, out) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    logging.getLogger().handlers = [_LogToParent(out)]  # the forked copies of the parent's handlers stay unused
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stopped: remove the partial shard and the claim
    try:
        work(plan, lambda *m: out.put(m))
    except Exception as e:  # sent to the parent, which raises it there (see _rebuilt_error)
        kind = next((c.__name__ for c in (ValueError, TypeError, OSError) if isinstance(e, c)), None)
        out.put(("error", kind, str(e) if kind else traceback.format_exc()))
    out.close()
    out.join_thread()


def _rebuilt_error(kind: str | None, message: str) -> Exception:
    """A worker's exception as the parent raises it: bad input (ValueError, TypeError) and unreadable or damaged
    files (OSError) keep their message and class family, which the caller maps to an exit code; anything else is a
    bug, raised with the worker's traceback."""
    return {"ValueError": ValueError, "TypeError": TypeError, "OSError": OSError}.get(kind, RuntimeError)(message)


def cache_key(source_fingerprint: dict, tokenizer: Tokenizer, shard_bytes: int) -> str:
    blob = json.dumps({"v": FORMAT_VERSION, "source": source_fingerprint, "tokenizer": tokenizer.fingerprint(),
                       "shard_bytes": shard_bytes}, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def make_plan(source: DocumentSource, tokenizer: Tokenizer, cache_root: str | os.PathLike, shard_bytes: int,
              order: list[int] | None = None) -> Plan:
    key = cache_key(source.fingerprint(), tokenizer, shard_bytes)
    root = Path(os.path.expanduser(str(cache_root)))
    (root / key[:20]).mkdir(parents=True, exist_ok=True)
    return Plan(source, tokenizer, root / key[:20], key, shard_bytes, order)


def build(plan: Plan, workers: int, show_progress: bool = True) -> None:
    """Build this process's share of the missing shards, wait for the shards other processes build (taking over
    those whose worker died), then finalize. Returns at once if the cache is complete."""
    if plan.complete():
        return
    bar = Progress(plan, show_progress)
    try:
        while not all(plan.done(i) for i in range(len(plan.slices))):
            if plan.all_claimed():
                time.sleep(POLL_S)
                bar.poll_disk()
                continue
            builder = Builder(plan, workers)
            while builder.poll(POLL_S, bar.update):
                pass
    finally:
        bar.close()
    plan.finalize()


class Progress:
    """A progress bar over the source's bytes, with tokens/s; shards finished elsewhere count when seen."""

    def __init__(self, plan: Plan, show: bool):
        self.plan, self.show = plan, show
        self.counted: set[int] = {i for i in range(len(plan.slices)) if plan.done(i)}
        self.tokens, self.start = 0, time.monotonic()
        self.bar = tqdm(total=plan.total_bytes, unit="B", unit_scale=True, dynamic_ncols=True, disable=not show,
                        desc=f"tokenizing {len(plan.slices)} shards into {plan.dir}",
                        initial=sum(plan.slices[i].nbytes for i in self.counted))

    def update(self, kind: str, a: int, b: int) -> None:
        if kind == "tokens":
            self.bar.update(a)
            self.tokens += b
            rate = self.tokens / max(time.monotonic() - self.start, 1e-9)
            self.bar.set_postfix_str(f"{rate / 1e6:.2f}M tokens/s", refresh=False)
        else:
            self.counted.add(a)
            self.bar.update(b)

    def poll_disk(self) -> None:
        for i in range(len(self.plan.slices)):
            if i not in self.counted and self.plan.done(i):
                self.counted.add(i)
                self.bar.update(self.plan.slices[i].nbytes)

    def close(self) -> None:
        self.bar.close()


def build_or_load_cache(source: DocumentSource, tokenizer: Tokenizer, cache_root: str | os.PathLike, *,
                        shard_bytes: int = DEFAULT_SHARD_BYTES, workers: int | None = None,
                        show_progress: bool = True) -> TokenCache:
    """The complete cache of (source, tokenizer), built first (or helped with) if needed, opened and checked."""
    plan = make_plan(source, tokenizer, cache_root, shard_bytes)
    build(plan, workers or default_workers(), show_progress)
    cache = TokenCache(plan.dir, tokenizer.vocab_size)
    if cache.key != plan.key:
        raise CacheError(f"token cache {plan.dir} belongs to other data (key {cache.key[:20]}...); delete {plan.dir} "
                         f"to rebuild it")
    return cache
