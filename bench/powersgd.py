"""PowerSGD on the replicate dimension: the compute it adds per step and the bytes it saves, at real model shapes.

For each model preset and PowerSGD rank: this rank's gradient shards under FSDP over `--shard` ranks (dim 0 split,
the largest shard; with expert parallelism over the same ranks the routed experts' shards have the same shape),
the bytes one rank hands to the replicate all-reduces per step (uncompressed vs compressed, `powersgd_bytes`), and
the time of `ReplicateReducer.reduce()` on one device in a one-rank process group: the all-reduces cost almost
nothing there, so the time is the compression and decompression (error feedback, P = M Q, orthogonalization,
Q = M^T P, P Q^T, copies) plus the flat-bucket copies. Side by side in the same process: the exact path (the
reducer's warmup step: bucketed all-reduce of every shard, the copies alone). The wire-time columns are arithmetic,
not measurements: a ring all-reduce over R replicas sends 2 (R - 1) / R times the bytes per rank (R = 2 here).

Usage: python bench/powersgd.py                  (CUDA: presets small and v2-lite, ranks 2, 4, 8, shard 8)
       python bench/powersgd.py --cpu            (smoke: tiny preset on the CPU, few iterations)
Writes bench/results/powersgd.md and .json (or into --out-dir).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.results_io import write_results  # noqa: E402
from moela.model.config import preset  # noqa: E402
from moela.model.transformer import Transformer  # noqa: E402
from moela.parallel.config import ParallelConfig  # noqa: E402
from moela.parallel.mesh import build_mesh  # noqa: E402
from moela.parallel.powersgd import powersgd_bytes  # noqa: E402
from moela.parallel.replicate import ReplicateReducer  # noqa: E402

LINKS_GBPS = (100, 200, 400)


def shard_shapes(size: str, shard: int) -> dict[str, tuple[int, ...]]:
    """Parameter name -> this rank's gradient shard shape under FSDP over `shard` ranks (the largest shard)."""
    with torch.device("meta"):
        model = Transformer(preset(size))
    return {name: (-(-p.shape[0] // shard),) + tuple(p.shape[1:]) for name, p in model.named_parameters()}


class Shards(nn.Module):
    """Parameters of the given shapes (with random gradients): what the reducer sees of a sharded model."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: torch.device):
        super().__init__()
        self.params = nn.ParameterList()
        for shape in shapes.values():
            p = nn.Parameter(torch.empty(shape, device=device))
            p.grad = torch.randn(shape, device=device)
            self.params.append(p)


def time_reduce(reducer: ReplicateReducer, device: torch.device, iters: int) -> float:
    """Median ms of `reducer.reduce()` over `iters` calls after two warm-up calls."""
    for _ in range(2):
        reducer.reduce()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            reducer.reduce()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            reducer.reduce()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def wire_ms(nbytes: int, gbps: float, replicas: int = 2) -> float:
    return 2 * (replicas - 1) / replicas * nbytes * 8 / (gbps * 1e9) * 1e3


def run(sizes: list[str], ranks: list[int], shard: int, device: torch.device, iters: int) -> list[dict]:
    mesh = build_mesh(ParallelConfig(), 1, device.type)
    rows = []
    for size in sizes:
        shapes = shard_shapes(size, shard)
        module = Shards(shapes, device)
        exact = ReplicateReducer(module, mesh, rank=1, warmup_steps=10 ** 9)
        exact_ms = time_reduce(exact, device, iters)
        uncompressed = 4 * sum(math.prod(s) for s in shapes.values())
        del exact
        for rank in ranks:
            reducer = ReplicateReducer(module, mesh, rank=rank, warmup_steps=0)
            compressed = powersgd_bytes(shapes.values(), rank)
            assert compressed == reducer.compressed_bytes
            row = {"preset": size, "shard": shard, "rank": rank, "params_per_rank": sum(math.prod(s) for s in
                                                                                         shapes.values()),
                   "bytes_uncompressed": uncompressed, "bytes_compressed": compressed,
                   "ratio": uncompressed / compressed, "exact_ms": exact_ms,
                   "powersgd_ms": time_reduce(reducer, device, iters)}
            for gbps in LINKS_GBPS:
                row[f"wire_ms_{gbps}"] = wire_ms(uncompressed, gbps)
                row[f"wire_ms_{gbps}_powersgd"] = wire_ms(compressed, gbps)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del reducer
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def render(rows: list[dict]) -> str:
    lines = ["Per rank, fp32 gradient shards under FSDP over `shard` ranks. ms: `ReplicateReducer.reduce()` on one "
             "device (one-rank group: compression and decompression plus copies; exact = the same reducer's "
             "uncompressed path). Wire ms: 2(R-1)/R x bytes at the link rate for R = 2 replicas, computed, not "
             "measured.", "",
             "| preset | shard | rank | MB/step exact | MB/step PowerSGD | ratio | exact ms | PowerSGD ms | "
             + " | ".join(f"wire ms {g} Gb/s exact / PowerSGD" for g in LINKS_GBPS) + " |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in LINKS_GBPS)
             + " |"]
    for r in rows:
        wires = " | ".join(f"{r[f'wire_ms_{g}']:.1f} / {r[f'wire_ms_{g}_powersgd']:.2f}" for g in LINKS_GBPS)
        lines.append(f"| {r['preset']} | {r['shard']} | {r['rank']} | {r['bytes_uncompressed'] / 1e6:.1f} | "
                     f"{r['bytes_compressed'] / 1e6:.2f} | {r['ratio']:.0f}x | {r['exact_ms']:.2f} | "
                     f"{r['powersgd_ms']:.2f} | {wires} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="smoke run: tiny preset on the CPU")
    parser.add_argument("--presets", nargs="+", default=None)
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--shard", type=int, default=8, help="FSDP shard group size (the GPUs of one node)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--out-dir", default=None, help="where powersgd.md and .json go (default bench/results)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    sizes = args.presets or (["tiny"] if args.cpu else ["small", "v2-lite"])
    iters = args.iters or (3 if args.cpu else 10)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("RANK", "0")
        dist.init_process_group("gloo" if args.cpu else "nccl", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)
        try:
            rows = run(sizes, args.ranks, args.shard, device, iters)
        finally:
            dist.destroy_process_group()
    write_results("powersgd", "PowerSGD on the replicate dimension: compute per step and bytes", render(rows), rows,
                  out_dir=args.out_dir)


if __name__ == "__main__":
    main()
