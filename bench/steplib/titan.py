"""torchtitan's DeepSeek-V3 model (PyPI `torchtitan==0.3.0`, its model code only) on moela's config and weights.

`import_torchtitan()` imports it after two stand-ins that torch 2.11 needs (torchtitan 0.3.0 is written against
a newer torch), applied only where the running torch lacks the feature:
- `torch.distributed.fsdp.DataParallelMeshDims` (imported at module level by its MTP and FSDP code, used only
  when sharding with FSDP): a dataclass with the same two fields;
- the `separate_full_blocks=` argument of `create_block_mask` (torchtitan passes it to build the packed-document
  FlexAttention mask): dropped, which is the older torch's behaviour (full blocks are always kept apart).

`titan_config(cfg)` maps a moela `ModelConfig` onto torchtitan's own layer builder (`_build_dsv3_layers`, the one
its registry uses) with the same shapes: MLA with or without q LoRA, dense first layers, sigmoid routing with
group-limited top-k, routed scaling and top-k renormalization as configured, shared experts, interleaved
(complex) RoPE, RMSNorm epsilon `rms_norm_eps` everywhere, FlexAttention with the packed-document mask, no MTP.
YaRN is not mapped (moela scales cos/sin by HF's attention factor, torchtitan does not): a config with
`rope_scaling` is refused.

`load_moela_weights(model, cfg, moela_model)` goes through moela's HF export names (`moela.model.hf`) and
torchtitan's own `DeepSeekV3StateDictAdapter.from_hf`, so both models hold the same numbers.

On the CPU (the benchmark's smoke run) FlexAttention has no backward: `use_dense_attention(model)` puts
`DenseMaskAttention` in its place, SDPA with the same packed-document causal mask as a dense boolean tensor
(`dense_document_mask`), so the rest of torchtitan's step still runs there. GPU rows never use it.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.nn.functional as F

from moela.model.config import ModelConfig


def _stand_in_mesh_dims() -> bool:
    """Before importing torchtitan: give torch.distributed.fsdp a `DataParallelMeshDims` if it lacks one."""
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        return False

    @dataclasses.dataclass
    class DataParallelMeshDims:
        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

    fsdp.DataParallelMeshDims = DataParallelMeshDims
    return True


def _drop_separate_full_blocks() -> bool:
    """After importing torchtitan: if `create_block_mask` has no `separate_full_blocks`, let torchtitan's mask
    helper drop the argument."""
    from torch.nn.attention.flex_attention import create_block_mask

    if "separate_full_blocks" in inspect.signature(create_block_mask).parameters:
        return False
    import torchtitan.models.common.attention as attention
    import torchtitan.models.common.decoder as decoder

    original = attention.create_attention_mask

    def create_attention_mask(*args, separate_full_blocks: bool = True, **kwargs):
        return original(*args, **kwargs)

    attention.create_attention_mask = decoder.create_attention_mask = create_attention_mask
    return True


def import_torchtitan() -> list[str]:
    """Import torchtitan's DeepSeek-V3 model with the stand-ins this torch needs; returns the stand-ins applied.
    Raises ImportError naming the wheels to install when torchtitan is missing."""
    applied = ["torch.distributed.fsdp.DataParallelMeshDims"] if _stand_in_mesh_dims() else []
    try:
        import torchtitan.models.deepseek_v3  # noqa: F401
    except ImportError as e:
        raise ImportError(f"torchtitan 0.3.0 is not importable ({e}); install it and its pure-Python "
                          f"dependencies: pip install --no-deps torchtitan==0.3.0 tyro spmd_types==0.2.3 "
                          f"docstring_parser typeguard typing_extensions") from e
    if _drop_separate_full_blocks():
        applied.append("create_block_mask(separate_full_blocks=)")
    return applied


def _set_norm_eps(node, eps: float) -> None:
    """Set `eps` on every RMSNorm config below `node` (torchtitan's builder leaves its default 1e-5)."""
    from torchtitan.models.common import RMSNorm

    if isinstance(node, RMSNorm.Config):
        node.eps = eps
    elif dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            _set_norm_eps(getattr(node, f.name), eps)
    elif isinstance(node, (list, tuple)):
        for item in node:
            _set_norm_eps(item, eps)


def titan_config(cfg: ModelConfig, max_seq_len: int):
    """torchtitan `DeepSeekV3Model.Config` with `cfg`'s shapes (see the module docstring); RoPE tables cover
    positions < max_seq_len."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        DeepSeekV3Model,
        _build_dsv3_layers,
        _output_linear_init,
    )

    if cfg.rope_scaling is not None:
        raise ValueError("torchtitan mapping: rope_scaling (YaRN) is not mapped; benchmark a config without it")
    if cfg.block != "standard" or cfg.qk_norm != "none" or cfg.tie_word_embeddings:
        raise ValueError(f"torchtitan mapping: block={cfg.block!r}, qk_norm={cfg.qk_norm!r}, tie_word_embeddings="
                         f"{cfg.tie_word_embeddings} have no torchtitan DeepSeek-V3 counterpart; use the standard "
                         f"block without QK-Norm and untied embeddings")
    grouped = cfg.n_group > 1
    layers = _build_dsv3_layers(
        n_layers=cfg.num_hidden_layers, n_dense_layers=cfg.first_k_dense_replace, dim=cfg.hidden_size,
        n_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank or 0, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        mscale=1.0, dense_hidden_dim=cfg.intermediate_size, moe_hidden_dim=cfg.moe_intermediate_size,
        num_experts=cfg.n_routed_experts, num_shared_experts=cfg.n_shared_experts,
        router_top_k=cfg.num_experts_per_tok, router_score_func="sigmoid",
        router_num_expert_groups=cfg.n_group if grouped else None,
        router_num_limited_groups=cfg.topk_group if grouped else None,
        router_route_scale=cfg.routed_scaling_factor, router_route_norm=cfg.norm_topk_prob,
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=cfg.qk_rope_head_dim, max_seq_len=max_seq_len, theta=cfg.rope_theta))
    d, v = cfg.hidden_size, cfg.vocab_size
    config = DeepSeekV3Model.Config(
        vocab_size=v, dim=d,
        tok_embeddings=Embedding.Config(num_embeddings=v, embedding_dim=d, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=d, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=d, out_features=v, param_init=_output_linear_init(d)),
        layers=layers)
    _set_norm_eps(config, cfg.rms_norm_eps)
    return config


def build_titan_model(cfg: ModelConfig, max_seq_len: int, device: torch.device):
    """(model, its config): torchtitan's model built on the meta device, materialized on `device`, initialized."""
    config = titan_config(cfg, max_seq_len)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=device)
    return model, config


def load_moela_weights(model, config, moela_model) -> None:
    """Copy `moela_model`'s weights into torchtitan's `model` through the HF names (strict: every tensor)."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3StateDictAdapter

    from moela.model.hf import to_hf_state_dict

    state = DeepSeekV3StateDictAdapter(config, None).from_hf(to_hf_state_dict(moela_model))
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise KeyError(f"torchtitan weight mapping: missing {missing[:4]}, unexpected {unexpected[:4]}")
    with torch.no_grad():
        for name, tensor in expected.items():
            tensor.copy_(state[name].to(tensor.dtype))


def compile_blocks(model) -> None:
    """torchtitan's own `apply_compile` on one GPU: every transformer block compiled whole (fullgraph=True)."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.compile import apply_compile

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    apply_compile(model, compile_config=CompileConfig(enable=True), parallel_dims=dims)


def dense_document_mask(positions: torch.Tensor) -> torch.Tensor:
    """positions [B, L] (restarting at 0 per document) -> [B, 1, L, L] bool: same document and causal."""
    doc = torch.cumsum(positions == 0, dim=1)  # [B, L]
    length = positions.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()  # [L, L]
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


class DenseMaskAttention(torch.nn.Module):
    """CPU stand-in for torchtitan's FlexAttention module (same call signature, (B, L, N, H) layout)."""

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks: torch.Tensor, scale: float | None = None,
                **kwargs) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))  # [B, N, L, H]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_masks, scale=scale).transpose(1, 2)


def use_dense_attention(model) -> None:
    for block in model.layers.values():
        block.attention.inner_attention = DenseMaskAttention()
