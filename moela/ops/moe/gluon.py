"""The MoE path's quantizing kernels that read tiles both by rows and by columns, staged through shared memory
(Gluon, Triton's explicit-layout dialect; Hopper).

`moela.ops.moe.quant_rows_cols` reads each 128x128 bf16 tile once and writes both its rowwise (1x128) and
its columnwise (128x1, stored transposed) e4m3 codes. In plain Triton the tile lives in registers (128 fp32 values
per thread, ~200 registers at 4 warps), so two blocks fit on an SM and little memory traffic is in flight: 65-66%
of the copy bandwidth on the H200. Here the tile is copied into shared memory by the copy engine (TMA, or cp.async
when rows are gathered through `src`), then read twice in small register chunks: 32-row slices for the rows,
64-column slices for the columns (through ldmatrix; both read patterns are free of bank conflicts on the
unswizzled tile). The column codes then change layout (through shared memory) so that 8 threads store 128
contiguous bytes of a qT row: stored straight from the ldmatrix layout, each thread's 16 bytes land in a
different 128-byte line and the kernel ran at 55%. ~100 registers per thread; shared memory (41 KB per block)
allows five blocks per SM, each with a whole tile in flight. Measured (bench/results/quant_transpose.md, moe.md
runs 20, 23): rows + columns 79-83% of the copy bandwidth, columns alone 87-88%. Also measured there (at commit
680e623, whose bench/quant_transpose.py --gluon ran them): the codes written transposed into shared memory and
copied out by a TMA store (as fast: 79%, 87%), a persistent kernel with a ring of TMA copies (slower: 60-69%), 8
warps and other chunk sizes (equal or lower).

The same staging serves two more kernels: the SwiGLU backward (g, u and dact tiles by TMA; dh's row and column
codes and act's column codes from one read of each; 0.67 ms against 1.49 for the Triton kernel, which runs one
program per output tile) and the weight quantization (each 128x128 block once: its amax, q by rows and the
transposed copy by columns; 1.41 ms against 1.99 for the Triton path's two launches, w13 + w2 of the V3 E32 layer;
moe.md run 22).

Codes and scales are the same bytes as the Triton kernels' (same `div_rn` scale math, same saturating e4m3
conversion, same SwiGLU expressions): the GPU tests `test_gluon_*` of tests/test_quant.py and tests/test_moe_ops.py
compare them byte for byte. Gluon does not run in the Triton interpreter; on CPU the Triton kernels run, and
tests/sm90_compile.py compiles these kernels for sm_90 (registers, spills, shared memory).
"""

from __future__ import annotations

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon: moela.ops.moe kernels keeps its Triton kernels
    gluon = None
else:  # the copy builtins' names: Triton 3.6 (the GPU machine) and newer ones (3.9, with torch 2.13)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cp_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

from moela.ops.moe.quant import AMAX_EPS, FP8_MAX

FP8 = torch.float8_e4m3fn
ROW_CHUNK = 32  # rows per register chunk of the rowwise pass
COL_CHUNK = 64  # columns per register chunk of the columnwise pass
NUM_WARPS = 4
# SwiGLU backward: three input tiles in shared memory (100 KB: two blocks per SM); 8 warps and 32-column chunks
# keep it at 92 registers per thread (4 warps / 64 columns spill at 255)
SWIGLU_WARPS = 8
SWIGLU_COL_CHUNK = 32


def available(x: torch.Tensor) -> bool:
    """True when the Gluon kernels can take x: bf16 on a Hopper GPU (sm_90, where they are tested) and a Triton
    with Gluon."""
    return gluon is not None and x.is_cuda and x.dtype == torch.bfloat16 and \
        torch.cuda.get_device_capability(x.device)[0] == 9


if gluon is not None:
    _EPS = gl.constexpr(AMAX_EPS)
    _FMAX = gl.constexpr(FP8_MAX)

    @gluon.jit
    def _scale_inv(amax):
        """(scale, inverse) of groups with this amax, rounded as moela.ops.moe.quant rounds them."""
        a = gl.maximum(amax, _EPS)
        return gl.div_rn(a, _FMAX), gl.div_rn(gl.full_like(a, 1.0), a) * _FMAX

    @gluon.constexpr_function
    def _row_layout(num_warps):
        """Register layout of a [RC, 128] row chunk: 8 contiguous values per thread, 16 threads per row."""
        return gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

    @gluon.constexpr_function
    def _col_layout(num_warps, cc):
        """Register layout of a [128, CC] column chunk read from shared memory: each thread 128 / warps rows of
        CC / 32 neighbouring columns (CC = 64: two, read by ldmatrix), a warp's 32 threads side by side."""
        return gl.BlockedLayout([128 // num_warps, cc // 32], [1, 32], [num_warps, 1], [0, 1])

    @gluon.jit
    def _rows_out(v, row0, col0, q_ptr, s_ptr, ld_q, ld_s):
        """Rowwise (1x128) quantization of v [RC, 128] fp32 (row layout) at rows row0.., columns col0..col0+127
        of q [*, ld_q] (scales s[row, col0 / 128], row stride ld_s)."""
        rl: gl.constexpr = _row_layout(gl.num_warps())
        rs, ri = _scale_inv(gl.max(gl.abs(v), axis=1))
        rows = row0 + gl.arange(0, v.shape[0], layout=gl.SliceLayout(1, rl))
        cols = col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, rl))
        gl.store(q_ptr + rows[:, None].to(gl.int64) * ld_q + cols[None, :], (v * ri[:, None]).to(gl.float8e4nv))
        gl.store(s_ptr + rows * ld_s + col0 // 128, rs)

    @gluon.jit
    def _cols_out(v, row0, col0, qt_ptr, st_ptr, M):
        """Columnwise (128x1) quantization of v [128, CC] fp32 (column layout) at rows row0..row0+127, columns
        col0..: codes into qT [*, M] (row col, column row), scales into sT [*, M / 128]. The codes change layout
        (through shared memory) to 16 rows per thread, 8 threads per column, so that 8 threads store 128 contiguous
        bytes of a qT row (stored from the column layout, each thread's 16 bytes would land in a different line)."""
        cl: gl.constexpr = _col_layout(gl.num_warps(), v.shape[1])
        sl: gl.constexpr = gl.BlockedLayout([16, 1], [8, 4], [1, gl.num_warps()], [0, 1])
        cc: gl.constexpr = v.shape[1]
        cs, ci = _scale_inv(gl.max(gl.abs(v), axis=0))
        codes = gl.convert_layout((v * ci[None, :]).to(gl.float8e4nv).to(gl.uint8, bitcast=True), sl)
        rows = row0 + gl.arange(0, 128, layout=gl.SliceLayout(1, sl))
        cols = col0 + gl.arange(0, cc, layout=gl.SliceLayout(0, sl))
        gl.store(qt_ptr.to(gl.pointer_type(gl.uint8)) + cols[None, :].to(gl.int64) * M + rows[:, None], codes)
        cols_s = col0 + gl.arange(0, cc, layout=gl.SliceLayout(0, cl))
        gl.store(st_ptr + cols_s * (M // 128) + row0 // 128, cs)

    @gluon.jit
    def _tma_tile(desc, row, col):
        """The [128, 128] block of desc's tensor at (row, col), copied into shared memory by the TMA engine."""
        tile = gl.allocate_shared_memory(gl.bfloat16, [128, 128], desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, desc.block_type.nbytes)
        _tma_load(desc, [row, col], bar, tile)
        mbarrier.wait(bar, 0)
        mbarrier.invalidate(bar)
        return tile

    @gluon.jit
    def _quantize_tile(tile, pid_m, pid_n, q_ptr, s_ptr, qt_ptr, st_ptr, M, N, ROWWISE: gl.constexpr,
                       COLWISE: gl.constexpr, RC: gl.constexpr, CC: gl.constexpr):
        """tile: [128, 128] bf16 in shared memory, the block (pid_m, pid_n) of x [M, N]. Rowwise: q [M, N] and
        s [M, N/128]; columnwise: qT [N, M] and sT [N, M/128]."""
        if ROWWISE:
            for r0 in gl.static_range(0, 128, RC):
                v = tile.slice(r0, RC, dim=0).load(_row_layout(gl.num_warps())).to(gl.float32)
                _rows_out(v, pid_m * 128 + r0, pid_n * 128, q_ptr, s_ptr, N, N // 128)
        if COLWISE:
            for c0 in gl.static_range(0, 128, CC):
                v = tile.slice(c0, CC, dim=1).load(_col_layout(gl.num_warps(), CC)).to(gl.float32)
                _cols_out(v, pid_m * 128, pid_n * 128 + c0, qt_ptr, st_ptr, M)

    @gluon.jit
    def _swiglu_grads(g, u, da, valid):
        """(dg, du, act) of SwiGLU act = silu(g) * u at fp32 values, zero where not valid (padding rows, whose
        inputs may be anything); the Triton kernel's expressions, so the same values."""
        g = gl.where(valid, g, 0.0)
        u = gl.where(valid, u, 0.0)
        da = gl.where(valid, da, 0.0)
        sig = 1 / (1 + gl.exp(-g))
        silu = g * sig
        return da * u * (sig + silu * (1.0 - sig)), da * silu, silu * u

    @gluon.jit
    def _swiglu_bwd_kernel(h_desc, da_desc, m_idx_ptr, dh_ptr, dhs_ptr, dht_ptr, dhst_ptr, at_ptr, ast_ptr, M, F,
                           RC: gl.constexpr, CC: gl.constexpr):
        """Tile (pid_m, pid_f): g = h[:, f], u = h[:, F + f] and dact arrive in shared memory by three TMA copies;
        the row pass writes dh's rowwise codes (dg and du), the column pass dh's and act's columnwise codes."""
        pid_f = gl.program_id(0)
        pid_m = gl.program_id(1)
        gs = gl.allocate_shared_memory(gl.bfloat16, [128, 128], h_desc.layout)
        us = gl.allocate_shared_memory(gl.bfloat16, [128, 128], h_desc.layout)
        das = gl.allocate_shared_memory(gl.bfloat16, [128, 128], da_desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, 2 * h_desc.block_type.nbytes + da_desc.block_type.nbytes)
        _tma_load(h_desc, [pid_m * 128, pid_f * 128], bar, gs)
        _tma_load(h_desc, [pid_m * 128, F + pid_f * 128], bar, us)
        _tma_load(da_desc, [pid_m * 128, pid_f * 128], bar, das)
        mbarrier.wait(bar, 0)
        mbarrier.invalidate(bar)
        rl: gl.constexpr = _row_layout(gl.num_warps())
        cl: gl.constexpr = _col_layout(gl.num_warps(), CC)
        for r0 in gl.static_range(0, 128, RC):
            rows = pid_m * 128 + r0 + gl.arange(0, RC, layout=gl.SliceLayout(1, rl))
            valid = (gl.load(m_idx_ptr + rows) >= 0)[:, None]
            dg, du, act = _swiglu_grads(gs.slice(r0, RC, dim=0).load(rl).to(gl.float32),
                                        us.slice(r0, RC, dim=0).load(rl).to(gl.float32),
                                        das.slice(r0, RC, dim=0).load(rl).to(gl.float32), valid)
            _rows_out(dg, pid_m * 128 + r0, pid_f * 128, dh_ptr, dhs_ptr, 2 * F, 2 * F // 128)
            _rows_out(du, pid_m * 128 + r0, F + pid_f * 128, dh_ptr, dhs_ptr, 2 * F, 2 * F // 128)
        rows = pid_m * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, cl))
        valid = (gl.load(m_idx_ptr + rows) >= 0)[:, None]
        for c0 in gl.static_range(0, 128, CC):
            dg, du, act = _swiglu_grads(gs.slice(c0, CC, dim=1).load(cl).to(gl.float32),
                                        us.slice(c0, CC, dim=1).load(cl).to(gl.float32),
                                        das.slice(c0, CC, dim=1).load(cl).to(gl.float32), valid)
            _cols_out(dg, pid_m * 128, pid_f * 128 + c0, dht_ptr, dhst_ptr, M)
            _cols_out(du, pid_m * 128, F + pid_f * 128 + c0, dht_ptr, dhst_ptr, M)
            _cols_out(act, pid_m * 128, pid_f * 128 + c0, at_ptr, ast_ptr, M)

    @gluon.jit
    def _rowcol_tma_kernel(x_desc, q_ptr, s_ptr, qt_ptr, st_ptr, M, N, ROWWISE: gl.constexpr, COLWISE: gl.constexpr,
                           RC: gl.constexpr, CC: gl.constexpr):
        """One 128x128 tile per program, column blocks fastest; the tile arrives by one TMA copy."""
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        tile = _tma_tile(x_desc, pid_m * 128, pid_n * 128)
        _quantize_tile(tile, pid_m, pid_n, q_ptr, s_ptr, qt_ptr, st_ptr, M, N, ROWWISE, COLWISE, RC, CC)

    @gluon.jit
    def _rowcol_gather_kernel(x_ptr, src_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, N, ld_x, gather_div,
                              ROWWISE: gl.constexpr, COLWISE: gl.constexpr, RC: gl.constexpr, CC: gl.constexpr):
        """Rows x[src // gather_div] (zeros where src < 0), one 128x128 tile per program, row blocks fastest (the
        order the Triton gather kernel measured faster); the tile arrives by cp.async (16 bytes per copy)."""
        pid_m = gl.program_id(0)
        pid_n = gl.program_id(1)
        ll: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
        tile = gl.allocate_shared_memory(gl.bfloat16, [128, 128],
                                         gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))
        rows = pid_m * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, ll))
        cols = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, ll))
        s = gl.load(src_ptr + rows)
        ok = s >= 0
        srow = gl.where(ok, s // gather_div, 0).to(gl.int64)
        _cp_async_load(tile, x_ptr + srow[:, None] * ld_x + cols[None, :],
                                               mask=ok[:, None] & (cols < N)[None, :])
        async_copy.commit_group()
        async_copy.wait_group(0)
        _cta_barrier()
        _quantize_tile(tile, pid_m, pid_n, q_ptr, s_ptr, qt_ptr, st_ptr, M, N, ROWWISE, COLWISE, RC, CC)

    @gluon.jit
    def _weight_quant_kernel(w_desc, q_ptr, s_ptr, qt_ptr, N, K, RC: gl.constexpr, CC: gl.constexpr,
                             TRANSPOSED: gl.constexpr):
        """Block (bn, bk) of expert e of w [E, N, K] (w_desc over its [E * N, K] view) by one TMA copy: its amax
        (one pass over the tile in shared memory), then q [E, N, K] from row chunks and, when TRANSPOSED, the same
        codes at their transposed places in qT [E, K, N] from column chunks, stored after a layout conversion so
        that 8 threads write 128 contiguous bytes of a qT row."""
        bk = gl.program_id(0)
        bn = gl.program_id(1)
        e = gl.program_id(2)
        tile = _tma_tile(w_desc, e * N + bn * 128, bk * 128)
        rl: gl.constexpr = _row_layout(gl.num_warps())
        cl: gl.constexpr = _col_layout(gl.num_warps(), CC)
        sl: gl.constexpr = gl.BlockedLayout([16, 1], [8, 4], [1, gl.num_warps()], [0, 1])
        amax = gl.zeros([RC], gl.float32, layout=gl.SliceLayout(1, rl))
        for r0 in gl.static_range(0, 128, RC):
            amax = gl.maximum(amax, gl.max(gl.abs(tile.slice(r0, RC, dim=0).load(rl).to(gl.float32)), axis=1))
        sc, inv = _scale_inv(gl.zeros_like(amax) + gl.max(amax, axis=0))  # [RC], every entry the block's
        gl.store(s_ptr + (e * (N // 128) + bn) * (K // 128) + bk, gl.max(sc, axis=0))
        inv_r = inv[:, None]
        qe = q_ptr + e.to(gl.int64) * N * K
        for r0 in gl.static_range(0, 128, RC):
            v = tile.slice(r0, RC, dim=0).load(rl).to(gl.float32)
            rows = bn * 128 + r0 + gl.arange(0, RC, layout=gl.SliceLayout(1, rl))
            cols = bk * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, rl))
            gl.store(qe + rows[:, None] * K + cols[None, :], (v * inv_r).to(gl.float8e4nv))
        if TRANSPOSED:
            inv_s = gl.max(inv, axis=0)
            qte = qt_ptr.to(gl.pointer_type(gl.uint8)) + e.to(gl.int64) * N * K
            for c0 in gl.static_range(0, 128, CC):
                v = tile.slice(c0, CC, dim=1).load(cl).to(gl.float32)
                codes = gl.convert_layout((v * inv_s).to(gl.float8e4nv).to(gl.uint8, bitcast=True), sl)
                rows = bn * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, sl))
                cols = bk * 128 + c0 + gl.arange(0, CC, layout=gl.SliceLayout(0, sl))
                gl.store(qte + cols[None, :] * N + rows[:, None], codes)


def quant_weights(w: torch.Tensor, q, s, qt) -> None:
    """Fill the outputs allocated by moela.ops.moe.quant_weights (w [E, N, K] contiguous bf16; qt None
    when the transposed copy is not asked): one read of w."""
    e, n, k = w.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    desc = TensorDescriptor.from_tensor(w.view(e * n, k), [128, 128], layout)
    _weight_quant_kernel[(k // 128, n // 128, e)](desc, q, s, qt if qt is not None else q, n, k, RC=ROW_CHUNK,
                                                  CC=COL_CHUNK, TRANSPOSED=qt is not None, num_warps=NUM_WARPS)


def swiglu_bwd(h: torch.Tensor, dact: torch.Tensor, m_indices: torch.Tensor, dhq, dhs, dhqt, dhst, aqt, ast, *,
               rc: int = ROW_CHUNK, cc: int = SWIGLU_COL_CHUNK, num_warps: int = SWIGLU_WARPS) -> None:
    """Fill the outputs allocated by moela.ops.moe.swiglu_bwd(quant=True): dh [M, 2F] rowwise and
    columnwise, act's columnwise codes, from h [M, 2F] and dact [M, F] (bf16, contiguous rows)."""
    m, two_f = h.shape
    f = two_f // 2
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    h_desc = TensorDescriptor.from_tensor(h, [128, 128], layout)
    da_desc = TensorDescriptor.from_tensor(dact, [128, 128], layout)
    _swiglu_bwd_kernel[(f // 128, m // 128)](h_desc, da_desc, m_indices, dhq, dhs, dhqt, dhst, aqt, ast, m, f, RC=rc,
                                             CC=cc, num_warps=num_warps)


def quant_rows_cols(x: torch.Tensor, rowwise: bool, colwise: bool, src: torch.Tensor | None, gather_div: int,
                    q, s, qt, st, *, rc: int = ROW_CHUNK, cc: int = COL_CHUNK, num_warps: int = NUM_WARPS) -> None:
    """Fill the outputs allocated by moela.ops.moe.quant_rows_cols (which checks the shapes); rc, cc and
    num_warps are the register chunks and warps (bench/quant_transpose.py --gluon sweeps them)."""
    m = src.numel() if src is not None else x.shape[0]
    n = x.shape[1]
    consts = dict(ROWWISE=rowwise, COLWISE=colwise, RC=rc, CC=cc, num_warps=num_warps)
    outs = (q if rowwise else x, s if rowwise else x, qt if colwise else x, st if colwise else x)
    if src is None:
        if x.stride(1) != 1 or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
            x = x.contiguous()
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        desc = TensorDescriptor.from_tensor(x, [128, 128], layout)
        _rowcol_tma_kernel[(n // 128, m // 128)](desc, *outs, m, n, **consts)
    else:
        if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
            x = x.contiguous()
        _rowcol_gather_kernel[(m // 128, n // 128)](x, src, *outs, m, n, x.stride(0), gather_div, **consts)
