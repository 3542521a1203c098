"""Samples printed at each evaluation (`logging.samples` > 0): continuations of `logging.sample_prompt`, to see what
the model has learned while it trains.

Decisions:
- The full training forward per new token (`moela.inference.generate_uncached`), not the latent cache: it runs
  on the model as the trainer holds it (FSDP2-sharded, expert-parallel), with every rank taking part in lockstep
  and rank 0's token broadcast each step, so ranks never disagree on when a sample ends. Samples are short, so the
  quadratic cost is small next to an evaluation. Context parallelism splits every sequence over ranks; there the
  trainer prints no samples.
- Temperature 0.8 and top-p 0.95 (the `generate` command's defaults), seeded by train.seed and the step: the
  same run prints the same samples, resumed or not.
- The prompt is encoded as documents were in training (BOS first when the run has one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moela.config import LoggingConfig
from moela.data.tokenizer import Tokenizer
from moela.inference import generate_uncached, make_generator

TEMPERATURE = 0.8
TOP_P = 0.95


def _broadcast_from_rank0(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.broadcast(t, src=0)
    return t


def sample_texts(model: torch.nn.Module, tokenizer: Tokenizer, cfg: LoggingConfig, seed: int) -> list[str]:
    """`cfg.samples` continuations of `cfg.sample_prompt` (prompt included); every rank must call this."""
    prompt = ([] if tokenizer.bos_id is None else [tokenizer.bos_id]) + tokenizer.encode(cfg.sample_prompt)
    if not prompt:
        return []
    device = next(model.parameters()).device
    generator = make_generator(seed, device)
    was_training = model.training
    model.eval()
    try:
        outs = [generate_uncached(model, prompt, max_new_tokens=cfg.sample_tokens, temperature=TEMPERATURE,
                                  top_p=TOP_P, generator=generator, eos_id=tokenizer.eos_id,
                                  sync=_broadcast_from_rank0) for _ in range(cfg.samples)]
    finally:
        model.train(was_training)
    return [cfg.sample_prompt + tokenizer.decode(ids) for ids in outs]


def format_samples(texts: list[str], step: int, cfg: LoggingConfig) -> str:
    if not texts:
        return (f"samples at step {step}: none (logging.sample_prompt is empty and the tokenizer has no BOS token "
                f"to start from; set logging.sample_prompt)")
    lines = [f"samples at step {step} ({cfg.sample_tokens} tokens after {cfg.sample_prompt!r}):"]
    for i, text in enumerate(texts):
        body = text.splitlines() or [""]
        lines += [f"  [{i + 1}] {body[0]}"] + [f"      {line}" for line in body[1:]]
    return "\n".join(lines)
