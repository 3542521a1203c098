"""`python -m moela eval RUN_DIR`: held-out loss, perplexity and bits per byte of a checkpoint, on the run's own
held-out split or on any source the data module reads; with `--tasks`, lm-eval-harness benchmarks instead.

Data (`--data`):
- `val` (default): the run's held-out split, exactly as the trainer builds it (same documents, cuts and packing),
  so the loss equals the trainer's `val_loss` (with `train.eval_batches: 0`). `--max-tokens` may only shrink it.
- `bundled`, a file / directory / glob (`.jsonl` -> jsonl, `.parquet` -> parquet, else text), or `hf:NAME` (with
  `--hf-config`, `--split`): every document of that source, in order, up to `--max-tokens` tokens (default 1M),
  tokenized with the run's tokenizer into the run's token cache directory.

Decisions:
- Documents are cut at the run's `data.max_doc_len` and packed into micro-batches of `train.tokens_per_microbatch`
  tokens, as in training; every labelled token counts (the end-of-document token included), token-mean.
- Bits per byte = sum of the losses of tokens that stand for text / (ln 2 * the UTF-8 bytes of that text):
  special tokens (EOS, BOS) carry no bytes and are left out of both sums, as nanochat does. A token's bytes come
  from the byte-level BPE alphabet when the tokenizer is byte-level (exact, also for tokens holding part of a
  multi-byte character), else from decoding the token alone.
- Same precision as training: bf16 autocast on CUDA unless the run's `train.precision` is fp32.
"""

from __future__ import annotations

import argparse
import json
import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moela.batch import IGNORE_INDEX
from moela.config import Config
from moela.data import held_out_parts, open_source
from moela.data.config import SourceConfig, expand_path
from moela.data.loader import Part, ValLoader
from moela.data.tokenizer import Tokenizer
from moela.model import Transformer
from moela.tools.runs import (
    UsageError,
    find_checkpoint,
    load_model,
    load_run_config,
    load_run_tokenizer,
    resolve_device,
)

DEFAULT_MAX_TOKENS = 1_000_000


@dataclass
class EvalResult:
    loss: float  # token-mean cross-entropy (nats) over every labelled token
    ppl: float
    bits_per_byte: float
    tokens: int  # labelled tokens
    bytes: int  # UTF-8 bytes of the text those tokens stand for

    def line(self) -> str:
        return (f"loss {self.loss:.4f} | ppl {self.ppl:.2f} | bits/byte {self.bits_per_byte:.4f} | "
                f"{self.tokens} tokens, {self.bytes} bytes")


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): each byte is shown as one printable character; this maps back."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_byte_lengths(tokenizer: Tokenizer, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: UTF-8 bytes of each token's text, 0 for special tokens and ids beyond the tokenizer."""
    spec = json.loads(tokenizer.hf.to_str())
    decoder = spec.get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    byte_level = "ByteLevel" in kinds
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    table = _byte_decoder()
    lengths = torch.zeros(vocab_size, dtype=torch.int64)
    for token, idx in tokenizer.hf.get_vocab(with_added_tokens=True).items():
        if idx >= vocab_size or idx in special:
            continue
        if byte_level and all(c in table for c in token):
            lengths[idx] = len(token)
        else:
            lengths[idx] = len(tokenizer.hf.decode([idx], skip_special_tokens=False).encode("utf-8"))
    return lengths


@torch.no_grad()
def evaluate_batches(model: Transformer, batches, byte_lengths: torch.Tensor,
                     autocast_dtype: torch.dtype | None = None) -> EvalResult:
    """Loss / perplexity / bits per byte of `model` over packed `batches`."""
    device = model.embed.weight.device
    byte_lengths = byte_lengths.to(device)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # [loss, loss of byte tokens, targets]
    nbytes = 0
    model.eval()
    for batch in batches:
        batch = batch.to(device)
        ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
        with ctx:
            logits = model(batch, return_logits=True).logits  # [T, V]
        ce = F.cross_entropy(logits.float(), batch.labels, ignore_index=IGNORE_INDEX, reduction="none")  # [T]
        labelled = batch.labels != IGNORE_INDEX  # [T]
        token_bytes = torch.where(labelled, byte_lengths[batch.labels.clamp_min(0)], 0)  # [T]
        sums[0] += ce.double().sum()
        sums[1] += ce.double()[token_bytes > 0].sum()
        sums[2] += labelled.sum()
        nbytes += int(token_bytes.sum())
    targets = int(sums[2])
    if targets == 0:
        raise UsageError("the evaluation data has no labelled token (every document is a single token?)")
    loss = float(sums[0]) / targets
    bpb = float(sums[1]) / (math.log(2) * nbytes) if nbytes else float("nan")
    return EvalResult(loss, math.exp(min(loss, 50.0)), bpb, targets, nbytes)


def held_out_loader(cfg: Config, tokenizer: Tokenizer, max_tokens: int | None) -> ValLoader:
    """The run's held-out split as the trainer builds it (optionally cut to fewer tokens)."""
    data = cfg.data
    cap = data.val_max_tokens if max_tokens is None else max_tokens
    if cap > data.val_max_tokens:
        raise UsageError(f"--max-tokens {max_tokens}: the run's held-out split has at most data.val_max_tokens="
                         f"{data.val_max_tokens} tokens (more would take training documents); pass a smaller value")
    parts = held_out_parts(data, tokenizer)
    if not sum(len(p.doc_ids) for p in parts) or cap == 0:
        raise UsageError("the run has no held-out split (data.val_fraction or data.val_max_tokens is 0); evaluate "
                         "on other data with --data")
    return ValLoader(parts, cap, tokens_per_microbatch=cfg.train.tokens_per_microbatch,
                     max_doc_len=data.max_doc_len, dp_rank=0, dp_size=1)


def source_from_spec(spec: str, *, text_field: str, hf_config: str | None, split: str) -> SourceConfig:
    if spec == "bundled":
        return SourceConfig()
    if spec.startswith("hf:"):
        source = SourceConfig(source="hf", hf_name=spec[3:], hf_config=hf_config, hf_split=split,
                              text_field=text_field)
    else:
        files = expand_path(spec)
        if not files:
            raise UsageError(f"--data {spec}: matches no file; give val, bundled, a file, directory or glob, or "
                             f"hf:NAME")
        suffix = Path(files[0]).suffix
        kind = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(suffix, "text")
        source = SourceConfig(source=kind, paths=[spec], text_field=text_field)
    errors = source.validate_source()
    if errors:
        raise UsageError(f"--data {spec}: " + "; ".join(errors))
    return source


def source_loader(cfg: Config, tokenizer: Tokenizer, source_cfg: SourceConfig, max_tokens: int) -> ValLoader:
    """Every document of `source_cfg`, in order, capped at `max_tokens` tokens."""
    try:
        cache = open_source(source_cfg, tokenizer, cfg.data)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise UsageError(f"cannot read the evaluation data: {e}") from None
    docs = np.arange(len(cache.doc_lengths))
    return ValLoader([Part(cache, docs)], max_tokens, tokens_per_microbatch=cfg.train.tokens_per_microbatch,
                     max_doc_len=cfg.data.max_doc_len, dp_rank=0, dp_size=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory (train.run_dir) or a checkpoints/step-N folder")
    p.add_argument("--data", default="val", help="val (the run's held-out split, default) | bundled | a file, "
                   "directory or glob (.jsonl, .parquet, else text) | hf:NAME")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate at most this many tokens (default: the "
                   f"whole held-out split; {DEFAULT_MAX_TOKENS} for other data)")
    p.add_argument("--text-field", default="text", help="jsonl field / parquet or hf column with the text")
    p.add_argument("--hf-config", default=None, help="hf:NAME only: dataset configuration")
    p.add_argument("--split", default="test", help="hf:NAME only: dataset split (default test)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--tasks", default=None, help="comma-separated lm-eval-harness tasks (needs pip install "
                   "'moela[eval]'); replaces the loss evaluation")
    p.add_argument("--limit", type=float, default=None, help="lm-eval: examples per task (or a fraction)")
    p.add_argument("--num-fewshot", type=int, default=None, help="lm-eval: few-shot examples")


def run(args: argparse.Namespace) -> int:
    if args.max_tokens is not None and args.max_tokens < 1:
        raise UsageError(f"--max-tokens {args.max_tokens}: must be >= 1")
    ckpt = find_checkpoint(args.run, args.step)
    cfg = load_run_config(ckpt.run_dir)
    device = resolve_device(args.device)
    if args.tasks:
        from moela.tools.lm_eval_adapter import run_tasks
        return run_tasks(ckpt, cfg, device, args)
    tokenizer = load_run_tokenizer(cfg)
    if args.data == "val":
        loader = held_out_loader(cfg, tokenizer, args.max_tokens)
    else:
        source = source_from_spec(args.data, text_field=args.text_field, hf_config=args.hf_config, split=args.split)
        loader = source_loader(cfg, tokenizer, source, args.max_tokens or DEFAULT_MAX_TOKENS)
    model = load_model(cfg.model, ckpt.path, device, torch.float32)
    precision = cfg.train.precision
    autocast = torch.bfloat16 if precision == "bf16" or (precision == "auto" and device.type == "cuda") else None
    result = evaluate_batches(model, loader, token_byte_lengths(tokenizer, cfg.model.vocab_size), autocast)
    print(f"eval {ckpt.path} on {args.data}: {result.line()}")
    return 0
