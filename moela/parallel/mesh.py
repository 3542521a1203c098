"""Build the DeviceMesh that every parallelism in moela reads its process groups from.

`build_mesh(cfg, world_size, device_type)` factors the world as `pp x dp_replicate x dp_shard x cp x tp` (outermost
to innermost, so tp and cp ranks are neighbours, i.e. on one node, and pipeline stages, which exchange only one
activation per micro-batch, are furthest apart) and returns a `ParallelMesh`: the world mesh plus
the flattened views the other parts need. Decisions:

- Expert parallelism borrows its ranks from `dp_shard x cp`, as torchtitan does: with `ep > 1` the dp_shard
  dimension is split into `dp_shard_mod_ep` (outer; expert FSDP shards over it) and `dp_shard_in_ep` (inner), and
  the EP group is `dp_shard_in_ep x cp`. Hence `ep` must be a multiple of `cp` and divide `dp_shard * cp`.
- Every other view lies inside one pipeline stage: FSDP, EP, CP and TP groups never span stages, and `pp` holds the
  ranks of one pipeline (same position in every other dimension).
- Named views (all flattened from the one world mesh, so DTensors on them compose):
  `dp` (data loading: ranks that see different batches), `dp_shard_cp` (FSDP shard group of dense params),
  `dp_cp` (every rank that holds a share of the global batch: loss and expert-load sums), `ep`, `efsdp`
  (FSDP shard group of expert params), `cp`, `tp`, `dp_replicate`, and with pp > 1 `pp` and `stage` (every rank
  of this rank's pipeline stage).
- One process (world_size 1, no process group): a `ParallelMesh` without a DeviceMesh; every size is 1.
- Every size-1 dimension still exists in the mesh, so callers never branch on which dimensions are present.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from moela.parallel.config import ParallelConfig


@dataclass(frozen=True)
class MeshSizes:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        return self.dp_shard * self.cp // self.ep


def resolve_sizes(cfg: ParallelConfig, world_size: int) -> MeshSizes:
    """Resolve `dp_shard: -1` and check every product against the world size; raises ValueError naming the bad one."""
    errors = cfg.validate()
    if errors:
        raise ValueError("parallel config is invalid:\n  " + "\n  ".join(f"parallel.{e}" for e in errors))
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    fixed = cfg.pp * cfg.dp_replicate * cfg.cp * cfg.tp
    pp_names, pp_sizes = ("pp * ", f"{cfg.pp} * ") if cfg.pp > 1 else ("", "")
    dp_shard = cfg.dp_shard
    if dp_shard == -1:
        if world_size % fixed:
            raise ValueError(
                f"parallel: {pp_names}dp_replicate * cp * tp = {pp_sizes}{cfg.dp_replicate} * {cfg.cp} * {cfg.tp} = "
                f"{fixed} does not "
                f"divide the world size {world_size}; change them so that their product divides {world_size}")
        dp_shard = world_size // fixed
    sizes = MeshSizes(cfg.pp, cfg.dp_replicate, dp_shard, cfg.cp, cfg.tp, cfg.ep)
    if sizes.world != world_size:
        raise ValueError(
            f"parallel: {pp_names}dp_replicate * dp_shard * cp * tp = {pp_sizes}{cfg.dp_replicate} * {dp_shard} * "
            f"{cfg.cp} * {cfg.tp} = {sizes.world} but the world size is {world_size}; set dp_shard: -1 to fill the "
            f"world, or change the sizes (or the number of launched processes) so the product equals {world_size}")
    if cfg.ep > 1:
        if (dp_shard * cfg.cp) % cfg.ep:
            raise ValueError(
                f"parallel.ep: ep = {cfg.ep} must divide dp_shard * cp = {dp_shard} * {cfg.cp} = {dp_shard * cfg.cp} "
                f"(expert parallelism borrows its ranks from the FSDP group); choose ep among the divisors of "
                f"{dp_shard * cfg.cp}")
    if not cfg.fsdp and sizes.dp_shard * sizes.cp > 1:
        raise ValueError(
            f"parallel.fsdp: false needs dp_shard * cp = 1, got {sizes.dp_shard} * {sizes.cp}; for plain "
            f"replication set dp_shard: 1 and dp_replicate: {sizes.dp_replicate * sizes.dp_shard}, or fsdp: true")
    return sizes


@dataclass
class ParallelMesh:
    """The world DeviceMesh (None for one process) and its named views; see the module docstring for the names."""

    sizes: MeshSizes
    device_type: str
    world: DeviceMesh | None = None
    _views: dict[str, DeviceMesh] = field(default_factory=dict)

    @property
    def distributed(self) -> bool:
        return self.world is not None

    def __getitem__(self, name: str) -> DeviceMesh:
        if self.world is None:
            raise RuntimeError(f"mesh view {name!r} requested but this run is a single process (no DeviceMesh)")
        if name in self._views:
            return self._views[name]
        return self.world[name]

    def has(self, name: str) -> bool:
        """Whether the view exists: always false for one process; "ep" and "efsdp" exist only with ep > 1."""
        return self.world is not None and (name in self._views or name in (self.world.mesh_dim_names or ()))

    def size(self, name: str) -> int:
        return self[name].size() if self.has(name) else 1

    def rank(self, name: str) -> int:
        return self[name].get_local_rank() if self.has(name) else 0

    def group(self, name: str) -> dist.ProcessGroup | None:
        return self[name].get_group() if self.has(name) else None

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP2 mesh of dense params: 1D dp_shard_cp, or 2D (dp_replicate, dp_shard_cp) for HSDP."""
        if self.sizes.dp_replicate > 1:
            return self.world["dp_replicate", "dp_shard_cp"]
        return self["dp_shard_cp"]

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """FSDP2 mesh of expert params under EP: 1D efsdp, or 2D (dp_replicate, efsdp) for HSDP."""
        if self.sizes.dp_replicate > 1:
            return self.world["dp_replicate", "efsdp"]
        return self["efsdp"]


def build_mesh(cfg: ParallelConfig, world_size: int, device_type: str) -> ParallelMesh:
    """Factor `world_size` ranks by `cfg` into a DeviceMesh on `device_type` ("cuda" or "cpu")."""
    sizes = resolve_sizes(cfg, world_size)
    if world_size == 1 and not (dist.is_available() and dist.is_initialized()):
        return ParallelMesh(sizes, device_type)
    if dist.is_initialized() and dist.get_world_size() != world_size:
        raise ValueError(f"build_mesh: world_size={world_size} but the process group has "
                         f"{dist.get_world_size()} ranks; pass dist.get_world_size()")
    if cfg.ep > 1:
        in_ep = cfg.ep // cfg.cp
        names = ("pp", "dp_replicate", "efsdp", "dp_shard_in_ep", "cp", "tp")
        shape = (sizes.pp, sizes.dp_replicate, sizes.efsdp, in_ep, sizes.cp, sizes.tp)
        shard_dims = ("efsdp", "dp_shard_in_ep")
    else:
        names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        shape = (sizes.pp, sizes.dp_replicate, sizes.dp_shard, sizes.cp, sizes.tp)
        shard_dims = ("dp_shard",)
    if device_type == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    world = init_device_mesh(device_type, shape, mesh_dim_names=names)
    views = {
        "dp": world[("dp_replicate",) + shard_dims]._flatten("dp"),
        "dp_shard_cp": world[shard_dims + ("cp",)]._flatten("dp_shard_cp"),
        "dp_cp": world[("dp_replicate",) + shard_dims + ("cp",)]._flatten("dp_cp"),
    }
    if cfg.ep > 1:
        views["ep"] = world["dp_shard_in_ep", "cp"]._flatten("ep")
    if cfg.pp > 1:
        views["stage"] = world[names[1:]]._flatten("stage")
    return ParallelMesh(sizes, device_type, world, views)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: the local tensor of a DTensor, `t` itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t
