"""HF deepseek_v3 interop: exported folders load in transformers' DeepseekV3ForCausalLM with equal float32 logits,
and import(export(model)) is the same model."""

import json
import zlib
from pathlib import Path

import pytest
import torch

from factories import packed_batch, tiny_config
from moela.model import RopeScaling, build_model
from moela.model.hf import export_hf, import_hf, load_hf_config
from moela.model.hf_folder import read_hf_weights

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "qlora_groups_mtp1": dict(q_lora_rank=24, n_group=2, topk_group=1, first_k_dense_replace=1,
                              num_nextn_predict_layers=1),
    "no_qlora_yarn_all_moe": dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0,
                                  num_nextn_predict_layers=0, norm_topk_prob=False, routed_scaling_factor=1.7,
                                  rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=8,
                                                           mscale=1.0, mscale_all_dim=0.7)),
    "yarn_4groups_dense2_mtp2": dict(q_lora_rank=40, n_routed_experts=12, n_group=4, topk_group=2,
                                     num_experts_per_tok=3, first_k_dense_replace=2, num_nextn_predict_layers=2,
                                     routed_scaling_factor=2.5, n_shared_experts=2,
                                     rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=16)),
    "tied_no_shared": dict(tie_word_embeddings=True, n_shared_experts=0, num_nextn_predict_layers=1),
}


def _tiny(**kw):
    return tiny_config(**{"max_position_embeddings": 64, **kw})


def _model(cfg):
    model = build_model(cfg)
    with torch.no_grad():
        for moe in model.moe_layers():  # a non-zero bias so that selection != weighting is exercised
            moe.gate.e_score_correction_bias.normal_(0.0, 0.05)
        for name, p in model.named_parameters():  # norms away from 1 so a swapped norm would show
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    return model


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # transformers' zero-width shared experts
@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformers_logits_match(name, tmp_path):
    torch.manual_seed(zlib.crc32(name.encode()))  # str hash() changes per process: not reproducible
    cfg = _tiny(**CONFIGS[name])
    model = _model(cfg)
    export_hf(model, tmp_path)
    hf, info = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                   output_loading_info=True)
    hf.eval()
    assert not info["mismatched_keys"]
    # transformers always builds shared experts; with n_shared_experts=0 they are zero-width (output 0)
    assert all(cfg.n_shared_experts == 0 and ".shared_experts." in k for k in info["missing_keys"])
    mtp_prefixes = tuple(f"model.layers.{cfg.num_hidden_layers + d}." for d in range(cfg.num_nextn_predict_layers))
    assert all(k.startswith(mtp_prefixes) for k in info["unexpected_keys"])  # transformers drops MTP layers
    assert bool(info["unexpected_keys"]) == (cfg.num_nextn_predict_layers > 0)
    assert hf.model.rotary_emb.rope_type == ("yarn" if cfg.rope_scaling else "default")
    batch = packed_batch(cfg.vocab_size, [9, 23, 5], seed=2)
    with torch.no_grad():
        ours = model(batch, return_logits=True).logits
        cu = batch.cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            ref = hf(input_ids=batch.input_ids[a:b][None]).logits[0]
            assert (ref - ours[a:b]).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["qlora_groups_mtp1", "yarn_4groups_dense2_mtp2", "tied_no_shared"])
def test_round_trip(name, tmp_path):
    torch.manual_seed(1)
    cfg = _tiny(**CONFIGS[name])
    model = _model(cfg)
    export_hf(model, tmp_path)
    back = import_hf(tmp_path)
    assert back.cfg == cfg
    sd, sd2 = model.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    assert back.moe_layers()[0].gate.e_score_correction_bias.dtype == torch.float32
    batch = packed_batch(cfg.vocab_size, [6, 13], seed=3)
    with torch.no_grad():
        assert torch.equal(model(batch).loss, back(batch).loss)


def test_config_json_alone_builds_fresh_model(tmp_path):
    cfg = _tiny(**CONFIGS["yarn_4groups_dense2_mtp2"])
    export_hf(build_model(cfg), tmp_path)
    only = tmp_path / "only"
    only.mkdir()
    (only / "config.json").write_text((tmp_path / "config.json").read_text())
    assert load_hf_config(only / "config.json") == cfg
    model = import_hf(only)
    assert model.cfg == cfg
    assert all(not p.is_meta for p in model.parameters())


def test_export_refuses_what_hf_cannot_express(tmp_path):
    with pytest.raises(ValueError, match="block"):
        export_hf(build_model(_tiny(block="fal")), tmp_path)
    with pytest.raises(ValueError, match="qk_norm"):
        export_hf(build_model(_tiny(qk_norm="head")), tmp_path)


def test_import_refuses_what_moela_would_misread(tmp_path):
    export_hf(build_model(_tiny()), tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "scoring_func": "softmax"}))
    with pytest.raises(ValueError, match="scoring_func"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "topk_method": "greedy"}))  # no group limit, no bias
    with pytest.raises(ValueError, match="topk_method='greedy'"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match="quantized"):
        import_hf(tmp_path)
    del hf["kv_lora_rank"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="kv_lora_rank"):
        load_hf_config(tmp_path)


def test_deepseek_v3_published_config_json(tmp_path):
    """The keys of DeepSeek-V3's published config.json (extra keys such as ep_size or aux_loss_alpha ignored)."""
    published = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "aux_loss_alpha": 0.001,
        "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
        "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False,
        "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128,
        "vocab_size": 129280}
    (tmp_path / "config.json").write_text(json.dumps(published))
    cfg = load_hf_config(tmp_path)
    assert cfg.rope_scaling == RopeScaling(factor=40, original_max_position_embeddings=4096)
    assert (cfg.q_lora_rank, cfg.n_group, cfg.topk_group, cfg.num_nextn_predict_layers) == (1536, 8, 4, 1)
    from moela.model import count_params
    total, active = count_params(cfg, include_mtp=False)
    assert 670e9 < total < 672e9 and 36.5e9 < active < 38e9


# ---------------------------------------------------------------------------------------------------------------
# config.json as others write it: every optional YaRN key present or absent, the family's model_types, shards


def _rope(c: dict) -> dict:
    return c["rope_scaling"]


def _drop(*keys):
    def edit(c):
        for key in keys:
            del _rope(c)[key]
    return edit


def _set(**values):
    return lambda c: _rope(c).update(values)


def _rope_parameters_form(c: dict) -> None:
    """transformers >= 5 writes `rope_parameters` with `rope_type` and its own `rope_theta` (which wins)."""
    rope = c.pop("rope_scaling")
    del rope["type"]
    c["rope_parameters"] = {**rope, "rope_theta": 2500.0}


def _top_level_original(c: dict) -> None:
    c["original_max_position_embeddings"] = 32  # a top-level key wins over rope_scaling's (transformers' rule)


# each edit turns the base config.json (YaRN factor 4 over 8 positions, mscale 1, mscale_all_dim 0.7) into another
# that transformers reads differently
YARN_EDITS = {
    "no_mscale_keys": _drop("mscale", "mscale_all_dim"),  # no softmax rescaling; cos/sin by 0.1 ln(factor) + 1
    "mscale_only": _drop("mscale_all_dim"),
    "mscale_all_dim_only": _drop("mscale"),
    "attention_factor": _set(attention_factor=1.7),
    "betas": _set(beta_fast=1.0, beta_slow=0.25),
    "betas_zero_mean_default": _set(beta_fast=0, beta_slow=0, original_max_position_embeddings=32),
    "no_truncate": _set(truncate=False),
    "no_original_max_position_embeddings": _drop("original_max_position_embeddings"),
    "top_level_original_max_position_embeddings": _top_level_original,
    "factor_from_lengths": lambda c: (_drop("mscale_all_dim")(c), _set(factor=None)(c)),
    "rope_parameters": _rope_parameters_form,
}
# RoPE over 16 dims with a low base and weights large enough for attention to be sharp: each edit moves the logits
YARN_BASE = dict(q_lora_rank=None, first_k_dense_replace=1, num_nextn_predict_layers=0, qk_rope_head_dim=16,
                 rope_theta=500.0, max_position_embeddings=128, initializer_range=0.1,
                 rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=16, mscale=1.0,
                                          mscale_all_dim=0.7))


def _exported(tmp_path, edit=None, **cfg_kw) -> tuple[Path, dict]:
    model = _model(_tiny(**{**YARN_BASE, **cfg_kw}))
    export_hf(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    if edit is not None:
        edit(config)
        (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path, config


def _transformers_logits(path, batch) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        return hf(input_ids=batch.input_ids[None]).logits[0]


@pytest.mark.parametrize("name", list(YARN_EDITS))
def test_optional_yarn_keys_follow_transformers(name, tmp_path):
    seed = zlib.crc32(name.encode())
    torch.manual_seed(seed)
    base, _ = _exported(tmp_path / "base")
    torch.manual_seed(seed)  # the same weights
    edited, config = _exported(tmp_path / "edited", YARN_EDITS[name])
    batch = packed_batch(_tiny().vocab_size, [100], seed=4)  # positions well past original_max_position_embeddings
    theirs = _transformers_logits(edited, batch)
    assert (theirs - _transformers_logits(base, batch)).abs().max() > 1e-3  # the edit matters to transformers
    with torch.no_grad():
        ours = import_hf(edited)(batch, return_logits=True).logits
    assert (theirs - ours).abs().max().item() < 1e-4


def test_the_deepseek_v3_family_imports_and_other_model_types_are_refused(tmp_path):
    """sarvam_mla is the model_type transformers also maps to DeepseekV3ForCausalLM; its config.json may use its
    legacy names (num_experts, num_shared_experts, rope type deepseek_yarn, a head_dim for vLLM)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from moela.model.hf import MODEL_TYPES

    family = {t for t, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if cls == "DeepseekV3ForCausalLM"}
    assert family <= set(MODEL_TYPES) and "deepseek_v3" in family
    assert all(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(t, "DeepseekV3ForCausalLM") == "DeepseekV3ForCausalLM"
               for t in MODEL_TYPES)

    def sarvam(c):
        c["model_type"] = "sarvam_mla"
        c["num_experts"], c["num_shared_experts"] = c.pop("n_routed_experts"), c.pop("n_shared_experts")
        _rope(c)["type"] = _rope(c)["rope_type"] = "deepseek_yarn"
        c["head_dim"] = c["kv_lora_rank"] + c["qk_rope_head_dim"]

    path, _ = _exported(tmp_path / "sarvam", sarvam, n_shared_experts=2)
    batch = packed_batch(_tiny().vocab_size, [30], seed=5)
    with torch.no_grad():
        ours = import_hf(path)(batch, return_logits=True).logits
    assert (_transformers_logits(path, batch) - ours).abs().max().item() < 1e-4
    for other in ("llama", "deepseek_v2", "deepseek_v32", None):
        config = json.loads((path / "config.json").read_text())
        config["model_type"] = other
        (path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=f"model_type {other!r} is not a DeepSeek-V3 architecture"):
            load_hf_config(path)


def test_a_sharded_checkpoint_loads_through_its_index_and_names_missing_shards(tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(3)
    model = _model(_tiny(**CONFIGS["qlora_groups_mtp1"]))
    export_hf(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file), metadata={"format": "pt"})
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({"stray": torch.zeros(1)}, str(tmp_path / "other.safetensors"))  # not in the index: not read
    back = import_hf(tmp_path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    assert read_hf_weights(tmp_path, model.cfg).keys() == model.state_dict().keys()  # `moela import`, init_from
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    for load in (import_hf, lambda path: read_hf_weights(path, model.cfg)):
        with pytest.raises(FileNotFoundError, match="model.safetensors.index.json names 1 shard that is missing: "
                                                    "model-00002-of-00002.safetensors"):
            load(tmp_path)
