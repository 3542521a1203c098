"""The recipe's `data` section: where documents come from, how they are tokenized, cached, split and packed.

Decisions: the bundled Shakespeare corpus and tokenizer are the defaults, so a recipe needs no data keys at all.
One source is given by the section's own source keys; several, with sampling weights, by `mixture` (each entry
has the same source keys plus `weight`). The micro-batch token budget is not here: it is a training-shape setting
passed to `build_loaders` by the trainer. `validate()` checks everything that can be checked without reading the
data (paths exist, values in range, keys that would be ignored, the `datasets` package that the hf source needs:
an optional extra, `moela[datasets]`), so a bad recipe fails at load time with all its errors at once.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Literal

SourceKind = Literal["bundled", "text", "jsonl", "parquet", "hf", "megatron"]


@dataclass
class SourceConfig:
    # Where documents come from:
    #   bundled: the Shakespeare corpus shipped in moela/data/corpus (941 scenes/poems, 5.3 MB; no other key needed)
    #   text:    text files; each file is one document, or several if `doc_separator` is set
    #   jsonl:   JSON-lines files; each line is one document, its text in `text_field`
    #   parquet: parquet files; each row is one document, its text in column `text_field`
    #   hf:      a Hugging Face `datasets` dataset: `hf_name` from the hub (online), or a builder such as
    #            "json" / "parquet" / "text" with local `paths` as its data_files (works offline)
    #   megatron: already tokenized Megatron-LM indexed datasets (.bin/.idx pairs); `paths` are their prefixes
    #            (as Megatron's --data-path; a path ending in .bin or .idx works too), read as they are, in order
    source: SourceKind = "bundled"
    # Files for text/jsonl/parquet (and data_files for hf): file paths, directories (all files inside,
    # recursively, sorted) or glob patterns; relative to the working directory; `~` and $VARS are expanded.
    paths: list[str] = field(default_factory=list)
    # Field (jsonl) or column (parquet, hf) that holds each document's text.
    text_field: str = "text"
    # text source only: a literal string that separates documents inside one file (e.g. "\n\n\n");
    # null makes each file one document.
    doc_separator: str | None = None
    # hf source: dataset name on the hub, or a builder name ("json", "parquet", "text", "csv") with `paths`.
    hf_name: str | None = None
    hf_config: str | None = None  # hf source: dataset configuration (subset) name
    hf_split: str = "train"  # hf source: which split to read (the held-out split is cut from it)
    hf_revision: str | None = None  # hf source: git revision of a hub dataset; part of the cache key
    # hf source: stream the dataset instead of downloading it whole first (for large hub datasets; combine with
    # max_docs to tokenize only a prefix).
    hf_streaming: bool = False
    # Read at most this many (non-empty) documents from the source; null = all. Part of the cache key.
    max_docs: int | None = None

    def validate_source(self) -> list[str]:
        errors = []
        if self.source in ("text", "jsonl", "parquet", "megatron"):
            if not self.paths:
                errors.append(f"paths: source '{self.source}' needs at least one file, directory or glob; "
                              f"set data.paths or use source: bundled")
        elif self.source == "hf":
            if not self.hf_name:
                errors.append("hf_name: source 'hf' needs a dataset name (hub) or a builder such as 'json' "
                              "with data.paths; set data.hf_name")
            if importlib.util.find_spec("datasets") is None:
                errors.append("source: 'hf' reads through the Hugging Face datasets package, which is not "
                              "installed; pip install 'moela[datasets]', or read the files with source: jsonl, "
                              "parquet or text")
        elif self.source == "bundled" and self.paths:
            errors.append("paths: given, but source 'bundled' reads only the shipped corpus; set data.source to "
                          "text, jsonl, parquet or hf to read these files")
        elif self.source != "bundled":
            errors.append(f"source: unknown source '{self.source}'; use one of bundled, text, jsonl, parquet, hf, "
                          f"megatron")
        if self.source == "megatron":
            from .megatron import prefix_errors

            errors += prefix_errors(self.paths)
            if self.max_docs is not None:
                errors.append("max_docs: the megatron source reads whole datasets; remove data.max_docs")
        for p in self.paths if self.source != "megatron" else []:
            if not expand_path(p):
                errors.append(f"paths: '{p}' matches no file; check the path or glob pattern")
        if self.doc_separator is not None and self.source != "text":
            errors.append(f"doc_separator: only the text source splits files; source '{self.source}' reads one "
                          f"document per line/row; remove data.doc_separator")
        if self.doc_separator == "":
            errors.append("doc_separator: must not be empty; use null to make each file one document")
        if not self.text_field:
            errors.append("text_field: must name the field/column that holds the text, e.g. 'text'")
        if self.max_docs is not None and self.max_docs < 1:
            errors.append(f"max_docs: must be >= 1 or null (all documents), got {self.max_docs}")
        return errors


@dataclass
class MixtureSource(SourceConfig):
    # Share of training tokens drawn from this source (weights are normalized over the mixture). A source whose
    # share exceeds its natural size is repeated (reshuffled each pass); a smaller share walks through it over
    # several epochs.
    weight: float = 1.0


@dataclass
class DataConfig(SourceConfig):
    # Several sources with sampling weights, e.g. [{source: jsonl, paths: [web/], weight: 0.7},
    # {source: bundled, weight: 0.3}]. When set, the source keys above must stay at their defaults.
    mixture: list[MixtureSource] = field(default_factory=list)
    # "bundled" (the committed byte-level BPE, 4096 tokens), a path to a tokenizer.json, or a hub model name
    # whose tokenizer.json `tokenizers` can download (online).
    tokenizer: str = "bundled"
    # The end-of-document token for a non-bundled tokenizer; null = the first of <|endoftext|>, </s>, <eos>,
    # <|end_of_text|> that the vocabulary has.
    eos_token: str | None = None
    # A token to put at the start of every document (e.g. "<｜begin▁of▁sentence｜>" for DeepSeek-V3's tokenizer);
    # null = none (the bundled tokenizer has no BOS).
    bos_token: str | None = None
    # Token cache root. The cache of one (source, tokenizer) pair lives in a subdirectory named by their hash; it is
    # built once (a progress bar shows the tokenization) and reused by later runs. Delete it to rebuild.
    cache_dir: str = "~/.cache/moela/tokens"
    # Worker processes that tokenize the cache's shards in parallel (one core each); null = the cores available
    # divided among the node's ranks. Several processes or nodes sharing cache_dir split the shards among them.
    tokenize_workers: int | None = None
    # Source bytes per cache shard (the unit of parallel tokenization and of the training stream). Part of the key.
    shard_bytes: int = 64 << 20
    # Start training once the shards the first steps need are tokenized, the rest following in the background.
    # The batches are those of `false` (the stream reads shard by shard either way; moela.data.stream) and never
    # depend on tokenization speed; a step whose shard is not ready waits for it. Works for a mixture of text
    # sources; not for megatron sources (tokenized already).
    stream_start: bool = False
    # Held-out validation split: this fraction of the documents of each source's first shard (at least one), chosen
    # by a fixed permutation of the document index, independent of the training seed; capped at `val_max_tokens`
    # tokens in all (a mixture shares the cap by weight).
    val_fraction: float = 0.01
    val_max_tokens: int = 262144
    # Documents longer than this many tokens (EOS included) are cut into pieces of at most this length before
    # packing (each piece restarts position_ids); null = only cut at the micro-batch budget.
    max_doc_len: int | None = None
    # Shuffle document pieces at every epoch (deterministically from the seed and the epoch number).
    shuffle: bool = True
    # Assign each step's micro-batches to data-parallel ranks so that their cost (a * sum L + b * sum L^2,
    # L = document lengths) is balanced; false = round robin.
    balance: bool = False
    # The cost's quadratic weight as a document length: the length at which a token's attention cost equals its
    # other (length-independent) cost, i.e. b / a = 1 / attn_cost_len. null = derive a and b from the model's
    # training FLOPs (what train.py does; moela.data.balance.cost_coefficients), or 4096 without a model.
    attn_cost_len: int | None = None

    def sources(self) -> list[tuple[SourceConfig, float]]:
        """(source, normalized weight) pairs: the mixture, or this section's own source with weight 1."""
        if not self.mixture:
            return [(self, 1.0)]
        total = sum(m.weight for m in self.mixture)
        return [(m, m.weight / total) for m in self.mixture]

    def validate(self) -> list[str]:
        errors = []
        if self.mixture:
            defaults = SourceConfig()
            own = [name for name in vars(defaults) if getattr(self, name) != getattr(defaults, name)]
            if own:
                errors.append(f"mixture: set together with {', '.join(own)}; give every source as a mixture entry "
                              f"and remove the top-level source keys")
            for i, m in enumerate(self.mixture):
                errors += [f"mixture[{i}].{e}" for e in m.validate_source()]
                if not m.weight > 0:
                    errors.append(f"mixture[{i}].weight: must be > 0, got {m.weight}")
        else:
            errors += self.validate_source()
        if self.tokenizer != "bundled" and self.tokenizer.endswith(".json") and not os.path.isfile(
                os.path.expanduser(self.tokenizer)):
            errors.append(f"tokenizer: file '{self.tokenizer}' not found; give a tokenizer.json path or 'bundled'")
        if not 0.0 <= self.val_fraction < 1.0:
            errors.append(f"val_fraction: must be in [0, 1), got {self.val_fraction}")
        if self.val_max_tokens < 0:
            errors.append(f"val_max_tokens: must be >= 0, got {self.val_max_tokens}")
        if self.max_doc_len is not None and self.max_doc_len < 2:
            errors.append(f"max_doc_len: must be >= 2 or null, got {self.max_doc_len}")
        if self.tokenize_workers is not None and self.tokenize_workers < 1:
            errors.append(f"tokenize_workers: must be >= 1 or null (the cores available), got {self.tokenize_workers}")
        if self.shard_bytes < 1 << 16:
            errors.append(f"shard_bytes: must be >= 65536 (64 KiB), got {self.shard_bytes}")
        if self.stream_start and any(source.source == "megatron" for source, _ in self.sources()):
            errors.append("stream_start: the megatron source is tokenized already; set data.stream_start=false")
        if self.attn_cost_len is not None and self.attn_cost_len < 1:
            errors.append(f"attn_cost_len: must be >= 1 or null (from the model's FLOPs), got {self.attn_cost_len}")
        return errors


def expand_path(pattern: str) -> list[str]:
    """Files named by one `paths` entry: a file, every file under a directory (sorted), or a glob's matches."""
    p = os.path.expandvars(os.path.expanduser(pattern))
    if os.path.isfile(p):
        return [p]
    if os.path.isdir(p):
        return sorted(os.path.join(root, name) for root, _, names in os.walk(p) for name in names
                      if not name.startswith("."))
    return sorted(f for f in glob.glob(p, recursive=True) if os.path.isfile(f))
