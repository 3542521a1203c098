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


FP8_TP_SHAPES = dict(hidden_size=128, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
                     qk_rope_head_dim=64, v_head_dim=64, moe_intermediate_size=256, intermediate_size=256)


def _fp8_linears(rank: int, world_size: int, x, w_col, w_row, dy_col, dy_row, want) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from moela.model.layers import Linear

    mesh = build_mesh(ParallelConfig(tp=world_size), world_size, "cpu")["tp"]
    cols, rows = w_col.shape[0] // world_size, w_row.shape[1] // world_size
    col, row = Linear(w_col.shape[1], w_col.shape[0], fp8=True), Linear(w_row.shape[1], w_row.shape[0], fp8=True)
    col.weight.data.copy_(w_col)
    row.weight.data.copy_(w_row)
    parallelize_module(col, mesh, ColwiseParallel())
    parallelize_module(row, mesh, RowwiseParallel())
    xc = x.clone().requires_grad_()
    y = col(xc)  # this rank's output features
    y.backward(dy_col[:, rank * cols:(rank + 1) * cols])
    xr = x.new_zeros(x.shape[0], w_row.shape[1]).normal_(generator=torch.Generator().manual_seed(5))
    xr_local = DTensor.from_local(xr[:, rank * rows:(rank + 1) * rows].clone(), mesh, (Shard(1),)).requires_grad_()
    z = row(xr_local)  # the partial sums added over the ranks
    assert isinstance(z, torch.Tensor) and not isinstance(z, DTensor)
    z.backward(dy_row)
    got = dict(y=torch.cat(_all_gather(y.detach()), dim=1), dx_col=xc.grad, dw_col=col.weight.grad.full_tensor(),
               z=z, dx_row=xr_local.grad.redistribute(placements=(Replicate(),)).to_local(),
               dw_row=row.weight.grad.full_tensor())
    for name, value in want.items():
        torch.testing.assert_close(got[name].detach(), value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _all_gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def test_fp8_linears_under_tensor_parallelism_compute_what_one_process_does():
    """A column- and a row-parallel FP8 linear on 2 gloo ranks (the reference kernels: simulated quantization):
    each rank multiplies its shards, and with 128-aligned shards the 1x128 groups and 128x128 blocks are the whole
    weight's, so outputs and gradients equal one process's within float32 summation order."""
    from moela.ops.fp8_linear import fp8_linear_reference

    torch.manual_seed(7)
    x, w_col, w_row = torch.randn(37, 128), torch.randn(256, 128) * 0.1, torch.randn(128, 256) * 0.1
    dy_col, dy_row = torch.randn(37, 256), torch.randn(37, 128)
    want = {}
    xc, wc = x.clone().requires_grad_(), w_col.clone().requires_grad_()
    y = fp8_linear_reference(xc, wc)
    y.backward(dy_col)
    xr = x.new_zeros(37, 256).normal_(generator=torch.Generator().manual_seed(5)).requires_grad_()
    wr = w_row.clone().requires_grad_()
    z = fp8_linear_reference(xr, wr)
    z.backward(dy_row)
    want.update(y=y.detach(), dx_col=xc.grad, dw_col=wc.grad, z=z.detach(), dx_row=xr.grad, dw_row=wr.grad)
    spawn(_fp8_linears, 2, x, w_col, w_row, dy_col, dy_row, want)


def _fp8_training(rank: int, world_size: int, cfg, ref_losses) -> None:
    _, losses, _, _ = train_parallel(cfg, ParallelConfig(tp=2), world_size, STEPS, vocab=VOCAB)
    # FP8 codes sit on a grid: the last-bit differences of another summation order flip a few of them (one e4m3
    # step, ~6% of an element), so the model's losses agree to FP8's noise, not float32's
    torch.testing.assert_close(torch.tensor(losses[:1]), torch.tensor(ref_losses[:1]), rtol=5e-3, atol=0)
    assert all(0.0 < loss < 20.0 for loss in losses)


def test_fp8_model_trains_under_tensor_parallelism():
    """`precision: fp8` with tp=2 (it stopped in a DTensor redistribution before): the sharded projections run
    their FP8 linears on their shards; the first step's loss equals one process's within FP8's noise."""
    cfg = config(precision="fp8", **FP8_TP_SHAPES)
    ref_losses = reference(cfg, 1)[0]
    spawn(_fp8_training, 2, cfg, ref_losses)
