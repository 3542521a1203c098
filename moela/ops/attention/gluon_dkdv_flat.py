"""DRAFT, never run on a GPU: the dK/dV kernel in Gluon without warp specialization, for wide heads (192/128), where
gluon_bwd.py's warp-specialized kernel is register-bound (bench/notes/attention.md, "Next: dK/dV at 192/128").

Why: a producer warp costs the consumers registers (setmaxnreg leaves them 240 a thread), and at 192/128 dK and dV
alone take 160, so gluon_bwd.py spills and runs slower than triton_bwd.py's kernel, which has one partition of 8 warps
at up to 255. This kernel keeps Triton's single partition (8 warps: keys [64 g, 64 g + 64) on warpgroup g, dK [128 x
Dqk] and dV [128 x Dv] in registers) and Gluon's explicit control: the Q / dO ring loaded by TMA STAGES - 1 steps
ahead by the same warps (after a barrier: both warpgroups are done with the slot), the products' waits placed by
hand, the mask only in steps that need it. Same inputs, results and key-block work list as gluon_bwd.py.
"""

from __future__ import annotations

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
except ImportError:
    gluon = None
else:
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # Triton 3.9 / 3.6

from moela.ops.attention.gluon_fwd import _descs, _rows, head_split, supports

if gluon is not None:  # the Gluon helpers the attention kernels share (gluon_fwd.py, gluon_bwd.py)
    from moela.ops.attention.gluon_bwd import _key_tile
    from moela.ops.attention.gluon_fwd import _rest_width
from moela.ops.triton_env import HOPPER_SHARED_BYTES

__all__ = ["CONFIGS", "dkdv", "shared_bytes", "supports"]

BN = 128  # keys per program: two warpgroups of 64
NUM_WARPS = 8
# (query rows per step, ring stages, lse / delta loaded a step ahead), by config name (triton_common.SCHEDULE["dkdv"]).
# The sm_90 build here (Triton 3.9, 192/128): bm32_s3 243 registers, no spills (Triton's dK/dV kernel: 255 and 168
# bytes of spills). Run 47: bm32_s3 / _s2 2-8% slower fwd+bwd than Triton's kernel at 192/128 (bm64_s2, 328 bytes of
# spills: 50% slower, dropped); the _ahead configs take the load of lse / delta off each step's critical path.
CONFIGS = {"gluon_flat_bm32_s3": (32, 3, False), "gluon_flat_bm32_s2": (32, 2, False),
           "gluon_flat_bm32_s3_ahead": (32, 3, True), "gluon_flat_bm32_s2_ahead": (32, 2, True)}
LOG2E = 1.4426950408889634


def shared_bytes(d_qk: int, d_v: int, block_m: int, stages: int) -> int:
    return 2 * (BN * (d_qk + d_v) + stages * block_m * (d_qk + d_v)) + 8 * (1 + stages)


if gluon is not None:
    _BN = gl.constexpr(BN)
    _LOG2E = gl.constexpr(LOG2E)

    @gluon.constexpr_function
    def _acc8(n):
        """Layout of a [128, n] wgmma result over 8 warps: warpgroup g holds rows [64 g, 64 g + 64)."""
        n = getattr(n, "value", n)
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, n, 16])

    @gluon.constexpr_function
    def _op8(n):
        return gl.DotOperandLayout(operand_index=0, parent=_acc8(n), k_width=2)

    @gluon.jit
    def _load_step(q_desc, qr_desc, do_desc, q_ring, qr_ring, do_ring, ready, i, row, head, D_QK: gl.constexpr,
                   D_MAIN: gl.constexpr, D_V: gl.constexpr, HAS_REST: gl.constexpr, BM: gl.constexpr,
                   STAGES: gl.constexpr):
        slot = i % STAGES
        mbarrier.expect(ready.index(slot), BM * (D_QK + D_V) * 2)
        _tma_load(q_desc, [row, head * D_QK], ready.index(slot), q_ring.index(slot))
        if HAS_REST:
            _tma_load(qr_desc, [row, head * D_QK + D_MAIN], ready.index(slot), qr_ring.index(slot))
        _tma_load(do_desc, [row, head * D_V], ready.index(slot), do_ring.index(slot))

    @gluon.jit
    def _dkdv_flat_kernel(q_desc, qr_desc, k_desc, kr_desc, v_desc, do_desc, LSE, DELTA, stride_lh, DK, stride_dkt,
                          stride_dkh, DV, stride_dvt, stride_dvh, CU_Q, CU_K, ITEMS, n_items, n_heads, qk_scale,
                          sm_scale, D_QK: gl.constexpr, D_MAIN: gl.constexpr, D_V: gl.constexpr,
                          CAUSAL: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, AHEAD: gl.constexpr):
        """One program (8 warps) per (key-block work-list entry, head): dK and dV of 128 keys."""
        HAS_REST: gl.constexpr = D_QK > D_MAIN
        D_REST: gl.constexpr = _rest_width(D_QK, D_MAIN)
        s_layout: gl.constexpr = _acc8(BM)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        k_main = gl.allocate_shared_memory(gl.bfloat16, [_BN, D_MAIN], k_desc.layout)
        q_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, D_MAIN], q_desc.layout)
        if HAS_REST:
            k_rest = gl.allocate_shared_memory(gl.bfloat16, [_BN, D_QK - D_MAIN], kr_desc.layout)
            qr_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, D_QK - D_MAIN], qr_desc.layout)
        else:
            k_rest = k_main
            qr_ring = q_ring
        v_tile = gl.allocate_shared_memory(gl.bfloat16, [_BN, D_V], v_desc.layout)
        do_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, D_V], do_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        head, q_start, q_len, k_start, k_len, start_n, q_shift, lo, n_steps = _key_tile(
            gl.program_id(0), CU_Q, CU_K, ITEMS, n_items, n_heads, CAUSAL, BM)
        keys = start_n + gl.arange(0, _BN, layout=row_s)
        dk_main = gl.zeros([_BN, D_MAIN], gl.float32, _acc8(D_MAIN))
        dk_rest = gl.zeros([_BN, D_REST], gl.float32, _acc8(D_REST))
        dv = gl.zeros([_BN, D_V], gl.float32, _acc8(D_V))
        if n_steps > 0:
            mbarrier.expect(kv_bar, _BN * (D_QK + D_V) * 2)
            _tma_load(k_desc, [k_start + start_n, head * D_QK], kv_bar, k_main)
            if HAS_REST:
                _tma_load(kr_desc, [k_start + start_n, head * D_QK + D_MAIN], kv_bar, k_rest)
            _tma_load(v_desc, [k_start + start_n, head * D_V], kv_bar, v_tile)
            for s in gl.static_range(STAGES - 1):
                if s < n_steps:
                    _load_step(q_desc, qr_desc, do_desc, q_ring, qr_ring, do_ring, ready, s,
                               q_start + lo + s * BM, head, D_QK, D_MAIN, D_V, HAS_REST, BM, STAGES)
            # the first step's lse and delta (AHEAD: each step loads the next one's under its products)
            rows = lo + gl.arange(0, BM, layout=col_s)
            lse2_n = gl.load(LSE + head * stride_lh + q_start + rows, mask=rows < q_len, other=0.0) * _LOG2E
            delta_n = gl.load(DELTA + head * stride_lh + q_start + rows, mask=rows < q_len, other=0.0)
            mbarrier.wait(kv_bar, 0)
            for i in range(n_steps):
                # the step STAGES - 1 ahead into the slot step i - 1 used; both warpgroups are past it
                _cta_barrier()
                if i + STAGES - 1 < n_steps:
                    _load_step(q_desc, qr_desc, do_desc, q_ring, qr_ring, do_ring, ready, i + STAGES - 1,
                               q_start + lo + (i + STAGES - 1) * BM, head, D_QK, D_MAIN, D_V, HAS_REST, BM, STAGES)
                slot = i % STAGES
                rows = lo + i * BM + gl.arange(0, BM, layout=col_s)  # query rows (document coordinates)
                if AHEAD:
                    lse2 = lse2_n
                    delta = delta_n
                    ahead = rows + BM  # past the document on the last step: masked, no memory read
                    lse2_n = gl.load(LSE + head * stride_lh + q_start + ahead, mask=ahead < q_len, other=0.0) * _LOG2E
                    delta_n = gl.load(DELTA + head * stride_lh + q_start + ahead, mask=ahead < q_len, other=0.0)
                else:
                    lse2 = gl.load(LSE + head * stride_lh + q_start + rows, mask=rows < q_len, other=0.0) * _LOG2E
                    delta = gl.load(DELTA + head * stride_lh + q_start + rows, mask=rows < q_len, other=0.0)
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
                qs = q_ring.index(slot)
                qrs = qr_ring.index(slot)
                dos = do_ring.index(slot)
                zeros = gl.zeros([_BN, BM], gl.float32, s_layout)
                st = warpgroup_mma(k_main, qs.permute((1, 0)), zeros, use_acc=False, is_async=True)
                if HAS_REST:
                    st = warpgroup_mma(k_rest, qrs.permute((1, 0)), st, is_async=True)
                dpt = warpgroup_mma(v_tile, dos.permute((1, 0)), zeros, use_acc=False, is_async=True)
                st, dpt = warpgroup_mma_wait(0, deps=[st, dpt])
                pt = gl.exp2(st * qk_scale - lse2[None, :])
                row0 = lo + i * BM
                whole = (row0 + BM <= q_len) & (start_n + _BN <= k_len)
                if CAUSAL:
                    whole = whole & (start_n + _BN - 1 <= row0 + q_shift)
                if not whole:
                    keep = (rows[None, :] < q_len) & (keys[:, None] < k_len)
                    if CAUSAL:
                        keep = keep & (keys[:, None] <= rows[None, :] + q_shift)
                    pt = gl.where(keep, pt, 0.0)
                ds16 = (pt * (dpt - delta[None, :])).to(gl.bfloat16)
                pt16 = pt.to(gl.bfloat16)
                dv = warpgroup_mma(gl.convert_layout(pt16, _op8(D_V)), dos, dv, is_async=True)
                dk_main = warpgroup_mma(gl.convert_layout(ds16, _op8(D_MAIN)), qs, dk_main, is_async=True)
                if HAS_REST:
                    dk_rest = warpgroup_mma(gl.convert_layout(ds16, _op8(D_REST)), qrs, dk_rest, is_async=True)
                dv, dk_main, dk_rest = warpgroup_mma_wait(0, deps=[dv, dk_main, dk_rest])
        km_layout: gl.constexpr = _acc8(D_MAIN)
        keys_m = start_n + gl.arange(0, _BN, layout=gl.SliceLayout(1, km_layout))
        cols_m = gl.arange(0, D_MAIN, layout=gl.SliceLayout(0, km_layout))
        base_k = DK + (k_start + keys_m)[:, None].to(gl.int64) * stride_dkt + head * stride_dkh
        gl.store(base_k + cols_m[None, :], (dk_main * sm_scale).to(gl.bfloat16), mask=keys_m[:, None] < k_len)
        if HAS_REST:
            kr_layout: gl.constexpr = _acc8(D_REST)
            keys_r = start_n + gl.arange(0, _BN, layout=gl.SliceLayout(1, kr_layout))
            cols_r = gl.arange(0, D_REST, layout=gl.SliceLayout(0, kr_layout))
            base_r = DK + (k_start + keys_r)[:, None].to(gl.int64) * stride_dkt + head * stride_dkh + D_MAIN
            gl.store(base_r + cols_r[None, :], (dk_rest * sm_scale).to(gl.bfloat16), mask=keys_r[:, None] < k_len)
        v_layout: gl.constexpr = _acc8(D_V)
        keys_v = start_n + gl.arange(0, _BN, layout=gl.SliceLayout(1, v_layout))
        cols_v = gl.arange(0, D_V, layout=gl.SliceLayout(0, v_layout))
        gl.store(DV + (k_start + keys_v)[:, None].to(gl.int64) * stride_dvt + head * stride_dvh + cols_v[None, :],
                 dv.to(gl.bfloat16), mask=keys_v[:, None] < k_len)


def dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
         delta: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, dk: torch.Tensor,
         dv: torch.Tensor, *, causal: bool, softmax_scale: float, config: str) -> None:
    """As gluon_bwd.dkdv: fills dk, dv (zeroed by the caller) from delta and the forward's lse."""
    from moela.ops.attention.triton_worklist import cached_worklist

    if config not in CONFIGS:
        raise ValueError(f"unknown flat Gluon dK/dV config {config!r}; choose one of {', '.join(CONFIGS)}")
    block_m, stages, ahead = CONFIGS[config]

    h, d_qk, d_v = q.shape[1], q.shape[2], v.shape[2]
    if shared_bytes(d_qk, d_v, block_m, stages) > HOPPER_SHARED_BYTES:
        raise ValueError(f"the flat Gluon dK/dV kernel needs {shared_bytes(d_qk, d_v, block_m, stages)} bytes of "
                         f"shared memory at head dims {d_qk}/{d_v}; the H100/H200 has {HOPPER_SHARED_BYTES}")
    if k.shape[0] == 0 or q.shape[0] == 0:
        return
    items = cached_worklist(cu_seqlens_q, cu_seqlens_k, k.shape[0], BN, key_blocks=True, causal=causal)
    q2, k2, v2, do2 = _rows(q), _rows(k), _rows(v), _rows(dout)
    (q_desc, qr_desc), (k_desc, kr_desc) = _descs(q2, block_m, d_qk), _descs(k2, BN, d_qk)
    v_desc, do_desc = _descs(v2, BN, d_v, split=False), _descs(do2, block_m, d_v, split=False)
    n_items = items.shape[1]
    _dkdv_flat_kernel[(n_items * h, )](
        q_desc, qr_desc, k_desc, kr_desc, v_desc, do_desc, lse, delta, lse.stride(0), dk, dk.stride(0), dk.stride(1),
        dv, dv.stride(0), dv.stride(1), cu_seqlens_q, cu_seqlens_k, items, n_items, h, softmax_scale * LOG2E,
        softmax_scale, D_QK=d_qk, D_MAIN=head_split(d_qk)[0], D_V=d_v, CAUSAL=causal, BM=block_m, STAGES=stages,
        AHEAD=ahead, num_warps=NUM_WARPS)
