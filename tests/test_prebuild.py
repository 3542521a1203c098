"""The kernel prebuild helper (`moela.trainer.prebuild`): the reduced model keeps every kind of block, the synthetic
micro-batch has the run's shape and layout, the helper process runs the same step as in this process, reports
success, failure or a stop, and dies with its parent. On CUDA: after the helper, the trainer's first step builds no
moela kernel the helper did not (Triton's disk cache gains no entry of ours)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from factories import tiny_config, tiny_overrides, two_micro_batch_cfg
from moela.batch import IGNORE_INDEX
from moela.model import build_model
from moela.trainer import prebuild
from moela.trainer.compile import StaticShapes
from moela.trainer.prebuild import Prebuild, reduced_model, run_step, synthetic_batch

REPO = Path(__file__).resolve().parents[1]


def _block_kinds(cfg) -> set[tuple]:
    """(kind, keeps a1, FFN class) of every block of `cfg`'s model as built, MTP blocks included."""
    model = build_model(cfg, "meta")
    blocks = list(model.layers) + [m.block for m in model.mtp]
    return {(b.kind, b.keeps_a1, type(b.ffn).__name__) for b in blocks}


@pytest.mark.parametrize("layers, dense, block, want_layers", [
    (6, 1, "standard", 2), (6, 0, "standard", 1), (3, 3, "standard", 1), (6, 3, "fal", 3), (5, 1, "fal_plus", 2),
    (4, 0, "fal", 2)])
def test_reduced_model_keeps_every_block_kind_and_the_widths(layers, dense, block, want_layers):
    cfg = tiny_config(num_hidden_layers=layers, first_k_dense_replace=dense, block=block)
    small = reduced_model(cfg)
    assert small.num_hidden_layers == want_layers and small.validate() == []
    assert _block_kinds(small) == _block_kinds(cfg)
    same = ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_attention_heads", "vocab_size",
            "num_nextn_predict_layers", "precision", "attention_backend", "moe_backend")
    assert all(getattr(small, k) == getattr(cfg, k) for k in same)


@pytest.mark.parametrize("tokens, max_doc_len", [(4096, None), (3000, 700), (1000, 2), (257, 64)])
def test_synthetic_batch_has_the_runs_padded_shape_and_a_packed_layout(tmp_path, tokens, max_doc_len):
    cfg = two_micro_batch_cfg(tmp_path, f"train.tokens_per_microbatch={tokens}",
                              f"data.max_doc_len={json.dumps(max_doc_len)}")
    b = synthetic_batch(cfg, seed=3)
    b.validate()
    shapes = StaticShapes(tokens, max_doc_len)
    assert b.num_tokens == tokens and b.max_seqlen == shapes.max_seqlen
    assert b.num_docs * b.max_seqlen != tokens  # not the "equal" layout attention's auto treats apart
    lens = (b.cu_seqlens[1:] - b.cu_seqlens[:-1]).long()
    assert int(lens.max()) <= b.max_seqlen
    real = tokens - b.filler_tokens
    ends = set((b.cu_seqlens[1:] - 1).tolist())
    for i in range(real):  # a label is the next token of the document, none at a document's end
        want = IGNORE_INDEX if i in ends else int(b.input_ids[i + 1])
        assert int(b.labels[i]) == want
    assert (b.labels[real:] == IGNORE_INDEX).all()
    starts = b.cu_seqlens[:-1].long()
    assert (b.position_ids[starts[lens > 0]] == 0).all()
    assert b.targets_on_host == int((b.labels != IGNORE_INDEX).sum())
    assert torch.equal(synthetic_batch(cfg, seed=3).input_ids, b.input_ids)


def _cpu_cfg(tmp_path, *extra):
    return two_micro_batch_cfg(tmp_path, "train.tokens_per_microbatch=256", "optim.grad_clip=1.0", *extra)


def test_run_step_trains_the_reduced_model_like_the_trainer(tmp_path):
    """The helper's step is a real training step: its loss is the reduced model's loss on the synthetic batch
    (computed here independently: the same initial weights, forward, token mean) and is finite."""
    cfg = _cpu_cfg(tmp_path)
    loss = run_step(cfg, torch.device("cpu"))
    torch.manual_seed(cfg.train.seed)
    model = build_model(reduced_model(cfg.model), "cpu")
    out = model(synthetic_batch(cfg, cfg.train.seed))
    assert loss == pytest.approx(float(out.loss.detach()), rel=1e-5)
    assert 0 < loss < 2 * torch.log(torch.tensor(float(cfg.model.vocab_size)))


def test_run_step_takes_the_graphed_warm_up_path_to_the_same_loss(tmp_path):
    """Under `train.cuda_graphs` the helper runs the graphed step's eager warm-up (static buffers, documents padded
    to the graph's count), as the trainer's first step does: the same loss as the plain path."""
    from dataclasses import replace

    cfg = _cpu_cfg(tmp_path)
    graphed = replace(cfg, train=replace(cfg.train, cuda_graphs=True))
    assert run_step(graphed, torch.device("cpu")) == pytest.approx(run_step(cfg, torch.device("cpu")), rel=1e-5)


def test_the_helpers_cuda_setup_on_an_unindexed_device(tmp_path, monkeypatch):
    """`train.device=cuda` (no index, the default) reaches the helper as "cuda": its memory cap must still name a
    device the way torch's own check requires (an unindexed device there made every helper exit at once, run 63),
    and its allocator setting is made before CUDA starts, keeping a user's own. CUDA calls are recorded, not run."""
    from torch._utils import _get_device_index

    from moela.config import dump_config

    calls = {}

    def cap(fraction, device):
        calls["cap"] = (fraction, _get_device_index(device, optional=False))  # raises as torch would

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", cap)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("set_device", device))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(prebuild, "_exit_with_parent", lambda: None)
    monkeypatch.setattr(prebuild, "run_step", lambda cfg, device, log: calls.setdefault("device", device) and 2.5)
    for preset, want in ((None, "expandable_segments:True"), ("backend:native", "backend:native")):
        if preset is None:
            monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        else:
            monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", preset)
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(dump_config(_cpu_cfg(tmp_path)))
        with torch._dynamo.config.patch(disable=False):  # the helper disables Dynamo for its process
            assert prebuild.main([str(recipe), "cuda"]) == 0
        assert calls["cap"] == (prebuild.MEMORY_FRACTION, 0)
        assert "set_device" not in calls  # no index to set
        assert calls["device"] == torch.device("cuda")
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == want
        assert not recipe.exists()  # the helper removes its recipe copy


def _wait(proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)


def test_helper_process_runs_the_step_and_reports_it(tmp_path):
    cfg = _cpu_cfg(tmp_path, "train.cpu_threads=1")
    helper = Prebuild.start(cfg, torch.device("cpu"))
    _wait(helper.proc)
    assert helper.proc.returncode == 0, helper.log_path.read_text()
    line = helper.stop(keep_log=tmp_path / "run")
    assert "built the run's kernels" in line and "one step of 2 layers" in line
    reported = float(line.rsplit("loss ", 1)[1].rstrip(")"))
    assert reported == pytest.approx(run_step(cfg, torch.device("cpu")), rel=1e-3)  # another process, 4 digits
    assert not helper.config_path.exists() and not helper.log_path.exists()
    assert not (tmp_path / "run").exists()  # a helper that succeeded leaves nothing in the run dir


def test_a_failed_helper_is_reported_and_its_log_kept_in_the_run_dir(tmp_path):
    from moela.config import dump_config

    recipe, log = tmp_path / "recipe.yaml", tmp_path / "helper.log"
    recipe.write_text(dump_config(_cpu_cfg(tmp_path)))
    with open(log, "w") as out:  # a device that does not exist
        proc = subprocess.Popen([sys.executable, "-m", "moela.trainer.prebuild", str(recipe), "nodevice"],
                                stdout=out, stderr=subprocess.STDOUT)
        proc.wait()
    line = Prebuild(proc, log, recipe).stop(keep_log=tmp_path / "run")
    kept = tmp_path / "run" / prebuild.LOG_NAME
    assert "failed" in line and "train.prebuild_kernels=false" in line and f"exit {proc.returncode}" in line
    assert proc.returncode != 0 and str(kept) in line and "nodevice" in kept.read_text() and not log.exists()


def test_stop_ends_a_helper_that_is_still_running(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    config = tmp_path / "recipe.yaml"
    config.write_text("{}")
    line = Prebuild(proc, tmp_path / "helper.log", config).stop()
    assert proc.returncode is not None and "still running" in line and not config.exists()
    assert "its log was not kept" in line


def test_the_helper_dies_with_the_training_process(tmp_path):
    """A trainer killed before its first step leaves no helper behind (on a GPU it would hold memory): the helper's
    watchdog ends it once the pid it was given is no longer its parent, even if that parent exited before the
    watchdog started."""
    helper = "import time; from moela.trainer import prebuild; prebuild._exit_with_parent(); time.sleep(300)"
    parent = ("import os, subprocess, sys; "
              f"p = subprocess.Popen([sys.executable, '-c', {helper!r}], "
              f"env=dict(os.environ, {prebuild.PARENT_ENV}=str(os.getpid()))); print(p.pid, flush=True)")
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    deadline = time.time() + 120  # it imports torch (through moela) before it watches
    while time.time() < deadline and _alive(pid):
        time.sleep(0.5)
    assert not _alive(pid)  # long before its sleep ends: the watchdog ended it


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split()[2] == "Z")  # a zombie has exited


def test_the_trainer_starts_no_helper_without_compile_or_on_the_cpu(tmp_path):
    from moela.trainer import Trainer

    trainer = Trainer(_cpu_cfg(tmp_path))
    assert trainer.prebuild is None and trainer.stop_prebuild() is None


@pytest.mark.parametrize("extra, device, world, want", [
    (["train.compile=true"], "cuda", 1, True), (["train.compile=true"], "cuda", 2, False),
    (["train.compile=true"], "cpu", 1, False), ([], "cuda", 1, False),
    (["train.compile=true", "train.prebuild_kernels=false"], "cuda", 1, False)])
def test_which_runs_start_the_helper(tmp_path, extra, device, world, want):
    assert prebuild.prebuild_wanted(_cpu_cfg(tmp_path, *extra), torch.device(device), world) is want


def test_a_helper_that_cannot_start_is_a_log_line_not_an_error(tmp_path, monkeypatch):
    def no_process(*args, **kwargs):
        raise OSError("no processes left")

    import tempfile

    monkeypatch.setattr(prebuild.subprocess, "Popen", no_process)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    said = []
    assert Prebuild.start_or_say(_cpu_cfg(tmp_path), torch.device("cpu"), said.append) is None
    assert len(said) == 1 and "no processes left" in said[0] and "builds the kernels itself" in said[0]
    assert not list(scratch.iterdir())  # its recipe copy and log file are removed


GPU_SHAPE = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                 n_routed_experts=8, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                 v_head_dim=32, num_attention_heads=4)


def _our_kernels(cache: Path) -> set[str]:
    """Triton cache entries of moela's kernels (Inductor's generated ones are named triton_*)."""
    return {str(p.relative_to(cache)) for p in cache.glob("*/*.json")
            if not p.name.startswith(("triton_", "__grp__"))}


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [[], ["model.precision=fp8"]])
def test_after_the_helper_the_first_step_builds_none_of_our_kernels(tmp_path, extra):
    """The helper's point: every moela kernel (Triton, Gluon) the compiled, graphed trainer's first step launches
    is one the helper built, same specialization, so the trainer finds it in the disk cache. Both run in fresh
    processes on an empty cache (this process's in-memory kernels would hide a miss)."""
    cache = tmp_path / "cache"
    overrides = tiny_overrides(num_hidden_layers=3, **GPU_SHAPE) + [
        f"train.run_dir={tmp_path / 'run'}", "train.device=cuda", "train.compile=true", "train.cuda_graphs=true",
        "train.tokens_per_microbatch=4096", "data.max_doc_len=1024", "train.steps=1", "train.eval_every=0",
        "train.prebuild_kernels=false", "logging.progress_bar=never", *extra]
    env = dict(os.environ, MOELA_CACHE_DIR=str(cache))
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        env.pop(name, None)
    code = ("import sys\n"
            "from moela.config import load_config\n"
            "from moela.trainer import Trainer, prebuild\n"
            "if sys.argv[1] != '-':\n"
            "    sys.exit(prebuild.main([sys.argv[1], 'cuda']))\n"
            "Trainer(load_config(None, sys.argv[2:])).train_step()\n")
    recipe = tmp_path / "recipe.yaml"
    from moela.config import dump_config, load_config

    recipe.write_text(dump_config(load_config(None, overrides)))
    helper = subprocess.run([sys.executable, "-c", code, str(recipe)], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert helper.returncode == 0, helper.stdout + helper.stderr
    built = _our_kernels(cache / "triton")
    assert built  # the helper compiled our kernels
    trainer = subprocess.run([sys.executable, "-c", code, "-", *overrides], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=600)
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    missed = _our_kernels(cache / "triton") - built
    assert not missed, f"the first step compiled kernels the helper did not: {sorted(missed)}"
