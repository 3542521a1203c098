"""The MoE path's bf16 grouped GEMMs in Triton over the m-grouped contiguous layout.

- m-grouped (forward and data gradient): out [M_pad, N] = A [M_pad, K] @ B_e [N, K]^T for each 128-row block of A,
  e = m_indices of the block's first row. Blocks with e = -1 (padding past the last expert, or a block that is
  only padding) run no K steps and are written as zeros.
- k-grouped (weight gradient): out [E, N, K] with out_e = A[:, rows_e] @ B[:, rows_e]^T, A [N, M_pad], B [K, M_pad]
  (transposed views of row-major activations), rows_e = expert e's padded block; the reduction runs along tokens.
  Empty experts get zeros. A tile's work is its expert's row count, and the grid is handed out to SMs as they free
  up, so a skewed expert load does not leave SMs idle behind the busiest experts' tiles (a persistent kernel with a
  static tile-to-SM assignment, such as torch._grouped_mm's, does).
Operands are addressed through strides, so row-major activations are read as their transposes without copies.
Under the Triton interpreter the operands are upcast to fp32 (its bf16 dot is wrong).

Launch configs: a shape in `TUNED` launches with the config measured best for it (`bench/moe_gemm.py --sections
wgrad_configs` times every one of `configs()`); any other shape is autotuned among `configs()` on its first call.
The table keeps the autotuner's timing pass (every config of every shape compiled and timed) out of the first
training step.

Shapes: M_pad padded rows, N output features, K reduction, E experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.triton_env import INTERPRET, require_interpreter_support

require_interpreter_support()


def configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BN": 128, "GROUP_M": 8}, num_warps=4, num_stages=1)]
    return [triton.Config({"BN": bn, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bn, w, s in ((128, 8, 4), (256, 8, 3), (256, 8, 4), (128, 4, 4))]


# (kernel, N, K) -> (BN, num_warps, num_stages). The weight gradient of `small` (w13: N 1024, K 1024; w2: 1024,
# 512) and V2-Lite (2816, 2048; 2048, 1408) at 64k tokens a step, uniform and skewed expert loads, on an H200:
# BN 256 / 8 warps / 3 stages within 1.7% of the fastest of `configs()` in all eight cases (BN 128 / 8 warps:
# 2-56% slower); the autotuner's pick, made from one timing of each config at the first call, varies.
TUNED: dict[tuple[str, int, int], tuple[int, int, int]] = {
    ("kgrouped", n, k): (256, 8, 3) for n, k in ((1024, 1024), (1024, 512), (2816, 2048), (2048, 1408))}


def _launch(kernel, autotuned, name: str, grid, args: tuple, n: int, k: int, config: tuple[int, int, int] | None,
            **constexprs) -> None:
    """Launches `kernel` with `config` (BN, num_warps, num_stages) if given, else TUNED's for the shape, else through
    its autotuner."""
    config = config or TUNED.get((name, n, k))
    if config is None:
        autotuned[grid](*args, **constexprs)
        return
    bn, warps, stages = config
    kernel[grid({"BN": bn})](*args, **constexprs, BN=bn, GROUP_M=8, num_warps=warps, num_stages=stages)


@triton.jit
def _grouped_tile(pid, num_rows, num_cols, GROUP: tl.constexpr):
    """Program pid's (row block, column block), GROUP row blocks walked together so that they share the column
    operand's tiles in L2."""
    width = GROUP * num_cols
    first_row = (pid // width) * GROUP
    group_rows = tl.minimum(num_rows - first_row, GROUP)
    return first_row + (pid % width) % group_rows, (pid % width) // group_rows


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b, in fp32 under the interpreter (UPCAST)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _mgrouped_kernel(
    a_ptr, stride_am, stride_ak,  # [M_pad, K]
    b_ptr, stride_be, stride_bn, stride_bk,  # [E, N, K]
    c_ptr, stride_cm,  # [M_pad, N], written
    m_idx_ptr,  # [M_pad] int32 expert of each row, -1 on padding
    M,
    N: tl.constexpr, K: tl.constexpr, UPCAST: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BM, BN] tile of out = A @ B_e^T, e the expert of its 128-row block. Grid: (M_pad/BM * cdiv(N, BN),)."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M // BM, tl.cdiv(N, BN), GROUP_M)
    rows_m = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    cols_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    n_ok = cols_n < N
    # the block's expert; padding blocks run no K steps and store zeros
    expert = tl.load(m_idx_ptr + pid_m * BM).to(tl.int64)
    k_end = tl.where(expert >= 0, K, 0)
    expert = tl.maximum(expert, 0)
    acc = tl.zeros((BM, BN), tl.float32)
    a_ptrs = a_ptr + rows_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + cols_n[:, None] * stride_bn + offs_k[None, :] * stride_bk
    for _ in range(0, k_end, BK):
        a = tl.load(a_ptrs)  # [BM, BK]
        b = tl.load(b_ptrs, mask=n_ok[:, None], other=0.0)  # [BN, BK]
        acc = _dot(a, tl.trans(b), acc, UPCAST)
        a_ptrs += BK * stride_ak
        b_ptrs += BK * stride_bk
    tl.store(c_ptr + rows_m[:, None] * stride_cm + cols_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=n_ok[None, :])


_mgrouped_autotuned = triton.autotune(configs=configs(), key=["N", "K"])(_mgrouped_kernel)


def mgrouped_gemm(a: torch.Tensor, b: torch.Tensor, m_indices: torch.Tensor, *,
                  out_dtype: torch.dtype = torch.bfloat16, config: tuple[int, int, int] | None = None
                  ) -> torch.Tensor:
    """out [M_pad, N] = a [M_pad, K] @ b[e] [N, K]^T per 128-row block (e from m_indices); b may be any strided
    [E, N, K] view (the transposed weight for the data gradient). `config` (BN, num_warps, num_stages): launch with
    it instead of the table's or the autotuner's (benchmarks)."""
    m, k = a.shape
    e, n, k2 = b.shape
    if k2 != k or m % 128 or k % 128:
        raise ValueError(f"mgrouped_gemm: a {tuple(a.shape)} and b {tuple(b.shape)} do not match, or M or K is not "
                         f"a multiple of 128")
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)

    def grid(meta):
        return (m // 128 * triton.cdiv(n, meta["BN"]),)

    args = (a, a.stride(0), a.stride(1),
            b, b.stride(0), b.stride(1), b.stride(2),
            out, out.stride(0),
            m_indices,
            m)
    _launch(_mgrouped_kernel, _mgrouped_autotuned, "mgrouped", grid, args, n, k, config,
            N=n, K=k, UPCAST=INTERPRET, BM=128, BK=64)
    return out


@triton.jit
def _kgrouped_kernel(
    a_ptr, stride_an, stride_at,  # [N, M_pad]
    b_ptr, stride_bk, stride_bt,  # [K, M_pad]
    c_ptr, stride_ce, stride_cn,  # [E, N, K], written
    offsets_ptr,  # [E + 1] int64 expert block starts (128-aligned)
    N: tl.constexpr, K: tl.constexpr, UPCAST: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BN, BK] tile of out_e = A[:, rows_e] @ B[:, rows_e]^T, reduced over expert e's rows in BT-token steps.
    Grid: (cdiv(N, BN) * cdiv(K, BK), E)."""
    pid_n, pid_k = _grouped_tile(tl.program_id(0), tl.cdiv(N, BN), tl.cdiv(K, BK), GROUP_M)
    expert = tl.program_id(1)
    rows_n = pid_n * BN + tl.arange(0, BN)
    cols_k = pid_k * BK + tl.arange(0, BK)
    offs_t = tl.arange(0, BT)
    n_ok, k_ok = rows_n < N, cols_k < K
    start = tl.multiple_of(tl.load(offsets_ptr + expert).to(tl.int32), 128)  # expert blocks are 128-aligned
    end = tl.load(offsets_ptr + expert + 1).to(tl.int32)
    acc = tl.zeros((BN, BK), tl.float32)
    for t_start in range(start, end, BT):
        tokens = t_start + offs_t
        a = tl.load(a_ptr + rows_n[:, None] * stride_an + tokens[None, :] * stride_at, mask=n_ok[:, None],
                    other=0.0)  # [BN, BT]
        b = tl.load(b_ptr + cols_k[:, None] * stride_bk + tokens[None, :] * stride_bt, mask=k_ok[:, None],
                    other=0.0)  # [BK, BT]
        acc = _dot(a, tl.trans(b), acc, UPCAST)
    c = c_ptr + expert.to(tl.int64) * stride_ce + rows_n[:, None] * stride_cn + cols_k[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


_kgrouped_autotuned = triton.autotune(configs=configs(), key=["N", "K"])(_kgrouped_kernel)


def kgrouped_gemm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *, out_dtype: torch.dtype = torch.float32,
                  config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """out [E, N, K]: out[e] = a[:, s:t] @ b[:, s:t]^T with [s, t) = offsets[e:e+2] (128-aligned). a [N, M_pad],
    b [K, M_pad] (any strides). `config`: as in mgrouped_gemm."""
    n, m = a.shape
    k, m2 = b.shape
    e = offsets.numel() - 1
    if m2 != m:
        raise ValueError(f"kgrouped_gemm: a {tuple(a.shape)} and b {tuple(b.shape)} disagree on the token dim")
    out = torch.empty(e, n, k, device=a.device, dtype=out_dtype)

    def grid(meta):
        return (triton.cdiv(n, meta["BN"]) * triton.cdiv(k, 128), e)

    args = (a, a.stride(0), a.stride(1),
            b, b.stride(0), b.stride(1),
            out, out.stride(0), out.stride(1),
            offsets)
    _launch(_kgrouped_kernel, _kgrouped_autotuned, "kgrouped", grid, args, n, k, config,
            N=n, K=k, UPCAST=INTERPRET, BT=64, BK=128)
    return out
