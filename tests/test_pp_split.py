"""The zero-bubble backward split (`moela.parallel.pp_split.SplitBackward`): I then W gives exactly the gradients of
one whole backward (float64, against `torch.autograd.backward`), I accumulates no parameter gradient, and W runs no
node of the inputs' part of the graph again."""

from __future__ import annotations

import pytest
import torch

from moela.parallel.pp_split import SplitBackward


def _stage(seed: int):
    """A stage-like graph in float64: two received inputs, a tied weight used twice, a parameter reached only
    through a loss term of the parameters alone, a norm, and a root with its own seed."""
    g = torch.Generator().manual_seed(seed)

    def param(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    params = {"w1": param(7, 5), "b1": param(5), "tied": param(5, 5), "w2": param(5, 3), "norm": param(5),
              "penalty": param(3)}
    inputs = [torch.randn(11, 7, generator=g, dtype=torch.float64).requires_grad_(),
              torch.randn(11, 5, generator=g, dtype=torch.float64).requires_grad_()]

    def roots():
        x, a1 = inputs
        h = torch.tanh(x @ params["w1"] + params["b1"]) + a1
        h = torch.nn.functional.rms_norm(h @ params["tied"], (5,), params["norm"])
        h = torch.relu(h @ params["tied"])
        out = h @ params["w2"]  # [11, 3]: sent on, its gradient received
        loss = out.square().mean() + 0.1 * params["penalty"].square().sum()
        return [out, loss], [torch.randn(11, 3, generator=g, dtype=torch.float64), torch.ones((), dtype=torch.float64)]

    return params, inputs, roots


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_inputs_then_weights_equal_one_whole_backward(seed):
    params, inputs, roots = _stage(seed)
    tensors, seeds = roots()
    torch.autograd.backward(tensors, seeds)
    want = {n: p.grad.clone() for n, p in params.items()}
    want_inputs = [t.grad.clone() for t in inputs]

    params, inputs, roots = _stage(seed)  # the same values and seeds, fresh leaves
    tensors, seeds = roots()
    split = SplitBackward(tensors, seeds, inputs)
    got_inputs = split.inputs_grad()
    assert all(p.grad is None for p in params.values()), "I accumulated a parameter gradient"
    for got, ref in zip(got_inputs, want_inputs):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    split.weights_grad()
    for name, p in params.items():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-12, atol=1e-12, msg=name)
    assert all(t.grad is None for t in inputs), "W accumulated into the inputs"


def test_weights_pass_runs_no_node_of_the_inputs_part():
    torch.manual_seed(3)
    x = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    w1, w2 = (torch.randn(6, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mid = torch.tanh(x @ w1)
    out = mid @ w2
    calls = {"I": 0, "W": 0}
    phase = "I"

    def count(_):
        calls[phase] += 1

    mid.grad_fn.register_prehook(count)  # tanh's backward: only on the way to x
    split = SplitBackward([out], [torch.randn(9, 6, dtype=torch.float64)], [x])
    split.inputs_grad()
    phase = "W"
    split.weights_grad()
    assert calls == {"I": 1, "W": 0}
    assert w1.grad is not None and w2.grad is not None


def test_an_input_the_roots_do_not_reach_gets_none():
    torch.manual_seed(4)
    x, unused = torch.randn(4, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)
    split = SplitBackward([(x @ w).sum()], [torch.ones(())], [x, unused])
    dx, du = split.inputs_grad()
    assert du is None and torch.allclose(dx, torch.ones(4, 3) @ w.detach().T)
    split.weights_grad()
    torch.testing.assert_close(w.grad, x.detach().T @ torch.ones(4, 3))


class _OnceMatmul(torch.autograd.Function):
    """x @ w whose backward may run once: it overwrites its saved input (as the fused expert op reuses buffers)."""

    calls = 0

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x.clone(), w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        _OnceMatmul.calls += 1
        x, w = ctx.saved_tensors
        dw = x.T @ g
        x.zero_()  # a second run would see zeros
        return g @ w.T, dw


def test_a_custom_function_boundary_runs_once_and_its_weight_gradient_is_kept():
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(6, 4, generator=g, dtype=torch.float64)
    w0, v0 = torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)
    seed = torch.randn(6, 3, generator=g, dtype=torch.float64)

    def leaves():
        return x0.clone().requires_grad_(), w0.clone().requires_grad_(), v0.clone().requires_grad_()

    x, w, v = leaves()
    (torch.tanh(_OnceMatmul.apply(x, w)) @ v).backward(seed)
    want = [t.grad for t in (x, w, v)]
    x, w, v = leaves()
    _OnceMatmul.calls = 0
    split = SplitBackward([torch.tanh(_OnceMatmul.apply(x, w)) @ v], [seed], [x])
    (dx,) = split.inputs_grad()
    split.weights_grad()
    assert _OnceMatmul.calls == 1
    for got, ref in zip((dx, w.grad, v.grad), want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
