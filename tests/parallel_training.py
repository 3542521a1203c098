"""The training loops that the parallel equality tests share (tests/test_parallel_fsdp.py, test_parallel_tp.py,
test_parallel_expert_training.py): one process over every micro-batch of each global step, and one rank over its
data-parallel share of the same steps with the trainer's loss weighting.

Each step: the loss of every micro-batch weighted by its share of the step's targets, gradient clipping, SGD with
momentum (unlike Adam it is not invariant to a per-parameter gradient scale, so a wrong reduction factor, e.g. for
expert weights, changes the result), and the router-bias update from the summed expert load. Both return the step
losses, every parameter's gradient after the first backward (when asked) and the final weights and router biases,
unsharded on the CPU. `meta_init` is torchtitan's order for models too large for one device (build on meta,
parallelize, `to_empty`, `init_weights`) with the checks of the initial weights both layouts' tests make.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from factories import random_batches
from moela.model import build_model
from moela.parallel import apply_parallelism, build_mesh, clip_grad_norm_, reduce_expert_load
from moela.parallel.config import ParallelConfig

LR, CLIP = 0.2, 1.0  # the tiny model's first gradient norm is ~2: clipping is exercised


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=0.01)


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter, gradient or state tensor, unsharded (DTensors gathered), detached, on the CPU."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def full_state(model) -> dict[str, torch.Tensor]:
    return {k: full(v) for k, v in model.state_dict().items()}


def train_single_process(cfg, dp_size: int, steps: int, *, vocab: int = 97, device: str = "cpu",
                         record_grads: bool = False):
    """-> (step losses, first gradients or None, final state) of one process over `dp_size` micro-batches a step."""
    torch.manual_seed(0)
    model = build_model(cfg, device)
    opt = make_optimizer(model)
    losses, grads = [], None
    for step in range(steps):
        batches = random_batches(dp_size, seed=100 + step, vocab=vocab)
        total = sum(b.num_targets() for b in batches)
        step_loss, load = 0.0, 0.0
        for b in batches:
            out = model(b.to(device))
            (out.loss * (out.num_targets / total)).backward()
            step_loss += out.loss.item() * out.num_targets / total
            load = load + out.expert_load
        if record_grads and grads is None:
            grads = {k: full(p.grad) for k, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_bias(load)
        losses.append(step_loss)
    return losses, grads, full_state(model)


def train_parallel(cfg, pcfg: ParallelConfig, world_size: int, steps: int, *, vocab: int = 97,
                   device: str = "cpu", record_grads: bool = False):
    """-> (model, step losses, first gradients or None, final state) of this rank under the layout `pcfg`; every
    rank reads the same global steps as train_single_process with dp_size = the mesh's data-parallel size."""
    mesh = build_mesh(pcfg, world_size, torch.device(device).type)
    torch.manual_seed(0)
    model = apply_parallelism(build_model(cfg, device), mesh, pcfg, mixed_precision=False)
    opt = make_optimizer(model)
    losses, grads = [], None
    for step in range(steps):
        batches = random_batches(mesh.size("dp"), seed=100 + step, vocab=vocab)
        total = sum(b.num_targets() for b in batches)
        out = model(batches[mesh.rank("dp")].to(device))
        (out.loss * (out.num_targets * mesh.size("dp_cp") / total)).backward()
        step_loss = torch.tensor([out.loss.item() * out.num_targets / total], device=device)
        dist.all_reduce(step_loss, group=mesh.group("dp_cp"))
        if record_grads and grads is None:
            grads = {k: full(p.grad) for k, p in model.named_parameters()}
        clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_bias(reduce_expert_load(out.expert_load.clone(), mesh))
        losses.append(step_loss.item())
    return model, losses, grads, full_state(model)


def meta_init(cfg, pcfg: ParallelConfig, world_size: int, rel_std_tol: float):
    """Build on meta, parallelize under `pcfg`, materialize and initialize; asserts norms at 1, router biases at 0
    and every matrix's std within `rel_std_tol` of `initializer_range` -> (model, its full initial state)."""
    from moela.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    apply_parallelism(model, build_mesh(pcfg, world_size, "cpu"), pcfg)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    state = full_state(model)
    for name, value in state.items():
        if name.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value)), name
        elif name.endswith("e_score_correction_bias"):
            assert torch.equal(value, torch.zeros_like(value)), name
        else:  # every matrix ~ N(0, initializer_range)
            assert abs(value.std().item() / cfg.initializer_range - 1) < rel_std_tol, name
    return model, state
