"""Strict loading of YAML files into nested dataclasses: `base:` inheritance, typed `a.b=value` overrides, every
problem reported at once. Generic: it knows no section of a moela recipe and imports nothing from moela; the
caller passes the top-level dataclass (`moela.config.Config`) and the sections that start from a preset.

The top-level dataclass has one field per section, each a dataclass; a YAML file is a mapping of sections. The
dataclasses are the only source of truth for names, types and defaults.

Decisions:
- Strict: an unknown key is an error with a did-you-mean suggestion, a value of the wrong type is an error (an
  int is accepted where a float is expected, nothing else is coerced; a float must be finite, so `.nan` and `.inf`
  are errors). All errors are collected and raised together as one `ConfigError`, each naming the file that set
  the key and the full key path.
- `base: other.yaml` (or a list of files) is resolved relative to the including file; the including file's keys
  win, mappings merge key by key, everything else is replaced.
- Overrides `a.b=value` are parsed with YAML rules (`lr=1e-3` is a float, `name=null` is None, `x=[1,2]` a list)
  and applied after all files, so they win over everything.
- A preset section (`Presets`) starts from `table[section[key]]` and the file's other keys of that section overlay
  it. A file (or an override) that changes the preset's name from what its bases (or the files) set drops the
  section's keys they set: those were chosen for the other preset, so a file with `base: tiny.yaml` and
  `size: small` gets the small preset.
- After typing, each section's `validate() -> list[str]` runs (messages `"<field>: <problem>; <fix>"`), and its
  messages are reported with the section path in front; then the top level's own `validate()` (checks that span
  sections, messages starting with their full key path).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

OVERRIDE_SOURCE = "command line"


class ConfigError(Exception):
    """One or more problems in a recipe; `errors` holds every message, each naming file and key path."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


@dataclass(frozen=True)
class Presets:
    """A section whose `key` names one entry of `table`, the values its other keys default to."""

    key: str
    table: Mapping[str, Mapping[str, Any]]
    default: str  # the name when a recipe sets none


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` as a float (YAML 1.2 rule; PyYAML's 1.1 rules need `1.0e-3`)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)

_MISSING = object()


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


def _forget(sources: dict, path: str) -> None:
    """Drop the recorded sources of `path` and of every key below it."""
    for p in [p for p in sources if p == path or p.startswith(path + ".")]:
        del sources[p]


def _merge(dst: dict, src: dict, sources: dict, prefix: str = "") -> None:
    """Overlay `src` onto `dst` in place: mappings merge key by key, other values replace (and forget their
    recorded sources, which the caller then sets from `src`'s)."""
    for key, value in src.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value, sources, path + ".")
            continue
        dst[key] = value
        _forget(sources, path)


def _record_sources(data: dict, source: str, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        out[f"{prefix}{key}"] = source
        if isinstance(value, dict):
            out.update(_record_sources(value, source, f"{prefix}{key}."))
    return out


def _drop_keys_of_other_preset(tree: dict, sources: dict, section: str, rule: Presets, name: Any,
                               keep: Callable[[str | None], bool]) -> None:
    """Before `section`'s preset changes to `name`: drop the section's keys set so far (except those whose source
    `keep` accepts), since they were chosen for the previous preset and would silently overlay the new one."""
    node = tree.get(section)
    if not isinstance(node, dict) or node.get(rule.key, rule.default) == name:
        return
    for key in list(node):
        if not keep(sources.get(f"{section}.{key}")):
            del node[key]
            _forget(sources, f"{section}.{key}")


def _load_tree(path: Path, presets: Mapping[str, Presets], errors: list[str],
               chain: tuple[Path, ...] = ()) -> tuple[dict, dict]:
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
        base_data, base_sources = _load_tree(path.parent / base, presets, errors, (*chain, resolved))
        _merge(merged, base_data, sources)
        sources.update(base_sources)
    for section, rule in presets.items():
        node = data.get(section)
        if isinstance(node, dict) and rule.key in node:
            _drop_keys_of_other_preset(merged, sources, section, rule, node[rule.key], keep=lambda source: False)
    _merge(merged, data, sources)
    sources.update(_record_sources(data, str(path)))
    return merged, sources


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


def _apply_overrides(tree: dict, sources: dict, overrides: Sequence[str], presets: Mapping[str, Presets],
                     errors: list[str]) -> None:
    for text in overrides:
        try:
            keys, value = parse_override(text)
        except ValueError as e:
            errors.append(f"{OVERRIDE_SOURCE}: {e}")
            continue
        rule = presets.get(keys[0])
        if rule is not None and keys[1:] == [rule.key]:
            _drop_keys_of_other_preset(tree, sources, keys[0], rule, value,
                                       keep=lambda source: source == OVERRIDE_SOURCE)
        node = tree
        for key in keys[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[keys[-1]] = value
        dotted = ".".join(keys)
        _forget(sources, dotted)
        sources[dotted] = OVERRIDE_SOURCE


def _apply_preset(tree: dict, section: str, rule: Presets, sources: dict, errors: list[str]) -> bool:
    """Replace tree[section] by the named preset overlaid with the section's keys; False if the name is unknown."""
    node = tree.get(section)
    if node is None:
        node = tree[section] = {}
    if not isinstance(node, dict):
        return True
    name = node.get(rule.key, rule.default)
    if not isinstance(name, str) or name not in rule.table:
        path = f"{section}.{rule.key}"
        errors.append(f"{_source_of(path, sources)}: {path}: unknown preset {name!r}; choose one of "
                      f"{', '.join(rule.table)}{_suggest(name, rule.table)}")
        return False
    tree[section] = {**rule.table[name], **node, rule.key: name}
    return True


# ---------------------------------------------------------------------------------------------------------------
# Typing a mapping onto the dataclasses.


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


def _suggest(word: Any, choices) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _source_of(path: str, sources: dict) -> str:
    while path:
        if path in sources:
            return sources[path]
        path = path[:path.rindex("[")] if path.endswith("]") else path.rpartition(".")[0]
    return sources.get("", "defaults")


def _convert(value: Any, tp: Any, path: str, sources: dict, errors: list[str]) -> Any:
    """`value` as type `tp`, or _MISSING after appending an error."""
    def fail(extra: str = "", expected: str = "") -> Any:
        shown = repr(value) if not isinstance(value, dict) else "a mapping"
        errors.append(f"{_source_of(path, sources)}: {path}: expected {expected or _type_name(tp)}, got {shown}"
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
        for arg in candidates:
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
            if not math.isfinite(value):  # YAML's .nan / .inf: no key of a recipe means anything by them
                return fail("", "a finite number")
            return float(value)
        return fail()
    if tp is str:
        return value if isinstance(value, str) else fail()
    return value if isinstance(value, tp) else fail()


def _build(cls: type, data: dict, path: str, sources: dict, errors: list[str], failed: list[str] | None = None) -> Any:
    """`cls(**data)` with each value converted to its field's type; a value that cannot be converted is reported and
    left at its default, its key added to `failed`."""
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
        elif failed is not None:
            failed.append(str(key))
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


# ---------------------------------------------------------------------------------------------------------------
# The entry points.


def load(schema: type, path: str | Path | None, overrides: Sequence[str] = (), *,
         presets: Mapping[str, Presets] | None = None) -> Any:
    """`schema` (a dataclass of section dataclasses) from the YAML file `path` (None: defaults only) and its
    bases, with `a.b=value` overrides, typed and validated. `presets` maps a section name to its `Presets`.

    Raises ConfigError listing every problem found.
    """
    presets = presets or {}
    errors: list[str] = []
    tree: dict = {}
    sources: dict = {}
    if path is not None:
        tree, sources = _load_tree(Path(path), presets, errors)
        sources[""] = str(path)
    _apply_overrides(tree, sources, overrides, presets, errors)
    if errors:
        raise ConfigError(errors)
    fields = dataclasses.fields(schema)
    sections = {f.name for f in fields}
    bad_sections = {name for name, rule in presets.items() if not _apply_preset(tree, name, rule, sources, errors)}
    for key, value in tree.items():
        if key in sections and not isinstance(value, dict):
            errors.append(f"{_source_of(key, sources)}: {key}: expected a mapping of keys, got {value!r}")
            bad_sections.add(key)
    for key in tree:
        if key not in sections:
            errors.append(f"{_source_of(key, sources)}: {key}: unknown key in the recipe's top level"
                          f"{_suggest(key, sorted(sections))}")
    kwargs = {}
    invalid: list[str] = []
    hints = typing.get_type_hints(schema)
    for f in fields:
        if f.name not in tree or f.name in bad_sections:
            continue
        failed: list[str] = []
        section = _build(hints[f.name], tree[f.name], f.name, sources, errors, failed)
        if section is _MISSING:
            continue
        kwargs[f.name] = section
        # the section's other problems too, every problem at once; checks that involve a key whose value could not
        # be read (left at its default) would only mislead
        found: list[str] = []
        _validate(section, f.name, found, sources)
        invalid += [m for m in found if not any(re.search(rf"\b{re.escape(k)}\b", m) for k in failed)]
    if errors:
        raise ConfigError(errors + invalid)
    cfg = schema(**kwargs)
    for f in fields:
        if f.name not in kwargs:
            _validate(getattr(cfg, f.name), f.name, invalid, sources)
    check = getattr(cfg, "validate", None)
    for message in check() if callable(check) else ():
        invalid.append(f"{_source_of(message.split(':', 1)[0], sources)}: {message}")
    if invalid:
        raise ConfigError(invalid)
    return cfg


def to_dict(obj: Any) -> dict:
    """Plain YAML-serializable mapping of a dataclass (tuples become lists)."""
    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(obj))


def dump(obj: Any) -> str:
    """`obj` as YAML; `load` of that text gives an equal object."""
    return yaml.safe_dump(to_dict(obj), sort_keys=False, default_flow_style=False, width=120)
