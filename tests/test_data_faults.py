"""A damaged token cache is named in one line with the directory to delete: garbage meta.json, truncated offsets,
a zeroed or truncated token file, ids beyond the vocabulary (even with rewritten checksums); `prepare --verify`
finds damage the sampled check on open does not read; training stops with exit code 1, no traceback."""

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from factories import tiny_overrides
from moela.data import DataConfig, load_tokenizer
from moela.data import cache as cache_mod
from moela.data.build import build_or_load_cache
from moela.data.cache import CacheError, TokenCache
from moela.data.sources import DocumentSource
from moela.tools.cli import main as moela_main

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import train  # noqa: E402

SHARD = 1 << 20
TINY = [*tiny_overrides(vocab_size=4096, num_hidden_layers=1, n_routed_experts=4, q_lora_rank=16),
        "data.max_doc_len=64", "data.val_max_tokens=256", "train.tokens_per_microbatch=128", "train.cpu_threads=1",
        "train.eval_every=0", "logging.plot=false", "logging.progress_bar=never", "train.steps=2",
        f"data.shard_bytes={SHARD}"]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cache")
    cache = build_or_load_cache(DocumentSource(DataConfig()), load_tokenizer(), root, shard_bytes=SHARD,
                                show_progress=False)
    assert len(cache.shards) >= 4
    return cache.path


@pytest.fixture
def cache_copy(built, tmp_path) -> Path:
    path = tmp_path / "root" / built.name
    shutil.copytree(built, path)
    return path


def zero(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


DAMAGE = {
    "garbage meta.json": ("meta.json", lambda p: p.write_text('{"key": oops'), "is not valid JSON"),
    "truncated offsets.npy": ("offsets.npy", truncate, "is truncated or not an offsets array"),
    "truncated shard offsets": ("00001.npy", truncate, "is truncated or not an offsets array"),
    "zeroed tokens": ("00002.bin", zero, "does not match its checksum"),
    "truncated tokens": ("00003.bin", truncate, "bytes, its offsets need"),
    "garbage shard record": ("00000.json", lambda p: p.write_bytes(b"\x00\xff"), "is not valid JSON"),
    "missing shard": ("00001.bin", lambda p: p.unlink(), "has 0 bytes"),
}


def open_and_use(path: Path, vocab_size: int) -> TokenCache:
    """Open a cache and read a document of every shard (each shard's content is checked at its first use)."""
    cache = TokenCache(path, vocab_size=vocab_size)
    for first in cache.shard_first_doc[:-1]:
        cache.doc(int(first))
    return cache


@pytest.mark.parametrize("case", DAMAGE)
def test_each_damage_is_named_with_the_directory_to_delete(cache_copy, case):
    name, damage, problem = DAMAGE[case]
    damage(cache_copy / name)
    with pytest.raises(CacheError) as info:
        open_and_use(cache_copy, 4096)
    message = str(info.value)
    assert "\n" not in message and f"token cache file {cache_copy / name} " in message and problem in message
    assert message.endswith(f"delete {cache_copy} to rebuild it")


def rewrite_shard(path: Path, shard: int, position: int, value: int, update_max: bool) -> None:
    """Put `value` at `position` of a shard and rewrite its checksums (as an attacker or a buggy tool would)."""
    tokens = np.fromfile(path / f"{shard:05d}.bin", dtype=np.uint16)
    tokens[position] = value
    tokens.tofile(path / f"{shard:05d}.bin")
    record = json.loads((path / f"{shard:05d}.json").read_text())
    record["crc32"] = cache_mod.block_crcs(tokens)
    if update_max:
        record["max_id"] = int(tokens.max())
    (path / f"{shard:05d}.json").write_text(json.dumps(record))


def test_ids_beyond_the_vocabulary_are_refused_even_with_valid_checksums(cache_copy):
    original = int(np.fromfile(cache_copy / "00001.bin", dtype=np.uint16)[10])
    rewrite_shard(cache_copy, 1, 10, 5000, update_max=True)
    with pytest.raises(CacheError, match=r"00001\.bin holds token id 5000, beyond the tokenizer's 4096 tokens"):
        TokenCache(cache_copy, vocab_size=4096)
    rewrite_shard(cache_copy, 1, 10, original, update_max=True)
    open_and_use(cache_copy, 4096)
    rewrite_shard(cache_copy, 1, 10, 5000, update_max=False)  # the record lies: the sampled blocks still show it
    with pytest.raises(CacheError, match=r"00001\.bin holds a token id beyond the tokenizer's 4096 tokens"):
        open_and_use(cache_copy, 4096)
    assert open_and_use(cache_copy, 8192).num_docs > 0


def small_block_cache(tmp_path, monkeypatch) -> tuple[list[str], TokenCache]:
    monkeypatch.setattr(cache_mod, "BLOCK_BYTES", 4096)
    overrides = [f"data.cache_dir={tmp_path / 'cache'}", f"data.shard_bytes={SHARD}"]
    cache = build_or_load_cache(DocumentSource(DataConfig()), load_tokenizer(), tmp_path / "cache",
                                shard_bytes=SHARD, show_progress=False)
    return overrides, cache


def unsampled_block(cache: TokenCache, shard: int) -> int:
    """A block of the shard that opening the cache does not check."""
    sampled = cache_mod._sampled(len(cache.shards[shard].crcs), cache.shards[shard].name)
    return next(b for b in range(1, len(cache.shards[shard].crcs)) if b not in sampled)


def test_verify_finds_what_the_sampled_check_does_not_read(tmp_path, monkeypatch, capsys):
    overrides, cache = small_block_cache(tmp_path, monkeypatch)
    block = unsampled_block(cache, 2)
    bin_path = cache.path / "00002.bin"
    data = bytearray(bin_path.read_bytes())
    data[block * 4096 + 7] ^= 0x01
    bin_path.write_bytes(bytes(data))
    open_and_use(cache.path, 4096)  # the sampled check passes
    assert moela_main(["prepare", str(ROOT / "recipes" / "tiny.yaml"), *overrides]) == 0
    capsys.readouterr()
    assert moela_main(["prepare", str(ROOT / "recipes" / "tiny.yaml"), *overrides, "--verify"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"error: token cache file {bin_path} does not match its checksum (block {block}: bytes "
                   f"{block * 4096}-{block * 4096 + 4096}); delete {cache.path} to rebuild it")


def test_training_on_a_damaged_cache_exits_1_with_one_line(tmp_path, monkeypatch, capsys):
    overrides, cache = small_block_cache(tmp_path, monkeypatch)
    args = [str(ROOT / "recipes" / "tiny.yaml"), *TINY, *overrides]
    for shard in cache.shards:
        zero(cache.path / f"{shard.name}.bin")
    assert train.main([*args, f"train.run_dir={tmp_path / 'run1'}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(
        f"error: cannot read the training data: token cache file {re.escape(str(cache.path))}/\\d{{5}}\\.bin does not "
        f"match its checksum \\(block 0: bytes 0-4096\\); delete {re.escape(str(cache.path))} to rebuild it", err[0])
    shutil.rmtree(cache.path)
    _, cache = small_block_cache(tmp_path, monkeypatch)
    for shard in cache.shards:  # ids beyond the vocabulary in every block the sampled check does not read
        sampled = cache_mod._sampled(len(shard.crcs), shard.name)
        hidden = [np.arange(b * 2048, min((b + 1) * 2048, shard.num_tokens)) for b in range(len(shard.crcs))
                  if b not in sampled]
        if hidden:
            rewrite_shard(cache.path, int(shard.name), np.concatenate(hidden), 4500, update_max=False)
    assert train.main([*args, f"train.run_dir={tmp_path / 'run2'}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot read the training data: token cache {cache.path}: "
                                               f"document ")
    assert err[0].endswith(f"holds token id 4500, beyond the tokenizer's 4096 tokens; delete {cache.path} to rebuild "
                           f"it")
