"""Grouped rowwise + columnwise quantization from one read, and the 128x128
weight quantization with its transposed copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.moe import gluon as moe_gluon
from moela.ops.moe.kernel_common import FP8, INTERPRET, LAUNCH, _quant, _scale_inv, _store_rows_cols


@triton.jit
def _rowcol_quant_kernel(x_ptr, src_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, N, ld_x, gather_div,
                         GATHER: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr):
    if GATHER:  # rows gathered from x: row blocks fastest (0.45 ms for the V3 layer's x, 0.56 the other way)
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    else:  # column blocks fastest: see LAUNCH
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m * 128 + tl.arange(0, 128)
    cols = pid_n * 128 + tl.arange(0, 128)
    row_ok, col_ok = rows < M, cols < N
    if GATHER:
        s = tl.load(src_ptr + rows, mask=row_ok, other=-1)
        ok = s >= 0
        srow = tl.where(ok, s // gather_div, 0).to(tl.int64)
    else:
        ok = row_ok
        srow = rows.to(tl.int64)
    tile = tl.load(x_ptr + srow[:, None] * ld_x + cols[None, :], mask=ok[:, None] & col_ok[None, :],
                   other=0.0).to(tl.float32)
    _store_rows_cols(tile, rows, cols, row_ok, col_ok, q_ptr, s_ptr, qt_ptr, st_ptr, N, N // 128, M, M // 128,
                     ROWWISE, COLWISE)


def _use_gluon(op: str, impl: str, *tensors: torch.Tensor) -> bool:
    """Whether `op` runs its Gluon kernel (moela.ops.moe.gluon): impl "gluon" demands it, "auto" takes it where it
    can run (never under the interpreter), "triton" never."""
    if impl not in ("auto", "triton", "gluon"):
        raise ValueError(f"{op}: impl={impl!r}; use 'auto', 'triton' or 'gluon'")
    ok = all(moe_gluon.available(t) for t in tensors)
    if impl == "gluon" and not ok:
        got = ", ".join(f"{t.dtype} on {t.device}" for t in tensors)
        raise ValueError(f"{op}: impl='gluon' needs bf16 CUDA tensors on a Hopper (sm_90) GPU and a Triton with Gluon "
                         f"(got {got}); use impl='triton'")
    return impl == "gluon" or (impl == "auto" and ok and not INTERPRET)


def quant_rows_cols(x: torch.Tensor, *, rowwise: bool = True, colwise: bool = True, src: torch.Tensor | None = None,
                    gather_div: int = 1, impl: str = "auto"):
    """One read of x [M, N] (or of rows x[src // gather_div], zero where src < 0, M = len(src)); returns
    (q [M, N] e4m3, s [M, N/128]) rowwise and (qT [N, M] e4m3, sT [N, M/128]) columnwise (None where not asked).
    M and N must be multiples of 128 (the padded layout guarantees M). impl: "triton" (the tile in registers; runs
    everywhere, the interpreter included), "gluon" (the tile staged in shared memory, moela.ops.moe.gluon: bf16 on
    sm_90), "auto" (gluon where it can run, else triton). Both give the same bytes."""
    m = src.numel() if src is not None else x.shape[0]
    n = x.shape[1]
    if m % 128 or n % 128:
        raise ValueError(f"quant_rows_cols: shape ({m}, {n}) must be multiples of 128 in both dims")
    use_gluon = _use_gluon("quant_rows_cols", impl, x)
    dev = x.device
    q = torch.empty(m, n, device=dev, dtype=FP8) if rowwise else None
    s = torch.empty(m, n // 128, device=dev, dtype=torch.float32) if rowwise else None
    qt = torch.empty(n, m, device=dev, dtype=FP8) if colwise else None
    st = torch.empty(n, m // 128, device=dev, dtype=torch.float32) if colwise else None
    if use_gluon:
        moe_gluon.quant_rows_cols(x, rowwise, colwise, src, gather_div, q, s, qt, st)
        return (q, s), (qt, st)
    dummy = x
    _rowcol_quant_kernel[(m // 128, n // 128) if src is not None else (n // 128, m // 128)](
        x, src if src is not None else dummy, q if rowwise else dummy, s if rowwise else dummy,
        qt if colwise else dummy, st if colwise else dummy, m, n, x.stride(0), gather_div,
        GATHER=src is not None, ROWWISE=rowwise, COLWISE=colwise,
        **LAUNCH["quant_rows_cols" if rowwise and colwise else "quant_rows_or_cols"])
    return (q, s), (qt, st)


@triton.jit
def _weight_quant_kernel(w_ptr, q_ptr, s_ptr, s_we, s_wn, s_wk, N, K):
    """One 128x128 block of expert e of a strided view [E, N, K] -> contiguous q [E, N, K] and its scale."""
    bk, bn, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = bn * 128 + tl.arange(0, 128)
    rk = bk * 128 + tl.arange(0, 128)
    src = w_ptr + e.to(tl.int64) * s_we + rn[:, None].to(tl.int64) * s_wn + rk[None, :].to(tl.int64) * s_wk
    blk = tl.load(src).to(tl.float32)  # [128, 128]
    sc, inv = _scale_inv(tl.max(tl.max(tl.abs(blk), axis=1), axis=0))
    tl.store(q_ptr + e.to(tl.int64) * N * K + rn[:, None] * K + rk[None, :], _quant(blk, inv))
    tl.store(s_ptr + (e * (N // 128) + bn) * (K // 128) + bk, sc)


def _weight_quant_launch(w: torch.Tensor):
    e, n, k = w.shape
    q = torch.empty(e, n, k, device=w.device, dtype=FP8)
    s = torch.empty(e, n // 128, k // 128, device=w.device, dtype=torch.float32)
    _weight_quant_kernel[(k // 128, n // 128, e)](w, q, s, w.stride(0), w.stride(1), w.stride(2), n, k,
                                                  **LAUNCH["weight_quant"])
    return q, s


def quant_weights(w: torch.Tensor, *, transposed: bool = True, transpose_by: str = "quant", impl: str = "auto"):
    """w [E, N, K] -> q [E, N, K] e4m3, s [E, N/128, K/128] fp32, and qT [E, K, N] (whose scales are
    s.transpose(1, 2)) when `transposed`. N and K must be multiples of 128. impl "gluon" (moela.ops.moe.gluon;
    contiguous bf16 on sm_90, "auto" takes it where it can run): one read of w, each 128x128 block staged in shared
    memory and its codes written to q and, read back by columns, to qT. impl "triton": transpose_by="quant" runs
    the kernel again on the transposed view of w: every 128x128 block has the same amax, hence the same scale and
    codes, so qT is exactly q's transpose, written with coalesced row stores (2.24 ms for both launches on w13 + w2
    of the V3 E32 layer on the H200, bench/results/moe.md run 11); "torch" copies q.transpose(1, 2) byte by byte
    (9.6 ms, run 4). Writing qT from the same Triton kernel gave wrong bytes on the H200 (triton 3.6) in three
    designs, though bit-exact in the interpreter: codes stored at transposed addresses (fp8 and uint8 stores) and
    the bf16 block transposed on chip (tl.trans) and quantized again; only that transpose inside a persistent,
    software-pipelined loop (the block read back from shared memory transposed) was right, and it was no faster
    (3.5 ms). The Gluon kernel's bytes are checked against the Triton launches on the GPU
    (tests/test_quant.py::test_gluon_weight_quant_equals_the_triton_kernel)."""
    e, n, k = w.shape
    if n % 128 or k % 128:
        raise ValueError(f"quant_weights: expert weight shape ({n}, {k}) must be multiples of 128")
    if transpose_by not in ("quant", "torch"):
        raise ValueError(f"quant_weights: transpose_by={transpose_by!r}; use 'quant' or 'torch'")
    if impl == "gluon" and transpose_by != "quant":
        raise ValueError("quant_weights: transpose_by='torch' is a way of the Triton kernel; use impl='triton'")
    if impl == "auto" and (not w.is_contiguous() or transpose_by != "quant"):
        impl = "triton"
    if _use_gluon("quant_weights", impl, w):
        w = w.contiguous()
        q = torch.empty(e, n, k, device=w.device, dtype=FP8)
        s = torch.empty(e, n // 128, k // 128, device=w.device, dtype=torch.float32)
        qt = torch.empty(e, k, n, device=w.device, dtype=FP8) if transposed else None
        moe_gluon.quant_weights(w, q, s, qt)
        return q, s, qt
    q, s = _weight_quant_launch(w)
    if not transposed:
        return q, s, None
    qt = _weight_quant_launch(w.transpose(1, 2))[0] if transpose_by == "quant" else q.transpose(1, 2).contiguous()
    return q, s, qt  # qt [E, K, N]
