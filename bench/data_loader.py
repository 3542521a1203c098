"""Data pipeline benchmark on the bundled corpus: token-cache build, packing efficiency, per-step loader latency.

    python bench/data_loader.py [--out-dir DIR]    # writes bench/results/data_loader.md and .json

Packing is compared side by side with two baselines on the same shuffled pieces: sequential greedy packing (one
open micro-batch, what a simple concatenating loader does without cutting documents) and offline best-fit
decreasing (sorts the whole epoch; a near-optimal bound that a streaming loader cannot use because it destroys
the shuffle). Fill = tokens / (micro-batches x budget): the fraction of each micro-batch's budget holding tokens.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.results_io import add_out_dir, write_results  # noqa: E402
from moela.data import DataConfig, build_loaders, load_tokenizer  # noqa: E402
from moela.data.build import build_or_load_cache  # noqa: E402
from moela.data.packing import pack, split_into_pieces  # noqa: E402
from moela.data.sources import BUNDLED_CORPUS, DocumentSource  # noqa: E402


def timed(fn, repeat=1):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_dir(ap)
    args = ap.parse_args()
    lines = [f"Python {platform.python_version()}; corpus {BUNDLED_CORPUS.name} "
             f"({BUNDLED_CORPUS.stat().st_size / 1e6:.2f} MB)", ""]
    tok = load_tokenizer()
    cache_root = tempfile.mkdtemp(prefix="moela-bench-")
    src = DocumentSource(DataConfig())
    build_s, cache = timed(lambda: build_or_load_cache(src, tok, cache_root, show_progress=False))
    reuse_s, _ = timed(lambda: build_or_load_cache(src, tok, cache_root, show_progress=False), 5)
    mb = BUNDLED_CORPUS.stat().st_size / 1e6
    payload = dict(cache=dict(docs=cache.num_docs, tokens=cache.num_tokens, build_s=build_s, reuse_s=reuse_s),
                   packing=[], next_step=[])
    lines += ["## Token cache", "", "| | time | throughput |", "|---|---:|---:|",
              f"| build (tokenize {cache.num_docs} docs, {cache.num_tokens} tokens) | {build_s:.2f} s | "
              f"{mb / build_s:.2f} MB/s, {cache.num_tokens / build_s / 1e6:.2f} M tokens/s |",
              f"| reuse (open existing cache) | {reuse_s * 1e3:.2f} ms | |", ""]

    lines += ["## Packing fill (the corpus' documents, cut at the budget, shuffled)", "",
              "| budget | pieces | best-fit, 16 open (moela) | sequential greedy | best-fit decreasing (offline) | "
              "moela pack time |", "|---:|---:|---:|---:|---:|---:|"]
    for budget in (1024, 4096, 16384):
        pieces = split_into_pieces(np.arange(cache.num_docs), cache.doc_lengths, budget)[2]  # [P] lengths
        lengths = pieces[np.random.default_rng(0).permutation(len(pieces))]
        pack_s, ours = timed(lambda: pack(lengths, budget), 3)
        greedy = pack(lengths, budget, max_open=1)
        offline = pack(np.sort(lengths)[::-1], budget, max_open=len(lengths))
        fill = [float(lengths.sum() / (len(b) * budget)) for b in (ours, greedy, offline)]
        payload["packing"].append(dict(budget=budget, pieces=len(lengths), fill_moela=fill[0], fill_greedy=fill[1],
                                       fill_offline=fill[2], pack_ms=pack_s * 1e3))
        lines.append(f"| {budget} | {len(lengths)} | {fill[0]:.2%} ({len(ours)} mb) | {fill[1]:.2%} ({len(greedy)} mb)"
                     f" | {fill[2]:.2%} ({len(offline)} mb) | {pack_s * 1e3:.1f} ms |")
    lines += ["", "## next_step() latency (this rank's micro-batches; layouts of the whole global step)", "",
              "| dp_size | grad_accum | budget | balance | ms / step (median of 30) |", "|---:|---:|---:|---|---:|"]
    for dp, ga, budget, balance in ((1, 1, 4096, False), (1, 8, 4096, False), (64, 8, 4096, False),
                                    (64, 8, 4096, True)):
        train, _, _ = build_loaders(DataConfig(cache_dir=cache_root, balance=balance), tokens_per_microbatch=budget,
                                    dp_size=dp, dp_rank=dp - 1, grad_accum=ga, show_progress=False)
        train.next_step()  # first epoch's packing happens here
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            train.next_step()
            times.append(time.perf_counter() - t0)
        ms = float(np.median(times) * 1e3)
        payload["next_step"].append(dict(dp_size=dp, grad_accum=ga, budget=budget, balance=balance, ms=ms))
        lines.append(f"| {dp} | {ga} | {budget} | {balance} | {ms:.2f} |")
    shutil.rmtree(cache_root)
    text = "\n".join(lines)
    write_results("data_loader", "Data pipeline benchmark", text, payload, out_dir=args.out_dir)
    print(text)


if __name__ == "__main__":
    main()
