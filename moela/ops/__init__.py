"""Fast ops, one public function per op, its pure-torch reference first, then its kernels.

Small ops are one module each (norm, rope, swiglu, loss, linear_cross_entropy, router); attention and the MoE
expert path are packages (`moela.ops.attention`, `moela.ops.moe`) whose `__init__` exports the public function.
`ops` imports nothing else from moela. Backend choice is per call (`backend="auto" | "reference" | ...`): the
names are in `moela.ops.backends`, the choice in `moela.ops.dispatch`.

Importing the package asks Triton to keep autotuning results on disk (TRITON_CACHE_AUTOTUNING, unless set): a
kernel autotuned once on a machine starts with its best configuration in every later process, instead of
benchmarking all of them during the first training step.
"""

import os

os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
