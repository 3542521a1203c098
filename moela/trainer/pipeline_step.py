"""The trainer's side of pipeline parallelism (`parallel.pp > 1`): `PipelineStep` builds this rank's stages and
runs a step's micro-batches, and an evaluation, through them.

Decisions:
- Every rank of a pipeline reads the same micro-batches: the data loader is built per data-parallel rank and the
  stages of one pipeline share it (the `dp` view excludes `pp`), so its position is one per global batch, saved
  and resumed like any run's, and the step's labelled-token count is the loader's global one.
- The step's sums (loss and metric shares times labelled tokens) are added over the pipeline as well as over
  `dp_cp`: each stage holds its share of every term (`moela.parallel.pp_stage`), so the sum is the whole model's.
  The gradient norm combines the stages' norms (`clip_grad_norm_(across=pp)`). Each stage updates the router bias
  of its own MoE layers from its rows of the expert load; the imbalance statistic reads all rows, summed over the
  pipeline.
- The step line's MFU counts the model once (the FLOPs of the whole model over all ranks' time), so the pipeline's
  bubble shows as lost MFU; `pp_bubble` logs the schedule's bubble share on the cost model F:B:W = 1:2:1
  (`moela.parallel.pp_schedules.simulate`), the share the schedule loses before any imbalance between stages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moela.batch import PackedBatch
from moela.config import Config
from moela.parallel import apply_parallelism
from moela.parallel.mesh import ParallelMesh
from moela.parallel.pipeline import Pipeline, build_pipeline
from moela.parallel.pp_schedules import schedule_actions, simulate
from moela.trainer.step_metrics import StepSums


class PipelineStep:
    def __init__(self, cfg: Config, mesh: ParallelMesh, device: torch.device, mixed_precision: bool):
        self.mesh, self.device = mesh, device
        pcfg = cfg.parallel
        self.microbatches = cfg.train.grad_accum

        def parallelize(model, roots):
            apply_parallelism(model, mesh, pcfg, mixed_precision=mixed_precision, fsdp_roots=roots)

        self.pipe: Pipeline = build_pipeline(cfg.model, pcfg, mesh, device, self.microbatches,
                                             parallelize=parallelize, seq_len=cfg.data.max_doc_len)
        v = pcfg.virtual_stages
        costs = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
        self.bubble = simulate(schedule_actions(pcfg.pp_schedule, pcfg.pp, self.microbatches, v), costs,
                               len(self.pipe.stages))["bubble"]

    @property
    def model(self):
        return self.pipe.model

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.mesh.group("pp")

    def run(self, batches: list[PackedBatch], loss_scale: float, autocast, to_device
            ) -> tuple[StepSums, torch.Tensor | None, torch.Tensor | None]:
        """Forward and backward of the step's micro-batches (on the host; `to_device` moves each, padded where the
        blocks are compiled) through this rank's stages; returns (this rank's StepSums summed over the pipeline,
        its expert load [L_r, E], the whole model's [L_moe, E] before the data-parallel sum)."""
        if len(batches) != self.microbatches:
            raise ValueError(f"the pipeline runs {self.microbatches} micro-batches a step, got {len(batches)}")
        on_device = [to_device(b) for b in batches]
        result = self.pipe.runtime.train_step(on_device, loss_scale, StepSums(), autocast)
        dist.all_reduce(result.sums.sums, group=self.group)
        full = None
        if result.expert_load is not None:
            full = self.pipe.full_expert_load(result.expert_load)
            dist.all_reduce(full, group=self.group)
        return result.sums, result.expert_load, full

    def evaluate(self, batches: list[PackedBatch], autocast, to_device) -> torch.Tensor:
        """[LM loss * labelled tokens, labelled tokens] over `batches` (float64, this data-parallel rank's, summed
        over the pipeline: only the last stage's share of the LM loss is non-zero)."""
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        results = self.pipe.runtime.forward_only([to_device(b) for b in batches], autocast)
        for metrics, num_targets in results:
            sums[0] += metrics["lm_loss"].double() * num_targets
            sums[1] += num_targets
        holds_loss = any(self.pipe.stages[k].loss for k in self.pipe.mine)
        sums[1] *= float(holds_loss)  # the token count once per pipeline
        dist.all_reduce(sums, group=self.group)
        return sums
