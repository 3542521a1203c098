"""Checkpoints: model + optimizer through `torch.distributed.checkpoint` (DCP), trainer state per rank, atomically,
with a manifest that makes damage visible.

Layout: `run_dir/checkpoints/step-N/` holds DCP's shard files and `.metadata` (model and optimizer state, saved
by every rank in SPMD style, so a checkpoint written under one parallel layout loads under another),
`trainer-rank{r}.pt` (step, scheduler, data loader, RNG states and counters of rank r) and `manifest.json` (the
size and sha256 of every other file, and the settings the run may not change on resume). `checkpoints/latest` is a
one-line file naming the most recently saved checkpoint.

Decisions:
- Atomic: everything is written into `step-N.tmp/`; only after every rank has finished and rank 0 has written the
  manifest (last, flushed to disk) does rank 0 rename it to `step-N/` (one `os.replace`, atomic on POSIX) and then
  rewrite `latest` through a temporary file. A kill at any moment leaves either the previous complete checkpoint
  or the new one, never a half-written `step-N/` (an existing `step-N/` being saved again is renamed aside before
  it is deleted); leftover `*.tmp` directories are ignored and cleaned up by the next save.
- Verified before use: the files are hashed when saved (each rank hashes a share of them, in the order of their
  names) and again before a resume loads them, so a truncated, overwritten or missing file is reported by name
  instead of loading garbage or being mistaken for a recipe change. After loading, a tensor holding NaN or inf
  also marks the checkpoint corrupt: no training state this trainer saves can hold one (non-finite steps are
  skipped). Hashing reads every file once more; at the ~1 GB/s of sha256 that is seconds per rank for models that
  take minutes to save.
- `resume: auto` tries the checkpoint `latest` names (the newest save, even when a run resumed from an explicit
  older `step-N` left higher-numbered checkpoints of the abandoned continuation behind), then the older ones from
  the newest down, then those of an abandoned continuation, and takes the first intact one, saying which it
  skipped and why; if none is intact it stops. An explicit `step-N` path is verified the same way but never
  replaced by another.
- The settings a checkpoint fixes (`fixed_settings`: the model section but its kernel and precision choices, loss
  weights and init scale; the data section but where its cache lives and how micro-batches are assigned to ranks;
  the seed and the micro-batch budget) are compared with the recipe's before anything is loaded; a change is an
  `InputError` listing each key, old -> new. Keys only one side knows (added or removed by another moela version)
  are not compared.
- Pruning to `keep_last_k` never deletes the checkpoint just written, and deletes the checkpoints of an abandoned
  continuation (steps above the one just written: left behind by a resume from an explicit older `step-N`)
  before the oldest of the run's own history.
- Model and optimizer state go through `get_state_dict` / `set_state_dict`, which key the optimizer state by
  parameter name and handle FSDP2's DTensors, so resharded resume works. A run resumes with the other AdamW
  (`optim.moment_dtype` changed: torch's AdamW and moela's carry different param-group options): the options the
  checkpoint lacks keep this optimizer's values, and the moments load into its dtype.
- Extra training state made of tensors (the replicate reducer's error feedback and Q matrices,
  `moela.parallel.replicate`) is saved through DCP beside the model under `extra.`; it loads only when the
  checkpoint holds every one of its tensors with the same shapes (saved by the same layout), and is otherwise left
  as built: a run that turns compression on, or changes its layout, starts that state afresh.
- A rank with no trainer file of its own (resuming on more ranks than saved) takes rank 0's; its RNG streams then
  equal rank 0's, which only matters for layouts that draw different random numbers per rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from moela.config import Config, to_dict
from moela.trainer.errors import InputError, TrainingError

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_HASH_CHUNK = 1 << 24

# Free to change on resume: how the same network is computed (kernels, FP8 or bf16), the weights of the objective's
# terms and the balancing rate (DeepSeek-V3 lowers the MTP weight and stops the bias updates late in training), the
# init scale (used only at init), and where the same data is cached and how its micro-batches go to ranks.
_FREE_MODEL_KEYS = ("attention_backend", "moe_backend", "moe_recipe", "precision", "kernels", "bias_update_rate",
                    "aux_loss_coef", "mtp_loss_weight", "z_loss_coef", "initializer_range")
_FREE_DATA_KEYS = ("cache_dir", "balance", "attn_cost_len")


class CorruptCheckpoint(TrainingError):
    """A checkpoint's files do not match its manifest, or its tensors hold non-finite values."""


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def is_complete(path: Path) -> bool:
    """Whether `path` is a finished checkpoint directory (its manifest is written last); says nothing about
    damage, which `verify_checkpoint` checks."""
    return path.is_dir() and (path / MANIFEST).is_file()


def _written_by_training(path: Path) -> bool:
    """A training checkpoint (damaged or not) rather than a weights-only folder (`python -m moela import`)."""
    return (path / MANIFEST).is_file() or any(path.glob("trainer-rank*.pt"))


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Every `step-N/` training checkpoint in `run_dir` (complete or damaged), oldest first, as (step, path);
    weights-only folders are not among them."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and _written_by_training(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def resume_candidates(run_dir: str | Path, resume: str) -> list[Path]:
    """The checkpoints `checkpoint.resume` may continue from, preferred first: none for a fresh start. Raises
    InputError for an explicit path that is not a checkpoint directory."""
    if resume == "none":
        return []
    if resume == "auto":
        found = list_checkpoints(run_dir)
        pointer = checkpoints_root(run_dir) / LATEST
        named = pointer.parent / pointer.read_text().strip() if pointer.is_file() else None
        latest = next((step for step, path in found if path == named), None)
        if latest is None:
            return [path for _, path in reversed(found)]
        own = [path for step, path in reversed(found) if step <= latest]  # the latest, then its history
        return own + [path for step, path in reversed(found) if step > latest]
    path = Path(resume)
    if not is_complete(path):
        raise InputError(f"checkpoint.resume: {resume} is not a complete checkpoint directory (expected a step-N "
                         f"folder with {MANIFEST}); use 'auto', 'none' or an existing step-N path")
    return [path]


def fixed_settings(cfg: Config) -> dict[str, Any]:
    """The settings a checkpoint fixes, as {dotted key: value} (see the module docstring)."""
    model = {k: v for k, v in to_dict(cfg.model).items() if k not in _FREE_MODEL_KEYS}
    data = {k: v for k, v in to_dict(cfg.data).items() if k not in _FREE_DATA_KEYS}
    flat = {**_flatten(model, "model."), **_flatten(data, "data."), "train.seed": cfg.train.seed,
            "train.tokens_per_microbatch": cfg.train.tokens_per_microbatch}
    return json.loads(json.dumps(flat))  # the values as the manifest stores them (tuples -> lists)


def _flatten(tree: dict, prefix: str) -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


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


def _digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], keep_last_k: int, settings: dict[str, Any] | None = None,
                    extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Write checkpoint `step` collectively (every rank calls this) and prune to the newest `keep_last_k`.
    `settings` (e.g. `fixed_settings(cfg)`) is stored in the manifest and checked on resume; `extra` tensors are
    saved with the model (module docstring)."""
    root = checkpoints_root(run_dir)
    final = root / f"step-{step}"
    tmp = root / f"step-{step}.tmp"
    rank, world = _rank(), _world()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.save({"model": model_state, "optim": optim_state, **({"extra": extra} if extra else {})},
                 checkpoint_id=str(tmp),
                 no_dist=not dist.is_initialized())
    torch.save(trainer_state, tmp / f"trainer-rank{rank}.pt")
    _barrier()
    # The shard names come from the `.metadata` just written, read back: the Metadata that dcp.save returns has no
    # storage_data on some torch versions (2.11), and reading it back also proves the file is complete.
    storage = dcp.FileSystemReader(str(tmp)).read_metadata().storage_data
    shards = {info.relative_path for info in storage.values()}
    names = sorted({".metadata", *shards, *(f"trainer-rank{r}.pt" for r in range(world))})
    digests = _all_gather({name: _digest(tmp / name) for i, name in enumerate(names) if i % world == rank})
    if rank == 0:
        manifest = {"format": MANIFEST_FORMAT, "step": step, "world_size": world,
                    "files": {name: entry for part in digests for name, entry in sorted(part.items())},
                    "settings": settings or {}}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
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


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint `path`; raises CorruptCheckpoint when it is missing or unreadable."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{MANIFEST} is missing (the checkpoint is incomplete, or was written by an "
                                f"older moela)") from None
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"{MANIFEST} is unreadable ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpoint(f"{MANIFEST} does not list the checkpoint's files")
    return manifest


def _check_file(path: Path, name: str, entry: dict) -> str | None:
    file = path / name
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        return f"{name} is missing"
    if size != entry.get("bytes"):
        return f"{name} has {size} bytes, {entry.get('bytes')} were written (truncated or overwritten)"
    if _digest(file)["sha256"] != entry.get("sha256"):
        return f"{name}: its sha256 differs from the one recorded when it was written (its bytes were changed)"
    return None


def verify_checkpoint(path: Path) -> str | None:
    """What is wrong with checkpoint `path`'s files (each named), or None when they are as written. Collective:
    every rank hashes a share of the files."""
    rank, world = _rank(), _world()
    problems = []
    try:
        files = sorted(read_manifest(path)["files"].items())
    except CorruptCheckpoint as e:
        problems.append(str(e))
        files = []
    for i, (name, entry) in enumerate(files):
        if i % world == rank and (problem := _check_file(path, name, entry if isinstance(entry, dict) else {})):
            problems.append(problem)
    found = sorted({p for part in _all_gather(problems) for p in part})
    return "; ".join(found) if found else None


def settings_changes(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key: old -> new` for each setting both sides know whose value differs."""
    return [f"{key}: {stored[key]!r} -> {current[key]!r}" for key in sorted(stored.keys() & current.keys())
            if stored[key] != current[key]]


def _nonfinite(value: Any) -> bool:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return False
    local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor: this rank's shard
    return not bool(torch.isfinite(local).all())


def _keep_saved_group_options(optim_state: dict, path: Path, optimizer: torch.optim.Optimizer) -> list[dict]:
    """Drop from the state dict DCP fills the param-group options the checkpoint does not hold, and return the
    optimizer's own options of each group (restored after loading where the checkpoint had none). A run saved by
    torch's AdamW (fp32 moments) resumes with moela's (bf16 moments, or sharded parameters on CUDA) and back: their
    groups carry different options (`moment_dtype`; `amsgrad`, `fused`, ...), and DCP refuses a key it was asked
    to fill but cannot find. The moments load into this optimizer's dtype (bf16 -> fp32 is exact)."""
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    own = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    for i, group in enumerate(optim_state.get("param_groups", [])):
        for key in [k for k in group if k != "params" and f"optim.param_groups.{i}.{k}" not in saved]:
            del group[key]
    return own


def _extra_matches(path: Path, extra: dict[str, torch.Tensor]) -> bool:
    """Whether checkpoint `path` holds every `extra` tensor with its shape, on every rank (collective)."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    ok = all(getattr(saved.get(f"extra.{k}"), "size", None) == v.shape for k, v in extra.items())
    return all(_all_gather(ok))


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Load model and optimizer in place (collectively), and the `extra` tensors in place where the checkpoint holds
    them (module docstring); return this rank's trainer state. Raises CorruptCheckpoint naming the tensors that
    hold NaN or inf (the model is then partly overwritten)."""
    path = Path(path)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    if extra and _extra_matches(path, extra):
        state["extra"] = extra
    own_options = _keep_saved_group_options(optim_state, path, optimizer)
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    bad = [f"model.{k}" for k, v in state["model"].items() if _nonfinite(v)]
    bad += [f"optim.{k}.{s}" for k, group in state["optim"].get("state", {}).items() for s, v in group.items()
            if _nonfinite(v)]
    bad = sorted({name for part in _all_gather(bad) for name in part})
    if bad:
        raise CorruptCheckpoint(f"{len(bad)} {'tensors hold' if len(bad) > 1 else 'tensor holds'} NaN or inf "
                                f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}), which no checkpoint of a "
                                f"training run holds")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for group, options in zip(optimizer.param_groups, own_options):
        for key, value in options.items():
            group.setdefault(key, value)
    own = path / f"trainer-rank{_rank()}.pt"
    return torch.load(own if own.exists() else path / "trainer-rank0.pt", weights_only=False)


def resume(run_dir: str | Path, resume_setting: str, model: nn.Module, optimizer: torch.optim.Optimizer,
           settings: dict[str, Any], echo: Callable[[str], None], extra: dict[str, torch.Tensor] | None = None
           ) -> tuple[Path, dict[str, Any]] | None:
    """Load the checkpoint `checkpoint.resume` selects (see the module docstring): (its path, this rank's trainer
    state), or None for a fresh start. `echo` reports each checkpoint skipped as corrupt; `extra` as in
    `load_checkpoint`."""
    candidates = resume_candidates(run_dir, resume_setting)
    skipped = []
    for path in candidates:
        try:
            problem = verify_checkpoint(path)
            if problem is not None:
                raise CorruptCheckpoint(problem)
            changes = settings_changes(read_manifest(path).get("settings", {}), settings)
            if changes:
                raise InputError(f"cannot resume from {path}: the recipe changes settings the checkpointed run "
                                 f"fixed:\n  " + "\n  ".join(changes) + "\nRestore them, or start a fresh run with "
                                 "checkpoint.resume=none or another train.run_dir")
            try:
                return path, load_checkpoint(path, model, optimizer, extra)
            except (CheckpointException, RuntimeError, ValueError, KeyError) as e:
                if isinstance(e, (TrainingError, torch.OutOfMemoryError)):
                    raise
                cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
                raise TrainingError(f"cannot resume from {path}: {str(cause).rstrip('.')}. Its files are intact and "
                                    f"its settings match the recipe's, so it was written by a moela whose model or "
                                    f"optimizer state differs from this one's; start a fresh run with "
                                    f"checkpoint.resume=none or another train.run_dir") from e
        except CorruptCheckpoint as e:
            if resume_setting != "auto":
                raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {e}. Resume from another checkpoint (or "
                                        f"checkpoint.resume=auto: the newest intact one), or start a fresh run with "
                                        f"checkpoint.resume=none") from None
            skipped.append(f"{path.name}: {e}")
            older = candidates[candidates.index(path) + 1:]
            echo(f"checkpoint {path} is corrupt: {e}; "
                 + (f"trying the next newest, {older[0].name}" if older else "no older checkpoint is left"))
    if skipped:
        raise CorruptCheckpoint(f"no intact checkpoint in {checkpoints_root(run_dir)}: " + "; ".join(skipped)
                                + ". Move the checkpoints directory aside to start over (or set "
                                  "checkpoint.resume=none with another train.run_dir)")
    return None
