"""Cost-balanced assignment of one optimizer step's micro-batches to data-parallel ranks and micro-steps.

With packed documents, equal token counts are not equal work: the linear layers cost the same per token, but
causal attention over a document of L tokens costs ~L^2. A micro-batch holding documents of lengths L_1..L_N costs

    cost = a * sum(L_i) + b * sum(L_i^2)

in training FLOPs (forward + backward), with the coefficients taken from the model config (`cost_coefficients`):

- `a` = 6 x (weights each token multiplies in linear layers): every attention projection (wq_a / wq_b or wq,
  wkv_a, wkv_b, wo), the dense MLPs, the router plus the top-k routed and the shared experts of each MoE layer,
  the output head, and the same for each multi-token-prediction module. 6 = 2 (multiply-add) x 3 (forward, input
  gradient, weight gradient).
- `b` = attention FLOPs per token pair, with the causal half folded in: a document has ~L^2/2 visible pairs; per
  pair and head the forward does 2*(Dqk + Dv) FLOPs (q.k and p.v) and the backward 2*(3*Dqk + 2*Dv) (dS, dQ, dK,
  dP, dV), so the L^2 coefficient is layers x heads x (4*Dqk + 3*Dv).

Assignment (`balanced_assign`), deterministic and communication-free (every rank computes it from the same costs,
which the loader derives from (seed, step)); it keeps no state, so resuming the loader resumes it exactly:

1. LPT with a cardinality limit: take the `dp_size * grad_accum` micro-batches largest cost first (ties by index)
   and give each to the rank with the smallest running total (ties by rank) among those holding fewer than
   `grad_accum`.
2. Refine: while swapping one micro-batch of the most loaded rank with one of another rank lowers the larger of
   the two ranks' totals, apply the best such swap (the sum of squared totals falls strictly at each swap, so
   this terminates; a cap bounds the work).
3. If the result's max rank total is still above the round-robin assignment's, return round-robin: by the cost
   model, balancing never makes a step costlier than not balancing.
4. Each rank runs its micro-batches largest first. When ranks synchronize inside every micro-step (FSDP
   all-gathers / reduce-scatters), the step takes sum_m max_r cost(r, m); sorting every rank's list lines the
   large micro-batches up in the same micro-steps, which keeps that sum close to the balanced total
   (`lockstep_imbalance` measures it).

The result lists, per rank, the micro-batch indices in micro-step order (the same signature as the round-robin
`assign` the loader uses without balancing). With `grad_accum == 1` each rank holds exactly one micro-batch and
no assignment can balance better than the packing itself.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

_EPS = 1e-12


def _field(cfg: Any, name: str, default: Any = None) -> Any:
    value = getattr(cfg, name, default)
    if value is None:
        raise ValueError(f"cost_coefficients: the model config has no field {name!r}; pass a DeepSeek-style "
                         f"ModelConfig (moela.model.config) or give the coefficients a, b explicitly")
    return value


def cost_coefficients(model_cfg: Any) -> tuple[float, float]:
    """(a, b) of `microbatch_cost` in training FLOPs for a `moela.model.config.ModelConfig` (HF deepseek_v3 key
    names; see the module docstring for what is counted)."""
    d = _field(model_cfg, "hidden_size")
    h = _field(model_cfg, "num_attention_heads")
    nope, rope, dv = (_field(model_cfg, n) for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    dqk = nope + rope
    q_lora = getattr(model_cfg, "q_lora_rank", None) or 0
    kv_lora = _field(model_cfg, "kv_lora_rank")
    n_layers = _field(model_cfg, "num_hidden_layers")
    n_dense = min(_field(model_cfg, "first_k_dense_replace", 0), n_layers)
    mtp = getattr(model_cfg, "num_nextn_predict_layers", 0) or 0
    vocab = _field(model_cfg, "vocab_size")

    attn = (d * q_lora + q_lora * h * dqk) if q_lora > 0 else d * h * dqk
    attn += d * (kv_lora + rope) + kv_lora * h * (nope + dv) + h * dv * d
    dense_ffn = 3 * d * _field(model_cfg, "intermediate_size")
    moe_ffn = 0
    if n_dense < n_layers:
        active = _field(model_cfg, "num_experts_per_tok") + (getattr(model_cfg, "n_shared_experts", 0) or 0)
        moe_ffn = d * _field(model_cfg, "n_routed_experts") + active * 3 * d * _field(model_cfg,
                                                                                        "moe_intermediate_size")
    per_token = n_layers * attn + n_dense * dense_ffn + (n_layers - n_dense) * moe_ffn + d * vocab
    # each MTP module: projection of [hidden; embedding] (2D -> D), one block like the last layer, the head
    per_token += mtp * (2 * d * d + attn + (moe_ffn if n_dense < n_layers else dense_ffn) + d * vocab)
    a = 6.0 * per_token
    b = float((n_layers + mtp) * h * (4 * dqk + 3 * dv))
    return a, b


def microbatch_cost(doc_lengths: Sequence[int], a: float, b: float) -> float:
    """a * sum(L) + b * sum(L^2) over the micro-batch's documents (lengths in tokens)."""
    s1 = 0
    s2 = 0
    for length in doc_lengths:
        length = int(length)
        s1 += length
        s2 += length * length
    return a * s1 + b * s2


def round_robin_assign(costs: Sequence[float], dp_size: int, grad_accum: int) -> list[list[int]]:
    """The unbalanced assignment: micro-batch m * dp_size + r is rank r's micro-step m."""
    _check(costs, dp_size, grad_accum)
    return [[m * dp_size + r for m in range(grad_accum)] for r in range(dp_size)]


def balanced_assign(costs: Sequence[float], dp_size: int, grad_accum: int) -> list[list[int]]:
    """Per rank, the indices of its `grad_accum` micro-batches in micro-step order, balancing rank totals."""
    _check(costs, dp_size, grad_accum)
    c = np.asarray(costs, dtype=np.float64)  # [n]
    owner = np.empty(len(c), dtype=np.int64)  # [n] -> rank
    held = [0] * dp_size
    open_ranks = [(0.0, r) for r in range(dp_size)]  # heap of (running total, rank) with room left
    for i in sorted(range(len(c)), key=lambda i: (-c[i], i)):
        load, r = heapq.heappop(open_ranks)
        owner[i] = r
        held[r] += 1
        if held[r] < grad_accum:
            heapq.heappush(open_ranks, (load + float(c[i]), r))
    loads = np.bincount(owner, weights=c, minlength=dp_size).astype(np.float64)  # [ranks]
    _refine(c, owner, loads)
    rr = round_robin_assign(costs, dp_size, grad_accum)
    if loads.max() > max(rank_totals(costs, rr)) * (1 + _EPS):
        return rr
    return [sorted(np.flatnonzero(owner == r).tolist(), key=lambda i: (-c[i], i)) for r in range(dp_size)]


def _refine(c: np.ndarray, owner: np.ndarray, loads: np.ndarray) -> None:
    """In-place swaps between the most loaded rank and another one (step 2 of the module docstring)."""
    if len(loads) < 2:
        return
    for _ in range(8 * len(c)):
        top = int(np.argmax(loads))
        mine = np.flatnonzero(owner == top)  # [grad_accum]
        delta = c[mine][:, None] - c[None, :]  # [grad_accum, n]: what moves from `top` to the other's rank
        new_pair_max = np.maximum(loads[top] - delta, loads[owner][None, :] + delta)
        ok = (delta > 0) & (new_pair_max < loads[top] * (1 - _EPS)) & (owner != top)[None, :]
        if not ok.any():
            return
        i, j = np.unravel_index(int(np.argmin(np.where(ok, new_pair_max, np.inf))), ok.shape)
        i, s = mine[i], owner[j]
        d = c[i] - c[j]
        owner[i], owner[j] = s, top
        loads[top] -= d
        loads[s] += d


def _check(costs: Sequence[float], dp_size: int, grad_accum: int) -> None:
    if dp_size < 1 or grad_accum < 1:
        raise ValueError(f"assign: dp_size and grad_accum must be >= 1, got {dp_size} and {grad_accum}")
    if len(costs) != dp_size * grad_accum:
        raise ValueError(f"assign: got {len(costs)} micro-batch costs for dp_size={dp_size} x "
                         f"grad_accum={grad_accum}; the loader must build dp_size * grad_accum micro-batches per step")


def rank_totals(costs: Sequence[float], assignment: list[list[int]]) -> list[float]:
    return [float(sum(costs[i] for i in rank)) for rank in assignment]


def imbalance(costs: Sequence[float], assignment: list[list[int]]) -> float:
    """max / mean of the ranks' total cost (1.0 = perfect); the step time's excess when ranks sync once per step."""
    totals = rank_totals(costs, assignment)
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean > 0 else 1.0


def lockstep_imbalance(costs: Sequence[float], assignment: list[list[int]]) -> float:
    """sum over micro-steps of the slowest rank's cost, / mean rank total: the excess when ranks sync every
    micro-step (FSDP collectives inside each micro-step)."""
    totals = rank_totals(costs, assignment)
    mean = sum(totals) / len(totals)
    steps = len(assignment[0])
    slowest = sum(max(costs[rank[m]] for rank in assignment) for m in range(steps))
    return slowest / mean if mean > 0 else 1.0


def imbalance_report(costs: Sequence[float], dp_size: int, grad_accum: int,
                     chosen: list[list[int]]) -> dict[str, float]:
    """What the loader exposes as `last_imbalance`: max/mean rank cost before (round-robin) and after."""
    return {"before": imbalance(costs, round_robin_assign(costs, dp_size, grad_accum)),
            "after": imbalance(costs, chosen)}
