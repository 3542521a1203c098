"""Run a function on N CPU ranks (spawned processes, gloo) for the multi-rank tests.

`spawn(fn, world_size, *args)` starts `world_size` processes, initializes a gloo process group through a file
store in a fresh temporary directory (no ports to collide), calls `fn(rank, world_size, *args)` in each and
re-raises the first failure in the parent. `fn` must be a module-level function so the children can import it.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, store: str, fn, args) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world_size, os.path.join(tmp, "store"), fn, args), nprocs=world_size, join=True)
