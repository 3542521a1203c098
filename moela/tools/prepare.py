"""`python -m moela prepare RECIPE [section.key=value ...] [--verify]`: build a recipe's token caches ahead of
training and print what the loader will see.

Training builds a missing cache on first use anyway; preparing first (once per machine, or once for a shared
filesystem: several machines running this at once split the shards among themselves) keeps GPUs from waiting on
tokenization and shows the split and packing before any GPU time is spent. `data.tokenize_workers` sets the
worker processes (default: the cores available); the progress bar shows bytes, tokens/s and an ETA. `--verify`
reads every shard of every cache (and every Megatron dataset) against the checksums recorded when it was built and
checks every id against the tokenizer's vocabulary.

Exit codes as train.py: 2 for a recipe or data error (named), 1 for a damaged cache (named, with the directory to
delete to rebuild it) or an unreadable file.
"""

from __future__ import annotations

import argparse
import sys
import time

from moela.trainer.errors import EXIT_ENVIRONMENT, EXIT_INPUT


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe, e.g. recipes/tiny.yaml")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="recipe overrides, as train.py")
    p.add_argument("--verify", action="store_true", help="check every byte of the caches against their checksums "
                   "and every id against the vocabulary")


def run(args: argparse.Namespace) -> int:
    from moela.config import ConfigError, load_config
    from moela.data import build_loaders, load_tokenizer, open_source

    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as e:
        print("error: problems in the recipe:\n  " + "\n  ".join(e.errors), file=sys.stderr)
        return EXIT_INPUT
    data = cfg.data
    try:
        tok = load_tokenizer(data.tokenizer, data.eos_token, data.bos_token)
        if tok.vocab_size > cfg.model.vocab_size:
            print(f"error: model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {tok.vocab_size} "
                  f"tokens; set model.vocab_size >= {tok.vocab_size}", file=sys.stderr)
            return EXIT_INPUT
        for source_cfg, weight in data.sources():
            start = time.perf_counter()
            store = open_source(source_cfg, tok, data)
            if args.verify:
                store.verify(tok.vocab_size)
            print(f"{'verified' if args.verify else 'ready'}:     {store.path} ({store.num_docs} documents, "
                  f"{store.num_tokens} tokens, {store.dtype}, weight {weight:.3g}, "
                  f"{time.perf_counter() - start:.1f} s)")
        train, val, _ = build_loaders(data, tokens_per_microbatch=cfg.train.tokens_per_microbatch,
                                      grad_accum=cfg.train.grad_accum, seed=cfg.train.seed, show_progress=False)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INPUT
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    print(f"tokenizer: {tok}")
    print(f"train:     {train.describe()}")
    print(f"validation: {val.num_tokens} tokens in {len(val)} micro-batches")
    return 0
