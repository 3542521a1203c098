"""Process setup for one training process: device choice, torch.distributed init from launcher env vars, seeding.

Launchers (`torchrun`, `accelerate launch`, SLURM wrappers that export the same names) set RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT; a plain `python train.py` sets none of them and runs as one process
without a process group. With WORLD_SIZE > 1 the process group uses NCCL on CUDA and gloo on CPU.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moela.trainer.errors import TrainingError


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_process_group: bool  # this process initialized the group and destroys it at the end

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise TrainingError(f"environment variable {name}={raw!r} is not an integer; unset it or launch with "
                            f"torchrun, which sets it") from None


def pick_device(kind: str, local_rank: int) -> torch.device:
    """`train.device` (auto / cpu / cuda) -> the torch device of this process."""
    if kind == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device: cuda requested but no CUDA device is visible; use train.device=cpu "
                           "or auto")
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_distributed(device_kind: str) -> DistEnv:
    """Read the launcher's env vars, pick the device and (for WORLD_SIZE > 1) initialize the process group."""
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    device = pick_device(device_kind, local_rank)
    owns = False
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        try:
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **kwargs)
        except ValueError as e:  # env:// rendezvous without MASTER_ADDR / MASTER_PORT
            raise TrainingError(f"cannot start the process group (WORLD_SIZE={world_size}): {e}; launch with "
                                f"torchrun, which sets every variable, or unset WORLD_SIZE") from None
        owns = True
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return DistEnv(rank, world_size, local_rank, device, owns)


def shutdown(env: DistEnv) -> None:
    if env.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict:
    """Every generator's state as tensors and plain values (NumPy's key as a tensor), so a checkpoint holding it
    loads with `torch.load(weights_only=True)`."""
    numpy = np.random.get_state(legacy=False)
    numpy["state"] = {**numpy["state"], "key": torch.from_numpy(numpy["state"]["key"].astype(np.int64))}
    state = {"python": random.getstate(), "numpy": numpy, "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    numpy = state["numpy"]
    if isinstance(numpy, dict):  # else the legacy tuple of files written before
        numpy = {**numpy, "state": {**numpy["state"], "key": np.asarray(numpy["state"]["key"], dtype=np.uint32)}}
    np.random.set_state(numpy)
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
