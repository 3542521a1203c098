"""What the fault tests share: the tiny recipe, running train.py and `python -m moela` in this process, resealing a
checkpoint's manifest after damaging it (as an attacker would), and the crafted payloads."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import sys
from pathlib import Path

import torch

from factories import TRAIN_FAST as TINY

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402
from moela.tools import cli  # noqa: E402


def overrides(run_dir, cache_dir, *extra) -> list[str]:
    return [*TINY, f"train.run_dir={run_dir}", f"data.cache_dir={cache_dir}", "train.steps=2", *extra]


def run_train(capsys, *args) -> tuple[int, str, str]:
    """train.py's main() in this process: (exit code, stdout, stderr)."""
    code = train.main([str(ROOT / "recipes" / "tiny.yaml"), *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def run_moela(capsys, *args) -> tuple[int, str, str]:
    """`python -m moela ARGS` in this process: (exit code, stdout, stderr)."""
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def reseal(checkpoint_dir: Path) -> None:
    """Record every file's current size and sha256 in the manifest, as whoever crafted the files would."""
    manifest = json.loads((checkpoint_dir / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (checkpoint_dir / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint_dir / "manifest.json").write_text(json.dumps(manifest))


class Payload:
    """Unpickling this creates `marker` (an empty file): proof that loading ran code the file chose."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def torch_saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def pickled(obj) -> bytes:
    return pickle.dumps(obj)


def full_disk(monkeypatch, pattern: str) -> None:
    """From now on (the test's monkeypatch undoes it), files whose path matches the regex `pattern` are opened on
    /dev/full when written: every write to them fails with the kernel's own ENOSPC, as on a full disk. Covers
    moela's own writes (os.open) and DCP's (its FileSystem.create_stream)."""
    import contextlib
    import os
    import re

    from torch.distributed.checkpoint.filesystem import FileSystem

    real_open, real_stream = os.open, FileSystem.create_stream

    def redirected(path, flags, *args, **kwargs):
        if re.search(pattern, str(path)) and flags & (os.O_WRONLY | os.O_RDWR):
            return real_open("/dev/full", os.O_WRONLY)
        return real_open(path, flags, *args, **kwargs)

    @contextlib.contextmanager
    def stream(self, path, mode):
        if re.search(pattern, str(path)) and "w" in mode:
            with open("/dev/full", "wb") as f:
                yield f
        else:
            with real_stream(self, path, mode) as f:
                yield f

    monkeypatch.setattr(os, "open", redirected)
    monkeypatch.setattr(FileSystem, "create_stream", stream)
