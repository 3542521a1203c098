"""GPU kernel time by family, from a torch.profiler run: what the step's device time is spent on.

`classify(name, context)` maps one kernel to a family from its name and the names of the CPU ops that launched it
(`context`: innermost first, e.g. ("aten::_scaled_mm", "MoEExpertsFnBackward", ...)). The context settles what a
name cannot: a cuBLAS GEMM launched inside moela's expert op (the FP8 path's per-expert `_scaled_mm`) is an expert
GEMM, kernels inside an SDPA / FlexAttention / moela attention op are attention, and everything the optimizer step
or the gradient clipping launches is optimizer time. Rules are checked in FAMILIES order; the first match wins.

Kernel names it knows (Hopper, torch 2.11-2.13): cuBLAS `nvjet_*`, `sm90_xmma_gemm_*`, `ampere_*gemm*`,
`splitKreduce_kernel`, `gemv*`; CUTLASS grouped GEMM (`torch._grouped_mm`: `GroupProblemShape`); attention:
FlashAttention `flash_fwd/bwd`, memory-efficient `fmha_cutlassF/B`, cuDNN `cudnn_generated_fort_native_sdpa`,
Inductor FlexAttention `triton_tem_fused_flex_attention*` (any Inductor template kernel that is not a matmul
template counts as attention: in these models FlexAttention is the only other template); Inductor's generated
kernels `triton_{poi,red,per}_
fused_<aten ops>_N` (classified by the fused ops: `rsqrt` -> norm, `silu` -> activation, `cat` -> copies, ...);
ATen elementwise / copy / cat / index / sort / top-k kernels; the fused AdamW and foreach kernels
(`multi_tensor_apply_kernel`, `FusedAdamMathFunctor`, `LpNormFunctor`, `lpnorm_cleanup`); NCCL; and moela's own
Triton kernels by their function names (attention `_fwd_kernel` / `_bwd_*_kernel`, experts `_mgrouped_kernel` /
`_kgrouped_kernel`, `_permute_kernel`, `_combine*_kernel`, quantization, SwiGLU, MoE layout).

Elementwise adds and multiplies (residual adds, gradient accumulation, scaling) count as `copies/cat/casts`: like
copies they move bytes without math worth the name. Anything unmatched is `other`; the breakdown keeps the largest
kernels of every family so that a new name is easy to spot and place.
"""

from __future__ import annotations

import re

import torch

FAMILIES = ("communication", "optimizer", "attention", "expert GEMM", "dense GEMM", "loss", "router/top-k",
            "norm/RoPE/activation", "copies/cat/casts", "other")

_MOELA_ATTENTION = ("_fwd_kernel", "_bwd_preprocess_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel",
                    "_dkdv_kernel", "_dq_kernel")
_MOELA_EXPERT_GEMM = ("_mgrouped_kernel", "_kgrouped_kernel")
# experts, or one group for fp8_linear (the Triton kernels and the warp-specialized Gluon one)
_MOELA_FP8_GEMM = ("_mgrouped_fp8_kernel", "_kgrouped_fp8_kernel", "_mgrouped_ws_kernel", "_kgrouped_ws_kernel")
_MOELA_COPIES = ("_permute_kernel", "_combine_kernel", "_combine_bwd_kernel", "_rowcol_quant_kernel",
                 "_weight_quant_kernel", "_rowcol_tma_kernel", "_rowcol_gather_kernel")
_MOELA_ACTIVATION = ("_swiglu_fwd_kernel", "_swiglu_bwd_kernel", "_swiglu_bwd_plain_kernel")
_MOELA_ROUTER = ("_layout_count_kernel", "_layout_scan_kernel", "_router_fwd_kernel")

_GEMM = re.compile(r"gemm|nvjet|xmma|gemv|splitkreduce|cutlass|matmul|"
                   r"^triton_tem_fused_(?:.*_)?(?:mm|addmm|bmm)(?:_|$)")
_ATTENTION = re.compile(r"flash|fmha|sdpa|flex_attention|flex_decoding|attention|mha_")
_EXPERT = re.compile(r"groupproblemshape|grouped|moeexperts|experts|moe_")
_OPTIMIZER = re.compile(r"adam|multi_tensor_apply|lpnorm|foreach")
_LOSS = re.compile(r"softmax|nll_loss|cross_entropy|logsumexp|linearce")
_ROUTER = re.compile(r"topk|sort|radix|sigmoid|histc|bincount")
_NORM_ROPE_ACT = re.compile(r"rsqrt|rms_?norm|layer_?norm|meanops|pow_tensor_scalar|silu|gelu|swiglu|complex|rope|"
                            r"rotary|polar|tanh|(?:^|[_:])(?:cos|sin)(?:_|$)")
_COPIES = re.compile(r"cat|copy|memcpy|memset|clone|convert|fill|index|gather|scatter|embedding|permute|transpose|"
                     r"contiguous|elementwise|add|mul|where|zeros|triton_poi_")


def _context_matches(pattern: re.Pattern, context: tuple[str, ...]) -> bool:
    return any(pattern.search(c.lower()) for c in context)


def classify(name: str, context: tuple[str, ...] = ()) -> str:
    """The family (one of FAMILIES) of a kernel `name` launched under the CPU ops `context` (innermost first)."""
    low = name.lower()
    ctx = tuple(c.lower() for c in context)
    if "nccl" in low:
        return "communication"
    if _OPTIMIZER.search(low) or any(c.startswith("optimizer.step") or "clip_grad" in c or "_foreach" in c
                                     or "fused_adam" in c for c in ctx):
        return "optimizer"
    if name in _MOELA_ATTENTION or _ATTENTION.search(low) or any(
            "flashmla" in c or "scaled_dot_product" in c or "scaleddotproduct" in c or "flex_attention" in c
            for c in ctx):
        return "attention"
    if name in _MOELA_EXPERT_GEMM:
        return "expert GEMM"
    if name in _MOELA_FP8_GEMM:
        return "expert GEMM" if any(_EXPERT.search(c) for c in ctx) else "dense GEMM"
    if _GEMM.search(low):
        expert = _EXPERT.search(low) or any(_EXPERT.search(c) for c in ctx)
        return "expert GEMM" if expert else "dense GEMM"
    if low.startswith("triton_tem_"):  # Inductor's other templates here: FlexAttention (mm templates matched above)
        return "attention"
    if name in _MOELA_COPIES:
        return "copies/cat/casts"
    if name in _MOELA_ACTIVATION:
        return "norm/RoPE/activation"
    if name in _MOELA_ROUTER:
        return "router/top-k"
    if _LOSS.search(low) or any("linearce" in c or "cross_entropy" in c or "nll_loss" in c for c in ctx):
        return "loss"
    if _NORM_ROPE_ACT.search(low) or ("pow" in low and ("mean" in low or "sum" in low)):
        return "norm/RoPE/activation"
    if _ROUTER.search(low):
        return "router/top-k"
    if _COPIES.search(low):
        return "copies/cat/casts"
    return "other"


def _ancestors(op) -> tuple[str, ...]:
    names = []
    while op is not None:
        names.append(op.name)
        op = op.cpu_parent
    return tuple(names)


def device_kernels(prof) -> list[tuple[str, float, tuple[str, ...]]]:
    """(name, device microseconds, launch context) of every GPU kernel, copy and memset of a finished
    torch.profiler run. A device event names the op that launched it by `linked_correlation_id` (the op's `id`);
    a torch whose events lack that field gets the context from the ops' own `kernels` lists instead, matched by
    kernel name and duration."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = prof.events()
    ops = [e for e in events if e.device_type == cpu and e.name != "[memory]"]
    # GPU user annotations (record_function ranges mirrored on the device) are spans over kernels, not kernels
    device = [e for e in events if e.device_type == cuda and not getattr(e, "is_user_annotation", False)]
    if device and all(hasattr(e, "linked_correlation_id") for e in device):
        by_id: dict = {}
        for op in ops:
            by_id.setdefault(op.id, op)
        contexts = [_ancestors(by_id.get(e.linked_correlation_id)) for e in device]
    else:
        launched: dict = {}
        for op in ops:
            for k in getattr(op, "kernels", ()):
                launched.setdefault((k.name, round(k.duration, 3)), []).append(_ancestors(op))
        contexts = []
        for e in device:
            found = launched.get((e.name, round(e.time_range.end - e.time_range.start, 3)))
            contexts.append(found.pop() if found else ())
    return [(e.name, e.time_range.end - e.time_range.start, ctx) for e, ctx in zip(device, contexts)]


def breakdown(kernels: list[tuple[str, float, tuple[str, ...]]], steps: int, top: int = 12) -> dict:
    """Per family: device ms per step, share of all kernel time, and its `top` largest kernels (name, ms/step).
    `kernels` as `device_kernels` returns them, over `steps` steps."""
    per_family: dict[str, dict[str, float]] = {f: {} for f in FAMILIES}
    contexts: dict[str, dict[str, float]] = {}  # kernel -> launch context -> us
    for name, us, context in kernels:
        family = per_family[classify(name, context)]
        family[name] = family.get(name, 0.0) + us
        where = contexts.setdefault(name, {})
        key = launch_context(context)
        where[key] = where.get(key, 0.0) + us
    total = sum(sum(f.values()) for f in per_family.values()) or 1.0
    out = {}
    for fam, names in per_family.items():
        us = sum(names.values())
        biggest = sorted(names.items(), key=lambda kv: -kv[1])[:top]
        out[fam] = {"ms_per_step": us / 1e3 / steps, "share": us / total,
                    "top": [[n[:120], v / 1e3 / steps] for n, v in biggest],
                    # where each of those kernels was launched from (its largest context by time), in the
                    # order of "top" (kernels whose names share the first 120 characters stay apart)
                    "top_context": [max(contexts[n].items(), key=lambda kv: kv[1])[0] for n, _ in biggest]}
    return out


def launch_context(context: tuple[str, ...], depth: int = 4) -> str:
    """The innermost `depth` ops above a kernel's launch (CUDA runtime calls left out), innermost first."""
    ops = [c for c in context if not c.startswith(("cu", "Activity Buffer"))]  # cudaLaunchKernel, cuLaunchKernel
    return " < ".join(ops[:depth])
