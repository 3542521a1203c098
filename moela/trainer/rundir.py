"""The run directory's guards: it must be writable, and only one training run may use it at a time.

Both run on rank 0 before the data and the model are built, so a run that cannot write its results fails in
seconds, not after tokenizing a corpus; the trainer hands the outcome to the other ranks.

Decisions:
- Writability is tested by creating (and removing) a file in the run dir, not with `os.access`: that also catches a
  read-only mount, a full quota and root squashing, which permission bits do not show.
- The lock is an `flock` on `run_dir/.lock`, held open for the run's life. The kernel releases it when the process
  ends, however it ends (kill -9 included), so a lock is never left held by a dead process; the file itself stays
  and names its last holder (host, pid, start time), which the message of a refused run quotes. A file naming a
  holder whose lock is free is stale (that run died without releasing it): it is taken over, saying so. flock works
  across hosts on local filesystems and NFSv4; where a filesystem refuses locks the run goes on with a warning.
- Only rank 0 locks: every process of one run shares the directory by design (torchrun's workers).
- No entry training writes may be a symlink (checked here, and the lock opened with `O_NOFOLLOW`): a link planted
  in a run dir would make training truncate or overwrite whatever it points at.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from moela.trainer.errors import TrainingError
from moela.trainer.safe_write import open_nofollow, refuse_symlink

LOCK_FILE = ".lock"
CHECKPOINT_DIR = "checkpoints"
# what training writes in a run dir (checkpoints/ and each entry in it are checked too)
WRITTEN = (LOCK_FILE, "config.yaml", "metrics.jsonl", "loss.png", "wandb_id", "wandb", "profile", "prebuild.log",
           CHECKPOINT_DIR)
log = logging.getLogger(__name__)


def check_writable(run_dir: Path) -> None:
    """Create `run_dir` if needed and write a file into it; a TrainingError says why it cannot be written, or
    names an entry moela writes that is a symlink."""
    probe = run_dir / f".write-test-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.write(fd, b"moela")
        os.close(fd)
        probe.unlink()
    except OSError as e:
        reason = "the filesystem is read-only" if e.errno == errno.EROFS else (e.strerror or str(e))
        raise TrainingError(f"train.run_dir={run_dir} cannot be written ({reason}: {e.filename}); the run would "
                            f"lose its checkpoints and metrics. Choose a writable directory with "
                            f"train.run_dir=PATH, or fix the directory's permissions") from None
    for name in WRITTEN:
        refuse_symlink(run_dir / name)
    if (run_dir / CHECKPOINT_DIR).is_dir():
        for entry in (run_dir / CHECKPOINT_DIR).iterdir():
            refuse_symlink(entry)


class RunDirLock:
    """An exclusive lock on a run directory for the life of one training run (see the module docstring)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._file = None

    def acquire(self) -> str | None:
        """Take the lock, or raise TrainingError naming the run that holds it. Returns a line to print when a stale
        lock was taken over, else None."""
        f = open_nofollow(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read_holder(f))
            f.close()
            raise TrainingError(f"train.run_dir={self.path.parent} is in use by another training run ({holder}); "
                                f"wait for it to finish or stop it, or give this run another train.run_dir") from None
        except OSError as e:  # a filesystem without locks
            log.warning("cannot lock %s (%s): nothing keeps a second run from using this run dir at the same time",
                        self.path, e.strerror)
        previous = _read_holder(f)
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                            "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
        f.flush()
        self._file = f
        if previous and previous.get("pid") != os.getpid():
            return (f"run dir lock: its last holder ({_describe(previous)}) ended without releasing it; taking it "
                    f"over")
        return None

    def release(self) -> None:
        """Clear the holder and unlock (closing the file unlocks)."""
        if self._file is None:
            return
        self._file.seek(0)
        self._file.truncate()
        self._file.close()
        self._file = None


def _read_holder(f) -> dict | None:
    f.seek(0)
    try:
        holder = json.loads(f.read() or "null")
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict | None) -> str:
    if not holder:
        return "holder unknown"
    alive = ""
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        alive = ", running" if _pid_alive(holder["pid"]) else ", no longer running"
    return f"pid {holder.get('pid')} on host {holder.get('host')}{alive}, started {holder.get('started')}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True
