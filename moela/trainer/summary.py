"""The end-of-run summary: what was trained, how fast, how well, where the files are and what to run next.

The trainer prints it last when a run finishes; `python -m moela summary RUN_DIR` prints it for any run directory.
Everything comes from the run directory itself (metrics.jsonl, checkpoints/, loss.png), so both agree.

Decisions:
- Training time is the time spent in optimizer steps, from the logged windows: each step line's record covers the
  tokens since the previous line (`tokens_seen` difference) at its window's `tokens_per_s`. Evaluation,
  checkpointing and start-up are not in it; the trainer adds the wall time of the current process separately.
- The next commands are printed with the run directory and the recipe's sample prompt, ready to paste.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from moela.trainer.checkpoint import resume_candidates
from moela.trainer.metrics import METRICS_FILE, PLOT_FILE, read_metrics


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _count(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def training_time(train_records: list[dict]) -> float:
    """Seconds spent in optimizer steps, summed over the logged windows."""
    total, seen = 0.0, 0
    for rec in train_records:
        tokens = rec["tokens_seen"] - seen
        seen = rec["tokens_seen"]
        if rec.get("tokens_per_s"):
            total += tokens / rec["tokens_per_s"]
    return total


def run_summary(run_dir: str | Path, *, total_steps: int | None = None, sample_prompt: str = "The",
                wall_s: float | None = None) -> str:
    """The summary text (several lines) of the run in `run_dir`."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    lines = [f"run summary | {run_dir}"]
    if not train:
        lines.append("  no training steps recorded yet")
    else:
        last = train[-1]
        of = f" of {total_steps}" if total_steps else ""
        skipped = f", {last['skipped']} skipped (non-finite)" if last.get("skipped") else ""
        lines.append(f"  steps       {last['step']}{of}, {_count(last['tokens_seen'])} tokens{skipped}")
        steps_s = training_time(train)
        rate = last["tokens_seen"] / steps_s if steps_s > 0 else 0.0
        wall = f"{_duration(wall_s)} wall in this process; " if wall_s is not None else ""
        lines.append(f"  time        {wall}{_duration(steps_s)} in training steps, {_count(rate)} tok/s")
        lm = f" (lm {last['lm_loss']:.4f})" if "lm_loss" in last else ""
        lines.append(f"  train loss  {last['loss']:.4f}{lm} over the last logged window")
    if evals:
        final, best = evals[-1], min(evals, key=lambda r: r["val_loss"])
        lines.append(f"  val_loss    final {final['val_loss']:.4f} (ppl {math.exp(min(final['val_loss'], 50)):.2f}) "
                     f"at step {final['step']}; best {best['val_loss']:.4f} at step {best['step']}")
    checkpoint = next(iter(resume_candidates(run_dir, "auto")), None)
    lines.append(f"  checkpoint  {checkpoint if checkpoint is not None else 'none saved'}")
    lines.append(f"  metrics     {run_dir / METRICS_FILE}")
    if (run_dir / PLOT_FILE).is_file():
        lines.append(f"  plot        {run_dir / PLOT_FILE}")
    if checkpoint is not None:
        run = shlex.quote(str(run_dir))
        lines += ["next:",
                  f"  python -m moela generate {run} --prompt {shlex.quote(sample_prompt)}",
                  f"  python -m moela eval {run}",
                  f"  python -m moela export {run} {shlex.quote(str(run_dir.parent / (run_dir.name + '-hf')))}"]
    return "\n".join(lines)
