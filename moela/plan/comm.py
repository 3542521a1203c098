"""The collectives one optimizer step issues on one rank, by kind, group and link, with the bytes it hands in
(`moela.parallel.comm.CommCounter`'s convention: a rank's shard for an all-gather, the whole input of a
reduce-scatter or all-reduce, the sent rows of an all-to-all).

Per step, from the parallel code's structure:
- FSDP2, per unit (a block's dense weights over dp_shard x cp; its routed experts over dp_shard x cp / ep; the
  root: embedding, final norm, head, MTP projections): an all-gather of the bf16 padded shards before each forward
  and again before each backward (blocks reshard after forward; the root does not, so it gathers once per
  micro-batch), and one fp32 reduce-scatter per step (gradients are synchronized on the last micro-batch only;
  with pipelining, by the stage's last backward of the step: `moela.parallel.pp_runtime`).
  With dp_replicate > 1 (HSDP) the reduced shard is then all-reduced across replicas; `replicate_compression`
  divides those bytes (a what-if), or under PowerSGD (`replicate_powersgd_rank`) they are what its reducer hands
  in (`powersgd_unit_bytes`; its compression compute is not priced).
- Expert parallelism, per MoE layer and micro-batch: `gather` all-gathers the padded tokens (bf16) and their ids
  and gate weights ([P, 2K] fp32) and reduce-scatters the partial outputs ([ep P, D] bf16); backward mirrors
  them. `alltoall` exchanges counts, then the (token, expert) rows each way, forward and backward; its bytes are
  the expected ones of uniform routing (the real split depends on the router).
- Tensor parallelism, per block and micro-batch: the latents' and the MLP input's all-gathers and one
  reduce-scatter per partial sum, mirrored in backward; the embedding's reduce-scatter and the loss's
  all-gather. Context parallelism: one all-gather of K and V per attention layer (a reduce-scatter of their
  gradients in backward). Pipeline parallelism: one send of the activation forward and of its gradient backward
  per micro-batch and chunk boundary.
- Once per step: the expert-load all-reduce ([L_moe, E] fp32 over the data ranks).

Shapes: T tokens of a micro-batch on this rank, D hidden, K top-k, E experts, P padded tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from moela.model.config import ModelConfig
from moela.parallel.powersgd import powersgd_bytes
from moela.plan.layout import Layout
from moela.plan.memory import BF16, FP32, ParamShard, ep_mode

VOCABULARY = ("embed.weight", "head.weight")  # sent whole by PowerSGD (moela.parallel.replicate)


@dataclass(frozen=True)
class Collective:
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | send
    group: str  # mesh view
    size: int  # ranks in the group
    count: int  # per step
    nbytes: int  # handed in per call
    what: str
    overlap: str  # which overlap assumption applies (moela.plan.timing.OVERLAP)

    @property
    def total(self) -> int:
        return self.count * self.nbytes


def powersgd_unit_bytes(shards: list[ParamShard], rank: int) -> int:
    """What `moela.parallel.replicate.ReplicateReducer` hands to the replicate all-reduces for these gradient
    shards at PowerSGD rank `rank`: P and Q of the matrices it compresses; 1-D tensors, small matrices and the
    vocabulary matrices (embedding, head) whole."""
    vocabulary = [s for s in shards if s.name in VOCABULARY]
    rest = [s.local_shape for s in shards if s.name not in VOCABULARY]
    return powersgd_bytes(rest, rank) + FP32 * sum(s.numel for s in vocabulary)


def fsdp_collectives(shards: list[ParamShard], layout: Layout, microbatches: int, stage: int = 0
                     ) -> list[Collective]:
    """FSDP2's collectives of the units held by pipeline rank `stage` (module docstring)."""
    if layout.world == 1:
        return []
    units: dict[tuple[str, str], int] = {}
    members: dict[tuple[str, str], list[ParamShard]] = {}
    for s in shards:
        if s.rank == stage:
            units[(s.unit, s.fsdp_group)] = units.get((s.unit, s.fsdp_group), 0) + s.padded_numel
            members.setdefault((s.unit, s.fsdp_group), []).append(s)
    out = []
    for (unit, group), padded in units.items():
        n = layout.efsdp if group == "efsdp" else layout.shard
        if n > 1:
            gathers = microbatches * (1 if unit == "root" else 2)
            out.append(Collective("all_gather", group, n, gathers, BF16 * padded, f"FSDP {unit}", "fsdp"))
            out.append(Collective("reduce_scatter", group, n, 1, FP32 * padded * n, f"FSDP {unit}", "fsdp"))
        if layout.dp_replicate > 1:
            nbytes = (powersgd_unit_bytes(members[(unit, group)], layout.replicate_powersgd_rank)
                      if layout.replicate_powersgd_rank else int(FP32 * padded / layout.replicate_compression))
            out.append(Collective("all_reduce", "dp_replicate", layout.dp_replicate, 1, nbytes, f"HSDP {unit}",
                                  "replicate"))
    return out


def step_collectives(cfg: ModelConfig, layout: Layout, shards: list[ParamShard], tokens: int, microbatches: int,
                     dispatch: str, stage: int = 0) -> list[Collective]:
    """Every collective of one step on pipeline rank `stage` (module docstring); tokens = tokens_per_microbatch."""
    out = fsdp_collectives(shards, layout, microbatches, stage)
    blocks = sorted({int(s.unit.split(".")[1]) for s in shards if s.unit != "root" and s.rank == stage})
    moe = [i for i in blocks if (i >= cfg.first_k_dense_replace if i < cfg.num_hidden_layers else cfg.mtp_is_moe)]
    local = -(-tokens // layout.cp)
    rows = -(-local // layout.tp)
    d, k = cfg.hidden_size, cfg.num_experts_per_tok
    mb = microbatches
    if layout.ep > 1 and moe:
        n, g = len(moe), layout.ep
        if ep_mode(cfg, layout, dispatch) == "gather":
            p = -(-rows // 256) * 256
            out += [Collective("all_gather", "ep", g, 2 * n * mb, BF16 * p * d, "EP tokens (fwd) / output grad (bwd)",
                               "ep"),
                    Collective("all_gather", "ep", g, n * mb, FP32 * p * 2 * k, "EP ids + gate weights", "ep"),
                    Collective("reduce_scatter", "ep", g, 2 * n * mb, BF16 * g * p * d,
                               "EP partial outputs (fwd) / token grads (bwd)", "ep"),
                    Collective("reduce_scatter", "ep", g, n * mb, FP32 * g * p * 2 * k, "EP gate-weight grads", "ep")]
        else:
            sent = rows * k * BF16 * d
            out += [Collective("all_to_all", "ep", g, n * mb, 8 * cfg.n_routed_experts, "EP counts", "ep"),
                    Collective("all_to_all", "ep", g, 4 * n * mb, sent, "EP rows (dispatch, combine, x2 bwd)",
                               "ep")]
    if layout.tp > 1 and blocks:
        n, g = len(blocks), layout.tp
        latent = (cfg.q_lora_rank or d) + cfg.kv_lora_rank + cfg.qk_rope_head_dim
        out += [Collective("all_gather", "tp", g, 2 * n * mb, BF16 * rows * latent, "TP latents (+ grad RS)", "tp"),
                Collective("all_gather", "tp", g, 2 * n * mb, BF16 * rows * d, "TP MLP input (+ grad RS)", "tp"),
                Collective("reduce_scatter", "tp", g, 4 * n * mb, BF16 * rows * g * d, "TP partial sums (+ grad AG)",
                           "tp")]
    if layout.cp > 1 and blocks:
        kv = cfg.num_attention_heads // layout.tp * (cfg.qk_head_dim + cfg.v_head_dim)
        out.append(Collective("all_gather", "cp", layout.cp, 2 * len(blocks) * mb, BF16 * local * kv,
                              "CP keys + values (+ grad RS)", "cp"))
    if layout.pp > 1:
        chunks = layout.stages // layout.pp
        out.append(Collective("send", "pp", 2, 2 * mb * chunks, BF16 * rows * d, "PP activations + grads", "pp"))
    if moe and layout.dp_replicate * layout.shard > 1:
        loads = cfg.num_moe_blocks * cfg.n_routed_experts
        out.append(Collective("all_reduce", "dp_cp", layout.dp_replicate * layout.shard, 1, FP32 * loads,
                              "expert load (router bias)", "small"))
    return out
