"""`python -m moela {plan,prepare,generate,export,import,eval,summary} ...`: argument parsing and dispatch.

A command's user errors (a missing run directory, no checkpoint, a bad step or device, an invalid option value) and
checkpoints it cannot use (damaged, or holding anything beyond tensors and plain data) print `error: ...` on stderr
and exit with code 2, like argparse's own usage errors; a disk that fails a write (full, read-only) exits 1 with
one line naming the file; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from moela.tools.runs import UsageError
from moela.trainer.errors import CorruptCheckpoint, TrainingError

USAGE_ERROR = 2

COMMANDS = {
    "prepare": ("moela.tools.prepare", "tokenize a recipe's data into its token cache ahead of training (--verify "
                "checks it)"),
    "generate": ("moela.tools.generate", "sample text from a checkpoint (MLA latent cache, streamed)"),
    "export": ("moela.tools.export", "write a Hugging Face deepseek_v3 folder from a checkpoint"),
    "import": ("moela.tools.import_hf", "write a moela run directory from a Hugging Face deepseek_v3 folder"),
    "eval": ("moela.tools.evaluate", "held-out loss, perplexity and bits per byte (or lm-eval tasks)"),
    "summary": ("moela.tools.summary", "print the summary of a training run from its run directory"),
    "plan": ("moela.tools.plan", "predict memory, communication and step time of a recipe's layout on N GPUs"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moela", description="moela around training: plan (memory and "
                                     "speed of a layout), prepare (the data), generate, export, import, eval, "
                                     "summary. Training itself is "
                                     "`python train.py RECIPE.yaml`.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        return importlib.import_module(COMMANDS[args.command][0]).run(args)
    except (UsageError, CorruptCheckpoint) as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR
    except TrainingError as e:  # the disk failed a write (WriteFailed)
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
