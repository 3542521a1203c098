"""DeepSeek-V3 Mixture-of-Experts FFN: sigmoid router with aux-loss-free balancing, group-limited top-k, routed
experts through `moe_experts`, shared experts, sequence-wise auxiliary loss per packed document.

Routing (per token, float32):
  s = sigmoid(x W_gate^T)                                     affinities [T, E]
  c = s + e_score_correction_bias                             used for SELECTION only
  group score = sum of the 2 largest c in each of n_group groups; keep the topk_group best groups
  topk_ids = top-K of c inside the kept groups
  topk_weights = s[topk_ids] (normalized to sum 1 if norm_topk_prob) * routed_scaling_factor
This is HF `DeepseekV3TopkRouter` / DeepSeek's `Gate` exactly (tested against transformers); everything after the
gate GEMM is one op, `moela.ops.router.router_topk` (one fused kernel on CUDA).

Decisions:
- `e_score_correction_bias` is an fp32 buffer (not a parameter: no gradient, no optimizer state). It changes only
  in `update_bias(load, rate)`, called by the trainer after each optimizer step with the expert load summed over
  the micro-batches and all-reduced over data / expert-parallel ranks: bias += rate * sign(mean(load) - load).
- Sequence-wise balance loss (DeepSeek-V3 eq. 17-20) is computed per DOCUMENT of the packed batch:
  f_i = E / (K * L_n) * #{t in n : i in topk(t)},  P_i = mean_{t in n} s_i,t / sum_j s_j,t,  L_n = sum_i f_i P_i,
  then weighted by the document's share of labelled tokens (doc_weight), so micro-batch splitting and gradient
  accumulation give the same objective. f is a count (no gradient); P carries the gradient to the router.
- `experts` is its own module (stacked `w13 [E, 2F, D]`, `w2 [E, D, F]`, forward(x, topk_ids, topk_weights,
  shared=None) -> routed output + shared(x)), so expert parallelism can replace it while keeping that contract;
  the shared experts are handed to it so that a replacement can run them while its collectives are in flight.
- The per-layer expert load (tokens per expert, float32, detached) is returned for logging and the bias update.

Shapes: T tokens, D hidden, E routed experts, K experts per token, G groups, F expert width, N documents.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from moela.model.config import ModelConfig
from moela.model.layers import MLP, PackedContext, call_op, call_outside_graph, linear_fp32, segment_sum
from moela.ops.moe import moe_experts
from moela.ops.moe.api import DISPATCH as MOE_DISPATCH
from moela.ops.router import router_topk


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.topk = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.empty(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (topk_ids [T, K] int64, topk_weights [T, K] float32, scores [T, E] float32)."""
        logits = linear_fp32(x, self.weight)  # [T, E]
        return router_topk(logits, self.e_score_correction_bias, n_group=self.n_group, topk_group=self.topk_group,
                           topk=self.topk, norm_topk_prob=self.norm_topk_prob, scaling=self.scaling)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float, enabled: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower it for over-loaded ones;
        a no-op where the 0-d tensor `enabled` is false (decided on the device)."""
        load = load.float().to(self.e_score_correction_bias.device)  # [E]
        step = torch.sign(load.mean() - load) * rate  # [E]
        if enabled is not None:
            step = step * enabled.to(step.device, step.dtype)
        self.e_score_correction_bias.add_(step)


class RoutedExperts(nn.Module):
    """The routed experts' stacked weights; forward is `moe_experts` (the contract expert parallelism keeps)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, f, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.recipe, self.backend = cfg.expert_recipe, cfg.moe_backend
        # our FP8 GEMMs' implementations (`model.kernels`), passed to every moe_experts call
        self.kernels = dict(fp8_gemm=cfg.kernels.moe_fp8_gemm, fp8_wgrad=cfg.kernels.moe_fp8_wgrad)
        self.w13 = nn.Parameter(torch.empty(e, 2 * f, d))  # rows [0, F): W1 (gate), [F, 2F): W3 (up)
        self.w2 = nn.Parameter(torch.empty(e, d, f))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                shared: nn.Module | None = None) -> torch.Tensor:
        y = call_op(moe_experts, MOE_DISPATCH, x, topk_ids, topk_weights, self.w13, self.w2, recipe=self.recipe,
                    backend=self.backend, **self.kernels)  # [T, D]
        return y if shared is None else y + shared(x)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.topk = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.balance = cfg.aux_loss_coef > 0
        self.gate = Gate(cfg)
        self.experts = RoutedExperts(cfg)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.fp8_linears)
                               if cfg.n_shared_experts > 0 else None)

    def balance_loss(self, topk_ids: torch.Tensor, scores: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        """Sequence-wise balance loss per document, weighted by doc_weight (see module docstring) -> []. The
        statistics count real tokens only (`ctx.real_tokens`) and are summed over the ranks holding parts of the
        same documents (`ctx.reduce_doc_stats`) first."""
        e, n = self.n_experts, ctx.num_docs
        hits = torch.zeros_like(scores).scatter_(1, topk_ids, 1.0)  # [T, E] 1 where the expert was chosen
        probs = scores / scores.sum(-1, keepdim=True)  # [T, E]
        count = torch.ones_like(scores[:, :1])  # [T, 1]
        if ctx.real_tokens is not None:
            count = ctx.real_tokens.to(scores.dtype)[:, None]
            hits, probs = hits * count, probs * count
        stats = torch.cat([segment_sum(v, ctx.doc_ids, n) for v in (hits, probs, count)], dim=1)  # [N, 2E + 1]
        if ctx.reduce_doc_stats is not None:
            stats = ctx.reduce_doc_stats(stats)  # whole documents
        lengths = stats[:, 2 * e:].clamp_min(1.0)  # [N, 1]; a document without real tokens (filler) weighs 0
        f = stats[:, :e] * (e / self.topk) / lengths  # [N, E]
        p = stats[:, e:2 * e] / lengths  # [N, E]
        return ((f * p).sum(-1) * ctx.doc_weight).sum()

    def expert_load(self, topk_ids: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        """Tokens routed to each expert, topk_ids [T, K] -> [E] float32 (no host sync); real tokens only
        (`ctx.real_tokens`)."""
        flat = topk_ids.reshape(-1)  # [T*K]
        real = ctx.real_tokens
        weight = (torch.ones_like(flat, dtype=torch.float32) if real is None
                  else real.float()[:, None].expand(topk_ids.shape).reshape(-1))  # [T*K]
        return torch.zeros(self.n_experts, device=topk_ids.device).index_add_(0, flat, weight)  # [E]

    def forward(self, x: torch.Tensor, ctx: PackedContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (y [T, D], balance loss [], expert load [E] float32 detached)."""
        topk_ids, topk_weights, scores = self.gate(x)  # [T, K], [T, K], [T, E]
        if isinstance(self.experts, RoutedExperts):
            y = self.experts(x, topk_ids, topk_weights, shared=self.shared_experts)  # [T, D] routed + shared
        else:  # a replacement (expert parallelism: collectives) runs outside compiled graphs
            y = call_outside_graph(self.experts, x, topk_ids, topk_weights, shared=self.shared_experts)  # [T, D]
        aux = self.balance_loss(topk_ids, scores, ctx) if self.balance else scores.new_zeros(())
        return y, aux, self.expert_load(topk_ids, ctx)
