"""AdamW with the usual decay exclusions, and the learning-rate schedules (warmup + cosine, warmup-stable-decay).

Decisions:
- Weight decay applies only to matrices that transform activations. Norm scales, biases and anything of rank < 2
  are excluded, as are embeddings and the router's score-correction bias (names containing `embed` or
  `e_score_correction_bias`); the output head decays unless it is tied to the embedding.
- On CUDA the fused AdamW kernel is used (`optim.fused`); on CPU the default implementation, whose result the
  tests treat as the reference. `optim.moment_dtype: bfloat16` uses moela's AdamW with bf16 moments instead
  (moela.trainer.adamw_moments), and so do sharded (DTensor) parameters on CUDA with fp32 moments: torch's fused
  kernel cannot take the trainer's device-side skip flag for DTensors (a plain flag among DTensor operands), so
  every FSDP2 step would read the flag on the host; moela's AdamW takes it, and equals torch's AdamW with fp32
  moments (tests/test_adamw_moments.py).
- The schedule is a `LambdaLR` over a multiplier object, a pure function of the recipe and the step: a resumed
  run rebuilds it at the checkpoint's step from its current settings (a raised `train.steps`, a new `optim.lr`)
  instead of loading the saved one, and re-applies the recipe's weight decay, betas and eps. Step i (0-based)
  trains with `lr * multiplier(i)`: warmup ramps linearly to the peak reaching it at step `warmup_steps - 1`, and
  every decay ends exactly at `min_lr_ratio` on the last step.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moela.parallel import clip_factor, clip_grad_norm_
from moela.trainer.adamw_moments import AdamWMoments
from moela.trainer.config import OptimConfig, ScheduleConfig

NO_DECAY_NAME_PARTS = ("embed", "e_score_correction_bias")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrices and everything else (norms, biases, embeddings, router bias); a group
    with no parameter (a pipeline stage may hold no vector, or no matrix) is left out: torch's distributed
    checkpoint loads the state of an optimizer with at most one empty group."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or any(part in name for part in NO_DECAY_NAME_PARTS):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    return [g for g in groups if g["params"]]


def apply_hyperparameters(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> None:
    """Set the recipe's weight decay, betas and eps, and this device's kernel choice (fused / foreach), on the
    groups of `param_groups` after loading a checkpoint, whose param groups carry the run that saved it."""
    for group in optimizer.param_groups:
        group["weight_decay"] = cfg.weight_decay if group.get("name") == "decay" else 0.0
        group["betas"] = (cfg.beta1, cfg.beta2)
        group["eps"] = cfg.eps
        for key in ("fused", "foreach", "capturable"):
            if key in optimizer.defaults:
                group[key] = optimizer.defaults[key]


def clip_gradients(model: nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float,
                   device: torch.device, *, across=None) -> torch.Tensor:
    """The global gradient norm (a 0-d device tensor), after clipping to `grad_clip` when it is > 0. An optimizer
    that scales gradients as it reads them (moela's AdamW) gets the clipping factor instead: no pass over the
    gradients. `across`: the process group of the other pipeline stages, whose gradients count in the norm."""
    max_norm = grad_clip if grad_clip > 0 else None
    in_step = max_norm is not None and getattr(optimizer, "scales_grads_in_step", False)
    total = clip_grad_norm_(model.parameters(), None if in_step else max_norm, across=across).to(device)
    if in_step:
        optimizer.grad_scale = clip_factor(total, max_norm)
    return total


def optimizer_step(optimizer: torch.optim.Optimizer, finite: torch.Tensor, on_device: bool) -> None:
    """The optimizer step unless `finite` (a device bool) is false: skipped on the device where the optimizer
    allows it (`on_device`: `step_metrics.skips_on_device`), else by a host read."""
    if on_device:
        optimizer.found_inf = (~finite).float()
        optimizer.step()
    elif bool(finite):  # the one host read of a step without device skipping (step_metrics docstring)
        optimizer.step()


def build_optimizer(model: nn.Module, cfg: OptimConfig, device_type: str) -> torch.optim.Optimizer:
    fused = cfg.fused and device_type == "cuda"
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    if cfg.moment_dtype != "float32" or (fused and sharded):
        return AdamWMoments(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            eps=cfg.eps, moment_dtype=cfg.moment_dtype)
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
        fused=fused or None,
    )


class LRMultiplier:
    """Multiplier of the peak learning rate at optimizer step i (0-based) of a `total_steps` run."""

    def __init__(self, cfg: ScheduleConfig, total_steps: int):
        self.kind = cfg.kind
        self.warmup = cfg.warmup_steps
        self.min_ratio = cfg.min_lr_ratio
        self.total = total_steps
        self.decay_steps = max(1, round(cfg.decay_fraction * total_steps))
        self.decay_shape = cfg.decay_shape

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        if self.kind == "cosine":
            progress = _progress(step, self.warmup, self.total)
            return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        decay_start = max(self.warmup, self.total - self.decay_steps)
        if step < decay_start:
            return 1.0
        progress = _progress(step, decay_start, self.total)
        if self.decay_shape == "linear":
            remaining = 1 - progress
        elif self.decay_shape == "sqrt":
            remaining = 1 - math.sqrt(progress)
        else:
            remaining = 0.5 * (1 + math.cos(math.pi * progress))
        return self.min_ratio + (1 - self.min_ratio) * remaining


def _progress(step: int, start: int, total: int) -> float:
    """0 at `start`, 1 at the last step `total - 1`."""
    span = total - 1 - start
    return 1.0 if span <= 0 else min(1.0, max(0.0, (step - start) / span))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int, *,
                    peak_lr: float | None = None, start_step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule, positioned before optimizer step `start_step` (0: a fresh run).

    `peak_lr` (default: each group's lr when the scheduler is built at step 0) becomes every group's peak; a
    resumed run passes `optim.lr` and the checkpoint's step, so the schedule follows the current recipe (e.g. a
    raised `train.steps`) rather than the lr saved in the optimizer's param groups.
    """
    if start_step < 0 or (start_step > 0 and peak_lr is None):
        raise ValueError(f"build_scheduler: start_step={start_step} needs start_step >= 0, and peak_lr when > 0")
    if peak_lr is not None:
        for group in optimizer.param_groups:
            group["initial_lr"] = peak_lr
    return torch.optim.lr_scheduler.LambdaLR(optimizer, LRMultiplier(cfg, total_steps), last_epoch=start_step - 1)
