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
def poisoned_empty():
    """Every tensor allocated without values (torch.empty / empty_like / empty_strided / new_empty, in Python or
    inside ATen) starts as NaN (floats, fp8 included) or the dtype's largest value (integers), so a row, scale or
    padding block a kernel forgot to write fails the comparisons instead of reading whatever the allocator
    returned.

    ATen's own fill of uninitialized memory in deterministic mode does it (`warn_only`: an op without a
    deterministic implementation warns instead of raising). Patching `torch.empty` on the module instead leaked:
    torch snapshots its factory functions lazily (for one, `torch.utils._device`'s constructor set, built on the
    first `torch.device` context or Dynamo trace), a snapshot first taken while the patch was on kept the
    NaN-filling stand-in after the test, and later `with torch.device("meta")` allocated real memory, consuming
    random numbers, which shifted every random draw of whatever ran next."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
