"""The MoE path's quantizing kernels that read tiles both by rows and by columns, staged through shared memory
(Gluon, Triton's explicit-layout dialect; Hopper, bf16).

`quantize.quant_rows_cols` reads each 128x128 tile once and writes both its rowwise (1x128) and its columnwise
(128x1, stored transposed) e4m3 codes. In plain Triton the tile lives in registers (128 fp32 values per thread at 4
warps), so two blocks fit on an SM and little memory traffic is in flight. Here the tile is copied into shared
memory by the copy engine (TMA, or cp.async when rows are gathered through `src`), then read twice in small
register chunks: 32-row slices for the rows, 64-column slices for the columns (through ldmatrix; both read patterns
are free of bank conflicts on the unswizzled tile). The column codes then change layout (through shared memory) so
that 8 threads store 128 contiguous bytes of a qT row; ~100 registers per thread and 41 KB of shared memory allow
five blocks per SM, each with a whole tile in flight. The same staging serves the SwiGLU backward (gate, up and
dact tiles by TMA; dh's row and column codes and act's column codes from one read of each) and the weight
quantization (each 128x128 block once: its amax, q by rows and the transposed copy by columns).

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
except ImportError:  # a Triton without Gluon: the MoE path keeps its Triton kernels
    gluon = None
else:  # the copy builtins' names: Triton 3.6 (the GPU machine) and newer ones (3.9, with torch 2.13)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cp_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

from moela.ops.moe.quant_spec import AMAX_EPS, FP8_MAX

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
    def _fp8_scale_inverse(amax):
        """(scale, inverse) of groups with this amax, rounded as moela.ops.moe.quant_spec rounds them."""
        clamped = gl.maximum(amax, _EPS)
        return gl.div_rn(clamped, _FMAX), gl.div_rn(gl.full_like(clamped, 1.0), clamped) * _FMAX

    @gluon.constexpr_function
    def _row_layout(num_warps):
        """Register layout of a [RC, 128] row chunk: 8 contiguous values per thread, 16 threads per row."""
        return gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

    @gluon.constexpr_function
    def _col_layout(num_warps, cc):
        """Register layout of a [128, CC] column chunk read from shared memory: each thread 128 / warps rows of
        CC / 32 neighbouring columns (CC = 64: two, read by ldmatrix), a warp's 32 threads side by side."""
        return gl.BlockedLayout([128 // num_warps, cc // 32], [1, 32], [num_warps, 1], [0, 1])

    @gluon.constexpr_function
    def _transposed_store_layout(num_warps):
        """Register layout of column codes on their way to qT: 16 rows per thread, 8 threads per column, so that 8
        threads store 128 contiguous bytes of a qT row (stored from the column layout, each thread's 16 bytes would
        land in a different line)."""
        return gl.BlockedLayout([16, 1], [8, 4], [1, num_warps], [0, 1])

    @gluon.jit
    def _rows_out(chunk, row0, col0, q_ptr, s_ptr, ld_q, ld_s):
        """Rowwise (1x128) quantization of chunk [RC, 128] fp32 (row layout) at rows row0.., columns
        col0..col0+127 of q [*, ld_q] (scales s[row, col0 / 128], row stride ld_s)."""
        row_layout: gl.constexpr = _row_layout(gl.num_warps())
        scale, inverse = _fp8_scale_inverse(gl.max(gl.abs(chunk), axis=1))
        rows = row0 + gl.arange(0, chunk.shape[0], layout=gl.SliceLayout(1, row_layout))
        cols = col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, row_layout))
        gl.store(q_ptr + rows[:, None].to(gl.int64) * ld_q + cols[None, :],
                 (chunk * inverse[:, None]).to(gl.float8e4nv))
        gl.store(s_ptr + rows * ld_s + col0 // 128, scale)

    @gluon.jit
    def _cols_out(chunk, row0, col0, qt_ptr, st_ptr, M):
        """Columnwise (128x1) quantization of chunk [128, CC] fp32 (column layout) at rows row0..row0+127, columns
        col0..: codes into qT [*, M] (row = column of the tile), scales into sT [*, M / 128]; the codes change layout
        before the store (_transposed_store_layout)."""
        col_layout: gl.constexpr = _col_layout(gl.num_warps(), chunk.shape[1])
        store_layout: gl.constexpr = _transposed_store_layout(gl.num_warps())
        width: gl.constexpr = chunk.shape[1]
        scale, inverse = _fp8_scale_inverse(gl.max(gl.abs(chunk), axis=0))
        codes = gl.convert_layout((chunk * inverse[None, :]).to(gl.float8e4nv).to(gl.uint8, bitcast=True),
                                  store_layout)
        rows = row0 + gl.arange(0, 128, layout=gl.SliceLayout(1, store_layout))
        cols = col0 + gl.arange(0, width, layout=gl.SliceLayout(0, store_layout))
        gl.store(qt_ptr.to(gl.pointer_type(gl.uint8)) + cols[None, :].to(gl.int64) * M + rows[:, None], codes)
        scale_cols = col0 + gl.arange(0, width, layout=gl.SliceLayout(0, col_layout))
        gl.store(st_ptr + scale_cols * (M // 128) + row0 // 128, scale)

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
            for first_row in gl.static_range(0, 128, RC):
                chunk = tile.slice(first_row, RC, dim=0).load(_row_layout(gl.num_warps())).to(gl.float32)
                _rows_out(chunk, pid_m * 128 + first_row, pid_n * 128, q_ptr, s_ptr, N, N // 128)
        if COLWISE:
            for first_col in gl.static_range(0, 128, CC):
                chunk = tile.slice(first_col, CC, dim=1).load(_col_layout(gl.num_warps(), CC)).to(gl.float32)
                _cols_out(chunk, pid_m * 128, pid_n * 128 + first_col, qt_ptr, st_ptr, M)

    @gluon.jit
    def _swiglu_grads(gate, up, dact, valid):
        """(dg, du, act) of SwiGLU act = silu(gate) * up at fp32 values, zero where not valid (padding rows, whose
        inputs may be anything); the Triton kernel's expressions, so the same values."""
        gate = gl.where(valid, gate, 0.0)
        up = gl.where(valid, up, 0.0)
        dact = gl.where(valid, dact, 0.0)
        sig = 1 / (1 + gl.exp(-gate))
        silu = gate * sig
        return dact * up * (sig + silu * (1.0 - sig)), dact * silu, silu * up

    @gluon.jit
    def _swiglu_bwd_kernel(
        h_desc,  # TMA descriptor of h [M_pad, 2F] bf16, [128, 128] blocks
        dact_desc,  # TMA descriptor of dact [M_pad, F] bf16, [128, 128] blocks
        m_idx_ptr,  # [M_pad] int32 expert of each row, -1 on padding
        dh_ptr,  # [M_pad, 2F] e4m3 rowwise codes, written
        dh_s_ptr,  # [M_pad, 2F/128] fp32, written
        dht_ptr,  # [2F, M_pad] e4m3 columnwise codes, transposed, written
        dht_s_ptr,  # [2F, M_pad/128] fp32, written
        actt_ptr,  # [F, M_pad] e4m3 act's columnwise codes, transposed, written
        actt_s_ptr,  # [F, M_pad/128] fp32, written
        M, F,
        RC: gl.constexpr, CC: gl.constexpr,
    ):
        """Program (f block, m block): gate = h[:, f], up = h[:, F + f] and dact arrive in shared memory by three
        TMA copies; the row pass writes dh's rowwise codes (dg and du), the column pass dh's and act's columnwise
        codes. Grid: (F/128, M_pad/128)."""
        pid_f = gl.program_id(0)
        pid_m = gl.program_id(1)
        # the three input tiles, by TMA
        gate_tile = gl.allocate_shared_memory(gl.bfloat16, [128, 128], h_desc.layout)
        up_tile = gl.allocate_shared_memory(gl.bfloat16, [128, 128], h_desc.layout)
        dact_tile = gl.allocate_shared_memory(gl.bfloat16, [128, 128], dact_desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, 2 * h_desc.block_type.nbytes + dact_desc.block_type.nbytes)
        _tma_load(h_desc, [pid_m * 128, pid_f * 128], bar, gate_tile)
        _tma_load(h_desc, [pid_m * 128, F + pid_f * 128], bar, up_tile)
        _tma_load(dact_desc, [pid_m * 128, pid_f * 128], bar, dact_tile)
        mbarrier.wait(bar, 0)
        mbarrier.invalidate(bar)
        row_layout: gl.constexpr = _row_layout(gl.num_warps())
        col_layout: gl.constexpr = _col_layout(gl.num_warps(), CC)
        # row pass: dh's rowwise codes
        for first_row in gl.static_range(0, 128, RC):
            rows = pid_m * 128 + first_row + gl.arange(0, RC, layout=gl.SliceLayout(1, row_layout))
            valid = (gl.load(m_idx_ptr + rows) >= 0)[:, None]
            dg, du, act = _swiglu_grads(gate_tile.slice(first_row, RC, dim=0).load(row_layout).to(gl.float32),
                                        up_tile.slice(first_row, RC, dim=0).load(row_layout).to(gl.float32),
                                        dact_tile.slice(first_row, RC, dim=0).load(row_layout).to(gl.float32), valid)
            _rows_out(dg, pid_m * 128 + first_row, pid_f * 128, dh_ptr, dh_s_ptr, 2 * F, 2 * F // 128)
            _rows_out(du, pid_m * 128 + first_row, F + pid_f * 128, dh_ptr, dh_s_ptr, 2 * F, 2 * F // 128)
        # column pass: dh's and act's columnwise codes
        rows = pid_m * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, col_layout))
        valid = (gl.load(m_idx_ptr + rows) >= 0)[:, None]
        for first_col in gl.static_range(0, 128, CC):
            dg, du, act = _swiglu_grads(gate_tile.slice(first_col, CC, dim=1).load(col_layout).to(gl.float32),
                                        up_tile.slice(first_col, CC, dim=1).load(col_layout).to(gl.float32),
                                        dact_tile.slice(first_col, CC, dim=1).load(col_layout).to(gl.float32), valid)
            _cols_out(dg, pid_m * 128, pid_f * 128 + first_col, dht_ptr, dht_s_ptr, M)
            _cols_out(du, pid_m * 128, F + pid_f * 128 + first_col, dht_ptr, dht_s_ptr, M)
            _cols_out(act, pid_m * 128, pid_f * 128 + first_col, actt_ptr, actt_s_ptr, M)

    @gluon.jit
    def _rowcol_tma_kernel(
        x_desc,  # TMA descriptor of x [M, N] bf16, [128, 128] blocks
        q_ptr,  # [M, N] e4m3, written (ROWWISE)
        s_ptr,  # [M, N/128] fp32, written (ROWWISE)
        qt_ptr,  # [N, M] e4m3, written (COLWISE)
        st_ptr,  # [N, M/128] fp32, written (COLWISE)
        M, N,
        ROWWISE: gl.constexpr, COLWISE: gl.constexpr, RC: gl.constexpr, CC: gl.constexpr,
    ):
        """One 128x128 tile per program, arriving by one TMA copy. Grid: (N/128, M/128), column blocks fastest."""
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        tile = _tma_tile(x_desc, pid_m * 128, pid_n * 128)
        _quantize_tile(tile, pid_m, pid_n, q_ptr, s_ptr, qt_ptr, st_ptr, M, N, ROWWISE, COLWISE, RC, CC)

    @gluon.jit
    def _rowcol_gather_kernel(
        x_ptr, ld_x,  # [rows of x, N] bf16 and its row stride
        src_ptr,  # [M] int32: tile row r reads x row src[r] // gather_div, zeros where src[r] < 0
        q_ptr,  # [M, N] e4m3, written (ROWWISE)
        s_ptr,  # [M, N/128] fp32, written (ROWWISE)
        qt_ptr,  # [N, M] e4m3, written (COLWISE)
        st_ptr,  # [N, M/128] fp32, written (COLWISE)
        M, N, gather_div,
        ROWWISE: gl.constexpr, COLWISE: gl.constexpr, RC: gl.constexpr, CC: gl.constexpr,
    ):
        """One 128x128 tile of gathered rows per program, arriving by cp.async (16 bytes per copy). Grid: (M/128,
        N/128), row blocks fastest (the order the Triton gather kernel measured faster)."""
        pid_m = gl.program_id(0)
        pid_n = gl.program_id(1)
        load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
        tile = gl.allocate_shared_memory(gl.bfloat16, [128, 128],
                                         gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))
        rows = pid_m * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, load_layout))
        cols = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, load_layout))
        src = gl.load(src_ptr + rows)
        read = src >= 0
        x_rows = gl.where(read, src // gather_div, 0).to(gl.int64)
        _cp_async_load(tile, x_ptr + x_rows[:, None] * ld_x + cols[None, :], mask=read[:, None] & (cols < N)[None, :])
        async_copy.commit_group()
        async_copy.wait_group(0)
        _cta_barrier()
        _quantize_tile(tile, pid_m, pid_n, q_ptr, s_ptr, qt_ptr, st_ptr, M, N, ROWWISE, COLWISE, RC, CC)

    @gluon.jit
    def _weight_quant_kernel(
        w_desc,  # TMA descriptor of w's [E * N, K] view, bf16, [128, 128] blocks
        q_ptr,  # [E, N, K] e4m3, written
        s_ptr,  # [E, N/128, K/128] fp32, written
        qt_ptr,  # [E, K, N] e4m3, written (TRANSPOSED)
        N, K,
        RC: gl.constexpr, CC: gl.constexpr, TRANSPOSED: gl.constexpr,
    ):
        """Program (k block, n block, expert), one 128x128 block of w by one TMA copy: its amax (one pass over the
        tile in shared memory), then q from row chunks and, when TRANSPOSED, the same codes at their transposed
        places in qT from column chunks. Grid: (K/128, N/128, E)."""
        block_k = gl.program_id(0)
        block_n = gl.program_id(1)
        expert = gl.program_id(2)
        tile = _tma_tile(w_desc, expert * N + block_n * 128, block_k * 128)
        row_layout: gl.constexpr = _row_layout(gl.num_warps())
        col_layout: gl.constexpr = _col_layout(gl.num_warps(), CC)
        store_layout: gl.constexpr = _transposed_store_layout(gl.num_warps())
        # the block's amax and scale
        amax = gl.zeros([RC], gl.float32, layout=gl.SliceLayout(1, row_layout))
        for first_row in gl.static_range(0, 128, RC):
            chunk = tile.slice(first_row, RC, dim=0).load(row_layout).to(gl.float32)
            amax = gl.maximum(amax, gl.max(gl.abs(chunk), axis=1))
        scale, inverse = _fp8_scale_inverse(gl.zeros_like(amax) + gl.max(amax, axis=0))  # [RC], all the block's
        gl.store(s_ptr + (expert * (N // 128) + block_n) * (K // 128) + block_k, gl.max(scale, axis=0))
        # q by rows
        inverse_rows = inverse[:, None]
        q_expert = q_ptr + expert.to(gl.int64) * N * K
        for first_row in gl.static_range(0, 128, RC):
            chunk = tile.slice(first_row, RC, dim=0).load(row_layout).to(gl.float32)
            rows = block_n * 128 + first_row + gl.arange(0, RC, layout=gl.SliceLayout(1, row_layout))
            cols = block_k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, row_layout))
            gl.store(q_expert + rows[:, None] * K + cols[None, :], (chunk * inverse_rows).to(gl.float8e4nv))
        # qT by columns
        if TRANSPOSED:
            inverse_block = gl.max(inverse, axis=0)
            qt_expert = qt_ptr.to(gl.pointer_type(gl.uint8)) + expert.to(gl.int64) * N * K
            for first_col in gl.static_range(0, 128, CC):
                chunk = tile.slice(first_col, CC, dim=1).load(col_layout).to(gl.float32)
                codes = gl.convert_layout((chunk * inverse_block).to(gl.float8e4nv).to(gl.uint8, bitcast=True),
                                          store_layout)
                rows = block_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, store_layout))
                cols = block_k * 128 + first_col + gl.arange(0, CC, layout=gl.SliceLayout(0, store_layout))
                gl.store(qt_expert + cols[None, :] * N + rows[:, None], codes)


def _tile_descriptor(x: torch.Tensor) -> "TensorDescriptor":
    """A TMA descriptor of a 2-D bf16 tensor in unswizzled [128, 128] blocks."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    return TensorDescriptor.from_tensor(x, [128, 128], layout)


def quant_weights(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, qt: torch.Tensor | None) -> None:
    """Fill the outputs allocated by quantize.quant_weights (w [E, N, K] contiguous bf16; qt None when the
    transposed copy is not asked): one read of w."""
    e, n, k = w.shape
    _weight_quant_kernel[(k // 128, n // 128, e)](
        _tile_descriptor(w.view(e * n, k)),
        q,
        s,
        qt if qt is not None else q,
        n, k,
        RC=ROW_CHUNK, CC=COL_CHUNK, TRANSPOSED=qt is not None, num_warps=NUM_WARPS)


def swiglu_bwd(h: torch.Tensor, dact: torch.Tensor, m_indices: torch.Tensor, dh: torch.Tensor, dh_s: torch.Tensor,
               dht: torch.Tensor, dht_s: torch.Tensor, actt: torch.Tensor, actt_s: torch.Tensor, *,
               rc: int = ROW_CHUNK, cc: int = SWIGLU_COL_CHUNK, num_warps: int = SWIGLU_WARPS) -> None:
    """Fill the outputs allocated by activation.swiglu_bwd(quant=True): dh [M, 2F] rowwise and columnwise, act's
    columnwise codes, from h [M, 2F] and dact [M, F] (bf16, contiguous rows)."""
    m, two_f = h.shape
    f = two_f // 2
    _swiglu_bwd_kernel[(f // 128, m // 128)](
        _tile_descriptor(h),
        _tile_descriptor(dact),
        m_indices,
        dh,
        dh_s,
        dht,
        dht_s,
        actt,
        actt_s,
        m, f,
        RC=rc, CC=cc, num_warps=num_warps)


def quant_rows_cols(x: torch.Tensor, rowwise: bool, colwise: bool, src: torch.Tensor | None, gather_div: int,
                    q: torch.Tensor | None, s: torch.Tensor | None, qt: torch.Tensor | None, st: torch.Tensor | None,
                    *, rc: int = ROW_CHUNK, cc: int = COL_CHUNK, num_warps: int = NUM_WARPS) -> None:
    """Fill the outputs allocated by quantize.quant_rows_cols (which checks the shapes); rc, cc and num_warps are
    the register chunks and warps (bench/quant_transpose.py sweeps them)."""
    m = src.numel() if src is not None else x.shape[0]
    n = x.shape[1]
    consts = dict(ROWWISE=rowwise, COLWISE=colwise, RC=rc, CC=cc, num_warps=num_warps)
    outs = (q if rowwise else x, s if rowwise else x, qt if colwise else x, st if colwise else x)
    if src is None:
        if x.stride(1) != 1 or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
            x = x.contiguous()
        _rowcol_tma_kernel[(n // 128, m // 128)](_tile_descriptor(x), *outs, m, n, **consts)
    else:
        if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
            x = x.contiguous()
        _rowcol_gather_kernel[(m // 128, n // 128)](x, x.stride(0), src, *outs, m, n, gather_div, **consts)
