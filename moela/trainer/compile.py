"""The compile strategy of a training run (`train.compile: true`): every transformer block compiled by
torch.compile, every micro-batch padded to one shape, and the on-disk caches that make the second start fast.

Decisions:
- The unit is the whole block (attention + FFN + norms + residuals), torchtitan's choice: the glue between the
  big kernels (RMSNorm, the q/k assembly with RoPE, SwiGLU, the router's sigmoid and weights, residual adds, dtype
  casts) is fused by Inductor into a few memory-bound kernels per block, and the host runs one compiled graph per
  block piece instead of a Python call per op. The embedding, the output head with its loss and the MTP glue run
  eagerly around the blocks: a handful of ops per micro-batch.
- One compiled function for all blocks (`Block._forward` compiled once per process, the block an input): layers
  of one kind share their graphs, so a 12-layer model compiles one dense and one MoE block, not twelve.
- Kernels that torch.compile cannot trace (an op backend not registered `traceable` in `moela.ops.dispatch`,
  expert parallelism's all-to-all, FP8 linears) are graph breaks: they run eagerly between the compiled pieces of
  the block. The attention kernels (flash-attn-4, moela's Triton), the query's in-place RoPE and the routed experts
  are custom ops inside the graph (`moela.ops.attention.graph`, `moela.ops.moe.autograd`): on CUDA a block is one
  graph.
- Shapes: a micro-batch is padded with filler documents to `train.tokens_per_microbatch` tokens and its
  `max_seqlen` set to the longest piece the loader can cut (`moela.batch.pad_batch`), so the token count and the
  length bound never change; only the document count does, and the model marks it dynamic. Training compiles
  during the first micro-batch and never again; evaluation (no autograd) compiles its own graphs at its first
  batch, padded to the same shape, and reuses them.
- Inductor's pointwise kernels get one heuristic launch config (`prepare_inductor`: `triton.autotune_pointwise`
  off) instead of several compiled and timed at their first launch: memory-bound elementwise kernels whose
  candidates differ by block size. That tunes a sixth as many kernels at their first launch and shortens the cold
  first step by about a sixth, at equal tokens/s. Starting Inductor's compile workers before the first graph moved
  builds off the training process but did not shorten the first step, so it is not done.
- Caches: every compiled kernel is kept on disk under one root (`moela.ops.disk_caches`: MOELA_CACHE_DIR, default
  `~/.cache/moela`): Inductor's FX graph and autograd caches, moela's Triton kernels with their autotuning results,
  flash-attn-4's CuTe kernels. A second start on the same machine (or on any machine sharing the root) skips
  compilation and autotuning.
"""

from __future__ import annotations

import torch

from moela.batch import PackedBatch, pad_batch
from moela.ops.compiled import raise_recompile_limit
from moela.parallel.fsdp import transformer_blocks


def prepare_inductor() -> None:
    """Inductor's pointwise kernels get one heuristic launch config (the module docstring)."""
    from torch._inductor import config as inductor_config

    inductor_config.triton.autotune_pointwise = False


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> None:
    """Run every transformer block of `model` (main stack and MTP) through torch.compile with `backend`."""
    raise_recompile_limit()
    for block in transformer_blocks(model):
        if not hasattr(block, "compile_backend"):
            raise TypeError(f"{type(block).__name__} has no `compile_backend`; compile_blocks compiles moela Blocks")
        block.compile_backend = backend


class StaticShapes:
    """Pads every micro-batch of a run to `num_tokens` tokens with documents of at most `max_seqlen` tokens."""

    def __init__(self, num_tokens: int, max_doc_len: int | None):
        self.num_tokens = num_tokens
        self.max_seqlen = min(max_doc_len or num_tokens, num_tokens)  # the loader's piece limit

    def __call__(self, batch: PackedBatch) -> PackedBatch:
        return pad_batch(batch, self.num_tokens, self.max_seqlen)
