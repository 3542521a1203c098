"""Compiles moela's Triton kernels for an H100/H200 (sm_90) on a machine without a GPU and prints, per kernel, its
shared memory and number of async copies as JSON (run by tests/test_kernels_sm90.py in a process without
TRITON_INTERPRET, whose kernels are not compilable). It checks what the interpreter cannot: that the GPU code
generator accepts the kernel (constexpr globals, dot shapes, dtypes), that its block loops are software-pipelined
and that its shared memory fits. Kernels are compiled with the launch configurations used on the GPU (the MLA
192/128 attention table, the largest grouped-GEMM autotune configuration) and the launcher's specialization.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def compile_sm90(kernel, args: dict, *, num_warps: int, num_stages: int = 3):
    """args: every parameter by name: a constexpr's value; for the others a pointer type string ("*bf16",
    16-byte aligned like a torch allocation), an int (i32, specialized as the launcher does: 1 becomes a constant,
    a multiple of 16 gets the divisibility hint) or a float (fp32). Returns (shared bytes, async copies in the
    TTGIR)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel
    while not isinstance(fn, triton.runtime.jit.JITFunction):  # unwrap @triton.autotune
        fn = fn.fn
    if set(args) != set(fn.arg_names):
        raise ValueError(f"{fn.__name__}: missing {set(fn.arg_names) - set(args)}, "
                         f"unknown {set(args) - set(fn.arg_names)}")
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        value = args[name]
        if i in fn.constexprs or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, str):
            signature[name], attrs[(i,)] = value, [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 128),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    return compiled.metadata.shared, len(re.findall("async_copy_global_to_local", compiled.asm["ttgir"]))


def attention_kernels():
    from moela.ops import attention_triton as A

    d_qk, d_v = 192, 128
    common = dict(D_QK=d_qk, D_V=d_v, CAUSAL=True, HAS_ALIBI=True, UPCAST=False, **A._dims(d_qk, d_v))
    ptrs = dict(Q="*bf16", K="*bf16", V="*bf16", LSE="*fp32", CU_Q="*i32", CU_K="*i32", SLOPES="*fp32")
    strides = {f"stride_{t}{d}": s for t in ("q", "k", "dq", "dk") for d, s in (("t", 16 * d_qk), ("h", d_qk))}
    strides.update({f"stride_{t}{d}": s for t in ("v", "o", "do", "dv") for d, s in (("t", 16 * d_v), ("h", d_v))})
    strides["stride_lh"] = 4096
    grads = dict(DO="*bf16", DELTA="*fp32", sm_scale=0.07)
    out = {}
    for name, kernel, extra in (("attention fwd", A._fwd_kernel, dict(O="*bf16")),
                                ("attention dkdv", A._bwd_dkdv_kernel, dict(DK="*bf16", DV="*bf16", **grads)),
                                ("attention dq", A._bwd_dq_kernel, dict(DQ="*bf16", **grads))):
        bm, bn, warps, stages = A.CONFIGS[name.split()[1]]["wide"]
        args = {**ptrs, **strides, **extra, **common, "qk_scale": 0.1, "BLOCK_M": bm, "BLOCK_N": bn}
        args = {a: args[a] for a in kernel.arg_names}
        out[name] = compile_sm90(kernel, args, num_warps=warps, num_stages=stages)
    return out


def moe_kernels():
    from moela.ops import moe_gemm as G

    largest = max(G._configs(), key=lambda c: (c.kwargs["BN"], c.num_stages))
    tile = dict(BN=largest.kwargs["BN"], GROUP_M=largest.kwargs["GROUP_M"])
    opts = dict(num_warps=largest.num_warps, num_stages=largest.num_stages)
    n, k = 4096, 7168
    fp8 = dict(as_ptr="*fp32", bs_ptr="*fp32", c_ptr="*bf16", N=n, K=k, FP8=True, UPCAST=False, INTERP=False, BK=128)
    out = {"moe mgrouped fp8": compile_sm90(G._mgrouped_kernel, dict(
        a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", m_idx_ptr="*i32", M=16384, s_am=k, s_ak=1, s_asm=k // 128, s_ask=1,
        s_be=n * k, s_bn=k, s_bk=1, s_bse=n * k // 2 ** 14, s_bsn=k // 128, s_bsk=1, s_cm=n, BM=128, **fp8,
        **tile), **opts)}
    out["moe kgrouped fp8"] = compile_sm90(G._kgrouped_kernel, dict(
        a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", off_ptr="*i64", s_an=16384, s_at=1, s_bk=16384, s_bt=1, s_asn=128,
        s_ast=1, s_bsk=128, s_bst=1, s_ce=n * k, s_cn=k, BT=128, **fp8, **tile), **opts)
    return out


if __name__ == "__main__":
    print(json.dumps({**attention_kernels(), **moe_kernels()}))
