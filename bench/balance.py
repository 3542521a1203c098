"""Data-parallel imbalance of packed micro-batches, round-robin vs `balanced_assign` (CPU, no model run).

For each document-length source, micro-batch budget, DP size and accumulation depth: draw a stream of
documents, cut them into pieces of at most the budget and pack them exactly as the loader does
(`moela.data.packing`), then for several optimizer steps take `dp * grad_accum` consecutive micro-batches and
assign them with round robin (the unbalanced baseline) and with `balanced_assign`. Cost of a micro-batch:
a * sum L + b * sum L^2 with (a, b) = `cost_coefficients` of a model preset (training FLOPs).

Reported per row (means over the steps):
- imbalance max/mean of the rank totals, before and after ("attn" columns: the b * sum L^2 part alone, the
  attention-cost imbalance);
- bound: a lower bound on max/mean for any assignment of these micro-batches, `grad_accum` per rank: the mean,
  and for k = 1..grad_accum, some rank holds k of the (k-1)*dp + 1 largest micro-batches (pigeonhole), so its
  total is at least their k smallest plus the grad_accum - k smallest micro-batches overall. What is left above
  it is the packing's granularity, not the assignment;
- implied step-time gain = sum over steps of max rank total, before / after (ranks synchronize once per step);
- lock-step gain: the same when ranks synchronize in every micro-step (FSDP), step time = sum_m max_r cost.

Document-length sources:
- `corpus`: lengths (tokens, EOS included) of the bundled corpus's 941 documents under the bundled tokenizer,
  drawn with replacement (the corpus holds 1.65M tokens, less than one step of the larger settings).
- `lognormal`: synthetic long tail, L = ceil(exp(N(ln 1500, 1.6^2))) clipped to [16, 2^20]: median 1.5k tokens,
  ~10% of documents above 11k, ~1% above 62k.

Usage: python bench/balance.py [--preset small] [--steps 8] [--out-dir DIR]  (bench/results/balance.md, .json)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.results_io import add_out_dir, write_results  # noqa: E402
from moela.data.balance import (  # noqa: E402
    balanced_assign,
    cost_coefficients,
    imbalance,
    lockstep_imbalance,
    microbatch_cost,
    rank_totals,
    round_robin_assign,
)
from moela.data.packing import MAX_OPEN_MICROBATCHES, pack, split_into_pieces  # noqa: E402
from moela.model.config import preset  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "moela" / "data" / "corpus" / "shakespeare.jsonl"


def corpus_lengths() -> np.ndarray:
    from moela.data.tokenizer import load_tokenizer
    tok = load_tokenizer("bundled")
    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines() if line.strip()]
    return np.array([len(ids) + 1 for ids in tok.encode_batch(texts)], dtype=np.int64)  # + EOS


def draw_lengths(source: str, n: int, rng: np.random.Generator, corpus: np.ndarray | None) -> np.ndarray:
    if source == "corpus":
        return rng.choice(corpus, size=n, replace=True)
    return np.clip(np.ceil(np.exp(rng.normal(math.log(1500), 1.6, size=n))), 16, 2 ** 20).astype(np.int64)


def micro_batches(source: str, budget: int, count: int, rng: np.random.Generator, corpus) -> list[list[int]]:
    """Piece lengths of `count` packed micro-batches (documents cut at the budget, best-fit packing)."""
    mean_len = float(np.mean(corpus)) if source == "corpus" else 1500 * math.exp(1.6 ** 2 / 2)
    out: list[list[int]] = []
    while len(out) < count:
        docs = draw_lengths(source, int(1.3 * (count - len(out) + 16) * budget / mean_len) + 64, rng, corpus)
        pieces = split_into_pieces(np.arange(len(docs)), docs, budget)[2].tolist()
        bins = pack(pieces, budget)
        out.extend([[pieces[i] for i in b] for b in bins[:-MAX_OPEN_MICROBATCHES]])  # the open bins: partly filled
    return out[:count]


def costs_of(batches: list[list[int]], a: float, b: float) -> tuple[list[float], list[float]]:
    """The loader's cost of each micro-batch, and its attention (b * sum L^2) part."""
    return [microbatch_cost(x, a, b) for x in batches], [microbatch_cost(x, 0.0, b) for x in batches]


def assignment_bound(costs: np.ndarray, dp: int, ga: int) -> float:
    """Lower bound on max/mean rank total over all assignments (module docstring)."""
    desc = np.sort(costs)[::-1]
    mean = desc.sum() / dp
    best = mean
    for k in range(1, ga + 1):
        m = (k - 1) * dp + 1
        best = max(best, desc[m - k:m].sum() + desc[::-1][:ga - k].sum())
    return best / mean


def run_row(source, budget, dp, ga, steps, a, b, corpus, seed) -> dict:
    rng = np.random.default_rng(seed)
    acc = {k: [] for k in ("before", "after", "attn_before", "attn_after", "bound", "lock_before", "lock_after")}
    max_before = max_after = lock_before = lock_after = 0.0
    t_assign = 0.0
    for _ in range(steps):
        full, attn = costs_of(micro_batches(source, budget, dp * ga, rng, corpus), a, b)
        rr = round_robin_assign(full, dp, ga)
        t0 = time.perf_counter()
        bal = balanced_assign(full, dp, ga)
        t_assign += time.perf_counter() - t0
        tb, ta = np.array(rank_totals(full, rr)), np.array(rank_totals(full, bal))
        mean = tb.mean()
        acc["before"].append(imbalance(full, rr))
        acc["after"].append(imbalance(full, bal))
        acc["attn_before"].append(imbalance(attn, rr))
        acc["attn_after"].append(imbalance(attn, bal))
        acc["bound"].append(assignment_bound(np.array(full), dp, ga))
        lb, la = lockstep_imbalance(full, rr), lockstep_imbalance(full, bal)
        acc["lock_before"].append(lb)
        acc["lock_after"].append(la)
        max_before += tb.max()
        max_after += ta.max()
        lock_before += lb * mean
        lock_after += la * mean
    row = {k: float(np.mean(v)) for k, v in acc.items()}
    row.update(source=source, budget=budget, dp=dp, ga=ga, gain=max_before / max_after,
               lock_gain=lock_before / lock_after, assign_ms=1e3 * t_assign / steps)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", help="model preset whose FLOP coefficients weigh the cost")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per row")
    ap.add_argument("--budgets", default="8192,32768,131072")
    ap.add_argument("--dp", default="8,64")
    ap.add_argument("--ga", default="4,16")
    add_out_dir(ap)
    args = ap.parse_args()
    a, b = cost_coefficients(preset(args.preset))
    corpus = corpus_lengths()
    rows = []
    for source in ("corpus", "lognormal"):
        for budget in (int(x) for x in args.budgets.split(",")):
            for dp in (int(x) for x in args.dp.split(",")):
                for ga in (int(x) for x in args.ga.split(",")):
                    rows.append(run_row(source, budget, dp, ga, args.steps, a, b, corpus,
                                        seed=zlib.crc32(f"{source}-{budget}-{dp}-{ga}".encode())))
                    r = rows[-1]
                    print(f"{source:9s} {budget:>7d} dp={dp:<3d} ga={ga:<3d} before {r['before']:.3f} after "
                          f"{r['after']:.3f} gain {r['gain']:.3f}", flush=True)
    lines = [
        "Numbers are FLOP-model costs, not timings (CPU only). "
        f"Cost = a*sum L + b*sum L^2 with the `{args.preset}` preset: a = {a:.4g}, b = {b:.4g} FLOPs "
        f"(attention equals the linear layers at L = a/b = {a / b:.0f} tokens). Corpus document lengths: "
        f"{len(corpus)} documents, median {int(np.median(corpus))}, max {int(corpus.max())} tokens. "
        f"Means over {args.steps} steps per row. imb = max/mean rank cost; attn = the same for the b*sum L^2 part; "
        "bound = pigeonhole lower bound on imb for any assignment (see the script's docstring); gain = implied "
        "step-time gain (sum of per-step max rank cost, before/after); lock-step = ranks synchronizing in every "
        "micro-step (FSDP).",
        "",
        "| source | budget | DP | accum | imb before | imb after | attn before | attn after | bound | gain "
        "| lock-step before | lock-step after | lock-step gain | assign ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['source']} | {r['budget'] // 1024}k | {r['dp']} | {r['ga']} | {r['before']:.3f} | "
                     f"{r['after']:.3f} | {r['attn_before']:.3f} | {r['attn_after']:.3f} | {r['bound']:.3f} | "
                     f"{r['gain']:.3f}x | {r['lock_before']:.3f} | {r['lock_after']:.3f} | {r['lock_gain']:.3f}x | "
                     f"{r['assign_ms']:.1f} |")
    write_results("balance", "DP cost balancing: round robin vs balanced_assign", "\n".join(lines),
                  dict(preset=args.preset, a=a, b=b, steps=args.steps, rows=rows), out_dir=args.out_dir)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
