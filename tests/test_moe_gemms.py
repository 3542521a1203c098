"""The MoE expert path's grouped GEMMs outside the FP8 kernels (tests/test_fp8.py, tests/test_fp8_gluon.py): the
bf16 Triton GEMMs against float64, their launch table, and the cuBLAS provider's per-expert wrappers against the FP8
Triton GEMMs under a CPU stand-in that enforces cuBLASLt's scale layouts. Kernels run under TRITON_INTERPRET=1 on
CPU; `-m gpu` tests use real sizes."""

import pytest
import torch

from moe_cases import DEV, HALF, MOE_MARKS, layout_and_rows, problem, rel, routing, run
from moela.ops.moe.quant_spec import dequant_1x128, dequant_128x128

pytestmark = MOE_MARKS
gpu = pytest.mark.gpu


def test_mgrouped_gemm_vs_float64():
    from moela.ops.moe.kernels.gemm_grouped_triton import mgrouped_gemm

    e, n, k = 3, 384, 256
    lay, real = layout_and_rows(70, e, skew=True)
    a = torch.randn(lay.m_pad, k, device=DEV, dtype=torch.float16) * real[:, None]
    b = torch.randn(e, n, k, device=DEV, dtype=torch.float16)
    out = mgrouped_gemm(a, b, lay.m_indices, out_dtype=torch.float32)
    ex = lay.m_indices.long()
    ref = torch.einsum("mk,mnk->mn", a.double(), b.double()[ex.clamp_min(0)]) * (ex >= 0)[:, None]
    assert rel(out, ref) < 1e-5  # fp32 accumulation of exactly representable products
    assert (out[ex < 0] == 0).all()


def test_kgrouped_gemm_vs_float64():
    from moela.ops.moe.kernels.gemm_grouped_triton import kgrouped_gemm

    e, n, k = 4, 256, 384
    lay, real = layout_and_rows(150, e, skew=True)  # expert 0 all tokens, others empty
    dy = torch.randn(lay.m_pad, n, device=DEV, dtype=torch.float16) * real[:, None]
    x = torch.randn(lay.m_pad, k, device=DEV, dtype=torch.float16) * real[:, None]
    out = kgrouped_gemm(dy.t(), x.t(), lay.offsets)
    ref = torch.zeros(e, n, k, dtype=torch.float64, device=DEV)
    for ex in range(e):
        rows = lay.m_indices.long() == ex
        ref[ex] = dy.double()[rows].t() @ x.double()[rows]
    assert rel(out, ref) < 1e-5
    assert (out[lay.counts == 0] == 0).all()


def test_grouped_gemm_launch_table(monkeypatch):
    """A shape in gemm_grouped_triton.TUNED launches the plain kernel with the table's config (BN 256 here, a tile the
    autotuner's interpreter config does not use) and still equals float64, masked edges included; a shape the table
    lacks goes through the autotuner."""
    from moela.ops.moe.kernels import gemm_grouped_triton as gemms
    from moela.ops.moe.kernels.permute import build_layout

    torch.manual_seed(5)
    e, n, k = 3, 200, 136
    ids = torch.tensor([0] * 150 + [2] * 61, device=DEV)[torch.randperm(211, device=DEV)]
    lay = build_layout(ids[:, None], e)
    real = (lay.src >= 0)[:, None]
    dy = torch.randn(lay.m_pad, n, device=DEV, dtype=torch.float16) * real
    x = torch.randn(lay.m_pad, k, device=DEV, dtype=torch.float16) * real
    w = torch.randn(e, n, k, device=DEV, dtype=torch.float16)
    through_autotuner = []
    for name in ("_kgrouped_autotuned", "_mgrouped_autotuned"):
        tuner = getattr(gemms, name)
        monkeypatch.setattr(gemms, name, type("Spy", (), {"__getitem__": lambda self, grid, t=tuner, nm=name: (
            through_autotuner.append(nm), t[grid])[1]})())
    monkeypatch.setattr(gemms, "TUNED", {("kgrouped", n, k): (256, 4, 2), ("mgrouped", n, 128 * 2): (256, 4, 2)})
    out = gemms.kgrouped_gemm(dy.t(), x.t(), lay.offsets)
    ref = torch.zeros(e, n, k, dtype=torch.float64, device=DEV)
    for ex in range(e):
        rows = lay.m_indices.long() == ex
        ref[ex] = dy.double()[rows].t() @ x.double()[rows]
    assert rel(out, ref) < 1e-5 and (out[1] == 0).all()
    a = x[:, :128].contiguous()  # m-grouped at K = 128: the table holds K = 256 only
    out_m = gemms.mgrouped_gemm(a, w[:, :, :128].contiguous(), lay.m_indices, out_dtype=torch.float32)
    ex = lay.m_indices.long()
    ref_m = torch.einsum("mk,mnk->mn", a.double(), w[:, :, :128].double()[ex.clamp_min(0)]) * (ex >= 0)[:, None]
    assert rel(out_m, ref_m) < 1e-5
    assert through_autotuner == ["_mgrouped_autotuned"]


def _cublas_contract_scaled_mm(a, b, scale_a, scale_b, *, out_dtype, out=None):
    """CPU stand-in for `torch._scaled_mm` with DeepSeek blockwise scales that enforces cuBLASLt's layout contract
    (cuBLAS docs, "scaling factors layouts"; torch's checks): a [M, K] row-major, b [K, N] column-major; a's 1x128
    scales [M, K/128] M-major (strides (1, M)); b's 1x128 scales [K/128, N] N-major (row-major); b's 128x128
    scales [K/128, N/128] with strides (1, L4), L4 = K/128 rounded up to 4. Computes the dequantized product."""
    m, k = a.shape
    n = b.shape[1]
    kb = k // 128
    assert a.dtype == b.dtype == torch.float8_e4m3fn and k % 128 == 0
    assert a.stride(1) == 1 and b.stride(0) == 1, "fp8 GEMMs need both operands K-contiguous (TN)"
    assert scale_a.shape == (m, kb) and scale_a.stride() == (1, m), (scale_a.shape, scale_a.stride())
    a32 = a.float() * scale_a.repeat_interleave(128, 1)
    if scale_b.shape == (kb, n):  # 1x128 x 1x128
        assert scale_b.stride() == (n, 1), scale_b.stride()
        b32 = b.float() * scale_b.repeat_interleave(128, 0)
    else:  # 1x128 x 128x128
        assert scale_b.shape == (kb, n // 128) and scale_b.stride() == (1, -(-kb // 4) * 4), scale_b.stride()
        b32 = b.float() * scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)
    res = (a32.double() @ b32.double()).to(out_dtype)
    if out is None:
        return res
    assert out.shape == res.shape and out.is_contiguous()
    out.copy_(res)
    return out


TOL_SAME = 5e-4 if DEV == "cuda" else 1e-6  # the GPU's fp8 MMA accumulates with fewer bits inside a K step


def test_cublas_grouped_wrappers_follow_the_scale_layouts(monkeypatch):
    """The cuBLAS provider's per-expert slicing and scale reordering against the FP8 Triton GEMMs on the same
    quantized operands: empty experts, rows past the last expert (zeros from cuBLAS; the Triton GEMM leaves them
    unwritten); K that cuBLASLt's layout cannot take is refused."""
    from moela.ops.moe.kernels.gemm_fp8_triton import kgrouped_fp8, mgrouped_fp8
    from moela.ops.moe.kernels.gemm_libraries import cublas_kgrouped, cublas_mgrouped
    from moela.ops.moe.kernels.quantize_triton import quant_rows_cols, quant_weights

    monkeypatch.setattr(torch, "_scaled_mm", _cublas_contract_scaled_mm)
    e, n, k = 4, 1024, 512
    lay, real = layout_and_rows(150, e, skew=True)  # expert 0 has every token, the others none
    bounds = lay.expert_bounds()
    used = int(lay.offsets[-1])
    a = torch.randn(lay.m_pad, k, device=DEV, dtype=torch.float16) * real[:, None]
    (aq, as_), (aqt, ast) = quant_rows_cols(a)
    bq, bs, bqt = quant_weights(torch.randn(e, n, k, device=DEV, dtype=torch.float16))
    got = cublas_mgrouped(aq, as_, bq, bs, bounds, torch.float32)
    want = mgrouped_fp8(aq, as_, bq, bs, lay.m_indices, lay.offsets, out_dtype=torch.float32, impl="triton")
    assert rel(got[:used], want[:used]) < TOL_SAME and (got[used:] == 0).all()
    with pytest.raises(ValueError, match="multiple of 512"):
        cublas_mgrouped(aq[:, :384], as_[:, :3], bq[:, :, :384], bs[:, :, :3], bounds)
    # data gradient: the transposed weight copy with the transposed block scales
    dy = torch.randn(lay.m_pad, n, device=DEV, dtype=torch.float16) * real[:, None]
    (dq, ds), (dqt, dst) = quant_rows_cols(dy)
    got = cublas_mgrouped(dq, ds, bqt, bs.transpose(1, 2), bounds, torch.float32)
    want = mgrouped_fp8(dq, ds, bqt, bs.transpose(1, 2), lay.m_indices, lay.offsets, out_dtype=torch.float32,
                        impl="triton")
    assert rel(got[:used], want[:used]) < TOL_SAME
    # weight gradient over tokens
    got = cublas_kgrouped(dqt, dst, aqt, ast, bounds)
    want = kgrouped_fp8(dqt, dst, aqt, ast, lay.offsets, impl="triton")
    assert rel(got, want) < TOL_SAME and (got[lay.counts == 0] == 0).all()


def test_cublas_provider_whole_path_matches_triton(monkeypatch):
    from moela.ops.moe import providers as moe_providers

    monkeypatch.setattr(torch, "_scaled_mm", _cublas_contract_scaled_mm)
    monkeypatch.setattr(moe_providers, "cublas_blockwise_available", lambda device=None: True)
    # D = 512: GEMM1 forward and GEMM2 data gradient on cuBLAS; F = 384 (2F = 768): the other two m-grouped GEMMs
    # fall back to Triton; both weight gradients on cuBLAS; 3 experts (the interpreter's time grows with M_pad)
    prob = problem(37, 512, 384, 3, 2, HALF)
    # CPU (fp16, both GEMMs in fp32 through the interpreter): near-identical. CUDA (bf16; the fp8 tensor-core
    # GEMM and the contract's fp32 matmul round differently): GEMM1's bf16 output differs in the last bit, which
    # moves some SwiGLU outputs across an e4m3 rounding boundary (one e4m3 step is 6-12%)
    tol = 2e-3 if DEV == "cpu" else 1.5e-2
    for a, b in zip(run(*prob, "fp8_blockwise", "cublas"),
                    run(*prob, "fp8_blockwise", "triton", fp8_gemm="triton", fp8_wgrad="triton")):
        assert rel(a, b) < tol


@gpu
def test_gpu_fp8_gemm_v3_shape_vs_float64():
    from moela.ops.moe.kernels.gemm_fp8_triton import mgrouped_fp8
    from moela.ops.moe.kernels.gemm_libraries import cublas_blockwise_available, cublas_mgrouped
    from moela.ops.moe.kernels.permute import permute_align
    from moela.ops.moe.kernels.quantize_triton import quant_weights

    t, d, n, e = 4096, 7168, 4096, 8
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    ids = routing(t, e, 1)
    w = torch.randn(e, n, d, device="cuda", dtype=torch.bfloat16)
    xq, xs, lay = permute_align(x, ids, e)
    wq, ws, _ = quant_weights(w)
    out = mgrouped_fp8(xq, xs, wq, ws, lay.m_indices, lay.offsets)  # the default implementation
    if cublas_blockwise_available():
        used = int(lay.offsets[-1])
        cub = cublas_mgrouped(xq, xs, wq, ws, lay.expert_bounds())
        assert rel(cub[:used], out[:used]) < 5e-3  # same quantized operands: bf16 output rounding, MMA order only
    rows = lay.row_map.long()
    ex = ids[:, 0]
    sel = torch.arange(0, t, 97, device="cuda")
    ref = torch.stack([x[i].double() @ w[ex[i]].double().t() for i in sel.tolist()])
    deq = torch.stack([dequant_1x128(xq[rows[i]][None], xs[rows[i]][None])[0].double()
                       @ dequant_128x128(wq[ex[i]], ws[ex[i]]).double().t() for i in sel.tolist()])
    got = out[rows[sel]]
    assert rel(got, deq) < 5e-3  # bf16 output rounding only
    assert rel(got, ref) <= 1.25 * rel(deq, ref) + 1e-3
