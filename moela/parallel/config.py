"""The recipe's `parallel` section: how the world is factored into mesh dimensions and how the model is wrapped.

world_size = pp * dp_replicate * dp_shard * cp * tp. `ep` borrows ranks from dp_shard * cp (as torchtitan): it must
divide dp_shard * cp and be a multiple of cp. `dp_shard: -1` means "whatever is left of the world". The checks
that need the world size live in `moela.parallel.mesh.resolve_sizes`; `validate` checks what it can alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ParallelConfig:
    # pipeline parallelism (moela.parallel.pipeline): `pp` stages (outermost mesh dimension), each holding
    # `pp_virtual_stages` chunks of the model; every optimizer step's micro-batches run through them in
    # `pp_schedule`'s order. The micro-batches of a step are the data loader's `train.grad_accum` (pp_microbatches
    # must equal it; 0: take grad_accum)
    pp: int = 1
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "zbv", "dualpipev"] = "1f1b"
    pp_microbatches: int = 0
    pp_virtual_stages: int = 0  # chunks per rank; 0: the schedule's own (1 for 1f1b, 2 for the others)
    # which layers go where (moela.parallel.pp_layout, e.g. "Et|tt|tt|tmL"); empty: balanced by training FLOPs
    pp_layout: str = ""
    dp_replicate: int = 1  # HSDP replica groups (> 1: gradients all-reduced across replicas)
    dp_shard: int = -1  # FSDP2 shard group size; -1 = world_size / (dp_replicate * cp * tp)
    cp: int = 1  # context parallel group size (documents cut into 2*cp chunks)
    cp_layout: Literal["dualchunk", "striped"] = "dualchunk"
    tp: int = 1  # tensor (+ sequence) parallel group size: heads, FFN widths and vocabulary split over tp ranks
    ep: int = 1  # expert parallel group size (borrowed from dp_shard * cp)
    # how tokens reach their experts (moela.parallel.expert_parallel): gather = all-gather + reduce-scatter, no host
    # sync, static shapes; alltoall = exact-size all-to-all, one host sync per MoE layer; auto = gather when
    # ep <= top-k (it then moves no more bytes than the exact all-to-all) and its static expert layout fits the
    # kernels' int32 offsets, else alltoall
    ep_dispatch: Literal["auto", "gather", "alltoall"] = "auto"
    ep_chunks: int = 1  # 2: pipeline the expert GEMMs of one half of the tokens with the other half's collectives
    # FSDP2 over dp_shard * cp. false is accepted only where there is nothing to shard (dp_shard * cp = 1), and
    # then changes nothing: the model is replicated over dp_replicate through HSDP with one-rank shard groups
    fsdp: bool = True
    reshard_after_forward: bool = True
    # consecutive blocks per FSDP2 unit: n > 1 runs FSDP's hooks and collectives once per n blocks (less host work
    # per step) at the price of n blocks' parameters gathered at once
    fsdp_unit_blocks: int = 1
    # dtype of FSDP2's gradient reduce-scatter on CUDA (parameters are gathered in bf16 either way): float32 sums
    # exactly; bfloat16 halves the reduce-scatter's bytes, for slow links
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    activation_checkpointing: Literal["none", "full", "selective"] = "none"  # selective: every second block
    # one process on one CUDA device: run the MLP of each FAL block on a second stream, beside its attention
    fal_streams: bool = False
    # how gradients cross the dp_replicate dimension (moela.parallel.replicate): none = HSDP's exact all-reduce;
    # powersgd = rank-`powersgd_rank` PowerSGD with error feedback, after `powersgd_warmup_steps` exact steps
    # (null: schedule.warmup_steps, so AdamW's moments form on exact gradients while the learning rate ramps up)
    replicate_compression: Literal["none", "powersgd"] = "none"
    powersgd_rank: int = 4
    powersgd_warmup_steps: int | None = None

    def validate(self) -> list[str]:
        errors = []
        for name in ("pp", "dp_replicate", "cp", "tp", "ep"):
            if getattr(self, name) < 1:
                errors.append(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.ep_chunks not in (1, 2):
            errors.append(f"ep_chunks: must be 1 or 2, got {self.ep_chunks}")
        if self.fsdp_unit_blocks < 1:
            errors.append(f"fsdp_unit_blocks: must be >= 1, got {self.fsdp_unit_blocks}")
        if self.dp_shard == 0 or self.dp_shard < -1:
            errors.append(f"dp_shard: must be >= 1 or -1 (auto), got {self.dp_shard}")
        if self.powersgd_rank < 1:
            errors.append(f"powersgd_rank: must be >= 1, got {self.powersgd_rank}")
        if self.powersgd_warmup_steps is not None and self.powersgd_warmup_steps < 0:
            errors.append(f"powersgd_warmup_steps: must be >= 0, got {self.powersgd_warmup_steps}")
        if self.replicate_compression == "powersgd" and self.dp_replicate < 2:
            errors.append(f"replicate_compression: powersgd compresses the all-reduce over dp_replicate, which is "
                          f"{self.dp_replicate} here; set dp_replicate >= 2 or replicate_compression: none")
        if self.ep > 1 and self.cp > 1 and self.ep % self.cp:
            errors.append(f"ep: must be a multiple of cp={self.cp} (the EP group spans whole CP groups), got "
                          f"{self.ep}; set ep to a multiple of {self.cp} or 1")
        if self.pp_microbatches < 0:
            errors.append(f"pp_microbatches: must be >= 0 (0: train.grad_accum), got {self.pp_microbatches}")
        if self.pp_virtual_stages < 0:
            errors.append(f"pp_virtual_stages: must be >= 0 (0: the schedule's own), got {self.pp_virtual_stages}")
        if self.pp == 1 and (self.pp_layout or self.pp_virtual_stages > 1):
            errors.append("pp_layout / pp_virtual_stages: set for a run without pipeline parallelism (pp: 1); set "
                          "parallel.pp > 1 or remove them")
        return errors

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline rank: pp_virtual_stages, else 1 for 1f1b and 2 for the other schedules (the
        V-shaped zbv and dualpipev need exactly 2)."""
        if self.pp_virtual_stages:
            return self.pp_virtual_stages
        return 1 if self.pp_schedule == "1f1b" else 2


def tensor_parallel_errors(model, tp: int) -> list[str]:
    """What in the `model` section (a `moela.model.config.ModelConfig`) tensor parallelism over `tp` ranks cannot
    split evenly: heads, vocabulary (embedding and head rows), the dense FFN and the shared experts' width."""
    needs = {"num_attention_heads": model.num_attention_heads, "vocab_size": model.vocab_size}
    if model.first_k_dense_replace > 0:
        needs["intermediate_size"] = model.intermediate_size
    if model.n_shared_experts > 0 and model.num_hidden_layers > model.first_k_dense_replace:
        needs["moe_intermediate_size * n_shared_experts"] = model.moe_intermediate_size * model.n_shared_experts
    return [f"parallel.tp: {tp} does not divide model.{name}={value}; choose tp among its divisors"
            for name, value in needs.items() if value % tp]


def pipeline_errors(cfg: ParallelConfig, model, grad_accum: int, *, cuda_graphs: bool = False) -> list[str]:
    """What pipeline parallelism (`cfg.pp > 1`) cannot run with the `model` section and the step's `grad_accum`
    micro-batches: a layout that does not parse or split, micro-batch counts the schedule cannot run, virtual
    stage counts it does not have, tied embeddings (the embedding would be needed on the first and last stage)."""
    if cfg.pp == 1:
        return []
    from moela.parallel.pp_layout import stage_layout

    errors = []
    m, v, sched = cfg.pp_microbatches or grad_accum, cfg.virtual_stages, cfg.pp_schedule
    if cfg.pp_microbatches and cfg.pp_microbatches != grad_accum:
        errors.append(f"pp_microbatches: {cfg.pp_microbatches} but train.grad_accum is {grad_accum} (the pipeline "
                      f"runs the step's micro-batches); set train.grad_accum: {cfg.pp_microbatches} or "
                      f"pp_microbatches: 0")
    if sched in ("zbv", "dualpipev") and v != 2:
        errors.append(f"pp_virtual_stages: {sched} runs exactly 2 stages per rank (a V), got {v}; set it to 2 or 0")
    if sched == "interleaved_1f1b" and v < 2:
        errors.append(f"pp_virtual_stages: interleaved_1f1b needs >= 2 stages per rank, got {v}; set it to 2 or "
                      f"more, or pp_schedule: 1f1b")
    if sched == "1f1b" and v != 1:
        errors.append(f"pp_virtual_stages: 1f1b runs one stage per rank, got {v}; use pp_schedule: "
                      f"interleaved_1f1b for virtual stages")
    least = {"1f1b": 1, "interleaved_1f1b": cfg.pp, "zbv": 2 * cfg.pp - 1, "dualpipev": 2 * cfg.pp}[sched]
    if m < least or (sched == "interleaved_1f1b" and m % cfg.pp):
        need = "a multiple of pp" if sched == "interleaved_1f1b" else f">= {least}"
        errors.append(f"pp_microbatches: {sched} with pp={cfg.pp} needs {need} micro-batches per step, got {m} "
                      f"(train.grad_accum); raise train.grad_accum to {max(least, -(-m // cfg.pp) * cfg.pp)}")
    if model.tie_word_embeddings:
        errors.append("pp: tied embeddings put the embedding on the first and the last stage; set "
                      "model.tie_word_embeddings: false or parallel.pp: 1")
    if cuda_graphs:
        errors.append("pp: train.cuda_graphs captures one process's whole step; set train.cuda_graphs: false")
    try:
        stage_layout(model, cfg.pp, v, cfg.pp_layout or None)
    except ValueError as e:
        errors.append(str(e).removeprefix("parallel."))
    return errors
