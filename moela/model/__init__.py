"""The DeepSeek-V3-style network (MLA + MoE, FAL / FAL+ blocks, QK-Norm, MTP) on flat packed batches.

Public API: `build_model(cfg, device) -> Transformer`, `Transformer.forward(batch) -> ModelOutput`,
`count_params(cfg)`, `flops_per_token(cfg, seq_len)`, `ModelConfig`, `PRESETS`; HF interop in `moela.model.hf`.
"""

from moela.model.config import PRESETS, ModelConfig, RopeScaling, preset
from moela.model.output import ModelOutput
from moela.model.params import count_params, flops_per_token
from moela.model.transformer import Transformer, build_model

__all__ = ["PRESETS", "ModelConfig", "ModelOutput", "RopeScaling", "Transformer", "build_model", "count_params",
           "flops_per_token", "preset"]
