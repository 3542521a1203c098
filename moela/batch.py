"""`PackedBatch`, the one batch type: documents concatenated into a flat token stream, no padding, no batch dim.

Lives at the package top level because both `moela.data` (which builds it) and `moela.model` (which consumes
it) need it, and the model must not import `data`.

Shapes: T tokens, N documents.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

IGNORE_INDEX = -100


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [T] int64
    labels: torch.Tensor  # [T] int64, IGNORE_INDEX where a token has no target (last token of each document)
    position_ids: torch.Tensor  # [T] int32, restart at 0 for each document (original positions under CP)
    cu_seqlens: torch.Tensor  # [N+1] int32, document boundaries in the flat stream
    max_seqlen: int
    # labelled-token count known on the host: set by the producer (the data loader's `make_batch`), else by `to()`
    # from a CPU batch, and carried to the device, so that the model reading it on the GPU does not synchronize
    # with the device once per micro-batch (a context-parallel shard counts its own on the device)
    targets_on_host: int | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def num_targets(self) -> int:
        """Tokens that carry a label (the denominator of the token-mean loss)."""
        if self.targets_on_host is not None:
            return self.targets_on_host
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PackedBatch":
        """The batch on `device`. A non-blocking copy from the CPU to a GPU goes through pinned memory, so that the
        host never waits for the device (a copy from pageable memory is staged synchronously)."""
        pin = non_blocking and torch.device(device).type == "cuda"
        moved = {
            f.name: (_copy(v, device, non_blocking, pin) if isinstance(v, torch.Tensor) else v)
            for f in fields(self)
            for v in [getattr(self, f.name)]
        }
        if self.targets_on_host is None and self.labels.device.type == "cpu":
            moved["targets_on_host"] = self.num_targets()
        return replace(self, **moved)

    def validate(self) -> None:
        """Check the invariants every producer must keep; raises ValueError naming the broken one."""
        t = self.input_ids.numel()
        if self.input_ids.dim() != 1 or self.labels.shape != self.input_ids.shape:
            raise ValueError(f"input_ids and labels must be flat [T] tensors of one length, got "
                             f"{tuple(self.input_ids.shape)} and {tuple(self.labels.shape)}")
        if self.position_ids.shape != self.input_ids.shape:
            raise ValueError(f"position_ids must be [T]={t}, got {tuple(self.position_ids.shape)}")
        cu = self.cu_seqlens
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != t:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={t}, got {cu.tolist()}")
        lens = cu[1:] - cu[:-1]
        if bool((lens <= 0).any()):
            raise ValueError("cu_seqlens must be strictly increasing (no empty documents)")
        if int(lens.max()) != self.max_seqlen:
            raise ValueError(f"max_seqlen={self.max_seqlen} but the longest document has {int(lens.max())} tokens")


def _copy(t: torch.Tensor, device: torch.device | str, non_blocking: bool, pin: bool) -> torch.Tensor:
    if pin and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)
