"""FSDP2 wrapping, activation checkpointing and gradient-norm clipping for sharded (and expert-parallel) models.

Decisions:
- FSDP units: every transformer block (`model.layers[i]`, `model.mtp[d].block`) and the root (embedding, final
  norm, head: the embedding is read again by the MTP depths and possibly tied to the head, so it stays with the
  root, gathered for the whole step). Routed experts under expert parallelism are their own unit, sharded over
  the `efsdp` mesh (the ranks holding the same experts), while the rest of the block shards over `dp_shard_cp`.
  With `dp_replicate > 1` both meshes are 2D: HSDP (shard inside a replica group, all-reduce across replicas),
  unless `hsdp=False` (`parallel.replicate_compression`): then they are the 1-D shard meshes and
  `moela.parallel.replicate` reduces over the replicas.
  `parallel.fsdp_unit_blocks: n` groups n consecutive blocks into one unit (and their routed experts into one
  expert unit; FSDP2's list form of `fully_shard`): each unit costs FSDP2 a fixed amount of host work per step
  (pre/post forward and backward hooks, parameter copy-in/out, one all-gather and one reduce-scatter launch), so
  n blocks per unit divide that work by n, while n blocks' parameters are gathered at once.
- Mixed precision on CUDA: parameters all-gathered in bf16, gradients reduced in fp32 (`parallel.reduce_dtype:
  bfloat16` halves the reduce-scatter's bytes for slow links), fp32 master weights and optimizer state. On CPU
  everything stays fp32. Forward inputs are not cast: a block's inputs include the packed-batch context (RoPE
  frequencies, loss weights) and the router's fp32 weights, which must stay fp32.
- Gradient reduction: FSDP's default, the average over the unit's reduce group. For dense units that group is
  every rank holding a share of the global batch (`dp_cp`), so the trainer scales the loss by
  `mesh.size("dp_cp")`. Expert units reduce over an `ep` times smaller group (the ranks holding the same
  experts), while each expert's gradient already sums the tokens of its whole EP group; the experts module
  therefore scales its weight gradients by 1/ep in backward, which makes every parameter's gradient the same
  average. No custom divide factor is set: how FSDP applies one on a one-rank group differs between torch
  versions. On gloo (CPU), which has no averaging collective, reductions are issued as sums plus a division.
- Explicit prefetching, one block ahead: each block's forward starts the all-gather of the next block (and of its
  expert unit), each block's backward that of the previous one. FSDP2's implicit prefetching issues a unit's
  all-gather when the CPU reaches that unit's forward, which overlaps compute only while the CPU runs ahead of the
  GPU; the host syncs of an MoE layer (the expert-parallel split sizes, the cuBLAS expert bounds) stop the CPU
  until the GPU catches up, so without explicit prefetching each block's all-gather would wait behind the
  previous block's tail (torchtitan sets explicit prefetching for expert parallelism for the same reason). It
  keeps at most one more unit's parameters unsharded.
- Activation checkpointing per block without changing parameter names: the block's `recompute` flag makes its
  forward run under a non-reentrant `torch.utils.checkpoint`. `full` recomputes every block; `selective`
  recomputes every second block (torchtitan's layer-selective mode: about half the activation memory of no
  checkpointing, at half the recompute cost of `full`). Op-level selective checkpointing is not used: it requires
  the recomputation to replay exactly the forward's operator sequence, which the nested FSDP unit of
  expert-parallel experts does not (its hooks differ between forward and recompute).
- Under tensor parallelism (`moela.parallel.tensor_parallel`), the parameters replicated over tp (norms, latent
  down-projections, router, routed experts without expert parallelism, the MTP projections) are computed on each
  rank's rows of the batch, so each rank's gradient is a partial sum over tp. In every block (and in the root)
  they form their own unit, whose reduced gradient (after the reduce-scatter, or after HSDP's all-reduce) is
  all-reduced over tp by FSDP's all-reduce hook: one collective per unit and step, only on the micro-batch that
  synchronizes gradients. The tp-sharded parameters (DTensors on the tp mesh) are sharded over the data-parallel
  mesh as 2-D DTensors and need nothing more. Expert units under expert parallelism get the same hook. FSDP is
  applied under tp > 1 even when no data-parallel rank shares the parameters (a one-rank shard group), since the
  hook is where the tp reduction happens.
- `clip_grad_norm_` handles gradients that live on different meshes (dense vs expert DTensors, plain tensors)
  by computing one total norm per mesh and combining them.
"""

from __future__ import annotations

from functools import partial
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from moela.parallel.expert_parallel import ExpertParallelExperts

AC_MODES = ("none", "full", "selective")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The units that FSDP and activation checkpointing wrap: main blocks, then the block of each MTP depth (the
    depth's own norms and projection are used outside that block's forward, so they stay with the root)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no `layers` ModuleList; parallelism wraps each block of it")
    return list(layers) + [getattr(depth, "block", depth) for depth in getattr(model, "mtp", [])]


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Recompute each block's activations in backward: mode "none", "full" or "selective" (see module doc)."""
    if mode not in AC_MODES:
        raise ValueError(f"parallel.activation_checkpointing: unknown mode {mode!r}; choose one of "
                         f"{', '.join(AC_MODES)}")
    if mode == "none":
        return
    for i, block in enumerate(transformer_blocks(model)):
        if not hasattr(block, "recompute"):
            raise TypeError(f"{type(block).__name__} has no `recompute` flag; activation checkpointing sets it on "
                            f"each moela Block")
        if mode == "full" or i % 2 == 1:
            block.recompute = True


def tp_replicated_modules(roots: list[nn.Module], skip: list[nn.Module]) -> list[nn.Module]:
    """Modules under `roots` that own parameters none of which is a DTensor: under tensor parallelism, the ones
    replicated over tp (module docstring). The modules in `skip` and everything under them are left out."""
    skipped = {id(m) for s in skip for m in s.modules()}
    return [m for root in roots for m in root.modules() if id(m) not in skipped
            and (own := list(m.parameters(recurse=False))) and not any(isinstance(p, DTensor) for p in own)]


def _sum_over(group, reduced: torch.Tensor) -> None:
    dist.all_reduce(reduced, group=group)


def apply_fsdp(model: nn.Module, mesh, *, reshard_after_forward: bool = True, mixed_precision: bool = False,
               reduce_dtype: torch.dtype = torch.float32, unit_blocks: int = 1, hsdp: bool = True) -> None:
    """Shard `model` in place with FSDP2 over `mesh` (a `ParallelMesh`); see the module docstring for the units
    (`unit_blocks` consecutive blocks per unit). `reduce_dtype` applies under `mixed_precision` only. `hsdp=False`
    leaves the dp_replicate dimension out of FSDP (its gradients are then reduced by `moela.parallel.replicate`)."""
    if unit_blocks < 1:
        raise ValueError(f"parallel.fsdp_unit_blocks: must be >= 1, got {unit_blocks}")
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype,
                                   cast_forward_inputs=False) if mixed_precision else MixedPrecisionPolicy())
    tp_group = mesh.group("tp") if mesh.size("tp") > 1 else None
    dense_mesh = mesh.fsdp_mesh if hsdp else mesh["dp_shard_cp"]

    def unit(modules: list[nn.Module], unit_mesh, **kwargs) -> nn.Module:
        """One FSDP unit of `modules`; the FSDPModule that names it (the first of a group)."""
        kwargs = {"mp_policy": policy, "reshard_after_forward": reshard_after_forward, **kwargs}
        if len(modules) == 1:
            return fully_shard(modules[0], mesh=unit_mesh, **kwargs)
        return fully_shard(modules, mesh=unit_mesh, **kwargs)[0]

    def replicated_unit(roots: list[nn.Module], skip: list[nn.Module], **kwargs) -> list[nn.Module]:
        """The unit of the parameters under `roots` replicated over tp, with the all-reduce hook; [] without tp."""
        modules = tp_replicated_modules(roots, skip) if tp_group is not None else []
        if not modules:
            return []
        replicated = unit(modules, dense_mesh, **kwargs)
        replicated.set_all_reduce_hook(partial(_sum_over, tp_group))
        return [replicated]

    units = []
    per_block = []  # forward order: [unit of blocks, their replicated unit (tp), their expert unit (ep)]
    blocks = transformer_blocks(model)
    for first in range(0, len(blocks), unit_blocks):
        group = blocks[first:first + unit_blocks]
        experts = [m for block in group for m in block.modules() if isinstance(m, ExpertParallelExperts)]
        for e in experts:
            e.grad_scale = 1.0 / mesh.size("ep")
        experts_units = [unit(experts, mesh.expert_fsdp_mesh if hsdp else mesh["efsdp"])] if experts else []
        if experts and tp_group is not None:
            experts_units[0].set_all_reduce_hook(partial(_sum_over, tp_group))
        replicated = replicated_unit(group, experts)
        per_block.append([unit(group, dense_mesh)] + replicated + experts_units)
        units += per_block[-1]
    units += replicated_unit([model], blocks, reshard_after_forward=False)
    units.append(fully_shard(model, mesh=dense_mesh, mp_policy=policy, reshard_after_forward=False))
    for cur, nxt in zip(per_block, per_block[1:]):  # explicit prefetching (module docstring)
        cur[0].set_modules_to_forward_prefetch(nxt)
        nxt[0].set_modules_to_backward_prefetch(cur)
    if mesh.device_type == "cpu":
        for fsdp_unit in units:
            fsdp_unit.set_force_sum_reduction_for_comms(True)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float | None, norm_type: float = 2.0
                    ) -> torch.Tensor:
    """Like `torch.nn.utils.clip_grad_norm_`, for gradients spread over several device meshes; returns the total
    norm (a plain tensor, the same on every rank; nothing is read on the host). `max_norm=None` only measures."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    if not groups:
        return torch.zeros(())
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float())
    stacked = torch.stack(norms)  # [meshes]
    total = stacked.max() if norm_type == float("inf") else stacked.pow(norm_type).sum().pow(1.0 / norm_type)
    if max_norm is not None:
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def clip_factor(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor `torch.nn.utils.clip_grads_with_norm_` multiplies the gradients by, min(1, max_norm / (norm +
    1e-6)), as a 0-d fp32 tensor on the norm's device: for an optimizer that applies it as it reads the gradients."""
    return torch.clamp(max_norm / (total_norm.float() + 1e-6), max=1.0)
