"""Loss curves of the same training run with bf16 and with FP8 (DeepSeek-V3 blockwise) routed experts.

Runs `train.py RECIPE` twice with the same seed and data, once with `model.moe_recipe=bf16` and once with
`model.moe_recipe=fp8_blockwise` (nothing else differs), reads both `metrics.jsonl` files and writes a table of the
logged losses (each averaged over the steps since the previous line) with the relative difference, plus the
validation loss and the median step time of each run. Issue target: within 1% after 200 steps of `small`.

  GPU (the issue's run):  python bench/fp8_training.py                                  # recipes/small.yaml, 200 steps
  CPU (reference experts, simulated FP8):
                          python bench/fp8_training.py --recipe recipes/tiny.yaml --out /tmp/fp8_tiny.md
Extra recipe overrides go after `--set`, e.g. `--set train.grad_accum=1`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(recipe: str, moe_recipe: str, steps: int, work: Path, extra: list[str]) -> list[dict]:
    run_dir = work / moe_recipe
    cmd = [sys.executable, str(ROOT / "train.py"), recipe, f"model.moe_recipe={moe_recipe}", f"train.steps={steps}",
           f"train.run_dir={run_dir}", f"train.eval_every={steps}", "checkpoint.every=0",
           "checkpoint.save_at_end=false", "checkpoint.resume=none", "logging.plot=false",
           "logging.progress_bar=never", *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def table(bf16: list[dict], fp8: list[dict]) -> list[str]:
    a = {r["step"]: r for r in bf16 if r["kind"] == "train"}
    b = {r["step"]: r for r in fp8 if r["kind"] == "train"}
    lines = ["| step | loss bf16 | loss fp8 | fp8 vs bf16 |", "| ---: | ---: | ---: | ---: |"]
    for step in sorted(set(a) & set(b)):
        la, lb = a[step]["loss"], b[step]["loss"]
        lines.append(f"| {step} | {la:.4f} | {lb:.4f} | {100 * (lb / la - 1):+.2f}% |")
    return lines


def summary(records: list[dict]) -> dict:
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    return {"val_loss": evals[-1]["val_loss"] if evals else float("nan"),
            "step_s": statistics.median(r["step_time_s"] for r in train[1:] or train),
            "skipped": train[-1].get("skipped", 0) if train else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/small.yaml")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--work-dir", default="/tmp/moela_fp8_training")
    ap.add_argument("--out", default="bench/results/moe_fp8_training.md")
    ap.add_argument("--set", nargs="*", default=[], help="more recipe overrides (section.key=value)")
    args = ap.parse_args()
    work = Path(args.work_dir)
    runs = {name: run(args.recipe, name, args.steps, work, args.set) for name in ("bf16", "fp8_blockwise")}
    s = {name: summary(recs) for name, recs in runs.items()}
    last = max(r["step"] for r in runs["bf16"] if r["kind"] == "train")
    lines = [
        "# FP8 vs bf16 routed experts: loss curves of the same training run",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Command: "
        f"`python bench/fp8_training.py {' '.join(sys.argv[1:])}` ({args.recipe}, {args.steps} steps; the runs differ "
        f"only in `model.moe_recipe`).",
        "",
        *table(runs["bf16"], runs["fp8_blockwise"]),
        "",
        f"Validation loss at step {last}: bf16 {s['bf16']['val_loss']:.4f}, fp8 {s['fp8_blockwise']['val_loss']:.4f} "
        f"({100 * (s['fp8_blockwise']['val_loss'] / s['bf16']['val_loss'] - 1):+.2f}%). Median step time: bf16 "
        f"{s['bf16']['step_s']:.3f} s, fp8 {s['fp8_blockwise']['step_s']:.3f} s. Skipped (non-finite) steps: bf16 "
        f"{s['bf16']['skipped']}, fp8 {s['fp8_blockwise']['skipped']}.",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
