"""Fast ops, one public function per op, its pure-torch reference first, then its kernels.

Small ops are one module each (norm, rope, swiglu, loss, linear_cross_entropy, router); attention and the MoE
expert path are packages (`moela.ops.attention`, `moela.ops.moe`) whose `__init__` exports the public function.
`ops` imports nothing else from moela. Backend choice is per call (`backend="auto" | "reference" | ...`): the
names are in `moela.ops.backends`, the choice in `moela.ops.dispatch`.

Importing the package points the kernel caches at one directory on disk (`moela.ops.disk_caches`, unless the user
set them): Triton's kernels with their autotuning results and flash-attn-4's compiled kernels, so a later process
starts with what an earlier one compiled and tuned instead of redoing it during its first training step.
"""

from moela.ops.disk_caches import use_disk_caches

use_disk_caches()
