"""Parameter counts and training FLOPs per token, computed from the config alone (no model is built).

Decisions:
- `count_params(cfg)` returns (total, active per token). Active counts only K of the E routed experts; the
  embedding and head count in both. `include_mtp=False` gives the figures DeepSeek quotes (671B / 37B for V3:
  MTP modules excluded); the default includes them, matching `sum(p.numel())` of the built model.
- `flops_per_token(cfg, seq_len)` is the 6N-style training estimate used for MFU: 6 * (active matmul parameters,
  embedding lookup excluded, MTP included since it runs every step) + causal attention
  3 * H * (Dqk + Dv) * seq_len per attention layer (forward 2*H*(Dqk+Dv) per visible key, seq_len/2 keys on
  average, backward twice the forward).
"""

from __future__ import annotations

from moela.model.config import ModelConfig


def _attention_params(cfg: ModelConfig, matmul_only: bool = False) -> int:
    d, h, qk = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim
    q = d * h * qk if cfg.q_lora_rank is None else d * cfg.q_lora_rank + cfg.q_lora_rank * h * qk
    kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    norms = (cfg.q_lora_rank or 0) + cfg.kv_lora_rank + {"none": 0, "head": 2 * qk, "layer": 2 * h * qk}[cfg.qk_norm]
    return q + kv + h * cfg.v_head_dim * d + (0 if matmul_only else norms)


def _ffn_params(cfg: ModelConfig, moe: bool) -> tuple[int, int]:
    """(total, active) of one FFN."""
    d = cfg.hidden_size
    if not moe:
        dense = 3 * d * cfg.intermediate_size
        return dense, dense
    expert = 3 * d * cfg.moe_intermediate_size
    fixed = cfg.n_routed_experts * d + cfg.n_shared_experts * expert
    return fixed + cfg.n_routed_experts * expert, fixed + cfg.num_experts_per_tok * expert


def _block_params(cfg: ModelConfig, moe: bool, fal_norm: bool, matmul_only: bool = False) -> tuple[int, int]:
    norms = 0 if matmul_only else (3 if fal_norm else 2) * cfg.hidden_size
    total, active = _ffn_params(cfg, moe)
    attn = _attention_params(cfg, matmul_only)
    return norms + attn + total, norms + attn + active


def count_params(cfg: ModelConfig, *, include_mtp: bool = True) -> tuple[int, int]:
    """(total parameters, parameters active per token)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    total = active = v * d * (1 if cfg.tie_word_embeddings else 2) + d
    for i in range(cfg.num_hidden_layers):
        t, a = _block_params(cfg, i >= cfg.first_k_dense_replace, fal_norm=i > 0 and cfg.block != "standard")
        total, active = total + t, active + a
    if include_mtp:
        t, a = _block_params(cfg, cfg.mtp_is_moe, fal_norm=False)
        per_depth = 3 * d + 2 * d * d
        total += cfg.num_nextn_predict_layers * (t + per_depth)
        active += cfg.num_nextn_predict_layers * (a + per_depth)
    return total, active


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at document length `seq_len`."""
    d, v = cfg.hidden_size, cfg.vocab_size
    matmul = v * d  # output head (the embedding is a lookup)
    for i in range(cfg.num_hidden_layers):
        matmul += _block_params(cfg, i >= cfg.first_k_dense_replace, fal_norm=False, matmul_only=True)[1]
    depth = cfg.num_nextn_predict_layers
    matmul += depth * (_block_params(cfg, cfg.mtp_is_moe, fal_norm=False, matmul_only=True)[1] + 2 * d * d + v * d)
    attn_layers = cfg.num_hidden_layers + depth
    attention = 3 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len * attn_layers
    return float(6 * matmul + attention)
