"""Checkpoint mechanics: DCP round trip, keep_last_k, resume resolution, atomicity under a simulated crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from moela.config import OptimConfig, ScheduleConfig
from moela.trainer import TrainingError
from moela.trainer import checkpoint as ckpt
from moela.trainer.optim import build_optimizer, build_scheduler


def make(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3, bias=False))
    model.register_buffer("router_bias", torch.zeros(3))
    opt = build_optimizer(model, OptimConfig(lr=1e-2), "cpu")
    sched = build_scheduler(opt, ScheduleConfig(warmup_steps=2), 20)
    return model, opt, sched


def train(model, opt, sched, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 11, (7,), generator=gen)
        model(x).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    model.router_bias += 0.5


def preferred(run_dir, resume):
    """The checkpoint `checkpoint.resume` tries first (None: a fresh start)."""
    found = ckpt.resume_candidates(run_dir, resume)
    return found[0] if found else None


def test_round_trip_restores_model_optimizer_and_trainer_state(tmp_path):
    model, opt, sched = make(0)
    train(model, opt, sched, 3, seed=1)
    state = {"step": 3, "scheduler": sched.state_dict(), "rng": torch.get_rng_state()}
    path = ckpt.save_checkpoint(tmp_path, 3, model, opt, state, keep_last_k=2)
    assert path == tmp_path / "checkpoints" / "step-3" and ckpt.is_complete(path)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-3"

    model2, opt2, sched2 = make(123)
    loaded = ckpt.load_checkpoint(path, model2, opt2)
    sched2.load_state_dict(loaded["scheduler"])
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name
    assert loaded["step"] == 3 and torch.equal(loaded["rng"], state["rng"])
    assert sched2.get_last_lr() == sched.get_last_lr()
    # identical continuation proves the optimizer moments came back too
    train(model, opt, sched, 2, seed=9)
    train(model2, opt2, sched2, 2, seed=9)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_save_does_not_rely_on_the_metadata_dcp_save_returns(tmp_path, monkeypatch):
    """torch 2.11's dcp.save returns Metadata without storage_data: the manifest's shard list comes from the
    `.metadata` file read back, so a save whose return value carries nothing still lists and verifies every shard."""
    real_save = ckpt.dcp.save

    def save_returning_nothing(*args, **kwargs):
        real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt.dcp, "save", save_returning_nothing)
    model, opt, sched = make(0)
    train(model, opt, sched, 2, seed=1)
    path = ckpt.save_checkpoint(tmp_path, 2, model, opt, {"step": 2}, keep_last_k=2)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    shards = sorted(p.name for p in path.glob("*.distcp"))
    assert shards and all(name in manifest["files"] for name in shards)
    model2, opt2, _ = make(5)
    assert ckpt.load_checkpoint(path, model2, opt2)["step"] == 2
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)


def test_keep_last_k_and_resume_resolution(tmp_path):
    model, opt, _ = make(0)
    assert preferred(tmp_path, "auto") is None
    for step in (2, 4, 6, 8):
        ckpt.save_checkpoint(tmp_path, step, model, opt, {"step": step}, keep_last_k=3)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 6, 8]
    assert preferred(tmp_path, "auto").name == "step-8"
    assert preferred(tmp_path, "none") is None
    explicit = tmp_path / "checkpoints" / "step-6"
    assert preferred(tmp_path, str(explicit)) == explicit
    with pytest.raises(TrainingError, match="not a complete checkpoint"):
        preferred(tmp_path, str(tmp_path / "checkpoints" / "step-2"))


def test_continuation_from_an_older_checkpoint_is_what_auto_resumes(tmp_path):
    """Resuming from an explicit older step-N and saving again: the new save is kept (never pruned) and is what
    `auto` resumes, not a higher-numbered checkpoint left by the abandoned continuation; pruning removes the
    abandoned continuation before the run's own history."""
    model, opt, _ = make(0)
    for step in (2, 4, 6):
        ckpt.save_checkpoint(tmp_path, step, model, opt, {"step": step}, keep_last_k=3)
    ckpt.save_checkpoint(tmp_path, 3, model, opt, {"step": 3}, keep_last_k=3)  # continued from step-2
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3, 6]  # 4 went first, then 6 would
    # the latest save, its history, then the abandoned continuation (what a damaged newest one falls back to)
    assert [p.name for p in ckpt.resume_candidates(tmp_path, "auto")] == ["step-3", "step-2", "step-6"]
    ckpt.save_checkpoint(tmp_path, 4, model, opt, {"step": 4}, keep_last_k=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3, 4]  # the abandoned step-6 before step-2
    (tmp_path / "checkpoints" / "latest").unlink()  # without the pointer, auto still finds this run's newest
    assert preferred(tmp_path, "auto").name == "step-4"
    ckpt.save_checkpoint(tmp_path, 5, model, opt, {"step": 5}, keep_last_k=1)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [5]
    assert preferred(tmp_path, "auto").name == "step-5"
    (tmp_path / "checkpoints" / "latest").write_text("step-9\n")  # a pointer to a missing checkpoint
    assert preferred(tmp_path, "auto").name == "step-5"
    ckpt.save_checkpoint(tmp_path, 5, model, opt, {"step": 5, "again": True}, keep_last_k=1)  # the same step again
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-5"]
    assert ckpt.load_checkpoint(tmp_path / "checkpoints" / "step-5", model, opt) == {"step": 5, "again": True}


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model, opt, sched = make(0)
    ckpt.save_checkpoint(tmp_path, 5, model, opt, {"step": 5}, keep_last_k=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, sched, 1, seed=3)

    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        raise OSError("simulated crash: disk full")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(CheckpointException, match="simulated crash"):  # DCP wraps the OSError
        ckpt.save_checkpoint(tmp_path, 6, model, opt, {"step": 6}, keep_last_k=2)
    monkeypatch.setattr(torch, "save", real_save)

    root = tmp_path / "checkpoints"
    assert not (root / "step-6.tmp").exists() and not (root / "step-6").exists()  # the partial save removed
    assert (root / "latest").read_text().strip() == "step-5"
    latest = preferred(tmp_path, "auto")
    assert latest.name == "step-5"
    fresh, fresh_opt, _ = make(7)
    ckpt.load_checkpoint(latest, fresh, fresh_opt)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, before[name]), name
    ckpt.save_checkpoint(tmp_path, 7, model, opt, {"step": 7}, keep_last_k=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [5, 7]


def test_process_killed_mid_save_leaves_no_partial_checkpoint(tmp_path):
    """A real SIGKILL while DCP is writing: the step directory never appears, the old one stays loadable."""
    script = textwrap.dedent(f"""
        import os, signal, torch
        from torch import nn
        from moela.trainer import checkpoint as ckpt
        from moela.trainer.optim import build_optimizer
        from moela.config import OptimConfig
        model = nn.Linear(64, 64)
        opt = build_optimizer(model, OptimConfig(), "cpu")
        ckpt.save_checkpoint({str(tmp_path)!r}, 1, model, opt, {{"step": 1}}, keep_last_k=2)
        def killed(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = killed
        ckpt.save_checkpoint({str(tmp_path)!r}, 2, model, opt, {{"step": 2}}, keep_last_k=2)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    root = tmp_path / "checkpoints"
    assert not (root / "step-2").exists() and (root / "step-2.tmp").exists()
    assert preferred(tmp_path, "auto").name == "step-1"
    model = nn.Linear(64, 64)
    opt = build_optimizer(model, OptimConfig(), "cpu")
    assert ckpt.load_checkpoint(root / "step-1", model, opt) == {"step": 1}
