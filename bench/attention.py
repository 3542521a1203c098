"""Benchmark `mla_attention`'s backends side by side in one process: moela's Triton kernels (and their schedule
variants), FlashAttention-4 (the `flash` backend, flash-attn-4) and cuDNN (PyTorch SDPA), on the cases that
`moela/ops/attention/auto.py`'s table ranks the backends by.

Cases (16 heads, bf16, causal; 192/128 unless the name says 128/128; --quick runs the ones marked q):
  q  B=2 S=8192, B=8 S=2048; B=4 S=4096, B=1 S=16384 (S=2k..16k at 16k tokens)
  q  packed, 185 Zipf-like documents, 55k tokens (lengths 8192 / rank^s, shuffled); packed, 40 lognormal documents,
     65k tokens (median ~1.2k, sigma 1, scaled to 65536 tokens)
  q  128/128: B=2 S=8192 and the lognormal packing
  q  z-loss (the lse returned, a gradient on it): the lognormal packing; B=2 S=8192
  q  ALiBi: B=2 S=8192; the lognormal packing
  q  96/64 (the `small` model's heads): 40 lognormal documents of at most 4096 tokens, 65k tokens
Implementations: `triton` (moela's kernels, each phase's `auto` choice), `flash` (flash-attn-4 through moela's
backend), `cudnn` (SDPA's cuDNN backend on a [B, H, S, D] copy: equal lengths, no lse, no ALiBi; "-" elsewhere), and
the kernel variants (`VARIANTS`: one phase of the `triton` backend named on its Triton or its Gluon kernel, or every
phase on Triton's; `mla_attention`'s forward_kernel / dq_kernel / dkdv_kernel) as extra rows on the cases marked for
them, so one run times them all (the backward's kernels also on the 96/64 case).

Per row: fwd and fwd+bwd time (`triton.testing.do_bench` medians), TFLOP/s with BENCHMARKS.md's counts (fwd 2 H
sum(L^2) (Dqk + Dv), bwd 2 H sum(L^2) (3 Dqk + 2 Dv), halved for causal), the first call's wall time (flash-attn-4
compiles its CuTe DSL kernels on first use, Triton its kernels unless cached: that is where the JIT time shows), and
the largest difference of out, lse, dq, dk, dv from the case's `triton` row, relative to that tensor's largest
magnitude. Writes bench/results/attention.md and attention.json (rows: case, impl, fwd_tflops, fwd_bwd_tflops,
...; `--out-dir`); prints, last, the rows of `auto.MEASURED` this run measured, ready to paste.

flash-attn-4's compiled kernels are kept on disk (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 unless set otherwise), so
a run after the GPU tests reuses theirs.

Usage: python bench/attention.py [--quick] [--only SUBSTR,...] [--impls triton,flash,cudnn,variants]
                                 [--variants SUBSTR,...] [--budget SECONDS] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.results_io import add_out_dir, write_results  # noqa: E402
from moela.ops.attention import api as attention_api  # noqa: E402
from moela.ops.attention import mla_attention  # noqa: E402
from moela.ops.attention.flash import flash_problem  # noqa: E402
from moela.ops.attention.kernels.triton_common import CONFIGS  # noqa: E402

DEV = "cuda"
DT = torch.bfloat16
H = 16
LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


@dataclasses.dataclass
class Case:
    name: str
    lens: list[int]
    d_qk: int = 192
    d_v: int = 128
    feature: str = "plain"  # "plain", "zloss" or "alibi"
    quick: bool = True
    variants: bool = False  # time the kernel variants too

    @property
    def layout(self) -> str:
        return "equal" if len(set(self.lens)) == 1 else "packed"


def zipf_lengths(n: int = 185, total: int = 55000, longest: int = 8192, seed: int = 0) -> list[int]:
    """n lengths longest / rank^s (at least 16), s chosen so they sum to ~total; shuffled."""
    lo, hi = 0.0, 4.0
    for _ in range(60):
        s = (lo + hi) / 2
        lens = [max(16, round(longest / r ** s)) for r in range(1, n + 1)]
        lo, hi = (lo, s) if sum(lens) < total else (s, hi)
    g = torch.Generator().manual_seed(seed)
    return [lens[i] for i in torch.randperm(n, generator=g).tolist()]


def lognormal_lengths(n: int = 40, total: int = 65536, seed: int = 0, longest: int | None = None) -> list[int]:
    """n lognormal lengths (sigma 1), scaled to sum to total, at least 16; with `longest`, the longer ones cut to it
    and what they lose spread over the shortest (a model's context)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.empty(n).log_normal_(0.0, 1.0, generator=g)
    lens = [max(16, int(x)) for x in (raw / raw.sum() * total).tolist()]
    lens[lens.index(max(lens))] += total - sum(lens)
    if longest is not None:
        spare = sum(max(0, x - longest) for x in lens)
        lens = [min(x, longest) for x in lens]
        while spare:
            i = lens.index(min(lens))
            add = min(spare, longest - lens[i])
            lens[i] += add
            spare -= add
    return lens


ZIPF = "packed, 185 Zipf-like documents, 55k tokens"
LOGNORMAL = "packed, 40 lognormal documents, 65k tokens"
SMALL = "96/64 packed, 40 lognormal documents <= 4096, 65k tokens"


def all_cases() -> list[Case]:
    zipf, lognormal = zipf_lengths(), lognormal_lengths()
    return [
        Case("B=2 S=8192", [8192] * 2, variants=True),
        Case("B=8 S=2048", [2048] * 8),
        Case("B=4 S=4096", [4096] * 4, quick=False),
        Case("B=1 S=16384", [16384], quick=False),
        Case(ZIPF, zipf, variants=True),
        Case(LOGNORMAL, lognormal, variants=True),
        Case("128/128 B=2 S=8192", [8192] * 2, d_qk=128, variants=True),
        Case(f"128/128 {LOGNORMAL}", lognormal, d_qk=128, variants=True),
        Case(f"z-loss {LOGNORMAL}", lognormal, feature="zloss"),
        Case("z-loss B=2 S=8192", [8192] * 2, feature="zloss", quick=False),
        Case("ALiBi B=2 S=8192", [8192] * 2, feature="alibi"),
        Case(f"ALiBi {LOGNORMAL}", lognormal, feature="alibi", quick=False),
        Case(SMALL, lognormal_lengths(longest=4096), d_qk=96, d_v=64, variants=True),
    ]


# kernel variants: mla_attention's kernel choices for the `triton` backend (moela.ops.attention.phases)
VARIANTS: dict[str, dict[str, str]] = {
    **{f"triton, {kernel} {phase}": {f"{key}_kernel": kernel} for phase, key in
       (("fwd", "forward"), ("dq", "dq"), ("dkdv", "dkdv")) for kernel in ("triton", "gluon")},
    "triton, all-Triton kernels": dict(forward_kernel="triton", dq_kernel="triton", dkdv_kernel="triton"),
}


class RowTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise RowTimeout()


def guarded(seconds: int, fn, *args):
    """fn(*args), or a string saying why there is no result (a failing peer is a result, not a crash)."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        return fn(*args)
    except RowTimeout:
        return f"timeout {seconds}s"
    except Exception as e:
        traceback.print_exc()
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:90] if str(e) else ''}"
    finally:
        signal.alarm(0)
        torch.cuda.synchronize()


def flops(case: Case) -> tuple[float, float]:
    pairs = sum(n * n for n in case.lens) * 0.5  # causal
    return 2 * H * pairs * (case.d_qk + case.d_v), 2 * H * pairs * (3 * case.d_qk + 2 * case.d_v)


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    dlse: torch.Tensor
    cu: torch.Tensor
    slopes: torch.Tensor | None


def make_inputs(case: Case, seed: int = 0) -> Inputs:
    torch.manual_seed(seed)
    t = sum(case.lens)
    cu = torch.tensor([0, *torch.tensor(case.lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = torch.randn(t, H, case.d_qk, device=DEV, dtype=DT).requires_grad_()
    k = torch.randn(t, H, case.d_qk, device=DEV, dtype=DT).requires_grad_()
    v = torch.randn(t, H, case.d_v, device=DEV, dtype=DT).requires_grad_()
    dout = torch.randn(t, H, case.d_v, device=DEV, dtype=DT)
    dlse = torch.randn(H, t, device=DEV) * 1e-3  # the size of a z-loss gradient (2 coef lse / (H T))
    slopes = (2.0 ** (-8.0 * torch.arange(1, H + 1, device=DEV) / H)).float() if case.feature == "alibi" else None
    return Inputs(q, k, v, dout, dlse, cu, slopes)


def moela_impl(backend: str, **kernels: str):
    def build(case: Case, x: Inputs):
        kw = dict(alibi_slopes=x.slopes, return_lse=case.feature == "zloss", backend=backend, **kernels)

        def fwd():
            res = mla_attention(x.q, x.k, x.v, x.cu, max(case.lens), **kw)
            return res if isinstance(res, tuple) else (res,)
        return fwd, (x.dout, x.dlse)[:2 if case.feature == "zloss" else 1], lambda outs: outs
    return build


def cudnn_impl(case: Case, x: Inputs):
    """SDPA's cuDNN backend on [B, H, S, D] copies made once (the layout it wants); its outputs and gradients are
    mapped back to [T, H, D] only for the comparison."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    b, s = len(case.lens), case.lens[0]
    qb, kb, vb = (t.detach().view(b, s, H, -1).transpose(1, 2).contiguous().requires_grad_() for t in (x.q, x.k, x.v))
    dob = x.dout.view(b, s, H, -1).transpose(1, 2).contiguous()

    def fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return (scaled_dot_product_attention(qb, kb, vb, is_causal=True),)

    def to_packed(outs):
        return [o.transpose(1, 2).reshape(b * s, H, -1) for o in outs]
    return fwd, (dob,), to_packed, (qb, kb, vb)


def supported(impl: str, case: Case) -> str | None:
    """Why impl cannot run the case, or None."""
    if impl == "cudnn" and (case.layout != "equal" or case.feature != "plain"):
        return "-"
    if impl == "flash":
        probe = torch.empty(1, 1, case.d_qk, device=DEV, dtype=DT)
        problem = flash_problem(probe, probe, torch.empty(1, 1, case.d_v, device=DEV, dtype=DT))
        return None if problem is None else f"- ({problem[:80]})"
    return None


def run_row(case: Case, impl: str, x: Inputs, reference: list | None, warmup: int, rep: int):
    """Times one implementation on one case: dict of results, and its [out, (lse), dq, dk, dv] for comparisons."""
    if impl == "cudnn":
        fwd, grads, to_packed, leaves = cudnn_impl(case, x)
    else:
        fwd, grads, to_packed = moela_impl("flash" if impl == "flash" else "triton", **VARIANTS.get(impl, {}))(case, x)
        leaves = (x.q, x.k, x.v)

    def fwd_bwd():  # gradients returned, not accumulated into .grad (an extra pass over q, k, v per call)
        outs = fwd()
        return torch.autograd.grad(list(outs), leaves, list(grads))

    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = fwd()
    input_grads = torch.autograd.grad(list(outs), leaves, list(grads))
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    got = [o.detach() for o in to_packed(list(outs))] + to_packed(list(input_grads))
    diff = None
    if reference is not None:
        names = ["out", "lse", "dq", "dk", "dv"] if len(got) == 5 else ["out", "dq", "dk", "dv"]
        diffs = {n: ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()
                 for n, a, b in zip(names, got, reference)}
        name = max(diffs, key=diffs.get)
        diff = (name, diffs[name])
    t_fwd = do_bench(fwd, warmup=warmup, rep=rep, return_mode="median")
    t_fwd_bwd = do_bench(fwd_bwd, warmup=warmup, rep=rep, return_mode="median")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    fl_fwd, fl_bwd = flops(case)
    return dict(fwd_ms=t_fwd, fwd_bwd_ms=t_fwd_bwd, fwd_tflops=fl_fwd / t_fwd / 1e9,
                fwd_bwd_tflops=(fl_fwd + fl_bwd) / t_fwd_bwd / 1e9, first_call_s=first, peak_mib=peak,
                max_rel_diff=diff), got


def auto_choice(case: Case, x: Inputs) -> str:
    order, why = attention_api._rank(x.q, x.k, x.v, x.cu, x.cu, max_seqlen_q=max(case.lens),
                                     max_seqlen_k=max(case.lens), return_lse=case.feature == "zloss", causal=True,
                                     softmax_scale=None, alibi_slopes=x.slopes)
    runnable = [name for name in order if attention_api.DISPATCH.fast[name].auto(
        x.q, x.k, x.v, x.cu, x.cu, max_seqlen_q=max(case.lens), max_seqlen_k=max(case.lens),
        return_lse=case.feature == "zloss", causal=True, softmax_scale=None, alibi_slopes=x.slopes)]
    return f"{runnable[0] if runnable else 'reference'} ({why})"


HEADER = ("| impl | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | first call s | peak MiB | "
          "max diff vs triton |\n| --- | --- | --- | --- | --- | --- | --- | --- |")


def table_row(impl: str, r) -> str:
    """One markdown row; r is a result dict or the reason there is none."""
    if isinstance(r, str):
        return f"| {impl} | {r} | | | | | | |"
    diff = "-" if r["max_rel_diff"] is None else f"{r['max_rel_diff'][0]} {r['max_rel_diff'][1]:.2g}"
    return (f"| {impl} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {r['fwd_tflops']:.0f} | "
            f"{r['fwd_bwd_tflops']:.0f} | {r['first_call_s']:.1f} | {r['peak_mib']:.0f} | {diff} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the cases marked q, shorter timing windows")
    ap.add_argument("--only", default="", help="comma list of substrings: run the cases whose name holds one")
    ap.add_argument("--impls", default="triton,flash,cudnn,variants")
    ap.add_argument("--variants", default="", help="comma list of substrings: the variant rows whose name holds one")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; rows past it are skipped and say so")
    add_out_dir(ap)
    args = ap.parse_args()
    impls = args.impls.split(",")
    unknown = set(impls) - {"triton", "flash", "cudnn", "variants"}
    if unknown:
        sys.exit(f"--impls: unknown {', '.join(sorted(unknown))}; choose from triton, flash, cudnn, variants")
    if not torch.cuda.is_available():
        sys.exit("bench/attention.py needs a CUDA GPU")
    cases = [c for c in all_cases() if (c.quick or not args.quick)
             and (not args.only or any(s in c.name for s in args.only.split(",")))]
    warmup, rep = (10, 40) if args.quick else (25, 100)
    t0 = time.time()
    say(f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    start = time.perf_counter()
    probe = torch.empty(1, 1, 64, device=DEV, dtype=DT)
    problem = flash_problem(probe, probe, probe)
    if problem is None:
        from importlib.metadata import version

        say(f"flash-attn-4 {version('flash-attn-4')} (import {time.perf_counter() - start:.1f} s)")
    else:
        say(f"flash-attn-4: {problem}")
    say(f"Triton launch configs: {CONFIGS}\n")
    rows, measured, references = [], [], {}

    def run_case(case: Case, names: list[str], title: str) -> None:
        x = make_inputs(case)
        docs = f"{len(case.lens)} documents, {sum(case.lens)} tokens, longest {max(case.lens)}"
        say(f"### {title}{case.name} ({case.d_qk}/{case.d_v}, {case.feature}; {docs})\n")
        if not title:
            say(f"auto picks: {auto_choice(case, x)}\n")
        say(HEADER)
        speeds = {}
        for impl in names:
            if time.time() - t0 > args.budget:
                say(table_row(impl, f"skipped (past the {args.budget:.0f} s budget)"))
                continue
            why = supported(impl if impl in ("triton", "flash", "cudnn") else "triton", case)
            if why is not None:
                say(table_row(impl, why))
                continue
            result = guarded(150, run_row, case, impl, x, references.get(case.name), warmup, rep)
            if isinstance(result, str):
                say(table_row(impl, result))
                continue
            r, got = result
            if impl == "triton":
                references[case.name] = got
            say(table_row(impl, r))
            rows.append(dict(case=case.name, impl=impl, **{k: v for k, v in r.items() if k != "max_rel_diff"},
                             max_rel_diff=None if r["max_rel_diff"] is None else r["max_rel_diff"][1]))
            if impl in ("triton", "flash", "cudnn"):
                speeds[impl] = round(r["fwd_bwd_tflops"])
        if speeds:
            measured.append((case, speeds))
        if not case.variants or title:
            references.pop(case.name, None)  # kept on the GPU only for the variant rows to come
        say()
        del x
        torch.cuda.empty_cache()

    # every case's backends first, then the kernel variants: a spent budget drops variant rows, not cases
    for case in cases:
        run_case(case, [i for i in ("triton", "flash", "cudnn") if i in impls], "")
    if "variants" in impls:
        for case in (c for c in cases if c.variants):
            run_case(case, [name for name in VARIANTS if not args.variants
                            or any(sub in name for sub in args.variants.split(","))], "Kernel variants: ")
    say(f"total {time.time() - t0:.0f} s\n")
    say("Rows for moela/ops/attention/auto.py MEASURED (fwd+bwd TFLOP/s of this run):\n\n```python")
    for case, speeds in measured:
        name = case.name.removeprefix("z-loss ").removeprefix("ALiBi ").removeprefix("128/128 ")
        per_doc = round(sum(case.lens) / len(case.lens))
        say(f'    Measured("{name}", ({case.d_qk}, {case.d_v}), "{case.layout}", {per_doc}, "{case.feature}", '
            f'{speeds}),')
    say("```")
    write_results("attention", "mla_attention's backends side by side", "\n".join(LINES),
                  dict(heads=H, dtype="bf16", causal=True, quick=args.quick, rows=rows), out_dir=args.out_dir)


if __name__ == "__main__":
    main()
