"""moela.plan: sharded state exact against the real model (CPU, one process and gloo ranks) and against the fake
world at full size; the FSDP collectives against what one step issues; the CLI's errors."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import torch

from moela.config import OptimConfig
from moela.model.config import preset
from moela.model.transformer import build_model
from moela.parallel.config import ParallelConfig
from moela.plan.comm import fsdp_collectives
from moela.plan.fake_world import build
from moela.plan.layout import layout_of
from moela.plan.memory import param_shards, state_bytes
from moela.trainer.optim import build_optimizer
from tests.factories import packed_batch, tiny_config
from tests.parallel_harness import spawn


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16"])
def test_state_bytes_equal_real_allocation(moment_dtype):
    torch.manual_seed(0)
    cfg = tiny_config()
    model = build_model(cfg)
    opt = build_optimizer(model, OptimConfig(moment_dtype=moment_dtype), "cpu")
    out = model(packed_batch(cfg.vocab_size, [17, 30], seed=0))
    out.loss.backward()
    opt.step()
    shards = param_shards(cfg, layout_of(ParallelConfig(), 1))
    want = state_bytes(shards, 2 if moment_dtype == "bfloat16" else 4)
    assert want.params == _tensor_bytes(model.parameters())
    assert want.grads == _tensor_bytes(p.grad for p in model.parameters())
    assert want.optimizer == _tensor_bytes(v for s in opt.state.values() for v in s.values())


def _shapes_match(size: str, parallel: ParallelConfig, world: int, grad_accum: int = 1) -> None:
    cfg = preset(size)
    fake = build(cfg, parallel, world)
    layout = layout_of(parallel, world, grad_accum=grad_accum)
    shards = [s for s in param_shards(cfg, layout) if s.rank == 0]  # the fake world is rank 0
    assert {s.name: s.local_shape for s in shards} == fake.local_shape
    if parallel.tp == 1 and parallel.pp == 1:  # under tp (pp) replicated weights (each chunk's root) are own units
        plan = Counter((c.size, c.nbytes // 2) for c in fsdp_collectives(shards, layout, 1)
                       if c.kind == "all_gather")
        assert plan == Counter((n, padded) for n, _, padded in fake.fsdp_units if n > 1)


def test_fake_world_v3_256_ranks_equals_plan():
    _shapes_match("v3", ParallelConfig(ep=64), 256)


@pytest.mark.parametrize("parallel,world", [(ParallelConfig(ep=8), 8),
                                            (ParallelConfig(dp_replicate=2, ep=4, tp=2), 16),
                                            (ParallelConfig(cp=2, ep=4), 16),
                                            (ParallelConfig(pp=2, ep=4), 16),
                                            (ParallelConfig(pp=4, pp_schedule="dualpipev", ep=2), 16),
                                            (ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", ep=8), 16)])
def test_fake_world_v2_lite_equals_plan(parallel, world):
    _shapes_match("v2-lite", parallel, world, grad_accum=8)


@pytest.mark.slow
@pytest.mark.parametrize("parallel,world", [(ParallelConfig(ep=64, dp_replicate=4), 1024),
                                            (ParallelConfig(ep=32, tp=8), 1024),
                                            (ParallelConfig(ep=64, dp_replicate=8), 2048),
                                            (ParallelConfig(ep=256), 2048),
                                            (ParallelConfig(pp=16, pp_schedule="dualpipev", ep=64), 2048),
                                            (ParallelConfig(pp=8, pp_schedule="interleaved_1f1b",
                                                            pp_virtual_stages=4, ep=64, tp=2), 1024)])
def test_fake_world_v3_at_scale_equals_plan(parallel, world):
    _shapes_match("v3", parallel, world, grad_accum=128)


def _gloo_rank(rank: int, world: int, parallel: ParallelConfig) -> None:
    from moela.parallel.apply import apply_parallelism
    from moela.parallel.comm import CommCounter
    from moela.parallel.mesh import build_mesh, local_shard

    torch.manual_seed(0)
    cfg = tiny_config()
    mesh = build_mesh(parallel, world, "cpu")
    model = build_model(cfg, parallelize=lambda m: apply_parallelism(m, mesh, parallel))
    layout = layout_of(parallel, world)
    shards = param_shards(cfg, layout)
    if rank == 0:  # the plan states rank 0's shards (the largest)
        assert {s.name: s.local_shape for s in shards} == {n: tuple(local_shard(p).shape)
                                                           for n, p in model.named_parameters()}
    assert sum(local_shard(p).numel() for p in model.parameters()) <= sum(s.numel for s in shards)
    with CommCounter() as comm:
        model(packed_batch(cfg.vocab_size, [40, 23], seed=rank)).loss.backward()
    # CPU runs FSDP in fp32: the gathered shards are 4 bytes per element where the plan prices bf16
    seen = Counter(c.nbytes for c in comm.collectives if c.kind == "all_gather" and c.dtype == torch.float32
                   and len(c.shape) == 1)
    planned = Counter()
    for c in fsdp_collectives(shards, layout, 1):
        if c.kind == "all_gather":
            planned[c.nbytes * 2] += c.count
    assert seen == planned


@pytest.mark.parametrize("parallel,world", [(ParallelConfig(), 2), (ParallelConfig(ep=2), 4)])
def test_gloo_shards_and_fsdp_gathers_equal_plan(parallel, world):
    spawn(_gloo_rank, world, parallel)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "moela", "plan", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_one_gpu_prints_the_plan():
    r = _cli("recipes/small.yaml", "--gpus", "1")
    assert r.returncode == 0, r.stderr
    assert "memory per GPU" in r.stdout and "tokens/s per GPU" in r.stdout


def test_cli_network_bandwidth_slows_the_cross_node_step():
    fast, slow = (_cli("recipes/small.yaml", "--gpus", "16", "--network-gbits", g) for g in ("400", "100"))
    assert fast.returncode == slow.returncode == 0, fast.stderr + slow.stderr
    assert "12.5 GB/s network per GPU (100 Gb/s)" in slow.stdout

    def step_ms(out: str) -> float:
        return float(next(line for line in out.splitlines() if line.startswith("step time")).split()[2])

    assert step_ms(slow.stdout) > step_ms(fast.stdout)


@pytest.mark.parametrize("args,needle", [(["recipes/small.yaml", "train.tokens_per_microbatch=0", "--gpus", "1"],
                                          "tokens_per_microbatch"),
                                         (["recipes/small.yaml", "parallel.pp=4", "--gpus", "6"], "parallel"),
                                         (["recipes/small.yaml", "parallel.tp=3", "--gpus", "8"], "tp"),
                                         (["recipes/nope.yaml", "--gpus", "1"], "nope.yaml"),
                                         (["recipes/small.yaml", "--gpus", "16", "--network-gbits", "0"],
                                          "--network-gbits")])
def test_cli_errors_are_one_line(args, needle):
    r = _cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr


def test_backward_overlap_is_the_timeline_peak():
    from moela.plan.memory import backward_overlap
    acts, grads = [5, 3, 4], [1, 2, 6]
    # backward of block i holds activations of blocks <= i and gradients of blocks >= i
    peaks = [5 + 9, 8 + 8, 12 + 6]
    assert backward_overlap(acts, grads) == sum(acts) + sum(grads) - max(peaks)


@pytest.mark.parametrize("mode,tokens,level", [("error", 1 << 20, "error"), ("warn", 1 << 20, "warn"),
                                               ("never", 1 << 20, None), ("error", 32768, None)])
def test_train_memory_check(mode, tokens, level):
    from moela.config import load_config
    from moela.plan.check import memory_check
    cfg = load_config("recipes/small.yaml", [f"train.plan_check={mode}", f"train.tokens_per_microbatch={tokens}"])
    found = memory_check(cfg, 1, "NVIDIA H100 80GB HBM3", 80 * 10**9)
    assert (found and found[0]) == level
    if found:
        assert "\n" not in found[1] and "GiB" in found[1]


@pytest.mark.parametrize("parallel", [ParallelConfig(pp=16, pp_schedule="dualpipev", ep=64),
                                      ParallelConfig(pp=8, pp_schedule="interleaved_1f1b", pp_virtual_stages=4,
                                                     tp=2, ep=64, dp_replicate=2, activation_checkpointing="full")])
def test_layout_reads_back_as_the_parallel_section(parallel):
    layout = layout_of(parallel, 2048, grad_accum=128)
    assert layout_of(layout.parallel(), 2048, grad_accum=128) == layout


def _v2_lite_hsdp(compression: str, gbits: float):
    from dataclasses import replace

    from moela.config import load_config
    from moela.plan.layout import GPUS
    from moela.plan.predict import predict
    cfg = load_config("recipes/tiny.yaml", ["model.size=v2-lite", "train.tokens_per_microbatch=4096",
                                            "data.max_doc_len=4096", "train.device=cuda", "train.compile=false",
                                            "parallel.ep=8", "parallel.dp_replicate=8", "train.grad_accum=2",
                                            f"parallel.replicate_compression={compression}"])
    layout = replace(layout_of(cfg.parallel, 64, grad_accum=2), activation_checkpointing="full")
    return predict(cfg, layout, replace(GPUS["h100"], network_gbps=gbits / 8))


def test_gradient_reductions_hide_only_under_the_last_backward():
    """HSDP across 8 nodes at 100 Gb/s: the replicate all-reduce runs once, as the step's last backward ends, so
    all of it beyond one micro-batch's backward is exposed; PowerSGD's bytes shrink it."""
    plan = _v2_lite_hsdp("none", 100)
    t = plan.time
    tail = (sum(t.compute.values()) - t.compute["optimizer"]) * 2 / 3 / plan.microbatches
    assert t.comm["replicate"] > tail and t.exposed["replicate"] >= t.comm["replicate"] - tail - 1e-9
    assert all(c.count == 1 for c in plan.collectives if c.kind == "reduce_scatter" and c.overlap == "fsdp")
    compressed = _v2_lite_hsdp("powersgd", 100)
    sent = [sum(c.nbytes for c in p.collectives if c.overlap == "replicate") for p in (plan, compressed)]
    assert sent[0] > 10 * sent[1] and compressed.time.seconds < t.seconds


def test_pipelined_fsdp_reduces_once_per_step():
    layout = layout_of(ParallelConfig(pp=2, dp_shard=2), 4, grad_accum=8)
    colls = fsdp_collectives(param_shards(tiny_config(num_hidden_layers=4), layout), layout, 8)
    assert {c.count for c in colls if c.kind == "reduce_scatter"} == {1}
    assert {c.count for c in colls if c.kind == "all_gather"} <= {8, 16}


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_zero_bubble_w_excludes_the_experts_weight_gradients(schedule):
    """The fused expert op's backward runs once, in I, weight gradients included (moela.parallel.pp_split): its
    GEMM time is not inflated, and the deferred W that fills the bubble is F less the experts' weight GEMMs,
    W = (1 - e) F with e the experts' share of the stage's compute, so (F = 1, B = 2) ZBV's bubble is
    (pp - 1)(1 + 2e) / 2 and DualPipeV's (pp - 1)(2 + 3e) / 2 over m (F + B)."""
    from moela.plan.layout import GPUS
    from moela.plan.timing import compute_seconds, step_time
    cfg = preset("v2-lite", num_hidden_layers=8)
    pp, m, tokens, doc_len, recompute = 4, 8, 4096, 2048.0, 1.0
    kw = dict(tokens_per_mb=tokens, microbatches=m, doc_len=doc_len, params_local=10**9, recompute=recompute,
              flops_per_token=1.0)
    layout = layout_of(ParallelConfig(pp=pp, pp_schedule=schedule), pp, grad_accum=m)
    t = step_time(cfg, layout, GPUS["h100"], [], **kw)
    plain = compute_seconds(cfg, doc_len, tokens * m / pp, 0, GPUS["h100"], recompute=recompute)
    assert t.compute["expert GEMM"] == pytest.approx(plain["expert GEMM"])
    baseline = step_time(cfg, layout_of(ParallelConfig(pp=pp), pp, grad_accum=m), GPUS["h100"], [], **kw)
    assert t.compute == pytest.approx(baseline.compute)  # the same work as 1F1B's
    work = sum(v for k, v in plain.items() if k != "optimizer")
    e = plain["expert GEMM"] / work
    assert 0.2 < e < 0.8
    units = (1 + 2 * e) / 2 if schedule == "zbv" else (2 + 3 * e) / 2
    assert t.bubble == pytest.approx((pp - 1) * units / (3 * m) * work)
    assert baseline.bubble == pytest.approx((pp - 1) * 3 / (3 * m) * work)
