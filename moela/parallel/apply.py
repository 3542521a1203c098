"""`apply_parallelism(model, mesh, cfg)`: the one entry point the trainer calls to parallelize a model in place.

It applies, in torchtitan's order: context parallelism (attached as `model.context_parallel`, so `model(batch)`
runs on this rank's part of the batch), expert parallelism (routed experts replaced by their EP version), tensor
parallelism (after EP: it hooks the experts module that will run), activation checkpointing (each block's
`recompute` flag), FSDP2 (also with tp > 1 alone: its all-reduce hook completes the tp-replicated gradients, see
`moela.parallel.fsdp`; under `parallel.replicate_compression` it shards over the shard group only, and the
trainer's `moela.parallel.replicate` reducer averages over the replicas). With `parallel.fal_streams` in a one-GPU
run, each FAL block runs its MLP on a second stream beside its attention (`moela.model.streams`). Parameter names
never change, so checkpoints written under one layout load under another.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from moela.parallel.config import ParallelConfig
from moela.parallel.context_parallel import apply_context_parallel
from moela.parallel.expert_parallel import apply_expert_parallel
from moela.parallel.fsdp import apply_activation_checkpointing, apply_fsdp
from moela.parallel.mesh import ParallelMesh
from moela.parallel.tensor_parallel import apply_tensor_parallel


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
    if mesh.size("tp") > 1:
        apply_tensor_parallel(model, mesh["tp"])
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if mesh.distributed and (mesh.size("dp_cp") > 1 or mesh.size("tp") > 1):
        apply_fsdp(model, mesh, reshard_after_forward=cfg.reshard_after_forward, mixed_precision=mixed_precision,
                   reduce_dtype=getattr(torch, cfg.reduce_dtype), unit_blocks=cfg.fsdp_unit_blocks,
                   hsdp=cfg.replicate_compression == "none")
    if cfg.fal_streams:
        apply_fal_streams(model, mesh)
    return model


def apply_fal_streams(model: nn.Module, mesh: ParallelMesh) -> int:
    """Give every FAL block (after the first) a side stream for its MLP; returns how many. One process on one CUDA
    device only: with several ranks the MLP's collectives (tensor, expert parallelism) and FSDP's gathers would
    have to be ordered across two streams, and on CPU there are no streams."""
    if mesh.device_type != "cuda" or not torch.cuda.is_available():
        raise ValueError("parallel.fal_streams: needs a CUDA device (it runs the MLP of each FAL block on a second "
                         "CUDA stream); set it to false on CPU")
    if mesh.distributed:
        raise ValueError("parallel.fal_streams: one process only (with several ranks the MLP's collectives would "
                         "run on a second stream); set it to false, or train on one GPU")
    blocks = [b for b in model.modules() if getattr(b, "kind", None) == "fal" and not getattr(b, "keeps_a1", True)]
    if not blocks:
        raise ValueError("parallel.fal_streams: the model has no FAL blocks (model.block is not 'fal'); set it to "
                         "false or model.block: fal")
    stream = torch.cuda.Stream()
    for block in blocks:
        block.side_stream = stream
    return len(blocks)
