"""Where compiled kernels are kept on disk, so that a second start skips compiling and autotuning them.

One root, `MOELA_CACHE_DIR` (default `~/.cache/moela`), holds every cache a training run fills:
- `inductor/`: Inductor's FX graph, AOTAutograd and Triton kernel caches of the compiled blocks
  (TORCHINDUCTOR_CACHE_DIR). Inductor's default is under /tmp, and importing `torch._dynamo` (which the first
  `torch.compiler.disable` does) writes that default into the environment, so a value equal to it counts as unset;
- `triton/`: Triton's cache of moela's own kernels (TRITON_CACHE_DIR), with their autotuning results
  (TRITON_CACHE_AUTOTUNING): a kernel autotuned once starts with its best configuration in every later process;
- `flash_attn/`: flash-attn-4's compiled CuTe kernels (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED / _DIR; off in
  flash-attn-4 by default, where every process recompiles them: 6.6-8.6 s of a first step on an H200); flash-attn-4
  guards its entries with file locks and a fingerprint of its sources.
A variable the user set wins over each default. Pointing the root at a shared file system makes every node of a
cluster, and every restart, start with what the first run compiled. Set before Triton, Inductor or flash-attn-4
read them: `moela.ops` calls `use_disk_caches()` on import.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MOELA_CACHE_DIR", "~/.cache/moela")).expanduser()


def use_disk_caches() -> None:
    """Set the kernel caches' environment variables to their defaults under `cache_root()`, unless set."""
    root = cache_root()
    # Inductor's default, only where Inductor is loaded (then it may have written it); importing it here would
    # load Triton with every recipe (moela.ops loads no kernels)
    inductor = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    torch_default = inductor.default_cache_dir() if inductor is not None else None
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, torch_default):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(root / "flash_attn"))
