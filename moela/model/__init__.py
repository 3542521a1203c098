"""The DeepSeek-V3-style network (MLA + MoE, FAL / FAL+ blocks, QK-Norm, MTP) on flat packed batches.

Public API: `build_model(cfg, device) -> Transformer`, `Transformer.forward(batch) -> ModelOutput`,
`count_params(cfg)`, `flops_per_token(cfg, seq_len)`, `ModelConfig`, `PRESETS`; HF interop in `moela.model.hf`.
The network itself (`Transformer`, `build_model`) is imported on first use, so that reading the `model` section of
a recipe (`moela.model.config`) imports no kernels.
"""

from importlib import import_module

from moela.model.config import PRESETS, ModelConfig, RopeScaling, preset
from moela.model.output import ModelOutput
from moela.model.params import count_params, flops_per_token

_LAZY = {"Transformer": "moela.model.transformer", "build_model": "moela.model.transformer"}

__all__ = ["PRESETS", "ModelConfig", "ModelOutput", "RopeScaling", "Transformer", "build_model", "count_params",
           "flops_per_token", "preset"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
