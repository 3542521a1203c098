"""Where moela's Triton kernels run: compiled for a GPU, or in Triton's interpreter (TRITON_INTERPRET=1, the CPU
tests), and the Triton version that interpreter needs.

The kernels' block loops take bounds loaded from memory (`range(lo, hi)` with `hi` read from cu_seqlens or the
expert offsets). Triton >= 3.9's interpreter runs them as written; older interpreters convert such bounds with
`int(array)`, which numpy >= 2.3 rejects, so under the interpreter a kernel module refuses to import on an older
Triton (an ImportError naming the fix: the fast backends then stay unregistered and the tests that need them skip
or say why). Compiled GPU code has no such limit (the GPU machine runs Triton 3.6).
"""

from __future__ import annotations

import os

import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MIN_INTERPRETER_TRITON = (3, 9)
HOPPER_SHARED_BYTES = 232448  # the H100/H200 per-block shared memory limit (the Gluon kernels size their rings by it)


def triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def require_interpreter_support() -> None:
    """Raise ImportError under TRITON_INTERPRET=1 with a Triton older than MIN_INTERPRETER_TRITON."""
    if INTERPRET and triton_version() < MIN_INTERPRETER_TRITON:
        need = ".".join(map(str, MIN_INTERPRETER_TRITON))
        raise ImportError(f"TRITON_INTERPRET=1 runs moela's Triton kernels only with triton >= {need} (installed: "
                          f"{triton.__version__}, whose interpreter rejects loop bounds loaded from memory); "
                          f"install triton>={need} or unset TRITON_INTERPRET")
