"""`apply_parallelism(model, mesh, cfg)`: the one entry point the trainer calls to parallelize a model in place.

It applies, in torchtitan's order: context parallelism (attached as `model.context_parallel`, so `model(batch)`
runs on this rank's part of the batch), expert parallelism (routed experts replaced by their EP version),
activation checkpointing (each block's `recompute` flag), FSDP2. Tensor parallelism is not built
(`ParallelConfig.validate` rejects `tp > 1`). Parameter names never change, so checkpoints written under one
layout load under another.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from moela.parallel.config import ParallelConfig
from moela.parallel.context_parallel import apply_context_parallel
from moela.parallel.expert_parallel import apply_expert_parallel
from moela.parallel.fsdp import apply_activation_checkpointing, apply_fsdp
from moela.parallel.mesh import ParallelMesh


def apply_parallelism(model: nn.Module, mesh: ParallelMesh, cfg: ParallelConfig, *,
                      mixed_precision: bool | None = None) -> nn.Module:
    """Parallelize `model` in place for `mesh` as `cfg` asks; returns it. `mixed_precision` (bf16 params, fp32
    gradient reduction in `cfg.reduce_dtype` under FSDP) defaults to on for CUDA meshes, off on CPU."""
    if mixed_precision is None:
        mixed_precision = mesh.device_type == "cuda" and torch.cuda.is_available()
    if mesh.size("cp") > 1:
        apply_context_parallel(model, mesh.group("cp"), cfg.cp_layout)
    if mesh.size("ep") > 1:
        if apply_expert_parallel(model, mesh["ep"], dispatch=cfg.ep_dispatch, chunks=cfg.ep_chunks) == 0:
            raise ValueError(f"parallel.ep={cfg.ep} but the model has no routed experts; set ep: 1 (a dense model "
                             f"has nothing to distribute)")
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if mesh.distributed and mesh.size("dp_cp") > 1:
        apply_fsdp(model, mesh, reshard_after_forward=cfg.reshard_after_forward, mixed_precision=mixed_precision,
                   reduce_dtype=getattr(torch, cfg.reduce_dtype), unit_blocks=cfg.fsdp_unit_blocks)
    return model
