"""What `Transformer.forward(batch)` returns: the training objective plus detached statistics for the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ModelOutput:
    loss: torch.Tensor  # scalar: token-mean LM loss + weighted MTP, aux and z-loss terms (what backward() takes)
    # tokens with a label in this micro-batch (the trainer weights micro-batches by it); a host int, or a 0-d device
    # tensor where only the device knows it (a context-parallel shard), so that nothing waits to read it
    num_targets: int | torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # detached scalars: lm_loss, mtp_loss, ...
    expert_load: torch.Tensor | None = None  # [L_moe, E] float32 tokens routed to each expert (detached)
    logits: torch.Tensor | None = None  # [T, V] main-head logits, only when forward(..., return_logits=True)
