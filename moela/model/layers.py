"""Small building blocks shared by the model files: RMSNorm, a bias-free Linear, the SwiGLU MLP, and `PackedContext`.

Decisions:
- Every projection is bias-free (DeepSeek has no biases in attention or FFN).
- Modules only hold parameters and call `moela.ops` functions; initialization lives in one place,
  `Transformer.init_weights`, so a model built on the meta device gets all its values after `to_empty()`.
- `PackedContext` carries what every layer needs about the packed batch (positions, document boundaries, loss
  weights per token and document) so block signatures stay fixed for activation checkpointing and FSDP wrapping.
  It is also the one seam for wrappers that split a batch over ranks (context parallelism): how attention reaches
  the keys of other ranks (`attend`), which tokens are real rather than padding (`real_tokens`), and how
  per-document statistics are summed over the ranks holding parts of the same documents (`reduce_doc_stats`).
  The defaults describe a rank that holds whole documents; `BatchPart` is what such a wrapper hands the model.
  Under tensor (sequence) parallelism the token-wise layers (norms, router, experts) see only this rank's rows of
  the batch while attention sees all of them: `doc_ids` and `real_tokens` then describe those rows.

Shapes: T tokens, D hidden, N documents, F FFN width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Shard

from moela.batch import PackedBatch
from moela.ops.dispatch import Dispatch
from moela.ops.fp8_linear import fp8_linear, traceable
from moela.ops.norm import rms_norm
from moela.ops.swiglu import swiglu


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class Linear(nn.Linear):
    """Bias-free linear layer (y = x W^T), weight [out, in]; with `fp8` in DeepSeek-V3's FP8 recipe
    (moela.ops.fp8_linear: every GEMM of forward and backward in e4m3 with blockwise scales, `fp8_backend` its
    backend). The FP8 kernels are ops a compiled graph holds, and so is the bf16 linear of an untileable layer on
    CUDA; the reference (the CPU under `auto`) runs outside the graph."""

    fp8_backend = "auto"

    def __init__(self, in_features: int, out_features: int, fp8: bool = False):
        super().__init__(in_features, out_features, bias=False)
        self.fp8 = fp8

    def fp8_in_graph(self, x: torch.Tensor) -> bool:
        """Whether this FP8 layer's call on an input like x runs inside a compiled graph."""
        return traceable(x, self.weight, self.fp8_backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            if isinstance(self.weight, DTensor):
                return self._fp8_sharded(x)
            return self._fp8(x, self.weight)
        return super().forward(x)

    def _fp8(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """fp8_linear inside the compiled graph where it can be traced, else outside it."""
        if self.fp8_in_graph(x):
            return fp8_linear(x, weight, backend=self.fp8_backend)
        return call_outside_graph(fp8_linear, x, weight, backend=self.fp8_backend)

    def _fp8_sharded(self, x: torch.Tensor) -> torch.Tensor:
        """The FP8 linear of a tensor-parallel layer (a DTensor weight): each rank multiplies its shards, and the
        result carries the placement F.linear's would. Column-parallel (weight rows sharded, x replicated): this
        rank's output features; row-parallel (weight columns sharded, x's features sharded alike): a partial sum.
        A shard whose features are multiples of 128 quantizes in the same 1x128 groups and 128x128 blocks as the
        whole weight, so the ranks compute what one process does. The shard is a new tensor each call, which the
        per-step weight cache does not hold: its FP8 codes are computed each forward."""
        w = self.weight
        placement = w.placements[0] if len(w.placements) == 1 else None
        if not isinstance(placement, Shard) or placement.dim not in (0, 1):
            raise ValueError(f"FP8 linear under tensor parallelism: weight placement {w.placements} is neither "
                             f"column- (Shard(0)) nor row-parallel (Shard(1)); use model.precision: fp8_experts")
        if isinstance(x, DTensor):  # column-parallel: this rank's part of x's gradient is a partial sum
            local = x.to_local(grad_placements=(Partial(),) if placement.dim == 0 else None)
        else:
            local = x
        y = self._fp8(local, w.to_local())
        out = Shard(y.dim() - 1) if placement.dim == 0 else Partial()
        return DTensor.from_local(y, w.device_mesh, (out,), run_check=False)

    def reset_parameters(self) -> None:
        """Values come from `Transformer.init_weights`; nothing to do at construction (meta-device friendly)."""


class MLP(nn.Module):
    """Dense SwiGLU FFN: w2(silu(w1 x) * w3 x). Used for dense layers and for the shared experts."""

    def __init__(self, dim: int, inter_dim: int, fp8: bool = False):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, fp8)
        self.w2 = Linear(inter_dim, dim, fp8)
        self.w3 = Linear(dim, inter_dim, fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))  # [T, F] -> [T, D]


@torch.compiler.disable
def call_outside_graph(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) run eagerly, outside any graph torch.compile is tracing (one graph break)."""
    return fn(*args, **kwargs)


def call_op(op: Callable[..., Any], dispatch: Dispatch, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """op(x, *args, **kwargs) for a `moela.ops` public function `op` with backends `dispatch`, as a block that
    torch.compile may trace calls it: traced into the graph on CUDA once every fast backend of the op is registered
    `traceable` (`moela.ops.dispatch`); otherwise the whole call runs outside the graph, so that neither its
    backend choice nor a reference that loops over documents or experts with host reads (the CPU path) is traced
    and specialized to the batch."""
    if x.is_cuda and all(b.traceable for b in dispatch.fast.values()):
        return op(x, *args, **kwargs)
    return call_outside_graph(op, x, *args, **kwargs)


def attend_locally(attention: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cu_seqlens: torch.Tensor, max_seqlen: int, **kwargs: Any) -> Any:
    """`PackedContext.attend` of a rank holding whole documents: the layer's attention op on its own tokens."""
    return attention(q, k, v, cu_seqlens, max_seqlen, **kwargs)


@dataclass
class PackedContext:
    """Per-micro-batch facts that every block needs; built once by `Transformer.forward`."""

    position_ids: torch.Tensor  # [T] int, restarting per document
    cu_seqlens: torch.Tensor  # [N+1] int32
    max_seqlen: int
    doc_ids: torch.Tensor  # [T] int64, document index of each token of the token-wise layers (see docstring)
    token_weight: torch.Tensor  # [T] float32: 1/num_targets where the token has a label, else 0
    doc_weight: torch.Tensor  # [N] float32: labelled tokens of the document / num_targets
    inv_freq: torch.Tensor  # [R/2] float32 RoPE inverse frequencies (YaRN-adjusted)
    # attend(attention, q, k, v, cu_seqlens, max_seqlen, causal=, softmax_scale=, return_lse=): applies a layer's
    # attention op (`mla_attention`'s signature) to this batch's queries and every key they see
    attend: Callable[..., Any] = attend_locally
    real_tokens: torch.Tensor | None = None  # [T] bool: tokens counted in MoE statistics (None: all of them)
    # [N, S] per-document statistics of this rank's tokens -> the same summed over every rank holding part of the
    # documents (None: this rank holds whole documents)
    reduce_doc_stats: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.numel() - 1


class BatchPart(NamedTuple):
    """One rank's part of a batch that a wrapper split over several ranks, and the `PackedContext` seams that let
    its layers compute what they would on the whole batch (see `Transformer.context_parallel`)."""

    batch: PackedBatch  # this rank's tokens (with their original positions)
    mtp_targets: list[tuple[torch.Tensor, torch.Tensor]]  # per MTP depth, (input token, label) of this rank's tokens
    attend: Callable[..., Any]
    real_tokens: torch.Tensor  # [T_loc] bool (of `rows` when set)
    reduce_doc_stats: Callable[[torch.Tensor], torch.Tensor]
    rows: slice | None = None  # the rows of `batch` the token-wise layers hold (sequence parallelism); None: all


def segment_sum(values: torch.Tensor, doc_ids: torch.Tensor, num_docs: int) -> torch.Tensor:
    """Sum rows of `values` [T, ...] per document -> [N, ...]."""
    out = values.new_zeros((num_docs,) + tuple(values.shape[1:]))
    return out.index_add(0, doc_ids, values)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T in float32 (router logits are computed in float32 whatever the model's dtype, autocast included)."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        return F.linear(x.float(), weight.float())
