"""`python -m moela COMMAND ...`: the after-training commands (see `moela.tools.cli`)."""

import sys

from moela.tools.cli import main

sys.exit(main())
