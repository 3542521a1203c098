"""Benchmark one training micro-step (forward + backward) of the whole moela model against baselines, in one process.

Candidates, all on the same weights and tokens (documents of equal length L packed into T tokens, bf16 params):
  moela/auto       every op on backend "auto" (the fastest registered kernels)
  moela/reference  attention and experts on their pure-torch reference backends (what the model is tested with)
  hf/sdpa          transformers' DeepseekV3ForCausalLM loaded from our HF export, batch [T/L, L], SDPA attention
                   and its default experts implementation (MTP is absent there, so moela runs without MTP too)
Reported: median ms per micro-step over `--repeats` synchronized calls after two warm-up calls, tokens/s, model
TFLOP/s from `flops_per_token` (6N active + causal attention), peak memory of one micro-step, and the loss of each
candidate (printed side by side, to compare by eye: they should agree to bf16 noise).

Usage (one GPU): python bench/model.py [--size small] [--tokens 16384] [--doc-len 2048] [--out-dir DIR]
Writes bench/results/model.md and .json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.results_io import add_out_dir, write_results  # noqa: E402
from moela.batch import IGNORE_INDEX, PackedBatch  # noqa: E402
from moela.model import build_model, count_params, flops_per_token, preset  # noqa: E402
from moela.model.hf import export_hf  # noqa: E402

LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def packed_batch(vocab: int, tokens: int, doc_len: int, device: str) -> PackedBatch:
    n = tokens // doc_len
    ids = torch.randint(0, vocab, (n * doc_len,), device=device)
    labels = torch.cat((ids[1:], ids[:1]))
    labels.view(n, doc_len)[:, -1] = IGNORE_INDEX
    pos = torch.arange(doc_len, device=device, dtype=torch.int32).repeat(n)
    cu = torch.arange(0, n * doc_len + 1, doc_len, device=device, dtype=torch.int32)
    return PackedBatch(ids, labels, pos, cu, doc_len)


def measure(name: str, step, tokens: int, flops_tok: float, repeats: int) -> None:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times)[len(times) // 2]
    tflops = flops_tok * tokens / (ms * 1e-3) / 1e12
    say(f"| {name} | {ms:.1f} | {tokens / ms * 1e3:,.0f} | {tflops:.0f} | {peak:.1f} | {loss:.4f} |")
    MEASURED[name] = dict(ms=ms, tokens_per_s=tokens / ms * 1e3, tflops=tflops, peak_gib=peak, loss=loss)


MEASURED: dict[str, dict] = {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--doc-len", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=10, help="timed micro-steps per candidate (median reported)")
    add_out_dir(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/model.py needs a CUDA GPU (it times the micro-step with CUDA events)")
    torch.manual_seed(0)
    dev = "cuda"
    cfg = preset(args.size, num_nextn_predict_layers=0, aux_loss_coef=0.0)
    total, active = count_params(cfg)
    flops_tok = flops_per_token(cfg, args.doc_len)
    say(f"{total / 1e6:.0f}M params, {active / 1e6:.0f}M active; {flops_tok / 1e9:.2f} GFLOP/token (training)")
    say()
    say("| candidate | ms / micro-step | tokens/s | model TFLOP/s | peak GiB | loss |")
    say("| --- | --- | --- | --- | --- | --- |")
    model = build_model(cfg, dev, dtype=torch.bfloat16)
    batch = packed_batch(cfg.vocab_size, args.tokens, args.doc_len, dev)

    def moela_step():
        model.zero_grad(set_to_none=True)
        out = model(batch)
        out.loss.backward()
        return out.metrics["lm_loss"].item()

    for name, attn_b, moe_b in [("moela/auto", "auto", "auto"), ("moela/reference", "reference", "reference")]:
        for layer in model.layers:
            layer.attn.core_attention.keywords["backend"] = attn_b
            if hasattr(layer.ffn, "experts"):
                layer.ffn.experts.backend = moe_b
        try:
            measure(name, moela_step, args.tokens, flops_tok, args.repeats)
        except Exception:  # a baseline that fails is reported, not fatal
            say(f"| {name} | failed: {traceback.format_exc(limit=1).splitlines()[-1]} | | | | |")
    if not args.skip_hf:
        import transformers
        with tempfile.TemporaryDirectory() as tmp:
            export_hf(model, tmp)
            del model
            model = None
            torch.cuda.empty_cache()
            hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16,
                                                                    attn_implementation="sdpa").to(dev)
        ids = batch.input_ids.view(-1, args.doc_len)
        labels = batch.input_ids.view(-1, args.doc_len)

        def hf_step():
            hf.zero_grad(set_to_none=True)
            out = hf(input_ids=ids, labels=labels)
            out.loss.backward()
            return out.loss.item()
        try:
            measure("hf/sdpa", hf_step, args.tokens, flops_tok, args.repeats)
        except Exception:
            say(f"| hf/sdpa | failed: {traceback.format_exc(limit=1).splitlines()[-1]} | | | | |")
    say()
    for name, row in MEASURED.items():
        if name != "moela/auto" and "moela/auto" in MEASURED:
            say(f"moela/auto vs {name}: {row['ms'] / MEASURED['moela/auto']['ms']:.2f}x faster")
    write_results("model", f"moela model step: {args.size}, {args.tokens} tokens, documents of {args.doc_len}",
                  "\n".join(LINES), dict(size=args.size, tokens=args.tokens, doc_len=args.doc_len, rows=MEASURED),
                  out_dir=args.out_dir)


if __name__ == "__main__":
    main()
