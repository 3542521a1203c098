"""Benchmark of the MoE expert layer on one GPU (`moe_experts` forward + backward), candidate and baselines side by
side on the same inputs: each recipe and backend (bf16 on torch._grouped_mm and on Triton; FP8 on the default
kernels, on the Triton kernels where Gluon is the default, and on cuBLAS per expert) against an eager per-expert
loop, in TFLOP/s with the output's relative error and peak memory; then each stage of the FP8 path alone (where the
layer's time goes). DeepSeek-V3 (D 7168, F 2048, top-8, E 32) and V2-Lite (D 2048, F 1408, top-6, E 16) shapes.
`--check` first prints GPU diagnostics: the relative errors vs float64 of the backward's intermediates and of the
whole path per recipe and backend (the `-m gpu` tests assert the same paths). The kernels' own benchmarks:
bench/moe_layout.py (permute, quantization), bench/moe_gemm.py (grouped GEMMs), bench/fp8.py (FP8 GEMMs, linear).

  python bench/moe.py [--quick] [--check] [--budget-s 400]
Writes bench/results/moe.md and moe.json (`--out-dir` elsewhere).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.moelib import SHAPES, Rows, bench, eager_layer, rel, require_cuda, routing  # noqa: E402
from bench.results_io import add_out_dir, write_results  # noqa: E402
from moela.ops.moe import moe_experts  # noqa: E402
from moela.ops.moe.kernels import gemm_fp8_gluon_mgrouped  # noqa: E402
from moela.ops.moe.kernels.combine import combine_bwd, unpermute_combine  # noqa: E402
from moela.ops.moe.kernels.gemm_fp8_triton import kgrouped_fp8, mgrouped_fp8  # noqa: E402
from moela.ops.moe.kernels.gemm_libraries import cublas_blockwise_available  # noqa: E402
from moela.ops.moe.kernels.permute import build_layout, permute_align  # noqa: E402
from moela.ops.moe.kernels.quantize_triton import quant_rows_cols, quant_weights  # noqa: E402
from moela.ops.moe.kernels.swiglu import swiglu_bwd, swiglu_fwd  # noqa: E402
from moela.ops.moe.quant_spec import dequant_1x128, dequant_128x128, quant_128x128  # noqa: E402


def fp8_breakdown(rows: Rows, case, x, ids, w, w13, w2):
    """Time each stage of the fp8 path alone on the same inputs (where the layer's time goes)."""
    e, k = w13.shape[0], ids.shape[1]
    x, w, w13, w2 = x.detach(), w.detach(), w13.detach(), w2.detach()
    lay = build_layout(ids, e)
    xq, xs, _ = permute_align(x, ids, e, layout=lay)
    w13q, w13s, w13qt = quant_weights(w13)
    w2q, w2s, w2qt = quant_weights(w2)
    h = mgrouped_fp8(xq, xs, w13q, w13s, lay.m_indices, lay.offsets)
    aq, as_ = swiglu_fwd(h, lay.m_indices, quant=True)
    o = mgrouped_fp8(aq, as_, w2q, w2s, lay.m_indices, lay.offsets)
    dy = torch.randn_like(x)
    (doq, dos), (doqt, dost), _ = combine_bwd(dy, o, lay, w, quant=True)
    dact = mgrouped_fp8(doq, dos, w2qt, w2s.transpose(1, 2), lay.m_indices, lay.offsets)
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
        "gemm1 fwd": lambda: mgrouped_fp8(xq, xs, w13q, w13s, lay.m_indices, lay.offsets),
        "swiglu fwd+quant": lambda: swiglu_fwd(h, lay.m_indices, quant=True),
        "gemm2 fwd": lambda: mgrouped_fp8(aq, as_, w2q, w2s, lay.m_indices, lay.offsets),
        "unpermute_combine": lambda: unpermute_combine(o, lay, w, x.dtype),
        "combine bwd+row/col quant": lambda: combine_bwd(dy, o, lay, w, quant=True),
        "gemm2 dgrad": lambda: mgrouped_fp8(doq, dos, w2qt, w2s.transpose(1, 2), lay.m_indices, lay.offsets),
        "swiglu bwd+quants": lambda: swiglu_bwd(h, dact, lay.m_indices, quant=True),
        "swiglu bwd+quants (Triton kernel)": lambda: swiglu_bwd(h, dact, lay.m_indices, quant=True, impl="triton"),
        "swiglu bwd bf16": lambda: swiglu_bwd(h, dact16, lay.m_indices, quant=False),
        "gemm2 wgrad": lambda: kgrouped_fp8(doqt, dost, aqt, ast, lay.offsets),
        "gemm1 dgrad": lambda: mgrouped_fp8(dhq, dhs, w13qt, w13s.transpose(1, 2), lay.m_indices, lay.offsets),
        "x column quant (gather)": lambda: quant_rows_cols(x, rowwise=False, src=lay.src, gather_div=k),
        "x column quant (gather, Triton kernel)": lambda: quant_rows_cols(x, rowwise=False, src=lay.src,
                                                                            gather_div=k, impl="triton"),
        "gemm1 wgrad": lambda: kgrouped_fp8(dhqt, dhst, xqt, xst, lay.offsets),
        "dx gather-sum": lambda: unpermute_combine(dxp, lay, None, x.dtype),
    }
    for name, fn in stages.items():
        rows.add("stage", case, name, bench(fn), 0.0, "-")


def section_layer(rows: Rows, quick: bool) -> None:
    """The whole expert layer forward + backward per recipe and backend (FP8 also on the Triton kernels where the
    Gluon ones are the default) vs the eager per-expert loop, with peak memory and the output's relative error; then
    each stage of the FP8 path alone (uniform cases)."""
    cases = [("v3", 32, 8192, False), ("v3", 32, 8192, True), ("v2lite", 16, 16384, False)]
    for name, e, t, skew in cases[:1] if quick else cases:
        if rows.out_of_time():
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
        combos = [("bf16", "torch_triton", {}), ("bf16", "triton", {}), ("fp8_blockwise", "triton", {})]
        if gemm_fp8_gluon_mgrouped.available(x.device):
            combos.append(("fp8_blockwise", "triton", dict(fp8_gemm="triton", fp8_wgrad="triton")))
        if cublas_blockwise_available():
            combos.append(("fp8_blockwise", "cublas", {}))
        t_e = bench(step(lambda: eager_layer(x, ids, w, w13, w2)))
        rows.add("layer", case, "eager per-expert loop bf16", t_e, flops / t_e / 1e9, "TFLOP/s")
        t_bf16 = None
        for recipe, backend, kernels in combos:
            def call():
                return moe_experts(x, ids, w, w13, w2, recipe=recipe, backend=backend, **kernels)

            err = rel(call().float(), y_eager)
            ms = bench(step(call))
            t_bf16 = t_bf16 or ms
            label = f"{recipe} {backend}" + "".join(f" {k}={v}" for k, v in kernels.items())
            torch.cuda.reset_peak_memory_stats()
            step(call)()
            rows.add("layer", case, label, ms, flops / ms / 1e9, "TFLOP/s", vs_eager=t_e / ms, vs_bf16=t_bf16 / ms,
                     rel_err=err, peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30)
        if not skew and not rows.out_of_time():
            fp8_breakdown(rows, case, x, ids, w, w13, w2)
        del x, w13, w2


def section_check(quick: bool) -> None:
    """Printed: every backward intermediate of the fp8 path on the GPU against float64 math on the same quantized
    inputs, and the whole path per recipe and backend against float64."""
    t, d, f, e, k = (200, 256, 128, 4, 2) if quick else (3000, 1024, 512, 6, 3)
    dev = "cuda"
    x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
    ids = routing(t, e, k, True, dev)
    w13 = torch.randn(e, 2 * f, d, device=dev) / d ** 0.5
    w2 = torch.randn(e, d, f, device=dev) / f ** 0.5
    lay = build_layout(ids, e)
    valid = lay.m_indices >= 0

    def deq_w(q, sc):
        return torch.stack([dequant_128x128(q[i], sc[i]) for i in range(q.shape[0])]).double()

    q2, s2, q2t = quant_weights(w2)
    ref_q = torch.stack([quant_128x128(w2[i])[0] for i in range(w2.shape[0])])  # torch (scales may differ by an ulp)
    exact = torch.equal(q2t.view(torch.uint8), q2.transpose(1, 2).contiguous().view(torch.uint8))
    unlike = (q2.float() != ref_q.float()).float().mean().item()
    print(f"check  w2 weight quantization: codes unlike torch's {unlike:.1e}, transposed copy exact {exact}")
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
    dact = mgrouped_fp8(doq, dos, q2t, s2.transpose(1, 2), lay.m_indices, lay.offsets, out_dtype=x.dtype)
    w2d = deq_w(q2, s2)
    ref = torch.einsum("md,mdf->mf", dequant_1x128(doq, dos).double(), w2d[lay.m_indices.long().clamp_min(0)])
    used = int(lay.offsets[-1])  # rows past the routed ones are not written
    print(f"check  dgrad fp8 rel err {rel(dact[valid], ref[valid]):.2e}  nan {torch.isnan(dact[:used]).any().item()}")
    h = torch.randn(lay.m_pad, 2 * f, device=dev, dtype=x.dtype) * valid[:, None]
    hh = h.float().requires_grad_()
    act = F.silu(hh[:, :f]) * hh[:, f:]
    (dh,) = torch.autograd.grad(act, hh, torch.where(valid[:, None], dact.float(), 0))  # rows past `used`: unwritten
    (dhq, dhs), (dhqt, dhst), (aqt, ast) = swiglu_bwd(h, dact, lay.m_indices, quant=True)
    print(f"check  swiglu bwd dh {rel(dequant_1x128(dhq, dhs), dh):.2e} "
          f"dhT {rel(dequant_1x128(dhqt, dhst).t(), dh):.2e} actT {rel(dequant_1x128(aqt, ast).t(), act.detach()):.2e}")
    _, (xqt, xst) = quant_rows_cols(x, rowwise=False, src=lay.src, gather_div=k)
    xg = torch.where(valid[:, None], x[(lay.src.clamp_min(0) // k).long()], 0)
    print(f"check  gathered column quant x {rel(dequant_1x128(xqt, xst).t(), xg):.2e}")
    combos = [("fp8_blockwise", "triton"), ("bf16", "triton"), ("bf16", "torch_triton")]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the uniform V3 case only (and a small --check)")
    ap.add_argument("--check", action="store_true", help="print the GPU diagnostics first")
    ap.add_argument("--budget-s", type=float, default=400)
    add_out_dir(ap)
    args = ap.parse_args()
    require_cuda("moe")
    torch.manual_seed(0)
    rows = Rows(args.budget_s)
    if args.check:
        section_check(args.quick)
    section_layer(rows, args.quick)
    note = ("Median of do_bench over >= 15 forward + backward calls; FLOPs 18 * T * K * D * F; vs_bf16: the bf16 "
            "torch_triton row's time over the row's; stage rows: each FP8 stage alone on the same inputs.")
    md = write_results("moe", "MoE expert layer", rows.markdown(note), rows.rows, out_dir=args.out_dir)
    print(md.read_text())


if __name__ == "__main__":
    main()
