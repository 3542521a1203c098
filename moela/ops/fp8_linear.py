"""FP8 linear layer, DeepSeek-V3's recipe: y = x W^T with every GEMM of forward and backward in e4m3.

- forward  y [T, N]  = x [T, K] (1x128 groups along K) @ W [N, K] (128x128 blocks)^T
- dgrad    dx [T, K] = dy [T, N] (1x128 along N) @ W (the same codes and scales, transposed)
- wgrad    dW [N, K] = dy^T [N, T] (1x128 along tokens) @ x^T [K, T] (1x128 along tokens)^T
fp32 accumulation with promotion every 128 of the reduction; y and dx in the activation dtype, dW in the weight's
dtype (fp32 master weights stay fp32). Backends:
- `reference`: quantize -> dequantize in torch (moela.ops.moe.quant_spec: the codes the kernels produce), GEMMs in
  fp32; any device, the specification.
- `triton`: one fused Triton/Gluon quantization kernel per activation tensor that reads it once and writes both its
  row codes (for the next GEMM) and its transposed column codes (for the weight gradient; saved for backward in
  place of x, at half x's bytes); the weight's codes, scales and transposed codes once per optimizer step
  (moela.ops.weight_cache); the GEMMs are moela.ops.moe.kernels.gemm_fp8_triton's persistent kernels with one group
  (Gluon on Hopper, else Triton). The token dim is padded to a multiple of 128 inside the quantization (zero
  rows), so any T works. Forward and backward are the torch.library ops `moela::fp8_linear_fwd` /
  `moela::fp8_linear_bwd` (fake implementations, an autograd formula), so a compiled block holds its FP8 linears as
  ops of its graph instead of breaking around them; the weight cache is consulted when the op runs, on the real
  parameter, as the expert path's is.
`auto`: `triton` on CUDA for features that are multiples of 128 (the quantization kernels' tiles), else the
plain bf16 linear (no FP8 for a layer the kernels cannot tile, e.g. MLA's wkv_a with 512 + 64 outputs; nor on a GPU
without FP8 tensor cores, logged once: the tools can evaluate an FP8 run there, the trainer refuses to train one).

Shapes: T tokens, K in features, N out features.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from moela.ops import weight_cache
from moela.ops.fp8_device import fp8_device_problem
from moela.ops.moe.quant_spec import dequant_1x128, dequant_128x128, quant_1x128, quant_128x128

FP8_LINEAR_BACKENDS = ("auto", "reference", "triton")
log = logging.getLogger("moela.ops")
_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED and not torch.compiler.is_compiling():
        _LOGGED.add(message)
        log.warning(message)


# ----------------------------------------------------------------------------------------------------------------
# reference


def _fq_rows(x: torch.Tensor) -> torch.Tensor:
    """x quantized in 1x128 groups along its last dim and dequantized, fp32."""
    return dequant_1x128(*quant_1x128(x))


def _fq_weight(w: torch.Tensor) -> torch.Tensor:
    return dequant_128x128(*quant_128x128(w))


class _ReferenceFn(torch.autograd.Function):
    """Simulated quantization of every GEMM operand, each quantized along its GEMM's reduction dim."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return (_fq_rows(x) @ _fq_weight(w).t()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = _fq_rows(dy) @ _fq_weight(w)  # dy grouped along N, the reduction of the data gradient
        dw = _fq_rows(dy.t()) @ _fq_rows(x.t()).t()  # both grouped along tokens
        return dx.to(x.dtype), dw.to(w.dtype)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _ReferenceFn.apply(x, weight)


# ----------------------------------------------------------------------------------------------------------------
# Triton: fused quantization + persistent FP8 GEMMs


def _padded_rows(t: int, device: torch.device) -> torch.Tensor | None:
    """src for the gathering quantization: row i reads x[i] for i < T, zeros up to the next multiple of 128 (None
    when T is a multiple of 128: the quantization then reads x by TMA tiles)."""
    if t % 128 == 0 and t > 0:
        return None
    m = -(-max(t, 1) // 128) * 128
    idx = torch.arange(m, device=device, dtype=torch.int32)
    return torch.where(idx < t, idx, -1)


def _quant_act(x: torch.Tensor, src: torch.Tensor, rowwise: bool = True):
    from moela.ops.moe.kernels.quantize_triton import quant_rows_cols

    return quant_rows_cols(x, rowwise=rowwise, colwise=True, src=src)


def _fp8_weight(w: torch.Tensor):
    from moela.ops.moe.kernels.quantize_triton import quant_weights

    def compute(v):
        q, s, qt = quant_weights(v[None])
        return q[0], s[0], qt[0]  # [N, K], [N/128, K/128], [K, N]

    return weight_cache.cached(w, "fp8_blockwise", compute)


def _rows_padded(t: int) -> int:
    """M: the quantized activations' rows, T rounded up to a multiple of 128 (at least 128)."""
    return (max(t, 1) + 127) // 128 * 128


@torch.library.custom_op("moela::fp8_linear_fwd", mutates_args=())
def fp8_linear_fwd(x: torch.Tensor, weight: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] (bf16/fp16, contiguous) @ weight [N, K]^T -> (y [T, N] in x's dtype; for the backward: x's
    transposed column codes xqt [K, M] e4m3 and scales xst [K, M/128], the weight's scales ws [N/128, K/128] and
    transposed codes wqt [K, N]), M = T padded to 128. The weight's codes come from the per-step cache
    (`_fp8_weight`), looked up here, when the op runs, on the real parameter; its scales and transposed codes are
    handed to the backward as detached aliases of the cache's tensors (outputs may alias no input and no other
    output; a lookup in the backward would miss under CUDA-graph capture, where the cache is off)."""
    from moela.ops.moe.kernels.gemm_fp8_triton import mgrouped_fp8

    t = x.shape[0]
    src = _padded_rows(t, x.device)
    (xq, xs), (xqt, xst) = _quant_act(x, src)  # [M, K], [M, K/128]; [K, M], [K, M/128]
    wq, ws, wqt = _fp8_weight(weight)
    y = mgrouped_fp8(xq, xs, wq, ws, out_dtype=x.dtype)[:t]  # [T, N]
    return y, xqt.contiguous(), xst.contiguous(), ws.detach(), wqt.detach()


@fp8_linear_fwd.register_fake
def _fp8_linear_fwd_fake(x, weight):
    t, k = x.shape
    n = weight.shape[0]
    m = _rows_padded(t)
    e4m3, f32 = torch.float8_e4m3fn, torch.float32
    return (x.new_empty(t, n), x.new_empty(k, m, dtype=e4m3), x.new_empty(k, m // 128, dtype=f32),
            weight.new_empty(n // 128, k // 128, dtype=f32), weight.new_empty(k, n, dtype=e4m3))


@torch.library.custom_op("moela::fp8_linear_bwd", mutates_args=())
def fp8_linear_bwd(dy: torch.Tensor, xqt: torch.Tensor, xst: torch.Tensor, ws: torch.Tensor, wqt: torch.Tensor,
                   weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [T, K] in dy's dtype, dW [N, K] in the weight's dtype) from dy [T, N] (the forward's output dtype,
    contiguous) and the forward's saved codes; `weight` only gives dW's dtype."""
    from moela.ops.moe.kernels.gemm_fp8_triton import kgrouped_fp8, mgrouped_fp8

    t = dy.shape[0]
    (dyq, dys), (dyqt, dyst) = _quant_act(dy, _padded_rows(t, dy.device))  # [M, N]; [N, M]
    dx = mgrouped_fp8(dyq, dys, wqt, ws.t(), out_dtype=dy.dtype)[:t]  # [T, K]
    dw = kgrouped_fp8(dyqt, dyst, xqt, xst, out_dtype=weight.dtype)[0]  # [N, K]
    return dx, dw


@fp8_linear_bwd.register_fake
def _fp8_linear_bwd_fake(dy, xqt, xst, ws, wqt, weight):
    return dy.new_empty(dy.shape[0], xqt.shape[0]), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight = inputs
    _, xqt, xst, ws, wqt = output
    ctx.save_for_backward(xqt, xst, ws, wqt, weight)
    ctx.mark_non_differentiable(xqt, xst, ws, wqt)
    ctx.x_dtype = x.dtype


def _backward_rule(ctx, dy, *unused):
    xqt, xst, ws, wqt, weight = ctx.saved_tensors
    return fp8_linear_bwd(dy.to(ctx.x_dtype).contiguous(), xqt, xst, ws, wqt, weight)


fp8_linear_fwd.register_autograd(_backward_rule, setup_context=_setup_context)


def fp8_tileable(in_features: int, out_features: int) -> bool:
    """Whether the Triton kernels tile this layer (both feature counts multiples of 128)."""
    return in_features % 128 == 0 and out_features % 128 == 0


def traceable(x: torch.Tensor, weight: torch.Tensor, backend: str = "auto") -> bool:
    """Whether a compiled graph can hold `fp8_linear(x, weight, backend=backend)`: the Triton op pair, and on CUDA
    under `auto` also the bf16 linear of a layer the kernels cannot tile (MLA's kv_a at kv_lora_rank + rope = 320
    features in `small`: left outside, it was a graph break in every attention). The reference (the CPU under
    `auto`) runs outside. Decided from what does not change between a layer's calls: the backend and x's device."""
    return backend == "triton" or (backend == "auto" and x.is_cuda)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T in DeepSeek-V3's FP8 recipe -> [..., N] (x's dtype, or the autocast dtype).
    `auto`: `triton` on CUDA where the features tile and the GPU has FP8 tensor cores (else the bf16 linear),
    `reference` on CPU."""
    if backend not in FP8_LINEAR_BACKENDS:
        raise ValueError(f"fp8_linear: unknown backend {backend!r}; choose one of {', '.join(FP8_LINEAR_BACKENDS)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, weight {tuple(weight.shape)} wants {k}")
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if backend == "triton" and (problem := fp8_device_problem(x.device)):
        raise RuntimeError(f"fp8_linear backend 'triton': {problem}; use a bf16 linear, or backend='reference' "
                           f"(FP8 simulated in torch, slow)")
    if backend == "auto":
        if not x.is_cuda:
            backend = "reference"
        elif not fp8_tileable(k, n) or x.dtype not in (torch.bfloat16, torch.float16):
            return F.linear(x, weight.to(x.dtype))
        elif problem := fp8_device_problem(x.device):  # e.g. generating from an FP8 run on an A100
            _log_once(f"fp8_linear: the bf16 linear ({problem})")
            return F.linear(x, weight.to(x.dtype))
        else:
            backend = "triton"
    if backend == "triton":
        if not fp8_tileable(k, n):
            raise ValueError(f"fp8_linear backend 'triton' needs in and out features that are multiples of 128; got "
                             f"{k} -> {n}; use backend='auto' (bf16 for this layer) or 'reference'")
        with torch.autocast(x.device.type, enabled=False):
            y = fp8_linear_fwd(x2.contiguous(), weight)[0]
    else:
        with torch.autocast(x.device.type, enabled=False):
            y = fp8_linear_reference(x2, weight)
    return y.reshape(*lead, n)
