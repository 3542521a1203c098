"""A pipeline stage of the real `Transformer`: `keep_stages` cuts the model down to the parts of this rank's stages,
`StageChunk` runs one stage's share of the forward.

Decisions:
- The model is cut from the outside, on the meta device, before parallelization and materialization
  (torchtitan's order), so a rank only ever allocates its stages' parameters. The cut model is still a
  `Transformer`: the kept main blocks and MTP depths sit in ModuleDicts keyed by their index in the whole model and
  the parts it lacks are None, so every parameter keeps the name it has in the whole model and checkpoints stay
  layout-free (`moela.trainer.checkpoint`). `init_weights` seeds each part apart (`Transformer.part_names`), so a
  stage initializes its parts to exactly the whole model's values.
- Every stage runs the model's own pieces (`prepare`, the blocks, `_ce_sum`, the MTP depths, `objective`): no
  second copy of the forward's math. Each stage prepares its own copy of the micro-batch (all stages of a
  pipeline read the same micro-batches: `moela.trainer.pipeline_step`), so positions, document offsets and
  per-document weights never travel and every received tensor's shape is known before it arrives.
- What travels from stage k to k + 1 (`wire_names`): the residual stream h [T, D]; for FAL blocks, once layer 0
  has run, its attention output a1 [T, D]; the MTP depths' input embeddings [T, D] each (made on the first stage,
  which holds the embedding, and passed along to the last, which holds the MTP depths: the embedding lives in one
  place, and its gradient comes back the same way).
- A stage's loss is its share of the objective (`Transformer.objective`): the balance and z-loss terms of its
  blocks, plus the LM and MTP losses on the last stage. The shares add up to the whole model's loss, and so do
  the detached metrics; each stage's expert load covers its own MoE layers.

Shapes: T tokens, D hidden, E experts, L_s this stage's MoE layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from moela.model.config import ModelConfig
from moela.model.transformer import Prepared, Transformer
from moela.parallel.pp_layout import StageParts

if TYPE_CHECKING:
    from moela.parallel.pp_overlap import GraphCuts


def keep_stages(model: Transformer, stages: list[StageParts], mine: list[int]) -> Transformer:
    """Cut `model` (on the meta device) down to the parts of stages `mine`, in place; returns it."""
    held = [stages[k] for k in mine]
    layers = sorted(i for s in held for i in s.layers)
    depths = sorted(d for s in held for d in s.mtp)
    model.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
    model.mtp = nn.ModuleDict({str(d): model.mtp[d] for d in depths})
    if not any(s.embed for s in held):
        model.embed = None
    if not any(s.loss for s in held):
        model.norm = None
        model.head = None
    return model


def wire_names(cfg: ModelConfig, stages: list[StageParts], k: int) -> list[str]:
    """The tensors stage k sends to stage k + 1, in order (module docstring)."""
    ran = sum(len(s.layers) for s in stages[:k + 1])
    return (["h"] + (["a1"] if cfg.block != "standard" and ran > 0 else [])
            + [f"mtp_embed.{d}" for d in range(cfg.num_nextn_predict_layers)])


@dataclass
class StageOutput:
    outputs: list[torch.Tensor]  # what goes to the next stage (wire_names order); empty on the last stage
    loss: torch.Tensor  # this stage's share of the micro-batch's objective (scalar)
    metrics: dict[str, torch.Tensor]  # its share of every detached statistic
    expert_load: torch.Tensor | None  # [L_s, E] tokens routed to each expert of its MoE layers (detached)


class StageChunk(nn.Module):
    """Stage `index` of the pipeline (`parts` of the model), run on this rank's cut model. A module of its own
    (never a child of the model, so parameter names stay the model's) holding the stage's parts: FSDP2 shards it
    as the stage's root unit, whose hooks then run around each call (the model's own root, whose forward a stage
    never calls, is not a unit under pipeline parallelism)."""

    def __init__(self, model: Transformer, stages: list[StageParts], index: int):
        super().__init__()
        object.__setattr__(self, "model", model)  # not a child: the model's names are the checkpoint's
        self.index, self.parts = index, stages[index]
        self.is_first, self.is_last = index == 0, index == len(stages) - 1
        self.in_names = [] if self.is_first else wire_names(model.cfg, stages, index - 1)
        self.out_names = [] if self.is_last else wire_names(model.cfg, stages, index)
        self.blocks = nn.ModuleList(model.layers[str(i)] for i in self.parts.layers)
        self.depths = nn.ModuleList(model.mtp[str(d)] for d in self.parts.mtp)
        self.embed = model.embed if self.is_first else None
        self.norm = model.norm if self.is_last else None
        self.head = model.head if self.is_last else None

    def forward(self, prep: Prepared, inputs: list[torch.Tensor], cuts: GraphCuts | None = None,
                between: Callable[[], None] | None = None) -> StageOutput:
        """This stage's forward on a prepared micro-batch; `inputs` [T, D] each, in `in_names` order.

        For DualPipeV's pairs (`moela.parallel.pp_overlap`): `cuts` cuts the autograd graph after the embedding and
        after each block (but the last, unless the head follows it), so that the backward can run block by block;
        `between()` is called before each block (the pair runs the other chunk's backward segments there)."""
        model, ctx = self.model, prep.ctx
        if self.is_first:
            h, a1 = model.embed(prep.batch.input_ids), None  # [T, D]
            embeds = [model.embed(tokens) for tokens, _ in prep.mtp_targets]  # [T, D] per depth
            if cuts is not None:
                h, *embeds = cuts.cut(h, *embeds)
        else:
            named = dict(zip(self.in_names, inputs))
            h, a1 = named["h"], named.get("a1")
            embeds = [named[n] for n in self.in_names if n.startswith("mtp_embed.")]
        zs, auxs, loads = [], [], []
        for i, block in enumerate(self.blocks):
            if between is not None:
                between()
            h, a1, z, aux, load = block(h, ctx, a1)  # [T, D]
            if cuts is not None and (self.is_last or i < len(self.blocks) - 1):  # the top segment has work
                h, a1, z, aux = cuts.cut(h, a1, z, aux)
            zs.append(z)
            if load is not None:
                auxs.append(aux)
                loads.append(load)
        lm_sum = mtp_sum = None
        if self.is_last:
            h = model.norm(h)  # [T, D]
            lm_sum = model._ce_sum(h, prep.batch.labels, False)[0]
            for module, emb, (_, labels) in zip(self.depths, embeds, prep.mtp_targets):
                h, normed, z, aux, load = module(h, emb, ctx)  # [T, D] x 2
                zs.append(z)
                if load is not None:
                    auxs.append(aux)
                    loads.append(load)
                ce = model._ce_sum(normed, labels, False)[0]
                mtp_sum = ce if mtp_sum is None else mtp_sum + ce
            outputs = []
        else:
            outputs = [h] + ([a1] if "a1" in self.out_names else []) + embeds
        num_targets = prep.num_targets
        denom = num_targets.clamp_min(1) if isinstance(num_targets, torch.Tensor) else max(num_targets, 1)
        loss, metrics = model.objective(denom, lm_sum=lm_sum, mtp_sum=mtp_sum, auxs=auxs, zs=zs)
        return StageOutput(outputs, loss, metrics, torch.stack(loads).detach() if loads else None)


def chunks_of(model: Transformer, stages: list[StageParts], mine: list[int]) -> dict[int, StageChunk]:
    """The `StageChunk` of each of this rank's stages (on the cut model, before it is parallelized)."""
    return {k: StageChunk(model, stages, k) for k in mine}
