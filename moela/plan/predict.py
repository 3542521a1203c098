"""`predict(cfg, layout, gpu)`: one layout's plan - memory per GPU, the step's collectives, step time, tokens/s
and MFU - from a loaded recipe (`moela.config.Config`) and a `Layout`.

Decisions:
- What a step is: `train.tokens_per_microbatch` tokens per micro-batch, `train.grad_accum` micro-batches per
  data-parallel rank (with pipelining, the schedule's: `parallel.pp_microbatches` or `train.grad_accum`).
  Attention's cost follows the documents' token-weighted mean length (`doc_len`; default the recipe's
  `data.max_doc_len`, capped by the micro-batch).
- The optimizer state's dtype is `optim.moment_dtype`; MFU uses the trainer's FLOPs per token
  (`moela.model.params.flops_per_token`) at `doc_len` and the GPU's dense bf16 peak, as the step line does.
- The meta model is built once per model config and its parameter shapes reused across layouts (`--search`
  prices hundreds).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from moela.model.config import ModelConfig
from moela.model.params import flops_per_token
from moela.plan.comm import Collective, step_collectives
from moela.plan.layout import GPU, Layout
from moela.plan.memory import GIB, Memory, Workload, memory, param_shards, param_specs
from moela.plan.timing import StepTime, step_time


@dataclass
class Plan:
    layout: Layout
    gpu: GPU
    memory: Memory
    collectives: list[Collective]
    time: StepTime
    tokens_per_microbatch: int
    microbatches: int
    doc_len: float

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.gpu.memory_gib * GIB

    @property
    def memory_ratio(self) -> float:
        return self.memory.total / (self.gpu.memory_gib * GIB)


@functools.lru_cache(maxsize=4)
def _specs(cfg_key: tuple) -> list:
    return param_specs(ModelConfig(**dict(cfg_key)))


@functools.lru_cache(maxsize=256)
def _shards(cfg_key: tuple, layout: Layout) -> list:
    return param_shards(ModelConfig(**dict(cfg_key)), layout, _specs(cfg_key))


def _shard_key(layout: Layout) -> Layout:
    """The layout with only what parameter shards depend on (search varies the rest)."""
    return replace(layout, pp_microbatches=1, activation_checkpointing="none", replicate_compression=1.0,
                   replicate_powersgd_rank=0, dp_replicate=min(layout.dp_replicate, 2))


def _key(cfg: ModelConfig) -> tuple:
    return tuple((k, v) for k, v in vars(cfg).items() if k != "rope_scaling")


def doc_length(cfg, tokens: int) -> float:
    """Token-weighted document length the attention cost assumes (module docstring)."""
    return float(min(tokens, cfg.data.max_doc_len or cfg.model.max_position_embeddings))


def predict(cfg, layout: Layout, gpu: GPU, *, doc_len: float | None = None, microbatches: int | None = None,
            only_if_fits: bool = False, overlap: dict[str, float] | None = None) -> Plan | None:
    """The plan of `layout`; with `only_if_fits`, None for a layout whose memory exceeds the GPU's (its step time
    is then not priced). `overlap` replaces `moela.plan.timing.OVERLAP` (what-if studies)."""
    model = cfg.model
    tokens = cfg.train.tokens_per_microbatch
    mbs = microbatches or (layout.pp_microbatches if layout.pp > 1 else cfg.train.grad_accum)
    doc = doc_len or doc_length(cfg, tokens)
    shards = _shards(_key(model), _shard_key(layout))
    moment = 2 if cfg.optim.moment_dtype == "bfloat16" else 4
    work = Workload(tokens, mbs, cfg.parallel.ep_dispatch)
    mem = memory(model, layout, work, moment_bytes=moment, ac=layout.activation_checkpointing, shards=shards)
    if only_if_fits and mem.total > gpu.memory_gib * GIB:
        return None
    colls = step_collectives(model, layout, shards, tokens, mbs, cfg.parallel.ep_dispatch, mem.stage)
    local = sum(s.numel for s in shards if s.rank == mem.stage)
    recompute = {"none": 0.0, "full": 1.0, "selective": 0.5}[layout.activation_checkpointing]
    t = step_time(model, layout, gpu, colls, tokens_per_mb=tokens, microbatches=mbs, doc_len=doc,
                  params_local=local, recompute=recompute, flops_per_token=flops_per_token(model, int(doc)),
                  overlap=overlap)
    return Plan(layout, gpu, mem, colls, t, tokens, mbs, doc)
