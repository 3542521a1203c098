"""Data pipeline: sources -> tokenizer -> token cache -> packing -> per-rank loaders.

`build_loaders(cfg.data, tokens_per_microbatch=..., dp_rank=..., dp_size=..., grad_accum=..., seed=...)` returns
`(train_loader, val_loader, tokenizer)`; see stream.py for the training stream's guarantees. The token cache is
built on first use by parallel workers (build.py; a progress bar shows it) and reused afterwards; the training
stream reads it shard by shard, and with `data.stream_start` starts training while it is built. Megatron datasets
are read in place (megatron.py).
"""

from __future__ import annotations

from .balance import balanced_assign, round_robin_assign
from .build import build_or_load_cache, default_workers, make_plan
from .cache import CacheError, TokenCache
from .config import DataConfig, MixtureSource, SourceConfig
from .loader import Part, ValLoader, split_train_val
from .megatron import MegatronSource
from .sources import DocumentSource
from .stream import ShardFeed, TrainLoader
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["DataConfig", "SourceConfig", "MixtureSource", "build_loaders", "held_out_parts", "open_source",
           "load_tokenizer", "Tokenizer", "TrainLoader", "ValLoader", "TokenCache", "CacheError", "round_robin_assign"]

DEFAULT_ATTN_COST_LEN = 4096  # quadratic weight of the balancing cost when neither the recipe nor a model sets it


def build_loaders(cfg: DataConfig, *, tokens_per_microbatch: int, dp_rank: int = 0, dp_size: int = 1,
                  grad_accum: int = 1, seed: int = 0, cost_coefficients: tuple[float, float] | None = None,
                  show_progress: bool = True):
    """Build (train_loader, val_loader, tokenizer) for one data-parallel rank.

    tokens_per_microbatch: token budget of one micro-batch (documents are packed up to it, never beyond).
    dp_rank / dp_size: this rank's index in the data-parallel group and the group's size (ranks that share the
    same data, e.g. context- or tensor-parallel peers, pass the same dp_rank). grad_accum: micro-batches per rank
    per optimizer step. seed: shuffling seed (the held-out split does not depend on it).
    cost_coefficients: (a, b) of the micro-batch cost a * sum L + b * sum L^2 used for DP balancing and the
    `last_imbalance` report, e.g. `moela.data.balance.cost_coefficients(cfg.model)` (training FLOPs). A recipe's
    `data.attn_cost_len` takes precedence, as (1, 1 / attn_cost_len); with neither, (1, 1 / 4096).
    show_progress: show a progress bar while the token cache is built.
    """
    errors = cfg.validate()
    if tokens_per_microbatch < 2:
        errors.append(f"tokens_per_microbatch: must be >= 2, got {tokens_per_microbatch}")
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        errors.append(f"dp_rank/dp_size: need 0 <= dp_rank < dp_size, got {dp_rank}/{dp_size}")
    if seed < 0:
        errors.append(f"seed: must be >= 0, got {seed}")
    if grad_accum < 1:
        errors.append(f"grad_accum: must be >= 1, got {grad_accum}")
    if errors:
        raise ValueError("invalid data settings:\n  " + "\n  ".join(errors))

    tokenizer = load_tokenizer(cfg.tokenizer, cfg.eos_token, cfg.bos_token)
    assign = balanced_assign if cfg.balance else round_robin_assign
    if cfg.attn_cost_len is not None:
        coefficients = (1.0, 1.0 / cfg.attn_cost_len)
    else:
        coefficients = cost_coefficients or (1.0, 1.0 / DEFAULT_ATTN_COST_LEN)
    settings = {"tokens_per_microbatch": tokens_per_microbatch, "max_doc_len": cfg.max_doc_len,
                "shuffle": cfg.shuffle, "val_fraction": cfg.val_fraction, "val_max_tokens": cfg.val_max_tokens}
    common = dict(tokens_per_microbatch=tokens_per_microbatch, max_doc_len=cfg.max_doc_len, dp_rank=dp_rank,
                  dp_size=dp_size)
    units, weights = source_units(cfg, tokenizer, seed, show_progress)
    train = TrainLoader(units, weights, grad_accum=grad_accum, seed=seed, shuffle=cfg.shuffle, assign=assign,
                        cost_coefficients=coefficients, settings=settings, val_fraction=cfg.val_fraction,
                        val_max_tokens=cfg.val_max_tokens, **common)
    val = ValLoader([Part(*held) for held in train.held_out()], cfg.val_max_tokens, **common)
    return train, val, tokenizer


def source_units(cfg: DataConfig, tokenizer: Tokenizer, seed: int, show_progress: bool = True):
    """(per source: its units as the training stream reads them, the normalized weights). With stream_start, the
    caches are built in the background (`ShardFeed`, the workers divided among the sources); otherwise each is
    completed first (`open_source`)."""
    sources = cfg.sources()
    if not cfg.stream_start:
        return [open_source(s, tokenizer, cfg, show_progress) for s, _ in sources], [w for _, w in sources]
    workers = max(1, (cfg.tokenize_workers or default_workers()) // len(sources))
    feeds = [ShardFeed(make_plan(DocumentSource(source_cfg), tokenizer, cfg.cache_dir, cfg.shard_bytes),
                       tokenizer.vocab_size, workers, seed, cfg.shuffle, i)
             for i, (source_cfg, _) in enumerate(sources)]
    return feeds, [weight for _, weight in sources]


def held_out_parts(cfg: DataConfig, tokenizer: Tokenizer) -> list[Part]:
    """The held-out documents exactly as training split them: from each source's first unit (shard)."""
    parts = []
    for units, weight in zip(*source_units(cfg, tokenizer, 0, show_progress=False)):
        first = units.get(0)
        held = split_train_val(first.doc_lengths, cfg.val_fraction, int(cfg.val_max_tokens * weight))[1]
        parts.append(Part(first, held, weight))
    return parts


def open_source(source_cfg: SourceConfig, tokenizer: Tokenizer, cfg: DataConfig, show_progress: bool = True):
    """One source's tokens: a Megatron dataset read in place, or the token cache (built first if missing)."""
    if source_cfg.source == "megatron":
        store = MegatronSource(source_cfg.paths, tokenizer.vocab_size)
        where = store.describe()
    else:
        source = DocumentSource(source_cfg)
        store = build_or_load_cache(source, tokenizer, cfg.cache_dir, shard_bytes=cfg.shard_bytes,
                                    workers=cfg.tokenize_workers, show_progress=show_progress)
        where = source.describe()
    if store.num_docs == 0:
        raise ValueError(f"no text found in {where}: no document holds more than whitespace; check data.paths "
                         f"(and data.text_field / data.doc_separator)")
    return store
