"""Tokenize a recipe's data into the token cache ahead of training, and print what the loader will see.

    python scripts/prepare_data.py recipes/tiny.yaml [data.source=jsonl data.paths=[corpus/*.jsonl] ...]

Training builds the cache on first use anyway; running this first (once per machine or shared filesystem) keeps a
multi-node job from waiting on tokenization, and shows the split and packing before any GPU time is spent.
A recipe mistake exits with code 2 and the list of problems, like train.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

USAGE_ERROR = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="YAML recipe, e.g. recipes/tiny.yaml")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="recipe overrides, as train.py")
    args = parser.parse_args(argv)

    from moela.config import ConfigError, load_config
    from moela.data import build_loaders

    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as e:
        print("error: problems in the recipe:\n  " + "\n  ".join(e.errors), file=sys.stderr)
        return USAGE_ERROR
    try:
        train, val, tok = build_loaders(cfg.data, tokens_per_microbatch=cfg.train.tokens_per_microbatch,
                                        grad_accum=cfg.train.grad_accum, seed=cfg.train.seed)
    except (FileNotFoundError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR
    plan = train.epoch_plan(0)
    epoch_tokens = int(train.pieces.len[plan.pieces].sum())
    fill = epoch_tokens / (len(plan) * train.budget)
    for cache, (_, weight) in zip(train.caches, cfg.data.sources()):
        print(f"cache:      {cache.path} ({cache.num_docs} documents, {cache.num_tokens} tokens, "
              f"{cache.tokens.dtype}, weight {weight:.3g})")
    print(f"tokenizer:  {tok}")
    print(f"train:      {train.num_tokens} tokens in {len(train.pieces)} pieces; an epoch packs {epoch_tokens} tokens "
          f"into {len(plan)} micro-batches of <= {train.budget} tokens ({fill:.1%} full)")
    print(f"validation: {val.num_tokens} tokens in {len(val)} micro-batches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
