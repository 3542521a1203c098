"""Every recipe in recipes/ loads and validates; tiny.yaml (the embedded default) documents every key."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from moela.config import Config, load_config

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"tiny.yaml", "small.yaml", "multi_gpu.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_loads_and_validates(recipe):
    cfg = load_config(recipe)
    assert isinstance(cfg, Config)
    assert cfg.train.run_dir.startswith("runs/"), "recipes write their runs under runs/"


def _schema_keys(obj, prefix=""):
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and f.name != "rope_scaling":
            keys += _schema_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _yaml_keys(tree, prefix=""):
    keys = []
    for key, value in tree.items():
        if isinstance(value, dict) and key != "rope_scaling":
            keys += _yaml_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def test_tiny_lists_every_key_with_a_comment():
    path = next(p for p in RECIPES if p.name == "tiny.yaml")
    text = path.read_text()
    listed = set(_yaml_keys(yaml.safe_load(text)))
    missing = sorted(set(_schema_keys(load_config(path))) - listed)
    assert not missing, f"tiny.yaml does not list: {missing}"
    for line in text.splitlines():
        if re.match(r"^\s+\w+:\s*\S", line):
            assert "#" in line, f"tiny.yaml key without a comment: {line.strip()}"
