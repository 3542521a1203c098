"""Stopping a run cleanly on SIGTERM / SIGINT: the handler records the request, the trainer finishes its step, saves
and returns.

One process decides alone. Several ranks must stop at the same step (a rank that leaves while the others enter the
next step's collectives hangs them), so they agree through an all-reduce of the flag - on logging steps only, where
the trainer reads the device anyway: a signal stops a multi-rank run at most `logging.log_every - 1` steps after it
arrived. Ranks decide on the all-reduced value alone: a signal landing between the all-reduce and the decision waits
for the next agreement (deciding on the local flag could split the ranks). A second Ctrl-C aborts at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from moela.trainer.errors import causes


class StopRequest:
    """The pending stop request of one trainer: which signal asked for it (None: none yet)."""

    def __init__(self, announce: bool):
        self.signum: int | None = None
        self.announce = announce  # print the "saving after this step" line (rank 0)
        self._previous: dict = {}

    def request(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum

    def agreed(self, device: torch.device, logging_step: bool) -> bool:
        """Whether to stop after this step (see the module docstring for the multi-rank rule)."""
        if not dist.is_initialized():
            return self.signum is not None
        if not logging_step:
            return False
        flag = torch.tensor([1.0 if self.signum is not None else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = bool(flag.item())
        if stop and self.signum is None:
            self.signum = signal.SIGTERM
        return stop

    def install(self) -> None:
        """Route SIGTERM and SIGINT here until `restore()` (main thread only: elsewhere signals cannot be caught)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            if signum == signal.SIGINT and self.signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.request(signum)
            if self.announce:  # os.write: print() may be mid-write on the same stream when the signal lands
                os.write(sys.stderr.fileno(), f"received {signal.Signals(signum).name}: saving a checkpoint after "
                                              f"this step (press Ctrl-C again to abort now)\n".encode())

        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, handler)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def interrupt_in(exc: BaseException) -> bool:
    """Whether a KeyboardInterrupt is behind `exc`: DCP's writer threads catch it and raise their own
    CheckpointException, which would hide the second Ctrl-C behind a traceback."""
    return any(isinstance(e, KeyboardInterrupt) for e in causes(exc))
