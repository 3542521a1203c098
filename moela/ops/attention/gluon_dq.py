"""The dQ kernel of the attention backward for Hopper (sm_90) in Gluon, warp-specialized on the scaffolding of
gluon_fwd.py. It computes what triton_bwd.py's dQ kernel computes, `dq_i = scale * sum_j p_ij (dO_i . v_j -
delta_i) k_j` with p recomputed from q, k and the forward's lse, over the same query-block work list, and replaces
it where triton_common.SCHEDULE["dq"] selects it (`auto`: AUTO) and `supports` takes the call.

Why: the dQ kernel is the forward's shape (a query tile streams the key blocks of its document), so the forward's
warp specialization carries over: a producer warp loads the tile's Q and dO once and K and V of every key block
into a ring, and the two consumer warpgroups (64 query rows each, 240 registers: dQ [64 x 192] fp32 is 96 of them)
only issue products and do the elementwise work. Triton's single partition of 8 warps issues its own loads and
waits for every product before the next.

Per tile: 128 query rows of one head (work-list entry x head, costliest first); one program per tile, or one per
SM walking them (`persistent`: the next tile's Q, dO and first key blocks load under this tile's last products, the
query tile released as soon as its last S and dP are done). Per key block j and consumer
warpgroup: S = Q K_j^T and dP = dO V_j^T (A from shared memory), P = exp2(S scale - lse), masked only in blocks that
cross the causal diagonal or the document's end, dS = P (dP - delta), then dQ += dS K_j with dS in registers as
the A operand. With `pipeline` the next block's S and dP are issued behind dQ's product before the wait, so the
tensor cores have the next work queued. A row that sees no key has lse = -inf: its P is 0 (the lse is read as +inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
except ImportError:
    gluon = None

from moela.ops.attention import gluon_fwd
from moela.ops.attention.gluon_fwd import _descs, _rows, head_split, supports

if gluon is not None:  # the Gluon helpers the attention kernels share (gluon_fwd.py)
    from moela.ops.attention.gluon_fwd import (
        _mma_layout,
        _operand_layout,
        _rest_width,
        _split_smem,
        _store_rows,
        _tile,
        _tma_load,
    )
from moela.ops.triton_env import HOPPER_SHARED_BYTES

__all__ = ["AUTO", "CONFIGS", "dq", "fits", "shared_bytes", "supports"]

BM = gluon_fwd.BM  # query rows per program (two consumer warpgroups of 64): the forward's tiles, which _tile reads
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class GluonDqConfig:
    """Key block rows (BN), the ring's depth, whether the next block's products are queued before the wait, and
    whether one program per SM walks the tiles (`persistent`: the next tile's loads run under this tile's end)
    instead of one program per tile."""

    block_n: int
    stages: int
    pipeline: bool = False
    persistent: bool = False


CONFIGS: dict[str, GluonDqConfig] = {
    "gluon_dq_bn64": GluonDqConfig(64, 3),
    "gluon_dq_bn64_pipe": GluonDqConfig(64, 3, pipeline=True),
    "gluon_dq_bn128": GluonDqConfig(128, 2),
    "gluon_dq_bn64_persistent": GluonDqConfig(64, 3, persistent=True),
}
# The `auto` config (triton_common.SCHEDULE["dq"]), measured side by side with the Triton dQ kernel
# (bench/notes/attention.md, run 44): fwd+bwd 6.752 -> 6.453 ms at 192/128 B=2 S=8192, 5.964 -> 5.652 ms at 96/64
# on 40 packed documents; in `small`'s training step the dQ kernel 28.0 -> 23.3 ms a step. bn64_pipe was no
# better (6.711 / 5.616 ms), bn128 fits only narrow heads and was slower at 96/64 (6.440 ms). Runs 45-46 (the
# packings): -0.4 to -5.4% against the Triton dQ (run 45's +2.5% on the 192/128 lognormal packing did not come
# back in run 46); bn64_pipe and persistent within 0-3.6% of bn64 there, neither yet timed in the step.
AUTO = "gluon_dq_bn64"


def shared_bytes(d_qk: int, d_v: int, cfg: GluonDqConfig) -> int:
    """Shared memory of one program: the query tile's Q and dO, the ring of K and V, the barriers."""
    return 2 * (BM * (d_qk + d_v) + cfg.stages * cfg.block_n * (d_qk + d_v)) + 8 * (2 + 2 * cfg.stages)


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
            head, q_start, q_len, k_start, k_len, start_m, q_shift, n_blocks = _tile(
                t, CU_Q, CU_K, ITEMS, n_items, n_heads, CAUSAL, BN)
            if n_blocks > 0:
                # (a fresh barrier's phase before its first counts as completed: the first wait passes)
                mbarrier.wait(q_empty, (n_q & 1) ^ 1)
                mbarrier.expect(q_bar, _BM * (D_QK + D_V) * 2)
                _tma_load(q_desc, [q_start + start_m, head * D_QK], q_bar, q_main)
                if HAS_REST:
                    _tma_load(qr_desc, [q_start + start_m, head * D_QK + D_MAIN], q_bar, q_rest)
                _tma_load(do_desc, [q_start + start_m, head * D_V], q_bar, do_tile)
                n_q += 1
            for j in range(n_blocks):
                slot = kv % STAGES
                mbarrier.wait(empty.index(slot), ((kv // STAGES) & 1) ^ 1)
                row = k_start + j * BN
                mbarrier.expect(ready.index(slot), BN * (D_QK + D_V) * 2)
                _tma_load(k_desc, [row, head * D_QK], ready.index(slot), k_ring.index(slot))
                if HAS_REST:
                    _tma_load(kr_desc, [row, head * D_QK + D_MAIN], ready.index(slot), kr_ring.index(slot))
                _tma_load(v_desc, [row, head * D_V], ready.index(slot), v_ring.index(slot))
                kv += 1

    @gluon.jit
    def _issue_products(qm, qr, dow, k_ring, kr_ring, v_ring, ready, j, HAS_REST: gl.constexpr, BN: gl.constexpr,
                        STAGES: gl.constexpr):
        """Ring block j's S = Q K^T and dP = dO V^T ([64 rows, BN keys]) issued once its K and V have landed."""
        slot = j % STAGES
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        zeros = gl.zeros([64, BN], gl.float32, _mma_layout(BN))
        s = warpgroup_mma(qm, k_ring.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        if HAS_REST:
            s = warpgroup_mma(qr, kr_ring.index(slot).permute((1, 0)), s, is_async=True)
        dp = warpgroup_mma(dow, v_ring.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        return s, dp

    @gluon.jit
    def _products(qm, qr, dow, k_ring, kr_ring, v_ring, ready, j, HAS_REST: gl.constexpr, BN: gl.constexpr,
                  STAGES: gl.constexpr):
        """_issue_products, waited for."""
        s, dp = _issue_products(qm, qr, dow, k_ring, kr_ring, v_ring, ready, j, HAS_REST, BN, STAGES)
        s, dp = warpgroup_mma_wait(0, deps=[s, dp])
        return s, dp

    @gluon.jit
    def _tile_dq(qm, qr, dow, k_ring, kr_ring, v_ring, q_empty, ready, empty, dq_main, dq_rest, kv, n_blocks, n_full,
                 lse2, delta, q_pos, k_len, qk_scale, s_layout: gl.constexpr, D_MAIN: gl.constexpr,
                 D_REST: gl.constexpr, HAS_REST: gl.constexpr, CAUSAL: gl.constexpr, BN: gl.constexpr,
                 STAGES: gl.constexpr, PIPELINE: gl.constexpr):
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
            # dQ += dS K (dS from registers); the products in flight under their own names, since both branches
            # below wait for them
            dqm_f = warpgroup_mma(gl.convert_layout(ds16, _operand_layout(D_MAIN)), k_ring.index(slot), dq_main,
                                  is_async=True)
            dqr_f = dq_rest
            if HAS_REST:
                dqr_f = warpgroup_mma(gl.convert_layout(ds16, _operand_layout(D_REST)), kr_ring.index(slot), dq_rest,
                                      is_async=True)
            if PIPELINE and j + 1 < n_blocks:
                s_next, dp_next = _issue_products(qm, qr, dow, k_ring, kr_ring, v_ring, ready, kv + j + 1, HAS_REST,
                                                  BN, STAGES)
                s, dp, dq_main, dq_rest = warpgroup_mma_wait(0, deps=[s_next, dp_next, dqm_f, dqr_f])
                mbarrier.arrive(empty.index(slot), count=1)
                if j + 2 == n_blocks:
                    mbarrier.arrive(q_empty, count=1)
            else:
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
                  BN: gl.constexpr, STAGES: gl.constexpr, PIPELINE: gl.constexpr, WG: gl.constexpr):
        """Consumer warpgroup WG: query rows [64 WG, 64 WG + 64) of each tile; dQ in registers, stored at its end.
        Counters kv (key blocks) and n_q (query tiles) follow the producer's."""
        D_REST: gl.constexpr = _rest_width(D_QK, D_MAIN)
        s_layout: gl.constexpr = _mma_layout(BN)
        qm_layout: gl.constexpr = _mma_layout(D_MAIN)
        qr_layout: gl.constexpr = _mma_layout(D_REST)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        qm = q_main.slice(WG * 64, 64)
        qr = q_rest.slice(WG * 64, 64)
        dow = do_tile.slice(WG * 64, 64)
        kv = 0
        n_q = 0
        for t in range(gl.program_id(0), n_items * n_heads, NUM_PROGRAMS):
            head, q_start, q_len, k_start, k_len, start_m, q_shift, n_blocks = _tile(
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
                                                s_layout, D_MAIN, D_REST, HAS_REST, CAUSAL, BN, STAGES, PIPELINE)
                n_q += 1
            # dq = scale * sum dS K; rows past the document are not stored
            _store_rows(DQ + head * stride_dqh, q_start, row0, q_len, stride_dqt,
                        (dq_main * sm_scale).to(gl.bfloat16), qm_layout, D_MAIN)
            if HAS_REST:
                _store_rows(DQ + head * stride_dqh + D_MAIN, q_start, row0, q_len, stride_dqt,
                            (dq_rest * sm_scale).to(gl.bfloat16), qr_layout, D_REST)

    @gluon.jit
    def _dq_kernel(q_desc, qr_desc, do_desc, k_desc, kr_desc, v_desc, LSE, DELTA, stride_lh, DQ, stride_dqt,
                   stride_dqh, CU_Q, CU_K, ITEMS, n_items, n_heads, NUM_PROGRAMS, qk_scale, sm_scale,
                   D_QK: gl.constexpr,
                   D_MAIN: gl.constexpr, D_V: gl.constexpr, CAUSAL: gl.constexpr, BN: gl.constexpr,
                   STAGES: gl.constexpr, PIPELINE: gl.constexpr):
        """Program p computes tiles p, p + NUM_PROGRAMS, ... of the n_items x H tiles (work-list query block, head):
        dq [Tq, H, Dqk] of 128 query rows each (one tile a program unless persistent)."""
        HAS_REST: gl.constexpr = D_QK > D_MAIN
        q_main, q_rest, k_ring, kr_ring = _split_smem(q_desc, qr_desc, k_desc, kr_desc, _BM, STAGES, BN, D_QK, D_MAIN)
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
                         qk_scale, sm_scale, D_QK, D_MAIN, HAS_REST, CAUSAL, BN, STAGES, PIPELINE, 0)),
            (_consumer, (q_main, q_rest, do_tile, k_ring, kr_ring, v_ring, q_bar, q_empty, ready, empty, LSE, DELTA,
                         stride_lh, DQ, stride_dqt, stride_dqh, CU_Q, CU_K, ITEMS, n_items, n_heads, NUM_PROGRAMS,
                         qk_scale, sm_scale, D_QK, D_MAIN, HAS_REST, CAUSAL, BN, STAGES, PIPELINE, 1)),
            (_producer, (q_desc, qr_desc, do_desc, k_desc, kr_desc, v_desc, q_main, q_rest, do_tile, k_ring, kr_ring,
                         v_ring, q_bar, q_empty, ready, empty, CU_Q, CU_K, ITEMS, n_items, n_heads, NUM_PROGRAMS, D_QK,
                         D_MAIN, D_V, HAS_REST, CAUSAL, BN, STAGES)),
        ], [4, 1], [240, 24])


def dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
       cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, dq_out: torch.Tensor, *, causal: bool,
       softmax_scale: float, config: str) -> None:
    """Fills dq_out [Tq, H, Dqk] (bf16) as triton_bwd's dQ kernel does, from delta [H, Tq] (rowsum(dO * O) - dlse)
    and the forward's lse [H, Tq]; the caller checked `supports` and `fits`."""
    from moela.ops.attention.triton_worklist import cached_worklist

    cfg = CONFIGS[config]
    tq, h, d_qk = q.shape
    d_v = v.shape[-1]
    if k.shape[0] == 0:  # no keys: no query sees one
        dq_out.zero_()
        return
    items = cached_worklist(cu_seqlens_q, cu_seqlens_k, tq, BM, key_blocks=False, causal=causal)
    q2, k2, v2, do2 = _rows(q), _rows(k), _rows(v), _rows(dout)
    main = head_split(d_qk)[0]
    bn = cfg.block_n
    (q_desc, qr_desc), (k_desc, kr_desc) = _descs(q2, BM, d_qk), _descs(k2, bn, d_qk)
    do_desc, v_desc = _descs(do2, BM, d_v, split=False), _descs(v2, bn, d_v, split=False)
    n_items = items.shape[1]
    tiles = n_items * h
    programs = min(tiles, torch.cuda.get_device_properties(q.device).multi_processor_count) if cfg.persistent \
        else tiles
    _dq_kernel[(programs, )](
        q_desc, qr_desc, do_desc, k_desc, kr_desc, v_desc, lse, delta, lse.stride(0), dq_out, dq_out.stride(0),
        dq_out.stride(1), cu_seqlens_q, cu_seqlens_k, items, n_items, h, programs, softmax_scale * LOG2E,
        softmax_scale,
        D_QK=d_qk, D_MAIN=main, D_V=d_v, CAUSAL=causal, BN=bn, STAGES=cfg.stages, PIPELINE=cfg.pipeline,
        num_warps=4)


def fits(d_qk: int, d_v: int, config: str) -> str | None:
    """None when `config` fits an H100/H200 at these head dims, else why not."""
    if config not in CONFIGS:
        raise ValueError(f"unknown Gluon dQ config {config!r}; choose one of {', '.join(CONFIGS)}, 'auto' or 'triton'")
    need = shared_bytes(d_qk, d_v, CONFIGS[config])
    if need > HOPPER_SHARED_BYTES:
        return f"{config} needs {need} bytes of shared memory at head dims {d_qk}/{d_v} (the GPU has " \
               f"{HOPPER_SHARED_BYTES})"
    return None
