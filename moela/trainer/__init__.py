"""Training: the loop (`Trainer`), optimizer and LR schedules, DCP checkpoints, metrics and plots.

`Trainer` is imported on first use, so that reading the training sections of a recipe (`moela.trainer.config`)
builds nothing and imports no kernels.
"""

from importlib import import_module

from moela.trainer.errors import TrainingError

__all__ = ["Trainer", "TrainingError"]


def __getattr__(name: str):
    if name == "Trainer":
        return import_module("moela.trainer.loop").Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
