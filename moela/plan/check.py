"""train.py's check before the first CUDA allocation: the plan's memory per GPU against the device's.

Decisions: the world size is the launcher's (`WORLD_SIZE`), the device's total memory and name come from
`torch.cuda.get_device_properties` (no allocation). A prediction above `NEAR` of the device's memory prints one
warning line with the plan's numbers; above `OVER` (a clear margin beyond the plan's error against measured
peaks, docs/plan.md) it is an error under `train.plan_check: error` (the default), a warning under `warn`. The
GPU's peak and links come from the nearest known kind (`moela.plan.layout.GPUS`); only memory matters here.
"""

from __future__ import annotations

from dataclasses import replace

from moela.plan.layout import GPUS, layout_of
from moela.plan.memory import GIB
from moela.plan.predict import predict
from moela.plan.report import one_line

NEAR = 0.9
OVER = 1.15


def memory_check(cfg, world_size: int, device_name: str, total_bytes: int) -> tuple[str, str] | None:
    """None when the plan fits comfortably (or `train.plan_check: never`), else (level "warn" | "error", line)."""
    mode = cfg.train.plan_check
    if mode == "never":
        return None
    kind = next((k for k in GPUS if k in device_name.lower()), "h100")
    gpu = replace(GPUS[kind], name=device_name, memory_gib=total_bytes / GIB)
    try:
        layout = layout_of(cfg.parallel, world_size, grad_accum=cfg.train.grad_accum)
    except ValueError:
        return None  # the trainer reports an impossible layout itself
    plan = predict(cfg, layout, gpu)
    ratio = plan.memory_ratio
    if ratio <= NEAR:
        return None
    level = "error" if ratio > OVER and mode == "error" else "warn"
    verdict = "exceeds" if ratio > 1 else "is near"
    fix = ("; lower train.tokens_per_microbatch, set parallel.activation_checkpointing: full, or shard over more "
           "GPUs (python -m moela plan RECIPE --gpus N --search); train.plan_check: warn runs it anyway"
           if level == "error" else "")
    return level, f"plan: this layout {verdict} the {device_name}'s memory ({ratio:.0%}): {one_line(plan)}{fix}"
