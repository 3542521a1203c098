"""The tokenizer object the rest of moela uses: `.encode(text)`, `.decode(ids)`, `.vocab_size`, `.eos_id`.

A thin wrapper over a Hugging Face `tokenizers.Tokenizer`. The default is the committed byte-level BPE
(`moela/data/tokenizer/tokenizer.json`, 4096 tokens, trained by scripts/train_tokenizer.py on the bundled corpus):
byte-level means every UTF-8 byte is a base symbol, so any text encodes without an unknown token and decodes back
exactly. Encoding never adds special tokens; the token cache appends `eos_id` to each document itself (and
prepends `bos_id` when a BOS token is configured, as checkpoints such as DeepSeek-V3's expect).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

BUNDLED_PATH = Path(__file__).resolve().parent / "tokenizer" / "tokenizer.json"
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class Tokenizer:
    def __init__(self, hf: HFTokenizer, eos_token: str | None = None, name: str = "", bos_token: str | None = None):
        self.hf = hf
        self.name = name
        if eos_token is None:
            eos_token = next((t for t in EOS_CANDIDATES if hf.token_to_id(t) is not None), None)
            if eos_token is None:
                raise ValueError(f"tokenizer '{name}' has none of the end-of-document tokens {EOS_CANDIDATES}; "
                                 f"set data.eos_token to the token that ends a document")
        eos_id = hf.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"data.eos_token '{eos_token}' is not in the vocabulary of tokenizer '{name}'")
        self.eos_token = eos_token
        self.eos_id: int = eos_id
        self.bos_token = bos_token
        self.bos_id: int | None = None if bos_token is None else hf.token_to_id(bos_token)
        if bos_token is not None and self.bos_id is None:
            raise ValueError(f"data.bos_token '{bos_token}' is not in the vocabulary of tokenizer '{name}'")
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch_fast(texts, add_special_tokens=False)]  # no offsets: less memory

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def fingerprint(self) -> str:
        """sha256 of the serialized tokenizer plus the EOS / BOS choice: part of the token-cache key."""
        blob = "\0".join([self.hf.to_str(), self.eos_token, self.bos_token or ""])
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def load_tokenizer(spec: str = "bundled", eos_token: str | None = None, bos_token: str | None = None) -> Tokenizer:
    """`spec`: "bundled", a path to a tokenizer.json, a tokenizer folder (tokenizer.json beside an optional
    tokenizer_config.json, as Hugging Face model folders ship them), or a hub model name (online).

    A folder's conventions fill what the recipe leaves null: its `eos_token`, and its `bos_token` when the folder
    adds one to every sequence (`add_bos_token: true`, as DeepSeek-V3 and Llama 2 set, or a post-processor template
    that starts with it, as Llama 3's tokenizer.json has)."""
    if spec == "bundled":
        return Tokenizer(HFTokenizer.from_file(str(BUNDLED_PATH)), eos_token, "bundled", bos_token)
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        eos_token, bos_token = _folder_conventions(path, eos_token, bos_token)
        path = path / "tokenizer.json"
    if path.is_file():
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust parser's error types: truncated or not a tokenizer
            raise ValueError(f"data.tokenizer: {path} is not a readable tokenizer.json ({str(e).splitlines()[0]}); "
                             f"download it again or point data.tokenizer at another one") from None
        return Tokenizer(hf, eos_token, str(path), bos_token)
    if spec.endswith(".json") or path.is_dir():
        raise FileNotFoundError(f"data.tokenizer: '{path}' not found; give a tokenizer.json path, a folder holding "
                                f"one, or 'bundled'")
    try:
        hf = HFTokenizer.from_pretrained(spec)
    except Exception as e:
        raise ValueError(f"data.tokenizer: '{spec}' is neither 'bundled', a tokenizer.json file, nor a hub model "
                         f"whose tokenizer could be downloaded ({e})") from e
    return Tokenizer(hf, eos_token, spec, bos_token)


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _folder_conventions(folder: Path, eos_token: str | None, bos_token: str | None) -> tuple[str | None, str | None]:
    """(eos, bos) with the folder's tokenizer_config.json filling the recipe's nulls (see `load_tokenizer`)."""
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return eos_token, bos_token
    try:
        config = json.loads(config_path.read_text())
    except ValueError:
        raise ValueError(f"data.tokenizer: {config_path} is not valid JSON; fix it, or remove it and set "
                         f"data.eos_token / data.bos_token") from None
    eos_token = eos_token or _token_text(config.get("eos_token"))
    folder_bos = _token_text(config.get("bos_token"))
    if bos_token is None and folder_bos and (config.get("add_bos_token") or _template_starts_with(folder,
                                                                                                   folder_bos)):
        bos_token = folder_bos
    return eos_token, bos_token


def _template_starts_with(folder: Path, token: str) -> bool:
    """Whether tokenizer.json's post-processor puts `token` first in every single sequence."""
    try:
        post = json.loads((folder / "tokenizer.json").read_text()).get("post_processor") or {}
    except (OSError, ValueError):
        return False
    processors = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for proc in processors:
        single = proc.get("single") or []
        if proc.get("type") == "TemplateProcessing" and single:
            return single[0].get("SpecialToken", {}).get("id") == token
    return False
