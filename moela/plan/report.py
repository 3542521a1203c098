"""The printed plan: memory per GPU term by term, the step's collectives by link, the step time's parts, tokens/s
and MFU, and the assumptions they rest on; `search_table` ranks layouts."""

from __future__ import annotations

from moela.plan.memory import CONTEXT_GIB, FRAGMENTATION, GIB
from moela.plan.predict import Plan
from moela.plan.timing import ALPHA_S, REFERENCE, link


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def plan_text(p: Plan) -> str:
    m, t, g, lay = p.memory, p.time, p.gpu, p.layout
    stage = f" (pipeline stage {m.stage}, the fullest)" if lay.pp > 1 else ""
    lines = [f"plan: {lay.world} x {g.name}, {lay.describe()}; {p.tokens_per_microbatch} tokens per micro-batch x "
             f"{p.microbatches} per step on each of {lay.dp} data-parallel ranks; documents ~{p.doc_len:.0f} tokens",
             "", f"memory per GPU{stage}:",
             f"  parameters (fp32 shards)        {_gib(m.params)}",
             f"  gradients (fp32 shards)         {_gib(m.grads)}",
             f"  optimizer state                 {_gib(m.optimizer)}",
             f"  working weights (bf16 copies)   {_gib(m.working_params)}",
             f"  activations                     {_gib(m.activations)}  ({_gib(m.activations_per_microbatch)} per "
             f"micro-batch x {m.microbatches_in_flight:g} in flight)",
             f"  backward transient              {_gib(m.transient)}",
             f"  expert all-to-all buffers       {_gib(m.ep_buffers)}",
             f"  head + loss                     {_gib(m.logits)}",
             f"  not at once (backward frees activations as it writes gradients)  -{_gib(m.not_at_once)}",
             f"  allocated (peak)                {_gib(m.allocated)}",
             f"  reserve (context {CONTEXT_GIB:g} GiB + {FRAGMENTATION:.0%} allocator)  {_gib(m.reserve)}",
             f"  total                           {_gib(m.total)} of {g.memory_gib:.1f} GiB "
             f"({m.total / (g.memory_gib * GIB):.0%}){'' if p.fits else '  DOES NOT FIT'}",
             "", "largest block's activations per micro-batch:"]
    lines += [f"  {k:<62} {_gib(v)}" for k, v in m.terms.items() if v]
    lines += ["", "communication per step (bytes handed in per call):"]
    for c in p.collectives:
        lines.append(f"  {c.kind:<14} {c.group:<12} n={c.size:<5} {link(c, lay):<7} {c.count:>5} x "
                     f"{c.nbytes / 2**20:9.2f} MiB  {c.what}")
    if not p.collectives:
        lines.append("  none (one GPU)")
    lines += ["", f"step time {t.seconds * 1e3:.1f} ms:"]
    lines += [f"  compute {k:<14} {v * 1e3:8.1f} ms" for k, v in t.compute.items()]
    lines += [f"  comm {k:<9} {t.comm[k] * 1e3:8.1f} ms, exposed {v * 1e3:.1f} ms (overlap {t.overlap[k]:.0%})"
              for k, v in t.exposed.items()]
    if lay.pp > 1:
        lines.append(f"  pipeline bubble ({lay.pp_schedule})  {t.bubble * 1e3:.1f} ms")
    lines += [f"tokens/s per GPU {t.tokens_per_s_per_gpu:,.0f}, MFU {t.mfu:.1%}", "",
              f"assumptions: compute rates from bench/step.py's {REFERENCE} row (H200, bf16), scaled by FLOPs; "
              f"latency {ALPHA_S['nvlink'] * 1e6:.0f}/{ALPHA_S['network'] * 1e6:.0f} us per ring step "
              f"(NVLink/network), {g.nvlink_gbps:.0f} GB/s NVLink, {g.network_gbps:g} GB/s network per GPU "
              f"({8 * g.network_gbps:g} Gb/s); "
              f"uniform routing; see docs/plan.md"]
    return "\n".join(lines)


def one_line(p: Plan) -> str:
    m = p.memory
    return (f"predicted {m.total / GIB:.1f} GiB per GPU of {p.gpu.memory_gib:.0f} (parameters "
            f"{(m.params + m.grads + m.optimizer) / GIB:.1f} with gradients and optimizer state, activations "
            f"{m.activations / GIB:.1f}), {p.time.tokens_per_s_per_gpu:,.0f} tokens/s per GPU")


def search_table(plans: list[Plan], top: int = 10) -> str:
    lines = ["| rank | layout | memory GiB | fits | tokens/s/GPU | MFU | step ms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, p in enumerate(plans[:top], 1):
        lines.append(f"| {i} | {p.layout.describe()} | {p.memory.total / GIB:.1f} | {'yes' if p.fits else 'no'} | "
                     f"{p.time.tokens_per_s_per_gpu:,.0f} | {p.time.mfu:.1%} | {p.time.seconds * 1e3:.0f} |")
    return "\n".join(lines)
