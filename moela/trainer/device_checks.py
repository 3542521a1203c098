"""What a recipe asks of the machine, checked when the trainer starts, before the model is built: a backend or FP8
that this device cannot run stops the run with the fix (an `InputError`), instead of failing inside the first
forward or the first kernel's compilation. What the recipe rules out by itself is `Config.validate`'s, so that a
run's recipe stays loadable on another machine (`python -m moela generate` on a laptop)."""

from __future__ import annotations

import importlib.util

import torch

from moela.model.config import ModelConfig
from moela.ops.fp8_device import fp8_device_problem
from moela.ops.triton_env import INTERPRET
from moela.trainer.errors import InputError


def check_fp8_device(model_cfg: ModelConfig, device: torch.device) -> None:
    """A recipe that asks for FP8 on a GPU without FP8 tensor cores fails here, before the model is built, with the
    fix, instead of inside the first FP8 GEMM's compilation (moela.ops.fp8_device). The reference backends
    simulate FP8 on any device: experts under `model.moe_backend: reference` pass when no FP8 linear is asked for."""
    if not model_cfg.fp8_linears and (model_cfg.expert_recipe == "bf16" or model_cfg.moe_backend == "reference"):
        return
    problem = fp8_device_problem(device)
    if problem:
        asked = f"model.precision: {model_cfg.precision}" if model_cfg.precision != "bf16" else \
            "model.moe_recipe: fp8_blockwise"
        simulate = "" if model_cfg.fp8_linears else \
            ", or simulate the FP8 experts with model.moe_backend: reference (slow)"
        raise InputError(f"{asked}: {problem}. Train in bf16 (model.precision: bf16, model.moe_recipe: bf16) on "
                         f"this GPU{simulate}")


def check_backends(model_cfg: ModelConfig, device: torch.device) -> None:
    """A named backend this machine cannot run fails before the model is built, with the fix, instead of inside the
    first forward. The fast MoE backends run CUDA kernels on bf16/fp16 activations (the CPU trains in float32) and
    `deep_gemm` needs its package; the attention's `sdpa` and `flash` run on CUDA, `triton` too, or on the CPU in
    Triton's interpreter (TRITON_INTERPRET=1, the tests), and a `gluon` kernel in `model.kernels` on Hopper only.
    What the recipe itself rules out is `Config.validate`'s."""
    on = device.type
    name = model_cfg.moe_backend
    fix = "use model.moe_backend: auto (the fastest backend the run can use, logged) or reference"
    if name not in ("auto", "reference") and on != "cuda":
        raise InputError(f"model.moe_backend: {name!r} runs CUDA kernels and this run is on the {on}; {fix}")
    if name == "deep_gemm" and importlib.util.find_spec("deep_gemm") is None:
        raise InputError(f"model.moe_backend: 'deep_gemm' needs the deep_gemm package, which is not installed; {fix}")
    name = model_cfg.attention_backend
    fix = "use model.attention_backend: auto (the fastest backend the run can use, logged) or reference"
    if name in ("sdpa", "flash", "triton") and on != "cuda" and not (name == "triton" and INTERPRET):
        interpreted = " (Triton interprets them on the CPU under TRITON_INTERPRET=1)" if name == "triton" else ""
        raise InputError(f"model.attention_backend: {name!r} runs CUDA kernels and this run is on the {on}"
                         f"{interpreted}; {fix}")
    gluon = [name for name in ("attention_forward", "attention_dq", "attention_dkdv")
             if getattr(model_cfg.kernels, name) == "gluon"]
    capability = torch.cuda.get_device_capability(device) if gluon and on == "cuda" else None
    if gluon and (capability is None or capability[0] != 9):
        where = f"sm_{capability[0]}{capability[1]}" if capability else f"the {on}"
        raise InputError(f"model.kernels.{gluon[0]}: 'gluon' runs on Hopper (sm_90) GPUs only, not on {where}; use "
                         f"auto (the Gluon kernel where it runs, the Triton one elsewhere) or triton")
