"""The attention op pair that compiled graphs hold (moela.ops.attention.graph): against float64 on packed odd
lengths, empty and single-token documents, a longer k side and ALiBi, with and without the lse gradient; the ops'
registration checked by torch.library.opcheck (schema, fake tensors, autograd, AOT dispatch with dynamic shapes);
which calls are traced; and the dispatch's restriction to backends with separate forward and backward kernels.
CPU: the Triton kernels under TRITON_INTERPRET=1. `-m gpu`: the flash backend through the pair against its own
autograd path and float64.
"""

from __future__ import annotations

import logging

import pytest
import torch

from attention_checks import check_against_float64, make_case, needs_interpreter, run_with_grads
from moela.ops.attention import api as attn_api
from moela.ops.attention import mla_attention
from moela.ops.attention.graph import mla_attention_in_graph, traces_in_graph
from moela.ops.dispatch import Dispatch


@needs_interpreter
@pytest.mark.parametrize("lens_q,lens_k,alibi,with_lse", [
    ([1, 7, 129, 0, 64], [1, 7, 129, 0, 64], False, True),  # single-token and empty documents, z-loss gradient
    ([5, 40], [9, 71], True, True),  # a longer k side (bottom-right causal), ALiBi
    ([33, 2], [33, 2], False, False),  # out alone: the lse gets no gradient
])
def test_op_pair_matches_float64(poisoned_empty, lens_q, lens_k, alibi, with_lse):
    check_against_float64(lens_q, lens_k, 3, 40, 24, torch.float32, "cpu", True, alibi, seed=len(lens_q) + alibi,
                          backend="triton", with_lse=with_lse, attention=mla_attention_in_graph)


@needs_interpreter
def test_op_pair_equals_the_eager_backend_and_handles_no_tokens():
    q, k, v, cu, _, _, dout, dlse = make_case([6, 17], [6, 17], 2, 32, 16, torch.float32, "cpu", False, seed=5)
    eager, pair = (run_with_grads(lambda a, b, c, fn=fn: fn(a, b, c, cu, 17, return_lse=True, backend="triton"),
                                  q, k, v, dout, dlse) for fn in (mla_attention, mla_attention_in_graph))
    for a, b in zip(eager, pair):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same kernels on the same inputs
    empty = torch.zeros(0, 2, 32, requires_grad=True)
    out, lse = mla_attention_in_graph(empty, empty, torch.zeros(0, 2, 16), torch.zeros(1, dtype=torch.int32), 0,
                                      return_lse=True, backend="triton")
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    out.sum().backward()
    assert empty.grad.shape == empty.shape


@needs_interpreter
def test_opcheck_of_the_op_pair():
    """torch.library's own checks: the schema, the fake implementations' shapes and strides against the real ones,
    the autograd registration, and AOT dispatch with static and dynamic shapes."""
    torch.manual_seed(0)
    q, k, v, cu, _, _, dout, dlse = make_case([5, 11], [5, 11], 2, 24, 16, torch.float32, "cpu", False, seed=8)
    kernels = ("auto", "triton", "auto")  # forward, dQ, dK/dV
    fwd_args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu, cu, 11, 11, True, 0.2, None, True,
                "triton", *kernels)
    torch.library.opcheck(torch.ops.moela.mla_attention_fwd.default, fwd_args)
    with torch.no_grad():
        out, lse = torch.ops.moela.mla_attention_fwd(*fwd_args)
    bwd_args = (dout, dlse, q.detach(), k.detach(), v.detach(), out, lse, cu, cu, 11, 11, True, 0.2, None, True,
                "triton", *kernels)
    torch.library.opcheck(torch.ops.moela.mla_attention_bwd.default, bwd_args)


def test_which_calls_a_graph_traces():
    """Backends with separate kernels are traced; the others, and auto on the CPU (no kernel backend can run), stay
    graph breaks."""
    for backend in ("reference", "sdpa", "flash"):
        assert not traces_in_graph("cpu", None, torch.float32, 192, 128, False, backend)
    assert not traces_in_graph("cpu", None, torch.bfloat16, 192, 128, False, "auto")
    if "triton" in attn_api.DISPATCH.fast:
        from moela.ops.triton_env import INTERPRET

        assert traces_in_graph("cpu", None, torch.float32, 192, 128, False, "triton") == INTERPRET
        assert not traces_in_graph("cpu", None, torch.float32, 320, 128, False, "triton")  # head dims over 256


def test_dispatch_among_skips_and_names_the_backends_a_form_cannot_run(caplog):
    d = Dispatch("op", ("auto", "reference", "sdpa", "flash", "triton"),
                 rank=lambda *a, **k: (["sdpa", "triton"], "measured: sdpa 465 > triton 372"))
    d.register("sdpa", lambda *a: "sdpa", auto=lambda *a, **k: True)
    d.register("triton", lambda *a: "triton", auto=lambda *a, **k: True)
    with caplog.at_level(logging.INFO, logger="moela.ops"):
        assert d.choose("auto", among=("flash", "triton")) == "triton"
        assert d.choose("auto") == "sdpa"
    assert "sdpa cannot run in this form of the op (it runs flash, triton)" in caplog.text
    with pytest.raises(ValueError, match="'sdpa' cannot run in this form"):
        d.choose("sdpa", among=("flash", "triton"))
    d2 = Dispatch("op2", ("auto", "reference", "sdpa"))
    d2.register("sdpa", lambda *a: "sdpa", auto=lambda *a, **k: True)
    with pytest.raises(RuntimeError, match="none of flash, triton can run this call"):
        d2.choose("auto", among=("flash", "triton"))
    assert d2.choose("auto", among=("reference",)) == "reference"


def test_the_op_pair_needs_max_seqlen_k_with_cu_seqlens_k():
    q = torch.zeros(4, 1, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs max_seqlen_k"):
        mla_attention_in_graph(q, q, q, cu, 4, cu_seqlens_k=cu, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("with_lse", [True, False])
def test_flash_through_the_op_pair_gpu(with_lse):
    """flash-attn-4 through the pair: against float64, and equal to its own autograd path (the same kernels; its dq
    accumulates with float32 atomics, so equal to a tight tolerance rather than bitwise)."""
    from moela.ops.attention.flash import flash_problem

    probe = torch.empty(1, 1, 192, dtype=torch.bfloat16, device="cuda")
    problem = flash_problem(probe, probe, probe[..., :128])
    if problem is not None:
        pytest.skip(problem)
    lens = [1, 300, 77, 0, 1029]
    check_against_float64(lens, lens, 4, 192, 128, torch.bfloat16, "cuda", True, False, seed=3, backend="flash",
                          ulps=4.0, with_lse=with_lse, attention=mla_attention_in_graph)
    q, k, v, cu, _, _, dout, dlse = make_case(lens, lens, 4, 192, 128, torch.bfloat16, "cuda", False, seed=4)
    results = [run_with_grads(lambda a, b, c, fn=fn: fn(a, b, c, cu, max(lens), return_lse=True, backend="flash"),
                              q, k, v, dout, dlse) for fn in (mla_attention, mla_attention_in_graph)]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)
