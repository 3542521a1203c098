"""Evaluation fits where training fits, and running out of device memory anywhere is one message.

CPU: an out-of-memory error (simulated: the evaluation or a training step raises torch.OutOfMemoryError) ends the run
with one line naming the phase, what it tried to allocate, the settings that lower it and the intact checkpoint a
rerun resumes from; exit code 1, nothing saved after it.
GPU: a graphed run whose device memory is capped just above what training reserved evaluates within the cap (the
graphs' pool is released for it) and captures again after; the control (the evaluation allocating beside the pool)
is reported alongside.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fault_helpers import ROOT, overrides, run_train
from moela.trainer import Trainer, evaluation

OOM_TEXT = ("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.06 GiB is free.")


def test_an_oom_in_the_final_evaluation_is_one_line_after_the_last_checkpoint(trained, cache_dir, capsys,
                                                                              monkeypatch):
    def out_of_memory(trainer):
        raise torch.OutOfMemoryError(OOM_TEXT)

    monkeypatch.setattr(evaluation, "evaluate", out_of_memory)
    code, out, err = run_train(capsys, *overrides(trained, cache_dir, "train.steps=3"))
    assert code == 1 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith("error: out of memory: the evaluation needed 2.50 GiB more. Lower its memory with: "
                           "train.tokens_per_microbatch")
    assert f"rerunning resumes from {trained}/checkpoints/step-2, which is intact" in line
    assert sorted(p.name for p in (trained / "checkpoints").iterdir()) == ["latest", "step-1", "step-2"]


def test_an_oom_in_a_training_step_names_the_step_and_its_settings(trained, cache_dir, capsys, monkeypatch):
    real = Trainer.train_step

    def third_fails(self):
        if self.step == 2:
            raise torch.OutOfMemoryError(OOM_TEXT)
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", third_fails)
    code, out, err = run_train(capsys, *overrides(trained, cache_dir, "train.steps=4", "checkpoint.resume=none",
                                                  "checkpoint.every=1"))
    assert code == 1 and "Traceback" not in err
    assert ("error: out of memory: the training step needed 2.50 GiB more. Lower its memory with: "
            "train.tokens_per_microbatch (raise train.grad_accum to keep the batch)") in err
    assert f"rerunning resumes from {trained}/checkpoints/step-2, which is intact" in err


@pytest.mark.gpu
def test_the_evaluation_fits_in_the_memory_the_graphed_training_step_used(tmp_path):
    def child(mode: str) -> dict:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "faults" / "eval_memory_child.py"),
                               str(tmp_path / mode), mode], capture_output=True, text=True, timeout=900, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    fit = child("release")
    assert fit["outcome"] is None, fit
    assert fit["eval_peak"] <= fit["cap"] and fit["replays_after_eval"] == 2, fit  # re-captured after it
    control = child("beside")
    print(f"training reserved {fit['train_peak'] / 2**30:.2f} GiB; evaluation peak {fit['eval_peak'] / 2**30:.2f} "
          f"GiB with the pool released, {control['eval_peak'] / 2**30:.2f} GiB beside it ({control['outcome']})")
