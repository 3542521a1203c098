"""mla_attention's `triton` backend on the GPU (`-m gpu`): every phase on the Triton kernel and on the Gluon kernel
(Hopper), named and under `auto`, against an independent float64 computation (tests/attention_checks.py), with the
outputs poisoned with NaN before each call; and the sdpa backend.

A Gluon kernel named for a phase runs every call it supports or raises (`moela.ops.attention.phases`), so a test
that names it and passes has run it; the `auto` tests check which kernel the phase's dispatch takes.
"""

from __future__ import annotations

import pytest
import torch

from attention_checks import GLUON_CASES, check_against_float64, make_case, naive_attention, run_with_grads
from moela.ops.attention import mla_attention

pytestmark = pytest.mark.gpu
phases = pytest.importorskip("moela.ops.attention.phases")


def gluon_or_skip(d_qk: int = 192, d_v: int = 128) -> None:
    """Skips where the Gluon kernels cannot run (no Gluon in this Triton, not a Hopper GPU)."""
    from moela.ops.attention.kernels.gluon_common import supports

    probe = [torch.empty(1, 1, d, device="cuda", dtype=torch.bfloat16) for d in (d_qk, d_qk, d_v)]
    why = supports(*probe, None)
    if why is not None:
        pytest.skip(f"the Gluon kernels cannot run here: {why}")


def test_triton_gpu_many_documents():
    """16 heads x 4500 documents: a work list of ~5000 entries, programs over heads and documents alike."""
    lens = [1, 2, 3, 17, 9] * 900
    check_against_float64(lens, lens, 16, 64, 64, torch.bfloat16, "cuda", True, False, seed=3, backend="triton")


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
    """The backend's defaults (`auto` in every phase: the Gluon kernels where they run, the Triton ones elsewhere)."""
    check_against_float64(lens_q, lens_k, 16, d_qk, d_v, dtype, "cuda", causal, alibi, seed=sum(lens_q),
                          backend="triton")


@pytest.mark.parametrize("d_qk,d_v,lens_q,lens_k,causal", GLUON_CASES[:4])
def test_triton_kernels_in_every_phase_gpu(poisoned_empty, d_qk, d_v, lens_q, lens_k, causal):
    """Every phase on the Triton kernel, where `auto` would take Gluon ones on a Hopper GPU."""
    check_against_float64(lens_q, lens_k, 16, d_qk, d_v, torch.bfloat16, "cuda", causal, False, seed=sum(lens_q),
                          backend="triton", forward_kernel="triton", dq_kernel="triton", dkdv_kernel="triton")


@pytest.mark.parametrize("phase", ["forward_kernel", "dq_kernel", "dkdv_kernel"])
@pytest.mark.parametrize("d_qk,d_v,lens_q,lens_k,causal", GLUON_CASES)
def test_gluon_kernel_of_each_phase_gpu(poisoned_empty, phase, d_qk, d_v, lens_q, lens_k, causal):
    """One phase on its Gluon kernel, the others on the Triton kernels, against float64 with a gradient on the lse
    too (the z-loss path): odd lengths, single-token and empty documents, longer k than q, full attention, 96/64 and
    128/128."""
    gluon_or_skip(d_qk, d_v)
    kernels = {name: "triton" for name in ("forward_kernel", "dq_kernel", "dkdv_kernel")} | {phase: "gluon"}
    check_against_float64(lens_q, lens_k, 16, d_qk, d_v, torch.bfloat16, "cuda", causal, False, seed=sum(lens_k),
                          backend="triton", **kernels)


@pytest.mark.parametrize("d_qk,d_v", [(192, 128), (96, 64), (128, 128)])
def test_auto_takes_the_gluon_kernels_where_they_measured_faster_gpu(d_qk, d_v):
    """`auto`: the Gluon forward and dQ wherever they run; the Gluon dK/dV only where Dqk + Dv <= 160 (96/64)."""
    gluon_or_skip(d_qk, d_v)
    q, k, v, *_ = make_case([70], [70], 2, d_qk, d_v, torch.bfloat16, "cuda", False, seed=1)
    assert phases.FORWARD.choose("auto", q, k, v, None) == "gluon"
    assert phases.DQ.choose("auto", q, k, v, None) == "gluon"
    assert phases.DKDV.choose("auto", q, k, v, None) == ("gluon" if d_qk + d_v <= 160 else "triton")
    slopes = torch.ones(2, device="cuda")
    assert phases.FORWARD.choose("auto", q, k, v, slopes) == "triton"  # ALiBi: the Triton kernels
    with pytest.raises(ValueError, match="ALiBi"):
        phases.DQ.choose("gluon", q, k, v, slopes)


def test_gluon_forward_queries_that_see_no_key_gpu(poisoned_empty):
    """Shorter k than q, causal: the first Lq - Lk queries of a document see no key (out 0, lse -inf), the others
    match the float64 reference."""
    gluon_or_skip()
    q, k, v, cu_q, cu_k, _, _, _ = make_case([300, 200], [100, 200], 16, 192, 128, torch.bfloat16, "cuda", False,
                                             seed=11)
    out, lse = mla_attention(q, k, v, cu_q, 300, cu_seqlens_k=cu_k, max_seqlen_k=200, return_lse=True,
                             backend="triton", forward_kernel="gluon")
    want_out, want_lse = naive_attention(q.double(), k.double(), v.double(), cu_q, cu_k, True, 192 ** -0.5, None)
    assert (out[:200] == 0).all() and torch.isneginf(lse[:, :200]).all()
    torch.testing.assert_close(out[200:].double(), want_out[200:], rtol=0, atol=2e-2)
    torch.testing.assert_close(lse[:, 200:].double(), want_lse[:, 200:], rtol=0, atol=1e-2)


def test_gluon_dq_queries_that_see_no_key_gpu(poisoned_empty):
    """Shorter k than q, causal: the first Lq - Lk queries of a document see no key (lse -inf), their dq is 0; the
    Gluon dQ kernel's dq equals the Triton kernel's on the same inputs (within bf16 rounding)."""
    gluon_or_skip(96, 64)
    q, k, v, cu_q, cu_k, _, dout, _ = make_case([300, 70], [100, 70], 16, 96, 64, torch.bfloat16, "cuda", False,
                                                seed=11)
    grads = {kernel: run_with_grads(lambda a, b, c, kernel=kernel: (mla_attention(
        a, b, c, cu_q, 300, cu_seqlens_k=cu_k, max_seqlen_k=100, backend="triton", dq_kernel=kernel),), q, k, v,
        dout, None)[1] for kernel in ("triton", "gluon")}
    got, want = grads["gluon"], grads["triton"]
    assert got[:200].abs().max().item() == 0.0  # rows 0..199 of the first document see no key
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("lens_q,lens_k", [([777, 1, 0, 1300], [777, 1, 0, 1300]), ([5, 400], [9, 1031])])
def test_triton_gpu_without_lse(poisoned_empty, lens_q, lens_k):
    """Out alone (no lse returned, so no lse gradient): the backward without a dlse."""
    check_against_float64(lens_q, lens_k, 16, 192, 128, torch.bfloat16, "cuda", True, False, seed=sum(lens_k),
                          backend="triton", with_lse=False)


def test_sdpa_backend_gpu():
    q, k, v, cu, _, _, _, _ = make_case([1024] * 3, [1024] * 3, 8, 192, 128, torch.bfloat16, "cuda", False, 1)
    out = mla_attention(q, k, v, cu, 1024, backend="sdpa")
    exact, _ = naive_attention(q.double(), k.double(), v.double(), cu, cu, True, 192 ** -0.5, None)
    lowp, _ = naive_attention(q, k, v, cu, cu, True, 192 ** -0.5, None)
    err = (out.double() - exact).abs().max().item()
    assert err <= 2 * (lowp.double() - exact).abs().max().item() + 1e-5
