"""`--search`: the layouts of a world size that fit, ranked by predicted tokens/s per GPU.

Candidates: tp among the divisors of the heads up to the node size; cp 1 or 2; ep among the divisors of the routed
experts that divide dp_shard x cp (from 8 up, when there are more than 8 experts); pp 1 or a power of two up to 16
that divides the world, with 1F1B, interleaved 1F1B (2 chunks per rank) and DualPipeV, at least 2 pp micro-batches
per step (interleaved: a multiple of pp), stages balanced by `moela.parallel.pp_layout`; dp_replicate 1, 2, or what
leaves FSDP shard groups of 8 or 64 ranks (HSDP inside one node or eight); activation checkpointing only where a
layout does not fit without it (it is never faster). The global batch (tokens per step) stays the recipe's, so
layouts trade micro-batches for data-parallel ranks as the same run would. Memory is priced first; step time only
for what fits.
"""

from __future__ import annotations

from dataclasses import replace

from moela.plan.layout import GPU, Layout
from moela.plan.predict import Plan, predict


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def candidates(cfg, gpus: int, gpus_per_node: int, global_tokens: int) -> list[tuple[Layout, int]]:
    model = cfg.model
    out = []
    per_mb = cfg.train.tokens_per_microbatch
    for pp in [1] + [p for p in (2, 4, 8, 16) if gpus % p == 0 and p <= model.num_hidden_layers // 2]:
        schedules = [("1f1b", 1)] if pp == 1 else [("1f1b", 1), ("interleaved_1f1b", 2), ("dualpipev", 2)]
        for tp in [t for t in (1, 2, 4, 8) if t <= gpus_per_node and model.num_attention_heads % t == 0]:
            for cp in (1, 2):
                rest = gpus // (pp * tp * cp)
                if rest < 1 or gpus % (pp * tp * cp):
                    continue
                shard_groups = [g for g in (8, 64) if rest % g == 0 and rest > g]  # HSDP: one node, eight nodes
                for rep in sorted({r for r in (1, 2) if rest % r == 0} | {rest // g for g in shard_groups}):
                    shard = rest // rep
                    for ep in _divisors(model.n_routed_experts, shard * cp):
                        if (shard * cp) % ep or (cp > 1 and ep % cp) or (model.num_moe_blocks == 0 and ep > 1):
                            continue
                        if ep < min(8, model.n_routed_experts) and shard * cp >= 8:
                            continue
                        dp = rep * shard
                        mbs = max(1, global_tokens // (per_mb * dp))
                        for sched, v in schedules:
                            m = -(-max(mbs, 2 * pp) // pp) * pp if pp > 1 else mbs
                            out.append((Layout(rep, shard, cp, tp, ep, pp, sched, m if pp > 1 else 1, v,
                                               gpus_per_node=gpus_per_node), m))
    return out


def search(cfg, gpus: int, gpu: GPU, *, gpus_per_node: int = 8, global_tokens: int | None = None,
           doc_len: float | None = None, replicate_compression: float = 1.0) -> list[Plan]:
    """Plans of every candidate that fits, fastest first."""
    base_dp = gpus // (cfg.parallel.cp * cfg.parallel.tp)
    global_tokens = global_tokens or cfg.train.tokens_per_microbatch * cfg.train.grad_accum * base_dp
    powersgd_rank = cfg.parallel.powersgd_rank if cfg.parallel.replicate_compression == "powersgd" else 0
    plans = []
    for layout, mbs in candidates(cfg, gpus, gpus_per_node, global_tokens):
        for ac in ("none", "full"):
            lay = replace(layout, replicate_compression=replicate_compression, activation_checkpointing=ac,
                          replicate_powersgd_rank=powersgd_rank)
            p = predict(cfg, lay, gpu, doc_len=doc_len, microbatches=mbs, only_if_fits=True)
            if p is not None:
                plans.append(p)
                break
    return sorted(plans, key=lambda p: -p.time.tokens_per_s_per_gpu)
