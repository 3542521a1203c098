"""`python -m moela plan RECIPE [section.key=value ...] --gpus N [--search]`: memory per GPU, communication per
step, step time and MFU of the recipe's layout on N GPUs, predicted without a GPU (`moela.plan`); `--search`
ranks the layouts that fit. The layout is the recipe's `parallel` section (pipeline settings included), so
`parallel.pp=16 parallel.pp_schedule=dualpipev train.grad_accum=32` prices that pipeline."""

from __future__ import annotations

import argparse
from dataclasses import replace

from moela.tools.runs import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from moela.plan.layout import GPUS
    p.add_argument("recipe", help="YAML recipe, e.g. recipes/small.yaml")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="recipe overrides, as train.py takes")
    p.add_argument("--gpus", type=int, required=True, help="world size (GPUs)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (NVLink domain), default 8")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="GPU kind, default h100")
    p.add_argument("--doc-len", type=float, default=None, help="token-weighted mean document length "
                   "(default: data.max_doc_len capped by the micro-batch)")
    p.add_argument("--global-tokens", type=int, default=None, help="tokens per optimizer step for --search "
                   "(default: the recipe's on N GPUs)")
    p.add_argument("--network-gbits", type=float, default=None,
                   help="network bandwidth per GPU between nodes in Gb/s (default: the GPU kind's, 400)")
    p.add_argument("--replicate-compression", type=float, default=1.0,
                   help="what-if factor the dp_replicate gradient all-reduce is shrunk by (a recipe with "
                   "parallel.replicate_compression=powersgd is priced by PowerSGD's own bytes)")
    p.add_argument("--search", action="store_true", help="rank the layouts that fit by predicted tokens/s")
    p.add_argument("--top", type=int, default=10, help="rows of --search's table")


def load_recipe(recipe: str, overrides: list[str]):
    from moela.config import ConfigError, load_config
    try:
        return load_config(recipe, overrides)
    except ConfigError as e:
        raise UsageError(f"{len(e.errors)} problem(s) in the recipe: " + "; ".join(e.errors)) from None
    except FileNotFoundError as e:
        raise UsageError(f"{e.filename or recipe}: no such recipe file; pass a path such as "
                         f"recipes/small.yaml") from None


def run(args: argparse.Namespace) -> int:
    from moela.plan.layout import GPUS, layout_of
    from moela.plan.predict import predict
    from moela.plan.report import plan_text, search_table
    from moela.plan.search import search

    if args.gpus < 1 or args.gpus_per_node < 1:
        raise UsageError(f"--gpus {args.gpus} / --gpus-per-node {args.gpus_per_node}: must be >= 1")
    cfg = load_recipe(args.recipe, args.overrides)
    gpu = GPUS[args.gpu]
    if args.network_gbits is not None:
        if args.network_gbits <= 0:
            raise UsageError(f"--network-gbits {args.network_gbits}: must be > 0 (Gb/s per GPU, e.g. 400)")
        gpu = replace(gpu, network_gbps=args.network_gbits / 8)
    if args.replicate_compression < 1:
        raise UsageError(f"--replicate-compression {args.replicate_compression}: must be >= 1 (1 = uncompressed)")
    if args.search:
        plans = search(cfg, args.gpus, gpu, gpus_per_node=args.gpus_per_node, global_tokens=args.global_tokens,
                       doc_len=args.doc_len, replicate_compression=args.replicate_compression)
        if not plans:
            raise UsageError(f"no layout of {args.gpus} x {gpu.name} fits this recipe; lower "
                             f"train.tokens_per_microbatch or add GPUs")
        print(search_table(plans, args.top))
        print()
        print(plan_text(plans[0]))
        return 0
    try:
        layout = layout_of(cfg.parallel, args.gpus, grad_accum=cfg.train.grad_accum, gpus_per_node=args.gpus_per_node,
                           replicate_compression=args.replicate_compression)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(plan_text(predict(cfg, layout, gpu, doc_len=args.doc_len)))
    return 0
