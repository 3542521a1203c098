"""The layout a plan prices: mesh sizes (as `moela.parallel.mesh` factors the world), pipeline settings, the GPU.

Decisions:
- The world is `pp x dp_replicate x dp_shard x cp x tp`, outermost to innermost: the non-pipeline part is exactly
  `moela.parallel.mesh.resolve_sizes` (so a plan accepts what training accepts and rejects it with the same
  message), and pipeline stages are outermost, as torchtitan orders them, so that every other group stays inside
  a stage's ranks. `ep` borrows ranks from `dp_shard x cp`.
- A group is on one node when the ranks it spans (its stride times its size) fit in `gpus_per_node`; otherwise
  its traffic crosses the network (`Group.intra_node`).
- Pipeline settings (`pp`, `pp_schedule`, `pp_microbatches`, `pp_virtual_stages`) are plan inputs: the blocks are
  split evenly over `pp * pp_virtual_stages` chunks, the embedding on the first stage, the final norm, head and
  the MTP depths on the last.
- `replicate_compression`: the factor by which the `dp_replicate` gradient all-reduce is shrunk (1 = plain; a
  compressor such as PowerSGD sets its ratio); the communication model divides those bytes by it.
- GPUs: memory as torch sees it, dense datasheet peaks, and the link bandwidths the alpha-beta model uses
  (`GPUS`; the sources are in its comments).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moela.parallel.config import ParallelConfig
from moela.parallel.mesh import resolve_sizes

PP_SCHEDULES = ("1f1b", "interleaved_1f1b", "zbv", "dualpipev")


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
    pp_virtual_stages: int = 1
    activation_checkpointing: str = "none"
    replicate_compression: float = 1.0
    gpus_per_node: int = 8

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
        """Model chunks: pp x virtual stages per rank (DualPipeV's V holds two chunks per rank)."""
        return self.pp * (2 if self.pp_schedule in ("zbv", "dualpipev") else self.pp_virtual_stages)

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


def layout_of(parallel: ParallelConfig, gpus: int, *, pp: int = 1, pp_schedule: str = "1f1b",
              pp_microbatches: int = 1, pp_virtual_stages: int = 1, gpus_per_node: int = 8,
              replicate_compression: float = 1.0) -> Layout:
    """The layout of `parallel` on `gpus` GPUs; raises ValueError (one line naming the fix) for an impossible one."""
    if pp < 1 or gpus % pp:
        raise ValueError(f"--pp {pp} must be >= 1 and divide --gpus {gpus}; choose a divisor of {gpus}")
    if pp_schedule not in PP_SCHEDULES:
        raise ValueError(f"--pp-schedule: unknown {pp_schedule!r}; choose one of {', '.join(PP_SCHEDULES)}")
    if pp > 1 and pp_microbatches < pp:
        raise ValueError(f"--pp-microbatches {pp_microbatches} must be >= --pp {pp} (fewer leave stages idle)")
    if pp_virtual_stages < 1 or (pp_schedule == "interleaved_1f1b") != (pp_virtual_stages > 1):
        raise ValueError(f"--pp-virtual-stages {pp_virtual_stages}: interleaved_1f1b needs >= 2, the other "
                         f"schedules 1 (zbv and dualpipev hold two chunks per rank by construction)")
    try:
        sizes = resolve_sizes(parallel, gpus // pp)
    except ValueError as e:
        raise ValueError(" ".join(str(e).split())) from None
    return Layout(sizes.dp_replicate, sizes.dp_shard, sizes.cp, sizes.tp, sizes.ep, pp, pp_schedule,
                  pp_microbatches if pp > 1 else 1, pp_virtual_stages, parallel.activation_checkpointing,
                  replicate_compression, gpus_per_node)


def with_sizes(layout: Layout, **sizes) -> Layout:
    return replace(layout, **sizes)
