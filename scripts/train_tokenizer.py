"""Train the bundled byte-level BPE tokenizer with Hugging Face `tokenizers` and write `tokenizer.json`.

    python scripts/train_tokenizer.py                       # bundled corpus -> moela/data/tokenizer/tokenizer.json
    python scripts/train_tokenizer.py --input my.jsonl --vocab-size 8192 --out my_tokenizer.json

Byte-level (GPT-2 style): text is mapped to its UTF-8 bytes before merges, and all 256 byte symbols are in the
initial alphabet, so any string encodes without an unknown token and decodes back exactly. One special token,
`<|endoftext|>` (id 0), ends every document. Input: .jsonl files (the `--field` of each line) or text files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
DEFAULT_INPUT = Path(__file__).resolve().parent.parent / "moela" / "data" / "corpus" / "shakespeare.jsonl"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "moela" / "data" / "tokenizer" / "tokenizer.json"


def iter_texts(paths: list[Path], field: str):
    for path in paths:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        yield json.loads(line)[field]
        else:
            yield path.read_text(encoding="utf-8")


def train(paths: list[Path], vocab_size: int, field: str = "text") -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(paths, field), trainer=trainer)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, nargs="+", default=[DEFAULT_INPUT], help=".jsonl or text files")
    parser.add_argument("--field", default="text", help="JSON field holding the text (jsonl input)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if not 257 <= args.vocab_size <= 65535:
        parser.error(f"--vocab-size must be in [257, 65535] (256 byte symbols + {EOS}), got {args.vocab_size}")
    missing = [str(p) for p in args.input if not p.is_file()]
    if missing:
        parser.error(f"input file(s) not found: {', '.join(missing)}")
    tok = train(args.input, args.vocab_size, args.field)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out))
    sample = "To be, or not to be: that is the question. Ünïcödé ✓"
    ids = tok.encode(sample).ids
    assert tok.decode(ids) == sample, "byte-level round trip failed"
    print(f"{args.out}: vocab {tok.get_vocab_size()}, eos id {tok.token_to_id(EOS)}, "
          f"sample {len(sample)} chars -> {len(ids)} tokens")


if __name__ == "__main__":
    main()
