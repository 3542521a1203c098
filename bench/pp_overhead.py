"""The pipeline code path's overhead: one process (pp=1) trains the same micro-batches through the pipeline
runtime (`moela.parallel.pipeline`, one stage, 1f1b: prepare, stage forward, weighted backward, local hand-offs)
and through the plain step (`model(batch)`, weighted backward), side by side on the same model weights; tokens/s
of each and their ratio (the target: within 2%).

    python bench/pp_overhead.py                 # GPU: the `small` preset, bf16 autocast
    python bench/pp_overhead.py --cpu           # smoke run: the tiny preset on the CPU (fp32)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results_io import add_out_dir, write_results  # noqa: E402
from moela.batch import IGNORE_INDEX, PackedBatch  # noqa: E402
from moela.model import build_model  # noqa: E402
from moela.model.config import preset  # noqa: E402
from moela.parallel import build_mesh  # noqa: E402
from moela.parallel.config import ParallelConfig  # noqa: E402
from moela.parallel.pipeline import build_pipeline  # noqa: E402
from moela.trainer.step_metrics import StepSums  # noqa: E402


def packed(vocab: int, tokens: int, doc_len: int, seed: int, device) -> PackedBatch:
    """`tokens` tokens of documents of random lengths up to `doc_len`."""
    g = torch.Generator().manual_seed(seed)
    lens, left = [], tokens
    while left:
        n = min(left, int(torch.randint(doc_len // 4, doc_len + 1, (1,), generator=g)))
        lens.append(n)
        left -= n
    ids = torch.randint(0, vocab, (tokens,), generator=g)  # [T]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)  # [N+1]
    labels = torch.cat((ids[1:], ids[:1]))  # [T]
    labels[(cu[1:] - 1).long()] = IGNORE_INDEX
    pos = torch.cat([torch.arange(n) for n in lens]).int()  # [T]
    return PackedBatch(ids, labels, pos, cu, max(lens)).to(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="smoke run: tiny preset on the CPU")
    ap.add_argument("--size", default=None, help="model preset (default: small on GPU, tiny on CPU)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch (default 16384 GPU, 64 CPU)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per path and round (default 10 GPU, 1 CPU)")
    ap.add_argument("--rounds", type=int, default=3)
    add_out_dir(ap)
    args = ap.parse_args()
    cpu = args.cpu or not torch.cuda.is_available()
    device = torch.device("cpu" if cpu else "cuda")
    cfg = preset(args.size or ("tiny" if cpu else "small"))
    tokens, steps = args.tokens or (64 if cpu else 16384), args.steps or (1 if cpu else 10)
    m = args.microbatches
    torch.manual_seed(0)
    plain = build_model(cfg, device)
    pcfg = ParallelConfig(pp=1)
    torch.manual_seed(0)
    pipe = build_pipeline(cfg, pcfg, build_mesh(pcfg, 1, device.type), device, m)
    pipe.model.load_state_dict(plain.state_dict())
    batches = [packed(cfg.vocab_size, tokens, min(4096, tokens), seed=i, device=device) for i in range(m)]
    total = sum(b.num_targets() for b in batches)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if not cpu
                else torch.autocast("cpu", enabled=False))

    def plain_step():
        for b in batches:
            with autocast:
                out = plain(b)
            (out.loss * (out.num_targets / total)).backward()
        plain.zero_grad(set_to_none=True)

    def pipe_step():
        pipe.runtime.train_step(batches, 1.0 / total, StepSums(), lambda: autocast)
        pipe.model.zero_grad(set_to_none=True)

    def timed(fn) -> float:
        fn()  # warm-up (kernel selection, allocator)
        if not cpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        if not cpu:
            torch.cuda.synchronize()
        return steps * m * tokens / (time.perf_counter() - start)

    rates = {"plain": [], "pipeline": []}
    for _ in range(args.rounds):  # alternated, so that drift hits both
        rates["plain"].append(timed(plain_step))
        rates["pipeline"].append(timed(pipe_step))
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med["pipeline"] / med["plain"]
    body = "\n".join([
        f"Model preset `{cfg.size}`, {m} micro-batches of {tokens} tokens a step, {steps} steps per path and round, "
        f"median of {args.rounds} alternated rounds; {'fp32' if cpu else 'bf16 autocast'}.", "",
        "| path | tokens/s | vs plain |", "|---|---|---|",
        f"| plain step (`model(batch)`) | {med['plain']:,.0f} | 1.000 |",
        f"| pipeline runtime, pp=1 | {med['pipeline']:,.0f} | {ratio:.3f} |"])
    path = write_results("pp_overhead", "Pipeline code path overhead at pp=1: tokens/s vs the plain step", body,
                         {"size": cfg.size, "tokens": tokens, "microbatches": m, "steps": steps, "rates": rates,
                          "median": med, "ratio": ratio}, out_dir=args.out_dir)
    print(path.read_text())


if __name__ == "__main__":
    main()
