"""Pipeline parallelism's entry point: `build_pipeline` cuts the model into this rank's stages, parallelizes and
materializes them, and returns the `Pipeline` that runs a step's micro-batches through them.

Decisions:
- Stages come from `parallel.pp_layout` or the FLOP-balanced default (`moela.parallel.pp_layout`), placed on
  ranks round-robin (1f1b, interleaved_1f1b) or in a V (zbv, dualpipev: `stage_ranks`).
- Order (torchtitan's): the whole model on the meta device, cut to this rank's stages (`keep_stages`),
  parallelized inside its stage (FSDP2, EP, CP, TP on the mesh's non-pipeline dimensions), materialized and
  initialized; so a rank allocates only its share, with the whole model's initial values.
- All ranks of a pipeline read the same micro-batches (the loader is per data-parallel rank, and the pipeline
  ranks share one): nothing but activations and their gradients crosses stages (`moela.parallel.pp_stage`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moela.model import build_model
from moela.model.config import ModelConfig
from moela.model.transformer import Transformer
from moela.parallel.config import ParallelConfig
from moela.parallel.mesh import ParallelMesh
from moela.parallel.pp_comm import StageLinks
from moela.parallel.pp_layout import StageParts, stage_layout, stage_ranks
from moela.parallel.pp_overlap import StreamPairOverlap
from moela.parallel.pp_runtime import PipelineRuntime
from moela.parallel.pp_schedules import schedule_actions
from moela.parallel.pp_stage import StageChunk, chunks_of, keep_stages


@dataclass
class Pipeline:
    model: Transformer  # this rank's stages of the model (parameter names those of the whole model)
    runtime: PipelineRuntime
    stages: list[StageParts]  # every stage of the pipeline, in order
    mine: list[int]  # the stages this rank holds
    moe_rows: list[int]  # for each of this rank's MoE layers, its row in the whole model's expert load

    def full_expert_load(self, load: torch.Tensor) -> torch.Tensor:
        """This rank's rows [L_r, E] placed in a zero [L_moe, E] of the whole model (sum it over the pipeline)."""
        full = load.new_zeros(_moe_count(self.model.cfg), load.shape[1])
        full[self.moe_rows] = load
        return full


def _moe_count(cfg: ModelConfig) -> int:
    main = max(cfg.num_hidden_layers - cfg.first_k_dense_replace, 0)
    return main + (cfg.num_nextn_predict_layers if cfg.mtp_is_moe else 0)


def _moe_rows(cfg: ModelConfig, layers: list[int], depths: list[int]) -> list[int]:
    main = max(cfg.num_hidden_layers - cfg.first_k_dense_replace, 0)
    rows = [i - cfg.first_k_dense_replace for i in layers if i >= cfg.first_k_dense_replace]
    return rows + ([main + d for d in depths] if cfg.mtp_is_moe else [])


def pipeline_ranks(mesh: ParallelMesh) -> tuple[list[int], list[list[int]]]:
    """(global ranks of this rank's pipeline by pp rank, the same for every pipeline)."""
    if mesh.world is None:  # one process: every stage on it
        return [0], [[0]]
    grid = mesh.world.mesh.reshape(mesh.sizes.pp, -1)  # [pp, ranks per stage]
    everyone = grid.T.tolist()
    me = torch.distributed.get_rank()
    return next(p for p in everyone if me in p), everyone


def build_pipeline(model_cfg: ModelConfig, pcfg: ParallelConfig, mesh: ParallelMesh, device: torch.device,
                   microbatches: int, *, parallelize: Callable[[Transformer, list[StageChunk]], object] | None = None,
                   seq_len: int = 4096, counts: dict | None = None, overlap: bool = True) -> Pipeline:
    """This rank's stages, parallelized by `parallelize(model, chunks)` (on the cut meta model; the chunks are
    FSDP's root units, `apply_parallelism`'s `fsdp_roots`) and materialized, with the runtime of
    `pcfg.pp_schedule` for steps of `microbatches` micro-batches. `counts` (tests): the transport counts its
    messages into it. `overlap`: dualpipev's pairs through `StreamPairOverlap` (else forward then backward)."""
    v = pcfg.virtual_stages
    stages = stage_layout(model_cfg, pcfg.pp, v, pcfg.pp_layout or None, seq_len=seq_len)
    placement = stage_ranks(pcfg.pp, v, pcfg.pp_schedule)
    pp_rank = mesh.rank("pp")
    mine = [k for k, r in enumerate(placement) if r == pp_rank]

    chunks: dict[int, StageChunk] = {}

    def cut(model: Transformer) -> None:
        keep_stages(model, stages, mine)
        chunks.update(chunks_of(model, stages, mine))
        if parallelize is not None:
            parallelize(model, [chunks[k] for k in mine])

    model = build_model(model_cfg, device, parallelize=cut)
    ranks, everyone = pipeline_ranks(mesh)
    links = StageLinks([ranks[r] for r in placement], [[p[r] for r in placement] for p in everyone], counts)
    actions = schedule_actions(pcfg.pp_schedule, pcfg.pp, microbatches, v)[pp_rank]
    pair = StreamPairOverlap(pcfg.pp, device) if overlap and pcfg.pp_schedule == "dualpipev" else None
    runtime = PipelineRuntime(model, chunks, len(stages), actions, links, device, overlap_f_b=pair)
    layers = sorted(i for k in mine for i in stages[k].layers)
    depths = sorted(d for k in mine for d in stages[k].mtp)
    return Pipeline(model, runtime, stages, mine, _moe_rows(model_cfg, layers, depths))
