"""Benchmark of the MoE path's data movement on one GPU: permute + align + 1x128 quantization (the whole op, its
parts, and as a CUDA graph) and the row + column quantization of the permuted rows, in GB/s and % of the measured
copy bandwidth, against an eager PyTorch baseline (sort / index_select, per-expert padding, a per-group
quantization loop) and torch.compile of that baseline's vectorized math. Every row reports how many e4m3 codes and
scales differ from the baseline's. DeepSeek-V3 (D 7168, top-8, E 32) and V2-Lite (D 2048, top-6, E 16) shapes,
uniform and skewed routings.

  python bench/moe_layout.py [--quick] [--budget-s 300]
Writes bench/results/moe_layout.md and moe_layout.json (`--out-dir` elsewhere).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.moelib import SHAPES, Rows, bench, code_diff, copy_bandwidth, e4m3, require_cuda, routing  # noqa: E402
from bench.results_io import add_out_dir, write_results  # noqa: E402
from moela.ops.moe.kernels.layout import count_and_scan  # noqa: E402
from moela.ops.moe.kernels.permute import build_layout, permute_align  # noqa: E402
from moela.ops.moe.kernels.quantize_triton import quant_rows_cols  # noqa: E402
from moela.ops.moe.kernels.triton_common import ALIGN  # noqa: E402
from moela.ops.moe.quant_spec import AMAX_EPS, FP8_MAX, inv_scale  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# eager baselines


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


# ---------------------------------------------------------------------------------------------------------------
# the kernels


def section_layout(rows: Rows, copy_gbs: float, quick: bool) -> None:
    """permute+align+quant (the whole op; its data pass, its counting launches, build_layout alone, the whole op
    replayed as a CUDA graph) and the row+column quantization of the permuted rows (the default kernel and the
    Triton one), against the eager and compiled baselines."""
    cases = [("v3", 32, 16384, False), ("v3", 32, 16384, True), ("v2lite", 16, 32768, False)]
    for name, e, t, skew in cases[:2] if quick else cases:
        if rows.out_of_time():
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
        rows.add("layout", case, "permute+align+quant ours", ours, gbs, "GB/s", pct_copy=100 * gbs / copy_gbs, **check)
        data = bench(lambda: permute_align(x, ids, e, layout=lay))  # the data pass alone, layout built before
        rows.add("layout", case, "  its data pass (layout given)", data, nbytes / data / 1e6, "GB/s",
            pct_copy=100 * nbytes / data / 1e6 / copy_gbs)
        lms = bench(lambda: count_and_scan(ids, e, ALIGN))
        rows.add("layout", case, "  its count + scan launches", lms, 0.0, "-")
        lms = bench(lambda: build_layout(ids, e))
        rows.add("layout", case, "  build_layout alone (3 launches)", lms, 0.0, "-")
        try:  # the op's GPU time without host launch overhead
            gms = triton.testing.do_bench_cudagraph(lambda: permute_align(x, ids, e), rep=40, return_mode="median")
            rows.add("layout", case, "  whole op as a CUDA graph", gms, nbytes / gms / 1e6, "GB/s",
                pct_copy=100 * nbytes / gms / 1e6 / copy_gbs)
        except Exception as exc:  # a diagnostic: must not stop the section
            print(f"cuda graph timing failed: {type(exc).__name__}: {exc}")
        eager = bench(lambda: eager_permute_quant(x, ids, e))
        rows.add("layout", case, "eager baseline", eager, nbytes / eager / 1e6, "GB/s", speedup=eager / ours)
        if name == "v3" and not skew and not rows.out_of_time():
            comp = torch.compile(vector_permute_quant)
            comp(x, ids, e)
            cms = bench(lambda: comp(x, ids, e))
            rows.add("layout", case, "torch.compile (vectorized)", cms, nbytes / cms / 1e6, "GB/s", speedup=cms / ours)
        xp, _, _ = permute_align(x, ids, e, quant=None, layout=lay)
        m = xp.shape[0]
        nb2 = m * d * 2 + 2 * m * d + 2 * m * d // 128 * 4
        (q1, s1), (qt1, st1) = quant_rows_cols(xp)
        (q2, s2), (qt2, st2) = eager_rows_cols(xp)
        rows_check = code_diff(q1, q2, s1, s2)
        cols_check = {f"col_{k}": v for k, v in code_diff(qt1, qt2, st1, st2).items()}
        ours = bench(lambda: quant_rows_cols(xp))
        gbs = nb2 / ours / 1e6
        rows.add("layout", case, "row+col quant ours", ours, gbs, "GB/s", pct_copy=100 * gbs / copy_gbs, **rows_check,
            **cols_check)
        (q3, s3), (qt3, st3) = quant_rows_cols(xp, impl="triton")
        same = torch.equal(q3.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s3, s1) and \
            torch.equal(qt3.view(torch.uint8), qt1.view(torch.uint8)) and torch.equal(st3, st1)
        tri = bench(lambda: quant_rows_cols(xp, impl="triton"))
        rows.add("layout", case, "row+col quant, Triton kernel (tile in registers)", tri, nb2 / tri / 1e6, "GB/s",
            pct_copy=100 * nb2 / tri / 1e6 / copy_gbs, same_bytes_as_ours=same)
        eager = bench(lambda: eager_rows_cols(xp))
        rows.add("layout", case, "row+col eager baseline", eager, nb2 / eager / 1e6, "GB/s", speedup=eager / ours)
        if name == "v3" and not skew and not rows.out_of_time():
            comp = torch.compile(vector_rows_cols)
            comp(xp)
            cms = bench(lambda: comp(xp))
            rows.add("layout", case, "row+col compile (vectorized)", cms, nb2 / cms / 1e6, "GB/s", speedup=cms / ours)
        del x, xp, q, rq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the V3 cases only")
    ap.add_argument("--budget-s", type=float, default=300)
    add_out_dir(ap)
    args = ap.parse_args()
    require_cuda("moe_layout")
    torch.manual_seed(0)
    rows = Rows(args.budget_s)
    section_layout(rows, copy_bandwidth(rows), args.quick)
    note = "Median of do_bench over >= 15 calls; pct_copy: % of the device's measured copy bandwidth."
    md = write_results("moe_layout", "MoE permute and quantization kernels", rows.markdown(note), rows.rows,
                       out_dir=args.out_dir)
    print(md.read_text())


if __name__ == "__main__":
    main()
