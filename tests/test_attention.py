"""mla_attention: the Triton kernels (CPU interpreter and `-m gpu`), the reference and the sdpa backend, against an
independent float64 computation.

Pass rule (DESIGN.md): err(candidate) <= 2 * err(naive torch attention in the candidate's dtype) + atol, errors
measured against float64. Outputs of the kernels are poisoned with NaN before each call (every `torch.empty` in
the launcher returns NaN), so an element the kernel forgot to write fails. The lse gradient is exercised with a
random dlse, which is what attention z-loss feeds it.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from moela.ops.attention import api as attn_mod
from moela.ops.attention import attention_reference, mla_attention
from moela.ops.attention import gluon_bwd as gluon_bwd_module
from moela.ops.attention import gluon_dq as gluon_dq_module
from moela.ops.attention import gluon_fwd as gluon_fwd_module

triton_mod = pytest.importorskip("moela.ops.attention.autograd")

needs_interpreter = pytest.mark.skipif(not triton_mod.INTERPRET, reason="set TRITON_INTERPRET=1 to run Triton on CPU")


def naive_attention(q, k, v, cu_q, cu_k, causal, scale, alibi):
    """Per-document attention in q's dtype (matmuls in that dtype, softmax in at least float32)."""
    soft = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs, lses = [], []
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qd, kd, vd = q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1)
        s = (qd @ kd.transpose(1, 2)).to(soft) * scale  # [H, Lq, Lk]
        i = torch.arange(q1 - q0, device=q.device)[:, None] + (k1 - k0) - (q1 - q0)
        j = torch.arange(k1 - k0, device=q.device)[None, :]
        if alibi is not None:
            s = s - alibi.to(soft)[:, None, None] * (i - j).abs()
        if causal:
            s = s.masked_fill(j > i, float("-inf"))
        lse = torch.logsumexp(s, -1)  # [H, Lq]
        p = torch.exp(s - lse[..., None]).to(q.dtype)
        outs.append((p @ vd).transpose(0, 1))
        lses.append(lse.float() if soft == torch.float32 else lse)
    return torch.cat(outs, 0), torch.cat(lses, 1)


def make_case(lens_q, lens_k, heads, d_qk, d_v, dtype, device, alibi, seed):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32, device=device)
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = (torch.randn(t, heads, d, generator=g).to(device, dtype) for t, d in ((tq, d_qk), (tk, d_qk), (tk, d_v)))
    slopes = (torch.rand(heads, generator=g) * 0.3 + 0.01).to(device) if alibi else None
    dout = torch.randn(tq, heads, d_v, generator=g).to(device, dtype)
    dlse = torch.randn(heads, tq, generator=g).to(device)
    return q, k, v, cu_q, cu_k, slopes, dout, dlse


def run_with_grads(fn, q, k, v, dout, dlse):
    """fn(q, k, v) -> (out, lse), or (out,) when dlse is None. Returns [out, (lse), dq, dk, dv]."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    outs = fn(q, k, v)
    grads = [dout] if dlse is None else [dout, dlse]
    torch.autograd.backward(list(outs), [g.to(o.dtype) for g, o in zip(grads, outs)])
    return [o.detach() for o in outs] + [q.grad, k.grad, v.grad]


def check_against_float64(lens_q, lens_k, heads, d_qk, d_v, dtype, device, causal, alibi, seed, backend,
                          ulps=0.0, slope_scale=1.0, with_lse=True, attention=mla_attention):
    """`with_lse`: the lse is returned and gets a random gradient (the z-loss path); else out alone. `attention`:
    the function under test, with mla_attention's signature."""
    q, k, v, cu_q, cu_k, slopes, dout, dlse = make_case(lens_q, lens_k, heads, d_qk, d_v, dtype, device, alibi, seed)
    if slopes is not None:
        slopes = slopes * slope_scale
    scale = 1.0 / math.sqrt(d_qk)

    def candidate(a, b, c):
        res = attention(a, b, c, cu_q, max(lens_q), cu_seqlens_k=cu_k, max_seqlen_k=max(lens_k), causal=causal,
                        alibi_slopes=slopes, return_lse=with_lse, backend=backend)
        return res if with_lse else (res,)

    def naive(a, b, c):
        res = naive_attention(a, b, c, cu_q, cu_k, causal, scale, slopes)
        return res if with_lse else res[:1]

    if not with_lse:
        dlse = None
    got = run_with_grads(candidate, q, k, v, dout, dlse)
    exact = run_with_grads(naive, q.double(), k.double(), v.double(), dout.double(),
                           None if dlse is None else dlse.double())
    lowp = run_with_grads(naive, q, k, v, dout, dlse)
    names = ("out", "lse", "dq", "dk", "dv") if with_lse else ("out", "dq", "dk", "dv")
    for name, g, e, r in zip(names, got, exact, lowp):
        assert g.shape == e.shape, name
        assert torch.isfinite(g).all(), f"{name}: non-finite values (unwritten output?)"
        err = (g.double() - e).abs().max().item()
        err_ref = (r.double() - e).abs().max().item()
        atol = (1e-5 + ulps * torch.finfo(dtype).eps) * max(1.0, e.abs().max().item())
        assert err <= 2 * err_ref + atol, f"{name}: err {err:.3g} vs same-dtype reference {err_ref:.3g}"


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


@needs_interpreter
def test_triton_per_document_grid_matches_float64(poisoned_empty, monkeypatch):
    """The per-document grid (kept for comparison in bench/attention.py) still computes the same attention."""
    monkeypatch.setitem(triton_mod.SCHEDULE, "grid", "documents")
    check_against_float64([1, 0, 70, 45], [1, 0, 131, 45], 2, 48, 40, torch.float32, "cpu", True, True, seed=19,
                          backend="triton")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("key_blocks", [True, False])
def test_worklist_holds_every_block_once_costliest_first(causal, key_blocks):
    from moela.ops.attention.triton_worklist import build_worklist

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
    from moela.ops.attention.triton_worklist import cached_worklist

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


def test_triton_rejects_what_its_launch_cannot_address(monkeypatch):
    q = torch.zeros(65536, 1, 16, dtype=torch.float16)
    cu = torch.arange(65537, dtype=torch.int32)  # 65536 one-token documents: one more than CUDA's grid z limit
    monkeypatch.setitem(triton_mod.SCHEDULE, "grid", "documents")  # the work list has no such limit
    with pytest.raises(ValueError, match="65535"):
        triton_mod.flash_mla_attention(q, q, q, cu, 1, cu, 1)
    monkeypatch.setitem(triton_mod.SCHEDULE, "grid", "worklist")
    strided = torch.tensor([0, 9, 5, 9, 10, 9], dtype=torch.int32)[::2]  # [0, 5, 10], read as [0, 9, 5] by a kernel
    with pytest.raises(TypeError, match="strided"):
        triton_mod.flash_mla_attention(q[:10], q[:10], q[:10], strided, 5, strided, 5)
    big = torch.zeros(1, 1, 64, dtype=torch.float16).expand(2048, 2 ** 14, 64)  # 2048 rows of 2^20 elements (views)
    one_doc = torch.tensor([0, 2048], dtype=torch.int32)
    with pytest.raises(ValueError, match="int32 offsets"):
        triton_mod.flash_mla_attention(big, big, big, one_doc, 2048, one_doc, 2048)


@pytest.mark.gpu
def test_triton_gpu_heads_times_documents_above_grid_y_limit():
    """16 heads x 4500 documents = 72000 program rows: more than grid dim y alone allows (heads on y, docs on z)."""
    lens = [1, 2, 3, 17, 9] * 900
    check_against_float64(lens, lens, 16, 64, 64, torch.bfloat16, "cuda", True, False, seed=3, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("d_qk,d_v,lens_q,lens_k,causal,alibi,dtype", [
    (192, 128, [2048, 2048], [2048, 2048], True, False, torch.bfloat16),
    (192, 128, [2048, 2048], [2048, 2048], True, False, torch.float16),
    (192, 128, [1, 300, 1500, 4000, 77], [1, 300, 1500, 4000, 77], True, True, torch.bfloat16),
    (192, 128, [1, 300, 1500, 4000, 77], [1, 300, 1500, 4000, 77], False, True, torch.float16),
    (128, 128, [1024, 513], [1024, 513], False, False, torch.bfloat16),
    (128, 128, [1024, 513], [1024, 513], True, True, torch.float16),
    (192, 128, [1000, 3000], [3000, 4096], True, False, torch.bfloat16),
    (256, 256, [700, 1300], [700, 1300], True, True, torch.bfloat16),
    (112, 72, [333, 1200], [333, 1200], True, False, torch.bfloat16),
    (192, 128, [1, 0, 33, 1, 700], [1, 0, 97, 1, 900], True, True, torch.bfloat16),
    (192, 128, [700, 33] + [0] * 62, [700, 33] + [0] * 62, True, False, torch.bfloat16),  # graphed-batch padding
])
def test_triton_gpu(poisoned_empty, d_qk, d_v, lens_q, lens_k, causal, alibi, dtype):
    check_against_float64(lens_q, lens_k, 16, d_qk, d_v, dtype, "cuda", causal, alibi, seed=sum(lens_q),
                          backend="triton")


def gluon_forward_or_skip(monkeypatch, config: str):
    """Routes the Triton backend's forward to the Gluon kernel with `config` and counts its launches; skips where
    it cannot run (no Gluon, not sm_90)."""
    from moela.ops.attention import gluon_fwd

    probe = torch.empty(1, 1, 192, device="cuda", dtype=torch.bfloat16)
    why = gluon_fwd.supports(probe, probe, probe[..., :128], None)
    if why is not None:
        pytest.skip(f"the Gluon forward cannot run here: {why}")
    monkeypatch.setitem(triton_mod.SCHEDULE, "forward", config)
    calls = []
    launch = gluon_fwd.attention_forward
    monkeypatch.setattr(gluon_fwd, "attention_forward", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    return calls


GLUON_FWD_CONFIGS = list(gluon_fwd_module.CONFIGS)  # every config the benchmark times, the default among them
# The Gluon kernels' GPU cases (d_qk, d_v, lens_q, lens_k, causal): odd lengths, single-token and empty documents,
# longer k than q (bottom-right alignment), full attention, 128/128, the `small` model's 96/64, graphed-batch padding
GLUON_CASES = [
    (192, 128, [1, 7, 129, 300, 2049], [1, 7, 129, 300, 2049], True),
    (192, 128, [1, 0, 33, 1, 700], [1, 0, 97, 1, 900], True),
    (192, 128, [1000, 3000], [3000, 4096], False),
    (128, 128, [1024, 513], [1024, 513], True),
    (96, 64, [65, 2, 1500, 190], [65, 2, 1500, 190], True),
    (192, 128, [700, 33] + [0] * 62, [700, 33] + [0] * 62, True),
    (96, 64, [700, 33] + [0] * 62, [700, 33] + [0] * 62, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GLUON_FWD_CONFIGS)
@pytest.mark.parametrize("d_qk,d_v,lens_q,lens_k,causal", GLUON_CASES)
def test_gluon_forward_gpu(poisoned_empty, monkeypatch, config, d_qk, d_v, lens_q, lens_k, causal):
    """The warp-specialized Gluon forward (gluon_fwd.py) with the Triton backward, against float64: odd lengths,
    single-token and empty documents, longer k than q, full attention, 96/64 and 128/128, every config."""
    calls = gluon_forward_or_skip(monkeypatch, config)
    check_against_float64(lens_q, lens_k, 16, d_qk, d_v, torch.bfloat16, "cuda", causal, False, seed=sum(lens_k),
                          backend="triton")
    assert calls, "the Gluon forward did not run"


@pytest.mark.gpu
@pytest.mark.parametrize("config", GLUON_FWD_CONFIGS)
def test_gluon_forward_gpu_queries_that_see_no_key(poisoned_empty, monkeypatch, config):
    """Shorter k than q, causal: the first Lq - Lk queries of a document see no key (out 0, lse -inf), the others
    match the float64 reference."""
    calls = gluon_forward_or_skip(monkeypatch, config)
    q, k, v, cu_q, cu_k, _, _, _ = make_case([300, 200], [100, 200], 16, 192, 128, torch.bfloat16, "cuda", False,
                                             seed=11)
    out, lse = mla_attention(q, k, v, cu_q, 300, cu_seqlens_k=cu_k, max_seqlen_k=200, return_lse=True,
                             backend="triton")
    assert calls
    want_out, want_lse = naive_attention(q.double(), k.double(), v.double(), cu_q, cu_k, True, 192 ** -0.5, None)
    assert (out[:200] == 0).all() and torch.isneginf(lse[:, :200]).all()
    torch.testing.assert_close(out[200:].double(), want_out[200:], rtol=0, atol=2e-2)
    torch.testing.assert_close(lse[:, 200:].double(), want_lse[:, 200:], rtol=0, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("lens_q,lens_k", [([777, 1, 0, 1300], [777, 1, 0, 1300]), ([5, 400], [9, 1031])])
def test_triton_gpu_without_lse(poisoned_empty, lens_q, lens_k):
    """Out alone (no lse returned, so no lse gradient): the backward without a dlse."""
    check_against_float64(lens_q, lens_k, 16, 192, 128, torch.bfloat16, "cuda", True, False, seed=sum(lens_k),
                          backend="triton", with_lse=False)


@pytest.mark.gpu
def test_sdpa_backend_gpu():
    q, k, v, cu, _, _, _, _ = make_case([1024] * 3, [1024] * 3, 8, 192, 128, torch.bfloat16, "cuda", False, 1)
    out = mla_attention(q, k, v, cu, 1024, backend="sdpa")
    exact, _ = naive_attention(q.double(), k.double(), v.double(), cu, cu, True, 192 ** -0.5, None)
    lowp, _ = naive_attention(q, k, v, cu, cu, True, 192 ** -0.5, None)
    err = (out.double() - exact).abs().max().item()
    assert err <= 2 * (lowp.double() - exact).abs().max().item() + 1e-5


def test_gluon_forward_configs_fit_and_split_head_dims():
    """The Gluon forward's configs fit the H100/H200 shared memory at every head-dim pair it accepts, and Dqk
    splits into the TMA boxes the kernel loads (a power of two, then a smaller power of two or nothing)."""
    from moela.ops.attention import gluon_fwd

    assert gluon_fwd.head_split(192) == (128, 64) and gluon_fwd.head_split(96) == (64, 32)
    assert gluon_fwd.head_split(128) == (128, 0) and gluon_fwd.head_split(112) == (64, 48)
    for name, cfg in gluon_fwd.CONFIGS.items():
        for d_qk, d_v in ((192, 128), (128, 128), (96, 64), (64, 64)):
            assert gluon_fwd.shared_bytes(d_qk, d_v, cfg) <= gluon_fwd.SHARED_BYTES, (name, d_qk, d_v)
    assert gluon_fwd.DEFAULT in gluon_fwd.CONFIGS


@needs_interpreter
def test_forward_says_once_why_the_gluon_kernel_does_not_run(monkeypatch, caplog):
    """With a Gluon config asked for, a call the Gluon forward cannot take (here: the CPU) runs the Triton kernel,
    and the log says so and why, once."""
    import logging

    from moela.ops.attention import gluon_fwd, triton_common

    monkeypatch.setitem(triton_mod.SCHEDULE, "forward", gluon_fwd.DEFAULT)
    monkeypatch.setattr(triton_common, "_SAID", set())
    q, k, v, cu_q, cu_k, _, _, _ = make_case([70, 9], [70, 9], 2, 96, 64, torch.float32, "cpu", False, seed=5)
    with caplog.at_level(logging.INFO, logger="moela.ops"):
        for _ in range(2):
            out = mla_attention(q, k, v, cu_q, 70, backend="triton")
    want, _ = naive_attention(q.double(), k.double(), v.double(), cu_q, cu_k, True, 96 ** -0.5, None)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    said = [r.getMessage() for r in caplog.records if "Gluon forward" in r.getMessage()]
    why = gluon_fwd.supports(q, k, v, None)  # no Hopper GPU here (or a Triton without Gluon)
    assert why is not None and said == [f"mla_attention forward: the Triton kernel, not the Gluon forward ({why})"]


def test_gluon_forward_reads_rows_without_copies_where_tma_can():
    """The Gluon forward's 2-D view [T, H * D] of a [T, H, D] tensor: the same values, no copy for a packed or
    token-strided tensor (a slice of a wider projection output), a copy where TMA cannot address it (heads not
    packed, a token stride that is not a multiple of 16 bytes)."""
    from moela.ops.attention import gluon_fwd

    g = torch.Generator().manual_seed(3)
    wide = torch.randn(37, 5 * 96 + 32, generator=g).to(torch.bfloat16)  # token stride 512 elements = 1024 bytes
    for x, copied in ((wide[:, :480].view(37, 5, 96), False),  # a slice: token-strided, heads packed
                      (torch.randn(37, 5, 96, generator=g).to(torch.bfloat16), False),
                      (torch.randn(37, 96, 5, generator=g).to(torch.bfloat16).transpose(1, 2), True),
                      (torch.randn(37, 5 * 96 + 3, generator=g).to(torch.bfloat16)[:, :480].view(37, 5, 96), True)):
        rows = gluon_fwd._rows(x)
        assert rows.shape == (37, 480)
        torch.testing.assert_close(rows, x.reshape(37, 480), rtol=0, atol=0)
        assert (rows.data_ptr() != x.data_ptr()) == copied
        assert rows.stride(1) == 1 and (rows.stride(0) * 2) % 16 == 0


def test_gluon_descriptors_split_dqk_into_its_boxes():
    """The Gluon kernels' TMA descriptors of a [T, H * D] view: Dqk as a power-of-two box and the rest (192 = 128 +
    64, 96 = 64 + 32; 128 has no second part, the first descriptor stands in for it), rows boxes of the asked size,
    the tensor's own shape and strides."""
    from moela.ops.attention import gluon_fwd

    if gluon_fwd.gluon is None:
        pytest.skip("this Triton has no Gluon")
    g = torch.Generator().manual_seed(4)
    for d, boxes in ((192, (128, 64)), (96, (64, 32)), (128, (128, 128))):
        x2 = gluon_fwd._rows(torch.randn(45, 3, d, generator=g).to(torch.bfloat16))
        first, second = gluon_fwd._descs(x2, 64, d)
        assert [first.block_shape, second.block_shape] == [[64, boxes[0]], [64, boxes[1]]]
        assert (second is first) == (d == 128)
        assert list(first.shape) == [45, 3 * d] and list(first.strides) == [3 * d, 1]
    single = gluon_fwd._descs(gluon_fwd._rows(torch.zeros(9, 2, 64, dtype=torch.bfloat16)), 128, 64, split=False)
    assert single.block_shape == [128, 64]


GLUON_DKDV_CONFIGS = list(gluon_bwd_module.CONFIGS)


def gluon_backward_or_skip(monkeypatch, module, kernel: str, config: str) -> list:
    """Routes the Triton backend's backward kernel `kernel` ("dkdv": gluon_bwd, "dq": gluon_dq) to `config` and
    records the config of every launch of the Gluon kernel; skips where it cannot run (no Gluon, not sm_90)."""
    why = module.supports(*(torch.empty(1, 1, d, device="cuda", dtype=torch.bfloat16) for d in (192, 192, 128)), None)
    if why is not None:
        pytest.skip(f"the Gluon {kernel} kernel cannot run here: {why}")
    monkeypatch.setitem(triton_mod.SCHEDULE, kernel, config)
    calls = []
    launch = getattr(module, kernel)
    monkeypatch.setattr(module, kernel, lambda *a, **kw: calls.append(kw["config"]) or launch(*a, **kw))
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("config", GLUON_DKDV_CONFIGS + ["auto"])
@pytest.mark.parametrize("d_qk,d_v,lens_q,lens_k,causal", GLUON_CASES)
def test_gluon_dkdv_gpu(poisoned_empty, monkeypatch, config, d_qk, d_v, lens_q, lens_k, causal):
    """The Gluon dK/dV kernel (gluon_bwd.py) in the Triton backend's backward, each config, against float64 with a
    gradient on the lse too (the z-loss path): odd lengths, single-token and empty documents, longer k than q, full
    attention, 96/64 and 128/128."""
    from moela.ops.attention import gluon_bwd

    calls = gluon_backward_or_skip(monkeypatch, gluon_bwd, "dkdv", config)
    check_against_float64(lens_q, lens_k, 16, d_qk, d_v, torch.bfloat16, "cuda", causal, False, seed=sum(lens_k),
                          backend="triton")
    if config == "auto":  # the Gluon kernel at the head dims where it measured faster, Triton's elsewhere
        assert calls == ([gluon_bwd.AUTO] if d_qk + d_v <= gluon_bwd.AUTO_MAX_HEAD_DIMS else []), calls
    else:
        assert calls == [config], "the Gluon dK/dV kernel did not run"


GLUON_DQ_CONFIGS = list(gluon_dq_module.CONFIGS)


@pytest.mark.gpu
@pytest.mark.parametrize("config", GLUON_DQ_CONFIGS + ["auto"])
@pytest.mark.parametrize("d_qk,d_v,lens_q,lens_k,causal", GLUON_CASES)
def test_gluon_dq_gpu(poisoned_empty, monkeypatch, config, d_qk, d_v, lens_q, lens_k, causal):
    """The Gluon dQ kernel (gluon_dq.py) in the Triton backend's backward, each config where its shared memory fits,
    against float64 with a gradient on the lse too: odd lengths, single-token and empty documents, longer k than q,
    full attention, 96/64 and 128/128."""
    from moela.ops.attention import gluon_dq

    runs = gluon_dq.AUTO if config == "auto" else config
    if gluon_dq.fits(d_qk, d_v, runs) is not None:
        pytest.skip(gluon_dq.fits(d_qk, d_v, runs))
    calls = gluon_backward_or_skip(monkeypatch, gluon_dq, "dq", config)
    check_against_float64(lens_q, lens_k, 16, d_qk, d_v, torch.bfloat16, "cuda", causal, False, seed=sum(lens_q),
                          backend="triton")
    assert calls == [runs], "the Gluon dQ kernel did not run"


@pytest.mark.gpu
def test_gluon_dq_gpu_queries_that_see_no_key(poisoned_empty, monkeypatch):
    """Shorter k than q, causal: the first Lq - Lk queries of a document see no key (lse -inf), their dq is 0; the
    Gluon dQ kernel's dq equals the Triton kernel's on the same inputs (within bf16 rounding)."""
    from moela.ops.attention import gluon_dq

    if gluon_dq.supports(*(torch.empty(1, 1, d, device="cuda", dtype=torch.bfloat16) for d in (96, 96, 64)),
                         None) is not None:
        pytest.skip("needs Gluon on a Hopper GPU")
    q, k, v, cu_q, cu_k, _, dout, _ = make_case([300, 70], [100, 70], 16, 96, 64, torch.bfloat16, "cuda", False,
                                                seed=11)
    grads = {}
    for config in ("triton", GLUON_DQ_CONFIGS[0]):
        monkeypatch.setitem(triton_mod.SCHEDULE, "dq", config)
        grads[config] = run_with_grads(lambda a, b, c: (mla_attention(
            a, b, c, cu_q, 300, cu_seqlens_k=cu_k, max_seqlen_k=100, backend="triton"),), q, k, v, dout, None)[1]
    got, want = grads[GLUON_DQ_CONFIGS[0]], grads["triton"]
    assert got[:200].abs().max().item() == 0.0  # rows 0..199 of the first document see no key
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@needs_interpreter
def test_backward_says_once_why_the_gluon_kernels_do_not_run(monkeypatch, caplog):
    """With Gluon dK/dV and dQ configs asked for, a call they cannot take (here: the CPU) runs the Triton kernels, with
    the same gradients, and the log says so and why, once each."""
    import logging

    from moela.ops.attention import gluon_bwd, triton_common

    monkeypatch.setitem(triton_mod.SCHEDULE, "dkdv", GLUON_DKDV_CONFIGS[0])
    monkeypatch.setitem(triton_mod.SCHEDULE, "dq", GLUON_DQ_CONFIGS[0])
    monkeypatch.setattr(triton_common, "_SAID", set())
    q, k, v, cu_q, cu_k, _, dout, _ = make_case([70, 9], [70, 9], 2, 96, 64, torch.float32, "cpu", False, seed=6)
    with caplog.at_level(logging.INFO, logger="moela.ops"):
        for _ in range(2):
            got = run_with_grads(lambda a, b, c: (mla_attention(a, b, c, cu_q, 70, backend="triton"),), q, k, v, dout,
                                 None)
    want = run_with_grads(lambda a, b, c: naive_attention(a, b, c, cu_q, cu_k, True, 96 ** -0.5, None)[:1],
                          q.double(), k.double(), v.double(), dout.double(), None)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)
    said = [r.getMessage() for r in caplog.records if "backward" in r.getMessage()]
    why = gluon_bwd.supports(q, k, v, None)
    assert why is not None and said == [f"mla_attention backward: the Triton dK/dV kernel, not the Gluon one ({why})",
                                        f"mla_attention backward: the Triton dQ kernel, not the Gluon one ({why})"]


def test_gluon_backward_auto_choice_and_shared_memory():
    """`auto` runs the Gluon dK/dV kernel only at head dims where it measured faster (96/64), never at 192/128, and the
    Gluon dQ kernel's AUTO config, which fits MLA's heads; every dK/dV config's shared memory fits an H200 at the
    head dims it is tested on, and gluon_dq.fits says which dQ configs do not."""
    from moela.ops.attention import gluon_bwd, gluon_dq

    assert gluon_bwd.choose(96, 64) == (gluon_bwd.AUTO, None)
    config, why = gluon_bwd.choose(192, 128)
    assert config == "" and "192/128" in why
    for bm, _ in gluon_bwd.CONFIGS.values():
        for d_qk, d_v in ((192, 128), (96, 64), (128, 128)):
            assert gluon_bwd.shared_bytes(d_qk, d_v, bm) <= gluon_bwd.HOPPER_SHARED_BYTES
    assert gluon_dq.fits(96, 64, "gluon_dq_bn128") is None and gluon_dq.fits(192, 128, "gluon_dq_bn64") is None
    assert gluon_dq.AUTO in gluon_dq.CONFIGS and gluon_dq.fits(192, 128, gluon_dq.AUTO) is None
    assert "shared memory" in gluon_dq.fits(192, 128, "gluon_dq_bn128")
    with pytest.raises(ValueError, match="unknown Gluon dQ config 'bn64'; choose one of gluon_dq_bn64"):
        gluon_dq.fits(192, 128, "bn64")
