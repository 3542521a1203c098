"""Loss curves of the same training run with AdamW's moments in fp32 and in bf16 (`optim.moment_dtype`).

Runs `train.py RECIPE` twice with the same seed and data, differing only in `optim.moment_dtype`, and writes a
table of the logged losses (each averaged over the steps since the previous line) with the relative difference,
the validation losses and the median throughput of the logged windows (each line's tokens/s is its window's
average; a logged record's own `step_time_s` is the logging step, which waits for every step the host queued
ahead, so it is not a step time): bench/results/moments_training.md, and the curves in moments_training.json.

  CPU:  python bench/moments_training.py --recipe recipes/tiny.yaml --out-dir /tmp/moments_tiny_cpu
  GPU:  python bench/moments_training.py                          # recipes/small.yaml, 500 steps
Extra recipe overrides go after `--set`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.results_io import add_out_dir, write_results  # noqa: E402

VARIANTS = ("float32", "bfloat16")


def run(recipe: str, moments: str, steps: int | None, work: Path, extra: list[str]) -> list[dict]:
    run_dir = work / moments
    cmd = [sys.executable, str(ROOT / "train.py"), recipe, f"optim.moment_dtype={moments}",
           f"train.run_dir={run_dir}", "checkpoint.every=0", "checkpoint.save_at_end=false",
           "checkpoint.resume=none", "logging.plot=false", "logging.progress_bar=never", *extra]
    if steps:
        cmd += [f"train.steps={steps}", f"train.eval_every={steps}"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/small.yaml")
    ap.add_argument("--steps", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--work-dir", default="/tmp/moela_moments_training")
    add_out_dir(ap)
    ap.add_argument("--set", nargs="*", default=[], help="more recipe overrides (section.key=value)")
    args = ap.parse_args()
    runs = {v: run(args.recipe, v, args.steps, Path(args.work_dir), args.set) for v in VARIANTS}
    curves = {v: {r["step"]: r["loss"] for r in recs if r["kind"] == "train"} for v, recs in runs.items()}
    lines = [f"{args.recipe}; the runs differ only in `optim.moment_dtype`. Curves: moments_training.json.", "",
             "| step | loss fp32 moments | loss bf16 moments | bf16 vs fp32 |", "| ---: | ---: | ---: | ---: |"]
    for step in sorted(set(curves["float32"]) & set(curves["bfloat16"])):
        a, b = curves["float32"][step], curves["bfloat16"][step]
        lines.append(f"| {step} | {a:.4f} | {b:.4f} | {100 * (b / a - 1):+.2f}% |")
    summary = {}
    for v, recs in runs.items():
        evals = [r["val_loss"] for r in recs if r["kind"] == "eval"]
        train = [r for r in recs if r["kind"] == "train"]
        summary[v] = {"val_loss": evals[-1] if evals else None,
                      "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train[1:] or train)}
    a, b = summary["float32"], summary["bfloat16"]
    if a["val_loss"] and b["val_loss"]:
        lines += ["", f"Validation at the end: fp32 moments {a['val_loss']:.4f}, bf16 moments {b['val_loss']:.4f} "
                      f"({100 * (b['val_loss'] / a['val_loss'] - 1):+.2f}%); median logged window "
                      f"{a['tokens_per_s']:,.0f} vs {b['tokens_per_s']:,.0f} tokens/s."]
    write_results("moments_training", "AdamW moments in fp32 vs bf16: loss curves of the same training run",
                  "\n".join(lines), {"curves": {v: sorted(c.items()) for v, c in curves.items()}, "summary": summary},
                  out_dir=args.out_dir)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
