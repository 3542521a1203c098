"""Data at pretraining scale on CPU: parallel tokenization against Hugging Face `datasets.map`, time to the first
step with and without stream_start, loader host memory at 1M and 10M documents, Megatron source read speed.

    python bench/data.py [--mb 64] [--workers 1 2] [--docs 1000000 10000000]   # bench/results/data.md + .json

Corpus: generated, seeded and documented here: documents are runs of 1-40 consecutive lines taken at random
positions of the bundled Shakespeare corpus (public domain; moela/data/corpus/SOURCE.md), with 30% of the words
replaced by words drawn (Zipf, s=1.1) from a lexicon of 300k synthetic words built from syllables (a stand-in for
the names and rare words of web text, which gives a BPE room for a 100k+ vocabulary), written as jsonl files of
about 16 MB. Tokenizers: the bundled 4k byte-level BPE, and a 100,352-token byte-level BPE trained here with
`tokenizers`' BpeTrainer on the first 24 MB of the corpus (nothing downloads).

Each side runs in this process's machine with the same files, the same tokenizer and one core per worker
(TOKENIZERS_PARALLELISM=false everywhere): moela's cache build with `data.tokenize_workers` = N, against
`datasets.load_dataset("json")` + `.map(batched=True, num_proc=N)` writing the ids to Arrow (its time is reported
with and without the load step, which converts the jsonl to Arrow first). Times to the first step run in a fresh
process each (imports excluded), from an empty cache. Loader memory: a synthetic cache of N documents (lengths 1-64
tokens, mean 32; shards of 250k documents, about 32 MB of text each), then a fresh process per row reports the growth
of its peak RSS (after imports) while building the training loader (stream.py) and taking 5 steps (dp_size 8,
grad_accum 4, 4096 tokens per micro-batch), i.e. per rank: over the complete cache (data.stream_start: false), and
over the shards as stream_start sees them.

    python bench/data.py --memory-only [--docs ...]   # re-measures the memory rows only; the other sections are
                                                      # kept from the committed data.json, with the command that
                                                      # made them
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.results_io import add_out_dir, write_results  # noqa: E402
from moela.data import DataConfig, build_loaders, load_tokenizer  # noqa: E402
from moela.data.build import build_or_load_cache  # noqa: E402
from moela.data.sources import BUNDLED_CORPUS, DocumentSource  # noqa: E402

FILE_BYTES = 16 << 20
SYLLABLES = ["ka", "lo", "mi", "ran", "te", "vor", "sha", "qui", "bel", "dun", "ix", "os", "tra", "em", "zu", "phe"]


def generate_corpus(out: Path, total_bytes: int, seed: int = 0) -> list[Path]:
    rng = random.Random(seed)
    lines = [json.loads(x)["text"] for x in BUNDLED_CORPUS.read_text().splitlines()]
    lines = [line for text in lines for line in text.split("\n") if line.strip()]
    lexicon = sorted({"".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 5))) for _ in range(400_000)})
    rng.shuffle(lexicon)
    lexicon = lexicon[:300_000]
    zipf = np.random.default_rng(seed).zipf(1.1, size=4_000_000) % len(lexicon)
    z = 0
    files, written, f, size = [], 0, None, 0
    while written < total_bytes:
        if f is None or size >= FILE_BYTES:
            if f is not None:
                f.close()
            files.append(out / f"part-{len(files):04d}.jsonl")
            f, size = open(files[-1], "w"), 0
        start = rng.randrange(len(lines))
        words = " ".join(lines[start:start + rng.randint(1, 40)]).split(" ")
        for i in range(len(words)):
            if rng.random() < 0.3:
                words[i] = lexicon[zipf[z % len(zipf)]]
                z += 1
        record = json.dumps({"text": " ".join(words)}) + "\n"
        f.write(record)
        size += len(record)
        written += len(record)
    f.close()
    return files


def train_big_tokenizer(files: list[Path], out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    texts = (json.loads(line)["text"] for p in files[:max(1, (24 << 20) // FILE_BYTES)] for line in open(p))
    hf.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=100_352, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    out.mkdir(exist_ok=True)
    hf.save(str(out / "tokenizer.json"))
    return out


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (the workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def moela_build(files, tok, root, workers) -> dict:
    cfg = DataConfig(source="jsonl", paths=[str(f) for f in files])
    t0, c0 = time.perf_counter(), cpu_seconds()
    cache = build_or_load_cache(DocumentSource(cfg), tok, root, workers=workers, show_progress=False)
    seconds = time.perf_counter() - t0
    result = {"seconds": seconds, "cpu_seconds": cpu_seconds() - c0, "tokens": cache.num_tokens,
              "docs": cache.num_docs}
    shutil.rmtree(root)
    return result


def hf_map(files, tok, root, workers) -> dict:
    import datasets

    datasets.disable_progress_bars()
    hf = tok.hf
    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train", cache_dir=str(root))
    loaded, c0 = time.perf_counter(), cpu_seconds()
    mapped = ds.map(lambda b: {"ids": [e.ids + [0] for e in hf.encode_batch_fast(b["text"], add_special_tokens=False)]},
                    batched=True, num_proc=workers if workers > 1 else None, remove_columns=["text"])
    done, c1 = time.perf_counter(), cpu_seconds()
    tokens = sum(len(x) for batch in mapped.iter(batch_size=10000) for x in batch["ids"])
    shutil.rmtree(root, ignore_errors=True)
    return {"seconds": done - t0, "map_seconds": done - loaded, "map_cpu_seconds": c1 - c0, "tokens": tokens}


FIRST_STEP = """
import os, sys, time, json
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from moela.data import DataConfig, build_loaders
cfg = DataConfig(source="jsonl", paths={paths!r}, cache_dir={root!r}, tokenize_workers={workers},
                 shard_bytes={shard_bytes}, stream_start={stream}, tokenizer={tokenizer!r})
t0 = time.perf_counter()
train, _, _ = build_loaders(cfg, tokens_per_microbatch=4096, grad_accum=4, show_progress=False)
train.next_step()
print(json.dumps({{"seconds": time.perf_counter() - t0}}))
"""


def first_step(files, root, workers, stream, tokenizer, shard_bytes) -> float:
    code = FIRST_STEP.format(paths=[str(f) for f in files], root=str(root), workers=workers, stream=stream,
                             tokenizer=tokenizer, shard_bytes=shard_bytes)
    seconds = json.loads(python(code).splitlines()[-1])["seconds"]
    shutil.rmtree(root, ignore_errors=True)
    return seconds


SYNTHETIC = """
import numpy as np
from pathlib import Path
from moela.data.cache import ShardWriter, finish_cache
n, path, per_shard = {n}, Path({path!r}), 250_000
path.mkdir(parents=True, exist_ok=True)
shards = -(-n // per_shard)
rng = np.random.default_rng(0)
for i in range(shards):
    lengths = rng.integers(1, 65, size=min(per_shard, n - i * per_shard))
    w = ShardWriter(path, i, np.uint16)
    w.write((np.arange(lengths.sum()) % 4000).astype(np.uint16))
    w.end_docs(lengths)
    w.commit()
finish_cache(path, "synthetic", shards, {{}})
"""

MEMORY = """
import json, types
from pathlib import Path
from moela.data.balance import round_robin_assign
from moela.data.cache import TokenCache
from moela.data.stream import ShardFeed, TrainLoader
kind, path = {kind!r}, Path({path!r})


def status_mib(key):
    line = next(x for x in open("/proc/self/status") if x.startswith(key))
    return int(line.split()[1]) / 1024


open("/proc/self/clear_refs", "w").write("5")  # the peak RSS restarts from the current RSS (after the imports)
base = status_mib("VmRSS")
common = dict(tokens_per_microbatch=4096, max_doc_len=None, dp_rank=3, dp_size=8, grad_accum=4, seed=0,
              shuffle=True, assign=round_robin_assign, cost_coefficients=(1.0, 1 / 4096), settings={{}},
              val_fraction=0.01, val_max_tokens=262144)
if kind == "prebuilt":
    store = TokenCache(path)
else:
    shards = len(list(path.glob("*.bin")))
    plan = types.SimpleNamespace(dir=path, key="synthetic", slices=[None] * shards, order=[],
                                 done=lambda i: True, complete=lambda: True)
    store = ShardFeed(plan, 4096, 1, 0, True)
loader = TrainLoader([store], [1.0], **common)
for _ in range(5):
    loader.next_step()
print(json.dumps({{"peak_growth_mib": status_mib("VmHWM") - base, "base_mib": base}}))
"""


def python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    if out.returncode:
        raise RuntimeError(out.stderr)
    return out.stdout


def loader_memory(docs: list[int], root: Path) -> dict:
    out = {}
    for n in docs:
        path = root / f"synthetic-{n}"
        python(SYNTHETIC.format(n=n, path=str(path)))
        for kind in ("prebuilt", "stream_start"):
            out[f"{kind} {n}"] = json.loads(python(MEMORY.format(kind=kind, path=str(path))).splitlines()[-1])
        shutil.rmtree(path)
    return out


def megatron_read(files, tok, root) -> dict:
    """Loader tokens/s over the same documents as a moela cache and as a Megatron .bin/.idx pair."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_data_megatron import write_megatron

    cfg = DataConfig(source="jsonl", paths=[str(f) for f in files[:2]], cache_dir=str(root / "c"))
    mega_cfg = DataConfig(source="megatron", paths=[str(root / "mega")])

    def loader(data_cfg):
        return build_loaders(data_cfg, tokens_per_microbatch=4096, grad_accum=8, show_progress=False)[0]

    cache = loader(cfg).stores[0]
    write_megatron(root / "mega", (cache.doc(i) for i in range(cache.num_docs)), np.uint16)
    out = {}
    for name, data_cfg in (("moela cache", cfg), ("megatron .bin/.idx", mega_cfg)):
        train = loader(data_cfg)
        train.next_step()
        t0, tokens = time.perf_counter(), 0
        while time.perf_counter() - t0 < 5.0:
            tokens += sum(b.num_tokens for b in train.next_step())
        out[name] = tokens / (time.perf_counter() - t0)
    a, b = loader(cfg), loader(mega_cfg)
    same = all(x.input_ids.tolist() == y.input_ids.tolist() for _ in range(20)
               for x, y in zip(a.next_step(), b.next_step()))
    return {"tokens_per_s": out, "same_batches": same, "docs": cache.num_docs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=64, help="generated corpus size in MB")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--docs", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--memory-only", action="store_true",
                        help="measure the loader memory only; keep the other sections of the committed data.json")
    add_out_dir(parser)
    args = parser.parse_args()
    if args.memory_only:
        committed = json.loads((ROOT / "bench" / "results" / "data.json").read_text())
        results = {**committed["results"], "memory": None, "kept_from": committed["header"]}
        work = Path(tempfile.mkdtemp(prefix="moela-bench-data-"))
        try:
            results["memory"] = loader_memory(args.docs, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    else:
        results = measure_all(args)
    body = render(results)
    write_results("data", "Data at pretraining scale", body, results, out_dir=args.out_dir)
    print(body)


def measure_all(args) -> dict:
    """Every section: tokenization beside datasets.map, time to the first step, loader memory, the Megatron source."""
    import datasets
    import tokenizers

    work = Path(tempfile.mkdtemp(prefix="moela-bench-data-"))
    results: dict = {"cores": len(os.sched_getaffinity(0)),
                     "versions": {"tokenizers": tokenizers.__version__, "datasets": datasets.__version__,
                                  "python": platform.python_version()}}
    try:
        files = generate_corpus(work, args.mb << 20)
        results["corpus_bytes"] = sum(f.stat().st_size for f in files)
        big = train_big_tokenizer(files, work / "big-tokenizer")
        toks = {"bundled (4,096)": load_tokenizer(), "trained BPE (100,352)": load_tokenizer(str(big))}
        results["tokenize"] = rows = []
        for name, tok in toks.items():
            for n in args.workers:
                m = moela_build(files, tok, work / "cache", n)
                h = hf_map(files, tok, work / "hf", n)
                rows.append({"tokenizer": name, "workers": n, "moela": m, "hf": h})
                print(rows[-1], flush=True)
        n = max(args.workers)
        shard_bytes = 8 << 20
        results["first_step"] = {name: first_step(files, work / "fs", n, stream, "bundled", shard_bytes)
                                 for name, stream in (("whole cache first", False), ("stream_start", True))}
        results["first_step_shard_bytes"] = shard_bytes
        print(results["first_step"], flush=True)
        results["memory"] = loader_memory(args.docs, work)
        print(results["memory"], flush=True)
        results["megatron"] = megatron_read(files, load_tokenizer(), work / "mega")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def render(r: dict) -> str:
    mb = r["corpus_bytes"] / 2**20
    lines = [f"{r['cores']} CPU cores available; " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + ".",
             "",
             f"Corpus: {mb:.0f} MB of generated jsonl (see the script's docstring for its origin). The machine's cores "
             f"are shared with other jobs, so times are noisy.", "",
             *([f"Only the loader memory section was measured by the command above; the other sections come from "
                f"`{r['kept_from']['command']}` at commit {r['kept_from']['commit'][:12]}, "
                f"{r['kept_from']['date']}.", ""] if "kept_from" in r else []),
             "## Tokenization (tokens/s; one core per worker)", "",
             "Wall-clock rates (tokens / elapsed s), and per CPU second (tokens / CPU s of the process and its "
             "workers: the per-core efficiency, less sensitive to the other jobs).", "",
             "| tokenizer | workers | tokens | moela | datasets.map | datasets load + map | moela / map | "
             "moela scaling vs 1 worker | moela per CPU s | map per CPU s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    one = {row["tokenizer"]: row["moela"]["tokens"] / row["moela"]["seconds"] for row in r["tokenize"]
           if row["workers"] == 1}
    for row in r["tokenize"]:
        m, h = row["moela"], row["hf"]
        rate = m["tokens"] / m["seconds"]
        scaling = rate / one[row["tokenizer"]] / row["workers"] if row["tokenizer"] in one else float("nan")
        lines.append(f"| {row['tokenizer']} | {row['workers']} | {m['tokens']:,} | {rate / 1e6:.2f} M | "
                     f"{h['tokens'] / h['map_seconds'] / 1e6:.2f} M | {h['tokens'] / h['seconds'] / 1e6:.2f} M | "
                     f"{rate / (h['tokens'] / h['map_seconds']):.2f}x | {scaling:.2f} of linear | "
                     f"{m['tokens'] / m['cpu_seconds'] / 1e6:.2f} M | "
                     f"{h['tokens'] / h['map_cpu_seconds'] / 1e6:.2f} M |")
    fs = r["first_step"]
    lines += ["", f"## Time to the first step from an empty cache ({max(row['workers'] for row in r['tokenize'])} "
              f"workers, bundled tokenizer, shards of {r['first_step_shard_bytes'] >> 20} MB)", "",
              "| | seconds |", "|---|---:|", *[f"| {k} | {v:.1f} |" for k, v in fs.items()], "",
              "## Loader host memory per rank (peak RSS growth building the loader + 5 steps)", "",
              "| loader | documents | MiB | bytes per document |", "|---|---:|---:|---:|"]
    for key, v in r["memory"].items():
        kind, docs = key.split()
        lines.append(f"| {kind} | {int(docs):,} | {v['peak_growth_mib']:.0f} | "
                     f"{v['peak_growth_mib'] * 2**20 / int(docs):.1f} |")
    mg = r["megatron"]
    lines += ["", f"## Megatron source ({mg['docs']:,} documents, same batches as the cache: {mg['same_batches']})", "",
              "| store | loader tokens/s (grad_accum 8 x 4096) |", "|---|---:|"]
    lines += [f"| {k} | {v / 1e6:.2f} M |" for k, v in mg["tokens_per_s"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
