"""The shared fixtures of tests/conftest.py do what the tests rely on: `poisoned_empty` fills every allocation
made without values (floats, fp8 and integers; in Python and inside ATen) and replaces no torch function, and
it switches itself off afterwards; `seeded_rng` gives every test the same random numbers."""

from __future__ import annotations

import torch

REAL_EMPTY, REAL_EMPTY_LIKE = torch.empty, torch.empty_like


def test_poisoned_empty_fills_every_uninitialized_allocation(poisoned_empty):
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        assert bool(torch.empty(5, dtype=dtype).float().isnan().all())
        assert bool(torch.empty_like(torch.zeros(3, dtype=dtype)).float().isnan().all())
        assert bool(torch.zeros(2, dtype=dtype).new_empty(4).float().isnan().all())
    assert bool((torch.empty(4, dtype=torch.int32) == torch.iinfo(torch.int32).max).all())
    assert bool((torch.empty_strided((2, 3), (3, 1), dtype=torch.int64) == torch.iinfo(torch.int64).max).all())
    assert torch.zeros(3).eq(0).all() and torch.ones(2).eq(1).all()  # only values left unset are poisoned
    # nothing is patched: a snapshot of torch's factory functions taken now (torch.device("meta") builds one
    # lazily) stays valid after the test
    assert torch.empty is REAL_EMPTY and torch.empty_like is REAL_EMPTY_LIKE
    with torch.device("meta"):
        assert torch.empty(3).device.type == "meta" and torch.nn.Linear(4, 4).weight.device.type == "meta"


def test_no_poison_outside_the_fixture():
    """Whatever ran before (in a shuffled order, poisoned tests often do), the mode is off again."""
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.empty is REAL_EMPTY


def test_seeded_rng_gives_every_test_the_same_numbers():
    want = torch.Generator().manual_seed(0)
    assert torch.equal(torch.rand(4), torch.rand(4, generator=want))
