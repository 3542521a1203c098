"""DualPipeV's overlapped pair on one device: two chunks of one model (the two stages of a V on one rank), one
chunk's forward interleaved block by block with the other chunk's backward on two CUDA streams
(`StreamPairOverlap`, no host sync), against the same pair run apart (forward, then backward, on one stream), with
the backward's graph whole (the plain runtime) and cut at block boundaries as the pair cuts it. Reported: the
pair's time each way and the ratios. One GPU has no expert all-to-all or FSDP collectives to hide, so this
measures the other half of the claim: that issuing the two chunks together does not slow their compute (target:
within ~5% of apart, or faster where one chunk's kernels fill SMs the other leaves idle), and what the cut costs.

    python bench/pp_overlap.py                  # GPU: the `small` preset, bf16 autocast
    python bench/pp_overlap.py --cpu            # smoke run: the tiny preset on the CPU (no streams: same path)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pp_overhead import packed  # noqa: E402
from bench.results_io import add_out_dir, write_results  # noqa: E402
from moela.model import build_model  # noqa: E402
from moela.model.config import preset  # noqa: E402
from moela.parallel.pp_comm import StageLinks  # noqa: E402
from moela.parallel.pp_layout import layout_string, stage_layout  # noqa: E402
from moela.parallel.pp_overlap import StreamPairOverlap  # noqa: E402
from moela.parallel.pp_runtime import PipelineRuntime  # noqa: E402
from moela.parallel.pp_schedules import Action, Overlap  # noqa: E402
from moela.parallel.pp_stage import chunks_of, keep_stages  # noqa: E402
from moela.trainer.step_metrics import StepSums  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="smoke run: tiny preset on the CPU")
    ap.add_argument("--size", default=None, help="model preset (default: small on GPU, tiny on CPU)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch (default 16384 GPU, 64 CPU)")
    ap.add_argument("--repeats", type=int, default=None, help="timed pairs per way (default 20 GPU, 2 CPU)")
    add_out_dir(ap)
    args = ap.parse_args()
    cpu = args.cpu or not torch.cuda.is_available()
    device = torch.device("cpu" if cpu else "cuda")
    cfg = preset(args.size or ("tiny" if cpu else "small"))
    tokens, repeats = args.tokens or (64 if cpu else 16384), args.repeats or (2 if cpu else 20)
    half = cfg.num_hidden_layers // 2  # the main layers split evenly, so that both chunks have blocks to pair
    layout = f"E{'t' * half}|{'t' * (cfg.num_hidden_layers - half)}{'m' * cfg.num_nextn_predict_layers}L"
    stages = stage_layout(cfg, 1, 2, layout)
    torch.manual_seed(0)
    model = build_model(cfg, device, parallelize=lambda m: keep_stages(m, stages, [0, 1]))
    chunks = chunks_of(model, stages, [0, 1])
    links = StageLinks([0, 0], [[0, 0]])
    f, b = Action("F", 0, 1), Action("B", 1, 0)
    pair = StreamPairOverlap(1, device)
    plain = PipelineRuntime(model, chunks, 2, [], links, device)
    cut = PipelineRuntime(model, chunks, 2, [Overlap(f, b)], links, device, overlap_f_b=pair)  # cuts b's forward
    batches = [packed(cfg.vocab_size, tokens, min(4096, tokens), seed=i, device=device) for i in range(2)]
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if not cpu
                else torch.autocast("cpu", enabled=False))

    def ready(runtime) -> None:
        """Micro-batch 0 through both chunks: chunk 1's backward of it and chunk 0's forward of micro-batch 1
        are then both ready, the state of a DualPipeV pair."""
        runtime.begin(batches, 1.0, StepSums(), lambda: autocast)  # each forward under autocast, as the trainer
        runtime.forward(Action("F", 0, 0))
        runtime.forward(Action("F", 1, 0))
        runtime.prepared(1)
        model.zero_grad(set_to_none=True)
        if not cpu:
            torch.cuda.synchronize()

    def apart(runtime) -> None:
        runtime.forward(f)
        runtime.backward(b)

    ways = {"apart": (plain, apart), "apart_cut": (cut, apart), "overlapped": (cut, lambda r: pair(r, f, b))}

    def timed(way: str) -> float:
        runtime, fn = ways[way]
        ready(runtime)
        start = time.perf_counter()
        fn(runtime)
        if not cpu:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    times = {way: [] for way in ways}
    for way in ways:  # warm-up
        timed(way)
    for _ in range(repeats):  # alternated, so that drift hits every way
        for way in ways:
            times[way].append(timed(way))
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["overlapped"] / med["apart"]
    body = "\n".join([
        f"Model preset `{cfg.size}` cut into two chunks `{layout_string(stages)}`, micro-batches of {tokens} tokens, "
        f"median of {repeats} alternated pairs (wall time to the device's end of the pair); "
        f"{'fp32, no streams (smoke run)' if cpu else 'bf16 autocast'}.", "",
        "| pair | ms | vs apart |", "|---|---|---|",
        f"| forward(chunk 0) then backward(chunk 1), one stream | {med['apart'] * 1e3:.2f} | 1.000 |",
        f"| the same, the backward's graph cut at block boundaries | {med['apart_cut'] * 1e3:.2f} | "
        f"{med['apart_cut'] / med['apart']:.3f} |",
        f"| interleaved block by block on two streams (`StreamPairOverlap`) | {med['overlapped'] * 1e3:.2f} | "
        f"{ratio:.3f} |"])
    path = write_results("pp_overlap", "DualPipeV overlapped pair on one device: two streams vs apart", body,
                         {"size": cfg.size, "tokens": tokens, "layout": layout_string(stages), "times_s": times,
                          "median_s": med, "ratio": ratio}, out_dir=args.out_dir)
    print(path.read_text())


if __name__ == "__main__":
    main()
