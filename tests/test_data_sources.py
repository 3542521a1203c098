"""Sources (text, jsonl, parquet, hf), the cache key, the bundled tokenizer (round trip, byte fallback) and
build_loaders end to end (the token cache itself: test_data_cache.py)."""

import hashlib
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moela.data import DataConfig, MixtureSource, build_loaders, load_tokenizer
from moela.data.sources import BUNDLED_CORPUS, DocumentSource

REPO = Path(__file__).resolve().parent.parent
DOCS = ["First document.\nTwo lines.", "Second, with ünïcödé ✓ and emoji 🎭.", "   ", "Third\n\nwith a gap."]


def nonempty(docs):
    return [d for d in docs if d.strip()]


def test_text_source_files_and_separator(tmp_path):
    d = tmp_path / "texts"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text(DOCS[1])
    (d / "a.txt").write_text(DOCS[0])
    (d / "sub" / "c.txt").write_text(DOCS[3])
    assert list(DocumentSource(DataConfig(source="text", paths=[str(d)]))) == [DOCS[0], DOCS[1], DOCS[3]]
    assert list(DocumentSource(DataConfig(source="text", paths=[str(d / "*.txt")]))) == [DOCS[0], DOCS[1]]
    joined = tmp_path / "joined.txt"
    joined.write_text("\n<doc>\n".join(DOCS))
    cfg = DataConfig(source="text", paths=[str(joined)], doc_separator="\n<doc>\n")
    assert list(DocumentSource(cfg)) == nonempty(DOCS)


def test_jsonl_source_custom_field_and_errors(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(DOCS)) + "\n\n")
    assert list(DocumentSource(DataConfig(source="jsonl", paths=[str(f)], text_field="body"))) == nonempty(DOCS)
    capped = DocumentSource(DataConfig(source="jsonl", paths=[str(f)], text_field="body", max_docs=2))
    assert list(capped) == nonempty(DOCS)[:2]
    with pytest.raises(ValueError, match="no field 'text'.*text_field"):
        list(DocumentSource(DataConfig(source="jsonl", paths=[str(f)])))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        list(DocumentSource(DataConfig(source="jsonl", paths=[str(bad)])))


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": DOCS + [None], "n": list(range(5))}), tmp_path / "d.parquet")
    cfg = DataConfig(source="parquet", paths=[str(tmp_path / "d.parquet")], text_field="content")
    assert list(DocumentSource(cfg)) == nonempty(DOCS)
    with pytest.raises(ValueError, match="no column 'text'"):
        list(DocumentSource(DataConfig(source="parquet", paths=[str(tmp_path / "d.parquet")])))


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_source_local_files_offline(tmp_path, monkeypatch, streaming):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    cfg = DataConfig(source="hf", hf_name="json", paths=[str(f)], hf_streaming=streaming)
    assert list(DocumentSource(cfg)) == nonempty(DOCS)
    with pytest.raises(ValueError, match="no column 'body'"):
        list(DocumentSource(DataConfig(source="hf", hf_name="json", paths=[str(f)], text_field="body")))
    with pytest.raises(ValueError, match="could not load dataset 'json'.*split validation"):
        list(DocumentSource(DataConfig(source="hf", hf_name="json", paths=[str(f)], hf_split="validation")))


def test_validate_names_field_and_fix(tmp_path):
    errors = DataConfig(source="jsonl").validate()
    assert any(e.startswith("paths:") and "set data.paths" in e for e in errors)
    errors = DataConfig(source="text", paths=[str(tmp_path / "missing*.txt")], val_fraction=1.5,
                        max_doc_len=1).validate()
    assert {e.split(":")[0] for e in errors} == {"paths", "val_fraction", "max_doc_len"}
    assert DataConfig(source="hf").validate()[0].startswith("hf_name:")
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    assert DataConfig(paths=[str(tmp_path)]).validate() == [
        "paths: given, but source 'bundled' reads only the shipped corpus; set data.source to text, jsonl, parquet "
        "or hf to read these files"]
    assert [e.split(":")[0] for e in DataConfig(source="jsonl", paths=[str(tmp_path)], doc_separator="\n").validate()
            ] == ["doc_separator"]
    assert DataConfig().validate() == []
    mixed = DataConfig(source="jsonl", mixture=[MixtureSource(), MixtureSource(source="text", weight=0)])
    assert [e.split(":")[0] for e in mixed.validate()] == ["mixture", "mixture[1].paths", "mixture[1].weight"]


def test_bundled_corpus_matches_its_source_note():
    note = (BUNDLED_CORPUS.parent / "SOURCE.md").read_text()
    data = BUNDLED_CORPUS.read_bytes()
    assert len(data) >= 1_000_000
    recorded = re.search(r"\| sha256 \| `([0-9a-f]{64})`", note).group(1)
    assert hashlib.sha256(data).hexdigest() == recorded, "SOURCE.md must state the corpus file's sha256"
    assert "public domain" in note and "License" in note


def test_tokenizer_round_trip_and_byte_fallback():
    tok = load_tokenizer()
    assert 4000 <= tok.vocab_size <= 8192
    assert tok.eos_id == 0 and tok.decode([tok.eos_id]) == "<|endoftext|>"
    rng = random.Random(11)
    alphabets = [range(32, 127), range(0, 0x250), range(0x4E00, 0x4FFF), range(0x1F300, 0x1F64F)]
    for _ in range(200):
        text = "".join(chr(rng.choice(rng.choice(alphabets))) for _ in range(rng.randint(0, 40)))
        text = text.replace("\ud800", "")  # surrogates are not encodable text
        ids = tok.encode(text)
        assert all(0 < i < tok.vocab_size for i in ids), "no unknown / special token for plain text"
        assert tok.decode(ids) == text
    english = "Now is the winter of our discontent made glorious summer by this sun of York."
    assert len(tok.encode(english)) < len(english) / 3, "BPE should compress English well"


def test_train_tokenizer_script(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("the quick brown fox jumps over the lazy dog. " * 50 + "ünï ✓")
    out = tmp_path / "tok.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "train_tokenizer.py"), "--input", str(src),
                    "--vocab-size", "300", "--out", str(out)], check=True, capture_output=True)
    tok = load_tokenizer(str(out))
    assert 257 < tok.vocab_size <= 300 and tok.decode(tok.encode("zebra ✓ quick")) == "zebra ✓ quick"


def test_cache_key_follows_file_changes(tmp_path):
    f = tmp_path / "d.txt"
    f.write_text("one version")
    cfg = DataConfig(source="text", paths=[str(f)])
    before = DocumentSource(cfg).fingerprint()
    f.write_text("another version!")
    os.utime(f, ns=(1, 1))
    assert DocumentSource(cfg).fingerprint() != before


def test_build_loaders_bundled_end_to_end(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path))
    train, val, tok = build_loaders(cfg, tokens_per_microbatch=1023, dp_rank=1, dp_size=2, grad_accum=2, seed=4,
                                    show_progress=False)
    assert tok.vocab_size == 4096
    assert train.stores[0].num_docs == 941
    batches = train.next_step()
    assert len(batches) == 2
    for b in batches:
        b.validate()
        assert b.num_tokens <= 1023 and int(b.input_ids.max()) < tok.vocab_size
    text = tok.decode(batches[0].input_ids[:200].tolist())
    assert sum(c.isalpha() for c in text) > len(text) / 2, "batches should decode to English text"
    assert len(val) >= 1 and val.num_tokens > 0
    again, _, _ = build_loaders(cfg, tokens_per_microbatch=1023, dp_rank=1, dp_size=2, grad_accum=2, seed=4,
                                show_progress=False)
    again.load_state_dict(train.state_dict())
    assert [b.input_ids.tolist() for b in again.next_step()] == [b.input_ids.tolist() for b in train.next_step()]
    with pytest.raises(ValueError, match="tokens_per_microbatch"):
        build_loaders(cfg, tokens_per_microbatch=1, show_progress=False)


def test_build_loaders_balanced_assignment(tmp_path):
    rng = random.Random(5)
    f = tmp_path / "d.jsonl"
    words = ["thou", "art", "the", "king", "of", "infinite", "space", "nutshell"]
    f.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 400)))}) + "\n"
                         for _ in range(120)))
    common = dict(tokens_per_microbatch=300, dp_size=2, grad_accum=4, seed=1, show_progress=False)
    cfg = dict(source="jsonl", paths=[str(f)], cache_dir=str(tmp_path / "cache"))
    plain = [build_loaders(DataConfig(**cfg), dp_rank=r, **common)[0] for r in range(2)]
    balanced = [build_loaders(DataConfig(**cfg, balance=True), dp_rank=r, **common)[0] for r in range(2)]
    for _ in range(3):
        a = sorted(b.input_ids.tolist() for ld in plain for b in ld.next_step())
        b = sorted(b.input_ids.tolist() for ld in balanced for b in ld.next_step())
        assert a == b, "balancing moves micro-batches between ranks, it never changes them"
        imb = balanced[0].last_imbalance
        assert imb == balanced[1].last_imbalance and imb["after"] <= imb["before"] + 1e-9
        assert plain[0].last_imbalance["after"] == plain[0].last_imbalance["before"]
    # the balancing cost: data.attn_cost_len when the recipe sets it, else the caller's (model) coefficients
    assert plain[0].cost_coefficients == (1.0, 1 / 4096)
    model_ab = dict(common, cost_coefficients=(6.0, 0.5))
    assert build_loaders(DataConfig(**cfg), **model_ab)[0].cost_coefficients == (6.0, 0.5)
    assert build_loaders(DataConfig(**cfg, attn_cost_len=64), **model_ab)[0].cost_coefficients == (1.0, 1 / 64)


def test_build_loaders_mixture(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.txt"
    a.write_text("".join(json.dumps({"text": f"alpha {i} " * 20}) + "\n" for i in range(40)))
    b.write_text("\n===\n".join(f"omega {i} " * 30 for i in range(20)))
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), val_fraction=0.1, mixture=[
        MixtureSource(source="jsonl", paths=[str(a)], weight=3.0),
        MixtureSource(source="text", paths=[str(b)], doc_separator="\n===\n", weight=1.0)])
    assert cfg.validate() == []
    train, val, tok = build_loaders(cfg, tokens_per_microbatch=200, grad_accum=2, seed=1, show_progress=False)
    assert [c.num_docs for c in train.stores] == [40, 20]
    words = {"alpha": 0, "omega": 0}
    for _ in range(20):
        for batch in train.next_step():
            batch.validate()
            text = tok.decode(batch.input_ids.tolist())
            for w in words:
                words[w] += text.count(w)
    share = words["alpha"] / sum(words.values())
    assert 0.6 < share < 0.9, f"weights 3:1 should give about 0.75 of the documents' words to 'alpha', got {share}"
    val_text = "".join(tok.decode(b.input_ids.tolist()) for b in val)
    assert "alpha" in val_text and "omega" in val_text, "each source contributes held-out documents"
    resumed, _, _ = build_loaders(cfg, tokens_per_microbatch=200, grad_accum=2, seed=1, show_progress=False)
    resumed.load_state_dict(train.state_dict())
    assert [x.input_ids.tolist() for x in resumed.next_step()] == [x.input_ids.tolist() for x in train.next_step()]
    other = DataConfig(**{**vars(cfg), "mixture": cfg.mixture[:1]})
    mismatched, _, _ = build_loaders(other, tokens_per_microbatch=200, grad_accum=2, seed=1, show_progress=False)
    with pytest.raises(ValueError, match="does not match"):
        mismatched.load_state_dict(train.state_dict())
