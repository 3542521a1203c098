"""Every bench script's output: `bench/results/<script>.md` and `<script>.json`, both regenerated whole, both
headed by what a reader needs to trust and rerun the numbers: the commit (and whether tracked files differed from
it), the UTC date, the device, the torch and triton versions and the exact command line.

The Markdown file is the title, the header as one line and the command, then the script's body; the JSON file is
`{"header": {...}, "results": payload}`. A copy of the tree without git (a machine the tree was copied to) names
its commit through the `BENCH_COMMIT` environment variable, else the header says `unknown`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]


@dataclass(frozen=True)
class Header:
    commit: str  # the full hash of HEAD, or BENCH_COMMIT, or "unknown"
    dirty: bool | None  # tracked files outside bench/results differ from the commit; None without git
    date: str  # UTC, to the minute
    device: str  # the GPU's name (with a count when several ran), or the CPU's
    torch: str
    triton: str
    command: str

    def markdown(self) -> str:
        state = {True: " (with uncommitted changes)", False: "", None: ""}[self.dirty]
        return (f"commit {self.commit[:12]}{state}, {self.date}, {self.device}, torch {self.torch}, "
                f"triton {self.triton}\n\n`{self.command}`\n")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def commit_state() -> tuple[str, bool | None]:
    """(commit, dirty). Result files are left out of `dirty`: a script run after another has rewritten them is
    still a run of the committed code."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return os.environ.get("BENCH_COMMIT", "unknown"), None
    status = _git("status", "--porcelain", "--", ".", ":(exclude)bench/results")
    return head.strip(), None if status is None else bool(status.strip())


def device_name() -> str:
    """The current CUDA device's name, else the CPU's."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def command_line() -> str:
    """The command that started this process, with the script's path relative to the repository; under torchrun,
    an equivalent torchrun command."""
    script = Path(sys.argv[0]).resolve()
    path = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0]
    words = shlex.join([path, *sys.argv[1:]])
    if "LOCAL_WORLD_SIZE" in os.environ:
        return f"torchrun --nproc_per_node={os.environ['LOCAL_WORLD_SIZE']} {words}"
    return f"python {words}"


def make_header(*, command: str | None = None, device: str | None = None, torch: str | None = None,
                triton: str | None = None) -> Header:
    """This process's header; a script whose numbers come from elsewhere (child processes on another device,
    rows of earlier runs) names the device or versions they ran with."""
    import torch as torch_module

    if triton is None:
        try:
            import triton as triton_module

            triton = triton_module.__version__
        except ImportError:
            triton = "-"
    commit, dirty = commit_state()
    date = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    return Header(commit=commit, dirty=dirty, date=date, device=device or device_name(),
                  torch=torch or torch_module.__version__, triton=triton, command=command or command_line())


def add_out_dir(parser, default: Path | None = RESULTS) -> None:
    """The `--out-dir` option every bench script takes (tests and smoke runs write elsewhere)."""
    parser.add_argument("--out-dir", default=None if default is None else str(default),
                        help=f"folder for <script>.md and <script>.json (default {default or 'none: print only'})")


def write_results(script: str, title: str, body: str, payload, *, out_dir: str | Path | None = None,
                  **header_fields: str | None) -> Path:
    """Write `<out_dir>/<script>.md` (title, header, body) and `<script>.json` (header and `payload`, which must
    be JSON-serializable), replacing both; `out_dir` defaults to bench/results; `header_fields` go to
    `make_header`. Returns the Markdown file's path."""
    if not title or "\n" in title:
        raise ValueError(f"the title must be one line, got {title!r}")
    header = make_header(**header_fields)
    out = Path(out_dir) if out_dir is not None else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    md = out / f"{script}.md"
    md.write_text(f"# {title}\n\n{header.markdown()}\n{body.strip()}\n")
    (out / f"{script}.json").write_text(json.dumps({"header": asdict(header), "results": payload}, indent=1) + "\n")
    return md
