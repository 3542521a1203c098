"""Checkpoints: model + optimizer through `torch.distributed.checkpoint` (DCP), trainer state per rank, atomically.

Layout: `run_dir/checkpoints/step-N/` holds DCP's shard files and `.metadata` (model and optimizer state, saved
by every rank in SPMD style, so a checkpoint written under one parallel layout loads under another) plus
`trainer-rank{r}.pt` (step, scheduler, data loader, RNG states and counters of rank r). `checkpoints/latest` is a
one-line file naming the most recently saved checkpoint.

Decisions:
- Atomic: everything is written into `step-N.tmp/`; only after every rank has finished does rank 0 rename it to
  `step-N/` (one `os.replace`, atomic on POSIX) and then rewrite `latest` through a temporary file. A kill at any
  moment leaves either the previous complete checkpoint or the new one, never a half-written `step-N/` (an
  existing `step-N/` being saved again is renamed aside before it is deleted); leftover `*.tmp` directories are
  ignored and cleaned up by the next save.
- `resume: auto` takes the checkpoint `latest` names when that one is complete (it is the newest save even when
  a run resumed from an explicit older `step-N` left higher-numbered checkpoints of the abandoned continuation
  behind), else the highest complete `step-N/` (those with DCP's `.metadata`), so a stale or missing pointer
  cannot lead to a corrupt load.
- Pruning to `keep_last_k` never deletes the checkpoint just written, and deletes the checkpoints of an abandoned
  continuation (steps above the one just written: left behind by a resume from an explicit older `step-N`)
  before the oldest of the run's own history.
- Model and optimizer state go through `get_state_dict` / `set_state_dict`, which key the optimizer state by
  parameter name and handle FSDP2's DTensors, so resharded resume works.
- A rank with no trainer file of its own (resuming on more ranks than saved) takes rank 0's; its RNG streams then
  equal rank 0's, which only matters for layouts that draw different random numbers per rank.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from moela.trainer.errors import TrainingError

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def is_complete(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file() and any(path.glob("trainer-rank*.pt"))


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in `run_dir`, oldest first, as (step, path)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def resolve_resume(run_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint to resume from: None for a fresh start. Raises TrainingError for a bad explicit path."""
    if resume == "none":
        return None
    if resume == "auto":
        pointer = checkpoints_root(run_dir) / LATEST
        if pointer.is_file():
            named = pointer.parent / pointer.read_text().strip()
            if _STEP_DIR.match(named.name) and is_complete(named):
                return named
        found = list_checkpoints(run_dir)
        return found[-1][1] if found else None
    path = Path(resume)
    if not is_complete(path):
        raise TrainingError(f"checkpoint.resume: {resume} is not a complete checkpoint directory (expected "
                            f"a step-N folder with .metadata and trainer-rank*.pt files); use 'auto', 'none' or "
                            f"an existing step-N path")
    return path


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextmanager
def _single_process_quiet():
    """DCP warns on every single-process save/load that it assumes a single process, which is what we want."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], keep_last_k: int) -> Path:
    """Write checkpoint `step` collectively (every rank calls this) and prune to the newest `keep_last_k`."""
    root = checkpoints_root(run_dir)
    final = root / f"step-{step}"
    tmp = root / f"step-{step}.tmp"
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp),
                 no_dist=not dist.is_initialized())
    torch.save(trainer_state, tmp / f"trainer-rank{rank}.pt")
    _barrier()
    if rank == 0:
        replaced = root / f"step-{step}.replaced.tmp"
        if final.exists():  # saving a step again (after resuming from an older one): move the old one aside first
            os.replace(final, replaced)
        os.replace(tmp, final)
        _write_atomic(root / LATEST, final.name + "\n")
        shutil.rmtree(replaced, ignore_errors=True)
        found = [(s, path) for s, path in list_checkpoints(run_dir) if path != final]
        others = [path for s, path in found if s > step] + [path for s, path in found if s < step]  # prune order
        for old in others[:max(len(others) - (keep_last_k - 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load model and optimizer in place (collectively) and return this rank's trainer state."""
    path = Path(path)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    own = path / f"trainer-rank{_rank()}.pt"
    return torch.load(own if own.exists() else path / "trainer-rank0.pt", weights_only=False)
