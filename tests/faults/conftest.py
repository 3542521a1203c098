"""Shared by the fault tests: a tiny run trained once per module (copied for each test that damages it), and the
runners of train.py and `python -m moela` in this process."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fault_helpers import ROOT, overrides, train


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("token_cache"))


@pytest.fixture(scope="module")
def trained_template(tmp_path_factory, cache_dir) -> Path:
    """A run dir trained for 2 steps with a checkpoint after each (both kept); copy it before damaging it."""
    run = tmp_path_factory.mktemp("template") / "run"
    assert train.main([str(ROOT / "recipes" / "tiny.yaml"), *overrides(run, cache_dir, "checkpoint.every=1")]) == 0
    return run


@pytest.fixture
def trained(trained_template, tmp_path) -> Path:
    """This test's own copy of the trained run."""
    run = tmp_path / "run"
    shutil.copytree(trained_template, run, symlinks=True)
    return run
