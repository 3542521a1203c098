"""The trainer with `parallel.pp: 2` on 2 gloo ranks: the same step losses as one process (the model's initial
values included: every stage initializes its parts as the whole model does), and its checkpoint resumes in one
process with the weights and AdamW moments the two stages saved, continuing the one-process run's losses (a constant
LR after warm-up, so that runs of 3 and 4 steps share their schedule), and at pp=1 x dp_shard=2 (x ep=2) and at
pp=4 with the same states.

Tolerance: 2e-5 relative on losses (the stages sum the same terms in another order, float32).
"""

from __future__ import annotations

import json

import pytest
import torch

from factories import two_micro_batch_cfg
from moela.trainer import Trainer, checkpoint
from parallel_harness import spawn
from test_parallel_checkpoint import full_states


def _losses(run) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("kind") == "train"]


def _cfg(run, cache, steps, *extra):
    return two_micro_batch_cfg(run, f"data.cache_dir={cache}", f"train.steps={steps}", "model.aux_loss_coef=0.01",
                               "checkpoint.save_at_end=true", "schedule.kind=constant", *extra)


def _train(rank, world, run, cache, steps, extra, out):
    trainer = Trainer(_cfg(run, cache, steps, *extra))
    trainer.fit()
    state = full_states(trainer.model, trainer.optimizer)
    torch.save(state, out / f"state-{rank}.pt")


def test_two_stage_training_matches_one_process_and_resumes_in_one(tmp_path):
    cache = tmp_path / "cache"
    one = tmp_path / "one"
    Trainer(_cfg(one, cache, 4)).fit()
    reference = _losses(one)
    pp = tmp_path / "pp"
    spawn(_train, 2, pp, cache, 3, ["parallel.pp=2", "parallel.pp_schedule=1f1b"], tmp_path)
    assert _losses(pp) == pytest.approx(reference[:3], rel=2e-5)
    saved = {**torch.load(tmp_path / "state-0.pt"), **torch.load(tmp_path / "state-1.pt")}
    cfg = _cfg(pp, cache, 4)
    resumed = Trainer(cfg)
    assert checkpoint.resume(resumed.run_dir, cfg.checkpoint.resume, resumed.model, resumed.optimizer,
                             checkpoint.fixed_settings(cfg), print) is not None
    loaded = full_states(resumed.model, resumed.optimizer)
    resumed.lock.release()
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
    Trainer(_cfg(pp, cache, 4)).fit()
    assert _losses(pp)[-1] == pytest.approx(reference[3], rel=2e-5)


def _resume(rank, world, run, cache, extra, out):
    cfg = _cfg(run, cache, 4, *extra)
    trainer = Trainer(cfg)
    assert checkpoint.resume(trainer.run_dir, cfg.checkpoint.resume, trainer.model, trainer.optimizer,
                             checkpoint.fixed_settings(cfg), print) is not None
    torch.save(full_states(trainer.model, trainer.optimizer), out / f"resumed-{rank}.pt")
    trainer.lock.release()


@pytest.mark.slow
@pytest.mark.parametrize("world,layout", [(2, ["parallel.dp_shard=2"]), (2, ["parallel.dp_shard=2", "parallel.ep=2"]),
                                          (4, ["parallel.pp=4", "parallel.pp_schedule=1f1b", "train.grad_accum=4"])])
def test_two_stage_checkpoint_resumes_under_another_layout(tmp_path, world, layout):
    """A pp=2 checkpoint loads at pp=1 x dp_shard=2 (and x ep=2) and at pp=4 with the same weights and AdamW
    moments, bit for bit (at pp=4 a stage may hold no matrix or no vector: an optimizer with an empty group)."""
    cache, run = tmp_path / "cache", tmp_path / "pp"
    spawn(_train, 2, run, cache, 3, ["parallel.pp=2", "parallel.pp_schedule=1f1b"], tmp_path)
    saved = {**torch.load(tmp_path / "state-0.pt"), **torch.load(tmp_path / "state-1.pt")}
    spawn(_resume, world, run, cache, layout, tmp_path)
    covered = set()
    for rank in range(world):  # each rank's own parameters (a stage's, under pp), all of them over the ranks
        loaded = torch.load(tmp_path / f"resumed-{rank}.pt")
        covered |= loaded.keys()
        for name, value in loaded.items():
            torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=f"rank {rank}: {name}")
    assert covered == saved.keys()
