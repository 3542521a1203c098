"""Transformer blocks: `standard` pre-norm, and `fal` / `fal_plus` from "First Attentions Last" (arXiv 2510.14614).

Our formulation (x_l is the residual stream entering block l, l = 1..L; norm1 = `attn_norm`, norm2 = `ffn_norm`,
norm_a = `a1_norm`, each block with its own weights):

  standard, and block 1 of every kind:
      a = Attn_l(norm1(x_l));  h = x_l + a;  x_{l+1} = h + MLP_l(norm2(h))
      block 1 keeps a1 = Attn_1(norm1(x_1)) for the later blocks (FAL kinds only)
  fal, l >= 2:
      x_{l+1} = x_l + Attn_l(norm1(x_l)) + MLP_l(norm2(x_l) + norm_a(a1))
      attention and MLP read the same x_l, so they are independent: they can run concurrently and, under tensor
      parallelism, their partial outputs can share one all-reduce
  fal_plus, l >= 2:
      h = x_l + Attn_l(norm1(x_l));  x_{l+1} = h + MLP_l(norm2(h + norm_a(a1)))

MLP_l is the dense SwiGLU MLP for the first `first_k_dense_replace` layers and the MoE afterwards.

Seams set from outside (`moela.parallel`): under tensor parallelism Attn_l and MLP_l return partial sums over the
ranks, which `sum_partials` adds and completes (a reduce-scatter onto this rank's tokens); the default adds them.
A FAL block hands both of its sublayers to ONE `sum_partials`, so it pays one reduction where the other kinds pay
two. `side_stream` (a CUDA stream, FAL blocks on one GPU) runs the MLP on that stream while attention runs on the
current one (`moela.model.streams`).

A block returns (x_{l+1}, a1, z, aux, load): a1 is passed along the stack (None for standard models), z is the
attention z-loss term, aux the MoE balance loss (0 for dense), load the expert load [E] (None for dense).
Returning values instead of accumulating side effects keeps blocks safe to re-run under activation checkpointing: a
block whose `recompute` is set (by `moela.parallel.fsdp.apply_activation_checkpointing`) runs its forward under a
non-reentrant `torch.utils.checkpoint` and recomputes its activations in backward. A block whose `compile_backend`
names a torch.compile backend (set by `moela.trainer.compile.compile_blocks`) runs `_forward` compiled.

Shapes: T tokens, D hidden, E experts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from moela.model.attention import MLA
from moela.model.config import ModelConfig
from moela.model.layers import MLP, PackedContext, RMSNorm
from moela.model.moe import MoE
from moela.model.streams import run_beside

BlockOutput = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def add_outputs(*outputs: torch.Tensor) -> torch.Tensor:
    """`Block.sum_partials` of a rank that computes whole sublayer outputs: their sum."""
    total = outputs[0]
    for out in outputs[1:]:
        total = total + out
    return total


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, *, moe: bool, kind: Literal["standard", "fal", "fal_plus"] = "standard",
                 keeps_a1: bool = False):
        super().__init__()
        self.kind = kind
        self.keeps_a1 = keeps_a1
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = MLA(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = MoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.fp8_linears)
        if kind != "standard":
            self.a1_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.recompute = False  # activation checkpointing: recompute this block's activations in backward
        self.compile_backend: str | None = None  # a torch.compile backend: run `_forward` compiled
        self.sum_partials = add_outputs  # tensor parallelism: completes the sublayers' partial sums
        self.side_stream: torch.cuda.Stream | None = None  # FAL on one GPU: the MLP's stream

    def extra_repr(self) -> str:
        return f"kind={self.kind}, recompute={self.recompute}, compile_backend={self.compile_backend}"

    def _ffn(self, x: torch.Tensor, ctx: PackedContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if isinstance(self.ffn, MoE):
            return self.ffn(x, ctx)
        return self.ffn(x), x.new_zeros((), dtype=torch.float32), None

    def forward(self, x: torch.Tensor, ctx: PackedContext, a1: torch.Tensor | None = None) -> BlockOutput:
        """x [T, D] (and a1 [T, D] for FAL blocks after the first) -> (x_next, a1, z, aux, load)."""
        fn = Block._forward if self.compile_backend is None else _compiled_forward(self.compile_backend)
        if self.recompute:
            return checkpoint(fn, self, x, ctx, a1, use_reentrant=False)
        return fn(self, x, ctx, a1)

    def _forward(self, x: torch.Tensor, ctx: PackedContext, a1: torch.Tensor | None) -> BlockOutput:
        if self.kind == "fal" and a1 is not None:
            m_in = self.ffn_norm(x) + self.a1_norm(a1)  # [T, D]
            if self.side_stream is not None:
                (a, z), (m, aux, load) = run_beside(lambda: self.attn(self.attn_norm(x), ctx),
                                                    lambda: self._ffn(m_in, ctx), self.side_stream,
                                                    inputs=(m_in, ctx.doc_ids, ctx.doc_weight, ctx.real_tokens))
            else:
                a, z = self.attn(self.attn_norm(x), ctx)  # [T, D]
                m, aux, load = self._ffn(m_in, ctx)  # [T, D]
            return x + self.sum_partials(a, m), a1, z, aux, load
        a, z = self.attn(self.attn_norm(x), ctx)  # [T, D]
        a = self.sum_partials(a)
        if self.kind == "standard":
            h = x + a  # [T, D]
            m, aux, load = self._ffn(self.ffn_norm(h), ctx)  # [T, D]
            return h + self.sum_partials(m), (a if self.keeps_a1 else a1), z, aux, load
        if a1 is None:
            raise ValueError(f"a {self.kind} block needs a1, the first block's attention output; build the "
                             f"model with Transformer so block 1 provides it")
        h = x + a  # [T, D]
        m, aux, load = self._ffn(self.ffn_norm(h + self.a1_norm(a1)), ctx)  # [T, D]
        return h + self.sum_partials(m), a1, z, aux, load


@functools.cache
def _compiled_forward(backend: str) -> Callable[..., BlockOutput]:
    """`Block._forward` compiled once per process: one code object, so Dynamo reuses its graphs for every block of
    the same kind (the block is an input, its parameters graph inputs) instead of compiling each layer."""
    return torch.compile(Block._forward, backend=backend)
