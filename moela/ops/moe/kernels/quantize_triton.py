"""The MoE path's standalone FP8 quantizations: rowwise + columnwise from one read of an activation (optionally
gathering its rows through the layout), and the 128x128 quantization of all experts' weights with the transposed
copy the data-gradient GEMM reads.

On Hopper, for bf16 inputs, both run the Gluon kernels of quantize_gluon.py (the tile staged in shared memory) where
they can; the Triton kernels here run everywhere else, the interpreter included, and write the same bytes.

Shapes: M rows (M_pad in the layout), N columns; E experts, N x K expert weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.moe.kernels import quantize_gluon
from moela.ops.moe.kernels.triton_common import FP8, LAUNCH, e4m3_codes, fp8_scale_inverse, store_tile_quantized
from moela.ops.triton_env import INTERPRET


@triton.jit
def _rowcol_quant_kernel(
    x_ptr, ld_x,  # [rows of x, N] bf16/fp16/fp32 and its row stride
    src_ptr,  # [M] int32 (GATHER): tile row r reads x row src[r] // gather_div, zeros where src[r] < 0
    q_ptr,  # [M, N] e4m3, written (ROWWISE)
    s_ptr,  # [M, N/128] fp32, written (ROWWISE)
    qt_ptr,  # [N, M] e4m3, written (COLWISE)
    st_ptr,  # [N, M/128] fp32, written (COLWISE)
    M, N, gather_div,
    GATHER: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
):
    """One 128x128 tile of x (or of its gathered rows) per program, quantized by rows and/or by columns. Grid:
    (N/128, M/128), column blocks fastest; gathering, (M/128, N/128), row blocks fastest (measured faster there)."""
    if GATHER:
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    else:
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m * 128 + tl.arange(0, 128)
    cols = pid_n * 128 + tl.arange(0, 128)
    row_ok, col_ok = rows < M, cols < N
    # the rows of x this tile reads
    if GATHER:
        src = tl.load(src_ptr + rows, mask=row_ok, other=-1)
        read = src >= 0
        x_rows = tl.where(read, src // gather_div, 0).to(tl.int64)
    else:
        read = row_ok
        x_rows = rows.to(tl.int64)
    tile = tl.load(x_ptr + x_rows[:, None] * ld_x + cols[None, :], mask=read[:, None] & col_ok[None, :],
                   other=0.0).to(tl.float32)
    store_tile_quantized(tile, rows, cols, row_ok, col_ok, q_ptr, N, s_ptr, N // 128, qt_ptr, M, st_ptr, M // 128,
                         ROWWISE, COLWISE)


def use_gluon(op: str, impl: str, *tensors: torch.Tensor) -> bool:
    """Whether `op` runs its Gluon kernel (quantize_gluon.py): impl "gluon" demands it, "auto" takes it where it can
    run (never under the interpreter), "triton" never."""
    if impl not in ("auto", "triton", "gluon"):
        raise ValueError(f"{op}: impl={impl!r}; use 'auto', 'triton' or 'gluon'")
    ok = all(quantize_gluon.available(t) for t in tensors)
    if impl == "gluon" and not ok:
        got = ", ".join(f"{t.dtype} on {t.device}" for t in tensors)
        raise ValueError(f"{op}: impl='gluon' needs bf16 CUDA tensors on a Hopper (sm_90) GPU and a Triton with Gluon "
                         f"(got {got}); use impl='triton'")
    return impl == "gluon" or (impl == "auto" and ok and not INTERPRET)


QuantPair = tuple[torch.Tensor | None, torch.Tensor | None]


def quant_rows_cols(x: torch.Tensor, *, rowwise: bool = True, colwise: bool = True, src: torch.Tensor | None = None,
                    gather_div: int = 1, impl: str = "auto") -> tuple[QuantPair, QuantPair]:
    """One read of x [M, N] (or of rows x[src // gather_div], zero where src < 0, M = len(src)); returns
    (q [M, N] e4m3, s [M, N/128]) rowwise and (qT [N, M] e4m3, sT [N, M/128]) columnwise (None where not asked).
    M and N must be multiples of 128 (the padded layout guarantees M). impl: "triton" (the tile in registers; runs
    everywhere, the interpreter included), "gluon" (the tile staged in shared memory, quantize_gluon.py: bf16 on
    sm_90), "auto" (gluon where it can run, else triton). Both give the same bytes."""
    m = src.numel() if src is not None else x.shape[0]
    n = x.shape[1]
    if m % 128 or n % 128:
        raise ValueError(f"quant_rows_cols: shape ({m}, {n}) must be multiples of 128 in both dims")
    gluon = use_gluon("quant_rows_cols", impl, x)
    dev = x.device
    q = torch.empty(m, n, device=dev, dtype=FP8) if rowwise else None
    s = torch.empty(m, n // 128, device=dev, dtype=torch.float32) if rowwise else None
    qt = torch.empty(n, m, device=dev, dtype=FP8) if colwise else None
    st = torch.empty(n, m // 128, device=dev, dtype=torch.float32) if colwise else None
    if gluon:
        quantize_gluon.quant_rows_cols(x, rowwise, colwise, src, gather_div, q, s, qt, st)
        return (q, s), (qt, st)
    unused = x  # any pointer for an output not asked for
    _rowcol_quant_kernel[(m // 128, n // 128) if src is not None else (n // 128, m // 128)](
        x, x.stride(0),
        src if src is not None else unused,
        q if rowwise else unused,
        s if rowwise else unused,
        qt if colwise else unused,
        st if colwise else unused,
        m, n, gather_div,
        GATHER=src is not None, ROWWISE=rowwise, COLWISE=colwise,
        **LAUNCH["quant_rows_cols" if rowwise and colwise else "quant_rows_or_cols"])
    return (q, s), (qt, st)


@triton.jit
def _weight_quant_kernel(
    w_ptr, stride_we, stride_wn, stride_wk,  # [E, N, K] any strides (a transposed view too)
    q_ptr,  # [E, N, K] e4m3, contiguous, written
    s_ptr,  # [E, N/128, K/128] fp32, written
    N, K,
):
    """Program (k block, n block, expert): q = e4m3(w * 448 / amax) over one 128x128 block and its scale
    amax / 448. Grid: (K/128, N/128, E)."""
    block_k, block_n, expert = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows_n = block_n * 128 + tl.arange(0, 128)
    cols_k = block_k * 128 + tl.arange(0, 128)
    block = tl.load(w_ptr + expert.to(tl.int64) * stride_we + rows_n[:, None].to(tl.int64) * stride_wn
                    + cols_k[None, :].to(tl.int64) * stride_wk).to(tl.float32)  # [128, 128]
    scale, inverse = fp8_scale_inverse(tl.max(tl.max(tl.abs(block), axis=1), axis=0))
    tl.store(q_ptr + expert.to(tl.int64) * N * K + rows_n[:, None] * K + cols_k[None, :], e4m3_codes(block, inverse))
    tl.store(s_ptr + (expert * (N // 128) + block_n) * (K // 128) + block_k, scale)


def _weight_quant_launch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    e, n, k = w.shape
    q = torch.empty(e, n, k, device=w.device, dtype=FP8)
    s = torch.empty(e, n // 128, k // 128, device=w.device, dtype=torch.float32)
    _weight_quant_kernel[(k // 128, n // 128, e)](
        w, w.stride(0), w.stride(1), w.stride(2),
        q,
        s,
        n, k,
        **LAUNCH["weight_quant"])
    return q, s


def quant_weights(w: torch.Tensor, *, transposed: bool = True, impl: str = "auto"
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w [E, N, K] -> q [E, N, K] e4m3, s [E, N/128, K/128] fp32, and qT [E, K, N] (whose scales are
    s.transpose(1, 2)) when `transposed`. N and K must be multiples of 128.
    impl "gluon" (quantize_gluon.py; contiguous bf16 on sm_90; "auto" takes it where it can run): one read of w,
    each 128x128 block staged in shared memory, its codes written to q and, read back by columns, to qT.
    impl "triton": qT from a second launch on the transposed view of w (every 128x128 block has the same amax, hence
    the same scale and codes, so qT is exactly q's transpose, written with coalesced row stores). Writing qT from the
    same Triton launch gave wrong bytes on the H200 (`store_e4m3_bytes`)."""
    e, n, k = w.shape
    if n % 128 or k % 128:
        raise ValueError(f"quant_weights: expert weight shape ({n}, {k}) must be multiples of 128")
    if impl == "auto" and not w.is_contiguous():
        impl = "triton"
    if use_gluon("quant_weights", impl, w):
        q = torch.empty(e, n, k, device=w.device, dtype=FP8)
        s = torch.empty(e, n // 128, k // 128, device=w.device, dtype=torch.float32)
        qt = torch.empty(e, k, n, device=w.device, dtype=FP8) if transposed else None
        quantize_gluon.quant_weights(w.contiguous(), q, s, qt)
        return q, s, qt
    q, s = _weight_quant_launch(w)
    qt = _weight_quant_launch(w.transpose(1, 2))[0] if transposed else None
    return q, s, qt  # qt [E, K, N]
