"""mla_attention's `flash` backend (flash-attn-4) and how `auto` picks among the backends.

CPU: the ranking from the measured table (moela.ops.attention.auto), its fallbacks and log reasons, the dispatch's
rank hook, and the flash backend's errors where it cannot run. `-m gpu`: the flash backend against float64
(odd lengths, empty and single-token documents, a longer k side, queries that see no key, with and without the
lse gradient, ALiBi through its score hooks), and auto's choice on a real call; skipped where flash-attn-4 does not
import or the GPU is not Hopper / Blackwell.
"""

from __future__ import annotations

import logging

import pytest
import torch

from attention_checks import check_against_float64, make_case, run_with_grads
from moela.ops.attention import api as attn_api
from moela.ops.attention import attention_reference, auto, mla_attention
from moela.ops.attention.flash import _HOST_SLOPES, flash_problem, host_slopes
from moela.ops.backends import ATTENTION_BACKENDS
from moela.ops.dispatch import Dispatch


def call(head_dims=(192, 128), layout="packed", tokens_per_doc=1500.0, feature="plain") -> auto.CallClass:
    return auto.CallClass(head_dims, layout, tokens_per_doc, feature)


def runs(*names):
    """problems mapping: the named backends can run the call, the others cannot."""
    return {name: (lambda ok=name in names: None if ok else "not here") for name in ("flash", "sdpa", "triton")}


TABLE = (
    auto.Measured("eq 8k", (192, 128), "equal", 8192, "plain", {"flash": 500, "sdpa": 450, "triton": 350}),
    auto.Measured("eq 2k", (192, 128), "equal", 2048, "plain", {"flash": 360, "sdpa": 380, "triton": 270}),
    auto.Measured("short docs", (192, 128), "packed", 300, "plain", {"flash": 340, "triton": 240}),
    auto.Measured("long docs", (192, 128), "packed", 1600, "plain", {"flash": 420, "triton": 310}),
    auto.Measured("alibi", (192, 128), "equal", 8192, "alibi", {"flash": 380, "triton": 350}),
)


def test_rank_takes_the_nearest_row_of_the_calls_layout():
    order, why = auto.rank(call(layout="equal", tokens_per_doc=2500), runs("flash", "sdpa", "triton"), TABLE)
    assert order == ["sdpa", "flash", "triton"] and "'eq 2k'" in why
    order, why = auto.rank(call(layout="equal", tokens_per_doc=7000), runs("flash", "sdpa", "triton"), TABLE)
    assert order == ["flash", "sdpa", "triton"] and "'eq 8k'" in why
    order, why = auto.rank(call(tokens_per_doc=250), runs("flash", "sdpa", "triton"), TABLE)
    assert order == ["flash", "triton"] and "'short docs'" in why and "flash 340 > triton 240" in why


def test_rank_names_a_faster_backend_it_must_skip():
    order, why = auto.rank(call(), {**runs("triton"), "flash": lambda: "flash-attn-4 is not importable"}, TABLE)
    assert order == ["triton"]
    assert "flash (420) cannot run it: flash-attn-4 is not importable" in why


def test_rank_fallbacks_are_explicit():
    order, why = auto.rank(call(feature="zloss"), runs("flash", "triton"), TABLE)
    assert order == ["flash", "triton"] and "z-loss not measured, plain rows" in why
    order, why = auto.rank(call(head_dims=(128, 128)), runs("flash", "triton"), TABLE)
    assert order == ["flash", "triton"] and "128/128 not measured" in why
    order, why = auto.rank(call(feature="alibi", layout="packed"), runs("flash", "triton"), TABLE)
    assert order == ["flash", "triton"] and "no packed row" in why
    order, why = auto.rank(call(feature="alibi", layout="equal", tokens_per_doc=8192), runs("flash", "triton"), TABLE)
    assert "alibi over plain on 'eq 8k': flash +32%, triton +0%" in why  # 500 / 380, 350 / 350
    no_alibi = tuple(r for r in TABLE if r.feature != "alibi")
    order, why = auto.rank(call(feature="alibi"), runs("flash", "triton"), no_alibi)
    assert order == ["triton"] and "no measurement of alibi" in why
    order, why = auto.rank(call(feature="alibi"), runs("flash"), no_alibi)
    assert order == [] and "Triton kernels cannot run it" in why  # the dispatch falls back to the reference


def test_measured_table_is_well_formed():
    for row in auto.MEASURED:
        assert set(row.tflops) <= set(ATTENTION_BACKENDS) - {"auto", "reference"}, row.case
        assert row.layout in ("equal", "packed") and row.feature in ("plain", "zloss", "alibi"), row.case
        assert row.tokens_per_doc > 0 and all(v > 0 for v in row.tflops.values()), row.case


def test_classify_needs_no_device_values():
    q, v = torch.zeros(12, 2, 24), torch.zeros(12, 2, 8)
    cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    got = auto.classify(q, q, v, cu, max_seqlen_q=4, max_seqlen_k=4, return_lse=True, alibi_slopes=None)
    assert got == auto.CallClass((24, 8), "equal", 4.0, "zloss")
    got = auto.classify(q, q, v, cu, max_seqlen_q=5, max_seqlen_k=5, return_lse=False,
                        alibi_slopes=torch.ones(2))
    assert got == auto.CallClass((24, 8), "packed", 4.0, "alibi")


def test_dispatch_rank_orders_auto_and_logs_why(caplog):
    d = Dispatch("op", ("auto", "reference", "a", "b"), rank=lambda x: (["b", "a"], f"ranked for {x}"))
    d.register("a", lambda x: "a", auto=lambda x: True)
    d.register("b", lambda x: "b", auto=lambda x: x > 0)
    with caplog.at_level(logging.INFO, logger="moela.ops"):
        assert d.choose("auto", 1) == "b"
        assert d.choose("auto", 0) == "a"  # b's predicate fails: the next in rank's order
    assert "op: using backend 'b' (auto, ranked for 1)" in caplog.text
    assert "op: using backend 'a' (auto, ranked for 0)" in caplog.text


def test_flash_backend_names_the_problem_off_gpu():
    q = torch.zeros(8, 2, 16, dtype=torch.bfloat16)
    assert "CUDA" in flash_problem(q, q, q)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="backend 'flash'.*CUDA tensors"):
        mla_attention(q, q, q, cu, 8, backend="flash")


def _flash_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    probe = torch.zeros(1, 1, 64, dtype=torch.bfloat16, device="cuda")
    problem = flash_problem(probe, probe, probe)
    if problem is not None:
        pytest.skip(problem)


def test_host_slopes_reads_a_tensor_once_per_version_and_forgets_it_when_it_dies():
    """ALiBi on flash-attn-4 compiles the slopes in as constants (moela.ops.attention.flash_alibi), read from the
    device at most once per tensor and in-place version."""
    import gc

    torch.manual_seed(0)
    slopes = torch.rand(5) * 0.3
    first = host_slopes(slopes)
    assert first == tuple(slopes.tolist()) and all(isinstance(x, float) for x in first)
    assert host_slopes(slopes) is first  # cached: no second read
    slopes.mul_(2)
    assert host_slopes(slopes) == tuple(slopes.tolist()) != first
    other = slopes.clone()
    assert host_slopes(other) == host_slopes(slopes)
    key = id(slopes)
    del slopes
    gc.collect()
    assert key not in _HOST_SLOPES and id(other) in _HOST_SLOPES


# bf16 and four kernel sets (192/128 causal, causal ALiBi, full ALiBi; 128/128 causal): flash-attn-4 compiles one
# set per head dims, dtype and mask, a few seconds each
@pytest.mark.gpu
@pytest.mark.parametrize("d_qk,d_v,lens_q,lens_k,causal,alibi", [
    (192, 128, [2048, 2048], [2048, 2048], True, False),  # equal lengths
    (192, 128, [1, 300, 1500, 4000, 77], [1, 300, 1500, 4000, 77], True, False),
    (192, 128, [1, 300, 1500, 4000, 77], [1, 300, 1500, 4000, 77], True, True),
    (192, 128, [5, 333, 1025], [5, 333, 1025], False, True),
    (192, 128, [1000, 3000], [3000, 4096], True, False),  # a longer k side: bottom-right
    (192, 128, [1, 0, 33, 1, 700], [1, 0, 97, 1, 900], True, True),  # empty and single-token documents
    (192, 128, [700, 33] + [0] * 62, [700, 33] + [0] * 62, True, False),  # a graphed batch's trailing padding
    (128, 128, [1024, 513, 7], [1024, 513, 7], True, False),
])
def test_flash_gpu(poisoned_empty, d_qk, d_v, lens_q, lens_k, causal, alibi):
    _flash_or_skip()
    check_against_float64(lens_q, lens_k, 16, d_qk, d_v, torch.bfloat16, "cuda", causal, alibi,
                          seed=sum(lens_q) + d_qk, backend="flash")


@pytest.mark.gpu
@pytest.mark.parametrize("lens_q,lens_k,alibi", [([777, 1, 0, 1300], [777, 1, 0, 1300], False),
                                                 ([5, 400], [9, 1031], True)])
def test_flash_gpu_without_lse(poisoned_empty, lens_q, lens_k, alibi):
    _flash_or_skip()
    check_against_float64(lens_q, lens_k, 16, 192, 128, torch.bfloat16, "cuda", True, alibi, seed=sum(lens_k),
                          backend="flash", with_lse=False)


@pytest.mark.gpu
@pytest.mark.parametrize("alibi", [False, True])
def test_flash_gpu_queries_that_see_no_key(alibi):
    """q side longer than k side, causal: the first Lq - Lk queries of a document see nothing -> out 0, lse -inf,
    no NaN in any gradient."""
    _flash_or_skip()
    q, k, v, cu_q, cu_k, slopes, dout, _ = make_case([100, 400], [40, 400], 4, 192, 128, torch.bfloat16, "cuda",
                                                     alibi, seed=9)
    kw = dict(alibi_slopes=slopes)
    got = run_with_grads(lambda a, b, c: (mla_attention(a, b, c, cu_q, 400, cu_seqlens_k=cu_k, max_seqlen_k=400,
                                                        backend="flash", **kw),), q, k, v, dout, None)
    want = run_with_grads(lambda a, b, c: (attention_reference(a, b, c, cu_q, cu_k, **kw)[0],), q, k, v, dout, None)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
    assert (got[0][:60] == 0).all() and (got[1][:60] == 0).all()  # out and dq of the blind queries
    _, lse = mla_attention(q, k, v, cu_q, 400, cu_seqlens_k=cu_k, max_seqlen_k=400, return_lse=True,
                           backend="flash", **kw)
    assert torch.isneginf(lse[:, :60]).all() and torch.isfinite(lse[:, 60:]).all()


@pytest.mark.gpu
def test_auto_gpu_picks_by_the_table_and_says_why(monkeypatch, caplog):
    """Packed documents with a z-loss: auto runs flash where flash-attn-4 imports (its measured speed is the
    highest), else triton, and the log line names the measurements; ALiBi goes where the table has a measurement."""
    monkeypatch.setattr(attn_api.DISPATCH, "logged", set())
    q, k, v, cu, _, slopes, _, _ = make_case([300, 1700], [300, 1700], 4, 192, 128, torch.bfloat16, "cuda", True,
                                             seed=2)
    probe_problem = flash_problem(q, k, v)
    with caplog.at_level(logging.INFO, logger="moela.ops"):
        mla_attention(q, k, v, cu, 1700, return_lse=True)
    expected = "flash" if probe_problem is None else "triton"
    assert f"using backend '{expected}' (auto, 192/128 packed zloss: measured fwd+bwd TFLOP/s" in caplog.text
    if probe_problem is not None:
        assert "flash (" in caplog.text and "cannot run it" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="moela.ops"):
        mla_attention(q, k, v, cu, 1700, alibi_slopes=slopes)
    assert "192/128 packed alibi" in caplog.text
