"""The fused glue around the big kernels: the output head + cross-entropy's per-chunk loss and logit gradient
(never float32 logits), against its float64 reference; GPU: the Inductor-fused chunk against the plain one, and
the chunked head's peak memory against the unfused head."""

from __future__ import annotations

import pytest
import torch

import moela.ops.linear_cross_entropy as lce
from moela.ops.loss import IGNORE_INDEX


def _chunk_inputs(device, dtype, rows=37, vocab=301, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g, device=device) * 3).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g, device=device)
    labels[::5] = IGNORE_INDEX
    return logits, labels


def _chunk_float64(logits, labels):
    lf = logits.double()
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, 0)
    p = torch.softmax(lf, -1)
    loss = (torch.logsumexp(lf, -1) - lf.gather(1, safe[:, None]).squeeze(1))[valid].sum()
    grad = (p - torch.nn.functional.one_hot(safe, lf.shape[1]).double()) * valid[:, None]
    return loss, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_loss_and_grad_match_float64(dtype):
    logits, labels = _chunk_inputs("cpu", dtype)
    loss, grad = lce.chunk_loss_and_grad(logits, labels)
    ref_loss, ref_grad = _chunk_float64(logits, labels)
    assert grad.dtype == dtype and loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-5)
    # the gradient is rounded once to the logits' dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, **tol)
    torch.testing.assert_close(lce.chunk_loss(logits, labels), loss, rtol=1e-6, atol=1e-5)


@pytest.mark.gpu
def test_fused_chunk_matches_the_plain_one_on_cuda():
    logits, labels = _chunk_inputs("cuda", torch.bfloat16, rows=1031, vocab=4099)
    loss, grad = lce.chunk_loss_and_grad_fused(logits, labels)
    ref_loss, ref_grad = lce.chunk_loss_and_grad(logits, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(lce.chunk_loss_fused(logits, labels), ref_loss, rtol=1e-5, atol=1e-3)


@pytest.mark.gpu
def test_chunked_head_uses_less_memory_than_the_unfused_head_and_agrees():
    """T=16384 tokens, V=32768, bf16 autocast: the unfused head holds bf16 and float32 logits (3 GiB); the chunked
    one at most a chunk of logits and one of their gradient."""
    g = torch.Generator(device="cuda").manual_seed(0)
    t, d, v = 16384, 1024, 32768
    h = torch.randn(t, d, device="cuda", generator=g, requires_grad=True)
    w = (torch.randn(v, d, device="cuda", generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, v, (t,), device="cuda", generator=g)
    out = {}
    for backend in ("reference", "chunked"):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lce.linear_cross_entropy(h, w, labels, backend=backend)
        loss.backward()
        out[backend] = (loss.detach(), h.grad.clone(), w.grad.clone(), torch.cuda.max_memory_allocated() - base)
    (lr, hr, wr, mr), (lc, hc, wc, mc) = out["reference"], out["chunked"]
    print(f"peak extra memory: reference {mr / 2**30:.2f} GiB, chunked {mc / 2**30:.2f} GiB")
    # float64 truth on the bf16-rounded operands (what autocast feeds the GEMMs). Both backends round their logits
    # and gradients to bf16, so single elements near zero differ by large relative amounts; the measure is the
    # norm-wise relative error, and the chunked head must be as close to the truth as the unfused one (2x + 1e-3).
    hb, wb = h.detach().bfloat16().double(), w.detach().bfloat16().double()
    logits = hb @ wb.t()
    lse = torch.logsumexp(logits, dim=-1)
    truth_loss = (lse - logits.gather(1, labels[:, None]).squeeze(1)).sum()
    dlogits = torch.softmax(logits, dim=-1)
    dlogits[torch.arange(t, device="cuda"), labels] -= 1
    truth_h, truth_w = dlogits @ wb, dlogits.t() @ hb
    del logits, dlogits

    def rel(x, ref):
        return ((x.double() - ref).norm() / ref.norm()).item()

    for name, c, r, x in (("loss", lc, lr, truth_loss), ("dh", hc, hr, truth_h), ("dw", wc, wr, truth_w)):
        print(f"{name}: chunked {rel(c, x):.2e}, reference {rel(r, x):.2e} relative to float64")
        assert rel(c, x) <= 2 * rel(r, x) + 1e-3, name
    assert mc < mr / 2
