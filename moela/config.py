"""The recipe: its sections, each defined beside the part it configures, assembled into `Config` and loaded by
the generic strict YAML loader (`moela.configlib`).

A recipe is a YAML mapping whose top-level keys are the sections of `Config`: `model` (`moela.model.config`),
`data` (`moela.data.config`), `optim`, `schedule`, `train`, `checkpoint`, `logging` (`moela.trainer.config`) and
`parallel` (`moela.parallel.config`). `model` is a preset section: it starts from `PRESETS[model.size]` (see
`moela.model.config.MODEL_PRESETS`). Loading a recipe imports no kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moela.configlib import OVERRIDE_SOURCE, ConfigError, dump, load, parse_override, to_dict
from moela.data.config import DataConfig
from moela.model.config import MODEL_PRESETS, ModelConfig
from moela.parallel.config import ParallelConfig, tensor_parallel_errors
from moela.trainer.config import CheckpointConfig, LoggingConfig, OptimConfig, ScheduleConfig, TrainConfig, WandbConfig

__all__ = ["OVERRIDE_SOURCE", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "LoggingConfig",
           "ModelConfig", "OptimConfig", "ParallelConfig", "ScheduleConfig", "TrainConfig", "WandbConfig",
           "dump_config", "load_config", "parse_override", "to_dict"]


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self) -> list[str]:
        """Checks that span sections (each section validates its own fields)."""
        errors = []
        if self.parallel.ep > 1 and self.model.n_routed_experts % self.parallel.ep:
            errors.append(f"parallel.ep: {self.parallel.ep} does not divide model.n_routed_experts="
                          f"{self.model.n_routed_experts}; pick an ep that divides the expert count")
        if self.parallel.tp > 1:
            errors += tensor_parallel_errors(self.model, self.parallel.tp)
        if self.train.compile and (self.parallel.cp > 1 or self.parallel.tp > 1):
            errors.append("train.compile: pads every micro-batch to one shape, which context and tensor parallelism "
                          "do not split yet; set train.compile: false with parallel.cp > 1 or parallel.tp > 1")
        if self.parallel.fal_streams and self.model.block != "fal":
            errors.append(f"parallel.fal_streams: runs the MLP of FAL blocks beside their attention, but model.block "
                          f"is {self.model.block!r}; set model.block: fal or fal_streams: false")
        if self.parallel.fal_streams and self.train.device == "cpu":
            errors.append("parallel.fal_streams: needs a CUDA device (a second CUDA stream); set it to false with "
                          "train.device: cpu")
        return errors + self._moe_backend_errors()

    def _moe_backend_errors(self) -> list[str]:
        """What a named fast MoE backend (`moela.ops.moe.providers`) cannot run in this recipe, found before the
        first forward raises it from inside the model: each needs hidden_size and moe_intermediate_size multiples of
        128; `torch` runs bf16 experts only, `cublas` FP8 only. What the machine lacks (a GPU, the deep_gemm
        package) is the trainer's check (`moela.trainer.loop.check_backends`): a run's recipe stays loadable
        on another machine."""
        name, model = self.model.moe_backend, self.model
        if name in ("auto", "reference"):
            return []
        errors = []
        if model.hidden_size % 128 or model.moe_intermediate_size % 128:
            errors.append(f"model.moe_backend: {name!r} needs hidden_size and moe_intermediate_size multiples of "
                          f"128, got {model.hidden_size} and {model.moe_intermediate_size}; use auto (the fastest "
                          f"backend the run can use, logged) or reference")
        if name == "torch" and model.expert_recipe != "bf16":
            errors.append("model.moe_backend: 'torch' (torch._grouped_mm) runs bf16 experts only, and the recipe asks "
                          "for FP8 experts; use triton or auto")
        if name == "cublas" and model.expert_recipe == "bf16":
            errors.append("model.moe_backend: 'cublas' (blockwise FP8 torch._scaled_mm) runs FP8 experts only; set "
                          "model.precision: fp8_experts, or use torch, triton or auto for bf16 experts")
        return errors


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Load a recipe (None: defaults only), apply `a.b=value` overrides, type and validate it.

    Raises ConfigError listing every problem found.
    """
    return load(Config, path, overrides, presets={"model": MODEL_PRESETS})


def dump_config(cfg: Config) -> str:
    """The resolved recipe as YAML; loading it back gives an equal Config."""
    return dump(cfg)
