"""Tensor parallelism (with sequence parallelism) on 2 and 4 gloo ranks trains exactly like one process, alone and
with FSDP2, expert and context parallelism (HSDP: tests/test_launchers.py), for standard / FAL / FAL+ blocks and
QK-Norm none / head / layer.

The parent trains the tiny MoE model (float32, reference kernels) for STEPS optimizer steps on every micro-batch of
each global step: gradient clipping, SGD with momentum (not invariant to a per-parameter gradient scale, so a wrong
reduction factor shows), router-bias updates from the summed expert load. Each rank builds the same model, applies
`apply_parallelism` for a layout, trains on its data-parallel share with the trainer's loss weighting, and compares
the step losses, every parameter's gradient after the first backward, and every weight and router bias at the end
with the parent's (the loops: tests/parallel_training.py); then the logits it returns (`return_logits`) with a
single-process model of its weights.
Tolerances: losses 1e-4 relative, gradients and weights 1e-4 relative + 1e-6 absolute (sums in another order; the
values are O(1e-1)). Micro-batches hold 2-4 documents of odd lengths, so most need padding to a multiple of tp.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from factories import VISIBLE_TRAINING, random_batches, tiny_config
from moela.config import ConfigError, load_config
from moela.model import build_model
from moela.parallel import apply_parallelism, build_mesh
from moela.parallel.apply import apply_fal_streams
from moela.parallel.config import ParallelConfig, tensor_parallel_errors
from parallel_harness import spawn
from parallel_training import meta_init, train_parallel, train_single_process

STEPS, VOCAB = 2, 96  # vocabulary divisible by tp


def config(**overrides):
    return tiny_config(**{**VISIBLE_TRAINING, "vocab_size": VOCAB, **overrides})


def reference(cfg, dp_size: int, device: str = "cpu"):
    return train_single_process(cfg, dp_size, STEPS, vocab=VOCAB, device=device, record_grads=True)


def check_logits(model, cfg, state: dict, device: str) -> None:
    """The tensor-parallel model's `return_logits` (gathered over the vocabulary, the padding rows dropped) equals
    a single-process model holding the same weights, on a batch whose length needs padding."""
    single = build_model(cfg, device)
    single.load_state_dict(state)
    batch = random_batches(1, seed=9, vocab=VOCAB)[0].to(device)
    with torch.no_grad():
        got, expected = model(batch, return_logits=True).logits, single(batch, return_logits=True).logits
    torch.testing.assert_close(got.cpu(), expected.cpu(), rtol=1e-4, atol=1e-5)


def _run(rank: int, world_size: int, cases, device: str = "cpu") -> None:
    for overrides, layout, (ref_losses, ref_grads, ref_state) in cases:
        what = f"{layout} {overrides}"
        device = f"cuda:{rank}" if device == "cuda" else device
        model, losses, grads, state = train_parallel(config(**overrides), ParallelConfig(**layout), world_size,
                                                     STEPS, vocab=VOCAB, device=device, record_grads=True)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6,
                                   msg=lambda m, what=what: f"{what}: {m}")
        assert grads.keys() == ref_grads.keys() and state.keys() == ref_state.keys(), what
        for kind, got, expected in (("grad", grads, ref_grads), ("final", state, ref_state)):
            for name, value in expected.items():
                torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, what=what, kind=kind, name=name: f"{what} {kind} {name}: {m}")
        if layout.get("cp", 1) == 1:  # under context parallelism a rank returns its part's logits
            check_logits(model, config(**overrides), state, device)
        dist.barrier()


CASES = {
    2: [(dict(z_loss_coef=1e-2), dict(tp=2)),
        (dict(block="fal", qk_norm="layer"), dict(tp=2, activation_checkpointing="full")),
        (dict(block="fal_plus", qk_norm="head", tie_word_embeddings=True, q_lora_rank=None), dict(tp=2))],
    4: [(dict(block="fal", qk_norm="layer", num_attention_heads=4), dict(tp=4)),
        (dict(block="fal_plus", qk_norm="layer"), dict(tp=2, activation_checkpointing="selective")),
        (dict(block="fal", qk_norm="layer", z_loss_coef=1e-2), dict(tp=2, cp=2, ep=2))],
}


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_tensor_parallel_training_matches_single_process(world_size):
    cases = []
    for overrides, layout in CASES[world_size]:
        dp_size = world_size // layout.get("tp", 1) // layout.get("cp", 1)
        expected = reference(config(**overrides), dp_size)
        assert all(0.0 < loss < 20.0 for loss in expected[0])
        cases.append((overrides, layout, expected))
    spawn(_run, world_size, cases)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_parallel_training_matches_single_process_on_two_gpus():
    """The same equality over NCCL (float32, reference kernels): tp=2 with FAL blocks and layer QK-Norm (the
    scalar exchange as an NCCL all-reduce)."""
    overrides = dict(block="fal", qk_norm="layer", z_loss_coef=1e-2)
    expected = reference(config(**overrides), 1, "cuda")
    spawn(_run, 2, [(overrides, dict(tp=2), expected)], "cuda", backend="nccl")


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True])
def test_fal_streams_train_like_one_stream(moe):
    """FAL blocks with the MLP on a second CUDA stream: the same loss and gradients as on one stream (float32,
    reference attention and experts, the Triton QK-Norm), over two micro-batches (the second reuses memory the
    first freed)."""
    cfg = config(block="fal", qk_norm="layer", first_k_dense_replace=1 if moe else 3)
    results = []
    for streams in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg, "cuda")
        mesh = build_mesh(ParallelConfig(fal_streams=streams), 1, "cuda")
        apply_parallelism(model, mesh, ParallelConfig(fal_streams=streams))
        assert sum(getattr(b, "side_stream", None) is not None for b in model.layers) == (2 if streams else 0)
        losses = []
        for batch in random_batches(2, seed=11, vocab=VOCAB):
            out = model(batch.to("cuda"))
            out.loss.backward()
            losses.append(out.loss.item())
        torch.cuda.synchronize()
        results.append((losses, {k: p.grad.detach().cpu() for k, p in model.named_parameters()}))
    (ref_losses, ref_grads), (losses, grads) = results
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for name, value in ref_grads.items():
        torch.testing.assert_close(grads[name], value, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def _meta_build(rank: int, world_size: int) -> None:
    model, _ = meta_init(config(block="fal", qk_norm="layer"), ParallelConfig(tp=2), world_size, rel_std_tol=0.25)
    out = model(random_batches(1, seed=3, vocab=VOCAB)[0])
    out.loss.backward()
    assert torch.isfinite(out.loss) and 0.0 < out.loss.item() < 20.0


def test_meta_build_then_tensor_parallel_then_init():
    """The trainer's order (meta model, parallelize, `to_empty`, `init_weights`) under tp=2."""
    spawn(_meta_build, 2)


def test_recipe_errors_name_what_tp_cannot_split_and_fal_streams_misuse():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["parallel.tp=4", "model.num_attention_heads=6", "model.intermediate_size=50",
                           "parallel.fal_streams=true", "train.device=cpu"])
    errors = info.value.errors
    assert any("parallel.tp: 4 does not divide model.num_attention_heads=6" in e for e in errors), errors
    assert any("model.intermediate_size=50" in e for e in errors), errors
    assert any("fal_streams" in e and "model.block" in e for e in errors), errors
    assert any("fal_streams: needs a CUDA device" in e for e in errors), errors
    assert load_config(None, ["parallel.tp=2"]).parallel.tp == 2  # the default model splits in two
    assert tensor_parallel_errors(config(num_attention_heads=4), 4) == []


def test_fal_streams_needs_cuda_and_fal_blocks():
    mesh = build_mesh(ParallelConfig(), 1, "cpu")
    with pytest.raises(ValueError, match="fal_streams: needs a CUDA device"):
        apply_fal_streams(build_model(config(block="fal"), "cpu"), mesh)
