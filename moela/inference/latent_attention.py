"""Absorbed MLA attention over one layer of the latent cache: `latent_attention(q_latent, q_rope, layer, positions,
softmax_scale=...)` -> the attention-weighted latent [B, S, H, C], before the value up-projection.

  score[b, s, h, t] = (q_latent[b, s, h] . c[b, t] + q_rope[b, s, h] . k_pe[b, t]) * softmax_scale
  p = softmax over the slots t <= positions[b, s] (float32)
  out[b, s, h] = sum_t p[b, s, h, t] c[b, t]

c is the cached latent (the same vectors serve as keys and values: that is the absorbed form, see
`moela.inference.decode`), k_pe the cached rotated RoPE key. `layer` is a `CachedLayer`: the float latent (16-bit
or float32 cache), or int8 / packed int4 codes with their per-group float32 scales (`moela.inference.quant`).

Backends:
- `reference`: dequantizes slots [0, max position] into the compute dtype, then the einsums and a float32 softmax;
  the specification, and what decoding ran before the kernel existed (the CPU path stays token-for-token the same).
- `triton` (`moela.inference.latent_attention_triton`): flash-decoding over the cache's own bytes; the codes and
  scales are dequantized in registers, so a step reads 1 (int8) or 0.5 (int4) byte per latent element once and
  never materializes the layer's latent in the compute dtype. `auto` takes it for CUDA tensors; on CPU it runs
  only by name, under TRITON_INTERPRET=1 (tests).

Shapes: B sequences, S query tokens per sequence, H heads, L slots, C kv_lora_rank, R RoPE dims, G group size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moela.inference.quant import dequantize
from moela.ops.backends import LATENT_ATTENTION_BACKENDS
from moela.ops.dispatch import Dispatch

DISPATCH = Dispatch("latent_attention", LATENT_ATTENTION_BACKENDS, needs="triton")


@dataclass(frozen=True)
class CachedLayer:
    """One layer of the latent cache, all slots: `latent` [B, L, C] in the compute dtype (bits None), int8 codes
    [B, L, C] (bits 8) or uint8 bytes of two int4 codes [B, L, C/2] (bits 4, low nibble = even channel); `scales`
    [B, L, C/G] float32 (quantized only); `rope` [B, L, R] rotated RoPE keys in the compute dtype."""
    latent: torch.Tensor
    rope: torch.Tensor
    bits: int | None = None
    scales: torch.Tensor | None = None
    group_size: int = 0

    @property
    def kv_lora_rank(self) -> int:
        return self.latent.shape[-1] * (2 if self.bits == 4 else 1)

    def values(self, length: int) -> torch.Tensor:
        """Slots [0, length) of the latent in the compute dtype [B, length, C] (dequantized if quantized)."""
        if self.bits is None:
            return self.latent[:, :length]
        return dequantize(self.latent[:, :length], self.scales[:, :length], self.bits, self.group_size,
                          self.rope.dtype)


def latent_attention_reference(q_latent: torch.Tensor, q_rope: torch.Tensor, layer: CachedLayer,
                               positions: torch.Tensor, softmax_scale: float, num_slots: int) -> torch.Tensor:
    keys = layer.values(num_slots)  # [B, L, C]
    keys_pe = layer.rope[:, :num_slots]  # [B, L, R]
    scores = (torch.einsum("bshc,btc->bsht", q_latent, keys)
              + torch.einsum("bshr,btr->bsht", q_rope, keys_pe))  # [B, S, H, L]
    slots = torch.arange(num_slots, device=scores.device)  # [L]
    hidden = slots[None, None, :] > positions[:, :, None]  # [B, S, L]
    scores = scores.float().mul(softmax_scale).masked_fill(hidden[:, :, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(keys.dtype)  # [B, S, H, L]
    return torch.einsum("bsht,btc->bshc", probs, keys)  # [B, S, H, C]


def _check(q_latent: torch.Tensor, q_rope: torch.Tensor, layer: CachedLayer, positions: torch.Tensor) -> None:
    if q_latent.dim() != 4 or q_rope.shape[:3] != q_latent.shape[:3]:
        raise ValueError(f"latent_attention wants q_latent [B, S, H, C] and q_rope [B, S, H, R]; got "
                         f"{tuple(q_latent.shape)} and {tuple(q_rope.shape)}")
    b, s, _, c = q_latent.shape
    if positions.shape != (b, s):
        raise ValueError(f"latent_attention: positions must be [B, S] = {(b, s)}, got {tuple(positions.shape)}")
    lat, rope = layer.latent, layer.rope
    if lat.dim() != 3 or rope.dim() != 3 or lat.shape[0] != b or rope.shape[:2] != lat.shape[:2]:
        raise ValueError(f"latent_attention: the cached layer must hold [B={b}, L, ...] latents and rope keys; got "
                         f"{tuple(lat.shape)} and {tuple(rope.shape)}")
    if layer.kv_lora_rank != c or rope.shape[2] != q_rope.shape[3]:
        raise ValueError(f"latent_attention: the queries' C={c}, R={q_rope.shape[3]} do not match the cache's "
                         f"C={layer.kv_lora_rank}, R={rope.shape[2]}")
    if layer.bits is not None and (layer.scales is None or layer.group_size < 1
                                   or layer.scales.shape != (*lat.shape[:2], c // layer.group_size)):
        raise ValueError(f"latent_attention: a {layer.bits}-bit cache needs scales [B, L, C/G] with G dividing C; "
                         f"got group size {layer.group_size} and scales "
                         f"{None if layer.scales is None else tuple(layer.scales.shape)}")


def latent_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, layer: CachedLayer, positions: torch.Tensor,
                     *, softmax_scale: float, num_slots: int | None = None, backend: str = "auto") -> torch.Tensor:
    """q_latent [B, S, H, C], q_rope [B, S, H, R] (rotated) in the compute dtype, `layer` the cache,
    positions [B, S]: the query at position p attends slots [0, p] -> [B, S, H, C] in the compute dtype.
    `num_slots` (max position + 1) saves the host sync that computes it when the caller knows it."""
    DISPATCH.check(backend)
    _check(q_latent, q_rope, layer, positions)
    if num_slots is None:
        num_slots = int(positions.max()) + 1
    if num_slots > layer.latent.shape[1]:
        raise ValueError(f"latent_attention: {num_slots} slots asked of a cache holding {layer.latent.shape[1]}")
    chosen = DISPATCH.choose(backend, q_latent)
    impl = latent_attention_reference if chosen == "reference" else DISPATCH.impl(chosen)
    return impl(q_latent, q_rope, layer, positions, float(softmax_scale), num_slots)


try:
    from moela.inference.latent_attention_triton import latent_attention_triton, triton_auto
except ImportError:  # no Triton on this platform: the reference remains
    pass
else:
    DISPATCH.register("triton", latent_attention_triton, auto=triton_auto)
