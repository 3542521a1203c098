"""Weak scaling of FSDP2 + expert parallelism: tokens/s per GPU, MFU, memory per GPU and communication share.

Each data-parallel rank trains on its own micro-batch of `train.tokens_per_microbatch` tokens (documents of
`--doc-len` tokens, random ids), so the work per GPU is fixed and tokens/s per GPU should stay flat as GPUs are
added (a layout with cp > 1 splits each micro-batch over its CP group: 1/cp of the tokens per GPU). For every
`--layout` (parallel-section overrides, e.g. `ep=2` or `ep=2,activation_checkpointing=full`) the script builds
the recipe's model, applies `apply_parallelism`, runs warm-up steps, times `--steps` full optimizer steps
(forward, backward, gradient clipping, AdamW, router-bias update) and profiles `--profile-steps` more with
torch.profiler to split the GPU time of NCCL kernels by collective. Reported per layout:
  tok/s/GPU     tokens_per_microbatch / cp / median step time
  vs 1 GPU      ratio to the latest 1-GPU `ep=1` row of the same recipe, model size, micro-batch and document
                length in the results file (the weak-scaling target)
  MFU           flops_per_token(model, doc_len) * tok/s/GPU / 989 TFLOP/s (H200 dense bf16 datasheet peak)
  mem/GPU       max over ranks of torch.cuda.max_memory_allocated
  busy          share of the profiled steps' wall time in which a non-NCCL kernel runs on the GPU (union of
                kernel intervals; the rest is compute idle: waiting for the host or for a collective)
  a2a / AG / RS / AR   GPU time of all-to-all (NCCL SendRecv), all-gather, reduce-scatter and all-reduce
                kernels as a share of the profiled steps' wall time (kernels can overlap compute: an upper bound on
                exposed time; the profiler's own overhead is in the wall time)
  loss@1        first step's loss (mean over ranks): equal across the cp=1 layouts of one GPU count (same
                weights and data; under CP the ranks hold parts of the same micro-batches)
With more than one GPU the run first measures the link: NCCL all-gather, reduce-scatter and all-to-all of
256 MiB over all ranks, bus bandwidth as nccl-tests defines it (algorithm bandwidth x (n-1)/n), written above the
table. Every run appends its rows to `--jsonl`; the markdown table `--out` is rebuilt from all rows, so run it once
per GPU count (one process per GPU, NCCL; the 1-GPU run is the baseline of the "vs 1 GPU" column):
  torchrun --standalone --nproc_per_node=1 bench/scaling.py --layout ep=1
  torchrun --standalone --nproc_per_node=2 bench/scaling.py --layout ep=1 --layout ep=2
  torchrun --standalone --nproc_per_node=4 bench/scaling.py --layout ep=1 --layout ep=2 --layout ep=4
Without CUDA it runs on CPU with gloo, fp32 parameters (a smoke test of the script: no memory or collective
numbers); keep its rows out of the results files:
  torchrun --standalone --nproc_per_node=2 bench/scaling.py --recipe recipes/tiny.yaml --layout ep=1 \\
      --layout ep=2 --set train.tokens_per_microbatch=256 --doc-len 64 --warmup 1 --steps 2 --profile-steps 1 \\
      --jsonl /tmp/scaling.jsonl --out /tmp/scaling.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moela.batch import IGNORE_INDEX, PackedBatch  # noqa: E402
from moela.config import load_config  # noqa: E402
from moela.model import build_model, count_params, flops_per_token  # noqa: E402
from moela.parallel import apply_parallelism, build_mesh, clip_grad_norm_, reduce_expert_load  # noqa: E402
from moela.trainer.profiling import COLLECTIVES, collective_times, compute_busy_us  # noqa: E402

PEAK_TFLOPS = 989.0


def synthetic_batch(vocab: int, tokens: int, doc_len: int, seed: int, device) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = [doc_len] * (tokens // doc_len) + ([tokens % doc_len] if tokens % doc_len else [])
    ids = torch.randint(0, vocab, (tokens,), generator=g)  # [T]
    labels = torch.cat((ids[1:], ids.new_full((1,), IGNORE_INDEX)))  # [T]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)  # [N+1]
    labels[(cu[1:] - 1).long()] = IGNORE_INDEX
    pos = torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths])  # [T]
    return PackedBatch(ids, labels, pos, cu, max(lengths)).to(device)


def link_bandwidth(world: int, device, nbytes: int = 256 << 20, iters: int = 5) -> dict:
    """NCCL bus bandwidth in GB/s of all-gather, reduce-scatter and all-to-all moving `nbytes` (bf16) over all
    ranks: {"AG": .., "RS": .., "a2a": ..}; {} on one rank or without CUDA."""
    if world == 1 or device.type != "cuda":
        return {}
    n = nbytes // 2 // world * world
    full = torch.randn(n, device=device, dtype=torch.bfloat16)  # [n]
    part = torch.empty(n // world, device=device, dtype=torch.bfloat16)  # [n / world]
    other = torch.empty_like(full)
    ops = {"AG": lambda: dist.all_gather_into_tensor(full, part), "RS": lambda: dist.reduce_scatter_tensor(part, full),
           "a2a": lambda: dist.all_to_all_single(other, full)}
    out = {}
    for name, op in ops.items():
        op()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            op()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / iters
        out[name] = n * 2 / seconds * (world - 1) / world / 1e9
    return out


def parse_layout(text: str) -> list[str]:
    return [f"parallel.{item.strip()}" for item in text.split(",") if item.strip()]


def run_layout(args, layout: str, world: int, device) -> dict:
    cfg = load_config(args.recipe, parse_layout(layout) + list(args.set))
    mesh = build_mesh(cfg.parallel, world, device.type)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(cfg.train.seed)
    model = apply_parallelism(build_model(cfg.model, device), mesh, cfg.parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    tokens = cfg.train.tokens_per_microbatch
    dp_rank = mesh.rank("dp")

    def step(i: int) -> float:
        batch = synthetic_batch(cfg.model.vocab_size, tokens, args.doc_len, 1000 * i + dp_rank, device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(batch)
        out.loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if out.expert_load is not None:
            model.update_router_bias(reduce_expert_load(out.expert_load.float(), mesh))
        return out.loss.detach().float()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first_loss = step(0)
    for i in range(1, args.warmup):
        step(i)
    times = []
    for i in range(args.steps):
        sync()
        t0 = time.perf_counter()
        step(args.warmup + i)
        sync()
        times.append(time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile

    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for i in range(args.profile_steps):
            step(args.warmup + args.steps + i)
        sync()
        profiled = time.perf_counter() - t0
    comm = collective_times(prof)
    busy = compute_busy_us(prof) / 1e6 / profiled

    memory = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    stats = torch.tensor([float(first_loss), memory, statistics.median(times)]
                         + [comm[k] / 1e6 / profiled for k in COLLECTIVES] + [busy], device=device)
    summed = stats.clone()
    dist.all_reduce(summed)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    median = float(stats[2])  # the slowest rank's median step
    tokens_gpu = tokens // mesh.size("cp")  # the ranks of a CP group share one micro-batch
    tok_s = tokens_gpu / median
    total, active = count_params(cfg.model)
    row = dict(world=world, layout=layout or "default", recipe=args.recipe, size=cfg.model.size,
               params=total, active=active, microbatch=tokens, tokens_per_gpu=tokens_gpu, doc_len=args.doc_len,
               step_ms=median * 1e3, tok_s_gpu=tok_s,
               mfu=flops_per_token(cfg.model, args.doc_len) * tok_s / (PEAK_TFLOPS * 1e12),
               mem_gib=float(stats[1]), loss1=float(summed[0]) / world,
               **{f"share_{k}": float(summed[3 + j]) / world for j, k in enumerate(COLLECTIVES)},
               busy=float(summed[-1]) / world,
               gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return row


def render(rows: list[dict]) -> str:
    import triton

    def key(r):  # the 1-GPU baseline of a row: same recipe, model size, micro-batch and document length
        return r["recipe"], r["size"], r.get("microbatch", r["tokens_per_gpu"]), r["doc_len"]

    base = {key(r): r["tok_s_gpu"] for r in rows if r["world"] == 1 and r["layout"] in ("ep=1", "default")}
    last = rows[-1]
    lines = [
        "# Weak scaling: FSDP2 + expert parallelism",
        "",
        f"{last['date']}; {last['gpu']}; torch {last['torch']}; triton {triton.__version__}.",
        f"Latest row: model `{last['size']}` ({last['params'] / 1e6:.0f}M params, {last['active'] / 1e6:.0f}M active "
        f"per token), one micro-batch per GPU per step (tokens: the micro-batch column) in documents of "
        f"{last['doc_len']}; "
        "bf16 autocast, "
        + ("FSDP2 fp32 params (CPU smoke run)" if last["gpu"] == "cpu"
           else "FSDP2 bf16 params / fp32 reduce (unless the layout sets reduce_dtype)")
        + "; fused AdamW. Command lines and column meanings: `bench/scaling.py`.",
        "",
    ]
    links = {r["world"]: r for r in rows if r.get("link")}
    for world, r in sorted(links.items()):
        bw = ", ".join(f"{k} {v:,.0f} GB/s" for k, v in r["link"].items())
        lines.append(f"Link, {world} GPUs (NCCL bus bandwidth at 256 MiB, {r['date']}): {bw}.")
    if links:
        lines.append("")
    lines += ["| GPUs | layout | micro-batch | step ms | tok/s/GPU | vs 1 GPU | MFU | mem/GPU GiB | busy | a2a | AG "
              "| RS | AR | loss@1 |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = f"{r['tok_s_gpu'] / base[key(r)]:.3f}" if key(r) in base else "-"
        shares = " | ".join(f"{100 * r[f'share_{k}']:.1f}%" for k in COLLECTIVES)
        busy = f"{100 * r['busy']:.1f}%" if "busy" in r else "-"
        micro = r.get("microbatch", r["tokens_per_gpu"])
        lines.append(f"| {r['world']} | {r['layout']} | {micro} | {r['step_ms']:.1f} | {r['tok_s_gpu']:,.0f} | "
                     f"{ratio} | {100 * r['mfu']:.1f}% | {r['mem_gib']:.1f} | {busy} | {shares} | {r['loss1']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/multi_gpu.yaml")
    parser.add_argument("--layout", action="append", default=None,
                        help="parallel overrides, comma separated (repeatable), e.g. "
                             "ep=2,activation_checkpointing=full")
    parser.add_argument("--set", action="append", default=[], help="other recipe overrides, e.g. model.size=small")
    parser.add_argument("--doc-len", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--jsonl", default="bench/results/scaling.jsonl")
    parser.add_argument("--out", default="bench/results/scaling.md")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        sys.exit("bench/scaling.py runs under torchrun, e.g. "
                 "torchrun --standalone --nproc_per_node=2 bench/scaling.py --layout ep=2")
    local = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    link = link_bandwidth(world, device)
    if link and dist.get_rank() == 0:
        print("link (NCCL bus bandwidth, GB/s):", json.dumps(link), flush=True)
    rows = []
    for layout in args.layout or [""]:
        row = run_layout(args, layout, world, device)
        row["link"] = link
        rows.append(row)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    if dist.get_rank() == 0:
        path = Path(args.jsonl)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        all_rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        Path(args.out).write_text(render(all_rows))
        print(render(all_rows), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
