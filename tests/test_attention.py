"""mla_attention on the CPU: the Triton backend's kernels under TRITON_INTERPRET=1, the work list they launch over,
the reference, and the backend errors, against an independent float64 computation (tests/attention_checks.py).
Outputs of the kernels are poisoned with NaN before each call (every `torch.empty` in the launcher returns NaN), so
an element the kernel forgot to write fails. The GPU tests are in test_attention_gpu.py, the choice of kernel per
phase in test_attention_phases.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from attention_checks import check_against_float64, make_case, naive_attention, needs_interpreter, run_with_grads
from moela.ops.attention import api as attn_mod
from moela.ops.attention import attention_reference, mla_attention

triton_mod = pytest.importorskip("moela.ops.attention.autograd")


LENS = [1, 7, 64, 129, 300]


@needs_interpreter
@pytest.mark.parametrize("d_qk,d_v,causal,alibi", [
    (192, 128, True, False), (192, 128, False, True), (64, 64, True, True), (64, 64, False, False),
])
def test_triton_varlen_matches_float64(poisoned_empty, d_qk, d_v, causal, alibi):
    # one head: the interpreter's time grows with heads; the other Triton tests cover head strides (H = 2, 3)
    check_against_float64(LENS, LENS, 1, d_qk, d_v, torch.float16, "cpu", causal, alibi,
                          seed=d_qk + 2 * causal + alibi, backend="triton")


@needs_interpreter
def test_triton_bottom_right_causal_longer_k(poisoned_empty):
    """A q chunk that is the tail of a longer k side (context parallelism): masking aligns bottom-right."""
    check_against_float64([5, 0, 33, 70], [5, 0, 97, 131], 3, 192, 128, torch.float16, "cpu", True, True,
                          seed=11, backend="triton")


@needs_interpreter
@pytest.mark.parametrize("alibi", [False, True])
def test_triton_queries_that_see_no_key(poisoned_empty, alibi):
    """q side longer than k side, causal: the first Lq - Lk queries see nothing -> out 0, lse -inf, no NaN (with
    ALiBi, their positions on the k side are negative)."""
    q, k, v, cu_q, cu_k, slopes, dout, _ = make_case([10, 40], [4, 40], 2, 32, 16, torch.float32, "cpu", alibi,
                                                     seed=9)
    kw = dict(alibi_slopes=slopes)
    got = run_with_grads(lambda a, b, c: (mla_attention(a, b, c, cu_q, 40, cu_seqlens_k=cu_k, max_seqlen_k=40,
                                                        return_lse=True, backend="triton", **kw)[0], None)[:1],
                         q, k, v, dout, None)
    want = run_with_grads(lambda a, b, c: (attention_reference(a, b, c, cu_q, cu_k, **kw)[0], None)[:1], q, k, v,
                          dout, None)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert (got[0][:6] == 0).all() and (got[1][:6] == 0).all()  # out and dq of the blind queries
    _, lse = mla_attention(q, k, v, cu_q, 40, cu_seqlens_k=cu_k, max_seqlen_k=40, return_lse=True, backend="triton",
                           **kw)
    assert torch.isneginf(lse[:, :6]).all() and torch.isfinite(lse[:, 6:]).all()
    torch.testing.assert_close(lse, attention_reference(q, k, v, cu_q, cu_k, **kw)[1], rtol=1e-5, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("lens_q,lens_k,slope_scale", [([330], [520], 1.0), ([40, 300], [40, 300], 3.0)])
def test_triton_causal_alibi_split_fp32(poisoned_empty, lens_q, lens_k, slope_scale):
    """Causal ALiBi adds only the bias's column term to the scores and its row term to lse, both relative to a point
    in each program's block: many blocks between a query and its first keys, a longer k side, and steep slopes (up to
    0.93), in float32."""
    check_against_float64(lens_q, lens_k, 2, 64, 64, torch.float32, "cpu", True, True, seed=17, backend="triton",
                          slope_scale=slope_scale)


@needs_interpreter
def test_triton_odd_head_dims_fp32(poisoned_empty):
    """Dqk that splits into 64 + 32 (masked to 48 here) and a non-power-of-two Dv, in float32."""
    check_against_float64([3, 40, 77], [3, 40, 77], 2, 112, 72, torch.float32, "cpu", True, True, seed=5,
                          backend="triton")


@needs_interpreter
def test_triton_bf16_upcast_in_interpreter(poisoned_empty):
    """bf16 tiles are upcast under the interpreter; its float32 -> bf16 store truncates, hence 3 ulps of slack."""
    check_against_float64([9, 50], [9, 50], 1, 192, 128, torch.bfloat16, "cpu", True, False, seed=3,
                          backend="triton", ulps=3.0)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("key_blocks", [True, False])
def test_worklist_holds_every_block_once_costliest_first(causal, key_blocks):
    from moela.ops.attention.kernels.worklist import build_worklist

    lens_q, lens_k, block = [5, 0, 130, 64, 1, 300], [9, 0, 200, 64, 1, 300], 32
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32)
    n_tokens = sum(lens_k if key_blocks else lens_q)
    items = build_worklist(cu_q, cu_k, n_tokens, block, key_blocks=key_blocks, causal=causal)
    side = lens_k if key_blocks else lens_q
    expected = {(d, b) for d, length in enumerate(side) for b in range(-(-length // block))}
    real = items[0] >= 0
    assert items.shape == (2, -(-n_tokens // block) + len(side)) and items.dtype == torch.int32
    assert real.sum() == len(expected) and real[:len(expected)].all()  # the unused entries come last
    assert {tuple(x) for x in items[:, real].T.tolist()} == expected

    def cost(d, b):  # (query, key) pairs of the block, from the definition of the mask
        lq, lk = lens_q[d], lens_k[d]
        pairs = [(i, j) for i in range(lq) for j in range(lk) if not causal or j <= i + lk - lq]
        return sum(1 for i, j in pairs if (j if key_blocks else i) // block == b)

    costs = [cost(d, b) for d, b in items[:, real].T.tolist()]
    big, small = max(costs), min(costs)
    assert costs[0] == big and costs[-1] == small  # the costliest block starts first, the cheapest ends the list


def test_worklist_cache_reuses_only_the_same_unmodified_tensors():
    from moela.ops.attention.kernels.worklist import cached_worklist

    cu = torch.tensor([0, 5, 70, 71], dtype=torch.int32)
    first = cached_worklist(cu, cu, 71, 32, key_blocks=False, causal=True)
    assert cached_worklist(cu, cu, 71, 32, key_blocks=False, causal=True) is first  # the next layer's call
    assert cached_worklist(cu, cu, 71, 32, key_blocks=True, causal=True) is not first
    twin = cu.clone()  # equal values, another tensor: built anew (identity, not contents, is the key)
    assert cached_worklist(twin, twin, 71, 32, key_blocks=False, causal=True) is not first
    cu[1:] = torch.tensor([30, 70, 71], dtype=torch.int32)  # modified in place: its version moved
    rebuilt = cached_worklist(cu, cu, 71, 32, key_blocks=False, causal=True)
    assert rebuilt is not first and (rebuilt[0] >= 0).sum() == 1 + 2 + 1


@pytest.mark.parametrize("causal,alibi", [(True, False), (False, True)])
def test_reference_matches_float64(causal, alibi):
    check_against_float64([2, 31, 90], [2, 45, 90], 2, 48, 40, torch.float32, "cpu", causal, alibi, seed=7,
                          backend="reference")


@needs_interpreter
def test_lse_only_gradient(poisoned_empty):
    """z-loss alone (out unused) still yields correct dq and dk, and zero dv."""
    q, k, v, cu, _, _, _, _ = make_case([13, 70], [13, 70], 2, 64, 64, torch.float32, "cpu", False, seed=21)
    qs = [x.clone().requires_grad_() for x in (q, k, v)]
    _, lse = mla_attention(*qs, cu, 70, return_lse=True, backend="triton")
    (lse.square().mean() * 1e-2).backward()
    qr = [x.double().requires_grad_() for x in (q, k, v)]
    _, lse_r = naive_attention(*qr, cu, cu, True, 1 / 8, None)
    (lse_r.square().mean() * 1e-2).backward()
    for a, b in zip(qs[:2], qr[:2]):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-6)
    assert qr[2].grad is None and torch.equal(qs[2].grad, torch.zeros_like(v))


@needs_interpreter
def test_triton_under_torch_compile():
    """A compiled caller gets the same values and gradients (the Triton call is a graph break)."""
    q, k, v, cu, _, _, _, _ = make_case([13, 27], [13, 27], 2, 64, 32, torch.float32, "cpu", False, seed=4)

    def loss(a, b, c):
        out, lse = mla_attention(a, b, c, cu, 27, return_lse=True, backend="triton")
        return out.square().sum() + lse.square().mean()

    results = []
    for fn in (loss, torch.compile(loss, backend="aot_eager")):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        value = fn(*xs)
        results.append([value.detach(), *torch.autograd.grad(value, xs)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_auto_on_cpu_is_reference(monkeypatch, caplog):
    monkeypatch.setattr(attn_mod.DISPATCH, "logged", set())  # the choice is logged once per process
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with caplog.at_level("INFO", logger="moela.ops"):
        out = mla_attention(q, q, q[..., :8].contiguous(), cu, 6)
    assert "mla_attention: using backend 'reference' (auto)" in caplog.text
    torch.testing.assert_close(out, attention_reference(q, q, q[..., :8], cu, cu)[0])


def test_explicit_backend_errors(monkeypatch):
    q = torch.randn(10, 2, 16, dtype=torch.float16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="sdpa"):
        mla_attention(q, q, q, cu, 10, backend="sdpa")
    monkeypatch.setattr(triton_mod, "INTERPRET", False)
    with pytest.raises(ValueError, match="triton"):
        mla_attention(q, q, q, cu, 10, backend="triton")
    with pytest.raises(RuntimeError, match="flash-attn-4 runs on CUDA tensors"):
        mla_attention(q, q, q, cu, 10, backend="flash")
    with pytest.raises(ValueError, match="unknown backend"):
        mla_attention(q, q, q, cu, 10, backend="flash3")


def test_triton_rejects_what_its_launch_cannot_address():
    q = torch.zeros(10, 1, 16, dtype=torch.float16)
    strided = torch.tensor([0, 9, 5, 9, 10, 9], dtype=torch.int32)[::2]  # [0, 5, 10], read as [0, 9, 5] by a kernel
    with pytest.raises(TypeError, match="strided"):
        triton_mod.flash_mla_attention(q, q, q, strided, 5, strided, 5)
    big = torch.zeros(1, 1, 64, dtype=torch.float16).expand(2048, 2 ** 14, 64)  # 2048 rows of 2^20 elements (views)
    one_doc = torch.tensor([0, 2048], dtype=torch.int32)
    with pytest.raises(ValueError, match="int32 offsets"):
        triton_mod.flash_mla_attention(big, big, big, one_doc, 2048, one_doc, 2048)
