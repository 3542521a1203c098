"""Warp-specialized blockwise FP8 grouped GEMM for Hopper (sm_90) in Gluon: the m-grouped product (forward and data
gradient; with one group a dense GEMM) of gemm_fp8_triton.py, same arguments and results, organized the way DeepGEMM
organizes its sm90 FP8 GEMM.

Shapes: M rows (the padded expert layout, experts 128-aligned; any count with one group), N output features,
K reduction, E experts. out [M, N] = A [M, K] @ B_e [N, K]^T for each 128-row block, e = m_indices[block's first
row]. A e4m3 [M, K] with 1x128 scales sa [M, K/128]; B e4m3 [E, N, K] with 128x128 scales sb [E, N/128, K/128]
(any strides: the data gradient passes the transposed weight copy and its scales' transposed view).

Math (DeepSeek-V3's promotion): for each 128-wide step kb of the reduction the tensor cores form the fp8 product
P = A[rows, kb] @ B_e[cols, kb]^T in fp32 (at most 128 products summed in their limited-precision adder); the
consumer adds P[m, n] * sa[m, kb] * sb[e, n / 128, kb] to an fp32 accumulator in registers. Output in out's dtype
(bf16 or fp32), stored through shared memory by TMA.

Why warp specialization: Triton's tl.dot loop (gemm_fp8_triton.py) waits on each wgmma before promoting and brackets
each shared-memory refill with CTA-wide barriers, so neither the promotion (~25% of a step's tensor-core time) nor
the refills overlap the tensor cores. Here the CTA runs three partitions that meet only at mbarriers:

- producer (one warp, 40 registers): walks the tile schedule and, per 128-wide step, waits until a ring slot is
  free (`empty`), then issues the TMA loads of the A tile [128, 128] and the B tile [128, 128] into it; the slot's
  `ready` barrier completes when their bytes have landed (out-of-range rows and columns arrive as zeros).
- two consumer warpgroups (the default partition and a worker; 232 registers each after setmaxnreg): warpgroup g
  owns rows [64g, 64g + 64) of the tile. Per step it waits on `ready`, issues the asynchronous wgmma of its 64 rows
  into an fp32 partial, waits for it, releases the slot (`empty` counts one arrival per warpgroup) and promotes
  the partial with its row scales and the block scale; the two warpgroups' products are left to the hardware to
  order (making them take turns, so that one's promotion runs under the other's product, was no faster). Scales
  are read from global memory (L2) one step ahead, across tiles too (the next tile's expert is read during the
  current tile), so no load latency sits between two steps. Each warpgroup stores its 64 x 128 result through its
  own shared-memory tile and a TMA store, and waits for that store only at its next tile's epilogue.

Tile 128 x 128: per consumer thread 64 fp32 accumulators + the 64 of one partial, no spills. Wider tiles lose to
registers: a 128 x 256 tile takes two independent 128-column products per step (one per weight scale block), and
ptxas issues the second before promoting the first, which needs 64 x 256 / 128 + 2 x 64 = 256 registers and spills
at 232 (Gluon's shapes are powers of two: DeepGEMM's 192-wide tile would also be two products). The ring takes 32 KB
per stage: 6 stages + the two output tiles (32 KB in bf16) fill 224 of the 227 KB (fp32 output: 5 stages).

The schedule is persistent (one CTA per SM) over the tiles of the rows the routing filled (offsets[E], read on the
device by every partition: no host sync, capturable in a CUDA graph; empty experts own no row block), in grouped
order: GROUP (8) consecutive row blocks per column block, so the B tiles the CTAs in flight read stay in L2. Gluon
does not run in the Triton interpreter: on CPU gemm_fp8_triton's kernel runs, tests/sm90_compile.py compiles this
kernel for sm_90 (registers, spills, shared memory; wgmma and setmaxnreg in the PTX) and tests/test_fp8_gluon.py
checks it on the GPU against float64 math on the same quantized operands.
"""

from __future__ import annotations

import functools

import torch

from moela.ops.triton_env import HOPPER_SHARED_BYTES

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon: gemm_fp8_triton's kernels serve every call
    gluon = None
else:  # the TMA builtins' names: Triton 3.6 (async_copy_*) and newer ones (async_load / async_store)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

BM = 128  # rows per tile: two consumer warpgroups of 64 (the expert layout aligns experts to 128 rows)
BN = 128  # columns per tile: one weight scale block
BK = 128  # reduction step: one scale per 128 of K
SHARED_BYTES = HOPPER_SHARED_BYTES
CONSUMER_REGS = 232  # registers per thread of each consumer warpgroup after reallocation
PRODUCER_REGS = 40  # registers per thread of the producer's warpgroup
NUM_WARPS = 4  # the default partition: consumer warpgroup 0
GROUP = 8  # row blocks per column block in the tile order
STAGES = 6  # ring depth, lowered at launch to what shared memory holds next to the output tiles (`fit_stages`)


def available(device: torch.device) -> bool:
    """Whether this kernel can run on `device`: a Hopper GPU (sm_90, where it is built and tested) and a Triton with
    Gluon."""
    return gluon is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def shared_bytes(stages: int, out_bytes: int) -> int:
    """Shared memory of one CTA: the ring (A and B tiles per stage), both warpgroups' output tiles, the ring's
    barriers."""
    return stages * (BM + BN) * BK + BM * BN * out_bytes + 2 * stages * 8


def fit_stages(stages: int, out_bytes: int) -> int:
    """The deepest ring up to `stages` that fits the shared memory next to output tiles of out_bytes per element."""
    while stages > 2 and shared_bytes(stages, out_bytes) > SHARED_BYTES:
        stages -= 1
    return stages


if gluon is not None:
    _BM = gl.constexpr(BM)
    _BN = gl.constexpr(BN)
    _BK = gl.constexpr(BK)
    _CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)

    @gluon.constexpr_function
    def _acc_layout():
        """Register layout of one consumer warpgroup's 64 x 128 wgmma result (m64n128k32 instructions)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])

    @gluon.jit
    def _tiles(m_idx_ptr, off_ptr, M, N, E, GROUPED: gl.constexpr):
        """(tiles, row blocks, column blocks) of the rows in use: offsets[E] (the padded rows the routing filled,
        read on the device) when GROUPED, else all M."""
        if GROUPED:
            m_used = gl.load(off_ptr + E).to(gl.int32)
        else:
            m_used = M
        num_m = gl.cdiv(m_used, _BM)
        num_n = gl.cdiv(N, _BN)
        return num_m * num_n, num_m, num_n

    @gluon.jit
    def _tile_origin(tile, num_m, num_n, GROUP: gl.constexpr):
        """Tile index -> (first row, first column); GROUP row blocks per column block, so consecutive tiles share a
        B tile (an index past the last tile gives some in-range origin: its uses are masked)."""
        width = GROUP * num_n
        first_m = (tile // width) * GROUP
        size_m = gl.maximum(gl.minimum(num_m - first_m, GROUP), 1)
        return (first_m + (tile % width) % size_m) * _BM, ((tile % width) // size_m) * _BN

    @gluon.jit
    def _expert(m_idx_ptr, m0, valid, GROUPED: gl.constexpr):
        """The expert of the row block at m0 (0 with one group or where not valid): a block inside the filled rows
        has one (m_indices >= 0 on its first row)."""
        if GROUPED:
            e = gl.maximum(gl.load(m_idx_ptr + m0, mask=valid, other=0), 0)
        else:
            e = 0
        return e

    @gluon.jit
    def _producer(
        a_desc,  # TMA descriptor of A [M, K] e4m3, [128, 128] blocks
        b_desc,  # TMA descriptor of B [E * N, K] e4m3, [128, 128] blocks
        a_ring,  # [STAGES, 128, 128] e4m3 shared, written
        b_ring,  # [STAGES, 128, 128] e4m3 shared, written
        ready,  # [STAGES] mbarriers: a slot's tiles have landed
        empty,  # [STAGES] mbarriers: both consumer warpgroups released a slot
        m_idx_ptr,  # [M] int32 expert of each row, -1 on padding (GROUPED)
        off_ptr,  # [E + 1] int64 expert block starts (GROUPED)
        M, N, K, E, NUM_PROGRAMS,
        GROUPED: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
    ):
        """One warp: for every step of every tile of this CTA, claim the next ring slot and load A and B into it.
        The next tile's expert is read while this tile's loads are issued."""
        num_tiles, num_m, num_n = _tiles(m_idx_ptr, off_ptr, M, N, E, GROUPED)
        k_steps = gl.cdiv(K, _BK)
        step_bytes: gl.constexpr = (_BM + _BN) * _BK
        first = gl.program_id(0)
        e = _expert(m_idx_ptr, _tile_origin(first, num_m, num_n, GROUP)[0], first < num_tiles, GROUPED)
        it = 0  # steps issued by this CTA: slot it % STAGES, pass it // STAGES over the ring
        for tile in range(first, num_tiles, NUM_PROGRAMS):
            m0, n0 = _tile_origin(tile, num_m, num_n, GROUP)
            nxt = tile + NUM_PROGRAMS
            e_next = _expert(m_idx_ptr, _tile_origin(nxt, num_m, num_n, GROUP)[0], nxt < num_tiles, GROUPED)
            b_row = e * N + n0  # B's experts stacked: [E * N, K]
            for kb in range(k_steps):
                slot = it % STAGES
                # step 1: wait until both consumer warpgroups released the slot's previous contents (on the first
                # pass: the phase before a fresh barrier's first, which counts as completed)
                mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
                # step 2: both tiles complete the slot's ready barrier when their bytes have landed
                mbarrier.expect(ready.index(slot), step_bytes)
                _tma_load(a_desc, [m0, kb * _BK], ready.index(slot), a_ring.index(slot))
                _tma_load(b_desc, [b_row, kb * _BK], ready.index(slot), b_ring.index(slot))
                it += 1
            e = e_next

    @gluon.jit
    def _row_scales(as_ptr, m0, M, s_asm, valid, WG: gl.constexpr, layout: gl.constexpr):
        """(pointers to step 0's scales of this warpgroup's 64 rows of the block at m0, which of them to read)."""
        rows = m0 + WG * 64 + gl.arange(0, 64, layout=layout)
        return as_ptr + rows * s_asm, (rows < M) & valid

    @gluon.jit
    def _consumer(
        a_ring,  # [STAGES, 128, 128] e4m3 shared
        b_ring,  # [STAGES, 128, 128] e4m3 shared
        c_tiles,  # [2, 64, 128] shared, one output tile per consumer warpgroup
        ready,  # [STAGES] mbarriers: a slot's tiles have landed
        empty,  # [STAGES] mbarriers: both consumer warpgroups released a slot
        c_desc,  # TMA descriptor of C [M, N] (bf16 or fp32), [64, 128] blocks, written
        as_ptr, s_asm, s_ask,  # A's scales [M, K/128] fp32
        bs_ptr, s_bse, s_bsn, s_bsk,  # B's scales [E, N/128, K/128] fp32
        m_idx_ptr,  # [M] int32 expert of each row, -1 on padding (GROUPED)
        off_ptr,  # [E + 1] int64 expert block starts (GROUPED)
        M, N, K, E, NUM_PROGRAMS,
        GROUPED: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr,
    ):
        """Consumer warpgroup WG: rows [64 WG, 64 WG + 64) of each tile; promotion in registers, TMA store. Scales
        come one step ahead, the next tile's expert during this tile and its first scales during this tile's last
        step, so no tile starts waiting on a global load."""
        acc_layout: gl.constexpr = _acc_layout()
        row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
        num_tiles, num_m, num_n = _tiles(m_idx_ptr, off_ptr, M, N, E, GROUPED)
        k_steps = gl.cdiv(K, _BK)
        partial = gl.zeros([64, _BN], gl.float32, acc_layout)  # one step's wgmma result
        # the first tile's expert and step-0 scales
        first = gl.program_id(0)
        m0, n0 = _tile_origin(first, num_m, num_n, GROUP)
        e = _expert(m_idx_ptr, m0, first < num_tiles, GROUPED)
        sa_rows, sa_ok = _row_scales(as_ptr, m0, M, s_asm, first < num_tiles, WG, row_layout)
        sa = gl.load(sa_rows, mask=sa_ok, other=0.0)
        sb = gl.load(bs_ptr + e * s_bse + (n0 // _BN) * s_bsn, mask=first < num_tiles, other=0.0)
        it = 0  # steps consumed: the producer's count, step for step
        for tile in range(first, num_tiles, NUM_PROGRAMS):
            m0, n0 = _tile_origin(tile, num_m, num_n, GROUP)
            sa_rows, sa_ok = _row_scales(as_ptr, m0, M, s_asm, True, WG, row_layout)
            sb_col = bs_ptr + e * s_bse + (n0 // _BN) * s_bsn  # the weight block column's step-0 scale
            # the next tile: its expert now (the load has the whole tile to land), its scales' addresses
            nxt = tile + NUM_PROGRAMS
            has_next = nxt < num_tiles
            m0_next, n0_next = _tile_origin(nxt, num_m, num_n, GROUP)
            e_next = _expert(m_idx_ptr, m0_next, has_next, GROUPED)
            sa_rows_next, sa_ok_next = _row_scales(as_ptr, m0_next, M, s_asm, has_next, WG, row_layout)
            acc = gl.zeros([64, _BN], gl.float32, acc_layout)
            for kb in range(k_steps):
                slot = it % STAGES
                # step 1: the next step's scales (this tile's, or after its last step the next tile's first), in
                # flight from L2 while this step runs
                more = kb + 1 < k_steps
                sa_next = gl.load(gl.where(more, sa_rows + (kb + 1) * s_ask, sa_rows_next),
                                  mask=gl.where(more, sa_ok, sa_ok_next), other=0.0)
                sb_next = gl.load(gl.where(more, sb_col + (kb + 1) * s_bsk,
                                           bs_ptr + e_next * s_bse + (n0_next // _BN) * s_bsn),
                                  mask=more | has_next, other=0.0)
                # step 2: wait for the slot's tiles; the fp8 product of this warpgroup's 64 rows on the tensor cores
                # (four m64n128k32 wgmmas, at most 128 products accumulated in their adder); wait for it and release
                # the slot to the producer
                mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
                a_tile = a_ring.index(slot).slice(WG * 64, 64)  # [64, BK]
                b_tile = b_ring.index(slot).permute((1, 0))  # [BK, BN], K-major
                partial = warpgroup_mma(a_tile, b_tile, partial, use_acc=False, is_async=True)
                partial = warpgroup_mma_wait(0, deps=(partial, ))
                mbarrier.arrive(empty.index(slot), count=1)
                # step 3: promotion, while the other warpgroup's product runs
                acc += partial * (sa * sb)[:, None]
                sa, sb = sa_next, sb_next
                it += 1
            # step 4: epilogue; this warpgroup's previous TMA store has had a whole tile of time to finish
            tma.store_wait(0)
            c_tiles.index(WG).store(acc.to(c_desc.dtype))
            fence_async_shared()
            _tma_store(c_desc, [m0 + WG * 64, n0], c_tiles.index(WG))
            e = e_next
        tma.store_wait(0)

    @gluon.jit
    def _mgrouped_ws_kernel(
        a_desc,  # TMA descriptor of A [M, K] e4m3, [128, 128] blocks
        b_desc,  # TMA descriptor of B [E * N, K] e4m3 (the experts stacked), [128, 128] blocks
        c_desc,  # TMA descriptor of C [M, N] (bf16 or fp32), [64, 128] blocks, written
        as_ptr, s_asm, s_ask,  # A's scales [M, K/128] fp32
        bs_ptr, s_bse, s_bsn, s_bsk,  # B's scales [E, N/128, K/128] fp32
        m_idx_ptr,  # [M] int32 expert of each row, -1 on padding (GROUPED)
        off_ptr,  # [E + 1] int64 expert block starts; offsets[E] the rows in use (GROUPED)
        M, N, K, E, NUM_PROGRAMS,
        GROUPED: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
    ):
        """Persistent: CTA p computes tiles p, p + NUM_PROGRAMS, ... of the filled rows' (M / 128) x (N / 128)
        tiles. a_desc [M, K] and b_desc [E * N, K] with [128, 128] blocks, c_desc [M, N] with [64, 128] blocks (one
        per consumer warpgroup); scales by pointer and strides."""
        a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES, _BM, _BK], a_desc.layout)
        b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES, _BN, _BK], b_desc.layout)
        c_tiles = gl.allocate_shared_memory(c_desc.dtype, [2, 64, _BN], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)  # the producer's expect; the TMA bytes complete it
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        fence_async_shared()  # the initialized barriers visible to the TMA engine
        gl.warp_specialize([
            (_consumer, (a_ring, b_ring, c_tiles, ready, empty, c_desc, as_ptr, s_asm, s_ask, bs_ptr, s_bse, s_bsn,
                         s_bsk, m_idx_ptr, off_ptr, M, N, K, E, NUM_PROGRAMS, GROUPED, GROUP, STAGES, 0)),
            (_consumer, (a_ring, b_ring, c_tiles, ready, empty, c_desc, as_ptr, s_asm, s_ask, bs_ptr, s_bse, s_bsn,
                         s_bsk, m_idx_ptr, off_ptr, M, N, K, E, NUM_PROGRAMS, GROUPED, GROUP, STAGES, 1)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, ready, empty, m_idx_ptr, off_ptr, M, N, K, E, NUM_PROGRAMS,
                         GROUPED, GROUP, STAGES)),
        ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


@functools.lru_cache(maxsize=None)
def shared_layout(rows: int, cols: int, dtype: torch.dtype):
    """The 128-byte-swizzled shared-memory layout of a [rows, cols] TMA tile of `dtype` (e4m3, bf16 or fp32).
    Cached: it depends only on the tile and the dtype, and each GEMM launch needs three of them."""
    gl_dtype = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl_dtype)


def descriptors(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor):
    """TMA descriptors of a [M, K], b [E, N, K] (viewed [E * N, K]) and out [M, N], 128-byte swizzled tiles."""
    e, n, k = b.shape
    tile = shared_layout(BM, BK, torch.float8_e4m3fn)
    a_desc = TensorDescriptor.from_tensor(a, [BM, BK], tile)
    b_desc = TensorDescriptor.from_tensor(b.view(e * n, k), [BN, BK], tile)
    c_desc = TensorDescriptor.from_tensor(out, [64, BN], shared_layout(64, BN, out.dtype))
    return a_desc, b_desc, c_desc


def mgrouped_fp8_gluon(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                       m_indices: torch.Tensor | None, offsets: torch.Tensor | None, out: torch.Tensor,
                       num_programs: int) -> torch.Tensor:
    """Fill out [M, N] (bf16 or fp32) as gemm_fp8_triton.mgrouped_fp8 does; that function checks the operands (a
    [M, K] and b [E, N, K] e4m3 contiguous, scales fp32 with any strides, m_indices and offsets for the grouped
    layout, whose rows at or past offsets[E] stay unwritten). num_programs: the persistent grid's size (the SM
    count)."""
    if out.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"mgrouped_fp8 (gluon): out_dtype {out.dtype} must be bf16 or fp32")
    m, k = a.shape
    e, n, _ = b.shape
    if m == 0:  # no rows: nothing to compute (a TMA descriptor needs a non-empty tensor)
        return out
    grouped = m_indices is not None
    a_desc, b_desc, c_desc = descriptors(a, b, out)
    grid = max(1, min(num_programs, -(-m // BM) * -(-n // BN)))
    dummy = a_scale  # in place of the layout's tensors when there is one group (never read)
    _mgrouped_ws_kernel[(grid, )](
        a_desc,
        b_desc,
        c_desc,
        a_scale, a_scale.stride(0), a_scale.stride(1),
        b_scale, b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
        m_indices if grouped else dummy,
        offsets if grouped else dummy,
        m, n, k, e, grid,
        GROUPED=grouped, GROUP=GROUP, STAGES=fit_stages(STAGES, out.element_size()), num_warps=NUM_WARPS)
    return out
