"""FP8 end to end: the persistent grouped FP8 GEMMs (moela.ops.moe.kernels.gemm_fp8_triton) against float64 math on
the same quantized operands and against a simulated-quantization reference, the quantized-weight cache, the FP8 linear,
the expert path under torch.compile, and the model's `precision` recipe. Kernels run under TRITON_INTERPRET=1 on
CPU on odd shapes (odd expert counts, empty experts, token counts that are not multiples of 128)."""

from __future__ import annotations

import os

import pytest
import torch

from factories import packed_batch, tiny_config
from moela.ops import weight_cache
from moela.ops.fp8_linear import fp8_linear, fp8_linear_reference
from moela.ops.moe.kernels.gemm_fp8_triton import kgrouped_fp8, mgrouped_fp8
from moela.ops.moe.kernels.permute import build_layout
from moela.ops.moe.quant_spec import dequant_1x128, dequant_128x128, quant_1x128, quant_128x128

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernels need TRITON_INTERPRET=1")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _weights(e, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g) / k ** 0.5
    q, s = zip(*(quant_128x128(w[i]) for i in range(e)))
    return w, torch.stack(q), torch.stack(s)


def _layout(t, e, k, seed, empty=(1,)):
    """Routing of t tokens to k distinct experts of e, none to the experts in `empty`, and its layout."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([ex for ex in range(e) if ex not in empty])
    ids = torch.stack([allowed[torch.randperm(allowed.numel(), generator=g)[:k]] for _ in range(t)])
    return ids, build_layout(ids, e)


@pytest.mark.parametrize("grouped", [False, True])
def test_mgrouped_fp8_vs_float64_and_simulated_reference(grouped):
    k, n = 384, 256
    if grouped:
        e = 5
        ids, lay = _layout(150, e, 2, seed=1)
        assert int(lay.counts[1]) == 0  # an empty expert
        m = lay.m_pad
        used = int(lay.offsets[-1])
        valid = (lay.m_indices >= 0)[:, None]
        a = torch.randn(m, k) * valid
        experts = lay.m_indices.long().clamp_min(0)
    else:
        e, m = 1, 200  # not a multiple of 128: a ragged last block
        used = m
        a = torch.randn(m, k)
        experts = torch.zeros(m, dtype=torch.long)
    w, wq, ws = _weights(e, n, k, seed=2)
    aq, as_ = quant_1x128(a)
    out = mgrouped_fp8(aq, as_, wq, ws, lay.m_indices if grouped else None, lay.offsets if grouped else None,
                       out_dtype=torch.float32)
    wd = torch.stack([dequant_128x128(wq[i], ws[i]) for i in range(e)]).double()
    same_operands = torch.einsum("mk,mnk->mn", dequant_1x128(aq, as_).double(), wd[experts])[:used]
    assert rel(out[:used], same_operands) < 1e-6
    exact = torch.einsum("mk,mnk->mn", a.double(), w.double()[experts])[:used]
    assert rel(out[:used], exact) <= 1.25 * rel(same_operands, exact) + 1e-6


def test_kgrouped_fp8_vs_float64_with_empty_experts():
    e, n, k = 5, 256, 384
    _, lay = _layout(170, e, 2, seed=3)
    m = lay.m_pad
    valid = (lay.m_indices >= 0)[None]
    a, b = torch.randn(n, m) * valid, torch.randn(k, m) * valid
    (aq, as_), (bq, bs) = quant_1x128(a), quant_1x128(b)
    out = kgrouped_fp8(aq, as_, bq, bs, lay.offsets)
    ad, bd = dequant_1x128(aq, as_).double(), dequant_1x128(bq, bs).double()
    off = lay.offsets.tolist()
    ref = torch.stack([ad[:, off[i]:off[i + 1]] @ bd[:, off[i]:off[i + 1]].t() for i in range(e)])
    assert rel(out, ref) < 1e-6
    assert torch.equal(out[1], torch.zeros(n, k))  # the empty expert: zeros, not garbage
    exact = torch.stack([a.double()[:, off[i]:off[i + 1]] @ b.double()[:, off[i]:off[i + 1]].t() for i in range(e)])
    assert rel(out, exact) <= 1.25 * rel(ref, exact) + 1e-6


def test_weight_cache_reuses_within_a_step_and_invalidates_on_updates():
    w = torch.nn.Parameter(torch.randn(4, 4))
    calls = []

    def compute(v):
        calls.append(1)
        return v.detach().clone() * 2

    first = weight_cache.cached(w, "t", compute)
    assert weight_cache.cached(w, "t", compute) is first and len(calls) == 1  # second micro-batch: reused
    opt = torch.optim.SGD([w], lr=0.1)
    w.grad = torch.ones_like(w)
    opt.step()  # the optimizer's in-place update: recomputed with the new values
    second = weight_cache.cached(w, "t", compute)
    assert len(calls) == 2 and torch.allclose(second, w.detach() * 2)
    with torch.no_grad():
        w.add_(1.0)  # any in-place update through the parameter bumps its version
    assert torch.allclose(weight_cache.cached(w, "t", compute), w.detach() * 2) and len(calls) == 3
    # FSDP2 re-gathers unsharded parameters with the version counter preserved: the optimizer step (of the
    # sharded parameters) is what invalidates
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(w):
        w.copy_(torch.zeros(4, 4))
    opt.zero_grad()
    w.grad = torch.zeros_like(w)
    opt.step()
    assert torch.equal(weight_cache.cached(w, "t", compute), torch.zeros(4, 4)) and len(calls) == 4
    assert weight_cache.cached(torch.randn(2), "t", compute) is not None and len(calls) == 5  # not a parameter


@pytest.mark.parametrize("t", [200, 256])
def test_fp8_linear_triton_matches_the_reference(t):
    x = torch.randn(t, 384, dtype=torch.float16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(256, 384) * 0.05)
    dy = torch.randn(t, 256, dtype=torch.float16)
    y = fp8_linear(x, w, backend="triton")
    y.backward(dy)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yr = fp8_linear_reference(x2, w2)
    yr.backward(dy)
    assert rel(y, yr) < 1e-3 and rel(x.grad, x2.grad) < 1e-3 and rel(w.grad, w2.grad) < 1e-5
    exact = x.detach().double() @ w.detach().double().t()
    assert rel(y, exact) < 0.05 and w.grad.dtype == torch.float32


def test_opcheck_of_the_fp8_linear_op_pair():
    """torch.library's checks of `moela::fp8_linear_fwd` / `_bwd` (the Triton path, interpreted here): schema, the
    fake implementations' shapes and strides against the real outputs (T padded to 128 inside), the autograd
    registration, AOT dispatch of the backward op (torch's schema check, and AOT dispatch of the forward, run
    arithmetic on the e4m3 codes that torch's CPU lacks); and the op's outputs are fresh tensors, not the weight
    cache's own objects."""
    from moela.ops import weight_cache
    from moela.ops.fp8_linear import fp8_linear_bwd, fp8_linear_fwd

    torch.manual_seed(3)
    x = torch.randn(200, 256, dtype=torch.float16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(384, 256) * 0.05)
    torch.library.opcheck(torch.ops.moela.fp8_linear_fwd.default, (x, w),
                          test_utils=("test_autograd_registration", "test_faketensor"))
    with torch.no_grad():
        y, xqt, xst, ws, wqt = fp8_linear_fwd(x, w)
    assert y.shape == (200, 384) and xqt.shape == (256, 256) and xst.shape == (256, 2) and wqt.shape == (256, 384)
    cached = weight_cache.cached(w, "fp8_blockwise", lambda v: None)  # the forward's entry
    assert cached is not None and wqt is not cached[2] and wqt.data_ptr() == cached[2].data_ptr()
    dy = torch.randn(200, 384, dtype=torch.float16)
    torch.library.opcheck(torch.ops.moela.fp8_linear_bwd.default, (dy, xqt, xst, ws, wqt, w.detach()),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    dx, dw = fp8_linear_bwd(dy, xqt, xst, ws, wqt, w)
    assert dx.shape == x.shape and dx.dtype == x.dtype and dw.shape == w.shape and dw.dtype == torch.float32


def test_fp8_linear_rejects_untileable_features_for_triton():
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_linear(torch.randn(4, 96), torch.nn.Parameter(torch.randn(128, 96)), backend="triton")


def test_moe_experts_compiles_without_graph_breaks():
    from moela.ops.moe import moe_experts

    t, d, f, e, k = 70, 128, 128, 3, 2
    x = torch.randn(t, d, dtype=torch.float16, requires_grad=True)
    ids, _ = _layout(t, e, k, seed=4, empty=())
    w = torch.rand(t, k)
    w13 = torch.nn.Parameter(torch.randn(e, 2 * f, d) / d ** 0.5)
    w2 = torch.nn.Parameter(torch.randn(e, d, f) / f ** 0.5)

    def fn(x, w):
        return moe_experts(x, ids, w, w13, w2, recipe="fp8_blockwise", backend="triton")

    eager = fn(x, w)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(x, w)
    compiled.float().sum().backward()
    # the same ops on the same inputs: equal unless another torch's trace moves an ulp, which can flip an FP8 code
    assert rel(compiled, eager) < 1e-3 and x.grad is not None and w13.grad.abs().sum() > 0


def test_precision_recipe_puts_fp8_on_the_named_linears():
    from moela.model import build_model

    model = build_model(tiny_config(precision="fp8"))
    fp8 = {name for name, m in model.named_modules() if getattr(m, "fp8", False)}
    assert any(name.endswith("attn.wq_a") for name in fp8) and any(name.endswith("shared_experts.w2") for name in fp8)
    assert any(name.endswith("eh_proj") for name in fp8)
    assert not any(name.endswith(("head", "gate")) for name in fp8)
    assert all(getattr(m, "recipe", "fp8_blockwise") == "fp8_blockwise" for m in model.modules())
    alias = build_model(tiny_config(moe_recipe="fp8_blockwise"))
    assert not any(getattr(m, "fp8", False) for m in alias.modules())
    assert {m.recipe for m in alias.modules() if hasattr(m, "recipe")} == {"fp8_blockwise"}
    batch = packed_batch(97, [37, 50], seed=0)
    out = model(batch)
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.layers[0].attn.wq_a.weight.grad.abs().sum() > 0


def test_gluon_descriptors_use_the_default_swizzled_layouts():
    """The cached shared-memory layouts of the Gluon GEMMs' TMA descriptors are the ones Gluon picks for each tile
    shape and dtype, and the descriptors cover the operands (built on the host: no GPU needed)."""
    from moela.ops.moe.kernels import gemm_fp8_gluon_mgrouped as ws

    if ws.gluon is None:
        pytest.skip("this Triton has no Gluon")
    gl = ws.gl
    for (rows, cols), dtype, gl_dtype in [((ws.BM, ws.BK), torch.float8_e4m3fn, gl.float8e4nv),
                                          ((64, ws.BN), torch.bfloat16, gl.bfloat16),
                                          ((64, ws.BN), torch.float32, gl.float32)]:
        assert ws.shared_layout(rows, cols, dtype) == gl.NVMMASharedLayout.get_default_for([rows, cols], gl_dtype)
    a = torch.zeros(384, 256, dtype=torch.float8_e4m3fn)
    b = torch.zeros(3, 128, 256, dtype=torch.float8_e4m3fn)
    out = torch.zeros(384, 128, dtype=torch.bfloat16)
    a_desc, b_desc, c_desc = ws.descriptors(a, b, out)
    assert list(a_desc.shape) == [384, 256] and list(b_desc.shape) == [3 * 128, 256]
    assert list(c_desc.block_shape) == [64, ws.BN] and c_desc.layout.element_bitwidth == 16
