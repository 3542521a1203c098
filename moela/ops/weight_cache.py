"""Quantized copies of weights, computed once per optimizer step instead of once per micro-batch.

FP8 GEMMs read e4m3 weights with 128x128 scales plus a transposed copy for the data gradient. The weights change
only when the optimizer steps, so with gradient accumulation every micro-batch after the first would redo the same
quantization. `cached(weight, kind, compute)` keeps one entry per (parameter, kind) and reuses it while
- the entry's tensor is still this very object (a weak reference: a freed parameter never aliases a new one),
- its version counter (`weight._version`) is unchanged: every in-place update through autograd's view of the
  tensor bumps it, the optimizers' (foreach, fused) included, and
- no optimizer has stepped since (`EPOCH`, bumped by a global `Optimizer` step post-hook).
The epoch is what makes FSDP2 correct: its unsharded parameters are re-gathered before every forward into the same
parameter object with the version counter deliberately preserved (`_unsafe_preserve_version_counter`), so after
an optimizer step (which updates the sharded parameters) the unsharded one carries new values under the old
version; the step hook invalidates every entry then. Between micro-batches of one step the re-gathered values
are the same, so the entry stays valid (one quantization per step under FSDP2 too, at the memory cost of keeping
each layer's quantized full weight: 2 bytes per weight element with the transposed copy).
Not cached: calls made while a CUDA graph is being captured (a hit would freeze the graph on the captured copy;
a captured quantization runs again at every replay) and weights that are not leaf parameters. `invalidate()`
drops everything (e.g. after loading weights outside autograd's view, through `.data`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

EPOCH = [0]
_ENTRIES: dict[tuple[int, str], tuple[weakref.ref, int, int, Any]] = {}


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    invalidate()


def invalidate() -> None:
    """Forget every cached copy (called after each optimizer step)."""
    EPOCH[0] += 1
    _ENTRIES.clear()


def cached(weight: torch.Tensor, kind: str, compute: Callable[[torch.Tensor], Any]) -> Any:
    """compute(weight), reused for the same parameter, version and optimizer step (see the module docstring)."""
    if not isinstance(weight, torch.nn.Parameter) or (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
        return compute(weight)
    key = (id(weight), kind)
    entry = _ENTRIES.get(key)
    if entry is not None:
        ref, epoch, version, value = entry
        if ref() is weight and epoch == EPOCH[0] and version == weight._version:
            return value
    value = compute(weight)
    _ENTRIES[key] = (weakref.ref(weight), EPOCH[0], weight._version, value)
    return value


def size() -> int:
    """Entries held (for tests and memory accounting)."""
    return len(_ENTRIES)


_HOOK = register_optimizer_step_post_hook(_on_optimizer_step)
