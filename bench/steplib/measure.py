"""Host-synchronization and compilation counters for the step benchmark.

Host syncs: a synchronization makes the CPU wait for the GPU, so the GPU then idles while the CPU launches the next
kernels. Two independent witnesses count them, per window (e.g. one training step):
- PyTorch's sync debug mode (`torch.cuda.set_sync_debug_mode("warn")`): every synchronizing copy or stream
  synchronization (`.item()`, `float(t)`, `.tolist()`, `.cpu()`, `nonzero`, a blocking host-device copy) issues
  a warning, which the window records and counts (the autograd engine replays its worker thread's warnings).
- CUDA trace callbacks (`torch.cuda._gpu_trace`, the hooks the CUDA sanitizer uses): a callback per device,
  stream or event synchronization. This one also sees `torch.cuda.synchronize()`, which the debug mode does not
  flag, so it is the reported count; the warning count is kept beside it as a cross-check.
Both are checked on the device against a deliberate `.item()` before they are trusted (`SyncCounter.check`).
Activating the trace hooks cannot be undone and slows every later allocation a little, so the benchmark counts
syncs after its timed and profiled steps.

Compilations: `torch._dynamo.utils.counters["stats"]["unique_graphs"]`, the graphs Dynamo has compiled so far;
the difference between two readings is the number of (re)compilations in between.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch

SYNC_WARNING = "called a synchronizing CUDA operation"


@dataclass
class SyncWindow:
    """Counts of one window: trace callbacks (`traced`) and sync-debug warnings (`warned`)."""
    traced: int = 0
    warned: int = 0


class SyncCounter:
    """`with counter.window() as w: ...` counts the host synchronizations inside the block (see the module
    docstring). One instance per process: the trace callbacks it registers cannot be removed, so they count only
    while a window is open."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._open: SyncWindow | None = None
        self._hooked = False

    def on_sync(self, *_args) -> None:
        """The trace callback (device, stream or event synchronization)."""
        if self._open is not None:
            self._open.traced += 1

    def _hook(self) -> None:
        if self._hooked:
            return
        from torch.cuda import _gpu_trace

        _gpu_trace.register_callback_for_device_synchronization(self.on_sync)
        _gpu_trace.register_callback_for_stream_synchronization(self.on_sync)
        _gpu_trace.register_callback_for_event_synchronization(self.on_sync)
        if self.cuda:
            torch._C._activate_gpu_trace()
        self._hooked = True

    @staticmethod
    def count_warnings(records: list[warnings.WarningMessage]) -> int:
        return sum(SYNC_WARNING in str(r.message) for r in records)

    @contextmanager
    def window(self):
        self._hook()
        w = SyncWindow()
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            if self.cuda:
                torch.cuda.set_sync_debug_mode("warn")
            self._open = w
            try:
                yield w
            finally:
                self._open = None
                if self.cuda:
                    torch.cuda.set_sync_debug_mode("default")
        w.warned = self.count_warnings(records)

    def check(self, device: torch.device) -> dict[str, int]:
        """Count one deliberate `.item()` and one `torch.cuda.synchronize()`: a trustworthy counter reports
        item_traced >= 1, item_warned >= 1 and synchronize_traced >= 1."""
        x = torch.ones((), device=device)
        with self.window() as item:
            (x + 1).item()
        with self.window() as sync:
            if self.cuda:
                torch.cuda.synchronize(device)
        return {"item_traced": item.traced, "item_warned": item.warned, "synchronize_traced": sync.traced}


def reported_syncs(check: dict[str, int], traced: float, warned: float) -> tuple[float | None, str]:
    """(host syncs per step, which witness) given `SyncCounter.check`'s result and both per-step counts: the trace
    count when it saw the deliberate `.item()` and `torch.cuda.synchronize()`, else the warning count when it saw
    the `.item()`, else None (neither witness can be trusted on this device)."""
    if check.get("item_traced", 0) >= 1 and check.get("synchronize_traced", 0) >= 1:
        return traced, "trace"
    if check.get("item_warned", 0) >= 1:
        return warned, "sync debug warnings (explicit torch.cuda.synchronize() not counted)"
    return None, "no witness saw a deliberate .item(); not counted"


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_seconds() -> float:
    """Seconds this process has spent compiling with torch.compile so far: Dynamo's frames with their backend
    (AOTAutograd, Inductor's code generation and its Triton compiles) and the compiled backward graphs. Not in it:
    kernels compiled outside Inductor at their first call (moela's Triton kernels and their autotuning,
    flash-attn-4's CuTe kernels)."""
    from torch._dynamo.utils import calculate_time_spent

    spent = calculate_time_spent()
    return float(spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0))
