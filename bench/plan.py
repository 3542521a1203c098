"""`moela plan` against what is measured and what is published: the plan's one-GPU peak memory beside the measured
peaks of bench/step.py rows, its compute model's cross-check, the fake world's per-rank bytes at full size, and
its predictions beside the published cluster runs (BENCHMARKS.md, "Published runs at cluster scale").

Sections of bench/results/plan.md (+ plan.json):
1. Memory calibration: every moela row of bench/step.py's result JSON (`--step-json`, default its current
   table; measured `torch.cuda.max_memory_allocated`) against the plan's allocated peak for the same recipe and
   overrides (bench/step.py's CONFIGS and MOELA_IMPLS), with the error.
2. Compute cross-check: the kernel time of the `small-64k` row predicted from the rates of the `v2lite6-64k` row.
3. Fake world: each listed layout built at its real world size on the fake process group (moela.plan.fake_world);
   rank 0's parameter bytes against the plan's rank 0 (pipeline stage 0), and the build time.
4. Anchors: per published run, the plan at the published layout (as moela would run it; activation
   checkpointing added when it would not fit otherwise) and at the layout `--search` picks, with predicted memory,
   tokens/s per GPU and MFU, the error against the published figure, and the sensitivity of the prediction to
   each assumption (the assumption whose change moves it most dominates its uncertainty). Both layouts are built
   in the fake world too (a layout the plan names builds at full size).
5. PowerSGD on the slow links: per HSDP layout (one replica per group of nodes), the predicted step at 100, 200
   and 400 Gb/s per GPU between nodes, with the dp_replicate all-reduce exact and under PowerSGD (rank 4: the
   bytes its reducer hands in; its compression compute, which bench/powersgd.py measures on a GPU, not priced).

Usage: python bench/plan.py [--quick] [--step-json PATH]
(CPU only; --quick skips the 2,048-rank fake worlds and the searches)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from bench.results_io import add_out_dir, write_results  # noqa: E402
from bench.step import CONFIGS, MOELA_IMPLS, RECIPE_OVERRIDES  # noqa: E402
from moela.config import load_config  # noqa: E402
from moela.model.config import preset  # noqa: E402
from moela.parallel.config import ParallelConfig  # noqa: E402
from moela.plan import timing  # noqa: E402
from moela.plan.fake_world import build  # noqa: E402
from moela.plan.layout import GPUS, layout_of  # noqa: E402
from moela.plan.memory import GIB, param_shards  # noqa: E402
from moela.plan.predict import predict  # noqa: E402
from moela.plan.search import search  # noqa: E402

V3 = ["model.size=v3", "train.tokens_per_microbatch=4096", "data.max_doc_len=4096", "train.device=cuda",
      "train.compile=false", "train.cuda_graphs=false", "optim.moment_dtype=bfloat16"]
SEQ = 4096

# name, source, GPUs, GPU, recipe overrides (the published layout), global tokens, published tok/s, MFU
ANCHORS = [
    dict(name="DeepSeek-V3 pretraining", source="DeepSeek-V3 report: 180K H800-hours per trillion tokens",
         gpus=2048, gpu="h800", overrides=V3 + ["model.precision=fp8", "parallel.ep=64", "parallel.pp=16",
                                                "parallel.pp_schedule=dualpipev", "train.grad_accum=120"],
         global_tokens=15360 * SEQ,
         published_layout="PP16 (DualPipe) EP64 ZeRO-1 DP, 15,360 x 4,096 tokens per step",
         tokens_per_s=1e12 / (180e3 * 3600), mfu=None),
    dict(name="Megatron-Core DeepSeek-V3 FP8 (dropless)", source="Megatron-Bridge performance summary, 25.09",
         gpus=1024, gpu="h100", overrides=V3 + ["model.precision=fp8", "parallel.ep=64", "parallel.tp=2",
                                                "parallel.pp=8", "parallel.pp_schedule=interleaved_1f1b",
                                                "parallel.pp_virtual_stages=4", "train.grad_accum=128"],
         global_tokens=8192 * SEQ, published_layout="TP2 PP8 VP4 EP64, 8,192 x 4,096 tokens per step",
         tokens_per_s=1297.0, mfu=338.0 / 989.0),
    dict(name="NeMo AutoModel DeepSeek-V3 BF16", source="NeMo AutoModel performance summary",
         gpus=256, gpu="h100", overrides=V3 + ["parallel.ep=64", "parallel.pp=4",
                                               "parallel.pp_schedule=interleaved_1f1b",
                                               "parallel.pp_virtual_stages=8", "train.grad_accum=8"],
         global_tokens=512 * SEQ, published_layout="FSDP2 64 + PP4 VP8 + EP64, 512 x 4,096 tokens per step",
         tokens_per_s=1002.0, mfu=250.0 / 989.0),
    dict(name="torchtitan DeepSeek-V3 16B", source="torchtitan (BENCHMARKS.md): ~21% MFU after tuning",
         gpus=8, gpu="b200",
         overrides=["model.size=v2-lite", "train.tokens_per_microbatch=32768", "data.max_doc_len=4096",
                    "train.device=cuda", "train.compile=false", "train.cuda_graphs=false", "parallel.ep=8"],
         global_tokens=8 * 32768, published_layout="FSDP 8 + EP8 (8 x 4,096 tokens per GPU assumed)",
         tokens_per_s=None, mfu=0.21),
]
SENSITIVITY = {  # assumption -> how it is varied
    "EP overlap 0 <-> 1": lambda o, g: ({**o, "ep": 1.0 - o["ep"], "ep_dualpipev": 1.0 - o["ep_dualpipev"]}, g),
    "network bandwidth x0.5": lambda o, g: (o, replace(g, network_gbps=g.network_gbps / 2)),
    "kernel rates x1.25": lambda o, g: (o, replace(g, compute_scale=g.compute_scale * 1.25)),
    "FSDP/HSDP overlap 0.5": lambda o, g: ({**o, "fsdp": 0.5, "replicate": 0.5}, g),
}
FAKE_WORLDS = [  # (model, parallel section, ranks, micro-batches per step)
    ("v3", ParallelConfig(ep=64), 256, 1),
    ("v3", ParallelConfig(ep=32, tp=8), 256, 1),
    ("v3", ParallelConfig(pp=4, pp_schedule="interleaved_1f1b", pp_virtual_stages=8, ep=64), 256, 8),
    ("v3", ParallelConfig(ep=64, dp_replicate=4), 1024, 1),
    ("v3", ParallelConfig(pp=8, pp_schedule="interleaved_1f1b", pp_virtual_stages=4, ep=64, tp=2), 1024, 128),
    ("v3", ParallelConfig(ep=64, dp_replicate=8), 2048, 1),
    ("v3", ParallelConfig(ep=256), 2048, 1),
    ("v3", ParallelConfig(pp=16, pp_schedule="dualpipev", ep=64), 2048, 120),
    ("v2-lite", ParallelConfig(ep=8), 8, 1),
    ("v2-lite", ParallelConfig(ep=4, tp=2), 8, 1),
    ("v2-lite", ParallelConfig(dp_replicate=2, ep=8), 16, 1),
    ("v2-lite", ParallelConfig(cp=2, ep=4), 16, 1),
    ("v2-lite", ParallelConfig(pp=2, ep=4), 16, 4),
]


# (name, recipe overrides, GPUs, GPU): layouts whose replicate all-reduce crosses nodes, shard group inside a node
POWERSGD_LAYOUTS = [
    ("V2-Lite, 8 nodes: replicate 8 x shard 8, EP8", ["model.size=v2-lite", *V3[1:], "parallel.ep=8",
                                                       "parallel.dp_replicate=8"], 64, "h100"),
    ("V3, 128 nodes: PP16 DualPipeV x replicate 8 x shard 8, EP8",
     V3 + ["model.precision=fp8", "parallel.ep=8", "parallel.dp_replicate=8", "parallel.pp=16",
           "parallel.pp_schedule=dualpipev", "train.grad_accum=32"], 1024, "h800"),
]
LINKS_GBITS = (100, 200, 400)


def powersgd_rows() -> list[dict]:
    rows = []
    for name, overrides, gpus, kind in POWERSGD_LAYOUTS:
        for gbits in LINKS_GBITS:
            gpu = replace(GPUS[kind], network_gbps=gbits / 8)
            row = dict(layout=name, gpus=gpus, gpu=gpu.name, gbits=gbits)
            for mode in ("none", "powersgd"):
                cfg = load_config(str(ROOT / "recipes" / "tiny.yaml"),
                                  overrides + [f"parallel.replicate_compression={mode}"])
                lay = layout_of(cfg.parallel, gpus, grad_accum=cfg.train.grad_accum)
                plan = predict(cfg, lay, gpu)
                if not plan.fits:
                    plan = predict(cfg, replace(lay, activation_checkpointing="full"), gpu)
                sent = sum(c.count * c.nbytes for c in plan.collectives if c.overlap == "replicate")
                row[mode] = dict(step_s=plan.time.seconds, tokens_per_s=plan.time.tokens_per_s_per_gpu,
                                 mfu=plan.time.mfu, replicate_mib=sent / 2 ** 20,
                                 replicate_exposed_s=plan.time.exposed.get("replicate", 0.0),
                                 memory_gib=plan.memory.total / GIB, fits=plan.fits,
                                 checkpointing=plan.layout.activation_checkpointing)
            rows.append(row)
    return rows


def memory_rows(step_json: Path) -> list[dict]:
    rows = []
    data = json.loads(step_json.read_text())
    for r in data["results"] if isinstance(data, dict) else data:  # the writer's {header, results}, or a bare list
        if r["impl"] not in MOELA_IMPLS:
            continue
        c = CONFIGS[r["config"]]
        overrides = list(c["overrides"]) + RECIPE_OVERRIDES[r["recipe"]] + MOELA_IMPLS[r["impl"]]
        cfg = load_config(c["recipe"], overrides + ["train.device=cuda"])
        plan = predict(cfg, layout_of(cfg.parallel, 1), GPUS["h200"], doc_len=r["doc_len_token_weighted"])
        pred = plan.memory.allocated / GIB
        rows.append(dict(file=step_json.name, config=r["config"], impl=r["impl"], recipe=r["recipe"],
                         measured_gib=r["peak_gib"], predicted_gib=pred, error=pred / r["peak_gib"] - 1,
                         activations_gib=plan.memory.activations / GIB))
    return rows


def fake_world_rows(quick: bool) -> list[dict]:
    rows = []
    for size, parallel, world, mbs in FAKE_WORLDS:
        if quick and world > 1024:
            continue
        cfg = preset(size)
        start = time.perf_counter()
        fw = build(cfg, parallel, world)
        seconds = time.perf_counter() - start
        layout = layout_of(parallel, world, grad_accum=mbs)
        plan_bytes = 4 * sum(s.numel for s in param_shards(cfg, layout) if s.rank == 0)
        rows.append(dict(model=size, world=world, layout=layout.describe(),
                         fake_world_gib=fw.param_bytes / GIB, plan_gib=plan_bytes / GIB,
                         equal=fw.param_bytes == plan_bytes, seconds=seconds))
    return rows


def _summary(cfg, p) -> dict:
    """A plan's headline numbers, and whether its layout builds in the fake world (rank 0's bytes as planned)."""
    fw = build(cfg.model, p.layout.parallel(), p.layout.world)
    planned = 4 * sum(s.numel for s in param_shards(cfg.model, p.layout) if s.rank == 0)
    return dict(layout=p.layout.describe(), memory_gib=p.memory.total / GIB, fits=p.fits,
                tokens_per_s=p.time.tokens_per_s_per_gpu, mfu=p.time.mfu, step_s=p.time.seconds,
                builds=fw.param_bytes == planned)


def anchor_rows(quick: bool) -> list[dict]:
    rows = []
    for a in ANCHORS:
        cfg = load_config(str(ROOT / "recipes" / "tiny.yaml"), a["overrides"])
        gpu = GPUS[a["gpu"]]
        lay = layout_of(cfg.parallel, a["gpus"], grad_accum=cfg.train.grad_accum)
        mbs = None if lay.pp > 1 else max(1, a["global_tokens"] // (cfg.train.tokens_per_microbatch * lay.dp))
        plan = predict(cfg, lay, gpu, microbatches=mbs)
        if not plan.fits:
            plan = predict(cfg, replace(lay, activation_checkpointing="full"), gpu, microbatches=mbs)
        sens = {}
        for label, vary in SENSITIVITY.items():
            overlap, g = vary(dict(timing.OVERLAP), gpu)
            varied = predict(cfg, plan.layout, g, microbatches=mbs, overlap=overlap)
            sens[label] = varied.time.tokens_per_s_per_gpu / plan.time.tokens_per_s_per_gpu - 1
        picked = None
        if not quick:
            found = search(cfg, a["gpus"], gpu, global_tokens=a["global_tokens"])
            picked = _summary(cfg, found[0]) if found else None
        published = a["tokens_per_s"]
        row = dict(name=a["name"], source=a["source"], gpus=a["gpus"], gpu=gpu.name,
                   published_layout=a["published_layout"], published_tokens_per_s=published,
                   published_mfu=a["mfu"], at_published=_summary(cfg, plan), searched=picked, sensitivity=sens,
                   dominant=max(sens, key=lambda k: abs(sens[k])))
        if published:
            row["error"] = plan.time.tokens_per_s_per_gpu / published - 1
        else:
            row["error"] = plan.time.mfu / a["mfu"] - 1
        rows.append(row)
    return rows


def _fmt(v, spec=",.0f") -> str:
    return "-" if v is None else format(v, spec)


def report(mem, check, worlds, anchors, powersgd) -> str:
    lines = ["## 1. Peak memory on one GPU: plan vs bench/step.py", "",
             "Measured: `torch.cuda.max_memory_allocated` of each row (H200). Predicted: the plan's allocated peak "
             "(no reserve) for the same recipe, overrides and token-weighted document length.", "",
             "| file | config | impl | recipe | measured GiB | predicted GiB | error | activations GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['file']} | {r['config']} | {r['impl']} | {r['recipe']} | {r['measured_gib']:.1f} | "
              f"{r['predicted_gib']:.1f} | {r['error']:+.1%} | {r['activations_gib']:.1f} |" for r in mem]
    within = sum(abs(r["error"]) <= 0.10 for r in mem)
    lines += ["", f"{within} of {len(mem)} rows within 10%.", "",
              "## 2. Compute model cross-check", "",
              f"Kernel time of `small-64k` (bf16, H200) predicted from the `{timing.REFERENCE}` rates: "
              f"{check[0]:.0f} ms against {check[1]:.0f} ms measured ({check[0] / check[1] - 1:+.0%}).", "",
              "## 3. Fake world: every layout built at its world size (rank 0's fp32 parameter bytes)", "",
              "| model | ranks | layout | fake world GiB | plan GiB | equal | build s |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['model']} | {r['world']} | {r['layout']} | {r['fake_world_gib']:.3f} | {r['plan_gib']:.3f} | "
              f"{'yes' if r['equal'] else 'NO'} | {r['seconds']:.1f} |" for r in worlds]
    lines += ["", "## 4. Published runs and the plan's predictions", "",
              "| run | GPUs | published | plan at the published layout | memory GiB | tok/s/GPU | MFU | error |"
              " --search's pick | its memory GiB | its tok/s/GPU | dominant assumption |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    built = all(r["at_published"]["builds"] and (r["searched"] or {"builds": True})["builds"] for r in anchors)
    for r in anchors:
        p, s = r["at_published"], r["searched"]
        pub = (f"{r['published_tokens_per_s']:,.0f} tok/s" if r["published_tokens_per_s"] else "") + (
            f" {r['published_mfu']:.0%} MFU" if r["published_mfu"] else "")
        lines.append(f"| {r['name']} ({r['source']}) | {r['gpus']} x {r['gpu']} | {pub.strip()}; "
                     f"{r['published_layout']} | {p['layout']}{'' if p['fits'] else ' (does not fit)'} | "
                     f"{p['memory_gib']:.1f} | "
                     f"{p['tokens_per_s']:,.0f} | {p['mfu']:.1%} | {r['error']:+.0%} | "
                     f"{s['layout'] if s else '-'} | {_fmt(s and s['memory_gib'], '.1f')} | "
                     f"{_fmt(s and s['tokens_per_s'])} | {r['dominant']} ({r['sensitivity'][r['dominant']]:+.0%}) |")
    lines += ["", "Error: the plan at the published layout against the published tokens/s per GPU (MFU for "
              "torchtitan, which publishes only that). Every layout of this table built in the fake world with the "
              f"planned bytes on rank 0: {'yes' if built else 'NO'}. A layout that does not fit is marked "
              "(does not fit). Sensitivity of each prediction (tokens/s change):", ""]
    for r in anchors:
        parts = ", ".join(f"{k} {v:+.0%}" for k, v in r["sensitivity"].items())
        lines.append(f"- {r['name']}: {parts}")
    lines += ["", "## 5. PowerSGD on the dp_replicate all-reduce: predicted step by network bandwidth", "",
              "Exact: HSDP's fp32 all-reduce of each replica's gradient shards. PowerSGD: rank 4, the bytes "
              "`ReplicateReducer` hands in (1-D tensors, small matrices and the vocabulary matrices whole). "
              "The compression compute is not priced (bench/powersgd.py measures it on a GPU).", "",
              "| layout | GPUs | network Gb/s per GPU | replicate MiB per step exact / PowerSGD | "
              "replicate exposed ms exact / PowerSGD | step ms exact / PowerSGD | tok/s/GPU exact / PowerSGD "
              "| speed-up |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in powersgd:
        e, c = r["none"], r["powersgd"]
        lines.append(f"| {r['layout']}{'' if e['checkpointing'] == 'none' else ' (full checkpointing)'} | "
                     f"{r['gpus']} x {r['gpu']} | {r['gbits']} | {e['replicate_mib']:,.0f} / "
                     f"{c['replicate_mib']:,.0f} | {1e3 * e['replicate_exposed_s']:,.0f} / "
                     f"{1e3 * c['replicate_exposed_s']:,.0f} | {1e3 * e['step_s']:,.0f} / {1e3 * c['step_s']:,.0f} | "
                     f"{e['tokens_per_s']:,.0f} / {c['tokens_per_s']:,.0f} | "
                     f"{c['tokens_per_s'] / e['tokens_per_s']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 2,048-rank fake worlds and the searches")
    parser.add_argument("--step-json", type=Path, default=ROOT / "bench" / "results" / "step.json",
                        help="bench/step.py's JSON to compare the one-GPU peaks with")
    add_out_dir(parser)
    args = parser.parse_args()
    mem = memory_rows(args.step_json)
    check = timing.calibration_check()
    worlds = fake_world_rows(args.quick)
    anchors = anchor_rows(args.quick)
    powersgd = powersgd_rows()
    md = write_results("plan", "moela plan: calibration, fake world, published anchors, PowerSGD links",
                       report(mem, check, worlds, anchors, powersgd),
                       dict(memory=mem, compute_check=check, fake_world=worlds, anchors=anchors, powersgd=powersgd),
                       out_dir=args.out_dir, device="CPU only (no GPU is touched)")
    print(md.read_text())


if __name__ == "__main__":
    main()
