"""The benchmark harness's tests: they import `bench` and `moela` from the repository root and the tiny-model
factories from tests/, and run under tests/conftest.py's fixtures and hooks (seeded RNGs before every test,
`gpu` tests skipped without CUDA), whether the whole suite runs or only this folder."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "tests", ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def _suite_conftest():
    spec = importlib.util.spec_from_file_location("moela_suite_conftest", ROOT / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


globals().update({name: value for name, value in vars(_suite_conftest()).items() if not name.startswith("_")})
