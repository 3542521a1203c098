"""Run a function on N ranks for the multi-rank tests (their model and data: tests/factories.py).

`spawn(fn, world_size, *args)` forks `world_size` CPU processes with a gloo process group (fork rather than spawn:
the children inherit the imported modules, which saves seconds of imports per rank on a small machine; each child
runs torch single-threaded). Once the parent has initialized CUDA (CUDA tests earlier in the same pytest process)
the ranks are spawned instead, since neither CUDA nor autograd's device threads survive a fork; `backend="nccl"`
always spawns, one process per GPU. The group is initialized through a file store in a fresh temporary directory
(no ports to collide), with a 5-minute collective timeout so that a stuck rank fails the test; a rank still running
after STACKS_AFTER_S prints every thread's stack to stderr (where it hangs, for a run that a time limit will cut).
`fn(rank, world_size, *args)` runs in each and the first failure is re-raised in the parent.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)  # a rank stuck in a collective fails the test, not the whole run
STACKS_AFTER_S = 90.0


def _entry(rank: int, world_size: int, store: str, backend: str, fn, args) -> None:
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(STACKS_AFTER_S, exit=False)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    extra = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT, **extra)
    try:
        fn(rank, world_size, *args)
    finally:
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args, backend: str = "gloo") -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; backend "nccl" uses one GPU per rank and
    spawned (not forked) processes, since CUDA does not survive a fork."""
    method = "spawn" if backend == "nccl" or torch.cuda.is_initialized() else "fork"
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world_size, os.path.join(tmp, "store"), backend, fn, args),
                           nprocs=world_size, join=True, start_method=method)
