"""How `mla_attention(..., backend="auto")` picks a backend: the fastest one that supports the call, by a table of
speeds the benchmark measured (`MEASURED`), never by guess.

A call is classified by what changes which kernel is fastest: head dims (Dqk/Dv), layout ("equal": every document
of one length on both sides, T == N * max_seqlen, checked without a device sync; "packed": anything else, a longer
k side included), tokens per document (T / N), and feature ("alibi", "zloss" when the lse is returned, else
"plain"). The table row of the same head dims, layout and feature whose tokens per document is nearest (in log
scale) ranks the backends it measured, fastest first; the first that can run the call wins. Where the table has no
row of the call's kind, the fallbacks are explicit and logged:
- head dims not measured: the 192/128 rows (MLA's dims, the ones measured most);
- z-loss not measured: the plain rows. Every backend that returns an lse folds its gradient into the backward's
  row-sum preprocess (one subtract per row), so the plain ranking holds;
- ALiBi not measured for a backend: that backend is not picked for ALiBi (its speed with the bias is unknown).
A backend the table ranks faster but that cannot run the call (flash-attn-4 not installed, an older GPU, sdpa for
packed documents) is named in the log with the reason, so a slower kernel never runs silently.

The table's rows are `bench/attention.py`'s measurements (it prints them in this format as its last output):
fwd+bwd TFLOP/s with BENCHMARKS.md's FLOP counts, bf16, causal, 16 heads, on an H200 (torch 2.11, triton 3.6,
flash-attn-4 4.0.0b36). Backends: "flash" flash-attn-4, "sdpa" cuDNN through PyTorch SDPA, "triton" moela's kernels.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch


@dataclass(frozen=True)
class Measured:
    case: str  # bench/attention.py's case name
    head_dims: tuple[int, int]  # (Dqk, Dv)
    layout: str  # "equal" or "packed"
    tokens_per_doc: int  # T / N of the case
    feature: str  # "plain", "zloss" or "alibi"
    tflops: dict[str, float]  # fwd+bwd TFLOP/s per backend


MEASURED: tuple[Measured, ...] = (
    Measured("B=2 S=8192", (192, 128), "equal", 8192, "plain", {"flash": 508, "sdpa": 465, "triton": 372}),
    Measured("B=8 S=2048", (192, 128), "equal", 2048, "plain", {"flash": 412, "sdpa": 393, "triton": 285}),
    Measured("packed, 185 Zipf-like documents, 55k tokens", (192, 128), "packed", 297, "plain",
             {"flash": 387, "triton": 286}),
    Measured("packed, 40 lognormal documents, 65k tokens", (192, 128), "packed", 1638, "plain",
             {"flash": 439, "triton": 307}),
    Measured("B=2 S=8192", (128, 128), "equal", 8192, "plain", {"flash": 568, "sdpa": 504, "triton": 336}),
    Measured("packed, 40 lognormal documents, 65k tokens", (128, 128), "packed", 1638, "plain",
             {"flash": 483, "triton": 283}),
    Measured("packed, 40 lognormal documents, 65k tokens", (192, 128), "packed", 1638, "zloss",
             {"flash": 391, "triton": 307}),
    # ALiBi: flash-attn-4 with the slopes compiled into its score modifier (moela.ops.attention.flash_alibi)
    Measured("B=2 S=8192", (192, 128), "equal", 8192, "alibi", {"flash": 487, "triton": 356}),
    Measured("packed, 40 lognormal documents, 65k tokens", (192, 128), "packed", 1638, "alibi",
             {"flash": 416, "triton": 260}),
)
DEFAULT_HEAD_DIMS = (192, 128)


@dataclass(frozen=True)
class CallClass:
    head_dims: tuple[int, int]
    layout: str
    tokens_per_doc: float
    feature: str


def classify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, *, max_seqlen_q: int,
             max_seqlen_k: int, return_lse: bool, alibi_slopes: torch.Tensor | None) -> CallClass:
    n_docs = max(cu_seqlens_q.numel() - 1, 1)
    equal = q.shape[0] == n_docs * max_seqlen_q and k.shape[0] == n_docs * max_seqlen_k
    feature = "alibi" if alibi_slopes is not None else "zloss" if return_lse else "plain"
    return CallClass((q.shape[-1], v.shape[-1]), "equal" if equal else "packed", max(q.shape[0] / n_docs, 1.0),
                     feature)


def nearest_row(call: CallClass, table: tuple[Measured, ...] = MEASURED) -> tuple[Measured | None, list[str]]:
    """The measured row that stands for this call, and the fallbacks taken to find it (for the log)."""
    notes = []
    dims = call.head_dims
    if not any(r.head_dims == dims for r in table):
        notes.append(f"{dims[0]}/{dims[1]} not measured, {DEFAULT_HEAD_DIMS[0]}/{DEFAULT_HEAD_DIMS[1]}'s rows")
        dims = DEFAULT_HEAD_DIMS
    feature = call.feature
    rows = [r for r in table if r.head_dims == dims and r.feature == feature]
    if not rows and feature == "zloss":
        notes.append("z-loss not measured, plain rows (the lse gradient is one subtract per row in every backward)")
        rows = [r for r in table if r.head_dims == dims and r.feature == "plain"]
    if not rows:
        return None, notes
    same_layout = [r for r in rows if r.layout == call.layout]
    if not same_layout:
        notes.append(f"no {call.layout} row, the nearest other")
    rows = same_layout or rows
    row = min(rows, key=lambda r: abs(math.log(r.tokens_per_doc / call.tokens_per_doc)))
    return row, notes


def rank(call: CallClass, problems: Mapping[str, Callable[[], str | None]],
         table: tuple[Measured, ...] = MEASURED) -> tuple[list[str], str]:
    """(backends that can run the call, fastest first by the table; the reason for the log). `problems[name]()`
    says why backend `name` cannot run the call, or None. Without a row for the call, the Triton kernels."""
    row, notes = nearest_row(call, table)
    dims = f"{call.head_dims[0]}/{call.head_dims[1]}"
    what = f"{dims} {call.layout} {call.feature}"
    triton_problem = problems["triton"]() if "triton" in problems else "not registered"
    if row is None:
        if triton_problem is None:
            return ["triton"], f"{what}: no measurement of {call.feature} for another backend, the Triton kernels"
        return [], f"{what}: no measurement of {call.feature}, and the Triton kernels cannot run it: {triton_problem}"
    ranked = sorted(row.tflops, key=lambda name: -row.tflops[name])
    order, skipped = [], []
    for name in ranked:
        problem = problems[name]() if name in problems else "not registered"
        if problem is None:
            order.append(name)
        else:
            skipped.append(f"{name} ({row.tflops[name]:.0f}) cannot run it: {problem}")
    speeds = " > ".join(f"{name} {row.tflops[name]:.0f}" for name in ranked)
    why = f"{what}: measured fwd+bwd TFLOP/s {speeds} on '{row.case}' (bench/attention.py, H200)"
    if row.feature != "plain":  # what the feature costs each backend (targets: <= 5% over its plain speed)
        plain, _ = nearest_row(dataclasses.replace(call, feature="plain"), table)
        costs = [f"{name} +{plain.tflops[name] / row.tflops[name] - 1:.0%}" for name in ranked
                 if plain is not None and name in plain.tflops]
        if costs:
            why += f"; {row.feature} over plain on '{plain.case}': {', '.join(costs)}"
    if notes:
        why += "; " + "; ".join(notes)
    if skipped:
        why += "; " + "; ".join(skipped)
    if not order and triton_problem is None:
        order = ["triton"]
        why += "; none measured can run it, the Triton kernels"
    return order, why
