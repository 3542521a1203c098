"""What the Gluon attention kernels for Hopper (sm_90) share: the Gluon imports, the common `supports` rule, the
2-D views and TMA descriptors of [T, H, D] tensors, and the @gluon.jit helpers (wgmma layouts, the Dqk split's
shared memory, a work-list tile's document span, masked row stores).

The kernels (gluon_forward.py, gluon_dq.py, gluon_dkdv.py) are warp-specialized on FA3's sm90 design: a producer
warp loads tiles by TMA into a ring guarded by mbarriers, two consumer warpgroups (240 registers each, setmaxnreg)
issue the wgmmas and do the elementwise work. They take the calls `supports` accepts (bf16 on sm_90, Dqk 64 or 128
plus an optional 32 or 64, Dv 64 or 128, no ALiBi) and read the same work lists (worklist.py) and the same lse as
the Triton kernels, so every phase can run either kernel.

Addressing: q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] are read as 2-D tensors [T, H * D] whose row stride is
the token stride, a tile of head h at column h * D; documents are rows [cu[d], cu[d + 1]). Dqk is a main part (a
power of two) and a rest, each its own TMA box and wgmma (192 = 128 + 64, 96 = 64 + 32: a 128-byte swizzle holds
64 bf16). Gluon does not run in the Triton interpreter: tests/sm90_compile.py compiles these kernels for sm_90 on
any machine, the GPU tests check them against the float64 reference.
"""

from __future__ import annotations

import functools

import torch

from moela.ops.triton_env import HOPPER_SHARED_BYTES

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon: the Triton kernels serve every call
    gluon = None
else:  # the TMA load's name: Triton 3.6 (async_copy_global_to_shared) and newer ones (async_load)
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

BM = 128  # query rows of a query tile (the forward's and dQ's): two consumer warpgroups of 64
SHARED_BYTES = HOPPER_SHARED_BYTES
LOG2E = 1.4426950408889634


def head_split(d_qk: int) -> tuple[int, int]:
    """Dqk as (main, rest): the largest power of two <= Dqk and what is left; each part is its own TMA box and
    wgmma (192 = 128 + 64, 96 = 64 + 32)."""
    main = 1 << (d_qk.bit_length() - 1)
    return main, d_qk - main


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: torch.Tensor | None) -> str | None:
    """None when the Gluon kernels can run the call (each kernel adds its shared-memory fit), else why not."""
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


def rows_2d(x: torch.Tensor) -> torch.Tensor:
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


def descs(x2: torch.Tensor, rows: int, d: int, split: bool = True):
    """TMA descriptors of x2 [T, H * D] read in [rows, D] boxes: with `split`, Dqk's main part and its rest (the main
    one again when there is none: the kernel never reads it), else the one box of width d."""
    if not split:
        return TensorDescriptor.from_tensor(x2, [rows, d], _layout(rows, d))
    main, rest = head_split(d)
    first = TensorDescriptor.from_tensor(x2, [rows, main], _layout(rows, main))
    return first, (TensorDescriptor.from_tensor(x2, [rows, rest], _layout(rows, rest)) if rest else first)


if gluon is not None:
    _BM = gl.constexpr(BM)

    @gluon.constexpr_function
    def mma_layout(n):
        """Register layout of one warpgroup's [64, n] wgmma result (bf16 inputs: k = 16 instructions)."""
        n = getattr(n, "value", n)  # the kernel's constexpr, unwrapped
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])

    @gluon.constexpr_function
    def operand_layout(n):
        """Register layout of a bf16 tile as the A operand of a wgmma whose result is [64, n] (bf16 pairs): P of
        P V here, P^T / dS^T / dS in the backward's kernels."""
        return gl.DotOperandLayout(operand_index=0, parent=mma_layout(n), k_width=2)

    @gluon.constexpr_function
    def rest_width(d_qk, d_main):
        """The second part of Dqk (d_main itself when there is none: the unused tiles keep a valid shape)."""
        d_qk, d_main = getattr(d_qk, "value", d_qk), getattr(d_main, "value", d_main)
        return d_qk - d_main if d_qk > d_main else d_main

    @gluon.jit
    def split_smem(tile_desc, tile_rest_desc, ring_desc, ring_rest_desc, TILE_ROWS: gl.constexpr,
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
    def document(t, CU_Q, CU_K, ITEMS, n_heads):
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
    def store_rows(ptr, first_row, row0, n_rows, stride_t, vals, LAYOUT: gl.constexpr, WIDTH: gl.constexpr):
        """A [64, WIDTH] register tile `vals` (layout LAYOUT) into rows first_row + row0 + [0, 64) of `ptr` (row
        stride stride_t, the head's columns already in `ptr`), the rows at row0 + i >= n_rows (past the document)
        left out."""
        rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, LAYOUT))
        cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, LAYOUT))
        gl.store(ptr + (first_row + rows)[:, None].to(gl.int64) * stride_t + cols[None, :], vals,
                 mask=(rows[:, None] < n_rows) & (cols[None, :] < WIDTH))

    @gluon.jit
    def query_tile(t, CU_Q, CU_K, ITEMS, n_items, n_heads, CAUSAL: gl.constexpr, BN: gl.constexpr):
        """Tile t's head, document span and key blocks: (head, q_start, q_len, k_start, k_len, start_m, q_shift,
        n_blocks); tile t is work-list entry t // H on head t % H. An unused work-list entry (document -1) gets
        q_len = n_blocks = 0. Causal alignment is bottom-right: query i sees key j when j <= i + q_shift,
        q_shift = Lk - Lq."""
        head, item, valid, q_start, q_len, k_start, k_len = document(t, CU_Q, CU_K, ITEMS, n_heads)
        q_len = gl.where(valid, q_len, 0)
        start_m = gl.load(ITEMS + n_items + item) * _BM
        q_shift = k_len - q_len
        if CAUSAL:
            end = gl.maximum(gl.minimum(k_len, start_m + _BM + q_shift), 0)
        else:
            end = k_len
        n_blocks = gl.where(valid & (start_m < q_len), gl.cdiv(end, BN), 0)
        return head, q_start, q_len, k_start, k_len, start_m, q_shift, n_blocks

