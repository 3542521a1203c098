"""The side process that builds a compiled run's kernels during its cold start (moela.trainer.prewarm): when it
starts, the config it runs (the run's, cut to one block of each kind), the environment it gets (no launcher
variables, the run's GPU), that its command really runs a forward and backward (here on the CPU), and that a run dir
it cannot write leaves the run alone."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from factories import tiny_overrides
from moela.config import load_config
from moela.trainer import prewarm

ROOT = Path(__file__).resolve().parents[1]


def _cfg(*extra):
    return load_config(str(ROOT / "recipes" / "tiny.yaml"), [*tiny_overrides(), "train.tokens_per_microbatch=96",
                                                             *extra])


def test_wanted_only_for_a_compiled_cuda_run_on_local_rank_0():
    on = _cfg("train.compile=true")
    assert prewarm.wanted(on, "cuda", 0)
    assert not prewarm.wanted(on, "cuda", 1)  # one side process a machine: the caches are the machine's
    assert not prewarm.wanted(on, "cpu", 0)  # nothing to build: the interpreter runs the kernels
    assert not prewarm.wanted(_cfg("train.compile=false"), "cuda", 0)
    assert not prewarm.wanted(_cfg("train.compile=true", "train.prewarm_kernels=false"), "cuda", 0)


@pytest.mark.parametrize("layers,dense,want", [(3, 1, (2, 1)), (5, 0, (1, 0)), (2, 2, (1, 1)), (6, 3, (2, 1))])
def test_cut_keeps_one_block_of_each_kind(layers, dense, want):
    cfg = _cfg(f"model.num_hidden_layers={layers}", f"model.first_k_dense_replace={dense}")
    cut = load_config(str(ROOT / "recipes" / "tiny.yaml"), [*tiny_overrides(), f"model.num_hidden_layers={layers}",
                                                          f"model.first_k_dense_replace={dense}",
                                                          *prewarm.cut_overrides(cfg.model)]).model
    assert (cut.num_hidden_layers, cut.first_k_dense_replace) == want
    assert cut.num_nextn_predict_layers == cfg.model.num_nextn_predict_layers  # the MTP block is compiled too
    assert (cut.hidden_size, cut.n_routed_experts, cut.qk_rope_head_dim) == (
        cfg.model.hidden_size, cfg.model.n_routed_experts, cfg.model.qk_rope_head_dim)


def test_start_runs_the_cut_model_in_a_clean_environment(tmp_path, monkeypatch):
    """start() writes the run's config, starts `python -m moela.trainer.prewarm` with the cut and no launcher
    variables on the run's physical GPU; the same command (on the CPU here) runs a forward and backward and prints
    a finite loss."""
    cfg = _cfg("train.compile=true", f"train.run_dir={tmp_path}")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    seen = {}

    class FakePopen:
        pid = 1234

        def __init__(self, args, env, stdout, stderr, stdin):
            seen.update(args=args, env=env)

    monkeypatch.setattr(prewarm.subprocess, "Popen", FakePopen)
    proc, line = prewarm.start(cfg, tmp_path, device_index=1, rank=3)
    assert isinstance(proc, FakePopen) and "pid 1234" in line and "prewarm-rank3.log" in line
    assert seen["args"][:3] == [sys.executable, "-m", "moela.trainer.prewarm"]
    assert seen["args"][3] == str(tmp_path / "prewarm-rank3.yaml")
    assert "RANK" not in seen["env"] and "MASTER_ADDR" not in seen["env"]
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "5"  # this process's cuda:1 is physical device 5
    assert (tmp_path / "prewarm-rank3.log").exists()
    monkeypatch.undo()  # the real subprocess.Popen again

    args = [a if a != "train.device=cuda" else "train.device=cpu" for a in seen["args"]]
    env = {**seen["env"], "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    loss = float(done.stdout.split("(loss ")[1].split(")")[0])
    # random tokens: the LM term near ln(V), plus the MTP term (weight mtp_loss_weight) near ln(V) too
    assert abs(loss - (1 + cfg.model.mtp_loss_weight) * math.log(cfg.model.vocab_size)) < 0.5, loss


def test_start_without_a_writable_run_dir_returns_the_reason(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc, line = prewarm.start(_cfg("train.compile=true"), blocker / "run", device_index=0)
    assert proc is None and "no side process" in line and "builds every kernel itself" in line


def test_stop_ends_a_running_side_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    prewarm.stop(proc)
    assert proc.poll() is not None
    prewarm.stop(None)  # nothing started: nothing to do
