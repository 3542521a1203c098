"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest
import torch


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
