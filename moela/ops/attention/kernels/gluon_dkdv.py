"""The dK/dV kernel of the attention backward for Hopper (sm_90) in Gluon, warp-specialized on the forward's
scaffolding (gluon_common.py); the `gluon` kernel of the dK/dV phase (moela.ops.attention.phases). It computes what
triton_backward.py's dK/dV kernel computes, from the same inputs (q, k, v, dO, the forward's lse, the preprocess's
delta) over the same key-block work list.

Why: the Triton dK/dV kernel (32 x 128 tiles, 8 warps) keeps dK and dV in fp32 registers in one partition that also
issues the loads, stages lse and delta, and waits for every product before the next step. Here a producer warp does
the loads and the two MMA warpgroups get 240 registers each (setmaxnreg), each holding its 64 keys' dK and dV.

Per program: a key block of 128 keys of one head, keys [64 g, 64 g + 64) on consumer warpgroup g. The producer warp
loads the block's K and V once, then Q and dO of every query step of 64 rows into a ring of 3. Each consumer
warpgroup, per step: S^T = K Q^T and dP^T = V dO^T ([64 keys, 64 queries], A from shared memory),
P^T = exp2(S^T scale - lse) masked, dS^T = P^T (dP^T - delta), then dV += P^T dO and dK += dS^T Q with P^T / dS^T
in registers as the A operand; the step's ring slot is released when those products are done, then the next
step's S^T and dP^T are issued. Query rows past the document (the last step's), keys past it and pairs above the
causal diagonal are masked; rows that see no key have lse = -inf and every pair masked.

Register budget: at 96/64 dK and dV take 80 of a consumer's 240 registers and nothing spills; at 192/128 they take
160, and the scores, the bf16 operands and the row statistics push it to spill (tests/sm90_compile.py reports the
bytes), which makes it slower than the Triton kernel there. So `auto` takes it only where Dqk + Dv <= 160
(`auto_problem`); named, it runs every call `supports` takes. Steps of 32 rows and the next step's products queued
before the wait were measured slower and removed.
"""

from __future__ import annotations

import torch

from moela.ops.attention.kernels.gluon_common import LOG2E, SHARED_BYTES, descs, gluon, head_split, rows_2d
from moela.ops.attention.kernels.worklist import cached_worklist

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

    from moela.ops.attention.kernels.gluon_common import (
        document,
        mma_layout,
        operand_layout,
        rest_width,
        split_smem,
        store_rows,
        tma_load,
    )

BN = 128  # keys per program: two consumer warpgroups of 64
STEP_ROWS = 64  # query rows per step
STAGES = 3  # ring slots of Q and dO
AUTO_MAX_HEAD_DIMS = 160  # Dqk + Dv up to which `auto` runs this kernel (its dK and dV fit the registers)


def auto_problem(d_qk: int, d_v: int) -> str | None:
    """None where `auto` takes this kernel at these head dims, else why not."""
    if d_qk + d_v > AUTO_MAX_HEAD_DIMS:
        return (f"head dims {d_qk}/{d_v}: its dK and dV take {(d_qk + d_v) // 2} of a consumer's 240 registers, "
                f"and the Triton kernel measured faster there")
    return None


def shared_bytes(d_qk: int, d_v: int) -> int:
    """Shared memory of one program: the key block's K and V, the ring of Q and dO, the barriers."""
    return 2 * (BN * (d_qk + d_v) + STAGES * STEP_ROWS * (d_qk + d_v)) + 8 * (1 + 2 * STAGES)


def fits(d_qk: int, d_v: int) -> str | None:
    """None when the kernel's shared memory fits an H100/H200 at these head dims, else why not."""
    need = shared_bytes(d_qk, d_v)
    return None if need <= SHARED_BYTES else f"needs {need} bytes of shared memory at {d_qk}/{d_v}, the GPU has " \
                                               f"{SHARED_BYTES}"


if gluon is not None:
    _BN = gl.constexpr(BN)
    STAGES_C = gl.constexpr(STAGES)
    _LOG2E = gl.constexpr(LOG2E)

    @gluon.jit
    def _key_tile(t, CU_Q, CU_K, ITEMS, n_items, n_heads, CAUSAL: gl.constexpr, BM: gl.constexpr):
        """Tile t's head, document span and query steps: (head, q_start, q_len, k_start, k_len, start_n, q_shift,
        first query row, number of query steps). Unused entries (document -1) get no steps."""
        head, item, valid, q_start, q_len, k_start, k_len = document(t, CU_Q, CU_K, ITEMS, n_heads)
        k_len = gl.where(valid, k_len, 0)
        start_n = gl.load(ITEMS + n_items + item) * _BN
        q_shift = k_len - q_len
        if CAUSAL:  # query i sees key j when j <= i + q_shift: the block's first key is seen from i = start_n - q_shift
            lo = gl.maximum(start_n - q_shift, 0) // BM * BM
        else:
            lo = 0
        n_steps = gl.where(valid & (start_n < k_len), gl.cdiv(gl.maximum(q_len - lo, 0), BM), 0)
        return head, q_start, q_len, k_start, k_len, start_n, q_shift, lo, n_steps

    @gluon.jit
    def _producer(q_desc, qr_desc, k_desc, kr_desc, v_desc, do_desc, k_main, k_rest, v_tile, q_ring, qr_ring, do_ring,
                  kv_bar, ready, empty, CU_Q, CU_K, ITEMS, n_items, n_heads, D_QK: gl.constexpr,
                  D_MAIN: gl.constexpr, D_V: gl.constexpr, HAS_REST: gl.constexpr, CAUSAL: gl.constexpr,
                  BM: gl.constexpr):
        """One warp: the key block's K and V once, then Q and dO of each query step into the ring."""
        head, q_start, q_len, k_start, k_len, start_n, q_shift, lo, n_steps = _key_tile(
            gl.program_id(0), CU_Q, CU_K, ITEMS, n_items, n_heads, CAUSAL, BM)
        if n_steps > 0:
            mbarrier.expect(kv_bar, _BN * (D_QK + D_V) * 2)
            tma_load(k_desc, [k_start + start_n, head * D_QK], kv_bar, k_main)
            if HAS_REST:
                tma_load(kr_desc, [k_start + start_n, head * D_QK + D_MAIN], kv_bar, k_rest)
            tma_load(v_desc, [k_start + start_n, head * D_V], kv_bar, v_tile)
        for i in range(n_steps):
            slot = i % STAGES_C
            mbarrier.wait(empty.index(slot), ((i // STAGES_C) & 1) ^ 1)
            row = q_start + lo + i * BM
            mbarrier.expect(ready.index(slot), BM * (D_QK + D_V) * 2)
            tma_load(q_desc, [row, head * D_QK], ready.index(slot), q_ring.index(slot))
            if HAS_REST:
                tma_load(qr_desc, [row, head * D_QK + D_MAIN], ready.index(slot), qr_ring.index(slot))
            tma_load(do_desc, [row, head * D_V], ready.index(slot), do_ring.index(slot))

    @gluon.jit
    def _scores_step(km, kr, vw, q_ring, qr_ring, do_ring, ready, i, HAS_REST: gl.constexpr, BM: gl.constexpr):
        """Step i's S^T = K Q^T and dP^T = V dO^T ([64 keys, BM queries]), issued once its Q and dO have landed and
        waited for."""
        slot = i % STAGES_C
        mbarrier.wait(ready.index(slot), (i // STAGES_C) & 1)
        zeros = gl.zeros([64, BM], gl.float32, mma_layout(BM))  # (made here: not a tensor held across the loop)
        st = warpgroup_mma(km, q_ring.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        if HAS_REST:
            st = warpgroup_mma(kr, qr_ring.index(slot).permute((1, 0)), st, is_async=True)
        dpt = warpgroup_mma(vw, do_ring.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        st, dpt = warpgroup_mma_wait(0, deps=[st, dpt])
        return st, dpt

    @gluon.jit
    def _row_stats(LSE, DELTA, offset, row0, q_len, BM: gl.constexpr, layout: gl.constexpr):
        """lse (base 2) and delta of query rows [row0, row0 + BM) (0 past the document: those rows are masked)."""
        rows = row0 + gl.arange(0, BM, layout=layout)
        lse2 = gl.load(LSE + offset + rows, mask=rows < q_len, other=0.0) * _LOG2E
        delta = gl.load(DELTA + offset + rows, mask=rows < q_len, other=0.0)
        return lse2, delta

    @gluon.jit
    def _consumer(k_main, k_rest, v_tile, q_ring, qr_ring, do_ring, kv_bar, ready, empty, LSE, DELTA, stride_lh,
                  DK, stride_dkt, stride_dkh, DV, stride_dvt, stride_dvh, CU_Q, CU_K, ITEMS, n_items, n_heads,
                  qk_scale, sm_scale, D_QK: gl.constexpr, D_MAIN: gl.constexpr, D_V: gl.constexpr,
                  HAS_REST: gl.constexpr, CAUSAL: gl.constexpr, BM: gl.constexpr, WG: gl.constexpr):
        """Consumer warpgroup WG: keys [64 WG, 64 WG + 64) of the block; dK and dV in registers, stored at the end."""
        D_REST: gl.constexpr = rest_width(D_QK, D_MAIN)
        s_layout: gl.constexpr = mma_layout(BM)
        km_layout: gl.constexpr = mma_layout(D_MAIN)
        kr_layout: gl.constexpr = mma_layout(D_REST)
        v_layout: gl.constexpr = mma_layout(D_V)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # per query (the columns of S^T)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)  # per key
        head, q_start, q_len, k_start, k_len, start_n, q_shift, lo, n_steps = _key_tile(
            gl.program_id(0), CU_Q, CU_K, ITEMS, n_items, n_heads, CAUSAL, BM)
        key0 = start_n + WG * 64
        keys = key0 + gl.arange(0, 64, layout=row_s)
        dk_main = gl.zeros([64, D_MAIN], gl.float32, km_layout)
        dk_rest = gl.zeros([64, D_REST], gl.float32, kr_layout)
        dv = gl.zeros([64, D_V], gl.float32, v_layout)
        if n_steps > 0:
            mbarrier.wait(kv_bar, 0)
            km = k_main.slice(WG * 64, 64)
            kr = k_rest.slice(WG * 64, 64)
            vw = v_tile.slice(WG * 64, 64)
            st, dpt = _scores_step(km, kr, vw, q_ring, qr_ring, do_ring, ready, 0, HAS_REST, BM)
            lse2, delta = _row_stats(LSE, DELTA, head * stride_lh + q_start, lo, q_len, BM, col_s)
            for i in range(n_steps):
                slot = i % STAGES_C
                row0 = lo + i * BM  # the step's first query row (document coordinates)
                # the next step's lse and delta, loaded now so their latency hides under this step
                lse2_next, delta_next = _row_stats(LSE, DELTA, head * stride_lh + q_start, row0 + BM, q_len, BM, col_s)
                pt = gl.exp2(st * qk_scale - lse2[None, :])
                rows = row0 + gl.arange(0, BM, layout=col_s)
                keep = (rows[None, :] < q_len) & (keys[:, None] < k_len)
                if CAUSAL:
                    keep = keep & (keys[:, None] <= rows[None, :] + q_shift)
                pt = gl.where(keep, pt, 0.0)
                dst = pt * (dpt - delta[None, :])
                lse2 = lse2_next
                delta = delta_next
                pt16 = pt.to(gl.bfloat16)
                ds16 = dst.to(gl.bfloat16)
                # dV += P^T dO, dK += dS^T Q (A operands from registers; the products in flight under their own
                # names until the wait), then the next step's scores
                dv_f = warpgroup_mma(gl.convert_layout(pt16, operand_layout(D_V)), do_ring.index(slot), dv,
                                     is_async=True)
                dkm_f = warpgroup_mma(gl.convert_layout(ds16, operand_layout(D_MAIN)), q_ring.index(slot), dk_main,
                                      is_async=True)
                dkr_f = dk_rest
                if HAS_REST:
                    dkr_f = warpgroup_mma(gl.convert_layout(ds16, operand_layout(D_REST)), qr_ring.index(slot),
                                          dk_rest, is_async=True)
                dv, dk_main, dk_rest = warpgroup_mma_wait(0, deps=[dv_f, dkm_f, dkr_f])
                mbarrier.arrive(empty.index(slot), count=1)  # this step's Q and dO are read
                if i + 1 < n_steps:
                    st, dpt = _scores_step(km, kr, vw, q_ring, qr_ring, do_ring, ready, i + 1, HAS_REST, BM)
        # dK = scale * sum dS^T Q; keys past the document are not stored
        store_rows(DK + head * stride_dkh, k_start, key0, k_len, stride_dkt, (dk_main * sm_scale).to(gl.bfloat16),
                    km_layout, D_MAIN)
        if HAS_REST:
            store_rows(DK + head * stride_dkh + D_MAIN, k_start, key0, k_len, stride_dkt,
                        (dk_rest * sm_scale).to(gl.bfloat16), kr_layout, D_REST)
        store_rows(DV + head * stride_dvh, k_start, key0, k_len, stride_dvt, dv.to(gl.bfloat16), v_layout, D_V)

    @gluon.jit
    def _dkdv_kernel(
        q_desc, qr_desc,  # q [Tq, H * Dqk] in [BM, D_MAIN] and [BM, Dqk - D_MAIN] boxes
        k_desc, kr_desc,  # k [Tk, H * Dqk] in [128, D_MAIN] and [128, Dqk - D_MAIN] boxes
        v_desc,  # v [Tk, H * Dv] in [128, Dv] boxes
        do_desc,  # dO [Tq, H * Dv] in [BM, Dv] boxes
        LSE,  # [H, Tq] fp32, the forward's (natural log)
        DELTA,  # [H, Tq] fp32, rowsum(dO * O) - dlse
        stride_lh,  # head stride of LSE and DELTA
        DK, stride_dkt, stride_dkh,  # [Tk, H, Dqk] bf16, written
        DV, stride_dvt, stride_dvh,  # [Tk, H, Dv] bf16, written
        CU_Q,  # [N + 1] int32, document starts on the q side
        CU_K,  # [N + 1] int32, document starts on the k side
        ITEMS, n_items, n_heads,  # the work list [2, n_items] int32 of key blocks, and H
        qk_scale,  # softmax scale * log2(e)
        sm_scale,  # softmax scale
        D_QK: gl.constexpr, D_MAIN: gl.constexpr, D_V: gl.constexpr,
        CAUSAL: gl.constexpr, BM: gl.constexpr,
    ):
        """One program per (key-block work-list entry, head): dK and dV of 128 keys, over query steps of BM rows.
        qr_desc / kr_desc are read only when Dqk > D_MAIN."""
        HAS_REST: gl.constexpr = D_QK > D_MAIN
        k_main, k_rest, q_ring, qr_ring = split_smem(k_desc, kr_desc, q_desc, qr_desc, _BN, STAGES_C, BM, D_QK,
                                                      D_MAIN)
        v_tile = gl.allocate_shared_memory(gl.bfloat16, [_BN, D_V], v_desc.layout)
        do_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES_C, BM, D_V], do_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES_C, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES_C, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES_C):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        gl.warp_specialize([
            (_consumer, (k_main, k_rest, v_tile, q_ring, qr_ring, do_ring, kv_bar, ready, empty, LSE, DELTA, stride_lh,
                         DK, stride_dkt, stride_dkh, DV, stride_dvt, stride_dvh, CU_Q, CU_K, ITEMS, n_items, n_heads,
                         qk_scale, sm_scale, D_QK, D_MAIN, D_V, HAS_REST, CAUSAL, BM, 0)),
            (_consumer, (k_main, k_rest, v_tile, q_ring, qr_ring, do_ring, kv_bar, ready, empty, LSE, DELTA, stride_lh,
                         DK, stride_dkt, stride_dkh, DV, stride_dvt, stride_dvh, CU_Q, CU_K, ITEMS, n_items, n_heads,
                         qk_scale, sm_scale, D_QK, D_MAIN, D_V, HAS_REST, CAUSAL, BM, 1)),
            (_producer, (q_desc, qr_desc, k_desc, kr_desc, v_desc, do_desc, k_main, k_rest, v_tile, q_ring, qr_ring,
                         do_ring, kv_bar, ready, empty, CU_Q, CU_K, ITEMS, n_items, n_heads, D_QK, D_MAIN, D_V,
                         HAS_REST, CAUSAL, BM)),
        ], [4, 1], [240, 24])


def gluon_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
               delta: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, dk: torch.Tensor,
               dv: torch.Tensor, *, causal: bool, softmax_scale: float, alibi_slopes: torch.Tensor | None = None
               ) -> None:
    """Fills dk [Tk, H, Dqk] and dv [Tk, H, Dv] (bf16, zeroed by the caller) as triton_backward's dK/dV kernel does,
    from delta [H, Tq] (rowsum(dO * O) - dlse) and the forward's lse [H, Tq]; the caller checked `supports` (so no
    ALiBi) and `fits`."""
    h, d_qk, d_v = q.shape[1], q.shape[2], v.shape[2]
    if k.shape[0] == 0 or q.shape[0] == 0:  # no keys, or no query sees them: dk and dv stay zero
        return
    items = cached_worklist(cu_seqlens_q, cu_seqlens_k, k.shape[0], BN, key_blocks=True, causal=causal)
    q2, k2, v2, do2 = rows_2d(q), rows_2d(k), rows_2d(v), rows_2d(dout)
    (q_desc, qr_desc), (k_desc, kr_desc) = descs(q2, STEP_ROWS, d_qk), descs(k2, BN, d_qk)
    v_desc, do_desc = descs(v2, BN, d_v, split=False), descs(do2, STEP_ROWS, d_v, split=False)
    n_items = items.shape[1]
    _dkdv_kernel[(n_items * h, )](
        q_desc, qr_desc,
        k_desc, kr_desc,
        v_desc,
        do_desc,
        lse,
        delta,
        lse.stride(0),
        dk, dk.stride(0), dk.stride(1),
        dv, dv.stride(0), dv.stride(1),
        cu_seqlens_q,
        cu_seqlens_k,
        items, n_items, h,
        softmax_scale * LOG2E,
        softmax_scale,
        D_QK=d_qk, D_MAIN=head_split(d_qk)[0], D_V=d_v, CAUSAL=causal, BM=STEP_ROWS, num_warps=4)
