"""The reference of `moe_experts`: pure torch, any device, a loop over experts in float32; the specification.

With `recipe="fp8_blockwise"` it simulates DeepSeek-V3's FP8 recipe (e4m3, activations 1x128 groups, weights
128x128 blocks) by quantize -> dequantize around each GEMM, so fast kernels can be compared against it with the
same scales.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moela.ops.moe.quant_spec import fake_quant_1x128, fake_quant_128x128


def moe_experts_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                          w2: torch.Tensor, *, recipe: str = "bf16") -> torch.Tensor:
    """Loop over experts in float32 (simulated FP8 for the fp8 recipe). Differentiable in x, weights, w13, w2."""
    t, d = x.shape
    e, two_f, _ = w13.shape
    f = two_f // 2
    fp8 = recipe == "fp8_blockwise"
    flat_ids = topk_ids.reshape(-1)  # [T*K]
    token_of = torch.arange(t, device=x.device).repeat_interleave(topk_ids.shape[1])  # [T*K]
    gate = topk_weights.reshape(-1).float()  # [T*K]
    y = torch.zeros(t, d, device=x.device, dtype=torch.float32)
    for ex in range(e):
        rows = (flat_ids == ex).nonzero(as_tuple=True)[0]
        if rows.numel() == 0:
            continue
        xe = x[token_of[rows]].float()  # [M, D]
        a, b = w13[ex].float(), w2[ex].float()  # [2F, D], [D, F]
        if fp8:
            xe, a, b = fake_quant_1x128(xe), fake_quant_128x128(a), fake_quant_128x128(b)
        h = xe @ a.t()  # [M, 2F]
        act = F.silu(h[:, :f]) * h[:, f:]  # [M, F]
        if fp8:
            act = fake_quant_1x128(act)
        y = y.index_add(0, token_of[rows], (act @ b.t()) * gate[rows, None])  # [M, D]
    return y.to(x.dtype)
