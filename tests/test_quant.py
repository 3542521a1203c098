"""FP8 blockwise quantization: the reference math (scale = amax / 448, error bounds, partial groups, zeros) and the
Triton quantization kernels, which must reproduce the reference bit for bit (same scales, same e4m3 codes)."""

import os

import pytest
import torch

from moela.ops.moe.quant_spec import (
    AMAX_EPS,
    FP8_MAX,
    dequant_1x128,
    dequant_128x128,
    fake_quant_1x128,
    quant_1x128,
    quant_128x128,
)

KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"

# e4m3: 3 mantissa bits -> round-to-nearest relative error <= 2^-4; subnormal spacing 2^-9 (in units of the scale)
REL = 2.0 ** -4
SUB = 2.0 ** -10


def assert_same_quant(q, s, rq, rs):
    """Kernel quantization == reference: bit for bit on CPU (the interpreter); on the GPU scales equal up to one
    float32 ulp and codes except rare neighbours that ulp can flip (torch's CUDA kernels need not round their
    divisions as the kernels' div_rn does)."""
    if DEV == "cpu":  # the interpreter and the CPU reference divide the same way: identical values (+-0 aside)
        assert torch.equal(s, rs) and torch.equal(q.float(), rq.float())
    torch.testing.assert_close(s, rs, rtol=2.5e-7, atol=0)
    a, b = q.float(), rq.float()
    diff = a != b
    assert diff.float().mean() <= 1e-3
    assert ((a - b).abs()[diff] <= 0.125 * torch.maximum(a.abs(), b.abs())[diff] + 2.0 ** -9).all()


def test_quant_1x128_scale_and_error_bound():
    x = torch.randn(37, 300, dtype=torch.float64) * torch.logspace(-3, 2, 300, dtype=torch.float64)
    q, s = quant_1x128(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (37, 3)
    padded = torch.nn.functional.pad(x, (0, 84)).view(37, 3, 128)
    amax = padded.abs().amax(-1).clamp_min(AMAX_EPS)
    torch.testing.assert_close(s.double(), amax / FP8_MAX, rtol=1e-6, atol=0)
    deq = dequant_1x128(q, s).double()
    scale_el = s.double().repeat_interleave(128, 1)[:, :300]
    assert ((deq - x).abs() <= REL * x.abs() + SUB * scale_el + 1e-12).all()
    assert q.float().abs().max() <= FP8_MAX
    # the largest element of each group maps to +-448 exactly
    assert (q.float().abs().view(37, -1)[:, :256].view(37, 2, 128).amax(-1) == FP8_MAX).all()


def test_quant_matches_deepgemm_published_formulas():
    """The recipe's reference: DeepGEMM's test utilities `per_token_cast_to_fp8` / `per_block_cast_to_fp8`
    (codes = e4m3(x * (448 / amax)), scale = amax / 448, amax clamped at 1e-4), written out here from their
    published form."""
    x = (torch.randn(19, 512) * torch.logspace(-6, 3, 512)).to(torch.bfloat16)
    x[3] = 0
    view = x.view(19, -1, 128)
    amax = view.abs().float().amax(2).clamp(1e-4)
    codes = (view * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(19, 512)
    q, s = quant_1x128(x)
    assert torch.equal(q.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(s, amax / 448.0)
    w = (torch.randn(256, 384) * 3).to(torch.bfloat16)
    blocks = w.view(2, 128, 3, 128)
    bmax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    bcodes = (blocks * (448.0 / bmax)).to(torch.float8_e4m3fn).view(256, 384)
    q, s = quant_128x128(w)
    assert torch.equal(q.view(torch.uint8), bcodes.view(torch.uint8)) and torch.equal(s, (bmax / 448.0).view(2, 3))


def test_quant_zero_groups_are_zero_with_finite_scale():
    x = torch.zeros(3, 256)
    x[1, 130] = 5.0
    q, s = quant_1x128(x)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert (dequant_1x128(q, s) == x).all()


def test_quant_128x128_blocks():
    w = torch.randn(300, 200, dtype=torch.float64)
    q, s = quant_128x128(w)
    assert s.shape == (3, 2)
    blocks = torch.nn.functional.pad(w, (0, 56, 0, 84)).view(3, 128, 2, 128)
    torch.testing.assert_close(s.double(), blocks.abs().amax((1, 3)) / FP8_MAX, rtol=1e-6, atol=0)
    deq = dequant_128x128(q, s).double()
    scale_el = s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    assert ((deq - w).abs() <= REL * w.abs() + SUB * scale_el + 1e-12).all()


def test_fake_quant_is_straight_through():
    x = torch.randn(4, 256, requires_grad=True)
    g = torch.randn(4, 256)
    fake_quant_1x128(x).backward(g)
    assert torch.equal(x.grad, g)


def test_random_normal_gemm_error_is_in_the_fp8_range():
    a, b = torch.randn(256, 512, dtype=torch.float64), torch.randn(384, 512, dtype=torch.float64)
    exact = a @ b.t()
    approx = dequant_1x128(*quant_1x128(a)).double() @ dequant_128x128(*quant_128x128(b)).double().t()
    rel = ((approx - exact).norm() / exact.norm()).item()
    assert 0.01 < rel < 0.06


@needs_kernels
def test_rows_cols_kernel_matches_reference_bitwise():
    from moela.ops.moe.kernels.quantize_triton import quant_rows_cols

    x = (torch.randn(256, 384, device=DEV) * torch.rand(256, 1, device=DEV) * 10).to(torch.bfloat16)
    x[5] = 0
    (q, s), (qt, st) = quant_rows_cols(x)
    rq, rs = quant_1x128(x.float())
    cq, cs = quant_1x128(x.float().t().contiguous())
    assert_same_quant(q, s, rq, rs)
    assert_same_quant(qt, st, cq, cs)


@needs_kernels
def test_rows_cols_kernel_gathers_rows():
    from moela.ops.moe.kernels.quantize_triton import quant_rows_cols

    x = torch.randn(50, 128, device=DEV, dtype=torch.float16)
    src = torch.randint(-1, 50 * 3, (256,), device=DEV, dtype=torch.int32)
    _, (qt, st) = quant_rows_cols(x, rowwise=False, src=src, gather_div=3)
    gathered = torch.where((src >= 0)[:, None], x[(src.clamp_min(0) // 3).long()], 0).float()
    cq, cs = quant_1x128(gathered.t().contiguous())
    assert_same_quant(qt, st, cq, cs)


def test_rows_cols_impl_is_checked():
    from moela.ops.moe.kernels.quantize_triton import quant_rows_cols

    x = torch.zeros(128, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="impl=.gluon. needs bf16 CUDA tensors"):
        quant_rows_cols(x, impl="gluon")
    with pytest.raises(ValueError, match="use 'auto', 'triton' or 'gluon'"):
        quant_rows_cols(x, impl="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["rows+cols", "rows", "cols", "strided", "gather", "gather rows+cols"])
def test_gluon_rows_cols_equal_the_triton_kernel(case):
    """The shared-memory (Gluon) row+column quantization writes the Triton kernel's bytes: 3 x 7 tiles of fresh
    random data with zero rows, one output or both, a row-strided view (TMA descriptor strides), gathered rows."""
    from moela.ops.moe.kernels import quantize_gluon
    from moela.ops.moe.kernels.quantize_triton import quant_rows_cols

    wide = (torch.randn(384, 1152, device=DEV) * torch.rand(384, 1, device=DEV) * 10).to(torch.bfloat16)
    wide[7] = 0
    x = wide[:, 128:1024] if case == "strided" else wide[:, :896].contiguous()
    kw = dict(rowwise=case != "cols", colwise=case != "rows")
    if case.startswith("gather"):
        x = x[:100]
        kw = dict(src=torch.randint(-1, 300, (384,), device=DEV, dtype=torch.int32), gather_div=3,
                  rowwise=case == "gather rows+cols", colwise=True)
    if not quantize_gluon.available(x):
        pytest.skip("the Gluon kernels need a Hopper (sm_90) GPU and a Triton with Gluon")
    got = quant_rows_cols(x, impl="gluon", **kw)
    want = quant_rows_cols(x, impl="triton", **kw)
    for (q, s), (rq, rs) in zip(got, want):
        assert (q is None) == (rq is None)
        if q is not None:
            assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    rows = x if "src" not in kw else torch.where((kw["src"] >= 0)[:, None], x[(kw["src"].clamp_min(0) // 3).long()], 0)
    if kw["rowwise"]:
        assert_same_quant(*got[0], *quant_1x128(rows.float()))
    if kw["colwise"]:
        assert_same_quant(*got[1], *quant_1x128(rows.float().t().contiguous()))


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [True, False])
def test_gluon_weight_quant_equals_the_triton_kernel(transposed):
    """One read per block (Gluon) gives the Triton launches' bytes: q, the block scales and the transposed copy, for
    experts of very different magnitudes, a zero block and 3 x 5 blocks per expert."""
    from moela.ops.moe.kernels import quantize_gluon
    from moela.ops.moe.kernels.quantize_triton import quant_weights

    w = torch.randn(3, 384, 640, device=DEV) * torch.tensor([1e-3, 1.0, 30.0], device=DEV)[:, None, None]
    w[1, :128, 128:256] = 0
    w = w.to(torch.bfloat16)
    if not quantize_gluon.available(w):
        pytest.skip("the Gluon kernels need a Hopper (sm_90) GPU and a Triton with Gluon")
    got = quant_weights(w, transposed=transposed, impl="gluon")
    want = quant_weights(w, transposed=transposed, impl="triton")
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    if transposed:
        assert torch.equal(got[2].view(torch.uint8), want[2].view(torch.uint8))
        assert torch.equal(got[2].view(torch.uint8), got[0].transpose(1, 2).contiguous().view(torch.uint8))
    else:
        assert got[2] is None
    for e in range(3):
        assert_same_quant(got[0][e], got[1][e], *quant_128x128(w[e]))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_quant_kernel_all_experts_and_transposed_copy(dtype):
    from moela.ops.moe.kernels.quantize_triton import quant_weights

    w = torch.randn(3, 256, 384, device=DEV) * torch.tensor([1e-3, 1.0, 30.0], device=DEV)[:, None, None]
    w = w.to(dtype)
    q, s, qt = quant_weights(w)
    for e in range(3):
        rq, rs = quant_128x128(w[e])
        assert_same_quant(q[e], s[e], rq, rs)
    assert torch.equal(qt.view(torch.uint8), q.transpose(1, 2).contiguous().view(torch.uint8))
