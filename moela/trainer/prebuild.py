"""Kernel prebuild (`train.prebuild_kernels`): a second process builds moela's Triton (and flash-attn-4) kernels
into the on-disk caches while the training process traces and compiles its blocks, so the first step finds them
built instead of compiling each at its first launch.

Why: with empty caches the first step of a compiled run on an H200 spends ~13 s compiling moela's own kernels
(19 Triton JIT builds at `small` 64k), one after another
and each on the step's critical path, beside ~16-26 s of torch.compile. torch.compile's work needs no kernel of
ours (it traces the custom ops' fake implementations), so the two can run side by side: Triton's compile is
serial within a process but its cache (`moela.ops.disk_caches`: TRITON_CACHE_DIR under MOELA_CACHE_DIR) is shared
by processes, written atomically and keyed by the kernel's source, signature and specialization, so a kernel that
the helper built is a cache hit for the trainer.

What the helper runs: the training step itself, eagerly (no torch.compile, not even the small ops' compiled forms,
`moela.ops.compiled`), on a model of the run's widths but only one layer of each kind (a dense block, an MoE block,
the MTP block; for FAL blocks also the first layer, a standard block), on a synthetic micro-batch of the run's
exact shape (padded like `moela.trainer.compile`'s `StaticShapes`, and to the graphed step's document count under
`train.cuda_graphs`), then one optimizer step. Its blocks recompute their activations in backward (one block's
activations held at a time) and its CUDA allocator uses expandable segments: the eager reference ops keep far more
memory than the trainer's compiled blocks, and without both the helper ran past its memory cap at V2-Lite shapes.
Every kernel the trainer's first step launches, it launches with the same shapes and dtypes, so with the same
specialization. It is a cache warmer only: its results are discarded, its failures never stop training (the
trainer logs them and keeps the helper's output as `prebuild.log` in the run dir), and its own autotuning results
are not written to the cache (it times its candidates while the trainer uses the same GPU; the trainer times them
again itself, compiled by then).

Measured (H200, `small` at 64k tokens, moela's Triton attention, each row with empty caches of its own, both
row orders; numbers and history in bench/RESULTS.md): the first step ends 24-25 s after the
model is built with the helper against 31-39 s without, the trainer's own Triton builds 2.1-2.4 s against
7.7-10.2 s (19 kernels), at equal tokens/s. The helper's step ends 18-22 s after it starts at `small` 64k, 26 s
at V2-Lite-6L (4-5 s of imports; `python bench/prebuild_helper.py`).

Scope: a compiled run (`train.compile`) of one process on a CUDA device. With several processes the ranks build
the same kernels side by side anyway, and sharded or expert-parallel layers see other shapes than this helper.
It is stopped when the training process has finished its first step (whatever it has not built by then the
trainer has built itself) or exits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from moela.batch import PackedBatch, pad_batch
from moela.config import Config, dump_config, load_config
from moela.model.config import ModelConfig

LOG_NAME = "prebuild.log"
DONE = "one step of"  # the helper's last line once its work is done (it may still be exiting)
PARENT_ENV = "MOELA_PREBUILD_PARENT"  # the training process's pid, for the helper's watchdog
# the largest share of the GPU's memory the helper may allocate: it runs while the trainer builds its model and
# starts its first step on the same GPU, so a helper that needed more would fail itself (the trainer then builds
# the kernels it did not), never push the trainer out of memory. Measured with its blocks checkpointed and
# expandable segments (`python bench/prebuild_helper.py`, H200, cap 35.0 GiB): 11.6 GiB at `small` 64k,
# 32.1 GiB at V2-Lite-6L 64k (the dense FFN's float32 SwiGLU temporaries in the eager reference)
MEMORY_FRACTION = 0.25


def _layer_kinds(cfg: ModelConfig) -> set[tuple]:
    """The distinct blocks of the main stack as `Transformer` builds them: (kind, keeps_a1, MoE) by layer index."""
    return {(cfg.block if i else "standard", i == 0 and cfg.block != "standard", i >= cfg.first_k_dense_replace)
            for i in range(cfg.num_hidden_layers)}


def reduced_model(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with the fewest layers that still hold every kind of block it builds (a dense and an MoE layer; for
    FAL / FAL+ blocks also the first layer, which is a standard block keeping a1), MTP blocks kept. Widths,
    experts, heads, precision and backends are unchanged, so every kernel sees the full model's shapes."""
    want = _layer_kinds(cfg)
    for layers in range(1, cfg.num_hidden_layers + 1):
        for dense in range(min(cfg.first_k_dense_replace, layers) + 1):
            small = replace(cfg, num_hidden_layers=layers, first_k_dense_replace=dense)
            if _layer_kinds(small) == want and not small.validate():
                return small
    return cfg


def synthetic_batch(cfg: Config, seed: int = 0) -> PackedBatch:
    """A micro-batch of the run's shape on the CPU, padded like `StaticShapes` (to `train.tokens_per_microbatch`
    tokens, the loader's piece limit as its length bound): random tokens in documents of 2,047 tokens (or one less
    than that bound), the packed layout of real data. Documents that all reach the bound and fill the batch
    exactly would be the "equal" layout, for which attention's `auto` may pick another backend
    (`moela.ops.attention.auto`), and the graphed step's document count follows the real default for short
    documents (`GraphedMicroBatch.fits`)."""
    num_tokens = cfg.train.tokens_per_microbatch
    max_seqlen = min(cfg.data.max_doc_len or num_tokens, num_tokens)
    doc = max(1, min(max_seqlen - 1, 2047))
    lens = [doc] * (num_tokens // doc)  # the filler documents of pad_batch take the rest
    total = sum(lens)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (total + 1,), generator=g)
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
    labels = tokens[1:].clone()
    labels[cu[1:] - 1] = -100  # each document's last token has no target
    positions = torch.arange(total) - torch.repeat_interleave(cu[:-1], torch.tensor(lens))
    batch = PackedBatch(input_ids=tokens[:-1].clone(), labels=labels, position_ids=positions.to(torch.int32),
                        cu_seqlens=cu.to(torch.int32), max_seqlen=doc, targets_on_host=total - len(lens))
    return pad_batch(batch, num_tokens, max_seqlen)


def run_step(cfg: Config, device: torch.device, log=lambda what: None) -> float:
    """The helper's work: one training step of the reduced model on a synthetic micro-batch, the way the trainer's
    first step runs it (graphed warm-up path or plain compiled-shape path); returns its loss (finite unless a
    kernel is wrong, which the tests check). `log(what)` is called after each phase (the helper's log times
    them)."""
    from moela.model import build_model
    from moela.model.block import Block
    from moela.trainer.cuda_graphs import GraphedMicroBatch
    from moela.trainer.optim import build_optimizer, clip_gradients, optimizer_step
    from moela.trainer.step_metrics import skips_on_device

    log("imported")
    torch.manual_seed(cfg.train.seed)
    model = build_model(reduced_model(cfg.model), device)
    for module in model.modules():
        if isinstance(module, Block):
            # activation checkpointing: only one block's activations at a time. The eager forms of the small ops
            # keep far more than the trainer's compiled blocks do, and at V2-Lite shapes the helper's 3 blocks ran
            # past its memory cap; the recomputed forward launches
            # the same kernels again, from the in-memory cache
            module.recompute = True
    optimizer = build_optimizer(model, cfg.optim, device.type)
    log("model built")
    precision = cfg.train.precision
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    batch = synthetic_batch(cfg, cfg.train.seed)
    model.train()
    if cfg.train.cuda_graphs:
        graphed = GraphedMicroBatch(model, device, autocast, max_docs=cfg.train.graph_max_docs, capture=False)
        graphed.start_step(1.0 / max(batch.num_targets(), 1))
        graphed.fits(batch)
        loss = graphed(batch)[0]
    else:
        with autocast():
            out = model(batch.to(device, non_blocking=True))
        log("forward launched")
        (out.loss * (out.num_targets / max(batch.num_targets(), 1))).backward()
        loss = out.loss.detach()
    log("forward and backward launched")
    total = clip_gradients(model, optimizer, cfg.optim.grad_clip, device)  # the trainer's clipping and step
    optimizer_step(optimizer, torch.isfinite(loss) & torch.isfinite(total), skips_on_device(optimizer))
    loss = float(loss)  # waits for the device
    log("optimizer step done")
    return loss


def prebuild_wanted(cfg: Config, device: torch.device, world_size: int) -> bool:
    """Whether a run starts the helper: `train.prebuild_kernels` on a compiled run of one process on CUDA."""
    return cfg.train.prebuild_kernels and cfg.train.compile and device.type == "cuda" and world_size == 1


class Prebuild:
    """The helper process of one training run: `start` it before the model is built, `stop` it after the first
    step (or on any exit); `stop` returns the line the trainer logs. Its output goes to a temporary file, so a run
    that turns out to have nothing to do writes nothing to its run dir; `stop(keep_log=run_dir)` moves the log of
    a helper that failed or was stopped there (`prebuild.log`) and deletes one that succeeded (its last line is in
    the trainer's)."""

    def __init__(self, proc: subprocess.Popen, log_path: Path, config_path: Path):
        self.proc, self.log_path, self.config_path = proc, log_path, config_path

    @classmethod
    def start(cls, cfg: Config, device: torch.device) -> "Prebuild":
        """Start the helper for `cfg` on `device`. The environment is inherited (the cache locations `moela.ops`
        set), except that its autotuning results are not cached."""
        fd, name = tempfile.mkstemp(prefix="moela-prebuild-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            f.write(dump_config(cfg))
        fd, log_name = tempfile.mkstemp(prefix="moela-prebuild-", suffix=".log")
        env = dict(os.environ, TRITON_CACHE_AUTOTUNING="0", **{PARENT_ENV: str(os.getpid())})
        try:
            with os.fdopen(fd, "w") as log:
                proc = subprocess.Popen([sys.executable, "-m", "moela.trainer.prebuild", name, str(device)],
                                        stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            Path(name).unlink(missing_ok=True)
            Path(log_name).unlink(missing_ok=True)
            raise
        return cls(proc, Path(log_name), Path(name))

    @classmethod
    def start_or_say(cls, cfg: Config, device: torch.device, echo: Callable[[str], None]) -> "Prebuild | None":
        """`start`, or None with a line to `echo` if no process can be started (a cache warmer: training goes on
        without it)."""
        try:
            return cls.start(cfg, device)
        except OSError as e:
            echo(f"prebuild: could not start the kernel-building helper ({e}); the first step builds the kernels "
                 f"itself")
            return None

    def stop(self, keep_log: Path | None = None) -> str:
        """Stop the helper if it still runs (what it has not built the trainer has built itself by now) and say how
        it went; the log of a helper that did not succeed is moved to `keep_log / prebuild.log` (else deleted)."""
        code = self.proc.poll()
        lines = self.log_path.read_text(errors="replace").strip().splitlines() if self.log_path.exists() else []
        if code is None and lines and lines[-1].startswith(DONE):
            code = 0  # done, still tearing down its CUDA context: nothing left to build
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.config_path.unlink(missing_ok=True)
        log = "its log was not kept"
        if code != 0 and keep_log is not None and self.log_path.exists():
            keep_log.mkdir(parents=True, exist_ok=True)
            log = str(shutil.move(self.log_path, keep_log / LOG_NAME))
        self.log_path.unlink(missing_ok=True)
        if code is None:
            return f"prebuild: the kernel-building helper was still running after the first step; stopped ({log})"
        if code == 0:
            done = lines[-1] if lines else "done"
            return f"prebuild: the helper built the run's kernels beside the first step's compile ({done})"
        return (f"prebuild: the kernel-building helper failed (exit {code}; {log}); the trainer built its kernels "
                f"itself. Set train.prebuild_kernels=false to skip it")


def _exit_with_parent() -> None:
    """End this process when the training process (`PARENT_ENV`, else the parent now) is gone: a killed trainer
    leaves no helper on its GPU. Named by pid, since the trainer may be gone before this process starts to watch."""
    parent = int(os.environ.get(PARENT_ENV) or os.getppid())

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m moela.trainer.prebuild RESOLVED_RECIPE.yaml DEVICE", file=sys.stderr)
        return 2
    _exit_with_parent()
    started = time.perf_counter()
    # before CUDA starts: the eager reference ops allocate and free tensors of many sizes (a dense FFN's float32
    # SwiGLU temporaries at 64k tokens: 2.7 GiB each), and the fixed-size segments of the default allocator held
    # 7.5 GiB free but unusable when the helper hit its cap at V2-Lite shapes; a user's own setting is kept
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # the small ops' Inductor-compiled forms (moela.ops.compiled: norms, RoPE, SwiGLU, losses, which eager code
    # calls on CUDA) run as their references: inside the trainer's compiled blocks they are traced into the block
    # and hold none of our kernels, and compiling them here took the helper 59-109 s of a 64k step
    torch._dynamo.config.disable = True
    cfg = load_config(argv[0])
    Path(argv[0]).unlink(missing_ok=True)  # the trainer's temporary copy of its recipe
    device = torch.device(argv[1])
    if device.type == "cuda":
        if device.index is not None:
            torch.cuda.set_device(device)
        # the trainer shares this GPU: past this share the helper fails (logged) rather than the trainer
        torch.cuda.set_per_process_memory_fraction(MEMORY_FRACTION, torch.cuda.current_device())
    loss = run_step(cfg, device, log=lambda what: print(f"{time.perf_counter() - started:6.1f} s  {what}",
                                                        flush=True))
    peak = f", peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else ""
    print(f"{DONE} {reduced_model(cfg.model).num_hidden_layers} layers in {time.perf_counter() - started:.1f} s "
          f"from the helper's start{peak}, loss {loss:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown: the GPU memory is released at once
