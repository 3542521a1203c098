"""Memory per GPU: parameters, gradients and optimizer state of this rank's shards (exact), the working copies
FSDP gathers, the activations one micro-batch saves for backward, how many micro-batches are in flight, the
expert-parallel buffers, and the allocator's reserve.

Decisions:
- Sharded state is counted, not estimated: the model is built on the meta device (no memory; V3 in a fraction of
  a second) and every parameter's local shape follows the rules the parallel code applies, in its order: tensor
  parallelism shards a projection's output rows (column-parallel: `wq`/`wq_b`, `wkv_b`, `w1`, `w3`, embedding,
  head) or input columns (row-parallel: `wo`, `w2`) over tp; expert parallelism keeps E / ep routed experts;
  FSDP2 then splits dim 0 of the local tensor like `torch.chunk` over its group (dp_shard x cp for dense weights,
  dp_shard x cp / ep for experts), so rank 0 holds ceil(rows / n) rows, the most of any rank. The figures are
  rank 0's, checked equal to the sharded model of `moela.plan.fake_world` by the tests.
- Dtypes as the trainer runs on CUDA: fp32 master weights and gradients (FSDP reduces in fp32), AdamW moments in
  `optim.moment_dtype`, one fp32 step counter per parameter tensor; FSDP gathers bf16 working copies.
- Activations are the tensors one block keeps for its backward, per token, as the CUDA path saves them (the
  autograd functions' `save_for_backward` lists: MLA saves q, k, v, out and the log-sum-exp; the expert op the
  gathered SwiGLU input h [M, 2F] and output o [M, D] over its padded layout of M rows; every linear its input;
  norms their input and 1/rms); `block_activation_terms` names each term. On one GPU each block also keeps
  autocast's bf16 copy of its matrices. Under full activation checkpointing a block keeps its input only, and one
  block's worth is rebuilt during its backward.
- The peak is taken over backward: it frees a block's activations as it writes that block's gradients, so with
  one micro-batch per step the two never peak together (`backward_overlap`).
- Micro-batches in flight on pipeline rank s, in units of the rank's blocks' activations of one micro-batch:
  1F1B pp - s; interleaved 1F1B with v chunks per rank (2(pp - 1 - s) + (v - 1) pp + 1) / v; ZBV pp and
  DualPipeV pp + 1/2 (their two directions fill both chunks of every rank; the counts of moela's schedules). Each
  rank holds the chunks `moela.parallel.pp_layout.stage_ranks` gives it (DualPipeV: chunks s and 2pp - 1 - s).
  Without pipelining one micro-batch is in flight (gradient accumulation runs them one after the other).
- With pipelining, FSDP runs as without it, once per micro-batch (moela's pipeline leaves gradient sync on): a
  unit is gathered for each micro-batch's forward and backward and reduce-scatters each micro-batch's gradients,
  so only sharded gradients are held.
- Reserve: the CUDA context and NCCL's buffers (a fixed `CONTEXT_GIB`) and the caching allocator's fragmentation
  (`FRAGMENTATION` of what is allocated) are assumptions, stated in the report; the measured peaks moela compares
  against are `torch.cuda.max_memory_allocated`, which excludes both.

Shapes: T tokens of a micro-batch on this rank, D hidden, H heads, K top-k, E experts, F expert width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moela.model.config import ModelConfig
from moela.plan.layout import Layout

GIB = 2**30
CONTEXT_GIB = 1.0  # CUDA context + NCCL communicators per process (assumption; not in max_memory_allocated)
FRAGMENTATION = 0.05  # caching allocator's reserved-over-allocated overhead at the peak (assumption)
BF16, FP32 = 2, 4

_COLWISE = ("attn.wq.weight", "attn.wq_b.weight", "attn.wkv_b.weight", "w1.weight", "w3.weight")
_ROWWISE = ("attn.wo.weight", "w2.weight")


@dataclass(frozen=True)
class ParamShard:
    name: str
    local_shape: tuple[int, ...]  # this rank's (rank 0's) tensor
    padded_numel: int  # what FSDP's all-gather sends from each rank (dim 0 padded to ceil(rows / n))
    unsharded_numel: int  # the tp/ep-local tensor FSDP gathers back
    rank: int  # pipeline rank holding it
    unit: str  # FSDP unit: "block.<i>", "experts.<i>" or "root"
    fsdp_group: str  # mesh view FSDP shards it over: dp_shard_cp or efsdp

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)


def _tp_dim(name: str, tp: int) -> int | None:
    """The dim tensor parallelism shards `name` on, None if replicated over tp."""
    if tp == 1:
        return None
    if name in ("embed.weight", "head.weight") or name.endswith(_COLWISE) and ".experts." not in name:
        return 0
    if name.endswith(_ROWWISE) and ".experts." not in name:
        return 1
    if name.endswith(("attn.q_qk_norm.weight", "attn.k_qk_norm.weight")):
        return 0
    return None


def _chunk_rows(rows: int, n: int) -> int:
    """Rows of rank 0 when `torch.chunk` (FSDP2's split) cuts `rows` into n pieces."""
    return min(rows, -(-rows // n))


def param_specs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the model, built on the meta device (no memory)."""
    from moela.model.transformer import Transformer
    with torch.device("meta"):
        model = Transformer(cfg)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def block_chunks(cfg: ModelConfig, layout: Layout) -> list[int]:
    """Pipeline chunk of each block (main blocks, then MTP blocks), as `moela.parallel.pp_layout` places them."""
    blocks = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    if layout.pp == 1:
        return [0] * blocks
    from moela.parallel.pp_layout import stage_layout
    out = [0] * blocks
    for k, parts in enumerate(stage_layout(cfg, layout.pp, layout.pp_virtual_stages, layout.pp_layout or None)):
        for i in parts.layers:
            out[i] = k
        for d in parts.mtp:
            out[cfg.num_hidden_layers + d] = k
    return out


def chunk_ranks(layout: Layout) -> list[int]:
    """The pipeline rank of each chunk (`moela.parallel.pp_layout.stage_ranks`)."""
    if layout.pp == 1:
        return [0]
    from moela.parallel.pp_layout import stage_ranks
    return stage_ranks(layout.pp, layout.pp_virtual_stages, layout.pp_schedule)


def param_shards(cfg: ModelConfig, layout: Layout, specs: list[tuple[str, tuple[int, ...]]] | None = None
                 ) -> list[ParamShard]:
    """Every parameter's shard on rank 0 (module docstring); `specs`: `param_specs(cfg)`, if already made."""
    specs = param_specs(cfg) if specs is None else specs
    main = cfg.num_hidden_layers
    chunks, ranks = block_chunks(cfg, layout), chunk_ranks(layout)
    sharded = layout.world > 1
    out = []
    for name, global_shape in specs:
        shape = list(global_shape)
        if (dim := _tp_dim(name, layout.tp)) is not None:
            shape[dim] //= layout.tp
        expert = ".experts." in name
        if expert:
            shape[0] //= layout.ep
        parts = name.split(".")
        if parts[0] == "layers":
            index = int(parts[1])
        elif parts[0] == "mtp" and parts[2] == "block":
            index = main + int(parts[1])
        else:
            index = None
        if index is None:  # the embedding opens the first chunk; final norm, head and MTP projections the last
            chunk, unit = (0 if parts[0] == "embed" else len(ranks) - 1), "root"
        else:
            own = expert and layout.ep > 1  # routed experts are their own FSDP unit under expert parallelism only
            chunk, unit = chunks[index], f"{'experts' if own else 'block'}.{index}"
        group = "efsdp" if expert and layout.ep > 1 else "dp_shard_cp"
        n = layout.efsdp if group == "efsdp" else layout.shard
        rest = math.prod(shape[1:])
        unsharded = math.prod(shape)
        rows = _chunk_rows(shape[0], n) if sharded else shape[0]
        padded = -(-shape[0] // n) * rest if sharded else unsharded
        out.append(ParamShard(name, (rows, *shape[1:]), padded, unsharded, ranks[chunk], unit, group))
    return out


def by_stage(shards: list[ParamShard], layout: Layout) -> list[list[ParamShard]]:
    """The shards of each pipeline rank."""
    out: list[list[ParamShard]] = [[] for _ in range(layout.pp)]
    for s in shards:
        out[s.rank].append(s)
    return out


@dataclass
class StateBytes:
    params: int
    grads: int
    optimizer: int


def state_bytes(shards: list[ParamShard], moment_bytes: int) -> StateBytes:
    """fp32 master weights and gradients, two AdamW moments in `moment_bytes`, one fp32 step per tensor."""
    numel = sum(s.numel for s in shards)
    return StateBytes(FP32 * numel, FP32 * numel, 2 * moment_bytes * numel + FP32 * len(shards))


# ---- activations --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """What a step is on this rank: micro-batches of `tokens`, and how tokens reach their experts."""

    tokens: int  # tokens_per_microbatch (the micro-batch before CP / TP split)
    microbatches: int  # per optimizer step on each data-parallel rank (grad_accum, or the pipeline's)
    ep_dispatch: str = "auto"


def ep_mode(cfg: ModelConfig, layout: Layout, dispatch: str) -> str:
    """gather or alltoall, as `ExpertParallelExperts` picks it (auto: gather when ep <= K)."""
    if dispatch != "auto":
        return dispatch
    return "gather" if layout.ep <= cfg.num_experts_per_tok else "alltoall"


def expert_rows(cfg: ModelConfig, layout: Layout, tokens: int, dispatch: str) -> int:
    """Rows of the expert op's layout on this rank (M): its static bound in gather mode (ep x tokens x K), the
    expected received (token, expert) pairs of uniform routing for the all-to-all."""
    from moela.ops.moe.kernels.layout import build_layout_rows  # the expert op's own bound (imports Triton)
    k, e_local = cfg.num_experts_per_tok, cfg.n_routed_experts // layout.ep
    if layout.ep == 1:
        return build_layout_rows(tokens, k, e_local)
    if ep_mode(cfg, layout, dispatch) == "gather":
        padded = -(-tokens // 256) * 256
        return build_layout_rows(layout.ep * padded, k, e_local)
    return build_layout_rows(tokens, k, e_local)


def block_activation_terms(cfg: ModelConfig, layout: Layout, tokens: int, moe: bool, dispatch: str
                           ) -> dict[str, int]:
    """ACTIVATION_INVENTORY: bytes one block saves for backward for `tokens` tokens of this rank (after the CP
    split; TP splits heads and FFN widths and keeps sequence-parallel rows)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads // layout.tp
    t, rows = tokens, -(-tokens // layout.tp)  # tokens attention sees, sequence-parallel rows
    qk, dv, c, r = cfg.qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    cq = cfg.q_lora_rank or 0
    terms = {
        "residual + attn norm (fp32 x, 1/rms)": rows * (FP32 * d + FP32),
        "normed input of wq_a / wkv_a (bf16)": rows * BF16 * d,
        "q latent + q_norm (bf16)": t * (2 * BF16 * cq + FP32) if cq else 0,
        "kv latent + kv_norm (bf16)": t * (BF16 * (c + r) + BF16 * c + FP32),
        "q, k, v, out (bf16) + lse (fp32)": t * h * (BF16 * (2 * qk + 2 * dv) + FP32),
        "ffn residual + norm (fp32 x, 1/rms; bf16 out)": rows * (FP32 * d + FP32 + BF16 * d),
    }
    if moe:
        k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
        m = expert_rows(cfg, layout, rows, dispatch)
        fs = cfg.moe_intermediate_size * cfg.n_shared_experts // layout.tp
        terms["router logits, scores, top-k (fp32, int64)"] = rows * (FP32 * 2 * e + (8 + FP32) * k)
        if cfg.aux_loss_coef > 0:
            terms["balance loss (fp32 [T, E] x2)"] = rows * FP32 * 2 * e
        terms["routed experts: h [M, 2F], o [M, D] (bf16), layout (int32)"] = (
            m * (BF16 * (2 * cfg.moe_intermediate_size + d) + 8) + rows * k * 4)
        if layout.ep > 1 and ep_mode(cfg, layout, dispatch) == "gather":
            terms["EP gather: gathered x and ids/weights"] = (m // k) * (BF16 * d + FP32 * 2 * k)
        if fs:
            terms["shared experts: w1, w3 out + SwiGLU out (bf16)"] = t * BF16 * 3 * fs
    else:
        f = cfg.intermediate_size // layout.tp
        terms["dense FFN: w1, w3 out + SwiGLU out (bf16)"] = t * BF16 * 3 * f
    return terms


@dataclass
class Memory:
    """Bytes per GPU on the pipeline stage that holds the most (`stage`)."""

    stage: int
    params: int
    grads: int
    optimizer: int
    working_params: int  # FSDP's gathered bf16 copies (and their gradients) at the peak; bf16 weight casts on 1 GPU
    activations_per_microbatch: int
    microbatches_in_flight: float
    activations: int
    transient: int  # one block's backward: the gradients of its activations (and its recompute, under AC)
    ep_buffers: int
    logits: int
    reserve: int
    terms: dict[str, int] = field(default_factory=dict)  # one block's inventory (the largest block)
    not_at_once: int = 0  # gradients not yet written while activations are still held (`backward_overlap`)

    @property
    def allocated(self) -> int:
        return (self.params + self.grads + self.optimizer + self.working_params + self.activations
                + self.transient + self.ep_buffers + self.logits - self.not_at_once)

    @property
    def total(self) -> int:
        return self.allocated + self.reserve


def in_flight(layout: Layout, stage: int = 0) -> float:
    """Micro-batches whose activations pipeline rank `stage` holds at the peak, in units of its blocks'
    activations of one micro-batch (the schedules' counts in docs/parallelism.md)."""
    pp, v = layout.pp, layout.pp_virtual_stages
    if pp == 1:
        return 1.0
    if layout.pp_schedule == "1f1b":
        return float(pp - stage)
    if layout.pp_schedule == "interleaved_1f1b":  # warm-up of (pp - 1 - s) * 2 + (v - 1) * pp chunks of 1/v each
        return (2 * (pp - 1 - stage) + (v - 1) * pp + 1) / v
    return pp + (0.5 if layout.pp_schedule == "dualpipev" else 0.0)  # both chunks fill from the two ends


def block_kinds(cfg: ModelConfig) -> list[bool]:
    """Whether each block (main, then MTP) is MoE."""
    main = [i >= cfg.first_k_dense_replace for i in range(cfg.num_hidden_layers)]
    return main + [cfg.mtp_is_moe] * cfg.num_nextn_predict_layers


def stage_memory(cfg: ModelConfig, layout: Layout, work: Workload, mine: list[ParamShard], stage: int, *,
                 moment_bytes: int, ac: str) -> Memory:
    """Memory of pipeline rank `stage`, which holds `mine` (stage s of 1F1B holds pp - s micro-batches)."""
    tokens = -(-work.tokens // layout.cp)
    kinds = block_kinds(cfg)
    st = state_bytes(mine, moment_bytes)
    held = sorted({int(s.unit.split(".")[1]) for s in mine if s.unit != "root"})
    terms = [block_activation_terms(cfg, layout, tokens, kinds[i], work.ep_dispatch) for i in held]
    acts = [sum(t.values()) for t in terms]
    input_only = -(-tokens // layout.tp) * FP32 * cfg.hidden_size
    kept = [input_only if ac == "full" or (ac == "selective" and j % 2 == 1) else a for j, a in enumerate(acts)]
    copies = _weight_copies(mine, layout, held)
    kept = [a + c for a, c in zip(kept, copies)]
    per_mb = sum(kept)
    flight = in_flight(layout, stage)
    transient = max(acts, default=0) * (2 if ac != "none" else 1)
    ep = _ep_buffers(cfg, layout, tokens, work.ep_dispatch) if any(kinds[i] for i in held) else 0
    logits = _logits_bytes(cfg, layout, tokens) if any(s.name.startswith("head.") for s in mine) else 0
    largest = terms[acts.index(max(acts))] if acts else {}
    grads = [FP32 * sum(s.numel for s in mine if s.unit != "root" and int(s.unit.split(".")[1]) == i) for i in held]
    credit = backward_overlap(kept, grads) if work.microbatches == 1 else 0
    return Memory(stage, st.params, st.grads, st.optimizer, _working_params(mine, layout), per_mb, flight,
                  int(per_mb * flight), transient, ep, logits, 0, largest, credit)


def backward_overlap(acts: list[int], grads: list[int]) -> int:
    """Bytes that activations and gradients never hold at once in a step of one micro-batch: backward frees block
    j's activations (`acts`, forward order) as it writes block j's gradients (`grads`), so the peak over backward is
    max over i of (activations of blocks <= i + gradients of blocks >= i), not their sum. With several
    micro-batches the gradients of the first stay for the rest, and nothing is saved."""
    if not acts:
        return 0
    total = sum(acts) + sum(grads)
    peak = max(sum(acts[:i + 1]) + sum(grads[i:]) for i in range(len(acts)))
    return total - peak


def memory(cfg: ModelConfig, layout: Layout, work: Workload, *, moment_bytes: int, ac: str = "none",
           shards: list[ParamShard] | None = None) -> Memory:
    """Memory per GPU on the pipeline rank that holds the most, with the allocator's reserve."""
    shards = param_shards(cfg, layout) if shards is None else shards
    stages = [stage_memory(cfg, layout, work, mine, s, moment_bytes=moment_bytes, ac=ac)
              for s, mine in enumerate(by_stage(shards, layout))]
    best = max(stages, key=lambda m: m.allocated)
    best.reserve = int(CONTEXT_GIB * GIB + FRAGMENTATION * best.allocated)
    return best


def _weight_copies(mine: list[ParamShard], layout: Layout, held: list[int]) -> list[int]:
    """One GPU: autocast's bf16 copy of each block's matrices, which the block saves for its backward (freed with
    its activations); FSDP gathers bf16 weights instead, counted in `_working_params`."""
    if layout.world > 1:
        return [0] * len(held)
    per = dict.fromkeys(held, 0)
    for s in mine:
        if s.unit != "root" and len(s.local_shape) >= 2:
            per[int(s.unit.split(".")[1])] += BF16 * s.unsharded_numel
    return [per[i] for i in held]


def _working_params(mine: list[ParamShard], layout: Layout) -> int:
    """FSDP (world > 1): the root's gathered bf16 weights for the whole step, plus the two largest block units
    (the one running and the one prefetched) in bf16 and, in backward, that unit's unsharded fp32 gradient for the
    reduce-scatter. One GPU: autocast's bf16 copy of the output head (the blocks' copies count with their
    activations, `_weight_copies`)."""
    if layout.world == 1:
        return BF16 * sum(s.unsharded_numel for s in mine if s.name.startswith("head."))
    units: dict[str, int] = {}
    for s in mine:
        key = s.unit.replace("experts", "block")
        units[key] = units.get(key, 0) + s.unsharded_numel
    root = units.pop("root", 0)
    top = sorted(units.values(), reverse=True)[:2]
    return BF16 * root + BF16 * sum(top) + FP32 * (top[0] if top else 0)


def _ep_buffers(cfg: ModelConfig, layout: Layout, tokens: int, dispatch: str) -> int:
    """Expert parallelism's collective buffers of one MoE layer in flight (freed after it): the gathered tokens
    and the partial outputs (gather), or the sent and received rows (all-to-all); both directions."""
    if layout.ep == 1:
        return 0
    rows = -(-tokens // layout.tp)
    d = cfg.hidden_size
    if ep_mode(cfg, layout, dispatch) == "gather":
        padded = -(-rows // 256) * 256
        return 2 * layout.ep * padded * BF16 * d
    return 2 * 2 * rows * cfg.num_experts_per_tok * BF16 * d


def _logits_bytes(cfg: ModelConfig, layout: Layout, tokens: int) -> int:
    """The fused head + cross-entropy's working set: its saved input (bf16) and per-token lse, and one chunk of
    logits in fp32 (`moela.ops.linear_cross_entropy` processes the vocabulary in chunks) - bounded by the
    model's full logits for small vocabularies."""
    rows = -(-tokens // layout.tp)
    heads = 1 + cfg.num_nextn_predict_layers
    chunk = min(tokens * cfg.vocab_size // layout.tp, 8192 * 8192)
    return heads * rows * (BF16 * cfg.hidden_size + FP32) + FP32 * chunk
