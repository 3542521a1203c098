"""Benchmark `mla_attention`'s Triton kernels against the baselines a user has today, all in one process.

Sections (each case under a per-case time guard; a failing or slow baseline is reported, not fatal):
  sweep   block-shape sweep of the three kernels at B=2, H=16, S=8192 causal (192/128 and 128/128); the best
          configuration of each kernel is installed before the tables below are measured
  equal   B=2, H=16, S in {8192, 4096, 2048}, causal: ours vs SDPA-flash with V padded to Dqk (then sliced),
          SDPA-cuDNN, compiled FlexAttention (192/128; 128/128 at S=8192 too)
  packed  32768 tokens of documents with lognormal lengths (median 1024, sigma 1.2, clipped to [16, 8192]),
          H=16, 192/128 causal: ours vs FlexAttention with a document mask vs padding every document to the
          longest (SDPA-cuDNN on the padded batch)
  zloss   fwd+bwd of ours without z-loss, ours with z-loss (coef * mean(lse^2) through the fused lse gradient),
          and a naive z-loss that materializes the fp32 scores to get lse (S = 2k, 4k, 8k at 16384 tokens per
          call, B = 16384 / S, H=16; then B=2, S=2k with a host-side profile: that pair is host-bound)
  alibi   ours with ALiBi vs SDPA with a materialized additive bias [1, H, S, S] (built outside the timing)

TFLOP/s use BENCHMARKS.md's counts: fwd 2*H*sum(L^2)*(Dqk+Dv), bwd 2*H*sum(L^2)*(3*Dqk+2*Dv), halved for causal
(useful work only: padding and masked-out blocks are not counted). Times are `triton.testing.do_bench` medians;
bwd = time(fwd+bwd) - time(fwd). Peak memory is the maximum allocated during one fwd+bwd above what was allocated
before it (inputs excluded). Writes a markdown report to --out (default bench/results/attention.md).

Usage: python bench/attention.py [--out PATH] [--budget SECONDS] [--no-sweep] [--cases equal,packed,zloss,...]
"""

from __future__ import annotations

import argparse
import datetime
import math
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moela.ops.attention import mla_attention  # noqa: E402
from moela.ops.attention.triton_bwd import attention_backward  # noqa: E402
from moela.ops.attention.triton_common import CONFIGS, head_class  # noqa: E402
from moela.ops.attention.triton_fwd import attention_forward  # noqa: E402

DEV = "cuda"
DT = torch.bfloat16
H = 16
ZCOEF = 1e-4
LINES: list[str] = []


def say(line=""):
    print(line, flush=True)
    LINES.append(line)


class CaseTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CaseTimeout()


def guarded(seconds, fn, *args):
    """Runs fn; returns its result or a string saying why there is none."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        return fn(*args)
    except CaseTimeout:
        return f"timeout {seconds}s"
    except Exception as e:  # a baseline that rejects the shape is a result, not a crash
        traceback.print_exc()
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
    finally:
        signal.alarm(0)
        torch.cuda.synchronize()


def flops(lens, d_qk, d_v, causal):
    s2 = sum(L * L for L in lens) * (0.5 if causal else 1.0)
    return 2 * H * s2 * (d_qk + d_v), 2 * H * s2 * (3 * d_qk + 2 * d_v)


def measure(fwd, fwdbwd):
    """fwd() -> output; fwdbwd() runs forward and backward. Returns dict of ms and peak bytes."""
    t_f = do_bench(fwd, warmup=25, rep=100, return_mode="median")
    t_fb = do_bench(fwdbwd, warmup=25, rep=100, return_mode="median")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwdbwd()
    torch.cuda.synchronize()
    return dict(fwd=t_f, fwdbwd=t_fb, bwd=t_fb - t_f, peak=torch.cuda.max_memory_allocated() - base)


def leaf(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEV, dtype=DT) * scale).requires_grad_()


def grad_fn(run, inputs, *grads):
    def fb():
        outs = run()
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.grad(outs, inputs, grads[:len(outs)])
    return fb


def row(name, r, fl, ref=None):
    if isinstance(r, str):
        say(f"| {name} | {r} | | | | | | |")
        return
    tf = lambda f, ms: f / (ms * 1e-3) / 1e12  # noqa: E731
    ratio = f"{r['fwdbwd'] / ref['fwdbwd']:.2f}" if isinstance(ref, dict) else "-"
    say(f"| {name} | {r['fwd']:.3f} | {r['bwd']:.3f} | {tf(fl[0], r['fwd']):.0f} | {tf(fl[1], r['bwd']):.0f} | "
        f"{tf(fl[0] + fl[1], r['fwdbwd']):.0f} | {r['peak'] / 2**20:.0f} | {ratio} |")


CASES = "equal,packed,zloss,alibi,short,d128"
HEADER = ("| impl | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | fwd+bwd TFLOP/s | peak MiB "
          "| fwd+bwd time / ref row |\n| --- | --- | --- | --- | --- | --- | --- | --- |")


def packed_inputs(lens, d_qk, d_v):
    t = sum(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)
    q, k = leaf(t, H, d_qk), leaf(t, H, d_qk)
    v = leaf(t, H, d_v)
    do = torch.randn(t, H, d_v, device=DEV, dtype=DT)
    return q, k, v, do, cu


def ours(q, k, v, cu, max_len, **kw):
    return lambda: mla_attention(q, k, v, cu, max_len, backend="triton", **kw)


def max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------------------------------------------- sweep
def sweep(d_qk, d_v, seq, candidates):
    lens = [seq, seq]
    q, k, v, do, cu = packed_inputs(lens, d_qk, d_v)
    scale = d_qk ** -0.5
    key = head_class(d_qk, d_v)
    fl = flops(lens, d_qk, d_v, True)
    out, lse = attention_forward(q, k, v, cu, cu, seq, causal=True, softmax_scale=scale, alibi_slopes=None)
    best = {}
    for kernel in ("fwd", "dkdv", "dq"):
        results = []
        for cfg in candidates[kernel]:
            saved = CONFIGS[kernel][key]
            CONFIGS[kernel][key] = cfg
            if kernel == "fwd":
                fn = lambda: attention_forward(q, k, v, cu, cu, seq, causal=True,  # noqa: E731
                                                  softmax_scale=scale, alibi_slopes=None)
            else:
                fn = lambda: attention_backward(do, None, q, k, v, out, lse, cu, cu, seq, seq,  # noqa: E731
                                                   causal=True, softmax_scale=scale, alibi_slopes=None)
            ms = guarded(60, lambda: do_bench(fn, warmup=10, rep=50, return_mode="median"))
            CONFIGS[kernel][key] = saved
            f = fl[0] if kernel == "fwd" else fl[1]
            say(f"sweep {d_qk}/{d_v} {kernel:5s} {cfg}: " + (ms if isinstance(ms, str) else
                                                           f"{ms:.3f} ms  {f / ms / 1e9:.0f} TFLOP/s"))
            if not isinstance(ms, str):
                results.append((ms, cfg))
        if results:
            best[kernel] = min(results)[1]
            CONFIGS[kernel][key] = best[kernel]
    say(f"sweep {d_qk}/{d_v} best: {best}")


SWEEP_WIDE = {
    "fwd": [(128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 1), (256, 64, 16, 2)],
    "dkdv": [(32, 128, 8, 2), (32, 128, 8, 3), (32, 128, 4, 2), (64, 128, 8, 3), (16, 128, 4, 3)],
    "dq": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)],
}
SWEEP_NARROW = {
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4)],
    "dkdv": [(32, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 3)],
    "dq": [(64, 64, 4, 2), (128, 64, 8, 3), (64, 64, 4, 3)],
}


# ---------------------------------------------------------------------------------------------------- equal
def bshd(x, b, s):
    """[B*S, H, D] packed -> a fresh [B, H, S, D] leaf (the layout SDPA / Flex prefer)."""
    return x.detach().view(b, s, H, -1).transpose(1, 2).contiguous().requires_grad_()


def equal_case(seq, d_qk, d_v, flex, budget_ok):
    b = 2
    lens = [seq] * b
    fl = flops(lens, d_qk, d_v, True)
    q, k, v, do, cu = packed_inputs(lens, d_qk, d_v)
    say(f"\n### equal lengths: B={b}, H={H}, S={seq}, {d_qk}/{d_v} causal, bf16\n")
    say(HEADER)
    mine = ours(q, k, v, cu, seq)
    r_ours = guarded(120, measure, mine, grad_fn(mine, (q, k, v), do))
    row("ours (triton)", r_ours, fl)
    ref_out = mine().detach()
    qb, kb, vb = bshd(q, b, seq), bshd(k, b, seq), bshd(v, b, seq)
    dob = do.view(b, seq, H, d_v).transpose(1, 2).contiguous()

    def back(x):  # [B, H, S, Dv] -> [B*S, H, Dv]
        return x.transpose(1, 2).reshape(b * seq, H, -1)

    def sdpa_pad():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            vp = F.pad(vb, (0, d_qk - d_v)) if d_qk != d_v else vb
            return F.scaled_dot_product_attention(qb, kb, vp, is_causal=True)[..., :d_v]

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)

    baselines = [("SDPA flash, V padded" if d_qk != d_v else "SDPA flash", sdpa_pad), ("SDPA cuDNN", cudnn)]
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        mask = create_block_mask(lambda bb, hh, i, j: i >= j, None, None, seq, seq, device=DEV)
        compiled = torch.compile(flex_attention, dynamic=False)
        baselines.append(("FlexAttention (compiled)", lambda: compiled(qb, kb, vb, block_mask=mask)))
    for name, fn in baselines:
        if not budget_ok():
            row(name, "skipped (time budget)", fl)
            continue
        r = guarded(150, measure, fn, grad_fn(fn, (qb, kb, vb), dob))
        err = guarded(30, lambda: max_err(back(fn().detach()), ref_out))
        row(name + (f" (max diff vs ours {err:.3g})" if not isinstance(err, str) else ""), r, fl, r_ours)
    return r_ours


# ---------------------------------------------------------------------------------------------------- packed
def doc_lengths(total, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        L = int(torch.empty(1).log_normal_(math.log(1024), 1.2, generator=g).clamp(16, 8192))
        lens.append(min(L, total - sum(lens)))
    return lens


def packed_case(budget_ok, total=32768):
    d_qk, d_v = 192, 128
    lens = doc_lengths(total)
    t = sum(lens)
    fl = flops(lens, d_qk, d_v, True)
    q, k, v, do, cu = packed_inputs(lens, d_qk, d_v)
    say(f"\n### packed: {len(lens)} documents, {t} tokens, lengths lognormal(median 1024, sigma 1.2) clipped to "
        f"[16, 8192]: max {max(lens)}, mean {t / len(lens):.0f}; H={H}, {d_qk}/{d_v} causal, bf16\n")
    say(HEADER)
    mine = ours(q, k, v, cu, max(lens))
    r_ours = guarded(120, measure, mine, grad_fn(mine, (q, k, v), do))
    row("ours (triton, varlen)", r_ours, fl)
    ref_out = mine().detach()

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    doc_id = torch.repeat_interleave(torch.arange(len(lens), device=DEV), torch.tensor(lens, device=DEV))
    mask = create_block_mask(lambda bb, hh, i, j: (doc_id[i] == doc_id[j]) & (i >= j), None, None, t, t,
                             device=DEV)
    compiled = torch.compile(flex_attention, dynamic=False)
    qf, kf, vf = (x.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for x in (q, k, v))
    dof = do.transpose(0, 1).unsqueeze(0).contiguous()
    flex = lambda: compiled(qf, kf, vf, block_mask=mask)  # noqa: E731
    if budget_ok():
        r = guarded(180, measure, flex, grad_fn(flex, (qf, kf, vf), dof))
        err = guarded(30, lambda: max_err(flex().detach()[0].transpose(0, 1), ref_out))
        row(f"FlexAttention, document mask (max diff vs ours {err if isinstance(err, str) else f'{err:.3g}'})", r,
            fl, r_ours)
    else:
        row("FlexAttention, document mask", "skipped (time budget)", fl)

    n, lmax = len(lens), max(lens)
    pos = torch.cat([torch.arange(L, device=DEV) + i * lmax for i, L in enumerate(lens)])  # [T] slot in padded

    def padded():
        def pad(x):
            z = x.new_zeros(n * lmax, H, x.shape[-1])
            return z.index_copy(0, pos, x).view(n, lmax, H, -1).transpose(1, 2)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True)  # [N, H, Lmax, Dv]
        return o.transpose(1, 2).reshape(n * lmax, H, d_v)[pos]
    r = guarded(150, measure, padded, grad_fn(padded, (q, k, v), do))
    err = guarded(30, lambda: max_err(padded().detach(), ref_out))
    row(f"pad to longest ({n}x{lmax}) + SDPA cuDNN (max diff vs ours "
        f"{err if isinstance(err, str) else f'{err:.3g}'})", r, fl, r_ours)


# ---------------------------------------------------------------------------------------------------- z-loss
def zloss_case(seq, tokens=16384):
    """A fixed number of tokens per call (B = tokens / S), as a training micro-batch packs them: at B=2, S=2048
    the pair of calls is host-bound (see the profile) and the comparison measures Python, not kernels."""
    d_qk, d_v, b = 192, 128, max(tokens // seq, 1)
    lens = [seq] * b
    fl = flops(lens, d_qk, d_v, True)
    q, k, v, do, cu = packed_inputs(lens, d_qk, d_v)
    say(f"\n### z-loss: B={b}, H={H}, S={seq}, 192/128 causal, coef {ZCOEF}\n")
    say(HEADER)
    plain = ours(q, k, v, cu, seq)
    r_plain = guarded(120, measure, plain, grad_fn(plain, (q, k, v), do))
    row("ours, no z-loss", r_plain, fl)

    def with_z():
        out, lse = mla_attention(q, k, v, cu, seq, backend="triton", return_lse=True)
        return out, ZCOEF * lse.square().mean()
    one = torch.ones((), device=DEV)
    r_z = guarded(120, measure, with_z, grad_fn(with_z, (q, k, v), do, one))
    row("ours + fused z-loss (ref: no z-loss)", r_z, fl, r_plain)

    def naive():
        out = mla_attention(q, k, v, cu, seq, backend="triton")
        qs = q.view(b, seq, H, d_qk).transpose(1, 2)
        ks = k.view(b, seq, H, d_qk).transpose(1, 2)
        s = (qs @ ks.transpose(-1, -2)).float() * d_qk ** -0.5  # [B, H, S, S] materialized
        s = s.masked_fill(torch.ones(seq, seq, device=DEV, dtype=torch.bool).triu(1), float("-inf"))
        return out, ZCOEF * torch.logsumexp(s, -1).square().mean()
    r_n = guarded(150, measure, naive, grad_fn(naive, (q, k, v), do, one))
    row("ours + naive z-loss, materialized scores (ref: fused)", r_n, fl, r_z)
    if b * seq <= 4096:
        guarded(60, profile_pair, grad_fn(plain, (q, k, v), do), grad_fn(with_z, (q, k, v), do, one))
    kernels = guarded(60, kernel_only_backward, q, k, v, do, cu, seq)
    say(f"\nbackward kernels alone (no autograd), S={seq}: " + (kernels if isinstance(kernels, str) else
        f"{kernels[0]:.3f} ms without dlse, {kernels[1]:.3f} ms with a dlse"))
    if isinstance(r_z, dict) and isinstance(r_n, dict) and isinstance(r_plain, dict):
        say(f"\nz-loss S={seq}: fused overhead {100 * (r_z['fwdbwd'] / r_plain['fwdbwd'] - 1):+.1f}%, "
            f"vs naive {r_n['fwdbwd'] / r_z['fwdbwd']:.1f}x faster, {r_n['peak'] / max(r_z['peak'], 1):.0f}x less "
            f"peak memory")


def profile_pair(plain_fb, z_fb, iters=20):
    """Where the z-loss's extra time goes at a short sequence: host enqueue and wall time per fwd+bwd (synchronized
    every iteration and not), and the profiler's top ops by self CPU time, for both."""
    from torch.profiler import ProfilerActivity, profile

    for name, fn in (("no z-loss", plain_fb), ("z-loss", z_fb)):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        host = (time.perf_counter() - t0) / iters * 1e3
        torch.cuda.synchronize()
        queued = (time.perf_counter() - t0) / iters * 1e3
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
            torch.cuda.synchronize()
        synced = (time.perf_counter() - t0) / iters * 1e3
        say(f"\n{name}: host enqueue {host:.3f} ms/iter, queued wall {queued:.3f}, synchronized wall {synced:.3f}")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        say("```\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14,
                                                 max_name_column_width=50) + "\n```")


def kernel_only_backward(q, k, v, do, cu, seq):
    """The fused lse gradient costs one subtraction per row in the preprocess; time the launches directly."""
    kw = dict(causal=True, softmax_scale=q.shape[-1] ** -0.5, alibi_slopes=None)
    out, lse = attention_forward(q, k, v, cu, cu, seq, **kw)
    dlse = torch.randn_like(lse)
    return [do_bench(lambda: attention_backward(do, g, q, k, v, out, lse, cu, cu, seq, seq, **kw), warmup=25,
                     rep=100, return_mode="median") for g in (None, dlse)]


# ---------------------------------------------------------------------------------------------------- alibi
def alibi_case(seq):
    d_qk, d_v, b = 192, 128, 2
    lens = [seq] * b
    fl = flops(lens, d_qk, d_v, True)
    q, k, v, do, cu = packed_inputs(lens, d_qk, d_v)
    slopes = torch.tensor([2 ** (-8 * (i + 1) / H) for i in range(H)], device=DEV)
    say(f"\n### ALiBi: B={b}, H={H}, S={seq}, 192/128 causal\n")
    say(HEADER)
    mine = ours(q, k, v, cu, seq, alibi_slopes=slopes)
    r_ours = guarded(120, measure, mine, grad_fn(mine, (q, k, v), do))
    row("ours, ALiBi in kernel", r_ours, fl)
    i = torch.arange(seq, device=DEV)
    dist = (i[:, None] - i[None, :]).float()
    bias = (-slopes[:, None, None] * dist).masked_fill(dist < 0, float("-inf")).to(DT)[None]  # [1, H, S, S]
    qb, kb, vb = bshd(q, b, seq), bshd(k, b, seq), bshd(v, b, seq)
    dob = do.view(b, seq, H, d_v).transpose(1, 2).contiguous()
    sdpa = lambda: F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bias)  # noqa: E731
    r = guarded(150, measure, sdpa, grad_fn(sdpa, (qb, kb, vb), dob))
    err = guarded(30, lambda: max_err(sdpa().detach().transpose(1, 2).reshape(b * seq, H, d_v), mine().detach()))
    row(f"SDPA + materialized bias (max diff vs ours {err if isinstance(err, str) else f'{err:.3g}'})", r, fl,
        r_ours)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "attention.md"))
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later baselines are skipped past it")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--cases", default=CASES,
                    help="comma list: equal (S=8192), packed, zloss, alibi, short (S=4096, 2048), d128 (128/128)")
    args = ap.parse_args()
    unknown = set(args.cases.split(",")) - set(CASES.split(","))
    if unknown:
        sys.exit(f"--cases: unknown {', '.join(sorted(unknown))}; choose from {CASES}")
    t0 = time.time()
    budget_ok = lambda: time.time() - t0 < args.budget  # noqa: E731
    props = torch.cuda.get_device_properties(0)
    say(f"# mla_attention benchmark\n\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, "
        f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}\n")
    if not args.no_sweep:
        say("## block-shape sweep (S=8192, B=2, causal)\n\n```")
        sweep(192, 128, 8192, SWEEP_WIDE)
        sweep(128, 128, 8192, SWEEP_NARROW)
        say("```")
    say(f"\nlaunch configs used below: {CONFIGS}")
    cases = set(args.cases.split(","))
    if "equal" in cases:
        equal_case(8192, 192, 128, True, budget_ok)
    if "packed" in cases:
        packed_case(budget_ok)
    for seq in (2048, 4096, 8192):
        if "zloss" in cases and budget_ok():
            zloss_case(seq)
    if "zloss" in cases and budget_ok():
        zloss_case(2048, tokens=4096)  # the host-bound B=2 case, with its profile
    for seq in (4096, 8192):
        if "alibi" in cases and budget_ok():
            alibi_case(seq)
    for seq in (4096, 2048):
        if "short" in cases and budget_ok():
            equal_case(seq, 192, 128, True, budget_ok)
    if "d128" in cases and budget_ok():
        equal_case(8192, 128, 128, False, budget_ok)
    say(f"\ntotal {time.time() - t0:.0f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
