"""Grouped GEMMs of the MoE expert path over the m-grouped contiguous layout: Triton (FP8 blockwise or bf16),
`torch._grouped_mm` (bf16), cuBLAS blockwise FP8 through `torch._scaled_mm` (Hopper, one GEMM per expert) and
DeepGEMM (FP8, when `deep_gemm` imports).

- m-grouped (forward and data gradient): out [M_pad, N] = A [M_pad, K] @ B_e[N, K]^T for each 128-row block of A,
  e = m_indices of the block's first row. Blocks with e = -1 (padding past the last expert, or a block that is
  only padding) are skipped and written as zeros. FP8: A has 1x128 scales [M_pad, K/128], B 128x128 scales
  [E, N/128, K/128]; each 128-wide K step is one fp8 MMA whose fp32 result is scaled and added to an fp32
  accumulator (DeepSeek-V3's promotion interval).
- k-grouped (weight gradient): out [E, N, K] with out_e = A[:, rows_e] @ B[:, rows_e]^T, A [N, M_pad], B [K, M_pad]
  (the columnwise-quantized, transposed operands), rows_e = expert e's padded block; reduction along tokens.
  Empty experts get zeros.
Operands are addressed through strides, so the bf16 path reads row-major activations as their transposes
without copies. Under the Triton interpreter bf16 operands are upcast to fp32 (its bf16 dot is wrong), and loops
whose bounds are loaded from memory are written as `while` loops (the interpreter cannot index with them).
cuBLAS (CUDA >= 12.9, torch >= 2.10, compute capability 9.x) takes DeepSeek's fp32 scales in its own layouts (with
`torch._scaled_mm(a [M, K] row-major, b [K, N] column-major)`): 1x128 scales of a as [M, K/128] with strides
(1, M) (M-major); 1x128 scales of b as [K/128, N] row-major (N-major); 128x128 scales of b as [K/128, N/128] with
strides (1, L4), L4 = K/128 rounded up to 4 (torch 2.11 accepts only K/128 = L4: K a multiple of 512). The
wrappers below reorder the (small) scale tensors (once per call, except a's 1x128 scales in the m-grouped GEMM:
once per expert, since cuBLAS wants their M-stride to equal the expert's row count) and launch one
`torch._scaled_mm` per non-empty expert over its padded block (the expert bounds come from the host, one sync
per layer, made by the caller).
`torch._grouped_mm` exists on torch 2.11 CUDA (used on the H200) and on torch 2.13 CPU (used by the CPU tests),
including the 2-D x 2-D form with `offs` for the weight gradient.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _configs():
    if INTERPRET:
        return [triton.Config({"BN": 128, "GROUP_M": 8}, num_warps=4, num_stages=1)]
    return [triton.Config({"BN": bn, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bn, w, s in ((128, 8, 4), (256, 8, 3), (256, 8, 4), (128, 4, 4))]


# ----------------------------------------------------------------------------------------------------------------
# m-grouped: forward and data gradient


@triton.jit
def _mgrouped_step(acc, a_ptrs, b_ptrs, as_ptr, bs_ptr, k0, e, rm, rn, rk, n_ok, s_asm, s_ask, s_bse, s_bsn, s_bsk,
                   K: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr):
    a = tl.load(a_ptrs)
    b = tl.load(b_ptrs, mask=n_ok[:, None], other=0.0)
    if FP8:
        sa = tl.load(as_ptr + rm * s_asm + (k0 // 128) * s_ask)  # [BM]
        sb = tl.load(bs_ptr + e * s_bse + (rn // 128) * s_bsn + (k0 // 128) * s_bsk, mask=n_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
    elif UPCAST:
        acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.autotune(configs=_configs(), key=["N", "K", "FP8"])
@triton.jit
def _mgrouped_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, m_idx_ptr, M,
                     s_am, s_ak, s_asm, s_ask, s_be, s_bn, s_bk, s_bse, s_bsn, s_bsk, s_cm,
                     N: tl.constexpr, K: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr,
                     INTERP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                     GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = M // BM
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    n_ok = rn < N
    e = tl.load(m_idx_ptr + pid_m * BM).to(tl.int64)
    k_end = tl.where(e >= 0, K, 0)  # padding blocks run no K steps and store zeros
    e = tl.maximum(e, 0)
    acc = tl.zeros((BM, BN), tl.float32)
    a_ptrs = a_ptr + rm[:, None] * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + e * s_be + rn[:, None] * s_bn + rk[None, :] * s_bk
    if INTERP:
        k0 = 0
        while k0 < k_end:
            acc = _mgrouped_step(acc, a_ptrs, b_ptrs, as_ptr, bs_ptr, k0, e, rm, rn, rk, n_ok, s_asm, s_ask, s_bse,
                                 s_bsn, s_bsk, K, FP8, UPCAST)
            a_ptrs += BK * s_ak
            b_ptrs += BK * s_bk
            k0 += BK
    else:
        for k0 in range(0, k_end, BK):
            acc = _mgrouped_step(acc, a_ptrs, b_ptrs, as_ptr, bs_ptr, k0, e, rm, rn, rk, n_ok, s_asm, s_ask, s_bse,
                                 s_bsn, s_bsk, K, FP8, UPCAST)
            a_ptrs += BK * s_ak
            b_ptrs += BK * s_bk
    tl.store(c_ptr + rm[:, None] * s_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=n_ok[None, :])


def mgrouped_gemm(a, b, m_indices, *, a_scale=None, b_scale=None, out_dtype=torch.bfloat16):
    """out [M_pad, N] = a [M_pad, K] @ b[e] [N, K]^T per 128-row block (e from m_indices). FP8 when scales given;
    b may be any strided [E, N, K] view (the transposed weight copy for the data gradient)."""
    m, k = a.shape
    e, n, k2 = b.shape
    if k2 != k or m % 128 or k % 128:
        raise ValueError(f"mgrouped_gemm: a {tuple(a.shape)} and b {tuple(b.shape)} do not match, or M or K is not "
                         f"a multiple of 128")
    fp8 = a_scale is not None
    if fp8 and (a.stride(1) != 1 or b.stride(2) != 1):
        raise ValueError("mgrouped_gemm: FP8 operands must be K-contiguous")
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    asc = a_scale if fp8 else a
    bsc = b_scale if fp8 else b
    sa = (asc.stride(0), asc.stride(1)) if fp8 else (0, 0)
    sb = (bsc.stride(0), bsc.stride(1), bsc.stride(2)) if fp8 else (0, 0, 0)

    def grid(meta):
        return (m // 128 * triton.cdiv(n, meta["BN"]),)

    _mgrouped_kernel[grid](a, asc, b, bsc, out, m_indices, m, a.stride(0), a.stride(1), *sa, b.stride(0),
                           b.stride(1), b.stride(2), *sb, out.stride(0), N=n, K=k, FP8=fp8,
                           UPCAST=INTERPRET and not fp8, INTERP=INTERPRET, BM=128, BK=128 if fp8 else 64)
    return out


# ----------------------------------------------------------------------------------------------------------------
# k-grouped: weight gradient


@triton.jit
def _kgrouped_step(acc, a_ptr, as_ptr, b_ptr, bs_ptr, t0, rn, rk, rt, n_ok, k_ok, s_an, s_at, s_bk, s_bt, s_asn,
                   s_ast, s_bsk, s_bst, FP8: tl.constexpr, UPCAST: tl.constexpr):
    a = tl.load(a_ptr + rn[:, None] * s_an + (t0 + rt)[None, :] * s_at, mask=n_ok[:, None], other=0.0)  # [BN, BT]
    b = tl.load(b_ptr + rk[:, None] * s_bk + (t0 + rt)[None, :] * s_bt, mask=k_ok[:, None], other=0.0)  # [BK, BT]
    if FP8:
        sa = tl.load(as_ptr + rn * s_asn + (t0 // 128) * s_ast, mask=n_ok, other=0.0)
        sb = tl.load(bs_ptr + rk * s_bsk + (t0 // 128) * s_bst, mask=k_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
    elif UPCAST:
        acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.autotune(configs=_configs(), key=["N", "K", "FP8"])
@triton.jit
def _kgrouped_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, off_ptr, s_an, s_at, s_bk, s_bt, s_asn, s_ast, s_bsk,
                     s_bst, s_ce, s_cn, N: tl.constexpr, K: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr,
                     INTERP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                     GROUP_M: tl.constexpr):
    pid, e = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BN)
    num_k = tl.cdiv(K, BK)
    width = GROUP_M * num_k
    first_n = (pid // width) * GROUP_M
    size_n = tl.minimum(num_n - first_n, GROUP_M)
    pid_n = first_n + (pid % width) % size_n
    pid_k = (pid % width) // size_n
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * BK + tl.arange(0, BK)
    rt = tl.arange(0, BT)
    n_ok, k_ok = rn < N, rk < K
    start = tl.multiple_of(tl.load(off_ptr + e).to(tl.int32), 128)  # expert blocks are 128-aligned
    end = tl.load(off_ptr + e + 1).to(tl.int32)
    acc = tl.zeros((BN, BK), tl.float32)
    if INTERP:
        t0 = start
        while t0 < end:
            acc = _kgrouped_step(acc, a_ptr, as_ptr, b_ptr, bs_ptr, t0, rn, rk, rt, n_ok, k_ok, s_an, s_at, s_bk,
                                 s_bt, s_asn, s_ast, s_bsk, s_bst, FP8, UPCAST)
            t0 += BT
    else:
        for t0 in range(start, end, BT):
            acc = _kgrouped_step(acc, a_ptr, as_ptr, b_ptr, bs_ptr, t0, rn, rk, rt, n_ok, k_ok, s_an, s_at, s_bk,
                                 s_bt, s_asn, s_ast, s_bsk, s_bst, FP8, UPCAST)
    c = c_ptr + e.to(tl.int64) * s_ce + rn[:, None] * s_cn + rk[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


def kgrouped_gemm(a, b, offsets, *, a_scale=None, b_scale=None, out_dtype=torch.float32):
    """out [E, N, K]: out[e] = a[:, s:t] @ b[:, s:t]^T with [s, t) = offsets[e:e+2] (128-aligned). a [N, M_pad],
    b [K, M_pad] (any strides; FP8 operands token-contiguous with scales [N, M_pad/128], [K, M_pad/128])."""
    n, m = a.shape
    k, m2 = b.shape
    e = offsets.numel() - 1
    if m2 != m:
        raise ValueError(f"kgrouped_gemm: a {tuple(a.shape)} and b {tuple(b.shape)} disagree on the token dim")
    fp8 = a_scale is not None
    out = torch.empty(e, n, k, device=a.device, dtype=out_dtype)
    asc = a_scale if fp8 else a
    bsc = b_scale if fp8 else b
    sa = (asc.stride(0), asc.stride(1)) if fp8 else (0, 0)
    sb = (bsc.stride(0), bsc.stride(1)) if fp8 else (0, 0)

    def grid(meta):
        return (triton.cdiv(n, meta["BN"]) * triton.cdiv(k, 128), e)

    _kgrouped_kernel[grid](a, asc, b, bsc, out, offsets, a.stride(0), a.stride(1), b.stride(0), b.stride(1), *sa,
                           *sb, out.stride(0), out.stride(1), N=n, K=k, FP8=fp8, UPCAST=INTERPRET and not fp8,
                           INTERP=INTERPRET, BT=128 if fp8 else 64, BK=128)
    return out
