"""FP8 GEMM benchmark on one GPU: the persistent grouped FP8 GEMMs and the FP8 linear vs bf16, same inputs, one
process.

Grouped (8 experts, balanced routing; the V3 expert shapes D 7168, F 2048 and the V2-Lite ones D 2048, F 1408) at
4096, 1024 and 256 rows per expert: fwd (A [M, D] @ W13_e^T), dgrad (dH [M, 2F] @ W13_e), wgrad (dH^T X per
expert) of ours vs bf16 torch._grouped_mm on the same shapes: the Triton kernels ("fp8 triton") and, on Hopper, the
warp-specialized Gluon kernels ("fp8 gluon"; also fed their scales already laid out as the kernel reads them); the
cuBLAS per-expert provider (host bounds) as a reference row. Each FP8 row's relative error is measured against the
bf16 result. Dense: fp8_linear forward+backward vs the bf16 linear at the small model's and V2-Lite's dense shapes
(64k tokens); section `small_linears`: the small model's other FP8 linears (weight gradients of few output tiles).

  python bench/fp8.py [--quick] [--budget-s 170] [--sections grouped,dense,small_linears]
--quick: the V3 shapes at 4096 and 256 rows per expert, one dense shape (under a minute). Writes
bench/results/fp8.md and fp8.json (rows: case, impl, tflops, ratio_vs_bf16, ms, rel_err, kernel_ms; `--out-dir`
elsewhere).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.attention_kernels import kernel_times  # noqa: E402
from bench.results_io import add_out_dir, write_results  # noqa: E402
from moela.ops.fp8_linear import fp8_linear  # noqa: E402
from moela.ops.moe.kernels import gemm_fp8_gluon_mgrouped  # noqa: E402
from moela.ops.moe.kernels.gemm_fp8_triton import kgrouped_fp8, mgrouped_fp8  # noqa: E402
from moela.ops.moe.kernels.gemm_libraries import cublas_blockwise_available, cublas_kgrouped, cublas_mgrouped  # noqa: E402,E501
from moela.ops.moe.kernels.quantize_triton import quant_rows_cols, quant_weights  # noqa: E402

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


def grouped(per: int, shape: str = "V3", e: int = 8):
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
    impls = ("triton", "gluon") if gemm_fp8_gluon_mgrouped.available(x.device) else ("triton",)

    def fwd(impl, a_scale=xs):
        return mgrouped_fp8(xq, a_scale, wq, ws, m_idx, offsets, impl=impl)

    def dgrad(impl, a_scale=hs):
        return mgrouped_fp8(hq, a_scale, wqt, ws.transpose(1, 2), m_idx, offsets, impl=impl)

    def wgrad(impl, scales=(hst, xst)):
        return kgrouped_fp8(hqt, scales[0], xqt, scales[1], offsets, out_dtype=torch.bfloat16, impl=impl)

    # the same scales laid out token-block-major ([M/128, N] in memory, passed as the [N, M/128] view): a step's 128
    # scales of one operand are then contiguous (one 512-byte read) instead of 128 reads M/128 x 4 bytes apart. The
    # Gluon launcher copies other layouts into this one (gemm_fp8_gluon_kgrouped.token_block_major), so this row
    # differs from the default one by that copy: what a quantizer writing the layout itself would save
    by_block = (hst.t().contiguous().t(), xst.t().contiguous().t())
    # the m-grouped kernels' row scales [M, K/128] likewise with the rows adjacent ([K/128, M] in memory): a
    # warpgroup's 64 row scales of a step then lie in one 256-byte run
    xs_by_block, hs_by_block = xs.t().contiguous().t(), hs.t().contiguous().t()

    def rows(run, *relaid):
        """(label, call) per implementation, and the Gluon kernel on the re-laid-out scales (Hopper only)."""
        out = [(f"fp8 {impl}", lambda impl=impl: run(impl)) for impl in impls]
        if "gluon" in impls:
            out.append(("fp8 gluon, scales token-block-major", lambda: run("gluon", *relaid)))
        return out

    cases = {
        "fwd": (lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs32), rows(fwd, xs_by_block),
                lambda: cublas_mgrouped(xq, xs, wq, ws, bounds)),
        "dgrad": (lambda: torch._grouped_mm(h, w, offs=offs32), rows(dgrad, hs_by_block),
                  lambda: cublas_mgrouped(hq, hs, wqt, ws.transpose(1, 2), bounds)),
        "wgrad": (lambda: torch._grouped_mm(h.t(), x, offs=offs32), rows(wgrad, by_block),
                  lambda: cublas_kgrouped(hqt, hst, xqt, xst, bounds, torch.bfloat16)),
    }
    for name, (bf16_fn, calls, cublas) in cases.items():
        case = f"grouped {name} {shape} {e}x{per} N{n if name != 'dgrad' else k}"
        ref = bf16_fn()
        t_bf = bench(bf16_fn)
        add(case, "bf16 torch._grouped_mm", t_bf, flops)
        for label, fn in calls:
            try:
                err = rel(fn(), ref)
                add(case, label, bench(fn), flops, t_bf, err)
            except Exception as exc:  # one failing implementation must not hide the others
                print(f"{case} {label} failed: {type(exc).__name__}: {str(exc)[:200]}")
        k_blocks = (k if name != "dgrad" else n) // 128
        if cublas_blockwise_available() and (name == "wgrad" or k_blocks % 4 == 0):
            add(case, "fp8 cublas per expert (host bounds)", bench(cublas), flops, t_bf, rel(cublas(), ref))
    del x, w, h, xq, xqt, wq, wqt, hq, hqt


def dense(name: str, t: int, k: int, n: int):
    """fp8_linear (its GEMMs: Gluon on Hopper, else Triton) against the bf16 linear, forward + backward."""
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
    with torch.autocast("cuda", torch.bfloat16):
        err = rel(fp8_linear(x, w), torch.nn.functional.linear(x, w))
    add(case, "fp8_linear (weights cached)", bench(fp8), flops, t_bf, err, kernel_ms(fp8))


DENSE_SHAPES = [("small dense FFN", 65536, 1024, 2816), ("small wq_b", 65536, 384, 1536),
                ("v2-lite dense FFN", 65536, 2048, 10944), ("v2-lite wkv_b", 65536, 512, 4096)]
# the rest of `small`'s FP8 linears at 64k tokens: the weight gradients with few output tiles
SMALL_LINEARS = [("small wq_a", 65536, 1024, 384), ("small wo", 65536, 1024, 1024),
                 ("small shared w1", 65536, 1024, 512), ("small shared w2", 65536, 512, 1024)]


def run(quick: bool, budget_s: float, sections: tuple[str, ...] = ("grouped", "dense")) -> None:
    """Every case of the sections, until the budget is spent."""
    deadline = time.time() + budget_s
    torch.manual_seed(0)
    if "grouped" in sections:
        for shape in ("V3",) if quick else tuple(EXPERT_SHAPES):
            for per in (4096, 256) if quick else (4096, 1024, 256):
                if time.time() < deadline:
                    grouped(per, shape)
    shapes = (DENSE_SHAPES[:1] if quick else DENSE_SHAPES) if "dense" in sections else []
    shapes = shapes + (SMALL_LINEARS if "small_linears" in sections else [])
    for shape in shapes:
        if time.time() < deadline:
            dense(*shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-s", type=float, default=170)
    ap.add_argument("--sections", default="grouped,dense",
                    help="comma-separated: grouped, dense, small_linears (the small model's other FP8 linears)")
    add_out_dir(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/fp8.py times CUDA kernels: run it on a GPU machine")
    run(args.quick, args.budget_s, tuple(args.sections.split(",")))
    table = ["Median of do_bench. kernel ms: the profiler's sum of the call's kernels (dense rows), without the host's "
             "launch gaps.", "", "| case | impl | ms | TFLOP/s | vs bf16 | rel err vs bf16 | kernel ms |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in ROWS:
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        kms = "" if r.get("kernel_ms") is None else f"{r['kernel_ms']:.3f}"
        table.append(f"| {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['tflops']:.1f} | {r['ratio_vs_bf16']:.2f}x | "
                     f"{err} | {kms} |")
    md = write_results("fp8", "FP8 GEMMs vs bf16", "\n".join(table), ROWS, out_dir=args.out_dir)
    print(md.read_text())


if __name__ == "__main__":
    main()
