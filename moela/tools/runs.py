"""What the after-training commands share: finding a run's checkpoint, reading its recipe and tokenizer, picking a
device, and loading the weights of a checkpoint of any parallel layout onto that one device.

A run directory (`train.run_dir`) holds `config.yaml` and `checkpoints/step-N/`; a checkpoint is a DCP folder whose
`model.*` entries are the global (unsharded) tensors whatever layout saved them, so one process reads them with
`dcp.load` into a plain model. Commands accept the run directory (newest checkpoint, or `--step N`) or a
`step-N` folder itself. Weights-only checkpoints (written by `python -m moela import`) have no trainer files and
are found the same way. A training checkpoint's files are checked against its manifest (sizes and sha256, as a
resume checks them) before they are read: a damaged one named by the user is an error naming the damaged file; the
newest checkpoint, chosen by default, falls back to the newest intact one and says so on stderr.

Every mistake a user can make here raises `UsageError` with the fix; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import re
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from moela.config import Config, ConfigError, load_config
from moela.data.tokenizer import Tokenizer, load_tokenizer
from moela.model import ModelConfig, Transformer, build_model
from moela.trainer import safe_load
from moela.trainer.checkpoint import MANIFEST, read_latest, verify_checkpoint
from moela.trainer.errors import CorruptCheckpoint

CONFIG_FILE = "config.yaml"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class UsageError(Exception):
    """A mistake in what the user asked for (missing run, no checkpoint, bad option); reported without a traceback
    and exit code 2."""


@dataclass
class RunCheckpoint:
    run_dir: Path
    path: Path
    step: int | None  # None: a checkpoint folder not named step-N


def _is_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def list_model_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint folder holding model weights, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and _is_checkpoint(p)]
    return sorted(found)


def _locate_checkpoint(target: str | Path, step: int | None) -> tuple[RunCheckpoint, list[tuple[int, Path]]]:
    """The checkpoint `target` names (a run directory: its newest checkpoint, or step `step`; or a checkpoint
    folder), and the run's other checkpoints to fall back on when it was chosen by default (oldest first)."""
    path = Path(target)
    if not path.exists():
        raise UsageError(f"{target}: no such directory; pass a run directory (the recipe's train.run_dir, e.g. "
                         f"runs/tiny) or one of its checkpoints/step-N folders")
    if _is_checkpoint(path):
        if step is not None:
            raise UsageError(f"--step {step}: {target} is already a checkpoint folder; pass its run directory to "
                             f"choose a step, or drop --step")
        run_dir = path.parent.parent if path.parent.name == CHECKPOINTS else path.parent
        match = _STEP_DIR.match(path.name)
        return RunCheckpoint(run_dir, path, int(match.group(1)) if match else None), []
    found = list_model_checkpoints(path)
    if not found:
        if not (path / CONFIG_FILE).is_file():
            raise UsageError(f"{target}: not a run directory (no {CONFIG_FILE}, no {CHECKPOINTS}/); pass the "
                             f"recipe's train.run_dir, e.g. runs/tiny")
        raise UsageError(f"{target}: no checkpoint in {path / CHECKPOINTS}; let training save one (at the end, "
                         f"every checkpoint.every steps, or on Ctrl-C) and retry")
    steps = [s for s, _ in found]
    if step is not None:
        if step not in steps:
            raise UsageError(f"--step {step}: {path / CHECKPOINTS} has no step-{step}; available steps: "
                             f"{', '.join(map(str, steps))}")
        return RunCheckpoint(path, dict(found)[step], step), []
    named = read_latest(path / CHECKPOINTS)
    if named:
        match = _STEP_DIR.match(named)
        if int(match.group(1)) in steps:
            latest = int(match.group(1))
            return RunCheckpoint(path, dict(found)[latest], latest), [f for f in found if f[0] != latest]
    return RunCheckpoint(path, found[-1][1], found[-1][0]), found[:-1]


def _damage(path: Path) -> str | None:
    """What is wrong with a training checkpoint's files, or None (also for weights-only folders, which have no
    manifest)."""
    return verify_checkpoint(path) if (path / MANIFEST).is_file() else None


def find_checkpoint(target: str | Path, step: int | None = None) -> RunCheckpoint:
    """The checkpoint to use: `target` is a run directory (its newest intact checkpoint, or step `step`) or a
    checkpoint folder; its files are verified against its manifest first."""
    chosen, others = _locate_checkpoint(target, step)
    problem = _damage(chosen.path)
    if problem is None:
        return chosen
    if not others:
        raise UsageError(f"{chosen.path} is damaged: {problem}; use another checkpoint (--step N) or retrain")
    for older_step, older in reversed(others):
        if _damage(older) is None:
            print(f"warning: {chosen.path} is damaged ({problem}); using the newest intact checkpoint, {older}",
                  file=sys.stderr)
            return RunCheckpoint(chosen.run_dir, older, older_step)
    raise UsageError(f"{chosen.path} is damaged ({problem}) and no other checkpoint of {chosen.run_dir} is "
                     f"intact; retrain, or resume training to write a new one")


def load_run_config(run_dir: str | Path) -> Config:
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise UsageError(f"{path}: not found; the run directory of a training run holds the resolved recipe "
                         f"(config.yaml) next to checkpoints/")
    try:
        return load_config(path)
    except ConfigError as e:
        raise UsageError(f"{path} is not a valid recipe for this moela: " + "; ".join(e.errors)) from None


def load_run_tokenizer(cfg: Config) -> Tokenizer:
    data = cfg.data
    try:
        return load_tokenizer(data.tokenizer, data.eos_token, data.bos_token)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot load the run's tokenizer (data.tokenizer={data.tokenizer!r}): {e}") from None


def resolve_device(name: str) -> torch.device:
    """`auto` (CUDA when visible), `cpu`, `cuda` or `cuda:N`."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    if not match:
        raise UsageError(f"--device {name!r}: unknown device; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {name}: no CUDA device is visible; use --device cpu")
    index = int(match.group(1) or 0)
    if index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return torch.device("cuda", index)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA (what training computes in), float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UsageError(f"--dtype {name!r}: unknown; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


@contextmanager
def single_process_dcp():
    """DCP warns on every call without a process group that it assumes a single process: the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read_model_weights(checkpoint: Path, state: dict[str, torch.Tensor]) -> None:
    """Fill `state` (our parameter names -> tensors of the right shapes, any dtype) in place from a checkpoint's
    `model.*` entries; a single process reads any saved layout."""
    with single_process_dcp():
        safe_load.load({"model": state}, checkpoint)


def load_model(cfg: ModelConfig, checkpoint: Path, device: torch.device, dtype: torch.dtype) -> Transformer:
    """A plain model on `device` in `dtype` (router bias and RoPE frequencies stay float32) with the checkpoint's
    weights, in eval mode."""
    model = build_model(cfg, device, dtype)
    try:
        read_model_weights(checkpoint, model.state_dict())
    except CorruptCheckpoint as e:
        raise UsageError(str(e)) from None
    except (CheckpointException, RuntimeError, KeyError) as e:
        cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
        raise UsageError(f"{checkpoint}: its weights do not fit the model section of the run's {CONFIG_FILE} "
                         f"({str(cause).strip()[:300]}); was config.yaml edited after training?") from None
    return model.eval()
