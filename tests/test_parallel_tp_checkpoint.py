"""Tensor-parallel checkpoints are layout-free: saved at tp=2 (2 gloo ranks), they load on 1 process (tp=1) and on
4 ranks at tp=4 and at tp=2 x dp_shard=2 with identical model weights and AdamW moments (every tensor exactly).

The model has FAL blocks and layer-wise QK-Norm (whose weights are sharded with the heads), MoE layers and MTP, so
every kind of sharded and replicated parameter is saved. DCP reshards on load; the parameter names are those of
the single-process model.
"""

from __future__ import annotations

import pytest

from factories import VISIBLE_TRAINING, random_batches, tiny_config
from test_parallel_checkpoint import build_model_and_adamw, resharded_roundtrip

VOCAB = 96


def build(layout: dict | None, world_size: int, seed: int):
    cfg = tiny_config(**{**VISIBLE_TRAINING, "vocab_size": VOCAB, "num_attention_heads": 4, "block": "fal",
                         "qk_norm": "layer"})
    return build_model_and_adamw(cfg, layout, world_size, seed)


def tp_batch(rank: int, world_size: int):
    """Both ranks of the tp group share one micro-batch."""
    return random_batches(1, seed=7, vocab=VOCAB)[0]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the 1-process load, on purpose
def test_checkpoint_saved_at_tp2_loads_at_tp1_and_tp4(tmp_path):
    resharded_roundtrip(tmp_path, build, dict(tp=2), tp_batch, [dict(tp=4), dict(tp=2)])  # tp=2 on 4: x dp_shard 2
