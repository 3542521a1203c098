"""Each pipeline schedule's measured bubble share on CPU ranks (gloo), against its formula.

The real schedules (`moela.parallel.pp_schedules`), runtime (`PipelineRuntime`: action order, I/W split, sends
and receives) and transport (`StageLinks`) run one step of `--microbatches` micro-batches over `--pp` ranks; only
the compute is replaced by a fixed cost per layer: a stage's forward sleeps F, its backward's input part I and
its weight part W (separate autograd branches, so the input-gradient pass I of the zero-bubble schedules runs
only I). Each rank records the time inside those sleeps; bubble share = 1 - busy / (ranks x step wall time).
The formula column is the schedule's cost-model makespan (`simulate`, which the tests check against the closed
forms in `pp_schedules`' docstring) with the same costs. A W of this runtime walks the stage's graph again (its
docstring), so the measured zero-bubble rows pay I once more per backward: that shows here as extra bubble.

    python bench/pp_bubble.py            # writes bench/results/pp_bubble.md and .json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results_io import add_out_dir, write_results  # noqa: E402
from moela.parallel.pp_comm import StageLinks  # noqa: E402
from moela.parallel.pp_layout import stage_ranks  # noqa: E402
from moela.parallel.pp_runtime import PipelineRuntime  # noqa: E402
from moela.parallel.pp_schedules import SCHEDULES, schedule_actions, simulate  # noqa: E402
from moela.parallel.pp_stage import StageOutput  # noqa: E402
from moela.trainer.step_metrics import StepSums  # noqa: E402

WIDTH, TOKENS = 8, 16


class _Sleep(torch.autograd.Function):
    """Identity that sleeps `fwd` seconds forward and `bwd` backward, adding both to `busy`."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, busy):
        ctx.bwd, ctx.busy = bwd, busy
        _nap(fwd, busy)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _nap(ctx.bwd, ctx.busy)
        return grad, None, None, None


def _nap(seconds: float, busy: list[float]) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    busy[0] += time.perf_counter() - start


class FakeStage(nn.Module):
    """A stage of `layers` layers at fixed costs: output = x + 0 * w, the x path costing I, the w path W."""

    def __init__(self, index: int, num_stages: int, costs: dict, layers: int, busy: list[float]):
        super().__init__()
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.in_names = [] if self.is_first else ["h"]
        self.out_names = [] if self.is_last else ["h"]
        self.w = nn.Parameter(torch.zeros(WIDTH))
        self.costs, self.layers, self.busy = costs, layers, busy

    def forward(self, prep, inputs):
        c, n = self.costs, self.layers
        x = inputs[0] if inputs else torch.ones(TOKENS, WIDTH)
        h = _Sleep.apply(x, n * c["F"], n * c["I"], self.busy) + 0 * _Sleep.apply(self.w, 0.0, n * c["W"], self.busy)
        loss = h.sum() * 0 if self.is_last else torch.zeros(())
        return StageOutput([] if self.is_last else [h], loss, {"lm_loss": loss.detach()}, None)


def _rank(rank: int, world: int, store: str, schedule: str, v: int, m: int, costs: dict, layers: int, out: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    placement = stage_ranks(world, v, schedule)
    busy = [0.0]
    chunks = {k: FakeStage(k, len(placement), costs, layers, busy) for k, r in enumerate(placement) if r == rank}
    links = StageLinks(placement, [placement])
    prep = SimpleNamespace(ctx=SimpleNamespace(doc_ids=torch.zeros(TOKENS)), num_targets=1)
    model = SimpleNamespace(cfg=SimpleNamespace(hidden_size=WIDTH), prepare=lambda batch: prep)
    runtime = PipelineRuntime(model, chunks, len(placement), schedule_actions(schedule, world, m, v)[rank], links,
                              torch.device("cpu"))
    walls, shares = [], []
    for _ in range(3):
        busy[0] = 0.0
        dist.barrier()
        start = time.perf_counter()
        runtime.train_step([None] * m, 1.0, StepSums())
        dist.barrier()
        wall = time.perf_counter() - start
        total = torch.tensor([busy[0]], dtype=torch.float64)
        dist.all_reduce(total)
        walls.append(wall)
        shares.append(1 - float(total) / (world * wall))
    if rank == 0:
        Path(out).write_text(json.dumps({"wall_s": sorted(walls)[1], "bubble": sorted(shares)[1]}))
    dist.destroy_process_group()


def measure(schedule: str, pp: int, m: int, layer_ms: dict, layers_per_rank: int) -> dict:
    v = 1 if schedule == "1f1b" else 2
    costs = {k: layer_ms[k] / 1000 for k in ("F", "I", "W")}
    layers = layers_per_rank // v
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(_rank, args=(pp, os.path.join(tmp, "store"), schedule, v, m, costs, layers, out),
                           nprocs=pp, join=True, start_method="fork")
        got = json.loads(Path(out).read_text())
    chunk = {k: layers * costs[k] for k in ("F", "I", "W")}
    model = simulate(schedule_actions(schedule, pp, m, v), {**chunk, "B": chunk["I"] + chunk["W"]}, pp * v)
    return {"schedule": schedule, "pp": pp, "virtual_stages": v, "microbatches": m, **got,
            "formula_bubble": model["bubble"], "formula_wall_s": model["makespan"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--layers-per-rank", type=int, default=2)
    ap.add_argument("--layer-ms", default="F=5,I=5,W=5", help="per-layer costs in ms (forward, input grad, weight)")
    add_out_dir(ap)
    args = ap.parse_args()
    layer_ms = {k: float(v) for k, v in (p.split("=") for p in args.layer_ms.split(","))}
    rows = [measure(s, args.pp, args.microbatches, layer_ms, args.layers_per_rank) for s in SCHEDULES]
    lines = [f"{args.microbatches} micro-batches, {args.layers_per_rank} layers per rank, gloo on {args.pp} CPU "
             f"ranks, per-layer cost {args.layer_ms} ms (sleeps: fixed compute), median of 3 steps.", "",
             "| schedule | pp | chunks/rank | step wall (s) | formula wall (s) | bubble measured | bubble formula |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['pp']} | {r['virtual_stages']} | {r['wall_s']:.3f} | "
                     f"{r['formula_wall_s']:.3f} | {r['bubble']:.1%} | {r['formula_bubble']:.1%} |")
    print(write_results("pp_bubble", "Pipeline bubble share per schedule: measured vs formula", "\n".join(lines),
                        rows, out_dir=args.out_dir).read_text())


if __name__ == "__main__":
    main()
