"""Loss curves and speed of the same training run with and without compiled blocks (`train.compile`).

Runs `train.py RECIPE` twice with the same seed and data, `train.compile=false` (every op eager, unpadded
micro-batches) and `train.compile=true` (blocks through torch.compile, micro-batches padded to one shape), reads
both `metrics.jsonl` files and writes a table of the logged losses (each averaged over the steps since the previous
line) with the relative difference, the validation loss, the throughput of the logged windows after the first
(median tokens/s and MFU) and the first step's time (compilation and autotuning included). Issue target: the
compiled run's loss equal to the eager one's within noise after 200 steps of `small` (speed must not change the
math); bf16 autocast makes two runs differ by rounding, so "noise" is the size of the difference between two eager
runs of different data orders, about 0.5% at step 200 (`bench/results/moe_fp8_training.md`).

  GPU (the issue's run):  python bench/compile_training.py                        # recipes/small.yaml, 200 steps
  CPU smoke run:          python bench/compile_training.py --recipe recipes/tiny.yaml --steps 20 \\
                              --out /tmp/compile_tiny.md
Extra recipe overrides (both runs) go after `--set`, e.g. `--set train.tokens_per_microbatch=65536
train.grad_accum=1`.
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
# both without CUDA graphs (which `small` ships on): this run isolates what compiling the blocks changes
VARIANTS = {"eager": ["train.compile=false", "train.cuda_graphs=false"],
            "compiled": ["train.compile=true", "train.cuda_graphs=false"]}


def run(recipe: str, name: str, steps: int, work: Path, extra: list[str]) -> list[dict]:
    run_dir = work / name
    cmd = [sys.executable, str(ROOT / "train.py"), recipe, *VARIANTS[name], f"train.steps={steps}",
           f"train.run_dir={run_dir}", f"train.eval_every={steps}", "checkpoint.every=0",
           "checkpoint.save_at_end=false", "checkpoint.resume=none", "logging.plot=false",
           "logging.progress_bar=never", *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def table(a_records: list[dict], b_records: list[dict]) -> list[str]:
    a = {r["step"]: r for r in a_records if r["kind"] == "train"}
    b = {r["step"]: r for r in b_records if r["kind"] == "train"}
    lines = ["| step | loss eager | loss compiled | compiled vs eager |", "| ---: | ---: | ---: | ---: |"]
    for step in sorted(set(a) & set(b)):
        la, lb = a[step]["loss"], b[step]["loss"]
        lines.append(f"| {step} | {la:.4f} | {lb:.4f} | {100 * (lb / la - 1):+.2f}% |")
    return lines


def summary(records: list[dict]) -> dict:
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    later = train[2:] or train  # windows after step 1 and the first full window (compilation)
    mfu = [r["mfu"] for r in later if r.get("mfu") is not None]
    return {"val_loss": evals[-1]["val_loss"] if evals else float("nan"),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later) if later else float("nan"),
            "mfu": statistics.median(mfu) if mfu else None,
            "first_step_s": train[0]["step_time_s"] if train else float("nan"),
            "mem_gib": max(r["mem_gib"] for r in train) if train else float("nan"),
            "skipped": train[-1].get("skipped", 0) if train else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/small.yaml")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--work-dir", default="/tmp/moela_compile_training")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "compile_training.md"))
    ap.add_argument("--set", nargs="*", default=[], help="extra recipe overrides for both runs")
    args = ap.parse_args()
    work = Path(args.work_dir)
    records = {name: run(args.recipe, name, args.steps, work, args.set) for name in VARIANTS}
    s = {name: summary(recs) for name, recs in records.items()}
    import torch
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    final = {name: [r for r in recs if r["kind"] == "train"][-1]["loss"] for name, recs in records.items()}
    lines = [f"# Compiled vs eager training: {args.recipe}, {args.steps} steps",
             "", f"{datetime.date.today()}, {device}, torch {torch.__version__}, triton {triton.__version__}; "
             f"`python bench/compile_training.py {' '.join(sys.argv[1:])}`", "",
             "| run | final logged loss | val loss | tokens/s (median window) | MFU | first step s | peak GiB | "
             "skipped |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name in VARIANTS:
        v = s[name]
        mfu = f"{100 * v['mfu']:.1f}%" if v["mfu"] is not None else "-"
        lines.append(f"| {name} | {final[name]:.4f} | {v['val_loss']:.4f} | {v['tokens_per_s']:,.0f} | {mfu} | "
                     f"{v['first_step_s']:.1f} | {v['mem_gib']:.1f} | {v['skipped']} |")
    lines += ["", f"Final loss, compiled vs eager: {100 * (final['compiled'] / final['eager'] - 1):+.2f}%; "
              f"speed-up {s['compiled']['tokens_per_s'] / s['eager']['tokens_per_s']:.2f}x.", ""]
    lines += table(records["eager"], records["compiled"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
