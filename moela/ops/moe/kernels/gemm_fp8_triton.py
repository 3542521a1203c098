"""Persistent blockwise FP8 GEMMs (DeepSeek-V3 scaling) for the MoE expert path and the FP8 linear layers: one
launch each, expert bounds read from device memory (no host sync, capturable in a CUDA graph). `mgrouped_fp8` and
`kgrouped_fp8` are the entry points: they check the operands and run the Triton kernel here or the Gluon kernel of
the same product (`impl`).

- m-grouped (forward and data gradient; with one group: a dense GEMM): out [M, N] = A [M, K] @ B_e [N, K]^T for
  each BM-row block of A, e = m_indices[block's first row] (DeepGEMM's contiguous layout: expert blocks 128-aligned,
  so a block never straddles two experts). A: e4m3 with 1x128 scales [M, K/128]; B: e4m3 [E, N, K] with 128x128
  scales [E, N/128, K/128] (any strides: the data gradient passes the transposed weight copy and its scales'
  transposed view). Rows past offsets[E] (the padded total, read on the device) are not computed and not written:
  every consumer of the layout masks them.
- k-grouped (weight gradient): out [E, N, K], out_e = A[:, s:t] @ B[:, s:t]^T with [s, t) = offsets[e:e+2] (the
  reduction runs along tokens); A [N, M], B [K, M] token-contiguous e4m3 with scales along tokens [N, M/128],
  [K, M/128] (the column quantization of the activations). Empty experts get zeros.

Numerics (DeepSeek-V3's promotion): each 128-wide step of the reduction is one fp8 tensor-core product whose fp32
result is multiplied by its two scales and added to an fp32 accumulator held in registers, so the tensor core's
limited-precision accumulation never spans more than 128 products. Output in out's dtype (bf16 / fp32).

Hopper design: operands arrive by TMA through tensor descriptors built on the device (`tl.make_tensor_descriptor`;
out-of-range rows and columns of a ragged edge read as zeros and are not stored); the reduction loop is software
pipelined (num_stages buffers in flight); tl.dot on e4m3 tiles in shared memory lowers to wgmma (checked in the
sm_90 PTX by tests/sm90_compile.py, with no register spills). The grid is one program per SM; each program walks
tiles pid, pid + #SMs, ... in a grouped order (GROUP consecutive row blocks share each column block, so the B
tiles they read stay in L2), so one launch covers every expert whatever the routing, and a tile past the routed
rows costs one comparison. Triton 3.6 does not warp-specialize on sm_90 (a `warp_specialize=True` loop compiles
to the same single-partition code), so the loads are hidden by software pipelining only. Each kernel has one
launch configuration (`MGROUPED`, `KGROUPED`), chosen without autotuning (a timing pass at the first call would
run inside CUDA graph capture or a compiled step).

Both products have a second implementation on Hopper, warp-specialized in Gluon (a TMA producer warp, two
consumer warpgroups promoting while the other's wgmma runs): gemm_fp8_gluon_mgrouped.py and
gemm_fp8_gluon_kgrouped.py, same arguments and results. `impl`: "gluon", "triton", or "auto" (the Gluon kernel
wherever it can run, the faster of the two on Hopper at every measured shape; this Triton kernel elsewhere and
under the interpreter). The recipe keys `model.kernels.moe_fp8_gemm` / `moe_fp8_wgrad` choose it for the experts.

Shapes: M rows (padded layout or tokens), N output features, K reduction, E experts (groups).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moela.ops.moe.kernels import gemm_fp8_gluon_kgrouped, gemm_fp8_gluon_mgrouped
from moela.ops.triton_env import INTERPRET

INTERPRETER_SMS = 3  # programs of the persistent grid under the interpreter: several tiles per program get tested
FP8_GEMM_IMPLS = ("auto", "gluon", "triton")


@dataclass(frozen=True)
class GemmConfig:
    """A launch configuration: tile BM x BN (x 128 of the reduction), GROUP row blocks per column block in the tile
    order, warps and pipeline stages."""

    bm: int
    bn: int
    group: int
    num_warps: int
    num_stages: int


# BM x 128 output tiles (m-grouped): one 128x128 weight block per tile and step, so its scale is a scalar and the
# promotion one FMA per element; at 8 warps the fp32 sum and one step's product take 2 x 64 registers per thread.
# A 128 x 256 tile needs 4 x 64 (Triton issues both halves' products before promoting either) and spills on sm_90.
# The k-grouped tiles carry a row and a column scale vector per step (the column one is 32 registers per thread at
# 64 wide, 64 at 128 wide, twice that with the next step's prefetched): 128 x 64 keeps them without spilling.
MGROUPED = GemmConfig(128, 128, 8, 8, 4)
KGROUPED = GemmConfig(128, 64, 8, 8, 4)


def _launch_config(cfg: GemmConfig) -> GemmConfig:
    """Under the interpreter: the same tiles, a small tile group (several groups per test) and no pipeline."""
    return GemmConfig(cfg.bm, cfg.bn, 2, cfg.num_warps, 1) if INTERPRET else cfg


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid_size(device: torch.device, tiles: int) -> int:
    sms = INTERPRETER_SMS if device.type != "cuda" else _num_sms(device.index or 0)
    return max(1, min(sms, tiles))


def _alloc(size: int, alignment: int, stream):
    """Global scratch for the tensor descriptors the kernels build on the device (128 bytes each per program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _set_allocator(device: torch.device) -> None:
    """Triton keeps its allocator in a context variable: set it in the calling thread (autograd's backward runs in
    its own threads)."""
    if device.type == "cuda":
        triton.set_allocator(_alloc)


def _uses_gluon(op: str, impl: str, out_dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    """Whether this call of `op` runs the Gluon kernel: "gluon" demands it, "auto" takes it where it can run,
    "triton" never."""
    if impl not in FP8_GEMM_IMPLS:
        raise ValueError(f"{op}: impl={impl!r}; use one of {', '.join(FP8_GEMM_IMPLS)}")
    dev = tensors[0].device
    runs = (not INTERPRET and gemm_fp8_gluon_mgrouped.available(dev) and out_dtype in (torch.bfloat16, torch.float32)
            and all(t.data_ptr() % 16 == 0 for t in tensors))
    if impl == "gluon" and not runs:
        raise ValueError(f"{op}: impl='gluon' needs a Hopper (sm_90) GPU, a Triton with Gluon, no "
                         f"TRITON_INTERPRET, 16-byte aligned operands and a bf16 or fp32 output (got {dev}, "
                         f"{out_dtype}); use impl='triton'")
    return runs and impl != "triton"


@triton.jit
def _tile_mn(tile, num_m, num_n, GROUP: tl.constexpr):
    """Tile index -> (row block, column block), GROUP row blocks per column block (consecutive tiles share B)."""
    width = GROUP * num_n
    first_m = (tile // width) * GROUP
    size_m = tl.minimum(num_m - first_m, GROUP)
    return first_m + (tile % width) % size_m, (tile % width) // size_m


# ----------------------------------------------------------------------------------------------------------------
# m-grouped: forward and data gradient


@triton.jit
def _mgrouped_scales(as_ptr, bs_ptr, rows, row_ok, kb, k_steps, bs_base, s_asm, s_ask, s_bsk):
    """Step kb's scales: a's [BM] (rows) and the weight block's scalar (zeros past the last step)."""
    sa = tl.load(as_ptr + rows * s_asm + kb * s_ask, mask=row_ok & (rows * 0 + kb < k_steps), other=0.0)
    sb = tl.load(bs_ptr + bs_base + kb * s_bsk, mask=kb < k_steps, other=0.0)
    return sa, sb


@triton.jit
def _mgrouped_fp8_kernel(
    a_ptr,  # [M, K] e4m3 row-major
    as_ptr, s_asm, s_ask,  # a's scales [M, K/128] fp32
    b_ptr,  # [E * N, K] e4m3 row-major: the experts' [N, K] stacked
    bs_ptr, s_bse, s_bsn, s_bsk,  # b's scales [E, N/128, K/128] fp32
    c_ptr,  # [M, N] row-major, written (rows past offsets[E] not written when GROUPED)
    m_idx_ptr,  # [M] int32 expert of each row, -1 on padding (GROUPED)
    off_ptr,  # [E + 1] int64 expert block starts; offsets[E] = the rows in use (GROUPED)
    M, N, K, E, NUM_PROGRAMS,
    GROUPED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
):
    """Persistent: program p computes tiles p, p + NUM_PROGRAMS, ... of the (M/BM) x (N/BN) output. A tile of
    expert e's last column block may read expert e+1's rows of B into columns past N, which are not stored.
    GROUPED: M is the padded layout's bound and rows past offsets[E] are skipped; otherwise E = 1 and M is the real
    row count (a ragged last block). Each step's scales are loaded one step ahead (plain loads: a [BM, 1] column of
    a row-major scale matrix is no TMA box)."""
    pid = tl.program_id(0)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E * N, K], strides=[K, 1], block_shape=[BN, BK])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    m_used = M
    if GROUPED:
        m_used = tl.load(off_ptr + E).to(tl.int32)  # rows the routing filled (padded per expert)
    k_steps = tl.cdiv(K, BK)
    for tile in tl.range(pid, num_m * num_n, NUM_PROGRAMS):
        pid_m, pid_n = _tile_mn(tile, num_m, num_n, GROUP)
        m0 = pid_m * BM
        if m0 < m_used:
            n0 = pid_n * BN
            e = 0
            if GROUPED:
                e = tl.maximum(tl.load(m_idx_ptr + m0), 0)  # a block inside [0, offsets[E]) has an expert
            rows = m0 + tl.arange(0, BM)
            row_ok = rows < M
            b_row = e * N + n0
            bs_base = e * s_bse + (n0 // 128) * s_bsn
            acc = tl.zeros((BM, BN), tl.float32)
            sa, sb = _mgrouped_scales(as_ptr, bs_ptr, rows, row_ok, 0, k_steps, bs_base, s_asm, s_ask, s_bsk)
            for kb in range(0, k_steps):
                # the next step's scales in flight while this step's fp8 product runs; then the promotion
                sa_next, sb_next = _mgrouped_scales(as_ptr, bs_ptr, rows, row_ok, kb + 1, k_steps, bs_base, s_asm,
                                                    s_ask, s_bsk)
                a = a_desc.load([m0, kb * BK])  # [BM, BK] e4m3
                b = b_desc.load([b_row, kb * BK])  # [BN, BK] e4m3
                acc += tl.dot(a, b.T) * (sa * sb)[:, None]
                sa, sb = sa_next, sb_next
            c_desc.store([m0, n0], acc.to(c_desc.dtype))


def mgrouped_fp8(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                 m_indices: torch.Tensor | None = None, offsets: torch.Tensor | None = None, *,
                 out_dtype: torch.dtype = torch.bfloat16, impl: str = "auto") -> torch.Tensor:
    """out [M, N] = a [M, K] @ b[e] [N, K]^T per row block, e from m_indices (grouped) or 0 (b [1, N, K] or
    [N, K]: a dense GEMM with any M). a, b e4m3 and K-contiguous (b's experts stacked contiguously); scales fp32
    with any strides: a_scale [M, ceil(K/128)], b_scale [E, ceil(N/128), ceil(K/128)] (or 2-D for one group).
    Grouped (m_indices [M] and offsets [E+1] of the 128-aligned layout): rows at or past offsets[E] are left
    unwritten. impl: "triton", "gluon" (sm_90, gemm_fp8_gluon_mgrouped.py) or "auto" (module docstring)."""
    if b.dim() == 2:
        b, b_scale = b[None], b_scale[None]
    m, k = a.shape
    e, n, k2 = b.shape
    grouped = m_indices is not None
    if k2 != k or a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"mgrouped_fp8: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} must be "
                         f"e4m3 with the same K")
    if grouped and (offsets is None or offsets.numel() != e + 1 or m % 128):
        raise ValueError("mgrouped_fp8: the grouped GEMM needs offsets [E+1] with m_indices and M a multiple of 128")
    if not grouped and e != 1:
        raise ValueError(f"mgrouped_fp8: {e} groups need m_indices and offsets")
    if a.stride(1) != 1 or a.stride(0) != k or not b.is_contiguous() or k % 16 or n % 8:
        raise ValueError("mgrouped_fp8: a and b must be row-major and contiguous, K a multiple of 16 and N of 8 "
                         "(TMA: 16-byte aligned rows)")
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    if _uses_gluon("mgrouped_fp8", impl, out_dtype, a, b):
        return gemm_fp8_gluon_mgrouped.mgrouped_fp8_gluon(a, a_scale, b, b_scale, m_indices, offsets, out,
                                                          _num_sms(a.device.index or 0))
    cfg = _launch_config(MGROUPED)
    grid = _grid_size(a.device, triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn))
    _set_allocator(a.device)
    dummy = a_scale  # in place of the layout's tensors when there is one group (never read)
    _mgrouped_fp8_kernel[(grid,)](
        a,
        a_scale, a_scale.stride(0), a_scale.stride(1),
        b,
        b_scale, b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
        out,
        m_indices if grouped else dummy,
        offsets if grouped else dummy,
        m, n, k, e, grid,
        GROUPED=grouped, BM=cfg.bm, BN=cfg.bn, BK=128, GROUP=cfg.group, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


# ----------------------------------------------------------------------------------------------------------------
# k-grouped: weight gradient


@triton.jit
def _kgrouped_scales(as_ptr, bs_ptr, rn, n_ok, rk, k_ok, tb, end_tb, s_asn, s_ast, s_bsk, s_bst):
    """Token block tb's scales: a's [BN] and b's [BK] (zeros at or past end_tb)."""
    sa = tl.load(as_ptr + rn * s_asn + tb * s_ast, mask=n_ok & (rn * 0 + tb < end_tb), other=0.0)
    sb = tl.load(bs_ptr + rk * s_bsk + tb * s_bst, mask=k_ok & (rk * 0 + tb < end_tb), other=0.0)
    return sa, sb


@triton.jit
def _kgrouped_fp8_kernel(
    a_ptr,  # [N, M] e4m3 token-contiguous
    as_ptr, s_asn, s_ast,  # a's scales along tokens [N, M/128] fp32
    b_ptr,  # [K, M] e4m3 token-contiguous
    bs_ptr, s_bsk, s_bst,  # b's scales along tokens [K, M/128] fp32
    c_ptr,  # [E * N, K] row-major, written
    off_ptr,  # [E + 1] int64 expert block starts, 128-aligned (GROUPED)
    N, K, M, E, NUM_PROGRAMS,
    GROUPED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, GROUP: tl.constexpr,
):
    """Persistent over E x (N/BN) x (K/BK) tiles, expert-major (the programs in flight share one expert's token
    slices in L2); tile (e, n, k) reduces over expert e's tokens [offsets[e], offsets[e+1]) (GROUPED) or all M,
    promoting each 128-token block with its row and column scales (loaded one block ahead)."""
    pid = tl.program_id(0)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[N, M], strides=[M, 1], block_shape=[BN, BT])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, M], strides=[M, 1], block_shape=[BK, BT])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[E * N, K], strides=[K, 1], block_shape=[BN, BK])
    num_n = tl.cdiv(N, BN)
    num_k = tl.cdiv(K, BK)
    per_e = num_n * num_k
    for tile in tl.range(pid, E * per_e, NUM_PROGRAMS):
        e = tile // per_e
        pid_n, pid_k = _tile_mn(tile % per_e, num_n, num_k, GROUP)
        n0, k0 = pid_n * BN, pid_k * BK
        rn = n0 + tl.arange(0, BN)
        rk = k0 + tl.arange(0, BK)
        n_ok, k_ok = rn < N, rk < K
        if GROUPED:
            start = tl.load(off_ptr + e).to(tl.int32) // BT  # expert blocks are 128-aligned
            end = tl.load(off_ptr + e + 1).to(tl.int32) // BT
        else:
            start = 0
            end = tl.cdiv(M, BT)
        acc = tl.zeros((BN, BK), tl.float32)
        sa, sb = _kgrouped_scales(as_ptr, bs_ptr, rn, n_ok, rk, k_ok, start, end, s_asn, s_ast, s_bsk, s_bst)
        for tb in range(start, end):
            # the next block's scales in flight while this block's fp8 product runs; then the promotion
            sa_next, sb_next = _kgrouped_scales(as_ptr, bs_ptr, rn, n_ok, rk, k_ok, tb + 1, end, s_asn, s_ast, s_bsk,
                                                s_bst)
            a = a_desc.load([n0, tb * BT])  # [BN, BT] e4m3
            b = b_desc.load([k0, tb * BT])  # [BK, BT] e4m3
            acc += tl.dot(a, b.T) * sa[:, None] * sb[None, :]
            sa, sb = sa_next, sb_next
        c_desc.store([e * N + n0, k0], acc.to(c_desc.dtype))


def kgrouped_fp8(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                 offsets: torch.Tensor | None = None, *, out_dtype: torch.dtype = torch.float32, impl: str = "auto",
                 order: torch.Tensor | None = None) -> torch.Tensor:
    """out [E, N, K]: out[e] = a[:, s:t] @ b[:, s:t]^T with [s, t) = offsets[e:e+2] (128-aligned, on the device);
    without offsets one group over all M columns (out [1, N, K]). a [N, M], b [K, M] e4m3, token-contiguous rows
    (M a multiple of 16: TMA rows are 16-byte aligned; columns past the real tokens must hold zero codes or lie past
    M); scales fp32 along tokens a_scale [N, ceil(M/128)], b_scale [K, ceil(M/128)] (any strides). Grouped: N a
    multiple of 128 (a tile never spans two experts' outputs). impl: "triton", "gluon" (sm_90,
    gemm_fp8_gluon_kgrouped.py) or "auto" (module docstring). order: the Gluon kernel's expert order
    (`gemm_fp8_gluon_kgrouped.experts_by_load(offsets)` when None; a caller with two weight gradients over one
    layout sorts once)."""
    n, m = a.shape
    k, m2 = b.shape
    if m2 != m or a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"kgrouped_fp8: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} must be e4m3 "
                         f"over the same tokens")
    if not (a.is_contiguous() and b.is_contiguous()) or m % 16 or k % 16:
        raise ValueError("kgrouped_fp8: a and b must be contiguous, the token count and K multiples of 16")
    grouped = offsets is not None
    e = offsets.numel() - 1 if grouped else 1
    if grouped and n % 128:
        raise ValueError(f"kgrouped_fp8: N={n} must be a multiple of 128 for the grouped weight gradient")
    out = torch.empty(e, n, k, device=a.device, dtype=out_dtype)
    if _uses_gluon("kgrouped_fp8", impl, out_dtype, a, b):
        return gemm_fp8_gluon_kgrouped.kgrouped_fp8_gluon(a, a_scale, b, b_scale, offsets, out,
                                                          _num_sms(a.device.index or 0), order)
    cfg = _launch_config(KGROUPED)
    grid = _grid_size(a.device, e * triton.cdiv(n, cfg.bm) * triton.cdiv(k, cfg.bn))
    _set_allocator(a.device)
    _kgrouped_fp8_kernel[(grid,)](
        a,
        a_scale, a_scale.stride(0), a_scale.stride(1),
        b,
        b_scale, b_scale.stride(0), b_scale.stride(1),
        out,
        offsets if grouped else a_scale,
        n, k, m, e, grid,
        GROUPED=grouped, BN=cfg.bm, BK=cfg.bn, BT=128, GROUP=cfg.group, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out
