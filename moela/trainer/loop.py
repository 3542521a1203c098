"""The training loop: `Trainer(cfg).fit()` builds everything from a `Config`, trains, evaluates, checkpoints.

One optimizer step: the loader hands this data-parallel rank its `grad_accum` packed micro-batches; the labelled
tokens of the whole global step are counted (summed over the data-parallel ranks, once per micro-batch) before any
backward, and micro-batch i contributes `loss_i * num_targets_i / total_targets`, so accumulation and data
parallelism reproduce the single-process token-mean gradient exactly. Then: the replicate reduction under
`parallel.replicate_compression` (moela.parallel.replicate), clip, check finiteness, AdamW step,
router-bias update from the expert load summed over all those ranks, LR schedule step.

Decisions:
- The step's labelled tokens are summed over the `dp` ranks (context-parallel peers share micro-batches), while
  each rank's `loss * num_targets` (its own part under CP) is summed over `dp_cp`. FSDP averages gradients over
  `dp_cp`; the loss is multiplied by that rank count so the average becomes the sum the weighting needs.
- A step whose loss or gradient norm is not finite is skipped (no optimizer or bias update; data and LR schedule
  still advance) and counted; after `train.max_nonfinite_steps` in a row training stops with `TrainingError`.
- SIGTERM / SIGINT set a flag (`stopping.py`); at the end of a step the ranks agree on it (several ranks: on logging
  steps), a checkpoint is written and `fit()` returns `STOPPED` (train.py exits 3). A second SIGINT interrupts
  immediately.
- Before the data and the model are built, rank 0 checks that the run dir can be written, locks it for the run's
  life (`rundir.py`) and, for wandb online, that a login exists; every rank raises the same error.
- Resume restores weights, optimizer moments, the data position, RNG states and counters from the newest intact
  checkpoint (`checkpoint.resume`); the LR schedule and AdamW hyperparameters come from the current recipe at the
  saved step. A recipe that changes what the checkpoint fixes stops with an `InputError` listing each change. A run
  already at `train.steps` writes nothing (not even config.yaml).
- A non-finite evaluation stops the run with a `TrainingError` before anything more is saved.
- bf16 autocast on CUDA (fp32 master weights and optimizer state), plain fp32 on CPU (`train.precision`).
"""

from __future__ import annotations

import math
import signal
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from moela.batch import PackedBatch
from moela.config import Config, dump_config
from moela.data import build_loaders
from moela.data.balance import cost_coefficients
from moela.model import build_model, count_params
from moela.parallel import apply_parallelism, build_mesh, reduce_expert_load
from moela.parallel.fsdp import set_gradient_sync
from moela.parallel.replicate import build_replicate_reducer
from moela.trainer import checkpoint, oom
from moela.trainer.compile import StaticShapes, compile_blocks, prepare_inductor
from moela.trainer.cuda_graphs import graphed_micro_batch
from moela.trainer.device_checks import check_backends, check_fp8_device
from moela.trainer.distributed import init_distributed, seed_everything, shutdown
from moela.trainer.errors import InputError, TrainingError
from moela.trainer.evaluation import evaluate_and_log
from moela.trainer.init_from import load_initial_weights
from moela.trainer.metrics import (
    LogWindow,
    MetricsWriter,
    check_wandb_login,
    device_peak_flops,
    loss_legend,
    memory_gib,
    mfu,
    plot_losses,
)
from moela.trainer.optim import (
    build_optimizer,
    build_scheduler,
    clip_gradients,
    optimizer_step,
)
from moela.trainer.pipeline_step import PipelineStep
from moela.trainer.prebuild import Prebuild, prebuild_wanted
from moela.trainer.profiling import StepProfiler, profile_record
from moela.trainer.rundir import RunDirLock, check_writable
from moela.trainer.safe_write import write_atomic
from moela.trainer.startup import compile_notice, first_step_line
from moela.trainer.step_metrics import (
    TAIL_KEYS,
    NonfiniteCounters,
    PendingRecords,
    StepSums,
    expert_imbalance_device,
    skips_on_device,
)
from moela.trainer.stopping import StopRequest
from moela.trainer.summary import run_summary
from moela.trainer.trainer_state import load_trainer_state, trainer_state

FINISHED, STOPPED, UP_TO_DATE = "finished", "stopped", "up to date"  # what fit() returns


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.env = init_distributed(cfg.train.device)
        self.device = self.env.device
        if self.device.type == "cpu" and cfg.train.cpu_threads:
            torch.set_num_threads(cfg.train.cpu_threads)
        self.run_dir = Path(cfg.train.run_dir)
        self.mesh = build_mesh(cfg.parallel, self.env.world_size, self.device.type)
        precision = cfg.train.precision
        if precision == "auto":
            precision = "bf16" if self.device.type == "cuda" else "fp32"
        self.autocast_dtype = torch.bfloat16 if precision == "bf16" else None
        self.lock = RunDirLock(self.run_dir)
        self._preflight()
        try:
            self._build()
        except BaseException:
            self.lock.release()
            raise

    def _preflight(self) -> None:
        """Rank 0 checks the run dir (writable, not in use by another run) and the wandb login before anything
        heavy; every rank raises the same error."""
        error = None
        if self.env.is_main:
            try:
                check_writable(self.run_dir)
                note = self.lock.acquire()
                if note:
                    self._echo(note)
                check_wandb_login(self.cfg.logging.wandb)
            except TrainingError as e:
                error = e
        if dist.is_initialized():
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            self.lock.release()
            raise error

    def _build(self) -> None:
        cfg = self.cfg
        self.prebuild = None
        if prebuild_wanted(cfg, self.device, self.env.world_size):
            # started first: it imports and builds while this process reads the data and builds the model
            self.prebuild = Prebuild.start_or_say(cfg, self.device, self._echo)
        try:
            self._build_rest()
        except BaseException:
            self.stop_prebuild(keep_log=False)
            raise

    def stop_prebuild(self, keep_log: bool = True) -> str | None:
        """Stop the kernel-building helper if one runs; the line to log about it. `keep_log`: a failed helper's
        output goes to the run dir (not for a run that writes nothing there)."""
        prebuild, self.prebuild = self.prebuild, None
        if prebuild is None:
            return None
        return prebuild.stop(self.run_dir if keep_log and self.env.is_main else None)

    def _build_rest(self) -> None:
        cfg = self.cfg
        try:
            self.train_loader, self.val_loader, self.tokenizer = build_loaders(
                cfg.data, tokens_per_microbatch=cfg.train.tokens_per_microbatch, dp_rank=self.mesh.rank("dp"),
                dp_size=self.mesh.size("dp"), grad_accum=cfg.train.grad_accum, seed=cfg.train.seed,
                cost_coefficients=cost_coefficients(cfg.model))
        except OSError as e:  # unreadable files, a missing hub dataset
            raise TrainingError(f"cannot read the training data: {e}") from e
        except (ValueError, TypeError) as e:  # bad records, undecodable or empty input, missing columns or tokens
            raise InputError(f"cannot read the training data: {e}") from e
        if self.tokenizer.vocab_size > cfg.model.vocab_size:
            raise InputError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                             f"{self.tokenizer.vocab_size} tokens; set model.vocab_size >= "
                             f"{self.tokenizer.vocab_size}")
        seed_everything(cfg.train.seed)
        check_fp8_device(cfg.model, self.device)
        check_backends(cfg.model, self.device)
        self.model = self._build_model()
        self.replicate = build_replicate_reducer(self.model, self.mesh, cfg.parallel, cfg.train.seed,
                                                 cfg.schedule.warmup_steps)
        self.static_shapes = None
        if cfg.train.compile:
            prepare_inductor()
            compile_blocks(self.model)
            if self.mesh.size("cp") == 1:  # context parallelism splits batches itself
                self.static_shapes = StaticShapes(cfg.train.tokens_per_microbatch, cfg.data.max_doc_len)
        self.graphed = graphed_micro_batch(self)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device.type)
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, cfg.train.steps)
        self.peak_flops = device_peak_flops(self.device, cfg.logging)
        self.step = 0
        self.nonfinite_in_row = 0
        self.skipped_total = 0
        self.tokens_seen = 0
        self.window = LogWindow()
        self.pending = PendingRecords()
        self.counters = NonfiniteCounters(self.device)
        self.skips_on_device = skips_on_device(self.optimizer)
        self._last_end = time.perf_counter()
        self.stop_request = StopRequest(announce=self.env.is_main)

    def _build_model(self) -> torch.nn.Module:
        """torchtitan's order: build on the meta device, parallelize (shard), then allocate only this rank's shards
        with `to_empty` and `init_weights`, so a model larger than one device never exists whole anywhere. With
        `parallel.pp > 1`, only this rank's pipeline stages (`moela.trainer.pipeline_step`)."""
        self.pipeline = None
        if self.mesh.size("pp") > 1:
            self.pipeline = PipelineStep(self.cfg, self.mesh, self.device, self.autocast_dtype is not None)
            return self.pipeline.model

        def parallelize(model):
            apply_parallelism(model, self.mesh, self.cfg.parallel, mixed_precision=self.autocast_dtype is not None)
        return build_model(self.cfg.model, self.device, parallelize=parallelize)

    # ----------------------------------------------------------------------------------------------------------
    def fit(self) -> str:
        """Train from scratch (or from `checkpoint.init_from` weights) or from the newest intact checkpoint up to
        `train.steps`; save and plot at the end, then print the run summary. Returns FINISHED, STOPPED (by a signal,
        after saving a checkpoint) or UP_TO_DATE (nothing to do)."""
        try:
            outcome = self._fit()
            self.lock.release()
            # every rank waits for rank 0's last writes (metrics, plot, wandb): a launcher that sees one rank exit
            # with a non-zero code (3: stopped) terminates the others at once
            self._barrier()
            return outcome
        finally:
            self.lock.release()
            shutdown(self.env)

    def _fit(self) -> str:
        cfg = self.cfg
        started = time.perf_counter()
        found = checkpoint.resume(self.run_dir, cfg.checkpoint.resume, self.model, self.optimizer,
                                  checkpoint.fixed_settings(cfg), self._echo, self._extra_state())
        resume = None
        if found is not None:
            resume, state = found
            load_trainer_state(self, state)
            if self.step >= cfg.train.steps:
                self.stop_prebuild(keep_log=False)
                self._echo(f"{resume} is already at train.steps={cfg.train.steps}; nothing to do (raise "
                           f"train.steps to continue, or set checkpoint.resume=none to start over)")
                return UP_TO_DATE
        elif cfg.checkpoint.init_from:
            load_initial_weights(self.model, cfg.checkpoint.init_from, cfg.model)
        if self.env.is_main:
            write_atomic(self.run_dir / "config.yaml", dump_config(cfg), "the resolved recipe")
        self._barrier()
        writer = MetricsWriter(cfg, self.run_dir, self.env.is_main, self.step)
        self.writer = writer
        total, active = count_params(cfg.model)
        writer.echo(f"moela: {total / 1e6:.2f}M params ({active / 1e6:.2f}M active per token) on "
                    f"{self.env.world_size} x {self.device.type}, {self.autocast_dtype or torch.float32} compute; "
                    f"run dir {self.run_dir}" + (f"; resumed from {resume} at step {self.step}" if resume else "")
                    + (f"; weights from {cfg.checkpoint.init_from}" if cfg.checkpoint.init_from and not resume else ""))
        legend = loss_legend(cfg.model)
        if legend:
            writer.echo(legend)
        self.stop_request.install()
        profiler = StepProfiler(cfg.logging.profile_steps, self.run_dir, self.env.rank, self.device.type == "cuda")
        notice = compile_notice(cfg.train.compile)
        if notice:
            writer.echo(notice)
        try:
            last_saved = self.step if resume is not None else -1
            loop_start = time.perf_counter()
            while self.step < cfg.train.steps:
                profiler.before_step(self.step + 1)
                with self._oom("the training step"):
                    record = self.train_step()
                if notice:  # the first step of this process
                    writer.echo(first_step_line(self.step, time.perf_counter() - loop_start))
                    notice = None
                    prebuilt = self.stop_prebuild()
                    if prebuilt:
                        writer.echo(prebuilt)
                if profiler.active:  # its window's wall time must include the device work
                    self._settle()
                window = profiler.after_step(self.step, record["step_time_s"])
                if window is not None:
                    writer.log(profile_record(window, self.step, self.device, self.run_dir))
                writer.advance(self.step)
                if self.logs_at(self.step):
                    writer.log(self.window.summarize(record))
                if cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                    evaluate_and_log(self)
                stop = self.stop_request.agreed(self.device, self.logs_at(self.step))
                if stop or (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0):
                    self.save()
                    last_saved = self.step
                if stop:
                    name = signal.Signals(self.stop_request.signum or signal.SIGTERM).name
                    writer.echo(f"stopped by {name} after step {self.step}; checkpoint saved in "
                                f"{self.run_dir / 'checkpoints'}; run the same command again to resume")
                    return STOPPED
            if not cfg.train.eval_every or cfg.train.steps % cfg.train.eval_every:
                evaluate_and_log(self)
            if cfg.checkpoint.save_at_end and last_saved != self.step:
                self.save()
        finally:
            self.stop_prebuild()
            profiler.close()
            self.stop_request.restore()
            writer.close()
            if self.env.is_main and cfg.logging.plot:
                plot_losses(self.run_dir)
        if self.env.is_main:
            print(run_summary(self.run_dir, total_steps=cfg.train.steps, sample_prompt=cfg.logging.sample_prompt,
                              wall_s=time.perf_counter() - started), flush=True)
        return FINISHED

    # ----------------------------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimizer step over this rank's micro-batches; returns the step's metrics record. On a logging step
        (`logs_at`) every value is a host number; on the other steps the values computed on the device (losses,
        `grad_norm`, `expert_imbalance`, `skipped`) are 0-d device tensors, read at the next logging step
        (`moela.trainer.step_metrics`): nothing in a non-logging step waits for the device."""
        t0 = time.perf_counter()
        try:
            batches = self.train_loader.next_step()
        except OSError as e:  # a damaged token cache (moela.data.CacheError names it) or an unreadable file
            raise TrainingError(f"cannot read the training data: {e}") from None
        # the step's totals over all data-parallel ranks: the loader plans every rank's micro-batches (no
        # collective; the ranks of a CP group share their micro-batches, so these count each one once)
        global_targets, global_tokens, global_sum_sq = self.train_loader.last_global_counts
        total_targets = max(float(global_targets), 1.0)
        grad_scale = self.mesh.size("dp_cp")
        lr = self.scheduler.get_last_lr()[0]

        sums = StepSums()
        load = None
        self.model.train()
        if self.graphed is not None:
            self.graphed.start_step(grad_scale / total_targets)
        full_load = None
        if self.pipeline is not None:
            sums, load, full_load = self.pipeline.run(batches, grad_scale / total_targets, self._autocast,
                                                      self._to_device)
        for i, batch in enumerate(batches if self.pipeline is None else []):
            set_gradient_sync(self.model, i == len(batches) - 1)
            loss, metrics, num_targets, expert_load = self._forward_backward(batch, grad_scale / total_targets)
            sums.add(loss, metrics, num_targets)
            if expert_load is not None:  # a copy: a graph replay overwrites its outputs
                load = expert_load.float().clone() if load is None else load + expert_load
        replicate_bytes = self.replicate.reduce() if self.replicate is not None else {}
        self._all_reduce(sums.sums, "dp_cp")
        means = sums.sums / total_targets  # [M] float64
        grad_norm = self._clip_grad_norm()
        finite = torch.isfinite(means[0]) & torch.isfinite(grad_norm)  # [] bool
        self._optimizer_step(finite)
        if load is not None:
            reduce_expert_load(load, self.mesh)
            self.model.update_router_bias(load, enabled=finite)
        if full_load is not None:  # the whole model's rows, for the imbalance statistic
            load = reduce_expert_load(full_load, self.mesh)
        if self.graphed is None:  # graphed: the next step's first micro-batch overwrites them (or zeroes them)
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        self.counters.update(finite)

        c = self.counters
        tail = torch.stack([grad_norm.double(), expert_imbalance_device(load, self.device), finite.double(),
                            c.skipped.double(), c.in_row.double(), c.worst.double()])  # [len(TAIL_KEYS)]
        tokens = float(global_tokens)
        self.tokens_seen += int(tokens)
        record = {"kind": "train", "step": self.step, "lr": lr, "tokens_seen": self.tokens_seen,
                  "mem_gib": memory_gib(self.device), "epoch": self.train_loader.epoch,
                  "_tokens": tokens, "_sum_sq": global_sum_sq, "_t0": t0, **replicate_bytes}
        imbalance = getattr(self.train_loader, "last_imbalance", None)
        if self.pipeline is not None:
            record["pp_bubble"] = self.pipeline.bubble
        if imbalance and self.mesh.size("dp") > 1:
            record["dp_imbalance"] = float(imbalance["after"])
            record["dp_imbalance_unbalanced"] = float(imbalance["before"])
        self.pending.add(record, torch.cat([means, tail]), sums.keys + list(TAIL_KEYS))
        if self.logs_at(self.step):
            self._read_pending()
        else:
            self._last_end = time.perf_counter()
            self._set_time(record, self._last_end - t0)
        return record

    def _forward_backward(self, batch: PackedBatch, loss_scale: float):
        """Forward and backward of one host micro-batch, its loss weighted by `num_targets * loss_scale`; returns
        (loss, metrics, num_targets, expert_load). Through the graphed step when there is one and the batch fits
        it."""
        if self.graphed is not None:
            batch = self.static_shapes(batch)
            if self.graphed.fits(batch):
                return self.graphed(batch)
            self.graphed.note_eager(batch)
        batch = self._to_device(batch)
        with self._autocast():
            out = self.model(batch)
        (out.loss * (out.num_targets * loss_scale)).backward()
        return out.loss.detach(), out.metrics, out.num_targets, out.expert_load

    def logs_at(self, step: int) -> bool:
        """Whether optimizer step `step` writes a step line (and so reads the device's numbers)."""
        cfg = self.cfg
        return step == 1 or step % cfg.logging.log_every == 0 or step == cfg.train.steps

    def _optimizer_step(self, finite: torch.Tensor) -> None:
        optimizer_step(self.optimizer, finite, self.skips_on_device)

    def _read_pending(self) -> None:
        """Bring the pending steps' numbers to the host (one read), add them to the log window, update the host
        counters, and stop if a non-finite streak reached `train.max_nonfinite_steps`."""
        records = self.pending.resolve()
        if not records:
            return
        self._last_end = time.perf_counter()
        if "step_time_s" not in records[-1]:  # the current step, timed to the end of its device work
            self._set_time(records[-1], self._last_end - records[-1]["_t0"])
        worst, last_bad = 0, None
        for rec in records:
            for key in ("_tokens", "_sum_sq", "_t0"):
                rec.pop(key)
            if not rec.pop("finite"):
                last_bad = rec
            worst = max(worst, int(rec.pop("worst_streak")))
            self.nonfinite_in_row = int(rec.pop("nonfinite_in_row"))
            rec["skipped"] = self.skipped_total = int(rec["skipped"])
            if math.isnan(rec["expert_imbalance"]):
                rec["expert_imbalance"] = None
            self.window.add(rec)
        self.counters.reset_worst(self.nonfinite_in_row)
        if worst >= self.cfg.train.max_nonfinite_steps:
            raise TrainingError(
                f"stopped at step {self.step}: {worst} consecutive steps had a non-finite loss "
                f"({last_bad['loss']}) or gradient norm ({last_bad['grad_norm']}) and were skipped. Lower optim.lr, "
                f"tighten optim.grad_clip or check the data; rerun to resume from the last checkpoint, or raise "
                f"train.max_nonfinite_steps to tolerate longer streaks")

    def _settle(self) -> None:
        """Wait for the steps already queued on the device and charge that time to the last one, before the loop
        does something that is not training (evaluation, checkpoint, a profiled step's timing)."""
        if not self.pending.records:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        last = self.pending.records[-1]
        self._set_time(last, last["step_time_s"] + now - self._last_end)
        self._last_end = now

    def _set_time(self, record: dict, dt: float) -> None:
        record["step_time_s"] = dt
        record["tokens_per_s"] = record["_tokens"] / dt
        record["mfu"] = mfu(self.cfg.model, self.peak_flops, record["_tokens"], record["_sum_sq"], dt,
                            self.env.world_size)

    def save(self) -> Path:
        self._settle()
        self._read_pending()  # the log window and the counters are part of the checkpoint
        with self._oom("the checkpoint save"):
            return checkpoint.save_checkpoint(self.run_dir, self.step, self.model, self.optimizer,
                                              trainer_state(self), self.cfg.checkpoint.keep_last_k,
                                              checkpoint.fixed_settings(self.cfg), self._extra_state())

    def _oom(self, phase: str):
        """Report a CUDA out-of-memory error in `phase` as one message (moela.trainer.oom)."""
        return oom.reported(phase, self.device, lambda: checkpoint.newest(self.run_dir))

    def _echo(self, text: str) -> None:
        """A line on rank 0's stdout, outside the metrics writer (before it exists, or after it is closed)."""
        if self.env.is_main:
            print(text, flush=True)

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """What the SIGTERM / SIGINT handler does: finish the current step, save, return from `fit()`."""
        self.stop_request.request(signum)

    # ----------------------------------------------------------------------------------------------------------
    def _extra_state(self) -> dict[str, torch.Tensor] | None:
        """The replicate reducer's tensors, checkpointed through DCP with the model (and loaded in place)."""
        return self.replicate.state_dict() if self.replicate is not None else None

    def _to_device(self, batch: PackedBatch) -> PackedBatch:
        """A micro-batch on the training device, copied without waiting for the device (pinned host memory); padded
        to the run's one shape first when the blocks are compiled."""
        if self.static_shapes is not None and batch.filler_tokens is None:
            batch = self.static_shapes(batch)
        return batch.to(self.device, non_blocking=True)

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _all_reduce(self, t: torch.Tensor, view: str) -> None:
        group = self.mesh.group(view)
        if group is not None:
            dist.all_reduce(t, group=group)

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def _clip_grad_norm(self) -> torch.Tensor:
        return clip_gradients(self.model, self.optimizer, self.cfg.optim.grad_clip, self.device,
                              across=self.mesh.group("pp"))
