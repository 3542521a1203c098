"""Loss curves and speed of the same training run eager, with compiled blocks (`train.compile`) and also graphed
(`train.cuda_graphs`).

Runs `train.py RECIPE` once per variant with the same seed and data - `eager` (every op eager, unpadded
micro-batches), `compiled` (blocks through torch.compile, micro-batches padded to one shape), `graphed` (compiled,
and each micro-batch's forward + backward replayed as one CUDA graph; CUDA only) - reads the `metrics.jsonl` files
and writes a table of the logged losses (each averaged over the steps since the previous line) with each
variant's relative difference to eager, the validation loss, the throughput of the logged windows after the first
(median tokens/s and MFU) and the first step's time (compilation and autotuning included). Issue target: the
faster runs' loss equal to the eager one's within noise after 200 steps of `small` (speed must not change the
math); bf16 autocast makes two runs differ by rounding, so "noise" is the size of the difference between two eager
runs of different data orders, about 0.5% at step 200. Writes bench/results/compile_training.md and .json.

  GPU (the issue's run):  python bench/compile_training.py                        # recipes/small.yaml, 200 steps
  CPU smoke run:          python bench/compile_training.py --recipe recipes/tiny.yaml --steps 20 \\
                              --out-dir /tmp/compile_tiny                         # eager and compiled only
Extra recipe overrides (all runs) go after `--set`, e.g. `--set train.tokens_per_microbatch=65536
train.grad_accum=1`.
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

VARIANTS = {"eager": ["train.compile=false", "train.cuda_graphs=false"],
            "compiled": ["train.compile=true", "train.cuda_graphs=false"],
            "graphed": ["train.compile=true", "train.cuda_graphs=true"]}


def run(recipe: str, name: str, steps: int, work: Path, extra: list[str]) -> list[dict]:
    run_dir = work / name
    cmd = [sys.executable, str(ROOT / "train.py"), recipe, *VARIANTS[name], f"train.steps={steps}",
           f"train.run_dir={run_dir}", f"train.eval_every={steps}", "checkpoint.every=0",
           "checkpoint.save_at_end=false", "checkpoint.resume=none", "logging.plot=false",
           "logging.progress_bar=never", *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def table(records: dict[str, list[dict]]) -> list[str]:
    """Logged losses per step, each variant after the first (eager) with its difference to it."""
    curves = {name: {r["step"]: r["loss"] for r in recs if r["kind"] == "train"} for name, recs in records.items()}
    base, *others = curves
    lines = [f"| step | loss {base} | " + " | ".join(f"loss {n} | {n} vs {base}" for n in others) + " |",
             "| ---: | ---: | " + " | ".join("---: | ---:" for _ in others) + " |"]
    for step in sorted(set.intersection(*(set(c) for c in curves.values()))):
        ref = curves[base][step]
        cells = " | ".join(f"{curves[n][step]:.4f} | {100 * (curves[n][step] / ref - 1):+.2f}%" for n in others)
        lines.append(f"| {step} | {ref:.4f} | {cells} |")
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
    add_out_dir(ap)
    ap.add_argument("--variants", help=f"comma list of {', '.join(VARIANTS)}, eager first (default: all on a GPU, "
                                       f"eager,compiled on the CPU)")
    ap.add_argument("--set", nargs="*", default=[], help="extra recipe overrides for every run")
    args = ap.parse_args()
    import torch

    names = (args.variants or ",".join(VARIANTS if torch.cuda.is_available() else list(VARIANTS)[:2])).split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or names[0] != "eager" or len(names) < 2:
        sys.exit(f"bench/compile_training.py: --variants must start with eager and name at least one of "
                 f"{', '.join(list(VARIANTS)[1:])}; got {args.variants!r}")
    work = Path(args.work_dir)
    records = {name: run(args.recipe, name, args.steps, work, args.set) for name in names}
    s = {name: summary(recs) for name, recs in records.items()}

    final = {name: [r for r in recs if r["kind"] == "train"][-1]["loss"] for name, recs in records.items()}
    lines = ["| run | final logged loss | val loss | tokens/s (median window) | MFU | first step s | peak GiB | "
             "skipped |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name in names:
        v = s[name]
        mfu = f"{100 * v['mfu']:.1f}%" if v["mfu"] is not None else "-"
        lines.append(f"| {name} | {final[name]:.4f} | {v['val_loss']:.4f} | {v['tokens_per_s']:,.0f} | {mfu} | "
                     f"{v['first_step_s']:.1f} | {v['mem_gib']:.1f} | {v['skipped']} |")
    lines += [""] + [f"Final loss, {n} vs eager: {100 * (final[n] / final['eager'] - 1):+.2f}%; speed-up "
                     f"{s[n]['tokens_per_s'] / s['eager']['tokens_per_s']:.2f}x." for n in names[1:]] + [""]
    lines += table(records)
    title = f"{', '.join(names[1:]).capitalize()} vs eager training: {args.recipe}, {args.steps} steps"
    write_results("compile_training", title, "\n".join(lines),
                  dict(recipe=args.recipe, steps=args.steps, overrides=args.set, final_loss=final, summary=s,
                       records=records), out_dir=args.out_dir)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
