"""DualPipeV's overlapped pair on one process (`moela/parallel/pp_overlap.py`): the pair runs one segment of the
backward chunk before each block of the forward chunk, and its losses and gradients equal forward-then-backward's.

Reference: the same two chunks of a 6-layer model from the same weights, the pair's forward and backward run one
after the other with the backward's graph uncut, then the rest of both micro-batches (so every parameter gets its
whole gradient). The cut backward adds each block's output gradient up in its own order: float32 rounding only,
1e-5 relative, 1e-6 absolute.
"""

from __future__ import annotations

import pytest
import torch

from factories import VISIBLE_TRAINING, random_batches, tiny_config
from moela.model import build_model
from moela.parallel.pp_comm import StageLinks
from moela.parallel.pp_layout import stage_layout
from moela.parallel.pp_overlap import StreamPairOverlap
from moela.parallel.pp_runtime import PipelineRuntime
from moela.parallel.pp_schedules import Action, Overlap
from moela.parallel.pp_stage import chunks_of, keep_stages
from moela.trainer.step_metrics import StepSums

F, B = Action("F", 0, 1), Action("B", 1, 0)  # the pair: chunk 0's forward of mb 1, chunk 1's backward of mb 0


def _run(block: str, overlap: bool, seed: int):
    """-> (the step's StepSums values, every parameter's gradient, the block event log of the pair)."""
    cfg = tiny_config(**VISIBLE_TRAINING, num_hidden_layers=6, block=block, z_loss_coef=1e-2)
    stages = stage_layout(cfg, 1, 2, "Ettt|tttmL")
    torch.manual_seed(seed)
    model = build_model(cfg, parallelize=lambda m: keep_stages(m, stages, [0, 1]))
    chunks = chunks_of(model, stages, [0, 1])
    device = torch.device("cpu")
    pair = StreamPairOverlap(1, device)
    runtime = PipelineRuntime(model, chunks, 2, [Overlap(F, B)], StageLinks([0, 0], [[0, 0]]), device,
                              overlap_f_b=pair if overlap else None)
    sums = StepSums()
    runtime.begin(random_batches(2, seed=seed, vocab=cfg.vocab_size), 1.0, sums)
    log: list[str] = []

    def input_grad_hook(module, args, i):  # block i's backward is done when its input's gradient is
        args[0].register_hook(lambda g: log.append(f"B{i}"))

    runtime.forward(Action("F", 0, 0))
    hooks = [model.layers[str(i)].register_forward_pre_hook(lambda m, a, i=i: input_grad_hook(m, a, i))
             for i in (3, 4, 5)]
    runtime.forward(Action("F", 1, 0))
    for h in hooks:
        h.remove()
    hooks = [model.layers[str(i)].register_forward_pre_hook(lambda m, a, i=i: log.append(f"F{i}"))
             for i in (0, 1, 2)]
    if overlap:
        pair(runtime, F, B)
    else:
        runtime.forward(F)
        runtime.backward(B)
    for h in hooks:
        h.remove()
    pair_log = list(log)
    for a in (Action("F", 1, 1), Action("B", 1, 1), Action("B", 0, 1), Action("B", 0, 0)):
        (runtime.forward if a.kind == "F" else runtime.backward)(a)
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return sums.sums.clone(), grads, pair_log


@pytest.mark.parametrize("block", ["standard", "fal"])
@pytest.mark.parametrize("seed", [0, 1])
def test_pair_equals_forward_then_backward(block, seed):
    sums, grads, log = _run(block, True, seed)
    ref_sums, ref_grads, ref_log = _run(block, False, seed)
    torch.testing.assert_close(sums, ref_sums, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) > 20
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    # before each forward block one backward segment: the top one (head, loss, MTP: no block), then blocks 5 and 4;
    # block 3's segment is what is left after the forward
    assert log == ["F0", "B5", "F1", "B4", "F2", "B3"]
    assert ref_log == ["F0", "F1", "F2", "B5", "B4", "B3"]
