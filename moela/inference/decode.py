"""Incremental decoding of a trained `Transformer` with the latent cache and DeepSeek's absorbed MLA weights.

`LatentDecoder(model).forward(tokens [B, S], positions [B, S], cache)` runs the main model path (embedding, every
block, final norm; no MTP, which only trains) over S new tokens per sequence, writing each layer's latent into the
cache and attending over slots [0, max position]. It reads the trained modules' weights from outside; nothing in
`moela.model` changes.

Absorbed attention (DeepSeek-V2 section 2.1.2, DeepSeek-V3's inference "absorb" mode). With wkv_b viewed per
head as [W_uk (Dn x C); W_uv (Dv x C)], the score q_nope . k_nope = q_nope . (W_uk c) = (W_uk^T q_nope) . c, so
the query is mapped once into the latent space (q_lat [H, C]) and scored against the cached latents c directly;
likewise sum_t p_t v_t = W_uv (sum_t p_t c_t), so values are summed in the latent space and expanded once per
query. Per step and layer that is O(L * H * C) work on a cache of L * (C + R) numbers instead of materializing
L * H * (Dqk + Dv) keys and values. The RoPE part adds q_pe . k_pe with the one k_pe every head shares.

Decisions:
- The attention over the cached latents is `moela.inference.latent_attention` (on CUDA a Triton kernel that reads
  the int8 / int4 codes directly; on CPU the torch reference), chosen by the decoder's `backend`.
- Scores and softmax in float32 whatever the compute dtype (the training kernels accumulate in float32 too); the
  softmax scale and the cos / sin factor are the MLA module's own (`softmax_scale` carries YaRN's mscale**2,
  `attention_factor` its cos / sin scale), so a YaRN model decodes exactly as it trains.
- Slot = position (see `moela.inference.cache`): a query at position p sees slots [0, p]. Right-padded prompts are
  therefore exact: a padding token only writes slots past its sequence's length, which the sequence overwrites
  before any query of its own can see them.
- QK-Norm normalizes each head's full key [k_nope; k_pe] before RoPE, which does not factor through the latent;
  for such models the cache holds the latent and the un-rotated k_pe, and each step expands keys and values from
  the cached latents (the same cache size, more work per step).
- MoE layers route exactly as in training (the gate's sigmoid scores, correction bias, group limit and top-k,
  then the same `moe_experts` call); FAL / FAL+ blocks keep the first block's attention output as in training.

Shapes: B sequences, S new tokens, L cached slots, D hidden, H heads, Dn / R / Dv nope / rope / value head dims,
C kv_lora_rank, V vocabulary, N = B * S.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from moela.inference.cache import LatentCache
from moela.inference.latent_attention import DISPATCH, latent_attention
from moela.model.attention import MLA
from moela.model.moe import MoE
from moela.model.transformer import Transformer
from moela.ops.rope import rope


def _norm_heads(mla: MLA, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """QK-Norm of x [N, H, Dqk]: per head (`head`) or over all heads together (`layer`)."""
    if mla.qk_norm_kind == "head":
        return norm(x)
    return norm(x.reshape(x.shape[0], -1)).view_as(x)


def _queries(mla: MLA, x: torch.Tensor) -> torch.Tensor:
    """x [N, D] -> q [N, H, Dqk]."""
    q = mla.wq(x) if mla.q_lora_rank is None else mla.wq_b(mla.q_norm(mla.wq_a(x)))  # [N, H*Dqk]
    return q.view(x.shape[0], mla.n_heads, mla.qk_dim)


def _attend(scores: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """scores [B, S, H, L] -> float32 probabilities, key slot t visible to a query at position p iff t <= p."""
    slots = torch.arange(scores.shape[-1], device=scores.device)  # [L]
    hidden = slots[None, None, :] > positions[:, :, None]  # [B, S, L]
    scores = scores.float().mul(scale).masked_fill(hidden[:, :, None, :], float("-inf"))
    return scores.softmax(dim=-1)  # [B, S, H, L]


def absorbed_attention(mla: MLA, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                       cache: LatentCache, layer: int, num_slots: int, backend: str = "auto") -> torch.Tensor:
    """One MLA layer over x [B, S, D] at `positions` [B, S], writing the cache first -> [B, S, D]. `backend`:
    `latent_attention`'s, for the attention over the cached latents."""
    b, s, _ = x.shape
    h, dn, r, dv, c = mla.n_heads, mla.nope_dim, mla.rope_dim, mla.v_dim, mla.kv_lora_rank
    flat, pos = x.reshape(b * s, -1), positions.reshape(-1)  # [N, D], [N]
    q = _queries(mla, flat)  # [N, H, Dqk]
    latent, k_pe = mla.wkv_a(flat).split([c, r], dim=-1)  # [N, C], [N, R]
    latent = mla.kv_norm(latent)  # [N, C]
    if mla.qk_norm_kind != "none":
        cache.write(layer, positions, latent.view(b, s, c), k_pe.view(b, s, r))
        return _expanded_attention(mla, q, positions, inv_freq, cache, layer, num_slots)
    q_nope, q_pe = q.split([dn, r], dim=-1)  # [N, H, Dn], [N, H, R]
    q_pe = rope(q_pe, pos, inv_freq, attention_factor=mla.attention_factor)  # [N, H, R]
    k_pe = rope(k_pe[:, None], pos, inv_freq, attention_factor=mla.attention_factor)[:, 0]  # [N, R]
    cache.write(layer, positions, latent.view(b, s, c), k_pe.view(b, s, r))
    w = mla.wkv_b.weight.view(h, dn + dv, c)  # [H, Dn + Dv, C]
    q_lat = torch.einsum("nhd,hdc->nhc", q_nope, w[:, :dn]).view(b, s, h, c)  # [B, S, H, C]
    out_lat = latent_attention(q_lat, q_pe.view(b, s, h, r), cache.layer(layer), positions,
                               softmax_scale=mla.softmax_scale, num_slots=num_slots, backend=backend)  # [B, S, H, C]
    out = torch.einsum("bshc,hdc->bshd", out_lat, w[:, dn:])  # [B, S, H, Dv]
    return mla.wo(out.reshape(b * s, h * dv)).view(b, s, -1)  # [B, S, D]


def _expanded_attention(mla: MLA, q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                        cache: LatentCache, layer: int, num_slots: int) -> torch.Tensor:
    """QK-Norm models: keys and values expanded from the cached latents each step. q [N, H, Dqk] -> [B, S, D]."""
    b, s = positions.shape
    h, dn, r, dv, c = mla.n_heads, mla.nope_dim, mla.rope_dim, mla.v_dim, mla.kv_lora_rank
    keys, keys_pe = cache.read(layer, num_slots)  # [B, L, C], [B, L, R] (k_pe before RoPE)
    length = keys.shape[1]
    kv = mla.wkv_b(keys.reshape(b * length, c)).view(b * length, h, dn + dv)  # [B*L, H, Dn + Dv]
    k_nope, v = kv.split([dn, dv], dim=-1)  # [B*L, H, Dn], [B*L, H, Dv]
    k = torch.cat((k_nope, keys_pe.reshape(b * length, 1, r).expand(-1, h, r)), dim=-1)  # [B*L, H, Dqk]
    q, k = _norm_heads(mla, mla.q_qk_norm, q), _norm_heads(mla, mla.k_qk_norm, k)
    slot_pos = torch.arange(length, device=q.device).repeat(b)  # [B*L]
    q_nope, q_pe = q.split([dn, r], dim=-1)
    k_nope, k_pe = k.split([dn, r], dim=-1)
    q = torch.cat((q_nope, rope(q_pe, positions.reshape(-1), inv_freq, attention_factor=mla.attention_factor)), -1)
    k = torch.cat((k_nope, rope(k_pe, slot_pos, inv_freq, attention_factor=mla.attention_factor)), -1)
    scores = torch.einsum("bshd,bthd->bsht", q.view(b, s, h, -1), k.view(b, length, h, -1))  # [B, S, H, L]
    probs = _attend(scores, positions, mla.softmax_scale).to(v.dtype)
    out = torch.einsum("bsht,bthd->bshd", probs, v.reshape(b, length, h, dv))  # [B, S, H, Dv]
    return mla.wo(out.reshape(b * s, h * dv)).view(b, s, -1)  # [B, S, D]


def _ffn(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's FFN on x [N, D]: dense SwiGLU, or routed + shared experts routed as in training."""
    ffn = block.ffn
    if not isinstance(ffn, MoE):
        return ffn(x)
    topk_ids, topk_weights, _ = ffn.gate(x)  # [N, K], [N, K]
    y = ffn.experts(x, topk_ids, topk_weights)  # [N, D]
    return y if ffn.shared_experts is None else y + ffn.shared_experts(x)


class LatentDecoder:
    """Decodes with a plain (unsharded) `Transformer` on one device; see the module docstring."""

    def __init__(self, model: Transformer, *, backend: str = "auto"):
        if not isinstance(model, Transformer):
            raise TypeError(f"LatentDecoder needs a moela Transformer, got {type(model).__name__}; load the "
                            f"checkpoint onto one device first (moela.tools.runs.load_model)")
        self.model = model
        self.cfg = model.cfg
        DISPATCH.check(backend)
        self.backend = backend

    def new_cache(self, batch: int, max_len: int, *, quant: str = "none", group_size: int = 64) -> LatentCache:
        dtype = self.model.embed.weight.dtype
        return LatentCache(self.cfg.num_hidden_layers, batch, max_len, self.cfg.kv_lora_rank,
                           self.cfg.qk_rope_head_dim, dtype=dtype, device=self.model.embed.weight.device,
                           quant=quant, group_size=group_size)

    @torch.no_grad()
    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, cache: LatentCache) -> torch.Tensor:
        """tokens, positions [B, S] -> final-norm hidden states [B, S, D]; writes the S tokens into the cache."""
        model = self.model
        b, s = tokens.shape
        last = int(positions.max())
        cache.check_room(last)
        x = model.embed(tokens.reshape(-1))  # [N, D]
        a1 = None
        for i, block in enumerate(model.layers):
            a = absorbed_attention(block.attn, block.attn_norm(x).view(b, s, -1), positions, model.inv_freq, cache,
                                   i, last + 1, self.backend).reshape(b * s, -1)  # [N, D]
            if block.kind == "standard":
                x = x + a
                x = x + _ffn(block, block.ffn_norm(x))
                a1 = a if block.keeps_a1 else a1
            elif block.kind == "fal":
                x = x + a + _ffn(block, block.ffn_norm(x) + block.a1_norm(a1))
            else:
                x = x + a
                x = x + _ffn(block, block.ffn_norm(x + block.a1_norm(a1)))
        return model.norm(x).view(b, s, -1)  # [B, S, D]

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [..., V] through the output head (float32)."""
        return self.model.logits(hidden).float()
