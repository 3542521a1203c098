"""SwiGLU between the MoE GEMMs: the forward (+ 1x128 quantization) and the backward (plain, quantized by rows and
columns, and its Gluon twin on Hopper) against autograd and float64 math. Kernels run under TRITON_INTERPRET=1 on
CPU; `-m gpu` tests need a GPU."""

import pytest
import torch
import torch.nn.functional as F

from moe_cases import DEV, HALF, MOE_MARKS, rel, routing
from moela.ops.moe.quant_spec import dequant_1x128, quant_1x128

pytestmark = MOE_MARKS
gpu = pytest.mark.gpu


def test_swiglu_kernels_match_autograd():
    from moela.ops.moe.kernels.permute import build_layout
    from moela.ops.moe.kernels.swiglu import swiglu_bwd, swiglu_fwd

    f = 256
    lay = build_layout(routing(60, 3, 2), 3)
    h = torch.randn(lay.m_pad, 2 * f, device=DEV, requires_grad=True)
    act_ref = F.silu(h[:, :f]) * h[:, f:]
    valid = (lay.m_indices >= 0)[:, None]
    act, _ = swiglu_fwd(h.detach(), lay.m_indices, quant=False)
    assert rel(act, act_ref * valid) < 1e-6
    aq, as_ = swiglu_fwd(h.detach(), lay.m_indices, quant=True)
    rq, rs = quant_1x128((act_ref * valid).detach())
    assert (aq.float() != rq.float()).float().mean() < 1e-3 and rel(as_, rs) < 1e-6
    da = torch.randn(lay.m_pad, f, device=DEV)
    (dh_ref,) = torch.autograd.grad(act_ref, h, da)
    dh, _, act2 = swiglu_bwd(h.detach(), da, lay.m_indices, quant=False)
    assert rel(dh, dh_ref * valid) < 1e-6 and rel(act2, act_ref * valid) < 1e-6
    (dq, ds), (dqt, dst), (aqt, ast) = swiglu_bwd(h.detach(), da, lay.m_indices, quant=True)
    assert rel(dequant_1x128(dq, ds), dh_ref * valid) < 0.04
    assert rel(dequant_1x128(dqt, dst).t(), dh_ref * valid) < 0.04
    assert rel(dequant_1x128(aqt, ast).t(), act_ref * valid) < 0.04


def test_unquantized_swiglu_bwd_in_bf16_against_float64():
    """The bf16 recipe's SwiGLU backward (one program per tile, all three outputs) on bf16 inputs with NaN in the
    padding rows: dg, du and the recomputed act within bf16 rounding of float64 math, padding rows exactly zero.
    F = 384: three column blocks."""
    from moela.ops.moe.kernels.permute import build_layout
    from moela.ops.moe.kernels.swiglu import swiglu_bwd

    f = 384
    lay = build_layout(routing(97, 5, 2, skew=True), 5)
    valid = (lay.m_indices >= 0)[:, None]
    dtype = HALF
    h = torch.randn(lay.m_pad, 2 * f, device=DEV).masked_fill(~valid, float("nan")).to(dtype)
    da = torch.randn(lay.m_pad, f, device=DEV).masked_fill(~valid, float("nan")).to(dtype)
    g, u, d = (torch.where(valid, t, 0).double() for t in (h[:, :f], h[:, f:], da))
    sig = torch.sigmoid(g)
    want_dh = torch.cat([d * u * sig * (1 + g * (1 - sig)), d * g * sig], 1)
    dh, _, act = swiglu_bwd(h, da, lay.m_indices, quant=False)
    assert dh.dtype == act.dtype == dtype
    assert rel(dh, want_dh) < 4e-3 and rel(act, g * sig * u) < 4e-3  # bf16 rounds to 2**-9 relative
    assert torch.equal(dh[~valid[:, 0]], torch.zeros_like(dh[~valid[:, 0]]))
    assert torch.equal(act[~valid[:, 0]], torch.zeros_like(act[~valid[:, 0]]))


@gpu
def test_gluon_swiglu_bwd_equals_the_triton_kernel():
    """The shared-memory (Gluon) SwiGLU backward writes the Triton kernel's bytes (3 column tiles, skewed routing
    with empty experts, NaN in the padding rows' inputs, which must come out as zeros) and matches autograd."""
    from moela.ops.moe.kernels import quantize_gluon
    from moela.ops.moe.kernels.permute import build_layout
    from moela.ops.moe.kernels.swiglu import swiglu_bwd

    f = 384
    lay = build_layout(routing(150, 5, 2, skew=True), 5)
    valid = (lay.m_indices >= 0)[:, None]
    h = torch.randn(lay.m_pad, 2 * f, device=DEV).masked_fill(~valid, float("nan")).to(torch.bfloat16)
    da = torch.randn(lay.m_pad, f, device=DEV).masked_fill(~valid, float("nan")).to(torch.bfloat16)
    if not quantize_gluon.available(h):
        pytest.skip("the Gluon kernels need a Hopper (sm_90) GPU and a Triton with Gluon")
    got = swiglu_bwd(h, da, lay.m_indices, quant=True, impl="gluon")
    want = swiglu_bwd(h, da, lay.m_indices, quant=True, impl="triton")
    for (q, sc), (rq, rsc) in zip(got, want):
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(sc, rsc)
    hr = torch.where(valid, h.float(), 0).requires_grad_()
    act_ref = F.silu(hr[:, :f]) * hr[:, f:]
    (dh_ref,) = torch.autograd.grad(act_ref, hr, torch.where(valid, da.float(), 0))
    (dq, ds), (dqt, dst), (aqt, ast) = got
    assert rel(dequant_1x128(dq, ds), dh_ref) < 0.04
    assert rel(dequant_1x128(dqt, dst).t(), dh_ref) < 0.04
    assert rel(dequant_1x128(aqt, ast).t(), act_ref) < 0.04
