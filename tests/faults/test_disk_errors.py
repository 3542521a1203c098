"""A full disk on every write path of a run: the checkpoint (DCP shards, trainer state, manifest, the latest
pointer), metrics.jsonl, the loss plot, config.yaml. Each ends with one line naming the file, what the disk said
and the fix, exit code 1, no partial file left, and the previous checkpoint intact (a rerun on a disk with space
resumes from it). The disk is made full for chosen files by opening them on /dev/full (real ENOSPC from the
kernel)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fault_helpers import full_disk, overrides, run_moela, run_train
from moela.trainer import checkpoint as ckpt
from moela.trainer import safe_write
from moela.trainer.metrics import read_metrics

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")


def leftovers(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*.tmp"))


@pytest.mark.parametrize("victim,pattern", [
    ("a DCP shard", r"step-3\.tmp/.*\.distcp$"),
    ("the trainer state", r"step-3\.tmp/trainer-rank0\.pt$"),
    ("the manifest", r"step-3\.tmp/manifest\.json$"),
])
def test_a_full_disk_during_a_save_is_one_line_and_the_rerun_resumes(victim, pattern, trained, cache_dir, capsys,
                                                                      monkeypatch):
    full_disk(monkeypatch, pattern)
    code, out, err = run_train(capsys, *overrides(trained, cache_dir, "train.steps=3", "checkpoint.every=1"))
    assert code == 1 and "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: cannot write checkpoint {trained}/checkpoints/step-3.tmp: no space left on the "
                           f"device") and "Fix: free space" in line and "resumes from the newest" in line
    assert "needs about" in line  # the previous checkpoint's size
    assert leftovers(trained) == [] and ckpt.read_latest(trained / "checkpoints") == "step-2"
    monkeypatch.undo()
    code, out, err = run_train(capsys, *overrides(trained, cache_dir, "train.steps=3", "checkpoint.every=1"))
    assert code == 0, err
    assert f"resumed from {trained}/checkpoints/step-2 at step 2" in out
    assert [r["step"] for r in read_metrics(trained) if r["kind"] == "train"] == [1, 2, 3]


@pytest.mark.parametrize("victim,pattern,what", [
    ("metrics", r"metrics\.jsonl$", "metrics"),
    ("the loss plot", r"loss\.png\.tmp$", "the loss plot"),
    ("config.yaml", r"config\.yaml\.tmp$", "the resolved recipe"),
    ("the latest pointer", r"checkpoints/latest\.tmp$", "the latest-checkpoint pointer"),
])
def test_a_full_disk_on_the_other_run_files_is_one_line(victim, pattern, what, trained, cache_dir, capsys,
                                                         monkeypatch):
    full_disk(monkeypatch, pattern)
    path = {"metrics": "metrics.jsonl", "the loss plot": "loss.png", "config.yaml": "config.yaml",
            "the latest pointer": "checkpoints/latest"}[victim]
    code, out, err = run_train(capsys, *overrides(trained, cache_dir, "train.steps=3", "checkpoint.every=1",
                                                  "logging.plot=true"))
    assert code == 1 and "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: cannot write {what} {trained / path}: no space left on the device")
    assert leftovers(trained) == []


def test_free_space_below_the_previous_checkpoint_is_announced_before_the_save(trained, cache_dir, capsys,
                                                                               monkeypatch, caplog):
    size = ckpt.previous_size(trained)
    assert size > 0
    monkeypatch.setattr(safe_write, "free_bytes", lambda path: size // 2)
    code, out, err = run_train(capsys, *overrides(trained, cache_dir, "train.steps=3", "checkpoint.every=1"))
    assert code == 0, err
    assert "the previous checkpoint took" in out and "the next save will likely fail" in out  # at the resume
    assert "the next save will likely fail" in caplog.text  # before the save itself


@pytest.mark.parametrize("errno_name,said", [("EROFS", "the filesystem is read-only"),
                                             ("EDQUOT", "the disk quota is exceeded"),
                                             ("EIO", "an I/O error")])
def test_each_disk_errno_is_named(errno_name, said, tmp_path):
    import errno

    err = OSError(getattr(errno, errno_name), os.strerror(getattr(errno, errno_name)), str(tmp_path / "f"))
    with pytest.raises(safe_write.WriteFailed) as info:
        with safe_write.writing("metrics", tmp_path / "f"):
            raise RuntimeError("wrapped") from err
    assert str(info.value).startswith(f"cannot write metrics {tmp_path / 'f'}: {said}")


def test_a_full_disk_during_an_import_is_one_line(trained, tmp_path, capsys, monkeypatch):
    assert run_moela(capsys, "export", trained, tmp_path / "hf")[0] == 0
    full_disk(monkeypatch, r"step-0\.tmp/.*\.distcp$")
    code, _, err = run_moela(capsys, "import", tmp_path / "hf", tmp_path / "imported")
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"error: cannot write the imported checkpoint {tmp_path}/imported/checkpoints/step-0: no space left" in err
    assert leftovers(tmp_path / "imported") == []
