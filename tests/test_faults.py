"""Fault injection: what a crash, a damaged file, a second run, a changed recipe or bad input does to a run.

Each test injects one fault and checks the outcome a user sees: the exit code, a message naming the problem and
its fix (no traceback), and what is left on disk. Trainer runs use a ~40k-parameter model on 128-token
micro-batches of the bundled corpus for a few steps; train.py runs in a subprocess only where its exit code or its
process (a lock holder, a signal) is what is tested.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from factories import random_batches, tiny_config
from fault_helpers import ROOT, overrides, run_train, train
from moela.config import ConfigError, load_config
from moela.model import build_model
from moela.parallel import ParallelConfig, apply_parallelism, build_mesh
from moela.trainer import Trainer
from moela.trainer import checkpoint as ckpt
from moela.trainer.metrics import MetricsWriter, read_metrics
from parallel_harness import spawn


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("token_cache"))


def make_cfg(run_dir, cache_dir, *extra):
    return load_config(None, overrides(run_dir, cache_dir, *extra))


# ---------------------------------------------------------------------------------------------------------------
# Recipe values


@pytest.mark.parametrize("override", ["optim.lr=.nan", "optim.lr=.inf", "optim.weight_decay=-.inf",
                                      "model.rope_theta=.nan", "schedule.min_lr_ratio=.nan"])
def test_non_finite_float_keys_are_recipe_errors(override, capsys):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"command line: {key}: expected a finite number, got"):
        load_config(None, [override])
    code, out, err = run_train(capsys, override, "--print-config")
    assert code == 2 and out == "" and f"{key}: expected a finite number" in err


# ---------------------------------------------------------------------------------------------------------------
# metrics.jsonl


def test_a_torn_last_line_of_metrics_jsonl_is_dropped_with_a_warning(tmp_path, caplog):
    cfg = make_cfg(tmp_path, tmp_path / "cache")
    records = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    lines = [json.dumps(r) for r in records]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:17])  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    writer = MetricsWriter(cfg, tmp_path, True, start_step=2)
    writer.log({"kind": "eval", "step": 2, "val_loss": 1.5, "val_ppl": math.exp(1.5)})
    writer.close()
    assert "metrics.jsonl: dropped line 3" in caplog.text and "torn" in caplog.text
    assert [(r["kind"], r["step"]) for r in read_metrics(tmp_path)] == [("train", 1), ("train", 2), ("eval", 2)]


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints


def trained(tmp_path, cache_dir, *extra) -> Path:
    """A run dir trained for 2 steps with a checkpoint after each (both kept)."""
    run = tmp_path / "run"
    code = train.main([str(ROOT / "recipes" / "tiny.yaml"), *overrides(run, cache_dir, "checkpoint.every=1", *extra)])
    assert code == 0
    return run


def shard(checkpoint_dir: Path) -> Path:
    (path,) = checkpoint_dir.glob("*.distcp")
    return path


def test_random_bytes_in_a_shard_are_named_and_auto_resume_takes_the_previous_checkpoint(tmp_path, cache_dir,
                                                                                          capsys):
    run = trained(tmp_path, cache_dir)
    capsys.readouterr()
    damaged = shard(run / "checkpoints" / "step-2")
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = random.Random(0).randbytes(64)  # same size, other bytes
    damaged.write_bytes(bytes(data))
    code, out, err = run_train(capsys, *overrides(run, cache_dir, "train.steps=3"))
    assert code == 0, err
    assert f"checkpoint {run}/checkpoints/step-2 is corrupt: {damaged.name}: its sha256 differs" in out
    assert "trying the next newest, step-1" in out and f"resumed from {run}/checkpoints/step-1 at step 1" in out
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in read_metrics(run) if r["kind"] == "train")


@pytest.mark.parametrize("victim", [".metadata", "shard", "trainer-rank0.pt"])
def test_a_truncated_file_is_named_and_not_blamed_on_the_recipe(victim, tmp_path, cache_dir, capsys):
    run = trained(tmp_path, cache_dir, "checkpoint.keep_last_k=1")
    capsys.readouterr()
    step = run / "checkpoints" / "step-2"
    path = shard(step) if victim == "shard" else step / victim
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 3])
    for resume in ("auto", step):
        code, out, err = run_train(capsys, *overrides(run, cache_dir, "train.steps=3", f"checkpoint.resume={resume}"))
        assert code == 1 and "Traceback" not in err
        assert f"{path.name} has {path.stat().st_size} bytes" in err and "truncated" in err
        assert "model section" not in err and "optim.lr" not in err
    assert "no intact checkpoint in" in run_train(capsys, *overrides(run, cache_dir, "train.steps=3"))[2]


def test_nan_saved_in_a_checkpoint_is_a_corrupt_checkpoint_not_a_learning_rate_problem(tmp_path, cache_dir, capsys):
    run = trained(tmp_path, cache_dir)
    trainer = Trainer(make_cfg(run, cache_dir))  # writes step-2 again, a weight poisoned, with a valid manifest
    with torch.no_grad():
        trainer.model.layers[0].attn.wkv_a.weight[3, 5] = float("nan")
    trainer.step = 2
    trainer.save()
    trainer.lock.release()
    capsys.readouterr()
    poisoned = run / "checkpoints" / "step-2"
    code, out, err = run_train(capsys, *overrides(run, cache_dir, "train.steps=3", f"checkpoint.resume={poisoned}"))
    assert code == 1 and "Traceback" not in err
    assert f"checkpoint {poisoned} is corrupt: 1 tensor holds NaN or inf (model.layers.0.attn.wkv_a.weight)" in err
    assert "optim.lr" not in err
    code, out, err = run_train(capsys, *overrides(run, cache_dir, "train.steps=3"))
    assert code == 0, err
    assert f"checkpoint {poisoned} is corrupt: 1 tensor holds NaN or inf (model.layers.0.attn.wkv_a.weight)" in out
    assert f"resumed from {run}/checkpoints/step-1 at step 1" in out


def test_non_finite_evaluation_exits_nonzero_and_saves_nothing(tmp_path, cache_dir, capsys, monkeypatch):
    build = Trainer._build_model

    def nan_in_eval(self):
        model = build(self)
        forward = model.forward

        def poisoned(batch, **kw):
            out = forward(batch, **kw)
            if not model.training:
                out.metrics["lm_loss"] = out.metrics["lm_loss"] * float("nan")
            return out

        model.forward = poisoned
        return model

    monkeypatch.setattr(Trainer, "_build_model", nan_in_eval)
    run = tmp_path / "run"
    code, out, err = run_train(capsys, *overrides(run, cache_dir))
    assert code == 1 and "Traceback" not in err
    assert "the evaluation at step 2 gave val_loss=nan" in err and "no checkpoint of them is written" in err
    assert not (run / "checkpoints").exists()
    assert math.isnan([r for r in read_metrics(run) if r["kind"] == "eval"][-1]["val_loss"])


# ---------------------------------------------------------------------------------------------------------------
# Resume with a changed recipe; runs with nothing to do; exit codes


def test_a_changed_setting_the_checkpoint_fixes_is_listed_and_exits_2(tmp_path, cache_dir, capsys):
    run = trained(tmp_path, cache_dir)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (run / "config.yaml", run / "metrics.jsonl")}
    capsys.readouterr()
    code, out, err = run_train(capsys, *overrides(run, cache_dir, "train.steps=4", "model.rope_theta=20000",
                                                 "model.num_experts_per_tok=1", "train.seed=7"))
    assert code == 2 and "Traceback" not in err
    assert (f"cannot resume from {run}/checkpoints/step-2: the recipe changes settings the checkpointed run "
            f"fixed:\n  model.num_experts_per_tok: 2 -> 1\n  model.rope_theta: 10000.0 -> 20000.0\n"
            f"  train.seed: 0 -> 7\n") in err
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (run / "config.yaml", run / "metrics.jsonl")}
    assert after == before
    # what only chooses kernels or weights the objective may change
    code, out, err = run_train(capsys, *overrides(run, cache_dir, "train.steps=3", "model.attention_backend=reference",
                                                 "model.mtp_loss_weight=0.1"))
    assert code == 0 and f"resumed from {run}/checkpoints/step-2" in out, err


def test_a_run_with_nothing_to_do_leaves_the_run_dir_alone(tmp_path, cache_dir, capsys):
    run = trained(tmp_path, cache_dir)
    files = [run / "config.yaml", run / "metrics.jsonl", run / "checkpoints" / "latest"]
    before = [(p.read_bytes(), p.stat().st_mtime_ns) for p in files]
    capsys.readouterr()
    code, out, err = run_train(capsys, *overrides(run, cache_dir, "optim.lr=1e-3"))
    assert code == 0 and "already at train.steps=2; nothing to do" in out
    assert [(p.read_bytes(), p.stat().st_mtime_ns) for p in files] == before


def test_a_stop_by_signal_exits_3_after_saving(tmp_path, cache_dir, capfd, monkeypatch):
    step = Trainer.train_step

    def signalled(self):
        record = step(self)
        if self.step == 1:
            signal.raise_signal(signal.SIGTERM)
        return record

    monkeypatch.setattr(Trainer, "train_step", signalled)
    run = tmp_path / "run"
    code, out, err = run_train(capfd, *overrides(run, cache_dir, "train.steps=5"))  # capfd: the handler os.write()s
    assert code == 3 and "stopped by SIGTERM after step 1" in out
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-1"
    assert "  3    stopped by SIGTERM" in subprocess.run([sys.executable, str(ROOT / "train.py"), "--help"],
                                                       capture_output=True, text=True).stdout


# ---------------------------------------------------------------------------------------------------------------
# The run dir: writable, one run at a time


def test_a_second_run_on_a_locked_run_dir_is_refused_naming_the_holder(tmp_path, cache_dir, capsys):
    run = tmp_path / "run"
    run.mkdir()
    script = ("import sys; from pathlib import Path; from moela.trainer.rundir import RunDirLock; "
              "lock = RunDirLock(Path(sys.argv[1])); lock.acquire(); print('locked', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", script, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline() == "locked\n"
        code, out, err = run_train(capsys, *overrides(run, tmp_path / "cache"))
        assert code == 1 and "Traceback" not in err
        assert (f"train.run_dir={run} is in use by another training run (pid {holder.pid} on host "
                f"{socket.gethostname()}, running, started ") in err
        assert not (tmp_path / "cache").exists()  # refused before the data was read
    finally:
        holder.kill()
        holder.wait()
    code, out, err = run_train(capsys, *overrides(run, cache_dir))
    assert code == 0, err
    assert (f"run dir lock: its last holder (pid {holder.pid} on host {socket.gethostname()}, no longer running, "
            f"started ") in out and "taking it over" in out
    assert (run / ".lock").read_text() == ""  # released at the end


def _read_only(path: Path) -> bool:
    """Make directory `path` unwritable (file permissions; for root, the immutable attribute); False if this
    machine allows neither."""
    path.chmod(0o555)
    if os.geteuid() != 0:
        return True
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


@pytest.mark.parametrize("where", ["read-only directory", "below a file"])
def test_an_unwritable_run_dir_fails_before_the_data_is_read(where, tmp_path, capsys):
    parent = tmp_path / "parent"
    if where == "below a file":
        parent.write_text("not a directory")
    else:
        parent.mkdir()
        if not _read_only(parent):
            pytest.skip("cannot make a directory read-only for root here (chattr)")
    try:
        code, out, err = run_train(capsys, *overrides(parent / "run", tmp_path / "cache"))
    finally:
        if where != "below a file":
            subprocess.run(["chattr", "-i", str(parent)], capture_output=True)
            parent.chmod(0o755)
    assert code == 1 and "Traceback" not in err
    assert f"train.run_dir={parent / 'run'} cannot be written" in err and "train.run_dir=PATH" in err
    assert not (tmp_path / "cache").exists()


def test_wandb_online_without_a_login_fails_before_the_data_is_read(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    home = tmp_path / "home"
    home.mkdir()
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), str(ROOT / "recipes" / "tiny.yaml"),
                           *overrides(tmp_path / "run", tmp_path / "cache", "logging.wandb.mode=online")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**env, "HOME": str(home), "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "logging.wandb.mode=online needs a wandb login" in proc.stderr and "WANDB_API_KEY" in proc.stderr
    assert not (tmp_path / "cache").exists()


# ---------------------------------------------------------------------------------------------------------------
# Data that is not text, or holds none


def data_run(capsys, tmp_path, source, *paths):
    return run_train(capsys, *overrides(tmp_path / "run", tmp_path / "cache", f"data.source={source}",
                                       f"data.paths=[{','.join(map(str, paths))}]"))


def test_a_binary_file_given_as_text_is_rejected_with_file_and_line(tmp_path, capsys):
    text = tmp_path / "good.txt"
    text.write_text("Some lines of text.\n" * 200)
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"a header line\n" + random.Random(0).randbytes(4000))
    code, out, err = data_run(capsys, tmp_path, "text", text, binary)
    assert code == 2 and "Traceback" not in err
    assert f"{binary}:2: " in err and "not valid UTF-8" in err and "binary" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_few_undecodable_bytes_in_text_are_replaced_with_a_warning(tmp_path, capsys, caplog):
    text = tmp_path / "latin1.txt"
    text.write_bytes(("Some lines of text.\n" * 300).encode() + "Caf\xe9 au lait\n".encode("latin-1"))
    code, out, err = data_run(capsys, tmp_path, "text", text, text)
    assert code == 0, err
    assert f"{text}:301: 1 byte is not valid UTF-8" in caplog.text


def test_invalid_utf8_in_jsonl_names_file_and_line(tmp_path, capsys):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "one"}\n{"text": "two"}\n{"text": "caf\xe9"}\n')
    code, out, err = data_run(capsys, tmp_path, "jsonl", path)
    assert code == 2 and "Traceback" not in err
    assert f"{path}:3: not valid UTF-8 (byte 0xe9 at column 14)" in err


@pytest.mark.parametrize("content", ["", "  \n\n\t\n"])
def test_empty_input_says_no_text_was_found(content, tmp_path, capsys):
    path = tmp_path / "empty.txt"
    path.write_text(content)
    code, out, err = data_run(capsys, tmp_path, "text", path)
    assert code == 2 and "Traceback" not in err
    assert f"no text found in {path}" in err and "val_fraction" not in err


# ---------------------------------------------------------------------------------------------------------------
# Several ranks: every file of every rank in the manifest, verification shared out and agreed on


def _two_rank_checkpoints(rank: int, world_size: int, run_dir: str) -> None:
    torch.manual_seed(0)
    pcfg = ParallelConfig(ep=2)
    model = apply_parallelism(build_model(tiny_config(), "cpu"), build_mesh(pcfg, world_size, "cpu"), pcfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(random_batches(world_size, seed=3)[rank]).loss.backward()
    opt.step()
    for step in (1, 2):
        ckpt.save_checkpoint(run_dir, step, model, opt, {"step": step, "rank": rank}, keep_last_k=2,
                             settings={"train.seed": 0})
    path = Path(run_dir) / "checkpoints" / "step-2"
    files = sorted(ckpt.read_manifest(path)["files"])
    assert {".metadata", "trainer-rank0.pt", "trainer-rank1.pt"} < set(files)
    assert len([f for f in files if f.endswith(".distcp")]) == 2
    assert ckpt.verify_checkpoint(path) is None
    torch.distributed.barrier()
    victim = files[1]  # hashed by rank 1; both ranks must report it
    if rank == 0:
        (path / victim).write_bytes(b"\0" * (path / victim).stat().st_size)
    torch.distributed.barrier()
    assert ckpt.verify_checkpoint(path).startswith(f"{victim}: its sha256 differs")
    echoed = []
    found, state = ckpt.resume(run_dir, "auto", model, opt, {"train.seed": 0}, echoed.append)
    assert found.name == "step-1" and state == {"step": 1, "rank": rank}
    assert echoed == [f"checkpoint {path} is corrupt: {victim}: its sha256 differs from the one recorded when it "
                      f"was written (its bytes were changed); trying the next newest, step-1"]


def test_checkpoints_of_two_ranks_are_verified_together(tmp_path):
    spawn(_two_rank_checkpoints, 2, str(tmp_path))


def test_init_from_a_damaged_checkpoint_names_the_file(tmp_path, cache_dir, capsys):
    source = trained(tmp_path, cache_dir) / "checkpoints" / "step-2"
    damaged = shard(source)
    damaged.write_bytes(damaged.read_bytes()[:-100])
    capsys.readouterr()
    code, out, err = run_train(capsys, *overrides(tmp_path / "fine-tune", cache_dir, f"checkpoint.init_from={source}"))
    assert code == 1 and "Traceback" not in err
    assert f"checkpoint.init_from: {source} is corrupt: {damaged.name} has" in err and "truncated" in err
