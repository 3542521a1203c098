"""The m-grouped contiguous layout of the MoE path (DeepGEMM's): the `Layout` record, its row bound, and the two
counting kernels of the stable counting sort that builds it.

The T*K (token, k) rows are grouped by expert; expert e's rows start at a multiple of 128 and its block is padded
with zero rows up to the next multiple. `m_indices [M_pad]` holds each row's expert (-1 on padding rows), `row_map
[T*K]` the row of (t, k), `src [M_pad]` the flat index t*K+k of each row (-1 on padding). M_pad is an upper bound
computed on the host from T, K and E (round_up(T*K, 128) + E*128), so building the layout needs no host sync; rows
past the last expert are padding. The sort: ranks and expert histograms per 128-id chunk (`_layout_count_kernel`),
their prefix sums over chunks (`_layout_scan_kernel`), then each row's placement, which the permute kernel
(permute.py) does inside its data pass: three launches for the whole permute, no torch index ops, no sort.

Shapes: T tokens, K top-k, E experts, C chunks of 128 expert ids, M_pad padded rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moela.ops.moe.kernels.triton_common import ALIGN, LAUNCH


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
        """Each expert's padded row range [start, end) as host integers (reads the offsets: one device sync)."""
        offsets = self.offsets.tolist()
        return list(zip(offsets[:-1], offsets[1:]))


def build_layout_rows(num_tokens: int, topk: int, num_experts: int, align: int = ALIGN) -> int:
    """M_pad: the rows of the layout, an upper bound on the padded total known without looking at the routing."""
    return triton.cdiv(num_tokens * topk, align) * align + num_experts * align


CHUNK = 128  # expert ids per program of the counting kernel (a [128, 128] comparison ranks them)


@triton.jit
def _layout_count_kernel(
    ids_ptr,  # [T*K] expert ids, int32 or int64
    rank_ptr,  # [T*K] int32, written: earlier ids of the same expert in the id's chunk
    hist_ptr,  # [E, C] int32, written: ids of each expert per chunk
    n_ids,  # T*K
    C,  # chunks
    E,
    CH: tl.constexpr, E_BLOCK: tl.constexpr, E_BLOCKS: tl.constexpr,
):
    """Program c, chunk [c * CH, (c + 1) * CH) of the flat ids: rank[i] = #{j < i in the chunk: id_j = id_i},
    hist[e, c] = #{i in the chunk: id_i = e}."""
    chunk = tl.program_id(0)
    lane = tl.arange(0, CH)
    flat = chunk * CH + lane
    valid = flat < n_ids
    ids = tl.load(ids_ptr + flat, mask=valid, other=-1).to(tl.int32)
    # rank within the chunk: count equal ids at earlier lanes
    before = (ids[None, :] == ids[:, None]) & (lane[None, :] < lane[:, None])  # [CH (i), CH (earlier)]
    tl.store(rank_ptr + flat, tl.sum(before.to(tl.int32), axis=1), mask=valid)
    # histogram, E_BLOCK experts at a time
    for e_block in tl.static_range(E_BLOCKS):
        experts = e_block * E_BLOCK + tl.arange(0, E_BLOCK)
        hist = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)  # [E_BLOCK]
        tl.store(hist_ptr + experts * C + chunk, hist, mask=experts < E)


@triton.jit
def _layout_scan_kernel(
    hist_ptr,  # [E, C] int32
    prefix_ptr,  # [E, C] int32, written: the expert's ids in earlier chunks
    counts_ptr,  # [E] int64, written: the expert's ids in all chunks
    C,  # chunks
    BLOCK_C: tl.constexpr,
):
    """Program e: prefix[e, c] = sum_{c' < c} hist[e, c'] (exclusive scan), counts[e] = sum_c hist[e, c].
    BLOCK_C >= C: one vector (32 values per thread at 4096 chunks, i.e. T*K = 512k)."""
    expert = tl.program_id(0)
    chunks = tl.arange(0, BLOCK_C)
    hist = tl.load(hist_ptr + expert * C + chunks, mask=chunks < C, other=0)
    tl.store(prefix_ptr + expert * C + chunks, tl.cumsum(hist, axis=0) - hist, mask=chunks < C)
    tl.store(counts_ptr + expert, tl.sum(hist, axis=0).to(tl.int64))


def count_and_scan(topk_ids: torch.Tensor, num_experts: int, align: int = ALIGN
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, Layout]:
    """The layout's first two launches and every index buffer of it. Returns
    (flat ids [T*K], rank [T*K], prefix [E, C], C, layout); the layout's counts are filled, its row_map, m_indices,
    src and offsets are written by the permute kernel placing the rows (permute.py). Scratch buffers share one
    allocation; the layout's tensors are separate ones."""
    if align != ALIGN:
        raise ValueError(f"build_layout: align={align} is not supported; the kernels use {ALIGN}-row blocks")
    if topk_ids.dim() != 2:
        raise ValueError(f"build_layout wants topk_ids [T, K]; got shape {tuple(topk_ids.shape)}")
    t, k = topk_ids.shape
    e, tk, dev = num_experts, topk_ids.numel(), topk_ids.device
    flat = topk_ids.reshape(-1).contiguous()  # [T*K], int32 or int64
    m_pad = build_layout_rows(t, k, e, align)
    chunks = max(1, triton.cdiv(tk, CHUNK))
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
    _layout_count_kernel[(chunks,)](
        flat,
        rank,
        hist,
        tk, chunks, e,
        CH=CHUNK, E_BLOCK=e_block, E_BLOCKS=triton.cdiv(e, e_block), **LAUNCH["layout"])
    _layout_scan_kernel[(e,)](
        hist,
        prefix,
        counts,
        chunks,
        BLOCK_C=triton.next_power_of_2(chunks), **LAUNCH["layout"])
    return flat, rank, prefix, chunks, Layout(m_indices, row_map, src, counts, offsets, t, k)
