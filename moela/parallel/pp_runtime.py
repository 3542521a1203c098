"""Run one optimizer step's micro-batches through this rank's pipeline stages: `PipelineRuntime`.

The runtime executes this rank's action list (`moela.parallel.pp_schedules`) in order:
- F(s, m): prepare micro-batch m (once per rank: `Transformer.prepare`), receive stage s's inputs (or take them
  from this rank's previous stage), run `StageChunk.forward`, keep what backward needs, send the outputs on.
- B(s, m): receive the gradients of stage s's outputs (none on the last stage), backpropagate them together with
  the stage's loss share weighted by the micro-batch's share of the step's labelled tokens (`loss_scale *
  num_targets`: the trainer's weighting), send the inputs' gradients back.
- I(s, m) and W(s, m): B split for the zero-bubble schedules (`moela.parallel.pp_split`). I computes only the
  inputs' gradients and sends them at once, keeping the gradients that reach the parameters' side of the graph;
  W later runs only that side and accumulates the parameter gradients, so I then W adds to every gradient
  exactly what B adds. A stage whose inputs take no gradient (the first) leaves its whole backward to W.
- Overlap(f, b): `overlap_f_b` if one is given (one chunk's forward and another's backward interleaved block by
  block on two CUDA streams, `moela.parallel.pp_overlap`), else f then b. The forward of each b of a pair cuts
  its graph at block boundaries (`GraphCuts`), so that its backward can run a block at a time.
Gradient sync (FSDP2 stage units): a stage's gradients are reduce-scattered once per step, by the last of its
actions that computes parameter gradients (its last B, or its last W under the zero-bubble split); the earlier
ones accumulate the unsharded gradients and keep the parameters gathered for the next backward (as
torch.distributed.pipelining does), and I, which computes no parameter gradient, never syncs. A rank holding two
chunks (ZBV, DualPipeV) switches each chunk's units on their own.
Autocast: each forward (and each micro-batch's preparation) runs in its own `autocast()` context, as the
trainer's plain step does, never the whole step. Autocast caches the low-precision copy of each weight until its
outermost context exits; one context around the step would keep that copy, and the autograd node that casts it,
across FSDP's reshard and re-gather of the weight between micro-batches, which loses part of the weight gradients
(tests/test_pipeline.py checks the step under bf16 autocast). Backward runs outside autocast, as autograd intends.
Statistics: each forward adds its stage's loss and metric shares times the micro-batch's labelled tokens to a
`StepSums`, and its expert load to this rank's rows; the trainer sums both over the pipeline.

Shapes: T tokens of a micro-batch (this rank's rows of it), D hidden, E experts, L_r this rank's MoE layers.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule

from moela.batch import PackedBatch
from moela.model.transformer import Prepared, Transformer
from moela.parallel.pp_comm import StageLinks
from moela.parallel.pp_overlap import GraphCuts
from moela.parallel.pp_schedules import Action, Overlap, Step
from moela.parallel.pp_split import SplitBackward, finish_fsdp_backward
from moela.parallel.pp_stage import StageChunk, StageOutput


@dataclass
class _Saved:
    inputs: list[torch.Tensor]
    out: StageOutput
    weight: float | torch.Tensor
    split: SplitBackward | None = None  # I's half-done backward, finished by W
    cuts: GraphCuts | None = None  # the forward's graph cut at block boundaries (the b of an overlapped pair)
    grads: list[torch.Tensor] | None = None  # the outputs' gradients, kept from I for W where I had nothing to do


@dataclass
class StepResult:
    sums: object  # moela.trainer.step_metrics.StepSums of this rank's stage shares
    expert_load: torch.Tensor | None  # [L_r, E], this rank's MoE layers in `Transformer.moe_layers` order


class PipelineRuntime:
    """This rank's stages (`chunks`, by stage index) of a pipeline of `num_stages` stages, and its action list."""

    def __init__(self, model: Transformer, chunks: dict[int, StageChunk], num_stages: int, actions: list[Step],
                 links: StageLinks, device: torch.device,
                 overlap_f_b: Callable[["PipelineRuntime", Action, Action], None] | None = None):
        self.model, self.chunks, self.num_stages, self.actions = model, chunks, num_stages, actions
        self.links, self.device, self.overlap_f_b = links, device, overlap_f_b
        self.width = model.cfg.hidden_size

    # ----- one step -----
    def train_step(self, batches: list[PackedBatch], loss_scale: float, sums, autocast=nullcontext) -> StepResult:
        """Forward and backward of every micro-batch (on the device) through this rank's stages; `sums` a fresh
        StepSums to fill. Parameter gradients accumulate in place. `autocast()`: the context each forward runs
        in (never the whole step: see the module docstring)."""
        self.begin(batches, loss_scale, sums, autocast)
        for step in self.actions:
            if isinstance(step, Overlap):
                if self.overlap_f_b is not None:
                    self.overlap_f_b(self, step.f, step.b)
                else:
                    self.forward(step.f)
                    self.backward(step.b)
            elif step.kind == "F":
                self.forward(step)
            elif step.kind == "W":
                self.weight_grad(step)
            else:
                self.backward(step)
        self.links.wait_sends()
        if self._saved:
            raise RuntimeError(f"pipeline schedule left work undone: {sorted(self._saved)}")
        loads = [self._loads[s] for s in sorted(self._loads)]
        return StepResult(sums, torch.cat(loads) if loads else None)

    def begin(self, batches: list[PackedBatch], loss_scale: float, sums, autocast=nullcontext) -> None:
        """Start a step on `batches` (what `train_step` does before its actions; benchmarks run actions alone)."""
        self._batches, self._loss_scale, self._sums, self._autocast = batches, loss_scale, sums, autocast
        self._preps: dict[int, Prepared] = {}
        self._saved: dict[tuple[int, int], _Saved] = {}
        self._loads: dict[int, torch.Tensor] = {}
        flat = [a for step in self.actions for a in ((step.f, step.b) if isinstance(step, Overlap) else (step,))]
        self._last_grad = {a.stage: (a.mb, a.kind) for a in flat if a.kind in ("B", "W")}
        self._cut = ({(s.b.stage, s.b.mb) for s in self.actions if isinstance(s, Overlap) and s.b.kind == "B"}
                     if self.overlap_f_b is not None else set())

    def _grad_sync(self, stage: int, mb: int, kind: str) -> None:
        """Let stage's FSDP units reduce-scatter (and reshard) after this backward only if it is the stage's last
        parameter-gradient action of the step."""
        chunk = self.chunks[stage]
        if isinstance(chunk, FSDPModule):
            last = self._last_grad.get(stage) == (mb, kind)
            chunk.set_requires_gradient_sync(last)
            chunk.set_reshard_after_backward(last)

    def prepared(self, mb: int) -> Prepared:
        if mb not in self._preps:
            with self._autocast():
                self._preps[mb] = self.model.prepare(self._batches[mb])
        return self._preps[mb]

    def _rows(self, prep: Prepared) -> int:
        return prep.ctx.doc_ids.numel()

    def receive_inputs(self, stage: int, mb: int) -> list[torch.Tensor]:
        chunk, prep = self.chunks[stage], self.prepared(mb)
        if chunk.is_first:
            return []
        shapes = [(self._rows(prep), self.width)] * len(chunk.in_names)
        return [t.requires_grad_(t.is_floating_point())
                for t in self.links.recv(stage - 1, "act", mb, shapes, self.device)]

    def run_forward(self, stage: int, mb: int, inputs: list[torch.Tensor],
                    between: Callable[[], None] | None = None) -> StageOutput:
        """The stage's forward on received inputs, its statistics counted and what backward needs kept;
        `between()` runs before each block (`StageChunk.forward`)."""
        chunk, prep = self.chunks[stage], self.prepared(mb)
        cuts = GraphCuts() if (stage, mb) in self._cut else None
        with self._autocast():
            out = chunk(prep, inputs, cuts, between)
        self._sums.add(out.loss, out.metrics, prep.num_targets)
        if out.expert_load is not None:
            self._loads[stage] = out.expert_load.float() + self._loads.get(stage, 0)
        self._saved[(stage, mb)] = _Saved(inputs, out, prep.num_targets * self._loss_scale, cuts=cuts)
        return out

    def send_outputs(self, stage: int, mb: int, out: StageOutput) -> None:
        if not self.chunks[stage].is_last:
            self.links.send(stage, "act", mb, out.outputs)

    def forward(self, a: Action) -> None:
        inputs = self.receive_inputs(a.stage, a.mb)
        self.send_outputs(a.stage, a.mb, self.run_forward(a.stage, a.mb, inputs))

    def receive_grads(self, stage: int, mb: int) -> list[torch.Tensor]:
        saved = self._saved[(stage, mb)]
        if self.chunks[stage].is_last:
            return []
        outs = saved.out.outputs
        return self.links.recv(stage, "grad", mb, [tuple(t.shape) for t in outs], self.device,
                               dtypes=[t.dtype for t in outs])

    def _roots(self, saved: _Saved, grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The tensors to backpropagate from and their gradients: the stage's outputs with the received gradients,
        and its weighted loss share."""
        tensors, seeds = [], []
        for t, g in zip(saved.out.outputs, grads):
            if t.requires_grad:
                tensors.append(t)
                seeds.append(g)
        if saved.out.loss.requires_grad:
            tensors.append(saved.out.loss * saved.weight)
            seeds.append(torch.ones_like(saved.out.loss))
        return tensors, seeds

    def run_backward(self, stage: int, mb: int, grads: list[torch.Tensor], kind: str) -> list[torch.Tensor]:
        """B (whole backward) or I (inputs' gradients only, graph kept for W); returns the inputs' gradients."""
        if kind == "B":
            segments = self.backward_segments(stage, mb, grads)
            while True:
                try:
                    next(segments)
                except StopIteration as end:
                    return end.value
        saved = self._saved[(stage, mb)]
        tensors, seeds = self._roots(saved, grads)
        wanted = [t for t in saved.inputs if t.requires_grad]
        self._grad_sync(stage, mb, kind)
        if wanted and tensors:
            saved.split = SplitBackward(tensors, seeds, wanted)
            got = saved.split.inputs_grad()
        else:  # no input takes a gradient (the first stage): the whole backward is W's
            saved.grads, got = grads, [None] * len(wanted)
        return [torch.zeros_like(t) if g is None else g for t, g in zip(wanted, got)]

    def backward_segments(self, stage: int, mb: int, grads: list[torch.Tensor]
                          ) -> Generator[None, None, list[torch.Tensor]]:
        """B as an iterator: one step per autograd segment (one, unless the forward was cut); the inputs'
        gradients are its return value (`StopIteration.value`)."""
        saved = self._saved.pop((stage, mb))
        tensors, seeds = self._roots(saved, grads)
        wanted = [t for t in saved.inputs if t.requires_grad]
        self._grad_sync(stage, mb, "B")
        if saved.cuts is not None:
            yield from saved.cuts.backward(tensors, seeds)
        elif tensors:
            torch.autograd.backward(tensors, seeds)
            yield
        return [torch.zeros_like(t) if t.grad is None else t.grad for t in wanted]

    def send_grads(self, stage: int, mb: int, input_grads: list[torch.Tensor]) -> None:
        if not self.chunks[stage].is_first:
            self.links.send(stage - 1, "grad", mb, input_grads)

    def backward(self, a: Action) -> None:
        grads = self.receive_grads(a.stage, a.mb)
        self.send_grads(a.stage, a.mb, self.run_backward(a.stage, a.mb, grads, a.kind))

    def weight_grad(self, a: Action) -> None:
        saved = self._saved.pop((a.stage, a.mb))
        self._grad_sync(a.stage, a.mb, "W")
        if saved.split is None:
            tensors, seeds = self._roots(saved, saved.grads)
            if tensors:
                torch.autograd.backward(tensors, seeds)
            return
        chunk = self.chunks[a.stage]
        units = [m for m in chunk.modules() if isinstance(m, FSDPModule)]
        for unit in units:  # a later forward may have resharded them; custom Functions' W reads the weights
            unit.unshard()
        saved.split.weights_grad()
        if units and self._last_grad.get(a.stage) == (a.mb, "W"):
            finish_fsdp_backward(chunk)

    # ----- evaluation -----
    @torch.no_grad()
    def forward_only(self, batches: list[PackedBatch], autocast=nullcontext
                     ) -> list[tuple[dict[str, torch.Tensor], object]]:
        """Every micro-batch through this rank's stages, forward only (micro-batch by micro-batch, stages in
        order: deadlock-free for any placement); returns per micro-batch the metric shares summed over this
        rank's stages and its labelled-token count."""
        self._batches, self._preps, self._autocast = batches, {}, autocast
        results = []
        for mb in range(len(batches)):
            total: dict[str, torch.Tensor] = {}
            for stage in sorted(self.chunks):
                prep, inputs = self.prepared(mb), self.receive_inputs(stage, mb)
                with autocast():
                    out = self.chunks[stage](prep, inputs)
                self.send_outputs(stage, mb, out)
                for k, v in out.metrics.items():
                    total[k] = v + total.get(k, 0)
            results.append((total, self.prepared(mb).num_targets))
            del self._preps[mb]
        self.links.wait_sends()
        return results
