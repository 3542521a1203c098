"""Warp-specialized blockwise FP8 k-grouped GEMM (the weight gradient) for Hopper (sm_90) in Gluon: the product of
gemm_fp8_triton.kgrouped_fp8, same arguments and results, built like the m-grouped kernel of
gemm_fp8_gluon_mgrouped.py (read its docstring first).

Shapes: M tokens (the padded expert layout, experts 128-aligned), N and K the weight's dims, E experts.
out[e] [N, K] = A[:, s:t] @ B[:, s:t]^T, [s, t) = offsets[e:e+2] (read on the device; an empty expert gets zeros);
without offsets one group over all M. A [N, M] and B [K, M] token-contiguous e4m3 (the column quantization of
the activations), with scales along the tokens: sa [N, M/128], sb [K, M/128].

Math (DeepSeek-V3's promotion): for each 128-token block tb the tensor cores form P = A[:, tb] @ B[:, tb]^T in fp32
and the consumer adds P[n, k] * sa[n, tb] * sb[k, tb] to the fp32 accumulator. Here both scales vary across the
tile (a row vector and a column vector per step): each consumer thread holds 2 rows x 32 columns of its 64 x 128
partial, so a step's scales are 2 + 32 values per thread.

Partitions (as in the m-grouped kernel): the producer warp, per 128-token step, copies the step's 128 row scales
and 128 column scales into the slot's shared-memory scale buffers (cp.async of 4 consecutive scales a lane: the
launcher hands the scales over token-block-major, `token_block_major`, so a step's 128 are contiguous; tracked by
the slot's `ready` barrier: cp.async.mbarrier.arrive.noinc, so the barrier's init count names all 33 arrivals of
every phase, the 32 lanes' copies and the expect of the TMA bytes) and issues the TMA loads of the A tile
[128 rows of N, 128 tokens] and the B tile [128 rows of K, 128 tokens]. Two consumer warpgroups own rows [64g,
64g + 64) of the 128 x 128 output tile; per step each reads its scales from shared memory, issues its wgmma, waits,
releases the slot and promotes (one multiply for the scale product, one fused multiply-add per element). Ordering
the two warpgroups' products so that one's promotion (twice the m-grouped kernel's work per element) runs under
the other's product was no faster: the promotion is not what limits this kernel. Registers per
consumer thread: 64 accumulators + 64 partial + 32 column scales. Output tiles are written by TMA in out's dtype
(fp32 for the weight gradient: 64 KB of output tiles, 4 ring stages of 33 KB; bf16: 5 stages).

Tiles are scheduled persistently, expert-major (the CTAs in flight share one expert's token slices in L2), in
grouped order inside an expert (bands of GROUP row blocks of N, walked column block by column block;
tile_blocks, the same arithmetic in Python for tests/test_fp8_schedule.py). A tile's length is its expert's
token count, read on the device by every partition at the tile's start; no host sync, capturable in a CUDA graph.
Since a tile's work is its expert's token count, the experts are taken in `order` (the launcher's default: most
tokens first, a device-side sort of the offsets' differences) and the tiles dealt to the CTAs in rounds that
alternate direction (`snake_index`: round i gives position p of the list to CTA p when i is even, to CTA P-1-p when
odd), so each CTA gets one long and one short tile per pair of rounds. With the experts in index order and tile t
on CTA t mod P, the CTAs that drew the busiest experts' tiles set the kernel's time: under a skewed load a
statically scheduled persistent kernel waits for the few CTAs holding the busiest experts' tiles.
The range is not read one tile ahead and carried to the next tile: Triton 3.6's Gluon front end does not carry a
value reassigned after a nested loop when it feeds that loop's bounds (the reassignment is dropped), so every
tile would reduce over its program's first tile's tokens.
"""

from __future__ import annotations

import torch

from moela.ops.moe.kernels import gemm_fp8_gluon_mgrouped as ws
from moela.ops.moe.kernels.gemm_fp8_gluon_mgrouped import BK, BM, BN, GROUP, NUM_WARPS, SHARED_BYTES

if ws.gluon is not None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

STAGES = 5  # ring depth, lowered at launch to what shared memory holds next to the output tiles (`fit_stages`)


def scale_slots(stages: int) -> int:
    """Slots of the scale buffers: the ring's stages rounded up to a power of two (a plain shared-memory layout's
    dims must be powers of two); slots past `stages` stay unused."""
    return 1 << (stages - 1).bit_length()


def shared_bytes(stages: int, out_bytes: int) -> int:
    """Shared memory of one CTA: per stage the A and B tiles, 2 x 128 fp32 scales per scale slot, the output tiles
    and the ring's barriers."""
    return stages * (BM + BN) * BK + scale_slots(stages) * (BM + BN) * 4 + BM * BN * out_bytes + 2 * stages * 8


def fit_stages(stages: int, out_bytes: int) -> int:
    """The deepest ring up to `stages` that fits the shared memory next to output tiles of out_bytes per element."""
    while stages > 2 and shared_bytes(stages, out_bytes) > SHARED_BYTES:
        stages -= 1
    return stages


def tile_blocks(tile, num_n, num_k, GROUP):
    """Tile index -> (expert, row block of N, column block of K): expert-major; inside an expert, bands of GROUP row
    blocks (the last band may be narrower), each band walked column block by column block, so the CTAs in flight
    share the B columns of one band. A band holds size x num_k tiles, so a tile's band is its index over
    GROUP x num_k. Plain integer arithmetic on non-negative values: the same function runs on the device (as the
    kernel's jitted helper) and in Python (tests/test_fp8_schedule.py walks every program's schedule with it)."""
    per_e = num_n * num_k
    t = tile % per_e
    band = GROUP * num_k
    first_n = (t // band) * GROUP
    size = num_n - first_n
    if size > GROUP:
        size = GROUP
    r = t % band
    return tile // per_e, first_n + r % size, r // size


def snake_index(i, p, programs):
    """Program p's position in the tile list in its round i: p in even rounds, programs - 1 - p in odd ones."""
    odd = i % 2
    return i * programs + p + odd * (programs - 1 - 2 * p)


def snake_rounds(p, programs, num_tiles):
    """How many rounds program p takes part in: all cdiv(num_tiles, programs) but the last one if its position in
    the last (partial) round lies past the list's end. num_tiles >= 1."""
    rounds = (num_tiles + programs - 1) // programs
    last = rounds - 1
    rem = num_tiles - last * programs  # tiles in the last round, 1..programs
    pos = p + (last % 2) * (programs - 1 - 2 * p)
    return rounds - (pos + programs - rem) // programs


def ring_position(step, STAGES):
    """The ring slot of a program's step-th token block and the parity of the slot's barrier phase it uses: the
    producer and both consumer warpgroups count every step of every tile of their program, so the three agree
    on both as long as they see the same step counts per tile."""
    return step % STAGES, (step // STAGES) & 1


if ws.gluon is not None:
    _scale_slots = gluon.constexpr_function(scale_slots)
    _tile_blocks = gluon.jit(tile_blocks)
    _snake_index = gluon.jit(snake_index)
    _snake_rounds = gluon.jit(snake_rounds)
    _ring_position = gluon.jit(ring_position)
    _BM = gl.constexpr(BM)
    _BN = gl.constexpr(BN)
    _BK = gl.constexpr(BK)
    _CONSUMER_REGS = gl.constexpr(ws.CONSUMER_REGS)
    _PRODUCER_REGS = gl.constexpr(ws.PRODUCER_REGS)
    _LANES = gl.constexpr(32)  # the producer warp's lanes: each one's scale copies arrive on the slot's barrier

    @gluon.jit
    def _tile_origin(tile, num_n, num_k, GROUP: gl.constexpr):
        """Tile index -> (expert, first row of N, first column of K)."""
        e, nb, kb = _tile_blocks(tile, num_n, num_k, GROUP)
        return e, nb * _BM, kb * _BN

    @gluon.jit
    def _round_tile(i, per_e, order_ptr, NUM_PROGRAMS, GROUPED: gl.constexpr):
        """This CTA's tile in round i: its position in the balanced list (experts in `order`), as a tile index of
        the expert-major numbering (tile // per_e = the expert)."""
        idx = _snake_index(i, gl.program_id(0), NUM_PROGRAMS)
        if GROUPED:
            idx = gl.load(order_ptr + idx // per_e) * per_e + idx % per_e
        return idx

    @gluon.jit
    def _token_blocks(off_ptr, tile, per_e, M, GROUPED: gl.constexpr):
        """[first, end) token blocks of the tile's expert (offsets are 128-aligned), or all of M with one group."""
        if GROUPED:
            e = tile // per_e
            start = (gl.load(off_ptr + e) // _BK).to(gl.int32)
            end = (gl.load(off_ptr + e + 1) // _BK).to(gl.int32)
        else:
            start = 0
            end = gl.cdiv(M, _BK)
        return start, end

    @gluon.jit
    def _producer(
        a_desc,  # TMA descriptor of A [N, M] e4m3, [128, 128] blocks
        b_desc,  # TMA descriptor of B [K, M] e4m3, [128, 128] blocks
        a_ring,  # [STAGES, 128, 128] e4m3 shared, written
        b_ring,  # [STAGES, 128, 128] e4m3 shared, written
        sa_ring,  # [slots, 128] fp32 shared: a step's row scales, written
        sb_ring,  # [slots, 128] fp32 shared: a step's column scales, written
        ready,  # [STAGES] mbarriers: a slot's tiles and scales have landed
        empty,  # [STAGES] mbarriers: both consumer warpgroups released a slot
        as_ptr, s_asn, s_ast,  # A's scales [N, M/128] fp32, token blocks adjacent
        bs_ptr, s_bsk, s_bst,  # B's scales [K, M/128] fp32, token blocks adjacent
        off_ptr,  # [E + 1] int64 expert block starts (GROUPED)
        order_ptr,  # [E] int32 the experts in the order their tiles are dealt (GROUPED)
        N, K, M, E, NUM_PROGRAMS,
        GROUPED: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
    ):
        """One warp: per token block of every tile of this CTA, claim the next slot; copy the block's row and column
        scales (cp.async) and load the A and B tiles (TMA) into it."""
        vec: gl.constexpr = gl.BlockedLayout([_BM // 32], [32], [1], [0])
        idx = gl.arange(0, _BM, layout=vec)
        num_n = gl.cdiv(N, _BM)
        num_k = gl.cdiv(K, _BN)
        num_tiles = E * num_n * num_k
        step_bytes: gl.constexpr = (_BM + _BN) * _BK
        it = 0  # steps issued by this CTA: slot it % STAGES, pass it // STAGES over the ring
        for i in range(0, _snake_rounds(gl.program_id(0), NUM_PROGRAMS, num_tiles)):
            tile = _round_tile(i, num_n * num_k, order_ptr, NUM_PROGRAMS, GROUPED)
            e, n0, k0 = _tile_origin(tile, num_n, num_k, GROUP)
            start, end = _token_blocks(off_ptr, tile, num_n * num_k, M, GROUPED)
            rows_ok = n0 + idx < N
            cols_ok = k0 + idx < K
            for tb in range(start, end):
                slot, phase = _ring_position(it, STAGES)
                # step 1: wait until both consumer warpgroups released the slot
                mbarrier.wait(empty.index(slot), phase ^ 1)
                # step 2: the step's scales; each lane arrives on the slot's ready barrier once its copies landed
                # (one of the barrier's counted arrivals, so every phase waits for all 32 lanes' copies)
                _cp_async(sa_ring.index(slot), as_ptr + (n0 + idx) * s_asn + tb * s_ast, mask=rows_ok)
                _cp_async(sb_ring.index(slot), bs_ptr + (k0 + idx) * s_bsk + tb * s_bst, mask=cols_ok)
                async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
                # step 3: the operand tiles; their bytes and the expect arrival complete the barrier
                mbarrier.expect(ready.index(slot), step_bytes)
                ws._tma_load(a_desc, [n0, tb * _BK], ready.index(slot), a_ring.index(slot))
                ws._tma_load(b_desc, [k0, tb * _BK], ready.index(slot), b_ring.index(slot))
                it += 1

    @gluon.jit
    def _consumer(
        a_ring,  # [STAGES, 128, 128] e4m3 shared
        b_ring,  # [STAGES, 128, 128] e4m3 shared
        sa_ring,  # [slots, 128] fp32 shared: a step's row scales
        sb_ring,  # [slots, 128] fp32 shared: a step's column scales
        c_tiles,  # [2, 64, 128] shared, one output tile per consumer warpgroup
        ready,  # [STAGES] mbarriers: a slot's tiles and scales have landed
        empty,  # [STAGES] mbarriers: both consumer warpgroups released a slot
        c_desc,  # TMA descriptor of C [E * N, K] (bf16 or fp32), [64, 128] blocks, written
        off_ptr,  # [E + 1] int64 expert block starts (GROUPED)
        order_ptr,  # [E] int32 the experts in the order their tiles are dealt (GROUPED)
        N, K, M, E, NUM_PROGRAMS,
        GROUPED: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr,
    ):
        """Consumer warpgroup WG: rows [64 WG, 64 WG + 64) of each output tile; promotion in registers, TMA store."""
        acc_layout: gl.constexpr = ws._acc_layout()
        num_n = gl.cdiv(N, _BM)
        num_k = gl.cdiv(K, _BN)
        num_tiles = E * num_n * num_k
        partial = gl.zeros([64, _BN], gl.float32, acc_layout)  # one step's wgmma result
        it = 0  # steps consumed: the producer's count, step for step
        for i in range(0, _snake_rounds(gl.program_id(0), NUM_PROGRAMS, num_tiles)):
            tile = _round_tile(i, num_n * num_k, order_ptr, NUM_PROGRAMS, GROUPED)
            e, n0, k0 = _tile_origin(tile, num_n, num_k, GROUP)
            start, end = _token_blocks(off_ptr, tile, num_n * num_k, M, GROUPED)
            acc = gl.zeros([64, _BN], gl.float32, acc_layout)
            for _ in range(start, end):
                slot, phase = _ring_position(it, STAGES)
                # step 1: wait for the slot; read this warpgroup's 64 row scales and the 128 column scales from
                # shared memory (before the slot can be released)
                mbarrier.wait(ready.index(slot), phase)
                sa = sa_ring.index(slot).slice(WG * 64, 64).load(gl.SliceLayout(1, acc_layout))
                sb = sb_ring.index(slot).load(gl.SliceLayout(0, acc_layout))
                # step 2: the fp8 product over the 128 tokens; wait for it and release the slot
                a_tile = a_ring.index(slot).slice(WG * 64, 64)  # [64 rows of N, 128 tokens]
                b_tile = b_ring.index(slot).permute((1, 0))  # [128 tokens, 128 columns of K], token-major
                partial = warpgroup_mma(a_tile, b_tile, partial, use_acc=False, is_async=True)
                partial = warpgroup_mma_wait(0, deps=(partial, ))
                mbarrier.arrive(empty.index(slot), count=1)
                # step 3: promotion by the outer product of the scales, while the other warpgroup's product runs
                acc += partial * (sa[:, None] * sb[None, :])
                it += 1
            # step 4: epilogue (an empty expert's tile stores zeros); the previous store had a tile's time
            tma.store_wait(0)
            c_tiles.index(WG).store(acc.to(c_desc.dtype))
            fence_async_shared()
            ws._tma_store(c_desc, [e * N + n0 + WG * 64, k0], c_tiles.index(WG))
        tma.store_wait(0)

    @gluon.jit
    def _kgrouped_ws_kernel(
        a_desc,  # TMA descriptor of A [N, M] e4m3, [128, 128] blocks
        b_desc,  # TMA descriptor of B [K, M] e4m3, [128, 128] blocks
        c_desc,  # TMA descriptor of C [E * N, K] (bf16 or fp32), [64, 128] blocks, written
        as_ptr, s_asn, s_ast,  # A's scales [N, M/128] fp32, token blocks adjacent
        bs_ptr, s_bsk, s_bst,  # B's scales [K, M/128] fp32, token blocks adjacent
        off_ptr,  # [E + 1] int64 expert block starts (GROUPED)
        order_ptr,  # [E] int32 the experts in the order their tiles are dealt (GROUPED)
        N, K, M, E, NUM_PROGRAMS,
        GROUPED: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
    ):
        """Persistent: CTA p computes its positions of the E x (N / 128) x (K / 128) output tiles, in the balanced
        order (module docstring)."""
        a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES, _BM, _BK], a_desc.layout)
        b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES, _BN, _BK], b_desc.layout)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # per slot: 128 plain fp32
        slots: gl.constexpr = _scale_slots(STAGES)
        sa_ring = gl.allocate_shared_memory(gl.float32, [slots, _BM], flat)
        sb_ring = gl.allocate_shared_memory(gl.float32, [slots, _BN], flat)
        c_tiles = gl.allocate_shared_memory(c_desc.dtype, [2, 64, _BN], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            # the producer's expect and its 32 lanes' cp.async arrivals; the TMA bytes complete it
            mbarrier.init(ready.index(i), count=1 + _LANES)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        fence_async_shared()  # the initialized barriers visible to the TMA engine
        gl.warp_specialize([
            (_consumer, (a_ring, b_ring, sa_ring, sb_ring, c_tiles, ready, empty, c_desc, off_ptr, order_ptr, N, K, M,
                         E, NUM_PROGRAMS, GROUPED, GROUP, STAGES, 0)),
            (_consumer, (a_ring, b_ring, sa_ring, sb_ring, c_tiles, ready, empty, c_desc, off_ptr, order_ptr, N, K, M,
                         E, NUM_PROGRAMS, GROUPED, GROUP, STAGES, 1)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, sa_ring, sb_ring, ready, empty, as_ptr, s_asn, s_ast, bs_ptr,
                         s_bsk, s_bst, off_ptr, order_ptr, N, K, M, E, NUM_PROGRAMS, GROUPED, GROUP, STAGES)),
        ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


def token_block_major(scale: torch.Tensor) -> torch.Tensor:
    """scale [rows, M/128] with the token blocks adjacent in memory ([M/128, rows] storage, returned as the [rows,
    M/128] view), copied only if it is not laid out so already. The producer warp then reads a step's 128 scales of
    an operand as one contiguous 512-byte run (coalesced cp.async) instead of 128 reads M/128 x 4 bytes apart
    (measurably faster for the whole weight gradient). The scales are 1/128 of the operand's elements, so the copy
    is small (4 MB for a [4096, 32768] operand)."""
    return scale if scale.stride(0) == 1 else scale.t().contiguous().t()


def experts_by_load(offsets: torch.Tensor) -> torch.Tensor:
    """[E] int32: the experts, most (padded) tokens first: the order the kernel deals their tiles in. On the device,
    no host sync."""
    return torch.argsort(offsets[1:] - offsets[:-1], descending=True, stable=True).to(torch.int32)


def kgrouped_fp8_gluon(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                       offsets: torch.Tensor | None, out: torch.Tensor, num_programs: int,
                       order: torch.Tensor | None = None) -> torch.Tensor:
    """Fill out [E, N, K] (bf16 or fp32) as gemm_fp8_triton.kgrouped_fp8 does; that function checks the operands
    (a [N, M] and b [K, M] e4m3 contiguous, scales fp32 with any strides, N a multiple of 128 when grouped).
    num_programs: the persistent grid's size (the SM count). order: [E] int32, a permutation of the experts to
    deal their tiles in (default `experts_by_load(offsets)`)."""
    if out.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"kgrouped_fp8 (gluon): out_dtype {out.dtype} must be bf16 or fp32")
    n, m = a.shape
    k = b.shape[0]
    e = out.shape[0]
    if m == 0:  # no tokens: every expert's gradient is zero (a TMA descriptor needs a non-empty tensor)
        return out.zero_()
    a_scale, b_scale = token_block_major(a_scale), token_block_major(b_scale)
    tile = ws.shared_layout(BM, BK, torch.float8_e4m3fn)
    grid = max(1, min(num_programs, e * -(-n // BM) * -(-k // BN)))
    grouped = offsets is not None
    if grouped and order is None:
        order = experts_by_load(offsets)
    _kgrouped_ws_kernel[(grid, )](
        ws.TensorDescriptor.from_tensor(a, [BM, BK], tile),
        ws.TensorDescriptor.from_tensor(b, [BN, BK], tile),
        ws.TensorDescriptor.from_tensor(out.view(e * n, k), [64, BN], ws.shared_layout(64, BN, out.dtype)),
        a_scale, a_scale.stride(0), a_scale.stride(1),
        b_scale, b_scale.stride(0), b_scale.stride(1),
        offsets if grouped else a_scale,
        order if grouped else a_scale,
        n, k, m, e, grid,
        GROUPED=grouped, GROUP=GROUP, STAGES=fit_stages(STAGES, out.element_size()), num_warps=NUM_WARPS)
    return out
