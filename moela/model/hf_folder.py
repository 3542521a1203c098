"""The weights of a Hugging Face `deepseek_v3` folder as moela tensors, read one safetensors tensor at a time.

`hf.from_hf_state_dict` needs a mapping of HF names to tensors; `SafetensorsFolder` is that mapping over the
folder's weight files (`hf.weight_files`: those its `model.safetensors.index.json` names, else every
`*.safetensors`), loading a tensor only when it is looked up, so converting a folder holds the converted model once
(plus one layer's per-expert tensors while they are stacked) rather than the HF copy as well.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from moela.model.config import ModelConfig
from moela.model.hf import HF_KEYS, from_hf_state_dict, weight_files


class SafetensorsFolder(Mapping):
    """HF name -> tensor over a folder's safetensors files; tensors are read on access."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files = weight_files(self.path)
        if not self.files:
            raise FileNotFoundError(f"{self.path}: no *.safetensors weight files; export or download the model's "
                                    f"weights into this folder")
        self._where: dict[str, Path] = {}
        for file in self.files:
            with safe_open(str(file), framework="pt") as f:
                self._where.update({name: file for name in f.keys()})

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self._where[name]), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def read_hf_weights(path: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict (parameter names -> tensors in the stored dtype) from an HF folder whose config is `cfg`.
    Raises ValueError for a quantized checkpoint, KeyError naming a missing or unknown tensor."""
    path = Path(path)
    config = path / "config.json"
    if config.is_file() and "quantization_config" in json.loads(config.read_text()):
        raise ValueError(f"{path}: the checkpoint is quantized (config.json has quantization_config); dequantize it "
                         f"to bf16/fp32 first")
    return from_hf_state_dict(SafetensorsFolder(path), cfg)


def config_differences(ours: ModelConfig, theirs: ModelConfig) -> list[str]:
    """`key: ours vs theirs` for every config.json-expressible model key (shapes, routing, RoPE) that differs."""
    keys = HF_KEYS + ("rope_scaling",)
    return [f"{k}: {getattr(ours, k)!r} vs {getattr(theirs, k)!r}" for k in keys
            if getattr(ours, k) != getattr(theirs, k)]
