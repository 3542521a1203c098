"""MoE expert path: contiguous-layout invariants, permute/combine kernels, grouped GEMMs against float64, SwiGLU
kernels, and the whole fused path (both recipes, every backend that runs here) against float64 math and the
simulated-quantization reference. Kernels run under TRITON_INTERPRET=1 on CPU; `-m gpu` tests use real sizes."""

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from moela.ops.moe import moe_experts
from moela.ops.moe.quant import dequant_1x128, dequant_128x128, quant_1x128
from test_quant import assert_same_quant

KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [pytest.mark.skipif(not KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_empty")]  # tests/conftest.py: unwritten outputs read as NaN
DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu


def _routing(t, e, k, skew=False, device=DEV):
    if skew:  # expert 0 is picked by every token, the last expert by none
        rest = torch.stack([torch.randperm(e - 2)[: k - 1] + 1 for _ in range(t)])
        return torch.cat([torch.zeros(t, 1, dtype=torch.int64), rest], 1).to(device)
    return torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(device)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _exact(x, ids, w, w13, w2):
    """float64 y = sum_k w * W2 (silu(W1 x) * W3 x), no quantization; loops over experts (differentiable)."""
    f = w13.shape[1] // 2
    y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for ex in range(w13.shape[0]):
        tok, slot = (ids == ex).nonzero(as_tuple=True)
        h = x[tok].double() @ w13[ex].double().t()  # [M, 2F]
        o = (F.silu(h[:, :f]) * h[:, f:]) @ w2[ex].double().t()  # [M, D]
        y = y.index_add(0, tok, o * w[tok, slot].double()[:, None])
    return y


# ---------------------------------------------------------------------------------------------------------------
# layout


def _stable_sort_layout(ids, e):
    """The contiguous layout by torch's stable sort (independent of the kernels' counting sort): counts, padded
    offsets, and each flat (token, k) index's row."""
    flat = ids.reshape(-1).long().cpu()
    counts = torch.bincount(flat, minlength=e)
    offsets = torch.zeros(e + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum((counts + 127) // 128 * 128, 0)
    order = torch.sort(flat, stable=True).indices
    rank_in_expert = torch.arange(flat.numel()) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    row_map = torch.empty_like(flat)
    row_map[order] = offsets[flat[order]] + rank_in_expert
    return counts, offsets, row_map


def _check_layout(lay, ids, e):
    t, k = ids.shape
    counts, off, row_map = _stable_sort_layout(ids, e)
    assert torch.equal(lay.counts.cpu(), counts) and torch.equal(lay.offsets.cpu(), off)
    assert torch.equal(lay.row_map.cpu().long(), row_map)
    assert lay.m_pad >= off[-1] and lay.m_pad % 128 == 0
    src, mi, rm = lay.src.cpu().long(), lay.m_indices.cpu().long(), row_map
    assert torch.equal(src[rm], torch.arange(t * k))  # row map round trip
    assert torch.equal(mi[rm], ids.reshape(-1).cpu())
    assert (src >= 0).sum() == t * k and torch.equal((mi == -1), (src == -1))  # -1 exactly on padding rows
    for ex in range(e):
        rows = torch.arange(off[ex], off[ex + 1])
        real = rows[: counts[ex]]
        assert (mi[real] == ex).all() and (mi[rows[counts[ex]:]] == -1).all()
        assert (src[real].diff() > 0).all()  # stable: token order inside each expert
    assert (mi[off[-1]:] == -1).all()


@pytest.mark.parametrize("case", ["uniform", "empty_experts", "one_expert_all", "many_experts", "no_tokens",
                                  "strided_ids"])
def test_layout_invariants(case):
    from moela.ops.moe.permute import build_layout, permute_align

    t, e, k = 90, 7, 3  # 270 (token, k) pairs: three 128-id chunks of the counting kernel, the last one partial
    if case == "many_experts":
        t, e = 53, 70  # two 64-expert blocks of the histogram, the second partial
    ids = _routing(t, e, k)
    if case == "empty_experts":
        ids = ids % 3 * 2  # only experts 0, 2, 4 (with repeats across k, allowed)
    if case == "one_expert_all":
        ids, k = torch.full((t, 1), 5, device=DEV), 1
    if case == "no_tokens":  # an expert-parallel rank can receive none
        ids = ids[:0]
    if case == "strided_ids":
        ids = torch.rand(t, e, device=DEV).argsort(1).to(torch.int32)[:, :1]  # a non-contiguous int32 view
        assert not ids.is_contiguous()
    lay = build_layout(ids, e)
    _check_layout(lay, ids, e)
    x = torch.randn(ids.shape[0], 128, device=DEV, dtype=torch.bfloat16)
    _, _, fused = permute_align(x, ids, e, quant=None)  # the layout placed inside the data pass
    for name in ("m_indices", "row_map", "src", "counts", "offsets"):
        assert torch.equal(getattr(fused, name), getattr(lay, name)), name


@settings(max_examples=12, deadline=None)
@given(t=st.integers(1, 150), e=st.integers(1, 40), k=st.integers(1, 8), seed=st.integers(0, 2 ** 31 - 1))
def test_layout_invariants_random_routing(t, e, k, seed):
    from moela.ops.moe.permute import build_layout

    k = min(k, e)
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(t, e, generator=g).argsort(1)[:, :k].to(DEV)  # distinct experts per token, any skew
    _check_layout(build_layout(ids, e), ids, e)


@pytest.mark.parametrize("quant", [None, "fp8_1x128"])
def test_permute_align_writes_rows_scales_and_zero_padding(quant):
    from moela.ops.moe.permute import permute_align

    t, d, e, k = 41, 256, 5, 2
    x = torch.randn(t, d, device=DEV, dtype=torch.float16)
    ids = _routing(t, e, k, skew=True)
    data, scales, lay = permute_align(x, ids, e, quant=quant)
    src = lay.src.long()
    real = src >= 0
    tok = src[real] // k
    if quant:
        rq, rs = quant_1x128(x.float())
        assert_same_quant(data[real], scales[real], rq[tok], rs[tok])
        assert (data[~real].float() == 0).all() and torch.isfinite(scales).all()
    else:
        assert torch.equal(data[real], x[tok]) and (data[~real] == 0).all()


def test_unpermute_combine_and_gradients():
    from moela.ops.moe.combine import combine_bwd, unpermute_combine
    from moela.ops.moe.permute import build_layout

    t, d, e, k = 29, 384, 4, 3
    ids = _routing(t, e, k)
    lay = build_layout(ids, e)
    o = torch.randn(lay.m_pad, d, device=DEV)
    w = torch.rand(t, k, device=DEV)
    y = unpermute_combine(o, lay, w, torch.float32)
    rows = lay.row_map.long().view(t, k)
    ref = (o.double()[rows] * w.double()[..., None]).sum(1)
    assert _rel(y, ref) < 1e-6
    dy = torch.randn(t, d, device=DEV)
    do, _, dw = combine_bwd(dy, o, lay, w, quant=False)
    ref_do = torch.zeros(lay.m_pad, d, dtype=torch.float64, device=DEV)
    ref_do[rows.reshape(-1)] = (dy.double()[:, None] * w.double()[..., None]).reshape(-1, d)
    assert _rel(do, ref_do) < 1e-6
    assert _rel(dw, (dy.double()[:, None] * o.double()[rows]).sum(-1)) < 1e-6
    (q, s), (qt, st), _ = combine_bwd(dy, o, lay, w, quant=True)
    assert_same_quant(q, s, *quant_1x128(do))
    assert_same_quant(qt, st, *quant_1x128(do.t().contiguous()))


# ---------------------------------------------------------------------------------------------------------------
# GEMMs


def _layout_and_rows(t, e, skew):
    from moela.ops.moe.permute import build_layout

    lay = build_layout(_routing(t, e, 1, skew=skew), e)
    return lay, lay.src >= 0


@pytest.mark.parametrize("fp8", [False, True])
def test_mgrouped_gemm_vs_float64(fp8):
    from moela.ops.moe.gemm_triton import mgrouped_gemm
    from moela.ops.moe.quantize import quant_weights

    e, n, k = 3, 384, 256
    lay, real = _layout_and_rows(70, e, skew=True)
    m = lay.m_pad
    a = torch.randn(m, k, device=DEV, dtype=torch.float16) * real[:, None]
    b = torch.randn(e, n, k, device=DEV, dtype=torch.float16)
    if fp8:
        aq, as_ = quant_1x128(a.float())
        bq, bs, _ = quant_weights(b)
        a64 = dequant_1x128(aq, as_).double()
        b64 = torch.stack([dequant_128x128(bq[i], bs[i]) for i in range(e)]).double()
        out = mgrouped_gemm(aq, bq, lay.m_indices, a_scale=as_, b_scale=bs, out_dtype=torch.float32)
    else:
        a64, b64 = a.double(), b.double()
        out = mgrouped_gemm(a, b, lay.m_indices, out_dtype=torch.float32)
    ex = lay.m_indices.long()
    ref = torch.einsum("mk,mnk->mn", a64, b64[ex.clamp_min(0)]) * (ex >= 0)[:, None]
    # fp32 accumulation of exactly representable products; Hopper's fp8 MMA accumulates inside each 128-wide K
    # step with fewer mantissa bits (why the kernel promotes to fp32 every 128), hence the looser GPU bound
    assert _rel(out, ref) < (5e-4 if fp8 and DEV == "cuda" else 1e-5)
    assert (out[ex < 0] == 0).all()


@pytest.mark.parametrize("fp8", [False, True])
def test_kgrouped_gemm_vs_float64(fp8):
    from moela.ops.moe.gemm_triton import kgrouped_gemm
    from moela.ops.moe.quantize import quant_rows_cols

    e, n, k = 4, 256, 384
    lay, real = _layout_and_rows(150, e, skew=True)  # expert 0 all tokens, others empty
    m = lay.m_pad
    dy = torch.randn(m, n, device=DEV, dtype=torch.float16) * real[:, None]
    x = torch.randn(m, k, device=DEV, dtype=torch.float16) * real[:, None]
    if fp8:
        _, (dyt, dyts) = quant_rows_cols(dy, rowwise=False)
        _, (xt, xts) = quant_rows_cols(x, rowwise=False)
        dy64, x64 = dequant_1x128(dyt, dyts).double().t(), dequant_1x128(xt, xts).double().t()
        out = kgrouped_gemm(dyt, xt, lay.offsets, a_scale=dyts, b_scale=xts)
    else:
        dy64, x64 = dy.double(), x.double()
        out = kgrouped_gemm(dy.t(), x.t(), lay.offsets)
    ref = torch.zeros(e, n, k, dtype=torch.float64, device=DEV)
    for ex in range(e):
        rows = lay.m_indices.long() == ex
        ref[ex] = dy64[rows].t() @ x64[rows]
    assert _rel(out, ref) < (5e-4 if fp8 and DEV == "cuda" else 1e-5)
    assert (out[lay.counts == 0] == 0).all()


@pytest.mark.parametrize("mode", ["table", "autotune"])
def test_grouped_gemm_launch_table(monkeypatch, mode):
    """A shape in gemm_triton.TUNED launches the plain kernel with the table's config (BN 256 here, a tile the
    autotuner's interpreter config does not use) and still equals float64, masked edges included; with
    TUNING["mode"] = "autotune", or a shape the table lacks, the call goes through the autotuner; an unknown mode is
    an error that names the choices."""
    from moela.ops.moe import gemm_triton
    from moela.ops.moe.permute import build_layout

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
        tuner = getattr(gemm_triton, name)
        monkeypatch.setattr(gemm_triton, name, type("Spy", (), {"__getitem__": lambda self, grid, t=tuner, nm=name: (
            through_autotuner.append(nm), t[grid])[1]})())
    monkeypatch.setitem(gemm_triton.TUNING, "mode", mode)
    monkeypatch.setattr(gemm_triton, "TUNED", {("kgrouped", n, k, False): (256, 4, 2),
                                               ("mgrouped", n, 128 * 2, False): (256, 4, 2)})
    out = gemm_triton.kgrouped_gemm(dy.t(), x.t(), lay.offsets)
    ref = torch.zeros(e, n, k, dtype=torch.float64, device=DEV)
    for ex in range(e):
        rows = lay.m_indices.long() == ex
        ref[ex] = dy.double()[rows].t() @ x.double()[rows]
    assert _rel(out, ref) < 1e-5 and (out[1] == 0).all()
    a = x[:, :128].contiguous()  # m-grouped at K = 128: the table holds K = 256 only
    out_m = gemm_triton.mgrouped_gemm(a, w[:, :, :128].contiguous(), lay.m_indices, out_dtype=torch.float32)
    ex = lay.m_indices.long()
    ref_m = torch.einsum("mk,mnk->mn", a.double(), w[:, :, :128].double()[ex.clamp_min(0)]) * (ex >= 0)[:, None]
    assert _rel(out_m, ref_m) < 1e-5
    assert through_autotuner == (["_mgrouped_autotuned"] if mode == "table" else
                                 ["_kgrouped_autotuned", "_mgrouped_autotuned"])
    monkeypatch.setitem(gemm_triton.TUNING, "mode", "fastest")
    with pytest.raises(ValueError, match="use 'table' or 'autotune'"):
        gemm_triton.kgrouped_gemm(dy.t(), x.t(), lay.offsets)


def test_kgrouped_gemm_expert_order():
    """The weight gradient with its experts' tiles launched in a given order (the most rows first) writes every
    expert's own block: equal to float64 per expert, empty experts zero, for a non-trivial permutation."""
    from moela.ops.moe.gemm_triton import kgrouped_gemm
    from moela.ops.moe.permute import build_layout

    torch.manual_seed(11)
    e, n, k = 5, 136, 200  # sizes off the 128 grid: masked edges
    ids = torch.tensor([0] * 130 + [2] * 40 + [3] * 257 + [4] * 3, device=DEV)[torch.randperm(430, device=DEV)]
    lay = build_layout(ids[:, None], e)  # expert 1 empty; 3 spans three 128-row blocks
    real = (lay.src >= 0)[:, None]
    dy = torch.randn(lay.m_pad, n, device=DEV, dtype=torch.float16) * real
    x = torch.randn(lay.m_pad, k, device=DEV, dtype=torch.float16) * real
    order = torch.argsort(lay.counts, descending=True, stable=True).to(torch.int32)
    assert order.tolist() == [3, 0, 2, 4, 1]
    out = kgrouped_gemm(dy.t(), x.t(), lay.offsets, order=order)
    ref = torch.zeros(e, n, k, dtype=torch.float64, device=DEV)
    for ex in range(e):
        rows = lay.m_indices.long() == ex
        ref[ex] = dy.double()[rows].t() @ x.double()[rows]
    assert _rel(out, ref) < 1e-5
    assert (out[1] == 0).all()


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
    """The cuBLAS provider's per-expert slicing and scale reordering against the Triton grouped GEMMs on the same
    quantized operands: empty experts, rows past the last expert; K that cuBLASLt's layout cannot take is refused."""
    from moela.ops.moe.gemm_library import cublas_kgrouped, cublas_mgrouped
    from moela.ops.moe.gemm_triton import kgrouped_gemm, mgrouped_gemm
    from moela.ops.moe.quantize import quant_rows_cols, quant_weights

    monkeypatch.setattr(torch, "_scaled_mm", _cublas_contract_scaled_mm)
    e, n, k = 4, 1024, 512
    lay, real = _layout_and_rows(150, e, skew=True)  # expert 0 has every token, the others none
    bounds = lay.expert_bounds()
    a = torch.randn(lay.m_pad, k, device=DEV, dtype=torch.float16) * real[:, None]
    (aq, as_), (aqt, ast) = quant_rows_cols(a)
    bq, bs, bqt = quant_weights(torch.randn(e, n, k, device=DEV, dtype=torch.float16))
    got = cublas_mgrouped(aq, as_, bq, bs, bounds, torch.float32)
    want = mgrouped_gemm(aq, bq, lay.m_indices, a_scale=as_, b_scale=bs, out_dtype=torch.float32)
    assert _rel(got, want) < TOL_SAME and (got[lay.offsets[-1]:] == 0).all()
    with pytest.raises(ValueError, match="multiple of 512"):
        cublas_mgrouped(aq[:, :384], as_[:, :3], bq[:, :, :384], bs[:, :, :3], bounds)
    # data gradient: the transposed weight copy with the transposed block scales
    dy = torch.randn(lay.m_pad, n, device=DEV, dtype=torch.float16) * real[:, None]
    (dq, ds), (dqt, dst) = quant_rows_cols(dy)
    got = cublas_mgrouped(dq, ds, bqt, bs.transpose(1, 2), bounds, torch.float32)
    want = mgrouped_gemm(dq, bqt, lay.m_indices, a_scale=ds, b_scale=bs.transpose(1, 2), out_dtype=torch.float32)
    assert _rel(got, want) < TOL_SAME
    # weight gradient over tokens
    got = cublas_kgrouped(dqt, dst, aqt, ast, bounds)
    want = kgrouped_gemm(dqt, aqt, lay.offsets, a_scale=dst, b_scale=ast)
    assert _rel(got, want) < TOL_SAME and (got[lay.counts == 0] == 0).all()


def test_cublas_provider_whole_path_matches_triton(monkeypatch):
    from moela.ops.moe import providers as moe_providers

    monkeypatch.setattr(torch, "_scaled_mm", _cublas_contract_scaled_mm)
    monkeypatch.setattr(moe_providers, "cublas_blockwise_available", lambda device=None: True)
    # D = 512: GEMM1 forward and GEMM2 data gradient on cuBLAS; F = 384 (2F = 768): the other two m-grouped GEMMs
    # fall back to Triton; both weight gradients on cuBLAS; 3 experts (the interpreter's time grows with M_pad)
    prob = _problem(37, 512, 384, 3, 2, torch.bfloat16 if DEV == "cuda" else torch.float16)
    # CPU (fp16, both GEMMs in fp32 through the interpreter): near-identical. CUDA (bf16; the fp8 tensor-core
    # GEMM and the contract's fp32 matmul round differently): GEMM1's bf16 output differs in the last bit, which
    # moves some SwiGLU outputs across an e4m3 rounding boundary (one e4m3 step is 6-12%)
    tol = 2e-3 if DEV == "cpu" else 1.5e-2
    for a, b in zip(_run(*prob, "fp8_blockwise", "cublas"), _run(*prob, "fp8_blockwise", "triton")):
        assert _rel(a, b) < tol


def test_swiglu_kernels_match_autograd():
    from moela.ops.moe.activation import swiglu_bwd, swiglu_fwd
    from moela.ops.moe.permute import build_layout

    f = 256
    lay = build_layout(_routing(60, 3, 2), 3)
    h = torch.randn(lay.m_pad, 2 * f, device=DEV, requires_grad=True)
    act_ref = F.silu(h[:, :f]) * h[:, f:]
    valid = (lay.m_indices >= 0)[:, None]
    act, _ = swiglu_fwd(h.detach(), lay.m_indices, quant=False)
    assert _rel(act, act_ref * valid) < 1e-6
    aq, as_ = swiglu_fwd(h.detach(), lay.m_indices, quant=True)
    rq, rs = quant_1x128((act_ref * valid).detach())
    assert (aq.float() != rq.float()).float().mean() < 1e-3 and _rel(as_, rs) < 1e-6
    da = torch.randn(lay.m_pad, f, device=DEV)
    (dh_ref,) = torch.autograd.grad(act_ref, h, da)
    dh, _, act2 = swiglu_bwd(h.detach(), da, lay.m_indices, quant=False)
    assert _rel(dh, dh_ref * valid) < 1e-6 and _rel(act2, act_ref * valid) < 1e-6
    dh_split, _, act_split = swiglu_bwd(h.detach(), da, lay.m_indices, quant=False, impl="split")
    assert _rel(dh_split, dh_ref * valid) < 1e-6 and _rel(act_split, act_ref * valid) < 1e-6
    (dq, ds), (dqt, dst), (aqt, ast) = swiglu_bwd(h.detach(), da, lay.m_indices, quant=True)
    assert _rel(dequant_1x128(dq, ds), dh_ref * valid) < 0.04
    assert _rel(dequant_1x128(dqt, dst).t(), dh_ref * valid) < 0.04
    assert _rel(dequant_1x128(aqt, ast).t(), act_ref * valid) < 0.04


@pytest.mark.parametrize("n,k,out_dtype", [(96, 40, torch.float32), (33, 129, torch.float32), (8, 8, torch.bfloat16)])
def test_weight_gradient_masked_cast(n, k, out_dtype):
    """The bf16 weight gradient's epilogue kernel: an expert with no rows gets zeros whatever its GEMM output holds
    (NaN here), the others their values cast exactly (bf16 -> fp32 is exact); sizes that are not multiples of the
    kernel's block, an expert's matrix larger than one block (96 x 40 = 3840 < 4096 < 33 x 129)."""
    from moela.ops.moe.masked_cast import masked_cast

    e = 5
    counts = torch.tensor([3, 0, 128, 0, 1], device=DEV, dtype=torch.int32)
    out = torch.randn(e, n, k, device=DEV).to(torch.bfloat16)
    out[counts == 0] = float("nan")
    got = masked_cast(out, counts, out_dtype)
    assert got.dtype == out_dtype and got.shape == (e, n, k)
    want = out.double().clone()
    want[counts == 0] = 0.0
    assert torch.equal(got.double(), want)


def test_unquantized_swiglu_bwd_in_bf16_against_float64():
    """The bf16 recipe's SwiGLU backward (one program per tile, all three outputs) on bf16 inputs with NaN in the
    padding rows: dg, du and the recomputed act within bf16 rounding of float64 math, padding rows exactly zero,
    and the three-programs-per-tile kernel's values. F = 384: three column blocks."""
    from moela.ops.moe.activation import swiglu_bwd
    from moela.ops.moe.permute import build_layout

    f = 384
    lay = build_layout(_routing(97, 5, 2, skew=True), 5)
    valid = (lay.m_indices >= 0)[:, None]
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float16
    h = torch.randn(lay.m_pad, 2 * f, device=DEV).masked_fill(~valid, float("nan")).to(dtype)
    da = torch.randn(lay.m_pad, f, device=DEV).masked_fill(~valid, float("nan")).to(dtype)
    g, u, d = (torch.where(valid, t, 0).double() for t in (h[:, :f], h[:, f:], da))
    sig = torch.sigmoid(g)
    want_dh = torch.cat([d * u * sig * (1 + g * (1 - sig)), d * g * sig], 1)
    dh, _, act = swiglu_bwd(h, da, lay.m_indices, quant=False)
    assert dh.dtype == act.dtype == dtype
    assert _rel(dh, want_dh) < 4e-3 and _rel(act, g * sig * u) < 4e-3  # bf16 rounds to 2**-9 relative
    assert torch.equal(dh[~valid[:, 0]], torch.zeros_like(dh[~valid[:, 0]]))
    assert torch.equal(act[~valid[:, 0]], torch.zeros_like(act[~valid[:, 0]]))
    split_dh, _, split_act = swiglu_bwd(h, da, lay.m_indices, quant=False, impl="split")
    # the same fp32 expressions; a compiler may contract them differently: at most one rounding step apart
    torch.testing.assert_close(dh, split_dh, rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(act, split_act, rtol=2 ** -7, atol=1e-6)


@gpu
def test_gluon_swiglu_bwd_equals_the_triton_kernel():
    """The shared-memory (Gluon) SwiGLU backward writes the Triton kernel's bytes (3 column tiles, skewed routing
    with empty experts, NaN in the padding rows' inputs, which must come out as zeros) and matches autograd."""
    from moela.ops.moe import gluon as moe_gluon
    from moela.ops.moe.activation import swiglu_bwd
    from moela.ops.moe.permute import build_layout

    f = 384
    lay = build_layout(_routing(150, 5, 2, skew=True), 5)
    valid = (lay.m_indices >= 0)[:, None]
    h = torch.randn(lay.m_pad, 2 * f, device=DEV).masked_fill(~valid, float("nan")).to(torch.bfloat16)
    da = torch.randn(lay.m_pad, f, device=DEV).masked_fill(~valid, float("nan")).to(torch.bfloat16)
    if not moe_gluon.available(h):
        pytest.skip("the Gluon kernels need a Hopper (sm_90) GPU and a Triton with Gluon")
    got = swiglu_bwd(h, da, lay.m_indices, quant=True, impl="gluon")
    want = swiglu_bwd(h, da, lay.m_indices, quant=True, impl="triton")
    for (q, sc), (rq, rsc) in zip(got, want):
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(sc, rsc)
    hr = torch.where(valid, h.float(), 0).requires_grad_()
    act_ref = F.silu(hr[:, :f]) * hr[:, f:]
    (dh_ref,) = torch.autograd.grad(act_ref, hr, torch.where(valid, da.float(), 0))
    (dq, ds), (dqt, dst), (aqt, ast) = got
    assert _rel(dequant_1x128(dq, ds), dh_ref) < 0.04
    assert _rel(dequant_1x128(dqt, dst).t(), dh_ref) < 0.04
    assert _rel(dequant_1x128(aqt, ast).t(), act_ref) < 0.04


# ---------------------------------------------------------------------------------------------------------------
# whole path


def _run(x, ids, w, w13, w2, g, recipe, backend):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
    y = moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], recipe=recipe, backend=backend)
    y.backward(g.to(y.dtype))
    return [y] + [t.grad for t in leaves]


def _exact_grads(x, ids, w, w13, w2, g):
    leaves = [t.detach().double().requires_grad_() for t in (x, w, w13, w2)]
    y = _exact(leaves[0], ids, *leaves[1:])
    y.backward(g.double())
    return [y] + [t.grad for t in leaves]


def _problem(t, d, f, e, k, dtype, skew=False):
    x = torch.randn(t, d, device=DEV, dtype=dtype)
    ids = _routing(t, e, k, skew=skew)
    w = torch.rand(t, k, device=DEV)
    w13 = torch.randn(e, 2 * f, d, device=DEV) / d ** 0.5
    w2 = torch.randn(e, d, f, device=DEV) / f ** 0.5
    return x, ids, w, w13, w2, torch.randn(t, d, device=DEV)


@pytest.mark.parametrize("backend,wgrad", [("triton", "triton"), ("torch", "torch"), ("torch", "triton")])
def test_bf16_recipe_path_vs_float64(backend, wgrad, monkeypatch):
    """`wgrad`: the weight gradient's GEMM under the torch provider (`BF16_WGRAD`; the triton provider's is ours)."""
    from moela.ops.moe import autograd as moe_autograd
    from moela.ops.moe.gemm_triton import kgrouped_gemm

    monkeypatch.setitem(moe_autograd.BF16_WGRAD, "impl", wgrad)
    ours = []
    monkeypatch.setattr(moe_autograd, "kgrouped_gemm", lambda *a, **kw: ours.append(1) or kgrouped_gemm(*a, **kw))
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float16
    prob = _problem(29, 256, 128, 4, 3, dtype, skew=backend == "torch")
    exact = _exact_grads(*prob)
    got = _run(*prob, "bf16", backend)
    assert len(ours) == (2 if wgrad == "triton" else 0)  # both weight gradients (w2, w13) on the GEMM asked for
    ref = _run(*prob, "bf16", "reference")  # float32 math, output in x's dtype
    names = ["y", "dx", "dw", "dw13", "dw2"]
    # slack: four units of roundoff of x's dtype (the fused path keeps its GEMM outputs h and o in it, the reference
    # in float32; d topk_weights = <dy, o> sees o's rounding): fp16 2^-11, bf16 (CUDA) 2^-8
    slack = 4 * torch.finfo(dtype).eps / 2
    for name, a, r, ex in zip(names, got, ref, exact):
        assert torch.isfinite(a).all(), name
        assert _rel(a, ex) <= 2 * _rel(r, ex) + slack, (name, _rel(a, ex), _rel(r, ex))


def test_fp8_recipe_path_vs_float64_and_simulated_reference():
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float16
    prob = _problem(31, 256, 128, 4, 2, dtype)
    exact = _exact_grads(*prob)
    got = _run(*prob, "fp8_blockwise", "triton")
    ref = _run(*prob, "fp8_blockwise", "reference")  # same quantization, simulated; straight-through backward
    err = {n: (_rel(a, ex), _rel(r, ex)) for n, a, r, ex in zip(["y", "dx", "dw", "dw13", "dw2"], got, ref, exact)}
    assert err["y"][0] <= 1.25 * err["y"][1] + 1e-3, err
    # the backward also quantizes dy, dh and the weight-gradient operands, which the reference does not
    for name in ["dx", "dw", "dw13", "dw2"]:
        assert err[name][0] <= 2.0 * err[name][1] + 1e-3, (name, err)
        assert err[name][0] < 0.12, (name, err)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_blockwise"])
def test_backward_reads_the_forwards_weight_copies(recipe, monkeypatch):
    """With the weight cache off (as while a CUDA graph is captured), a forward + backward casts / quantizes each
    expert weight once: the backward reads the copies the forward made. Its output and gradients equal those of
    the backward that makes its own copies (`WEIGHT_COPIES["saved"] = False`)."""
    from moela.ops.moe import autograd as moe_autograd

    made = []
    monkeypatch.setattr(moe_autograd.weight_cache, "cached",
                        lambda w, kind, compute: (made.append(kind), compute(w))[1])
    prob = _problem(21, 256, 128, 3, 2, torch.bfloat16 if DEV == "cuda" else torch.float16)
    saved = _run(*prob, recipe, "triton")
    assert len(made) == 2, made  # w13 and w2, in the forward
    made.clear()
    monkeypatch.setitem(moe_autograd.WEIGHT_COPIES, "saved", False)
    looked_up = _run(*prob, recipe, "triton")
    assert len(made) == 4, made  # again in the backward
    for name, a, b in zip(["y", "dx", "dw", "dw13", "dw2"], saved, looked_up):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("recipe,weight_dtype", [("bf16", torch.float32), ("bf16", None), ("fp8_blockwise", None)])
def test_forward_op_fake_matches_real_outputs(recipe, weight_dtype):
    """The compiler's view of the forward op (its fake implementation) gives every output the real shape and dtype,
    weight copies included: cast weights, an empty placeholder where no cast is needed (weights already in x's
    dtype), fp8 scales and transposed codes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moela.ops.moe.autograd import moe_experts_fwd

    dtype = torch.bfloat16 if DEV == "cuda" else torch.float16
    x, ids, w, w13, w2, _ = _problem(13, 256, 128, 3, 2, dtype)
    w13, w2 = (t.to(weight_dtype or dtype) for t in (w13, w2))
    for save in (True, False):
        real = moe_experts_fwd(x, ids, w, w13, w2, recipe, "triton", save)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = moe_experts_fwd(*(mode.from_tensor(t) for t in (x, ids, w, w13, w2)), recipe, "triton", save)
        assert [(tuple(t.shape), t.dtype) for t in fake] == [(tuple(t.shape), t.dtype) for t in real], save


def test_cached_weight_copies_over_two_micro_batches():
    """Parameters (the weight cache on): two micro-batches accumulate the gradients of both, each backward reading
    the detached aliases of the cache's copies that its forward handed over."""
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float16
    x, ids, w, w13, w2, g = _problem(17, 256, 128, 3, 2, dtype)
    p13, p2 = torch.nn.Parameter(w13.clone()), torch.nn.Parameter(w2.clone())
    for _ in range(2):
        moe_experts(x, ids, w, p13, p2, recipe="bf16", backend="triton").backward(g.to(dtype))
    once = _run(x, ids, w, w13, w2, g, "bf16", "triton")
    assert torch.allclose(p13.grad, 2 * once[3], rtol=1e-5, atol=1e-6)
    assert torch.allclose(p2.grad, 2 * once[4], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_blockwise"])
def test_empty_batch(recipe):
    """An expert-parallel rank can receive no rows: zeros out, zero weight gradients."""
    x, _, w, w13, w2, g = _problem(1, 128, 128, 3, 1, torch.bfloat16 if DEV == "cuda" else torch.float16)
    ids = torch.zeros(0, 1, dtype=torch.int64, device=DEV)
    y, dx, dw, dw13, dw2 = _run(x[:0], ids, w[:0], w13, w2, g[:0], recipe, "triton")
    assert y.shape == (0, 128) and dx.shape == (0, 128)
    assert (dw13 == 0).all() and (dw2 == 0).all()


def test_auto_backend_on_cpu_is_reference():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU choice")
    x, ids, w, w13, w2, _ = _problem(5, 128, 128, 3, 2, torch.float32)
    y = moe_experts(x, ids, w, w13, w2, recipe="fp8_blockwise")
    torch.testing.assert_close(y, moe_experts(x, ids, w, w13, w2, recipe="fp8_blockwise", backend="reference"))


def test_the_deep_gemm_probe_traces_without_a_graph_break():
    """`auto` asks whether DeepGEMM imports on every MoE call, inside torch.compile's trace too (a CUDA MoE block
    is one graph): the answer is a constant probed at import, so Dynamo traces it without running an import."""
    from moela.ops.moe.gemm_library import DEEP_GEMM_IMPORTS, deep_gemm_available

    torch.manual_seed(0)
    x = torch.randn(3)
    traced = torch.compile(lambda t: t + float(deep_gemm_available()), fullgraph=True, backend="eager")
    torch.testing.assert_close(traced(x), x + float(DEEP_GEMM_IMPORTS and torch.cuda.is_available()))


def test_fast_backend_rejects_layouts_past_int32_offsets():
    t, d, f = 300_000, 128, 4096  # 2.4M padded rows x 2F = 8192 columns > 2^31
    x = torch.zeros(1, d, dtype=torch.float16).expand(t, d)
    ids = torch.zeros(t, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="int32 offsets"):
        moe_experts(x, ids, torch.zeros(t, 8), torch.zeros(2, 2 * f, d), torch.zeros(2, d, f), backend="triton")


def test_fast_backend_rejects_unaligned_shapes_with_a_clear_message():
    x, ids, w, w13, w2, _ = _problem(5, 96, 128, 3, 2, torch.float16)
    with pytest.raises(ValueError, match="multiples of 128"):
        moe_experts(x, ids, w, w13, w2, backend="triton")


# ---------------------------------------------------------------------------------------------------------------
# GPU, real sizes


@gpu
@pytest.mark.parametrize("recipe,backend", [("fp8_blockwise", "triton"), ("fp8_blockwise", "cublas"),
                                            ("bf16", "triton"), ("bf16", "torch")])
@pytest.mark.parametrize("skew", [False, True])
def test_gpu_whole_path_v2lite_shape(recipe, backend, skew):
    from moela.ops.moe.gemm_library import cublas_blockwise_available

    if backend == "cublas" and not cublas_blockwise_available():
        pytest.skip("cuBLAS blockwise FP8 needs a Hopper GPU and torch >= 2.10")
    prob = _problem(2048, 2048, 1408, 16, 6, torch.bfloat16, skew=skew)
    exact = _exact_grads(*prob)
    got = _run(*prob, recipe, backend)
    ref = _run(*prob, recipe, "reference")
    for name, a, r, ex in zip(["y", "dx", "dw", "dw13", "dw2"], got, ref, exact):
        ea, er = _rel(a, ex), _rel(r, ex)
        bound = (1.25 if name == "y" else 2.0) * er + 2e-3 if recipe == "fp8_blockwise" else 2 * er + 5e-3
        assert ea <= bound, (name, ea, er)


@gpu
def test_gpu_fp8_gemm_v3_shape_vs_float64():
    from moela.ops.moe.gemm_library import cublas_blockwise_available, cublas_mgrouped
    from moela.ops.moe.gemm_triton import mgrouped_gemm
    from moela.ops.moe.permute import permute_align
    from moela.ops.moe.quantize import quant_weights

    t, d, n, e = 4096, 7168, 4096, 8
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    ids = _routing(t, e, 1)
    w = torch.randn(e, n, d, device="cuda", dtype=torch.bfloat16)
    xq, xs, lay = permute_align(x, ids, e)
    wq, ws, _ = quant_weights(w)
    out = mgrouped_gemm(xq, wq, lay.m_indices, a_scale=xs, b_scale=ws)
    if cublas_blockwise_available():
        bounds = lay.expert_bounds()
        cub = cublas_mgrouped(xq, xs, wq, ws, bounds)
        assert _rel(cub, out) < 5e-3  # the same quantized operands; bf16 output rounding and MMA order only
    rows = lay.row_map.long()
    ex = ids[:, 0]
    sel = torch.arange(0, t, 97, device="cuda")
    ref = torch.stack([x[i].double() @ w[ex[i]].double().t() for i in sel.tolist()])
    deq = torch.stack([dequant_1x128(xq[rows[i]][None], xs[rows[i]][None])[0].double()
                       @ dequant_128x128(wq[ex[i]], ws[ex[i]]).double().t() for i in sel.tolist()])
    got = out[rows[sel]]
    assert _rel(got, deq) < 5e-3  # bf16 output rounding only
    assert _rel(got, ref) <= 1.25 * _rel(deq, ref) + 1e-3


def test_backend_recipe_mismatches_are_explained():
    x, ids, w, w13, w2, _ = _problem(5, 128, 128, 3, 2, torch.float16)
    with pytest.raises(ValueError, match="recipe='bf16'"):
        moe_experts(x, ids, w, w13, w2, recipe="fp8_blockwise", backend="torch")
    with pytest.raises(ValueError, match="recipe='fp8_blockwise'"):
        moe_experts(x, ids, w, w13, w2, recipe="bf16", backend="cublas")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="deep_gemm"):
            moe_experts(x, ids, w, w13, w2, recipe="fp8_blockwise", backend="deep_gemm")
        with pytest.raises(RuntimeError, match="Hopper"):
            moe_experts(x, ids, w, w13, w2, recipe="fp8_blockwise", backend="cublas")
