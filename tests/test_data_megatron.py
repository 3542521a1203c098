"""The Megatron-LM source: datasets written in the layout of Megatron-LM's IndexedDatasetBuilder read back exactly
(token dtypes, one or several sequences per document, several files), the same batches as the jsonl source of the
same documents, read unit by unit across files (every token once an epoch), blends through the mixture, and damaged
files named."""

import json
import struct

import numpy as np
import pytest

from moela.data import DataConfig, MixtureSource, build_loaders
from moela.data import megatron as megatron_mod
from moela.data.cache import CacheError
from moela.data.megatron import MegatronSource

CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def write_megatron(prefix, documents, dtype=np.int32, sentences=False) -> None:
    """Megatron-LM's builder, step by step: every sequence's tokens appended to .bin; the index holds the header,
    then int32 lengths, int64 byte pointers and int64 document indices (the sequence count before each document
    ends, starting with 0). `sentences`: each document is stored as sequences of at most 5 tokens."""
    lengths, doc_index = [], [0]
    with open(f"{prefix}.bin", "wb") as f:
        for doc in documents:
            pieces = [doc[i:i + 5] for i in range(0, len(doc), 5)] if sentences else [doc]
            for piece in pieces:
                f.write(np.asarray(piece, dtype=dtype).tobytes())
                lengths.append(len(piece))
            doc_index.append(len(lengths))
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * itemsize if lengths else []
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_index)))
        f.write(np.asarray(lengths, dtype=np.int32).tobytes())
        f.write(np.asarray(pointers, dtype=np.int64).tobytes())
        f.write(np.asarray(doc_index, dtype=np.int64).tobytes())


def random_documents(seed, n, vocab=4096):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, 60))).tolist() for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
@pytest.mark.parametrize("sentences", [False, True])
def test_round_trip_is_exact_across_files(tmp_path, dtype, sentences):
    a, b = random_documents(0, 37), random_documents(1, 23)
    write_megatron(tmp_path / "a", a, dtype, sentences)
    write_megatron(tmp_path / "b", b, dtype, sentences)
    source = MegatronSource([str(tmp_path / "a"), str(tmp_path / "b.bin")], vocab_size=4096)
    assert source.num_docs == 60 and source.num_tokens == sum(map(len, a + b)) and source.dtype == np.dtype(dtype)
    assert [source.doc(i).tolist() for i in range(60)] == a + b
    np.testing.assert_array_equal(source.doc_lengths, [len(d) for d in a + b])
    source.verify(4096)
    by_dir = MegatronSource([str(tmp_path)])
    assert [f.prefix for f in by_dir.files] == [str(tmp_path / "a"), str(tmp_path / "b")]


def test_same_batches_as_the_jsonl_source_of_the_same_documents(tmp_path):
    rng = np.random.default_rng(2)
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"text": " ".join(["the", "sea", "night", "king"][i] for i in
                                                      rng.integers(0, 4, int(rng.integers(1, 200))))}) + "\n"
                         for _ in range(300)))
    common = dict(tokens_per_microbatch=256, dp_size=2, grad_accum=2, seed=3, show_progress=False)
    jsonl = DataConfig(source="jsonl", paths=[str(f)], cache_dir=str(tmp_path / "c"), val_fraction=0.05,
                       max_doc_len=100)
    train, val, _ = build_loaders(jsonl, **common)
    cache = train.stores[0]
    write_megatron(tmp_path / "mega", [cache.doc(i).tolist() for i in range(cache.num_docs)], np.uint16)
    megatron = DataConfig(source="megatron", paths=[str(tmp_path / "mega.idx")], val_fraction=0.05, max_doc_len=100)
    assert megatron.validate() == []
    m_train, m_val, _ = build_loaders(megatron, **common)
    for _ in range(6):
        for x, y in zip(train.next_step(), m_train.next_step()):
            assert x.input_ids.tolist() == y.input_ids.tolist() and x.labels.tolist() == y.labels.tolist()
            assert x.cu_seqlens.tolist() == y.cu_seqlens.tolist()
    assert [b.input_ids.tolist() for b in val] == [b.input_ids.tolist() for b in m_val]


@pytest.mark.parametrize("sentences", [False, True])
def test_units_cover_the_documents_across_files_and_every_token_once_an_epoch(tmp_path, monkeypatch, sentences):
    a, b = random_documents(5, 23), random_documents(6, 18)
    write_megatron(tmp_path / "a", a, np.uint16, sentences)
    write_megatron(tmp_path / "b", b, np.uint16, sentences)
    monkeypatch.setattr(megatron_mod, "UNIT_DOCS", 7)  # units straddle the two files
    source = MegatronSource([str(tmp_path / "a"), str(tmp_path / "b")], vocab_size=4096)
    units = [source.get(i) for i in range(source.num_shards)]
    assert source.num_shards == 6 and [len(u.doc_lengths) for u in units] == [7] * 5 + [6]
    assert [u.doc(i).tolist() for u in units for i in range(len(u.doc_lengths))] == a + b
    np.testing.assert_array_equal(np.concatenate([u.doc_lengths for u in units]), [len(d) for d in a + b])
    cfg = DataConfig(source="megatron", paths=[str(tmp_path / "a"), str(tmp_path / "b")], val_fraction=0.0)
    train, _, _ = build_loaders(cfg, tokens_per_microbatch=64, grad_accum=2, seed=1, show_progress=False)
    stream = train.sources[0]
    per_epoch = sum(len(stream._pack(0, k, 0).bins) for k in range(6))
    got = [b.input_ids.tolist() for _ in range(-(-per_epoch // 2)) for b in train.next_step()][:per_epoch]
    assert sorted(t for x in got for t in x) == sorted(t for d in a + b for t in d)


def test_a_blend_through_the_mixture(tmp_path):
    write_megatron(tmp_path / "web", [[7] * 50 for _ in range(60)])
    write_megatron(tmp_path / "code", [[9] * 50 for _ in range(60)])
    cfg = DataConfig(mixture=[MixtureSource(source="megatron", paths=[str(tmp_path / "web")], weight=3.0),
                              MixtureSource(source="megatron", paths=[str(tmp_path / "code")], weight=1.0)])
    train, _, _ = build_loaders(cfg, tokens_per_microbatch=100, grad_accum=4, seed=0, show_progress=False)
    ids = np.concatenate([b.input_ids.numpy() for _ in range(10) for b in train.next_step()])
    share = float((ids == 7).sum()) / len(ids)
    assert 0.65 < share < 0.85, f"weights 3:1 should give about 0.75 of the tokens to the first source, got {share}"


def test_damaged_or_mismatched_files_are_named(tmp_path):
    write_megatron(tmp_path / "d", random_documents(4, 20))
    idx, data = tmp_path / "d.idx", (tmp_path / "d.idx").read_bytes()
    for damage, problem in ((b"NOTMEGA\x00\x00" + data[9:], "bad header"), (data[:-8], "truncated or damaged"),
                            (data[:17] + b"\x06" + data[18:], "not an integer token type")):
        idx.write_bytes(damage)
        with pytest.raises(CacheError, match=f"{idx} .*{problem}.*remove {tmp_path / 'd'} from data.paths"):
            MegatronSource([str(tmp_path / "d")])
    idx.write_bytes(data)
    with open(tmp_path / "d.bin", "ab") as f:
        f.write(b"\x00\x00\x00\x00")
    with pytest.raises(CacheError, match="d.bin has .* bytes, its index needs"):
        MegatronSource([str(tmp_path / "d")])
    write_megatron(tmp_path / "d", [[1, 2, 3], [5000, 4]])
    with pytest.raises(CacheError, match="outside the tokenizer's 4096 tokens"):
        MegatronSource([str(tmp_path / "d")], vocab_size=4096)
    (tmp_path / "lonely.idx").write_bytes(data)
    errors = DataConfig(source="megatron", paths=[str(tmp_path / "lonely"), str(tmp_path / "none")]).validate()
    assert any("lonely.bin is missing" in e for e in errors) and any("names no Megatron dataset" in e for e in errors)
