"""`checkpoint.init_from` on 2 gloo ranks equals one process: the Trainer starts from an HF export (`hf:PATH`) and
from a native `step-N` checkpoint of a model written by one process, under FSDP2 (dp_shard=2), FSDP2 + expert
parallelism (ep=2) and tensor parallelism (tp=2), and on 4 ranks under tp=2 x dp_shard=2. After loading, every
weight gathered from the shards equals the written one exactly (copying is exact; the layouts' random
initializations all differ from it, so nothing may stay at its init), and the loss of step 1 (computed before any
update) equals the single process's (relative 1e-5: float32 sums in another order). Bad input raises the same
clear error on every rank, also when only one rank fails (a path another rank cannot see), and leaves no rank
waiting in a collective.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from factories import VISIBLE_TRAINING, tiny_config, tiny_overrides
from moela.config import load_config
from moela.model import build_model
from moela.model.hf import export_hf
from moela.parallel import apply_parallelism, build_mesh
from moela.parallel.config import ParallelConfig
from moela.trainer import Trainer, TrainingError
from moela.trainer.checkpoint import save_checkpoint
from moela.trainer.init_from import load_initial_weights
from parallel_harness import spawn

SHAPE = dict(VISIBLE_TRAINING, vocab_size=4096, max_position_embeddings=256)  # the bundled tokenizer's vocabulary
LAYOUTS = [dict(dp_shard=2), dict(dp_shard=2, ep=2), dict(tp=2)]


def _cfg(run_dir: Path, cache_dir: Path, *extra: str):
    return load_config(None, tiny_overrides(**SHAPE) + [
        f"train.run_dir={run_dir}", f"data.cache_dir={cache_dir}", "data.max_doc_len=64", "data.val_max_tokens=0",
        "train.tokens_per_microbatch=128", "train.steps=1", "train.cpu_threads=1", "train.eval_every=0",
        "logging.log_every=1", "logging.progress_bar=never", "logging.samples=0", "logging.plot=false",
        "checkpoint.save_at_end=false", *extra])


def _step1_loss(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in records if r.get("kind") == "train" and r["step"] == 1)


def _full_weights(model) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in get_model_state_dict(model).items()}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(hf export, step-N folder, the written weights, the token cache) of one process's model."""
    tmp = tmp_path_factory.mktemp("source")
    torch.manual_seed(123)
    model = build_model(tiny_config(**SHAPE), "cpu")
    with torch.no_grad():  # a router bias away from its zero init, so that loading it shows
        for moe in model.moe_layers():
            moe.gate.e_score_correction_bias.add_(0.01 * torch.arange(moe.n_experts))
    export_hf(model, tmp / "hf")
    step = save_checkpoint(tmp / "run", 1, model, torch.optim.AdamW(model.parameters()), {}, keep_last_k=1)
    torch.save(model.state_dict(), tmp / "weights.pt")
    return tmp / "hf", step, tmp / "weights.pt", tmp / "cache"


def _check_weights(model, weights_file: Path) -> None:
    expected, got = torch.load(weights_file), _full_weights(model)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def _sharded_runs(rank: int, world_size: int, specs: list[str], weights_file: Path, cache: Path, tmp: Path,
                  expected_loss: float, layouts: list[dict]) -> None:
    for i, layout in enumerate(layouts):
        accum = 1 if layout.get("dp_shard") == 2 else 2  # every run takes the single process's 2 micro-batches
        for j, spec in enumerate(specs):
            run_dir = tmp / f"run{i}-{j}"
            cfg = _cfg(run_dir, cache, f"train.grad_accum={accum}", f"checkpoint.init_from={spec}",
                       *(f"parallel.{k}={v}" for k, v in layout.items()))
            trainer = Trainer(cfg)
            load_initial_weights(trainer.model, spec, cfg.model)  # what fit() does first, checked on its own
            _check_weights(trainer.model, weights_file)
            trainer.fit()
            if rank == 0:
                assert _step1_loss(run_dir) == pytest.approx(expected_loss, rel=1e-5), (layout, spec)
            dist.barrier()


def _single_process_loss(source, tmp_path: Path) -> tuple[list[str], float]:
    hf, step, weights_file, cache = source
    specs = [f"hf:{hf}", str(step)]
    losses = []
    for j, spec in enumerate(specs):
        trainer = Trainer(_cfg(tmp_path / f"single{j}", cache, "train.grad_accum=2", f"checkpoint.init_from={spec}"))
        load_initial_weights(trainer.model, spec, trainer.cfg.model)
        _check_weights(trainer.model, weights_file)
        trainer.fit()
        losses.append(_step1_loss(tmp_path / f"single{j}"))
    assert losses[0] == losses[1]  # the same weights and data in the same process
    return specs, losses[0]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_init_from_on_two_ranks_loads_every_shard_and_equals_one_process(source, tmp_path):
    specs, loss = _single_process_loss(source, tmp_path)
    spawn(_sharded_runs, 2, specs, source[2], source[3], tmp_path, loss, LAYOUTS)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_init_from_on_four_ranks_with_tp_inside_fsdp(source, tmp_path):
    """tp=2 x dp_shard=2: a rank's shard of a tensor-parallel weight is a slice of a slice (not one box of the
    full tensor), so it reads the parameter whole and keeps its part; the result must still be exact."""
    specs, loss = _single_process_loss(source, tmp_path)
    spawn(_sharded_runs, 4, specs, source[2], source[3], tmp_path, loss, [dict(tp=2, dp_shard=2)])


def _errors(rank: int, world_size: int, hf: Path, step: Path, tmp: Path) -> None:
    pcfg = ParallelConfig(ep=2)
    model = apply_parallelism(build_model(tiny_config(**SHAPE), "cpu"), build_mesh(pcfg, world_size, "cpu"), pcfg)
    missing = tmp / "nowhere"
    cases = [
        (f"hf:{missing}", tiny_config(**SHAPE), f"checkpoint.init_from: cannot read {missing}"),
        (f"hf:{hf}", tiny_config(**{**SHAPE, "kv_lora_rank": 8}), "kv_lora_rank: 8 vs 16"),
        (str(missing), tiny_config(**SHAPE), f"{missing} is not a checkpoint folder"),
        # only rank 1 fails: rank 0 must stop too, with rank 1's reason
        (f"hf:{hf if rank == 0 else missing}", tiny_config(**SHAPE), "on rank 1: checkpoint.init_from: cannot read"),
        (str(step if rank == 0 else missing), tiny_config(**SHAPE), "on rank 1: checkpoint.init_from: "),
    ]
    for spec, cfg, message in cases:
        with pytest.raises(TrainingError, match=message.replace("(", r"\(")) as info:
            load_initial_weights(model, spec, cfg)
        assert "Traceback" not in str(info.value)
    dist.barrier()  # every rank got here: none is left inside a collective
    load_initial_weights(model, f"hf:{hf}", tiny_config(**SHAPE))  # and a good load still works afterwards


def test_init_from_errors_reach_every_rank_without_hanging(source, tmp_path):
    hf, step, _, _ = source
    spawn(_errors, 2, hf, step, tmp_path)
