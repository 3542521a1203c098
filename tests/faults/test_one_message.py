"""Damaged or unexpected inputs that used to end in a traceback or the wrong exit code: each is now one line with
the documented exit code (train.py: 1 environment / state on disk, 2 bad input, 130 second Ctrl-C; python -m moela:
2), naming the file and the fix."""

from __future__ import annotations

import logging

import pytest
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from fault_helpers import ROOT, overrides, run_moela, run_train
from moela.config import load_config
from moela.trainer import metrics


def test_a_binary_latest_pointer_falls_back_to_the_newest_checkpoint(trained, cache_dir, capsys):
    (trained / "checkpoints" / "latest").write_bytes(bytes(range(256)))
    code, out, err = run_train(capsys, *overrides(trained, cache_dir, "train.steps=3"))
    assert code == 0, err
    assert f"{trained}/checkpoints/latest does not name a checkpoint (damaged)" in out
    assert f"resumed from {trained}/checkpoints/step-2 at step 2" in out
    code, _, err = run_moela(capsys, "generate", trained, "--prompt", "ROMEO:", "--max-new-tokens", "2",
                             "--device", "cpu")
    assert code == 0, err


def test_a_second_ctrl_c_during_a_save_exits_130_without_a_traceback(trained, cache_dir, capsys, monkeypatch):
    def interrupted(self, write_item):
        raise KeyboardInterrupt  # what the second SIGINT's handler raises, here inside DCP's writer

    monkeypatch.setattr(DefaultSavePlanner, "resolve_data", interrupted)
    code, out, err = run_train(capsys, *overrides(trained, cache_dir, "train.steps=3", "checkpoint.every=1"))
    assert code == 130 and "Traceback" not in err
    assert "interrupted before a checkpoint was written; the newest complete checkpoint is kept" in err
    assert sorted(p.name for p in (trained / "checkpoints").iterdir()) == ["latest", "step-1", "step-2"]


@pytest.fixture
def exported(trained, tmp_path, capsys):
    out = tmp_path / "hf"
    assert run_moela(capsys, "export", trained, out)[0] == 0
    return out


def test_import_of_a_truncated_safetensors_file_names_it(exported, tmp_path, capsys):
    (shard,) = exported.glob("*.safetensors")
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    code, _, err = run_moela(capsys, "import", exported, tmp_path / "imported")
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"error: {shard}: not a complete safetensors file" in err
    assert not (tmp_path / "imported" / "checkpoints").exists()


def test_init_from_hf_with_a_truncated_file_or_nan_weights_blames_the_weights(exported, trained, cache_dir,
                                                                                tmp_path, capsys):
    (shard,) = exported.glob("*.safetensors")
    tensors = load_file(shard)
    tensors["model.layers.0.mlp.down_proj.weight"][1, 2] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    code, out, err = run_train(capsys, *overrides(tmp_path / "ft", cache_dir, f"checkpoint.init_from=hf:{exported}"))
    assert code == 1 and "Traceback" not in err
    assert f"checkpoint.init_from: {exported} holds NaN or inf in 1 tensor(s) (layers.0.ffn.w2.weight)" in err
    assert "optim.lr" not in err
    shard.write_bytes(shard.read_bytes()[:1000])
    code, out, err = run_train(capsys, *overrides(tmp_path / "ft2", cache_dir, f"checkpoint.init_from=hf:{exported}"))
    assert code == 1 and "Traceback" not in err and f"{shard}: not a complete safetensors file" in err


def test_a_truncated_tokenizer_json_is_named(tmp_path, cache_dir, capsys):
    bundled = ROOT / "moela" / "data" / "tokenizer" / "tokenizer.json"
    broken = tmp_path / "tokenizer.json"
    broken.write_bytes(bundled.read_bytes()[:500])
    code, _, err = run_train(capsys, *overrides(tmp_path / "run", cache_dir, f"data.tokenizer={broken}"))
    assert code == 2 and "Traceback" not in err
    assert f"data.tokenizer: {broken} is not a readable tokenizer.json" in err


def test_changed_training_data_on_resume_says_the_data_changed(tmp_path, cache_dir, capsys):
    data = tmp_path / "data.txt"
    data.write_text("\n\n".join(f"Document {i}: " + "words and more words " * 20 for i in range(60)))
    extra = ["data.source=text", f"data.paths=[{data}]"]
    assert run_train(capsys, *overrides(tmp_path / "run", cache_dir, *extra, "train.steps=1"))[0] == 0
    data.write_text(data.read_text() + "\n\none more document")
    code, _, err = run_train(capsys, *overrides(tmp_path / "run", cache_dir, *extra))
    assert code == 1 and "Traceback" not in err
    assert "the training data changed since the checkpoint was written" in err
    assert "resume with the data section" not in err


def test_an_empty_wandb_id_gets_a_new_one_and_offline_failures_do_not_suggest_offline(tmp_path, caplog,
                                                                                     monkeypatch):
    (tmp_path / "wandb_id").write_text("")
    with caplog.at_level(logging.WARNING):
        run_id = metrics._wandb_id(tmp_path)
    assert len(run_id) == 12 and (tmp_path / "wandb_id").read_text().strip() == run_id
    assert "does not hold a wandb run id" in caplog.text
    wandb = pytest.importorskip("wandb")

    def failing(**kwargs):
        raise RuntimeError("simulated")

    monkeypatch.setattr(wandb, "init", failing)
    cfg = load_config(None, [f"train.run_dir={tmp_path}", "logging.wandb.mode=offline"])
    with pytest.raises(metrics.TrainingError) as info:
        metrics.MetricsWriter(cfg, tmp_path, True, 0)
    assert "logging.wandb.mode=offline" in str(info.value) and "use logging.wandb.mode=offline" not in str(info.value)
    assert "logging.wandb.mode=disabled" in str(info.value)


@pytest.mark.parametrize("entry", [".lock", "config.yaml", "metrics.jsonl", "checkpoints/latest", "checkpoints"])
def test_a_symlink_in_the_run_dir_is_refused_and_its_target_untouched(entry, trained, cache_dir, tmp_path, capsys):
    target = tmp_path / "precious"
    if entry == "checkpoints":
        (trained / entry).rename(target)
    else:
        target.write_text("precious\n")
        (trained / entry).unlink()
    before = sorted(p.name for p in target.iterdir()) if target.is_dir() else target.read_text()
    (trained / entry).symlink_to(target)
    code, _, err = run_train(capsys, *overrides(trained, cache_dir, "train.steps=3"))
    assert code == 1 and "Traceback" not in err
    assert f"{trained / entry} is a symlink (to {target}); moela never writes through a link" in err
    assert (sorted(p.name for p in target.iterdir()) if target.is_dir() else target.read_text()) == before

