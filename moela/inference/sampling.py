"""Sampling: next-token choice (greedy, temperature, top-k, top-p) and the generation loops.

`generate` decodes a batch of prompts with the latent cache (`moela.inference.decode`): the prompts are prefilled
in chunks (bounding the score tensor to chunk x prompt length), then one token per step for every sequence; a
sequence stops at the end-of-document token, which is not part of its output. `on_step(tokens, finished)` is called
after every step (for streaming); a true return value stops the generation there (stop strings).

`generate_uncached` reruns the full training forward over the whole sequence for every new token: no cache, so it
works on a sharded model (FSDP2, expert parallelism) as long as every rank calls it with the same prompt; `sync`
lets the ranks agree on each sampled token. The trainer prints its evaluation samples with it.

Decisions:
- temperature 0 is greedy (argmax; the lowest id wins a tie, as torch.argmax does). Otherwise logits are divided
  by the temperature, then top-k keeps the k largest, then top-p keeps the smallest set of most likely tokens
  whose probability reaches p (always at least the most likely one), and a token is drawn from what is left.
- A `torch.Generator` seeded by the caller makes sampling reproducible.

Shapes: B sequences, V vocabulary.
"""

from __future__ import annotations

from typing import Callable

import torch

from moela.batch import IGNORE_INDEX, PackedBatch
from moela.inference.decode import LatentDecoder
from moela.model.transformer import Transformer

PREFILL_CHUNK = 256


def sample_next(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> next token ids [B] int64."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature  # [B, V]
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass of the more likely tokens
        drop_sorted = before >= top_p  # [B, V]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
             cache_quant: str = "none", group_size: int = 64, backend: str = "auto",
             on_step: Callable[[list[int], list[bool]], bool | None] | None = None) -> list[list[int]]:
    """Continue each prompt (token ids, at least one each) by up to `max_new_tokens` tokens -> the new tokens.
    `backend`: the attention over the cached latents (`moela.inference.latent_attention`)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    decoder = LatentDecoder(model, backend=backend)
    device = model.embed.weight.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # [B]
    b, longest = len(prompts), max(len(p) for p in prompts)
    cache = decoder.new_cache(b, longest + max_new_tokens, quant=cache_quant, group_size=group_size)
    tokens = torch.zeros(b, longest, dtype=torch.long, device=device)  # [B, S] right-padded
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p, device=device)
    positions = torch.arange(longest, device=device).expand(b, longest)  # [B, S]
    last_hidden = None
    for start in range(0, longest, PREFILL_CHUNK):
        end = min(start + PREFILL_CHUNK, longest)
        h = decoder.hidden(tokens[:, start:end], positions[:, start:end], cache)  # [B, c, D]
        idx = (lengths - 1 - start).clamp(0, end - start - 1)  # [B] each prompt's last token, if in this chunk
        picked = h[torch.arange(b, device=device), idx]  # [B, D]
        in_chunk = ((lengths - 1 >= start) & (lengths - 1 < end))[:, None]  # [B, 1]
        last_hidden = picked if last_hidden is None else torch.where(in_chunk, picked, last_hidden)
    generator = make_generator(seed, device)
    out: list[list[int]] = [[] for _ in prompts]
    finished = [False] * b
    logits = decoder.logits(last_hidden)  # [B, V]
    for step in range(max_new_tokens):
        nxt = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)  # [B]
        new = nxt.tolist()
        for i, t in enumerate(new):
            if finished[i]:
                continue
            if eos_id is not None and t == eos_id:
                finished[i] = True
            else:
                out[i].append(t)
        stop = on_step is not None and on_step(new, list(finished))
        if stop or all(finished) or step == max_new_tokens - 1:
            break
        h = decoder.hidden(nxt[:, None], (lengths + step)[:, None], cache)  # [B, 1, D]
        logits = decoder.logits(h[:, 0])  # [B, V]
    return out


@torch.no_grad()
def generate_uncached(model: torch.nn.Module, prompt: list[int], *, max_new_tokens: int, temperature: float = 1.0,
                      top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None,
                      eos_id: int | None = None, sync: Callable[[torch.Tensor], torch.Tensor] | None = None
                      ) -> list[int]:
    """Continue one prompt with a full forward per new token (see the module docstring) -> the new tokens."""
    if not prompt:
        raise ValueError("generate_uncached: the prompt needs at least one token")
    device = next(model.parameters()).device
    ids = torch.tensor(prompt, dtype=torch.long, device=device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        t = ids.numel()
        batch = PackedBatch(ids, torch.full_like(ids, IGNORE_INDEX), torch.arange(t, dtype=torch.int32, device=device),
                            torch.tensor([0, t], dtype=torch.int32, device=device), t, targets_on_host=0)
        logits = model(batch, return_logits=True).logits[-1:]  # [1, V]
        nxt = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)  # [1]
        if sync is not None:
            nxt = sync(nxt)
        token = int(nxt)
        if eos_id is not None and token == eos_id:
            break
        out.append(token)
        ids = torch.cat((ids, nxt.to(ids.dtype)))
    return out
