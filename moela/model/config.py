"""The recipe's `model` section: a DeepSeek-V3-shaped network described with Hugging Face `deepseek_v3` key names.

Decisions:
- Keys that exist in HF's `DeepseekV3Config` keep its names and meanings (`q_lora_rank: null` = no q compression,
  `rope_scaling` = YaRN, `n_group` / `topk_group` = group-limited routing), so `hf.py` maps config.json one to one.
  Our own keys (`block`, `qk_norm`, balancing, auxiliary losses, backends) have no HF counterpart.
- `size` names a preset from `PRESETS`; the recipe loader builds the section from `PRESETS[size]` and overlays
  the recipe's other model keys (`MODEL_PRESETS`). A file or override that changes `size` from what its bases set
  drops the model keys they set: those were chosen for the other size, so `base: tiny.yaml` + `size: small` is
  the small preset. The dataclass defaults equal the `tiny` preset.
- The backend names each op accepts (`BACKEND_NAMES`) come from `moela.ops.backends`, which imports nothing, so
  loading a recipe imports no kernels.
- The presets are pretraining shapes: `v2-lite` and `v3` have YaRN off (DeepSeek extends context after
  pretraining); set `rope_scaling` to train long-context stages. `v2-lite` takes DeepSeek-V2-Lite's sizes only:
  its routing is moela's (V3's sigmoid gate with a balancing bias), not V2's softmax gate, so V2-Lite checkpoints
  do not load (`hf.py` refuses softmax-routed configs).
- `validate()` returns messages `"<field>: <what is wrong>; <how to fix>"`; the loader prefixes `model.`.
- `kernels` (`KernelsConfig`, YAML `model.kernels.<field>`) holds every choice of implementation inside an op; the
  model passes each one down to its op as a keyword argument, never through module state. The defaults (`auto`)
  take the fastest measured for the call, and the op logs which ran and why.
"""

from __future__ import annotations

import difflib
import importlib.util
from dataclasses import dataclass, field, fields
from typing import Literal

from moela.configlib import Presets
from moela.ops.backends import ATTENTION_BACKENDS, ATTENTION_KERNELS, MOE_BACKENDS

# model key -> the backends its op accepts (`moela.ops.backends` imports nothing: loading a recipe imports no kernel)
BACKEND_NAMES: dict[str, tuple[str, ...]] = {"attention_backend": ATTENTION_BACKENDS, "moe_backend": MOE_BACKENDS}


@dataclass
class RopeScaling:
    """YaRN context extension (HF `rope_scaling` with `type: yarn`), with transformers' meaning for every key: 0 for
    `mscale` or `mscale_all_dim` means absent (no softmax rescaling without `mscale_all_dim`; cos / sin scaled by
    0.1 ln(factor) + 1 unless both are set or `attention_factor` is)."""

    type: Literal["yarn"] = "yarn"
    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    attention_factor: float | None = None  # the cos / sin scale; null: from factor, mscale and mscale_all_dim
    truncate: bool = True  # round the correction range to whole dimensions (floor / ceil), as YaRN does


@dataclass(frozen=True)
class KernelsConfig:
    """Which kernel runs each phase of an op where moela has more than one (YAML `model.kernels.<field>`), each
    `auto` by default: the kernel measured fastest for the call among those that can run it, logged once per
    reason."""

    # Attention, where the `triton` backend runs (`model.attention_backend: triton`, or auto choosing it;
    # moela.ops.attention.phases): "triton" runs on any CUDA GPU; "gluon" is Hopper-only (bf16, no ALiBi), and
    # auto takes it wherever it supports the call, except dK/dV at head dims over 160 (Dqk + Dv)
    attention_forward: Literal["auto", "triton", "gluon"] = "auto"
    attention_dq: Literal["auto", "triton", "gluon"] = "auto"
    attention_dkdv: Literal["auto", "triton", "gluon"] = "auto"

    # MoE
    # the routed experts' FP8 forward and data-gradient GEMMs: auto (Gluon on Hopper, else Triton) | gluon | triton
    moe_fp8_gemm: Literal["auto", "gluon", "triton"] = "auto"
    # the routed experts' FP8 weight-gradient GEMM: auto (Gluon on Hopper, else Triton) | gluon | triton
    moe_fp8_wgrad: Literal["auto", "gluon", "triton"] = "auto"

    def problems(self, attention_backend: str) -> list[str]:
        """`ModelConfig.validate`'s messages for the attention kernels (it knows the attention backend)."""
        errors = []
        for name in ("attention_forward", "attention_dq", "attention_dkdv"):
            value = getattr(self, name)
            if value not in ATTENTION_KERNELS:
                close = difflib.get_close_matches(str(value), ATTENTION_KERNELS, n=1, cutoff=0.6)
                errors.append(f"kernels.{name}: unknown kernel {value!r}; choose one of {', '.join(ATTENTION_KERNELS)}"
                              + (f" (did you mean {close[0]!r}?)" if close else ""))
            elif value != "auto" and attention_backend not in ("auto", "triton"):
                errors.append(f"kernels.{name}: {value!r} is one of moela's attention kernels, which "
                              f"attention_backend {attention_backend!r} does not run; set attention_backend: triton "
                              f"or kernels.{name}: auto")
        return errors


@dataclass
class ModelConfig:
    size: str = "tiny"
    # --- HF deepseek_v3 keys ---
    vocab_size: int = 4096  # the bundled BPE tokenizer
    hidden_size: int = 128
    intermediate_size: int = 352  # dense FFN width (first_k_dense_replace layers)
    moe_intermediate_size: int = 64  # width of one routed / shared expert
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 1  # the first k layers use a dense FFN instead of MoE
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 2  # expert groups for group-limited routing (1 = unrestricted)
    topk_group: int = 1  # groups a token may route to
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    q_lora_rank: int | None = 64  # None: q projected directly from the hidden state
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    num_attention_heads: int = 4
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1  # MTP depth
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02  # std of every weight matrix at init
    # --- ours ---
    block: Literal["standard", "fal", "fal_plus"] = "standard"
    qk_norm: Literal["none", "head", "layer"] = "none"
    bias_update_rate: float = 1e-3  # aux-loss-free balancing: bias step per optimizer step (sign-based)
    aux_loss_coef: float = 1e-4  # sequence-wise balance loss (per document), 0 disables
    mtp_loss_weight: float = 0.3  # lambda: weight of the mean MTP loss over depths
    z_loss_coef: float = 0.0  # attention z-loss: coef * mean(lse**2), 0 disables
    attention_backend: str = "auto"
    moe_backend: str = "auto"
    moe_recipe: Literal["bf16", "fp8_blockwise"] = "bf16"  # fp8_blockwise: an alias of precision fp8_experts
    # bf16 | fp8_experts (routed experts in DeepSeek-V3's FP8) | fp8 (also the attention projections, shared
    # experts, dense FFNs and MTP eh_proj); embedding, output head, router, norms and attention core stay bf16
    precision: Literal["bf16", "fp8_experts", "fp8"] = "bf16"
    kernels: KernelsConfig = field(default_factory=KernelsConfig)

    @property
    def expert_recipe(self) -> str:
        """The routed experts' `moe_experts` recipe: FP8 under either FP8 precision or the `moe_recipe` alias."""
        return "fp8_blockwise" if self.precision != "bf16" or self.moe_recipe == "fp8_blockwise" else "bf16"

    @property
    def fp8_linears(self) -> bool:
        """Whether the projections outside the routed experts run in FP8 (moela.ops.fp8_linear)."""
        return self.precision == "fp8"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        """MoE layers in the main stack (MTP blocks come on top, see `num_moe_blocks`)."""
        return max(0, self.num_hidden_layers - self.first_k_dense_replace)

    @property
    def mtp_is_moe(self) -> bool:
        """MTP blocks copy the last main layer's FFN kind (DeepSeek-V3's MTP layer is an MoE layer)."""
        return self.num_hidden_layers > self.first_k_dense_replace

    @property
    def num_moe_blocks(self) -> int:
        """Rows of `expert_load`: main MoE layers, then MoE MTP blocks."""
        return self.num_moe_layers + (self.num_nextn_predict_layers if self.mtp_is_moe else 0)

    def validate(self) -> list[str]:
        errors = []
        positive = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "kv_lora_rank",
                    "qk_nope_head_dim", "v_head_dim", "num_attention_heads", "max_position_embeddings")
        for name in positive:
            if getattr(self, name) < 1:
                errors.append(f"{name}: must be >= 1, got {getattr(self, name)}; set a positive value")
        for name in ("first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers", "bias_update_rate",
                     "aux_loss_coef", "mtp_loss_weight", "z_loss_coef", "qk_rope_head_dim"):
            if getattr(self, name) < 0:
                errors.append(f"{name}: must be >= 0, got {getattr(self, name)}; set 0 to disable")
        if self.qk_rope_head_dim % 2:
            errors.append(f"qk_rope_head_dim: must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}; "
                          f"use e.g. {self.qk_rope_head_dim + 1}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            errors.append(f"q_lora_rank: must be >= 1 or null (no q compression), got {self.q_lora_rank}")
        if self.n_group >= 1 and self.n_routed_experts % self.n_group:
            errors.append(f"n_group: n_routed_experts={self.n_routed_experts} is not divisible by "
                          f"n_group={self.n_group}; pick n_group dividing the expert count")
        elif self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            errors.append(f"n_group: each group needs >= 2 experts (group score = sum of its top-2), got "
                          f"{self.n_routed_experts // self.n_group}; lower n_group")
        if self.topk_group > self.n_group:
            errors.append(f"topk_group: {self.topk_group} > n_group={self.n_group}; set topk_group <= n_group")
        elif self.n_group >= 1 and self.n_routed_experts % self.n_group == 0:
            reachable = self.topk_group * (self.n_routed_experts // self.n_group)
            if self.num_experts_per_tok > reachable:
                errors.append(f"num_experts_per_tok: {self.num_experts_per_tok} experts cannot be chosen from "
                              f"topk_group={self.topk_group} groups of {self.n_routed_experts // self.n_group}; "
                              f"raise topk_group or lower num_experts_per_tok")
        if self.num_experts_per_tok > self.n_routed_experts:
            errors.append(f"num_experts_per_tok: {self.num_experts_per_tok} > n_routed_experts="
                          f"{self.n_routed_experts}; lower it")
        if self.first_k_dense_replace > self.num_hidden_layers:
            errors.append(f"first_k_dense_replace: {self.first_k_dense_replace} > num_hidden_layers="
                          f"{self.num_hidden_layers}; at most every layer can be dense")
        if self.block != "standard" and self.num_hidden_layers < 2:
            errors.append(f"block: {self.block!r} needs num_hidden_layers >= 2 (layer 1 provides a1); use "
                          f"block: standard")
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            if rs.factor < 1:
                errors.append(f"rope_scaling.factor: must be >= 1, got {rs.factor}")
            if rs.original_max_position_embeddings < 1:
                errors.append("rope_scaling.original_max_position_embeddings: must be >= 1; set the pretraining "
                              "context length")
        if self.rms_norm_eps <= 0:
            errors.append(f"rms_norm_eps: must be > 0, got {self.rms_norm_eps}")
        if self.initializer_range <= 0:
            errors.append(f"initializer_range: must be > 0, got {self.initializer_range}")
        for name, known in BACKEND_NAMES.items():
            if getattr(self, name) not in known:
                errors.append(f"{name}: unknown backend {getattr(self, name)!r}; choose one of {', '.join(known)}")
        if self.attention_backend == "flash" and importlib.util.find_spec("flash_attn") is None:
            errors.append("attention_backend: 'flash' needs flash-attn-4, which is not installed; pip install "
                          "'moela[flash]' (Hopper / Blackwell GPUs), or use auto")
        errors += self.kernels.problems(self.attention_backend)
        if self.size not in PRESETS:
            errors.append(f"size: unknown preset {self.size!r}; choose one of {', '.join(PRESETS)}")
        return errors


_SHAPE_KEYS = [f.name for f in fields(ModelConfig)][1:[f.name for f in fields(ModelConfig)].index("block")]
_TINY = {name: getattr(ModelConfig(), name) for name in _SHAPE_KEYS}

PRESETS: dict[str, dict] = {
    "tiny": dict(_TINY),
    "small": dict(
        vocab_size=32768, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
        num_hidden_layers=12, first_k_dense_replace=1, n_routed_experts=32, n_shared_experts=1,
        num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=1.0, norm_topk_prob=True,
        q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        num_attention_heads=16, max_position_embeddings=4096, num_nextn_predict_layers=1,
    ),
    "v2-lite": dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, first_k_dense_replace=1, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_attention_heads=16, max_position_embeddings=4096, num_nextn_predict_layers=0,
    ),
    "v3": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_attention_heads=128, max_position_embeddings=4096, num_nextn_predict_layers=1,
        initializer_range=0.006,
    ),
}


MODEL_PRESETS = Presets(key="size", table=PRESETS, default=ModelConfig().size)


def preset(size: str, **overrides) -> ModelConfig:
    """`ModelConfig` of a named size with keyword overrides (what the recipe loader does, for code and tests)."""
    if size not in PRESETS:
        raise ValueError(f"model.size: unknown preset {size!r}; choose one of {', '.join(PRESETS)}")
    cfg = ModelConfig(size=size, **{**PRESETS[size], **overrides})
    errors = cfg.validate()
    if errors:
        raise ValueError("invalid model config:\n  " + "\n  ".join(errors))
    return cfg
