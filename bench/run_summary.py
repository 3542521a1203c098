"""The curve and the step-time line of a training run, from its run directory (metrics.jsonl, config.yaml), as
markdown: a row per logged step (loss, step time, tokens/s over all ranks, MFU, memory, expert and data-rank
imbalance), the evaluations, the profiled window's busy and collective shares, and one line: median step time over
the steps from `--from-step` on, tokens/s per GPU, MFU and peak memory.

  python bench/run_summary.py runs/multi_gpu --gpus 4 > runs/multi_gpu/summary.md

A record of one run, not a benchmark: it prints, and writes nothing into bench/results.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _fmt(value, spec: str, unit: str = "") -> str:
    return "-" if value is None else format(value, spec) + unit


def summarize(run_dir: Path, gpus: int, from_step: int) -> str:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    profiles = [r for r in records if r["kind"] == "profile"]
    if not train:
        return f"# {run_dir}: no training step was logged\n"
    lines = [f"# Training run `{run_dir.name}` on {gpus} GPU(s)", "",
             "| step | loss | step s | tok/s (all ranks) | MFU | mem GiB | expert load max/mean | DP cost max/mean |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in train:
        mfu = None if r.get("mfu") is None else 100 * r["mfu"]
        lines.append(f"| {r['step']} | {r['loss']:.4f} | {r['step_time_s']:.3f} | {r['tokens_per_s'] / 1e3:.1f}k | "
                     f"{_fmt(mfu, '.1f', '%')} | {_fmt(r.get('mem_gib'), '.1f')} | "
                     f"{_fmt(r.get('expert_imbalance'), '.2f')} | {_fmt(r.get('dp_imbalance'), '.3f')} |")
    lines.append("")
    for r in evals:
        lines.append(f"Evaluation at step {r['step']}: " + ", ".join(
            f"{k} {v:.4f}" for k, v in r.items() if k not in ("kind", "step") and isinstance(v, float)) + ".")
    for r in profiles:
        shares = ", ".join(f"{k.removeprefix('share_')} {100 * v:.1f}%" for k, v in r.items()
                           if k.startswith("share_"))
        lines.append(f"Profiled steps {r.get('first_step')}-{r.get('first_step', 0) + r.get('steps', 1) - 1}: GPU "
                     f"busy {100 * r.get('busy', 0.0):.1f}%, {shares} of the wall time (rank 0).")
    late = [r for r in train if r["step"] >= from_step] or train[-1:]
    step_s = statistics.median(r["step_time_s"] for r in late)
    tok_s = statistics.median(r["tokens_per_s"] for r in late)
    mfus = [r["mfu"] for r in late if r.get("mfu") is not None]
    mfu = _fmt(100 * statistics.median(mfus) if mfus else None, ".1f", "%")
    lines += ["", f"**Steps {late[0]['step']}-{late[-1]['step']}: median step {step_s:.3f} s, "
              f"{tok_s / gpus / 1e3:.1f}k tokens/s per GPU, MFU {mfu}, peak "
              f"{max(r.get('mem_gib') or 0.0 for r in train):.1f} GiB allocated per GPU; final loss "
              f"{train[-1]['loss']:.4f} at step {train[-1]['step']}.**"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--gpus", type=int, required=True, help="processes of the run (tokens/s per GPU)")
    parser.add_argument("--from-step", type=int, default=20, help="first step of the step-time line")
    args = parser.parse_args()
    if not (args.run_dir / "metrics.jsonl").exists():
        raise SystemExit(f"{args.run_dir}/metrics.jsonl not found: is {args.run_dir} a run directory (train.run_dir)?")
    print(summarize(args.run_dir, args.gpus, args.from_step), end="")


if __name__ == "__main__":
    main()
