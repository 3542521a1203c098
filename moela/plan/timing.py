"""Predicted step time and MFU: compute from the kernel time per family that `bench/step.py` measured on one GPU,
scaled by FLOPs (or elements) to other shapes; communication from an alpha-beta model per link; the overlap each
parallelism achieves and the pipeline bubble as stated assumptions.

Decisions:
- Calibration (`CALIBRATION`): the kernel milliseconds per step of each family in one profiled training step of
  `bench/step.py` on an H200 (bf16, no parallelism), with the step's shape. Each family's achieved rate is its
  work divided by its time: FLOPs for the GEMM families (attention projections, dense FFNs, shared experts,
  router and the output head with its cross-entropy: "dense GEMM + head", since the profile files the chunked
  head's GEMMs under dense GEMM; routed experts: "expert GEMM"; the attention core at the step's token-weighted
  document length: "attention"), elements of the residual stream for the memory-bound
  families (norms, RoPE, SwiGLU, copies, casts, routing top-k), parameters held for the optimizer. The rates come
  from the `v2lite6-64k` row (DeepSeek-V2-Lite shapes, the closest measured to V3's); `small-64k` is predicted from
  them as a check (`calibration_check`). FP8 experts run at the bf16 rate: moela's measured FP8 step is within 5%
  of bf16 at these shapes. Other GPUs scale every rate by `GPU.compute_scale`.
- A rank's compute is the step's work divided evenly over the ranks that share it: tp and cp split a
  micro-batch, pp splits the blocks, ep spreads the experts (routing assumed uniform), and full activation
  checkpointing repeats the blocks' forward (4/3 of their compute; selective: every second block).
- Communication: a ring collective over n ranks moves (n - 1) / n of the full buffer through each rank's link,
  in (n - 1) steps of latency `ALPHA_S`; a group inside a node uses NVLink, one spanning nodes the network
  bandwidth per GPU. An all-to-all sends the share of its rows bound for other nodes over the network, the rest
  over NVLink; a pipeline send is one transfer.
- Overlap (`OVERLAP`, the share of each kind's time hidden under compute): FSDP's gathers and reduce-scatters are
  prefetched one unit ahead (hidden while they are shorter than the compute; the first gather and the last
  reduce-scatter are exposed); expert, tensor and context parallelism run inside the layer (exposed) except under
  DualPipeV, whose overlapped pairs run one chunk's forward beside the other's backward: moela interleaves the pair
  block by block on two CUDA streams (DualPipe pairs phases inside a block), assumed to hide half of the expert
  collectives; pipeline sends are half hidden. The collectives hidden on one link share it: together they hide under
  at most the compute time, and the rest is exposed. The gradient reductions (FSDP's reduce-scatters, HSDP's
  replicate all-reduce) run once per step, as each unit's last backward of the step ends, so they hide only under
  what is left of that backward: at most one micro-batch's backward (2/3 of a micro-batch's compute).
- Bubble, in units of one stage's forward F and backward B (= 2F, split into I and the deferred weight gradient
  W) per micro-batch, as docs/parallelism.md states moela's schedules: 1F1B (pp - 1)(F + B); interleaved 1F1B
  that over v; ZBV (pp - 1)(F + B - 2W) / 2; DualPipeV (pp - 1)(F&B + B - 3W) / 2 with F&B = F + B. Both split the
  backward into I and W (`moela.parallel.pp_split`), and no op's backward runs twice: the routed experts are one
  custom op whose backward computes their data and weight gradients together, so it runs once, in I, and W runs
  only the torch-native weight gradients. W is therefore B/2 less the routed experts' weight GEMMs: with e the
  expert GEMMs' share of the stage's compute (optimizer excluded), W = (1 - e) F, I = B - W, and the work per
  micro-batch stays F + B. (The chunked head's custom op likewise computes its weight gradient in I; it sits on
  one stage and is not taken out of W.)

Shapes: D hidden, H heads, K top-k, F expert width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moela.model.config import ModelConfig, preset
from moela.plan.comm import Collective
from moela.plan.layout import GPU, Layout
from moela.plan.memory import block_kinds

ALPHA_S = {"nvlink": 10e-6, "network": 20e-6}  # latency per ring step (assumption)
OVERLAP = {"fsdp": 1.0, "replicate": 1.0, "ep": 0.0, "ep_dualpipev": 0.5, "tp": 0.0, "cp": 0.0, "pp": 0.5,
           "small": 0.0}

# bench/step.py on an H200, bf16, its `moela` rows: kernel ms per step by family (router/top-k, norm/RoPE/activation,
# copies/cat/casts and other together as memory-bound), tokens per step, token-weighted mean document length, the
# model's parameters, and the recipe overrides of that row's model (bench/step.py's CONFIGS)
CALIBRATION = {
    "v2lite6-64k": dict(model=dict(size="v2-lite", num_hidden_layers=6), tokens=65536, doc_len=2568.35,
                        params=3424678912,
                        ms={"optimizer": 22.27, "attention": 49.36, "expert GEMM": 154.71,
                            "dense GEMM + head": 254.44 + 31.02, "memory-bound": 0.54 + 42.61 + 43.46 + 1.56}),
    "small-64k": dict(model=dict(size="small", vocab_size=4096), tokens=65536, doc_len=2618.76, params=679483520,
                      ms={"optimizer": 5.15, "attention": 52.47, "expert GEMM": 47.4,
                          "dense GEMM + head": 45.03 + 3.75, "memory-bound": 0.69 + 29.88 + 29.23 + 1.7}),
}
REFERENCE = "v2lite6-64k"


def family_work(cfg: ModelConfig, doc_len: float) -> dict[str, float]:
    """Work per token of each family (module docstring): FLOPs, or elements for memory-bound."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    qk, dv, c, r = cfg.qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    q = d * h * qk if cfg.q_lora_rank is None else d * cfg.q_lora_rank + cfg.q_lora_rank * h * qk
    attn_proj = q + d * (c + r) + c * h * (cfg.qk_nope_head_dim + dv) + h * dv * d
    dense = expert = 0
    for moe in block_kinds(cfg):
        dense += attn_proj
        if moe:
            dense += 3 * d * cfg.moe_intermediate_size * cfg.n_shared_experts + cfg.n_routed_experts * d
            expert += 3 * d * cfg.moe_intermediate_size * cfg.num_experts_per_tok
        else:
            dense += 3 * d * cfg.intermediate_size
    dense += 2 * d * d * cfg.num_nextn_predict_layers
    blocks = len(block_kinds(cfg))
    head = cfg.vocab_size * d * (1 + cfg.num_nextn_predict_layers)
    return {"dense GEMM + head": 6.0 * (dense + head), "expert GEMM": 6.0 * expert,
            "attention": 3.0 * h * (qk + dv) * doc_len * blocks, "memory-bound": float(blocks * d)}


def _rates(name: str) -> dict[str, float]:
    """Work per second of each family in calibration row `name` (optimizer: parameters per second)."""
    row = CALIBRATION[name]
    cfg = preset(**row["model"])
    work = family_work(cfg, row["doc_len"])
    rates = {f: work[f] * row["tokens"] / (row["ms"][f] / 1e3) for f in work}
    rates["optimizer"] = row["params"] / (row["ms"]["optimizer"] / 1e3)
    return rates


RATES = _rates(REFERENCE)


def compute_seconds(cfg: ModelConfig, doc_len: float, tokens: float, params: float, gpu: GPU, *,
                    recompute: float = 0.0) -> dict[str, float]:
    """Seconds per family for `tokens` tokens and an optimizer step over `params` parameters on `gpu`;
    `recompute`: the share of blocks whose forward runs twice (1 = full activation checkpointing)."""
    work = family_work(cfg, doc_len)
    out = {}
    for fam, w in work.items():
        again = 1.0 + recompute / 3.0
        out[fam] = w * tokens * again / RATES[fam] / gpu.compute_scale
    out["optimizer"] = params / RATES["optimizer"] / gpu.compute_scale
    return out


def calibration_check(name: str = "small-64k") -> tuple[float, float]:
    """(predicted, measured) kernel milliseconds of calibration row `name` from the reference rates."""
    row = CALIBRATION[name]
    cfg = preset(**row["model"])
    from moela.plan.layout import GPUS
    pred = compute_seconds(cfg, row["doc_len"], row["tokens"], row["params"], GPUS["h200"])
    return 1e3 * sum(pred.values()), sum(row["ms"].values())


def link(c: Collective, layout: Layout) -> str:
    """nvlink or network: a group inside a node, or a pipeline send to a neighbour stage on the same node."""
    g = layout.group(c.group)
    if c.kind == "send":
        return "nvlink" if g.stride < layout.gpus_per_node else "network"
    return "nvlink" if g.intra_node else "network"


def collective_seconds(c: Collective, layout: Layout, gpu: GPU) -> float:
    """One call's time by the alpha-beta model (module docstring)."""
    n = c.size
    if n <= 1:
        return 0.0
    where = link(c, layout)
    bw = 1e9 * (gpu.nvlink_gbps if where == "nvlink" else gpu.network_gbps)
    alpha = ALPHA_S[where]
    if c.kind == "all_gather":
        return (n - 1) * alpha + (n - 1) * c.nbytes / bw
    if c.kind == "reduce_scatter":
        return (n - 1) * alpha + (n - 1) / n * c.nbytes / bw
    if c.kind == "all_reduce":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * c.nbytes / bw
    if c.kind == "all_to_all":
        remote = layout.group(c.group).remote_fraction
        moved = c.nbytes * (n - 1) / n
        return alpha + max(moved * remote / (1e9 * gpu.network_gbps), moved * (1 - remote) / (1e9 * gpu.nvlink_gbps))
    return alpha + c.nbytes / bw


def bubble_fraction(layout: Layout, expert_share: float = 0.0) -> float:
    """Pipeline bubble over the step's busy time (module docstring); F = 1, B = 2 per micro-batch, and under the
    zero-bubble schedules W = 1 - `expert_share` (the routed experts' weight GEMMs run in I, not in W)."""
    pp, m = layout.pp, layout.pp_microbatches
    if pp == 1:
        return 0.0
    f, b, w = 1.0, 2.0, 1.0 - expert_share
    bubble = {"1f1b": (pp - 1) * (f + b), "interleaved_1f1b": (pp - 1) * (f + b) / layout.pp_virtual_stages,
              "zbv": (pp - 1) * (f + b - 2 * w) / 2,
              "dualpipev": (pp - 1) * ((f + b) + b - 3 * w) / 2}[layout.pp_schedule]
    return bubble / (m * (f + b))


@dataclass
class StepTime:
    compute: dict[str, float]
    comm: dict[str, float]  # by overlap kind: total seconds of the collectives
    exposed: dict[str, float]
    bubble: float
    seconds: float
    tokens_per_s_per_gpu: float
    mfu: float
    overlap: dict[str, float] = field(default_factory=dict)


def step_time(cfg: ModelConfig, layout: Layout, gpu: GPU, collectives: list[Collective], *, tokens_per_mb: int,
              microbatches: int, doc_len: float, params_local: int, recompute: float, flops_per_token: float,
              overlap: dict[str, float] | None = None) -> StepTime:
    share = layout.cp * layout.tp * layout.pp
    compute = compute_seconds(cfg, doc_len, tokens_per_mb * microbatches / share, 0, gpu, recompute=recompute)
    expert_share = compute["expert GEMM"] / sum(v for k, v in compute.items() if k != "optimizer")
    compute["optimizer"] = params_local / RATES["optimizer"] / gpu.compute_scale
    busy = sum(compute.values())
    overlap = dict(OVERLAP if overlap is None else overlap)
    if layout.pp_schedule == "dualpipev" and layout.pp > 1:
        overlap["ep"] = overlap["ep_dualpipev"]
    comm: dict[str, float] = {}
    per_link: dict[tuple[bool, str, str], float] = {}
    for c in collectives:
        seconds = c.count * collective_seconds(c, layout, gpu)
        comm[c.overlap] = comm.get(c.overlap, 0.0) + seconds
        reduction = c.overlap == "replicate" or (c.overlap == "fsdp" and c.kind == "reduce_scatter")
        key = (not reduction, c.overlap, link(c, layout))
        per_link[key] = per_link.get(key, 0.0) + seconds
    exposed = dict.fromkeys(comm, 0.0)
    last_backward = (busy - compute["optimizer"]) * 2.0 / 3.0 / microbatches
    for where in ("nvlink", "network"):  # what a link can hide is bounded by the compute it hides under
        room, tail = busy, last_backward
        for (anywhere, kind, at), seconds in sorted(per_link.items()):  # the reductions first, under the tail
            if at != where:
                continue
            hidden = min(overlap[kind] * seconds, room if anywhere else min(room, tail))
            room -= hidden
            tail -= 0.0 if anywhere else hidden
            exposed[kind] += seconds - hidden
    bubble = bubble_fraction(layout, expert_share) * (busy - compute["optimizer"])
    seconds = busy + sum(exposed.values()) + bubble
    tokens = tokens_per_mb * microbatches * layout.dp
    per_gpu = tokens / seconds / layout.world
    mfu = flops_per_token * per_gpu / (gpu.bf16_tflops * 1e12)
    return StepTime(compute, comm, exposed, bubble, seconds, per_gpu, mfu, overlap)
