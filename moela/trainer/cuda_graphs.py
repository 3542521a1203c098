"""The graphed micro-batch (`train.cuda_graphs`): forward and backward of one micro-batch captured once as a CUDA
graph and replayed for every later one, so the host launches one graph instead of thousands of kernels.

Why: at the shipped `small` size the compiled step is host-bound - a 16k-token micro-batch's kernels take less
time than the Python that launches them (compiled only, the GPU is busy two thirds of the step). A replay is one
launch call whatever the graph holds (two `cudaGraphLaunch` calls per step of two micro-batches, against ~2,500
kernel launches per micro-batch without).

What makes the step capturable (each is a precondition a capture would otherwise break or silently freeze):
- One shape: tokens are padded by `pad_batch` (the compile path already does), and the document count is fixed
  too: `pad_documents` appends empty documents up to `max_docs`. `max_docs` is `train.graph_max_docs`, or (0) the
  largest of 64, one per 128 tokens (the filler documents of a padded batch never exceed that) and twice the first
  micro-batch's documents rounded up to a power of two. The bundled corpus has 10-18 documents per 16k tokens, but
  short documents at an epoch boundary once made a micro-batch of 106 where the rule gave 64; hence the per-token
  floor. A micro-batch with more documents runs eagerly (same numbers, host-bound),
  and the first such one is logged with the fix. Empty documents cost little: no attention block, a program that
  exits at once in the kernels' grids.
- No host value frozen into the graph: the batch lives in static device buffers that each micro-batch is copied
  into (pinned, non-blocking); the labelled-token count is counted on the device (the static batch carries no
  `targets_on_host`), the filler count is a device scalar, and the loss weight of the micro-batch
  (`num_targets * grad_scale / total_targets`, a Python float in the eager step) multiplies a device scalar
  that the trainer fills once per step (`start_step`).
- No synchronization inside the step (tests/test_trainer_sync.py) and no lazy work left for the capture: the first
  `warmup_steps` (2) optimizer steps run the same function eagerly on the same static buffers, which compiles the
  blocks, autotunes the Triton kernels and builds the flash-attn kernels for exactly these shapes. Two, not one:
  Dynamo may compile a second variant of a block at step 2 (`small` at 32k tokens with FP8 experts recompiled a
  block when step 2 captured, and compiling inside a capture fails); after step 2 nothing recompiles (bench/step.py
  counts it).
- Gradients live in the graph's memory: the first micro-batch of a step is one graph, captured with every
  gradient unset, so autograd assigns the gradients it computes (tensors of the graph's private pool, kept by
  `p.grad` for the rest of the run) and each replay overwrites them; with `grad_accum` > 1 the later micro-batches
  are a second graph sharing that pool, captured with those gradients set, so it adds into them. The step never
  zeroes the gradients and never adds the first micro-batch's into zeros: against gradients allocated up front,
  zeroed before each step and added into by every graph, that is ~2 ms a step and 2.5 GiB less at `small`. A
  first micro-batch that runs eagerly (the warm-up, more documents than the graph holds, the profiler's
  `eager_replay`) zeroes them in place first; they are never set to None once a graph writes them. The optimizer,
  clipping and the router-bias update run eagerly on them (a few fused launches).
- Weights and buffers are updated in place (fused AdamW, the router bias `add_`), so the graph reads their current
  values. FP8 weight copies are never reused across a capture boundary (`moela.ops.weight_cache`), so the graph
  quantizes the weights itself, at every replay: once per micro-batch, not once per optimizer step as the eager
  step does (the same once with `grad_accum: 1`, as `small` ships). Attention's work lists are rebuilt inside the
  graph (`moela.ops.attention.kernels.worklist`: the static cu_seqlens is rewritten before every capture).

The replay's outputs (loss, metrics, target count, expert load) are the graph's own tensors, overwritten by the
next replay: the trainer consumes or copies them before it (it does, on the same stream). The captured graph
holds one micro-batch's activations in its private memory pool; the eager step's cached blocks are returned to
the driver before the capture, so the peak stays that of one micro-batch. The evaluation runs eagerly, so the
trainer releases the graphs before it (`release`) and the next step captures them again: an evaluation forward
allocating beside a pool that keeps a whole training micro-batch's memory ran out of memory where training fit.

Scope: one process on one GPU (no FSDP, tensor, context or expert parallelism: their hooks and collectives are
not captured here); `Trainer` rejects other layouts with an `InputError`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from moela.batch import FILLER_DOC, PackedBatch, pad_documents
from moela.trainer.compile import StaticShapes
from moela.trainer.errors import InputError, TrainingError

MIN_AUTO_DOCS = 64


class GraphedMicroBatch:
    """`__call__(batch)` runs forward + backward of a padded host micro-batch: eagerly on the static buffers during
    the first `warmup_steps` optimizer steps of this process (counted by `start_step`; a resumed run warms up again:
    its kernels are not compiled yet), then through the captured graphs (one for the first micro-batch of a step,
    which writes the gradients, one for the others, which add to them); returns (loss, metrics, num_targets,
    expert_load) as device tensors."""

    def __init__(self, model: torch.nn.Module, device: torch.device, autocast: Callable, *, max_docs: int = 0,
                 warmup_steps: int = 2, echo: Callable[[str], None] = print, capture: bool | None = None):
        self.model, self.device, self.autocast, self.echo = model, device, autocast, echo
        self.max_docs = max_docs  # 0: chosen by the first `fits` call
        self.warmup_steps = max(1, warmup_steps)
        # capture: False runs every micro-batch eagerly on the static buffers (the CPU tests of this bookkeeping)
        self.capture = device.type == "cuda" if capture is None else capture
        self.loss_scale = torch.zeros((), dtype=torch.float32, device=device)  # filled once per step
        self.static: PackedBatch | None = None
        # per role, True: the step's first micro-batch (assigns the gradients), False: a later one (adds)
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[bool, tuple] = {}
        # True: run the captured work eagerly instead of replaying it (the same kernels on the same buffers, but
        # launched by the ops, which a profiler needs to attribute kernels to ops: bench/steplib/row.py)
        self.eager_replay = False
        self.steps = 0  # optimizer steps started in this process
        self.first = True  # the next micro-batch is the first of its step
        self.replays = 0
        self.eager_batches = 0  # micro-batches with more than max_docs documents (run eagerly)
        self._warned = False

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The first micro-batch's graph, once captured."""
        return self.graphs.get(True)

    # ---------------------------------------------------------------------------------------------------------
    def start_step(self, loss_scale: float) -> None:
        """A new optimizer step begins; its micro-batches' loss weight is `num_targets * loss_scale` (the scale
        `grad_scale / total_targets` is written by a fill kernel: no host wait)."""
        self.steps += 1
        self.first = True
        self.loss_scale.fill_(loss_scale)

    def fits(self, batch: PackedBatch) -> bool:
        """Whether `batch` (padded tokens, on the host) fits the static buffers; the first call fixes their
        document count (see the module docstring)."""
        if not self.max_docs:
            self.max_docs = max(MIN_AUTO_DOCS, batch.num_tokens // FILLER_DOC, _pow2(2 * batch.num_docs))
        return batch.num_docs <= self.max_docs

    def __call__(self, batch: PackedBatch):
        """Forward + backward of `batch` (one that `fits`) on the static buffers: eagerly during the warm-up
        steps, then by replaying the graph of its role (captured at the first call after them)."""
        role, self.first = self.first, False
        self._load(batch)
        # a later micro-batch's graph shares the first one's pool, so it waits for that one
        if (role not in self.graphs and self.capture and self.steps > self.warmup_steps
                and (role or True in self.graphs)):
            self._capture(role)
        eager = role not in self.graphs or self.eager_replay
        if role and eager:
            self._clear_gradients()
        if eager:
            return self._forward_backward()
        self.graphs[role].replay()
        self.replays += 1
        return self.outputs[role]

    def release(self) -> None:
        """Free the graphs' private memory before work that is not a training step (the evaluation), so that work
        allocates from the memory training used instead of beside it: the graphs, their outputs and the gradients
        they hold go (a step's gradients are consumed by then), and the next optimizer step captures again without
        a new warm-up (its kernels are built)."""
        if not self.graphs:
            return
        self.graphs.clear()
        self.outputs.clear()
        self.model.zero_grad(set_to_none=True)
        self.warmup_steps = min(self.warmup_steps, self.steps)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def note_eager(self, batch: PackedBatch) -> None:
        """A micro-batch with more than `max_docs` documents runs eagerly (the caller runs it, after this call);
        the first one says so."""
        self.eager_batches += 1
        if self.first:
            self._clear_gradients()
            self.first = False
        if not self._warned:
            self._warned = True
            self.echo(f"cuda_graphs: a micro-batch has {batch.num_docs} documents, more than the graph's "
                      f"{self.max_docs}; such micro-batches run eagerly (slower, same result). Set "
                      f"train.graph_max_docs={_pow2(batch.num_docs)} to graph them")

    # ---------------------------------------------------------------------------------------------------------
    def _clear_gradients(self) -> None:
        """Before an eager first micro-batch: no gradient of an earlier step may remain. Unset until a graph holds
        them (autograd then assigns, as in the plain step); zeroed in place after (the graph writes there)."""
        if not self.graphs:
            self.model.zero_grad(set_to_none=True)
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    def _load(self, batch: PackedBatch) -> None:
        """Copy `batch` into the static buffers (allocated at the first call). The copy bumps the version of the
        static cu_seqlens, so no attention work list cached before a capture is reused inside it."""
        batch = pad_documents(batch, self.max_docs)
        if self.static is None:
            self.static = _static_like(batch, self.device)
        s = self.static
        if s.input_ids.shape != batch.input_ids.shape:
            raise ValueError(f"cuda_graphs: a micro-batch of {batch.num_tokens} tokens, the graph holds "
                             f"{s.num_tokens} (micro-batches are padded to train.tokens_per_microbatch)")
        for name in ("input_ids", "labels", "position_ids", "cu_seqlens"):
            getattr(s, name).copy_(_pinned(getattr(batch, name)), non_blocking=True)
        s.filler_tokens.fill_(int(batch.filler_tokens))

    def _forward_backward(self):
        with self.autocast():
            out = self.model(self.static)
        (out.loss * (out.num_targets * self.loss_scale)).backward()
        metrics = {k: v.detach() for k, v in out.metrics.items()}
        return out.loss.detach(), metrics, out.num_targets, out.expert_load

    def _capture(self, first: bool) -> None:
        """Capture the graph of the first micro-batch (gradients unset: autograd allocates them in the graph's
        pool and assigns them) or of a later one (gradients set: it adds; it shares the first graph's pool, the
        two never run at once)."""
        torch.cuda.synchronize(self.device)
        if first:
            self.model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()  # the warm-up's cached blocks back to the driver: the graph pool takes their place
        graph = torch.cuda.CUDAGraph()
        pool = None if first else self.graphs[True].pool()
        try:
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[first] = self._forward_backward()
        except Exception as e:  # noqa: BLE001 - any failure of the capture is reported the same way
            raise TrainingError(
                f"train.cuda_graphs: capturing the training micro-batch as a CUDA graph failed ({type(e).__name__}: "
                f"{e}). An op of this configuration synchronizes with the host or is not capturable; set "
                f"train.cuda_graphs=false to train without graphs") from e
        self.graphs[first] = graph
        self.echo(f"cuda_graphs: captured forward + backward of {'the first' if first else 'a later'} micro-batch "
                  f"of a step ({self.static.num_tokens} tokens, up to {self.max_docs} documents); replaying it "
                  f"from now on")


def _static_like(batch: PackedBatch, device: torch.device) -> PackedBatch:
    """Device buffers shaped like `batch` (host), with a device filler count and no host target count."""
    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    return replace(batch, input_ids=empty(batch.input_ids), labels=empty(batch.labels),
                   position_ids=empty(batch.position_ids), cu_seqlens=empty(batch.cu_seqlens),
                   targets_on_host=None, filler_tokens=torch.zeros((), dtype=torch.int64, device=device))


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if torch.cuda.is_available() and t.device.type == "cpu" else t


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def graphed_micro_batch(trainer) -> GraphedMicroBatch | None:
    """`train.cuda_graphs` for a `Trainer`: the graphed forward + backward (one GPU, no parallelism), micro-batches
    padded to one shape (setting the trainer's `static_shapes` if compilation did not); None when off."""
    cfg = trainer.cfg.train
    if not cfg.cuda_graphs:
        return None
    if trainer.device.type != "cuda":
        raise InputError(f"train.cuda_graphs needs a CUDA device, this run trains on {trainer.device.type}; set "
                         f"train.cuda_graphs=false")
    if trainer.env.world_size > 1:
        raise InputError(f"train.cuda_graphs captures the step of one process on one GPU; this run has "
                         f"{trainer.env.world_size} processes (FSDP / tensor / context / expert parallelism hooks "
                         f"and collectives are not captured). Set train.cuda_graphs=false")
    if trainer.static_shapes is None:
        trainer.static_shapes = StaticShapes(cfg.tokens_per_microbatch, trainer.cfg.data.max_doc_len)
    return GraphedMicroBatch(trainer.model, trainer.device, trainer._autocast, max_docs=cfg.graph_max_docs,
                             echo=trainer._echo)
