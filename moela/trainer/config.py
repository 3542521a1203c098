"""The recipe's training sections: `optim` (AdamW), `schedule` (learning rate), `train` (steps, batch shape,
device, precision), `checkpoint` and `logging` (step line, wandb, plot, profiler).

Each section is a plain dataclass; `moela.config` assembles them with the other sections into the recipe and
`moela.configlib` loads it. `validate()` returns messages `"<field>: <what is wrong>; <how to fix>"`; the loader
prefixes the section name. wandb is an optional extra (`moela[wandb]`): a recipe that logs to it without it
installed is a recipe error.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class OptimConfig:
    lr: float = 3e-4  # peak learning rate (reached at the end of warmup)
    weight_decay: float = 0.1  # decoupled AdamW decay; never applied to norms, biases, embeddings, router bias
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient L2 norm; 0 disables clipping (the norm is still logged)
    fused: bool = True  # use the fused CUDA AdamW kernel when training on CUDA (ignored on CPU)
    # storage of AdamW's two moments: float32 (torch's AdamW), or bfloat16 as DeepSeek-V3 trains (moela's AdamW,
    # moela.trainer.adamw_moments: 4 bytes less per parameter held, 8 less moved per step; needs beta2 <= 0.99)
    moment_dtype: Literal["float32", "bfloat16"] = "float32"

    def validate(self) -> list[str]:
        errors = []
        if self.lr <= 0:
            errors.append(f"lr: must be > 0, got {self.lr}; set a positive learning rate such as 3e-4")
        if self.weight_decay < 0:
            errors.append(f"weight_decay: must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                errors.append(f"{name}: must be in [0, 1), got {getattr(self, name)}")
        if self.eps <= 0:
            errors.append(f"eps: must be > 0, got {self.eps}")
        if self.grad_clip < 0:
            errors.append(f"grad_clip: must be >= 0 (0 disables clipping), got {self.grad_clip}")
        if self.moment_dtype == "bfloat16" and self.beta2 > 0.99:
            errors.append(f"moment_dtype: bfloat16 moments with beta2 {self.beta2} lose the second moment's updates "
                          f"(bf16 keeps 8 significant bits); use beta2 <= 0.99 (DeepSeek-V3: 0.95) or "
                          f"moment_dtype: float32")
        return errors


@dataclass
class ScheduleConfig:
    kind: Literal["cosine", "wsd", "constant"] = "cosine"  # cosine: warmup + cosine decay; wsd: warmup-stable-decay
    warmup_steps: int = 100  # linear warmup from 0 to optim.lr
    min_lr_ratio: float = 0.1  # final learning rate as a fraction of optim.lr (cosine and wsd)
    decay_fraction: float = 0.2  # wsd: fraction of train.steps spent in the final decay
    decay_shape: Literal["linear", "sqrt", "cosine"] = "sqrt"  # wsd: shape of the final decay (sqrt = 1 - sqrt)

    def validate(self) -> list[str]:
        errors = []
        if self.warmup_steps < 0:
            errors.append(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            errors.append(f"min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 < self.decay_fraction <= 1:
            errors.append(f"decay_fraction: must be in (0, 1], got {self.decay_fraction}")
        return errors


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps to train for
    tokens_per_microbatch: int = 4096  # token budget of one packed micro-batch (documents concatenated, no padding)
    grad_accum: int = 1  # micro-batches per optimizer step on each data-parallel rank
    seed: int = 0  # seeds model init, data order and every RNG (resume restores the RNG state)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available, else cpu
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on cuda, fp32 on cpu
    cpu_threads: int = 0  # torch intra-op threads on CPU (0: torch's default, one per core); 1 is fastest on a busy CPU
    eval_every: int = 100  # run the validation loop every N steps (0: only at the end)
    eval_batches: int = 0  # validation micro-batches per evaluation (0: the whole held-out split)
    max_nonfinite_steps: int = 5  # stop after this many consecutive skipped (non-finite loss or grad) steps
    # torch.compile each transformer block (attention + FFN + norms) and pad every micro-batch to
    # tokens_per_microbatch tokens, so the compiled blocks see one shape (moela.trainer.compile)
    compile: bool = False
    # capture forward + backward of a micro-batch as a CUDA graph after two optimizer steps and replay it:
    # the host launches one graph per micro-batch instead of every kernel (one GPU, no parallelism; pads
    # micro-batches like `compile` and to a fixed document count; moela.trainer.cuda_graphs)
    cuda_graphs: bool = False
    # documents per graphed micro-batch (0: max of 64, one per 128 tokens, twice the first micro-batch's); a
    # micro-batch with more runs eagerly, and the log says so
    graph_max_docs: int = 0
    # with `compile` on one GPU: a helper process builds moela's kernels into the disk caches while this one
    # compiles its blocks, so the first step finds them built (moela.trainer.prebuild; a failed helper's output
    # is kept as prebuild.log in the run dir)
    prebuild_kernels: bool = True
    run_dir: str = "runs/default"  # holds config.yaml, metrics.jsonl, checkpoints/ and loss.png
    # before the first CUDA allocation, train.py predicts this layout's memory per GPU (moela.plan): warn prints one
    # line when it comes near the device's, error also stops (exit 2) when it exceeds it clearly; never skips it
    plan_check: Literal["warn", "error", "never"] = "error"

    def validate(self) -> list[str]:
        errors = []
        if self.steps < 1:
            errors.append(f"steps: must be >= 1, got {self.steps}")
        if self.tokens_per_microbatch < 2:
            errors.append(f"tokens_per_microbatch: must be >= 2, got {self.tokens_per_microbatch}")
        if self.grad_accum < 1:
            errors.append(f"grad_accum: must be >= 1, got {self.grad_accum}")
        if self.eval_every < 0 or self.eval_batches < 0:
            errors.append("eval_every / eval_batches: must be >= 0 (0 means only at the end / all batches)")
        if self.cpu_threads < 0:
            errors.append(f"cpu_threads: must be >= 0 (0 = torch default), got {self.cpu_threads}")
        if self.graph_max_docs < 0:
            errors.append(f"graph_max_docs: must be >= 0 (0 = chosen from the first micro-batch), got "
                          f"{self.graph_max_docs}")
        if self.cuda_graphs and self.device == "cpu":
            errors.append("cuda_graphs: CUDA graphs need train.device=cuda (or auto on a GPU machine); set "
                          "train.cuda_graphs=false on the CPU")
        if self.max_nonfinite_steps < 1:
            errors.append(f"max_nonfinite_steps: must be >= 1, got {self.max_nonfinite_steps}")
        if not self.run_dir:
            errors.append("run_dir: must not be empty; name a directory such as runs/tiny")
        return errors


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps (0: only at the end and on SIGTERM/SIGINT)
    keep_last_k: int = 2  # complete checkpoints kept in run_dir/checkpoints (older ones are deleted)
    resume: str = "auto"  # auto: newest complete checkpoint in run_dir if any; none: start fresh; or a step-N path
    save_at_end: bool = True  # save a checkpoint after the last step
    # a fresh run (nothing to resume) starts from these weights with a new optimizer: hf:PATH (a Hugging Face
    # deepseek_v3 folder) or a checkpoint folder (step-N); null: random initialization
    init_from: str | None = None

    def validate(self) -> list[str]:
        errors = []
        if self.every < 0:
            errors.append(f"every: must be >= 0 (0 = only at the end), got {self.every}")
        if self.keep_last_k < 1:
            errors.append(f"keep_last_k: must be >= 1, got {self.keep_last_k}")
        if not self.resume:
            errors.append("resume: must be 'auto', 'none' or a checkpoint directory")
        if self.init_from in ("", "hf:"):
            errors.append(f"init_from: {self.init_from!r} names nothing; give hf:PATH, a step-N folder, or null")
        return errors


@dataclass
class WandbConfig:
    mode: Literal["disabled", "offline", "online"] = "disabled"  # offline writes run_dir/wandb for `wandb sync`
    project: str = "moela"
    entity: str | None = None
    name: str | None = None  # run name; defaults to the run directory's name
    tags: list[str] = field(default_factory=list)

    def validate(self) -> list[str]:
        if self.mode != "disabled" and importlib.util.find_spec("wandb") is None:
            return [f"mode: {self.mode!r} needs the wandb package, which is not installed; pip install "
                    f"'moela[wandb]', or set logging.wandb.mode: disabled"]
        return []


@dataclass
class LoggingConfig:
    log_every: int = 10  # print the step line and append to metrics.jsonl every N steps
    progress_bar: Literal["auto", "always", "never"] = "auto"  # auto: a tqdm bar when stdout is a terminal
    plot: bool = True  # write run_dir/loss.png at the end
    peak_tflops: float | None = None  # device peak (dense bf16, per device) for MFU; null: looked up by GPU name
    # [first, last]: profile these optimizer steps with torch.profiler (traces and op tables in run_dir/profile,
    # a `profile` record with the collectives' shares in metrics.jsonl); null: no profiling
    profile_steps: list[int] | None = None
    samples: int = 0  # print this many sampled continuations of sample_prompt at each evaluation (0: off)
    sample_prompt: str = "The"  # text the samples continue
    sample_tokens: int = 64  # tokens per sample
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def validate(self) -> list[str]:
        errors = []
        if self.log_every < 1:
            errors.append(f"log_every: must be >= 1, got {self.log_every}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            errors.append(f"peak_tflops: must be > 0 or null (look up by GPU name), got {self.peak_tflops}")
        p = self.profile_steps
        if p is not None and (len(p) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in p)
                              or not 1 <= p[0] <= p[1]):
            errors.append(f"profile_steps: must be [first, last] optimizer steps with 1 <= first <= last (e.g. "
                          f"[20, 22]) or null, got {p}")
        if self.samples < 0 or self.sample_tokens < 1:
            errors.append(f"samples / sample_tokens: need samples >= 0 (0: off) and sample_tokens >= 1, got "
                          f"{self.samples} / {self.sample_tokens}")
        return errors
