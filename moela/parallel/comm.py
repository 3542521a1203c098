"""`CommCounter`: records every collective a piece of code issues - kind, tensor shape, dtype and bytes - by watching
the dispatcher (a `TorchDispatchMode`).

Both ways torch issues collectives pass through it: the c10d ops behind `torch.distributed.all_reduce` and friends
(`c10d.allreduce_`, `c10d._allgather_base_`, ...), and the functional collectives that DTensor's redistributions
use (`_c10d_functional.all_gather_into_tensor`, ...). Backward passes run under the mode too (autograd carries it
to the thread that runs the backward), so a forward + backward inside the context is counted whole. The bytes of a
collective are those of the tensor a rank hands in: its shard for an all-gather, the whole input of a
reduce-scatter or all-reduce, the sent rows of an all-to-all. Used by the tests that pin the communication of
each parallel layout, and by benchmarks to report it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# op name (without the overload) -> (kind, index of the argument whose bytes count)
_OPS = {
    "c10d.allreduce_": ("all_reduce", 0),
    "c10d._allgather_base_": ("all_gather", 1),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 1),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d.alltoall_base_": ("all_to_all", 1),
    "_c10d_functional.all_reduce": ("all_reduce", 0),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", 0),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional.all_to_all_single": ("all_to_all", 0),
}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _shape(value) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


@dataclass(frozen=True)
class Collective:
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    nbytes: int


class CommCounter(TorchDispatchMode):
    """`with CommCounter() as comm: ...` then `comm.collectives` (in issue order), `comm.counts()`,
    `comm.bytes()`."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"{func.namespace}.{func._opname}"
        if name in _OPS:
            kind, index = _OPS[name]
            arg = args[index] if index < len(args) else None
            first = arg[0] if isinstance(arg, (list, tuple)) and arg else arg
            self.collectives.append(Collective(kind, _shape(arg), getattr(first, "dtype", None), _nbytes(arg)))
        return func(*args, **kwargs)

    def counts(self) -> Counter:
        """Collectives per kind."""
        return Counter(c.kind for c in self.collectives)

    def bytes(self) -> Counter:
        """Bytes handed in per kind (see the module docstring)."""
        out: Counter = Counter()
        for c in self.collectives:
            out[c.kind] += c.nbytes
        return out
