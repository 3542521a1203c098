"""The warp-specialized Gluon FP8 GEMM (moela.ops.moe.gemm_fp8_gluon) on a Hopper GPU: float64 math on the same
quantized operands, which the project's quantizing kernels produce bit for bit as the pure-torch quantizer does
(on the CPU); odd expert counts, empty experts, no routed rows at all, token counts that are not multiples of 128,
the data gradient's transposed weights with strided scales, several tiles per CTA (the ring's phases wrap), rows
past the routed ones left unwritten, a CUDA graph replayed on new routing, and the expert path and the FP8 linear
with the kernel switched on. Gluon does not run in the Triton interpreter: without a Hopper GPU these tests are
skipped, and tests/test_kernels_sm90.py compiles the kernel for sm_90 on any machine."""

from __future__ import annotations

import pytest
import torch

from moela.ops.moe import gemm_fp8, gemm_fp8_gluon
from moela.ops.moe.quant import dequant_1x128, dequant_128x128, quant_1x128, quant_128x128

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def hopper():
    if not (torch.cuda.is_available() and gemm_fp8_gluon.available(torch.device("cuda"))):
        pytest.skip("the Gluon FP8 GEMM needs a Hopper (sm_90) GPU and a Triton with Gluon")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _same_bits(q, s, rq, rs):
    """GPU kernel codes and scales == the pure-torch quantizer's on the CPU, bit for bit."""
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)


def _activations(m, k, valid, seed):
    """a [m, k] bf16 (zero on invalid rows, rows of very different magnitudes) quantized by the project's row
    quantizer on the GPU, checked against quant_1x128 on the CPU."""
    from moela.ops.moe.quantize import quant_rows_cols

    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[torch.randperm(m, generator=g), None])
    a = (a * valid[:, None].cpu()).to(torch.bfloat16)
    (aq, as_), _ = quant_rows_cols(a.cuda(), colwise=False)
    _same_bits(aq, as_, *quant_1x128(a.float()))
    return aq, as_


def _weights(e, n, k, seed):
    """w [e, n, k] quantized by the project's weight quantizer on the GPU (codes, scales, transposed codes), checked
    against quant_128x128 on the CPU."""
    from moela.ops.moe.quantize import quant_weights

    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(e, n, k, generator=g) / k ** 0.5 * torch.logspace(-1, 1, e)[:, None, None]).to(torch.bfloat16)
    wq, ws, wqt = quant_weights(w.cuda())
    for i in range(e):
        _same_bits(wq[i], ws[i], *quant_128x128(w[i].float()))
    return wq, ws, wqt


def _routing_layout(t, e, k, empty, seed):
    """Tokens routed to k distinct experts of e, none to those in `empty`, and their padded layout."""
    from moela.ops.moe.permute import build_layout

    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([x for x in range(e) if x not in empty])
    ids = torch.stack([allowed[torch.randperm(allowed.numel(), generator=g)[:k]] for _ in range(t)])
    return build_layout(ids.cuda(), e)


def _reference(aq, as_, wq, ws, experts):
    """float64 out[r] = dequant(a)[r] @ dequant(w[experts[r]])^T on the CPU, one expert at a time."""
    a = dequant_1x128(aq.cpu().float(), as_.cpu()).double()
    experts = experts.cpu()
    out = torch.zeros(a.shape[0], wq.shape[1], dtype=torch.float64)
    for i in range(wq.shape[0]):
        rows = (experts == i).nonzero()[:, 0]
        out[rows] = a[rows] @ dequant_128x128(wq[i].cpu().float(), ws[i].cpu()).double().t()
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
    assert _rel(out[:used].cpu(), ref[:used]) < tol
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
    assert out.shape == (m, n) and _rel(out.cpu(), ref) < 1e-3


def test_few_programs_and_no_routed_rows(poisoned_empty):
    """Three CTAs walking every tile (each CTA's ring wraps many times), and a routing that fills no row at all."""
    e, n, k = 3, 384, 512
    lay = _routing_layout(400, e, 1, (), seed=4)
    used = int(lay.offsets[-1])
    aq, as_ = _activations(lay.m_pad, k, lay.m_indices >= 0, seed=5)
    wq, ws, _ = _weights(e, n, k, seed=6)
    out = torch.full((lay.m_pad, n), float("nan"), device="cuda")
    gemm_fp8_gluon.mgrouped_fp8_ws(aq, as_, wq, ws, lay.m_indices, lay.offsets, out, num_programs=3)
    ref = _reference(aq, as_, wq, ws, lay.m_indices.clamp_min(0).long())
    assert _rel(out[:used].cpu(), ref[:used]) < 1e-3 and torch.isnan(out[used:]).all()
    nothing = torch.zeros_like(lay.offsets)  # offsets[E] = 0: no tile to compute
    out = gemm_fp8.mgrouped_fp8(aq, as_, wq, ws, torch.full_like(lay.m_indices, -1), nothing,
                                out_dtype=torch.float32, impl="gluon")
    assert torch.isnan(out).all()


def test_cuda_graph_replays_on_new_routing():
    """Captured once, replayed after the routing and the activations change in place: the expert bounds are read on
    the device, so the replay follows the new routing (no host sync inside the launch)."""
    e, n, k, t = 4, 256, 384, 300
    first, second = (_routing_layout(t, e, 2, empty, seed=s) for s, empty in ((7, ()), (8, (2,))))
    assert first.m_pad == second.m_pad
    wq, ws, _ = _weights(e, n, k, seed=9)
    aq, as_ = _activations(first.m_pad, k, first.m_indices >= 0, seed=10)
    m_idx, offsets = first.m_indices.clone(), first.offsets.clone()
    gemm_fp8.mgrouped_fp8(aq, as_, wq, ws, m_idx, offsets, impl="gluon")  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm_fp8.mgrouped_fp8(aq, as_, wq, ws, m_idx, offsets, impl="gluon")
    aq2, as2 = _activations(second.m_pad, k, second.m_indices >= 0, seed=11)
    for dst, src in ((m_idx, second.m_indices), (offsets, second.offsets), (aq, aq2), (as_, as2)):
        dst.copy_(src)
    graph.replay()
    used = int(second.offsets[-1])
    want = gemm_fp8.mgrouped_fp8(aq2, as2, wq, ws, second.m_indices, second.offsets, impl="gluon")
    assert torch.equal(out[:used], want[:used])


def test_expert_path_and_fp8_linear_with_the_gluon_kernel(monkeypatch):
    """The one-line switch (gemm_fp8.AUTO_MGROUPED_IMPL): forward, data gradients and the FP8 linear through the
    Gluon kernel match the Triton kernels' results."""
    from moela.ops.fp8_linear import fp8_linear
    from moela.ops.moe import moe_experts

    t, d, f, e, topk = 300, 384, 256, 5, 2
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e - 1)[:topk] for _ in range(t)]).cuda()  # expert e-1 empty
    tw = torch.rand(t, topk, device="cuda")
    w13 = torch.randn(e, 2 * f, d, device="cuda") / d ** 0.5
    w2 = torch.randn(e, d, f, device="cuda") / f ** 0.5
    lin = torch.randn(640, d, device="cuda") / d ** 0.5  # an FP8 linear d -> 640
    dy = torch.randn(t, d, device="cuda")

    def run(impl):
        monkeypatch.setattr(gemm_fp8, "AUTO_MGROUPED_IMPL", impl)
        leaves = [torch.nn.Parameter(v.clone()) for v in (x, w13, w2, lin)]
        y = moe_experts(leaves[0], ids, tw, leaves[1], leaves[2], recipe="fp8_blockwise", backend="triton")
        z = fp8_linear(leaves[0], leaves[3], backend="triton")
        (y.float() * dy).sum().backward()
        z.float().sum().backward()
        return y, z, leaves[0].grad, leaves[3].grad

    for got, want in zip(run("gluon"), run("triton")):
        assert _rel(got, want) < 1e-3
