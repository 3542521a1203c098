"""What a training step leaves on the device, and the one read that brings a logging window's numbers to the host.

A step's losses, gradient norm, finiteness and expert-load statistics are tensors on the training device. Reading
any of them on the host (`.item()`, `float(t)`, `.tolist()`) makes the CPU wait until the GPU has finished every
kernel queued so far; the GPU then idles while the CPU queues the next step. So a step keeps them on the device and
the trainer reads them once per logging step, for all the steps of the window in one copy.

Decisions:
- `StepSums` accumulates, per micro-batch, `value * num_targets` of the loss and each metric in float64 (the same
  weighting the host code did), stacked into one vector, so one micro-batch adds one small kernel.
- A non-finite step (loss or gradient norm) is skipped without a host read where the optimizer can do it: fused
  AdamW takes a `found_inf` tensor (the mechanism `torch.amp.GradScaler` uses) and leaves parameters, moments and
  its step count untouched when it is 1; so does moela's AdamW (`moela.trainer.adamw_moments`), which the trainer
  builds for bf16 moments and for sharded (DTensor) parameters on CUDA, where torch's fused kernel would mix the
  plain flag into DTensor operands. The router-bias update is multiplied by the same flag. Plain (for-loop or
  foreach) AdamW cannot take the flag: it reads the flag on the host, one synchronization per step (free on the
  CPU).
- The counts of skipped steps and of non-finite steps in a row are device tensors too, with the longest streak
  since the last read, so a streak that reaches `train.max_nonfinite_steps` and ends between two reads is still
  seen. The trainer checks it when it reads (every logging step), so a run with non-finite steps stops at most
  `logging.log_every - 1` steps after the streak reached the limit; the steps in between were skipped (no update).
- `PendingRecords` keeps each step's record with its device vector until the trainer resolves them; on a logging
  step the values become floats in the same dicts the steps returned (until then they hold 0-d device tensors).

Shapes: M metrics of a step (loss first, then the model's metrics in sorted key order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

# the per-step counters after the means: gradient norm, expert imbalance, finite flag, skipped steps in all,
# non-finite steps in a row, the longest such streak since the last read
TAIL_KEYS = ("grad_norm", "expert_imbalance", "finite", "skipped", "nonfinite_in_row", "worst_streak")


class StepSums:
    """Per-step sums of `value * num_targets` for the loss and every metric, as one float64 device vector."""

    def __init__(self) -> None:
        self.keys: list[str] | None = None
        self.sums: torch.Tensor | None = None  # [M] float64

    def add(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor], num_targets: int | torch.Tensor) -> None:
        keys = ["loss"] + sorted(metrics)
        if self.keys is not None and keys != self.keys:
            raise ValueError(f"micro-batches of one step returned different metrics: {self.keys} vs {keys}")
        self.keys = keys
        values = torch.stack([loss.detach().reshape(())] + [metrics[k].detach().reshape(()) for k in keys[1:]])
        values = values.double() * num_targets  # [M]
        self.sums = values if self.sums is None else self.sums + values


def expert_imbalance_device(load: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Mean over MoE layers of max / mean tokens per expert (`load` [L_moe, E]), as a 0-d float64 device tensor;
    NaN without MoE layers (reported as None)."""
    if load is None or load.numel() == 0:
        return torch.full((), float("nan"), dtype=torch.float64, device=device)
    load = load.double()
    return (load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-12)).mean()


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` can be skipped by a device flag (see the module docstring)."""
    if getattr(optimizer, "skips_on_found_inf", False):  # moela's AdamW, sharded or not
        return True
    if not optimizer.defaults.get("fused"):
        return False
    return not any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])


class NonfiniteCounters:
    """Skipped steps, the current non-finite streak and its longest value since the last `reset_worst()`: int64
    device scalars updated from each step's finite flag without a host read."""

    def __init__(self, device: torch.device, skipped: int = 0, in_row: int = 0):
        self.skipped = torch.tensor(skipped, dtype=torch.int64, device=device)
        self.in_row = torch.tensor(in_row, dtype=torch.int64, device=device)
        self.worst = self.in_row.clone()

    def update(self, finite: torch.Tensor) -> None:
        bad = (~finite).to(torch.int64)
        self.skipped = self.skipped + bad
        self.in_row = (self.in_row + 1) * bad
        self.worst = torch.maximum(self.worst, self.in_row)

    def reset_worst(self, in_row: int) -> None:
        self.worst = torch.full_like(self.worst, in_row)


@dataclass
class PendingRecords:
    """Records of the steps since the last read; `resolve()` turns their device values into floats in place."""

    records: list[dict] = field(default_factory=list)

    def add(self, record: dict, device_values: torch.Tensor, keys: list[str]) -> None:
        """`device_values` [len(keys)] float64; the record gets a 0-d view per key until resolved."""
        record.update({k: device_values[i] for i, k in enumerate(keys)})
        record["_device"] = (device_values, keys)
        self.records.append(record)

    def __len__(self) -> int:
        return len(self.records)

    def resolve(self) -> list[dict]:
        """One device-to-host copy for every pending record; returns them (now plain numbers) and forgets them."""
        if not self.records:
            return []
        values = torch.stack([r["_device"][0] for r in self.records]).tolist()  # the read: [records, keys]
        done, self.records = self.records, []
        for record, row in zip(done, values):
            _, keys = record.pop("_device")
            record.update(zip(keys, row))
        return done
