"""The MLA decoding cache: per layer and token, only the compressed latent (kv_lora_rank values, kv_norm'ed) and
the shared RoPE key (qk_rope_head_dim values), never the per-head keys and values.

That is C + R numbers per token and layer (DeepSeek-V3: 512 + 64 = 576) instead of H * (Dqk + Dv) for an
expanded cache (128 * (192 + 128) = 40960): the absorbed attention of `moela.inference.decode` works on the latent
directly. With `quant="int8"` / `"int4"` the latent is stored as per-token-group integer codes with one float32
scale per `group_size` channels (`moela.inference.quant`); the attention reads the codes as they are stored
(`moela.inference.latent_attention`: on CUDA its kernel dequantizes them in registers, the CPU reference
dequantizes the slots it reads), and the QK-Norm path dequantizes through `read`. The RoPE key stays
in the compute dtype (it is 1/9 of the entry and carries the position signal, the part most sensitive to noise).

Slots are positions: sequence b's token at position p lives in slot p of row b, so batched prompts of different
lengths share one tensor and each sequence appends at its own length.

Shapes: B sequences, S slots (the longest prompt + new tokens), C latent, R RoPE dims, G group size.
"""

from __future__ import annotations

import torch

from moela.inference.latent_attention import CachedLayer
from moela.inference.quant import check_group, dequantize, quantize

QUANT_BITS = {"none": None, "int8": 8, "int4": 4}
SCALE_BYTES = 4


def cache_bytes_per_token(kv_lora_rank: int, rope_dim: int, num_layers: int, *, quant: str = "none",
                          group_size: int = 64, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one token occupies in the cache over all `num_layers` layers."""
    item = torch.empty((), dtype=dtype).element_size()
    bits = QUANT_BITS[quant]
    if bits is None:
        latent = kv_lora_rank * item
    else:
        latent = kv_lora_rank * bits // 8 + kv_lora_rank // group_size * SCALE_BYTES
    return num_layers * (latent + rope_dim * item)


class LatentCache:
    def __init__(self, num_layers: int, batch: int, max_len: int, kv_lora_rank: int, rope_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str, quant: str = "none", group_size: int = 64):
        if quant not in QUANT_BITS:
            raise ValueError(f"cache quant: unknown kind {quant!r}; choose one of {', '.join(QUANT_BITS)}")
        self.bits = QUANT_BITS[quant]
        self.quant, self.group_size, self.dtype = quant, min(group_size, kv_lora_rank), dtype
        self.kv_lora_rank, self.rope_dim, self.num_layers = kv_lora_rank, rope_dim, num_layers
        self.batch, self.max_len = batch, max_len
        if self.bits is not None:
            check_group(kv_lora_rank, self.group_size)
        shape = (batch, max_len)
        if self.bits is None:
            self.latent = [torch.zeros(*shape, kv_lora_rank, dtype=dtype, device=device) for _ in range(num_layers)]
        else:
            width = kv_lora_rank * self.bits // 8
            code_dtype = torch.int8 if self.bits == 8 else torch.uint8
            self.latent = [torch.zeros(*shape, width, dtype=code_dtype, device=device) for _ in range(num_layers)]
            self.scales = [torch.zeros(*shape, kv_lora_rank // self.group_size, dtype=torch.float32, device=device)
                           for _ in range(num_layers)]
        self.rope = [torch.zeros(*shape, rope_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.rows = torch.arange(batch, device=device)[:, None]  # [B, 1]

    def bytes_per_token(self) -> int:
        return cache_bytes_per_token(self.kv_lora_rank, self.rope_dim, self.num_layers, quant=self.quant,
                                     group_size=self.group_size, dtype=self.dtype)

    def check_room(self, last_position: int) -> None:
        if last_position >= self.max_len:
            raise ValueError(f"latent cache: position {last_position} is beyond the cache's {self.max_len} slots; "
                             f"allocate it for the prompt plus the new tokens")

    def write(self, layer: int, positions: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> None:
        """Store the tokens at `positions` [B, S] (each < max_len, see `check_room`): latent [B, S, C],
        rope [B, S, R]."""
        if self.bits is None:
            self.latent[layer][self.rows, positions] = latent.to(self.dtype)
        else:
            codes, scales = quantize(latent, self.bits, self.group_size)
            self.latent[layer][self.rows, positions] = codes
            self.scales[layer][self.rows, positions] = scales
        self.rope[layer][self.rows, positions] = rope.to(self.dtype)

    def layer(self, layer: int) -> CachedLayer:
        """Every slot of one layer as stored (codes and scales when quantized), for `latent_attention`."""
        if self.bits is None:
            return CachedLayer(self.latent[layer], self.rope[layer])
        return CachedLayer(self.latent[layer], self.rope[layer], self.bits, self.scales[layer], self.group_size)

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [0, length) of every row: (latent [B, L, C], rope [B, L, R]) in the compute dtype."""
        rope = self.rope[layer][:, :length]  # [B, L, R]
        if self.bits is None:
            return self.latent[layer][:, :length], rope
        latent = dequantize(self.latent[layer][:, :length], self.scales[layer][:, :length], self.bits,
                            self.group_size, self.dtype)  # [B, L, C]
        return latent, rope
