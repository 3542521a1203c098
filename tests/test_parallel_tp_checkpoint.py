"""Tensor-parallel checkpoints are layout-free: saved at tp=2 (2 gloo ranks), they load on 1 process (tp=1) and on
4 ranks at tp=4 and at tp=2 x dp_shard=2 with identical model weights and AdamW moments (every tensor exactly).

The model has FAL blocks and layer-wise QK-Norm (whose weights are sharded with the heads), MoE layers and MTP, so
every kind of sharded and replicated parameter is saved. DCP reshards on load; the parameter names are those of
the single-process model.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from factories import VISIBLE_TRAINING, random_batches, tiny_config
from moela.model import build_model
from moela.parallel import apply_parallelism, build_mesh
from moela.parallel.config import ParallelConfig
from parallel_harness import spawn
from test_parallel_checkpoint import check_loaded, full_states, load_into

VOCAB = 96


def build(layout: dict | None, world_size: int, seed: int):
    torch.manual_seed(seed)
    cfg = tiny_config(**{**VISIBLE_TRAINING, "vocab_size": VOCAB, "num_attention_heads": 4, "block": "fal",
                         "qk_norm": "layer"})
    model = build_model(cfg, "cpu")
    if layout is not None:
        pcfg = ParallelConfig(**layout)
        model = apply_parallelism(model, build_mesh(pcfg, world_size, "cpu"), pcfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _save(rank: int, world_size: int, path: str, expected_file: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = build(dict(tp=2), world_size, seed=0)
    out = model(random_batches(1, seed=7, vocab=VOCAB)[0])
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    expected = full_states(model, opt)
    if rank == 0:
        torch.save(expected, expected_file)
    dist.barrier()


def _load(rank: int, world_size: int, path: str, expected_file: str) -> None:
    for layout in (dict(tp=4), dict(tp=2)):
        model, opt = build(layout, world_size, seed=1)
        load_into(model, opt, path)
        check_loaded(model, opt, expected_file)
        dist.barrier()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the 1-process load, on purpose
def test_checkpoint_saved_at_tp2_loads_at_tp1_and_tp4(tmp_path):
    path, expected_file = str(tmp_path / "step-1"), str(tmp_path / "expected.pt")
    spawn(_save, 2, path, expected_file)
    model, opt = build(None, 1, seed=1)
    load_into(model, opt, path)
    check_loaded(model, opt, expected_file)
    spawn(_load, 4, path, expected_file)
