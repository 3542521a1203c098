"""The in-place RoPE of the query's rotary columns (`moela.ops.rope_triton.rope_columns_`) against float64 math, and
MLA with it against MLA with the out-of-place split / rope / cat. Under TRITON_INTERPRET=1 on CPU; on CUDA too."""

from __future__ import annotations

import pytest
import torch

from factories import packed_batch, tiny_config
from moela.model import attention as attention_mod
from moela.model import build_model
from moela.model.config import RopeScaling
from moela.ops.rope import rope_reference, yarn_inv_freq
from moela.ops.triton_env import INTERPRET

rope_triton = pytest.importorskip("moela.ops.rope_triton")
DEVICES = (["cpu"] if INTERPRET else []) + (["cuda"] if torch.cuda.is_available() else [])
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs TRITON_INTERPRET=1 (CPU) or CUDA for the Triton kernel")


def _truth(x: torch.Tensor, pos, inv_freq, col0: int, factor: float) -> torch.Tensor:
    """float64: x with columns col0 .. col0 + R rotated, by the reference formula."""
    r = 2 * inv_freq.numel()
    x = x.double()
    rot = rope_reference(x[..., col0:col0 + r], pos, inv_freq.double(), factor)
    return torch.cat((x[..., :col0], rot, x[..., col0 + r:]), dim=-1)


# (T, H, D, col0, R): R/2 a power of two and not (R = 12), rotary columns at the end and in the middle
SHAPES = [(37, 3, 24, 8, 16), (70, 2, 20, 6, 12), (9, 5, 40, 20, 16)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_value_and_gradient_match_float64(device, shape, dtype, atol):
    t, h, d, col0, r = shape
    g = torch.Generator().manual_seed(t * 100 + d)
    pos = torch.randint(0, 4000, (t,), generator=g)  # angles far past 2 pi, as deep in a long document
    inv_freq = yarn_inv_freq(r, 10000.0, factor=4.0, original_max_position_embeddings=512)
    x64 = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    grad = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    leaf = x64.to(device, dtype).requires_grad_()
    out = rope_triton.rope_columns_(leaf * 1, pos.to(device), inv_freq.to(device), col0, attention_factor=1.3)
    out.backward(grad.to(device, dtype))
    ref_leaf = leaf.detach().double().cpu().requires_grad_()
    truth = _truth(ref_leaf, pos, inv_freq, col0, 1.3)
    truth.backward(grad)
    assert torch.allclose(out.double().cpu(), truth.detach(), atol=atol, rtol=atol)
    assert torch.allclose(leaf.grad.double().cpu(), ref_leaf.grad, atol=atol, rtol=atol)


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_of_a_head_view_and_an_expanded_gradient(device):
    """The model's case: the input is the projection's [T, H*D] output viewed as heads; `sum()` hands the backward
    an expanded (stride 0) gradient, which must be copied before it is rotated."""
    torch.manual_seed(3)
    t, h, d, col0, r = 29, 4, 12, 4, 8
    pos = torch.randint(0, 300, (t,)).to(device)
    inv_freq = yarn_inv_freq(r, 10000.0).to(device)
    a = torch.randn(t, 10, device=device, requires_grad=True)
    w = torch.randn(h * d, 10, device=device, requires_grad=True)
    out = rope_triton.rope_columns_((a @ w.t()).view(t, h, d), pos, inv_freq, col0)
    out.sum().backward()
    a64, w64 = a.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    _truth((a64 @ w64.t()).view(t, h, d), pos, inv_freq.double(), col0, 1.0).sum().backward()
    assert torch.allclose(a.grad.double(), a64.grad, atol=1e-4, rtol=1e-4)
    assert torch.allclose(w.grad.double(), w64.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_input_saved_by_another_op_fails_loudly(device):
    """Rotating in place a tensor that another op saved for its backward is caught by the version counter."""
    torch.manual_seed(4)
    x = torch.randn(5, 2, 8, device=device, requires_grad=True) * 1
    y = x * x  # saves x
    rope_triton.rope_columns_(x, torch.arange(5, device=device), yarn_inv_freq(4, 10000.0).to(device), 4)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_no_tokens(device):
    x = torch.zeros(0, 2, 8, device=device, requires_grad=True)
    out = rope_triton.rope_columns_(x * 1, torch.zeros(0, dtype=torch.int32, device=device),
                                    yarn_inv_freq(4, 10000.0).to(device), 4)
    out.sum().backward()
    assert out.shape == (0, 2, 8) and x.grad.shape == (0, 2, 8)


def test_bad_shapes_are_named():
    x = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="col0"):
        rope_triton.rope_columns_(x, torch.arange(4), torch.ones(4), 2)
    with pytest.raises(ValueError, match="stride"):
        rope_triton.rope_columns_(torch.zeros(4, 8, 2).transpose(1, 2), torch.arange(4), torch.ones(2), 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qk_norm", ["none", "layer"])
def test_mla_in_place_equals_the_cat_form(device, qk_norm, monkeypatch):
    """The whole model with the query rotated in place gives the out-of-place form's loss and gradients (float32,
    reference attention and experts)."""
    torch.manual_seed(5)
    cfg = tiny_config(qk_norm=qk_norm, rope_scaling=RopeScaling(factor=2.0, original_max_position_embeddings=16,
                                                                mscale=1.0, mscale_all_dim=0.7))
    model = build_model(cfg, device)
    batch = packed_batch(cfg.vocab_size, [13, 30, 1], seed=6).to(device)

    def loss_and_grads(in_place: bool):
        monkeypatch.setattr(attention_mod, "rotate_q_in_place", lambda q: in_place)
        model.zero_grad(set_to_none=True)
        out = model(batch)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_loss, ref = loss_and_grads(False)
    loss, got = loss_and_grads(True)
    assert torch.allclose(loss, ref_loss, rtol=1e-6)
    for n, g in ref.items():
        assert torch.allclose(got[n], g, atol=1e-6, rtol=1e-4), n
