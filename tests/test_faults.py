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
import subprocess
import sys
from pathlib import Path

import pytest

from moela.config import ConfigError, load_config
from moela.trainer import Trainer, TrainingError
from moela.trainer.metrics import MetricsWriter, read_metrics

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402

TINY = [
    "model.vocab_size=4096", "model.hidden_size=32", "model.num_hidden_layers=2", "model.first_k_dense_replace=1",
    "model.n_routed_experts=4", "model.n_group=2", "model.topk_group=1", "model.num_experts_per_tok=2",
    "model.num_attention_heads=2", "model.q_lora_rank=16", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8",
    "model.qk_rope_head_dim=8", "model.v_head_dim=8", "model.intermediate_size=48", "model.moe_intermediate_size=16",
    "model.num_nextn_predict_layers=1", "data.max_doc_len=64", "data.val_max_tokens=256",
    "train.tokens_per_microbatch=128", "train.cpu_threads=1", "train.eval_every=0", "schedule.warmup_steps=1",
    "optim.lr=3e-3", "logging.log_every=1", "logging.plot=false", "logging.progress_bar=never",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("token_cache"))


def overrides(run_dir, cache_dir, *extra) -> list[str]:
    return [*TINY, f"train.run_dir={run_dir}", f"data.cache_dir={cache_dir}", "train.steps=2", *extra]


def make_cfg(run_dir, cache_dir, *extra):
    return load_config(None, overrides(run_dir, cache_dir, *extra))


def run_main(capsys, *args) -> tuple[int, str, str]:
    """train.py's main() in this process: (exit code, stdout, stderr)."""
    code = train.main([str(ROOT / "recipes" / "tiny.yaml"), *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------------------------------------------
# Recipe values


@pytest.mark.parametrize("override", ["optim.lr=.nan", "optim.lr=.inf", "optim.weight_decay=-.inf",
                                      "model.rope_theta=.nan", "schedule.min_lr_ratio=.nan"])
def test_non_finite_float_keys_are_recipe_errors(override, capsys):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"command line: {key}: expected a finite number, got"):
        load_config(None, [override])
    code, out, err = run_main(capsys, override, "--print-config")
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
