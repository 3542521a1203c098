"""The token cache: built in parallel into shards byte-identical for any number of workers and equal to encoding
each document alone; reused; shared by concurrent builders (claims, a dead worker's shard taken over); long
documents encoded in pieces with the same ids and bounded memory."""

import json
import multiprocessing as mp
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moela.data import DataConfig, load_tokenizer
from moela.data import build as build_mod
from moela.data.build import build_or_load_cache, cut_points, make_plan
from moela.data.cache import TokenCache, shard_name
from moela.data.sources import DocumentSource

REPO = Path(__file__).resolve().parent.parent
WORDS = ["the", "king", "ünïcödé", "✓", "🎭", "sea,", "night.", "and", "a", "42", "\n", "  ", "O!", "thee"]
SHARD = 1 << 16


def random_docs(seed: int, n: int, max_words: int = 400) -> list[str]:
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words))) for _ in range(n)]
    docs[3] = "   "  # whitespace only: skipped
    return docs


def write_source(tmp_path: Path, kind: str, docs: list[str]) -> DataConfig:
    if kind == "jsonl":
        f = tmp_path / "docs.jsonl"
        f.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs) + "\n")
        return DataConfig(source="jsonl", paths=[str(f)], shard_bytes=SHARD)
    if kind == "text":
        (tmp_path / "texts").mkdir()
        for i in range(0, len(docs), 7):
            (tmp_path / "texts" / f"{i:04d}.txt").write_text("\n<doc>\n".join(docs[i:i + 7]))
        return DataConfig(source="text", paths=[str(tmp_path / "texts")], doc_separator="\n<doc>\n",
                          shard_bytes=SHARD)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs}), tmp_path / "docs.parquet", row_group_size=37)
    return DataConfig(source="parquet", paths=[str(tmp_path / "docs.parquet")], shard_bytes=SHARD)


def reference_tokens(tok, docs):
    """The single-process cache: each non-empty document encoded alone, [BOS] ids EOS, back to back."""
    bos = [] if tok.bos_id is None else [tok.bos_id]
    encoded = [bos + tok.encode(d) + [tok.eos_id] for d in docs if d.strip()]
    offsets = np.concatenate([[0], np.cumsum([len(e) for e in encoded])])
    return np.concatenate([np.asarray(e) for e in encoded]), offsets


def all_tokens(cache: TokenCache) -> np.ndarray:
    return np.concatenate([np.asarray(s.tokens) for s in cache.shards])


@pytest.mark.parametrize("kind", ["jsonl", "text", "parquet"])
def test_cache_is_the_same_for_any_number_of_workers(tmp_path, kind):
    docs = random_docs(0, 700)
    cfg = write_source(tmp_path, kind, docs)
    tok = load_tokenizer(bos_token="<|endoftext|>") if kind == "text" else load_tokenizer()
    caches = [build_or_load_cache(DocumentSource(cfg), tok, tmp_path / f"c{n}", shard_bytes=SHARD, workers=n,
                                  show_progress=False) for n in (1, 3)]
    assert len(caches[0].shards) >= 3, "the corpus must span several shards for this test to mean anything"
    expected, offsets = reference_tokens(tok, docs)
    for cache in caches:
        np.testing.assert_array_equal(all_tokens(cache), expected)
        np.testing.assert_array_equal(cache.offsets, offsets)
        assert cache.doc(5).tolist() == expected[offsets[5]:offsets[6]].tolist()
    for name in sorted(p.name for p in caches[0].path.iterdir() if p.suffix in (".bin", ".npy")):
        assert (caches[0].path / name).read_bytes() == (caches[1].path / name).read_bytes(), name


def test_a_complete_cache_is_reused_and_keyed_by_its_inputs(tmp_path, monkeypatch):
    cfg = write_source(tmp_path, "jsonl", random_docs(1, 50))
    tok = load_tokenizer()
    first = build_or_load_cache(DocumentSource(cfg), tok, tmp_path / "c", shard_bytes=SHARD, show_progress=False)
    monkeypatch.setattr(build_mod, "Builder", None)  # any attempt to tokenize again would fail
    again = build_or_load_cache(DocumentSource(cfg), tok, tmp_path / "c", shard_bytes=SHARD, show_progress=False)
    assert again.path == first.path
    for other_tok, shard in ((load_tokenizer(bos_token="<|endoftext|>"), SHARD), (tok, 2 * SHARD)):
        assert make_plan(DocumentSource(cfg), other_tok, tmp_path / "c", shard).dir != first.path


def test_a_bad_record_names_its_line_and_leaves_no_complete_cache(tmp_path):
    docs = random_docs(2, 300)
    cfg = write_source(tmp_path, "jsonl", docs)
    with open(cfg.paths[0], "a") as f:
        f.write('{"text": "fine"}\n{"txt": "no text field"}\n')
    with pytest.raises(ValueError, match=r"docs\.jsonl:303: no field 'text'"):
        build_or_load_cache(DocumentSource(cfg), load_tokenizer(), tmp_path / "c", shard_bytes=SHARD, workers=2,
                            show_progress=False)
    (cache_dir,) = [p for p in (tmp_path / "c").iterdir() if p.is_dir()]
    assert not (cache_dir / "meta.json").exists()
    assert not list(cache_dir.glob(".*tmp*")), "a failed shard leaves no temporary files"


def _build_concurrently(cfg, cache_dir, barrier, out):
    barrier.wait()
    cache = build_or_load_cache(DocumentSource(cfg), load_tokenizer(), cache_dir, shard_bytes=SHARD, workers=1,
                                show_progress=False)
    out.put(all_tokens(cache).tobytes())


def test_concurrent_builders_split_the_shards(tmp_path, monkeypatch):
    cfg = write_source(tmp_path, "jsonl", random_docs(3, 1500))
    builders = []
    real = build_mod.build_shard

    def recording(plan, i, report):  # runs in the forked workers: records who built each shard
        with open(tmp_path / "built", "a") as f:
            f.write(f"{i} {os.getppid()}\n")
        # hold the shard until another builder has claimed one (60 s at most): a builder that starts while another
        # holds claims must take the unclaimed shards rather than wait, and one builder cannot finish every shard
        # before the others are scheduled, however loaded the machine
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len({line.split()[1] for line in
                                                   (tmp_path / "built").read_text().splitlines()}) < 2:
            time.sleep(0.05)
        return real(plan, i, report)

    monkeypatch.setattr(build_mod, "build_shard", recording)
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_build_concurrently, args=(cfg, tmp_path / "c", barrier, out)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0] and len(set(results)) == 1
    builders = [line.split() for line in (tmp_path / "built").read_text().splitlines()]
    shards = [int(i) for i, _ in builders]
    assert sorted(shards) == list(range(len(shards))) and len(shards) >= 6, "every shard built exactly once"
    assert len({pid for _, pid in builders}) >= 2, "the builders split the shards"


def test_a_dead_workers_claim_is_taken_over(tmp_path):
    cfg = write_source(tmp_path, "jsonl", random_docs(4, 400))
    tok = load_tokenizer()
    plan = make_plan(DocumentSource(cfg), tok, tmp_path / "c", SHARD)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    claim = plan.dir / f"{shard_name(1)}.claim"
    claim.write_text(f"{socket.gethostname()} {dead.stdout.strip()}")
    (plan.dir / f".{shard_name(1)}.tmp-{dead.stdout.strip()}.bin").write_bytes(b"half a shard")
    cache = build_or_load_cache(DocumentSource(cfg), tok, tmp_path / "c", shard_bytes=SHARD, show_progress=False)
    np.testing.assert_array_equal(all_tokens(cache), reference_tokens(tok, random_docs(4, 400))[0])
    assert not list(plan.dir.glob(".*tmp*")) and not list(plan.dir.glob("*.claim"))


def test_cut_points_fall_before_a_space_between_words():
    rng = random.Random(5)
    text = "".join(rng.choice(["ab", " ", "c", "  ", "\n", "d."]) for _ in range(20000))
    cuts = cut_points(text, 500)
    assert cuts[0] == 0 and cuts[-1] == len(text) and all(0 < b - a <= 500 for a, b in zip(cuts, cuts[1:]))
    for c in cuts[1:-1]:
        assert text[c] == " " and not text[c - 1].isspace() and not text[c + 1].isspace()
    assert cut_points("x" * 1200, 500) == [0, 500, 1000, 1200], "no space: cut at the piece length"


def test_long_documents_encode_in_pieces_to_the_same_ids(tmp_path, monkeypatch):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from moela.data.tokenizer import Tokenizer

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(random_docs(6, 200), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    docs = random_docs(7, 40, max_words=6000)
    cfg = write_source(tmp_path, "jsonl", docs)
    monkeypatch.setattr(build_mod, "LONG_DOC_CHARS", 3000)
    for tok in (load_tokenizer(bos_token="<|endoftext|>"), Tokenizer(hf, name="trained")):
        cache = build_or_load_cache(DocumentSource(cfg), tok, tmp_path / "c", shard_bytes=SHARD, workers=2,
                                    show_progress=False)
        np.testing.assert_array_equal(all_tokens(cache), reference_tokens(tok, docs)[0])


def test_a_10mb_line_tokenizes_in_bounded_memory(tmp_path):
    rng = random.Random(8)
    f = tmp_path / "one.jsonl"
    words = [" ".join(rng.choice(["the", "king", "sea,", "night.", "and", "a", "42", "O!", "thee"]) for _ in range(100))
             for _ in range(64)]
    text = " ".join(words[rng.randrange(64)] for _ in range(10_000_000 // len(words[0])))
    f.write_text(json.dumps({"text": text}) + "\n")
    del text, words
    code = (f"import resource; from moela.data import DataConfig, load_tokenizer;"
            f"from moela.data.build import build_or_load_cache; from moela.data.sources import DocumentSource;"
            f"c = build_or_load_cache(DocumentSource(DataConfig(source='jsonl', paths=[{str(f)!r}])), "
            f"load_tokenizer(), {str(tmp_path / 'c')!r}, workers=1, show_progress=False);"
            f"print(c.num_docs, c.num_tokens, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    docs, tokens, worker_kib = map(int, out.stdout.split())
    assert docs == 1 and tokens > 1_000_000
    # encoded whole, such a document took ~155x its size (1.5 GB here); in pieces its raw text dominates
    assert worker_kib < 400_000, f"the worker peaked at {worker_kib / 1024:.0f} MiB for a 10 MB document"
