"""Output head + cross-entropy, forward and backward, on one GPU: moela's chunked head against its earlier chunking
and against the unfused head a user would write, same inputs, one process. Writes bench/results/head_loss.json
(rows: case, impl, ms, tflops, peak_extra_gib, rel_err_dh, rel_err_dw) and head_loss.md.

Cases: T tokens x hidden D x vocabulary V, bf16 autocast over float32 h and a float32 weight (the trainer's
setting): `small` (65,536 x 1,024 x 4,096), V2-Lite (65,536 x 2,048 x 102,400) and a DeepSeek-V3-sized head on
fewer tokens (16,384 x 7,168 x 129,280). Implementations:
  chunked                  moela's `linear_cross_entropy` as shipped: chunks of max(2^26 / V, 4096) rows, the weight
                           gradient accumulated in float32 by the GEMM itself (`add_product_`)
  chunked, 2^26/V rows     the same with the earlier chunk size (MIN_CHUNK_ROWS = 1: 655 rows at V = 102,400)
  chunked, 2^26/V rows, add pass   and the earlier accumulation: each chunk's [V, D] product written in bf16 and
                           added to the float32 accumulator by a second kernel (the earlier code also cast the
                           [V, D] weight once per chunk; not reproduced here)
  unfused                  `F.cross_entropy(F.linear(h, w), labels, reduction="sum")` (bf16 logits, float32
                           softmax in autograd)
TFLOP/s counts the three GEMMs (6 T D V). Errors: norm-wise, of dh and dw against the unfused head's.

  python bench/head_loss.py [--cases small,v2-lite,v3] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moela.ops.linear_cross_entropy as lce  # noqa: E402
from bench.results_io import add_out_dir, write_results  # noqa: E402

CASES = {"small": (65536, 1024, 4096), "v2-lite": (65536, 2048, 102400), "v3": (16384, 7168, 129280)}
ROWS: list[dict] = []


@contextlib.contextmanager
def setting(min_rows: int | None = None, addmm_out_dtype: bool | None = None):
    """lce's chunk floor and in-GEMM accumulation set for the duration."""
    saved = lce.MIN_CHUNK_ROWS, lce._ADDMM_OUT_DTYPE
    lce.MIN_CHUNK_ROWS = saved[0] if min_rows is None else min_rows
    lce._ADDMM_OUT_DTYPE = saved[1] if addmm_out_dtype is None else addmm_out_dtype
    try:
        yield
    finally:
        lce.MIN_CHUNK_ROWS, lce._ADDMM_OUT_DTYPE = saved


def run_case(name: str) -> None:
    t, d, v = CASES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(t, d, device="cuda", generator=g, requires_grad=True)
    w = (torch.randn(v, d, device="cuda", generator=g) * d ** -0.5).requires_grad_()
    labels = torch.randint(0, v, (t,), device="cuda", generator=g)

    def chunked():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lce.linear_cross_entropy(h, w, labels, backend="chunked")
        loss.backward()

    def unfused():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(F.linear(h, w), labels, reduction="sum")
        loss.backward()

    impls = [("chunked", chunked, {}), ("chunked, 2^26/V rows", chunked, dict(min_rows=1)),
             ("chunked, 2^26/V rows, add pass", chunked, dict(min_rows=1, addmm_out_dtype=False)),
             ("unfused", unfused, {})]
    grads, rows = {}, []
    for label, fn, knobs in reversed(impls):  # the unfused head first: its gradients are the comparison
        with setting(**knobs):
            try:
                h.grad = w.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fn()
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
                grads[label] = (h.grad.clone(), w.grad.clone())

                def step(fn=fn):
                    h.grad = w.grad = None
                    fn()
                ms = do_bench(step, warmup=3, rep=300, return_mode="median")
            except torch.OutOfMemoryError:
                print(f"{name} {label}: out of memory")
                continue
        ref = grads.get("unfused")
        errs = [None, None] if ref is None or label == "unfused" else [
            ((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(grads[label], ref)]
        row = dict(case=f"{name} T{t} D{d} V{v}", impl=label, ms=round(ms, 3),
                   tflops=round(6 * t * d * v / ms / 1e9, 1), peak_extra_gib=round(peak, 2),
                   rel_err_dh=errs[0], rel_err_dw=errs[1])
        rows.insert(0, row)
        print(f"{row['case']:32s} {label:34s} {ms:9.3f} ms {row['tflops']:7.1f} TFLOP/s  peak +{peak:.2f} GiB"
              + ("" if errs[0] is None else f"  err dh {errs[0]:.1e} dw {errs[1]:.1e}"), flush=True)
        torch.cuda.empty_cache()
    ROWS.extend(rows)  # in the order of `impls`


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    add_out_dir(ap)
    args = ap.parse_args()
    for name in args.cases.split(","):
        run_case(name)
    lines = ["bf16 autocast, float32 h and weight; median of do_bench.", "",
             "| case | impl | ms | TFLOP/s (3 GEMMs) | peak extra GiB | rel err dh / dw vs unfused |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in ROWS:
        err = "" if r["rel_err_dh"] is None else f"{r['rel_err_dh']:.1e} / {r['rel_err_dw']:.1e}"
        lines.append(f"| {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['tflops']:.1f} | {r['peak_extra_gib']:.2f} | "
                     f"{err} |")
    write_results("head_loss", "Output head + cross-entropy, forward + backward", "\n".join(lines), ROWS,
                  out_dir=args.out_dir)


if __name__ == "__main__":
    main()
