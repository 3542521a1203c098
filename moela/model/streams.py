"""`run_beside(main, side, stream)`: two independent parts of a block on two CUDA streams (FAL's attention and MLP).

A FAL block's attention and MLP read the same inputs and meet only in the final sum, so on one GPU they can run
at the same time, each filling the SMs the other leaves idle. Decisions:
- `main` is launched on the current stream first, then `side` on `stream`: the MLP of an MoE layer may wait on the
  host for the device (expert-parallel split sizes, expert row bounds), and such a wait blocks only its own stream
  if the attention kernels are already queued.
- Stream order: `stream` first waits for the current stream (the inputs were computed there); the current stream
  waits for `stream` before anything reads the side's results.
- Caching allocator: a tensor is returned to its allocating stream's pool when Python frees it, and that stream may
  reuse the memory at once. Tensors made on the current stream and read on the side (`inputs`, plus everything
  autograd saves from them, which is the same storage) are marked with `record_stream(stream)`, the side's outputs
  with `record_stream(current)`, so neither stream can overwrite memory the other still reads.
- Autograd runs each backward op on the stream of its forward op and synchronizes where gradients cross streams,
  so the backward of the two parts overlaps the same way without further code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

A = TypeVar("A")
B = TypeVar("B")


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def run_beside(main: Callable[[], A], side: Callable[[], B], stream: torch.cuda.Stream,
               inputs: Iterable[torch.Tensor | None] = ()) -> tuple[A, B]:
    """(main(), side()) with `side` on `stream` and `main` on the current stream, concurrently; `inputs`: tensors
    made on the current stream that `side` reads."""
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    for t in inputs:
        if t is not None:
            t.record_stream(stream)
    main_out = main()
    with torch.cuda.stream(stream):
        side_out = side()
    current.wait_stream(stream)
    for t in _tensors(side_out):
        t.record_stream(current)
    return main_out, side_out
