"""The dQ kernel of the attention backward for Hopper (sm_90) in Gluon, warp-specialized on the forward's
scaffolding (gluon_common.py); the `gluon` kernel of the dQ phase (moela.ops.attention.phases), which `auto` takes
for every call it supports. It computes what triton_backward.py's dQ kernel computes,
`dq_i = scale * sum_j p_ij (dO_i . v_j - delta_i) k_j` with p recomputed from q, k and the forward's lse, over the
same query-block work list.

Why: the dQ kernel is the forward's shape (a query tile streams the key blocks of its document), so the forward's
warp specialization carries over: a producer warp loads the tile's Q and dO once and K and V of every key block
into a ring, and the two consumer warpgroups (64 query rows each, 240 registers: dQ [64 x 192] fp32 is 96 of them)
only issue products and do the elementwise work. Triton's single partition of 8 warps issues its own loads and
waits for every product before the next.

Per tile: 128 query rows of one head (work-list entry x head, costliest first), one program per tile. Per key block
j and consumer warpgroup: S = Q K_j^T and dP = dO V_j^T (A from shared memory), P = exp2(S scale - lse), masked only
in blocks that cross the causal diagonal or the document's end, dS = P (dP - delta), then dQ += dS K_j with dS in
registers as the A operand; the slot is released once that product is done, then the next block's S and dP are
issued. The query tile is released as soon as its last S and dP are done. A row that sees no key has lse = -inf:
its P is 0 (the lse is read as +inf). Key blocks of 128, the next block's products queued before the wait, and one
program per SM walking the tiles were measured no faster and removed.
"""

from __future__ import annotations

import torch

from moela.ops.attention.kernels.gluon_common import BM, LOG2E, SHARED_BYTES, descs, gluon, head_split, rows_2d
from moela.ops.attention.kernels.worklist import cached_worklist

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

    from moela.ops.attention.kernels.gluon_common import (
        mma_layout,
        operand_layout,
        query_tile,
        rest_width,
        split_smem,
        store_rows,
        tma_load,
    )

BN = 64  # key rows per ring slot
STAGES = 3  # ring slots of K and V


def shared_bytes(d_qk: int, d_v: int) -> int:
    """Shared memory of one program: the query tile's Q and dO, the ring of K and V, the barriers."""
    return 2 * (BM * (d_qk + d_v) + STAGES * BN * (d_qk + d_v)) + 8 * (2 + 2 * STAGES)


def fits(d_qk: int, d_v: int) -> str | None:
    """None when the kernel's shared memory fits an H100/H200 at these head dims, else why not."""
    need = shared_bytes(d_qk, d_v)
    return None if need <= SHARED_BYTES else f"needs {need} bytes of shared memory at {d_qk}/{d_v}, the GPU has " \
                                               f"{SHARED_BYTES}"


if gluon is not None:
    _BM = gl.constexpr(BM)
    _LOG2E = gl.constexpr(LOG2E)

    @gluon.jit
    def _producer(q_desc, qr_desc, do_desc, k_desc, kr_desc, v_desc, q_main, q_rest, do_tile, k_ring, kr_ring,
                  v_ring, q_bar, q_empty, ready, empty, CU_Q, CU_K, ITEMS, n_items, n_heads, NUM_PROGRAMS,
                  D_QK: gl.constexpr, D_MAIN: gl.constexpr, D_V: gl.constexpr, HAS_REST: gl.constexpr,
                  CAUSAL: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
        """One warp: for each of this program's tiles, its Q and dO (once both consumers' last S and dP of the
        previous tile are done), then K and V of every key block into the ring (block count kv over all tiles: slot
        kv % STAGES), each slot refilled once both warpgroups released it."""
        kv = 0
        n_q = 0  # query tiles loaded
        for t in range(gl.program_id(0), n_items * n_heads, NUM_PROGRAMS):
            head, q_start, q_len, k_start, k_len, start_m, q_shift, n_blocks = query_tile(
                t, CU_Q, CU_K, ITEMS, n_items, n_heads, CAUSAL, BN)
            if n_blocks > 0:
                # (a fresh barrier's phase before its first counts as completed: the first wait passes)
                mbarrier.wait(q_empty, (n_q & 1) ^ 1)
                mbarrier.expect(q_bar, _BM * (D_QK + D_V) * 2)
                tma_load(q_desc, [q_start + start_m, head * D_QK], q_bar, q_main)
                if HAS_REST:
                    tma_load(qr_desc, [q_start + start_m, head * D_QK + D_MAIN], q_bar, q_rest)
                tma_load(do_desc, [q_start + start_m, head * D_V], q_bar, do_tile)
                n_q += 1
            for j in range(n_blocks):
                slot = kv % STAGES
                mbarrier.wait(empty.index(slot), ((kv // STAGES) & 1) ^ 1)
                row = k_start + j * BN
                mbarrier.expect(ready.index(slot), BN * (D_QK + D_V) * 2)
                tma_load(k_desc, [row, head * D_QK], ready.index(slot), k_ring.index(slot))
                if HAS_REST:
                    tma_load(kr_desc, [row, head * D_QK + D_MAIN], ready.index(slot), kr_ring.index(slot))
                tma_load(v_desc, [row, head * D_V], ready.index(slot), v_ring.index(slot))
                kv += 1

    @gluon.jit
    def _products(qm, qr, dow, k_ring, kr_ring, v_ring, ready, j, HAS_REST: gl.constexpr, BN: gl.constexpr,
                  STAGES: gl.constexpr):
        """Ring block j's S = Q K^T and dP = dO V^T ([64 rows, BN keys]), issued once its K and V have landed and
        waited for."""
        slot = j % STAGES
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        zeros = gl.zeros([64, BN], gl.float32, mma_layout(BN))
        s = warpgroup_mma(qm, k_ring.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        if HAS_REST:
            s = warpgroup_mma(qr, kr_ring.index(slot).permute((1, 0)), s, is_async=True)
        dp = warpgroup_mma(dow, v_ring.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        s, dp = warpgroup_mma_wait(0, deps=[s, dp])
        return s, dp

    @gluon.jit
    def _tile_dq(qm, qr, dow, k_ring, kr_ring, v_ring, q_empty, ready, empty, dq_main, dq_rest, kv, n_blocks, n_full,
                 lse2, delta, q_pos, k_len, qk_scale, s_layout: gl.constexpr, D_MAIN: gl.constexpr,
                 D_REST: gl.constexpr, HAS_REST: gl.constexpr, CAUSAL: gl.constexpr, BN: gl.constexpr,
                 STAGES: gl.constexpr):
        """dQ of one tile over its key blocks (n_blocks >= 1), ring blocks kv, kv + 1, ...; returns (dq_main, dq_rest,
        kv past the tile). The query tile is released (q_empty) as soon as the last S and dP are done."""
        s, dp = _products(qm, qr, dow, k_ring, kr_ring, v_ring, ready, kv, HAS_REST, BN, STAGES)
        if n_blocks == 1:
            mbarrier.arrive(q_empty, count=1)
        for j in range(n_blocks):
            slot = (kv + j) % STAGES
            p = gl.exp2(s * qk_scale - lse2[:, None])
            if j >= n_full:  # the diagonal or the document's last partial block
                cols = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
                keep = cols[None, :] < k_len
                if CAUSAL:
                    keep = keep & (cols[None, :] <= q_pos[:, None])
                p = gl.where(keep, p, 0.0)
            ds16 = (p * (dp - delta[:, None])).to(gl.bfloat16)
            # dQ += dS K (dS from registers); the products in flight under their own names until the wait
            dqm_f = warpgroup_mma(gl.convert_layout(ds16, operand_layout(D_MAIN)), k_ring.index(slot), dq_main,
                                  is_async=True)
            dqr_f = dq_rest
            if HAS_REST:
                dqr_f = warpgroup_mma(gl.convert_layout(ds16, operand_layout(D_REST)), kr_ring.index(slot), dq_rest,
                                      is_async=True)
            dq_main, dq_rest = warpgroup_mma_wait(0, deps=[dqm_f, dqr_f])
            mbarrier.arrive(empty.index(slot), count=1)
            if j + 1 < n_blocks:
                s, dp = _products(qm, qr, dow, k_ring, kr_ring, v_ring, ready, kv + j + 1, HAS_REST, BN, STAGES)
                if j + 2 == n_blocks:
                    mbarrier.arrive(q_empty, count=1)
        return dq_main, dq_rest, kv + n_blocks

    @gluon.jit
    def _consumer(q_main, q_rest, do_tile, k_ring, kr_ring, v_ring, q_bar, q_empty, ready, empty, LSE, DELTA,
                  stride_lh, DQ, stride_dqt, stride_dqh, CU_Q, CU_K, ITEMS, n_items, n_heads, NUM_PROGRAMS, qk_scale,
                  sm_scale, D_QK: gl.constexpr, D_MAIN: gl.constexpr, HAS_REST: gl.constexpr, CAUSAL: gl.constexpr,
                  BN: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr):
        """Consumer warpgroup WG: query rows [64 WG, 64 WG + 64) of each tile; dQ in registers, stored at its end.
        Counters kv (key blocks) and n_q (query tiles) follow the producer's."""
        D_REST: gl.constexpr = rest_width(D_QK, D_MAIN)
        s_layout: gl.constexpr = mma_layout(BN)
        qm_layout: gl.constexpr = mma_layout(D_MAIN)
        qr_layout: gl.constexpr = mma_layout(D_REST)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        qm = q_main.slice(WG * 64, 64)
        qr = q_rest.slice(WG * 64, 64)
        dow = do_tile.slice(WG * 64, 64)
        kv = 0
        n_q = 0
        for t in range(gl.program_id(0), n_items * n_heads, NUM_PROGRAMS):
            head, q_start, q_len, k_start, k_len, start_m, q_shift, n_blocks = query_tile(
                t, CU_Q, CU_K, ITEMS, n_items, n_heads, CAUSAL, BN)
            row0 = start_m + WG * 64
            rows = row0 + gl.arange(0, 64, layout=row_s)
            q_pos = rows + q_shift  # the rows' positions on the key side
            if CAUSAL:  # key blocks every row of this warpgroup sees whole: no mask
                n_full = gl.maximum(gl.minimum(k_len, row0 + q_shift + 1), 0) // BN
            else:
                n_full = k_len // BN
            dq_main = gl.zeros([64, D_MAIN], gl.float32, qm_layout)
            dq_rest = gl.zeros([64, D_REST], gl.float32, qr_layout)
            if n_blocks > 0:
                lse = gl.load(LSE + head * stride_lh + q_start + rows, mask=rows < q_len, other=0.0)
                lse2 = gl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)  # a row that sees no key: p = 0
                delta = gl.load(DELTA + head * stride_lh + q_start + rows, mask=rows < q_len, other=0.0)
                mbarrier.wait(q_bar, n_q & 1)
                dq_main, dq_rest, kv = _tile_dq(qm, qr, dow, k_ring, kr_ring, v_ring, q_empty, ready, empty, dq_main,
                                                dq_rest, kv, n_blocks, n_full, lse2, delta, q_pos, k_len, qk_scale,
                                                s_layout, D_MAIN, D_REST, HAS_REST, CAUSAL, BN, STAGES)
                n_q += 1
            # dq = scale * sum dS K; rows past the document are not stored
            store_rows(DQ + head * stride_dqh, q_start, row0, q_len, stride_dqt,
                        (dq_main * sm_scale).to(gl.bfloat16), qm_layout, D_MAIN)
            if HAS_REST:
                store_rows(DQ + head * stride_dqh + D_MAIN, q_start, row0, q_len, stride_dqt,
                            (dq_rest * sm_scale).to(gl.bfloat16), qr_layout, D_REST)

    @gluon.jit
    def _dq_kernel(
        q_desc, qr_desc,  # q [Tq, H * Dqk] in [BM, D_MAIN] and [BM, Dqk - D_MAIN] boxes
        do_desc,  # dO [Tq, H * Dv] in [BM, Dv] boxes
        k_desc, kr_desc,  # k [Tk, H * Dqk] in [BN, D_MAIN] and [BN, Dqk - D_MAIN] boxes
        v_desc,  # v [Tk, H * Dv] in [BN, Dv] boxes
        LSE,  # [H, Tq] fp32, the forward's (natural log)
        DELTA,  # [H, Tq] fp32, rowsum(dO * O) - dlse
        stride_lh,  # head stride of LSE and DELTA
        DQ, stride_dqt, stride_dqh,  # [Tq, H, Dqk] bf16, written
        CU_Q,  # [N + 1] int32, document starts on the q side
        CU_K,  # [N + 1] int32, document starts on the k side
        ITEMS, n_items, n_heads,  # the work list [2, n_items] int32 of query blocks, and H
        NUM_PROGRAMS,  # programs launched: one per tile
        qk_scale,  # softmax scale * log2(e)
        sm_scale,  # softmax scale
        D_QK: gl.constexpr, D_MAIN: gl.constexpr, D_V: gl.constexpr,
        CAUSAL: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
    ):
        """Program p computes tiles p, p + NUM_PROGRAMS, ... of the n_items x H tiles (work-list query block, head):
        dq of 128 query rows each. qr_desc / kr_desc are read only when Dqk > D_MAIN."""
        HAS_REST: gl.constexpr = D_QK > D_MAIN
        q_main, q_rest, k_ring, kr_ring = split_smem(q_desc, qr_desc, k_desc, kr_desc, _BM, STAGES, BN, D_QK, D_MAIN)
        do_tile = gl.allocate_shared_memory(gl.bfloat16, [_BM, D_V], do_desc.layout)
        v_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, D_V], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(q_empty, count=2)  # one arrival per consumer warpgroup
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        # (the partitions' arguments as literal tuples: a tuple held in a variable turns constexprs into tensors)
        gl.warp_specialize([
            (_consumer, (q_main, q_rest, do_tile, k_ring, kr_ring, v_ring, q_bar, q_empty, ready, empty, LSE, DELTA,
                         stride_lh, DQ, stride_dqt, stride_dqh, CU_Q, CU_K, ITEMS, n_items, n_heads, NUM_PROGRAMS,
                         qk_scale, sm_scale, D_QK, D_MAIN, HAS_REST, CAUSAL, BN, STAGES, 0)),
            (_consumer, (q_main, q_rest, do_tile, k_ring, kr_ring, v_ring, q_bar, q_empty, ready, empty, LSE, DELTA,
                         stride_lh, DQ, stride_dqt, stride_dqh, CU_Q, CU_K, ITEMS, n_items, n_heads, NUM_PROGRAMS,
                         qk_scale, sm_scale, D_QK, D_MAIN, HAS_REST, CAUSAL, BN, STAGES, 1)),
            (_producer, (q_desc, qr_desc, do_desc, k_desc, kr_desc, v_desc, q_main, q_rest, do_tile, k_ring, kr_ring,
                         v_ring, q_bar, q_empty, ready, empty, CU_Q, CU_K, ITEMS, n_items, n_heads, NUM_PROGRAMS, D_QK,
                         D_MAIN, D_V, HAS_REST, CAUSAL, BN, STAGES)),
        ], [4, 1], [240, 24])


def gluon_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
             delta: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, dq: torch.Tensor, *,
             causal: bool, softmax_scale: float, alibi_slopes: torch.Tensor | None = None) -> None:
    """Fills dq [Tq, H, Dqk] (bf16) as triton_backward's dQ kernel does, from delta [H, Tq] (rowsum(dO * O) - dlse)
    and the forward's lse [H, Tq]; the caller checked `supports` (so no ALiBi) and `fits`."""
    tq, h, d_qk = q.shape
    d_v = v.shape[-1]
    if k.shape[0] == 0:  # no keys: no query sees one
        dq.zero_()
        return
    items = cached_worklist(cu_seqlens_q, cu_seqlens_k, tq, BM, key_blocks=False, causal=causal)
    q2, k2, v2, do2 = rows_2d(q), rows_2d(k), rows_2d(v), rows_2d(dout)
    (q_desc, qr_desc), (k_desc, kr_desc) = descs(q2, BM, d_qk), descs(k2, BN, d_qk)
    do_desc, v_desc = descs(do2, BM, d_v, split=False), descs(v2, BN, d_v, split=False)
    n_items = items.shape[1]
    programs = n_items * h
    _dq_kernel[(programs, )](
        q_desc, qr_desc,
        do_desc,
        k_desc, kr_desc,
        v_desc,
        lse,
        delta,
        lse.stride(0),
        dq, dq.stride(0), dq.stride(1),
        cu_seqlens_q,
        cu_seqlens_k,
        items, n_items, h,
        programs,
        softmax_scale * LOG2E,
        softmax_scale,
        D_QK=d_qk, D_MAIN=head_split(d_qk)[0], D_V=d_v, CAUSAL=causal, BN=BN, STAGES=STAGES, num_warps=4)
