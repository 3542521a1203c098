"""FP8 (e4m3) blockwise quantization, DeepSeek-V3 recipe: reference math shared by every backend.

Activations: one fp32 scale per 1x128 group (per row, per 128 consecutive channels). Weights: one fp32 scale per
128x128 block. scale = amax / 448 (e4m3's largest finite value), with amax clamped below at AMAX_EPS = 1e-4
so all-zero groups quantize to zero with a finite scale; codes = e4m3(x * inv) with inv = (1 / amax) * 448 in
fp32 (one division per group, a multiply per element): DeepGEMM's `per_token_cast_to_fp8` / `per_block_cast_to_fp8`
formulas `x * (448.0 / amax)` as torch evaluates them (a scalar divided by a tensor is the tensor's reciprocal times
the scalar), which the kernels reproduce bit for bit. Dequantize = fp8 value * scale.
A trailing partial group (channels not a multiple of 128) is its own, shorter group.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
AMAX_EPS = 1e-4


def inv_scale(amax: torch.Tensor) -> torch.Tensor:
    """The factor that maps a group onto e4m3's range: (1 / amax) * 448, each step rounded to fp32."""
    return amax.reciprocal() * FP8_MAX


def _pad_to(x: torch.Tensor, dim: int, mult: int) -> torch.Tensor:
    pad = (-x.shape[dim]) % mult
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim)


def quant_1x128(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, ceil(K/128)] fp32), q * scale ~= x."""
    m, k = x.shape
    xp = _pad_to(x.float(), 1, group).view(m, -1, group)  # [M, G, 128]
    amax = xp.abs().amax(-1).clamp_min(AMAX_EPS)  # [M, G]
    q = (xp * inv_scale(amax)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, -1)[:, :k], amax / FP8_MAX


def dequant_1x128(q: torch.Tensor, scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    m, k = q.shape
    return (_pad_to(q.float(), 1, group).view(m, -1, group) * scale[..., None]).view(m, -1)[:, :k]


def quant_128x128(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] float8_e4m3fn, scale [ceil(N/128), ceil(K/128)] fp32)."""
    n, k = w.shape
    wp = _pad_to(_pad_to(w.float(), 0, block), 1, block)
    gn, gk = wp.shape[0] // block, wp.shape[1] // block
    blocks = wp.view(gn, block, gk, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(AMAX_EPS)  # [Gn, Gk]
    q = (blocks * inv_scale(amax)[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(gn * block, gk * block)[:n, :k], amax / FP8_MAX


def dequant_128x128(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    n, k = q.shape
    qp = _pad_to(_pad_to(q.float(), 0, block), 1, block)
    gn, gk = scale.shape
    return (qp.view(gn, block, gk, block) * scale[:, None, :, None]).view(gn * block, gk * block)[:n, :k]


class _FakeQuant(torch.autograd.Function):
    """Quantize -> dequantize in the forward; straight-through gradient (identity) in the backward."""

    @staticmethod
    def forward(ctx, x, blockwise):
        if blockwise:
            return dequant_128x128(*quant_128x128(x)).to(x.dtype)
        return dequant_1x128(*quant_1x128(x)).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None


def fake_quant_1x128(x: torch.Tensor) -> torch.Tensor:
    return _FakeQuant.apply(x, False)


def fake_quant_128x128(w: torch.Tensor) -> torch.Tensor:
    return _FakeQuant.apply(w, True)
