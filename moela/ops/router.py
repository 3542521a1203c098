"""DeepSeek-V3 routing after the gate GEMM: `router_topk(logits, bias, ...)` -> (topk_ids, topk_weights, scores).

  s = sigmoid(logits)                                       affinities [T, E] float32
  c = s + bias                                              used for SELECTION only (no gradient)
  group score = sum of the 2 largest c in each of n_group groups; keep the topk_group best groups
  topk_ids = top-K of c inside the kept groups, in descending order of c
  topk_weights = s[topk_ids] (divided by their sum + 1e-20 if norm_topk_prob) * scaling
Gradients reach `logits` through `scores` (the balance loss reads them) and through `topk_weights`.

Backends:
- `reference`: the formulas above in torch (sigmoid, three top-k, masking, gather); the specification.
- `triton`: one kernel per block of tokens does all of the forward in registers: sigmoid, bias, the group scores
  (top-2 per group by two max passes), the kept groups and the K experts by repeated arg-max (K and topk_group are
  small), the weights and their normalization; it writes scores, ids and weights and nothing else. Its backward
  is a few fused elementwise torch ops (d weights through the normalization, scattered onto the K chosen scores,
  plus d scores, times s (1 - s)). It is a `torch.library` custom op with a fake implementation, so a compiled
  block keeps it in its graph (`traceable`). `auto` takes it for CUDA float32 logits; on CPU only by name, under
  TRITON_INTERPRET=1 (tests). Ties between equal scores may be broken differently from torch.topk (which does not
  specify its order either).

Shapes: T tokens, E routed experts, G groups, K experts per token.
"""

from __future__ import annotations

import torch

from moela.ops.backends import ROUTER_BACKENDS
from moela.ops.dispatch import Dispatch

DISPATCH = Dispatch("router_topk", ROUTER_BACKENDS, needs="triton")


def router_topk_reference(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, topk: int,
                          norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 for tests
    scores = logits.to(dtype).sigmoid()  # [T, E]
    choice = scores.detach() + bias.to(dtype)  # [T, E]
    if n_group > 1:
        t = choice.shape[0]
        grouped = choice.view(t, n_group, -1)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)  # [T, G]
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(t, -1)  # [T, E]
        choice = choice.masked_fill(~expert_mask, float("-inf"))  # [T, E]
    topk_ids = choice.topk(topk, dim=-1).indices  # [T, K]
    weights = scores.gather(1, topk_ids)  # [T, K]
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return topk_ids, weights * scaling, scores


def _check(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, topk: int) -> None:
    if logits.dim() != 2 or bias.shape != logits.shape[1:]:
        raise ValueError(f"router_topk wants logits [T, E] and bias [E]; got {tuple(logits.shape)}, "
                         f"{tuple(bias.shape)}")
    e = logits.shape[1]
    if n_group < 1 or e % n_group or not 1 <= topk_group <= n_group or (n_group > 1 and e // n_group < 2):
        raise ValueError(f"router_topk: {e} experts in n_group={n_group} groups keeping topk_group={topk_group}: "
                         f"n_group must divide E with >= 2 experts per group, 1 <= topk_group <= n_group")
    reachable = e if n_group == 1 else topk_group * (e // n_group)
    if not 1 <= topk <= reachable:
        raise ValueError(f"router_topk: topk={topk} experts cannot be chosen from {reachable} reachable ones")


def router_topk(logits: torch.Tensor, bias: torch.Tensor, *, n_group: int, topk_group: int, topk: int,
                norm_topk_prob: bool, scaling: float, backend: str = "auto"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, E] (float32 gate output), bias [E] float32 -> (topk_ids [T, K] int64, topk_weights [T, K]
    float32, scores [T, E] float32); differentiable in logits through weights and scores."""
    DISPATCH.check(backend)
    _check(logits, bias, n_group, topk_group, topk)
    args = (logits, bias, n_group, topk_group, topk, norm_topk_prob, float(scaling))
    chosen = DISPATCH.choose(backend, logits)
    if chosen == "reference":
        return router_topk_reference(*args)
    return DISPATCH.impl(chosen)(*args)


try:
    from moela.ops.router_triton import router_topk_triton, triton_auto
except ImportError:  # no Triton on this platform: the reference remains
    pass
else:
    DISPATCH.register("triton", router_topk_triton, auto=triton_auto, traceable=True)
