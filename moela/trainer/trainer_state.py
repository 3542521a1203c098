"""The trainer's own state in a checkpoint (beside the model and optimizer): step, LR schedule, data position, RNG
states, non-finite counters, tokens seen and the log window. `trainer_state(trainer)` collects it,
`load_trainer_state(trainer, state)` restores it; the LR schedule and AdamW hyperparameters come from the current
recipe at the saved step."""

from __future__ import annotations

from moela.trainer.distributed import rng_state, set_rng_state
from moela.trainer.errors import TrainingError
from moela.trainer.optim import apply_hyperparameters, build_scheduler
from moela.trainer.step_metrics import NonfiniteCounters

STATE_KEYS = ("step", "scheduler", "loader", "rng", "nonfinite_in_row", "skipped_total", "tokens_seen", "log_window")


def trainer_state(trainer) -> dict:
    return {"step": trainer.step, "scheduler": trainer.scheduler.state_dict(),
            "loader": trainer.train_loader.state_dict(), "rng": rng_state(trainer.device),
            "nonfinite_in_row": trainer.nonfinite_in_row, "skipped_total": trainer.skipped_total,
            "tokens_seen": trainer.tokens_seen, "log_window": trainer.window.state_dict()}


def load_trainer_state(trainer, state: dict) -> None:
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise TrainingError(f"the checkpoint's trainer state lacks {', '.join(missing)}: it was written by an "
                            f"older moela and cannot be resumed by this one; start a fresh run with "
                            f"checkpoint.resume=none or another train.run_dir")
    cfg = trainer.cfg
    trainer.step = state["step"]
    apply_hyperparameters(trainer.optimizer, cfg.optim)
    trainer.scheduler = build_scheduler(trainer.optimizer, cfg.schedule, cfg.train.steps, peak_lr=cfg.optim.lr,
                                        start_step=state["scheduler"]["last_epoch"])
    try:
        trainer.train_loader.load_state_dict(state["loader"])
    except ValueError as e:
        raise TrainingError(f"cannot resume the data stream: {e}; or start a fresh run with "
                            f"checkpoint.resume=none or another train.run_dir") from None
    set_rng_state(state["rng"], trainer.device)
    trainer.nonfinite_in_row = state["nonfinite_in_row"]
    trainer.skipped_total = state["skipped_total"]
    trainer.counters = NonfiniteCounters(trainer.device, trainer.skipped_total, trainer.nonfinite_in_row)
    trainer.tokens_seen = state["tokens_seen"]
    trainer.window.load_state_dict(state["log_window"])
