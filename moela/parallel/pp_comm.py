"""Point-to-point transport between pipeline stages: `StageLinks`.

Decisions:
- One process group per stage edge and direction (activations k -> k+1, gradients k+1 -> k) between the two ranks
  holding those stages. Point-to-point messages between two ranks are matched in posting order (NCCL ignores
  tags), and two ranks may exchange several kinds of message in different orders (a V-shaped schedule sends
  chunk 0's activations and chunk 1's gradients over the same pair of ranks); within one edge and direction both
  sides handle micro-batches in increasing order, so a group per edge and direction makes every match right.
  Edges between two stages of one rank pass tensors in memory.
- Shapes never travel: every stage prepares its own copy of the micro-batch, so the receiver knows each
  tensor's rows, and the width is the model's. Dtypes travel once per activation edge, in a small header before
  the first message (they depend on autocast and mixed precision, not on the micro-batch); gradients have their
  activation's dtype.
- Sends never wait (`isend`; the handles are kept until `wait_sends`), receives do: a rank blocks only on data it
  needs now.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class StageLinks:
    """The transport of one pipeline: `ranks[k]` is the global rank holding stage k, for this rank's pipeline;
    `all_pipelines[p][k]` the same for every pipeline (every rank creates every group, in one order)."""

    def __init__(self, ranks: list[int], all_pipelines: list[list[int]], counts: dict | None = None):
        self.ranks = ranks
        self.groups: dict[tuple[int, str], dist.ProcessGroup] = {}
        for pipeline in all_pipelines:
            for k in range(len(pipeline) - 1):
                for direction in ("act", "grad"):
                    if pipeline[k] == pipeline[k + 1]:
                        continue
                    group = dist.new_group(sorted({pipeline[k], pipeline[k + 1]}))
                    if pipeline == ranks:
                        self.groups[(k, direction)] = group
        self.local: dict[tuple[int, str, int], list[torch.Tensor]] = {}
        self.dtypes: dict[int, list[torch.dtype]] = {}
        self.pending: list[dist.Work] = []
        self.counts = counts  # if given: {"send": n, "recv": n} messages (tensors) counted, for tests

    def _count(self, kind: str, n: int) -> None:
        if self.counts is not None:
            self.counts[kind] = self.counts.get(kind, 0) + n

    def send(self, edge: int, direction: str, mb: int, tensors: list[torch.Tensor]) -> None:
        """Send `tensors` over stage edge `edge` (stage edge -> edge + 1 for "act", back for "grad")."""
        src, dst = (edge, edge + 1) if direction == "act" else (edge + 1, edge)
        if self.ranks[src] == self.ranks[dst]:
            self.local[(edge, direction, mb)] = [t.detach() for t in tensors]
            return
        group, peer = self.groups[(edge, direction)], self.ranks[dst]
        if direction == "act" and edge not in self.dtypes:
            self.dtypes[edge] = [t.dtype for t in tensors]
            header = torch.tensor([_DTYPES.index(t.dtype) for t in tensors], dtype=torch.int64,
                                  device=tensors[0].device)
            self.pending.append(dist.isend(header, dst=peer, group=group))
        for t in tensors:
            self.pending.append(dist.isend(t.detach().contiguous(), dst=peer, group=group))
        self._count("send", len(tensors))

    def recv(self, edge: int, direction: str, mb: int, shapes: list[tuple[int, ...]], device: torch.device,
             dtypes: list[torch.dtype] | None = None) -> list[torch.Tensor]:
        """Receive the tensors `send` sent over `edge` for micro-batch `mb`; `dtypes` for gradients (their
        activations'), activations learn theirs from the edge's header."""
        src, dst = (edge, edge + 1) if direction == "act" else (edge + 1, edge)
        if self.ranks[src] == self.ranks[dst]:
            return self.local.pop((edge, direction, mb))
        group, peer = self.groups[(edge, direction)], self.ranks[src]
        if dtypes is None:
            if edge not in self.dtypes:
                header = torch.empty(len(shapes), dtype=torch.int64, device=device)
                dist.recv(header, src=peer, group=group)
                self.dtypes[edge] = [_DTYPES[i] for i in header.tolist()]  # once per edge (module docstring)
            dtypes = self.dtypes[edge]
        out = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in zip(shapes, dtypes)]
        for t in out:
            dist.recv(t, src=peer, group=group)
        self._count("recv", len(out))
        return out

    def wait_sends(self) -> None:
        """Wait for every send posted so far (at the end of a step: their buffers may then be freed)."""
        for work in self.pending:
            work.wait()
        self.pending.clear()
