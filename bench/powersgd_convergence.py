"""Convergence of PowerSGD on the replicate dimension: the tiny recipe trained with HSDP's exact all-reduce and with
rank-r PowerSGD, same seed, data and layout, side by side.

Each run (the exact one, then one per PowerSGD variant) is `train.py recipes/tiny.yaml` under torchrun on `--nproc`
CPU processes (gloo) laid out as dp_replicate = 2 x dp_shard = nproc / 2; the script reads the runs' metrics.jsonl
and reports the training loss
(the logged window means) and the validation loss every `--every` steps, the bytes per step on the replicate
dimension, and whether each PowerSGD run's final validation loss is within `--tolerance` of the exact run's.

Usage: python bench/powersgd_convergence.py [--steps 300] [--every 25] [--variants 4:30 8:30 ...] [--nproc 4]
[--parallel]
Writes bench/results/powersgd_convergence.md and .json (or into --out-dir).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results_io import write_results  # noqa: E402


def start(run_dir: Path, args, variant: tuple[int, int] | None) -> tuple[subprocess.Popen, float]:
    """Start one torchrun training run, exact (`variant` None) or PowerSGD at (rank, warmup steps) -> (the process,
    its start time)."""
    overrides = [f"train.steps={args.steps}", f"train.run_dir={run_dir}", "parallel.dp_replicate=2",
                 f"logging.log_every={args.every}", f"train.eval_every={args.every}", "logging.progress_bar=never",
                 "logging.plot=false", "checkpoint.every=0", "checkpoint.save_at_end=false"]
    if variant is not None:
        overrides += ["parallel.replicate_compression=powersgd", f"parallel.powersgd_rank={variant[0]}",
                      f"parallel.powersgd_warmup_steps={variant[1]}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(ROOT / "train.py"), str(ROOT / "recipes" / "tiny.yaml"), *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL), time.perf_counter()


def finish(run_dir: Path, proc: subprocess.Popen, started: float) -> tuple[list[dict], float]:
    """Wait for a run -> (its metrics records, wall seconds)."""
    if proc.wait() != 0:
        raise SystemExit(f"training run {run_dir} failed (exit code {proc.returncode})")
    wall = time.perf_counter() - started
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()], wall


def variant(text: str) -> tuple[int, int]:
    rank, _, warmup = text.partition(":")
    return int(rank), int(warmup or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--variants", nargs="+", type=variant, default=[(4, 30)],
                        help="PowerSGD runs as RANK:WARMUP_STEPS (default 4:30: the tiny recipe's lr warmup)")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--parallel", action="store_true",
                        help="run the exact and PowerSGD trainings at the same time (the same results; less wall time "
                             "where cores are shared)")
    parser.add_argument("--out-dir", default=None, help="where powersgd_convergence.md and .json go (default "
                        "bench/results)")
    args = parser.parse_args()
    names = ["exact"] + [f"r{rank} w{warmup}" for rank, warmup in args.variants]
    runs = {}
    tmp = Path(tempfile.mkdtemp(prefix="powersgd_convergence_"))
    print(f"run directories: {tmp}", flush=True)
    pending = []
    for name, v in zip(names, [None] + args.variants):
        pending.append((name, tmp / name.replace(" ", "_"), *start(tmp / name.replace(" ", "_"), args, v)))
        if not args.parallel:
            runs[name] = finish(*pending.pop()[1:])
    for name, run_dir, proc, started in pending:
        runs[name] = finish(run_dir, proc, started)
    by_step: dict[int, dict] = {}
    summary = []
    for name, (records, wall) in runs.items():
        train_recs = [r for r in records if r["kind"] == "train"]
        for r in records:
            row = by_step.setdefault(r["step"], {"step": r["step"]})
            row[f"{name} {'loss' if r['kind'] == 'train' else 'val'}"] = r.get("loss", r.get("val_loss"))
        final = next(r["val_loss"] for r in reversed(records) if r["kind"] == "eval")
        last = train_recs[-1]
        summary.append({"run": name, "final_val": final, "wall_s": wall, "bytes": last.get("replicate_bytes"),
                        "bytes_uncompressed": last.get("replicate_bytes_uncompressed")})
    base = summary[0]["final_val"]
    for s in summary:
        s["relative_gap"] = s["final_val"] / base - 1
    rows = [by_step[s] for s in sorted(by_step)]
    full = summary[1]["bytes_uncompressed"]
    summary[0]["bytes"] = full
    lines = [f"{args.nproc} CPU processes (gloo) as dp_replicate 2 x dp_shard {args.nproc // 2}, {args.steps} steps "
             f"of `recipes/tiny.yaml` (AdamW, lr warmup 30 steps), the same seed and data in every run. PowerSGD "
             f"runs are named by rank r and uncompressed warmup steps w. loss: the training loss logged every "
             f"{args.every} steps (mean over the window); val: validation loss. Bytes: per rank and compressed "
             f"step on the replicate dimension ({full:,} uncompressed). Wall times are of a shared CPU, not a speed "
             "comparison.", "",
             "| run | final val loss | gap to exact | bytes per step | less than exact | wall s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for s in summary:
        within = "" if s["run"] == "exact" else (" (within" if abs(s["relative_gap"]) <= args.tolerance
                                                  else " (outside") + f" {args.tolerance:.0%})"
        lines.append(f"| {s['run']} | {s['final_val']:.4f} | {s['relative_gap']:+.2%}{within} | {s['bytes']:,} | "
                     f"{full / s['bytes']:.1f}x | {s['wall_s']:.0f} |")
    columns = [f"{n} {k}" for k in ("loss", "val") for n in names]
    lines += ["", "| step | " + " | ".join(columns) + " |", "| ---: |" + " ---: |" * len(columns)]
    for r in rows:
        lines.append(f"| {r['step']} | " + " | ".join("" if r.get(c) is None else f"{r[c]:.4f}" for c in columns)
                     + " |")
    write_results("powersgd_convergence", "PowerSGD convergence: tiny recipe, exact HSDP all-reduce vs PowerSGD",
                  "\n".join(lines), {"args": {**vars(args)}, "summary": summary, "rows": rows},
                  out_dir=args.out_dir, device=f"CPU ({platform.machine()}, {os.cpu_count()} cores)")
    print("\n".join(lines))
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
