"""moela's AdamW with bf16 moments (moela.trainer.adamw_moments) against independent references: torch's AdamW for
fp32 moments, a float64 AdamW that rounds the moments to bf16 after every step for bf16 ones; the Triton kernel
(interpreter on CPU) against the torch path; skipping on the device flag; state dicts across both optimizers; the
trainer with `optim.moment_dtype: bfloat16`."""

from __future__ import annotations

import math

import pytest
import torch

from moela.trainer import adamw_moments
from moela.trainer.adamw_moments import AdamWMoments

SHAPES = [(37, 5), (129,), (3, 7, 11), (2050,)]  # the last one spans two kernel blocks
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) * (0.5 + step) for s in SHAPES]


def _set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()


@pytest.fixture(params=["torch", "kernel"])
def path(request, monkeypatch):
    """The torch path, or the Triton kernel (needs CUDA or TRITON_INTERPRET=1 to run on these CPU tensors)."""
    if request.param == "kernel":
        if not adamw_moments.INTERPRET:
            pytest.skip("the Triton kernel runs on CPU tensors only under TRITON_INTERPRET=1")
    else:
        monkeypatch.setattr(adamw_moments, "INTERPRET", False)
    return request.param


def test_float32_moments_equal_torch_adamw(path):
    ref, got = _params(), _params()
    opt_ref = torch.optim.AdamW(ref, foreach=False, **HYPER)
    opt_got = AdamWMoments(got, moment_dtype="float32", **HYPER)
    for step in range(4):
        _set_grads(ref, _grads(step))
        _set_grads(got, _grads(step))
        opt_ref.step()
        opt_got.step()
    for p, q in zip(ref, got):
        torch.testing.assert_close(q, p, rtol=2e-6, atol=2e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt_got.state[q][key], opt_ref.state[p][key], rtol=2e-6, atol=1e-7)
        assert float(opt_got.state[q]["step"]) == 4


def test_bf16_moments_against_float64_adamw_that_rounds_its_moments(path):
    """The float64 reference rounds m and v to bf16 after each update (what is stored), and updates the
    parameter with the unrounded ones; the optimizer computes in fp32, so they agree to fp32 rounding, except
    where fp32 and float64 values straddle a bf16 rounding boundary (rare: compared by relative norm)."""
    params = _params()
    opt = AdamWMoments(params, moment_dtype="bfloat16", **HYPER)
    ref = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(p) for p in ref]
    v = [torch.zeros_like(p) for p in ref]
    b1, b2 = HYPER["betas"]
    for step in range(1, 6):
        grads = _grads(step)
        _set_grads(params, grads)
        opt.step()
        for i, g in enumerate(grads):
            g = g.double()
            mi = m[i] + (g - m[i]) * (1 - b1)
            vi = v[i] * b2 + (1 - b2) * g * g
            ref[i] = ref[i] * (1 - HYPER["lr"] * HYPER["weight_decay"])
            denom = vi.sqrt() / math.sqrt(1 - b2 ** step) + HYPER["eps"]
            ref[i] = ref[i] - HYPER["lr"] / (1 - b1 ** step) * mi / denom
            m[i], v[i] = mi.bfloat16().double(), vi.bfloat16().double()
    for p, r, mi, vi in zip(params, ref, m, v):
        st = opt.state[p]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16 and p.dtype == torch.float32
        assert ((p.double() - r).norm() / r.norm()).item() < 1e-6
        for got, want in ((st["exp_avg"], mi), (st["exp_avg_sq"], vi)):
            assert ((got.double() - want).norm() / want.norm()).item() < 2e-3  # a bf16 step where fp32 rounded across


def test_a_flagged_step_changes_nothing_and_is_not_counted(path):
    params = _params()
    opt = AdamWMoments(params, moment_dtype="bfloat16", **HYPER)
    _set_grads(params, _grads(0))
    opt.step()
    before = [p.detach().clone() for p in params]
    moments = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    opt.found_inf = torch.ones(())
    _set_grads(params, [g * float("nan") for g in _grads(1)])
    opt.step()
    for p, b, mo in zip(params, before, moments):
        assert torch.equal(p, b) and torch.equal(opt.state[p]["exp_avg_sq"], mo) and float(opt.state[p]["step"]) == 1
    opt.found_inf = torch.zeros(())
    _set_grads(params, _grads(1))
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(params, before))
    assert all(float(opt.state[p]["step"]) == 2 for p in params)


def test_state_dicts_cross_between_torch_adamw_and_bf16_moments():
    """A torch AdamW state loads into bf16 moments (rounded once) and back; bf16 -> fp32 -> bf16 is exact."""
    params = _params()
    torch_opt = torch.optim.AdamW(params, foreach=False, **HYPER)
    _set_grads(params, _grads(0))
    torch_opt.step()
    ours = AdamWMoments(params, moment_dtype="bfloat16", **HYPER)
    ours.load_state_dict(torch_opt.state_dict())
    for p in params:
        st = ours.state[p]
        assert st["exp_avg"].dtype == torch.bfloat16 and st["step"].dtype == torch.float32
        assert torch.equal(st["exp_avg_sq"], torch_opt.state[p]["exp_avg_sq"].bfloat16())
    assert all(g["moment_dtype"] == "bfloat16" for g in ours.param_groups)
    again = AdamWMoments(params, moment_dtype="bfloat16", **HYPER)
    again.load_state_dict(ours.state_dict())
    for p in params:
        assert torch.equal(again.state[p]["exp_avg"], ours.state[p]["exp_avg"])
        assert again.state[p]["exp_avg"].dtype == torch.bfloat16
    back = torch.optim.AdamW(params, foreach=False, **HYPER)
    back.load_state_dict(ours.state_dict())
    assert all(back.state[p]["exp_avg"].dtype == torch.float32 for p in params)


def test_the_recipe_refuses_bf16_moments_with_a_slow_second_moment():
    from moela.trainer.config import OptimConfig

    errors = OptimConfig(moment_dtype="bfloat16", beta2=0.999).validate()
    assert len(errors) == 1 and "beta2 <= 0.99" in errors[0]
    assert OptimConfig(moment_dtype="bfloat16").validate() == []


def _trainer_cfg(run_dir, cache_dir, steps, *extra):
    from factories import tiny_overrides
    from moela.config import load_config

    return load_config(None, tiny_overrides(vocab_size=4096, num_hidden_layers=2, n_routed_experts=4,
                                            q_lora_rank=16) + [
        f"train.run_dir={run_dir}", f"data.cache_dir={cache_dir}", "data.max_doc_len=64", "data.val_max_tokens=256",
        "train.tokens_per_microbatch=128", f"train.steps={steps}", "train.cpu_threads=1", "train.eval_every=0",
        "schedule.kind=constant", "schedule.warmup_steps=0", "optim.lr=3e-3", "logging.log_every=1",
        "logging.plot=false", "logging.progress_bar=never", "checkpoint.every=2", "optim.moment_dtype=bfloat16",
        *extra])


def test_the_trainer_with_bf16_moments_trains_skips_on_the_device_and_resumes_exactly(tmp_path):
    """The tiny model: the trainer builds moela's AdamW, the loss falls, the moments are bf16; a run stopped after
    step 2 and resumed from its checkpoint ends where an uninterrupted run does (bit for bit: same process, same
    math)."""
    from moela.trainer import Trainer

    cache = str(tmp_path / "cache")
    straight = Trainer(_trainer_cfg(tmp_path / "a", cache, 4))
    assert isinstance(straight.optimizer, AdamWMoments) and straight.skips_on_device
    records = [straight.train_step() for _ in range(4)]
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in straight.optimizer.state.values())

    Trainer(_trainer_cfg(tmp_path / "b", cache, 2)).fit()
    resumed = Trainer(_trainer_cfg(tmp_path / "b", cache, 4))
    resumed.fit()
    assert resumed.step == 4
    assert all(s["exp_avg_sq"].dtype == torch.bfloat16 for s in resumed.optimizer.state.values())
    for (name, pa), pb in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(pa, pb), name


def _sharded_steps(rank, world_size, expected):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = AdamWMoments(model.parameters(), moment_dtype="bfloat16", **HYPER)
    for step in range(3):
        x = torch.randn(16, 12, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()  # every rank the same batch: the reduced gradient is the batch's
        opt.step()
        opt.zero_grad()
    for (name, p), want in zip(model.named_parameters(), expected):
        assert isinstance(p, DTensor) and isinstance(opt.state[p]["exp_avg"], DTensor)
        assert opt.state[p]["exp_avg"].to_local().dtype == torch.bfloat16
        torch.testing.assert_close(p.full_tensor(), want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_sharded_parameters_update_like_whole_ones():
    """FSDP2 on two gloo ranks: each rank updates its shards of parameters and bf16 moments (DTensors), and the
    gathered parameters after three steps equal one process's run on the whole model."""
    from parallel_harness import spawn

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    opt = AdamWMoments(model.parameters(), moment_dtype="bfloat16", **HYPER)
    for step in range(3):
        x = torch.randn(16, 12, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    spawn(_sharded_steps, 2, [p.detach().clone() for p in model.parameters()])
