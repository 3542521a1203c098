"""Forward kernel of the flash attention for Hopper (sm_90) in Gluon, warp-specialized on FA3's design: the same
arguments, work list and results (out, natural-log lse) as triton_forward.py's kernel; the `gluon` kernel of the
forward phase (moela.ops.attention.phases), which `auto` takes for every call it supports. The backward reads its
out and lse unchanged.

Why not Triton: Triton places the tensor cores' waits itself. A product that other operations read is waited for
at once, and a wait takes every product in flight, so the softmax of one key block cannot run under the tensor
cores' P V of the block before, and the loads share the warps that compute (three attempts inside Triton were each
slower). Gluon states the waits (`warpgroup_mma_wait(num_outstanding=...)`) and the partitions (`warp_specialize`),
so the kernel is organized as FA3's sm90 forward:

- producer (one warp): for each of the program's tiles, the 128 query rows (once both consumers' last scores of the
  previous tile are done), then for every key block K and V into a ring slot by TMA, each with its own barrier (the
  scores can start when K has landed), after both consumer warpgroups released the slot.
- two consumer warpgroups (the default partition and a worker, 240 registers each): warpgroup g owns query rows
  [64 g, 64 g + 64). Per key block j it issues S_j = Q K_j^T (asynchronous wgmmas, Dqk's two parts each a TMA box
  and a wgmma), then O += P_{j-1} V_{j-1} with P in registers, waits for S_j only (O's product stays in flight),
  runs the online softmax of S_j under it, then waits for O, releases slot j - 1 and rescales O. The two
  warpgroups' products interleave on the tensor cores.

Launch: key blocks of 64 in a ring of 4, one program per SM walking the tiles (work-list entry, head) costliest
first, so the next tile's loads run under this tile's end. Measured against the alternatives (128-row key blocks,
one program per tile, ping-pong turns between the warpgroups, two products in flight under the softmax), this is
the fastest on packed batches and within a few percent at equal lengths.

Masks: the blocks every row of a warpgroup sees whole (inside the document, below the causal diagonal) run without
the mask; the rest (the diagonal, the document's last partial block) apply it. Rows past the document's end
compute garbage that is never stored; keys past it (or past the tensor, which TMA fills with zeros) are masked.
"""

from __future__ import annotations

import torch

from moela.ops.attention.kernels.gluon_common import BM, LOG2E, descs, gluon, head_split, rows_2d
from moela.ops.attention.kernels.worklist import cached_worklist

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

    from moela.ops.attention.kernels.gluon_common import (
        _BM,
        mma_layout,
        operand_layout,
        query_tile,
        split_smem,
        tma_load,
    )

BN = 64  # key rows per ring slot
STAGES = 4  # ring slots of K and V
CONSUMER_REGS = 240
PRODUCER_REGS = 24
NUM_WARPS = 4  # the default partition: consumer warpgroup 0


if gluon is not None:
    _LN2 = gl.constexpr(0.6931471805599453)
    _CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)

    @gluon.jit
    def _producer(q_desc, qr_desc, k_desc, kr_desc, v_desc, q_main, q_rest, k_ring, kr_ring, v_ring, q_bar, q_empty,
                  k_ready, v_ready, empty, CU_Q, CU_K, ITEMS, n_items, n_heads, NUM_PROGRAMS, D_QK: gl.constexpr,
                  D_MAIN: gl.constexpr, D_V: gl.constexpr, HAS_REST: gl.constexpr, CAUSAL: gl.constexpr,
                  BN: gl.constexpr, STAGES: gl.constexpr):
        """One warp: for each of this program's tiles, the query tile (once both consumer warpgroups have read the
        previous one: their last scores done), then K and V of every key block into the ring (block count kv over
        all tiles: slot kv % STAGES), each slot refilled once both warpgroups released it. The next tile's loads
        thus run under this tile's last P V and store."""
        kv = 0
        n_q = 0  # query tiles loaded
        for t in range(gl.program_id(0), n_items * n_heads, NUM_PROGRAMS):
            head, q_start, q_len, k_start, k_len, start_m, q_shift, n_blocks = query_tile(t, CU_Q, CU_K, ITEMS, n_items,
                                                                                     n_heads, CAUSAL, BN)
            if n_blocks > 0:
                # (a fresh barrier's phase before its first counts as completed: the first wait passes)
                mbarrier.wait(q_empty, (n_q & 1) ^ 1)
                mbarrier.expect(q_bar, _BM * D_QK * 2)
                tma_load(q_desc, [q_start + start_m, head * D_QK], q_bar, q_main)
                if HAS_REST:
                    tma_load(qr_desc, [q_start + start_m, head * D_QK + D_MAIN], q_bar, q_rest)
                n_q += 1
            for j in range(n_blocks):
                slot = kv % STAGES
                mbarrier.wait(empty.index(slot), ((kv // STAGES) & 1) ^ 1)
                row = k_start + j * BN
                mbarrier.expect(k_ready.index(slot), BN * D_QK * 2)
                tma_load(k_desc, [row, head * D_QK], k_ready.index(slot), k_ring.index(slot))
                if HAS_REST:
                    tma_load(kr_desc, [row, head * D_QK + D_MAIN], k_ready.index(slot), kr_ring.index(slot))
                mbarrier.expect(v_ready.index(slot), BN * D_V * 2)
                tma_load(v_desc, [row, head * D_V], v_ready.index(slot), v_ring.index(slot))
                kv += 1

    @gluon.jit
    def _issue_scores(q_main, q_rest, k_ring, kr_ring, slot, zeros, HAS_REST: gl.constexpr):
        """S = Q K^T of the key block in `slot`, issued asynchronously (one or two wgmma groups)."""
        s = warpgroup_mma(q_main, k_ring.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        if HAS_REST:
            s = warpgroup_mma(q_rest, kr_ring.index(slot).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _softmax(s, m_i, l_i, start_n, masked, q_pos, k_len, qk_scale, CAUSAL: gl.constexpr,
                 s_layout: gl.constexpr, BN: gl.constexpr):
        """Online softmax step over raw scores s [64, BN] of the keys from start_n: (P fp32, new row maxima in
        scaled log2 units, new row sums, the factor alpha that rescales what was accumulated). `masked`: this block
        needs the causal / length mask."""
        if masked:
            cols = start_n + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            keep = cols[None, :] < k_len
            if CAUSAL:
                keep = keep & (cols[None, :] <= q_pos[:, None])
            s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _tile_blocks(qm, qr, k_ring, kr_ring, v_ring, q_empty, k_ready, v_ready, empty, acc, m_i, l_i, kv, n_blocks,
                     n_full, q_pos, k_len, qk_scale, p_layout: gl.constexpr, row_o: gl.constexpr,
                     s_layout: gl.constexpr, zeros, HAS_REST: gl.constexpr, CAUSAL: gl.constexpr, BN: gl.constexpr,
                     STAGES: gl.constexpr):
        """The key blocks of one tile (n_blocks >= 1), FA3's intra-warpgroup overlap: per block j the scores S_j
        and P_{j-1} V_{j-1} are issued together, the wait takes S_j alone, and the softmax of S_j runs under P V.
        Returns (acc, m_i, l_i, kv) with kv past the tile's blocks."""
        slot = kv % STAGES
        mbarrier.wait(k_ready.index(slot), (kv // STAGES) & 1)
        s = _issue_scores(qm, qr, k_ring, kr_ring, slot, zeros, HAS_REST)
        s = warpgroup_mma_wait(0, deps=[s])
        if n_blocks == 1:  # the tile's last scores: the query tile may be refilled
            mbarrier.arrive(q_empty, count=1)
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, 0, n_full == 0, q_pos, k_len, qk_scale, CAUSAL, s_layout, BN)
        p = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        for j in range(1, n_blocks):
            prev = kv % STAGES
            kv += 1
            slot = kv % STAGES
            mbarrier.wait(k_ready.index(slot), (kv // STAGES) & 1)
            mbarrier.wait(v_ready.index(prev), ((kv - 1) // STAGES) & 1)
            s = _issue_scores(qm, qr, k_ring, kr_ring, slot, zeros, HAS_REST)
            acc = warpgroup_mma(p, v_ring.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s])  # the scores; P V stays in flight
            if j == n_blocks - 1:
                mbarrier.arrive(q_empty, count=1)
            p_next, m_i, l_i, alpha = _softmax(s, m_i, l_i, j * BN, j >= n_full, q_pos, k_len, qk_scale, CAUSAL,
                                               s_layout, BN)
            p_next = gl.convert_layout(p_next.to(gl.bfloat16), p_layout)
            # O complete under the old maxima (P_{j-1} stays alive until here); release the slot, rescale
            acc, p = warpgroup_mma_wait(0, deps=[acc, p])
            mbarrier.arrive(empty.index(prev), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p = p_next
        last = kv % STAGES
        mbarrier.wait(v_ready.index(last), (kv // STAGES) & 1)
        acc = warpgroup_mma(p, v_ring.index(last), acc, is_async=True)
        acc, p = warpgroup_mma_wait(0, deps=[acc, p])
        mbarrier.arrive(empty.index(last), count=1)
        return acc, m_i, l_i, kv + 1

    @gluon.jit
    def _consumer(q_main, q_rest, k_ring, kr_ring, v_ring, q_bar, q_empty, k_ready, v_ready, empty, Out, stride_ot,
                  stride_oh, LSE, stride_lh, CU_Q, CU_K, ITEMS, n_items, n_heads, NUM_PROGRAMS, qk_scale,
                  D_V: gl.constexpr, HAS_REST: gl.constexpr, CAUSAL: gl.constexpr, BN: gl.constexpr,
                  STAGES: gl.constexpr, WG: gl.constexpr):
        """Consumer warpgroup WG: query rows [64 WG, 64 WG + 64) of each tile; scores, softmax and P V
        (_tile_blocks), the store. Counters kv (key blocks) and n_q (query tiles) follow the producer's."""
        s_layout: gl.constexpr = mma_layout(BN)
        o_layout: gl.constexpr = mma_layout(D_V)
        p_layout: gl.constexpr = operand_layout(D_V)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        zeros = gl.zeros([64, BN], gl.float32, s_layout)
        qm = q_main.slice(WG * 64, 64)
        qr = q_rest.slice(WG * 64, 64)
        kv = 0
        n_q = 0
        for t in range(gl.program_id(0), n_items * n_heads, NUM_PROGRAMS):
            head, q_start, q_len, k_start, k_len, start_m, q_shift, n_blocks = query_tile(t, CU_Q, CU_K, ITEMS, n_items,
                                                                                     n_heads, CAUSAL, BN)
            row0 = start_m + WG * 64
            q_pos = row0 + gl.arange(0, 64, layout=row_s) + q_shift  # the rows' positions on the key side
            # key blocks every row of this warpgroup sees whole: no mask
            if CAUSAL:
                n_full = gl.maximum(gl.minimum(k_len, row0 + q_shift + 1), 0) // BN
            else:
                n_full = k_len // BN
            acc = gl.zeros([64, D_V], gl.float32, o_layout)
            m_i = gl.full([64], -1.0e38, gl.float32, row_s)  # finite: a fully masked row keeps exp2(-inf - m) = 0
            l_i = gl.zeros([64], gl.float32, row_s)
            if n_blocks > 0:
                mbarrier.wait(q_bar, n_q & 1)
                acc, m_i, l_i, kv = _tile_blocks(qm, qr, k_ring, kr_ring, v_ring, q_empty, k_ready, v_ready, empty,
                                                 acc, m_i, l_i, kv, n_blocks, n_full, q_pos, k_len, qk_scale,
                                                 p_layout, row_o, s_layout, zeros, HAS_REST, CAUSAL, BN, STAGES)
                n_q += 1
            # normalize; lse in natural log, -inf for a row that sees no key
            empty_row = l_i == 0.0
            l_safe = gl.where(empty_row, 1.0, l_i)
            out = acc / gl.convert_layout(l_safe, row_o)[:, None]
            lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(l_safe)) * _LN2)
            rows_o = row0 + gl.arange(0, 64, layout=row_o)
            cols_o = gl.arange(0, D_V, layout=gl.SliceLayout(0, o_layout))
            ptrs = Out + (q_start + rows_o)[:, None].to(gl.int64) * stride_ot + head * stride_oh + cols_o[None, :]
            gl.store(ptrs, out.to(gl.bfloat16), mask=(rows_o[:, None] < q_len) & (cols_o[None, :] < D_V))
            rows_s = row0 + gl.arange(0, 64, layout=row_s)
            gl.store(LSE + head * stride_lh + q_start + rows_s, lse, mask=rows_s < q_len)

    @gluon.jit
    def _fwd_kernel(
        q_desc, qr_desc,  # q [Tq, H * Dqk] in [BM, D_MAIN] and [BM, Dqk - D_MAIN] boxes
        k_desc, kr_desc,  # k [Tk, H * Dqk] in [BN, D_MAIN] and [BN, Dqk - D_MAIN] boxes
        v_desc,  # v [Tk, H * Dv] in [BN, Dv] boxes
        Out, stride_ot, stride_oh,  # [Tq, H, Dv] bf16, written
        LSE, stride_lh,  # [H, Tq] fp32, written (natural log)
        CU_Q,  # [N + 1] int32, document starts on the q side
        CU_K,  # [N + 1] int32, document starts on the k side
        ITEMS, n_items, n_heads,  # the work list [2, n_items] int32 of query blocks, and H
        NUM_PROGRAMS,  # programs launched (one per SM, or fewer)
        qk_scale,  # softmax scale * log2(e)
        D_QK: gl.constexpr, D_MAIN: gl.constexpr, D_V: gl.constexpr,
        CAUSAL: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
    ):
        """Program p computes tiles p, p + NUM_PROGRAMS, ... of the n_items x H tiles (work-list entry, head): out
        and lse of 128 query rows each. qr_desc / kr_desc are read only when Dqk > D_MAIN."""
        HAS_REST: gl.constexpr = D_QK > D_MAIN
        q_main, q_rest, k_ring, kr_ring = split_smem(q_desc, qr_desc, k_desc, kr_desc, _BM, STAGES, BN, D_QK, D_MAIN)
        v_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, D_V], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(q_empty, count=2)  # one arrival per consumer warpgroup
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)  # the producer's expect; the TMA bytes complete it
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        # (the partitions' arguments as literal tuples: a tuple held in a variable turns constexprs into tensors)
        gl.warp_specialize([
            (_consumer, (q_main, q_rest, k_ring, kr_ring, v_ring, q_bar, q_empty, k_ready, v_ready, empty, Out,
                         stride_ot, stride_oh, LSE, stride_lh, CU_Q, CU_K, ITEMS, n_items, n_heads, NUM_PROGRAMS,
                         qk_scale, D_V, HAS_REST, CAUSAL, BN, STAGES, 0)),
            (_consumer, (q_main, q_rest, k_ring, kr_ring, v_ring, q_bar, q_empty, k_ready, v_ready, empty, Out,
                         stride_ot, stride_oh, LSE, stride_lh, CU_Q, CU_K, ITEMS, n_items, n_heads, NUM_PROGRAMS,
                         qk_scale, D_V, HAS_REST, CAUSAL, BN, STAGES, 1)),
            (_producer, (q_desc, qr_desc, k_desc, kr_desc, v_desc, q_main, q_rest, k_ring, kr_ring, v_ring, q_bar,
                         q_empty, k_ready, v_ready, empty, CU_Q, CU_K, ITEMS, n_items, n_heads, NUM_PROGRAMS, D_QK,
                         D_MAIN, D_V, HAS_REST, CAUSAL, BN, STAGES)),
        ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


def gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_k: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                  softmax_scale: float, alibi_slopes: torch.Tensor | None = None) -> None:
    """Launches the kernel into out [Tq, H, Dv] bf16 and lse [H, Tq] float32 (the caller allocated them, checked
    `supports` (so no ALiBi), and that Tq and the document count are not zero)."""
    tq, h, d_qk = q.shape
    d_v = v.shape[-1]
    if k.shape[0] == 0:  # no keys: every query sees none
        out.zero_()
        lse.fill_(float("-inf"))
        return
    items = cached_worklist(cu_seqlens_q, cu_seqlens_k, tq, BM, key_blocks=False, causal=causal)
    q2, k2, v2 = rows_2d(q), rows_2d(k), rows_2d(v)
    (q_desc, qr_desc), (k_desc, kr_desc) = descs(q2, BM, d_qk), descs(k2, BN, d_qk)
    v_desc = descs(v2, BN, d_v, split=False)
    n_items = items.shape[1]
    programs = min(n_items * h, torch.cuda.get_device_properties(q.device).multi_processor_count)
    _fwd_kernel[(programs, )](
        q_desc, qr_desc,
        k_desc, kr_desc,
        v_desc,
        out, out.stride(0), out.stride(1),
        lse, lse.stride(0),
        cu_seqlens_q,
        cu_seqlens_k,
        items, n_items, h,
        programs,
        softmax_scale * LOG2E,
        D_QK=d_qk, D_MAIN=head_split(d_qk)[0], D_V=d_v, CAUSAL=causal, BN=BN, STAGES=STAGES, num_warps=NUM_WARPS)
