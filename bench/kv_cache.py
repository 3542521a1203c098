"""MLA latent cache: memory per token and held-out quality of the full-precision, int8 and int4 latent caches.

    python bench/kv_cache.py                         # trains the tiny recipe briefly on CPU, writes the table
    python bench/kv_cache.py --run-dir runs/tiny     # or measures an existing run's newest checkpoint
    python bench/kv_cache.py --recipe recipes/small.yaml --steps 200 --device cuda \
        --out-dir /tmp/kv_cache_small                # the small model on a GPU (bf16 compute)

Writes bench/results/kv_cache.md and .json (`--out-dir`).

Quality: held-out perplexity (the run's validation split, teacher forcing) through the cached decoding path, where
every token's latent is written to the cache (quantized for int8 / int4) and read back before its own query
attends, exactly what decoding does, next to the full training forward on the same documents. Documents are
decoded right-padded in batches, prefilled in chunks of positions; that gives the same values as token-by-token
decoding, since the quantization is per token. Memory: bytes one token occupies per layer, for the measured model
and, from the same formula, the `small` preset and DeepSeek-V3, next to an expanded K/V cache (H x (Dqk + Dv)
values).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.results_io import add_out_dir, write_results  # noqa: E402
from moela.batch import IGNORE_INDEX  # noqa: E402
from moela.config import load_config  # noqa: E402
from moela.inference import LatentDecoder, cache_bytes_per_token  # noqa: E402
from moela.model import PRESETS, ModelConfig, Transformer  # noqa: E402
from moela.tools.evaluate import held_out_loader  # noqa: E402
from moela.tools.runs import find_checkpoint, load_model, load_run_config, load_run_tokenizer  # noqa: E402
from moela.trainer import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CASES = [("none", 64), ("int8", 64), ("int8", 16), ("int4", 64), ("int4", 16), ("int4", 8)]
TOKENS_PER_BATCH = 16384  # documents x longest document, per decoding batch
CHUNK = 256  # positions per prefill chunk (bounds the [B, chunk, H, L] scores)


def train(recipe: Path, steps: int, run_dir: Path) -> None:
    cfg = load_config(recipe, [f"train.steps={steps}", f"train.run_dir={run_dir}", "logging.progress_bar=never",
                               "logging.plot=false", f"train.eval_every={steps}", "checkpoint.every=0",
                               "logging.samples=0"])
    with contextlib.redirect_stdout(io.StringIO()):
        Trainer(cfg).fit()


def documents(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input ids, labels) of every held-out document piece, from the packed validation batches."""
    out = []
    for batch in loader:
        cu = batch.cu_seqlens.tolist()
        out += [(batch.input_ids[a:b], batch.labels[a:b]) for a, b in zip(cu[:-1], cu[1:])]
    return out


def batches(docs) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Documents grouped (longest first) so that each group's documents x longest length fits TOKENS_PER_BATCH."""
    order = sorted(docs, key=lambda d: -len(d[0]))
    out, group = [], []
    for doc in order:
        if group and (len(group) + 1) * len(group[0][0]) > TOKENS_PER_BATCH:
            out.append(group)
            group = []
        group.append(doc)
    return out + ([group] if group else [])


@torch.no_grad()
def cached_nll(model: Transformer, docs, quant: str, group: int) -> tuple[float, int]:
    """Summed NLL and labelled tokens through the latent cache, teacher forcing."""
    decoder = LatentDecoder(model)
    device = model.embed.weight.device
    total, count = 0.0, 0
    for chunk in batches(docs):
        b, s = len(chunk), max(len(ids) for ids, _ in chunk)
        tokens = torch.zeros(b, s, dtype=torch.long, device=device)
        labels = torch.full((b, s), IGNORE_INDEX, dtype=torch.long, device=device)
        for j, (ids, lab) in enumerate(chunk):
            tokens[j, :len(ids)], labels[j, :len(lab)] = ids, lab
        cache = decoder.new_cache(b, s, quant=quant, group_size=group)
        positions = torch.arange(s, device=device).expand(b, s)
        for start in range(0, s, CHUNK):
            end = min(start + CHUNK, s)
            logits = decoder.logits(decoder.hidden(tokens[:, start:end], positions[:, start:end], cache))
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, start:end].reshape(-1),
                                           ignore_index=IGNORE_INDEX, reduction="sum"))
        count += int((labels != IGNORE_INDEX).sum())
    return total, count


@torch.no_grad()
def full_nll(model: Transformer, loader) -> tuple[float, int]:
    device = model.embed.weight.device
    total, count = 0.0, 0
    for batch in loader:
        batch = batch.to(device)
        logits = model(batch, return_logits=True).logits.float()
        total += float(F.cross_entropy(logits, batch.labels, ignore_index=IGNORE_INDEX, reduction="sum"))
        count += batch.num_targets()
    return total, count


def memory_rows(cfg: ModelConfig, name: str) -> list[str]:
    c, r, h = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_attention_heads
    expanded = h * (cfg.qk_head_dim + cfg.v_head_dim) * 2
    rows = []
    for quant, group in [("none", 64), ("int8", 64), ("int4", 64), ("int4", 16)]:
        g = min(group, c)
        per_layer = cache_bytes_per_token(c, r, 1, quant=quant, group_size=g, dtype=torch.bfloat16)
        total = per_layer * cfg.num_hidden_layers
        label = "bf16 latent" if quant == "none" else f"{quant}, group {g}"
        rows.append(f"| {name} | {label} | {per_layer} | {total / 1024:.1f} KiB | {expanded / per_layer:.1f}x | "
                    f"{cache_bytes_per_token(c, r, 1) / per_layer:.2f}x |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default=None, help="measure this run's newest checkpoint instead of training")
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "tiny.yaml"), help="recipe to train")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--device", default="cpu", help="cpu (float32) or cuda (bfloat16) for the measurement")
    add_out_dir(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.run_dir) if args.run_dir else Path(tmp) / "run"
        if not args.run_dir:
            train(Path(args.recipe), args.steps, run_dir)
        trained_s = time.perf_counter() - t0
        ckpt = find_checkpoint(run_dir)
        cfg = load_run_config(run_dir)
        tok = load_run_tokenizer(cfg)
        model = load_model(cfg.model, ckpt.path, device, dtype)
        loader = held_out_loader(cfg, tok, None)
        docs = [(ids.to(device), labels.to(device)) for ids, labels in documents(loader)]
        ref_nll, ref_n = full_nll(model, loader)
        rows, quality = [], []
        for quant, group in CASES:
            g = min(group, cfg.model.kv_lora_rank)
            if quant != "none" and (quant, g) in [(q, min(gg, cfg.model.kv_lora_rank)) for q, gg in
                                                  CASES[:CASES.index((quant, group))]]:
                continue
            nll, n = cached_nll(model, docs, quant, g)
            assert n == ref_n, (n, ref_n)
            bytes_layer = cache_bytes_per_token(cfg.model.kv_lora_rank, cfg.model.qk_rope_head_dim, 1, quant=quant,
                                                group_size=g, dtype=torch.bfloat16)
            label = "none (bf16 latent)" if quant == "none" else f"{quant}, group {g}"
            ppl, ref_ppl = math.exp(nll / n), math.exp(ref_nll / ref_n)
            rows.append(f"| {label} | {bytes_layer} | {nll / n:.5f} | {ppl:.3f} | {100 * (ppl / ref_ppl - 1):+.3f}% |")
            quality.append(dict(cache=quant, group=g, bytes_per_token_layer=bytes_layer, loss=nll / n, ppl=ppl))
        control = copy.deepcopy(model)
        with torch.no_grad():
            for block in control.layers:
                block.attn.kv_norm.weight.zero_()  # every cached latent 0: attention keeps only its RoPE scores
        nll, n = cached_nll(control, docs, "none", cfg.model.kv_lora_rank)
        ppl = math.exp(nll / n)
        rows.append(f"| control: latent zeroed | - | {nll / n:.5f} | {ppl:.3f} | {100 * (ppl / ref_ppl - 1):+.3f}% |")
        quality.append(dict(cache="control: latent zeroed", group=None, bytes_per_token_layer=None, loss=nll / n,
                            ppl=ppl))
    mc = cfg.model
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU ({platform.machine()}, 1 thread)")
    trained = (f"{Path(args.recipe).name} trained {args.steps} steps on its data in {trained_s:.0f} s"
               if not args.run_dir else str(ckpt.path))
    lines = [
        f"{'bf16' if device.type == 'cuda' else 'float32'} compute, python {platform.python_version()}.", "",
        f"Model: {trained} (kv_lora_rank {mc.kv_lora_rank}, qk_rope_head_dim {mc.qk_rope_head_dim}, "
        f"{mc.num_hidden_layers} layers; checkpoint step {ckpt.step}). Held-out split: {ref_n} labelled tokens in "
        f"{len(docs)} document pieces. Full training forward (no cache) on the same documents: loss "
        f"{ref_nll / ref_n:.5f}, ppl {math.exp(ref_nll / ref_n):.3f}.", "",
        "## Quality through the cached decoding path (teacher forcing)", "",
        "Bytes per token per layer for a bf16 compute dtype: the RoPE key stays bf16, the latent is bf16 or int8 / "
        "int4 codes plus one float32 scale per group. 'none' stores the latent in the compute dtype. The control row "
        "zeroes every latent (keys keep only their RoPE part, values vanish): how much the measured path depends on "
        "what the cache holds.", "",
        "| latent cache | bytes / token / layer | loss | ppl | ppl vs full forward |",
        "| --- | ---: | ---: | ---: | ---: |", *rows, "",
        "## Memory per token (formula of `moela.inference.cache_bytes_per_token`)", "",
        "| model | cache | bytes / token / layer | all layers | smaller than expanded bf16 K/V | "
        "smaller than bf16 latent |", "| --- | --- | ---: | ---: | ---: | ---: |",
        *memory_rows(mc, "this model"),
        *memory_rows(ModelConfig(**PRESETS["small"]), "small preset"),
        *memory_rows(ModelConfig(**PRESETS["v3"]), "DeepSeek-V3"), "",
    ]
    payload = dict(model=trained, checkpoint_step=ckpt.step, held_out_tokens=ref_n, documents=len(docs),
                   full_forward=dict(loss=ref_nll / ref_n, ppl=math.exp(ref_nll / ref_n)), cached=quality)
    write_results("kv_cache", "MLA latent cache: memory and quality", "\n".join(lines), payload,
                  out_dir=args.out_dir, device=where)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
