"""The warp-specialized Gluon FP8 GEMMs (moela.ops.moe.kernels.gemm_fp8_gluon_mgrouped: m-grouped, forward and data
gradient; gemm_fp8_gluon_kgrouped: the weight gradient) on a Hopper GPU: float64 math on the same quantized operands,
which the project's quantizing kernels produce bit for bit as the pure-torch quantizer does (on the CPU); odd expert
counts, empty experts, no routed rows at all, row counts that are not multiples of 128, the data gradient's
transposed weights with strided scales, several tiles per CTA (the ring's phases wrap), rows past the routed ones
left unwritten, a CUDA graph replayed on new routing, and the expert path (`fp8_gemm` / `fp8_wgrad`) and the FP8
linear on the kernels. Gluon does not run in the Triton interpreter: without a Hopper GPU these tests are skipped,
and tests/test_kernels_sm90.py compiles the kernels for sm_90 on any machine."""

from __future__ import annotations

import pytest
import torch

from moela.ops.moe.kernels import gemm_fp8_gluon_kgrouped, gemm_fp8_gluon_mgrouped
from moela.ops.moe.kernels import gemm_fp8_triton as gemm_fp8
from moela.ops.moe.quant_spec import dequant_1x128, dequant_128x128, quant_1x128, quant_128x128

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def hopper():
    if not (torch.cuda.is_available() and gemm_fp8_gluon_mgrouped.available(torch.device("cuda"))):
        pytest.skip("the Gluon FP8 GEMM needs a Hopper (sm_90) GPU and a Triton with Gluon")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _same_bits(q, s, rq, rs):
    """GPU kernel codes and scales == the pure-torch quantizer's on the CPU, bit for bit."""
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)


def _activations(m, k, valid, seed):
    """a [m, k] bf16 (zero on invalid rows, rows of very different magnitudes) quantized by the project's row
    quantizer on the GPU, checked against quant_1x128 on the CPU."""
    from moela.ops.moe.kernels.quantize_triton import quant_rows_cols

    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[torch.randperm(m, generator=g), None])
    a = (a * valid[:, None].cpu()).to(torch.bfloat16)
    (aq, as_), _ = quant_rows_cols(a.cuda(), colwise=False)
    _same_bits(aq, as_, *quant_1x128(a.float()))
    return aq, as_


def _columns(m, n, valid, seed):
    """x [m, n] bf16 (zero on invalid rows) quantized by columns (1x128 groups along the rows, the weight
    gradient's operand layout [n, m]) on the GPU, checked against quant_1x128 of x^T on the CPU."""
    from moela.ops.moe.kernels.quantize_triton import quant_rows_cols

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, n, generator=g) * torch.logspace(-1, 1, n)[None] * valid[:, None].cpu()).to(torch.bfloat16)
    _, (xqt, xst) = quant_rows_cols(x.cuda(), rowwise=False)
    _same_bits(xqt, xst, *quant_1x128(x.float().t().contiguous()))
    return xqt, xst


def _weight_gradient_reference(aqt, ast, bqt, bst, offsets):
    """float64 out[e] = dequant(a)[:, s:t] @ dequant(b)[:, s:t]^T, [s, t) = offsets[e:e+2] (on the GPU)."""
    a = dequant_1x128(aqt.float(), ast).double()
    b = dequant_1x128(bqt.float(), bst).double()
    off = offsets.tolist()
    return torch.stack([a[:, off[i]:off[i + 1]] @ b[:, off[i]:off[i + 1]].t() for i in range(len(off) - 1)])


def _weights(e, n, k, seed):
    """w [e, n, k] quantized by the project's weight quantizer on the GPU (codes, scales, transposed codes), checked
    against quant_128x128 on the CPU."""
    from moela.ops.moe.kernels.quantize_triton import quant_weights

    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(e, n, k, generator=g) / k ** 0.5 * torch.logspace(-1, 1, e)[:, None, None]).to(torch.bfloat16)
    wq, ws, wqt = quant_weights(w.cuda())
    for i in range(e):
        _same_bits(wq[i], ws[i], *quant_128x128(w[i].float()))
    return wq, ws, wqt


def _routing_layout(t, e, k, empty, seed):
    """Tokens routed to k distinct experts of e, none to those in `empty`, and their padded layout."""
    from moela.ops.moe.kernels.permute import build_layout

    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([x for x in range(e) if x not in empty])
    ids = torch.stack([allowed[torch.randperm(allowed.numel(), generator=g)[:k]] for _ in range(t)])
    return build_layout(ids.cuda(), e)


def _reference(aq, as_, wq, ws, experts):
    """float64 out[r] = dequant(a)[r] @ dequant(w[experts[r]])^T, one expert at a time (on the GPU)."""
    a = dequant_1x128(aq.cuda().float(), as_.cuda()).double()
    experts = experts.cuda()
    out = torch.zeros(a.shape[0], wq.shape[1], dtype=torch.float64, device="cuda")
    for i in range(wq.shape[0]):
        rows = (experts == i).nonzero()[:, 0]
        out[rows] = a[rows] @ dequant_128x128(wq[i].cuda().float(), ws[i].cuda()).double().t()
    return out


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", ["odd experts", "many tiles per CTA", "data gradient"])
def test_grouped_vs_float64(case, out_dtype, poisoned_empty):
    e, t, topk, n, k, empty = {"odd experts": (5, 150, 2, 384, 640, (1,)),
                               "many tiles per CTA": (9, 1000, 3, 1280, 1024, (0, 4)),
                               "data gradient": (7, 333, 2, 512, 384, (6,))}[case]
    lay = _routing_layout(t, e, topk, empty, seed=1)
    used = int(lay.offsets[-1])
    assert all(int(lay.counts[x]) == 0 for x in empty) and lay.m_pad > used
    valid = lay.m_indices >= 0
    aq, as_ = _activations(lay.m_pad, k, valid, seed=2)
    if case == "data gradient":  # W [E, k, n] quantized as stored; the product reads its transposed codes
        wq, ws, wqt = _weights(e, k, n, seed=3)  # [E, n, k] and the scales' transposed (strided) view
        b, bs = wqt, ws.transpose(1, 2)
        ref = _reference(aq, as_, wqt, ws.transpose(1, 2).contiguous(), lay.m_indices.clamp_min(0).long())
    else:
        b, bs, _ = _weights(e, n, k, seed=3)
        ref = _reference(aq, as_, b, bs, lay.m_indices.clamp_min(0).long())
    out = gemm_fp8.mgrouped_fp8(aq, as_, b, bs, lay.m_indices, lay.offsets, out_dtype=out_dtype, impl="gluon")
    tol = 3e-3 if out_dtype == torch.bfloat16 else 1e-3  # bf16 output rounding; the tensor cores' fp8 adder
    assert _rel(out[:used], ref[:used]) < tol
    assert torch.isnan(out[used:]).all()  # rows past the routed ones: not computed, not written
    if out_dtype == torch.float32:  # the Triton kernel: the same products, the same promotion order
        triton_out = gemm_fp8.mgrouped_fp8(aq, as_, b, bs, lay.m_indices, lay.offsets, out_dtype=out_dtype,
                                           impl="triton")
        assert _rel(out[:used], triton_out[:used]) < 1e-5


@pytest.mark.parametrize("m", [1, 200, 1000])
def test_one_group_any_row_count(m, poisoned_empty):
    """The dense GEMM of fp8_linear: M not a multiple of 128 (a ragged last block, clipped by TMA)."""
    n, k = 640, 896
    aq, as_ = quant_1x128(torch.randn(m, k))
    wq, ws = quant_128x128(torch.randn(n, k) / k ** 0.5)
    out = gemm_fp8.mgrouped_fp8(aq.cuda(), as_.cuda(), wq.cuda(), ws.cuda(), out_dtype=torch.float32, impl="gluon")
    ref = _reference(aq, as_, wq[None], ws[None], torch.zeros(m, dtype=torch.long))
    assert out.shape == (m, n) and _rel(out, ref) < 1e-3


def test_few_programs_and_no_routed_rows(poisoned_empty):
    """Three CTAs walking every tile (each CTA's ring wraps many times), and a routing that fills no row at all."""
    e, n, k = 3, 384, 512
    lay = _routing_layout(400, e, 1, (), seed=4)
    used = int(lay.offsets[-1])
    aq, as_ = _activations(lay.m_pad, k, lay.m_indices >= 0, seed=5)
    wq, ws, _ = _weights(e, n, k, seed=6)
    out = torch.full((lay.m_pad, n), float("nan"), device="cuda")
    gemm_fp8_gluon_mgrouped.mgrouped_fp8_gluon(aq, as_, wq, ws, lay.m_indices, lay.offsets, out, num_programs=3)
    ref = _reference(aq, as_, wq, ws, lay.m_indices.clamp_min(0).long())
    assert _rel(out[:used], ref[:used]) < 1e-3 and torch.isnan(out[used:]).all()
    nothing = torch.zeros_like(lay.offsets)  # offsets[E] = 0: no tile to compute
    out = gemm_fp8.mgrouped_fp8(aq, as_, wq, ws, torch.full_like(lay.m_indices, -1), nothing,
                                out_dtype=torch.float32, impl="gluon")
    assert torch.isnan(out).all()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_vs_float64(out_dtype):
    """out[e] = dH_e^T X_e over each expert's tokens; odd expert count, two empty experts (zeros, not garbage)."""
    e, t, topk, n, k = 7, 500, 2, 384, 640
    lay = _routing_layout(t, e, topk, (0, 5), seed=12)
    valid = lay.m_indices >= 0
    aqt, ast = _columns(lay.m_pad, n, valid, seed=13)  # [n, M_pad]
    bqt, bst = _columns(lay.m_pad, k, valid, seed=14)  # [k, M_pad]
    out = gemm_fp8.kgrouped_fp8(aqt, ast, bqt, bst, lay.offsets, out_dtype=out_dtype, impl="gluon")
    ref = _weight_gradient_reference(aqt, ast, bqt, bst, lay.offsets)
    assert out.shape == (e, n, k) and torch.equal(out[0], torch.zeros_like(out[0])) and not out[5].any()
    assert _rel(out, ref) < (3e-3 if out_dtype == torch.bfloat16 else 1e-3)
    if out_dtype == torch.float32:
        assert _rel(out, gemm_fp8.kgrouped_fp8(aqt, ast, bqt, bst, lay.offsets, impl="triton")) < 1e-5


def test_weight_gradient_one_group():
    """One group over M = 208 tokens (a partial last block) and N = 320 (a ragged last row block, clipped by TMA)."""
    m, n, k = 208, 320, 256
    aqt, ast = quant_1x128(torch.randn(n, m))
    bqt, bst = quant_1x128(torch.randn(k, m))
    aqt, ast, bqt, bst = (v.cuda() for v in (aqt, ast, bqt, bst))
    out = gemm_fp8.kgrouped_fp8(aqt, ast, bqt, bst, impl="gluon")
    ref = _weight_gradient_reference(aqt, ast, bqt, bst, torch.tensor([0, m]))
    assert out.shape == (1, n, k) and _rel(out, ref) < 1e-3


@pytest.mark.parametrize("order", ["by_load", "reversed"])
def test_weight_gradient_few_programs(order):
    """The grouped product over 5 experts (one empty) with three CTAs walking every tile: each program must read
    its tile's token range at the tile's start (the kernel once carried it across tiles and was wrong here); the
    experts' tiles dealt in the default order (most tokens first) or in another permutation."""
    lay = _routing_layout(300, 5, 2, (3,), seed=15)
    aqt, ast = _columns(lay.m_pad, 256, lay.m_indices >= 0, seed=16)
    bqt, bst = _columns(lay.m_pad, 384, lay.m_indices >= 0, seed=17)
    out = torch.full((5, 256, 384), float("nan"), device="cuda")
    perm = None if order == "by_load" else torch.arange(4, -1, -1, device="cuda", dtype=torch.int32)
    gemm_fp8_gluon_kgrouped.kgrouped_fp8_gluon(aqt, ast, bqt, bst, lay.offsets, out, num_programs=3, order=perm)
    assert _rel(out, _weight_gradient_reference(aqt, ast, bqt, bst, lay.offsets)) < 1e-3


def test_cuda_graph_replays_on_new_routing():
    """Captured once, replayed after the routing and the activations change in place: the expert bounds are read on
    the device, so the replay follows the new routing (no host sync inside the launches)."""
    from moela.ops.moe.kernels.quantize_triton import quant_rows_cols

    e, n, k, t = 4, 256, 384, 300
    first, second = (_routing_layout(t, e, 2, empty, seed=s) for s, empty in ((7, ()), (8, (2,))))
    assert first.m_pad == second.m_pad
    wq, ws, _ = _weights(e, n, k, seed=9)

    def operands(lay):  # rows and columns of activations in the layout (zero padding rows)
        x = torch.randn(lay.m_pad, k, device="cuda") * (lay.m_indices >= 0)[:, None]
        (xq, xs), (xqt, xst) = quant_rows_cols(x.to(torch.bfloat16))
        return [lay.m_indices.clone(), lay.offsets.clone(), xq, xs, xqt, xst]

    live = operands(first)

    def launches():
        m_idx, offsets, xq, xs, xqt, xst = live
        return (gemm_fp8.mgrouped_fp8(xq, xs, wq, ws, m_idx, offsets, impl="gluon"),
                gemm_fp8.kgrouped_fp8(xqt, xst, xqt, xst, offsets, impl="gluon"))

    launches()  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, wgrad = launches()
    for dst, src in zip(live, operands(second)):
        dst.copy_(src)
    graph.replay()
    used = int(second.offsets[-1])
    want, want_wgrad = launches()
    assert torch.equal(out[:used], want[:used]) and torch.equal(wgrad, want_wgrad)
    assert not wgrad[2].any() and wgrad[0].any()  # the expert the second routing left empty, and a routed one


def test_expert_path_and_fp8_linear_on_the_gluon_kernels():
    """The expert path with `fp8_gemm` / `fp8_wgrad` = "gluon" (forward, data and weight gradients) matches the
    Triton kernels' results; the FP8 linear (whose GEMMs are the Gluon kernels on Hopper) matches the simulated
    reference's output on the same quantization."""
    from moela.ops.fp8_linear import fp8_linear
    from moela.ops.moe import moe_experts

    torch.manual_seed(0)
    t, d, f, e, topk = 300, 384, 256, 5, 2
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e - 1)[:topk] for _ in range(t)]).cuda()  # expert e-1 empty
    tw = torch.rand(t, topk, device="cuda")
    w13 = torch.randn(e, 2 * f, d, device="cuda") / d ** 0.5
    w2 = torch.randn(e, d, f, device="cuda") / f ** 0.5
    dy = torch.randn(t, d, device="cuda")

    def run(impl):
        leaves = [torch.nn.Parameter(v.clone()) for v in (x, w13, w2)]
        y = moe_experts(leaves[0], ids, tw, leaves[1], leaves[2], recipe="fp8_blockwise", backend="triton",
                        fp8_gemm=impl, fp8_wgrad=impl)
        (y.float() * dy).sum().backward()
        return y, *(leaf.grad for leaf in leaves)

    for got, want in zip(run("gluon"), run("triton")):
        assert _rel(got, want) < 1e-3
    lin = torch.nn.Parameter(torch.randn(640, d, device="cuda") / d ** 0.5)  # an FP8 linear d -> 640
    z = fp8_linear(x, lin, backend="triton")
    assert _rel(z, fp8_linear(x, lin, backend="reference")) < 1e-2  # bf16 output rounding, the fp8 adder
