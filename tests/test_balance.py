"""Balanced DP assignment: a valid permutation, never worse than round-robin, deterministic, locally optimal,
and within 5% of perfect balance on realistic packed micro-batches; the cost model against independent counts."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factories import tiny_config
from moela.data.balance import (
    balanced_assign,
    cost_coefficients,
    imbalance,
    imbalance_report,
    microbatch_cost,
    rank_totals,
    round_robin_assign,
)
from moela.model.config import preset

costs_strategy = st.integers(1, 12).flatmap(
    lambda dp: st.integers(1, 8).flatmap(
        lambda ga: st.tuples(st.just(dp), st.just(ga),
                             st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=dp * ga,
                                      max_size=dp * ga))))


def _check_valid(assignment, dp, ga):
    assert len(assignment) == dp
    assert all(len(rank) == ga for rank in assignment)
    assert sorted(i for rank in assignment for i in rank) == list(range(dp * ga))


@settings(max_examples=300, deadline=None)
@given(costs_strategy)
def test_balanced_is_permutation_and_never_worse_than_round_robin(case):
    dp, ga, costs = case
    out = balanced_assign(costs, dp, ga)
    _check_valid(out, dp, ga)
    rr = round_robin_assign(costs, dp, ga)
    assert max(rank_totals(costs, out)) <= max(rank_totals(costs, rr)) * (1 + 1e-9) + 1e-9
    assert out == balanced_assign(list(costs), dp, ga)


@settings(max_examples=150, deadline=None)
@given(costs_strategy)
def test_no_improving_swap_left_and_micro_steps_largest_first(case):
    dp, ga, costs = case
    out = balanced_assign(costs, dp, ga)
    if out == round_robin_assign(costs, dp, ga):
        return
    for rank in out:
        assert [costs[i] for i in rank] == sorted((costs[i] for i in rank), reverse=True)
    totals = rank_totals(costs, out)
    top = max(range(dp), key=lambda r: (totals[r], -r))
    for i in out[top]:
        for s in range(dp):
            for j in out[s]:
                d = costs[i] - costs[j]
                if s != top and d > 0:
                    assert max(totals[top] - d, totals[s] + d) >= totals[top] * (1 - 1e-9)


def _pack(rng: random.Random, budget: int, n: int) -> list[list[int]]:
    """Greedy packing of long-tailed documents (lognormal lengths, capped at the budget) into micro-batches."""
    batches, cur, used = [], [], 0
    while len(batches) < n:
        length = min(budget, max(2, int(rng.lognormvariate(6.5, 1.4))))
        if used + length > budget:
            batches.append(cur + [budget - used] if budget > used else cur)
            cur, used = [], 0
        cur.append(length)
        used += length
    return batches


@pytest.mark.parametrize("dp,ga,budget", [(8, 8, 16384), (32, 8, 32768), (8, 16, 65536)])
def test_realistic_packed_batches_reach_target(dp, ga, budget):
    rng = random.Random(dp * 1000 + ga)
    a, b = 6.0 * 1.5e8, 8.0 * 16 * (4 * 192 + 3 * 128)
    worst_after = 0.0
    for _ in range(5):
        costs = [microbatch_cost(docs, a, b) for docs in _pack(rng, budget, dp * ga)]
        rep = imbalance_report(costs, dp, ga, balanced_assign(costs, dp, ga))
        assert rep["after"] <= rep["before"] + 1e-12
        worst_after = max(worst_after, rep["after"])
    assert worst_after <= 1.05


def test_assignment_identical_in_a_fresh_process():
    rng = random.Random(7)
    costs = [rng.random() * 100 for _ in range(6 * 5)]
    code = ("import sys, json; from moela.data.balance import balanced_assign; "
            "print(json.dumps(balanced_assign(json.loads(sys.argv[1]), 6, 5)))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(costs)], check=True, capture_output=True,
                         text=True).stdout
    assert json.loads(out) == balanced_assign(costs, 6, 5)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="dp_size=2 x grad_accum=3"):
        balanced_assign([1.0] * 5, 2, 3)
    with pytest.raises(ValueError, match=">= 1"):
        round_robin_assign([], 0, 1)


def test_microbatch_cost_matches_float64_reference():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 5000, size=37)
    a, b = 1234.5, 6.75
    ref = a * lengths.astype(np.float64).sum() + b * (lengths.astype(np.float64) ** 2).sum()
    assert microbatch_cost(lengths.tolist(), a, b) == pytest.approx(ref, rel=1e-12)
    assert imbalance([1.0, 3.0], [[0], [1]]) == pytest.approx(1.5)


def attention_training_flops(length: int, heads: int, dqk: int, dv: int) -> float:
    """One layer's causal attention over one document, forward + backward, as BENCHMARKS.md counts them: forward
    2*H*L^2*(Dqk+Dv), backward 2*H*L^2*(3*Dqk+2*Dv), each halved for causal masking."""
    fwd = 2 * heads * length**2 * (dqk + dv) / 2
    bwd = 2 * heads * length**2 * (3 * dqk + 2 * dv) / 2
    return fwd + bwd


def test_cost_coefficients_count_every_linear_weight():
    """a / 6 equals the weights one token multiplies, counted from real nn.Linear shapes of an MLA + MoE layer."""
    import torch.nn as nn
    cfg = tiny_config(hidden_size=48, num_attention_heads=3, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=12, q_lora_rank=20, kv_lora_rank=24, num_hidden_layers=3, first_k_dense_replace=1,
                      intermediate_size=96, moe_intermediate_size=32, n_routed_experts=6, num_experts_per_tok=2,
                      n_shared_experts=1, vocab_size=101, num_nextn_predict_layers=1, n_group=1, topk_group=1)
    d, h, dqk = 48, 3, 24

    def attn():
        return [nn.Linear(d, 20), nn.Linear(20, h * dqk), nn.Linear(d, 24 + 8), nn.Linear(24, h * (16 + 12)),
                nn.Linear(h * 12, d)]

    def dense():
        return [nn.Linear(d, 96), nn.Linear(d, 96), nn.Linear(96, d)]

    def moe_active():  # router + (2 routed + 1 shared) SwiGLU experts
        return [nn.Linear(d, 6)] + [nn.Linear(d, 32), nn.Linear(d, 32), nn.Linear(32, d)] * 3

    head = [nn.Linear(d, 101)]
    mods = attn() * 3 + dense() + moe_active() * 2 + head
    mods += [nn.Linear(2 * d, d)] + attn() + moe_active() + head  # the MTP module
    weights = sum(m.weight.numel() for m in mods)
    a, b = cost_coefficients(cfg)
    assert a == 6.0 * weights
    assert b * 100**2 == pytest.approx((3 + 1) * attention_training_flops(100, h, dqk, 12))
    with pytest.raises(ValueError, match="no field 'num_attention_heads'"):
        cost_coefficients(SimpleNamespace(hidden_size=4))


def _loader(cache, rank, dp, ga, assign):
    from moela.data.stream import TrainLoader
    return TrainLoader([cache], [1.0], tokens_per_microbatch=96, max_doc_len=None, dp_rank=rank, dp_size=dp,
                       grad_accum=ga, seed=5, shuffle=True, assign=assign, cost_coefficients=(1.0, 1 / 16),
                       settings={"tokens_per_microbatch": 96}, val_fraction=0.0, val_max_tokens=0)


def test_loader_with_balanced_assign_covers_the_step_and_resumes(tmp_path):
    """Through the real loader: the ranks' balanced micro-batches are exactly the round-robin ones, regrouped;
    the reported imbalance never rises; a resumed loader continues identically."""
    from moela.data.cache import ShardWriter, TokenCache, finish_cache
    lengths = np.random.default_rng(2).integers(1, 90, size=60)
    (tmp_path / "c").mkdir()
    writer = ShardWriter(tmp_path / "c", 0, np.uint32)
    writer.write(np.arange(lengths.sum(), dtype=np.uint32))
    writer.end_docs(lengths)
    writer.commit()
    finish_cache(tmp_path / "c", "c", 1, {})
    cache = TokenCache(tmp_path / "c")
    dp, ga = 3, 4
    balanced = [_loader(cache, r, dp, ga, balanced_assign) for r in range(dp)]
    plain = [_loader(cache, r, dp, ga, round_robin_assign) for r in range(dp)]
    for _ in range(3):
        got = [tuple(b.input_ids.tolist()) for ld in balanced for b in ld.next_step()]
        want = [tuple(b.input_ids.tolist()) for ld in plain for b in ld.next_step()]
        assert sorted(got) == sorted(want)
        rep = balanced[0].last_imbalance
        assert rep["after"] <= rep["before"] + 1e-12
    state = json.loads(json.dumps(balanced[1].state_dict()))
    expected = [[b.input_ids.tolist() for b in balanced[1].next_step()] for _ in range(2)]
    resumed = _loader(cache, 1, dp, ga, balanced_assign)
    resumed.load_state_dict(state)
    assert [[b.input_ids.tolist() for b in resumed.next_step()] for _ in range(2)] == expected


@pytest.mark.parametrize("size", ["tiny", "small", "v2-lite", "v3"])
def test_linear_coefficient_agrees_with_the_model_flop_count(size):
    """`a` equals the model's own (independently written) training FLOPs per token without attention."""
    from moela.model import flops_per_token
    cfg = preset(size)
    a, b = cost_coefficients(cfg)
    assert a == flops_per_token(cfg, 0)
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    length = 777
    assert b * length**2 == pytest.approx(layers * attention_training_flops(
        length, cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim), rel=1e-12)
