"""The real model and mesh at the real world size, in one CPU process: torch's fake process group (`FakeStore`,
backend "fake": every collective returns at once, nothing is sent) and the meta device (no memory).

`build(model_cfg, parallel_cfg, world_size)` initializes a fake world of `world_size` ranks as rank 0, builds the
moela mesh, the model on the meta device, cuts it to pipeline rank 0's stages as `moela.parallel.pipeline` does
(with pp > 1), and applies `apply_parallelism` exactly as training does (mixed precision as on CUDA, the stages'
chunks as FSDP roots), then reads back from the sharded model what rank 0 holds: every parameter's local shape and
bytes, and the FSDP2 units' collectives (each parameter group's padded shard, its dtype and its group sizes: the
all-gather and reduce-scatter calls one step issues). This is what `moela.plan` must equal (tests), and a check that
the layout builds at full size. The process group is destroyed on exit, so several worlds can be built one after
another.
Expert dispatch is pinned to `alltoall` here, whose setup needs no host-side twin group (the fake backend cannot
make gloo groups); the parameters are the same either way.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from moela.model.config import ModelConfig
from moela.parallel.config import ParallelConfig


@dataclass
class FakeWorld:
    world_size: int
    local_numel: dict[str, int]  # parameter name -> rank 0's elements
    local_shape: dict[str, tuple[int, ...]]
    fsdp_units: list[tuple[int, int, int]]  # (shard group size, replicate group size, padded shard elements)

    @property
    def param_bytes(self) -> int:
        """fp32 master weights of rank 0."""
        return 4 * sum(self.local_numel.values())


@contextlib.contextmanager
def fake_process_group(world_size: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized; build a fake world in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, world_size: int) -> FakeWorld:
    from moela.model.transformer import Transformer
    from moela.parallel.apply import apply_parallelism
    from moela.parallel.mesh import build_mesh, local_shard
    from moela.parallel.pp_layout import stage_layout, stage_ranks
    from moela.parallel.pp_stage import chunks_of, keep_stages

    cfg = replace(parallel_cfg, ep_dispatch="alltoall")
    with fake_process_group(world_size):
        mesh = build_mesh(cfg, world_size, "cpu")
        with torch.device("meta"):
            model = Transformer(model_cfg)
        roots = None
        if cfg.pp > 1:
            stages = stage_layout(model_cfg, cfg.pp, cfg.virtual_stages, cfg.pp_layout or None)
            mine = [k for k, r in enumerate(stage_ranks(cfg.pp, cfg.virtual_stages, cfg.pp_schedule))
                    if r == mesh.rank("pp")]
            keep_stages(model, stages, mine)
            chunks = chunks_of(model, stages, mine)
            roots = [chunks[k] for k in mine]
        apply_parallelism(model, mesh, cfg, mixed_precision=True, fsdp_roots=roots)
        numel = {name: local_shard(p).numel() for name, p in model.named_parameters()}
        shapes = {name: tuple(local_shard(p).shape) for name, p in model.named_parameters()}
        units = []
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            for group in module._get_fsdp_state()._fsdp_param_groups:
                info = group.mesh_info
                padded = sum(math.prod(fp.padded_sharded_param_size) for fp in group.fsdp_params)
                units.append((info.shard_mesh_size, getattr(info, "replicate_mesh_size", 1), padded))
    return FakeWorld(world_size, numel, shapes, units)
