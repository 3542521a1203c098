"""Held-out evaluation and sample generation for the `Trainer`: `evaluate(trainer)` (token-mean LM loss and
perplexity), `evaluate_and_log(trainer)` (which stops a run whose evaluation is not finite) and `print_samples`.

Under pipeline parallelism the held-out micro-batches run forward only through the stages
(`moela.trainer.pipeline_step`); sample generation needs the whole model in one process and is skipped.
"""

from __future__ import annotations

import math

import torch

from moela.trainer.errors import TrainingError
from moela.trainer.samples import format_samples, sample_texts


@torch.no_grad()
def evaluate(trainer) -> dict:
    """Token-mean LM loss and perplexity over the held-out split (or its first `train.eval_batches`)."""
    cfg = trainer.cfg
    trainer.model.eval()
    limit = cfg.train.eval_batches or None
    if trainer.pipeline is not None:
        batches = [b for i, b in zip(range(limit or len(trainer.val_loader)), trainer.val_loader)]
        sums = trainer.pipeline.evaluate(batches, trainer._autocast, trainer._to_device)
    else:
        sums = torch.zeros(2, dtype=torch.float64, device=trainer.device)  # [loss * targets, targets]
        for i, batch in enumerate(trainer.val_loader):
            if limit and i >= limit:
                break
            with trainer._autocast():
                out = trainer.model(trainer._to_device(batch))
            lm = out.metrics.get("lm_loss", out.loss)
            sums[0] += lm.double() * out.num_targets
            sums[1] += out.num_targets
    trainer._all_reduce(sums, "dp_cp")
    trainer.model.train()
    val_loss = float(sums[0] / sums[1].clamp_min(1))
    return {"kind": "eval", "step": trainer.step, "val_loss": val_loss,
            "val_ppl": math.exp(min(val_loss, 50.0)), "val_targets": int(sums[1])}


def evaluate_and_log(trainer) -> None:
    """Evaluate and log, unless there is no held-out split (data.val_fraction or data.val_max_tokens is 0): a
    non-finite result stops the run. Then print the samples `logging.samples` asks for."""
    if len(trainer.val_loader):  # the same on every rank
        trainer._settle()
        if trainer.graphed is not None:  # the graphs' memory goes to the evaluation (re-captured after)
            trainer.graphed.release()
        with trainer._oom("the evaluation"):
            record = evaluate(trainer)
        trainer.writer.log(record)
        if not math.isfinite(record["val_loss"]):
            raise TrainingError(
                f"the evaluation at step {trainer.step} gave val_loss={record['val_loss']}: the model's outputs on "
                f"the held-out split are not finite, so its weights are unusable and no checkpoint of them is "
                f"written. Resume from an earlier checkpoint (checkpoint.resume="
                f"{trainer.run_dir / 'checkpoints'}/step-N) with a lower optim.lr or a tighter optim.grad_clip")
    if trainer.cfg.logging.samples:
        with trainer._oom("the samples"):
            print_samples(trainer)


def print_samples(trainer) -> None:
    """`logging.samples` continuations of the sample prompt (all ranks generate in lockstep; rank 0 prints)."""
    for view, why in (("cp", "context parallelism"), ("pp", "pipeline parallelism")):
        if trainer.mesh.size(view) > 1:
            trainer.writer.echo(f"logging.samples: none under {why} (parallel.{view} > 1)")
            return
    with trainer._autocast():
        texts = sample_texts(trainer.model, trainer.tokenizer, trainer.cfg.logging,
                             trainer.cfg.train.seed + trainer.step)
    trainer.writer.echo(format_samples(texts, trainer.step, trainer.cfg.logging))
