"""Small models and packed batches shared by the tests.

`tiny_config(**overrides)`: an MLA + MoE model (a dense layer, then MoE layers with group-limited routing, a shared
expert, one MoE MTP depth) that trains in milliseconds on CPU; a test passes only what it needs different.
`tiny_overrides(**overrides)`: the same shape as recipe overrides (`model.key=value`), for tests of the trainer.
`packed_batch(vocab, lens, seed)`: one packed batch of documents of the given lengths, labels shifted within each
document. `random_batches(count, seed)`: micro-batches of a few documents of odd lengths each.
"""

from __future__ import annotations

import json

import torch

from moela.batch import IGNORE_INDEX, PackedBatch
from moela.model.config import ModelConfig, preset

TINY_SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
                  num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=24, kv_lora_rank=16,
                  qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_attention_heads=2,
                  num_nextn_predict_layers=1)

# Training settings under which every signal shows within a few steps (balance loss, router-bias update, weight
# gradients well above rounding) and every op runs its reference, for the multi-rank training tests
VISIBLE_TRAINING = dict(aux_loss_coef=1e-2, bias_update_rate=1e-2, initializer_range=0.1,
                        attention_backend="reference", moe_backend="reference")


def tiny_config(**overrides) -> ModelConfig:
    """The tiny test model's config with `overrides` (validated like a recipe's model section)."""
    return preset("tiny", **{**TINY_SHAPE, **overrides})


def tiny_overrides(**overrides) -> list[str]:
    """`model.key=value` recipe overrides that give the trainer `tiny_config(**overrides)`'s model."""
    return [f"model.{key}={json.dumps(value)}" for key, value in {**TINY_SHAPE, **overrides}.items()]


# train.py overrides for the fault and CLI tests: a 2-layer 4,096-vocabulary model (the bundled tokenizer's), tiny
# micro-batches, one CPU thread, no evaluation, plots or progress bars
TRAIN_FAST = [
    *tiny_overrides(vocab_size=4096, num_hidden_layers=2, n_routed_experts=4, q_lora_rank=16),
    "data.max_doc_len=64", "data.val_max_tokens=256",
    "train.tokens_per_microbatch=128", "train.cpu_threads=1", "train.eval_every=0", "schedule.warmup_steps=1",
    "optim.lr=3e-3", "logging.log_every=1", "logging.plot=false", "logging.progress_bar=never",
]


def packed_batch(vocab: int, lens: list[int], seed: int = 0) -> PackedBatch:
    """Documents of lengths `lens` packed into one batch, random token ids below `vocab` drawn from a generator
    seeded with `seed`, each token labelled with its successor within the document (IGNORE_INDEX at the end)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lens),), generator=g)  # [T]
    pos = torch.cat([torch.arange(n) for n in lens]).int()  # [T]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)  # [N+1]
    labels = torch.cat((ids[1:], ids[:1]))  # [T]
    labels[(cu[1:] - 1).long()] = IGNORE_INDEX
    return PackedBatch(ids, labels, pos, cu, max(lens))


def random_batches(count: int, seed: int, vocab: int = 97) -> list[PackedBatch]:
    """`count` packed micro-batches of 2-4 documents of 3-16 tokens each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        docs = int(torch.randint(2, 5, (1,), generator=g))
        lens = [int(n) for n in torch.randint(3, 17, (docs,), generator=g)]
        out.append(packed_batch(vocab, lens, seed=seed * 1000 + i))
    return out


def poison_steps(trainer, bad_steps) -> None:
    """Make the trainer's loss NaN on the given (1-based) steps: the non-finite-step path, without real overflow."""
    real_forward = trainer.model.forward

    def forward(batch, **kw):
        out = real_forward(batch, **kw)
        if trainer.step + 1 in bad_steps:
            out.loss = out.loss * float("nan")
        return out

    trainer.model.forward = forward


def graphed_on_cpu(trainer, max_docs: int = 0):
    """What `train.cuda_graphs` sets up in `trainer` (a `Trainer`), on the CPU and without the capture: every
    micro-batch runs eagerly on the static buffers (moela.trainer.cuda_graphs). Returns the GraphedMicroBatch."""
    from moela.trainer.compile import StaticShapes
    from moela.trainer.cuda_graphs import GraphedMicroBatch

    trainer.static_shapes = StaticShapes(trainer.cfg.train.tokens_per_microbatch, trainer.cfg.data.max_doc_len)
    trainer.graphed = GraphedMicroBatch(trainer.model, trainer.device, trainer._autocast, max_docs=max_docs,
                                        capture=False, echo=lambda line: None)
    return trainer.graphed


def steps_without_sync(trainer, steps: int) -> dict:
    """`steps` training steps of `trainer` on CUDA with `torch.cuda.set_sync_debug_mode("error")`: any host
    synchronization inside them raises. Returns the last step's record."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            record = trainer.train_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return record


def two_micro_batch_cfg(run_dir, *extra):
    """A CPU training recipe of a 2-layer tiny MoE: 128-token micro-batches, grad_accum 2, a line every step, 4 steps
    (override `train.steps`)."""
    from moela.config import load_config

    return load_config(None, tiny_overrides(vocab_size=4096, num_hidden_layers=2, n_routed_experts=4,
                                            q_lora_rank=16) + [
        f"train.run_dir={run_dir}", "data.max_doc_len=64", "data.val_max_tokens=256", "train.steps=4",
        "train.tokens_per_microbatch=128", "train.grad_accum=2", "train.cpu_threads=1", "train.eval_every=0",
        "schedule.warmup_steps=2", "optim.lr=3e-3", "logging.log_every=1", "logging.plot=false",
        "logging.progress_bar=never", "checkpoint.every=0", *extra])
