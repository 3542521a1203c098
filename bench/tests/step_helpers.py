"""What several bench/step.py tests share: the repository root, bench/step.py loaded as a module, and the tiny
model's overrides and config."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from factories import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]

TINY = tiny_overrides(vocab_size=4096, num_hidden_layers=2, n_routed_experts=4, q_lora_rank=16) + [
    "data.val_max_tokens=256"]


def step_module():
    spec = importlib.util.spec_from_file_location("bench_step", ROOT / "bench" / "step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_config(*extra):
    """The tiny MTP-off model with init std 0.2: large enough logits that attention (RoPE, the document mask)
    moves them by far more than float rounding, so an equality test sees a wrong mask or rotation."""
    from moela.config import load_config

    return load_config(str(ROOT / "recipes" / "tiny.yaml"),
                       TINY + ["model.num_nextn_predict_layers=0", "model.initializer_range=0.2", "train.device=cpu",
                               *extra])
