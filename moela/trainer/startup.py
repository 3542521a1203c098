"""What a compiled run says about its first step: what the wait is, where the kernel caches live, what it cost.

Why: with `train.compile` the first step traces and compiles every block variant (torch.compile) and builds each
Triton and flash-attn-4 kernel the first time it runs. On an H200 with empty caches that is 25 s to a
minute for `small` (24-25 s after the model is built at 64k tokens without flash-attn-4 with the kernel prebuild
helper, 31-39 s without it; about 50 s in the first process on a fresh machine; 10 s when an earlier run left its
caches), during which the log would otherwise be silent. These
lines tell a cold start from a hang, say where the caches are (a second start reads them), and report what the
first step took.
"""

from __future__ import annotations

from moela.ops.disk_caches import cache_root


def compile_notice(compile_blocks: bool) -> str | None:
    """The line printed before the first step of a compiled run; None when nothing is compiled."""
    if not compile_blocks:
        return None
    return (f"train.compile: the first step compiles the blocks (torch.compile) and the kernels they run for the "
            f"first time; they are cached in {cache_root()} (MOELA_CACHE_DIR), so a later start on this machine "
            f"skips most of it")


def first_step_line(step: int, seconds: float) -> str:
    """The line printed once the first step of this process is done (host clock: the device may still be running
    its last kernels)."""
    return f"step {step} done {seconds:.1f} s after training started (compiling included)"
