"""`python -m moela generate RUN_DIR`: sample text from a trained checkpoint, streamed as it is generated.

The checkpoint (any parallel layout) is loaded onto one device and decoded with the MLA latent cache
(`moela.inference`). Each prompt is encoded as training saw documents: the BOS token first when the run uses one,
then the text; a sequence ends at the end-of-document token or after `--max-new-tokens`. One prompt streams to
stdout token by token (whole characters only: a multi-byte character split over tokens is printed once complete);
several `--prompt`s decode as one batch and print when done. Run information goes to stderr, so stdout is only text.
"""

from __future__ import annotations

import argparse
import sys

from moela.inference import QUANT_BITS, cache_bytes_per_token, generate
from moela.tools.runs import (
    UsageError,
    find_checkpoint,
    load_model,
    load_run_config,
    load_run_tokenizer,
    resolve_device,
    resolve_dtype,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory (train.run_dir) or a checkpoints/step-N folder")
    p.add_argument("--prompt", action="append", default=None,
                   help="text to continue; repeat for a batch of prompts (default: one empty prompt, which needs a "
                        "BOS token)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per prompt (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass, 1 = off (default 0.95)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0 = off (default 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16")
    p.add_argument("--cache", default="none", choices=list(QUANT_BITS),
                   help="latent cache storage: none (compute dtype), int8 or int4 per-token-group codes")
    p.add_argument("--group-size", type=int, default=64, help="channels per quantization group (default 64)")


def _check(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    if args.temperature < 0:
        raise UsageError(f"--temperature {args.temperature}: must be >= 0 (0 = greedy)")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p {args.top_p}: must be in (0, 1] (1 = off)")
    if args.top_k < 0:
        raise UsageError(f"--top-k {args.top_k}: must be >= 0 (0 = off)")
    if args.group_size < 1:
        raise UsageError(f"--group-size {args.group_size}: must be >= 1")


class _Streamer:
    """Prints the newly decoded text of one sequence after every step (complete characters only)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.out = tokenizer, sys.stdout
        self.ids: list[int] = []
        self.printed = 0
        self.done = False

    def __call__(self, tokens: list[int], finished: list[bool]) -> None:
        if self.done or finished[0]:  # the step that finishes a sequence produced its end-of-document token
            self.done = True
            return
        self.ids.append(tokens[0])
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self.out.write(text[self.printed:])
            self.out.flush()
            self.printed = len(text)

    def finish(self) -> None:
        text = self.tokenizer.decode(self.ids)
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()


def run(args: argparse.Namespace) -> int:
    _check(args)
    ckpt = find_checkpoint(args.run, args.step)
    cfg = load_run_config(ckpt.run_dir)
    tokenizer = load_run_tokenizer(cfg)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    prompts = args.prompt or [""]
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    encoded = [bos + tokenizer.encode(p) for p in prompts]
    if any(not e for e in encoded):
        raise UsageError("--prompt: an empty prompt needs a BOS token to start from, and this run's tokenizer has "
                         "none (data.bos_token is null); give some text, e.g. --prompt 'ROMEO:'")
    group = min(args.group_size, cfg.model.kv_lora_rank)
    if args.cache != "none" and cfg.model.kv_lora_rank % group:
        raise UsageError(f"--group-size {args.group_size}: must divide the model's kv_lora_rank="
                         f"{cfg.model.kv_lora_rank}")
    model = load_model(cfg.model, ckpt.path, device, dtype)
    per_token = cache_bytes_per_token(cfg.model.kv_lora_rank, cfg.model.qk_rope_head_dim,
                                      cfg.model.num_hidden_layers, quant=args.cache,
                                      group_size=group, dtype=dtype)
    print(f"moela generate: {ckpt.path} on {device} ({str(dtype).replace('torch.', '')}), latent cache "
          f"{args.cache}: {per_token} bytes per token", file=sys.stderr)
    stream = _Streamer(tokenizer) if len(prompts) == 1 else None
    if stream is not None:
        sys.stdout.write(prompts[0])
    outputs = generate(model, encoded, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_id=tokenizer.eos_id,
                       cache_quant=args.cache, group_size=args.group_size, on_step=stream)
    if stream is not None:
        stream.finish()
        return 0
    for i, (prompt, ids) in enumerate(zip(prompts, outputs)):
        print(f"--- sample {i + 1}/{len(prompts)}")
        print(prompt + tokenizer.decode(ids))
    return 0
