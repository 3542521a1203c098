"""The m-grouped contiguous layout of the MoE path: the Layout record, its row bound, and the counting kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moela.ops.moe.kernel_common import ALIGN, LAUNCH


@dataclass
class Layout:
    """Where each (token, k) row lives in the padded expert-grouped layout."""

    m_indices: torch.Tensor  # [M_pad] int32, expert per row, -1 on padding rows
    row_map: torch.Tensor  # [T*K] int32, padded row of flat index t*K+k
    src: torch.Tensor  # [M_pad] int32, flat index t*K+k of each row, -1 on padding rows
    counts: torch.Tensor  # [E] int64 real rows per expert
    offsets: torch.Tensor  # [E+1] int64 padded start of each expert's block (offsets[E] = end of the last)
    num_tokens: int
    topk: int

    @property
    def m_pad(self) -> int:
        return self.m_indices.numel()

    def expert_bounds(self) -> list[tuple[int, int]]:
        """Each expert's padded row range [s, t) as host integers (reads the offsets: one device sync)."""
        off = self.offsets.tolist()
        return list(zip(off[:-1], off[1:]))


def build_layout_rows(num_tokens: int, topk: int, num_experts: int, align: int = ALIGN) -> int:
    """M_pad: the rows of the layout, an upper bound on the padded total known without looking at the routing."""
    return triton.cdiv(num_tokens * topk, align) * align + num_experts * align


_CHUNK = 128  # expert ids per program of the layout's counting kernel (a [128, 128] comparison ranks them)


@triton.jit
def _layout_count_kernel(ids_ptr, rank_ptr, hist_ptr, n, C, E, CH: tl.constexpr, E_BLOCK: tl.constexpr,
                         E_BLOCKS: tl.constexpr):
    """Chunk c of the flat expert ids [c * CH, (c + 1) * CH): rank[i] = how many earlier ids of the chunk equal
    id_i; hist[e, c] = how many ids of the chunk are e."""
    c = tl.program_id(0)
    j = tl.arange(0, CH)
    i = c * CH + j
    ok = i < n
    ids = tl.load(ids_ptr + i, mask=ok, other=-1).to(tl.int32)
    before = (ids[None, :] == ids[:, None]) & (j[None, :] < j[:, None])  # [CH (i), CH (earlier)]
    tl.store(rank_ptr + i, tl.sum(before.to(tl.int32), axis=1), mask=ok)
    for b in tl.static_range(E_BLOCKS):
        ex = b * E_BLOCK + tl.arange(0, E_BLOCK)
        hist = tl.sum((ids[:, None] == ex[None, :]).to(tl.int32), axis=0)  # [E_BLOCK]
        tl.store(hist_ptr + ex * C + c, hist, mask=ex < E)


@triton.jit
def _layout_scan_kernel(hist_ptr, prefix_ptr, counts_ptr, C, BLOCK_C: tl.constexpr):
    """Expert e: prefix[e, c] = its ids in chunks before c (exclusive scan of hist[e, :]); counts[e] = all of them.
    BLOCK_C >= C (one vector: 32 values per thread at 4096 chunks, i.e. T*K = 512k)."""
    e = tl.program_id(0)
    cc = tl.arange(0, BLOCK_C)
    h = tl.load(hist_ptr + e * C + cc, mask=cc < C, other=0)
    tl.store(prefix_ptr + e * C + cc, tl.cumsum(h, axis=0) - h, mask=cc < C)
    tl.store(counts_ptr + e, tl.sum(h, axis=0).to(tl.int64))


def _count_and_scan(topk_ids: torch.Tensor, num_experts: int, align: int):
    """The layout's first two launches (ranks and histograms per chunk; counts and per-chunk prefix sums per expert)
    and every index buffer of it. Returns (flat ids, rank, prefix, chunks,
    row_map, m_indices, src, counts, offsets); the permute kernel in PLACE mode then writes row_map, m_indices, src
    and offsets."""
    if align != ALIGN:
        raise ValueError(f"build_layout: align={align} is not supported; the kernels use {ALIGN}-row blocks")
    if topk_ids.dim() != 2:
        raise ValueError(f"build_layout wants topk_ids [T, K]; got shape {tuple(topk_ids.shape)}")
    t, k = topk_ids.shape
    e, tk, dev = num_experts, topk_ids.numel(), topk_ids.device
    flat = topk_ids.reshape(-1).contiguous()  # [T*K], int32 or int64
    m_pad = build_layout_rows(t, k, e, align)
    chunks = max(1, triton.cdiv(tk, _CHUNK))
    scratch = torch.empty(tk + 2 * e * chunks, dtype=torch.int32, device=dev)
    rank, hist, prefix = scratch.split([tk, e * chunks, e * chunks])
    # the layout's own tensors are separate allocations: they leave moela::moe_experts_fwd as outputs, which must
    # not alias one another
    row_map = torch.empty(tk, dtype=torch.int32, device=dev)
    m_indices = torch.empty(m_pad, dtype=torch.int32, device=dev)
    src = torch.empty(m_pad, dtype=torch.int32, device=dev)
    counts = torch.empty(e, dtype=torch.int64, device=dev)
    offsets = torch.empty(e + 1, dtype=torch.int64, device=dev)
    e_block = min(64, triton.next_power_of_2(e))
    _layout_count_kernel[(chunks,)](flat, rank, hist, tk, chunks, e, CH=_CHUNK, E_BLOCK=e_block,
                                    E_BLOCKS=triton.cdiv(e, e_block), **LAUNCH["layout"])
    _layout_scan_kernel[(e,)](hist, prefix, counts, chunks, BLOCK_C=triton.next_power_of_2(chunks),
                              **LAUNCH["layout"])
    return flat, rank, prefix, chunks, row_map, m_indices, src, counts, offsets
