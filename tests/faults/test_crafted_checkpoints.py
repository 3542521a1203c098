"""A shared checkpoint cannot run code: every route that opens one (resume, init_from=step-N, generate, eval,
export) meets crafted files whose unpickling would create a marker file, and must refuse them naming the file,
without the marker appearing.

Three crafts, each with a manifest resealed to match (whoever crafts the files rehashes them):
- `.metadata` replaced by a pickle that calls `open(marker, "w")`;
- `trainer-rank0.pt` replaced by a torch-saved object that does the same;
- a legitimate `.metadata` that declares one entry (a weight, or the optimizer's learning rate, which DCP does
  store as bytes) as bytes in a shard where the payload was appended: DCP's default planner would read it with
  `torch.load(weights_only=False)`.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from fault_helpers import Payload, overrides, pickled, reseal, run_moela, run_train, torch_saved
from moela.trainer import safe_load


def craft_metadata(step: Path, marker: Path) -> Path:
    (step / ".metadata").write_bytes(pickled(Payload(marker)))
    reseal(step)
    return step / ".metadata"


def craft_trainer_state(step: Path, marker: Path) -> Path:
    (step / "trainer-rank0.pt").write_bytes(torch_saved(Payload(marker)))
    reseal(step)
    return step / "trainer-rank0.pt"


def craft_bytes_entry(step: Path, marker: Path, key: str = "model.embed.weight") -> Path:
    metadata = safe_load.read_metadata(step)
    assert key in metadata.state_dict_metadata
    shard = sorted(step.glob("*.distcp"))[0]
    payload = torch_saved(Payload(marker))
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data = {i: s for i, s in metadata.storage_data.items() if i.fqn != key}
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(shard.name, offset, len(payload))
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(step)
    return step


CRAFTS = {"metadata": craft_metadata, "trainer_state": craft_trainer_state, "bytes_entry": craft_bytes_entry,
          "optimizer_bytes": lambda step, marker: craft_bytes_entry(step, marker, "optim.param_groups.0.lr")}


def test_the_payloads_run_code_when_read_the_unsafe_way(tmp_path):
    """The crafts are real: a plain unpickler and torch.load(weights_only=False) create the marker."""
    marker = tmp_path / "ran"
    pickle.loads(pickled(Payload(marker)))
    assert marker.exists()
    marker.unlink()
    torch.load(tmp_path.joinpath("x.pt") if tmp_path.joinpath("x.pt").write_bytes(torch_saved(Payload(marker)))
               else None, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("craft", CRAFTS)
def test_resume_refuses_a_crafted_checkpoint_and_auto_falls_back(craft, trained, cache_dir, capsys, tmp_path):
    marker = tmp_path / "ran"
    step = trained / "checkpoints" / "step-2"
    named = CRAFTS[craft](step, marker)
    code, out, err = run_train(capsys, *overrides(trained, cache_dir, "train.steps=3", f"checkpoint.resume={step}"))
    assert code == 1 and "Traceback" not in err and not marker.exists()
    assert str(named) in err and "refusing to read it" in err
    code, out, err = run_train(capsys, *overrides(trained, cache_dir, "train.steps=3"))
    assert code == 0, err
    assert not marker.exists()
    assert f"checkpoint {step} is corrupt: {named}" in out
    assert f"resumed from {trained}/checkpoints/step-1 at step 1" in out


@pytest.mark.parametrize("craft", ["metadata", "bytes_entry"])
def test_init_from_refuses_a_crafted_checkpoint(craft, trained, cache_dir, capsys, tmp_path):
    marker = tmp_path / "ran"
    step = trained / "checkpoints" / "step-2"
    named = CRAFTS[craft](step, marker)
    code, out, err = run_train(capsys, *overrides(tmp_path / "fine-tune", cache_dir,
                                                  f"checkpoint.init_from={step}"))
    assert code == 1 and "Traceback" not in err and not marker.exists()
    assert "checkpoint.init_from:" in err and str(named) in err and "refusing to read it" in err


@pytest.mark.parametrize("craft", ["metadata", "bytes_entry"])
@pytest.mark.parametrize("command", [["generate", "--prompt", "ROMEO:", "--max-new-tokens", "2", "--device", "cpu"],
                                     ["eval", "--max-tokens", "64", "--device", "cpu"],
                                     ["export", "OUT"]])
def test_commands_refuse_a_crafted_checkpoint(command, craft, trained, capsys, tmp_path):
    marker = tmp_path / "ran"
    step = trained / "checkpoints" / "step-2"
    named = CRAFTS[craft](step, marker)
    args = [command[0], step, *[tmp_path / "export" if a == "OUT" else a for a in command[1:]]]
    code, out, err = run_moela(capsys, *args)
    assert code == 2 and "Traceback" not in err and not marker.exists()
    assert str(named) in err and "refusing to read it" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("command", ["generate", "export"])
def test_commands_on_the_run_fall_back_from_a_crafted_newest_checkpoint(command, trained, capsys, tmp_path):
    marker = tmp_path / "ran"
    named = craft_metadata(trained / "checkpoints" / "step-2", marker)
    extra = [tmp_path / "export"]
    if command == "generate":
        extra = ["--prompt", "ROMEO:", "--max-new-tokens", "2", "--device", "cpu"]
    code, out, err = run_moela(capsys, command, trained, *extra)
    assert code == 0, err
    assert not marker.exists()
    assert f"{named} names io.open" in err
    assert f"using the newest intact checkpoint, {trained}/checkpoints/step-1" in err


def test_a_metadata_pointing_outside_the_checkpoint_is_refused(trained, tmp_path):
    step = trained / "checkpoints" / "step-2"
    metadata = safe_load.read_metadata(step)
    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    metadata.storage_data[index] = _StorageInfo("../../../etc/passwd", info.offset, info.length)
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(safe_load.CorruptCheckpoint, match="not a file name inside the checkpoint folder"):
        safe_load.read_metadata(step)


def test_trainer_state_is_plain_data_and_legacy_numpy_state_still_loads(trained, tmp_path):
    """What the trainer saves loads with weights_only=True alone; a file holding NumPy's legacy RNG tuple (as
    written before) loads through the allow-list with its array intact."""
    state = torch.load(trained / "checkpoints" / "step-2" / "trainer-rank0.pt", weights_only=True)
    assert state["step"] == 2 and isinstance(state["rng"]["numpy"]["state"]["key"], torch.Tensor)
    import numpy as np
    legacy = {**state, "rng": {**state["rng"], "numpy": np.random.RandomState(3).get_state()}}
    file = tmp_path / "legacy.pt"
    torch.save(legacy, file)
    loaded = safe_load.load_trainer_state(file)
    assert (loaded["rng"]["numpy"][1] == np.random.RandomState(3).get_state()[1]).all()
