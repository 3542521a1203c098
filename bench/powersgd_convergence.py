"""Convergence of PowerSGD on the replicate dimension: the tiny recipe trained with HSDP's exact all-reduce and with
rank-r PowerSGD, same seed, data and layout, side by side.

Each run is `train.py recipes/tiny.yaml` under torchrun on `--nproc` CPU processes (gloo) laid out as
dp_replicate = 2 x dp_shard = nproc / 2; the script reads both runs' metrics.jsonl and reports the training loss
(the logged window means) and the validation loss every `--every` steps, the bytes per step on the replicate
dimension, and whether the final validation loss of PowerSGD is within `--tolerance` of the exact run's.

Usage: python bench/powersgd_convergence.py [--steps 300] [--every 25] [--rank 4] [--warmup 0] [--nproc 4]
Writes bench/results/powersgd_convergence.md and .json (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def train(run_dir: Path, args, compressed: bool) -> tuple[list[dict], float]:
    """One torchrun training run -> (its metrics records, wall seconds)."""
    overrides = [f"train.steps={args.steps}", f"train.run_dir={run_dir}", "parallel.dp_replicate=2",
                 f"logging.log_every={args.every}", f"train.eval_every={args.every}", "logging.progress_bar=never",
                 "logging.plot=false", "checkpoint.every=0", "checkpoint.save_at_end=false"]
    if compressed:
        overrides += ["parallel.replicate_compression=powersgd", f"parallel.powersgd_rank={args.rank}",
                      f"parallel.powersgd_warmup_steps={args.warmup}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(ROOT / "train.py"), str(ROOT / "recipes" / "tiny.yaml"), *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()], time.perf_counter() - start


def header(command: str) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return (f"Commit {commit}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, CPU "
            f"({platform.machine()}, {os.cpu_count()} cores), torch {torch.__version__}, triton {triton_version}. "
            f"Command: `{command}`.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=0, help="parallel.powersgd_warmup_steps")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "powersgd_convergence"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exact, exact_s = train(Path(tmp) / "exact", args, compressed=False)
        psgd, psgd_s = train(Path(tmp) / "powersgd", args, compressed=True)
    by_step = {}
    for name, records in (("exact", exact), ("powersgd", psgd)):
        for r in records:
            row = by_step.setdefault(r["step"], {"step": r["step"]})
            if r["kind"] == "train":
                row[f"{name}_loss"] = r["loss"]
                if name == "powersgd":
                    row["bytes"] = r["replicate_bytes"]
                    row["bytes_uncompressed"] = r["replicate_bytes_uncompressed"]
            elif r["kind"] == "eval":
                row[f"{name}_val"] = r["val_loss"]
    rows = [by_step[s] for s in sorted(by_step)]
    final = [next(r["val_loss"] for r in reversed(recs) if r["kind"] == "eval") for recs in (exact, psgd)]
    gap = final[1] / final[0] - 1
    command = "python bench/powersgd_convergence.py " + " ".join(sys.argv[1:])
    head = header(command)
    last = rows[-1]
    lines = ["# PowerSGD convergence: tiny recipe, exact HSDP all-reduce vs PowerSGD", "", head, "",
             f"{args.nproc} CPU processes (gloo) as dp_replicate 2 x dp_shard {args.nproc // 2}, {args.steps} steps, "
             f"PowerSGD rank {args.rank}, {args.warmup} uncompressed warmup steps. Loss: the training loss logged "
             f"every {args.every} steps (mean over the window); val: validation loss. Replicate bytes per rank and "
             f"step (compressed steps): {last['bytes']:,} vs {last['bytes_uncompressed']:,} uncompressed "
             f"({last['bytes_uncompressed'] / last['bytes']:.1f}x less). Wall time: exact {exact_s:.0f} s, "
             f"PowerSGD {psgd_s:.0f} s (shared CPU: not a speed comparison).", "",
             f"Final validation loss: exact {final[0]:.4f}, PowerSGD {final[1]:.4f}, relative gap {gap:+.2%} "
             f"({'within' if abs(gap) <= args.tolerance else 'outside'} the {args.tolerance:.0%} tolerance).", "",
             "| step | loss exact | loss PowerSGD | val exact | val PowerSGD |", "| ---: | ---: | ---: | ---: | ---: |"]
    fmt = lambda v: "" if v is None else f"{v:.4f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['step']} | {fmt(r.get('exact_loss'))} | {fmt(r.get('powersgd_loss'))} | "
                     f"{fmt(r.get('exact_val'))} | {fmt(r.get('powersgd_val'))} |")
    out = Path(args.out)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"header": head, "args": vars(args), "final_val": final,
                                                    "relative_gap": gap, "wall_s": [exact_s, psgd_s],
                                                    "rows": rows}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
