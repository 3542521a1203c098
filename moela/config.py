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
from moela.ops.backends import moe_backend_problems
from moela.parallel.config import ParallelConfig, pipeline_errors, tensor_parallel_errors
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
        errors += [f"parallel.{e}" for e in pipeline_errors(self.parallel, self.model, self.train.grad_accum,
                                                            cuda_graphs=self.train.cuda_graphs)]
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
        """What a named fast MoE backend cannot run in this recipe (`moela.ops.backends.moe_backend_problems`),
        found before the first forward raises it from inside the model. What the machine lacks (a GPU, the
        deep_gemm package) is the trainer's check (`moela.trainer.device_checks`): a run's recipe stays loadable
        on another machine."""
        model = self.model
        return [f"model.moe_backend: {model.moe_backend!r} {problem}; or use auto (the fastest backend the run can "
                f"use, logged)" for problem in moe_backend_problems(model.moe_backend, model.expert_recipe,
                                                                     model.hidden_size, model.moe_intermediate_size)]


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Load a recipe (None: defaults only), apply `a.b=value` overrides, type and validate it.

    Raises ConfigError listing every problem found.
    """
    return load(Config, path, overrides, presets={"model": MODEL_PRESETS})


def dump_config(cfg: Config) -> str:
    """The resolved recipe as YAML; loading it back gives an equal Config."""
    return dump(cfg)
