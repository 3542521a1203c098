"""Writing run files: never through a symlink, and a full, read-only or failing disk reported in one line.

Decisions:
- A disk error (ENOSPC, EDQUOT, EROFS, EIO) anywhere in a write becomes `WriteFailed`: one line naming the file,
  what the disk said, the bytes the write needed where known, and the fix; the partial file or folder the write
  created is removed first. The error is looked for along the exception's causes and inside DCP's
  `CheckpointException` (whose writer threads wrap it); torch's C++ writer loses the errno ("unexpected pos"), so
  files moela saves with torch are serialized in memory and written by Python, which keeps it.
- Files in a run directory are created with `O_NOFOLLOW` and an existing entry that is a symlink is refused by
  name: a link planted in a run directory (or a shared one) must not make training overwrite its target.
- Before a checkpoint the free space is compared with the previous checkpoint's size, and a shortfall is announced
  then, not when the save fails.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moela.trainer.errors import TrainingError, causes

DISK_ERRORS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
               errno.EROFS: "the filesystem is read-only", errno.EIO: "an I/O error (a failing disk or a lost network "
                                                                      "mount)"}
RUN_DIR_FIX = ("free space on that disk (or move train.run_dir to another one), then rerun the same command: it "
               "resumes from the newest complete checkpoint")


class WriteFailed(TrainingError):
    """A write failed because of the disk (full, over quota, read-only, failing); the message names the file."""


class SymlinkRefused(TrainingError):
    """A file moela writes is a symlink."""


def disk_error(exc: BaseException) -> OSError | None:
    """The OSError with a disk errno behind `exc` (itself, a cause or context, or a failure DCP collected)."""
    return next((e for e in causes(exc) if isinstance(e, OSError) and e.errno in DISK_ERRORS), None)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def failure_message(what: str, path: Path, err: OSError, needed: int | None, fix: str) -> str:
    where = f" ({err.filename})" if err.filename and str(err.filename) != str(path) else ""
    free = free_bytes(path)
    need = ""
    if needed:
        need = f"; it needs about {_size(needed)}" + (f", {_size(free)} are free" if free is not None else "")
    return f"cannot write {what} {path}: {DISK_ERRORS[err.errno]}{where}{need}. Fix: {fix}"


def remove(path: Path) -> None:
    """Remove a file or folder this process created, whatever is left of it."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass


@contextmanager
def writing(what: str, path: Path, *, needed: int | None = None, fix: str = RUN_DIR_FIX,
            partial: Path | None = None) -> Iterator[None]:
    """Turn a disk error inside the block into WriteFailed naming `path`; `partial` (a file or folder the block
    creates) is removed on any error."""
    try:
        yield
    except BaseException as e:
        if partial is not None:
            remove(partial)
        err = disk_error(e)
        if err is None:
            raise
        raise WriteFailed(failure_message(what, path, err, needed, fix)) from None


def refuse_symlink(path: Path) -> None:
    if Path(path).is_symlink():
        raise SymlinkRefused(f"{path} is a symlink (to {os.readlink(path)}); moela never writes through a link in a "
                             f"run directory. Remove it (or point train.run_dir at the disk it leads to)")


def open_nofollow(path: Path, mode: str = "w"):
    """`open(path, mode)` for "w", "a", "a+", "wb" and "ab", refusing a symlink at `path`."""
    flags = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
             "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND}[mode.replace("b", "")]
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_symlink(path)
        raise
    return os.fdopen(fd, mode)


def write_atomic(path: Path, data: str | bytes, what: str, *, fix: str = RUN_DIR_FIX) -> None:
    """Write `data` to `path` through a fresh temporary sibling renamed over it (fsynced), refusing a symlink at
    `path`; a disk error removes the temporary and raises WriteFailed."""
    path = Path(path)
    refuse_symlink(path)
    tmp = path.with_name(f"{path.name}.tmp")
    remove(tmp)
    with writing(what, path, needed=len(data), fix=fix, partial=tmp):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def space_warning(path: Path, needed: int) -> str | None:
    """A warning line when the disk holding `path` has less free space than `needed` bytes."""
    free = free_bytes(path)
    if free is None or free >= needed:
        return None
    return (f"warning: {_size(free)} free on the disk of {path}, and the previous checkpoint took {_size(needed)}: "
            f"the next save will likely fail. Free space now (or move train.run_dir to another disk)")
