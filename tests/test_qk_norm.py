"""Layer-wise QK-Norm (`moela.ops.qk_norm`): the Triton kernels and the pure-torch reference against float64, on one
rank and with the columns split over 2 gloo ranks (the scalar exchange and the all-gather formulation), forward and
backward; the small all-reduce of its statistics (`moela.ops.small_all_reduce`; symmetric memory on 2 GPUs).

Pass rule (DESIGN.md): err(candidate) <= 2 * err(torch reference in the same dtype) + atol, against float64 math
on the full width. Fresh random inputs, odd sizes (T = 37 tokens, widths 45 and 51 that no block size divides),
outputs poisoned (NaN) before the kernels so an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moela.ops import qk_norm_triton as kernels
from moela.ops import small_all_reduce
from moela.ops.qk_norm import qk_rms_norm, qk_rms_norm_allgather
from moela.ops.small_all_reduce import sum_small
from parallel_harness import spawn

needs_interpreter = pytest.mark.skipif(not kernels.INTERPRET, reason="set TRITON_INTERPRET=1 to run Triton on CPU")
EPS = 1e-6


def inputs(t: int, nq: int, nk: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, nq, generator=g) * 3).to(dtype)
    k = torch.randn(t, nk, generator=g).to(dtype)
    wq, wk = torch.rand(nq, generator=g) + 0.5, torch.rand(nk, generator=g) + 0.5
    gq, gk = torch.randn(t, nq, generator=g).to(dtype), torch.randn(t, nk, generator=g).to(dtype)
    return q, k, wq, wk, gq, gk


def run(fn, q, k, wq, wk, gq, gk):
    """Outputs and the gradients of sum(y * g) for q, k and both weights."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, wq, wk)]
    yq, yk = fn(*leaves)
    loss = (yq.double() * gq.double()).sum() + (yk.double() * gk.double()).sum()
    return [yq, yk, *torch.autograd.grad(loss, leaves)]


def float64_truth(q, k, wq, wk, gq, gk):
    def full(q, k, wq, wk):
        return qk_rms_norm(q, k, wq, wk, EPS, backend="reference")

    return run(full, *(t.double() for t in (q, k, wq, wk, gq, gk)))


def check(got, same_dtype_reference, truth, atol):
    """Each output's largest error against float64 within twice the same-dtype reference's plus `atol` relative to
    the output's size: the weight gradients are sums over all tokens (values ~100 at 1531 tokens), where a fixed
    absolute tolerance would measure the summation order, not the kernel."""
    for name, g, r, x in zip(("yq", "yk", "dq", "dk", "dwq", "dwk"), got, same_dtype_reference, truth):
        err = (g.double() - x).abs().max().item()
        ref_err = (r.double() - x).abs().max().item()
        scale = max(1.0, x.abs().max().item())
        assert err <= 2 * ref_err + atol * scale, f"{name}: error {err:.3g} vs the reference's {ref_err:.3g}"


@needs_interpreter
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_triton_matches_float64(dtype, atol, poisoned_empty):
    args = inputs(37, 45, 51, dtype, seed=11)
    truth = float64_truth(*args)
    reference = run(lambda *a: qk_rms_norm(*a, EPS, backend="reference"), *args)
    got = run(lambda *a: qk_rms_norm(*a, EPS, backend="triton"), *args)
    assert got[0].dtype == dtype and got[4].dtype == torch.float32
    check(got, reference, truth, atol)


def test_weight_and_shape_errors_are_named():
    q, k, wq, wk, _, _ = inputs(5, 8, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"q_weight must be \[Nq\]=8"):
        qk_rms_norm(q, k, wk[:3], wk)
    with pytest.raises(ValueError, match="the same T"):
        qk_rms_norm(q, k[:4], wq, wk)


def _split_columns(rank: int, world_size: int, backends) -> None:
    args = inputs(37, 2 * 23, 2 * 25, torch.float32, seed=5)  # each rank: 23 q columns and 25 k columns
    truth = float64_truth(*args)
    cols = [slice(rank * t.shape[-1] // world_size, (rank + 1) * t.shape[-1] // world_size) for t in args]
    mine = [t[..., c] for t, c in zip(args, cols)]  # this rank's columns of q, k, wq, wk, gq, gk
    local_truth = [x[..., c] for x, c in zip(truth, (cols[0], cols[1], cols[0], cols[1], cols[2], cols[3]))]
    group = dist.group.WORLD
    stats = torch.randn(37, 2, generator=torch.Generator().manual_seed(rank))
    summed = stats.clone()
    sum_small(summed, group)  # auto: gloo has no symmetric memory, the group's all-reduce runs
    expected = stats.clone()
    dist.all_reduce(expected)
    assert torch.equal(summed, expected) and small_all_reduce._CHOSEN[group.group_name] == "all_reduce"
    reference = run(lambda *a: qk_rms_norm(*a, EPS, group=group, backend="reference"), *mine)
    candidates = {"allgather": run(lambda *a: qk_rms_norm_allgather(*a, EPS, group), *mine)}
    for backend in backends:
        candidates[backend] = run(lambda *a, backend=backend: qk_rms_norm(*a, EPS, group=group, backend=backend),
                                  *mine)
    for got, x in zip(reference, local_truth):  # the reference itself, absolutely (float32 rounding)
        assert (got.double() - x).abs().max().item() < 1e-4
    for name, got in candidates.items():
        try:
            check(got, reference, local_truth, 1e-5)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_columns_split_over_two_ranks_match_the_full_width():
    """Each rank holds half of the heads: the per-token scalars exchanged give the full-width statistic; the
    all-gather formulation gives the same."""
    spawn(_split_columns, 2, ("triton",) if kernels.INTERPRET else ())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_matches_float64_on_cuda(dtype, atol, poisoned_empty):
    """The compiled kernels at model-like widths (16 heads x 192) and an odd token count."""
    args = [t.cuda() for t in inputs(1531, 16 * 192, 16 * 192, dtype, seed=13)]
    truth = float64_truth(*args)
    reference = run(lambda *a: qk_rms_norm(*a, EPS, backend="reference"), *args)
    got = run(lambda *a: qk_rms_norm(*a, EPS, backend="auto"), *args)
    check(got, reference, truth, atol)


def _symmetric_memory(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    for rows in (37, 4099):  # the second call grows the buffer (a new rendezvous)
        stats = torch.randn(rows, 2, generator=torch.Generator().manual_seed(rank), device="cuda")
        expected = stats.clone()
        dist.all_reduce(expected)
        got = stats.clone()
        sum_small(got, group, exchange="symm_mem")
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    assert small_all_reduce._verified(stats, group) == "symm_mem"  # auto picks it on NVLink peers


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_symmetric_memory_sum_equals_the_all_reduce_on_two_gpus():
    spawn(_symmetric_memory, 2, backend="nccl")
