"""One call of mla_attention's Triton backend on a bench/attention.py case, for a kernel profiler: the forward
(`ncu -k regex:_fwd_kernel -c 1 ...`), or the forward and backward (`--backward`: `ncu -k regex:_bwd_dkdv_kernel
...` or `regex:dq`), each run once after a warm-up call that compiles its kernels.

Usage: python bench/attention_once.py [--backward] [FORWARD] [CASE]   FORWARD: the forward's kernel, "auto" (default),
       "triton" or "gluon"; CASE: a substring of a bench/attention.py case name (default "B=2 S=8192")
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import all_cases, make_inputs  # noqa: E402

from moela.ops.attention import mla_attention  # noqa: E402


def main() -> None:
    args = sys.argv[1:]
    backward = "--backward" in args
    args = [a for a in args if a != "--backward"]
    forward = args[0] if args else "auto"
    name = args[1] if len(args) > 1 else "B=2 S=8192"
    case = next(c for c in all_cases() if name in c.name and c.feature == "plain")
    x = make_inputs(case)
    for _ in range(2):  # the first call compiles; a profiler filtering on one launch takes the last
        with torch.set_grad_enabled(backward):
            out = mla_attention(x.q, x.k, x.v, x.cu, max(case.lens), causal=True, backend="triton",
                                forward_kernel=forward)
        if backward:
            out.backward(x.dout)
    torch.cuda.synchronize()
    print(f"{case.name} ({case.d_qk}/{case.d_v}): forward {forward}{' and backward' if backward else ''} ran")


if __name__ == "__main__":
    main()
