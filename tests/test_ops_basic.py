"""Reference ops the model uses (rms_norm, rope + YaRN, swiglu, cross_entropy) against independent float64 math, and
the backend dispatch every op shares."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moela.ops.loss import IGNORE_INDEX, cross_entropy
from moela.ops.norm import rms_norm
from moela.ops.rope import rope, yarn_inv_freq, yarn_mscale
from moela.ops.swiglu import swiglu


def test_rms_norm_matches_float64():
    x, w = torch.randn(13, 37), torch.randn(37)
    x64 = x.double()
    ref = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w.double()
    assert torch.allclose(rms_norm(x, w, 1e-5).double(), ref, atol=1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(36))


def test_rope_is_complex_rotation_of_pairs():
    t, h, r = 11, 3, 10
    x, pos = torch.randn(t, h, r), torch.randint(0, 50, (t,)).int()
    inv_freq = yarn_inv_freq(r, 500.0)
    out = rope(x, pos, inv_freq, attention_factor=0.9)
    z = torch.view_as_complex(x.double().reshape(t, h, r // 2, 2).contiguous())
    ang = pos.double()[:, None] * (1.0 / 500.0 ** (torch.arange(0, r, 2).double() / r))[None]
    ref = torch.view_as_real(z * torch.polar(torch.full_like(ang, 0.9), ang)[:, None]).reshape(t, h, r)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    # rotation preserves relative-position dot products: <R(p)q, R(p')k> depends only on p - p'
    q, k = torch.randn(1, 1, r), torch.randn(1, 1, r)
    one = lambda v, p: rope(v, torch.tensor([p]), inv_freq)  # noqa: E731
    assert torch.allclose((one(q, 7) * one(k, 3)).sum(), (one(q, 14) * one(k, 10)).sum(), atol=1e-5)


def test_yarn_frequencies_blend():
    dim, theta, factor, orig = 64, 10000.0, 40.0, 4096
    got = yarn_inv_freq(dim, theta, factor=factor, original_max_position_embeddings=orig, beta_fast=32,
                        beta_slow=1).double()
    base = 1.0 / theta ** (torch.arange(0, dim, 2).double() / dim)

    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))
    low, high = math.floor(corr(32)), math.ceil(corr(1))
    for i in range(dim // 2):  # high frequencies kept, low ones divided by factor, linear in between
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        assert math.isclose(got[i].item(), base[i].item() * (1 - ramp) + base[i].item() / factor * ramp,
                            rel_tol=1e-5)
    assert yarn_mscale(1.0) == 1.0 and math.isclose(yarn_mscale(40.0, 0.5), 0.05 * math.log(40.0) + 1)


def test_swiglu():
    g, u = torch.randn(5, 17), torch.randn(5, 17)
    ref = g.double() / (1 + torch.exp(-g.double())) * u.double()
    assert torch.allclose(swiglu(g, u).double(), ref, atol=1e-6)


def test_cross_entropy_sum_and_ignore():
    logits, labels = torch.randn(19, 31) * 3, torch.randint(0, 31, (19,))
    labels[[0, 5, 18]] = IGNORE_INDEX
    lp = torch.log_softmax(logits.double(), -1)
    keep = labels != IGNORE_INDEX
    ref = -lp[keep].gather(1, labels[keep][:, None]).squeeze(1)
    per = cross_entropy(logits, labels, reduction="none")
    assert torch.allclose(per[keep].double(), ref, atol=1e-5) and per[~keep].abs().max() == 0
    assert torch.allclose(cross_entropy(logits, labels).double(), ref.sum(), atol=1e-4)
    logits.requires_grad_(True)
    cross_entropy(logits, labels).backward()
    assert logits.grad[~keep].abs().max() == 0


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="backend"):
        swiglu(torch.ones(2), torch.ones(2), backend="cuda-magic")


@pytest.mark.gpu
def test_compiled_backends_match_reference_on_cuda():
    dev = "cuda"
    x = torch.randn(1037, 3, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, device=dev, requires_grad=True)
    pos = torch.randint(0, 4000, (1037,), device=dev)
    inv = yarn_inv_freq(64, 10000.0).to(dev)
    logits = torch.randn(1037, 5003, device=dev, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 5003, (1037,), device=dev)
    labels[::7] = IGNORE_INDEX
    cases = [(rms_norm, lambda b: rms_norm(x, w, 1e-6, backend=b), [x, w]),
             (rope, lambda b: rope(x, pos, inv, attention_factor=1.1, backend=b), [x]),
             (swiglu, lambda b: swiglu(x, x * 0.5 + 1, backend=b), [x]),
             (cross_entropy, lambda b: cross_entropy(logits, labels, reduction="none", backend=b), [logits])]
    for op, call, inputs in cases:
        outs, g = {}, None
        for b in ("reference", "compiled"):
            y = call(b)
            g = torch.randn_like(y) if g is None else g
            grads = torch.autograd.grad(y, inputs, g)
            outs[b] = (y.float(), [t.float() for t in grads])
        (yr, gr), (yc, gc) = outs["reference"], outs["compiled"]
        tol = 2e-2 * (yr.abs().max().item() + 1)
        assert (yr - yc).abs().max().item() <= tol, op.__name__
        for a, c in zip(gr, gc):
            assert (a - c).abs().max().item() <= 2e-2 * (a.abs().max().item() + 1e-3), op.__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_cross_entropy_chunked_matches_float64(dtype, monkeypatch):
    import moela.ops.linear_cross_entropy as lce
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 5 * 53)  # chunks of 5 rows: several chunks and a ragged tail
    monkeypatch.setattr(lce, "MIN_CHUNK_ROWS", 1)
    h = torch.randn(23, 19, dtype=dtype, requires_grad=True)
    w = (torch.randn(53, 19, dtype=dtype) * 0.5).requires_grad_(True)
    labels = torch.randint(0, 53, (23,))
    labels[[2, 11, 22]] = IGNORE_INDEX
    loss = lce.linear_cross_entropy(h, w, labels, backend="chunked")
    (loss * 0.7).backward()
    h64, w64 = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    keep = labels != IGNORE_INDEX
    ref = -torch.log_softmax(h64 @ w64.t(), -1)[keep].gather(1, labels[keep][:, None]).sum()
    (ref * 0.7).backward()
    assert loss.dtype == torch.float32 and math.isclose(loss.item(), ref.item(), rel_tol=1e-5)
    assert torch.allclose(h.grad.double(), h64.grad, atol=1e-5) and torch.allclose(w.grad.double(), w64.grad, atol=1e-5)
    assert torch.allclose(lce.linear_cross_entropy(h, w, labels, backend="reference").double(), ref, rtol=1e-5)


@pytest.mark.parametrize("h_dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_chunked_under_autocast_matches_the_reference(h_dtype, monkeypatch):
    """Under bf16 autocast (fp32 h, as the model's final norm gives it, or bf16 h) the chunked loss and its
    gradients agree with the reference head + cross-entropy run under the same autocast, to bf16 precision, across
    chunks of 16 rows."""
    import moela.ops.linear_cross_entropy as lce
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 16 * 301)
    monkeypatch.setattr(lce, "MIN_CHUNK_ROWS", 1)
    torch.manual_seed(11)
    h = torch.randn(37, 64, dtype=h_dtype, requires_grad=True)
    w = (torch.randn(301, 64) * 0.2).requires_grad_(True)
    labels = torch.randint(0, 301, (37,))
    labels[[0, 20]] = IGNORE_INDEX
    out = {}
    for backend in ("reference", "chunked"):
        h.grad = w.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lce.linear_cross_entropy(h, w, labels, backend=backend)
        loss.backward()
        out[backend] = (loss.item(), h.grad.clone(), w.grad.clone())
    (lr, hr, wr), (lc, hc, wc) = out["reference"], out["chunked"]
    assert math.isclose(lc, lr, rel_tol=1e-2)
    assert h.grad.dtype == h_dtype and w.grad.dtype == torch.float32
    # bf16 autocast: CPUs with native bf16 take other matmul kernels (80% of atol 3e-3 used on AVX-512)
    torch.testing.assert_close(hc, hr, rtol=3e-2, atol=1e-2)
    torch.testing.assert_close(wc, wr, rtol=3e-2, atol=1e-2)


def test_linear_cross_entropy_chunk_rows_and_helpers():
    """Chunks: CHUNK_ELEMENTS logits, never fewer than MIN_CHUNK_ROWS rows (a 102,400-token vocabulary made
    655-row chunks). The matmul dtype follows autocast (not for float64). add_product_ sums a low-precision
    product into a float32 accumulator (on CPU by forming it first)."""
    import moela.ops.linear_cross_entropy as lce
    assert lce.chunk_rows(4096) == lce.CHUNK_ELEMENTS // 4096 and lce.chunk_rows(102400) == lce.MIN_CHUNK_ROWS
    h32, w32 = torch.randn(3, 4), torch.randn(5, 4)
    assert lce.matmul_dtype(h32, w32) == torch.float32
    assert lce.matmul_dtype(h32.double(), w32) == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lce.matmul_dtype(h32, w32) == torch.bfloat16
        assert lce.matmul_dtype(h32.double(), w32.double()) == torch.float64
    torch.manual_seed(3)
    a, b = torch.randn(7, 9).bfloat16(), torch.randn(9, 6).bfloat16()
    acc = torch.randn(7, 6)
    want = acc.double() + a.double() @ b.double()
    lce.add_product_(acc, a, b)
    assert acc.dtype == torch.float32 and (acc.double() - want).abs().max() < 0.1  # one bf16 rounding of a @ b
    a32, b32, acc32 = a.float(), b.float(), torch.zeros(7, 6)
    lce.add_product_(acc32, a32, b32)
    torch.testing.assert_close(acc32.double(), a32.double() @ b32.double(), rtol=1e-6, atol=1e-6)


def test_linear_cross_entropy_chunked_skips_the_gradients_under_no_grad(monkeypatch):
    """Evaluation runs under no_grad with a weight that still requires grad: the chunked loss must not form the
    softmax gradients (two GEMMs and a [V, D] float32 buffer per call) that nobody will read."""
    import moela.ops.linear_cross_entropy as lce
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 5 * 53)
    monkeypatch.setattr(lce, "MIN_CHUNK_ROWS", 1)
    h, w = torch.randn(23, 19), torch.randn(53, 19, requires_grad=True)
    labels = torch.randint(0, 53, (23,))
    expected = lce.linear_cross_entropy(h, w, labels, backend="reference").item()

    def no_softmax(*args, **kwargs):
        raise AssertionError("softmax gradient formed under no_grad")
    monkeypatch.setattr(lce.torch, "exp", no_softmax)  # only the gradient branch calls torch.exp
    with torch.no_grad():
        loss = lce.linear_cross_entropy(h, w, labels, backend="chunked")
    assert math.isclose(loss.item(), expected, rel_tol=1e-5)


def test_compiled_backend_falls_back_to_the_reference_when_compilation_fails(monkeypatch, caplog):
    from moela.ops import compiled as comp

    monkeypatch.setattr(comp, "raise_recompile_limit", lambda: None)  # torch's config stays as the test found it

    def broken(fn, **kw):
        def fail(*a, **k):
            raise RuntimeError("no compiler here")
        return fail
    monkeypatch.setattr(comp.torch, "compile", broken)
    calls = []

    def ref(x):
        calls.append(1)
        return x * 2
    run = comp.compiled(ref)
    with caplog.at_level("WARNING", logger="moela.ops"):
        assert torch.equal(run(torch.ones(3)), torch.full((3,), 2.0))
        assert torch.equal(run(torch.ones(2)), torch.full((2,), 2.0))
    assert len(calls) == 2 and "no compiler here" in caplog.text and caplog.text.count("torch.compile failed") == 1


def test_dispatch_picks_the_first_supporting_backend_and_logs_each_choice_once(caplog):
    from moela.ops.dispatch import Dispatch

    dispatch = Dispatch("toy", ("auto", "reference", "fast", "narrow", "absent"), needs="a GPU",
                        describe=lambda x: f"x={x}")
    dispatch.register("narrow", lambda x: "narrow", auto=lambda x: x < 0, accepts=lambda x: x < 10)
    dispatch.register("fast", lambda x: "fast", auto=lambda x: x > 5)
    with caplog.at_level("INFO", logger="moela.ops"):
        assert [dispatch.choose("auto", x) for x in (-1, 7, 3, 7)] == ["narrow", "fast", "reference", "fast"]
    assert caplog.text.count("toy: using backend 'fast' (auto)") == 1
    assert dispatch.choose("fast", 1) == "fast" and dispatch.impl("fast")(1) == "fast"
    with pytest.raises(ValueError, match=r"'narrow' does not support this call \(x=12\)"):
        dispatch.choose("narrow", 12)
    with pytest.raises(RuntimeError, match=r"'absent' is not available here \(needs a GPU\)"):
        dispatch.choose("absent", 1)
    with pytest.raises(ValueError, match="unknown backend 'other'"):
        dispatch.choose("other", 1)
    with pytest.raises(ValueError, match="cannot register"):
        dispatch.register("reference", lambda x: x, auto=lambda x: True)


def test_backend_names_load_without_importing_a_kernel():
    code = ("import sys; import moela.ops.backends as b; assert b.MOE_RECIPES == ('bf16', 'fp8_blockwise'); "
            "loaded = [m for m in sys.modules if m.startswith(('triton', 'moela.ops.attention', 'moela.ops.moe'))]; "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
