"""FSDP2, expert parallelism, HSDP, plain replication and context parallelism on 2 and 4 gloo ranks train exactly
like one process (float32, 3 steps).

The parent process trains the tiny MoE model on every micro-batch of each global step (gradient clipping,
router-bias updates from the summed expert load). Each rank then builds the same model, applies
`apply_parallelism` for a layout, trains on its data-parallel share of the same steps with the trainer's loss
weighting, and compares the step losses and every final weight and router bias with the parent's (the loops:
tests/parallel_training.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from factories import VISIBLE_TRAINING, random_batches, tiny_config
from moela.model import build_model
from moela.parallel import apply_parallelism, build_mesh
from moela.parallel.config import ParallelConfig
from moela.parallel.expert_parallel import ExpertParallelExperts
from parallel_harness import spawn
from parallel_training import meta_init, train_parallel, train_single_process

STEPS = 3


def _run(rank: int, world_size: int, cases, device: str = "cpu") -> None:
    for cfg, layout, (ref_losses, _, ref_state) in cases:
        pcfg = ParallelConfig(**layout)
        model, losses, _, state = train_parallel(cfg, pcfg, world_size, STEPS,
                                                 device=f"cuda:{rank}" if device == "cuda" else device)
        if pcfg.ep > 1:
            experts = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
            assert len(experts) == 3 and experts[0].w13.to_local().shape[0] < cfg.n_routed_experts, layout
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6,
                                   msg=lambda m, layout=layout: f"{layout}: {m}")
        assert state.keys() == ref_state.keys(), layout
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, layout=layout, name=name: f"{layout} {name}: {m}")
        dist.barrier()


@pytest.mark.parametrize("world_size, layouts", [
    (2, [dict(), dict(ep=2, activation_checkpointing="full"), dict(cp=2, ep=2),
         dict(dp_replicate=2, dp_shard=1, fsdp=False)]),
    (4, [dict(ep=4, activation_checkpointing="selective"), dict(ep=2),
         dict(dp_replicate=2, ep=2, reshard_after_forward=False)]),
])
def test_parallel_training_matches_single_process(world_size, layouts):
    cfg, expected = tiny_config(**VISIBLE_TRAINING), {}
    for layout in layouts:  # the reference depends only on how many data-parallel shares a step has
        dp_size = world_size // layout.get("cp", 1)
        if dp_size not in expected:
            expected[dp_size] = train_single_process(cfg, dp_size, STEPS)
            assert all(0.0 < loss < 20.0 for loss in expected[dp_size][0])
    spawn(_run, world_size, [(cfg, layout, expected[world_size // layout.get("cp", 1)]) for layout in layouts])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_parallel_training_matches_single_process_on_two_gpus():
    """The same equality over NCCL (float32, reference kernels): FSDP2 alone and with EP=2."""
    cfg = tiny_config(**VISIBLE_TRAINING)
    expected = train_single_process(cfg, 2, STEPS, device="cuda")
    spawn(_run, 2, [(cfg, dict(), expected), (cfg, dict(ep=2), expected)], "cuda", backend="nccl")


def _mixed_precision(rank: int, world_size: int, cfg, ref_loss: float) -> None:
    pcfg = ParallelConfig(ep=2, reduce_dtype="bfloat16")
    mesh = build_mesh(pcfg, world_size, "cpu")
    torch.manual_seed(0)
    model = apply_parallelism(build_model(cfg, "cpu"), mesh, pcfg, mixed_precision=True)
    seen = {}
    block = model.layers[1]
    block.register_forward_pre_hook(lambda m, args: seen.update(inv_freq=args[1].inv_freq.dtype))
    block.attn.wq_a.register_forward_pre_hook(lambda m, args: seen.update(weight=m.weight.dtype))
    block.ffn.experts.register_forward_pre_hook(lambda m, args: seen.update(expert=m.w13.dtype, gate=args[2].dtype))
    batches = random_batches(world_size, seed=100)
    total = sum(b.num_targets() for b in batches)
    out = model(batches[rank])
    (out.loss * (out.num_targets * world_size / total)).backward()
    loss = torch.tensor([out.loss.item() * out.num_targets / total])
    dist.all_reduce(loss)
    assert seen == dict(inv_freq=torch.float32, weight=torch.bfloat16, expert=torch.bfloat16, gate=torch.float32)
    for unit in (model, model.layers[1], model.layers[1].ffn.experts):  # parallel.reduce_dtype reaches every unit
        assert unit._get_fsdp_state()._mp_policy.reduce_dtype == torch.bfloat16
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(loss.item(), ref_loss, rtol=2e-2, atol=0)


def test_mixed_precision_gathers_bf16_keeps_fp32_inputs_and_grads():
    cfg = tiny_config(**VISIBLE_TRAINING)
    ref_losses = train_single_process(cfg, 2, STEPS)[0]
    spawn(_mixed_precision, 2, cfg, ref_losses[0])


def _meta_build(rank: int, world_size: int) -> None:
    cfg = tiny_config(**VISIBLE_TRAINING)
    model, state = meta_init(cfg, ParallelConfig(ep=2), world_size, rel_std_tol=0.2)  # each expert drawn apart
    w13 = state["layers.1.ffn.experts.w13"]  # [E, 2F, D]: experts of both EP ranks
    assert len({tuple(w13[e, 0, :4].tolist()) for e in range(cfg.n_routed_experts)}) == cfg.n_routed_experts
    out = model(random_batches(world_size, seed=3)[rank])
    out.loss.backward()
    assert torch.isfinite(out.loss) and 0.0 < out.loss.item() < 20.0


def test_meta_build_then_parallelize_then_init():
    """torchtitan's order, for models too large for one device: build on meta, shard, `to_empty`, `init_weights`."""
    spawn(_meta_build, 2)


def _prefetch_chain(rank: int, world_size: int) -> None:
    from moela.parallel.fsdp import transformer_blocks

    cfg, pcfg = tiny_config(**VISIBLE_TRAINING), ParallelConfig(ep=2)
    model = apply_parallelism(build_model(cfg, "cpu"), build_mesh(pcfg, world_size, "cpu"), pcfg)
    blocks = transformer_blocks(model)  # forward order: main layers, then the MTP block

    def units(block):
        return [block] + [m for m in block.modules() if isinstance(m, ExpertParallelExperts)]

    def targets(block, kind):  # FSDP2 keeps explicit prefetch targets as the prefetched modules' states
        states = getattr(block._get_fsdp_state(), f"_states_to_{kind}_prefetch")
        return [m for state in states for m in state._modules]

    assert len(blocks) == 4 and len(units(blocks[1])) == 2  # dense first layer, 2 MoE layers, MTP block
    for cur, nxt in zip(blocks, blocks[1:]):
        assert targets(cur, "forward") == units(nxt)
        assert targets(nxt, "backward") == units(cur)
    assert targets(blocks[-1], "forward") == [] and targets(blocks[0], "backward") == []
    out = model(random_batches(world_size, seed=5)[rank])  # prefetching runs forward and backward
    out.loss.backward()
    assert torch.isfinite(out.loss)


def test_fsdp_prefetches_the_next_block_and_its_experts_explicitly():
    """An MoE layer's host syncs stall FSDP2's implicit prefetching; each block names the next (previous, in
    backward) block and its expert unit to gather ahead."""
    spawn(_prefetch_chain, 2)

