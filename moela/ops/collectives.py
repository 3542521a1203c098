"""The single-tensor collectives under the names of the running torch: torch >= 2.13 calls them
`all_gather_single` / `reduce_scatter_single` and deprecates `all_gather_into_tensor` / `reduce_scatter_tensor`;
the signatures are the same. One place for the shim, so every caller (QK-Norm, context and expert parallelism)
follows the same torch."""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
