"""Parallelism applied to the model from the outside: DeviceMesh, FSDP2, expert, context and tensor (+ sequence)
parallelism.

`apply_parallelism(model, mesh, cfg)` (`moela.parallel.apply`) is the one entry point the trainer calls.
Contract with the trainer: FSDP averages every gradient over the `dp_cp` ranks (see `moela.parallel.fsdp`), so the
trainer multiplies each rank's loss by `mesh.size("dp_cp")` after weighting micro-batches by their share of the
global step's labelled tokens; gradient clipping goes through `clip_grad_norm_` (gradients may live on several
meshes); the per-step expert load is summed with `reduce_expert_load` before `update_router_bias`. Under tensor
parallelism the ranks of a tp group share their micro-batches (they have the same `dp` rank) and return the same
loss, metrics and `num_targets`; only `reduce_expert_load` sums over them (each routes its own rows).

Everything but `ParallelConfig` is imported on first use, so that reading the `parallel` section of a recipe
(`moela.parallel.config`) imports no kernels.
"""

from importlib import import_module

from moela.parallel.config import ParallelConfig

_LAZY = {
    "ExpertParallelExperts": "moela.parallel.expert_parallel",
    "reduce_expert_load": "moela.parallel.expert_parallel",
    "apply_parallelism": "moela.parallel.apply",
    "clip_grad_norm_": "moela.parallel.fsdp",
    "clip_factor": "moela.parallel.fsdp",
    "ParallelMesh": "moela.parallel.mesh",
    "build_mesh": "moela.parallel.mesh",
}

__all__ = ["ExpertParallelExperts", "ParallelConfig", "ParallelMesh", "apply_parallelism", "build_mesh",
           "clip_factor", "clip_grad_norm_", "reduce_expert_load"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
