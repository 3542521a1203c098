"""Per-token-group integer quantization of the MLA latent cache: int8 and int4 codes with one scale per group.

Each cached token's latent c_kv [C] is cut into C / G groups of G consecutive channels; a group stores
round(x / s) with s = amax(|x|) / qmax (symmetric, no zero point: the kv_norm'ed latent is centred), and the
attention step reads back codes * s. int8 uses qmax = 127; int4 uses qmax = 7 and packs two codes per byte (low
nibble = even channel). The scale is kept in float32: at 4 bytes per group of 64 it costs 1/16 byte per channel,
and a bf16 scale would add up to 0.4% error to every value of the group.

Shapes: N tokens (any leading dims), C latent channels, G group size.
"""

from __future__ import annotations

import torch

QMAX = {8: 127, 4: 7}
SCALE_EPS = 1e-12  # an all-zero group gets a tiny finite scale and zero codes


def check_group(channels: int, group_size: int) -> None:
    if group_size < 1 or channels % group_size:
        raise ValueError(f"latent cache quantization: group size {group_size} must divide kv_lora_rank={channels}; "
                         f"pick a divisor such as {_divisor_near(channels, group_size)}")


def _divisor_near(n: int, want: int) -> int:
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= max(want, 1))


def quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] -> (codes, scales [..., C/G] float32); codes int8 [..., C] (8 bits) or uint8 [..., C/2] (4 bits,
    two per byte)."""
    check_group(x.shape[-1], group_size)
    qmax = QMAX[bits]
    groups = x.float().unflatten(-1, (-1, group_size))  # [..., C/G, G]
    scales = (groups.abs().amax(-1) / qmax).clamp_min(SCALE_EPS)  # [..., C/G]
    codes = torch.round(groups / scales[..., None]).clamp_(-qmax, qmax).to(torch.int8).flatten(-2)  # [..., C]
    if bits == 4:
        lo, hi = codes[..., 0::2], codes[..., 1::2]  # [..., C/2]
        codes = ((lo & 0xF) | ((hi & 0xF) << 4)).view(torch.uint8)  # [..., C/2]
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize`: -> [..., C] in `dtype`."""
    if bits == 4:
        packed = codes.view(torch.int8)
        lo = (packed << 4) >> 4  # arithmetic shifts sign-extend the low nibble
        hi = packed >> 4
        codes = torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., C]
    groups = codes.float().unflatten(-1, (-1, group_size)) * scales[..., None]  # [..., C/G, G]
    return groups.flatten(-2).to(dtype)
