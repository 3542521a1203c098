"""Shared by the tests: every test starts from the same seeded RNGs, whatever ran before it; tests marked `gpu`
are skipped where CUDA is not available."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test marked `gpu` without a CUDA device (a test that needs more than one GPU checks the count
    itself)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def seeded_rng():
    """Seed Python's, NumPy's and torch's global generators before every test, so a test that draws from them
    gets the same numbers in any order and alone."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every float tensor (fp8 included) allocated with torch.empty / torch.empty_like starts as NaN, so a row, scale
    or padding block a kernel forgot to write fails the comparisons instead of reading whatever the allocator
    returned."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_empty(*a, **kw):
        t = empty(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def nan_empty_like(*a, **kw):
        t = empty_like(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(torch, "empty_like", nan_empty_like)
