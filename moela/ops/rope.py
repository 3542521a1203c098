"""Rotary position embedding on the flat packed layout: `rope(x, position_ids, inv_freq)`, plus YaRN frequencies.

Decisions:
- Angles come from `position_ids` (restarting at 0 for each document; the original positions under context
  parallelism), never from the token index, so packing never leaks positions between documents.
- Pairs are interleaved, DeepSeek's layout: dims (2i, 2i+1) rotate together by angle pos * inv_freq[i]. Its
  checkpoints are laid out for it; HF's `rope_interleave=True` computes the same scores (it permutes q and k alike).
- cos / sin are computed in float32 and may be multiplied by `attention_factor` (YaRN's cos/sin scale, HF's
  `attention_factor`; 1.0 for DeepSeek's configs where mscale == mscale_all_dim).
- `yarn_inv_freq` follows the YaRN paper as DeepSeek and HF implement it: per-dimension blend between
  interpolated (freq / factor) and original frequencies, with a linear ramp between the correction dims found from
  beta_fast / beta_slow rotations, floored / ceiled unless `truncate` is off.
- Backends: `reference`, `compiled` (the reference through TorchInductor, CUDA, see `moela.ops.compiled`).

Shapes: T tokens, H heads, R rotary dim (even).
"""

from __future__ import annotations

import math

import torch

from moela.ops.backends import ROPE_BACKENDS
from moela.ops.compiled import compiled, on_cuda
from moela.ops.dispatch import Dispatch

DISPATCH = Dispatch("rope", ROPE_BACKENDS)


def yarn_inv_freq(dim: int, theta: float, *, factor: float | None = None, original_max_position_embeddings: int = 0,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True) -> torch.Tensor:
    """Inverse frequencies [dim/2] float32 on the CPU: plain RoPE when `factor` is None, else YaRN-blended."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [R/2]
    if factor is None:
        return inv_freq

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [R/2]
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_reference(x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor,
                   attention_factor: float = 1.0) -> torch.Tensor:
    t, h, r = x.shape
    ang = position_ids.float()[:, None] * inv_freq.float()[None, :]  # [T, R/2]
    cos = (torch.cos(ang) * attention_factor)[:, None, :]  # [T, 1, R/2]
    sin = (torch.sin(ang) * attention_factor)[:, None, :]  # [T, 1, R/2]
    xf = x.float().reshape(t, h, r // 2, 2)  # [T, H, R/2, 2]
    x0, x1 = xf[..., 0], xf[..., 1]  # [T, H, R/2]
    out = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1)  # [T, H, R/2, 2]
    return out.reshape(t, h, r).to(x.dtype)


DISPATCH.register("compiled", compiled(rope_reference), auto=on_cuda, traceable=True)


def rope(x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor, *, attention_factor: float = 1.0,
         backend: str = "auto") -> torch.Tensor:
    """x [T, H, R], position_ids [T], inv_freq [R/2] -> x rotated, [T, H, R] in x's dtype."""
    DISPATCH.check(backend)
    if x.dim() != 3 or x.shape[-1] % 2 or position_ids.shape != x.shape[:1] or inv_freq.shape != (x.shape[-1] // 2,):
        raise ValueError(f"rope wants x [T, H, R] with R even, position_ids [T], inv_freq [R/2]; got "
                         f"{tuple(x.shape)}, {tuple(position_ids.shape)}, {tuple(inv_freq.shape)}")
    chosen = DISPATCH.choose(backend, x, position_ids, inv_freq)
    if chosen == "reference":
        return rope_reference(x, position_ids, inv_freq, attention_factor)
    return DISPATCH.impl(chosen)(x, position_ids, inv_freq, attention_factor)
