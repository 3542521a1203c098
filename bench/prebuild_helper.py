"""The kernel prebuild helper on its own (`moela/trainer/prebuild.py`): for each config, the helper process the
trainer would start, run alone on an empty kernel cache and then again on the cache it filled, with its phase
lines, its wall time and its peak GPU memory against the cap it runs under (`prebuild.MEMORY_FRACTION` of the
device).

Why: the helper shares the GPU with a trainer that is building its model and starting its first step, so it caps
its own memory; a helper that needs more than the cap fails (the trainer logs it and builds the kernels itself).
This measures whether the cap holds at each config's shapes, and how long the helper needs, which must be less than
the trainer's torch.compile for its builds to arrive in time.

Usage:  python bench/prebuild_helper.py [--device cuda] [--configs small-64k,v2lite6-64k]
            [--recipes bf16,fp8_blockwise] [--out-dir DIR]
On CUDA it writes bench/results/prebuild_helper.md and .json. On CPU (`--device cpu`, the default without CUDA) it
runs the `tiny` config: the same code path, no memory figure; printed, written only with `--out-dir`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_io import RESULTS, add_out_dir, write_results  # noqa: E402
from bench.step import CONFIGS, RECIPE_OVERRIDES  # noqa: E402
from moela.config import dump_config, load_config  # noqa: E402
from moela.trainer import prebuild  # noqa: E402

PEAK = re.compile(r"peak ([0-9.]+) GiB")
DONE_TIME = re.compile(r"in ([0-9.]+) s from the helper's start")


def run_helper(config: str, recipe: str, device: str, cache_dir: Path) -> dict:
    """One helper process on `config` x `recipe`, with `cache_dir` as MOELA_CACHE_DIR; its output and figures."""
    c = CONFIGS[config]
    overrides = list(c["overrides"]) + RECIPE_OVERRIDES[recipe] + [f"train.device={device}"]
    cfg = load_config(c["recipe"], overrides)
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="prebuild-bench-")
    with os.fdopen(fd, "w") as f:
        f.write(dump_config(cfg))  # the helper deletes its recipe file, as it does the trainer's temporary copy
    env = dict(os.environ, MOELA_CACHE_DIR=str(cache_dir), TRITON_CACHE_AUTOTUNING="0")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "moela.trainer.prebuild", path, device], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - started
    Path(path).unlink(missing_ok=True)
    out = proc.stdout + proc.stderr
    peak = PEAK.search(out)
    done = DONE_TIME.search(out)
    return dict(config=config, recipe=recipe, rc=proc.returncode, wall_s=wall,
                done_s=float(done.group(1)) if done else None, peak_gib=float(peak.group(1)) if peak else None,
                log=out.strip().splitlines()[-12:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    import torch
    cuda = torch.cuda.is_available()
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--configs", default=None)
    p.add_argument("--recipes", default="bf16")
    add_out_dir(p, default=None)
    args = p.parse_args()
    out_dir = args.out_dir or (RESULTS if args.device.startswith("cuda") else None)
    configs = (args.configs or ("small-64k,v2lite6-64k" if args.device.startswith("cuda") else "tiny")).split(",")
    recipes = args.recipes.split(",")
    for name in configs:
        if name not in CONFIGS:
            sys.exit(f"unknown config {name!r}: one of {', '.join(CONFIGS)}")
    for r in recipes:
        if r not in RECIPE_OVERRIDES:
            sys.exit(f"unknown recipe {r!r}: one of {', '.join(RECIPE_OVERRIDES)}")
    cap = None
    if args.device.startswith("cuda"):
        total = torch.cuda.get_device_properties(torch.device(args.device)).total_memory
        cap = prebuild.MEMORY_FRACTION * total / 2**30
    rows = []
    for config in configs:
        for recipe in recipes:
            with tempfile.TemporaryDirectory(prefix="prebuild-cache-") as cache:
                for cache_state in ("empty", "filled"):
                    r = run_helper(config, recipe, args.device, Path(cache))
                    r["cache"] = cache_state
                    rows.append(r)
                    print(f"{config} {recipe} cache {cache_state}: rc {r['rc']}, done {r['done_s']} s, "
                          f"wall {r['wall_s']:.1f} s, peak {r['peak_gib']} GiB", flush=True)
                    for line in r["log"]:
                        print("    " + line, flush=True)
    lines = [(f"The helper's memory cap: {prebuild.MEMORY_FRACTION} of the device = {cap:.1f} GiB." if cap
              else "On the CPU: no memory cap."), "",
             "| config | recipe | cache | exit | step done, s from the helper's start | wall s | peak GiB |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['recipe']} | {r['cache']} | {r['rc']} | {r['done_s']} | "
                     f"{r['wall_s']:.1f} | {r['peak_gib']} |")
    lines += ["", "The helper's last lines, per row:", ""]
    for r in rows:
        lines.append(f"{r['config']} {r['recipe']}, cache {r['cache']}:")
        lines += ["    " + line for line in r["log"]]
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if out_dir is not None:
        device = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "CPU"
        write_results("prebuild_helper", "The prebuild helper alone", text, dict(cap_gib=cap, rows=rows),
                      out_dir=out_dir, device=device)


if __name__ == "__main__":
    main()
