"""One forward call of mla_attention's Triton backend on a bench/attention.py case, for a kernel profiler
(`ncu -k regex:_fwd_kernel -c 1 ...`): the forward kernel selected by SCHEDULE["forward"] runs once after a warm-up
call that compiles it.

Usage: python bench/attention_once.py [FORWARD] [CASE]   FORWARD: "triton" or a gluon_fwd.CONFIGS name (default
       gluon_fwd.DEFAULT); CASE: a substring of a bench/attention.py case name (default "B=2 S=8192")
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import all_cases, make_inputs  # noqa: E402

from moela.ops.attention import gluon_fwd, mla_attention  # noqa: E402
from moela.ops.attention.triton_common import SCHEDULE  # noqa: E402


def main() -> None:
    forward = sys.argv[1] if len(sys.argv) > 1 else gluon_fwd.DEFAULT
    name = sys.argv[2] if len(sys.argv) > 2 else "B=2 S=8192"
    case = next(c for c in all_cases() if name in c.name and c.feature == "plain")
    SCHEDULE["forward"] = forward
    x = make_inputs(case)
    with torch.no_grad():
        for _ in range(2):  # the first call compiles; a profiler filtering on one launch takes the last
            mla_attention(x.q, x.k, x.v, x.cu, max(case.lens), causal=True, backend="triton")
    torch.cuda.synchronize()
    print(f"{case.name}: forward {forward} ran")


if __name__ == "__main__":
    main()
