"""FAL vs standard blocks on one GPU: the whole training step of the same model with each block kind, through
`bench/step.py`'s machinery (one child process per row, the trainer's own step, the same synthetic documents and
initial weights for every row of a config).

Rows per config (`small-64k`, `v2lite6-64k` of `bench/step.py`; moela with MTP off, bf16 experts, compiled
blocks without CUDA graphs):
  standard        pre-norm blocks: attention, then the MLP on the updated stream
  fal             First Attentions Last: attention and MLP read the same input, run one after the other
  fal+streams     fal with `parallel.fal_streams: true`: each block's MLP on a second CUDA stream beside its
                  attention (`moela.model.streams`); the FAL speedup on one GPU comes from this overlap
  fal_plus        FAL+: standard blocks plus the first attention's output in the MLP input (no overlap possible)
Reported per row: tokens/s (median step), step ms, ratio to the config's standard row, MFU, GPU-busy share, peak
memory, the first step's loss (the block kinds are different models: the losses differ; fal and fal+streams must
agree closely).

Usage (GPU): python bench/fal.py [--configs small-64k,v2lite6-64k] [--variants standard,fal,fal+streams,fal_plus]
             (CPU smoke run): python bench/fal.py --device cpu --configs tiny --variants standard,fal --quick
Writes bench/results/fal.md and fal.json (`--out-dir`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_io import add_out_dir, write_results  # noqa: E402
from bench.step import CONFIGS, STEPS, plan_rows, run_rows  # noqa: E402

VARIANTS = {
    "standard": ["model.block=standard"],
    "fal": ["model.block=fal"],
    "fal+streams": ["model.block=fal", "parallel.fal_streams=true"],
    "fal_plus": ["model.block=fal_plus"],
}


def render(rows: list[dict]) -> str:
    lines = ["Columns: `bench/fal.py`.", "",
             "| config | block | tok/s | step ms | vs standard | MFU | busy | peak GiB | loss@1 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = {r["config"]: r["tokens_per_s"] for r in rows if r["impl"] == "standard" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['impl']} | {r['error'][:200]} | | | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base[r['config']]:.3f}x" if r["config"] in base else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        busy = f"{100 * r['busy']:.1f}%" if r.get("busy") is not None else "-"
        lines.append(f"| {r['config']} | {r['impl']} | {r['tokens_per_s']:,.0f} | {r['step_ms_median']:.1f} | "
                     f"{ratio} | {mfu} | {busy} | {r['peak_gib']:.1f} | {r['first_step_loss']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="small-64k,v2lite6-64k")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true")
    add_out_dir(ap)
    ap.add_argument("--row-timeout-s", type=float, default=300.0)
    ap.add_argument("--budget-s", type=float, default=900.0)
    args = ap.parse_args()
    configs, variants = args.configs.split(","), args.variants.split(",")
    for kind, given, known in (("config", configs, CONFIGS), ("variant", variants, VARIANTS)):
        bad = [g for g in given if g not in known]
        if bad:
            sys.exit(f"bench/fal.py: unknown {kind} {', '.join(bad)}; choose from {', '.join(known)}")
    counts = dict(STEPS["quick" if args.quick else "default"], sync_steps=0)
    log_dir = Path(tempfile.mkdtemp(prefix="moela_fal_"))
    specs = []
    for spec in plan_rows(configs, ["moela-nomtp"], ["bf16"], args.device, counts, str(log_dir / "run")):
        for name in variants:
            # compiled, not graphed: the committed FAL rows ran so, and a second stream inside a captured graph
            # (fal_streams) has not been measured
            specs.append(spec | {"label": name,
                                 "overrides": spec["overrides"] + VARIANTS[name] + ["train.cuda_graphs=false"]})
    print(f"[fal] {len(specs)} rows, logs in {log_dir}", flush=True)
    rows = run_rows(specs, log_dir, args.row_timeout_s, args.budget_s)
    md = render(rows)
    device = next((r["device_name"] for r in rows if "device_name" in r), None)  # the rows ran in child processes
    write_results("fal", "FAL vs standard blocks, one GPU", md, rows, out_dir=args.out_dir,
                  device=device or ("CPU" if args.device == "cpu" else None))
    print(md)


if __name__ == "__main__":
    main()
