"""Shared by the MoE expert-path tests: routings, problems, float64 math, and one forward + backward of
`moe_experts`. Kernels run under TRITON_INTERPRET=1 on CPU; `-m gpu` tests use real sizes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from moela.ops.moe import moe_experts

KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
# every MoE kernel test: Triton needs CUDA or the interpreter; unwritten outputs read as NaN (tests/conftest.py)
MOE_MARKS = [pytest.mark.skipif(not KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"),
             pytest.mark.usefixtures("poisoned_empty")]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
HALF = torch.bfloat16 if DEV == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong: fp16 on the CPU
NAMES = ["y", "dx", "dw", "dw13", "dw2"]


def routing(t, e, k, skew=False, device=DEV):
    """topk_ids [t, k] of distinct experts; skew: expert 0 picked by every token, the last expert by none."""
    if skew:
        rest = torch.stack([torch.randperm(e - 2)[: k - 1] + 1 for _ in range(t)])
        return torch.cat([torch.zeros(t, 1, dtype=torch.int64), rest], 1).to(device)
    return torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(device)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def exact(x, ids, w, w13, w2):
    """float64 y = sum_k w * W2 (silu(W1 x) * W3 x), no quantization; loops over experts (differentiable)."""
    f = w13.shape[1] // 2
    y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for ex in range(w13.shape[0]):
        tok, slot = (ids == ex).nonzero(as_tuple=True)
        h = x[tok].double() @ w13[ex].double().t()  # [M, 2F]
        o = (F.silu(h[:, :f]) * h[:, f:]) @ w2[ex].double().t()  # [M, D]
        y = y.index_add(0, tok, o * w[tok, slot].double()[:, None])
    return y


def layout_and_rows(t, e, skew):
    """The layout of t tokens routed to one of e experts, and which of its rows are real."""
    from moela.ops.moe.kernels.permute import build_layout

    lay = build_layout(routing(t, e, 1, skew=skew), e)
    return lay, lay.src >= 0


def run(x, ids, w, w13, w2, g, recipe, backend, **kernels):
    """[y, dx, d topk_weights, dw13, dw2] of `moe_experts` with upstream gradient g."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
    y = moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], recipe=recipe, backend=backend, **kernels)
    y.backward(g.to(y.dtype))
    return [y] + [t.grad for t in leaves]


def exact_grads(x, ids, w, w13, w2, g):
    """`run`'s outputs in float64 math."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w, w13, w2)]
    y = exact(leaves[0], ids, *leaves[1:])
    y.backward(g.double())
    return [y] + [t.grad for t in leaves]


def problem(t, d, f, e, k, dtype, skew=False):
    """(x [t, d], ids [t, k], topk_weights, w13 [e, 2f, d], w2 [e, d, f], upstream gradient [t, d])."""
    x = torch.randn(t, d, device=DEV, dtype=dtype)
    ids = routing(t, e, k, skew=skew)
    w = torch.rand(t, k, device=DEV)
    w13 = torch.randn(e, 2 * f, d, device=DEV) / d ** 0.5
    w2 = torch.randn(e, d, f, device=DEV) / f ** 0.5
    return x, ids, w, w13, w2, torch.randn(t, d, device=DEV)
