"""Shared by the tests: every test starts from the same seeded RNGs, whatever ran before it, and must leave the
process as it found it (`unchanged_globals`); tests marked `gpu` are skipped where CUDA is not available."""

from __future__ import annotations

import copy
import random
import sys
from contextlib import ExitStack

import numpy as np
import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config


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


# moela globals that change by design while code runs (not switches a test could leave set)
RUNTIME_STATE = {("moela.ops.weight_cache", "EPOCH")}  # the cache's clock: bumped by every optimizer step


def _moela_globals() -> dict[tuple[str, str], tuple[int, object]]:
    """(module, name) -> (id of the value, a copy of it for public UPPER_CASE plain data) for every global of every
    loaded moela module: a rebinding shows as another id, a constant changed in place as another copy."""
    plain = (dict, list, set, tuple, str, int, float, bool, type(None))
    out = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "moela" or module_name.startswith("moela.")):
            continue
        for name, value in list(vars(module).items()):
            if name.startswith("__") or (module_name, name) in RUNTIME_STATE:
                continue
            public_constant = name.isupper() and not name.startswith("_")  # private ones may be caches
            kept = copy.deepcopy(value) if public_constant and isinstance(value, plain) else None
            out[(module_name, name)] = (id(value), kept)
    return out


def _torch_globals() -> dict[str, object]:
    return {"dynamo config": torch._dynamo.config.get_config_copy(),
            "inductor config": inductor_config.get_config_copy(),
            "default dtype": torch.get_default_dtype(),
            "deterministic algorithms": (torch.are_deterministic_algorithms_enabled(),
                                         torch.is_deterministic_algorithms_warn_only_enabled(),
                                         torch.utils.deterministic.fill_uninitialized_memory),
            "grad mode": (torch.is_grad_enabled(), torch.is_inference_mode_enabled()),
            "float32 matmul precision": torch.get_float32_matmul_precision()}


def _differences(before: dict, after: dict) -> list[str]:
    changed = []
    for key, old in before.items():
        new = after.get(key, old)
        if isinstance(old, dict) and isinstance(new, dict) and key in ("dynamo config", "inductor config"):
            changed += [f"{key}: {k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old.keys() | new.keys())
                        if old.get(k) != new.get(k)]
        elif isinstance(key, tuple):  # a moela global
            if old[0] != new[0] or old[1] != new[1]:
                changed.append(f"moela global {key[0]}.{key[1]}")
        elif old != new:
            changed.append(f"{key}: {old!r} -> {new!r}")
    return changed


@pytest.fixture(autouse=True)
def unchanged_globals():
    """Fail a test that leaves torch's Dynamo / Inductor configuration, default dtype, deterministic flags, grad
    mode or matmul precision, or a global of a moela module, different from before it: the next test in the same
    worker would run under it (change torch's config with its scoped `patch`, other globals with monkeypatch)."""
    torch_before, moela_before = _torch_globals(), _moela_globals()
    yield
    changed = _differences(torch_before, _torch_globals()) + _differences(moela_before, _moela_globals())
    if changed:
        pytest.fail("the test left global state changed (restore it: torch's config through its scoped patch(), "
                    "other globals through monkeypatch): " + "; ".join(changed[:8]), pytrace=False)


@pytest.fixture
def compile_config_scope():
    """For a test that runs moela code which sets torch's compile configuration for its process (a compiled
    Trainer raises Dynamo's recompile limit and turns off Inductor's pointwise autotuning; the kernel-building
    helper disables Dynamo): those keys are restored after the test, through torch's scoped `patch`."""
    dynamo = torch._dynamo.config
    with ExitStack() as stack:
        stack.enter_context(dynamo.patch(recompile_limit=dynamo.recompile_limit, disable=dynamo.disable))
        stack.enter_context(inductor_config.patch(
            {"triton.autotune_pointwise": inductor_config.triton.autotune_pointwise}))
        yield


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
