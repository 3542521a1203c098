"""PowerSGD on the replicate dimension (moela.parallel.powersgd, moela.parallel.replicate).

The math against float64: orthogonalization against a float64 QR; on 4 gloo ranks as 2 (replicate) x 2 (shard)
with the tiny MoE model's real sharded gradients, the reducer's compressed, error-fed gradients over a warmup step
and three compressed steps against a float64 PowerSGD computed from every replica's gradients, also with the
routed experts under expert parallelism; at full rank, the exact mean; a NaN in one replica's gradient marks the
group's result non-finite and resets its state; the embedding and output head sent whole; and the bytes a
CommCounter sees on the replicate all-reduces against `powersgd_bytes` and against what HSDP's own all-reduce sends
for the same model.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist

from factories import random_batches, tiny_config
from moela.model import build_model
from moela.parallel import apply_parallelism, build_mesh
from moela.parallel.comm import CommCounter
from moela.parallel.config import ParallelConfig
from moela.parallel.mesh import local_shard
from moela.parallel.powersgd import ORTHO_EPS, matrix_shape, orthogonalize_, powersgd_bytes
from moela.parallel.replicate import ReplicateReducer
from moela.plan.comm import fsdp_collectives
from moela.plan.layout import layout_of
from moela.plan.memory import param_shards
from parallel_harness import spawn

RANK = 2
TOL = 1e-4  # relative (to the reference's norm) error of fp32 PowerSGD against float64 on these small matrices
FULL_TOL = 1e-3  # the same at full rank (up to 32 columns orthogonalized in fp32, warm-started Q ill-conditioned)
VOCABULARY = ("embed.weight", "head.weight")  # the tiny model's embedding and output head: never compressed


def test_orthogonalize_spans_the_columns_like_a_float64_qr():
    torch.manual_seed(0)
    p = torch.randn(3, 37, 5)
    q64, _ = torch.linalg.qr(p.double())
    out = orthogonalize_(p.clone())
    eye = torch.eye(5, dtype=torch.float64).expand(3, 5, 5)
    torch.testing.assert_close(out.double().transpose(1, 2) @ out.double(), eye, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.double() @ out.double().transpose(1, 2), q64 @ q64.transpose(1, 2),
                               atol=1e-6, rtol=0)
    zero = torch.randn(1, 11, 3)
    zero[..., 1] = 0
    assert torch.all(orthogonalize_(zero)[..., 1] == 0)
    bad = torch.randn(1, 11, 3)
    bad[0, 4, 0] = float("nan")
    assert not torch.isfinite(orthogonalize_(bad)).all()


def test_which_tensors_are_compressed_and_their_bytes():
    assert matrix_shape((64,), 4) is None  # 1-D: a norm or a bias
    assert matrix_shape((8, 128), 4) is None  # a router gate: P and Q would be more than half its size
    assert matrix_shape((128, 64), 4) == (1, 128, 64, 4)
    assert matrix_shape((8, 96, 64), 4) == (8, 96, 64, 4)  # stacked experts: one matrix each
    assert matrix_shape((3, 5), 10, min_compression=0) == (1, 3, 5, 3)  # the rank is capped at min(n, m)
    shapes = [(64,), (8, 128), (128, 64), (8, 96, 64)]
    assert powersgd_bytes(shapes, 4) == 4 * (64 + 8 * 128 + (128 + 64) * 4 + 8 * (96 + 64) * 4)


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _backward(model, mesh, seed: int) -> None:
    model.zero_grad(set_to_none=True)
    batch = random_batches(mesh.size("dp"), seed=seed)[mesh.rank("dp")]
    out = model(batch)
    (out.loss * mesh.size("dp_cp")).backward()


def _reference_step(ms: list[torch.Tensor], q: torch.Tensor, first_q: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 PowerSGD of the replicas' error-fed gradients `ms` [B, n, m] with Q `q` [B, m, r] -> (the
    decompressed mean, the next Q). P's columns dependent on the previous ones (a diagonal entry of QR's R below
    ORTHO_EPS of the column's norm) are dropped, and the Q columns they leave at zero restart from `first_q`."""
    p = sum(m @ q for m in ms)  # [B, n, r]
    p_hat, r = torch.linalg.qr(p)
    dead = torch.diagonal(r, dim1=1, dim2=2).abs() <= ORTHO_EPS * p.norm(dim=1)  # [B, r]
    p_hat = p_hat.masked_fill(dead[:, None, :], 0.0)
    new_q = sum(m.transpose(1, 2) @ p_hat for m in ms) / len(ms)  # [B, m, r]
    return p_hat @ new_q.transpose(1, 2), torch.where(dead[:, None, :], first_q, new_q)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = TOL) -> None:
    err = (actual.double() - expected).norm().item()
    assert err <= tol * expected.norm().item() + 1e-9, f"{what}: error {err} vs norm {expected.norm().item()}"


def _check_against_float64(model, mesh, reducer: ReplicateReducer, warmup: int, steps: int) -> None:
    """`steps` reductions of real gradients, each against float64 PowerSGD (exact means for the warmup steps and
    the uncompressed tensors) computed from every replica's gradients, the reference keeping its own state."""
    group = mesh.group("dp_replicate")
    me = mesh.rank("dp_replicate")
    ref_q = {name: q.double() for name, q in reducer.qs.items()}
    ref_err = {name: [torch.zeros_like(e, dtype=torch.float64)] * 2 for name, e in reducer.errors.items()}
    for step in range(steps):
        _backward(model, mesh, seed=100 + step)
        before = [_gather(local_shard(p.grad).double(), group) for _, p in reducer.params]  # [param][replica]
        with CommCounter() as comm:
            stats = reducer.reduce()
        assert set(comm.counts()) == {"all_reduce"} and comm.bytes()["all_reduce"] == stats["replicate_bytes"]
        for (name, p), grads in zip(reducer.params, before):
            after = local_shard(p.grad)
            if step < warmup or name not in ref_q:
                _close(after, sum(grads) / 2, f"step {step} {name} (exact mean)")
                continue
            shape = ref_err[name][0].shape
            ms = [g.reshape(shape) + e for g, e in zip(grads, ref_err[name])]  # each replica's error-fed gradient
            approx, ref_q[name] = _reference_step(ms, ref_q[name], reducer.first_qs[name].double())
            _close(after.reshape(shape), approx, f"step {step} {name}")
            ref_err[name] = [m - approx for m in ms]
            _close(reducer.errors[name], ref_err[name][me], f"step {step} {name} error feedback")


def _reducer_checks(rank: int, world_size: int) -> None:
    cfg = tiny_config(attention_backend="reference", moe_backend="reference")
    pcfg = ParallelConfig(dp_replicate=2, replicate_compression="powersgd")
    mesh = build_mesh(pcfg, world_size, "cpu")
    torch.manual_seed(rank)  # different initial weights per replica: the reducer broadcasts replica 0's
    model = apply_parallelism(build_model(cfg, "cpu"), mesh, pcfg, mixed_precision=False)
    reducer = ReplicateReducer(model, mesh, rank=RANK, warmup_steps=1)
    group = mesh.group("dp_replicate")
    for _, p in reducer.params:
        a, b = _gather(local_shard(p).detach(), group)
        assert torch.equal(a, b)
    shapes = [local_shard(p).shape for _, p in reducer.params]
    vocabulary = [name in VOCABULARY for name, _ in reducer.params]
    assert sum(vocabulary) == len(VOCABULARY)
    assert all(v is None for v, vocab in zip(reducer.views, vocabulary) if vocab)  # sent whole
    assert reducer.compressed_bytes == (powersgd_bytes([s for s, vocab in zip(shapes, vocabulary) if not vocab], RANK)
                                        + 4 * sum(math.prod(s) for s, vocab in zip(shapes, vocabulary) if vocab))
    assert reducer.uncompressed_bytes == 4 * sum(math.prod(s) for s in shapes)
    assert reducer.uncompressed_bytes / reducer.compressed_bytes > 2
    if rank == 0:  # `moela plan` prices the replicate all-reduce by these bytes (rank 0's shards, the largest)
        layout = replace(layout_of(pcfg, world_size), replicate_powersgd_rank=RANK)
        planned = fsdp_collectives(param_shards(cfg, layout), layout, 1)
        assert sum(c.nbytes for c in planned if c.overlap == "replicate") == reducer.compressed_bytes
    assert any(len(s) == 3 and matrix_shape(s, RANK) for s in shapes)  # the routed experts are compressed

    _check_against_float64(model, mesh, reducer, warmup=1, steps=4)

    # the same model under HSDP sends every gradient shard whole over the replicate group, padded to equal shards
    torch.manual_seed(0)
    hsdp_cfg = ParallelConfig(dp_replicate=2)
    hsdp = apply_parallelism(build_model(cfg, "cpu"), build_mesh(hsdp_cfg, world_size, "cpu"), hsdp_cfg,
                             mixed_precision=False)
    with CommCounter() as comm:
        _backward(hsdp, mesh, seed=7)
    padded = sum(4 * -(-p.shape[0] // 2) * math.prod(p.shape[1:]) for _, p in reducer.params)
    assert comm.bytes()["all_reduce"] == padded >= reducer.uncompressed_bytes

    # at full rank (every tensor of >= 2 dims compressed) PowerSGD is the exact mean
    full = ReplicateReducer(model, mesh, rank=10**6, warmup_steps=0, min_compression=0.0)
    assert all(v is not None for (name, p), v in zip(full.params, full.views) if p.ndim >= 2 and name not in VOCABULARY)
    for step in range(3):
        _backward(model, mesh, seed=200 + step)
        before = [_gather(local_shard(p.grad).double(), group) for _, p in full.params]
        full.reduce()
        for (name, p), grads in zip(full.params, before):
            _close(local_shard(p.grad), sum(grads) / 2, f"full rank step {step} {name}", FULL_TOL)

    # a NaN in one replica's gradient: that tensor is non-finite in the whole replicate group, its error feedback is
    # zeroed and its Q kept; the next finite step is finite again
    name, p = next((n, p) for (n, p), v in zip(reducer.params, reducer.views) if v is not None)
    q_before = reducer.qs[name].clone()
    _backward(model, mesh, seed=300)
    if rank == 0:
        local_shard(p.grad).view(-1)[3] = float("nan")
    reducer.reduce()
    if mesh.rank("dp_shard") == 0:
        assert not torch.isfinite(local_shard(p.grad)).all()
        assert torch.equal(reducer.errors[name], torch.zeros_like(reducer.errors[name]))
        assert torch.equal(reducer.qs[name], q_before)
    _backward(model, mesh, seed=301)
    reducer.reduce()
    assert all(torch.isfinite(local_shard(q.grad)).all() for _, q in reducer.params)


def _expert_parallel_checks(rank: int, world_size: int) -> None:
    """Routed experts split over ep = 2 (their own FSDP mesh): reduced over the same replicas, one matrix each."""
    cfg = tiny_config(attention_backend="reference", moe_backend="reference")
    pcfg = ParallelConfig(dp_replicate=2, ep=2, replicate_compression="powersgd")
    mesh = build_mesh(pcfg, world_size, "cpu")
    torch.manual_seed(0)
    model = apply_parallelism(build_model(cfg, "cpu"), mesh, pcfg, mixed_precision=False)
    reducer = ReplicateReducer(model, mesh, rank=RANK, warmup_steps=1)
    experts = [name for name, p in reducer.params if name.endswith("experts.w13")]
    assert experts and all(reducer.errors[name].shape[0] == cfg.n_routed_experts // 2 for name in experts)
    _check_against_float64(model, mesh, reducer, warmup=1, steps=3)


def test_powersgd_reducer_on_2_replicas_x_2_shards():
    spawn(_reducer_checks, 4)


def test_powersgd_reducer_with_expert_parallelism():
    spawn(_expert_parallel_checks, 4)
