"""Training: the loop (`Trainer`), optimizer and LR schedules, DCP checkpoints, metrics and plots."""

from moela.trainer.loop import Trainer, TrainingError

__all__ = ["Trainer", "TrainingError"]
