"""One decoding step's attention over one layer of the MLA latent cache: the fused kernel, which reads the int8 /
int4 codes and dequantizes them in registers, against the torch path (dequantize the visible slots into bf16, then
the einsums and a float32 softmax), for the bf16, int8 and int4 caches, in one process on the same inputs.

    python bench/kv_decode.py                                  # GPU: bench/results/kv_decode.md and .json
    TRITON_INTERPRET=1 python bench/kv_decode.py --device cpu  # smoke run on tiny shapes (checks, no timing claim;
                                                               # printed, written only with --out-dir)

Shapes: DeepSeek's latent (kv_lora_rank 512, RoPE key 64, int groups of 64), 16 heads (V2-Lite) and 128 (V3),
batch 1 / 8 / 64, every sequence at the end of a 4k or 32k cache (one new token each). Columns: microseconds per
step and layer; GB/s against the bytes the cache holds for the visible slots (codes + scales + RoPE key: what a
step must read at least); the speed-up over the torch path on the same cache and over the bf16 cache's torch path;
the transient memory of the call (peak allocated minus what was allocated before: the dequantized latent and the
score tensor on the torch path, the split partials on the fused one). Every fused result is checked against the
torch path on the same cache (bf16 tolerance) before it is timed.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.results_io import RESULTS, add_out_dir, write_results  # noqa: E402
from moela.inference.cache import cache_bytes_per_token  # noqa: E402
from moela.inference.latent_attention import CachedLayer, latent_attention  # noqa: E402
from moela.inference.quant import quantize  # noqa: E402

GPU_SHAPES = [(heads, batch, slots) for heads in (16, 128) for batch in (1, 8, 64) for slots in (4096, 32768)]
CPU_SHAPES = [(5, 2, 97)]
CACHES = [("none", None), ("int8", 8), ("int4", 4)]  # the cache's quant; "none" holds the compute dtype
GROUP = 64


def make_inputs(heads: int, batch: int, slots: int, c: int, r: int, dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    latent = torch.randn(batch, slots, c, device=device, dtype=dtype, generator=g)  # [B, L, C]
    rope = torch.randn(batch, slots, r, device=device, dtype=dtype, generator=g)  # [B, L, R]
    q_lat = torch.randn(batch, 1, heads, c, device=device, dtype=dtype, generator=g) / c ** 0.25  # [B, 1, H, C]
    q_pe = torch.randn(batch, 1, heads, r, device=device, dtype=dtype, generator=g) / r ** 0.25  # [B, 1, H, R]
    positions = torch.full((batch, 1), slots - 1, device=device, dtype=torch.long)  # [B, 1]
    layers = {}
    for name, bits in CACHES:
        if bits is None:
            layers[name] = CachedLayer(latent, rope)
        else:
            codes, scales = quantize(latent, bits, GROUP)
            layers[name] = CachedLayer(codes, rope, bits, scales, GROUP)
    return q_lat, q_pe, positions, layers


def measure(fn, device: str, iters: int) -> tuple[float, float]:
    """(microseconds per call, transient MiB) after a warm-up call."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        transient = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / iters, transient
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e6 / iters, float("nan")


def run_shape(heads: int, batch: int, slots: int, c: int, r: int, dtype: torch.dtype, device: str,
              iters: int) -> list[dict]:
    q_lat, q_pe, positions, layers = make_inputs(heads, batch, slots, c, r, dtype, device, seed=heads + batch + slots)
    scale = 1 / math.sqrt(192)
    rows, base = [], None
    for name, _ in CACHES:
        layer = layers[name]
        quant, label = name, str(dtype).removeprefix("torch.") if name == "none" else name
        held = cache_bytes_per_token(c, r, 1, quant=quant, group_size=GROUP, dtype=dtype) * batch * slots

        def call(backend, layer=layer):
            return latent_attention(q_lat, q_pe, layer, positions, softmax_scale=scale, num_slots=slots,
                                    backend=backend)

        ref, fused = call("reference"), call("triton")
        err = (fused.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
        if not err <= 2e-2:
            raise SystemExit(f"{label} cache, {heads} heads, batch {batch}, {slots} slots: the fused kernel is off "
                             f"the torch path by {err:.3g} of its scale")
        for backend, path in (("reference", "torch"), ("triton", "fused")):
            us, transient = measure(lambda backend=backend: call(backend), device, iters)
            rows.append(dict(heads=heads, batch=batch, slots=slots, cache=label, path=path, us=us,
                             gbps=held / us / 1e3, transient_mib=transient, held_mib=held / 2 ** 20, err=err))
        torch_us = rows[-2]["us"]
        base = rows[0]["us"] if base is None else base
        for row in rows[-2:]:
            row["vs_torch"] = torch_us / row["us"]
            row["vs_bf16_torch"] = base / row["us"]
    return rows


def table(rows: list[dict]) -> str:
    head = ("| heads | batch | slots | cache | path | us / step | GB/s (held) | x torch, same cache | x bf16 torch "
            "| transient MiB | cache MiB | rel. err vs torch |\n|" + "---|" * 12)
    lines = [head]
    for x in rows:
        lines.append(f"| {x['heads']} | {x['batch']} | {x['slots']} | {x['cache']} | {x['path']} | {x['us']:.1f} | "
                     f"{x['gbps']:.0f} | {x['vs_torch']:.2f} | {x['vs_bf16_torch']:.2f} | "
                     f"{x['transient_mib']:.1f} | {x['held_mib']:.1f} | {x['err']:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--iters", type=int, default=20)
    add_out_dir(parser, default=None)
    args = parser.parse_args(argv)
    out_dir = args.out_dir or (RESULTS if args.device == "cuda" else None)  # a smoke run's times mean nothing
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kv_decode: no CUDA device; run the smoke mode with TRITON_INTERPRET=1 ... --device cpu")
    if args.device == "cuda":
        shapes, c, r, dtype, iters = GPU_SHAPES, 512, 64, torch.bfloat16, args.iters
    else:
        shapes, c, r, dtype, iters = CPU_SHAPES, 64, 16, torch.float32, 1
    rows = [row for shape in shapes for row in run_shape(*shape, c, r, dtype, args.device, iters)]
    smoke = "" if args.device == "cuda" else " Triton interpreter smoke run on the CPU: the times mean nothing."
    text = (f"kv_lora_rank {c}, RoPE key {r}, groups of {GROUP}, {str(dtype).removeprefix('torch.')} queries; one "
            f"layer, one new token per sequence, every sequence at the end of the cache.{smoke}\n\n{table(rows)}\n")
    print(text)
    if out_dir is not None:
        device = None if args.device == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
        write_results("kv_decode", "Decoding attention over the latent cache", text, rows, out_dir=out_dir,
                      device=device)


if __name__ == "__main__":
    main()
