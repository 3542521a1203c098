"""Real tokenizers: a folder's BOS/EOS conventions (DeepSeek-V3's add_bos_token, Llama 3's post-processor, Qwen's
none), a vocabulary beyond uint16 cached as uint32, model.vocab_size checked against the tokenizer, and a damaged
tokenizer.json named. Tokenizers are built here with `tokenizers` (nothing downloads)."""

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from moela.data import DataConfig, load_tokenizer
from moela.data.build import build_or_load_cache
from moela.data.sources import DocumentSource
from moela.tools.cli import main as moela_main

ROOT = Path(__file__).resolve().parent.parent


def byte_level_bpe(specials: list[str], extra_tokens: int = 0, seed: int = 0) -> HFTokenizer:
    """A byte-level BPE whose merges grow random ASCII words letter by letter (a valid merge list of any size)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(specials + alphabet)}
    rng = np.random.default_rng(seed)
    letters = [c for c in alphabet if c.isascii() and c.isalpha()]
    tokens, merges = list(letters), []
    while len(merges) < extra_tokens:
        for i, j in rng.integers(0, 1 << 62, size=(2 * extra_tokens, 2)).tolist():
            a, b = tokens[i % len(tokens)], letters[j % len(letters)]  # a word grown by one letter
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                tokens.append(a + b)
                merges.append((a, b))
                if len(merges) == extra_tokens:
                    break
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(specials)
    return hf


def folder(tmp_path, name, hf, config=None) -> Path:
    path = tmp_path / name
    path.mkdir()
    hf.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_folder_conventions_for_bos_and_eos(tmp_path):
    deepseek = folder(tmp_path, "deepseek", byte_level_bpe(["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]), {
        "add_bos_token": True, "add_eos_token": False,
        "bos_token": {"content": "<｜begin▁of▁sentence｜>", "special": True},
        "eos_token": {"content": "<｜end▁of▁sentence｜>", "special": True}})
    tok = load_tokenizer(str(deepseek))
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    llama_hf = byte_level_bpe(["<|begin_of_text|>", "<|end_of_text|>"])
    llama_hf.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                            special_tokens=[("<|begin_of_text|>", 0)])
    llama = folder(tmp_path, "llama3", llama_hf, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    tok = load_tokenizer(str(llama))
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    qwen = folder(tmp_path, "qwen", byte_level_bpe(["<|endoftext|>", "<|im_end|>"]),
                  {"bos_token": None, "eos_token": "<|endoftext|>"})
    tok = load_tokenizer(str(qwen))
    assert (tok.bos_id, tok.eos_id) == (None, 0)
    assert load_tokenizer(str(qwen), eos_token="<|im_end|>").eos_id == 1, "the recipe's choice wins"
    (tmp_path / "docs.jsonl").write_text('{"text": "hello world"}\n{"text": "more text"}\n')
    cfg = DataConfig(source="jsonl", paths=[str(tmp_path / "docs.jsonl")])
    ds = load_tokenizer(str(deepseek))
    cache = build_or_load_cache(DocumentSource(cfg), ds, tmp_path / "c", show_progress=False)
    assert cache.doc(1).tolist() == [0] + ds.encode("more text") + [1]


def test_a_vocabulary_beyond_uint16_is_cached_as_uint32(tmp_path):
    hf = byte_level_bpe(["<|endoftext|>"], extra_tokens=100_000 - 257)
    tok = load_tokenizer(str(folder(tmp_path, "big", hf)))
    assert tok.vocab_size == 100_000
    texts = [hf.decode([i]) for i in range(80_000, 100_000, 50)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = DataConfig(source="jsonl", paths=[str(tmp_path / "docs.jsonl")])
    cache = build_or_load_cache(DocumentSource(cfg), tok, tmp_path / "c", show_progress=False)
    assert cache.dtype == np.uint32 and cache.num_docs == len(texts) > 50
    assert [cache.doc(i).tolist() for i in range(len(texts))] == [tok.encode(t) + [0] for t in texts]
    assert int(cache.shards[0].tokens.max()) >= 1 << 16


def test_model_vocab_size_is_checked_against_the_tokenizer(tmp_path, capsys):
    hf = byte_level_bpe(["<|endoftext|>"], extra_tokens=5000 - 257)
    path = folder(tmp_path, "tok", hf)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(20)))
    args = ["prepare", str(ROOT / "recipes" / "tiny.yaml"), f"data.tokenizer={path}", "data.source=jsonl",
            f"data.paths=[{tmp_path / 'docs.jsonl'}]", f"data.cache_dir={tmp_path / 'c'}"]
    assert moela_main(args) == 2
    assert capsys.readouterr().err.strip() == ("error: model.vocab_size=4096 is smaller than the tokenizer's 5000 "
                                               "tokens; set model.vocab_size >= 5000")
    assert moela_main([*args, "model.vocab_size=5000"]) == 0


def test_a_truncated_tokenizer_json_is_named(tmp_path):
    path = folder(tmp_path, "tok", byte_level_bpe(["<|endoftext|>"]))
    data = (path / "tokenizer.json").read_bytes()
    (path / "tokenizer.json").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=f"data.tokenizer: {path / 'tokenizer.json'} is not a readable "
                                         f"tokenizer.json"):
        load_tokenizer(str(path))
