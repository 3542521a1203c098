"""`PackedBatch`, the one batch type: documents concatenated into a flat token stream, no batch dim; and `pad_batch`,
which gives every micro-batch one fixed shape for compiled training.

Lives at the package top level because both `moela.data` (which builds it) and `moela.model` (which consumes
it) need it, and the model must not import `data`.

Padding (`pad_batch`): a compiled model specializes on tensor shapes, so a token count that changes every
micro-batch would recompile or run slower dynamic-shape code. `pad_batch` appends filler tokens up to a fixed T:
token id 0, label IGNORE_INDEX, cut into filler documents of at most `FILLER_DOC` tokens each (attention inside a
filler document costs at most FILLER_DOC^2 / 2 per document, and nothing real ever attends to it), and sets
`max_seqlen` to a fixed upper bound. The model leaves filler tokens out of every statistic (`filler_tokens`), so
padding changes no loss, gradient, balance loss or expert load. The document count still varies (cu_seqlens [N+1]):
the model marks that dimension dynamic.

Document padding (`pad_documents`): a CUDA graph replays fixed shapes, so the graphed step (`train.cuda_graphs`)
also fixes N, appending empty documents (cu_seqlens repeating T) after the last one. An empty document holds no
token: every kernel skips it (attention's work list gives it no block, a segment sum no row) and every per-document
statistic weighs it 0. Empty documents are legal only there, at the end of a padded batch.

Shapes: T tokens, N documents.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

IGNORE_INDEX = -100


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [T] int64
    labels: torch.Tensor  # [T] int64, IGNORE_INDEX where a token has no target (last token of each document)
    position_ids: torch.Tensor  # [T] int32, restart at 0 for each document (original positions under CP)
    cu_seqlens: torch.Tensor  # [N+1] int32, document boundaries in the flat stream
    max_seqlen: int
    # labelled-token count known on the host: set by the producer (the data loader's `make_batch`), else by `to()`
    # from a CPU batch, and carried to the device, so that the model reading it on the GPU does not synchronize
    # with the device once per micro-batch (a context-parallel shard counts its own on the device)
    targets_on_host: int | None = field(default=None, repr=False, compare=False)
    # None: every token is a document's. An int (possibly 0): the batch was padded to a fixed shape by `pad_batch`
    # and its last `filler_tokens` tokens are filler (no labels, outside every statistic); max_seqlen is then an
    # upper bound of the longest document. A 0-d int64 device tensor in the graphed step's static batch (a host
    # int would be frozen into the captured graph)
    filler_tokens: int | torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def num_targets(self) -> int:
        """Tokens that carry a label (the denominator of the token-mean loss)."""
        if self.targets_on_host is not None:
            return self.targets_on_host
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PackedBatch":
        """The batch on `device`. A non-blocking copy from the CPU to a GPU goes through pinned memory, so that the
        host never waits for the device (a copy from pageable memory is staged synchronously)."""
        pin = non_blocking and torch.device(device).type == "cuda"
        moved = {
            f.name: (_copy(v, device, non_blocking, pin) if isinstance(v, torch.Tensor) else v)
            for f in fields(self)
            for v in [getattr(self, f.name)]
        }
        if self.targets_on_host is None and self.labels.device.type == "cpu":
            moved["targets_on_host"] = self.num_targets()
        return replace(self, **moved)

    def validate(self) -> None:
        """Check the invariants every producer must keep; raises ValueError naming the broken one."""
        t = self.input_ids.numel()
        if self.input_ids.dim() != 1 or self.labels.shape != self.input_ids.shape:
            raise ValueError(f"input_ids and labels must be flat [T] tensors of one length, got "
                             f"{tuple(self.input_ids.shape)} and {tuple(self.labels.shape)}")
        if self.position_ids.shape != self.input_ids.shape:
            raise ValueError(f"position_ids must be [T]={t}, got {tuple(self.position_ids.shape)}")
        cu = self.cu_seqlens
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != t:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={t}, got {cu.tolist()}")
        lens = cu[1:] - cu[:-1]
        real = lens.numel() - _trailing_empty(lens) if self.filler_tokens is not None else lens.numel()
        if bool((lens[:real] <= 0).any()):
            raise ValueError("cu_seqlens must be strictly increasing (no empty documents; a padded batch may end "
                             "with empty ones, `pad_documents`)")
        if int(lens.max()) > self.max_seqlen or (self.filler_tokens is None and int(lens.max()) != self.max_seqlen):
            raise ValueError(f"max_seqlen={self.max_seqlen} but the longest document has {int(lens.max())} tokens")


def _copy(t: torch.Tensor, device: torch.device | str, non_blocking: bool, pin: bool) -> torch.Tensor:
    if pin and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)


FILLER_DOC = 128  # tokens per filler document at most


def pad_batch(batch: PackedBatch, num_tokens: int, max_seqlen: int) -> PackedBatch:
    """`batch` (on the CPU) padded with filler documents to exactly `num_tokens` tokens, with `max_seqlen` as its
    length bound (see the module docstring)."""
    t = batch.num_tokens
    if batch.filler_tokens is not None:
        raise ValueError("pad_batch: the batch is already padded")
    if t > num_tokens or batch.max_seqlen > max_seqlen:
        raise ValueError(f"pad_batch: a batch of {t} tokens (longest document {batch.max_seqlen}) does not fit "
                         f"{num_tokens} tokens with documents of at most {max_seqlen}")
    if batch.input_ids.device.type != "cpu":
        raise ValueError("pad_batch pads on the CPU, before the copy to the device (its sizes are host numbers)")
    fill = num_tokens - t
    piece = min(FILLER_DOC, max_seqlen)
    lens = [piece] * (fill // piece) + ([fill % piece] if fill % piece else [])
    ends = torch.tensor(lens, dtype=torch.int64).cumsum(0) + t  # [filler docs]
    positions = torch.arange(fill, dtype=torch.int64)
    if lens:
        positions -= torch.repeat_interleave(ends - t - torch.tensor(lens), torch.tensor(lens))
    targets = batch.targets_on_host if batch.targets_on_host is not None else batch.num_targets()
    return PackedBatch(
        input_ids=torch.cat((batch.input_ids, batch.input_ids.new_zeros(fill))),  # [T_pad]
        labels=torch.cat((batch.labels, batch.labels.new_full((fill,), IGNORE_INDEX))),  # [T_pad]
        position_ids=torch.cat((batch.position_ids, positions.to(batch.position_ids.dtype))),  # [T_pad]
        cu_seqlens=torch.cat((batch.cu_seqlens, ends.to(batch.cu_seqlens.dtype))),  # [N + filler docs + 1]
        max_seqlen=max_seqlen, targets_on_host=targets, filler_tokens=fill)


def _trailing_empty(lengths: torch.Tensor) -> int:
    """How many of the last document lengths are 0."""
    nonzero = torch.nonzero(lengths).flatten()
    return lengths.numel() - (int(nonzero[-1]) + 1 if nonzero.numel() else 0)


def pad_documents(batch: PackedBatch, num_docs: int) -> PackedBatch:
    """`batch` (on the CPU, already padded by `pad_batch`) with empty documents appended up to exactly `num_docs`
    documents (see the module docstring)."""
    if batch.filler_tokens is None:
        raise ValueError("pad_documents: pad the tokens first (pad_batch); an unpadded batch keeps its documents")
    if batch.cu_seqlens.device.type != "cpu":
        raise ValueError("pad_documents pads on the CPU, before the copy to the device")
    if batch.num_docs > num_docs:
        raise ValueError(f"pad_documents: the batch has {batch.num_docs} documents, more than {num_docs}")
    extra = batch.cu_seqlens[-1:].expand(num_docs - batch.num_docs)  # [num_docs - N] copies of T
    return replace(batch, cu_seqlens=torch.cat((batch.cu_seqlens, extra)))
