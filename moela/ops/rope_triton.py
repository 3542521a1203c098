"""RoPE on a column slice of a [T, H, D] tensor, in place: `rope_columns_(x, position_ids, inv_freq, col0)`.

MLA's query is [q_nope ; q_pe] per head, and only the last R columns rotate. Applied out of place, as
`cat(q_nope, rope(q_pe))`, the forward writes the whole [T, H, Dqk] query again and the backward writes the whole
gradient again to change its R rotary columns (Dqk = 192, R = 64: three times the bytes the rotation needs; the
fused backward kernel Inductor made of it was 2.7 ms of a 110 ms `small` step). Here the
forward rotates the rotary columns of the projection's output where they lie, and the backward rotates the same
columns of the attention's query gradient back: R of the D columns are read and written, in both passes.

Decisions:
- The math is `moela.ops.rope.rope_reference`'s: interleaved pairs (2i, 2i+1), angles pos * inv_freq[i] in
  float32, cos / sin times `attention_factor`, stored in x's dtype. The backward is the transposed rotation
  (sin negated; the factor stays), applied to the float32-upcast gradient.
- In place, and still an ordinary out-of-place op to autograd: the function returns a detached alias of its input,
  rotated. Marking the input dirty instead would make autograd route the gradient of a view input (the
  projection's output reshaped to heads) through CopySlices, which clones the whole gradient: the copy this op
  exists to remove. The caller hands the input over and must not read it afterwards; if autograd had saved it for
  another backward, the alias's shared version counter makes that backward fail loudly, never silently.
- The gradient is rotated in place when it is contiguous (what every attention backend returns); otherwise
  (expanded or strided) a contiguous copy is rotated.
- The launch is a torch.library op that mutates its input (`moela::rope_columns_`), so torch.compile traces this
  autograd Function into a compiled block's graph (it was a graph break) and keeps both rotations in place.
- One program per BLOCK_T tokens and head, each token's R columns one contiguous load and store (pairs split and
  joined in registers). A first form looped over the heads in one program per token block and loaded the pairs'
  halves with two stride-2 loads: 0.27 ms a call at small-32k, ~6x its bytes' time.

Shapes: T tokens, H heads, D columns per head, R rotary columns (even) starting at column col0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.triton_env import INTERPRET

BLOCK_T = 8 if INTERPRET else 64


@triton.jit
def _rope_columns_kernel(x_ptr, pos_ptr, inv_freq_ptr, T, stride_t, stride_h, col0, attention_factor,
                         HALF: tl.constexpr, INVERSE: tl.constexpr, HALF_P2: tl.constexpr, BLOCK_T: tl.constexpr):
    """x[t, h, col0 + 2i : col0 + 2i + 2] rotated by pos[t] * inv_freq[i] (INVERSE: by minus that angle), for the
    BLOCK_T tokens of program 0's index and head program 1's index. Each token's R columns are one contiguous load
    and one contiguous store; the pairs are split and joined in registers."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    pairs = tl.arange(0, HALF_P2)
    cols = tl.arange(0, 2 * HALF_P2)
    ok = (rows < T)[:, None] & (cols < 2 * HALF)[None, :]  # [BLOCK_T, 2 * HALF_P2]
    pos = tl.load(pos_ptr + rows, mask=rows < T, other=0).to(tl.float32)
    freq = tl.load(inv_freq_ptr + pairs, mask=pairs < HALF, other=0.0).to(tl.float32)
    ang = pos[:, None] * freq[None, :]  # [BLOCK_T, HALF_P2]
    cos = tl.cos(ang) * attention_factor
    sin = tl.sin(ang) * attention_factor
    if INVERSE:
        sin = -sin
    ptr = x_ptr + rows[:, None] * stride_t + tl.program_id(1).to(tl.int64) * stride_h + col0 + cols[None, :]
    x = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    x0, x1 = tl.split(tl.reshape(x, (BLOCK_T, HALF_P2, 2)))  # [BLOCK_T, HALF_P2] each: the pairs' two halves
    y = tl.reshape(tl.join(x0 * cos - x1 * sin, x1 * cos + x0 * sin), (BLOCK_T, 2 * HALF_P2))
    tl.store(ptr, y.to(x_ptr.dtype.element_ty), mask=ok)


def _launch(x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor, col0: int,
            attention_factor: float, inverse: bool) -> None:
    t, h, _ = x.shape
    if t == 0 or h == 0:
        return
    half = inv_freq.numel()
    _rope_columns_kernel[(triton.cdiv(t, BLOCK_T), h)](
        x, position_ids, inv_freq, t, x.stride(0), x.stride(1), col0, float(attention_factor), HALF=half,
        INVERSE=inverse, HALF_P2=triton.next_power_of_2(half), BLOCK_T=BLOCK_T)


@torch.library.custom_op("moela::rope_columns_", mutates_args={"x"})
def _rope_columns_op(x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor, col0: int,
                     attention_factor: float, inverse: bool) -> None:
    """The kernel as an op that mutates x (module docstring): its call bumps x's version counter, and a compiled
    graph holds it (Inductor writes in place into the buffer it mutates when nothing reads that buffer after)."""
    _launch(x, position_ids, inv_freq, col0, attention_factor, inverse)


@_rope_columns_op.register_fake
def _rope_columns_fake(x, position_ids, inv_freq, col0, attention_factor, inverse) -> None:
    return None


class _RopeColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, position_ids, inv_freq, col0, attention_factor):
        out = x.detach()  # the alias that is rotated and returned (module docstring)
        _rope_columns_op(out, position_ids, inv_freq, col0, attention_factor, False)
        ctx.save_for_backward(position_ids, inv_freq)
        ctx.col0, ctx.attention_factor = col0, attention_factor
        return out

    @staticmethod
    def backward(ctx, grad):
        position_ids, inv_freq = ctx.saved_tensors
        g = grad if grad.is_contiguous() else grad.clone(memory_format=torch.contiguous_format)
        _rope_columns_op(g, position_ids, inv_freq, ctx.col0, ctx.attention_factor, True)
        return g, None, None, None, None


def rope_columns_(x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor, col0: int, *,
                  attention_factor: float = 1.0) -> torch.Tensor:
    """x [T, H, D] with columns col0 .. col0 + R rotated in place (R = 2 * inv_freq.numel()); returns x's alias.

    Equal to `torch.cat((x[..., :col0], rope_reference(x[..., col0:col0 + R], ...), x[..., col0 + R:]), -1)` in
    value and gradient. x must be a CUDA tensor (or any tensor under TRITON_INTERPRET=1) whose last dim is dense;
    the caller must not use x again (module docstring)."""
    r = 2 * inv_freq.numel()
    if x.dim() != 3 or position_ids.shape != x.shape[:1] or not 0 <= col0 <= x.shape[-1] - r:
        raise ValueError(f"rope_columns_ wants x [T, H, D], position_ids [T] and col0 + R <= D (R = {r}); got "
                         f"{tuple(x.shape)}, {tuple(position_ids.shape)}, col0={col0}")
    if x.stride(-1) != 1:
        raise ValueError(f"rope_columns_ needs x's last dim dense (stride 1), got strides {x.stride()}")
    return _RopeColumns.apply(x, position_ids, inv_freq.to(device=x.device, dtype=torch.float32), col0,
                              attention_factor)
