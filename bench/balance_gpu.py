"""Measured step time of a multi-rank run with and without the cost-balanced DP sampler, on long documents.

The same training run (the `small` preset through `recipes/multi_gpu.yaml`, the same seed, hence the same global
micro-batches every step) is launched with `torchrun` with `data.balance=false` and `data.balance=true`,
alternating (`--repeats` times each) so that drift in the machine hits both alike. Only the assignment of
micro-batches to ranks differs. Each run's `metrics.jsonl` gives per-step `step_time_s` and the loader's
imbalance (max/mean rank cost, before and after balancing); the first `--warmup` steps are dropped and the
median step time of the rest is compared.

Long documents mixed with short ones (what makes equal-token micro-batches unequal work): the bundled corpus's
texts (in order, cycling) are cut into synthetic documents; a fraction `--long-frac` (default 2%) of them have
length uniform in [budget/4, budget] tokens, the rest log-normal with median 800 tokens and sigma 1.0, clipped
to [16, budget] (3.3 characters per token assumed). With the defaults about a quarter of the tokens sit in the
long documents. The report's imbalance columns are the cost model's prediction for the run's own
micro-batches (the loader's max/mean rank cost), next to the measured step times. The file is written once to
`--work-dir`.

Expected device time with the defaults: about 1-2 minutes per run on two H200s, 4 runs, plus tokenization.

The script launches `torchrun --standalone --nproc_per_node=NPROC train.py recipes/multi_gpu.yaml ...` itself
(NCCL on GPUs; `parallel.ep=2` from the recipe), so it is started with plain python:
  2 GPUs:          python bench/balance_gpu.py              # writes bench/results/balance_gpu.md and .json
  4 GPUs:          python bench/balance_gpu.py --nproc 4    # the same files (`--out-dir` to keep both)
  CPU smoke test:  python bench/balance_gpu.py --smoke      # tiny model, gloo, 2 ranks; writes to --work-dir
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.results_io import add_out_dir, write_results  # noqa: E402

CORPUS = ROOT / "moela" / "data" / "corpus" / "shakespeare.jsonl"
CHARS_PER_TOKEN = 3.3


def write_documents(path: Path, n_docs: int, budget: int, long_frac: float, seed: int) -> dict:
    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines() if line.strip()]
    rng = np.random.default_rng(seed)
    short = np.clip(np.exp(rng.normal(math.log(800), 1.0, size=n_docs)), 16, budget)
    long_ = rng.uniform(budget / 4, budget, size=n_docs)
    is_long = rng.random(n_docs) < long_frac  # [n_docs] drawn from the long-document branch
    targets = np.where(is_long, long_, short).astype(np.int64)
    stream = "\n\n".join(texts)
    cursor = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for target in targets:
            n_chars = int(target * CHARS_PER_TOKEN)
            text = (stream[cursor:] + stream)[:n_chars]
            cursor = (cursor + n_chars) % len(stream)
            f.write(json.dumps({"text": text}) + "\n")
    long_tokens = float(targets[is_long].sum())
    return {"docs": n_docs, "long_docs": int(is_long.sum()),
            "long_token_share": long_tokens / float(targets.sum()), "median_tokens": float(np.median(targets))}


def run(args, balance: bool, repeat: int, data: Path) -> list[dict]:
    run_dir = Path(args.work_dir) / f"run-balance{int(balance)}-{repeat}"
    overrides = [
        "data.source=jsonl", f"data.paths=[{data}]", f"data.balance={str(balance).lower()}", "data.max_doc_len=null",
        "data.val_fraction=0.001", "data.val_max_tokens=8192",
        f"train.tokens_per_microbatch={args.budget}", f"train.grad_accum={args.grad_accum}",
        f"train.steps={args.steps}", "train.eval_every=0", "train.eval_batches=1", f"train.run_dir={run_dir}",
        "checkpoint.every=0", "checkpoint.save_at_end=false", "checkpoint.resume=none",
        "logging.log_every=1", "logging.plot=false", "logging.progress_bar=never",
    ]
    if args.smoke:
        overrides += ["model.size=tiny", "model.vocab_size=4096", "parallel.ep=1", "train.device=cpu",
                      "train.precision=fp32", "train.cpu_threads=1"]
    cmd = ["torchrun", "--standalone", f"--nproc_per_node={args.nproc}", str(ROOT / "train.py"),
           str(ROOT / "recipes" / "multi_gpu.yaml")] + overrides
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


def summarize(records: list[dict], warmup: int) -> dict:
    steady = [r for r in records if r["step"] > warmup] or records
    return {"step_time_s": statistics.median(r["step_time_s"] for r in steady),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "imb_before": statistics.mean(r.get("dp_imbalance_unbalanced", float("nan")) for r in steady),
            "imb_after": statistics.mean(r.get("dp_imbalance", float("nan")) for r in steady),
            "steps": len(steady)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--budget", type=int, default=32768, help="tokens per micro-batch")
    ap.add_argument("--grad-accum", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--long-frac", type=float, default=0.02, help="fraction of long documents")
    ap.add_argument("--docs", type=int, default=6000)
    ap.add_argument("--work-dir", default="/tmp/moela_balance_gpu")
    add_out_dir(ap)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU with gloo, a few small steps")
    args = ap.parse_args()
    if args.smoke:
        args.budget, args.grad_accum, args.steps, args.warmup, args.repeats = 2048, 4, 3, 1, 1
        args.docs = 300
        args.out_dir = args.work_dir
    data = Path(args.work_dir) / f"docs-{args.budget}.jsonl"
    info = write_documents(data, args.docs, args.budget, args.long_frac, seed=0)
    results: dict[bool, list[dict]] = {False: [], True: []}
    for repeat in range(args.repeats):
        for balance in (False, True):
            results[balance].append(summarize(run(args, balance, repeat, data), args.warmup))
    import torch
    device = f"{args.nproc} x {torch.cuda.get_device_name(0)}" if not args.smoke else f"{args.nproc} CPU processes"
    base = statistics.median(r["step_time_s"] for r in results[False])
    bal = statistics.median(r["step_time_s"] for r in results[True])
    lines = [
        f"`recipes/multi_gpu.yaml`{' (smoke: tiny model on CPU)' if args.smoke else ''}, {args.budget} tokens per "
        f"micro-batch, grad_accum {args.grad_accum}, {args.steps} steps (first {args.warmup} dropped); "
        f"{info['docs']} synthetic documents (median {info['median_tokens']:.0f} tokens), {info['long_docs']} of them "
        f"long ({100 * info['long_token_share']:.0f}% of the tokens; see the script). Imbalance = max/mean rank "
        f"cost per the loader's cost model.",
        "",
        "| sampler | run | median step s | tokens/s | imbalance before | imbalance after |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for balance in (False, True):
        for i, r in enumerate(results[balance]):
            lines.append(f"| {'balanced' if balance else 'round robin'} | {i} | {r['step_time_s']:.3f} | "
                         f"{r['tokens_per_s']:.0f} | {r['imb_before']:.3f} | {r['imb_after']:.3f} |")
    lines += ["", f"Median step time: round robin {base:.3f} s, balanced {bal:.3f} s: gain {base / bal:.3f}x."]
    payload = dict(nproc=args.nproc, smoke=args.smoke, budget=args.budget, grad_accum=args.grad_accum,
                   steps=args.steps, warmup=args.warmup, documents=info,
                   runs={"round_robin": results[False], "balanced": results[True]}, gain=base / bal)
    write_results("balance_gpu", f"{args.nproc}-rank step time with and without the cost-balanced DP sampler",
                  "\n".join(lines), payload, out_dir=args.out_dir, device=device)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
