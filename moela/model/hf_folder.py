"""The weights of a Hugging Face `deepseek_v3` folder as moela tensors, read one tensor (or slice) at a time.

`SafetensorsFolder` maps HF names to tensors over the folder's weight files (`hf.weight_files`: those its
`model.safetensors.index.json` names, else every `*.safetensors`), reading a tensor only when it is looked up.
`HFWeights` names the folder's tensors by our parameter names and reads any box of one (`read(name, box)`): a
stacked expert weight `[E, 2F, D]` is assembled from just the per-expert HF tensors and rows the box covers. A
sharded model's rank thus reads only its own shard of each parameter (`checkpoint.init_from`), and converting a
whole folder (`read_hf_weights`) holds the converted model once (plus one layer's experts while they are stacked)
rather than the HF copy as well.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moela.model.config import ModelConfig
from moela.model.hf import HF_KEYS, hf_tensor_plan, weight_files

Box = Sequence[tuple[int, int]]  # [start, stop) per dimension


def _open(file: Path):
    """`safe_open(file)`; a file that is not a complete safetensors file raises ValueError naming it."""
    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{file}: not a complete safetensors file ({e}); download or export it again") from None


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
            with _open(file) as f:
                self._where.update({name: file for name in f.keys()})

    def __getitem__(self, name: str) -> torch.Tensor:
        with _open(self._where[name]) as f:
            return f.get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        with _open(self._where[name]) as f:
            return tuple(f.get_slice(name).get_shape())

    def read(self, name: str, box: Box) -> torch.Tensor:
        """The part `box` of tensor `name`, reading only those bytes."""
        with _open(self._where[name]) as f:
            return f.get_slice(name)[tuple(slice(a, b) for a, b in box)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


class HFWeights:
    """An HF folder whose config is `cfg`, by our parameter names: `names`, `shape(name)`, `read(name, box)`.
    Raises ValueError for a quantized checkpoint, KeyError naming a missing or unknown tensor."""

    def __init__(self, path: str | Path, cfg: ModelConfig):
        path = Path(path)
        config = path / "config.json"
        if config.is_file() and "quantization_config" in json.loads(config.read_text()):
            raise ValueError(f"{path}: the checkpoint is quantized (config.json has quantization_config); "
                             f"dequantize it to bf16/fp32 first")
        self.folder = SafetensorsFolder(path)
        self.direct, self.stacked = hf_tensor_plan(cfg, self.folder.keys())
        self.names = [*self.direct, *self.stacked]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.direct:
            return self.folder.shape(self.direct[name])
        per_expert = self.stacked[name]
        shapes = [self.folder.shape(k) for k in per_expert[0]]
        return (len(per_expert), sum(s[0] for s in shapes), *shapes[0][1:])

    def read(self, name: str, box: Box | None = None) -> torch.Tensor:
        """The part `box` of our tensor `name` (all of it for None), in the stored dtype."""
        box = box if box is not None else [(0, n) for n in self.shape(name)]
        if name in self.direct:
            return self.folder.read(self.direct[name], box)
        (e0, e1), (r0, r1), rest = box[0], box[1], list(box[2:])
        experts = []
        for keys in self.stacked[name][e0:e1]:  # rows [r0, r1) of cat(parts): each part's overlap with them
            parts, offset = [], 0
            for key in keys:
                rows = self.folder.shape(key)[0]
                lo, hi = max(r0 - offset, 0), min(r1 - offset, rows)
                if lo < hi:
                    parts.append(self.folder.read(key, [(lo, hi), *rest]))
                offset += rows
            experts.append(torch.cat(parts))
        return torch.stack(experts)


def read_hf_weights(path: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict (parameter names -> tensors in the stored dtype) from an HF folder whose config is `cfg`.
    Raises ValueError for a quantized checkpoint, KeyError naming a missing or unknown tensor."""
    weights = HFWeights(path, cfg)
    return {name: weights.read(name) for name in weights.names}


def config_differences(ours: ModelConfig, theirs: ModelConfig) -> list[str]:
    """`key: ours vs theirs` for every config.json-expressible model key (shapes, routing, RoPE) that differs."""
    keys = HF_KEYS + ("rope_scaling",)
    return [f"{k}: {getattr(ours, k)!r} vs {getattr(theirs, k)!r}" for k in keys
            if getattr(ours, k) != getattr(theirs, k)]
