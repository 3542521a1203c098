"""Train a moela model: `python train.py RECIPE.yaml [section.key=value ...]`.

Works unchanged under `torchrun` / `accelerate launch` (the process group comes from their env vars). A mistake
in the recipe or the overrides exits with code 2 and lists every problem (file, key path, suggestion); no
traceback. `--print-config` prints the resolved recipe and exits. Log records (e.g. which kernel backend each op
uses) go to stderr, INFO on rank 0 and WARNING elsewhere. The exit codes are listed in EXIT_CODES (and --help).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

EXIT_CODES = """exit codes:
  0    finished: trained to train.steps (or already there: nothing to do)
  1    the environment stopped the run: unwritable or locked run dir, no wandb login, no intact checkpoint,
       a non-finite evaluation, repeated non-finite steps, ...
  2    bad input: a recipe error, data that is not text or holds none, a recipe that changes what the
       checkpoint fixes
  3    stopped by SIGTERM / Ctrl-C after saving a checkpoint; the same command resumes
  130  a second Ctrl-C: aborted without a new checkpoint"""


USAGE = """usage: python train.py RECIPE.yaml [section.key=value ...] [--print-config]
try:   python train.py recipes/tiny.yaml    (the tiny model on CPU, about 2 minutes; --help lists the options)"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="train.py", description="Train a DeepSeek-V3-style MLA + MoE model from a YAML recipe.",
        epilog="example: python train.py recipes/tiny.yaml train.steps=50 optim.lr=1e-3\n\n" + EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", help="YAML recipe, e.g. recipes/tiny.yaml")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override any recipe key; values are parsed as YAML (1e-3, true, null, [1, 2])")
    parser.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    return parser.parse_intermixed_args(argv)


def _is_rank0() -> bool:
    """Whether this process is rank 0 of its launcher (or unlaunched); a malformed RANK counts as rank 0 here and
    is reported by the trainer."""
    try:
        return int(os.environ.get("RANK") or 0) == 0
    except ValueError:
        return True


def _plan_stops(cfg) -> bool:
    """The plan's memory check (`train.plan_check`, moela.plan.check) on a CUDA run, before any allocation; prints
    its line on rank 0; true when it is an error."""
    import torch
    if cfg.train.plan_check == "never" or cfg.train.device == "cpu" or not torch.cuda.is_available():
        return False
    from moela.plan.check import memory_check
    try:
        local_rank, world_size = int(os.environ.get("LOCAL_RANK") or 0), int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError:
        return False  # a malformed launcher environment: the trainer reports it
    props = torch.cuda.get_device_properties(local_rank)
    found = memory_check(cfg, world_size, props.name, props.total_memory)
    if found is None:
        return False
    level, line = found
    if _is_rank0():
        print(f"{'error' if level == 'error' else 'warning'}: {line}", file=sys.stderr)
    return level == "error"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.recipe is None:
        print(USAGE, file=sys.stderr)
        return 2
    from moela.config import ConfigError, dump_config, load_config
    from moela.trainer.errors import EXIT_FINISHED, EXIT_INPUT, EXIT_INTERRUPTED, EXIT_STOPPED

    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as e:
        count = len(e.errors)
        print(f"error: {count} problem{'s' if count > 1 else ''} in the recipe:", file=sys.stderr)
        for message in e.errors:
            print(f"  {message}", file=sys.stderr)
        return EXIT_INPUT
    if args.print_config:
        if _is_rank0():
            print(dump_config(cfg), end="")
        return 0

    from moela.trainer import Trainer, TrainingError
    from moela.trainer.loop import STOPPED

    logging.basicConfig(level=logging.INFO if _is_rank0() else logging.WARNING, format="%(name)s: %(message)s")
    if _plan_stops(cfg):
        return EXIT_INPUT
    try:
        outcome = Trainer(cfg).fit()
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted before a checkpoint was written; the newest complete checkpoint is kept",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_STOPPED if outcome == STOPPED else EXIT_FINISHED


if __name__ == "__main__":
    sys.exit(main())
