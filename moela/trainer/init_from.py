"""`checkpoint.init_from`: start a fresh run from existing weights (fine-tuning, continued pretraining).

`hf:PATH` reads a Hugging Face `deepseek_v3` folder (e.g. a `python -m moela export` or a Hub download); any other
value is a checkpoint folder (`.../checkpoints/step-N`, from training or `python -m moela import`). Only the
weights (router bias included) are taken: the optimizer, the schedule, the data position and the step start fresh.
A run that already has a checkpoint of its own resumes from it instead (`checkpoint.resume`), so restarting an
interrupted fine-tuning run never goes back to the initial weights.

Decisions:
- Weights are loaded after parallelization, into the sharded parameters: for an HF folder each rank reads only the
  box of each tensor that its shard covers (safetensors slice reads; `HFWeights`), so no rank ever holds the whole
  model and no collective moves weights. A shard that is not one box (FSDP over tensor-parallel rows) is cut from
  that one parameter read whole. A DCP checkpoint is read in its saved layout by `dcp.load`, resharding as a resume
  would, after checking its files against its manifest when it has one (a training checkpoint; weights-only
  folders from `python -m moela import` have none).
- A folder whose config.json disagrees with the recipe's model section, or whose tensors have other shapes, is
  refused, naming what differs. Every rank checks and reads on its own, then all agree before the first
  collective: a failure on any rank (a path another rank cannot see) raises the same error on every rank instead
  of leaving the others waiting.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from moela.model import ModelConfig
from moela.model.hf import load_hf_config
from moela.model.hf_folder import HFWeights, config_differences
from moela.trainer import safe_load
from moela.trainer.checkpoint import MANIFEST, verify_checkpoint
from moela.trainer.errors import CorruptCheckpoint, TrainingError

HF_PREFIX = "hf:"


def load_initial_weights(model: nn.Module, spec: str, cfg: ModelConfig) -> None:
    """Load the weights named by `spec` into `model` (plain or parallelized) in place; every rank calls this."""
    if spec.startswith(HF_PREFIX):
        _load_hf(model, Path(spec[len(HF_PREFIX):]), cfg)
    else:
        _load_dcp(model, Path(spec))


def _agree(error: str | None) -> None:
    """Raise on every rank if any rank has an error (collective): its message if all share it, else the first
    failing rank's, naming it."""
    errors = [error]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = {rank: e for rank, e in enumerate(errors) if e is not None}
    if not failed:
        return
    rank, first = next(iter(failed.items()))
    if len(failed) == len(errors) and len(set(failed.values())) == 1:
        raise TrainingError(first)
    raise TrainingError(f"on rank {rank}: {first}")


def _local_box(value: DTensor) -> list[tuple[int, int]] | None:
    """This rank's shard of `value` as [start, stop) per dimension, or None when it is not one box."""
    if not all(type(p) in (Shard, Replicate) for p in value.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return [(o, o + n) for o, n in zip(offset, shape)]


def _fill(value: torch.Tensor, weights: HFWeights, name: str) -> None:
    """Copy this rank's part of parameter `name` from `weights` into `value` (a plain tensor or a DTensor)."""
    if not isinstance(value, DTensor):
        value.copy_(weights.read(name))
        return
    local = value.to_local()
    if local.numel() == 0:  # an uneven shard left this rank nothing
        return
    box = _local_box(value)
    if box is not None:
        local.copy_(weights.read(name, box))
    else:
        full = weights.read(name).to(local.dtype)
        local.copy_(distribute_tensor(full, value.device_mesh, value.placements, src_data_rank=None).to_local())


def _load_hf(model: nn.Module, path: Path, cfg: ModelConfig) -> None:
    state = get_model_state_dict(model)
    error = None
    try:
        differences = config_differences(cfg, load_hf_config(path))
        if differences:
            raise TrainingError(f"{path}/config.json does not match the recipe's model section "
                                f"({'; '.join(differences)}); set those model keys to the folder's values")
        weights = HFWeights(path, cfg)
        if set(weights.names) != set(state):
            raise TrainingError(f"{path} holds other tensors than the model: "
                                f"{sorted(set(weights.names) ^ set(state))[:5]}")
        wrong = [f"{n}: {list(weights.shape(n))} vs {list(state[n].shape)}" for n in state
                 if tuple(weights.shape(n)) != tuple(state[n].shape)]
        if wrong:
            raise TrainingError(f"{path} has tensors of other shapes than the recipe's model (stored vs model: "
                                f"{'; '.join(wrong[:3])}); is config.json the one saved with these weights?")
        with torch.no_grad():
            for name, value in state.items():
                _fill(value, weights, name)
    except TrainingError as e:
        error = f"checkpoint.init_from: {e}"
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        error = f"checkpoint.init_from: cannot read {path}: {str(e).strip(chr(34))}"
    _agree(error)
    _check_finite(state, path)
    set_model_state_dict(model, state)


def _check_finite(state: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse weights holding NaN or inf (collective): training from them fails at once, and the learning rate
    would be blamed."""
    bad = []
    for name, value in state.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            bad.append(name)
    error = None
    if bad:
        error = (f"checkpoint.init_from: {path} holds NaN or inf in {len(bad)} tensor(s) ({', '.join(bad[:3])}"
                 f"{', ...' if len(bad) > 3 else ''}): the weights are damaged; export or download them again")
    _agree(error)


def _load_dcp(model: nn.Module, path: Path) -> None:
    error = None
    if not (path / ".metadata").is_file():
        error = (f"checkpoint.init_from: {path} is not a checkpoint folder (no .metadata); give a step-N folder, "
                 f"or hf:PATH for a Hugging Face folder")
    _agree(error)
    problem = verify_checkpoint(path) if (path / MANIFEST).is_file() else None
    if problem is not None:
        raise TrainingError(f"checkpoint.init_from: {path} is corrupt: {problem}; start from another checkpoint")
    state = get_model_state_dict(model)
    try:
        with warnings.catch_warnings():  # DCP's "assuming a single process" warning: that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            safe_load.load({"model": state}, path)
    except CorruptCheckpoint as e:
        raise TrainingError(f"checkpoint.init_from: {e}") from None
    except (CheckpointException, RuntimeError) as e:
        cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
        raise TrainingError(f"checkpoint.init_from: {path} does not fit the recipe's model section: "
                            f"{str(cause).strip()[:300]}") from None
    _check_finite(state, path)
    set_model_state_dict(model, state)
