"""Trainer: exact resume after SIGTERM, accumulation weighting, non-finite handling, run files, wandb offline,
optimizer groups and LR schedules. Runs a ~40k-parameter model on 128-token micro-batches of the bundled corpus."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import signal

import pytest
import torch

from factories import poison_steps, tiny_overrides
from moela.config import Config, OptimConfig, ScheduleConfig, load_config
from moela.model import flops_per_token
from moela.trainer import Trainer, TrainingError
from moela.trainer.errors import InputError
from moela.trainer.metrics import LogWindow
from moela.trainer.optim import LRMultiplier, apply_hyperparameters, build_optimizer, param_groups

TINY_MODEL = tiny_overrides(vocab_size=4096, num_hidden_layers=2, n_routed_experts=4, q_lora_rank=16)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("token_cache"))


def make_cfg(run_dir, cache_dir, *extra) -> Config:
    return load_config(None, TINY_MODEL + [
        f"train.run_dir={run_dir}", f"data.cache_dir={cache_dir}", "data.max_doc_len=64", "data.val_max_tokens=256",
        "train.tokens_per_microbatch=128", "train.steps=6", "train.cpu_threads=1", "train.eval_every=0",
        "schedule.warmup_steps=2", "optim.lr=3e-3", "logging.log_every=1", "logging.plot=false",
        "logging.progress_bar=never", "checkpoint.every=0", *extra])


def train_records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


class SignalAtStep(Trainer):
    """Sends itself a real signal right after optimizer step `at`."""

    def __init__(self, cfg, at: int, signum: int = signal.SIGTERM):
        super().__init__(cfg)
        self.at, self.signum = at, signum

    def train_step(self):
        record = super().train_step()
        if self.step == self.at:
            signal.raise_signal(self.signum)
        return record


def test_interrupted_and_resumed_run_matches_uninterrupted_exactly(tmp_path, cache_dir):
    extra = ("train.grad_accum=2", "logging.log_every=2")  # the signal lands inside a logging window
    straight = Trainer(make_cfg(tmp_path / "a", cache_dir, *extra))
    straight.fit()

    handler_before = signal.getsignal(signal.SIGTERM)
    first = SignalAtStep(make_cfg(tmp_path / "b", cache_dir, *extra), at=3)
    first.fit()
    assert signal.getsignal(signal.SIGTERM) is handler_before
    assert first.step == 3
    assert [s.name for s in sorted((tmp_path / "b" / "checkpoints").glob("step-*"))] == ["step-3"]
    resumed = Trainer(make_cfg(tmp_path / "b", cache_dir, *extra))
    resumed.fit()
    assert resumed.step == 6

    a, b = train_records(tmp_path / "a"), train_records(tmp_path / "b")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 4, 6]
    for ra, rb in zip(a, b):
        for key in ("loss", "loss_step", "lm_loss", "mtp_loss", "grad_norm", "lr", "tokens_seen", "window_steps"):
            assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])
    for (name, pa), pb in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert a[0]["loss"] > a[-1]["loss"]
    metrics = (tmp_path / "b" / "metrics.jsonl").read_text()
    Trainer(make_cfg(tmp_path / "b", cache_dir, *extra)).fit()  # already complete: nothing changes
    assert (tmp_path / "b" / "metrics.jsonl").read_text() == metrics


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_micro_batches_are_weighted_by_their_targets(tmp_path, cache_dir, monkeypatch):
    """One step with grad_accum=3 gives the gradient of the token-mean loss over all three micro-batches."""
    trainer = Trainer(make_cfg(tmp_path, cache_dir, "train.grad_accum=3", "optim.grad_clip=0"))
    state = trainer.train_loader.state_dict()
    batches = trainer.train_loader.next_step()
    trainer.train_loader.load_state_dict(state)
    reference = copy.deepcopy(trainer.model).double()
    outs = [reference(b) for b in batches]
    total = sum(o.num_targets for o in outs)
    objective = sum(o.loss * o.num_targets for o in outs) / total
    objective.backward()
    expected_load = sum(o.expert_load for o in outs)

    captured = {}
    monkeypatch.setattr(trainer.optimizer, "step", lambda: captured.update(
        {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}))
    monkeypatch.setattr(trainer.model, "update_router_bias",
                        lambda load, enabled=None: captured.update(load=load.clone(), enabled=enabled))
    record = trainer.train_step()

    assert math.isclose(record["loss"], float(objective.detach()), rel_tol=1e-5)
    for name, p in reference.named_parameters():
        if p.grad is None:
            continue
        torch.testing.assert_close(captured[name].double(), p.grad, rtol=1e-4, atol=1e-7, msg=name)
    torch.testing.assert_close(captured["load"].double(), expected_load.double())


def test_router_bias_moves_after_a_step(tmp_path, cache_dir, monkeypatch):
    """Each MoE layer's bias steps by `rate` against the sign of its experts' load imbalance. Unrestricted routing
    (n_group=1): with 2 groups of 2 experts and top-2, a token takes both experts of one group, so a layer whose
    tokens split evenly between the groups sees exactly equal loads and, rightly, no bias change."""
    trainer = Trainer(make_cfg(tmp_path, cache_dir, "model.n_group=1", "model.topk_group=1"))
    biases = [m.gate.e_score_correction_bias for m in trainer.model.moe_layers()]
    assert len(biases) == 2 and all(torch.count_nonzero(b) == 0 for b in biases)
    loads = []
    update = trainer.model.update_router_bias
    monkeypatch.setattr(trainer.model, "update_router_bias",
                        lambda load, enabled=None: (loads.append(load.clone()), update(load, enabled=enabled))[1])
    trainer.train_step()
    (load,) = loads  # [L_moe, E] summed over the step's micro-batches
    rate = trainer.model.cfg.bias_update_rate
    for bias, layer_load in zip(biases, load):
        assert layer_load.min() < layer_load.max(), layer_load  # an imbalance to correct
        assert torch.equal(bias, torch.sign(layer_load.mean() - layer_load) * rate), (bias, layer_load)
        assert torch.count_nonzero(bias) > 0


def test_nonfinite_steps_are_skipped_and_counted(tmp_path, cache_dir):
    trainer = Trainer(make_cfg(tmp_path, cache_dir, "train.max_nonfinite_steps=3"))
    poison_steps(trainer, {2, 3})
    trainer.train_step()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    bias_before = [b.clone() for n, b in trainer.model.named_buffers() if n.endswith("e_score_correction_bias")]
    rec2, rec3 = trainer.train_step(), trainer.train_step()
    assert math.isnan(rec2["loss"]) and (rec2["skipped"], rec3["skipped"]) == (1, 2)
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, before[n]), n
    bias_after = [b for n, b in trainer.model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert all(torch.equal(a, b) for a, b in zip(bias_before, bias_after))
    rec4 = trainer.train_step()
    assert math.isfinite(rec4["loss"]) and trainer.nonfinite_in_row == 0 and rec4["skipped"] == 2
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_too_many_nonfinite_steps_in_a_row_stop_with_a_clear_message(tmp_path, cache_dir):
    trainer = Trainer(make_cfg(tmp_path, cache_dir, "train.max_nonfinite_steps=2"))
    poison_steps(trainer, {2, 3, 4})
    with pytest.raises(TrainingError, match="2 consecutive steps had a non-finite loss") as info:
        trainer.fit()
    assert "train.max_nonfinite_steps" in str(info.value) and trainer.step == 3


def test_run_directory_files_and_wandb_offline(tmp_path, cache_dir):
    run = tmp_path / "run"
    cfg = make_cfg(run, cache_dir, "train.steps=3", "train.eval_every=2", "logging.plot=true",
                   "logging.wandb.mode=offline", "logging.wandb.tags=[test]", "logging.peak_tflops=0.001")
    Trainer(cfg).fit()
    assert load_config(run / "config.yaml") == cfg
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [
        ("train", 1), ("train", 2), ("eval", 2), ("train", 3), ("eval", 3)]
    for r in records[:1]:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mem_gib", "expert_imbalance", "lm_loss"):
            assert math.isfinite(r[key]), key
    assert records[-1]["val_ppl"] == pytest.approx(math.exp(records[-1]["val_loss"]))
    epochs = [r["epoch"] for r in records if r["kind"] == "train"]
    assert 0 < epochs[0] < epochs[1] < epochs[2] < 1  # fractional passes over the training split
    # MFU = FLOPs per token (at the token-weighted mean document length, <= max_doc_len 64) x tokens/s / peak
    flops = records[0]["mfu"] * 1e9 / records[0]["tokens_per_s"]
    rounding = 1e-9  # mfu and tokens/s are each a ratio to the step time
    assert flops_per_token(cfg.model, 2) * (1 - rounding) <= flops <= flops_per_token(cfg.model, 64) * (1 + rounding)
    assert (run / "loss.png").stat().st_size > 1000
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-3"]
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    assert list(offline[0].glob("run-*.wandb")) and (offline[0] / "files").is_dir()
    changed = make_cfg(run, cache_dir, "train.steps=4", "data.max_doc_len=32", "model.hidden_size=48")
    with pytest.raises(InputError, match="cannot resume from .*step-3: the recipe changes settings") as info:
        Trainer(changed).fit()
    assert "data.max_doc_len: 64 -> 32\n  model.hidden_size: 32 -> 48\n" in str(info.value)
    assert "checkpoint.resume=none" in str(info.value) and info.value.exit_code == 2


def test_resume_follows_the_current_schedule_settings(tmp_path, cache_dir):
    """Raising train.steps (and changing optim settings) on resume continues on the new schedule and
    hyperparameters, not the saved ones."""
    Trainer(make_cfg(tmp_path, cache_dir, "train.steps=3")).fit()
    longer = make_cfg(tmp_path, cache_dir, "train.steps=8", "optim.lr=2e-3", "optim.weight_decay=0.05",
                      "optim.beta2=0.99")
    trainer = Trainer(longer)
    trainer.fit()
    assert trainer.step == 8
    assert [(g["name"], g["weight_decay"], g["betas"]) for g in trainer.optimizer.param_groups] == [
        ("decay", 0.05, (0.9, 0.99)), ("no_decay", 0.0, (0.9, 0.99))]
    resumed = [r for r in train_records(tmp_path) if r["step"] > 3]
    multiplier = LRMultiplier(longer.schedule, total_steps=8)
    assert [r["lr"] for r in resumed] == pytest.approx([2e-3 * multiplier(r["step"] - 1) for r in resumed])
    assert resumed[-1]["lr"] == pytest.approx(2e-3 * longer.schedule.min_lr_ratio)


def rewrite_trainer_state(checkpoint_dir, state) -> None:
    """Replace rank 0's trainer state and record the new file in the manifest, as a save of that state would."""
    path = checkpoint_dir / "trainer-rank0.pt"
    torch.save(state, path)
    manifest = json.loads((checkpoint_dir / "manifest.json").read_text())
    manifest["files"][path.name] = {"bytes": path.stat().st_size,
                                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    (checkpoint_dir / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_without_the_current_trainer_state_is_refused_with_a_clear_error(tmp_path, cache_dir):
    Trainer(make_cfg(tmp_path, cache_dir, "train.steps=2")).fit()
    (saved,) = (tmp_path / "checkpoints").glob("step-*")
    state = torch.load(saved / "trainer-rank0.pt", weights_only=False)
    del state["log_window"], state["loader"]["weights"]  # what an older version wrote
    rewrite_trainer_state(saved, state)
    with pytest.raises(TrainingError, match="lacks log_window: it was written by an older moela"):
        Trainer(make_cfg(tmp_path, cache_dir, "train.steps=3")).fit()
    state["log_window"] = {}
    rewrite_trainer_state(saved, state)
    with pytest.raises(TrainingError, match="loader state lacks weights"):
        Trainer(make_cfg(tmp_path, cache_dir, "train.steps=3")).fit()


def test_no_held_out_split_means_no_evaluation(tmp_path, cache_dir):
    Trainer(make_cfg(tmp_path, cache_dir, "data.val_fraction=0", "train.steps=2", "train.eval_every=1")).fit()
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kinds == ["train", "train"]  # not a val_loss of 0 over no tokens


def test_unreadable_data_is_a_training_error(tmp_path, cache_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a document"}\n{"body": "another"}\n')
    cfg = make_cfg(tmp_path / "run", str(tmp_path / "cache"), "data.source=jsonl", f"data.paths=[{bad}]")
    with pytest.raises(TrainingError, match="cannot read the training data: .*bad.jsonl:2: no field 'text'"):
        Trainer(cfg)


def test_vocab_smaller_than_tokenizer_is_rejected(tmp_path, cache_dir):
    with pytest.raises(TrainingError, match="model.vocab_size=1000 is smaller than the tokenizer"):
        Trainer(make_cfg(tmp_path, cache_dir, "model.vocab_size=1000"))


def test_log_window_averages_finite_losses_and_throughput():
    window = LogWindow()
    steps = [dict(loss=4.0, lm_loss=3.0, step_time_s=1.0, tokens_per_s=100.0, mfu=0.2, lr=1.0),
             dict(loss=float("nan"), lm_loss=float("nan"), step_time_s=1.0, tokens_per_s=300.0, mfu=0.6, lr=2.0),
             dict(loss=2.0, lm_loss=1.0, step_time_s=2.0, tokens_per_s=50.0, mfu=0.1, lr=3.0)]
    for rec in steps:
        window.add(rec)
    out = window.summarize(steps[-1])
    assert (out["loss"], out["lm_loss"], out["loss_step"], out["lr"]) == (3.0, 2.0, 2.0, 3.0)
    assert out["tokens_per_s"] == pytest.approx(500 / 4) and out["mfu"] == pytest.approx(1.0 / 4)
    assert out["window_steps"] == 3 and window.steps == 0 and window.sums == {}


def test_apply_hyperparameters_overrides_what_a_checkpoint_loaded():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, OptimConfig(), "cpu")
    for group in opt.param_groups:  # as loaded from a checkpoint written on CUDA with other settings
        group.update(weight_decay=0.7, betas=(0.5, 0.5), eps=1.0, fused=True)
    apply_hyperparameters(opt, OptimConfig(weight_decay=0.02, beta1=0.8, beta2=0.9, eps=1e-6))
    assert [(g["name"], g["weight_decay"], g["betas"], g["eps"], g["fused"]) for g in opt.param_groups] == [
        ("decay", 0.02, (0.8, 0.9), 1e-6, None), ("no_decay", 0.0, (0.8, 0.9), 1e-6, None)]


def test_param_groups_exclude_norms_biases_embeddings_and_router_bias():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "embed": torch.nn.Embedding(10, 4), "attn_norm": torch.nn.LayerNorm(4), "wq": torch.nn.Linear(4, 4),
        "head": torch.nn.Linear(4, 10, bias=False)})
    model.register_parameter("e_score_correction_bias", torch.nn.Parameter(torch.zeros(1, 3)))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in decay["params"]) == ["head.weight", "wq.weight"]
    assert sorted(names[id(p)] for p in no_decay["params"]) == [
        "attn_norm.bias", "attn_norm.weight", "e_score_correction_bias", "embed.weight", "wq.bias"]
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert not build_optimizer(model, OptimConfig(), "cpu").defaults["fused"]


def test_schedules():
    cos = LRMultiplier(ScheduleConfig(kind="cosine", warmup_steps=4, min_lr_ratio=0.1), total_steps=20)
    assert [cos(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cos(19) == pytest.approx(0.1) and cos(11) == pytest.approx(0.55 + 0.45 * math.cos(math.pi * 7 / 15))
    assert all(cos(i) >= cos(i + 1) for i in range(3, 19))
    wsd = LRMultiplier(ScheduleConfig(kind="wsd", warmup_steps=2, min_lr_ratio=0.0, decay_fraction=0.25,
                                      decay_shape="linear"), total_steps=21)
    assert [wsd(i) for i in (0, 1, 2, 10, 15)] == [0.5, 1.0, 1.0, 1.0, 1.0]
    assert wsd(16) == 1.0 and wsd(18) == pytest.approx(0.5) and wsd(20) == 0.0
    sqrt = LRMultiplier(ScheduleConfig(kind="wsd", warmup_steps=0, min_lr_ratio=0.2, decay_fraction=0.5,
                                       decay_shape="sqrt"), total_steps=9)
    assert sqrt(4) == sqrt(5) == 1.0 and sqrt(8) == pytest.approx(0.2)  # 4 decay steps: 5..8
    assert sqrt(6) == pytest.approx(0.2 + 0.8 * (1 - math.sqrt(1 / 3)))
    const = LRMultiplier(ScheduleConfig(kind="constant", warmup_steps=1), total_steps=5)
    assert [const(i) for i in range(5)] == [1.0] * 5
    short = LRMultiplier(ScheduleConfig(kind="cosine", warmup_steps=10), total_steps=4)
    assert [short(i) for i in range(4)] == [0.1, 0.2, 0.3, 0.4]  # a run shorter than its warmup never decays


def test_cpu_peak_memory_is_gib_on_linux_and_macos(monkeypatch):
    from types import SimpleNamespace

    from moela.trainer import metrics

    for platform, maxrss in (("linux", 3 * 2**20), ("darwin", 3 * 2**30)):  # ru_maxrss: KiB on Linux, bytes on macOS
        monkeypatch.setattr(metrics.sys, "platform", platform)
        monkeypatch.setattr(metrics.resource, "getrusage", lambda _who, m=maxrss: SimpleNamespace(ru_maxrss=m))
        assert metrics.memory_gib(torch.device("cpu")) == 3.0


def test_profiling_window_writes_traces_and_a_record(tmp_path, cache_dir, capsys):
    Trainer(make_cfg(tmp_path, cache_dir, "logging.profile_steps=[2,3]", "train.steps=4")).fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    prof = [r for r in records if r["kind"] == "profile"]
    assert len(prof) == 1 and prof[0]["step"] == 3 and prof[0]["first_step"] == 2 and prof[0]["steps"] == 2
    steps = {r["step"]: r["step_time_s"] for r in records if r["kind"] == "train"}
    assert prof[0]["wall_s"] == pytest.approx(steps[2] + steps[3])
    assert all(prof[0][f"share_{k}"] == 0.0 for k in ("a2a", "AG", "RS", "AR"))  # one CPU process: no NCCL
    assert prof[0]["busy"] == 0.0  # no GPU kernels on CPU
    trace = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("aten::" in n for n in names)  # ops of the profiled steps are in the trace
    assert "Name" in (tmp_path / "profile" / "rank0.txt").read_text()
    assert "profile steps 2-3" in capsys.readouterr().out
    assert len(train_records(tmp_path)) == 4  # profiling changes no training record


def test_compute_busy_is_the_union_of_non_nccl_kernel_intervals():
    from types import SimpleNamespace

    from moela.trainer.profiling import compute_busy_us

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, start, end, device=cuda, annotation=False):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               is_user_annotation=annotation)

    events = [ev("gemm", 10, 30), ev("norm", 20, 40), ev("inner", 22, 25),  # overlapping and nested: 10..40
              ev("ncclDevKernel_AllGather", 0, 100), ev("aten::mm", 0, 100, cpu),  # excluded
              ev("Optimizer.step#AdamW.step", 40, 90, annotation=True),  # a range over idle time: excluded
              ev("softmax", 50, 55), ev("copy", 55, 60)]  # touching: 50..60
    assert compute_busy_us(SimpleNamespace(events=lambda: events)) == 40.0


def test_profiling_window_interrupted_by_a_stop_leaves_no_output(tmp_path, cache_dir):
    SignalAtStep(make_cfg(tmp_path, cache_dir, "logging.profile_steps=[2,5]", "train.steps=6"), at=3).fit()
    assert not (tmp_path / "profile").exists()
    assert all(json.loads(line)["kind"] != "profile" for line in (tmp_path / "metrics.jsonl").read_text().splitlines())


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused_before_the_build(monkeypatch):
    """A recipe asking for FP8 on a GPU older than compute capability 8.9 (an A100 here, by its reported capability)
    stops with what was asked, why and the fix, not inside the first FP8 GEMM's compilation; bf16, and FP8 experts
    simulated by the reference backend, pass; the CPU and Hopper run the kernels."""
    from moela.model.config import ModelConfig
    from moela.ops.fp8_device import fp8_device_problem
    from moela.trainer.device_checks import check_fp8_device

    capability = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    gpu = torch.device("cuda", 0)
    assert "compute capability 8.0" in fp8_device_problem(gpu) and fp8_device_problem(torch.device("cpu")) is None
    for asked in (dict(precision="fp8"), dict(precision="fp8_experts"), dict(moe_recipe="fp8_blockwise")):
        with pytest.raises(InputError, match=r"model\.(precision|moe_recipe): fp8.*A100.*8\.0.*model\.precision: bf16"):
            check_fp8_device(ModelConfig(**asked), gpu)
    check_fp8_device(ModelConfig(), gpu)
    check_fp8_device(ModelConfig(precision="fp8_experts", moe_backend="reference"), gpu)
    with pytest.raises(InputError, match="precision: fp8"):  # FP8 linears have no simulated backend in a recipe
        check_fp8_device(ModelConfig(precision="fp8", moe_backend="reference"), gpu)
    check_fp8_device(ModelConfig(precision="fp8"), torch.device("cpu"))
    capability["value"] = (9, 0)
    check_fp8_device(ModelConfig(precision="fp8"), gpu)
    assert fp8_device_problem(gpu) is None


def test_a_named_backend_this_machine_cannot_run_is_refused_before_the_build(monkeypatch):
    """The fast MoE backends run CUDA kernels: named on the CPU (which trains in float32), or `deep_gemm` without
    its package, the trainer stops with the fix before building the model; so for the attention's sdpa, flash and
    triton (which the interpreter runs on the CPU), and for a Gluon attention kernel off Hopper; `auto` and
    `reference` run anywhere."""
    import importlib.util

    from moela.model.config import KernelsConfig, ModelConfig
    from moela.trainer import device_checks
    from moela.trainer.device_checks import check_backends

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    for name in ("triton", "torch_triton", "cublas", "deep_gemm"):
        with pytest.raises(InputError, match=f"model.moe_backend: '{name}' runs CUDA kernels .* on the cpu; use "
                                             f"model.moe_backend: auto"):
            check_backends(ModelConfig(moe_backend=name), cpu)
    monkeypatch.setattr(device_checks, "INTERPRET", False)
    for name in ("sdpa", "flash", "triton"):
        with pytest.raises(InputError, match=f"model.attention_backend: '{name}' runs CUDA kernels .* on the cpu"):
            check_backends(ModelConfig(attention_backend=name), cpu)
        check_backends(ModelConfig(attention_backend=name), gpu)
    monkeypatch.setattr(device_checks, "INTERPRET", True)
    check_backends(ModelConfig(attention_backend="triton"), cpu)
    for name in ("auto", "reference"):
        check_backends(ModelConfig(moe_backend=name, attention_backend=name), cpu)
    check_backends(ModelConfig(moe_backend="triton"), gpu)
    gluon = ModelConfig(kernels=KernelsConfig(attention_dq="gluon"))
    with pytest.raises(InputError, match="model.kernels.attention_dq: 'gluon' runs on Hopper .* not on the cpu"):
        check_backends(gluon, cpu)
    for capability, ok in (((9, 0), True), ((8, 0), False), ((10, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        if ok:
            check_backends(gluon, gpu)
        else:
            with pytest.raises(InputError, match=f"'gluon' runs on Hopper .* not on sm_{capability[0]}0; use auto"):
                check_backends(gluon, gpu)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(InputError, match="'deep_gemm' needs the deep_gemm package"):
        check_backends(ModelConfig(moe_backend="deep_gemm"), gpu)
