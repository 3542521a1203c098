"""The one output of a benchmark script: bench/results/<script>.md and <script>.json, regenerated whole on every run,
both starting with the same header (commit, date, device, torch and triton versions, the command)."""

from __future__ import annotations

import datetime
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _commit() -> str:
    """The checkout's commit, marked `+dirty` when tracked files differ from it ("unknown" outside git)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD")
    if not sha:
        return "unknown"
    return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def header(device: str | None = None) -> dict:
    """commit, date (UTC), device (the CUDA device's name, or `device`), torch, triton, command."""
    import torch
    import triton

    if device is None:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"commit": _commit(), "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "device": device, "torch": torch.__version__, "triton": triton.__version__,
            "command": "python " + " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}


def write(script: str, title: str, rows: list[dict], table: list[str], notes: tuple[str, ...] = (),
          out_dir: Path = RESULTS, device: str | None = None) -> Path:
    """Write <out_dir>/<script>.json ({"header": ..., "rows": rows}) and <script>.md (title, header, notes, then
    `table`: Markdown lines). Returns the .md path."""
    head = header(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{script}.json").write_text(json.dumps({"header": head, "rows": rows}, indent=1) + "\n")
    lines = [f"# {title}", "", f"Commit {head['commit']}, {head['date']}, {head['device']}, torch {head['torch']}, "
             f"triton {head['triton']}. Command: `{head['command']}`", ""]
    for note in notes:
        lines += [note, ""]
    md = out_dir / f"{script}.md"
    md.write_text("\n".join(lines + table) + "\n")
    return md
