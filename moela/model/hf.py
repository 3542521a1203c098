"""Hugging Face `deepseek_v3` interop: export a model to a folder (config.json + model.safetensors) that
`transformers.DeepseekV3ForCausalLM` loads, and import such a folder (or a config.json alone) into moela.

Decisions:
- The weight layout is DeepSeek's published one: experts stored one by one (`mlp.experts.{e}.gate_proj` etc.,
  split from our stacked `w13` / `w2`), `mlp.gate.e_score_correction_bias` in float32, RoPE dims interleaved
  (`rope_interleave: true`), MTP depth d at `model.layers.{num_hidden_layers + d}` with `enorm`, `hnorm`,
  `eh_proj`, `shared_head.norm`, `shared_head.head` and its own `embed_tokens` copy. transformers builds no MTP
  modules: it reports those keys as unexpected and ignores them, so its logits are the main head's.
- Only what HF can express is exported: `block: standard` and `qk_norm: none`; other settings raise. moela-only
  training settings (loss coefficients, backends) are not part of config.json; on import they take the values
  of `overrides` or the dataclass defaults.
- DeepSeek's routing keys (`scoring_func: sigmoid`, `topk_method: noaux_tc`) are written for other readers and
  checked on import: softmax-routed checkpoints (DeepSeek-V2) are refused rather than silently misread.
- Import reads config.json as transformers does (its `DeepseekV3Config` and `_compute_yarn_parameters`): the
  `model_type`s it builds as `DeepseekV3ForCausalLM` (`MODEL_TYPES`, with their configs' alias key names) and no
  other; YaRN keys that are absent take transformers' defaults, not moela's: no `mscale` / `mscale_all_dim` means
  no softmax rescaling and a cos / sin scale of 0.1 ln(factor) + 1, a missing or 0 `beta_fast` / `beta_slow` is
  32 / 1, a null `factor` is max_position_embeddings / original_max_position_embeddings, which itself defaults to
  max_position_embeddings and is overridden by a top-level key of that name; `rope_parameters`' own `rope_theta`
  wins over the top-level one.
- Weights: the files `model.safetensors.index.json` names (a missing one is an error naming it), else every
  `*.safetensors` in the folder.
- HF names appear only in this file.

Shapes: E routed experts, F expert width, D hidden.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moela.model.config import ModelConfig, RopeScaling
from moela.model.transformer import Transformer, build_model

HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
           "first_k_dense_replace", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
           "topk_group", "routed_scaling_factor", "norm_topk_prob", "q_lora_rank", "kv_lora_rank",
           "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_attention_heads", "rope_theta",
           "max_position_embeddings", "rms_norm_eps", "num_nextn_predict_layers", "tie_word_embeddings",
           "initializer_range")

# keys a config.json may omit, with the value moela assumes then
_OPTIONAL = {"q_lora_rank": None, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
             "initializer_range": 0.02, "rms_norm_eps": 1e-6, "rope_theta": None, "max_position_embeddings": 4096}

# model_type -> {alias: our key}: the types transformers maps to DeepseekV3ForCausalLM (models/auto/modeling_auto.py)
# and the other names their configs' `attribute_map` accepts for our keys
MODEL_TYPES = {
    "deepseek_v3": {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"},
    "sarvam_mla": {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers",
                   "num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts"},
}
_YARN_TYPES = {"deepseek_v3": ("yarn",), "sarvam_mla": ("yarn", "deepseek_yarn")}
INDEX_FILE = "model.safetensors.index.json"

_ATTN = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
         "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
_MLP = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def to_hf_config(cfg: ModelConfig) -> dict:
    if cfg.block != "standard" or cfg.qk_norm != "none":
        raise ValueError(f"HF export: deepseek_v3 has no block={cfg.block!r} / qk_norm={cfg.qk_norm!r}; only "
                         f"block: standard with qk_norm: none can be exported")
    out = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    out.update({k: getattr(cfg, k) for k in HF_KEYS})
    out.update(num_key_value_heads=cfg.num_attention_heads, hidden_act="silu", attention_bias=False,
               attention_dropout=0.0, rope_interleave=True, moe_layer_freq=1, scoring_func="sigmoid",
               topk_method="noaux_tc", torch_dtype="float32", use_cache=True)
    rs = cfg.rope_scaling
    out["rope_scaling"] = None if rs is None else {
        "type": "yarn", "rope_type": "yarn", "factor": rs.factor,
        "original_max_position_embeddings": rs.original_max_position_embeddings, "beta_fast": rs.beta_fast,
        "beta_slow": rs.beta_slow, "mscale": rs.mscale, "mscale_all_dim": rs.mscale_all_dim}
    if rs is not None and rs.attention_factor is not None:
        out["rope_scaling"]["attention_factor"] = rs.attention_factor
    if rs is not None and not rs.truncate:
        out["rope_scaling"]["truncate"] = False
    return out


def _rope_from_hf(hf: dict, model_type: str, where: str) -> tuple[RopeScaling | None, float | None]:
    """(YaRN settings or None, rope_theta or None) from config.json, with transformers' defaults."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None, theta
    if kind not in _YARN_TYPES[model_type]:
        raise ValueError(f"{where}: rope type {kind!r} is not supported; use yarn or none")
    max_len = hf.get("max_position_embeddings", _OPTIONAL["max_position_embeddings"])
    original = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") or max_len
    factor = rope.get("factor")
    scaling = RopeScaling(
        factor=max_len / original if factor is None else factor, original_max_position_embeddings=original,
        beta_fast=rope.get("beta_fast") or 32.0, beta_slow=rope.get("beta_slow") or 1.0,
        mscale=rope.get("mscale") or 0.0, mscale_all_dim=rope.get("mscale_all_dim") or 0.0,
        attention_factor=rope.get("attention_factor"), truncate=bool(rope.get("truncate", True)))
    return scaling, theta


def from_hf_config(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig from a deepseek_v3 config.json dict (legacy `rope_scaling` or newer `rope_parameters`)."""
    where = "HF config.json"
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{where}: model_type {model_type!r} is not a DeepSeek-V3 architecture; moela imports "
                         f"{' and '.join(MODEL_TYPES)} (the model types transformers builds as "
                         f"DeepseekV3ForCausalLM)")
    aliases = MODEL_TYPES[model_type]
    hf = {**{aliases[k]: v for k, v in hf.items() if k in aliases}, **{k: v for k, v in hf.items() if k not in aliases}}
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"{where}: scoring_func={hf.get('scoring_func')!r} / topk_method="
                         f"{hf.get('topk_method')!r} is not DeepSeek-V3 routing (sigmoid, noaux_tc); moela "
                         f"cannot import it")
    if hf.get("rope_interleave", True) is not True:
        raise ValueError(f"{where}: rope_interleave=false is not supported; moela uses DeepSeek's interleaved "
                         f"RoPE layout")
    missing = [k for k in HF_KEYS if k not in hf and k not in _OPTIONAL]
    if missing:
        raise ValueError(f"{where}: missing keys {missing}; a deepseek_v3 config.json names every shape key")
    kw = {k: hf.get(k, _OPTIONAL.get(k)) for k in HF_KEYS}
    kw["rope_scaling"], kw["rope_theta"] = _rope_from_hf(hf, model_type, where)
    if kw["rope_theta"] is None:
        kw.pop("rope_theta")
    cfg = ModelConfig(**{**kw, **overrides})
    errors = cfg.validate()
    if errors:
        raise ValueError(f"{where} gives an invalid model config:\n  " + "\n  ".join(errors))
    return cfg


def _block_to_hf(sd: dict, ours: str, hf: str, moe: bool, out: dict) -> None:
    out[f"{hf}.input_layernorm.weight"] = sd[f"{ours}.attn_norm.weight"]
    out[f"{hf}.post_attention_layernorm.weight"] = sd[f"{ours}.ffn_norm.weight"]
    for name, hf_name in _ATTN.items():
        if f"{ours}.attn.{name}.weight" in sd:
            out[f"{hf}.self_attn.{hf_name}.weight"] = sd[f"{ours}.attn.{name}.weight"]
    if not moe:
        for name, hf_name in _MLP.items():
            out[f"{hf}.mlp.{hf_name}.weight"] = sd[f"{ours}.ffn.{name}.weight"]
        return
    out[f"{hf}.mlp.gate.weight"] = sd[f"{ours}.ffn.gate.weight"]
    out[f"{hf}.mlp.gate.e_score_correction_bias"] = sd[f"{ours}.ffn.gate.e_score_correction_bias"].float()
    w13, w2 = sd[f"{ours}.ffn.experts.w13"], sd[f"{ours}.ffn.experts.w2"]  # [E, 2F, D], [E, D, F]
    f = w2.shape[2]
    for e in range(w13.shape[0]):
        out[f"{hf}.mlp.experts.{e}.gate_proj.weight"] = w13[e, :f]  # [F, D]
        out[f"{hf}.mlp.experts.{e}.up_proj.weight"] = w13[e, f:]  # [F, D]
        out[f"{hf}.mlp.experts.{e}.down_proj.weight"] = w2[e]  # [D, F]
    for name, hf_name in _MLP.items():
        if f"{ours}.ffn.shared_experts.{name}.weight" in sd:
            out[f"{hf}.mlp.shared_experts.{hf_name}.weight"] = sd[f"{ours}.ffn.shared_experts.{name}.weight"]


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2-sharded (DTensor) parameter; every rank must call this collectively."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """HF-named tensors of `model`. Under FSDP2 every rank must call it (parameters are gathered)."""
    cfg = model.cfg
    sd = {k: _full(v).detach().cpu() for k, v in model.state_dict().items()}
    head = sd["embed.weight"] if cfg.tie_word_embeddings else sd["head.weight"]
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = head
    for i in range(cfg.num_hidden_layers):
        _block_to_hf(sd, f"layers.{i}", f"model.layers.{i}", i >= cfg.first_k_dense_replace, out)
    for d in range(cfg.num_nextn_predict_layers):
        hf = f"model.layers.{cfg.num_hidden_layers + d}"
        _block_to_hf(sd, f"mtp.{d}.block", hf, cfg.mtp_is_moe, out)
        out.update({f"{hf}.enorm.weight": sd[f"mtp.{d}.enorm.weight"],
                    f"{hf}.hnorm.weight": sd[f"mtp.{d}.hnorm.weight"],
                    f"{hf}.eh_proj.weight": sd[f"mtp.{d}.eh_proj.weight"],
                    f"{hf}.shared_head.norm.weight": sd[f"mtp.{d}.norm.weight"],
                    f"{hf}.shared_head.head.weight": head, f"{hf}.embed_tokens.weight": sd["embed.weight"]})
    return {k: v.contiguous().clone() for k, v in out.items()}


def _hf_to_ours_names(cfg: ModelConfig) -> dict[str, str]:
    """HF name -> our name for every tensor except the per-expert ones (handled by stacking)."""
    m = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = "head.weight"

    def block(ours: str, hf: str, moe: bool) -> None:
        m[f"{hf}.input_layernorm.weight"] = f"{ours}.attn_norm.weight"
        m[f"{hf}.post_attention_layernorm.weight"] = f"{ours}.ffn_norm.weight"
        q_path = ("wq",) if cfg.q_lora_rank is None else ("wq_a", "q_norm", "wq_b")
        for name, hf_name in _ATTN.items():
            if name in q_path or name not in ("wq", "wq_a", "q_norm", "wq_b"):
                m[f"{hf}.self_attn.{hf_name}.weight"] = f"{ours}.attn.{name}.weight"
        if moe:
            m[f"{hf}.mlp.gate.weight"] = f"{ours}.ffn.gate.weight"
            m[f"{hf}.mlp.gate.e_score_correction_bias"] = f"{ours}.ffn.gate.e_score_correction_bias"
            if cfg.n_shared_experts > 0:
                for name, hf_name in _MLP.items():
                    m[f"{hf}.mlp.shared_experts.{hf_name}.weight"] = f"{ours}.ffn.shared_experts.{name}.weight"
        else:
            for name, hf_name in _MLP.items():
                m[f"{hf}.mlp.{hf_name}.weight"] = f"{ours}.ffn.{name}.weight"

    for i in range(cfg.num_hidden_layers):
        block(f"layers.{i}", f"model.layers.{i}", i >= cfg.first_k_dense_replace)
    for d in range(cfg.num_nextn_predict_layers):
        hf = f"model.layers.{cfg.num_hidden_layers + d}"
        block(f"mtp.{d}.block", hf, cfg.mtp_is_moe)
        m.update({f"{hf}.enorm.weight": f"mtp.{d}.enorm.weight", f"{hf}.hnorm.weight": f"mtp.{d}.hnorm.weight",
                  f"{hf}.eh_proj.weight": f"mtp.{d}.eh_proj.weight",
                  f"{hf}.shared_head.norm.weight": f"mtp.{d}.norm.weight"})
    return m


def hf_tensor_plan(cfg: ModelConfig,
                   hf_names: Collection[str]) -> tuple[dict[str, str], dict[str, list[tuple[str, ...]]]]:
    """Which HF tensors make each of our tensors: `direct` (our name -> the HF name it is) and `stacked` (our name
    of each stacked expert weight -> per expert, the HF names concatenated on dim 0: gate_proj, up_proj for `w13`;
    down_proj for `w2`). Raises KeyError naming a missing or unknown HF tensor."""
    names = set(hf_names)
    direct, stacked, used = {}, {}, set()
    for hf_name, our_name in _hf_to_ours_names(cfg).items():
        if hf_name not in names:
            raise KeyError(f"HF checkpoint lacks {hf_name!r} (needed for {our_name}); is the config.json the one "
                           f"this checkpoint was saved with?")
        direct[our_name] = hf_name
        used.add(hf_name)
    moe_blocks = [(f"layers.{i}", f"model.layers.{i}") for i in range(cfg.first_k_dense_replace,
                                                                      cfg.num_hidden_layers)]
    if cfg.mtp_is_moe:
        moe_blocks += [(f"mtp.{d}.block", f"model.layers.{cfg.num_hidden_layers + d}")
                       for d in range(cfg.num_nextn_predict_layers)]
    for our, hf in moe_blocks:
        w13, w2 = [], []
        for e in range(cfg.n_routed_experts):
            keys = [f"{hf}.mlp.experts.{e}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
            missing = [k for k in keys if k not in names]
            if missing:
                raise KeyError(f"HF checkpoint lacks {missing[0]!r}; experts must be stored one by one")
            w13.append((keys[0], keys[1]))
            w2.append((keys[2],))
            used.update(keys)
        stacked[f"{our}.ffn.experts.w13"] = w13
        stacked[f"{our}.ffn.experts.w2"] = w2
    mtp_shared = [f"model.layers.{cfg.num_hidden_layers + d}.{s}" for d in range(cfg.num_nextn_predict_layers)
                  for s in ("shared_head.head.weight", "embed_tokens.weight")]
    unknown = sorted(names - used - set(mtp_shared))
    if unknown:
        raise KeyError(f"HF checkpoint has tensors moela does not know: {unknown[:5]}"
                       f"{' ...' if len(unknown) > 5 else ''}; check num_hidden_layers / "
                       f"num_nextn_predict_layers / q_lora_rank in config.json")
    return direct, stacked


def from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict from HF tensors; raises naming missing or unknown keys."""
    direct, stacked = hf_tensor_plan(cfg, hf_sd.keys())
    ours = {our: hf_sd[hf] for our, hf in direct.items()}
    for our, per_expert in stacked.items():  # w13 [E, 2F, D] from [F, D] pairs, w2 [E, D, F]
        ours[our] = torch.stack([torch.cat([hf_sd[k] for k in keys], dim=0) for keys in per_expert])
    return ours


def export_hf(model: Transformer, path: str | Path) -> Path:
    """Write `config.json` and `model.safetensors` (HF deepseek_v3 layout) into folder `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(to_hf_config(model.cfg), indent=2) + "\n")
    save_file(to_hf_state_dict(model), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def load_hf_config(path: str | Path, **overrides) -> ModelConfig:
    """ModelConfig from a folder holding config.json, or from the config.json file itself."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no HF config.json at {file}; pass a folder containing config.json or the file")
    return from_hf_config(json.loads(file.read_text()), **overrides)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of an HF folder: those its shard index names (all must exist), else every one."""
    index = path / INDEX_FILE
    if not index.is_file():
        return sorted(path.glob("*.safetensors"))
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index}: not a safetensors index (a JSON object with a weight_map of tensor name -> "
                         f"file): {e!r}") from None
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{path}: {INDEX_FILE} names {len(missing)} "
                                f"{'shards that are' if len(missing) > 1 else 'shard that is'} missing: "
                                f"{', '.join(missing)}; download the whole checkpoint (e.g. huggingface-cli "
                                f"download REPO --local-dir {path})")
    return [path / f for f in files]


def import_hf(path: str | Path, device: torch.device | str = "cpu", **overrides) -> Transformer:
    """Build a moela model from an HF deepseek_v3 folder. With weights (model.safetensors, or the shards its
    model.safetensors.index.json names) they are loaded; with a config.json alone the model is freshly
    initialized."""
    cfg = load_hf_config(path, **overrides)
    path = Path(path)
    files = weight_files(path) if path.is_dir() else []
    if files and "quantization_config" in json.loads((path / "config.json").read_text()):
        raise ValueError(f"{path}: the checkpoint is quantized (config.json has quantization_config); dequantize "
                         f"it to bf16/fp32 first, or import its config.json alone")
    model = build_model(cfg, device)
    if files:
        hf_sd = {}
        for f in files:
            hf_sd.update(load_file(str(f)))
        sd = from_hf_state_dict(hf_sd, cfg)
        model.load_state_dict({k: v.to(device) for k, v in sd.items()}, strict=True)
    return model
