"""Layer-wise QK-Norm alone (`moela.ops.qk_norm`): the fused Triton op against the torch formulations, forward and
forward + backward, bf16 q and k, float32 weights.

One GPU (`python bench/qk_norm.py`), per shape (T tokens, N = heads x Dqk columns of q and of k):
  triton     qk_rms_norm(backend="triton"): statistics, then normalization, q and k in one launch per pass
  compiled   two RMSNorms through TorchInductor (what the model ran before: `rms_norm`'s CUDA backend)
  eager      the pure-torch reference
  ms (CUDA events, median of --iters), GB/s against the least traffic an implementation could have (forward:
  read q, k and write them once; backward: read the gradients and q, k, write dq, dk: 2 and 3 bf16 tensors of
  T x 2N), and the ratio of each time to triton's.
Several GPUs (`torchrun --nproc_per_node=P bench/qk_norm.py`): each rank holds N / P columns (its heads); rows
  scalar     the op with the group: [T, 2] float32 statistics all-reduced, 8 bytes a token each way
  allgather  the standard formulation: q and k all-gathered over the heads, their gradients reduce-scattered
  ms forward + backward, and bytes each rank hands to collectives per step (`moela.parallel.comm.CommCounter`).
Prints the table and writes bench/results/qk_norm.md and .json (`--out-dir`; a run on several GPUs replaces the
one-GPU table, so give it another folder to keep both).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.results_io import add_out_dir, write_results  # noqa: E402
from moela.ops.norm import rms_norm  # noqa: E402
from moela.ops.qk_norm import qk_rms_norm, qk_rms_norm_allgather  # noqa: E402
from moela.parallel.comm import CommCounter  # noqa: E402

# (label, tokens, columns of q and of k): small (16 heads x 96), V2-Lite (16 x 192), V3 (128 x 192) at tp=1 and 8
SHAPES = [("small 16k", 16384, 1536), ("small 64k", 65536, 1536), ("v2-lite 64k", 65536, 3072),
          ("v3 16k", 16384, 24576), ("v3/tp8 64k", 65536, 3072)]
EPS = 1e-6


def timed(fn, iters: int) -> float:
    """Median milliseconds of fn() over `iters` runs (after 3 warm-up runs)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def two_norms(backend: str):
    def run(q, k, wq, wk, eps, group=None):
        return rms_norm(q, wq, eps, backend=backend), rms_norm(k, wk, eps, backend=backend)
    return run


def inputs(t: int, n: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k = (torch.randn(t, n, device=device, generator=g, dtype=torch.bfloat16) for _ in range(2))
    wq, wk = (torch.rand(n, device=device, generator=g) + 0.5 for _ in range(2))
    gq, gk = (torch.randn(t, n, device=device, generator=g, dtype=torch.bfloat16) for _ in range(2))
    return q, k, wq, wk, gq, gk


def fwd_bwd(fn, q, k, wq, wk, gq, gk, **kw):
    q, k, wq, wk = (x.detach().requires_grad_() for x in (q, k, wq, wk))
    yq, yk = fn(q, k, wq, wk, EPS, **kw)
    torch.autograd.backward((yq, yk), (gq, gk))


def one_gpu(args) -> tuple[str, list[dict]]:
    impls = {"triton": lambda *a, **kw: qk_rms_norm(*a, backend="triton", **kw), "compiled": two_norms("compiled"),
             "eager": two_norms("reference")}
    lines = ["| shape | T | N | impl | fwd ms | fwd GB/s | fwd+bwd ms | fwd+bwd GB/s | vs triton (fwd+bwd) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    out = []
    for label, t, n in SHAPES:
        data = inputs(t, n, "cuda")
        q, k, wq, wk = data[:4]
        tensor_bytes = t * 2 * n * 2  # q and k in bf16
        rows = {}
        for name, fn in impls.items():
            with torch.no_grad():
                fwd = timed(lambda fn=fn: fn(q, k, wq, wk, EPS), args.iters)
            both = timed(lambda fn=fn: fwd_bwd(fn, *data), args.iters)
            rows[name] = (fwd, both)
        for name, (fwd, both) in rows.items():
            out.append(dict(shape=label, tokens=t, columns=n, impl=name, fwd_ms=fwd, fwd_bwd_ms=both))
            lines.append(f"| {label} | {t} | {n} | {name} | {fwd:.3f} | {2 * tensor_bytes / fwd / 1e6:,.0f} | "
                         f"{both:.3f} | {5 * tensor_bytes / both / 1e6:,.0f} | {both / rows['triton'][1]:.2f}x |")
    return "\n".join(lines), out


def several_gpus(args) -> tuple[str, list[dict]]:
    world, group = dist.get_world_size(), dist.group.WORLD
    impls = {"scalar": lambda *a: qk_rms_norm(*a, group=group, backend="triton"),
             "allgather": lambda *a: qk_rms_norm_allgather(*a, group)}
    lines = ["| shape | T | N (all ranks) | impl | fwd+bwd ms | bytes / rank / step | bytes / token |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    out = []
    for label, t, n in SHAPES:
        if n % world:
            continue
        data = inputs(t, n // world, "cuda", seed=dist.get_rank())
        for name, fn in impls.items():
            ms = torch.tensor(timed(lambda fn=fn: fwd_bwd(fn, *data), args.iters), device="cuda")
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            with CommCounter() as comm:
                fwd_bwd(fn, *data)
            sent = sum(comm.bytes().values())
            lines.append(f"| {label} | {t} | {n} | {name} | {ms.item():.3f} | {sent:,} | {sent / t:.1f} |")
            out.append(dict(shape=label, tokens=t, columns=n, impl=name, fwd_bwd_ms=ms.item(), bytes_per_rank=sent))
    return "\n".join(lines), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    add_out_dir(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/qk_norm.py needs a CUDA device (the kernels' CPU check is tests/test_qk_norm.py)")
    distributed = "LOCAL_RANK" in os.environ
    if distributed:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    table, rows = several_gpus(args) if distributed else one_gpu(args)
    if not distributed or dist.get_rank() == 0:
        world = dist.get_world_size() if distributed else 1
        write_results("qk_norm", f"Layer QK-Norm on {world} GPU(s)", f"Columns: `bench/qk_norm.py`.\n\n{table}",
                      dict(gpus=world, rows=rows), out_dir=args.out_dir,
                      device=f"{world} x {torch.cuda.get_device_name()}")
        print(table)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
