"""What the MoE benchmarks (bench/moe.py, moe_layout.py, moe_gemm.py) share: timing, routings, the rows they
collect and their Markdown table, the eager baselines' FP8 codes and the eager per-expert layer. GPU only: every
script times CUDA kernels."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moela.ops.moe.quant_spec import FP8_MAX  # noqa: E402

SHAPES = {"v3": dict(d=7168, f=2048, k=8), "v2lite": dict(d=2048, f=1408, k=6)}  # DeepSeek-V3 / V2-Lite experts


def require_cuda(script: str) -> None:
    if not torch.cuda.is_available():
        sys.exit(f"bench/{script}.py times CUDA kernels: run it on a GPU machine")


def bench(fn) -> float:
    """Median ms of do_bench over at least ~15 timed calls: do_bench's warmup and rep are milliseconds, so 10 / 40 ms
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


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class Rows:
    """The timed rows of one script (section, case, impl, ms, metric + unit, extra notes), under a time budget."""

    def __init__(self, budget_s: float):
        self.rows: list[dict] = []
        self.deadline = time.time() + budget_s

    def out_of_time(self) -> bool:
        return time.time() > self.deadline

    def add(self, section, case, impl, ms, metric, unit, **extra):
        self.rows.append(dict(section=section, case=case, impl=impl, ms=ms, metric=metric, unit=unit, **extra))
        print(f"{section:7s} {case:34s} {impl:26s} {ms:9.3f} ms {metric:9.1f} {unit}", flush=True)

    def markdown(self, note: str) -> str:
        """`note`, then the rows as one table (the results file's body)."""
        table = [note, "", "| section | case | impl | ms | rate | notes |", "| --- | --- | --- | ---: | ---: | --- |"]
        for r in self.rows:
            extra = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                              if k not in ("section", "case", "impl", "ms", "metric", "unit"))
            table.append(f"| {r['section']} | {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['metric']:.1f} "
                         f"{r['unit']} | {extra} |")
        return "\n".join(table)


def e4m3(v, inv):
    """The recipe's codes: v * inv (inv = (1 / amax) * 448), clamped, cast to e4m3 (moela.ops.moe.quant_spec)."""
    return (v * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def code_diff(q, rq, s, rs):
    """How far our e4m3 codes and scales are from the eager baseline's (reported with the timing row instead of
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


def eager_layer(x, ids, w, w13, w2):
    """The expert layer as a per-expert loop of torch ops (the baseline, and in float64 the reference)."""
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


def copy_bandwidth(rows: Rows) -> float:
    """The device's copy bandwidth (read + write, GB/s): the ceiling of the memory-bound kernels."""
    a = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    gbs = 2 * a.numel() / ms / 1e6
    rows.add("ceiling", "d2d copy 2 GiB", "torch copy_", ms, gbs, "GB/s")
    return gbs
