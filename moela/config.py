"""The recipe schema and its strict loader: YAML files with `base:` inheritance and typed `a.b=value` overrides.

A recipe is a YAML mapping whose top-level keys are the sections of `Config` (model, data, optim, schedule,
train, checkpoint, logging, parallel). Every section is a plain dataclass; the loader maps YAML onto it field by
field, and the dataclass is the only source of truth for names, types and defaults.

Decisions:
- Strict: an unknown key is an error with a did-you-mean suggestion, a value of the wrong type is an error (an
  int is accepted where a float is expected, nothing else is coerced). All errors of a recipe are collected and
  raised together as one `ConfigError`, each naming the file that set the key and the full key path.
- `base: other.yaml` (or a list of files) is resolved relative to the including file; the including file's keys
  win, mappings merge key by key, everything else is replaced.
- Overrides `a.b=value` are parsed with YAML rules (`lr=1e-3` is a float, `name=null` is None, `x=[1,2]` a list)
  and applied after all files, so they win over everything.
- The model section starts from `PRESETS[model.size]` and the recipe's other model keys overlay the preset. A
  file (or an override) that changes `model.size` from what its bases (or the recipe) set drops the model keys
  they set: those were chosen for the other size, so `base: tiny.yaml` + `size: small` is the small preset.
- After typing, each section's `validate() -> list[str]` runs (messages `"<field>: <problem>; <fix>"`), and its
  messages are reported with the section path in front.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from moela.data.config import DataConfig
from moela.model.config import PRESETS, ModelConfig
from moela.parallel.config import ParallelConfig

OVERRIDE_SOURCE = "command line"


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` as a float (YAML 1.2 rule; PyYAML's 1.1 rules need `1.0e-3`)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


@dataclass
class OptimConfig:
    lr: float = 3e-4  # peak learning rate (reached at the end of warmup)
    weight_decay: float = 0.1  # decoupled AdamW decay; never applied to norms, biases, embeddings, router bias
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient L2 norm; 0 disables clipping (the norm is still logged)
    fused: bool = True  # use the fused CUDA AdamW kernel when training on CUDA (ignored on CPU)

    def validate(self) -> list[str]:
        errors = []
        if self.lr <= 0:
            errors.append(f"lr: must be > 0, got {self.lr}; set a positive learning rate such as 3e-4")
        if self.weight_decay < 0:
            errors.append(f"weight_decay: must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                errors.append(f"{name}: must be in [0, 1), got {getattr(self, name)}")
        if self.eps <= 0:
            errors.append(f"eps: must be > 0, got {self.eps}")
        if self.grad_clip < 0:
            errors.append(f"grad_clip: must be >= 0 (0 disables clipping), got {self.grad_clip}")
        return errors


@dataclass
class ScheduleConfig:
    kind: Literal["cosine", "wsd", "constant"] = "cosine"  # cosine: warmup + cosine decay; wsd: warmup-stable-decay
    warmup_steps: int = 100  # linear warmup from 0 to optim.lr
    min_lr_ratio: float = 0.1  # final learning rate as a fraction of optim.lr (cosine and wsd)
    decay_fraction: float = 0.2  # wsd: fraction of train.steps spent in the final decay
    decay_shape: Literal["linear", "sqrt", "cosine"] = "sqrt"  # wsd: shape of the final decay (sqrt = 1 - sqrt)

    def validate(self) -> list[str]:
        errors = []
        if self.warmup_steps < 0:
            errors.append(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            errors.append(f"min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 < self.decay_fraction <= 1:
            errors.append(f"decay_fraction: must be in (0, 1], got {self.decay_fraction}")
        return errors


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps to train for
    tokens_per_microbatch: int = 4096  # token budget of one packed micro-batch (documents concatenated, no padding)
    grad_accum: int = 1  # micro-batches per optimizer step on each data-parallel rank
    seed: int = 0  # seeds model init, data order and every RNG (resume restores the RNG state)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available, else cpu
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on cuda, fp32 on cpu
    cpu_threads: int = 0  # torch intra-op threads on CPU (0: torch's default, one per core); 1 is fastest on a busy CPU
    eval_every: int = 100  # run the validation loop every N steps (0: only at the end)
    eval_batches: int = 0  # validation micro-batches per evaluation (0: the whole held-out split)
    max_nonfinite_steps: int = 5  # stop after this many consecutive skipped (non-finite loss or grad) steps
    run_dir: str = "runs/default"  # holds config.yaml, metrics.jsonl, checkpoints/ and loss.png

    def validate(self) -> list[str]:
        errors = []
        if self.steps < 1:
            errors.append(f"steps: must be >= 1, got {self.steps}")
        if self.tokens_per_microbatch < 2:
            errors.append(f"tokens_per_microbatch: must be >= 2, got {self.tokens_per_microbatch}")
        if self.grad_accum < 1:
            errors.append(f"grad_accum: must be >= 1, got {self.grad_accum}")
        if self.eval_every < 0 or self.eval_batches < 0:
            errors.append("eval_every / eval_batches: must be >= 0 (0 means only at the end / all batches)")
        if self.cpu_threads < 0:
            errors.append(f"cpu_threads: must be >= 0 (0 = torch default), got {self.cpu_threads}")
        if self.max_nonfinite_steps < 1:
            errors.append(f"max_nonfinite_steps: must be >= 1, got {self.max_nonfinite_steps}")
        if not self.run_dir:
            errors.append("run_dir: must not be empty; name a directory such as runs/tiny")
        return errors


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps (0: only at the end and on SIGTERM/SIGINT)
    keep_last_k: int = 2  # complete checkpoints kept in run_dir/checkpoints (older ones are deleted)
    resume: str = "auto"  # auto: newest complete checkpoint in run_dir if any; none: start fresh; or a step-N path
    save_at_end: bool = True  # save a checkpoint after the last step

    def validate(self) -> list[str]:
        errors = []
        if self.every < 0:
            errors.append(f"every: must be >= 0 (0 = only at the end), got {self.every}")
        if self.keep_last_k < 1:
            errors.append(f"keep_last_k: must be >= 1, got {self.keep_last_k}")
        if not self.resume:
            errors.append("resume: must be 'auto', 'none' or a checkpoint directory")
        return errors


@dataclass
class WandbConfig:
    mode: Literal["disabled", "offline", "online"] = "disabled"  # offline writes run_dir/wandb for `wandb sync`
    project: str = "moela"
    entity: str | None = None
    name: str | None = None  # run name; defaults to the run directory's name
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    log_every: int = 10  # print the step line and append to metrics.jsonl every N steps
    progress_bar: Literal["auto", "always", "never"] = "auto"  # auto: a tqdm bar when stdout is a terminal
    plot: bool = True  # write run_dir/loss.png at the end
    peak_tflops: float | None = None  # device peak (dense bf16, per device) for MFU; null: looked up by GPU name
    # [first, last]: profile these optimizer steps with torch.profiler (traces and op tables in run_dir/profile,
    # a `profile` record with the collectives' shares in metrics.jsonl); null: no profiling
    profile_steps: list[int] | None = None
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def validate(self) -> list[str]:
        errors = []
        if self.log_every < 1:
            errors.append(f"log_every: must be >= 1, got {self.log_every}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            errors.append(f"peak_tflops: must be > 0 or null (look up by GPU name), got {self.peak_tflops}")
        p = self.profile_steps
        if p is not None and (len(p) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in p)
                              or not 1 <= p[0] <= p[1]):
            errors.append(f"profile_steps: must be [first, last] optimizer steps with 1 <= first <= last (e.g. "
                          f"[20, 22]) or null, got {p}")
        return errors


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self) -> list[str]:
        """Checks that span sections (each section validates its own fields)."""
        errors = []
        if self.parallel.ep > 1 and self.model.n_routed_experts % self.parallel.ep:
            errors.append(f"parallel.ep: {self.parallel.ep} does not divide model.n_routed_experts="
                          f"{self.model.n_routed_experts}; pick an ep that divides the expert count")
        return errors


class ConfigError(Exception):
    """One or more problems in a recipe; `errors` holds every message, each naming file and key path."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


# ---------------------------------------------------------------------------------------------------------------
# Reading YAML files (with base inheritance) into one mapping plus the file that set each key.


def _read_yaml(path: Path, errors: list[str]) -> dict | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        errors.append(f"{path}: file not found; check the recipe path")
        return None
    except OSError as e:
        errors.append(f"{path}: cannot read ({e.strerror})")
        return None
    try:
        data = yaml.load(text, Loader=_YamlLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        errors.append(f"{path}: invalid YAML{where}: {problem}; fix the syntax")
        return None
    if data is None:
        return {}
    if not isinstance(data, dict):
        errors.append(f"{path}: a recipe must be a mapping of sections (model:, train:, ...), "
                      f"got {type(data).__name__}")
        return None
    return data


def _merge(dst: dict, src: dict, sources: dict, prefix: str = "") -> None:
    """Overlay `src` onto `dst` in place: mappings merge key by key, other values replace (and forget their
    recorded sources, which the caller then sets from `src`'s)."""
    for key, value in src.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value, sources, path + ".")
            continue
        dst[key] = value
        for p in [p for p in sources if p == path or p.startswith(path + ".")]:
            del sources[p]


def _record_sources(data: dict, source: str, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        out[f"{prefix}{key}"] = source
        if isinstance(value, dict):
            out.update(_record_sources(value, source, f"{prefix}{key}."))
    return out


def _load_tree(path: Path, errors: list[str], chain: tuple[Path, ...] = ()) -> tuple[dict, dict]:
    """The merged mapping of `path` and its bases, and {key path: file that set it}."""
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        errors.append(f"{path}: base: inheritance cycle ({cycle}); remove one of the base: lines")
        return {}, {}
    data = _read_yaml(path, errors)
    if data is None:
        return {}, {}
    bases = data.pop("base", None)
    if bases is None:
        bases = []
    elif isinstance(bases, str):
        bases = [bases]
    elif not (isinstance(bases, list) and all(isinstance(b, str) for b in bases)):
        errors.append(f"{path}: base: must be a file name or a list of file names, got {bases!r}")
        bases = []
    merged: dict = {}
    sources: dict = {}
    for base in bases:
        base_data, base_sources = _load_tree(path.parent / base, errors, (*chain, resolved))
        _merge(merged, base_data, sources)
        sources.update(base_sources)
    model = data.get("model")
    if isinstance(model, dict) and "size" in model:
        _drop_model_keys_of_other_size(merged, sources, model["size"], keep=lambda source: False)
    _merge(merged, data, sources)
    sources.update(_record_sources(data, str(path)))
    return merged, sources


def _drop_model_keys_of_other_size(tree: dict, sources: dict, size: Any, keep) -> None:
    """Before `model.size` changes to `size`: drop the model keys set so far (except those whose source `keep`
    accepts), since they were chosen for the previous size and would silently overlay the new preset."""
    model = tree.get("model")
    if not isinstance(model, dict) or model.get("size", ModelConfig().size) == size:
        return
    for key in list(model):
        if not keep(sources.get(f"model.{key}")):
            del model[key]
            for p in [p for p in sources if p == f"model.{key}" or p.startswith(f"model.{key}.")]:
                del sources[p]


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value typed by YAML rules). Raises ValueError with a usage hint."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ValueError(f"override {text!r}: expected section.key=value, e.g. optim.lr=1e-3")
    try:
        value = yaml.load(raw, Loader=_YamlLoader) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


# ---------------------------------------------------------------------------------------------------------------
# Typing a mapping onto the dataclasses.

_MISSING = object()


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of {_type_name(typing.get_args(tp)[1])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(tp, str(tp))


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _convert(value: Any, tp: Any, path: str, sources: dict, errors: list[str]) -> Any:
    """`value` as type `tp`, or _MISSING after appending an error."""
    def fail(extra: str = "") -> Any:
        shown = repr(value) if not isinstance(value, dict) else "a mapping"
        errors.append(f"{_source_of(path, sources)}: {path}: expected {_type_name(tp)}, got {shown}"
                      f" ({type(value).__name__}){extra}")
        return _MISSING

    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            return fail()
        return _build(tp, value, path, sources, errors)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value in args and not (isinstance(value, bool) and not any(isinstance(a, bool) for a in args)):
            return value
        return fail(_suggest(value, args))
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        candidates = [a for a in args if a is not type(None)]
        if len(candidates) == 1 and value is not None:
            return _convert(value, candidates[0], path, sources, errors)
        for arg in args:
            if arg is type(None):
                continue
            trial: list[str] = []
            converted = _convert(value, arg, path, sources, trial)
            if not trial:
                return converted
        return fail()
    if origin in (list, tuple):
        if not isinstance(value, list):
            return fail()
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, f"{path}[{i}]", sources, errors) for i, v in enumerate(value)]
        if any(v is _MISSING for v in items):
            return _MISSING
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            return fail()
        val_tp = args[1] if args else Any
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                errors.append(f"{_source_of(path, sources)}: {path}: keys must be strings, got {k!r}")
                return _MISSING
            out[k] = _convert(v, val_tp, f"{path}.{k}", sources, errors)
        return _MISSING if any(v is _MISSING for v in out.values()) else out
    if tp is bool:
        return value if isinstance(value, bool) else fail()
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else fail()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        return fail()
    if tp is str:
        return value if isinstance(value, str) else fail()
    return value if isinstance(value, tp) else fail()


def _source_of(path: str, sources: dict) -> str:
    while path:
        if path in sources:
            return sources[path]
        path = path[:path.rindex("[")] if path.endswith("]") else path.rpartition(".")[0]
    return sources.get("", "defaults")


def _build(cls: type, data: dict, path: str, sources: dict, errors: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in names:
            section = f"section {path!r}" if path else "the recipe's top level"
            errors.append(f"{_source_of(key_path, sources)}: {key_path}: unknown key in {section}"
                          f"{_suggest(key, names)}")
            continue
        converted = _convert(value, hints[key], key_path, sources, errors)
        if converted is not _MISSING:
            kwargs[key] = converted
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        errors.append(f"{_source_of(path, sources)}: {path or 'recipe'}: {e}")
        return _MISSING
    return obj


def _validate(obj: Any, path: str, errors: list[str], sources: dict) -> None:
    """Run `validate()` of `obj` and of every nested dataclass, prefixing messages with the section path."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _validate(value, f"{path}.{f.name}" if path else f.name, errors, sources)
    check = getattr(obj, "validate", None)
    if callable(check):
        for message in check():
            full = f"{path}.{message}" if path else message
            key = full.split(":", 1)[0].split(" ")[0]
            errors.append(f"{_source_of(key, sources)}: {full}")


def _apply_model_preset(tree: dict, sources: dict, errors: list[str]) -> bool:
    """Replace tree["model"] by PRESETS[size] overlaid with the recipe's model keys; False if size is unknown."""
    model = tree.get("model")
    if model is None:
        model = tree["model"] = {}
    if not isinstance(model, dict):
        return True
    size = model.get("size", ModelConfig().size)
    if not isinstance(size, str) or size not in PRESETS:
        errors.append(f"{_source_of('model.size', sources)}: model.size: unknown preset {size!r}; choose one of "
                      f"{', '.join(PRESETS)}{_suggest(size, PRESETS)}")
        return False
    tree["model"] = {**PRESETS[size], **model, "size": size}
    return True


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Load a recipe (None: defaults only), apply `a.b=value` overrides, type and validate it.

    Raises ConfigError listing every problem found.
    """
    errors: list[str] = []
    tree: dict = {}
    sources: dict = {}
    if path is not None:
        tree, sources = _load_tree(Path(path), errors)
        sources[""] = str(path)
    for text in overrides:
        try:
            keys, value = parse_override(text)
        except ValueError as e:
            errors.append(f"{OVERRIDE_SOURCE}: {e}")
            continue
        if keys == ["model", "size"]:
            _drop_model_keys_of_other_size(tree, sources, value, keep=lambda source: source == OVERRIDE_SOURCE)
        node = tree
        for key in keys[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[keys[-1]] = value
        dotted = ".".join(keys)
        for p in [p for p in sources if p == dotted or p.startswith(dotted + ".")]:
            del sources[p]
        sources[dotted] = OVERRIDE_SOURCE
    if errors:
        raise ConfigError(errors)
    sections = {f.name for f in dataclasses.fields(Config)}
    bad_sections = set() if _apply_model_preset(tree, sources, errors) else {"model"}
    for key, value in tree.items():
        if key in sections and not isinstance(value, dict):
            errors.append(f"{_source_of(key, sources)}: {key}: expected a mapping of keys, got {value!r}")
            bad_sections.add(key)
    kwargs = {}
    for key in tree:
        if key not in sections:
            errors.append(f"{_source_of(key, sources)}: {key}: unknown key in the recipe's top level"
                          f"{_suggest(key, sorted(sections))}")
    invalid: list[str] = []
    for f in dataclasses.fields(Config):
        if f.name not in tree or f.name in bad_sections:
            continue
        before = len(errors)
        section = _build(typing.get_type_hints(Config)[f.name], tree[f.name], f.name, sources, errors)
        if section is _MISSING:
            continue
        kwargs[f.name] = section
        if len(errors) == before:
            _validate(section, f.name, invalid, sources)
    if errors:
        raise ConfigError(errors + invalid)
    cfg = Config(**kwargs)
    for f in dataclasses.fields(Config):
        if f.name not in kwargs:
            _validate(getattr(cfg, f.name), f.name, invalid, sources)
    for message in cfg.validate():
        invalid.append(f"{_source_of(message.split(':', 1)[0], sources)}: {message}")
    if invalid:
        raise ConfigError(invalid)
    return cfg


def to_dict(cfg: Any) -> dict:
    """Plain YAML-serializable mapping of a config (tuples become lists)."""
    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(cfg))


def dump_config(cfg: Config) -> str:
    """The resolved recipe as YAML; loading it back gives an equal Config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False, width=120)
