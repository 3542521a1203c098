"""DualPipeV's overlapped pair (`Overlap(f, b)` of `moela.parallel.pp_schedules`): one chunk's forward and the
other chunk's backward issued together on two CUDA streams, so that the collectives of one (each MoE layer's
expert dispatch and combine, FSDP's gathers and reduce-scatters, tensor parallelism's reductions) run while the
other computes.

How: the forward runs under its chunk's stream (chunk 0 of the V on one, chunk 1 on another; pairs always join
the two chunks, so they never share a stream); the backward runs where autograd puts it, on the streams its
forward ran on, which are not the forward's. Both streams first wait for the current one (the received inputs
and gradients), and the current one waits for both before the results are sent: device-side event waits only,
no host synchronization, so the host queues both chunks' kernels back to back and the GPU interleaves them.
Tensors made on a side stream and read on the current one are recorded there for the allocator.

This is the stream-level form of the overlap: the GPU interleaves the two chunks' kernels as they become ready;
DeepSeek's DualPipe goes further and issues the pair phase by phase (attention, dispatch, experts, combine) so
that each all-to-all is issued exactly beside the other chunk's compute.

On the CPU (or without CUDA) the pair runs forward then backward, with the same results.
"""

from __future__ import annotations

import torch

from moela.parallel.pp_schedules import Action


class StreamPairOverlap:
    """`PipelineRuntime.overlap_f_b` for a V of `pp` ranks (stages below pp are chunk 0) on `device`."""

    def __init__(self, pp: int, device: torch.device):
        self.pp = pp
        self.streams = ([torch.cuda.Stream(device), torch.cuda.Stream(device)]
                        if device.type == "cuda" and torch.cuda.is_available() else None)

    def __call__(self, runtime, f: Action, b: Action) -> None:
        inputs = runtime.receive_inputs(f.stage, f.mb)
        grads = runtime.receive_grads(b.stage, b.mb)
        if self.streams is None:
            out = runtime.run_forward(f.stage, f.mb, inputs)
            input_grads = runtime.run_backward(b.stage, b.mb, grads, b.kind)
        else:
            current = torch.cuda.current_stream()
            side_f, side_b = self.streams[f.stage >= self.pp], self.streams[b.stage >= self.pp]
            side_f.wait_stream(current)
            side_b.wait_stream(current)
            with torch.cuda.stream(side_f):
                out = runtime.run_forward(f.stage, f.mb, inputs)
            with torch.cuda.stream(side_b):
                input_grads = runtime.run_backward(b.stage, b.mb, grads, b.kind)
            current.wait_stream(side_f)
            current.wait_stream(side_b)
            for t in [*out.outputs, *input_grads]:
                t.record_stream(current)
        runtime.send_outputs(f.stage, f.mb, out)
        runtime.send_grads(b.stage, b.mb, input_grads)
