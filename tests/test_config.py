"""Recipe loading: strict keys with did-you-mean, typing, base inheritance, overrides, validation, round trip."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from moela.config import Config, ConfigError, dump_config, load_config, parse_override
from moela.configlib import Presets, load
from moela.model.config import BACKEND_NAMES, PRESETS

ROOT = Path(__file__).resolve().parents[1]


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def errors_of(path, overrides=()):
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return info.value.errors


def test_defaults_load_and_equal_dataclass_defaults():
    cfg = load_config(None)
    assert cfg == Config()


def test_unknown_keys_name_file_path_and_suggestion(tmp_path):
    recipe = write(tmp_path / "r.yaml", """
        optim:
          weight_decy: 0.1
        traning:
          steps: 3
        logging:
          wandb: {projet: x}
    """)
    errors = errors_of(recipe)
    assert len(errors) == 3, errors
    joined = "\n".join(errors)
    assert f"{recipe}: optim.weight_decy: unknown key" in joined and "did you mean 'weight_decay'" in joined
    assert f"{recipe}: traning: unknown key" in joined and "did you mean 'train'" in joined
    assert "logging.wandb.projet" in joined and "did you mean 'project'" in joined


def test_type_errors_and_coercion_rules(tmp_path):
    recipe = write(tmp_path / "r.yaml", """
        optim: {lr: fast, weight_decay: 0}
        train: {steps: 2.5, grad_accum: true, device: gpu}
        logging: {wandb: {tags: [a, 3]}}
    """)
    errors = errors_of(recipe)
    joined = "\n".join(errors)
    assert "optim.lr: expected a number, got 'fast'" in joined
    assert "train.steps: expected an integer, got 2.5" in joined
    assert "train.grad_accum: expected an integer, got True" in joined
    assert "train.device: expected one of 'auto', 'cpu', 'cuda', got 'gpu'" in joined
    assert "logging.wandb.tags[1]: expected a string, got 3" in joined
    assert "weight_decay" not in joined  # an int where a float is expected is fine
    assert len(errors) == 5


def test_yaml_float_forms_and_int_to_float(tmp_path):
    recipe = write(tmp_path / "r.yaml", """
        optim: {lr: 1e-3, eps: 1.5E-8, weight_decay: 0}
    """)
    cfg = load_config(recipe)
    assert cfg.optim.lr == 1e-3 and cfg.optim.eps == 1.5e-8
    assert isinstance(cfg.optim.weight_decay, float) and cfg.optim.weight_decay == 0.0


def test_base_inheritance_merges_and_child_wins(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "grand.yaml", """
        train: {steps: 11, seed: 7}
        optim: {lr: 0.5}
    """)
    write(tmp_path / "sub" / "base.yaml", """
        base: grand.yaml
        train: {steps: 12, grad_accum: 3}
        model: {size: tiny, hidden_size: 96}
    """)
    write(tmp_path / "other.yaml", """
        optim: {beta2: 0.99}
    """)
    child = write(tmp_path / "child.yaml", """
        base: [sub/base.yaml, other.yaml]
        train: {steps: 13}
        schedule: {warmup_steps: 2}
    """)
    cfg = load_config(child)
    assert (cfg.train.steps, cfg.train.seed, cfg.train.grad_accum) == (13, 7, 3)
    assert cfg.optim.lr == 0.5 and cfg.optim.beta2 == 0.99
    assert cfg.model.hidden_size == 96 and cfg.model.num_hidden_layers == PRESETS["tiny"]["num_hidden_layers"]


def test_error_names_the_base_file_that_set_the_key(tmp_path):
    base = write(tmp_path / "base.yaml", """
        optim: {lr: 0.1, bta1: 0.9}
    """)
    child = write(tmp_path / "child.yaml", """
        base: base.yaml
        optim: {lr: 0.2}
    """)
    (error,) = errors_of(child)
    assert error.startswith(f"{base}: optim.bta1: unknown key") and "did you mean 'beta1'" in error


def test_base_cycle_and_missing_base(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    assert any("inheritance cycle" in e for e in errors_of(tmp_path / "a.yaml"))
    write(tmp_path / "c.yaml", "base: nowhere.yaml\n")
    (error,) = errors_of(tmp_path / "c.yaml")
    assert "nowhere.yaml: file not found" in error


def test_overrides_are_typed_by_yaml_and_win(tmp_path):
    recipe = write(tmp_path / "r.yaml", """
        optim: {lr: 0.1}
        logging: {wandb: {name: run}}
    """)
    cfg = load_config(recipe, ["optim.lr=2e-4", "logging.wandb.name=null", "logging.wandb.tags=[x, y]",
                               "optim.fused=false", "model.rope_scaling={factor: 4}", "train.run_dir=out/1"])
    assert cfg.optim.lr == 2e-4 and cfg.logging.wandb.name is None and cfg.logging.wandb.tags == ["x", "y"]
    assert cfg.optim.fused is False and cfg.model.rope_scaling.factor == 4.0 and cfg.train.run_dir == "out/1"
    assert parse_override("a.b=c=d") == (["a", "b"], "c=d")


def test_lists_of_sections(tmp_path):
    recipe = write(tmp_path / "r.yaml", f"""
        data:
          mixture:
            - {{source: bundled, weight: 2}}
            - {{source: text, paths: [{tmp_path / 'r.yaml'}], wieght: 1}}
    """)
    (error,) = errors_of(recipe)
    assert error == (f"{recipe}: data.mixture[1].wieght: unknown key in section 'data.mixture[1]'; "
                     f"did you mean 'weight'?")
    cfg = load_config(recipe, ["data.mixture=[{source: bundled, weight: 3}]"])
    assert len(cfg.data.mixture) == 1 and cfg.data.mixture[0].weight == 3.0


def test_bad_overrides_are_reported_with_the_recipe_errors(tmp_path):
    recipe = write(tmp_path / "r.yaml", "optim: {lrr: 1}\n")
    errors = errors_of(recipe, ["optim.lr", "=3", "train.stepz=4"])
    assert len(errors) == 2  # malformed overrides stop before typing, and are all reported
    assert all(e.startswith("command line: override") for e in errors)
    errors = errors_of(recipe, ["train.stepz=4", "optim.beta1=x"])
    joined = "\n".join(errors)
    assert "command line: train.stepz: unknown key" in joined and "did you mean 'steps'" in joined
    assert "command line: optim.beta1: expected a number" in joined and f"{recipe}: optim.lrr" in joined


def test_section_validation_messages_are_prefixed(tmp_path):
    recipe = write(tmp_path / "r.yaml", """
        model: {n_group: 2, topk_group: 3}
        optim: {lr: -1}
        parallel: {ep: 3}
    """)
    errors = errors_of(recipe)
    joined = "\n".join(errors)
    assert f"{recipe}: model.topk_group: 3 > n_group=2" in joined
    assert f"{recipe}: optim.lr: must be > 0" in joined
    assert f"{recipe}: parallel.ep: 3 does not divide model.n_routed_experts=8" in joined


def test_a_type_error_does_not_hide_the_other_problems_of_its_section(tmp_path):
    recipe = write(tmp_path / "r.yaml", """
        optim: {lr: fast, weight_decay: -1}
        train: {steps: ten, tokens_per_microbatch: -5}
    """)
    assert sorted(errors_of(recipe)) == sorted([
        f"{recipe}: optim.lr: expected a number, got 'fast' (str)",
        f"{recipe}: optim.weight_decay: must be >= 0, got -1.0",
        f"{recipe}: train.steps: expected an integer, got 'ten' (str)",
        f"{recipe}: train.tokens_per_microbatch: must be >= 2, got -5"])


def test_model_preset_overlay_and_unknown_size(tmp_path):
    recipe = write(tmp_path / "r.yaml", "model: {size: small, num_hidden_layers: 3}\n")
    cfg = load_config(recipe)
    assert cfg.model.size == "small" and cfg.model.hidden_size == PRESETS["small"]["hidden_size"]
    assert cfg.model.num_hidden_layers == 3
    (error,) = errors_of(recipe, ["model.size=smal"])
    assert "command line: model.size: unknown preset 'smal'" in error and "did you mean 'small'" in error


def test_changing_model_size_drops_the_model_keys_set_for_the_old_size(tmp_path):
    base = write(tmp_path / "base.yaml", """
        model: {hidden_size: 96, num_hidden_layers: 3, qk_norm: head}
        train: {steps: 5}
    """)
    same = write(tmp_path / "same.yaml", "base: base.yaml\nmodel: {size: tiny, n_routed_experts: 4}\n")
    cfg = load_config(same)
    assert (cfg.model.hidden_size, cfg.model.num_hidden_layers, cfg.model.n_routed_experts) == (96, 3, 4)
    bigger = write(tmp_path / "bigger.yaml", "base: base.yaml\nmodel: {size: small, num_hidden_layers: 2}\n")
    cfg = load_config(bigger)
    assert cfg.model.hidden_size == PRESETS["small"]["hidden_size"] and cfg.model.num_hidden_layers == 2
    assert cfg.model.qk_norm == "none" and cfg.train.steps == 5  # only the model section starts afresh
    cfg = load_config(base, ["model.qk_norm=layer", "model.size=small", "model.n_routed_experts=16"])
    assert cfg.model.hidden_size == PRESETS["small"]["hidden_size"] and cfg.model.num_hidden_layers == 12
    assert cfg.model.qk_norm == "layer" and cfg.model.n_routed_experts == 16  # earlier overrides are kept


def test_small_recipe_is_the_small_preset():
    small = load_config(ROOT / "recipes" / "small.yaml")
    for key in ("hidden_size", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok", "q_lora_rank"):
        assert getattr(small.model, key) == PRESETS["small"][key], key
    assert small.model.vocab_size == 4096 and small.train.run_dir == "runs/small"


def test_invalid_yaml_and_non_mapping(tmp_path):
    bad = write(tmp_path / "bad.yaml", "optim:\n  lr: [1, 2\n")
    (error,) = errors_of(bad)
    assert error.startswith(f"{bad}: invalid YAML at line") and "fix the syntax" in error
    scalar = write(tmp_path / "scalar.yaml", "42\n")
    (error,) = errors_of(scalar)
    assert "must be a mapping of sections" in error
    section = write(tmp_path / "section.yaml", "optim: 3\n")
    (error,) = errors_of(section)
    assert "optim: expected a mapping" in error
    assert "file not found" in errors_of(tmp_path / "missing.yaml")[0]


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["model.size=small", "model.q_lora_rank=null", "optim.lr=1e-3", "logging.wandb.tags=[a]",
                             "model.rope_scaling={factor: 8}", "schedule.kind=wsd"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter has imported after running `code` in the repository root."""
    script = f"import sys\n{code}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_loading_a_recipe_imports_no_kernels():
    modules = _modules_after("import moela.config\nmoela.config.load_config('recipes/small.yaml')")
    assert "moela.config" in modules
    kernels = sorted(m for m in modules if m == "triton" or m.startswith(("triton.", "moela.ops.attention",
                                                                          "moela.ops.moe", "moela.model.transformer")))
    assert not kernels, kernels
    loader = _modules_after("import moela.configlib")
    assert sorted(m for m in loader if m.startswith("moela")) == ["moela", "moela.configlib"]


def test_backend_names_are_the_ops_backends():
    from moela.ops.attention.api import DISPATCH as attention
    from moela.ops.moe.api import DISPATCH as moe

    assert BACKEND_NAMES == {"attention_backend": attention.names, "moe_backend": moe.names}


@dataclass
class _Shape:
    kind: str = "square"
    width: int = 1
    height: int = 1


@dataclass
class _Run:
    name: str = "x"


@dataclass
class _Doc:
    shape: _Shape = field(default_factory=_Shape)
    run: _Run = field(default_factory=_Run)


def test_loader_is_generic_over_schemas_and_presets(tmp_path):
    """The loader on a schema of its own: preset sections, inheritance and overrides without any moela section."""
    rule = Presets(key="kind", table={"square": dict(width=2, height=2), "strip": dict(width=9, height=1)},
                   default="square")
    base = write(tmp_path / "base.yaml", "shape: {width: 5}\nrun: {name: a}\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\nshape: {kind: strip}\n")
    assert load(_Doc, base, presets={"shape": rule}) == _Doc(_Shape("square", 5, 2), _Run("a"))
    assert load(_Doc, child, presets={"shape": rule}) == _Doc(_Shape("strip", 9, 1), _Run("a"))
    assert load(_Doc, child, ["shape.height=3"], presets={"shape": rule}).shape == _Shape("strip", 9, 3)
    with pytest.raises(ConfigError) as info:
        load(_Doc, child, ["shape.kind=stripe", "run.nme=b"], presets={"shape": rule})
    assert info.value.errors == ["command line: shape.kind: unknown preset 'stripe'; choose one of square, strip; "
                                 "did you mean 'strip'?",
                                 "command line: run.nme: unknown key in section 'run'; did you mean 'name'?"]


def test_a_named_moe_backend_the_recipe_rules_out_is_a_recipe_error():
    """Named fast MoE backends need 128-aligned expert shapes, `torch_triton` runs bf16 experts only, `cublas` FP8 only:
    recipe errors naming the fix, not a ValueError from inside the first forward. `auto` and `reference` run
    anything."""
    errors = errors_of(None, ["model.moe_backend=cublas"])  # the default model: 128 wide, experts 64
    assert any("'cublas' needs D and F (hidden_size, moe_intermediate_size) multiples of 128, got D=128, F=64" in e
               for e in errors)
    assert any("'cublas' (blockwise FP8 torch._scaled_mm) runs only recipe='fp8_blockwise'" in e for e in errors)
    wide = ["model.hidden_size=256", "model.moe_intermediate_size=128"]
    assert any("'torch_triton' (torch._grouped_mm) runs only recipe='bf16'" in e
               for e in errors_of(None, ["model.moe_backend=torch_triton", "model.precision=fp8_experts", *wide]))
    for name in ("triton", "deep_gemm"):
        load_config(None, [f"model.moe_backend={name}", "model.precision=fp8", *wide])
    for name in ("auto", "reference"):
        load_config(None, [f"model.moe_backend={name}"])
