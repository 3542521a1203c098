"""A compiled run's kernels, built by a side process while the main one traces (`train.prewarm_kernels`).

Why: on a machine with empty caches, the first step of a compiled run builds moela's Triton / Gluon kernels (and
flash-attn-4's CuTe kernels where installed) only when each compiled block first runs them, after torch.compile
has traced and compiled that block: one after the other, on the critical path (bench/results/step_64k_dq_run44.md:
12.7 s of Triton builds in `small`'s cold first step, after 33 s of torch.compile). The kernels depend on the
model's shapes, dtypes and backends, not on the compiled graphs, so a second process can build them meanwhile: it
runs one eager forward and backward of a copy of the model cut to one block of each kind (the dense and the MoE
block, MTP as configured) on a padded batch of the run's micro-batch size, which fills the same on-disk caches
(`moela.ops.disk_caches`); the main process then loads each kernel instead of building it. Best effort: the side
process never touches the run's state, its failure changes only the wait, and its log is `prewarm.log` in the
run dir. It runs where building pays: a compiled run on CUDA, one side process per machine (local rank 0).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# launcher variables a side process must not see: it is not a rank of the run
_DISTRIBUTED_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                          "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def wanted(cfg, device_type: str, local_rank: int) -> bool:
    """Whether this process starts the side process: a compiled CUDA run, `train.prewarm_kernels` on, local rank
    0 (the kernel caches are shared by the machine's ranks)."""
    return bool(cfg.train.prewarm_kernels and cfg.train.compile and device_type == "cuda" and local_rank == 0)


def cut_overrides(model) -> list[str]:
    """Config overrides that cut `model` (a ModelConfig) to the block kinds the run compiles: its dense blocks
    (`first_k_dense_replace`) to one, if it has any, its MoE blocks to one; MTP as configured (compiled too)."""
    dense = 1 if model.first_k_dense_replace > 0 else 0
    moe = 1 if model.num_hidden_layers > model.first_k_dense_replace else 0
    return [f"model.num_hidden_layers={dense + moe}", f"model.first_k_dense_replace={dense}"]


def start(cfg, run_dir: Path, device_index: int, rank: int = 0) -> tuple[subprocess.Popen | None, str]:
    """Starts the side process for `cfg` on this process's CUDA device `device_index`: the run's config as written
    to run_dir/prewarm.yaml, cut by `cut_overrides`, its stdout and stderr to run_dir/prewarm.log (`-rank{rank}`
    added for a machine other than rank 0's). Returns (the process, a line for the log); (None, why) where it
    could not start, which the run survives."""
    from moela.config import dump_config

    tag = "" if rank == 0 else f"-rank{rank}"
    run_dir = Path(run_dir)
    config, log_path = run_dir / f"prewarm{tag}.yaml", run_dir / f"prewarm{tag}.log"
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARIABLES}
    env["CUDA_VISIBLE_DEVICES"] = _visible_device(device_index)
    args = [sys.executable, "-m", "moela.trainer.prewarm", str(config), *cut_overrides(cfg.model),
            "train.device=cuda"]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        config.write_text(dump_config(cfg))
        with open(log_path, "w") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    except OSError as e:
        return None, f"train.prewarm_kernels: no side process ({e}); the first step builds every kernel itself"
    return proc, (f"train.prewarm_kernels: a side process builds the first step's kernels meanwhile (pid "
                  f"{proc.pid}, log {log_path})")


def _visible_device(index: int) -> str:
    """The physical device of this process's CUDA device `index`, as CUDA_VISIBLE_DEVICES names it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return visible.split(",")[index].strip()
    return str(index)


def stop(proc: subprocess.Popen | None) -> None:
    """Ends the side process if it still runs (the run finished or failed first)."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


TOKENS = 16384  # the side batch's size at most: the kernels specialize on dtypes, head and model dims and on
# integer arguments' divisibility by 16, not on the token count, and a small batch keeps the side process's memory
# small beside the run's first step


def run(cfg) -> float:
    """One eager forward + backward of the model `cfg` describes on a padded batch of the run's micro-batch size
    (at most TOKENS; three documents, then filler, as the compiled run pads: `moela.batch.pad_batch`); returns the
    loss (the side process prints it: a finite number says the kernels ran)."""
    import torch

    from moela.batch import IGNORE_INDEX, PackedBatch, pad_batch
    from moela.model import build_model

    torch.manual_seed(cfg.train.seed)
    device = torch.device("cuda" if cfg.train.device == "auto" and torch.cuda.is_available() else
                          "cpu" if cfg.train.device == "auto" else cfg.train.device)
    model = build_model(cfg.model, device)
    tokens = min(cfg.train.tokens_per_microbatch, TOKENS)
    longest = min(cfg.data.max_doc_len or tokens, tokens)
    lengths = [min(longest, max(2, tokens // 4))] * 3
    ids = torch.randint(0, cfg.model.vocab_size, (sum(lengths),))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    labels = ids.roll(-1)
    labels[cu[1:].long() - 1] = IGNORE_INDEX  # a document's last token has no target
    positions = torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths])
    batch = PackedBatch(ids, labels, positions, cu, max(lengths), targets_on_host=int((labels != IGNORE_INDEX).sum()))
    batch = pad_batch(batch, tokens, longest).to(device)
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model(batch)
    out.loss.backward()
    return float(out.loss)  # waits for the device


def main(argv: list[str]) -> int:
    """`python -m moela.trainer.prewarm CONFIG.yaml [overrides]`: `run` on that config."""
    import time

    from moela.config import load_config

    t0 = time.perf_counter()
    loss = run(load_config(argv[0], argv[1:]))
    print(f"prewarm: the cut model's forward and backward ran (loss {loss:.4f}) in {time.perf_counter() - t0:.1f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
