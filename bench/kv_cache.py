"""MLA latent cache: memory per token and held-out quality of the full-precision, int8 and int4 latent caches.

    python bench/kv_cache.py                         # trains the tiny recipe briefly on CPU, writes the table
    python bench/kv_cache.py --run-dir runs/tiny     # or measures an existing run's newest checkpoint

Quality: held-out perplexity (the run's validation split, teacher forcing) through the cached decoding path, where
every token's latent is written to the cache (quantized for int8 / int4) and read back before its own query
attends, exactly what decoding does, next to the full training forward on the same documents. Documents are
decoded right-padded in batches; one prefill per batch gives the same values as token-by-token decoding, since the
quantization is per token. Memory: bytes one token occupies per layer, for the measured model and, computed from
the same formula, the `small` preset and DeepSeek-V3, next to an expanded K/V cache (H x (Dqk + Dv) values).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
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

from moela.batch import IGNORE_INDEX  # noqa: E402
from moela.config import load_config  # noqa: E402
from moela.inference import LatentDecoder, cache_bytes_per_token, generate  # noqa: E402
from moela.model import PRESETS, ModelConfig, Transformer  # noqa: E402
from moela.tools.evaluate import held_out_loader  # noqa: E402
from moela.tools.runs import find_checkpoint, load_model, load_run_config, load_run_tokenizer  # noqa: E402
from moela.trainer import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "kv_cache.md"
CASES = [("none", 64), ("int8", 64), ("int8", 16), ("int4", 64), ("int4", 16), ("int4", 8)]
DOCS_PER_BATCH = 16


def train_tiny(steps: int, run_dir: Path) -> None:
    cfg = load_config(ROOT / "recipes" / "tiny.yaml", [f"train.steps={steps}", f"train.run_dir={run_dir}",
                                                      "logging.progress_bar=never", "logging.plot=false",
                                                      f"train.eval_every={steps}", "checkpoint.every=0"])
    with contextlib.redirect_stdout(io.StringIO()):
        Trainer(cfg).fit()


def documents(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input ids, labels) of every held-out document piece, from the packed validation batches."""
    out = []
    for batch in loader:
        cu = batch.cu_seqlens.tolist()
        out += [(batch.input_ids[a:b], batch.labels[a:b]) for a, b in zip(cu[:-1], cu[1:])]
    return out


@torch.no_grad()
def cached_nll(model: Transformer, docs, quant: str, group: int) -> tuple[float, int]:
    """Summed NLL and labelled tokens through the latent cache, teacher forcing."""
    decoder = LatentDecoder(model)
    total, count = 0.0, 0
    for i in range(0, len(docs), DOCS_PER_BATCH):
        chunk = docs[i:i + DOCS_PER_BATCH]
        b, s = len(chunk), max(len(ids) for ids, _ in chunk)
        tokens = torch.zeros(b, s, dtype=torch.long)
        labels = torch.full((b, s), IGNORE_INDEX, dtype=torch.long)
        for j, (ids, lab) in enumerate(chunk):
            tokens[j, :len(ids)], labels[j, :len(lab)] = ids, lab
        cache = decoder.new_cache(b, s, quant=quant, group_size=group)
        logits = decoder.logits(decoder.hidden(tokens, torch.arange(s).expand(b, s), cache))  # [B, S, V]
        total += float(F.cross_entropy(logits.reshape(b * s, -1), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                       reduction="sum"))
        count += int((labels != IGNORE_INDEX).sum())
    return total, count


@torch.no_grad()
def full_nll(model: Transformer, loader) -> tuple[float, int]:
    total, count = 0.0, 0
    for batch in loader:
        logits = model(batch, return_logits=True).logits
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
    parser.add_argument("--steps", type=int, default=300, help="training steps of the tiny recipe (default 300)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.run_dir) if args.run_dir else Path(tmp) / "tiny"
        if not args.run_dir:
            train_tiny(args.steps, run_dir)
        trained_s = time.perf_counter() - t0
        ckpt = find_checkpoint(run_dir)
        cfg = load_run_config(run_dir)
        tok = load_run_tokenizer(cfg)
        model = load_model(cfg.model, ckpt.path, torch.device("cpu"), torch.float32)
        loader = held_out_loader(cfg, tok, None)
        docs = documents(loader)
        ref_nll, ref_n = full_nll(model, loader)
        rows = []
        for quant, group in CASES:
            g = min(group, cfg.model.kv_lora_rank)
            if quant != "none" and (quant, g) in [(q, min(gg, cfg.model.kv_lora_rank)) for q, gg in
                                                  CASES[:CASES.index((quant, group))]]:
                continue
            start = time.perf_counter()
            nll, n = cached_nll(model, docs, quant, g)
            elapsed = time.perf_counter() - start
            assert n == ref_n, (n, ref_n)
            prompt = [tok.encode("ROMEO:")]
            gen_start = time.perf_counter()
            generate(model, prompt, max_new_tokens=64, temperature=0, cache_quant=quant, group_size=g)
            tok_s = 64 / (time.perf_counter() - gen_start)
            bytes_layer = cache_bytes_per_token(cfg.model.kv_lora_rank, cfg.model.qk_rope_head_dim, 1, quant=quant,
                                                group_size=g, dtype=torch.bfloat16)
            label = "none (bf16 latent)" if quant == "none" else f"{quant}, group {g}"
            ppl, ref_ppl = math.exp(nll / n), math.exp(ref_nll / ref_n)
            rows.append(f"| {label} | {bytes_layer} | {nll / n:.5f} | {ppl:.3f} | {100 * (ppl / ref_ppl - 1):+.3f}% | "
                        f"{elapsed:.1f} s | {tok_s:.0f} |")
    mc = cfg.model
    lines = [
        f"# MLA latent cache: memory and quality ({datetime.date.today()})", "",
        f"CPU ({platform.machine()}, 1 thread), torch {torch.__version__}, python {platform.python_version()}. "
        f"Command: `python bench/kv_cache.py" + (f" --run-dir {args.run_dir}`" if args.run_dir else
                                                 f" --steps {args.steps}`") + ".", "",
        f"Model: {'the tiny recipe trained ' + str(args.steps) + ' steps on the bundled corpus' if not args.run_dir else ckpt.path} "
        f"(kv_lora_rank {mc.kv_lora_rank}, qk_rope_head_dim {mc.qk_rope_head_dim}, {mc.num_hidden_layers} layers; "
        f"{'trained in ' + format(trained_s, '.0f') + ' s; ' if not args.run_dir else ''}checkpoint step "
        f"{ckpt.step}). Held-out split: {ref_n} labelled tokens in {len(docs)} document pieces.", "",
        f"Full training forward (no cache), same documents: loss {ref_nll / ref_n:.5f}, "
        f"ppl {math.exp(ref_nll / ref_n):.3f}.", "",
        "## Quality through the cached decoding path (teacher forcing)", "",
        "Bytes per token per layer with a bf16 compute dtype (the RoPE key stays bf16; int8 / int4 latent codes plus "
        "one float32 scale per group). The quality runs compute in float32 on the CPU; 'none' stores the latent in "
        "the compute dtype. tok/s: greedy decoding of 64 tokens, one sequence, on this CPU (not a GPU measurement).",
        "",
        "| latent cache | bytes / token / layer | loss | ppl | ppl vs full forward | eval time | decode tok/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |", *rows, "",
        "## Memory per token (formula of `moela.inference.cache_bytes_per_token`)", "",
        "| model | cache | bytes / token / layer | all layers | smaller than expanded bf16 K/V | "
        "smaller than bf16 latent |", "| --- | --- | ---: | ---: | ---: | ---: |",
        *memory_rows(mc, "this model"),
        *memory_rows(ModelConfig(**PRESETS["small"]), "small preset"),
        *memory_rows(ModelConfig(**PRESETS["v3"]), "DeepSeek-V3"), "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
