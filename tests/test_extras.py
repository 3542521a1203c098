"""The optional extras (wandb, datasets, matplotlib, flash-attn-4): a recipe that needs a missing one fails at load
time with the pip command that installs it; without matplotlib the loss plot is skipped with a message, and training
goes on."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from moela.config import ConfigError, load_config
from moela.trainer.metrics import METRICS_FILE, PLOT_FILE, plot_losses


@pytest.fixture
def without(monkeypatch):
    """Make the named packages look uninstalled (find_spec finds nothing, import raises ImportError)."""
    def hide(*names: str) -> None:
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in names
                            else find_spec(name, *a))
        for name in names:
            monkeypatch.setitem(sys.modules, name, None)
    return hide


def test_a_recipe_needing_a_missing_extra_names_the_install(without):
    without("wandb", "datasets")
    with pytest.raises(ConfigError) as info:
        load_config(None, ["logging.wandb.mode=offline", "data.source=hf", "data.hf_name=json"])
    joined = "\n".join(info.value.errors)
    assert "logging.wandb.mode: 'offline' needs the wandb package" in joined and "moela[wandb]" in joined
    assert "data.source: 'hf' reads through the Hugging Face datasets package" in joined
    assert "moela[datasets]" in joined and len(info.value.errors) == 2
    assert load_config(None).logging.wandb.mode == "disabled"  # the defaults need neither


def test_the_flash_attention_backend_names_its_install(without):
    without("flash_attn")
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.attention_backend=flash"])
    assert "model.attention_backend: 'flash' needs flash-attn-4" in "\n".join(info.value.errors)
    assert "moela[flash]" in "\n".join(info.value.errors)


def test_plot_is_skipped_without_matplotlib(tmp_path, without, capsys):
    records = [{"kind": "train", "step": s, "loss": 5.0 - s, "lm_loss": 4.5 - s} for s in (1, 2, 3)]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    without("matplotlib")
    assert plot_losses(tmp_path) is None and not (tmp_path / PLOT_FILE).exists()
    assert "matplotlib is not installed; pip install 'moela[plot]'" in capsys.readouterr().err
