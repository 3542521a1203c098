"""`router_topk`: the fused Triton router (sigmoid, bias, group-limited top-k, normalized weights in one kernel;
backward through weights and scores) against the float64 reference on odd shapes, inside a compiled graph without
a break, and in the model on CUDA. Kernels run under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import os

import pytest
import torch

from moela.ops.router import router_topk, router_topk_reference

KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [pytest.mark.skipif(not KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_empty")]  # tests/conftest.py: unwritten outputs read as NaN
DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (T, E, n_group, topk_group, K, norm_topk_prob, scaling): DeepSeek-V3-like groups, no groups (V2-Lite), groups of
# a size that is not a power of two, more experts than a group holds, and a single token
CASES = [(37, 8, 2, 1, 2, True, 1.0), (53, 32, 4, 2, 4, True, 2.5), (29, 64, 1, 1, 6, False, 1.0),
         (41, 24, 4, 2, 3, True, 1.0), (5, 12, 3, 2, 5, False, 0.7), (1, 16, 2, 2, 8, True, 1.0)]


@pytest.mark.parametrize("case", CASES)
def test_triton_router_matches_the_float64_reference(case):
    t, e, g, tg, k, norm, scaling = case
    gen = torch.Generator().manual_seed(t * e + k)
    logits = torch.randn(t, e, generator=gen, dtype=torch.float64) * 2  # [T, E]
    bias = torch.randn(e, generator=gen) * 0.1  # [E]
    d_weights, d_scores = torch.randn(t, k, generator=gen, dtype=torch.float64), torch.randn(t, e, generator=gen,
                                                                                            dtype=torch.float64)
    kernel_in = logits.float().to(DEV).requires_grad_()
    ids, weights, scores = router_topk(kernel_in, bias.to(DEV), n_group=g, topk_group=tg, topk=k,
                                       norm_topk_prob=norm, scaling=scaling, backend="triton")
    ref_in = logits.clone().requires_grad_()
    ref_ids, ref_weights, ref_scores = router_topk_reference(ref_in, bias.double(), g, tg, k, norm, scaling)
    assert ids.dtype == torch.int64 and torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.double().cpu(), ref_weights, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(scores.double().cpu(), ref_scores, rtol=1e-6, atol=1e-7)
    ((weights.double().cpu() * d_weights).sum() + (scores.double().cpu() * d_scores).sum()).backward()
    ((ref_weights * d_weights).sum() + (ref_scores * d_scores).sum()).backward()
    torch.testing.assert_close(kernel_in.grad.double().cpu(), ref_in.grad, rtol=1e-5, atol=1e-6)  # float32 math


def test_triton_router_gradient_from_the_weights_alone():
    """Without the balance loss only the weights carry a gradient (d scores is None in the backward)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(19, 32, generator=gen) * 2
    outs = []
    for backend in ("triton", "reference"):
        x = logits.clone().to(DEV).requires_grad_()
        _, w, _ = router_topk(x, torch.zeros(32, device=DEV), n_group=4, topk_group=2, topk=4, norm_topk_prob=True,
                              scaling=1.0, backend=backend)
        (w * torch.arange(4.0, device=DEV)).sum().backward()
        outs.append(x.grad.cpu())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-7)


def test_triton_router_stays_in_a_compiled_graph():
    """A custom op with a fake implementation: Dynamo traces it without a graph break."""
    def route(logits, bias):
        ids, w, s = router_topk(logits.float() * 2, bias, n_group=4, topk_group=2, topk=4, norm_topk_prob=True,
                                scaling=1.0, backend="triton")
        return w.sum() + s.mean(), ids

    logits, bias = torch.randn(13, 32, device=DEV), torch.zeros(32, device=DEV)
    explained = torch._dynamo.explain(route)(logits, bias)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(route, backend="aot_eager", fullgraph=True)
    (got, got_ids), (want, want_ids) = compiled(logits, bias), route(logits, bias)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got, want)


def test_bad_routing_settings_are_rejected_with_the_fix():
    logits = torch.randn(4, 12)
    with pytest.raises(ValueError, match="n_group must divide E"):
        router_topk(logits, torch.zeros(12), n_group=5, topk_group=1, topk=2, norm_topk_prob=True, scaling=1.0)
    with pytest.raises(ValueError, match="cannot be chosen"):
        router_topk(logits, torch.zeros(12), n_group=3, topk_group=1, topk=5, norm_topk_prob=True, scaling=1.0)


@pytest.mark.gpu
def test_triton_router_at_deepseek_v3_shape_on_cuda():
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(16411, 256, device="cuda", generator=gen)
    bias = torch.randn(256, device="cuda", generator=gen) * 0.05
    ids, w, s = router_topk(logits, bias, n_group=8, topk_group=4, topk=8, norm_topk_prob=True, scaling=2.5,
                            backend="triton")
    ref_ids, ref_w, ref_s = router_topk_reference(logits.double(), bias.double(), 8, 4, 8, True, 2.5)
    agree = (ids == ref_ids).all(-1).float().mean().item()
    assert agree > 0.999, agree  # float32 vs float64 sums may swap near-equal neighbours
    torch.testing.assert_close(s.double(), ref_s, rtol=1e-6, atol=1e-7)
