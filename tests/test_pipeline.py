"""Pipeline parallelism on CPU (gloo): every schedule's step equals the one-process step (loss, every gradient, five
optimizer steps of weights and router biases; also x FSDP2, x EP, x TP, x CP), the layout grammar and its errors,
the schedules' completeness and bubble on the cost model, the transport's message counts, FSDP2's one gradient
reduction per unit and step.

Tolerance: the pipelined step sums the same terms in another order (stage shares of the loss, gradient
accumulation across stages), so values agree to float32 rounding: 2e-5 relative on losses, 1e-5 + 1e-4 relative on
gradients and weights.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_param_group

from factories import VISIBLE_TRAINING, tiny_config
from moela.config import ConfigError, load_config
from moela.parallel.config import ParallelConfig
from moela.parallel.pp_layout import layout_string, parse_layout, stage_layout, stage_ranks
from moela.parallel.pp_schedules import Overlap, schedule_actions, simulate
from parallel_harness import spawn
from pp_harness import pipelined, reference

SCHEDULES = [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2)]


def _check(rank, world, cfg, pcfg, ref, steps, counts_expected=None, overlap=True):
    counts = {} if counts_expected is not None else None
    losses, grads, metrics, state = pipelined(cfg, pcfg, world, steps, initial=ref[4], counts=counts,
                                              overlap=overlap)
    assert losses == pytest.approx(ref[0], rel=2e-5)
    for key, value in metrics[0].items():
        assert value == pytest.approx(ref[2][0][key], rel=2e-5, abs=1e-7), key
    assert grads, "this rank holds no parameters"
    for name, g in grads.items():
        torch.testing.assert_close(g, ref[1][name], rtol=1e-4, atol=1e-5, msg=name)
    for name, v in state.items():
        torch.testing.assert_close(v, ref[3][name], rtol=1e-4, atol=1e-5, msg=name)
    if counts_expected is not None:
        assert counts == counts_expected[rank]


def _run(schedule, v, world, *, pp=2, m=4, steps=2, model=None, extra=None, counts=None, overlap=True):
    cfg = tiny_config(**{"num_hidden_layers": 4, **VISIBLE_TRAINING, **(model or {})})
    extra = extra or {}
    dp = world // pp // extra.get("tp", 1) // extra.get("cp", 1)
    pcfg = ParallelConfig(pp=pp, pp_schedule=schedule, pp_virtual_stages=v, pp_microbatches=m, dp_shard=dp, **extra)
    ref = reference(cfg, m * dp, steps)
    spawn(_check, world, cfg, pcfg, ref, steps, counts, overlap)


@pytest.mark.parametrize("schedule,v", [SCHEDULES[0], SCHEDULES[3],
                                        *(pytest.param(*s, marks=pytest.mark.slow) for s in SCHEDULES[1:3])])
def test_two_stages_equal_one_process(schedule, v):
    _run(schedule, v, 2, steps=5)


def test_dualpipev_pairs_forward_then_backward_equal_the_overlap_function():
    """The runtime's plain pair (forward, then backward) against the same reference as the overlap function's
    (test_two_stages_equal_one_process[dualpipev]); on the CPU the function keeps the order, so both must agree
    with the one-process step, and with each other."""
    _run("dualpipev", 2, 2, overlap=False)


def test_without_mtp_and_z_loss():
    _run("1f1b", 1, 2, model=dict(num_nextn_predict_layers=0, z_loss_coef=1e-3))


def test_message_counts_per_micro_batch_and_stage():
    """1f1b, pp=2, 4 micro-batches: each micro-batch sends its 2 wire tensors (h, the MTP embedding) forward and
    their 2 gradients back, once per stage edge; nothing else crosses (dtypes travel once, uncounted)."""
    _run("1f1b", 1, 2, steps=1, counts=[{"send": 8, "recv": 8}, {"send": 8, "recv": 8}])


@pytest.mark.slow
@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_four_stages_equal_one_process(schedule, v):
    _run(schedule, v, 4, pp=4, m=8, model=dict(num_hidden_layers=6) if v == 2 else None)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_two_stages_times_fsdp(schedule, v):
    _run(schedule, v, 4)


def _check_bf16(rank, world, cfg, pcfg, ref, autocast):
    losses, grads, _, _ = pipelined(cfg, pcfg, world, 1, initial=ref[4], autocast=autocast)
    assert losses == pytest.approx(ref[0], rel=1e-3)
    for name, g in grads.items():
        err = float((g - ref[1][name]).norm() / ref[1][name].norm().clamp_min(1e-12))
        assert err < 1e-2, (name, err)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), pytest.param("zbv", 2, marks=pytest.mark.slow),
                                        pytest.param("dualpipev", 2, marks=pytest.mark.slow)])
def test_two_stages_times_fsdp_under_bf16_autocast(schedule, v):
    """pp=2 x dp_shard=2 under bf16 autocast (each forward in its own context) against the one-process step under
    the same autocast: bf16 rounding only (1e-2 of each gradient's norm; an autocast context around the whole
    step loses about a third of the weight gradients here). DualPipeV with two layers a stage: its pairs run the
    backward's block segments from inside the other chunk's autocast forward."""
    cfg = tiny_config(**{"num_hidden_layers": 8 if schedule == "dualpipev" else 4, **VISIBLE_TRAINING})
    pcfg = ParallelConfig(pp=2, pp_schedule=schedule, pp_virtual_stages=v, pp_microbatches=4, dp_shard=2)
    autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    spawn(_check_bf16, 4, cfg, pcfg, reference(cfg, 8, 1, autocast=autocast), autocast)


def _check_one_reduce_scatter_per_unit(rank, world, cfg, pcfg, ref, steps, counts_expected, overlap):
    """_check, counting FSDP2's gradient reductions (one `foreach_reduce` per unit's parameter group and call)."""
    calls = Counter()
    reduce = fsdp_param_group.foreach_reduce

    def counted(fsdp_params, *args, **kwargs):
        calls[id(fsdp_params[0])] += 1  # one key per unit
        return reduce(fsdp_params, *args, **kwargs)

    fsdp_param_group.foreach_reduce = counted  # this spawned rank's own module, gone with its process
    _check(rank, world, cfg, pcfg, ref, steps, counts_expected, overlap)
    assert calls and set(calls.values()) == {steps}, calls


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), pytest.param("zbv", 2, marks=pytest.mark.slow),
                                        pytest.param("dualpipev", 2, marks=pytest.mark.slow)])
def test_fsdp_reduce_scatters_once_per_unit_and_step(schedule, v):
    """pp=2 x dp_shard=2, 4 micro-batches: each FSDP unit reduce-scatters its gradients once a step (by its stage's
    last B or W), the step still equal to the one-process step."""
    cfg = tiny_config(**{"num_hidden_layers": 4, **VISIBLE_TRAINING})
    pcfg = ParallelConfig(pp=2, pp_schedule=schedule, pp_virtual_stages=v, pp_microbatches=4, dp_shard=2)
    spawn(_check_one_reduce_scatter_per_unit, 4, cfg, pcfg, reference(cfg, 8, 2), 2, None, True)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("dualpipev", 2)])
def test_two_stages_times_expert_parallel(schedule, v):
    _run(schedule, v, 4, extra=dict(ep=2))


@pytest.mark.slow
def test_dualpipev_pairs_with_the_exact_all_to_all():
    """Two layers a stage, so the pairs interleave blocks whose exact all-to-all (host-read split sizes) runs in
    both the forward and the backward segments: the same order on both expert ranks, the one-process result."""
    _run("dualpipev", 2, 4, m=4, model=dict(num_hidden_layers=8), extra=dict(ep=2, ep_dispatch="alltoall"))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [dict(tp=2), dict(cp=2)])
def test_two_stages_times_tensor_or_context_parallel(extra):
    _run("1f1b", 1, 4, extra=extra, model=dict(vocab_size=98))


def test_layout_grammar_and_balance():
    cfg = tiny_config(num_hidden_layers=6)
    assert layout_string(parse_layout("Et|(tt|)*2tmL", 6, 1, 4)) == "Et|tt|tt|tmL"
    assert layout_string(parse_layout("E t*3 | t*3 m L", 6, 1, 2)) == "Ettt|tttmL"
    # the head + loss + MTP depth cost more than two of these layers: the last stage gets fewer layers
    assert layout_string(stage_layout(cfg, 2, 1, None)) == "Etttt|ttmL"
    assert stage_ranks(2, 2, "zbv") == [0, 1, 1, 0] and stage_ranks(2, 2, "interleaved_1f1b") == [0, 1, 0, 1]


@pytest.mark.parametrize("layout,problem", [
    ("Ett|ttmL", "has 4 't'"), ("tEt|ttttmL", "'E' must open"), ("Etttt|mL|tt", "3 stages"),
    ("Ettt||tttmL", "3 stages"), ("EtttmL|ttt", "last stage"), ("Ettt|tttmLx", "unknown characters")])
def test_layout_errors_name_the_fix(layout, problem):
    with pytest.raises(ValueError, match=problem) as info:
        parse_layout(layout, 6, 1, 2)
    assert "leave parallel.pp_layout empty" in str(info.value)


@pytest.mark.parametrize("override,problem", [
    (["parallel.pp_schedule=dualpipev", "train.grad_accum=3"], "needs >= 4 micro-batches"),
    (["parallel.pp_schedule=1f1b", "parallel.pp_virtual_stages=2"], "1f1b runs one stage per rank"),
    (["model.tie_word_embeddings=true"], "tied embeddings"),
    (["parallel.pp_layout=Et|tL"], "pp_layout"),
])
def test_recipe_errors_at_load_time(override, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(None, ["parallel.pp=2", "train.grad_accum=4", *override])


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16)])
@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_schedules_complete_and_bubble_formula(schedule, v, pp, m):
    """Every (stage, micro-batch) runs F once and B once (or I and W once); the cost model's bubble equals the
    formula of the module docstring: per chunk F=1, B=2 (I=W=1) for the 1F1B family, F=I=W=1/2 on the V."""
    ranks = schedule_actions(schedule, pp, m, v)
    stages = pp * v
    seen = Counter((a.kind, a.stage, a.mb) for ops in ranks for step in ops
                   for a in (step if isinstance(step, Overlap) else [step]))
    for s in range(stages):
        for mb in range(m):
            assert seen[("F", s, mb)] == 1
            assert seen[("B", s, mb)] + seen[("I", s, mb)] == 1 and seen[("W", s, mb)] == seen[("I", s, mb)]
    if schedule in ("zbv", "dualpipev"):
        f, b, w = 0.5, 1.0, 0.5
        bubble = (pp - 1) * (f + b - 2 * w) if schedule == "zbv" else (pp - 1) * ((f + b) + b - 3 * w)
    else:
        f, b, w = 1.0, 2.0, 1.0
        bubble = (pp - 1) * (f + b)
    result = simulate(ranks, {"F": f, "B": b, "I": b - w, "W": w}, stages)
    work = m * v * (f + b)
    assert result["makespan"] == pytest.approx(work + bubble)
