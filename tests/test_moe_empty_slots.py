"""`moe_experts` with empty slots (topk_ids < 0), as expert parallelism hands it: a received token's slots whose
experts live on other ranks, and padding rows with no slot at all. An empty slot contributes nothing, takes no row
of the layout and its weight gets no gradient; every backend must agree with float64 math over the used slots.
Kernels run under TRITON_INTERPRET=1 on CPU (fp16 operands: the interpreter's bf16 dot is wrong)."""

import pytest
import torch

from moe_cases import DEV, KERNELS, exact_grads, rel, run
from moela.ops.moe import moe_experts
from moela.ops.moe.kernels.permute import permute_align


def _problem_with_empty_slots(t, d, f, e, k, dtype):
    """Random routing with about a third of the slots empty and the last 5 tokens entirely empty."""
    g = torch.Generator().manual_seed(t * 100 + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, K]
    ids[torch.rand(t, k, generator=g) < 0.35] = -1
    ids[-5:] = -1
    x = torch.randn(t, d, generator=g).to(DEV, dtype)  # [T, D]
    w = torch.rand(t, k, generator=g).to(DEV)  # [T, K]
    w13 = (torch.randn(e, 2 * f, d, generator=g) / d ** 0.5).to(DEV)  # [E, 2F, D]
    w2 = (torch.randn(e, d, f, generator=g) / f ** 0.5).to(DEV)  # [E, D, F]
    return x, ids.to(DEV), w, w13, w2, torch.randn(t, d, generator=g).to(DEV)


def test_reference_ignores_empty_slots():
    x, ids, w, w13, w2, g = _problem_with_empty_slots(23, 24, 20, 5, 3, torch.float64)
    got = run(x, ids, w, w13, w2, g, "bf16", "reference")
    exact = exact_grads(x, ids, w, w13, w2, g)
    for name, a, b in zip(["y", "dx", "dw", "dw13", "dw2"], got, exact):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=name)  # float32 weights vs float64
    assert (got[2][ids < 0] == 0).all()


@pytest.mark.skipif(not KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
@pytest.mark.usefixtures("poisoned_empty")
def test_layout_gives_empty_slots_no_row():
    _, ids, _, _, _, _ = _problem_with_empty_slots(37, 128, 128, 4, 3, torch.float16)
    x = torch.randn(37, 128, device=DEV, dtype=torch.float16)
    xp, _, lay = permute_align(x, ids, 4, quant=None)
    used = ids.reshape(-1) >= 0
    row_map = lay.row_map.long()
    assert (row_map[~used] == -1).all() and (row_map[used] >= 0).all()
    assert torch.equal(lay.counts.cpu(), torch.bincount(ids[ids >= 0].cpu(), minlength=4))
    assert int((lay.src >= 0).sum()) == int(used.sum())
    tok = torch.arange(37, device=DEV).repeat_interleave(3)[used]
    torch.testing.assert_close(xp[row_map[used]], x[tok])


@pytest.mark.skipif(not KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("recipe", ["bf16", "fp8_blockwise"])
def test_fused_path_with_empty_slots_vs_float64(recipe):
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float16
    prob = _problem_with_empty_slots(19, 128, 128, 3, 2, dtype)
    ids = prob[1]
    got = run(*prob, recipe, "triton")
    ref = run(*prob, recipe, "reference")
    exact = exact_grads(*prob)
    slack = 4 * torch.finfo(dtype).eps / 2 if recipe == "bf16" else 1e-3
    factor = 2.0 if recipe == "bf16" else 2.5
    for name, a, r, ex in zip(["y", "dx", "dw", "dw13", "dw2"], got, ref, exact):
        assert torch.isfinite(a).all(), name
        assert rel(a, ex) <= factor * rel(r, ex) + slack, (name, rel(a, ex), rel(r, ex))
    assert (got[0][-5:] == 0).all() and (got[1][-5:] == 0).all()  # tokens with no slot: y = 0, dx = 0
    assert (got[2][ids < 0] == 0).all()  # empty slots' weights get no gradient


def test_all_slots_empty_gives_zeros():
    x, ids, w, w13, w2, g = _problem_with_empty_slots(9, 24, 20, 5, 2, torch.float32)
    ids = torch.full_like(ids, -1)
    y = moe_experts(x, ids, w, w13, w2, backend="reference")
    assert y.shape == x.shape and (y == 0).all()
