"""Errors a user can fix, and the exit codes `train.py` gives every outcome of a run.

`TrainingError`: the run cannot start or continue because of its environment or its state on disk (an unwritable
or locked run dir, a missing wandb login, no intact checkpoint, a non-finite evaluation); exit code 1.
`InputError`: what the user gave is wrong (data that is not text, a recipe that changes settings a checkpoint
fixes); exit code 2, like a recipe error. `train.py` prints the message (no traceback) and exits with the error's
`exit_code`.
"""

from collections.abc import Iterator

EXIT_FINISHED = 0  # trained to train.steps (or already there: nothing to do)
EXIT_ENVIRONMENT = 1  # TrainingError
EXIT_INPUT = 2  # a recipe error or an InputError
EXIT_STOPPED = 3  # stopped by SIGTERM / SIGINT after writing a checkpoint; the same command resumes
EXIT_INTERRUPTED = 130  # a second Ctrl-C: aborted without a new checkpoint


class TrainingError(RuntimeError):
    """Training cannot start or continue (no CUDA device, repeated non-finite losses, ...); the message says why
    and what to do."""

    exit_code = EXIT_ENVIRONMENT


class InputError(TrainingError):
    """The recipe or the data is wrong in a way only visible once the run starts; the message names what to fix."""

    exit_code = EXIT_INPUT


class CorruptCheckpoint(TrainingError):
    """A checkpoint's files do not match its manifest, hold non-finite tensors, or hold something moela refuses to
    read (anything beyond tensors and plain data)."""


def causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and every exception behind it: causes, contexts, and the per-rank failures a DCP
    `CheckpointException` collected from its worker threads (kept as exceptions or (exception, traceback))."""
    seen: set[int] = set()
    stack: list[object] = [exc]
    while stack:
        e = stack.pop()
        if isinstance(e, tuple):
            stack.extend(e)
            continue
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack.extend([e.__cause__, e.__context__, *getattr(e, "failures", {}).values()])
