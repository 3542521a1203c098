"""The pipeline tests' shared runs: one process over a step's micro-batches (the reference), and one pipeline
rank over the same micro-batches with the trainer's weighting (tests/test_pipeline*.py).

Both return the step losses (the pipeline's summed over its stages), every parameter's gradient after the first
backward (when asked) and the final weights and router biases, unsharded on the CPU. Steps: the loss of every
micro-batch weighted by its share of the step's targets, gradient clipping, SGD with momentum
(tests/parallel_training.py explains why), the router-bias update from the summed expert load.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from factories import random_batches
from moela.model import build_model
from moela.parallel import apply_parallelism, build_mesh, clip_grad_norm_, reduce_expert_load
from moela.parallel.pipeline import build_pipeline
from moela.trainer.step_metrics import StepSums
from parallel_training import CLIP, full, full_state, make_optimizer


def reference(cfg, microbatches: int, steps: int, *, seed: int = 100, record_grads: bool = True,
              autocast=nullcontext):
    """-> (step losses, first gradients, step metric sums, final state, initial state) of one process; each
    forward under `autocast()`, as the trainer runs it."""
    torch.manual_seed(0)
    model = build_model(cfg)
    initial = full_state(model)
    opt = make_optimizer(model)
    losses, grads, metrics = [], None, []
    for step in range(steps):
        batches = random_batches(microbatches, seed=seed + step, vocab=cfg.vocab_size)
        total = sum(b.num_targets() for b in batches)
        sums, load = StepSums(), 0.0
        for b in batches:
            with autocast():
                out = model(b)
            (out.loss * (out.num_targets / total)).backward()
            sums.add(out.loss, out.metrics, out.num_targets)
            load = load + out.expert_load
        if record_grads and grads is None:
            grads = {k: full(p.grad) for k, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_bias(load)
        losses.append(float(sums.sums[0]) / total)
        metrics.append(dict(zip(sums.keys, (sums.sums / total).tolist())))
    return losses, grads, metrics, full_state(model), initial


def pipelined(cfg, pcfg, world_size: int, steps: int, *, seed: int = 100, counts: dict | None = None,
              initial: dict | None = None, overlap: bool = True, autocast=nullcontext):
    """-> (step losses, first gradients of this rank's parameters, step metric sums, this rank's final state)
    under `pcfg` (pp > 1); the data-parallel ranks of one step split its micro-batches as the loader does.
    `initial`: the whole model's initial state, loaded into the stages (FSDP on the CPU initializes each shard
    from its rank's generator, so a sharded stage does not draw the whole model's values itself). `overlap`: run
    dualpipev's pairs through the overlap function (else forward then backward)."""
    mesh = build_mesh(pcfg, world_size, "cpu")
    dp, m = mesh.size("dp"), pcfg.pp_microbatches
    torch.manual_seed(0)
    pipe = build_pipeline(cfg, pcfg, mesh, torch.device("cpu"), m, counts=counts, overlap=overlap,
                          parallelize=lambda model, roots: apply_parallelism(model, mesh, pcfg, mixed_precision=False,
                                                                               fsdp_roots=roots))
    model = pipe.model
    if initial is not None:
        own = model.state_dict()
        set_model_state_dict(model, {k: v for k, v in initial.items() if k in own},
                             options=StateDictOptions(full_state_dict=True))
    opt = make_optimizer(model)
    pp_group = mesh.group("pp")
    losses, grads, metrics = [], None, []
    for step in range(steps):
        batches = random_batches(m * dp, seed=seed + step, vocab=cfg.vocab_size)
        total = sum(b.num_targets() for b in batches)
        mine = batches[mesh.rank("dp") * m:(mesh.rank("dp") + 1) * m]
        result = pipe.runtime.train_step(mine, mesh.size("dp_cp") / total, StepSums(), autocast)
        sums = result.sums.sums.clone()
        dist.all_reduce(sums, group=pp_group)
        if mesh.group("dp_cp") is not None:
            dist.all_reduce(sums, group=mesh.group("dp_cp"))
        if grads is None:
            grads = {k: full(p.grad) for k, p in model.named_parameters()}
        clip_grad_norm_(model.parameters(), CLIP, across=pp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if result.expert_load is not None:
            model.update_router_bias(reduce_expert_load(result.expert_load, mesh))
        losses.append(float(sums[0]) / total)
        metrics.append(dict(zip(result.sums.keys, (sums / total).tolist())))
    return losses, grads, metrics, full_state(model)
