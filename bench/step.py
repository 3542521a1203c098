"""Benchmark the whole training step on one device: moela's trainer against torchtitan and transformers.

Rows (implementations x configs x MoE recipes, run in that order), each in its own process so that a crash or an
out-of-memory error ends only its row:
  configs   small-16k    recipes/small.yaml with 16k tokens per micro-batch (2 rows of 8192), grad_accum 2: the same
                         32k tokens per optimizer step in two micro-batches (the recipe's setting before CUDA graphs)
            small-32k    recipes/small.yaml as shipped: 32k tokens per micro-batch (4 x 8192), grad_accum 1
            small-64k    the same model, 64k tokens per micro-batch (8 x 8192), grad_accum 1
            v2lite6-64k  DeepSeek-V2-Lite shapes (hidden 2048, 16 heads, no q LoRA, kv LoRA 512, 64 routed + 2
                         shared experts, top-6, expert FFN 1408, first layer dense, vocab 102400), 6 layers, 64k
            tiny         the tiny preset on 2 x 256 tokens, grad_accum 2 (the CPU smoke run)
  impls     moela         the trainer's own step (`Trainer.train_step`), the recipe as configured (MTP on where it
                          is: small has depth 1)
            moela-nomtp   the same with MTP off: the row the peers are compared with
            moela-nographs  the same with `train.cuda_graphs=false`: compiled blocks, every kernel launched by the
                          host (the `small` recipe graphs forward + backward, captured in the third step)
            moela-fp32-moments  the recipe with `optim.moment_dtype=float32` (torch's fused AdamW; `small` ships bf16
                          moments, moela's AdamW)
            moela-no-prebuild  moela without the helper process that builds its kernels beside the first step's
                          compile (`train.prebuild_kernels=false`; moela.trainer.prebuild)
            moela-{fwd,dq,dkdv}-{triton,gluon}  moela on moela's attention kernels (`model.attention_backend=triton`)
                          with one phase's kernel named (`model.kernels.attention_forward`, `attention_dq`,
                          `attention_dkdv`), the others `auto`
            titan-compile, hf, titan-eager   the peers (bench/steplib/impls.py), MTP off, bf16 parameters
  recipes   bf16, fp8_blockwise (the routed experts in FP8), fp8 (`model.precision: fp8`: also every linear whose
            features tile, as ops inside the compiled blocks); FP8 rows are moela rows only (the peers have no FP8)
All rows of a config read the same synthetic packed documents (bench/steplib/source.py) and start from the same
weights. Per row: tokens/s (median step) and MFU (the trainer's formula), both again over a window of as many
steps synchronized once at its end (the trainer's pace, logging steps included), GPU-busy share, peak memory,
host syncs per step, time to the end of the first optimizer step (from process start / from model built, the
part of it torch.compile spent compiling, and the graphs it compiled), Dynamo recompilations after step 2, the
first-step loss (printed side by side per config), the kernel time by family and the kernels launched most often.
The time to the first step includes compilation with whatever the on-disk kernel caches hold (MOELA_CACHE_DIR:
Inductor's, Triton's, flash-attn-4's): the first row on a fresh machine pays the cold compile, later rows reuse the
kernels earlier rows built; `--cold` gives every row empty caches of its own, a cold first step on any machine.
`--steps N` sets the timed steps (three timed steps do not resolve differences under ~3%: A/B rows use 30, in both
row orders).

Usage (GPU):  python bench/step.py [--configs small-16k,small-64k,v2lite6-64k] [--impls ...] [--recipes ...]
                  [--quick] [--cold] [--out-dir bench/results] [--log-dir DIR]
      (CPU):  python bench/step.py --device cpu --quick
      (rows of several runs, each with its `source`):  python bench/step.py --report-only bench/results/step.json
Writes <out-dir>/step.md and <out-dir>/step.json through bench/results_io.write_results (the JSON's `results` is the
list of rows); each row's output goes to <log-dir>/<row>.log. torchtitan
0.3.0 must be importable for its rows (pip install --no-deps torchtitan==0.3.0 tyro spmd_types==0.2.3
docstring_parser typeguard typing_extensions); a row that cannot run says why in the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_io import add_out_dir, write_results  # noqa: E402
from bench.steplib.report import devices, render, render_sourced, sourced_versions  # noqa: E402

SMALL = str(ROOT / "recipes" / "small.yaml")
TINY = str(ROOT / "recipes" / "tiny.yaml")
CONFIGS = {
    "small-16k": dict(recipe=SMALL, rows=2, row_len=8192, median_doc_len=2048,
                      overrides=["train.tokens_per_microbatch=16384", "train.grad_accum=2"]),
    "small-32k": dict(recipe=SMALL, rows=4, row_len=8192, median_doc_len=2048, overrides=[]),
    "small-64k": dict(recipe=SMALL, rows=8, row_len=8192, median_doc_len=2048,
                      overrides=["train.tokens_per_microbatch=65536", "train.grad_accum=1"]),
    "v2lite6-64k": dict(recipe=SMALL, rows=8, row_len=8192, median_doc_len=2048,
                        overrides=["model.size=v2-lite", "model.num_hidden_layers=6",
                                   "train.tokens_per_microbatch=65536", "train.grad_accum=1",
                                   "train.cuda_graphs=false"]),  # GPU-bound (96% busy); graphs not measured here
    "tiny": dict(recipe=TINY, rows=2, row_len=256, median_doc_len=64,
                 overrides=["train.tokens_per_microbatch=512", "train.grad_accum=2"]),
}
# label -> the recipe overrides of a row timing one attention phase on one of moela's kernels
KERNEL_ROWS = {f"moela-{phase}-{kernel}": ["model.attention_backend=triton", f"model.kernels.attention_{key}={kernel}"]
               for phase, key in (("fwd", "forward"), ("dq", "dq"), ("dkdv", "dkdv")) for kernel in ("triton", "gluon")}
IMPLS = ("moela", "moela-nographs", "moela-fp32-moments", "moela-nomtp", "moela-no-prebuild", *KERNEL_ROWS,
         "titan-compile", "hf", "titan-eager")
MOELA_IMPLS = {"moela": [], "moela-nographs": ["train.cuda_graphs=false"],
               "moela-fp32-moments": ["optim.moment_dtype=float32"],
               "moela-nomtp": ["model.num_nextn_predict_layers=0"],
               "moela-no-prebuild": ["train.prebuild_kernels=false"], **KERNEL_ROWS}  # label -> recipe overrides
MOELA_ALL_RECIPES = ("moela", "moela-nographs", "moela-fp32-moments")  # bf16 and fp8 rows
RECIPES = ("bf16", "fp8_blockwise", "fp8")
RECIPE_OVERRIDES = {"bf16": ["model.moe_recipe=bf16"], "fp8_blockwise": ["model.moe_recipe=fp8_blockwise"],
                    "fp8": ["model.precision=fp8"]}
TITLE = "Whole training step: moela against torchtitan and transformers"
# warm-up: at least 3 steps, since a graphed row (`train.cuda_graphs`) captures in its third step
STEPS = {"default": dict(warmup=4, steps=6, profile_steps=2, sync_steps=1),
         "quick": dict(warmup=3, steps=3, profile_steps=1, sync_steps=1)}


def plan_rows(configs: list[str], impls: list[str], recipes: list[str], device: str, counts: dict,
              run_dir: str) -> list[dict]:
    """One spec per row, in run order: implementation by implementation (in `impls` order), each over the configs
    and, for moela, the recipes (the peers and moela-nomtp run bf16 only). A run that meets its time budget thus
    drops whole implementations from the end of the list, never a config's moela rows."""
    rows = []
    for impl in impls:
        for config in configs:
            c = CONFIGS[config]
            moela_recipes = impl in MOELA_ALL_RECIPES
            for recipe in recipes if moela_recipes else [r for r in recipes if r == "bf16"]:
                overrides = list(c["overrides"]) + RECIPE_OVERRIDES[recipe] + [
                    f"train.device={device}", f"train.run_dir={run_dir}",
                    "train.steps=1000", "train.eval_every=0", "checkpoint.every=0", "logging.progress_bar=never"]
                overrides += MOELA_IMPLS.get(impl, ["model.num_nextn_predict_layers=0"])
                rows.append({"config": config, "impl": "moela" if impl in MOELA_IMPLS else impl, "label": impl,
                             "recipe": recipe, "device": device, "recipe_path": c["recipe"],
                             "overrides": overrides, "rows": c["rows"], "row_len": c["row_len"],
                             "median_doc_len": c["median_doc_len"],
                             **counts})
    return rows


def _tail(path: Path, lines: int = 6) -> str:
    """A failed row's log in one line: its last exception line first (the table cuts long messages, and a traceback's
    last lines are often frames), then the last `lines` lines."""
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    tail = " | ".join(line.strip() for line in text[-lines:])
    raised = [line.strip() for line in text if re.match(r"[\w.]+(Error|Exception)\b", line.strip())]
    return f"{raised[-1][:300]} | {tail}" if raised else tail


CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR",
                   "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED")


def cold_env(env: dict, root: Path) -> dict:
    """`env` for a row whose kernel caches start empty: MOELA_CACHE_DIR a new directory `root`, and the variables
    that would point a cache elsewhere removed, so moela's defaults put every cache under it
    (`moela.ops.disk_caches`)."""
    out = {k: v for k, v in env.items() if k not in CACHE_VARIABLES}
    out["MOELA_CACHE_DIR"] = str(root)
    return out


def run_rows(specs: list[dict], log_dir: Path, row_timeout: float, budget: float, cold: bool = False) -> list[dict]:
    """Run each spec in a child process (`--row`), within `row_timeout` each and `budget` seconds in all; with
    `cold`, each with empty kernel caches of its own (`cold_env`)."""
    results, start = [], time.monotonic()
    for spec in specs:
        name = f"{spec['config']}_{spec['label']}_{spec['recipe']}"
        left = budget - (time.monotonic() - start)
        base = {k: spec[k] for k in ("config", "recipe")} | {"impl": spec["label"]}
        if left < 20:
            results.append(base | {"error": f"not run: the {budget:.0f} s budget was spent"})
            print(f"[step] {name}: skipped (budget)", flush=True)
            continue
        log, out = log_dir / f"{name}.log", log_dir / f"{name}.json"
        out.unlink(missing_ok=True)
        env = dict(os.environ, MOELA_BENCH_T0=repr(time.time()))
        if cold:
            env = cold_env(env, Path(tempfile.mkdtemp(prefix=f"caches_{name}_", dir=log_dir)))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--row", json.dumps(spec), "--row-out", str(out)]
        t = time.monotonic()
        with open(log, "w") as f:  # its own session: a timeout ends the row and its compile workers together
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
            try:
                rc = proc.wait(timeout=min(row_timeout, left))
                error = None if rc == 0 and out.exists() else f"exit code {rc}: {_tail(log)}"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                error = f"timed out after {min(row_timeout, left):.0f} s: {_tail(log)}"
        row = json.loads(out.read_text()) if error is None else base | {"error": error}
        row["row_wall_s"] = time.monotonic() - t
        results.append(row)
        print(f"[step] {name}: {row['row_wall_s']:.0f} s, " + (
            f"{row['tokens_per_s']:,.0f} tok/s" if "error" not in row else row["error"][:300]), flush=True)
    return results


def child(spec_json: str, out: str) -> None:
    from bench.steplib.row import run_row

    row = run_row(json.loads(spec_json))
    Path(out).write_text(json.dumps(row, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", help=f"comma list of {', '.join(CONFIGS)} (default: all but tiny on cuda, tiny "
                                      f"on cpu)")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    ap.add_argument("--recipes", help="comma list of bf16, fp8_blockwise, fp8 (default: bf16,fp8_blockwise on cuda, "
                                      "bf16 on cpu)")
    ap.add_argument("--device", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="fewer steps per row: a smoke run")
    for key in STEPS["default"]:
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"default {STEPS['default'][key]} "
                                                                    f"(--quick: {STEPS['quick'][key]})")
    ap.add_argument("--fp8-wgrad-impl", choices=("auto", "triton", "gluon"), default="auto",
                    help="the experts' FP8 weight-gradient GEMM in every row (the recipe override "
                         "model.kernels.moe_fp8_wgrad; auto: the shipped choice), to compare kernels inside the step")
    ap.add_argument("--cold", action="store_true",
                    help="every row starts with empty kernel caches of its own (a cold first step on any machine)")
    add_out_dir(ap)
    ap.add_argument("--report-only", metavar="STEP_JSON",
                    help="measure nothing: rebuild step.md and step.json from the rows of this file, each row with "
                         "the `source` of its run")
    ap.add_argument("--log-dir", help="per-row logs (default: a new temporary folder)")
    ap.add_argument("--row-timeout-s", type=float, default=300.0)
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="seconds for all rows: a row is cut at the budget's end and rows not started are reported "
                         "as not run (rerun them with --impls / --configs)")
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--row-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.row:
        return child(args.row, args.row_out)
    if args.report_only:
        return report_only(Path(args.report_only), args.out_dir)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/step.py: --device cuda but no CUDA device is visible; use --device cpu for the smoke run")
    configs = (args.configs or ("tiny" if device == "cpu" else "small-16k,small-64k,v2lite6-64k")).split(",")
    impls = args.impls.split(",")
    recipes = (args.recipes or ("bf16" if device == "cpu" else "bf16,fp8_blockwise")).split(",")
    for kind, given, known in (("config", configs, CONFIGS), ("impl", impls, IMPLS), ("recipe", recipes, RECIPES)):
        bad = [g for g in given if g not in known]
        if bad:
            sys.exit(f"bench/step.py: unknown {kind} {', '.join(bad)}; choose from {', '.join(known)}")
    counts = dict(STEPS["quick" if args.quick else "default"])
    for key in counts:
        if getattr(args, key) is not None:
            counts[key] = getattr(args, key)
    if counts["steps"] < 1 or counts["warmup"] < 2:
        sys.exit("bench/step.py: --steps must be >= 1 and --warmup >= 2 (steps 1 and 2 are the warm-up that "
                 "time the first step and anchor the recompilation count)")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="moela_step_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    specs = plan_rows(configs, impls, recipes, device, counts, str(log_dir / "run"))
    for spec in specs:
        spec["overrides"].append(f"model.kernels.moe_fp8_wgrad={args.fp8_wgrad_impl}")
    print(f"[step] {len(specs)} rows, logs in {log_dir}", flush=True)
    results = run_rows(specs, log_dir, args.row_timeout_s, args.budget_s, cold=args.cold)
    write(results, render(results, counts=counts), args.out_dir)


def write(rows: list[dict], body: str, out_dir: str, **versions: str) -> None:
    """step.md (the header and `body`) and step.json (the header and the rows); the device is the rows'."""
    print(write_results("step", TITLE, body, rows, out_dir=out_dir, device=devices(rows), **versions).read_text())


def read_rows(path: Path) -> list[dict]:
    """The rows of a step.json: the writer's `results`, or a bare list of rows."""
    data = json.loads(path.read_text())
    return data["results"] if isinstance(data, dict) else data


def report_only(path: Path, out_dir: str) -> None:
    """Rebuild the report from rows gathered from several runs; the header names the rows' device and versions."""
    rows = read_rows(path)
    unsourced = [f"{r['config']} {r['impl']} {r['recipe']}" for r in rows if "source" not in r]
    if unsourced:
        sys.exit(f"bench/step.py: --report-only needs every row's `source` (what, date, commit, command); "
                 f"{path} lacks it for {', '.join(unsourced)}")
    write(rows, render_sourced(rows), out_dir, **sourced_versions(rows))


if __name__ == "__main__":
    main()
