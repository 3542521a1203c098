"""Forward kernel of the flash attention for Hopper (sm_90) in Gluon, warp-specialized on FA3's design: the same
arguments, work list and results (out, natural-log lse) as triton_fwd.py's kernel, which it replaces on the GPU for
the calls it supports (`supports`) while SCHEDULE["forward"] names one of its configs (the default,
triton_common.py); the Triton backward reads its out and lse unchanged.

Why not Triton: Triton places the tensor cores' waits itself. A product that other operations read is waited for
at once, and a wait takes every product in flight, so the softmax of one key block cannot run under the tensor
cores' P V of the block before, and the loads share the warps that compute (bench/notes/attention.md, runs 34-35:
three attempts inside Triton, each slower). Gluon states the waits (`warpgroup_mma_wait(num_outstanding=...)`) and
the partitions (`warp_specialize`), so the kernel is organized as FA3's sm90 forward:

- producer (one warp): for each of the program's tiles, the 128 query rows (once both consumers' last scores of the
  previous tile are done), then for every key block K and V into a ring slot by TMA, each with its own barrier (the
  scores can start when K has landed), after both consumer warpgroups released the slot.
- two consumer warpgroups (the default partition and a worker, 240 registers each): warpgroup g owns query rows
  [64 g, 64 g + 64). Per key block j it issues S_j = Q K_j^T (asynchronous wgmmas: Dqk = 192 is a 128-wide and a
  64-wide part, each a TMA box and a wgmma, since a 128-byte swizzle holds 64 bf16), then O += P_{j-1} V_{j-1} with
  P in registers, waits for S_j only (O's product stays in flight), runs the online softmax of S_j under it, then
  waits for O, releases slot j - 1 and rescales O. The two warpgroups' products interleave on the tensor cores.

Measured (bench/notes/attention.md, runs 38-41, one H200): the default config's forward is 12-23% faster than
triton_fwd.py's kernel at 192/128 (B=2 S=8192 and both packings), 0.79-0.90x flash-attn-4's forward; in the
training step of `small` (96/64 heads) its kernel time is 23.1 -> 17.3 ms a step at 64k tokens, +1.3-1.8%
tokens/s. Nsight Compute: the tensor pipe ~64% busy at S=8192 (flash-attn-4's forward runs at 70-76% of the bf16
peak by its FLOP count, runs 38 and 41); ping-pong turns between the warpgroups and two products in flight under
the softmax were tried and measured slower.

Masks: the blocks every row of a warpgroup sees whole (inside the document, below the causal diagonal) run without
the mask; the rest (the diagonal, the document's last partial block) apply it. Rows past the document's end
compute garbage that is never stored; keys past it (or past the tensor, which TMA fills with zeros) are masked.

Addressing: q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] are read as 2-D tensors [T, H * D] whose row stride is
the token stride, a tile of head h at column h * D; documents are rows [cu[d], cu[d + 1]). Tiles are (work-list
entry, head) pairs (triton_worklist.py: query blocks of 128, costliest first); one program per tile, or one per SM
walking them (`persistent`).

Supported: bf16 on sm_90, Dqk 64 or 128 plus an optional 32 or 64, Dv 64 or 128 (tested on the GPU at 192/128,
96/64 and 128/128), no ALiBi (`supports`); other calls keep the Triton kernel. Gluon does not run in the
Triton interpreter: tests/sm90_compile.py compiles this kernel for sm_90 (registers, spills, wgmma / setmaxnreg /
TMA in the PTX), tests/test_attention.py checks it on the GPU against the float64 reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moela.ops.triton_env import HOPPER_SHARED_BYTES

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon: the Triton forward serves every call
    gluon = None
else:  # the TMA load's name: Triton 3.6 (async_copy_global_to_shared) and newer ones (async_load)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

BM = 128  # query rows per program: two consumer warpgroups of 64
CONSUMER_REGS = 240
PRODUCER_REGS = 24
NUM_WARPS = 4  # the default partition: consumer warpgroup 0
SHARED_BYTES = HOPPER_SHARED_BYTES
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class GluonFwdConfig:
    """Key block rows (BN), the ring's depth (stages of K and V), and whether one program per SM walks the tiles
    (`persistent`: the next tile's loads run under this tile's end) instead of one program per tile."""

    block_n: int
    stages: int
    persistent: bool = False


# Measured side by side by bench/attention.py's variant rows (bench/notes/attention.md, runs 38-41): 128 x 64 ahead
# of 128 x 128 in every run; persistent 7% faster on the packings and within +-4% at B=2 S=8192 (two runs), so the
# default for packed training batches (triton_common.SCHEDULE["forward"]).
CONFIGS: dict[str, GluonFwdConfig] = {
    "gluon_128x128_s2": GluonFwdConfig(128, 2),
    "gluon_128x64_s4": GluonFwdConfig(64, 4),
    "gluon_128x64_s4_persistent": GluonFwdConfig(64, 4, persistent=True),
}
DEFAULT = "gluon_128x64_s4_persistent"


def shared_bytes(d_qk: int, d_v: int, cfg: GluonFwdConfig) -> int:
    """Shared memory of one program: the query tile, the ring of K and V tiles, the barriers."""
    return 2 * (BM * d_qk + cfg.stages * cfg.block_n * (d_qk + d_v)) + 8 * (2 + 3 * cfg.stages)


def head_split(d_qk: int) -> tuple[int, int]:
    """Dqk as (main, rest): the largest power of two <= Dqk and what is left; each part is its own TMA box and
    wgmma (192 = 128 + 64, 96 = 64 + 32)."""
    main = 1 << (d_qk.bit_length() - 1)
    return main, d_qk - main


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: torch.Tensor | None) -> str | None:
    """None when this kernel can run the call, else why not (the Triton forward runs it)."""
    if gluon is None:
        return "this Triton has no Gluon"
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "not a Hopper (sm_90) GPU"
    if q.dtype != torch.bfloat16 or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} (the kernel is bf16)"
    main, rest = head_split(q.shape[-1])
    if main not in (64, 128) or rest not in (0, 32, 64) or v.shape[-1] not in (64, 128):
        return (f"head dims {q.shape[-1]}/{v.shape[-1]} (built for Dqk 64 or 128, plus 32 or 64, and Dv 64 or 128; "
                f"tested at 192/128, 96/64 and 128/128)")
    if alibi_slopes is not None:
        return "ALiBi"
    return None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] as [T, H * D] with x's token stride, copied only when TMA cannot read it as it is (heads not
    packed, or a token stride or base that is not 16-byte aligned)."""
    t, h, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16 or \
            (t > 1 and x.stride(0) < h * d):
        x = x.contiguous()
    return x.as_strided((t, h * d), (x.stride(0), 1))


@functools.lru_cache(maxsize=None)
def _layout(rows: int, cols: int):
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


def _descs(x2: torch.Tensor, rows: int, d: int, split: bool = True):
    """TMA descriptors of x2 [T, H * D] read in [rows, D] boxes: with `split`, Dqk's main part and its rest (the main
    one again when there is none: the kernel never reads it), else the one box of width d."""
    if not split:
        return TensorDescriptor.from_tensor(x2, [rows, d], _layout(rows, d))
    main, rest = head_split(d)
    first = TensorDescriptor.from_tensor(x2, [rows, main], _layout(rows, main))
    return first, (TensorDescriptor.from_tensor(x2, [rows, rest], _layout(rows, rest)) if rest else first)


if gluon is not None:
    _BM = gl.constexpr(BM)
    _LN2 = gl.constexpr(0.6931471805599453)
    _CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)

    @gluon.constexpr_function
    def _mma_layout(n):
        """Register layout of one warpgroup's [64, n] wgmma result (bf16 inputs: k = 16 instructions)."""
        n = getattr(n, "value", n)  # the kernel's constexpr, unwrapped
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])

    @gluon.constexpr_function
    def _operand_layout(n):
        """Register layout of a bf16 tile as the A operand of a wgmma whose result is [64, n] (bf16 pairs): P of
        P V here, P^T / dS^T / dS in the backward's kernels."""
        return gl.DotOperandLayout(operand_index=0, parent=_mma_layout(n), k_width=2)

    @gluon.constexpr_function
    def _rest_width(d_qk, d_main):
        """The second part of Dqk (d_main itself when there is none: the unused tiles keep a valid shape)."""
        d_qk, d_main = getattr(d_qk, "value", d_qk), getattr(d_main, "value", d_main)
        return d_qk - d_main if d_qk > d_main else d_main

    @gluon.jit
    def _split_smem(tile_desc, tile_rest_desc, ring_desc, ring_rest_desc, TILE_ROWS: gl.constexpr,
                    STAGES: gl.constexpr, RING_ROWS: gl.constexpr, D_QK: gl.constexpr, D_MAIN: gl.constexpr):
        """Shared memory for the Dqk-wide operands of a kernel: a tile loaded once ([TILE_ROWS, Dqk]) and a ring
        ([STAGES, RING_ROWS, Dqk]), each as its D_MAIN part and its rest (the main part again when Dqk has no rest:
        never read). Returns (tile, tile_rest, ring, ring_rest)."""
        tile = gl.allocate_shared_memory(gl.bfloat16, [TILE_ROWS, D_MAIN], tile_desc.layout)
        ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, RING_ROWS, D_MAIN], ring_desc.layout)
        if D_QK > D_MAIN:
            tile_rest = gl.allocate_shared_memory(gl.bfloat16, [TILE_ROWS, D_QK - D_MAIN], tile_rest_desc.layout)
            ring_rest = gl.allocate_shared_memory(gl.bfloat16, [STAGES, RING_ROWS, D_QK - D_MAIN],
                                                  ring_rest_desc.layout)
        else:
            tile_rest = tile
            ring_rest = ring
        return tile, tile_rest, ring, ring_rest

    @gluon.jit
    def _document(t, CU_Q, CU_K, ITEMS, n_heads):
        """Tile t's work-list entry (t // H) on head t % H and its document's spans: (head, item, valid, q_start,
        q_len, k_start, k_len); an unused entry (document -1) is not valid and reads document 0's spans."""
        head = t % n_heads
        item = t // n_heads
        doc = gl.load(ITEMS + item)
        valid = doc >= 0
        doc = gl.maximum(doc, 0)
        q_start = gl.load(CU_Q + doc)
        q_len = gl.load(CU_Q + doc + 1) - q_start
        k_start = gl.load(CU_K + doc)
        k_len = gl.load(CU_K + doc + 1) - k_start
        return head, item, valid, q_start, q_len, k_start, k_len

    @gluon.jit
    def _store_rows(ptr, first_row, row0, n_rows, stride_t, vals, LAYOUT: gl.constexpr, WIDTH: gl.constexpr):
        """A [64, WIDTH] register tile `vals` (layout LAYOUT) into rows first_row + row0 + [0, 64) of `ptr` (row
        stride stride_t, the head's columns already in `ptr`), the rows at row0 + i >= n_rows (past the document)
        left out."""
        rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, LAYOUT))
        cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, LAYOUT))
        gl.store(ptr + (first_row + rows)[:, None].to(gl.int64) * stride_t + cols[None, :], vals,
                 mask=(rows[:, None] < n_rows) & (cols[None, :] < WIDTH))

    @gluon.jit
    def _tile(t, CU_Q, CU_K, ITEMS, n_items, n_heads, CAUSAL: gl.constexpr, BN: gl.constexpr):
        """Tile t's head, document span and key blocks: (head, q_start, q_len, k_start, k_len, start_m, q_shift,
        n_blocks); tile t is work-list entry t // H on head t % H. An unused work-list entry (document -1) gets
        q_len = n_blocks = 0. Causal alignment is bottom-right: query i sees key j when j <= i + q_shift,
        q_shift = Lk - Lq."""
        head, item, valid, q_start, q_len, k_start, k_len = _document(t, CU_Q, CU_K, ITEMS, n_heads)
        q_len = gl.where(valid, q_len, 0)
        start_m = gl.load(ITEMS + n_items + item) * _BM
        q_shift = k_len - q_len
        if CAUSAL:
            end = gl.maximum(gl.minimum(k_len, start_m + _BM + q_shift), 0)
        else:
            end = k_len
        n_blocks = gl.where(valid & (start_m < q_len), gl.cdiv(end, BN), 0)
        return head, q_start, q_len, k_start, k_len, start_m, q_shift, n_blocks

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
            head, q_start, q_len, k_start, k_len, start_m, q_shift, n_blocks = _tile(t, CU_Q, CU_K, ITEMS, n_items,
                                                                                     n_heads, CAUSAL, BN)
            if n_blocks > 0:
                # (a fresh barrier's phase before its first counts as completed: the first wait passes)
                mbarrier.wait(q_empty, (n_q & 1) ^ 1)
                mbarrier.expect(q_bar, _BM * D_QK * 2)
                _tma_load(q_desc, [q_start + start_m, head * D_QK], q_bar, q_main)
                if HAS_REST:
                    _tma_load(qr_desc, [q_start + start_m, head * D_QK + D_MAIN], q_bar, q_rest)
                n_q += 1
            for j in range(n_blocks):
                slot = kv % STAGES
                mbarrier.wait(empty.index(slot), ((kv // STAGES) & 1) ^ 1)
                row = k_start + j * BN
                mbarrier.expect(k_ready.index(slot), BN * D_QK * 2)
                _tma_load(k_desc, [row, head * D_QK], k_ready.index(slot), k_ring.index(slot))
                if HAS_REST:
                    _tma_load(kr_desc, [row, head * D_QK + D_MAIN], k_ready.index(slot), kr_ring.index(slot))
                mbarrier.expect(v_ready.index(slot), BN * D_V * 2)
                _tma_load(v_desc, [row, head * D_V], v_ready.index(slot), v_ring.index(slot))
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
        Returns (acc, m_i, l_i, kv) with kv past the tile's blocks. (Issuing S_{j+1} as soon as S_j is done, so
        that two products wait under each softmax, measured 22-30% slower: bench/notes/attention.md, run 41.)"""
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
        s_layout: gl.constexpr = _mma_layout(BN)
        o_layout: gl.constexpr = _mma_layout(D_V)
        p_layout: gl.constexpr = _operand_layout(D_V)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        zeros = gl.zeros([64, BN], gl.float32, s_layout)
        qm = q_main.slice(WG * 64, 64)
        qr = q_rest.slice(WG * 64, 64)
        kv = 0
        n_q = 0
        for t in range(gl.program_id(0), n_items * n_heads, NUM_PROGRAMS):
            head, q_start, q_len, k_start, k_len, start_m, q_shift, n_blocks = _tile(t, CU_Q, CU_K, ITEMS, n_items,
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
    def _fwd_kernel(q_desc, qr_desc, k_desc, kr_desc, v_desc, Out, stride_ot, stride_oh, LSE, stride_lh, CU_Q, CU_K,
                    ITEMS, n_items, n_heads, NUM_PROGRAMS, qk_scale, D_QK: gl.constexpr, D_MAIN: gl.constexpr,
                    D_V: gl.constexpr, CAUSAL: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
        """Program p computes tiles p, p + NUM_PROGRAMS, ... of the n_items x H tiles (work-list entry, head): out
        [Tq, H, Dv] and lse [H, Tq] of 128 query rows each. q_desc / k_desc read the first D_MAIN of Dqk, qr_desc /
        kr_desc the rest (when Dqk > D_MAIN), v_desc all of Dv."""
        HAS_REST: gl.constexpr = D_QK > D_MAIN
        q_main, q_rest, k_ring, kr_ring = _split_smem(q_desc, qr_desc, k_desc, kr_desc, _BM, STAGES, BN, D_QK, D_MAIN)
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


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                      softmax_scale: float, config: str | None = None) -> None:
    """Launches the kernel into out [Tq, H, Dv] bf16 and lse [H, Tq] float32, which triton_fwd.attention_forward
    allocated (the caller checked `supports`, and that Tq and the document count are not zero)."""
    from moela.ops.attention.triton_worklist import cached_worklist

    name = config or DEFAULT
    if name not in CONFIGS:
        raise ValueError(f"unknown Gluon attention forward config {name!r}; choose one of {', '.join(CONFIGS)}")
    cfg = CONFIGS[name]
    tq, h, d_qk = q.shape
    d_v = v.shape[-1]
    if k.shape[0] == 0:  # no keys: every query sees none
        out.zero_()
        lse.fill_(float("-inf"))
        return
    if shared_bytes(d_qk, d_v, cfg) > SHARED_BYTES:
        raise ValueError(f"Gluon attention forward config {name!r} needs {shared_bytes(d_qk, d_v, cfg)} bytes of "
                         f"shared memory at head dims {d_qk}/{d_v}; the H100/H200 has {SHARED_BYTES}")
    items = cached_worklist(cu_seqlens_q, cu_seqlens_k, tq, BM, key_blocks=False, causal=causal)
    q2, k2, v2 = _rows(q), _rows(k), _rows(v)
    main = head_split(d_qk)[0]
    bn = cfg.block_n
    (q_desc, qr_desc), (k_desc, kr_desc) = _descs(q2, BM, d_qk), _descs(k2, bn, d_qk)
    v_desc = _descs(v2, bn, d_v, split=False)
    n_items = items.shape[1]
    tiles = n_items * h
    programs = min(tiles, torch.cuda.get_device_properties(q.device).multi_processor_count) if cfg.persistent \
        else tiles
    _fwd_kernel[(programs, )](
        q_desc, qr_desc, k_desc, kr_desc, v_desc, out, out.stride(0), out.stride(1), lse, lse.stride(0),
        cu_seqlens_q, cu_seqlens_k, items, n_items, h, programs, softmax_scale * LOG2E, D_QK=d_qk, D_MAIN=main,
        D_V=d_v, CAUSAL=causal, BN=bn, STAGES=cfg.stages, num_warps=NUM_WARPS)
