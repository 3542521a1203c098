"""The layout a plan prices: mesh sizes (as `moela.parallel.mesh` factors the world), pipeline settings, the GPU.

Decisions:
- The world is `pp x dp_replicate x dp_shard x cp x tp`, outermost to innermost, exactly as
  `moela.parallel.mesh.resolve_sizes` factors it (so a plan accepts what training accepts and rejects it with the
  same message): every other group stays inside a pipeline stage's ranks. `ep` borrows ranks from
  `dp_shard x cp`.
- A group is on one node when the ranks it spans (its stride times its size) fit in `gpus_per_node`; otherwise
  its traffic crosses the network (`Group.intra_node`).
- Pipeline settings are the recipe's (`parallel.pp`, `pp_schedule`, `pp_microbatches` or `train.grad_accum`,
  `pp_virtual_stages`, `pp_layout`): the blocks go to the `pp x virtual stages` chunks as
  `moela.parallel.pp_layout.stage_layout` places them, and chunk k to the rank `stage_ranks` names.
- `replicate_compression`: the factor by which the `dp_replicate` gradient all-reduce is shrunk (1 = plain), a
  what-if the communication model divides those bytes by; `replicate_powersgd_rank` > 0 (the recipe's
  `parallel.powersgd_rank` under `replicate_compression: powersgd`) prices that all-reduce by the bytes PowerSGD
  hands in instead (`moela.plan.comm`).
- GPUs: memory as torch sees it, dense datasheet peaks, and the link bandwidths the alpha-beta model uses
  (`GPUS`; the sources are in its comments).
"""

from __future__ import annotations

from dataclasses import dataclass

from moela.parallel.config import ParallelConfig
from moela.parallel.mesh import resolve_sizes


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # what torch.cuda.mem_get_info reports as total
    bf16_tflops: float  # dense datasheet peak (MFU's denominator, as moela.trainer.metrics)
    fp8_tflops: float
    nvlink_gbps: float  # GB/s per direction per GPU inside a node
    network_gbps: float  # GB/s per GPU between nodes (one NIC per GPU)
    compute_scale: float  # kernel speed relative to the H100/H200 the calibration was measured on


# H100/H200/H800: NVIDIA datasheets (989 dense bf16 TFLOP/s); NVLink 450 GB/s per direction (H100/H200), 200 for
# H800 (400 GB/s bidirectional; DeepEP measures 153-158 GB/s of it); one 400 Gb/s InfiniBand NIC per GPU = 50 GB/s.
# B200: 2,250 dense bf16 TFLOP/s, NVLink 5 at 900 GB/s per direction; its kernel speed relative to Hopper is the
# peak ratio, an assumption (moela has no B200 measurement).
GPUS = {
    "h100": GPU("H100 80GB", 79.1, 989.0, 1979.0, 450.0, 50.0, 1.0),
    "h200": GPU("H200 141GB", 139.8, 989.0, 1979.0, 450.0, 50.0, 1.0),
    "h800": GPU("H800 80GB", 79.1, 989.0, 1979.0, 200.0, 50.0, 1.0),
    "b200": GPU("B200 180GB", 178.4, 2250.0, 4500.0, 900.0, 50.0, 2250.0 / 989.0),
}


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 1
    pp_virtual_stages: int = 1  # chunks per pipeline rank (2 for zbv and dualpipev)
    pp_layout: str = ""  # moela.parallel.pp_layout's grammar; empty: balanced by FLOPs
    activation_checkpointing: str = "none"
    replicate_compression: float = 1.0
    gpus_per_node: int = 8
    replicate_powersgd_rank: int = 0

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def shard(self) -> int:
        """FSDP shard group of dense parameters (dp_shard x cp)."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """FSDP shard group of expert parameters (the ranks holding the same experts)."""
        return self.shard // self.ep

    @property
    def dp(self) -> int:
        """Ranks that see different micro-batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def stages(self) -> int:
        """Model chunks: pp x virtual stages per rank."""
        return self.pp * self.pp_virtual_stages

    def group(self, name: str) -> "Group":
        """The group of mesh view `name` (tp, cp, ep, dp_shard_cp, efsdp, dp_replicate, dp_cp, pp) with its
        stride."""
        tp, cp = self.tp, self.cp
        spans = {"tp": (1, tp), "cp": (tp, cp), "ep": (tp, self.ep), "dp_shard_cp": (tp, self.shard),
                 "efsdp": (tp * self.ep, self.efsdp), "dp_replicate": (tp * self.shard, self.dp_replicate),
                 "dp_cp": (tp, self.dp_replicate * self.shard),
                 "pp": (tp * self.shard * self.dp_replicate, self.pp)}
        stride, size = spans[name]
        return Group(name, size, stride, self.gpus_per_node)

    def parallel(self) -> ParallelConfig:
        """The recipe's `parallel` section of this layout (what `layout_of` reads back)."""
        return ParallelConfig(pp=self.pp, pp_schedule=self.pp_schedule,
                              pp_virtual_stages=self.pp_virtual_stages if self.pp > 1 else 0,
                              pp_layout=self.pp_layout, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard,
                              cp=self.cp, tp=self.tp, ep=self.ep,
                              activation_checkpointing=self.activation_checkpointing)

    def describe(self) -> str:
        parts = [f"{k}{getattr(self, k)}" for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
                 if getattr(self, k) > 1]
        if self.pp > 1:
            parts.append(f"{self.pp_schedule}x{self.pp_microbatches}")
        if self.activation_checkpointing != "none":
            parts.append(f"ac-{self.activation_checkpointing}")
        return " ".join(parts) or "1 GPU"


@dataclass(frozen=True)
class Group:
    name: str
    size: int
    stride: int
    gpus_per_node: int

    @property
    def intra_node(self) -> bool:
        return self.stride * self.size <= self.gpus_per_node

    @property
    def remote_fraction(self) -> float:
        """Share of a rank's peers on other nodes (what an all-to-all sends over the network)."""
        if self.size <= 1 or self.intra_node:
            return 0.0
        local = max(1, self.gpus_per_node // self.stride) if self.stride < self.gpus_per_node else 1
        return (self.size - local) / (self.size - 1)


def layout_of(parallel: ParallelConfig, gpus: int, *, grad_accum: int = 1, gpus_per_node: int = 8,
              replicate_compression: float = 1.0) -> Layout:
    """The layout of the recipe's `parallel` section on `gpus` GPUs (`grad_accum`: the step's micro-batches, what
    a pipeline runs); raises ValueError (one line naming the fix) for an impossible one."""
    try:
        sizes = resolve_sizes(parallel, gpus)
    except ValueError as e:
        raise ValueError(" ".join(str(e).split())) from None
    pipelined = sizes.pp > 1
    return Layout(sizes.dp_replicate, sizes.dp_shard, sizes.cp, sizes.tp, sizes.ep, sizes.pp, parallel.pp_schedule,
                  (parallel.pp_microbatches or grad_accum) if pipelined else 1,
                  parallel.virtual_stages if pipelined else 1, parallel.pp_layout if pipelined else "",
                  parallel.activation_checkpointing, replicate_compression, gpus_per_node,
                  parallel.powersgd_rank if parallel.replicate_compression == "powersgd" else 0)
