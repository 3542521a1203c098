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

SHAPES = [(37, 5), (129,), (3, 7, 11), (adamw_moments.BLOCK + 2,)]  # the last one spans two kernel blocks
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) * (0.5 + step) for s in SHAPES]


def _two_groups(params):
    """The first three parameters decayed, the rest not."""
    return [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}]


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
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt_got.state[q][key], opt_ref.state[p][key], rtol=1e-5, atol=1e-6)
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


def test_groups_clipping_factor_and_odd_tensors_equal_torch_adamw_on_clipped_gradients(path):
    """Two groups (decayed and not), an empty parameter and a non-contiguous gradient (the torch path inside a
    kernel launch's group); the gradients' clipping factor given to the step equals torch's clipping them first."""
    from moela.parallel import clip_factor, clip_grad_norm_

    def build(seed=0):
        g = torch.Generator().manual_seed(seed)
        shapes = [(37, 5), (0,), (129,), (9, 13), (adamw_moments.BLOCK + 2,)]
        return [torch.randn(s, generator=g).requires_grad_() for s in shapes]

    def grads(step, params):
        g = torch.Generator().manual_seed(200 + step)
        out = [torch.randn(p.shape, generator=g) * (1 + step) for p in params]
        out[3] = out[3].t().contiguous().t()  # same values, column-major
        return out

    ref, got = build(), build()
    hyper = {k: v for k, v in HYPER.items() if k != "weight_decay"}
    opt_ref = torch.optim.AdamW(_two_groups(ref), foreach=False, **hyper)
    opt_got = AdamWMoments(_two_groups(got), moment_dtype="float32", **hyper)
    for step in range(4):
        for ps in (ref, got):
            for p, g in zip(ps, grads(step, ps)):
                p.grad = g
        assert not got[3].grad.is_contiguous()
        norm_ref = clip_grad_norm_(ref, 1.0)
        norm_got = clip_grad_norm_(got, None)  # measures only: the gradients stay as they are
        torch.testing.assert_close(norm_got, norm_ref, rtol=1e-6, atol=0)
        assert float(clip_factor(norm_got, 1.0)) < 1  # the clipping does something
        opt_got.grad_scale = clip_factor(norm_got, 1.0)
        opt_ref.step()
        opt_got.step()
    for p, q in zip(ref, got):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_the_launch_table_is_reused_until_an_address_changes():
    """The kernel's table of addresses is built once while gradients are written in place (a graphed step's),
    and rebuilt when a gradient is a new tensor; the result follows torch's AdamW throughout."""
    if not adamw_moments.INTERPRET:
        pytest.skip("the Triton kernel runs on CPU tensors only under TRITON_INTERPRET=1")
    ref, got = _params(), _params()
    opt_ref = torch.optim.AdamW(ref, foreach=False, **HYPER)
    opt_got = AdamWMoments(got, moment_dtype="float32", **HYPER)
    _set_grads(ref, _grads(0))
    _set_grads(got, _grads(0))
    tables = []
    for step in range(4):
        if step == 2:  # new gradient tensors: new addresses
            _set_grads(got, _grads(step))
        else:
            for p, g in zip(got, _grads(step)):
                p.grad.copy_(g)
        _set_grads(ref, _grads(step))
        opt_ref.step()
        opt_got.step()
        (table,) = opt_got._tables.values()
        tables.append((table.table, table.work))
    assert tables[1][0] is tables[0][0] and tables[3][0] is tables[2][0] and tables[2][0] is not tables[1][0]
    assert all(work is tables[0][1] for _, work in tables)  # the sizes never changed
    for p, q in zip(ref, got):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


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


def _sharded_steps(rank, world_size, expected, moments):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from moela.trainer.config import OptimConfig
    from moela.trainer.optim import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    # what the trainer builds for sharded parameters on CUDA, with either moment dtype
    built = build_optimizer(model, OptimConfig(moment_dtype=moments), "cuda")
    assert isinstance(built, AdamWMoments) and built.defaults["moment_dtype"] == moments
    opt = AdamWMoments(model.parameters(), moment_dtype=moments, **HYPER)
    for step in range(3):
        x = torch.randn(16, 12, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()  # every rank the same batch: the reduced gradient is the batch's
        opt.step()
        opt.zero_grad()
    for (name, p), want in zip(model.named_parameters(), expected):
        assert isinstance(p, DTensor) and isinstance(opt.state[p]["exp_avg"], DTensor)
        assert opt.state[p]["exp_avg"].to_local().dtype == adamw_moments.MOMENT_DTYPES[moments]
        torch.testing.assert_close(p.full_tensor(), want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("moments", ["bfloat16", "float32"])
def test_sharded_parameters_update_like_whole_ones(moments):
    """FSDP2 on two gloo ranks: each rank updates its shards of parameters and moments (DTensors), and the
    gathered parameters after three steps equal one process's run on the whole model. The trainer's optimizer for
    sharded parameters on CUDA is this one with either moment dtype (torch's fused AdamW cannot skip on the device
    for DTensors)."""
    from parallel_harness import spawn

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    opt = AdamWMoments(model.parameters(), moment_dtype=moments, **HYPER)
    for step in range(3):
        x = torch.randn(16, 12, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    spawn(_sharded_steps, 2, [p.detach().clone() for p in model.parameters()], moments)


def test_the_trainer_clips_through_the_step_as_it_would_clip_the_gradients(tmp_path, monkeypatch):
    """With a clip that binds, the trainer hands moela's AdamW the clipping factor; the weights after two steps
    equal those of the same run clipping the gradients in place first (the optimizer told it cannot scale)."""
    from moela.trainer import Trainer

    cache = str(tmp_path / "cache")
    runs = {}
    for in_step in (True, False):
        monkeypatch.setattr(AdamWMoments, "scales_grads_in_step", in_step)
        trainer = Trainer(_trainer_cfg(tmp_path / str(in_step), cache, 2, "optim.grad_clip=0.05"))
        records = [trainer.train_step() for _ in range(2)]
        assert all(r["grad_norm"] > 0.5 for r in records)  # the clip binds at every step
        assert (trainer.optimizer.grad_scale is not None) == in_step
        runs[in_step] = trainer.model.state_dict()
    for name, want in runs[False].items():
        torch.testing.assert_close(runs[True][name], want, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
def test_the_cuda_kernel_against_torch_adamw_and_the_float64_reference_without_a_sync():
    """On the GPU: fp32 moments equal torch's AdamW (clipping factor and skip flag set, odd sizes, two groups);
    bf16 moments round to nearest (the interpreter truncates) and follow the float64 AdamW that rounds its moments;
    neither step synchronizes with the host."""
    shapes = [(37, 5), (129,), (4099,), (3, 2048), (1,)]
    g = torch.Generator().manual_seed(7)
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[(torch.randn(s, generator=g) * (1 + i)).cuda() for s in shapes] for i in range(4)]
    hyper = {k: v for k, v in HYPER.items() if k != "weight_decay"}
    ref = [p.cuda().requires_grad_() for p in init]
    opt_ref = torch.optim.AdamW(_two_groups(ref), foreach=False, **hyper)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        got = [p.cuda().requires_grad_() for p in init]
        opt = AdamWMoments(_two_groups(got), moment_dtype=dtype, **hyper)
        for p, gr in zip(got, grads[0]):
            p.grad = gr.clone()
        runs[dtype] = (got, opt)
    f64 = [p.double() for p in init]
    m64 = [torch.zeros_like(p) for p in f64]
    v64 = [torch.zeros_like(p) for p in f64]
    b1, b2 = HYPER["betas"]
    scale = torch.tensor(0.5, device="cuda")
    for step in range(1, 4):
        for p, gr in zip(ref, grads[step]):
            p.grad = gr * scale
        opt_ref.step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for got, opt in runs.values():
                for p, gr in zip(got, grads[step]):
                    p.grad.copy_(gr)
                opt.grad_scale, opt.found_inf = scale, torch.zeros((), device="cuda")
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for i, gr in enumerate(grads[step]):
            gd = gr.cpu().double() * 0.5
            mi = m64[i] + (gd - m64[i]) * (1 - b1)
            vi = v64[i] * b2 + (1 - b2) * gd * gd
            wd = 0.1 if i < 3 else 0.0
            f64[i] = f64[i] * (1 - HYPER["lr"] * wd) - HYPER["lr"] / (1 - b1 ** step) * mi / (
                vi.sqrt() / math.sqrt(1 - b2 ** step) + HYPER["eps"])
            m64[i], v64[i] = mi.bfloat16().double(), vi.bfloat16().double()
    got32, opt32 = runs["float32"]
    for p, q in zip(ref, got32):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    got16, opt16 = runs["bfloat16"]
    for p, r, mi in zip(got16, f64, m64):
        assert ((p.double().cpu() - r).norm() / r.norm()).item() < 1e-6
        m = opt16.state[p]["exp_avg"].double().cpu()
        assert ((m - mi).norm() / mi.norm()).item() < 2e-3


def test_weight_copies_cached_for_a_step_are_recomputed_after_this_optimizers_step(path):
    """FP8 weight copies are cached per optimizer step (moela.ops.weight_cache). The kernel writes the parameters
    through their addresses, which bumps no version counter; the optimizer-step hook still invalidates them."""
    from moela.ops import weight_cache

    w = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(3)))
    opt = AdamWMoments([w], moment_dtype="bfloat16", **HYPER)
    first = weight_cache.cached(w, "adamw-test", lambda v: v.detach().clone())
    w.grad = torch.ones_like(w)
    opt.step()
    second = weight_cache.cached(w, "adamw-test", lambda v: v.detach().clone())
    assert not torch.equal(first, second) and torch.equal(second, w.detach())


def test_a_run_resumes_across_moment_dtypes_with_its_moments(tmp_path):
    """fp32 moments (torch's AdamW) -> bf16 (moela's) -> fp32, each a resume of the same run directory: the saved
    moments load into the new optimizer's dtype (rounded to nearest going down, exact going up) with the step counts
    and weights, each optimizer keeps its own group options (torch's AdamW stays decoupled), and training goes on."""
    from moela.trainer import Trainer

    cache, run = str(tmp_path / "cache"), tmp_path / "run"

    def moments(trainer):
        names = {p: n for n, p in trainer.model.named_parameters()}
        return {names[p]: (s["exp_avg_sq"].clone(), float(s["step"])) for p, s in trainer.optimizer.state.items()}

    first = Trainer(_trainer_cfg(run, cache, 2, "optim.moment_dtype=float32"))
    first.fit()
    assert type(first.optimizer) is torch.optim.AdamW
    down = Trainer(_trainer_cfg(run, cache, 2))  # bf16 moments; at the checkpoint's step: loads, nothing to train
    down.fit()
    assert isinstance(down.optimizer, AdamWMoments) and down.step == 2
    got = moments(down)
    assert got.keys() == moments(first).keys()
    for name, (v, step) in moments(first).items():
        assert got[name][0].dtype == torch.bfloat16 and torch.equal(got[name][0], v.bfloat16()), name
        assert got[name][1] == step == 2
    for (name, a), b in zip(first.model.state_dict().items(), down.model.state_dict().values()):
        assert torch.equal(a, b), name

    bf16 = Trainer(_trainer_cfg(run, cache, 4))  # two bf16 steps, saved at step 4
    bf16.fit()
    up = Trainer(_trainer_cfg(run, cache, 4, "optim.moment_dtype=float32"))
    up.fit()
    assert type(up.optimizer) is torch.optim.AdamW and up.step == 4
    assert all(g["decoupled_weight_decay"] and not g["amsgrad"] for g in up.optimizer.param_groups)
    got = moments(up)
    for name, (v, step) in moments(bf16).items():
        assert got[name][0].dtype == torch.float32 and torch.equal(got[name][0], v.float()), name
        assert got[name][1] == step == 4
    last = Trainer(_trainer_cfg(run, cache, 5, "optim.moment_dtype=float32"))
    last.fit()
    assert last.step == 5
