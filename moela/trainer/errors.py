"""`TrainingError`: a run cannot start or continue for a reason the user can fix; `train.py` prints its message
(no traceback) and exits with status 1."""


class TrainingError(RuntimeError):
    """Training cannot start or continue (no CUDA device, repeated non-finite losses, ...); the message says why
    and what to do."""
