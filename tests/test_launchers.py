"""Launchers on one CPU machine, each running the unchanged CLI with tensor parallelism, equal to one process:

- two `torchrun` agents as two "nodes" (`--nnodes=2`, c10d rendezvous on localhost, 2 gloo workers each): HSDP
  replicates across the nodes (`dp_replicate=2`) and tensor parallelism (`tp=2`) runs inside each, with the
  cost-balanced sampler;
- `accelerate launch` (2 processes; on a machine without GPUs its `--multi_gpu` launcher starts CPU workers) with
  `tp=2`.
Both resume from a checkpoint a single process wrote after 2 steps and train step 3, whose loss must equal the single
process's own step 3 (relative 1e-4: float32 sums in another order). They start from the same
checkpoint because initialization draws each parameter's values for its own layout (a tp shard is drawn as its
own tensor), so two layouts started from scratch differ from the first step; from equal weights, optimizer state,
data position and RNG states on, they must train alike. Every run takes 2 micro-batches a step: the single
process and the accelerate run (1 data-parallel rank) accumulate 2, each HSDP replica takes 1.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from factories import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
MODEL = tiny_overrides(vocab_size=4096, block="fal", qk_norm="layer", num_hidden_layers=2, num_nextn_predict_layers=0)
COMMON = [*MODEL, "train.device=cpu", "train.steps=3", "train.tokens_per_microbatch=128", "train.eval_every=0",
          "data.max_doc_len=64", "data.val_max_tokens=0", "logging.log_every=1", "logging.plot=false",
          "checkpoint.every=2", "checkpoint.save_at_end=false", "model.attention_backend=reference",
          "model.moe_backend=reference"]
TIMEOUT = 600


def train_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> tuple[Path, Path]:
    """(the single process's run dir, the token cache) after 3 steps, with a checkpoint at step 2."""
    tmp = tmp_path_factory.mktemp("single")
    run, cache = tmp / "run", tmp / "cache"
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), str(ROOT / "recipes" / "tiny.yaml"), *COMMON,
                           "train.grad_accum=2", f"train.run_dir={run}", f"data.cache_dir={cache}"],
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, cache


def resumed_run(single: tuple[Path, Path], tmp_path: Path) -> tuple[Path, list[str]]:
    """A run dir holding the single process's step-2 checkpoint, and the overrides that resume from it."""
    source, cache = single
    run = tmp_path / "run"
    shutil.copytree(source / "checkpoints" / "step-2", run / "checkpoints" / "step-2")
    return run, [*COMMON, f"train.run_dir={run}", f"data.cache_dir={cache}", "checkpoint.resume=auto"]


def check_continues_like_one_process(run: Path, single: Path) -> None:
    got, expected = train_losses(run), train_losses(single)
    assert sorted(got) == [3] and sorted(expected) == [1, 2, 3], (got, expected)
    assert got[3] == pytest.approx(expected[3], rel=1e-4), (got, expected)


def test_two_torchrun_nodes_hsdp_across_tp_inside_equal_one_process(single_process, tmp_path):
    run, overrides = resumed_run(single_process, tmp_path)
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=moela-two-nodes", str(ROOT / "train.py"),
           str(ROOT / "recipes" / "tiny.yaml"), *overrides, "parallel.dp_replicate=2", "parallel.dp_shard=1",
           "parallel.tp=2", "data.balance=true", "train.grad_accum=1"]
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    files = [log.open("w") for log in logs]
    try:
        nodes = [subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, cwd=ROOT) for f in files]
        codes = [node.wait(timeout=TIMEOUT) for node in nodes]
    finally:
        for f in files:
            f.close()
    output = "\n".join(log.read_text() for log in logs)
    assert codes == [0, 0], output[-4000:]
    assert "on 4 x cpu" in output and "resumed from" in output
    check_continues_like_one_process(run, single_process[0])


def test_accelerate_launch_runs_the_same_recipe_with_tp(single_process, tmp_path):
    pytest.importorskip("accelerate")
    run, overrides = resumed_run(single_process, tmp_path)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2",
           "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", f"--main_process_port={free_port()}",
           str(ROOT / "train.py"), str(ROOT / "recipes" / "tiny.yaml"), *overrides, "parallel.tp=2",
           "train.grad_accum=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "on 2 x cpu" in proc.stdout
    check_continues_like_one_process(run, single_process[0])
