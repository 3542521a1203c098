"""The expert-parallel options train exactly like one process (float32, 3 steps, the harness and reference of
tests/test_parallel_fsdp.py, whose layouts already cover both dispatches as `auto` picks them: the tiny model
routes top-2, so it gathers at ep=2 and uses the all-to-all at ep=4): the gather forced at ep=4, two pipelined
chunks, and FSDP units of several blocks (with activation checkpointing)."""

from __future__ import annotations

import pytest
import torch

from factories import VISIBLE_TRAINING, tiny_config
from moela.parallel.config import ParallelConfig
from moela.parallel.fsdp import transformer_blocks
from parallel_harness import spawn
from parallel_training import train_single_process
from test_parallel_fsdp import STEPS, _run


@pytest.mark.parametrize("world_size, layouts", [
    (2, [dict(ep=2, ep_chunks=2, fsdp_unit_blocks=3, activation_checkpointing="full")]),
    (4, [dict(ep=4, ep_dispatch="gather", ep_chunks=2, fsdp_unit_blocks=2)]),
])
def test_expert_parallel_options_train_like_one_process(world_size, layouts):
    cfg = tiny_config(**VISIBLE_TRAINING)
    expected = train_single_process(cfg, world_size, STEPS)
    spawn(_run, world_size, [(cfg, layout, expected) for layout in layouts])


def _grouped_units(rank: int, world_size: int) -> None:
    from moela.model import build_model
    from moela.parallel import apply_parallelism, build_mesh

    cfg, pcfg = tiny_config(**VISIBLE_TRAINING), ParallelConfig(ep=2, fsdp_unit_blocks=2)
    model = apply_parallelism(build_model(cfg, "cpu"), build_mesh(pcfg, world_size, "cpu"), pcfg)
    blocks = transformer_blocks(model)  # 3 layers + the MTP block: units (0, 1) and (2, mtp)
    states = [b._get_fsdp_state() for b in blocks]
    assert states[0] is states[1] and states[2] is states[3] and states[0] is not states[2]
    prefetched = [m for s in states[0]._states_to_forward_prefetch for m in s._modules]
    assert blocks[2] in prefetched


def test_fsdp_unit_blocks_groups_consecutive_blocks():
    spawn(_grouped_units, 2)


def test_parallel_options_are_validated():
    errors = ParallelConfig(ep_chunks=3, fsdp_unit_blocks=0).validate()
    assert any(e.startswith("ep_chunks") for e in errors) and any(e.startswith("fsdp_unit_blocks") for e in errors)
    assert torch.distributed.is_available()
