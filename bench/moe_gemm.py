"""Benchmark of the MoE expert path's grouped GEMMs on one GPU, candidate and baselines side by side on the same
inputs.

Sections:
  gemm           fwd / dgrad / wgrad at balanced loads (V3 and V2-Lite expert shapes): TFLOP/s of ours (FP8 blockwise
                 in each implementation that runs here, bf16) and of cuBLAS blockwise FP8 per expert vs bf16
                 torch._grouped_mm and fp8 rowwise torch._scaled_grouped_mm; relative errors vs the bf16 result.
  wgrad_bf16     the bf16 weight gradient at the training step's shapes (`small`, V2-Lite; 64k tokens), uniform and
                 skewed loads: torch._grouped_mm (as called, on token-contiguous copies) vs moela's Triton kernel.
  wgrad_configs  that Triton kernel in each launch config of its autotune list and the default: the measurement
                 behind gemm_grouped_triton.TUNED.
  wgrad_fp8      the FP8 weight gradient at the same shapes and loads: Triton, Gluon (experts by load, and in index
                 order), beside bf16 torch and Triton.

  python bench/moe_gemm.py [--sections gemm,wgrad_bf16,wgrad_configs,wgrad_fp8] [--quick] [--budget-s 400]
Writes bench/results/moe_gemm.md and moe_gemm.json (`--out-dir` elsewhere).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.moelib import Rows, bench, rel, require_cuda, routing  # noqa: E402
from bench.results_io import add_out_dir, write_results  # noqa: E402
from moela.ops.moe.kernels import gemm_fp8_gluon_kgrouped, gemm_fp8_gluon_mgrouped, gemm_libraries  # noqa: E402
from moela.ops.moe.kernels import gemm_grouped_triton as gemms  # noqa: E402
from moela.ops.moe.kernels.gemm_fp8_triton import kgrouped_fp8, mgrouped_fp8  # noqa: E402
from moela.ops.moe.kernels.gemm_grouped_triton import kgrouped_gemm, mgrouped_gemm  # noqa: E402
from moela.ops.moe.kernels.gemm_libraries import cublas_blockwise_available, cublas_kgrouped, cublas_mgrouped  # noqa: E402,E501
from moela.ops.moe.kernels.permute import build_layout  # noqa: E402
from moela.ops.moe.kernels.quantize_triton import quant_rows_cols, quant_weights  # noqa: E402
from moela.ops.moe.quant_spec import FP8_MAX  # noqa: E402


def _scaled_grouped(aq, a_s, bq, b_s, offs):
    return torch._scaled_grouped_mm(aq, bq.transpose(-2, -1), a_s, b_s, offs=offs, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)


def section_gemm(rows: Rows, quick: bool) -> None:
    """Grouped GEMMs fwd / dgrad / wgrad at balanced loads: ours (FP8 in each implementation that runs here, bf16)
    and cuBLAS blockwise FP8 per expert vs bf16 torch._grouped_mm and fp8 rowwise torch._scaled_grouped_mm."""
    cases = [("v3 w13 E32", 32, 2048, 4096, 7168), ("v3 w2 E32", 32, 2048, 7168, 2048), ("v3 w13", 8, 4096, 4096, 7168),
             ("v3 w2", 8, 4096, 7168, 2048), ("v3 w13 E32", 32, 1024, 4096, 7168),
             ("v2lite w13", 16, 4096, 2816, 2048), ("v2lite w2", 16, 4096, 2048, 1408)]
    for name, e, per, n, k in cases[:2] if quick else cases:
        if rows.out_of_time():
            return
        m = e * per
        case = f"{name} {e}x{per} N{n} K{k}"
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        m_idx = torch.arange(e, device="cuda", dtype=torch.int32).repeat_interleave(per)
        impls = ("gluon", "triton") if gemm_fp8_gluon_mgrouped.available(a.device) else ("triton",)
        offsets = torch.arange(0, m + 1, per, device="cuda", dtype=torch.int64)
        offs32 = offsets[1:].to(torch.int32)
        (aq, a_s), (aqt, ast) = quant_rows_cols(a)
        bq, b_s, bqt = quant_weights(b)
        flops = 2 * m * n * k
        ref = torch._grouped_mm(a, b.transpose(-2, -1), offs=offs32)
        t_bf = bench(lambda: torch._grouped_mm(a, b.transpose(-2, -1), offs=offs32))
        rows.add("gemm", case, "fwd bf16 torch._grouped_mm", t_bf, flops / t_bf / 1e9, "TFLOP/s")
        for impl in impls:
            err = rel(mgrouped_fp8(aq, a_s, bq, b_s, m_idx, offsets, impl=impl), ref)
            t_o = bench(lambda: mgrouped_fp8(aq, a_s, bq, b_s, m_idx, offsets, impl=impl))
            rows.add("gemm", case, f"fwd fp8 ours ({impl})", t_o, flops / t_o / 1e9, "TFLOP/s", vs_bf16=t_bf / t_o,
                     rel_err=err)
        t_ob = bench(lambda: mgrouped_gemm(a, b, m_idx))
        rows.add("gemm", case, "fwd bf16 ours", t_ob, flops / t_ob / 1e9, "TFLOP/s", vs_bf16=t_bf / t_ob)
        cub = cublas_blockwise_available()
        bounds = list(zip(offsets.tolist()[:-1], offsets.tolist()[1:]))
        if cub:
            err_c = rel(cublas_mgrouped(aq, a_s, bq, b_s, bounds), ref)
            t_c = bench(lambda: cublas_mgrouped(aq, a_s, bq, b_s, bounds))
            rows.add("gemm", case, "fwd fp8 cublas (per expert)", t_c, flops / t_c / 1e9, "TFLOP/s",
                     vs_bf16=t_bf / t_c, rel_err=err_c)
        try:
            ar = a.float().abs().amax(1) / FP8_MAX
            aqr = (a.float() / ar[:, None]).to(torch.float8_e4m3fn)
            br = b.float().abs().amax(2) / FP8_MAX
            bqr = (b.float() / br[..., None]).to(torch.float8_e4m3fn)
            _scaled_grouped(aqr, ar, bqr, br, offs32)
            t_sg = bench(lambda: _scaled_grouped(aqr, ar, bqr, br, offs32))
            rows.add("gemm", case, "fwd fp8 rowwise _scaled_gmm", t_sg, flops / t_sg / 1e9, "TFLOP/s")
        except (RuntimeError, TypeError) as exc:
            print(f"_scaled_grouped_mm unavailable: {str(exc)[:120]}")
        # data gradient: dX [M, K] = dY [M, N] @ W_e [N, K]
        (dq, ds), (dqt, dst) = quant_rows_cols(ref)
        t_bf = bench(lambda: torch._grouped_mm(ref, b, offs=offs32))
        rows.add("gemm", case, "dgrad bf16 torch._grouped_mm", t_bf, flops / t_bf / 1e9, "TFLOP/s")
        for impl in impls:
            t_o = bench(lambda: mgrouped_fp8(dq, ds, bqt, b_s.transpose(1, 2), m_idx, offsets, impl=impl))
            rows.add("gemm", case, f"dgrad fp8 ours ({impl})", t_o, flops / t_o / 1e9, "TFLOP/s", vs_bf16=t_bf / t_o)
        if cub:
            t_c = bench(lambda: cublas_mgrouped(dq, ds, bqt, b_s.transpose(1, 2), bounds))
            rows.add("gemm", case, "dgrad fp8 cublas", t_c, flops / t_c / 1e9, "TFLOP/s", vs_bf16=t_bf / t_c)
        # weight gradient: dW_e [N, K] = dY_e^T @ X_e
        t_bf = bench(lambda: torch._grouped_mm(ref.t(), a, offs=offs32))
        rows.add("gemm", case, "wgrad bf16 torch._grouped_mm", t_bf, flops / t_bf / 1e9, "TFLOP/s")
        wref = torch._grouped_mm(ref.t(), a, offs=offs32).float()
        for impl in impls:
            werr = rel(kgrouped_fp8(dqt, dst, aqt, ast, offsets, impl=impl), wref)
            t_o = bench(lambda: kgrouped_fp8(dqt, dst, aqt, ast, offsets, impl=impl))
            rows.add("gemm", case, f"wgrad fp8 ours ({impl})", t_o, flops / t_o / 1e9, "TFLOP/s", vs_bf16=t_bf / t_o,
                     rel_err=werr)
        if cub:
            werr_c = rel(cublas_kgrouped(dqt, dst, aqt, ast, bounds), wref)
            t_c = bench(lambda: cublas_kgrouped(dqt, dst, aqt, ast, bounds))
            rows.add("gemm", case, "wgrad fp8 cublas", t_c, flops / t_c / 1e9, "TFLOP/s", vs_bf16=t_bf / t_c,
                     rel_err=werr_c, fp32_out=gemm_libraries._FP32_OUT[0])
            # the baseline's output dtype (what the layer writes for bf16 weights): half the output bytes
            t_c16 = bench(lambda: cublas_kgrouped(dqt, dst, aqt, ast, bounds, torch.bfloat16))
            rows.add("gemm", case, "wgrad fp8 cublas, bf16 out", t_c16, flops / t_c16 / 1e9, "TFLOP/s",
                     vs_bf16=t_bf / t_c16)
        t_ob = bench(lambda: kgrouped_gemm(ref.t(), a.t(), offsets, out_dtype=torch.bfloat16))
        rows.add("gemm", case, "wgrad bf16 ours", t_ob, flops / t_ob / 1e9, "TFLOP/s", vs_bf16=t_bf / t_ob)
        del a, b, aq, aqt, bq, bqt, ref


WGRAD_CASES = [("small w13", 65536, 32, 4, 1024, 1024), ("small w2", 65536, 32, 4, 1024, 512),
               ("v2lite w13", 65536, 64, 6, 2816, 2048), ("v2lite w2", 65536, 64, 6, 2048, 1408)]


def wgrad_inputs(rows: Rows, quick: bool):
    """The weight gradient's inputs at the training step's shapes (WGRAD_CASES: name, T, E, top-k, N, K; the first
    two when quick), each under uniform and skewed expert loads, until the section's time is up: (name, T, E,
    top-k, N, K, layout, g [M_pad, N] the output gradient rows, x [M_pad, K] the input rows, load label). Padding
    rows are zeros, as the layer's are."""
    for name, t, e, k, n, kk in WGRAD_CASES[:2] if quick else WGRAD_CASES:
        for skew in (False, True):
            if rows.out_of_time():
                return
            lay = build_layout(routing(t, e, k, skew), e)
            load = f"{'skew' if skew else 'unif'} max/mean {(lay.counts.max() / lay.counts.float().mean()).item():.2f}"
            valid = (lay.m_indices >= 0)[:, None]
            g = torch.randn(lay.m_pad, n, device="cuda", dtype=torch.bfloat16) * valid
            x = torch.randn(lay.m_pad, kk, device="cuda", dtype=torch.bfloat16) * valid
            yield name, t, e, k, n, kk, lay, g, x, load


def masked_cast(out, counts):
    """The baseline's epilogue of torch._grouped_mm's weight gradient: zeros for the experts with no rows (the
    k-grouped form promises nothing there), fp32 for the master weights."""
    return torch.where((counts > 0)[:, None, None], out, 0).float()


def section_wgrad_bf16(rows: Rows, quick: bool) -> None:
    """The bf16 expert weight gradient at the training step's shapes (`small` and V2-Lite at 64k tokens a step), as
    the step calls it: out [E, N, K] fp32 = A[:, rows_e] @ B[:, rows_e]^T with both operands the row-major
    activations read transposed (token-strided). torch._grouped_mm (+ the masked fp32 cast), the same on
    token-contiguous copies (GEMM alone and with the copies), and moela's Triton kernel; the forward's m-grouped
    GEMM of the same FLOPs for reference. Expert loads uniform and skewed (Zipf 1.2 popularity), since a k-grouped
    tile's work is its expert's row count."""
    for name, t, e, k, n, kk, lay, g, x, load in wgrad_inputs(rows, quick):
        counts = lay.counts
        case = f"{name} E{e} T{t} N{n} K{kk} {load}"
        flops = 2 * t * k * n * kk
        offs32 = lay.offsets[1:].to(torch.int32)
        ref = masked_cast(torch._grouped_mm(g.t(), x, offs=offs32), counts)
        w = torch.randn(e, n, kk, device="cuda", dtype=torch.bfloat16)
        t_f = bench(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs32))
        rows.add("wgrad_bf16", case, "fwd-shaped m-grouped torch", t_f, flops / t_f / 1e9, "TFLOP/s")
        t_bf = bench(lambda: masked_cast(torch._grouped_mm(g.t(), x, offs=offs32), counts))
        rows.add("wgrad_bf16", case, "torch._grouped_mm + cast", t_bf, flops / t_bf / 1e9, "TFLOP/s")
        t_g = bench(lambda: torch._grouped_mm(g.t(), x, offs=offs32))
        rows.add("wgrad_bf16", case, "torch._grouped_mm alone", t_g, flops / t_g / 1e9, "TFLOP/s")
        gt, xt = g.t().contiguous(), x.t().contiguous()
        t_k = bench(lambda: torch._grouped_mm(gt, xt.t(), offs=offs32))
        rows.add("wgrad_bf16", case, "torch, token-contiguous operands", t_k, flops / t_k / 1e9, "TFLOP/s",
                 vs_torch=t_bf / t_k)
        t_kc = bench(lambda: torch._grouped_mm(g.t().contiguous(), x.t().contiguous().t(), offs=offs32))
        rows.add("wgrad_bf16", case, "torch, + the two copies", t_kc, flops / t_kc / 1e9, "TFLOP/s",
                 vs_torch=t_bf / t_kc)
        t_o = bench(lambda: kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32))
        rows.add("wgrad_bf16", case, "triton (the step's)", t_o, flops / t_o / 1e9, "TFLOP/s", vs_torch=t_bf / t_o,
                 rel_err=rel(kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32), ref))
        del g, x, gt, xt, ref, w


def section_wgrad_configs(rows: Rows, quick: bool) -> None:
    """The bf16 weight gradient's Triton kernel (as the step calls it: row-major activations read transposed, fp32
    out) in each launch config of `gemm_grouped_triton.configs()`, at the step's shapes, uniform and skewed loads,
    and the default (the table's config for the shape): the fastest config over both loads of a shape is what
    `gemm_grouped_triton.TUNED` should hold."""
    for name, t, _e, k, n, kk, lay, g, x, load in wgrad_inputs(rows, quick):
        case = f"{name} N{n} K{kk} {load}"
        flops = 2 * t * k * n * kk
        ref = kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32, config=(128, 8, 4))
        for cfg in gemms.configs():
            c = (cfg.kwargs["BN"], cfg.num_warps, cfg.num_stages)
            out = kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32, config=c)
            ms = bench(lambda c=c: kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32, config=c))
            rows.add("wgrad_configs", case, f"BN {c[0]}, {c[1]} warps, {c[2]} stages", ms, flops / ms / 1e9,
                     "TFLOP/s", max_diff_vs_first=(out - ref).abs().max().item())
        tuned = gemms.TUNED.get(("kgrouped", n, kk))
        ms = bench(lambda: kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32))
        rows.add("wgrad_configs", case, f"default (table: {tuned})", ms, flops / ms / 1e9, "TFLOP/s")
        del g, x, ref


def section_wgrad_fp8(rows: Rows, quick: bool) -> None:
    """The FP8 expert weight gradient (the Gluon k-grouped kernel the fp8_blockwise step runs on Hopper) at the
    training step's shapes, uniform and skewed loads: its tiles dealt along the snake with the experts by load (the
    default), and along the snake in expert-index order; the Triton FP8 kernel, the bf16 torch._grouped_mm
    (statically scheduled) and moela's Triton bf16 kernel on the same rows. The FP8 operands are quantized once,
    outside the timing (the layer's fused kernels produce them)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gluon = gemm_fp8_gluon_mgrouped.available(torch.device("cuda"))
    for name, t, e, k, n, kk in WGRAD_CASES[:2] if quick else WGRAD_CASES:
        for skew in (False, True):
            if rows.out_of_time():
                return
            # the busiest experts at random indices, as a trained router's are (routing() makes expert 0 the
            # busiest, which would make the index order the load order)
            ids = torch.randperm(e, device="cuda")[routing(t, e, k, skew)]
            lay = build_layout(ids, e)
            counts = lay.counts
            case = f"{name} E{e} T{t} N{n} K{kk} {'skew' if skew else 'unif'} max/mean " \
                   f"{(counts.max() / counts.float().mean()).item():.2f}"
            valid = (lay.m_indices >= 0)[:, None]
            g = torch.randn(lay.m_pad, n, device="cuda", dtype=torch.bfloat16) * valid
            x = torch.randn(lay.m_pad, kk, device="cuda", dtype=torch.bfloat16) * valid
            _, (gq, gs) = quant_rows_cols(g, rowwise=False)  # token-contiguous [N, M_pad] e4m3, scales along tokens
            _, (xq, xs) = quant_rows_cols(x, rowwise=False)
            flops = 2 * t * k * n * kk
            offs32 = lay.offsets[1:].to(torch.int32)
            t_bf = bench(lambda: masked_cast(torch._grouped_mm(g.t(), x, offs=offs32), counts))
            rows.add("wgrad_fp8", case, "bf16 torch._grouped_mm + cast", t_bf, flops / t_bf / 1e9, "TFLOP/s")
            t_tr = bench(lambda: kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32))
            rows.add("wgrad_fp8", case, "bf16 triton", t_tr, flops / t_tr / 1e9, "TFLOP/s", vs_torch=t_bf / t_tr)
            ref = kgrouped_fp8(gq, gs, xq, xs, lay.offsets, out_dtype=torch.float32, impl="triton")
            t_t8 = bench(lambda: kgrouped_fp8(gq, gs, xq, xs, lay.offsets, out_dtype=torch.float32, impl="triton"))
            rows.add("wgrad_fp8", case, "fp8 triton", t_t8, flops / t_t8 / 1e9, "TFLOP/s", vs_torch=t_bf / t_t8)
            if not gluon:
                continue
            got = kgrouped_fp8(gq, gs, xq, xs, lay.offsets, out_dtype=torch.float32, impl="gluon")
            t_g = bench(lambda: kgrouped_fp8(gq, gs, xq, xs, lay.offsets, out_dtype=torch.float32, impl="gluon"))
            rows.add("wgrad_fp8", case, "fp8 gluon, snake, experts by load", t_g, flops / t_g / 1e9, "TFLOP/s",
                     vs_torch=t_bf / t_g, vs_triton_bf16=t_tr / t_g, rel_diff_triton_fp8=rel(got, ref))
            index_order = torch.arange(e, device="cuda", dtype=torch.int32)

            def in_index_order():
                out = torch.empty(e, n, kk, device="cuda", dtype=torch.float32)
                return gemm_fp8_gluon_kgrouped.kgrouped_fp8_gluon(gq, gs, xq, xs, lay.offsets, out, sms,
                                                                  order=index_order)

            t_i = bench(in_index_order)
            rows.add("wgrad_fp8", case, "fp8 gluon, snake, index order", t_i, flops / t_i / 1e9, "TFLOP/s",
                     vs_torch=t_bf / t_i, rel_diff_triton_fp8=rel(in_index_order(), ref))
            del g, x, gq, xq, ref, got


SECTIONS = {"gemm": section_gemm, "wgrad_bf16": section_wgrad_bf16, "wgrad_configs": section_wgrad_configs,
            "wgrad_fp8": section_wgrad_fp8}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--quick", action="store_true", help="the first cases of each section")
    ap.add_argument("--budget-s", type=float, default=400)
    add_out_dir(ap)
    args = ap.parse_args()
    sections = args.sections.split(",")
    if unknown := [s for s in sections if s not in SECTIONS]:
        sys.exit(f"bench/moe_gemm.py: unknown section {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    require_cuda("moe_gemm")
    torch.manual_seed(0)
    rows = Rows(args.budget_s)
    for name in sections:
        try:
            SECTIONS[name](rows, args.quick)
        except Exception as exc:  # a failing section must not hide the others' numbers
            print(f"section {name} failed: {type(exc).__name__}: {exc}")
        torch.cuda.empty_cache()
    note = "Median of do_bench over >= 15 calls; vs_bf16 / vs_torch: the torch baseline's time over the row's."
    md = write_results("moe_gemm", "MoE grouped GEMMs", rows.markdown(note), rows.rows, out_dir=args.out_dir)
    print(md.read_text())


if __name__ == "__main__":
    main()
