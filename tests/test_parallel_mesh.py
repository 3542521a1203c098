"""Mesh factoring: size resolution and its error messages, and the process groups of each view on 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from moela.parallel.config import ParallelConfig
from moela.parallel.mesh import build_mesh, resolve_sizes
from parallel_harness import spawn


def test_dp_shard_auto_fills_the_world():
    sizes = resolve_sizes(ParallelConfig(dp_replicate=2, cp=3), 24)
    assert (sizes.dp_replicate, sizes.dp_shard, sizes.cp, sizes.tp, sizes.world, sizes.dp) == (2, 4, 3, 1, 24, 8)


@pytest.mark.parametrize("cfg, world, message", [
    (ParallelConfig(dp_replicate=3), 8, r"dp_replicate \* cp \* tp = 3 \* 1 \* 1 = 3 does not divide the world size 8"),
    (ParallelConfig(dp_shard=2, cp=2), 8,
     r"dp_replicate \* dp_shard \* cp \* tp = 1 \* 2 \* 2 \* 1 = 4 but the world size is 8"),
    (ParallelConfig(ep=3), 4, r"ep = 3 must divide dp_shard \* cp = 4 \* 1 = 4"),
    (ParallelConfig(ep=2, cp=4), 8, r"parallel.ep: must be a multiple of cp=4"),
    (ParallelConfig(tp=3, cp=2), 8, r"dp_replicate \* cp \* tp = 1 \* 2 \* 3 = 6 does not divide the world size 8"),
    (ParallelConfig(fsdp=False), 2, r"fsdp: false needs dp_shard \* cp = 1"),
    (ParallelConfig(dp_shard=0), 2, r"parallel.dp_shard: must be >= 1 or -1"),
    (ParallelConfig(ep=0), 2, r"parallel.ep: must be >= 1"),
])
def test_mismatches_name_the_product(cfg, world, message):
    with pytest.raises(ValueError, match=message):
        resolve_sizes(cfg, world)


def test_single_process_mesh_has_trivial_views():
    mesh = build_mesh(ParallelConfig(), 1, "cpu")
    assert not mesh.distributed
    assert [mesh.size(n) for n in ("dp", "ep", "cp")] == [1, 1, 1]
    assert mesh.group("dp_cp") is None


def _groups(rank: int, world_size: int) -> None:
    ranks = lambda m, n: dist.get_process_group_ranks(m.group(n))  # noqa: E731
    # world 4 = dp_shard 2 x cp 2; ep 2 = the cp pair; efsdp strides over it
    mesh = build_mesh(ParallelConfig(cp=2, ep=2), world_size, "cpu")
    assert ranks(mesh, "cp") == ranks(mesh, "ep") == [rank - rank % 2, rank - rank % 2 + 1]
    assert ranks(mesh, "dp") == ranks(mesh, "efsdp") == [rank % 2, rank % 2 + 2]
    assert ranks(mesh, "dp_shard_cp") == ranks(mesh, "dp_cp") == [0, 1, 2, 3]
    assert mesh.fsdp_mesh.size() == 4 and mesh.expert_fsdp_mesh.size() == 2
    # world 4 = dp_replicate 2 x dp_shard 2 with ep 2 over dp_shard: HSDP meshes are 2D
    mesh = build_mesh(ParallelConfig(dp_replicate=2, ep=2), world_size, "cpu")
    assert ranks(mesh, "ep") == [rank - rank % 2, rank - rank % 2 + 1]
    assert ranks(mesh, "dp") == [0, 1, 2, 3] and mesh.size("efsdp") == 1
    assert mesh.fsdp_mesh.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
    assert tuple(mesh.expert_fsdp_mesh.shape) == (2, 1)
    mesh = build_mesh(ParallelConfig(), world_size, "cpu")
    assert mesh.size("dp") == 4 and not mesh.has("ep") and mesh.size("ep") == 1
    # world 4 = dp_shard 2 x tp 2: tp pairs are neighbours; data and FSDP groups stride over them
    mesh = build_mesh(ParallelConfig(tp=2), world_size, "cpu")
    assert ranks(mesh, "tp") == [rank - rank % 2, rank - rank % 2 + 1]
    assert ranks(mesh, "dp") == ranks(mesh, "dp_cp") == ranks(mesh, "dp_shard_cp") == [rank % 2, rank % 2 + 2]


def test_views_have_the_right_groups_on_4_ranks():
    spawn(_groups, 4)
