"""A CUDA out-of-memory error during a run, as one message: the phase that ran out (training step, evaluation,
samples, checkpoint), what it tried to allocate against what the device holds, and the recipe settings that lower
that phase's memory.

Nothing is saved after an out-of-memory error (the step it interrupted left the model and optimizer half-updated),
so the newest complete checkpoint stays what a rerun resumes from, and the message names it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from moela.trainer.errors import TrainingError

# the settings that lower each phase's memory, most effective first
LOWER = {
    "the training step": ["train.tokens_per_microbatch (raise train.grad_accum to keep the batch)",
                          "optim.moment_dtype=bfloat16", "train.cuda_graphs=false",
                          "more GPUs (parallel.dp_shard, parallel.ep)"],
    "the evaluation": ["train.tokens_per_microbatch (evaluation micro-batches have the training budget)",
                       "train.eval_every=0 (evaluate only at the end)"],
    "the samples": ["logging.samples=0", "logging.sample_tokens"],
    "the checkpoint save": ["more GPUs (parallel.dp_shard: each rank saves its shard)"],
}
_GIB = 2**30


def _tried(error: BaseException) -> str | None:
    match = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(error))
    return match.group(1) if match else None


def message(phase: str, error: BaseException, device: torch.device, checkpoint: Path | None) -> str:
    """The one-line report of `error` (an out-of-memory error) in `phase` (a key of LOWER)."""
    held = ""
    if device.type == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(device).total_memory
        held = (f", with {torch.cuda.memory_reserved(device) / _GIB:.1f} GiB of the device's {total / _GIB:.1f} "
                f"GiB held by this process (peak {torch.cuda.max_memory_reserved(device) / _GIB:.1f} GiB)")
    tried = _tried(error)
    need = f" needed {tried} more" if tried else " ran out of device memory"
    resume = (f"rerunning resumes from {checkpoint}, which is intact" if checkpoint is not None else
              "no checkpoint was written yet")
    return (f"out of memory: {phase}{need}{held}. Lower its memory with: {'; '.join(LOWER[phase])}. Nothing was "
            f"saved after the error; {resume}")


@contextmanager
def reported(phase: str, device: torch.device, newest_checkpoint) -> Iterator[None]:
    """Turn an out-of-memory error inside the block into a TrainingError carrying `message`;
    `newest_checkpoint()` gives the checkpoint a rerun resumes from (or None)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise TrainingError(message(phase, e, device, newest_checkpoint())) from None
