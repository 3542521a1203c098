"""Where the time of one attention forward + backward goes, kernel by kernel: the plain call against the same call
with the z-loss (the lse returned and given a gradient) and with ALiBi, for the flash-attn-4 backend and moela's
Triton kernels, in one process on one GPU.

bench/attention.py measures the z-loss and ALiBi overheads as whole fwd+bwd times; this script says which kernels
they come from (or that they come from no kernel: the gap between the sum of the kernels and the timed call is
launch and host time). Cases are bench/attention.py's: the lognormal packing (40 documents, 65k tokens) and
B=2 S=8192, 192/128, 16 heads, bf16, causal.

Per case and implementation: the do_bench median of fwd+bwd (ms), then `--iters` calls under torch.profiler (CUDA
activity only) with each kernel's device time per call, the sum of the kernels per call, and the difference of each
kernel against the plain call of the same implementation. Writes bench/results/attention_kernels.md and .json
(`--out-dir`) and prints the tables.

Usage (GPU): python bench/attention_kernels.py [--iters 10] [--impls flash,triton] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.attention import LOGNORMAL, Case, lognormal_lengths, make_inputs, moela_impl  # noqa: E402
from bench.results_io import add_out_dir, write_results  # noqa: E402


def cases() -> list[tuple[str, list[Case]]]:
    """(layout name, [plain, z-loss, ALiBi]) per layout."""
    lognormal = lognormal_lengths()
    out = []
    for name, lens in ((LOGNORMAL, lognormal), ("B=2 S=8192", [8192] * 2)):
        out.append((name, [Case(name, lens, feature=f) for f in ("plain", "zloss", "alibi")]))
    return out


def fwd_bwd_fn(case: Case, backend: str):
    x = make_inputs(case)
    fwd, grads, _ = moela_impl(backend)(case, x)

    def call():
        outs = fwd()
        return torch.autograd.grad(list(outs), (x.q, x.k, x.v), list(grads))
    return call


def kernel_times(call, iters: int) -> dict[str, float]:
    """Device microseconds per call by kernel name, over `iters` profiled calls (after the caller's warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    cuda = torch.autograd.DeviceType.CUDA
    for e in prof.events():
        if e.device_type == cuda and not getattr(e, "is_user_annotation", False):
            totals[e.name] += (e.time_range.end - e.time_range.start) / iters
    return dict(totals)


def short(name: str) -> str:
    """A readable kernel name: flash-attn-4's CuTe kernels carry their class name in a long mangled string."""
    for key in ("FlashAttentionForward", "FlashAttentionBackwardPreprocess", "FlashAttentionBackwardPostprocess",
                "FlashAttentionBackward"):
        if key in name:
            return key
    return name[:70]


def main() -> None:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--impls", default="flash,triton")
    add_out_dir(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/attention_kernels.py profiles GPU kernels: run it on a CUDA machine")
    rows = []
    lines = [f"Device microseconds per call (mean over {args.iters} profiled calls after warm-up); `timed` is the "
             f"do_bench median of the whole call, so timed - kernels is time the device spent waiting for "
             f"launches.", ""]
    for layout, trio in cases():
        for impl in args.impls.split(","):
            lines += [f"## {layout}, {impl}", ""]
            per_feature, timed, errors = {}, {}, {}
            for case in trio:
                try:
                    call = fwd_bwd_fn(case, impl)
                    timed[case.feature] = do_bench(call, warmup=25, rep=200, return_mode="median") * 1e3
                    per_feature[case.feature] = kernel_times(call, args.iters)
                except Exception as e:  # noqa: BLE001 - a backend that cannot run a feature is a row, not a crash
                    errors[case.feature] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    lines.append(f"- {case.feature}: not run ({errors[case.feature]})")
            rows.append(dict(layout=layout, impl=impl, timed_us=timed, kernels_us=per_feature,
                             errors=errors))
            if not per_feature:
                lines.append("")
                continue
            features = list(per_feature)
            names = sorted({short(n) for f in features for n in per_feature[f]},
                           key=lambda n: -max(sum(v for k, v in per_feature[f].items() if short(k) == n)
                                              for f in features))
            lines += ["| kernel | " + " | ".join(f"{f} us" for f in features) + " | "
                      + " | ".join(f"{f} - plain" for f in features if f != "plain") + " |",
                      "| --- |" + " ---: |" * (2 * len(features) - 1)]

            def us(f, n):
                return sum(v for k, v in per_feature[f].items() if short(k) == n)
            for n in names:
                cells = [f"{us(f, n):.1f}" for f in features]
                deltas = [f"{us(f, n) - us('plain', n):+.1f}" for f in features if f != "plain" and "plain" in
                          per_feature]
                lines.append(f"| `{n}` | " + " | ".join(cells) + " | " + " | ".join(deltas) + " |")
            sums = {f: sum(per_feature[f].values()) for f in features}
            lines.append("| **kernels** | " + " | ".join(f"{sums[f]:.1f}" for f in features) + " | " + " | ".join(
                f"{sums[f] - sums['plain']:+.1f}" for f in features if f != "plain" and "plain" in sums) + " |")
            lines.append("| **timed** | " + " | ".join(f"{timed[f]:.1f}" for f in features) + " | " + " | ".join(
                f"{timed[f] - timed['plain']:+.1f} ({100 * (timed[f] / timed['plain'] - 1):+.1f}%)"
                for f in features if f != "plain" and "plain" in timed) + " |")
            lines.append("")
            print("\n".join(lines[-len(names) - 5:]), flush=True)
    md = write_results("attention_kernels", "Attention fwd+bwd by kernel: plain vs z-loss vs ALiBi", "\n".join(lines),
                       dict(iters=args.iters, rows=rows), out_dir=args.out_dir)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
