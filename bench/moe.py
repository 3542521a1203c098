"""Benchmark of the MoE expert path on one GPU, candidate and baselines side by side on the same inputs.

Sections (DeepSeek-V3 expert shapes: D 7168, F 2048, top-8; V2-Lite: D 2048, F 1408, top-6):
  check   GPU diagnostics printed to stdout (not written to --out): relative errors vs float64 of the kernels'
          intermediate outputs and of the whole path per recipe and provider, and the weight codes compared with
          torch's reference and their transposed copy byte for byte; the CUDA tests
          (`pytest -m gpu tests/test_moe_ops.py`) assert the same paths.
  layout  permute+align+quant (the whole op; its data pass, its counting launches, build_layout alone, and the
          whole op replayed as a CUDA graph) and grouped row+column
          quantization: GB/s, % of the measured copy bandwidth, speedup over an eager PyTorch baseline
          (sort/index_select, per-expert padding, per-group quantization loop) and over torch.compile of that
          baseline.
  permute_cfg  the whole permute+align+quant op at other channel chunks (BLOCK_D) and warp counts.
  gemm    grouped GEMMs fwd / dgrad / wgrad: TFLOP/s of ours (FP8 blockwise, bf16) and of cuBLAS blockwise FP8
          (torch._scaled_mm per expert, the `cublas` provider) vs bf16 torch._grouped_mm and fp8 rowwise
          torch._scaled_grouped_mm.
  wgrad_bf16  the bf16 expert weight gradient at the training step's shapes: torch._grouped_mm as the step calls it,
          on token-contiguous copies, moela's Triton kernel (expert order, most rows first), uniform and skewed loads.
  wgrad_configs  the bf16 weight gradient's Triton kernel in each of its launch configs (`gemm_triton.configs()`)
          at the same shapes and loads, the table's choice (`gemm_triton.TUNED`) and the autotuner's: the
          measurements behind the table.
  wgrad_fp8  the FP8 weight gradient (the Gluon kernel) at the same shapes and loads: its tiles dealt with the
          experts by load (default) and in index order, beside bf16 torch and Triton.
  fp8     the persistent FP8 grouped GEMMs and the FP8 linear vs bf16 (bench/fp8.py; its own files
          bench/results/fp8.json and fp8.md are written by `python bench/fp8.py`).
  layer   the whole expert layer forward+backward: fp8 (Triton GEMMs; cuBLAS GEMMs) vs bf16 path vs an eager
          per-expert loop.
Every timed case is compared with its baseline first: layout rows report how many e4m3 codes and scales differ
from the eager baseline (columns of the row), gemm and layer rows their relative error; every section runs under
a time guard. Usage:
  python bench/moe.py [--sections check,layout,permute_cfg,gemm,wgrad_cast,wgrad_bf16,wgrad_configs,wgrad_fp8,layer] [--quick] [--out bench/results/moe.md]
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from moela.ops.moe import gemm_library as moe_gemm_library
from moela.ops.moe import gemm_triton, moe_experts
from moela.ops.moe import permute as moe_permute
from moela.ops.moe.activation import swiglu_bwd, swiglu_fwd
from moela.ops.moe.combine import combine_bwd, unpermute_combine
from moela.ops.moe.gemm_library import cublas_blockwise_available, cublas_kgrouped, cublas_mgrouped
from moela.ops.moe.gemm_triton import _kgrouped_autotuned, _mgrouped_autotuned, kgrouped_gemm, mgrouped_gemm
from moela.ops.moe.kernel_common import ALIGN, LAUNCH
from moela.ops.moe.layout import count_and_scan
from moela.ops.moe.permute import build_layout, permute_align
from moela.ops.moe.quant import AMAX_EPS, FP8_MAX, inv_scale, quant_128x128
from moela.ops.moe.quantize import quant_rows_cols, quant_weights

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"v3": dict(d=7168, f=2048, k=8), "v2lite": dict(d=2048, f=1408, k=6)}
ROWS: list[dict] = []
DEADLINE = [0.0]


def bench(fn):
    """Median of do_bench over at least ~15 timed calls: do_bench's warmup and rep are milliseconds, so 10 / 40 ms
    would time a 30 ms layer step once."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) * 1e3
    return do_bench(fn, warmup=max(10.0, 3 * est), rep=max(40.0, 15 * est), return_mode="median")


def routing(t, e, k, skew, dev="cuda"):
    """Top-k ids without repeats; skewed: expert popularity ~ Zipf(1.2), the top expert gets several times average."""
    pop = torch.arange(1, e + 1, device=dev, dtype=torch.float32) ** -1.2 if skew else torch.ones(e, device=dev)
    return torch.multinomial(pop.expand(t, e), k, replacement=False)


def row(section, case, impl, ms, metric, unit, **extra):
    ROWS.append(dict(section=section, case=case, impl=impl, ms=ms, metric=metric, unit=unit, **extra))
    print(f"{section:7s} {case:34s} {impl:26s} {ms:9.3f} ms {metric:9.1f} {unit}", flush=True)


def code_diff(q, rq, s, rs):
    """How far our e4m3 codes and scales are from the eager baseline's (printed with the timing row instead of
    stopping the section): fraction of differing codes, of rows with any, max scale ratio, max dequantized error
    in units of the group scale, and how many codes differ by more than one e4m3 step. Torch's CUDA baseline computes
    amax / 448 through a reciprocal (1-ulp scale differences); the codes use the same inverse (1 / amax) * 448 as
    the kernels, so they should agree exactly; a code off by more than one step is a defect."""
    diff = q.float() != rq.float()
    deq = (q.float().view(q.shape[0], -1, 128) * s[..., None]).view(q.shape)
    rdeq = (rq.float().view(q.shape[0], -1, 128) * rs[..., None]).view(q.shape)
    step = (q.view(torch.uint8).int() - rq.view(torch.uint8).int()).abs()  # e4m3 codes of one sign are ordered
    out = dict(code_mismatch=diff.float().mean().item(), not_one_step=(step > 1).sum().item(),
               rows_mismatch=diff.any(1).float().mean().item(),
               scale_ratio=(s / rs).sub(1).abs().max().item(),
               deq_err=((deq - rdeq).abs().view(q.shape[0], -1, 128) / rs[..., None]).max().item())
    if out["not_one_step"] or out["scale_ratio"] > 1e-6:
        bad = diff.any(1).nonzero()[:, 0]
        print(f"code mismatch {out}; first bad rows {bad[:8].tolist()}, columns of the first "
              f"{diff[bad[0]].nonzero()[:16, 0].tolist()}")
    return out


def out_of_time():
    return time.time() > DEADLINE[0]


# ---------------------------------------------------------------------------------------------------------------
# eager baselines


def e4m3(v, inv):
    """The recipe's codes: v * inv (inv = (1 / amax) * 448), clamped, cast to e4m3 (moela.ops.moe.quant)."""
    return (v * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def eager_permute_quant(x, ids, e, quant=True):
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=e).tolist()
    chunks, start = [], 0
    for c in counts:
        rows = x.index_select(0, order[start:start + c] // k)
        chunks.append(torch.cat([rows, rows.new_zeros((-c) % 128, x.shape[1])]))
        start += c
    xp = torch.cat(chunks)
    if not quant:
        return xp, None
    q = torch.empty(xp.shape, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(xp.shape[0], x.shape[1] // 128, device=x.device)
    for g in range(x.shape[1] // 128):
        blk = xp[:, g * 128:(g + 1) * 128].float()
        amax = blk.abs().amax(1).clamp_min(AMAX_EPS)
        q[:, g * 128:(g + 1) * 128] = e4m3(blk, inv_scale(amax)[:, None])
        s[:, g] = amax / FP8_MAX
    return q, s


def eager_rows_cols(x):
    m, n = x.shape
    q, s = torch.empty_like(x, dtype=torch.float8_e4m3fn), torch.empty(m, n // 128, device=x.device)
    for g in range(n // 128):
        blk = x[:, g * 128:(g + 1) * 128].float()
        amax = blk.abs().amax(1).clamp_min(AMAX_EPS)
        q[:, g * 128:(g + 1) * 128] = e4m3(blk, inv_scale(amax)[:, None])
        s[:, g] = amax / FP8_MAX
    xt = x.t().float()
    qt, st = torch.empty(n, m, device=x.device, dtype=torch.float8_e4m3fn), torch.empty(n, m // 128, device=x.device)
    for g in range(m // 128):
        blk = xt[:, g * 128:(g + 1) * 128]
        amax = blk.abs().amax(1).clamp_min(AMAX_EPS)
        qt[:, g * 128:(g + 1) * 128] = e4m3(blk, inv_scale(amax)[:, None])
        st[:, g] = amax / FP8_MAX
    return (q, s), (qt, st)


def vector_permute_quant(x, ids, e):
    """The eager baseline's math without Python loops (what torch.compile gets to fuse)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + 127) // 128 * 128
    starts = torch.cumsum(padded, 0) - padded
    ranks = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    dest = starts[flat[order]] + ranks
    xp = x.new_zeros(flat.numel() + e * 128, x.shape[1]).index_copy(0, dest, x[order // k])
    g = xp.float().view(xp.shape[0], -1, 128)
    amax = g.abs().amax(-1).clamp_min(AMAX_EPS)
    return e4m3(g, inv_scale(amax)[..., None]).view(xp.shape), amax / FP8_MAX


def vector_rows_cols(x):
    m, n = x.shape
    g = x.float().view(m, n // 128, 128)
    amax = g.abs().amax(-1).clamp_min(AMAX_EPS)
    q = e4m3(g, inv_scale(amax)[..., None]).view(m, n)
    gt = x.float().view(m // 128, 128, n)
    amax_t = gt.abs().amax(1).clamp_min(AMAX_EPS)
    qt = e4m3(gt, inv_scale(amax_t)[:, None]).view(m, n).t().contiguous()
    return (q, amax / FP8_MAX), (qt, (amax_t / FP8_MAX).t().contiguous())


def eager_layer(x, ids, w, w13, w2):
    f = w13.shape[1] // 2
    y = torch.zeros_like(x, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    flat = ids.reshape(-1)
    tok = torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])
    for ex in range(w13.shape[0]):
        r = (flat == ex).nonzero(as_tuple=True)[0]
        h = x[tok[r]] @ w13[ex].t()
        o = (F.silu(h[:, :f]) * h[:, f:]) @ w2[ex].t()
        y = y.index_add(0, tok[r], o.to(y.dtype) * w.reshape(-1)[r, None])
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# sections


def copy_bandwidth():
    a = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    gbs = 2 * a.numel() / ms / 1e6
    row("ceiling", "d2d copy 2 GiB", "torch copy_", ms, gbs, "GB/s")
    return gbs


def section_layout(copy_gbs, quick):
    cases = [("v3", 32, 16384, False), ("v3", 32, 16384, True), ("v2lite", 16, 32768, False)]
    for name, e, t, skew in cases[:2] if quick else cases:
        if out_of_time():
            return
        d, k = SHAPES[name]["d"], SHAPES[name]["k"]
        case = f"{name} E{e} T{t} {'skew' if skew else 'unif'}"
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        ids = routing(t, e, k, skew)
        q, s, lay = permute_align(x, ids, e)
        rq, rs = eager_permute_quant(x, ids, e)
        real = lay.src[: lay.offsets[-1]] >= 0
        check = code_diff(q[: lay.offsets[-1]][real], rq[real], s[: lay.offsets[-1]][real], rs[real])
        nbytes = t * d * 2 + t * k * d + t * k * d // 128 * 4
        ours = bench(lambda: permute_align(x, ids, e))
        gbs = nbytes / ours / 1e6
        row("layout", case, "permute+align+quant ours", ours, gbs, "GB/s", pct_copy=100 * gbs / copy_gbs, **check)
        data = bench(lambda: permute_align(x, ids, e, layout=lay))  # the data pass alone, layout built before
        row("layout", case, "  its data pass (layout given)", data, nbytes / data / 1e6, "GB/s",
            pct_copy=100 * nbytes / data / 1e6 / copy_gbs)
        lms = bench(lambda: count_and_scan(ids, e, ALIGN))
        row("layout", case, "  its count + scan launches", lms, 0.0, "-")
        lms = bench(lambda: build_layout(ids, e))
        row("layout", case, "  build_layout alone (3 launches)", lms, 0.0, "-")
        try:  # the op's GPU time without host launch overhead
            gms = triton.testing.do_bench_cudagraph(lambda: permute_align(x, ids, e), rep=40, return_mode="median")
            row("layout", case, "  whole op as a CUDA graph", gms, nbytes / gms / 1e6, "GB/s",
                pct_copy=100 * nbytes / gms / 1e6 / copy_gbs)
        except Exception as exc:  # a diagnostic: must not stop the section
            print(f"cuda graph timing failed: {type(exc).__name__}: {exc}")
        eager = bench(lambda: eager_permute_quant(x, ids, e))
        row("layout", case, "eager baseline", eager, nbytes / eager / 1e6, "GB/s", speedup=eager / ours)
        if name == "v3" and not skew and not out_of_time():
            comp = torch.compile(vector_permute_quant)
            comp(x, ids, e)
            cms = bench(lambda: comp(x, ids, e))
            row("layout", case, "torch.compile (vectorized)", cms, nbytes / cms / 1e6, "GB/s", speedup=cms / ours)
        xp, _, _ = permute_align(x, ids, e, quant=None, layout=lay)
        m = xp.shape[0]
        nb2 = m * d * 2 + 2 * m * d + 2 * m * d // 128 * 4
        (q1, s1), (qt1, st1) = quant_rows_cols(xp)
        (q2, s2), (qt2, st2) = eager_rows_cols(xp)
        rows_check = code_diff(q1, q2, s1, s2)
        cols_check = {f"col_{k}": v for k, v in code_diff(qt1, qt2, st1, st2).items()}
        ours = bench(lambda: quant_rows_cols(xp))
        gbs = nb2 / ours / 1e6
        row("layout", case, "row+col quant ours", ours, gbs, "GB/s", pct_copy=100 * gbs / copy_gbs, **rows_check,
            **cols_check)
        (q3, s3), (qt3, st3) = quant_rows_cols(xp, impl="triton")
        same = torch.equal(q3.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s3, s1) and \
            torch.equal(qt3.view(torch.uint8), qt1.view(torch.uint8)) and torch.equal(st3, st1)
        tri = bench(lambda: quant_rows_cols(xp, impl="triton"))
        row("layout", case, "row+col quant, Triton kernel (tile in registers)", tri, nb2 / tri / 1e6, "GB/s",
            pct_copy=100 * nb2 / tri / 1e6 / copy_gbs, same_bytes_as_ours=same)
        eager = bench(lambda: eager_rows_cols(xp))
        row("layout", case, "row+col eager baseline", eager, nb2 / eager / 1e6, "GB/s", speedup=eager / ours)
        if name == "v3" and not skew and not out_of_time():
            comp = torch.compile(vector_rows_cols)
            comp(xp)
            cms = bench(lambda: comp(xp))
            row("layout", case, "row+col compile (vectorized)", cms, nb2 / cms / 1e6, "GB/s", speedup=cms / ours)
        del x, xp, q, rq


def section_permute_configs(copy_gbs):
    """The whole permute+align+quant op at other channel chunks and warp counts (V3 E32 T16384 uniform); codes and
    scales compared byte for byte with the default configuration's."""
    e, t, d, k = 32, 16384, SHAPES["v3"]["d"], SHAPES["v3"]["k"]
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    ids = routing(t, e, k, False)
    q0, s0, _ = permute_align(x, ids, e)
    nbytes = t * d * 2 + t * k * d + t * k * d // 128 * 4
    default = (moe_permute.PERMUTE_BLOCK_D, LAUNCH["permute"]["num_warps"])
    try:
        for block_d in (512, 1024, 2048):
            for warps in (2, 4, 8):
                if out_of_time():
                    return
                moe_permute.PERMUTE_BLOCK_D, LAUNCH["permute"]["num_warps"] = block_d, warps
                q, s, _ = permute_align(x, ids, e)
                same = torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
                ms = bench(lambda: permute_align(x, ids, e))
                row("permute_cfg", f"v3 E{e} T{t} unif", f"BLOCK_D {block_d}, {warps} warps", ms, nbytes / ms / 1e6,
                    "GB/s", pct_copy=100 * nbytes / ms / 1e6 / copy_gbs, same_bytes=same)
    finally:
        moe_permute.PERMUTE_BLOCK_D, LAUNCH["permute"]["num_warps"] = default


def _scaled_grouped(aq, a_s, bq, b_s, offs):
    return torch._scaled_grouped_mm(aq, bq.transpose(-2, -1), a_s, b_s, offs=offs, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)


def section_gemm(quick):
    cases = [("v3 w13 E32", 32, 2048, 4096, 7168), ("v3 w2 E32", 32, 2048, 7168, 2048), ("v3 w13", 8, 4096, 4096, 7168),
             ("v3 w2", 8, 4096, 7168, 2048), ("v3 w13 E32", 32, 1024, 4096, 7168),
             ("v2lite w13", 16, 4096, 2816, 2048), ("v2lite w2", 16, 4096, 2048, 1408)]
    for name, e, per, n, k in cases[:2] if quick else cases:
        if out_of_time():
            return
        m = e * per
        case = f"{name} {e}x{per} N{n} K{k}"
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        m_idx = torch.arange(e, device="cuda", dtype=torch.int32).repeat_interleave(per)
        offsets = torch.arange(0, m + 1, per, device="cuda", dtype=torch.int64)
        offs32 = offsets[1:].to(torch.int32)
        (aq, a_s), (aqt, ast) = quant_rows_cols(a)
        bq, b_s, bqt = quant_weights(b)
        flops = 2 * m * n * k
        ref = torch._grouped_mm(a, b.transpose(-2, -1), offs=offs32)
        ours = mgrouped_gemm(aq, bq, m_idx, a_scale=a_s, b_scale=b_s)
        err = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
        t_bf = bench(lambda: torch._grouped_mm(a, b.transpose(-2, -1), offs=offs32))
        row("gemm", case, "fwd bf16 torch._grouped_mm", t_bf, flops / t_bf / 1e9, "TFLOP/s")
        t_o = bench(lambda: mgrouped_gemm(aq, bq, m_idx, a_scale=a_s, b_scale=b_s))
        row("gemm", case, "fwd fp8 ours", t_o, flops / t_o / 1e9, "TFLOP/s", vs_bf16=t_bf / t_o, rel_err=err)
        t_ob = bench(lambda: mgrouped_gemm(a, b, m_idx))
        row("gemm", case, "fwd bf16 ours", t_ob, flops / t_ob / 1e9, "TFLOP/s", vs_bf16=t_bf / t_ob)
        cub = cublas_blockwise_available()
        bounds = list(zip(offsets.tolist()[:-1], offsets.tolist()[1:]))
        if cub:
            err_c = ((cublas_mgrouped(aq, a_s, bq, b_s, bounds).float() - ref.float()).norm()
                     / ref.float().norm()).item()
            t_c = bench(lambda: cublas_mgrouped(aq, a_s, bq, b_s, bounds))
            row("gemm", case, "fwd fp8 cublas (per expert)", t_c, flops / t_c / 1e9, "TFLOP/s", vs_bf16=t_bf / t_c,
                rel_err=err_c)
        try:
            ar = a.float().abs().amax(1) / FP8_MAX
            aqr = (a.float() / ar[:, None]).to(torch.float8_e4m3fn)
            br = b.float().abs().amax(2) / FP8_MAX
            bqr = (b.float() / br[..., None]).to(torch.float8_e4m3fn)
            _scaled_grouped(aqr, ar, bqr, br, offs32)
            t_sg = bench(lambda: _scaled_grouped(aqr, ar, bqr, br, offs32))
            row("gemm", case, "fwd fp8 rowwise _scaled_gmm", t_sg, flops / t_sg / 1e9, "TFLOP/s")
        except (RuntimeError, TypeError) as exc:
            print(f"_scaled_grouped_mm unavailable: {str(exc)[:120]}")
        # data gradient: dX [M, K] = dY [M, N] @ W_e [N, K]
        (dq, ds), (dqt, dst) = quant_rows_cols(ref)
        t_bf = bench(lambda: torch._grouped_mm(ref, b, offs=offs32))
        row("gemm", case, "dgrad bf16 torch._grouped_mm", t_bf, flops / t_bf / 1e9, "TFLOP/s")
        t_o = bench(lambda: mgrouped_gemm(dq, bqt, m_idx, a_scale=ds, b_scale=b_s.transpose(1, 2)))
        row("gemm", case, "dgrad fp8 ours", t_o, flops / t_o / 1e9, "TFLOP/s", vs_bf16=t_bf / t_o)
        if cub:
            t_c = bench(lambda: cublas_mgrouped(dq, ds, bqt, b_s.transpose(1, 2), bounds))
            row("gemm", case, "dgrad fp8 cublas", t_c, flops / t_c / 1e9, "TFLOP/s", vs_bf16=t_bf / t_c)
        # weight gradient: dW_e [N, K] = dY_e^T @ X_e
        t_bf = bench(lambda: torch._grouped_mm(ref.t(), a, offs=offs32))
        row("gemm", case, "wgrad bf16 torch._grouped_mm", t_bf, flops / t_bf / 1e9, "TFLOP/s")
        wref = torch._grouped_mm(ref.t(), a, offs=offs32).float()
        wo = kgrouped_gemm(dqt, aqt, offsets, a_scale=dst, b_scale=ast)
        werr = ((wo - wref).norm() / wref.norm()).item()
        t_o = bench(lambda: kgrouped_gemm(dqt, aqt, offsets, a_scale=dst, b_scale=ast))
        row("gemm", case, "wgrad fp8 ours", t_o, flops / t_o / 1e9, "TFLOP/s", vs_bf16=t_bf / t_o, rel_err=werr)
        if cub:
            wc = cublas_kgrouped(dqt, dst, aqt, ast, bounds)
            werr_c = ((wc.float() - wref).norm() / wref.norm()).item()
            t_c = bench(lambda: cublas_kgrouped(dqt, dst, aqt, ast, bounds))
            row("gemm", case, "wgrad fp8 cublas", t_c, flops / t_c / 1e9, "TFLOP/s", vs_bf16=t_bf / t_c,
                rel_err=werr_c, fp32_out=moe_gemm_library._FP32_OUT[0])
            # the baseline's output dtype (what the layer writes for bf16 weights): half the output bytes
            t_c16 = bench(lambda: cublas_kgrouped(dqt, dst, aqt, ast, bounds, torch.bfloat16))
            row("gemm", case, "wgrad fp8 cublas, bf16 out", t_c16, flops / t_c16 / 1e9, "TFLOP/s",
                vs_bf16=t_bf / t_c16)
        t_ob = bench(lambda: kgrouped_gemm(ref.t(), a.t(), offsets, out_dtype=torch.bfloat16))
        row("gemm", case, "wgrad bf16 ours", t_ob, flops / t_ob / 1e9, "TFLOP/s", vs_bf16=t_bf / t_ob)
        del a, b, aq, aqt, bq, bqt, ref


def fp8_breakdown(case, x, ids, w, w13, w2):
    """Time each stage of the fp8 path alone on the same inputs (where the layer's time goes)."""
    e, k = w13.shape[0], ids.shape[1]
    x, w, w13, w2 = x.detach(), w.detach(), w13.detach(), w2.detach()
    lay = build_layout(ids, e)
    xq, xs, _ = permute_align(x, ids, e, layout=lay)
    w13q, w13s, w13qt = quant_weights(w13)
    w2q, w2s, w2qt = quant_weights(w2)
    h = mgrouped_gemm(xq, w13q, lay.m_indices, a_scale=xs, b_scale=w13s)
    aq, as_ = swiglu_fwd(h, lay.m_indices, quant=True)
    o = mgrouped_gemm(aq, w2q, lay.m_indices, a_scale=as_, b_scale=w2s)
    dy = torch.randn_like(x)
    (doq, dos), (doqt, dost), _ = combine_bwd(dy, o, lay, w, quant=True)
    dact = mgrouped_gemm(doq, w2qt, lay.m_indices, a_scale=dos, b_scale=w2s.transpose(1, 2))
    (dhq, dhs), (dhqt, dhst), (aqt, ast) = swiglu_bwd(h, dact, lay.m_indices, quant=True)
    _, (xqt, xst) = quant_rows_cols(x, rowwise=False, src=lay.src, gather_div=k)
    dxp = dact.new_zeros(lay.m_pad, x.shape[1])  # [M_pad, D] the gather-sum's input, allocated outside the timing
    dact16 = dact.to(h.dtype)  # the bf16 recipe's SwiGLU backward input
    stages = {
        "build_layout": lambda: build_layout(ids, e),
        "permute_align+quant": lambda: permute_align(x, ids, e, layout=lay),
        "quant_weights w13+w2": lambda: (quant_weights(w13), quant_weights(w2)),
        "quant_weights w13+w2 (Triton kernel)": lambda: (quant_weights(w13, impl="triton"),
                                                         quant_weights(w2, impl="triton")),
        "gemm1 fwd": lambda: mgrouped_gemm(xq, w13q, lay.m_indices, a_scale=xs, b_scale=w13s),
        "swiglu fwd+quant": lambda: swiglu_fwd(h, lay.m_indices, quant=True),
        "gemm2 fwd": lambda: mgrouped_gemm(aq, w2q, lay.m_indices, a_scale=as_, b_scale=w2s),
        "unpermute_combine": lambda: unpermute_combine(o, lay, w, x.dtype),
        "combine bwd+row/col quant": lambda: combine_bwd(dy, o, lay, w, quant=True),
        "gemm2 dgrad": lambda: mgrouped_gemm(doq, w2qt, lay.m_indices, a_scale=dos, b_scale=w2s.transpose(1, 2)),
        "swiglu bwd+quants": lambda: swiglu_bwd(h, dact, lay.m_indices, quant=True),
        "swiglu bwd+quants (Triton kernel)": lambda: swiglu_bwd(h, dact, lay.m_indices, quant=True, impl="triton"),
        "swiglu bwd bf16": lambda: swiglu_bwd(h, dact16, lay.m_indices, quant=False),
        "swiglu bwd bf16 (split kernel)": lambda: swiglu_bwd(h, dact16, lay.m_indices, quant=False, impl="split"),
        "gemm2 wgrad": lambda: kgrouped_gemm(doqt, aqt, lay.offsets, a_scale=dost, b_scale=ast),
        "gemm1 dgrad": lambda: mgrouped_gemm(dhq, w13qt, lay.m_indices, a_scale=dhs, b_scale=w13s.transpose(1, 2)),
        "x column quant (gather)": lambda: quant_rows_cols(x, rowwise=False, src=lay.src, gather_div=k),
        "x column quant (gather, Triton kernel)": lambda: quant_rows_cols(x, rowwise=False, src=lay.src,
                                                                            gather_div=k, impl="triton"),
        "gemm1 wgrad": lambda: kgrouped_gemm(dhqt, xqt, lay.offsets, a_scale=dhst, b_scale=xst),
        "dx gather-sum": lambda: unpermute_combine(dxp, lay, None, x.dtype),
    }
    for name, fn in stages.items():
        row("stage", case, name, bench(fn), 0.0, "-")


def section_wgrad_cast(quick):
    """The bf16 weight gradient's epilogue (zero the empty experts, cast to the fp32 master weights' dtype): the
    torch `where` + `.to` it replaced against moela.ops.moe.masked_cast's one-pass kernel, with GB/s of the bytes
    each must move (the kernel 6 bytes per element, the torch pair 10)."""
    from moela.ops.moe.masked_cast import masked_cast, masked_cast_reference

    shapes = [("small w13", 32, 1024, 1024), ("small w2", 32, 1024, 512), ("v3 w13", 32, 4096, 7168)]
    for name, e, n, k in shapes[:2] if quick else shapes:
        out = torch.randn(e, n, k, device="cuda").to(torch.bfloat16)
        counts = torch.randint(1, 100, (e,), device="cuda")
        counts[3] = 0
        want = masked_cast_reference(out, counts, torch.float32)
        assert torch.equal(masked_cast(out, counts, torch.float32), want)
        numel = out.numel()
        t_ref = bench(lambda: masked_cast_reference(out, counts, torch.float32))
        t_new = bench(lambda: masked_cast(out, counts, torch.float32))
        case = f"{name} E{e} {n}x{k}"
        row("wgrad_cast", case, "torch where + to(fp32)", t_ref, 10 * numel / t_ref / 1e6, "GB/s")
        row("wgrad_cast", case, "masked_cast kernel", t_new, 6 * numel / t_new / 1e6, "GB/s", vs_torch=t_ref / t_new)
        del out, want


WGRAD_CASES = [("small w13", 65536, 32, 4, 1024, 1024), ("small w2", 65536, 32, 4, 1024, 512),
               ("v2lite w13", 65536, 64, 6, 2816, 2048), ("v2lite w2", 65536, 64, 6, 2048, 1408)]


def wgrad_inputs(quick):
    """The weight gradient's inputs at the training step's shapes (WGRAD_CASES: name, T, E, top-k, N, K; the first
    two when quick), each under uniform and skewed expert loads, until the section's time is up: (name, T, E,
    top-k, N, K, layout, g [M_pad, N] the output gradient rows, x [M_pad, K] the input rows, load label). Padding
    rows are zeros, as the layer's are."""
    for name, t, e, k, n, kk in WGRAD_CASES[:2] if quick else WGRAD_CASES:
        for skew in (False, True):
            if out_of_time():
                return
            lay = build_layout(routing(t, e, k, skew), e)
            load = f"{'skew' if skew else 'unif'} max/mean {(lay.counts.max() / lay.counts.float().mean()).item():.2f}"
            valid = (lay.m_indices >= 0)[:, None]
            g = torch.randn(lay.m_pad, n, device="cuda", dtype=torch.bfloat16) * valid
            x = torch.randn(lay.m_pad, kk, device="cuda", dtype=torch.bfloat16) * valid
            yield name, t, e, k, n, kk, lay, g, x, load


def section_wgrad_bf16(quick):
    """The bf16 expert weight gradient at the training step's shapes (`small` and V2-Lite at 64k tokens a step), as
    the step calls it: out [E, N, K] fp32 = A[:, rows_e] @ B[:, rows_e]^T with both operands the row-major
    activations read transposed (token-strided). torch._grouped_mm (+ the fp32 masked cast), the same on
    token-contiguous copies (GEMM alone and with the copies), and moela's Triton kernel in expert order and with the
    experts with the most rows launched first; the forward's m-grouped GEMM of the same FLOPs for reference. Expert
    loads uniform and skewed (Zipf 1.2 popularity), since a k-grouped tile's work is its expert's row count."""
    for name, t, e, k, n, kk, lay, g, x, load in wgrad_inputs(quick):
        counts = lay.counts
        case = f"{name} E{e} T{t} N{n} K{kk} {load}"
        flops = 2 * t * k * n * kk
        offs32 = lay.offsets[1:].to(torch.int32)
        ref = torch._grouped_mm(g.t(), x, offs=offs32).float()
        ref[counts == 0] = 0
        nrm = ref.norm()

        def err(out):
            return ((out.float() - ref).norm() / nrm).item()

        w = torch.randn(e, n, kk, device="cuda", dtype=torch.bfloat16)
        t_f = bench(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs32))
        row("wgrad_bf16", case, "fwd-shaped m-grouped torch", t_f, flops / t_f / 1e9, "TFLOP/s")
        t_bf = bench(lambda: moe_gemm_library.torch_kgrouped(g.t(), x.t(), lay.offsets, counts, torch.float32))
        row("wgrad_bf16", case, "torch._grouped_mm + cast (step)", t_bf, flops / t_bf / 1e9, "TFLOP/s",
            rel_err=err(moe_gemm_library.torch_kgrouped(g.t(), x.t(), lay.offsets, counts, torch.float32)))
        t_g = bench(lambda: torch._grouped_mm(g.t(), x, offs=offs32))
        row("wgrad_bf16", case, "torch._grouped_mm alone", t_g, flops / t_g / 1e9, "TFLOP/s")
        gt, xt = g.t().contiguous(), x.t().contiguous()
        t_k = bench(lambda: torch._grouped_mm(gt, xt.t(), offs=offs32))
        row("wgrad_bf16", case, "torch, token-contiguous operands", t_k, flops / t_k / 1e9, "TFLOP/s",
            vs_step=t_bf / t_k)
        t_kc = bench(lambda: torch._grouped_mm(g.t().contiguous(), x.t().contiguous().t(), offs=offs32))
        row("wgrad_bf16", case, "torch, + the two copies", t_kc, flops / t_kc / 1e9, "TFLOP/s",
            vs_step=t_bf / t_kc)
        t_o = bench(lambda: kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32))
        row("wgrad_bf16", case, "triton", t_o, flops / t_o / 1e9, "TFLOP/s", vs_step=t_bf / t_o,
            rel_err=err(kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32)))
        order = torch.argsort(counts, descending=True, stable=True).to(torch.int32)
        t_oo = bench(lambda: kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32,
                                           order=torch.argsort(counts, descending=True).to(torch.int32)))
        row("wgrad_bf16", case, "triton, most rows first", t_oo, flops / t_oo / 1e9, "TFLOP/s",
            vs_step=t_bf / t_oo,
            rel_err=err(kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32, order=order)))
        t_ok = bench(lambda: kgrouped_gemm(gt, xt, lay.offsets, out_dtype=torch.float32, order=order))
        row("wgrad_bf16", case, "triton, token-contiguous operands", t_ok, flops / t_ok / 1e9, "TFLOP/s",
            vs_step=t_bf / t_ok)
        del g, x, gt, xt, ref, w


def section_wgrad_configs(quick):
    """The bf16 weight gradient's Triton kernel (as the step calls it: row-major activations read transposed, expert
    order, fp32 out) in each launch config of `gemm_triton.configs()`, at the step's shapes, uniform and skewed
    loads; then the table's config and the autotuner's pick (which runs once per shape: its first call times them
    all). The fastest config over both loads of a shape is what `gemm_triton.TUNED` should hold."""
    for name, t, _e, k, n, kk, lay, g, x, load in wgrad_inputs(quick):
        case = f"{name} N{n} K{kk} {load}"
        flops = 2 * t * k * n * kk
        ref = kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32, config=(128, 8, 4))
        for cfg in gemm_triton.configs():
            c = (cfg.kwargs["BN"], cfg.num_warps, cfg.num_stages)
            out = kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32, config=c)
            ms = bench(lambda c=c: kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32, config=c))
            row("wgrad_configs", case, f"BN {c[0]}, {c[1]} warps, {c[2]} stages", ms, flops / ms / 1e9, "TFLOP/s",
                max_diff_vs_first=(out - ref).abs().max().item())
        tuned = gemm_triton.TUNED.get(("kgrouped", n, kk, False))
        ms = bench(lambda: kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32))
        row("wgrad_configs", case, f"default (table: {tuned})", ms, flops / ms / 1e9, "TFLOP/s")
        mode = gemm_triton.TUNING["mode"]
        gemm_triton.TUNING["mode"] = "autotune"
        try:
            ms = bench(lambda: kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32))
            best = "; ".join(str(cfg) for key, cfg in _kgrouped_autotuned.cache.items()
                             if tuple(key[:3]) == (n, kk, False))
        finally:
            gemm_triton.TUNING["mode"] = mode
        row("wgrad_configs", case, f"autotuner (picked {best})", ms, flops / ms / 1e9, "TFLOP/s")
        del g, x, ref


def section_wgrad_fp8(quick):
    """The FP8 expert weight gradient (the Gluon k-grouped kernel the fp8_blockwise step runs) at the training step's
    shapes, uniform and skewed loads: its tiles dealt along the snake with the experts by load (the default), and
    along the snake in expert-index order; the bf16 torch._grouped_mm (statically scheduled) and moela's Triton
    bf16 kernel on the same rows for reference. The FP8 operands are quantized once, outside the timing (the layer's
    fused kernels produce them)."""
    from moela.ops.moe import gemm_fp8, gemm_fp8_gluon_kgrouped

    cases = [("small w13", 65536, 32, 4, 1024, 1024), ("small w2", 65536, 32, 4, 1024, 512),
             ("v2lite w13", 65536, 64, 6, 2816, 2048), ("v2lite w2", 65536, 64, 6, 2048, 1408)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, t, e, k, n, kk in cases[:2] if quick else cases:
        for skew in (False, True):
            if out_of_time():
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
            t_bf = bench(lambda: moe_gemm_library.torch_kgrouped(g.t(), x.t(), lay.offsets, counts, torch.float32))
            row("wgrad_fp8", case, "bf16 torch._grouped_mm + cast", t_bf, flops / t_bf / 1e9, "TFLOP/s")
            t_tr = bench(lambda: kgrouped_gemm(g.t(), x.t(), lay.offsets, out_dtype=torch.float32))
            row("wgrad_fp8", case, "bf16 triton", t_tr, flops / t_tr / 1e9, "TFLOP/s", vs_torch=t_bf / t_tr)
            ref = gemm_fp8.kgrouped_fp8(gq, gs, xq, xs, lay.offsets, out_dtype=torch.float32, impl="triton")
            nrm = ref.norm()
            got = gemm_fp8.kgrouped_fp8(gq, gs, xq, xs, lay.offsets, out_dtype=torch.float32, impl="gluon")
            t_g = bench(lambda: gemm_fp8.kgrouped_fp8(gq, gs, xq, xs, lay.offsets, out_dtype=torch.float32,
                                                      impl="gluon"))
            row("wgrad_fp8", case, "fp8 gluon, snake, experts by load", t_g, flops / t_g / 1e9, "TFLOP/s",
                vs_torch=t_bf / t_g, vs_triton_bf16=t_tr / t_g, rel_diff_triton_fp8=((got - ref).norm() / nrm).item())
            index_order = torch.arange(e, device="cuda", dtype=torch.int32)

            def in_index_order():
                out = torch.empty(e, n, kk, device="cuda", dtype=torch.float32)
                return gemm_fp8_gluon_kgrouped.kgrouped_fp8_ws(gq, gs, xq, xs, lay.offsets, out, sms,
                                                               order=index_order)

            t_i = bench(in_index_order)
            row("wgrad_fp8", case, "fp8 gluon, snake, index order", t_i, flops / t_i / 1e9, "TFLOP/s",
                vs_torch=t_bf / t_i, rel_diff_triton_fp8=((in_index_order() - ref).norm() / nrm).item())
            del g, x, gq, xq, ref, got


def section_layer(quick):
    cases = [("v3", 32, 8192, False), ("v3", 32, 8192, True), ("v2lite", 16, 16384, False)]
    for name, e, t, skew in cases[:1] if quick else cases:
        if out_of_time():
            return
        d, f, k = SHAPES[name]["d"], SHAPES[name]["f"], SHAPES[name]["k"]
        case = f"{name} E{e} T{t} {'skew' if skew else 'unif'}"
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ids = routing(t, e, k, skew)
        w = torch.softmax(torch.randn(t, k, device="cuda"), -1).requires_grad_()
        w13 = (torch.randn(e, 2 * f, d, device="cuda", dtype=torch.bfloat16) / d ** 0.5).requires_grad_()
        w2 = (torch.randn(e, d, f, device="cuda", dtype=torch.bfloat16) / f ** 0.5).requires_grad_()
        dy = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        flops = 18 * t * k * d * f

        def step(fn):
            def run():
                for p in (x, w, w13, w2):
                    p.grad = None
                fn().backward(dy)
            return run

        y_eager = eager_layer(x, ids, w, w13, w2).float()
        t_e = bench(step(lambda: eager_layer(x, ids, w, w13, w2)))
        row("layer", case, "eager per-expert loop bf16", t_e, flops / t_e / 1e9, "TFLOP/s")
        res = {}
        combos = [("bf16", "torch"), ("bf16", "triton"), ("fp8_blockwise", "triton")]
        if cublas_blockwise_available():
            combos.append(("fp8_blockwise", "cublas"))
        for recipe, backend in combos:
            y = moe_experts(x, ids, w, w13, w2, recipe=recipe, backend=backend).float()
            err = ((y - y_eager).norm() / y_eager.norm()).item()
            ms = bench(step(lambda: moe_experts(x, ids, w, w13, w2, recipe=recipe, backend=backend)))
            res[(recipe, backend)] = ms
            row("layer", case, f"{recipe} {backend}", ms, flops / ms / 1e9, "TFLOP/s", vs_eager=t_e / ms,
                vs_bf16=res[("bf16", "torch")] / ms, rel_err=err)
            torch.cuda.reset_peak_memory_stats()
            step(lambda: moe_experts(x, ids, w, w13, w2, recipe=recipe, backend=backend))()
            ROWS[-1]["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        if not skew and not out_of_time():
            fp8_breakdown(case, x, ids, w, w13, w2)
        del x, w13, w2


def section_check(quick):
    """Every backward intermediate of the fp8 path on the GPU against float64 math on the same quantized inputs."""
    from moela.ops.moe.quant import dequant_1x128, dequant_128x128

    t, d, f, e, k = (200, 256, 128, 4, 2) if quick else (3000, 1024, 512, 6, 3)
    dev = DEV
    x = torch.randn(t, d, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float16)
    ids = routing(t, e, k, True, dev)
    w13 = torch.randn(e, 2 * f, d, device=dev) / d ** 0.5
    w2 = torch.randn(e, d, f, device=dev) / f ** 0.5
    lay = build_layout(ids, e)
    valid = lay.m_indices >= 0

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    def deq_w(q, sc):
        return torch.stack([dequant_128x128(q[i], sc[i]) for i in range(q.shape[0])]).double()

    q2, s2, q2t = quant_weights(w2)
    ref = [quant_128x128(w2[i]) for i in range(w2.shape[0])]  # torch on the GPU (scales may differ by an ulp)
    ref_q = torch.stack([r[0] for r in ref])
    msg = []
    for by in ("quant", "torch"):
        q, sc, qt = quant_weights(w2, transpose_by=by)
        exact = torch.equal(qt.view(torch.uint8), q.transpose(1, 2).contiguous().view(torch.uint8))
        msg.append(f"{by}: {(q.float() != ref_q.float()).float().mean().item():.1e}, {exact}")
    print("check  w2 weight quantization (fraction of codes unlike torch's; transposed copy exact): " + "; ".join(msg))
    wgt = torch.rand(t, k, device=dev)
    o = torch.randn(lay.m_pad, d, device=dev, dtype=x.dtype)
    dy = torch.randn(t, d, device=dev, dtype=x.dtype)
    (cq, cs), (cqt, cst), _ = combine_bwd(dy, o, lay, wgt, quant=True)
    src = lay.src.long()
    do_ref = torch.where(valid[:, None], dy[(src.clamp_min(0) // k)].double()
                         * wgt.reshape(-1)[src.clamp_min(0)].double()[:, None], 0)
    print(f"check  combine bwd do rows {rel(dequant_1x128(cq, cs)[valid], do_ref[valid]):.2e} "
          f"cols {rel(dequant_1x128(cqt, cst).t()[valid], do_ref[valid]):.2e}")
    do = torch.randn(lay.m_pad, d, device=dev, dtype=x.dtype) * valid[:, None]
    (doq, dos), (doqt, dost) = quant_rows_cols(do)
    dact = mgrouped_gemm(doq, q2t, lay.m_indices, a_scale=dos, b_scale=s2.transpose(1, 2), out_dtype=x.dtype)
    w2d = deq_w(q2, s2)
    ref = torch.einsum("md,mdf->mf", dequant_1x128(doq, dos).double(), w2d[lay.m_indices.long().clamp_min(0)])
    print(f"check  dgrad fp8 rel err {rel(dact[valid], ref[valid]):.2e}  nan {torch.isnan(dact).any().item()}")
    h = torch.randn(lay.m_pad, 2 * f, device=dev, dtype=x.dtype) * valid[:, None]
    hh = h.float().requires_grad_()
    act = F.silu(hh[:, :f]) * hh[:, f:]
    (dh,) = torch.autograd.grad(act, hh, dact.float())
    (dhq, dhs), (dhqt, dhst), (aqt, ast) = swiglu_bwd(h, dact, lay.m_indices, quant=True)
    print(f"check  swiglu bwd dh {rel(dequant_1x128(dhq, dhs), dh):.2e} dhT {rel(dequant_1x128(dhqt, dhst).t(), dh):.2e}"
          f" actT {rel(dequant_1x128(aqt, ast).t(), act.detach()):.2e}")
    _, (xqt, xst) = quant_rows_cols(x, rowwise=False, src=lay.src, gather_div=k)
    xg = torch.where(valid[:, None], x[(lay.src.clamp_min(0) // k).long()], 0)
    print(f"check  gathered column quant x {rel(dequant_1x128(xqt, xst).t(), xg):.2e}")
    combos = [("fp8_blockwise", "triton"), ("bf16", "triton")]
    if cublas_blockwise_available():
        combos.insert(1, ("fp8_blockwise", "cublas"))
    for recipe, backend in combos:
        leaves = [v.detach().clone().requires_grad_() for v in (x, torch.rand(t, k, device=dev), w13, w2)]
        y = moe_experts(leaves[0], ids, *leaves[1:], recipe=recipe, backend=backend)
        y.backward(torch.ones_like(y))
        ex = [v.detach().double().requires_grad_() for v in leaves]
        ye = eager_layer(ex[0], ids, *ex[1:])
        ye.backward(torch.ones_like(ye))
        errs = " ".join(f"{n} {rel(a.grad, b.grad):.2e}" for n, a, b in zip(["dx", "dw", "dw13", "dw2"], leaves, ex))
        print(f"check  whole path {recipe} {backend}: y {rel(y, ye):.2e} {errs}")


def write_markdown(path, copy_gbs):
    lines = [f"# bench/moe.py results", "",
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}, triton {triton.__version__}; median of do_bench; copy ceiling {copy_gbs:.0f} GB/s",
             "", "| section | case | impl | ms | rate | notes |", "| --- | --- | --- | --- | --- | --- |"]
    for r in ROWS:
        extra = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                          if k not in ("section", "case", "impl", "ms", "metric", "unit"))
        lines.append(f"| {r['section']} | {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['metric']:.1f} {r['unit']} "
                     f"| {extra} |")
    open(path, "w").write("\n".join(lines) + "\n")


def best_configs():
    for name, kern in (("mgrouped", _mgrouped_autotuned), ("kgrouped", _kgrouped_autotuned)):
        for key, cfg in kern.cache.items():
            print(f"autotune {name} {key}: {cfg}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="check,layout,gemm,layer")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--out", default="bench/results/moe.md")
    args = ap.parse_args()
    DEADLINE[0] = time.time() + args.budget_s
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    for sec in args.sections.split(","):
        try:
            {"check": lambda: section_check(args.quick), "layout": lambda: section_layout(copy_gbs, args.quick),
             "permute_cfg": lambda: section_permute_configs(copy_gbs),
             "gemm": lambda: section_gemm(args.quick),
             "wgrad_cast": lambda: section_wgrad_cast(args.quick),
             "wgrad_bf16": lambda: section_wgrad_bf16(args.quick),
             "wgrad_configs": lambda: section_wgrad_configs(args.quick),
             "wgrad_fp8": lambda: section_wgrad_fp8(args.quick),
             "fp8": lambda: __import__("fp8").run(args.quick, False, 170),
             "layer": lambda: section_layer(args.quick)}[sec]()
        except Exception as exc:  # a failing section must not hide the others' numbers
            print(f"section {sec} failed: {type(exc).__name__}: {exc}")
        torch.cuda.empty_cache()
    best_configs()
    write_markdown(args.out, copy_gbs)
    print(open(args.out).read())


if __name__ == "__main__":
    main()
