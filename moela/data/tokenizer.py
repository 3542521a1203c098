"""The tokenizer object the rest of moela uses: `.encode(text)`, `.decode(ids)`, `.vocab_size`, `.eos_id`.

A thin wrapper over a Hugging Face `tokenizers.Tokenizer`. The default is the committed byte-level BPE
(`moela/data/tokenizer/tokenizer.json`, 4096 tokens, trained by scripts/train_tokenizer.py on the bundled corpus):
byte-level means every UTF-8 byte is a base symbol, so any text encodes without an unknown token and decodes back
exactly. Encoding never adds special tokens; the token cache appends `eos_id` to each document itself (and
prepends `bos_id` when a BOS token is configured, as checkpoints such as DeepSeek-V3's expect).
"""

from __future__ import annotations

import hashlib
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
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def fingerprint(self) -> str:
        """sha256 of the serialized tokenizer plus the EOS / BOS choice: part of the token-cache key."""
        blob = "\0".join([self.hf.to_str(), self.eos_token, self.bos_token or ""])
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def load_tokenizer(spec: str = "bundled", eos_token: str | None = None, bos_token: str | None = None) -> Tokenizer:
    """`spec`: "bundled", a path to a tokenizer.json (or a directory holding one), or a hub model name (online)."""
    if spec == "bundled":
        return Tokenizer(HFTokenizer.from_file(str(BUNDLED_PATH)), eos_token, "bundled", bos_token)
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exception for a file it cannot parse
            raise ValueError(f"data.tokenizer: {path} is not a valid tokenizer.json ({e}): truncated or damaged; "
                             f"copy it again from its source") from None
        return Tokenizer(hf, eos_token, str(path), bos_token)
    if spec.endswith(".json"):
        raise FileNotFoundError(f"data.tokenizer: file '{spec}' not found; give a tokenizer.json path or 'bundled'")
    try:
        hf = HFTokenizer.from_pretrained(spec)
    except Exception as e:
        raise ValueError(f"data.tokenizer: '{spec}' is neither 'bundled', a tokenizer.json file, nor a hub model "
                         f"whose tokenizer could be downloaded ({e})") from e
    return Tokenizer(hf, eos_token, spec, bos_token)
