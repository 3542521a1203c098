"""Column (128x1, along tokens) quantization with a transposed output, kernel designs side by side on one GPU.

The weight-gradient GEMM reads token-contiguous e4m3 operands, so every column quantization of the MoE path writes
the transpose of its input: qT [N, M] e4m3 and sT [N, M/128] from x [M, N] bf16, which makes it the slowest of the
quantizing stores. This script times the library kernel (`moela.ops.moe.kernels.quantize_triton.quant_rows_cols`,
which stores the codes at transposed addresses) against candidate designs, each checked byte for byte against it
first:

  store-T   the library's way in a one-tile-per-program kernel: a [128, BC] tile, codes stored at transposed
            addresses (uint8 stores; Triton moves them through shared memory)
  trans     tl.trans of the loaded bf16 tile, quantized and stored row-major (the transpose happens on bf16)
  load-T    the tile loaded through transposed pointers ([BC, 128]), quantized and stored row-major
  pack4     as store-T, but the codes of 4 consecutive rows are first packed into one int32 (a sum over 4 lanes
            of disjoint bytes), so the transposing store moves words, not bytes

BC (columns per tile) and warps are swept. Rows and columns from one read (both outputs) are timed for the
library's rows+cols kernel against the row+column variant of `trans` and the designs of `_rowcol_kernel` (halves,
satfinite, L2 re-read, program orders) and `_rowcol_persistent_kernel`; `--rows-cols-only` runs only that table.
`--gluon` times the library's Triton and Gluon (moela.ops.moe.kernels.quantize_gluon: the tile staged in shared
memory) kernels and the Gluon kernel at other register chunks and warp counts.
Usage (GPU):
  python bench/quant_transpose.py [--m 69632] [--n 7168] [--rows-cols-only | --gluon]
Writes bench/results/quant_transpose.md and quant_transpose.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.results_io import add_out_dir, write_results  # noqa: E402
from moela.ops.moe.kernels import quantize_gluon  # noqa: E402
from moela.ops.moe.kernels.quantize_triton import quant_rows_cols  # noqa: E402
from moela.ops.moe.kernels.triton_common import FP8, LAUNCH, e4m3_codes, fp8_scale_inverse, store_e4m3_bytes  # noqa: E402,E501

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _colq_kernel(x_ptr, qt_ptr, st_ptr, q_ptr, s_ptr, M, N, BC: tl.constexpr, MODE: tl.constexpr,
                 ROWS: tl.constexpr):
    """One [128 rows, BC cols] tile of x [M, N] per program: qT [N, M] (+ sT) by design MODE (0 store-T, 1 trans,
    2 load-T, 3 pack4); ROWS (trans only, BC = 128): also the rowwise codes q [M, N] and s from the same read."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * 128 + tl.arange(0, 128)
    cols = pid_n * BC + tl.arange(0, BC)
    if MODE == 0 or MODE == 3:
        tile = tl.load(x_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]).to(tl.float32)  # [128, BC]
        sc, inv = fp8_scale_inverse(tl.max(tl.abs(tile), axis=0))
        q = e4m3_codes(tile, inv[None, :])
        if MODE == 0:
            store_e4m3_bytes(qt_ptr + cols[None, :].to(tl.int64) * M + rows[:, None], q, (rows < M)[:, None])
        else:  # 4 codes of consecutive rows packed into one int32 (a reduction over 4 lanes), stored as words
            b = tl.reshape(q.to(tl.uint8, bitcast=True).to(tl.int32), (32, 4, BC))
            packed = tl.sum(b << (tl.arange(0, 4) * 8)[None, :, None], axis=1)  # [32, BC]
            r4 = pid_m * 32 + tl.arange(0, 32)
            tl.store(qt_ptr.to(tl.pointer_type(tl.int32)) + cols[None, :].to(tl.int64) * (M // 4) + r4[:, None],
                     packed)
    else:
        if MODE == 1:
            raw = tl.load(x_ptr + rows[:, None].to(tl.int64) * N + cols[None, :])  # [128, BC] bf16
            t = tl.trans(raw).to(tl.float32)  # [BC, 128]
        else:
            t = tl.load(x_ptr + rows[None, :].to(tl.int64) * N + cols[:, None]).to(tl.float32)  # [BC, 128]
        sc, inv = fp8_scale_inverse(tl.max(tl.abs(t), axis=1))
        tl.store(qt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], e4m3_codes(t, inv[:, None]))
        if ROWS:
            tile = raw.to(tl.float32)
            rs, ri = fp8_scale_inverse(tl.max(tl.abs(tile), axis=1))
            tl.store(q_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], e4m3_codes(tile, ri[:, None]))
            tl.store(s_ptr + rows * (N // 128) + pid_n, rs)
    tl.store(st_ptr + cols * (M // 128) + pid_m, sc)


@triton.jit
def _cols_out(tile, rows, cols, qt_ptr, st_ptr, M, pid_m):
    """Column (128x1) quantization of tile [128, BC] at (rows, cols): codes transposed into qT, scales into sT."""
    cs, ci = fp8_scale_inverse(tl.max(tl.abs(tile), axis=0))
    store_e4m3_bytes(qt_ptr + cols[None, :].to(tl.int64) * M + rows[:, None], e4m3_codes(tile, ci[None, :]),
                     (rows < M)[:, None])
    tl.store(st_ptr + cols * (M // 128) + pid_m, cs)


@triton.jit
def _rows_out(tile, rows, cols, q_ptr, s_ptr, N, pid_n):
    """Row (1x128) quantization of tile [128, 128] at (rows, cols)."""
    rs, ri = fp8_scale_inverse(tl.max(tl.abs(tile), axis=1))
    tl.store(q_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], e4m3_codes(tile, ri[:, None]))
    tl.store(s_ptr + rows * (N // 128) + pid_n, rs)


@triton.jit
def _rowcol_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, N, MODE: tl.constexpr, GROUP_M: tl.constexpr = 1):
    """Rows and columns of one [128, 128] tile from one read, by design MODE:
    4 "halves": two [128, 64] halves; each half's columns quantized and stored (transposed) on their own, the rows
      from the max of both halves' row amaxes.
    5 "satfinite": the library's order without the clamp to +-448 before the e4m3 conversion (the hardware
      conversion saturates; bytes checked equal).
    6 "L2 re-read": rows from the tile, then the tile loaded again (volatile) for the columns: fewer live registers,
      a second read that should come from L2.
    7 "n-major grid": the library's algorithm with column blocks on the grid's fast axis (neighbouring programs read
      neighbouring column blocks of the same rows).
    8 "columns first": the column quantization before the row one.
    9 "grouped grid": a 1-D grid walking GROUP_M row blocks at a time, row blocks fastest inside a group (GROUP_M = 1
      is the n-major order)."""
    if MODE == 7:
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    elif MODE == 9:
        pid, n_m, n_n = tl.program_id(0), M // 128, N // 128
        first_m = pid // (GROUP_M * n_n) * GROUP_M
        size = tl.minimum(n_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * n_n)) % size
        pid_n = (pid % (GROUP_M * n_n)) // size
    else:
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * 128 + tl.arange(0, 128)
    if MODE == 8:
        cols = pid_n * 128 + tl.arange(0, 128)
        tile = tl.load(x_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]).to(tl.float32)
        _cols_out(tile, rows, cols, qt_ptr, st_ptr, M, pid_m)
        _rows_out(tile, rows, cols, q_ptr, s_ptr, N, pid_n)
    elif MODE == 4:
        ca = pid_n * 128 + tl.arange(0, 64)
        cb = ca + 64
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * N + ca[None, :]).to(tl.float32)  # [128, 64]
        b = tl.load(x_ptr + rows[:, None].to(tl.int64) * N + cb[None, :]).to(tl.float32)
        _cols_out(a, rows, ca, qt_ptr, st_ptr, M, pid_m)
        _cols_out(b, rows, cb, qt_ptr, st_ptr, M, pid_m)
        rs, ri = fp8_scale_inverse(tl.maximum(tl.max(tl.abs(a), axis=1), tl.max(tl.abs(b), axis=1)))
        tl.store(q_ptr + rows[:, None].to(tl.int64) * N + ca[None, :], e4m3_codes(a, ri[:, None]))
        tl.store(q_ptr + rows[:, None].to(tl.int64) * N + cb[None, :], e4m3_codes(b, ri[:, None]))
        tl.store(s_ptr + rows * (N // 128) + pid_n, rs)
    elif MODE == 6:
        cols = pid_n * 128 + tl.arange(0, 128)
        tile = tl.load(x_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]).to(tl.float32)
        _rows_out(tile, rows, cols, q_ptr, s_ptr, N, pid_n)
        tl.debug_barrier()
        again = tl.load(x_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], volatile=True).to(tl.float32)
        _cols_out(again, rows, cols, qt_ptr, st_ptr, M, pid_m)
    elif MODE == 5:
        cols = pid_n * 128 + tl.arange(0, 128)
        tile = tl.load(x_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]).to(tl.float32)
        rs, ri = fp8_scale_inverse(tl.max(tl.abs(tile), axis=1))
        tl.store(q_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], (tile * ri[:, None]).to(tl.float8e4nv))
        tl.store(s_ptr + rows * (N // 128) + pid_n, rs)
        cs, ci = fp8_scale_inverse(tl.max(tl.abs(tile), axis=0))
        store_e4m3_bytes(qt_ptr + cols[None, :].to(tl.int64) * M + rows[:, None],
                         (tile * ci[None, :]).to(tl.float8e4nv), (rows < M)[:, None])
        tl.store(st_ptr + cols * (M // 128) + pid_m, cs)
    else:  # 7, 9: the library's algorithm in another program order
        cols = pid_n * 128 + tl.arange(0, 128)
        tile = tl.load(x_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]).to(tl.float32)
        _rows_out(tile, rows, cols, q_ptr, s_ptr, N, pid_n)
        _cols_out(tile, rows, cols, qt_ptr, st_ptr, M, pid_m)


@triton.jit
def _rowcol_persistent_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, N, n_tiles, n_tn, STAGES: tl.constexpr):
    """Rows and columns from one read, persistent: each program loops over tiles (pid, pid + grid, ...) and Triton's
    pipeliner prefetches the next tiles' loads into shared memory (STAGES deep, cp.async) while this one is
    quantized, so a block keeps loads in flight without holding a second tile in registers."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    for t in tl.range(pid, n_tiles, nprog, num_stages=STAGES):
        pid_m, pid_n = t // n_tn, t % n_tn
        rows = pid_m * 128 + tl.arange(0, 128)
        cols = pid_n * 128 + tl.arange(0, 128)
        tile = tl.load(x_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]).to(tl.float32)
        _rows_out(tile, rows, cols, q_ptr, s_ptr, N, pid_n)
        _cols_out(tile, rows, cols, qt_ptr, st_ptr, M, pid_m)


def rowcol_persistent(x, stages: int, warps: int, per_sm: int):
    m, n = x.shape
    q = torch.empty(m, n, device=x.device, dtype=FP8)
    s = torch.empty(m, n // 128, device=x.device, dtype=torch.float32)
    qt = torch.empty(n, m, device=x.device, dtype=FP8)
    st = torch.empty(n, m // 128, device=x.device, dtype=torch.float32)
    tiles = (m // 128) * (n // 128)
    grid = min(tiles, per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count)
    _rowcol_persistent_kernel[(grid,)](x, q, s, qt, st, m, n, tiles, n // 128, STAGES=stages, num_warps=warps)
    return (q, s), (qt, st)


def rowcol(x, mode: int, warps: int, group_m: int = 1):
    m, n = x.shape
    q = torch.empty(m, n, device=x.device, dtype=FP8)
    s = torch.empty(m, n // 128, device=x.device, dtype=torch.float32)
    qt = torch.empty(n, m, device=x.device, dtype=FP8)
    st = torch.empty(n, m // 128, device=x.device, dtype=torch.float32)
    grid = (n // 128, m // 128) if mode == 7 else ((m // 128) * (n // 128),) if mode == 9 else (m // 128, n // 128)
    _rowcol_kernel[grid](x, q, s, qt, st, m, n, MODE=mode, GROUP_M=group_m, num_warps=warps)
    return (q, s), (qt, st)


def colq(x, mode: int, bc: int, warps: int, rows: bool = False):
    m, n = x.shape
    qt = torch.empty(n, m, device=x.device, dtype=FP8)
    st = torch.empty(n, m // 128, device=x.device, dtype=torch.float32)
    q = torch.empty(m, n, device=x.device, dtype=FP8) if rows else qt
    s = torch.empty(m, n // 128, device=x.device, dtype=torch.float32) if rows else st
    _colq_kernel[(m // 128, n // bc)](x, qt, st, q, s, m, n, BC=bc, MODE=mode, ROWS=rows, num_warps=warps)
    return (q, s) if rows else None, (qt, st)


def gluon_rowcol(x, rc, cc, warps, rowwise=True):
    """The Gluon kernel of moela.ops.moe.kernels.quantize_gluon at given register chunks and warps."""
    m, n = x.shape
    q = torch.empty(m, n, device=x.device, dtype=FP8) if rowwise else None
    s = torch.empty(m, n // 128, device=x.device, dtype=torch.float32) if rowwise else None
    qt = torch.empty(n, m, device=x.device, dtype=FP8)
    st = torch.empty(n, m // 128, device=x.device, dtype=torch.float32)
    quantize_gluon.quant_rows_cols(x, rowwise, True, None, 1, q, s, qt, st, rc=rc, cc=cc, num_warps=warps)
    return (q, s), (qt, st)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=69632)  # M_pad of the V3 layer: T 8192 x top-8 + E 32 x 128
    ap.add_argument("--n", type=int, default=7168)
    ap.add_argument("--rows-cols-only", action="store_true", help="only the rows+columns table")
    ap.add_argument("--gluon", action="store_true",
                    help="only the library's kernels and the Gluon configurations (chunks, warps, persistence)")
    add_out_dir(ap)
    args = ap.parse_args()
    torch.manual_seed(0)
    x = (torch.randn(args.m, args.n, device=DEV) * torch.rand(args.m, 1, device=DEV) * 4).to(torch.bfloat16)
    (rq, rs), (rqt, rst) = quant_rows_cols(x, impl="triton")
    a = torch.empty(2 << 30, dtype=torch.uint8, device=DEV)
    copy_gbs = 2 * a.numel() / do_bench(lambda: a.clone(), return_mode="median") / 1e6
    del a
    col_bytes, both_bytes = x.numel() * 3, x.numel() * 4  # bf16 read, one or two e4m3 writes (scales ~1%)
    note = (f"x [{args.m}, {args.n}] bf16; median of do_bench; copy ceiling {copy_gbs:.0f} GB/s; bytes = 2 per "
            f"element read + 1 per e4m3 code written.")
    lines = ["| design | BC | warps | ms | GB/s | % of copy | bytes equal to the library's |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    rows = []

    def write():
        write_results("quant_transpose", "Transposed column quantization designs", "\n".join([note, "", *lines]),
                      rows, out_dir=args.out_dir)

    def add(name, bc, warps, fn, nbytes, check):
        ok = check()
        ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
        gbs = nbytes / ms / 1e6
        rows.append(dict(design=name, bc=bc, warps=warps, ms=ms, gbs=gbs, pct_copy=100 * gbs / copy_gbs,
                         same_bytes=ok))
        lines.append(f"| {name} | {bc} | {warps} | {ms:.3f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | {ok} |")
        print(lines[-1], flush=True)

    def same_cols(out):
        return torch.equal(out[1][0].view(torch.uint8), rqt.view(torch.uint8)) and torch.equal(out[1][1], rst)

    add("library quant_rows_cols(rowwise=False), Triton", 128, LAUNCH["quant_rows_or_cols"]["num_warps"],
        lambda: quant_rows_cols(x, rowwise=False, impl="triton"), col_bytes, lambda: True)
    if quantize_gluon.available(x):
        add("library quant_rows_cols(rowwise=False), Gluon", 128, quantize_gluon.NUM_WARPS,
            lambda: quant_rows_cols(x, rowwise=False, impl="gluon"), col_bytes,
            lambda: same_cols(quant_rows_cols(x, rowwise=False, impl="gluon")))
    designs = ((0, "store-T"), (1, "trans"), (2, "load-T"), (3, "pack4"))
    for mode, name in () if args.rows_cols_only or args.gluon else designs:
        for bc in (32, 64, 128):
            for warps in (4, 8):
                try:
                    add(name, bc, warps, lambda: colq(x, mode, bc, warps), col_bytes,
                        lambda: same_cols(colq(x, mode, bc, warps)))
                except Exception as exc:  # a design that does not compile must not hide the others
                    rows.append(dict(design=name, bc=bc, warps=warps, failed=type(exc).__name__))
                    lines.append(f"| {name} | {bc} | {warps} | failed: {type(exc).__name__} | | | |")
                    print(lines[-1], flush=True)
    lines += ["", "Rows and columns from one read:", "",
              "| design | BC | warps | ms | GB/s | % of copy | bytes equal to the library's |",
              "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    def same_both(out):
        return same_cols(out) and torch.equal(out[0][0].view(torch.uint8), rq.view(torch.uint8)) and \
            torch.equal(out[0][1], rs)

    add("library quant_rows_cols, Triton", 128, LAUNCH["quant_rows_cols"]["num_warps"],
        lambda: quant_rows_cols(x, impl="triton"), both_bytes, lambda: True)
    if quantize_gluon.available(x):
        add("library quant_rows_cols, Gluon (tile in shared memory)", 128, quantize_gluon.NUM_WARPS,
            lambda: quant_rows_cols(x, impl="gluon"), both_bytes,
            lambda: same_both(quant_rows_cols(x, impl="gluon")))

    if args.gluon:
        for warps, rc, cc in ((4, 32, 64), (4, 16, 32), (8, 32, 64), (8, 16, 32)):
            add(f"Gluon rows+cols, {rc}-row / {cc}-column chunks", 128, warps, lambda: gluon_rowcol(x, rc, cc, warps),
                both_bytes, lambda: same_both(gluon_rowcol(x, rc, cc, warps)))
        write()
        return
    for warps in (4, 8, 16):
        add("trans rows+cols", 128, warps, lambda: colq(x, 1, 128, warps, rows=True), both_bytes,
            lambda: same_both(colq(x, 1, 128, warps, rows=True)))
    designs = ((4, "halves rows+cols"), (5, "satfinite rows+cols"), (6, "L2 re-read rows+cols"),
               (7, "n-major grid rows+cols"), (8, "columns first rows+cols"))
    for mode, name in designs:
        for warps in (4, 8):
            add(name, 128, warps, lambda: rowcol(x, mode, warps), both_bytes,
                lambda: same_both(rowcol(x, mode, warps)))
    for group_m in (1, 2, 4, 8, 16, 64):
        add(f"grouped grid rows+cols, GROUP_M {group_m}", 128, 4, lambda: rowcol(x, 9, 4, group_m), both_bytes,
            lambda: same_both(rowcol(x, 9, 4, group_m)))
    for stages in (2, 3):  # persistent, prefetching through shared memory (8 warps: 4 spill at 255 registers)
        add(f"persistent {stages}-stage rows+cols", 128, 8, lambda: rowcol_persistent(x, stages, 8, 1), both_bytes,
            lambda: same_both(rowcol_persistent(x, stages, 8, 1)))
    write()


if __name__ == "__main__":
    main()
