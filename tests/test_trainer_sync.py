"""The training step reads nothing back from the device except on logging steps.

CPU: every Python-level host read of a tensor (`.item()`, `.tolist()`, `float(t)`, `int(t)`, `bool(t)`, `.numpy()`,
`.cpu()`) made during a non-logging step of the real Trainer is counted, except inside the ops' pure-torch references
(`moela/ops/**/reference.py`: the CPU specification loops over documents and experts on the host; CUDA runs kernels
that take host sizes instead). With the fused AdamW that skips non-finite steps on the device, the count is 0; a
logging step reads once. GPU: `torch.cuda.set_sync_debug_mode("error")` over a non-logging step of the Trainer on
the tiny model with the CUDA kernels.
"""

from __future__ import annotations

import contextlib
import math
import sys

import pytest
import torch

from factories import graphed_on_cpu, poison_steps, steps_without_sync, tiny_overrides
from moela.config import load_config
from moela.trainer import Trainer, TrainingError
from moela.trainer.optim import build_scheduler, param_groups
from moela.trainer.step_metrics import skips_on_device

TINY_MODEL = tiny_overrides(vocab_size=4096, num_hidden_layers=2, n_routed_experts=4, q_lora_rank=16)
# a model whose every CUDA kernel path applies (the expert GEMMs need D and F multiples of 128)
GPU_MODEL = tiny_overrides(vocab_size=4096, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                           num_hidden_layers=2, n_routed_experts=8, q_lora_rank=64, kv_lora_rank=64,
                           qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_attention_heads=4)
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu")
ALLOWED = ("/moela/ops/attention/reference.py", "/moela/ops/moe/reference.py")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("token_cache"))


def make_cfg(run_dir, cache_dir, *extra):
    return load_config(None, TINY_MODEL + [
        f"train.run_dir={run_dir}", f"data.cache_dir={cache_dir}", "data.max_doc_len=64", "data.val_max_tokens=256",
        "train.tokens_per_microbatch=128", "train.steps=20", "train.cpu_threads=1", "train.eval_every=0",
        "train.grad_accum=2", "schedule.warmup_steps=2", "optim.lr=3e-3", "logging.plot=false",
        "logging.progress_bar=never", "checkpoint.every=0", *extra])


def fused_trainer(cfg) -> Trainer:
    """The trainer with fused AdamW on the CPU too (what it uses on CUDA), so the device-side skip runs here."""
    trainer = Trainer(cfg)
    o = cfg.optim
    trainer.optimizer = torch.optim.AdamW(param_groups(trainer.model, o.weight_decay), lr=o.lr,
                                          betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    trainer.scheduler = build_scheduler(trainer.optimizer, cfg.schedule, cfg.train.steps)
    trainer.skips_on_device = skips_on_device(trainer.optimizer)
    assert trainer.skips_on_device
    return trainer


@contextlib.contextmanager
def host_reads():
    """Yields a list that collects (file:line of the innermost moela frame, method) of every host read."""
    seen: list[tuple[str, str]] = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, original):
        def counted(self, *args, **kwargs):
            frame, where = sys._getframe(1), None
            while frame is not None:
                path = frame.f_code.co_filename.replace("\\", "/")
                if path.endswith(ALLOWED):
                    return original(self, *args, **kwargs)
                if where is None and "/moela/" in path:
                    where = f"{path.rsplit('/moela/', 1)[1]}:{frame.f_lineno}"
                frame = frame.f_back
            seen.append((where or "outside moela", name))
            return original(self, *args, **kwargs)
        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@pytest.mark.parametrize("graphed", [False, True], ids=["plain", "static-buffers"])
def test_a_non_logging_step_reads_nothing_and_a_logging_step_reads_once(tmp_path, cache_dir, graphed):
    """Also through the graphed step's static buffers (`train.cuda_graphs`, run eagerly here): what a capture
    would record must not read the device either."""
    trainer = fused_trainer(make_cfg(tmp_path, cache_dir, "logging.log_every=4"))
    if graphed:
        graphed_on_cpu(trainer)
    trainer.train_step()  # step 1 logs
    with host_reads() as reads:
        rec2 = trainer.train_step()
        rec3 = trainer.train_step()
    assert reads == [], reads
    assert isinstance(rec2["loss"], torch.Tensor) and isinstance(rec3["grad_norm"], torch.Tensor)
    with host_reads() as reads:
        rec4 = trainer.train_step()  # a logging step: one read of steps 2-4
    assert [name for _, name in reads] == ["tolist"], reads
    for rec in (rec2, rec3, rec4):
        assert isinstance(rec["loss"], float) and math.isfinite(rec["loss"]) and rec["skipped"] == 0
        assert set(rec) >= {"lm_loss", "mtp_loss", "grad_norm", "tokens_per_s", "step_time_s", "expert_imbalance"}
    assert trainer.window.steps == 4  # steps 1-4: only fit() summarizes (and resets) the window


def test_deferred_reads_log_the_same_numbers_as_reading_every_step(tmp_path, cache_dir):
    every = fused_trainer(make_cfg(tmp_path / "a", cache_dir, "logging.log_every=1"))
    every.fit()
    deferred = fused_trainer(make_cfg(tmp_path / "b", cache_dir, "logging.log_every=5"))
    deferred.fit()
    from moela.trainer.metrics import read_metrics

    a = {r["step"]: r for r in read_metrics(tmp_path / "a") if r["kind"] == "train"}
    b = [r for r in read_metrics(tmp_path / "b") if r["kind"] == "train"]
    assert [r["step"] for r in b] == [1, 5, 10, 15, 20]
    for prev, rec in zip([None] + b, b):
        for key in ("loss_step", "grad_norm", "lm_loss" if rec["step"] == 1 else "skipped", "tokens_seen"):
            assert rec[key] == a[rec["step"]][key], (rec["step"], key)
        if prev is not None:  # the window's mean loss over the steps since the previous line
            steps = range(prev["step"] + 1, rec["step"] + 1)
            mean = sum(a[s]["loss_step"] for s in steps) / len(steps)
            assert rec["window_steps"] == len(steps) and math.isclose(rec["loss"], mean, rel_tol=1e-12), rec["step"]
    for (name, pa), pb in zip(every.model.state_dict().items(), deferred.model.state_dict().values()):
        assert torch.equal(pa, pb), name


def test_non_finite_steps_are_skipped_on_the_device(tmp_path, cache_dir):
    trainer = fused_trainer(make_cfg(tmp_path, cache_dir, "logging.log_every=4", "train.max_nonfinite_steps=3"))
    poison_steps(trainer, {2, 3})
    trainer.train_step()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    moments = {id(p): s["exp_avg"].clone() for p, s in trainer.optimizer.state.items()}
    biases = [b.clone() for n, b in trainer.model.named_buffers() if n.endswith("e_score_correction_bias")]
    with host_reads() as reads:
        trainer.train_step()
        trainer.train_step()
    assert reads == []
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, params[n]), n
    for p, s in trainer.optimizer.state.items():
        assert torch.equal(s["exp_avg"], moments[id(p)]) and int(s["step"]) == 1
    after = [b for n, b in trainer.model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert all(torch.equal(a, b) for a, b in zip(biases, after))
    rec4 = trainer.train_step()
    assert rec4["skipped"] == 2 and trainer.nonfinite_in_row == 0 and math.isfinite(rec4["loss"])
    assert any(not torch.equal(p, params[n]) for n, p in trainer.model.named_parameters())
    assert all(int(s["step"]) == 2 for s in trainer.optimizer.state.values())


def test_a_streak_that_ends_between_two_reads_still_stops_the_run(tmp_path, cache_dir):
    """max 2 in a row: steps 2 and 3 are non-finite, 4 is fine; the logging step 5 sees the streak and stops."""
    trainer = fused_trainer(make_cfg(tmp_path, cache_dir, "logging.log_every=5", "train.max_nonfinite_steps=2"))
    poison_steps(trainer, {2, 3})
    with pytest.raises(TrainingError, match="2 consecutive steps had a non-finite loss"):
        trainer.fit()
    assert trainer.step == 5 and trainer.skipped_total == 2


@pytest.mark.gpu
@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_a_non_logging_cuda_step_does_not_synchronize(tmp_path, cache_dir, moments):
    """torch's fused AdamW, and moela's AdamW (bf16 moments) with the clipping factor handed to its step."""
    cfg = make_cfg(tmp_path, cache_dir, *GPU_MODEL, "logging.log_every=100", "train.device=cuda",
                   "train.tokens_per_microbatch=512", "data.max_doc_len=128", f"optim.moment_dtype={moments}",
                   "optim.grad_clip=1.0")
    trainer = Trainer(cfg)
    assert trainer.skips_on_device
    for _ in range(3):  # step 1 logs; kernels compile and autotune during the first steps
        trainer.train_step()
    rec = steps_without_sync(trainer, 2)
    assert isinstance(rec["loss"], torch.Tensor)
    trainer.save()  # reads the pending steps
    assert math.isfinite(rec["loss"]) and rec["skipped"] == 0


def test_bf16_moments_step_reads_nothing_either(tmp_path, cache_dir):
    """moela's AdamW (`optim.moment_dtype: bfloat16`) takes the skip flag on the device too: a non-logging step
    reads nothing back."""
    trainer = Trainer(make_cfg(tmp_path, cache_dir, "logging.log_every=4", "optim.moment_dtype=bfloat16"))
    assert trainer.skips_on_device
    trainer.train_step()
    with host_reads() as reads:
        trainer.train_step()
        trainer.train_step()
    assert reads == [], reads
