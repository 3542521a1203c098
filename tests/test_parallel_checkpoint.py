"""Resharded resume through DCP: a checkpoint saved on 2 ranks (FSDP2 + EP=2) loads on 1 process and on 4 ranks
(FSDP2 + EP=4, and FSDP2 + EP=2 where each expert is also sharded over 2 ranks) with identical model weights and
AdamW state.

The saving ranks train one step, write model + optimizer with `get_state_dict` + `dcp.save`, and rank 0 also
stores the full (unsharded) tensors as the expectation. Loaders start from a differently seeded model, load with
`dcp.load` + `set_state_dict`, and compare every weight and every `exp_avg` / `exp_avg_sq` with the expectation.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from factories import VISIBLE_TRAINING, random_batches, tiny_config
from moela.model import build_model
from moela.parallel import apply_parallelism, build_mesh
from moela.parallel.config import ParallelConfig
from moela.trainer.adamw_moments import AdamWMoments
from parallel_harness import spawn


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def full_states(model, optimizer) -> dict[str, torch.Tensor]:
    """Model weights and AdamW moments, unsharded, keyed by parameter name."""
    model_state, optim_state = get_state_dict(model, optimizer)
    out = {f"model.{k}": _full(v) for k, v in model_state.items()}
    for name, state in optim_state["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"optim.{name}.{key}"] = _full(state[key])
    return out


def build_model_and_adamw(cfg, layout: dict | None, world_size: int, seed: int):
    """The model of `cfg` seeded with `seed`, parallelized under `layout` (None: one process), and its AdamW."""
    torch.manual_seed(seed)
    model = build_model(cfg, "cpu")
    if layout is not None:
        pcfg = ParallelConfig(**layout)
        model = apply_parallelism(model, build_mesh(pcfg, world_size, "cpu"), pcfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def build(layout: dict | None, world_size: int, seed: int):
    return build_model_and_adamw(tiny_config(**VISIBLE_TRAINING), layout, world_size, seed)


def build_bf16_moments(layout: dict | None, world_size: int, seed: int):
    """`build` with moela's AdamW keeping bf16 moments (`optim.moment_dtype: bfloat16`)."""
    model, _ = build(layout, world_size, seed)
    return model, AdamWMoments(model.parameters(), lr=1e-2, weight_decay=0.1, moment_dtype="bfloat16")


def load_into(model, optimizer, path: str) -> None:
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def ep_batch(rank: int, world_size: int):
    """Each data-parallel rank trains on its own micro-batch."""
    return random_batches(world_size, seed=7)[rank]


def _save(rank: int, world_size: int, build_fn, layout: dict, batch_fn, path: str, expected_file: str) -> None:
    model, opt = build_fn(layout, world_size, seed=0)
    out = model(batch_fn(rank, world_size))
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    expected = full_states(model, opt)
    if rank == 0:
        torch.save(expected, expected_file)
    dist.barrier()


def check_loaded(model, opt, expected_file: str) -> None:
    expected = torch.load(expected_file)
    got = full_states(model, opt)
    assert got.keys() == expected.keys()
    moment_dtype = torch.bfloat16 if isinstance(opt, AdamWMoments) else torch.float32
    assert all(v.dtype == moment_dtype for k, v in got.items() if k.startswith("optim."))
    assert any("experts.w13" in k for k in got)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def _load(rank: int, world_size: int, build_fn, layouts: list[dict], path: str, expected_file: str) -> None:
    for layout in layouts:
        model, opt = build_fn(layout, world_size, seed=1)
        load_into(model, opt, path)
        check_loaded(model, opt, expected_file)
        dist.barrier()


def resharded_roundtrip(tmp_path, build_fn, save_layout: dict, batch_fn, load_layouts: list[dict]) -> None:
    """Train one step and save on 2 ranks under `save_layout`, then load in 1 process and on 4 ranks under each of
    `load_layouts`, each load checked against the saved full tensors. build_fn(layout or None, world_size, seed)
    -> (model, AdamW); batch_fn(rank, world_size) -> that rank's micro-batch."""
    path, expected_file = str(tmp_path / "step-1"), str(tmp_path / "expected.pt")
    spawn(_save, 2, build_fn, save_layout, batch_fn, path, expected_file)
    model, opt = build_fn(None, 1, seed=1)
    load_into(model, opt, path)
    check_loaded(model, opt, expected_file)
    spawn(_load, 4, build_fn, load_layouts, path, expected_file)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the 1-process load, on purpose
def test_checkpoint_saved_on_2_ranks_resumes_on_1_and_4(tmp_path):
    # ep=2 on 4 ranks: experts also FSDP-sharded
    resharded_roundtrip(tmp_path, build, dict(ep=2), ep_batch,
                        [dict(ep=4), dict(ep=2, activation_checkpointing="full")])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_bf16_moments_checkpoint_saved_on_2_ranks_resumes_on_1_and_4(tmp_path):
    """The same round trip with bf16 moments: sharded bf16 moments save, reshard and load bit for bit, and stay
    bf16 (torch's loading would cast them to the parameters' fp32)."""
    resharded_roundtrip(tmp_path, build_bf16_moments, dict(ep=2), ep_batch, [dict(ep=4)])
