"""FP8 GEMM benchmark on one GPU: the persistent grouped FP8 GEMMs and the FP8 linear vs bf16, same inputs, one
process. Writes bench/results/fp8.json (rows: case, impl, tflops, ratio_vs_bf16, ms, rel_err) and fp8.md.

Grouped (8 experts, balanced routing; the V3 expert shapes D 7168, F 2048 and the V2-Lite ones D 2048, F 1408) at
4096, 1024 and 256 rows per expert: fwd (A [M, D] @ W13_e^T), dgrad (dH [M, 2F] @ W13_e), wgrad (dH^T X per
expert) of ours vs bf16 torch._grouped_mm on the same shapes: the Triton kernels ("fp8 triton <config>") and, on
Hopper, the warp-specialized Gluon kernels ("fp8 gluon <config>"), every named config with --sweep, else the
defaults (for Gluon also the default's twin whose consumer warpgroups take turns, and the default fed its
activation scales token-block-major); the cuBLAS per-expert provider (host bounds) as a reference row.
Each FP8 row's relative error is measured against the bf16 result. Dense: fp8_linear forward+backward vs the bf16
linear at the small model's and V2-Lite's dense shapes (64k tokens), with the GEMMs of either implementation; section
`small_linears`: the small model's other FP8 linears (weight gradients of few output tiles).

  python bench/fp8.py [--quick] [--sweep] [--budget-s 170] [--sections grouped,dense,small_linears]
--quick: the V3 shapes at 4096 and 256 rows per expert, the default configs, one dense shape (under a minute); the
full run with --sweep fits ~4 minutes on one H200.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.attention_kernels import kernel_times  # noqa: E402
from moela.ops.fp8_linear import fp8_linear  # noqa: E402
from moela.ops.moe import gemm_fp8, gemm_fp8_gluon, gemm_fp8_gluon_kgrouped  # noqa: E402
from moela.ops.moe.gemm_library import cublas_blockwise_available, cublas_kgrouped, cublas_mgrouped  # noqa: E402
from moela.ops.moe.quantize import quant_rows_cols, quant_weights  # noqa: E402

ROWS: list[dict] = []


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def add(case, impl, ms, flops, bf16_ms=None, err=None, kernel_ms=None):
    r = dict(case=case, impl=impl, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
             ratio_vs_bf16=round(bf16_ms / ms, 3) if bf16_ms else 1.0, rel_err=err,
             kernel_ms=None if kernel_ms is None else round(kernel_ms, 4))
    ROWS.append(r)
    print(f"{case:34s} {impl:32s} {ms:8.3f} ms {r['tflops']:7.1f} TFLOP/s  x{r['ratio_vs_bf16']:.2f}"
          + (f"  err {err:.2e}" if err is not None else "")
          + (f"  kernels {kernel_ms:.3f} ms" if kernel_ms is not None else ""), flush=True)


def kernel_ms(fn, iters: int = 10) -> float:
    """Device time of fn's kernels per call (the profiler's sum): what a captured step pays, where do_bench's
    time between events also holds the host's launch gaps (an eager call of the FP8 linear is host-bound)."""
    return sum(kernel_times(fn, iters).values()) / 1000


EXPERT_SHAPES = {"V3": (7168, 2048), "v2-lite": (2048, 1408)}  # (D, F)


def grouped(per: int, sweep: bool, shape: str = "V3", e: int = 8):
    d, f = EXPERT_SHAPES[shape]
    m, n, k = e * per, 2 * f, d
    dev = "cuda"
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    offsets = torch.arange(0, m + 1, per, device=dev, dtype=torch.int64)
    m_idx = torch.arange(e, device=dev, dtype=torch.int32).repeat_interleave(per)
    offs32 = offsets[1:].to(torch.int32)
    bounds = list(zip(range(0, m, per), range(per, m + 1, per)))
    (xq, xs), (xqt, xst) = quant_rows_cols(x)
    wq, ws, wqt = quant_weights(w)
    flops = 2 * m * n * k
    h = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs32)  # [M, N]
    (hq, hs), (hqt, hst) = quant_rows_cols(h)
    gluon = gemm_fp8_gluon.available(x.device)

    def impls(triton_configs, triton_default, gluon_configs, gluon_defaults, run):
        """(row label, call) of each implementation and config to time."""
        rows = [(f"fp8 triton {c}", lambda c=c: run(c, "triton")) for c in (triton_configs if sweep else
                                                                             [triton_default])]
        if gluon:
            rows += [(f"fp8 gluon {c}", lambda c=c: run(c, "gluon")) for c in (gluon_configs if sweep else
                                                                               gluon_defaults)]
        return rows

    # without --sweep: the Gluon default and its twin whose warpgroups take turns (ping-pong), side by side
    mgrouped = (gemm_fp8.MGROUPED_CONFIGS, gemm_fp8.DEFAULT_MGROUPED, gemm_fp8_gluon.MGROUPED_CONFIGS,
                [gemm_fp8_gluon.DEFAULT_MGROUPED, gemm_fp8_gluon.PINGPONG_MGROUPED])
    kgrouped = (gemm_fp8.KGROUPED_CONFIGS, gemm_fp8.DEFAULT_KGROUPED, gemm_fp8_gluon_kgrouped.KGROUPED_CONFIGS,
                [gemm_fp8_gluon_kgrouped.DEFAULT_KGROUPED, gemm_fp8_gluon_kgrouped.PINGPONG_KGROUPED])

    def fwd(cfg, impl, a_scale=xs):
        return gemm_fp8.mgrouped_fp8(xq, a_scale, wq, ws, m_idx, offsets, config=cfg, impl=impl)

    def dgrad(cfg, impl, a_scale=hs):
        return gemm_fp8.mgrouped_fp8(hq, a_scale, wqt, ws.transpose(1, 2), m_idx, offsets, config=cfg, impl=impl)

    def wgrad(cfg, impl, scales=(hst, xst)):
        return gemm_fp8.kgrouped_fp8(hqt, scales[0], xqt, scales[1], offsets, out_dtype=torch.bfloat16, config=cfg,
                                     impl=impl)

    # the same scales laid out token-block-major ([M/128, N] in memory, passed as the [N, M/128] view): a step's 128
    # scales of one operand are then contiguous (one 512-byte read) instead of 128 reads M/128 x 4 bytes apart. The
    # Gluon launcher copies other layouts into this one (gemm_fp8_gluon_kgrouped.token_block_major), so this row
    # differs from the default one by that copy: what a quantizer writing the layout itself would save
    by_block = (hst.t().contiguous().t(), xst.t().contiguous().t())
    # the m-grouped kernels' row scales [M, K/128] likewise with the rows adjacent ([K/128, M] in memory): a
    # warpgroup's 64 row scales of a step then lie in one 256-byte run (not measured yet; the default keeps the
    # quantizer's layout)
    xs_by_block, hs_by_block = xs.t().contiguous().t(), hs.t().contiguous().t()

    def by_block_row(run, label, *args):
        """The default Gluon config on the re-laid-out scales, as an extra row (Hopper only)."""
        return [(f"fp8 gluon {label}, scales token-block-major", lambda: run(None, "gluon", *args))] if gluon else []

    cases = {
        "fwd": (lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs32),
                impls(*mgrouped, fwd) + by_block_row(fwd, gemm_fp8_gluon.DEFAULT_MGROUPED, xs_by_block),
                lambda: cublas_mgrouped(xq, xs, wq, ws, bounds)),
        "dgrad": (lambda: torch._grouped_mm(h, w, offs=offs32),
                  impls(*mgrouped, dgrad) + by_block_row(dgrad, gemm_fp8_gluon.DEFAULT_MGROUPED, hs_by_block),
                  lambda: cublas_mgrouped(hq, hs, wqt, ws.transpose(1, 2), bounds)),
        "wgrad": (lambda: torch._grouped_mm(h.t(), x, offs=offs32),
                  impls(*kgrouped, wgrad) + by_block_row(wgrad, gemm_fp8_gluon_kgrouped.DEFAULT_KGROUPED, by_block),
                  lambda: cublas_kgrouped(hqt, hst, xqt, xst, bounds, torch.bfloat16)),
    }
    for name, (bf16_fn, rows, cublas) in cases.items():
        case = f"grouped {name} {shape} {e}x{per} N{n if name != 'dgrad' else k}"
        ref = bf16_fn()
        t_bf = bench(bf16_fn)
        add(case, "bf16 torch._grouped_mm", t_bf, flops)
        for label, fn in rows:
            try:
                err = rel(fn(), ref)
                add(case, label, bench(fn), flops, t_bf, err)
            except Exception as exc:  # one failing config must not hide the others
                print(f"{case} {label} failed: {type(exc).__name__}: {str(exc)[:200]}")
        k_blocks = (k if name != "dgrad" else n) // 128
        if cublas_blockwise_available() and (name == "wgrad" or k_blocks % 4 == 0):
            add(case, "fp8 cublas per expert (host bounds)", bench(cublas), flops, t_bf, rel(cublas(), ref))
    del x, w, h, xq, xqt, wq, wqt, hq, hqt


@contextlib.contextmanager
def auto_impl(impl: str):
    """impl="auto" of both grouped GEMMs (what fp8_linear runs) set to `impl` for the duration."""
    saved = gemm_fp8.AUTO_MGROUPED_IMPL, gemm_fp8.AUTO_KGROUPED_IMPL
    gemm_fp8.AUTO_MGROUPED_IMPL = gemm_fp8.AUTO_KGROUPED_IMPL = impl
    try:
        yield
    finally:
        gemm_fp8.AUTO_MGROUPED_IMPL, gemm_fp8.AUTO_KGROUPED_IMPL = saved


def dense(name: str, t: int, k: int, n: int):
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(n, k, device="cuda") / k ** 0.5)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    flops = 6 * t * n * k
    case = f"linear fwd+bwd {name} T{t} {k}->{n}"

    def bf16():
        with torch.autocast("cuda", torch.bfloat16):
            torch.nn.functional.linear(x, w).backward(dy)

    def fp8():
        with torch.autocast("cuda", torch.bfloat16):
            fp8_linear(x, w).backward(dy)

    t_bf = bench(bf16)
    add(case, "bf16 F.linear", t_bf, flops, kernel_ms=kernel_ms(bf16))
    for impl in ("triton", "gluon") if gemm_fp8_gluon.available(x.device) else ("triton",):
        with auto_impl(impl), torch.autocast("cuda", torch.bfloat16):
            err = rel(fp8_linear(x, w), torch.nn.functional.linear(x, w))
            add(case, f"fp8_linear (weights cached, {impl} GEMMs)", bench(fp8), flops, t_bf, err, kernel_ms(fp8))


DENSE_SHAPES = [("small dense FFN", 65536, 1024, 2816), ("small wq_b", 65536, 384, 1536),
                ("v2-lite dense FFN", 65536, 2048, 10944), ("v2-lite wkv_b", 65536, 512, 4096)]
# the rest of `small`'s FP8 linears at 64k tokens: the weight gradients with few output tiles
SMALL_LINEARS = [("small wq_a", 65536, 1024, 384), ("small wo", 65536, 1024, 1024),
                 ("small shared w1", 65536, 1024, 512), ("small shared w2", 65536, 512, 1024)]


def run(quick: bool, sweep: bool, budget_s: float, sections: tuple[str, ...] = ("grouped", "dense")) -> None:
    """Every case of the sections (the FP8 section of bench/moe.py calls this too)."""
    deadline = time.time() + budget_s
    torch.manual_seed(0)
    if "grouped" in sections:
        for shape in ("V3",) if quick else tuple(EXPERT_SHAPES):
            for per in (4096, 256) if quick else (4096, 1024, 256):
                if time.time() < deadline:
                    grouped(per, sweep, shape)
    shapes = (DENSE_SHAPES[:1] if quick else DENSE_SHAPES) if "dense" in sections else []
    shapes = shapes + (SMALL_LINEARS if "small_linears" in sections else [])
    for shape in shapes:
        if time.time() < deadline:
            dense(*shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="every named config of the grouped GEMMs")
    ap.add_argument("--budget-s", type=float, default=170)
    ap.add_argument("--out", default="bench/results/fp8")
    ap.add_argument("--sections", default="grouped,dense",
                    help="comma-separated: grouped, dense, small_linears (the small model's other FP8 linears)")
    args = ap.parse_args()
    run(args.quick, args.sweep, args.budget_s, tuple(args.sections.split(",")))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(ROWS, indent=1) + "\n")
    lines = ["# FP8 GEMMs vs bf16 (`bench/fp8.py`)", "",
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}, triton {triton.__version__}; median of do_bench. Command: "
             f"`python bench/fp8.py {' '.join(f'--{k}' for k, v in vars(args).items() if v is True)} --sections "
             f"{args.sections}`", "",
             "kernel ms: the profiler's sum of the call's kernels (dense rows), without the host's launch gaps.", "",
             "| case | impl | ms | TFLOP/s | vs bf16 | rel err vs bf16 | kernel ms |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in ROWS:
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        kms = "" if r.get("kernel_ms") is None else f"{r['kernel_ms']:.3f}"
        lines.append(f"| {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['tflops']:.1f} | {r['ratio_vs_bf16']:.2f}x | "
                     f"{err} | {kms} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
