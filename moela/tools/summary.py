"""`python -m moela summary RUN_DIR`: the trainer's end-of-run summary for any run directory (finished, stopped
or still training): steps, tokens, time, losses, files and the next commands (`moela.trainer.summary`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from moela.tools.runs import UsageError, load_run_config
from moela.trainer.metrics import METRICS_FILE
from moela.trainer.summary import run_summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory (train.run_dir)")


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run)
    if not (run_dir / METRICS_FILE).is_file():
        raise UsageError(f"{run_dir}: no {METRICS_FILE}; pass the run directory of a training run (train.run_dir)")
    cfg = load_run_config(run_dir)
    print(run_summary(run_dir, total_steps=cfg.train.steps, sample_prompt=cfg.logging.sample_prompt))
    return 0
