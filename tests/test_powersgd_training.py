"""The trainer with `parallel.replicate_compression: powersgd` on 4 gloo ranks as 2 (replicate) x 2 (shard).

- Tracking: the tiny MoE recipe with gradient accumulation and clipping, compressed at rank 4, follows the HSDP
  (uncompressed) run from the same start; the step records log the replicate bytes and their ratio, equal to
  what `powersgd_bytes` predicts for the rank's gradient shards with the embedding and head sent whole.
- Resume: a run stopped at a checkpoint after its warmup and resumed ends with the same weights, optimizer-free
  reducer state (error feedback, Q) and losses, bit for bit, as the run that went straight through; without the
  reducer state in the checkpoint it would not (the resumed run would restart the error feedback and Q).
- A NaN loss on one rank at a compressed step: the step is skipped and the next ones train on, every weight and
  every error-feedback and Q tensor finite.
- A recipe asking for compression without a replicate dimension is refused with the fix.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from factories import poison_steps, tiny_overrides
from moela.config import load_config
from moela.configlib import ConfigError
from moela.parallel.mesh import local_shard
from moela.parallel.powersgd import powersgd_bytes
from moela.trainer import Trainer
from parallel_harness import spawn
from parallel_training import full_state

TRACK_STEPS = 30
TRACK_TOL = 0.03  # relative gap of the logged mean training loss over the last 10 steps and of the final val loss


def _cfg(run_dir, cache_dir, *extra):
    return load_config(None, tiny_overrides(vocab_size=4096, num_hidden_layers=2, n_routed_experts=4,
                                            q_lora_rank=16, hidden_size=64) + [
        f"train.run_dir={run_dir}", f"data.cache_dir={cache_dir}", "data.max_doc_len=64",
        "data.val_max_tokens=512", "train.tokens_per_microbatch=128", "train.grad_accum=2", "train.cpu_threads=1",
        "train.eval_every=0", "schedule.warmup_steps=3", "optim.lr=3e-3", "logging.plot=false",
        "logging.progress_bar=never", "checkpoint.every=0", "checkpoint.save_at_end=false",
        "parallel.dp_replicate=2", *extra])


def _fit(rank: int, world_size: int, run_dir: str, cache_dir: str, extra: list[str], out: str | None,
         poisoned: tuple[int, ...] = ()) -> None:
    trainer = Trainer(_cfg(run_dir, cache_dir, *extra))
    if rank == 0:
        poison_steps(trainer, poisoned)
    trainer.fit()
    if out is None:
        return
    state = full_state(trainer.model)
    if trainer.replicate is not None:
        state.update({k: v.clone() for k, v in trainer.replicate.state_dict().items()})
        shapes = {name: local_shard(p).shape for name, p in trainer.replicate.params}
        vocabulary = [shapes.pop("embed.weight"), shapes.pop("head.weight")]  # sent whole
        state["bytes"] = torch.tensor(powersgd_bytes(shapes.values(), trainer.cfg.parallel.powersgd_rank)
                                      + 4 * sum(math.prod(s) for s in vocabulary))
        state["uncompressed"] = torch.tensor(4 * sum(local_shard(p).numel() for _, p in trainer.replicate.params))
    torch.save(state, f"{out}-rank{rank}.pt")


def _records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_compressed_training_tracks_hsdp_and_logs_its_bytes(tmp_path):
    cache = str(tmp_path / "cache")
    common = [f"train.steps={TRACK_STEPS}", "logging.log_every=1", "train.eval_every=30",
              "parallel.powersgd_warmup_steps=5"]
    spawn(_fit, 4, str(tmp_path / "hsdp"), cache, common, None)
    spawn(_fit, 4, str(tmp_path / "psgd"), cache, common + ["parallel.replicate_compression=powersgd"],
          str(tmp_path / "psgd"))
    exact, compressed = _records(tmp_path / "hsdp"), _records(tmp_path / "psgd")
    train = [[r for r in recs if r["kind"] == "train"] for recs in (exact, compressed)]
    evals = [[r["val_loss"] for r in recs if r["kind"] == "eval"][-1] for recs in (exact, compressed)]
    late = [sum(r["loss"] for r in recs[-10:]) / 10 for recs in train]
    assert abs(late[1] / late[0] - 1) < TRACK_TOL, late
    assert abs(evals[1] / evals[0] - 1) < TRACK_TOL, evals
    assert late[1] < train[1][0]["loss"] - 0.5  # it learns
    state = torch.load(tmp_path / "psgd-rank0.pt")
    first, last = train[1][0], train[1][-1]
    assert first["replicate_bytes"] == first["replicate_bytes_uncompressed"] == int(state["uncompressed"])
    # every block matrix is compressed; the 4096-row embedding and head, sent whole, are most of this small model
    assert last["replicate_bytes"] == int(state["bytes"]) < last["replicate_bytes_uncompressed"]
    assert sum(k.endswith(".error") for k in state) >= 4
    assert last["replicate_compression"] == pytest.approx(int(state["uncompressed"]) / int(state["bytes"]))
    assert "replicate_bytes" not in train[0][-1]


def test_resume_mid_run_is_exact(tmp_path):
    cache = str(tmp_path / "cache")
    common = ["parallel.replicate_compression=powersgd", "parallel.powersgd_warmup_steps=1", "logging.log_every=1"]
    spawn(_fit, 4, str(tmp_path / "straight"), cache, common + ["train.steps=5"], str(tmp_path / "straight"))
    spawn(_fit, 4, str(tmp_path / "resumed"), cache, common + ["train.steps=3", "checkpoint.save_at_end=true"],
          None)
    spawn(_fit, 4, str(tmp_path / "resumed"), cache, common + ["train.steps=5"], str(tmp_path / "resumed"))
    for rank in range(4):
        straight = torch.load(tmp_path / f"straight-rank{rank}.pt")
        resumed = torch.load(tmp_path / f"resumed-rank{rank}.pt")
        assert straight.keys() == resumed.keys()
        assert any(k.endswith(".error") for k in straight) and int(straight[f"rank{rank}.steps"]) == 5
        for key, value in straight.items():
            assert torch.equal(resumed[key], value), (rank, key)
    losses = [[r["loss"] for r in _records(tmp_path / run) if r["kind"] == "train"][-2:]
              for run in ("straight", "resumed")]
    assert losses[0] == losses[1] and all(math.isfinite(x) for x in losses[0])


def test_a_non_finite_gradient_on_one_rank_skips_the_step_and_training_goes_on(tmp_path):
    run = tmp_path / "run"
    spawn(_fit, 4, str(run), str(tmp_path / "cache"), ["parallel.replicate_compression=powersgd",
          "parallel.powersgd_warmup_steps=1", "logging.log_every=1", "train.steps=5"], str(run), (3,))
    train = [r for r in _records(run) if r["kind"] == "train"]
    assert [r["skipped"] for r in train] == [0, 0, 1, 1, 1]
    assert all(math.isfinite(r["loss"]) for r in train[3:]) and math.isnan(train[2]["loss"])
    for rank in range(4):
        state = torch.load(tmp_path / f"run-rank{rank}.pt")
        assert all(torch.isfinite(v).all() for v in state.values()), rank


def test_compression_without_a_replicate_dimension_is_refused():
    with pytest.raises(ConfigError, match="dp_replicate >= 2 or replicate_compression: none"):
        load_config(None, ["parallel.replicate_compression=powersgd"])
