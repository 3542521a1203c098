"""After-training commands, run as `python -m moela COMMAND`: generate, export, import, eval, summary.

Each command lives in its own module with `add_arguments(parser)` and `run(args) -> exit code`; `moela.tools.cli`
dispatches to them and turns a `UsageError` into a one-line message and exit code 2.
"""
