"""DualPipeV's overlapped pair (`Overlap(f, b)` of `moela.parallel.pp_schedules`): one chunk's forward and the
other chunk's backward interleaved block by block on two CUDA streams, so that the collectives of one (each MoE
layer's expert dispatch and combine, FSDP's gathers and reduce-scatters, tensor parallelism's reductions) run while
the other computes: `StreamPairOverlap`.

How:
- The backward is issued in segments. A forward whose backward will be one of the pair's (the runtime knows which
  from the schedule) cuts its autograd graph after the embedding and after each block (`GraphCuts`): each block's
  outputs (h, a1, and its z-loss and balance terms) are replaced by detached leaves for the rest of the forward.
  The backward then runs the top segment (head, loss, MTP: the stage's roots) and each block's segment in turn,
  every one seeded with the gradients its leaves received above: the chain rule, cut into parts, so exact.
- The pair issues f's forward and, before each of its blocks, one segment of b's backward (`StageChunk.forward`'s
  `between`), then whatever is left of b. The host thus alternates between the two chunks block by block, which
  matters when a block waits on the host: the exact expert all-to-all reads its split sizes, one sync per MoE
  layer, and with the two chunks interleaved the GPU always holds the other chunk's last block while the host
  waits. Without the interleave the host would queue all of f (waiting at each of its syncs on an otherwise idle
  GPU) before any of b. The order is fixed by the schedule, the same on every rank, so the collectives of the two
  chunks are issued in the same order everywhere.
- Streams: f's forward runs on its chunk's side stream, b's segments on the other chunk's; both first wait for
  the current stream (the received inputs and gradients), and the current stream waits for both before the
  results are sent. Device-side event waits only, no host synchronization. Tensors made on a side stream and
  read on the current one are recorded there for the allocator. b's segments run with autocast off, like every
  backward, although they are issued from inside f's autocast forward.

DeepSeek's DualPipe goes one level finer, pairing phases inside a block (attention with the other chunk's
combine, dispatch with its MLP); here the unit is the block, and within a pair of blocks the GPU interleaves the
two streams' kernels as they become ready.

On the CPU (or without CUDA) the pair runs the same interleave on one stream, with the same results.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext

import torch

from moela.parallel.pp_schedules import Action


class GraphCuts:
    """A stage forward's autograd graph cut into segments (module docstring). `cut(*tensors)` returns stand-ins
    for the rest of the forward: a detached leaf for each tensor that takes a gradient, the value itself
    otherwise. `backward(roots, seeds)` is an iterator that runs one segment per step, top first."""

    def __init__(self):
        self._cuts: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def cut(self, *tensors):
        pairs, out = [], []
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                leaf = t.detach().requires_grad_()
                pairs.append((t, leaf))
                t = leaf
            out.append(t)
        self._cuts.append(pairs)
        return out

    def backward(self, roots: list[torch.Tensor], seeds: list[torch.Tensor]) -> Iterator[None]:
        if roots:
            torch.autograd.backward(roots, seeds)
        yield
        while self._cuts:
            pairs = self._cuts.pop()
            below = [(t, leaf.grad) for t, leaf in pairs if leaf.grad is not None]
            if below:
                torch.autograd.backward([t for t, _ in below], [g for _, g in below])
            yield


class StreamPairOverlap:
    """`PipelineRuntime.overlap_f_b` for a V of `pp` ranks (stages below pp are chunk 0) on `device`."""

    def __init__(self, pp: int, device: torch.device):
        self.pp, self.device = pp, device
        self.streams = ([torch.cuda.Stream(device), torch.cuda.Stream(device)]
                        if device.type == "cuda" and torch.cuda.is_available() else None)

    def __call__(self, runtime, f: Action, b: Action) -> None:
        inputs = runtime.receive_inputs(f.stage, f.mb)
        grads = runtime.receive_grads(b.stage, b.mb)
        segments = runtime.backward_segments(b.stage, b.mb, grads)
        done: list[list[torch.Tensor]] = []
        side_b = None if self.streams is None else self.streams[b.stage >= self.pp]

        def next_segment() -> None:
            if done:
                return
            with torch.autocast(self.device.type, enabled=False), \
                    (torch.cuda.stream(side_b) if side_b is not None else nullcontext()):
                try:
                    next(segments)
                except StopIteration as end:
                    done.append(end.value)

        if self.streams is None:
            out = runtime.run_forward(f.stage, f.mb, inputs, between=next_segment)
            while not done:
                next_segment()
        else:
            current = torch.cuda.current_stream()
            side_f = self.streams[f.stage >= self.pp]
            side_f.wait_stream(current)
            side_b.wait_stream(current)
            with torch.cuda.stream(side_f):
                out = runtime.run_forward(f.stage, f.mb, inputs, between=next_segment)
            while not done:
                next_segment()
            current.wait_stream(side_f)
            current.wait_stream(side_b)
            for t in [*out.outputs, *done[0]]:
                t.record_stream(current)
        runtime.send_outputs(f.stage, f.mb, out)
        runtime.send_grads(b.stage, b.mb, done[0])
