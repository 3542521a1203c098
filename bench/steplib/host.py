"""The host side of a profiled step: device launches per step by family, and the CPU ops that take the host's time.

A step whose GPU is busy only part of the time (`bench/step.py`'s `busy` column) is bound by the host: Python, the
dispatcher and the launch calls queue work more slowly than the GPU runs it. Two numbers say where to cut:

- launches per step, by the kernel families of `bench.steplib.kernels` (each launch costs host time whatever its
  size: two rows with equal kernel time and different launch counts differ in host time);
- the kernels launched most often per step (with their family and device time per launch);
- the CPU ops with the largest self time per step (torch.profiler's `self_cpu_time_total`: an op's time minus
  its children's), with their calls per step: `cudaLaunchKernel` / `cuLaunchKernelEx` (launches of ATen / Triton
  kernels), `aten::*` dispatch, autograd nodes, compiled graphs (`Torch-Compiled Region`, `CompiledFunction`).

Both come from the profiled run with CPU activity that `bench/steplib/row.py` already records for the kernel
breakdown; the profiler's own overhead inflates self times about evenly, so compare rows, not absolute times.
"""

from __future__ import annotations

import torch

from bench.steplib.kernels import FAMILIES, classify, launch_context


def launches(kernels: list[tuple[str, float, tuple[str, ...]]], steps: int) -> dict[str, float]:
    """Device events (kernels, copies, memsets) per step by family, and their `total`; `kernels` as
    `bench.steplib.kernels.device_kernels` returns them, over `steps` steps."""
    counts = dict.fromkeys(FAMILIES, 0)
    for name, _us, context in kernels:
        counts[classify(name, context)] += 1
    out = {family: n / steps for family, n in counts.items()}
    out["total"] = len(kernels) / steps
    return out


def most_launched(kernels: list[tuple[str, float, tuple[str, ...]]], steps: int, top: int = 15) -> list[list]:
    """The `top` kernels by launches per step: [name, family, launches per step, device us per launch, the ops
    that launched them (`launch_context`, most frequent first, up to three)]. Inside a CUDA graph each launch still
    costs the GPU a gap of a few microseconds, so many small launches of one kernel are a fusion candidate even
    when its time is small."""
    totals: dict[str, list] = {}
    for name, us, context in kernels:
        entry = totals.setdefault(name[:120], [classify(name, context), 0, 0.0, {}])
        entry[1] += 1
        entry[2] += us
        where = launch_context(context)
        entry[3][where] = entry[3].get(where, 0) + 1
    biggest = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [[name, family, n / steps, us / n, [w for w, _ in sorted(ctx.items(), key=lambda kv: -kv[1])[:3]]]
            for name, (family, n, us, ctx) in biggest]


def host_ops(prof, steps: int, top: int = 10) -> list[list]:
    """The `top` CPU ops by self time: [name, self ms per step, calls per step], largest first."""
    cpu = torch.autograd.DeviceType.CPU
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type != cpu or e.name == "[memory]" or e.name.startswith("ProfilerStep"):
            continue
        entry = totals.setdefault(e.name, [0.0, 0])
        entry[0] += e.self_cpu_time_total
        entry[1] += 1
    biggest = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [[name[:120], us / 1e3 / steps, calls / steps] for name, (us, calls) in biggest]
