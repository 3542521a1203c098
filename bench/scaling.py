"""Weak scaling over GPUs: FSDP2, FSDP2 + expert parallelism, HSDP, context and pipeline parallelism, tokens/s per
GPU, MFU, memory, busy share and each collective's share.

Each data-parallel rank trains on its own micro-batch of `train.tokens_per_microbatch` tokens (documents of
`--doc-len` tokens, random ids), so the work per GPU is fixed and tokens/s per GPU should stay flat as GPUs are
added (a layout with cp > 1 splits each micro-batch over its CP group: give it cp times the tokens to keep the
work per GPU). For every `--layout` (comma-separated overrides: `ep=2` is `parallel.ep=2`; a key with a dot is
taken as is, e.g. `cp=2,train.tokens_per_microbatch=131072` or `tp=2,model.block=fal`) the script builds the
recipe's model, applies `apply_parallelism`, runs warm-up steps, times `--steps` full optimizer steps (forward,
backward with the trainer's loss weighting, gradient clipping, AdamW, router-bias update) and profiles
`--profile-steps` more with torch.profiler to split the GPU time of NCCL kernels by collective. A layout with
`pp > 1` runs the trainer's pipeline (`moela.trainer.pipeline_step`) over `train.grad_accum` micro-batches a step;
its tokens per GPU are the step's tokens over the pipeline's GPUs. `--pipeline-set` adds the pipeline layouts of
the GPU count (`bench/scaling_report.PIPELINE_LAYOUTS`). Per row:
  layout        a name from the resolved sizes (`1gpu`, `fsdp2`, `hsdp2x2`, `+pp2`, `+ep2`, `+cp2`, `+tp2`) and any
                non-parallel overrides; the raw overrides are kept too
  tok/s/GPU     tokens_per_microbatch / (cp * tp) / median step time (the slowest rank's)
  vs 1 GPU      efficiency: ratio to the latest 1-GPU row of the same recipe, model size, tokens per GPU and
                document length (the weak-scaling target)
  MFU           flops_per_token(model, doc_len) * tok/s/GPU / 989 TFLOP/s (H200 dense bf16 datasheet peak)
  mem/GPU       max over ranks of torch.cuda.max_memory_allocated
  busy          share of the profiled steps' wall time in which a non-NCCL kernel runs on the GPU (union of
                kernel intervals; the rest is compute idle: waiting for the host or for a collective)
  a2a / AG / RS / AR   GPU time of all-to-all (NCCL SendRecv), all-gather, reduce-scatter and all-reduce
                kernels as a share of the profiled steps' wall time (kernels can overlap compute: an upper bound on
                exposed time; the profiler's own overhead is in the wall time)
  ep            the part of those that expert parallelism launched (kernels under `moela.ep.*` profiler ranges;
                AG + RS with the gather dispatch, a2a with the all-to-all one)
  loss@1, gnorm@1   the first step's loss (summed over the data ranks with the trainer's weighting) and gradient
                norm before clipping; a cp > 1 row is checked against the 1-GPU row with the same micro-batch
                (same data and weights): both must agree within bf16 noise (relative 2e-2; `CP check` lines)
With more than one GPU the run first measures the link: NCCL all-gather, reduce-scatter and all-to-all of
256 MiB over all ranks, bus bandwidth as nccl-tests defines it (algorithm bandwidth x (n-1)/n), written above the
table. Every run appends its rows (with its commit and command) to `--jsonl`; bench/results/scaling.md (the table)
and scaling.json (the current rows: layout, gpus, tokens_per_s_per_gpu, mfu, efficiency_vs_1gpu, and the other
columns; the latest row per layout, GPU count and shape; see bench/scaling_report.py) are rebuilt from all rows
(`--out-dir`), so run it once per GPU count (one process per GPU, NCCL; the 1-GPU run is the baseline of the "vs 1
GPU" column); `python bench/scaling.py --report-only` rebuilds them without measuring. bench/multi_gpu_runbook.sh runs
the whole set for 1, 2 and 4 GPUs and the multi-GPU recipe, e.g.:
  torchrun --standalone --nproc_per_node=1 bench/scaling.py --layout ep=1
  torchrun --standalone --nproc_per_node=2 bench/scaling.py --layout ep=1 --layout ep=2 --layout dp_replicate=2 \\
      --layout cp=2,train.tokens_per_microbatch=131072
Tensor parallelism: standard / FAL / FAL+ blocks at tp=2 and tp=4, and layer QK-Norm through its per-token
scalars or (layout item `qk=allgather`) the all-gather formulation, e.g. on 4 GPUs
  torchrun --standalone --nproc_per_node=4 bench/scaling.py --set model.qk_norm=layer \\
      --layout tp=2 --layout tp=2,model.block=fal --layout tp=2,model.block=fal_plus \\
      --layout tp=4 --layout tp=4,model.block=fal --layout tp=4,model.block=fal_plus \\
      --layout tp=4,model.block=fal,qk=allgather
Without CUDA it runs on CPU with gloo, fp32 parameters (a smoke test of the script: no memory or collective
numbers); keep its rows out of the results files:
  torchrun --standalone --nproc_per_node=2 bench/scaling.py --recipe recipes/tiny.yaml --layout ep=1 \\
      --layout ep=2 --set train.tokens_per_microbatch=256 --doc-len 64 --warmup 1 --steps 2 --profile-steps 1 \\
      --jsonl /tmp/scaling.jsonl --out-dir /tmp/scaling
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
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.results_io import add_out_dir, command_line, commit_state, write_results  # noqa: E402
from bench.scaling_report import PIPELINE_LAYOUTS, json_rows, render  # noqa: E402
from moela.batch import IGNORE_INDEX, PackedBatch  # noqa: E402
from moela.config import load_config  # noqa: E402
from moela.model import build_model, count_params, flops_per_token  # noqa: E402
from moela.parallel import apply_parallelism, build_mesh, clip_grad_norm_, reduce_expert_load  # noqa: E402
from moela.parallel.ep_comm import PROFILE_PREFIX  # noqa: E402
from moela.parallel.fsdp import transformer_blocks  # noqa: E402
from moela.parallel.tensor_parallel import GroupQKNorm  # noqa: E402
from moela.trainer.pipeline_step import PipelineStep  # noqa: E402
from moela.trainer.profiling import COLLECTIVES, collective_times, compute_busy_us  # noqa: E402

PEAK_TFLOPS = 989.0
SHARES = list(COLLECTIVES) + ["ep"]
QK_ALLGATHER = "qk=allgather"  # layout item: layer QK-Norm through the all-gather formulation instead of scalars


def synthetic_batch(vocab: int, tokens: int, doc_len: int, seed: int) -> PackedBatch:
    """Documents of doc_len random ids (the last one shorter), on the host."""
    g = torch.Generator().manual_seed(seed)
    lengths = [doc_len] * (tokens // doc_len) + ([tokens % doc_len] if tokens % doc_len else [])
    ids = torch.randint(0, vocab, (tokens,), generator=g)  # [T]
    labels = torch.cat((ids[1:], ids.new_full((1,), IGNORE_INDEX)))  # [T]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)  # [N+1]
    labels[(cu[1:] - 1).long()] = IGNORE_INDEX
    pos = torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths])  # [T]
    return PackedBatch(ids, labels, pos, cu, max(lengths))


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
    """`ep=2,train.tokens_per_microbatch=1024` -> ["parallel.ep=2", "train.tokens_per_microbatch=1024"] (the item
    `qk=allgather` is not an override: see `QK_ALLGATHER`)."""
    items = [item.strip() for item in text.split(",") if item.strip() and item.strip() != QK_ALLGATHER]
    return [item if "." in item.split("=")[0] else f"parallel.{item}" for item in items]


def layout_name(mesh, overrides: list[str]) -> str:
    """`1gpu`, `fsdp2`, `hsdp2x2` (replicas x shards), then `+ep2`, `+cp2`, `+tp2`, then the overrides outside
    `parallel` that change the model or the work (the micro-batch is a column of its own)."""
    s = mesh.sizes
    if s.world == 1:
        name = "1gpu"
    elif s.dp_replicate > 1:
        name = f"hsdp{s.dp_replicate}x{s.dp_shard * s.cp}"
    else:
        name = "fsdp2"
    name += "".join(f"+{dim}{getattr(s, dim)}" for dim in ("pp", "ep", "cp", "tp") if getattr(s, dim) > 1)
    extra = [o for o in overrides if not o.startswith(("parallel.pp=", "parallel.ep=", "parallel.cp=", "parallel.tp=",
                                                       "parallel.dp_replicate=", "parallel.dp_shard=",
                                                       "train.tokens_per_microbatch="))]
    return " ".join([name] + [o.removeprefix("parallel.") for o in extra])


def ep_collective_us(prof) -> float:
    """Device microseconds of the NCCL kernels launched inside expert parallelism's profiler ranges."""
    total = 0.0
    for event in prof.events():
        if event.name.startswith(PROFILE_PREFIX):
            total += event.device_time_total
    return total


def run_layout(args, layout: str, world: int, device) -> dict:
    overrides = list(args.set) + parse_layout(layout)  # a layout's own overrides win over --set
    cfg = load_config(args.recipe, overrides)
    mesh = build_mesh(cfg.parallel, world, device.type)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(cfg.train.seed)
    pipe = PipelineStep(cfg, mesh, device, mixed_precision=cuda) if cfg.parallel.pp > 1 else None
    micro = cfg.train.grad_accum if pipe is not None else 1  # a pipeline runs the step's micro-batches
    model = pipe.model if pipe is not None else apply_parallelism(build_model(cfg.model, device), mesh, cfg.parallel)
    if QK_ALLGATHER in layout.split(","):
        for block in transformer_blocks(model):
            block.attn.layer_qk_norm = GroupQKNorm(mesh.group("tp"), allgather=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=cuda)
    tokens = cfg.train.tokens_per_microbatch
    dp_rank, dp_size, dp_cp = mesh.rank("dp"), mesh.size("dp"), mesh.size("dp_cp")
    targets = synthetic_batch(cfg.model.vocab_size, tokens, args.doc_len, 0).num_targets()  # the same for every seed

    def step(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on micro-batch seed 1000 i + dp rank; (this rank's weighted loss, gradient norm)."""
        if pipe is not None:
            return pipeline_step(i)
        batch = synthetic_batch(cfg.model.vocab_size, tokens, args.doc_len, 1000 * i + dp_rank).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(batch)
        weight = out.num_targets / (dp_size * targets)  # the trainer's weighting (moela.trainer.loop)
        (out.loss * (weight * dp_cp)).backward()
        norm = clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if out.expert_load is not None:
            model.update_router_bias(reduce_expert_load(out.expert_load.float(), mesh))
        return out.loss.detach().float() * weight, norm.detach().float()

    def pipeline_step(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The same through the trainer's pipeline: `micro` micro-batches (seeds 1000 i + 100 j + dp rank)."""
        batches = [synthetic_batch(cfg.model.vocab_size, tokens, args.doc_len, 1000 * i + 100 * j + dp_rank)
                   for j in range(micro)]
        total = dp_size * targets * micro

        def autocast():
            return torch.autocast(device.type, dtype=torch.bfloat16)

        sums, load, _ = pipe.run(batches, dp_cp / total, autocast, lambda b: b.to(device))
        norm = clip_grad_norm_(model.parameters(), 1.0, across=mesh.group("pp"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if load is not None:
            model.update_router_bias(reduce_expert_load(load.float(), mesh))
        return (sums.sums[0] / total).float(), norm.detach().float()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first_loss, first_norm = step(0)
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
    comm["ep"] = ep_collective_us(prof)
    busy = compute_busy_us(prof) / 1e6 / profiled

    memory = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    loss1 = first_loss.reshape(1).clone()
    if mesh.group("dp_cp") is not None:
        dist.all_reduce(loss1, group=mesh.group("dp_cp"))
    stats = torch.tensor([memory, statistics.median(times)] + [comm[k] / 1e6 / profiled for k in SHARES] + [busy],
                         device=device)
    summed = stats.clone()
    dist.all_reduce(summed)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    median = float(stats[1])  # the slowest rank's median step
    # CP and TP ranks share one micro-batch, the stages of a pipeline its `micro` micro-batches
    tokens_gpu = tokens * micro // (mesh.size("cp") * mesh.size("tp") * mesh.size("pp"))
    tok_s = tokens_gpu / median
    total, active = count_params(cfg.model)
    name = layout_name(mesh, overrides) + (f" {QK_ALLGATHER}" if QK_ALLGATHER in layout.split(",") else "")
    row = dict(world=world, dp=dp_size, layout=layout or "default", name=name,
               recipe=args.recipe,
               size=cfg.model.size, params=total, active=active, microbatch=tokens, tokens_per_gpu=tokens_gpu,
               doc_len=args.doc_len, step_ms=median * 1e3, tok_s_gpu=tok_s,
               mfu=flops_per_token(cfg.model, args.doc_len) * tok_s / (PEAK_TFLOPS * 1e12),
               mem_gib=float(stats[0]), loss1=float(loss1[0]), gnorm1=float(first_norm),
               **{f"share_{k}": float(summed[2 + j]) / world for j, k in enumerate(SHARES)},
               busy=float(summed[-1]) / world, ep_dispatch=cfg.parallel.ep_dispatch, ep_chunks=cfg.parallel.ep_chunks,
               gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__, triton=triton.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               commit=commit_state()[0], command=command_line())
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/multi_gpu.yaml")
    parser.add_argument("--layout", action="append", default=None,
                        help="overrides, comma separated (repeatable); bare keys are parallel.*, e.g. "
                             "ep=2,activation_checkpointing=full or cp=2,train.tokens_per_microbatch=131072")
    parser.add_argument("--set", action="append", default=[],
                        help="recipe overrides for every layout (a layout's own overrides take precedence)")
    parser.add_argument("--doc-len", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--jsonl", default="bench/notes/scaling.jsonl")
    add_out_dir(parser)
    parser.add_argument("--report-only", action="store_true", help="rebuild the tables from --jsonl, measure nothing")
    parser.add_argument("--pipeline-set", action="store_true",
                        help="add the pipeline layouts of this GPU count (bench/scaling_report.PIPELINE_LAYOUTS)")
    args = parser.parse_args()
    if args.report_only:
        print(write_report(Path(args.jsonl), args.out_dir))
        return
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
    path = Path(args.jsonl)
    layouts = (args.layout or []) + (PIPELINE_LAYOUTS.get(world, []) if args.pipeline_set else [])
    for layout in layouts or [""]:
        row = run_layout(args, layout, world, device)
        row["link"] = link
        if dist.get_rank() == 0:  # appended at once: a run cut short by a time limit keeps its finished rows
            print(json.dumps(row), flush=True)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(json.dumps(row) + "\n")
    if dist.get_rank() == 0:
        print(write_report(path, args.out_dir), flush=True)
    dist.destroy_process_group()


def write_report(jsonl: Path, out_dir: str) -> str:
    """Rebuild scaling.md and scaling.json from every row of `jsonl`; the header's device and versions are the
    current rows' (each row keeps its own date, commit and command)."""
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    current = json_rows(rows)
    body = render(rows)
    ran = {key: ", ".join(sorted({str(r[key] or "-") for r in current})) for key in ("gpu", "torch", "triton")}
    write_results("scaling", "Weak scaling: FSDP2, expert, HSDP, context and pipeline parallelism", body, current,
                  out_dir=out_dir, device=ran["gpu"], torch=ran["torch"], triton=ran["triton"])
    return body


if __name__ == "__main__":
    main()
