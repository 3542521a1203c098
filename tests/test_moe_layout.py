"""The MoE expert path's data movement: the contiguous layout's invariants against torch's stable sort, permute
(+ 1x128 quantization) and unpermute + combine with its backward, against float64 math. Kernels run under
TRITON_INTERPRET=1 on CPU."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_cases import DEV, MOE_MARKS, rel, routing
from moela.ops.moe.quant_spec import quant_1x128
from test_quant import assert_same_quant

pytestmark = MOE_MARKS


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
    from moela.ops.moe.kernels.permute import build_layout, permute_align

    t, e, k = 90, 7, 3  # 270 (token, k) pairs: three 128-id chunks of the counting kernel, the last one partial
    if case == "many_experts":
        t, e = 53, 70  # two 64-expert blocks of the histogram, the second partial
    ids = routing(t, e, k)
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
def test_layout_invariants_randomrouting(t, e, k, seed):
    from moela.ops.moe.kernels.permute import build_layout

    k = min(k, e)
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(t, e, generator=g).argsort(1)[:, :k].to(DEV)  # distinct experts per token, any skew
    _check_layout(build_layout(ids, e), ids, e)


@pytest.mark.parametrize("quant", [None, "fp8_1x128"])
def test_permute_align_writes_rows_scales_and_zero_padding(quant):
    from moela.ops.moe.kernels.permute import permute_align

    t, d, e, k = 41, 256, 5, 2
    x = torch.randn(t, d, device=DEV, dtype=torch.float16)
    ids = routing(t, e, k, skew=True)
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
    from moela.ops.moe.kernels.combine import combine_bwd, unpermute_combine
    from moela.ops.moe.kernels.permute import build_layout

    t, d, e, k = 29, 384, 4, 3
    ids = routing(t, e, k)
    lay = build_layout(ids, e)
    o = torch.randn(lay.m_pad, d, device=DEV)
    w = torch.rand(t, k, device=DEV)
    y = unpermute_combine(o, lay, w, torch.float32)
    rows = lay.row_map.long().view(t, k)
    ref = (o.double()[rows] * w.double()[..., None]).sum(1)
    assert rel(y, ref) < 1e-6
    dy = torch.randn(t, d, device=DEV)
    do, _, dw = combine_bwd(dy, o, lay, w, quant=False)
    ref_do = torch.zeros(lay.m_pad, d, dtype=torch.float64, device=DEV)
    ref_do[rows.reshape(-1)] = (dy.double()[:, None] * w.double()[..., None]).reshape(-1, d)
    assert rel(do, ref_do) < 1e-6
    assert rel(dw, (dy.double()[:, None] * o.double()[rows]).sum(-1)) < 1e-6
    (q, s), (qt, st), _ = combine_bwd(dy, o, lay, w, quant=True)
    assert_same_quant(q, s, *quant_1x128(do))
    assert_same_quant(qt, st, *quant_1x128(do.t().contiguous()))
