"""`checkpoint.init_from`: start a fresh run from existing weights (fine-tuning, continued pretraining).

`hf:PATH` reads a Hugging Face `deepseek_v3` folder (e.g. a `python -m moela export` or a Hub download); any other
value is a checkpoint folder (`.../checkpoints/step-N`, from training or `python -m moela import`). Only the
weights (router bias included) are taken: the optimizer, the schedule, the data position and the step start fresh.
A run that already has a checkpoint of its own resumes from it instead (`checkpoint.resume`), so restarting an
interrupted fine-tuning run never goes back to the initial weights.

Decisions: every rank reads the full tensors and keeps its shard (`set_model_state_dict` with full state dicts), so
any layout (FSDP2, expert parallelism) starts from the same weights; a DCP checkpoint is read in its saved layout
by `dcp.load` as a resume would, after checking its files against its manifest when it has one (a training
checkpoint; weights-only folders from `python -m moela import` have none). A folder whose config.json disagrees
with the recipe's model section is refused, naming the keys that differ.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from moela.model import ModelConfig
from moela.model.hf import load_hf_config
from moela.model.hf_folder import config_differences, read_hf_weights
from moela.trainer.checkpoint import MANIFEST, verify_checkpoint
from moela.trainer.errors import TrainingError

HF_PREFIX = "hf:"


def load_initial_weights(model: nn.Module, spec: str, cfg: ModelConfig) -> None:
    """Load the weights named by `spec` into `model` (plain or parallelized) in place; every rank calls this."""
    if spec.startswith(HF_PREFIX):
        _load_hf(model, Path(spec[len(HF_PREFIX):]), cfg)
    else:
        _load_dcp(model, Path(spec))


def _load_hf(model: nn.Module, path: Path, cfg: ModelConfig) -> None:
    try:
        differences = config_differences(cfg, load_hf_config(path))
        if differences:
            raise TrainingError(f"checkpoint.init_from: {path}/config.json does not match the recipe's model "
                                f"section ({'; '.join(differences)}); set those model keys to the folder's values")
        full = read_hf_weights(path, cfg)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise TrainingError(f"checkpoint.init_from: cannot read {path}: {str(e).strip(chr(34))}") from None
    local = get_model_state_dict(model)
    full = {k: v.to(local[k].dtype) for k, v in full.items() if k in local}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=True))


def _load_dcp(model: nn.Module, path: Path) -> None:
    if not (path / ".metadata").is_file():
        raise TrainingError(f"checkpoint.init_from: {path} is not a checkpoint folder (no .metadata); give a "
                            f"step-N folder, or hf:PATH for a Hugging Face folder")
    problem = verify_checkpoint(path) if (path / MANIFEST).is_file() else None
    if problem is not None:
        raise TrainingError(f"checkpoint.init_from: {path} is corrupt: {problem}; start from another checkpoint")
    state = get_model_state_dict(model)
    try:
        with warnings.catch_warnings():  # DCP's "assuming a single process" warning: that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": state}, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except (CheckpointException, RuntimeError) as e:
        cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
        raise TrainingError(f"checkpoint.init_from: {path} does not fit the recipe's model section: "
                            f"{str(cause).strip()[:300]}") from None
    set_model_state_dict(model, state)
