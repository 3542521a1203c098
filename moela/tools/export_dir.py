"""Where `python -m moela export` may write, and what `--overwrite` may remove.

Decisions:
- OUT may not be, contain or lie inside the run directory being exported, nor lie inside any run directory or
  checkpoints folder (paths resolved, symlinks included): an export next to a run never touches it.
- `--overwrite` removes only a previous export: a folder holding `config.json`, at least one safetensors file and
  nothing but the files an export writes (no subfolder, no symlink, no other file). Anything else is refused,
  naming the first entry that does not belong; deleting a user's folder by mistake cannot happen.
- The export is written into a fresh hidden sibling of OUT and renamed into place; the previous export is renamed
  aside first and deleted only after the new one is in place. Any error removes the sibling.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moela.tools.runs import CHECKPOINTS, CONFIG_FILE, UsageError
from moela.trainer.safe_write import writing

EXPORT_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "model.safetensors.index.json", "model.safetensors"}
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
EXPORT_FIX = "free space on that disk or choose another OUT folder, then run the export again"


def _inside(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def _is_run_dir(path: Path) -> bool:
    return (path / CHECKPOINTS).is_dir() and (path / CONFIG_FILE).is_file()


def check_out(out: Path, run_dir: Path) -> None:
    """Refuse an OUT that would put the run (or any run) at risk (see the module docstring)."""
    target, run = out.resolve(), run_dir.resolve()
    if _inside(target, run):
        raise UsageError(f"{out}: inside the run directory {run_dir}; export next to it instead, e.g. "
                         f"{run_dir.parent / (run_dir.name + '-hf')}")
    if _inside(run, target):
        raise UsageError(f"{out}: contains the run directory {run_dir}; choose a folder of its own for the export, "
                         f"e.g. {run_dir.parent / (run_dir.name + '-hf')}")
    for parent in [target, *target.parents]:
        if _is_run_dir(parent) or (parent.name == CHECKPOINTS and _is_run_dir(parent.parent)):
            raise UsageError(f"{out}: inside {parent}, which holds a training run's checkpoints; choose a folder "
                             f"outside any run directory")


def previous_export_problem(out: Path) -> str | None:
    """Why `out` is not a previous export that --overwrite may remove, or None when it is one."""
    if out.is_symlink():
        return "is a symlink"
    if not out.is_dir():
        return "is a file, not a folder"
    entries = sorted(out.iterdir())
    for entry in entries:
        if entry.is_symlink() or not entry.is_file():
            return f"holds {entry.name}, which is not a plain file"
        if entry.name not in EXPORT_FILES and not _SHARD.match(entry.name):
            return f"holds {entry.name}, which an export never writes"
    names = {e.name for e in entries}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        return "lacks config.json or safetensors weights"
    return None


def check_overwrite(out: Path, overwrite: bool) -> None:
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise UsageError(f"{out}: already exists; pick another folder or pass --overwrite to replace a previous "
                         f"export")
    problem = previous_export_problem(out)
    if problem:
        raise UsageError(f"{out}: --overwrite replaces only a previous export, and {out} {problem}; remove it "
                         f"yourself or pick another folder")


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A fresh folder beside `out` to write the export into; moved to `out` when the block succeeds (a previous
    export there is replaced), removed on any error. Disk errors become WriteFailed naming `out`."""
    with writing("the export", out, fix=EXPORT_FIX):
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    with writing("the export", out, fix=EXPORT_FIX, partial=partial):
        yield partial
        old = None
        if out.exists() or out.is_symlink():
            problem = previous_export_problem(out)  # checked again: it may have changed while exporting
            if problem:
                raise UsageError(f"{out}: changed during the export and {problem}; the new export is not moved "
                                 f"there")
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / out.name)
        try:
            os.replace(partial, out)
        except OSError:
            if old is not None:  # put the previous export back
                os.replace(old / out.name, out)
                old.rmdir()
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
