"""The kernel of each phase of mla_attention's `triton` backend (moela.ops.attention.phases): the choice is a
keyword argument (the recipe's `model.kernels`), validated, taken by one dispatch per phase for eager and compiled
calls alike, and logged once with the reason; the Gluon kernels' host-side helpers (head-dim split, 2-D views, TMA
descriptors, shared-memory fit, `auto`'s head-dim rule). CPU: the Triton kernels under TRITON_INTERPRET=1; the GPU
runs of both kernels of every phase are in test_attention_gpu.py.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

from attention_checks import make_case, naive_attention, needs_interpreter, run_with_grads
from moela.ops.attention import mla_attention
from moela.ops.attention.graph import mla_attention_in_graph

phases = pytest.importorskip("moela.ops.attention.phases")
from moela.ops.attention.kernels import gluon_common, gluon_dkdv, gluon_dq  # noqa: E402


@pytest.mark.parametrize("attention", [mla_attention, mla_attention_in_graph])
def test_kernel_choices_are_validated(attention):
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="unknown dq_kernel 'gluonn'; choose one of auto, triton, gluon"):
        attention(q, q, q, cu, 10, backend="triton", dq_kernel="gluonn")
    with pytest.raises(ValueError, match="forward_kernel='gluon' chooses among moela's kernels, which backend "
                                         "'reference' does not run"):
        attention(q, q, q, cu, 10, backend="reference", forward_kernel="gluon")


@needs_interpreter
def test_auto_runs_the_triton_kernels_and_says_once_why_not_gluon(poisoned_empty, monkeypatch, caplog):
    """Where the Gluon kernels cannot run (here: the CPU), `auto` runs the Triton kernel of every phase, with the
    reference's gradients, and each phase's dispatch logs its choice and the reason once."""
    for dispatch in (phases.FORWARD, phases.DQ, phases.DKDV):
        monkeypatch.setattr(dispatch, "logged", set())
    q, k, v, cu_q, cu_k, _, dout, _ = make_case([70, 9], [70, 9], 2, 96, 64, torch.float32, "cpu", False, seed=6)
    with caplog.at_level(logging.INFO, logger="moela.ops"):
        for _ in range(2):
            got = run_with_grads(lambda a, b, c: (mla_attention(a, b, c, cu_q, 70, backend="triton"),), q, k, v, dout,
                                 None)
    want = run_with_grads(lambda a, b, c: naive_attention(a, b, c, cu_q, cu_k, True, 96 ** -0.5, None)[:1],
                          q.double(), k.double(), v.double(), dout.double(), None)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)
    why = gluon_common.supports(q, k, v, None)  # no Hopper GPU here (or a Triton without Gluon)
    said = sorted(r.getMessage() for r in caplog.records if "mla_attention " in r.getMessage())
    assert why is not None and said == sorted(
        f"mla_attention {phase}: using backend 'triton' (auto, not the Gluon kernel: {why})"
        for phase in ("forward", "dQ", "dK/dV"))


@needs_interpreter
@pytest.mark.parametrize("attention", [mla_attention, mla_attention_in_graph])
@pytest.mark.parametrize("phase,where", [("forward_kernel", "forward"), ("dq_kernel", "dQ"),
                                         ("dkdv_kernel", "dK/dV")])
def test_a_named_gluon_kernel_that_cannot_run_says_why(attention, phase, where):
    """A Gluon kernel named for a call it cannot run is an error naming the phase and the reason, from the eager
    path and from the compiled graph's op pair alike (both ask the phase's dispatch)."""
    q, k, v, cu_q, _, _, dout, _ = make_case([30, 9], [30, 9], 2, 32, 16, torch.float32, "cpu", False, seed=2)
    why = gluon_common.supports(q, k, v, None)
    with pytest.raises(ValueError, match=re.escape(f"mla_attention {where}: backend 'gluon' does not support this "
                                                   f"call ({why})")):
        run_with_grads(lambda a, b, c: (attention(a, b, c, cu_q, 30, backend="triton", **{phase: "gluon"}),), q, k,
                       v, dout, None)


@needs_interpreter
def test_the_model_passes_its_recipe_kernels_to_the_op():
    from moela.model.config import KernelsConfig
    from moela.model.transformer import build_model
    from tests.factories import packed_batch, tiny_config

    cfg = tiny_config(attention_backend="triton", kernels=KernelsConfig(attention_forward="gluon"))
    model = build_model(cfg)
    assert model.layers[0].attn.kernels == dict(forward_kernel="gluon", dq_kernel="auto", dkdv_kernel="auto")
    with pytest.raises(ValueError, match="mla_attention forward: backend 'gluon' does not support this call"):
        model(packed_batch(cfg.vocab_size, [9, 20]))


def test_gluon_head_split_and_shared_memory():
    """Dqk splits into the TMA boxes the Gluon kernels load (a power of two, then a smaller part or nothing); the dQ
    and dK/dV kernels fit the H100/H200 shared memory at the head dims they are tested on and say why where not;
    `auto` takes the Gluon dK/dV only up to Dqk + Dv = 160."""
    assert gluon_common.head_split(192) == (128, 64) and gluon_common.head_split(96) == (64, 32)
    assert gluon_common.head_split(128) == (128, 0) and gluon_common.head_split(112) == (64, 48)
    for d_qk, d_v in ((192, 128), (128, 128), (96, 64)):
        assert gluon_dq.fits(d_qk, d_v) is None and gluon_dkdv.fits(d_qk, d_v) is None
    assert "shared memory" in gluon_dkdv.fits(256, 256)
    assert gluon_dkdv.auto_problem(96, 64) is None and "192/128" in gluon_dkdv.auto_problem(192, 128)


def test_gluon_rows_without_copies_where_tma_can():
    """The Gluon kernels' 2-D view [T, H * D] of a [T, H, D] tensor: the same values, no copy for a packed or
    token-strided tensor (a slice of a wider projection output), a copy where TMA cannot address it (heads not
    packed, a token stride that is not a multiple of 16 bytes)."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(37, 5 * 96 + 32, generator=g).to(torch.bfloat16)  # token stride 512 elements = 1024 bytes
    for x, copied in ((wide[:, :480].view(37, 5, 96), False),  # a slice: token-strided, heads packed
                      (torch.randn(37, 5, 96, generator=g).to(torch.bfloat16), False),
                      (torch.randn(37, 96, 5, generator=g).to(torch.bfloat16).transpose(1, 2), True),
                      (torch.randn(37, 5 * 96 + 3, generator=g).to(torch.bfloat16)[:, :480].view(37, 5, 96), True)):
        rows = gluon_common.rows_2d(x)
        assert rows.shape == (37, 480)
        torch.testing.assert_close(rows, x.reshape(37, 480), rtol=0, atol=0)
        assert (rows.data_ptr() != x.data_ptr()) == copied
        assert rows.stride(1) == 1 and (rows.stride(0) * 2) % 16 == 0


def test_gluon_descriptors_split_dqk_into_its_boxes():
    """The Gluon kernels' TMA descriptors of a [T, H * D] view: Dqk as a power-of-two box and the rest (192 = 128 +
    64, 96 = 64 + 32; 128 has no second part, the first descriptor stands in for it), rows boxes of the asked size,
    the tensor's own shape and strides."""
    if gluon_common.gluon is None:
        pytest.skip("this Triton has no Gluon")
    g = torch.Generator().manual_seed(4)
    for d, boxes in ((192, (128, 64)), (96, (64, 32)), (128, (128, 128))):
        x2 = gluon_common.rows_2d(torch.randn(45, 3, d, generator=g).to(torch.bfloat16))
        first, second = gluon_common.descs(x2, 64, d)
        assert [first.block_shape, second.block_shape] == [[64, boxes[0]], [64, boxes[1]]]
        assert (second is first) == (d == 128)
        assert list(first.shape) == [45, 3 * d] and list(first.strides) == [3 * d, 1]
    single = gluon_common.descs(gluon_common.rows_2d(torch.zeros(9, 2, 64, dtype=torch.bfloat16)), 128, 64,
                                split=False)
    assert single.block_shape == [128, 64]
