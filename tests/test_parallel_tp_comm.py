"""The tensor-parallel collectives of one block (forward + backward, tp=2 on gloo), counted by `CommCounter`.

Per block and micro-batch of T tokens (padded to a multiple of tp), rows = T / tp, L = the latents' width
(q_lora_rank + kv_lora_rank + qk_rope_head_dim), D hidden, float32 (4 bytes):
- standard and FAL+: forward all-gathers of the latents [rows, L] and of the MLP input [rows, D], and a
  reduce-scatter of each sublayer's partial output [T, D]; the backward mirrors them (reduce-scatters of the
  gathered inputs' gradients [T, L] and [T, D], all-gathers of the outputs' gradients [rows, D]): 4 + 4.
- FAL: the attention's and the MLP's partial outputs share ONE reduce-scatter (and its backward ONE all-gather):
  the output reductions halve, 3 + 3 collectives in all.
- layer QK-Norm adds one all-reduce of [T, 2] float32 each way - 8 bytes a token - where the all-gather
  formulation moves q and k of every head (2 x H x Dqk values a token; here 2 x 2 x 16 x 4 = 256 bytes).
- an MoE block with the sequence-wise balance loss all-reduces its per-document statistics [N, 2E + 1] once
  (forward only: the loss is the same on every rank, the backward of that sum is the identity).
Head QK-Norm and the routed experts (expert-TP = 1, no expert parallelism) add nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from factories import packed_batch, tiny_config
from moela.model import build_model
from moela.parallel import build_mesh
from moela.parallel.comm import CommCounter
from moela.parallel.config import ParallelConfig
from moela.parallel.tensor_parallel import GroupQKNorm, apply_tensor_parallel
from parallel_harness import spawn

LENS = [7, 6]  # T = 13 tokens, padded to 14: 7 rows per rank
T, ROWS, D, L = 14, 7, 32, 24 + 16 + 8
QK_LOCAL = 16  # this rank's q (or k) columns: 1 of the 2 heads, Dqk = 16


def block_collectives(rank: int, block_kind: str, qk_norm: str, dense: bool, allgather_qk: bool = False):
    cfg = tiny_config(vocab_size=96, block=block_kind, qk_norm=qk_norm, first_k_dense_replace=3 if dense else 1,
                      attention_backend="reference", moe_backend="reference")
    mesh = build_mesh(ParallelConfig(tp=2), 2, "cpu")
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    tp = apply_tensor_parallel(model, mesh["tp"])
    block = model.layers[1]
    if allgather_qk:
        block.attn.layer_qk_norm = GroupQKNorm(mesh["tp"].get_group(), allgather=True)
    part = tp.split(packed_batch(96, LENS, seed=1), [], None)
    ctx = model._context(part.batch, part.batch.num_targets(), part)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(ROWS, D, generator=g, requires_grad=True)  # this rank's rows of the residual stream
    a1 = torch.randn(ROWS, D, generator=g, requires_grad=True)
    with CommCounter() as comm:
        out, _, z, aux, _ = block(x, ctx, a1)
        (out.square().sum() + z + aux).backward()
    assert torch.isfinite(x.grad).all()
    return comm


def _check(rank: int, world_size: int) -> None:
    f32 = 4
    gather_fwd = {"latents": ROWS * L * f32, "mlp": ROWS * D * f32}
    for kind, reductions in (("standard", 2), ("fal_plus", 2), ("fal", 1)):
        for dense in (True, False):
            comm = block_collectives(rank, kind, "none", dense)
            what = f"{kind} dense={dense}: {comm.collectives}"
            stats = {} if dense else {"all_reduce": 1}
            assert comm.counts() == {"all_gather": 2 + reductions, "reduce_scatter": 2 + reductions, **stats}, what
            assert comm.bytes()["all_reduce"] == (0 if dense else len(LENS) * (2 * 8 + 1) * f32), what
            assert sorted(c.nbytes for c in comm.collectives if c.kind == "all_gather") == sorted(
                [*gather_fwd.values()] + [ROWS * D * f32] * reductions), what
            assert comm.bytes()["reduce_scatter"] == (reductions * T * D + T * L + T * D) * f32, what
    base = block_collectives(rank, "fal", "none", False).counts()
    assert block_collectives(rank, "fal", "head", False).counts() == base  # head QK-Norm: no communication
    scalar = block_collectives(rank, "fal", "layer", False)
    assert scalar.counts() - base == {"all_reduce": 2}
    assert [c.nbytes for c in scalar.collectives if c.kind == "all_reduce" and c.shape == (T, 2)] == [T * 2 * f32] * 2
    gathered = block_collectives(rank, "fal", "layer", False, allgather_qk=True)
    extra = gathered.bytes() - block_collectives(rank, "fal", "none", False).bytes()
    assert gathered.counts()["all_reduce"] == base["all_reduce"]
    # each rank hands in its q and k columns (and gets every head's back), and reduce-scatters their gradients
    assert extra["all_gather"] >= T * 2 * QK_LOCAL * f32 and extra["reduce_scatter"] >= T * 2 * 2 * QK_LOCAL * f32
    dist.barrier()


def test_block_collectives_fal_halves_the_reductions_and_layer_qk_norm_sends_8_bytes_a_token():
    spawn(_check, 2)
