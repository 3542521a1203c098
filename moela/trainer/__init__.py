"""Training: the loop (`Trainer`), optimizer and LR schedules, DCP checkpoints, metrics and plots."""

from moela.trainer.errors import TrainingError
from moela.trainer.loop import Trainer

__all__ = ["Trainer", "TrainingError"]
