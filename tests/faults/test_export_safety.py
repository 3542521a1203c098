"""`python -m moela export` cannot destroy: OUT may not be, contain or lie inside a run directory; `--overwrite`
replaces only a previous export; a failure at any point leaves nothing half-written and the previous export
intact; `--no-mtp` writes a folder transformers loads without unexpected keys."""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from fault_helpers import run_moela
from moela.tools import export


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative name -> sha256)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.endswith((".partial", ".old")))


@pytest.mark.parametrize("where", ["the run", "its parent", "inside the run", "its checkpoints", "another run"])
def test_an_out_that_touches_a_run_is_refused_and_the_run_is_untouched(where, trained, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(trained, other)
    out = {"the run": trained, "its parent": trained.parent, "inside the run": trained / "hf",
           "its checkpoints": trained / "checkpoints", "another run": other / "checkpoints" / "hf"}[where]
    before = snapshot(tmp_path)
    code, _, err = run_moela(capsys, "export", trained, out, "--overwrite")
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"error: {out}:" in err and ("run directory" in err or "checkpoints" in err)
    assert snapshot(tmp_path) == before and not (trained / "hf").exists()


def test_a_symlink_into_the_run_is_refused(trained, tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(trained)
    code, _, err = run_moela(capsys, "export", trained, link, "--overwrite")
    assert code == 2 and "inside the run directory" in err
    assert (trained / "checkpoints" / "step-2" / "manifest.json").is_file()


@pytest.mark.parametrize("kind", ["file", "folder of the user's", "empty folder"])
def test_overwrite_replaces_only_a_previous_export(kind, trained, tmp_path, capsys):
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("keep me")
    else:
        out.mkdir()
        if kind == "folder of the user's":
            (out / "config.json").write_text("{}")
            (out / "model.safetensors").write_bytes(b"")
            (out / "notes.txt").write_text("keep me")
    before = snapshot(tmp_path)
    code, _, err = run_moela(capsys, "export", trained, out, "--overwrite")
    assert code == 2 and "Traceback" not in err and "replaces only a previous export" in err
    assert snapshot(tmp_path) == before and leftovers(tmp_path) == []


def test_a_previous_export_is_replaced_and_nothing_is_left_beside_it(trained, tmp_path, capsys):
    out = tmp_path / "hf"
    assert run_moela(capsys, "export", trained, out, "--step", "1")[0] == 0
    code, _, err = run_moela(capsys, "export", trained, out)
    assert code == 2 and "already exists" in err
    assert run_moela(capsys, "export", trained, out, "--overwrite")[0] == 0
    assert leftovers(tmp_path) == [] and export.export_dir.previous_export_problem(out) is None


def test_a_disk_error_mid_export_is_one_line_and_keeps_the_previous_export(trained, tmp_path, capsys, monkeypatch):
    out = tmp_path / "hf"
    assert run_moela(capsys, "export", trained, out, "--step", "1")[0] == 0
    before = snapshot(out)

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.out_dir / "shard-00000.safetensors"))

    monkeypatch.setattr(export._Exporter, "flush", full)
    code, _, err = run_moela(capsys, "export", trained, out, "--overwrite")
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"cannot write the export {out}: no space left on the device" in err and "choose another OUT" in err
    assert snapshot(out) == before and leftovers(tmp_path) == []


def test_any_error_mid_export_removes_the_partial_folder(trained, tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(export, "write_tokenizer_files", broken)
    with pytest.raises(RuntimeError, match="simulated failure"):
        run_moela(capsys, "export", trained, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_no_mtp_leaves_the_mtp_layers_out_and_the_message_says_so(trained, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    code, _, err = run_moela(capsys, "export", trained, tmp_path / "with")
    assert code == 0 and "--no-mtp leaves them out" in err
    code, _, err = run_moela(capsys, "export", trained, tmp_path / "without", "--no-mtp")
    assert code == 0 and "--no-mtp" not in err
    config = json.loads((tmp_path / "without" / "config.json").read_text())
    layers = config["num_hidden_layers"]
    assert config["num_nextn_predict_layers"] == 0
    index = json.loads((tmp_path / "without" / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(k.startswith(f"model.layers.{layers}.") for k in index)
    with_mtp = json.loads((tmp_path / "with" / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.startswith(f"model.layers.{layers}.") for k in with_mtp)
    assert set(index) < set(with_mtp)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "with", output_loading_info=True)
    assert any(k.startswith(f"model.layers.{layers}.") for k in info["unexpected_keys"])
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "without", output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
