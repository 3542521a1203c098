"""A profiling window of a training run (`logging.profile_steps: [first, last]`) and the communication breakdown
that `bench/scaling.py` shares.

Optimizer steps first..last (counted from 1, inclusive) run under torch.profiler (CPU activity, and CUDA on GPUs).
When the window closes every rank writes `run_dir/profile/rank{R}.json` (a Chrome trace for chrome://tracing or
Perfetto) and `rank{R}.txt` (ops sorted by device time, by CPU time on CPU; on GPUs also `rank{R}_cpu.txt`, sorted
by CPU time), and the trainer logs one record of kind `profile`: the window's wall time, the share of it in which
the GPU ran compute kernels (`busy`) and, per NCCL collective kind, its kernels' device time as a share of that
wall time (all-to-all = NCCL SendRecv/AllToAll kernels, AG all-gather, RS reduce-scatter, AR all-reduce; averaged
over ranks). Collective kernels can overlap compute, so a share is an upper bound on the exposed communication.
`busy` is the union of the non-NCCL kernels' intervals: the rest is GPU compute idle, waiting for the host or for
a collective. GPU-side user annotations (the device copies of `record_function` ranges, e.g.
`Optimizer.step#AdamW.step`) are ranges, not kernels: they are left out, since one can span idle time.
A window that a stop signal or an error interrupts is closed without output.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

COLLECTIVES = {"a2a": ("SendRecv", "AllToAll"), "AG": ("AllGather",), "RS": ("ReduceScatter",),
               "AR": ("AllReduce",)}


def collective_times(prof, averages=None) -> dict[str, float]:
    """Device microseconds per collective kind (keys of COLLECTIVES) from a finished torch.profiler run
    (`averages`: its `key_averages()` when the caller already has them)."""
    out = {k: 0.0 for k in COLLECTIVES}
    for event in averages if averages is not None else prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        key = event.key.lower()
        for kind, needles in COLLECTIVES.items():
            if "nccl" in key and any(n.lower() in key for n in needles):
                out[kind] += total
    return out


def compute_busy_us(prof) -> float:
    """Device microseconds covered by at least one non-NCCL GPU kernel (the union of their intervals) in a finished
    torch.profiler run; 0 without CUDA activity."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and "nccl" not in e.name.lower()
                   and not getattr(e, "is_user_annotation", False))
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


class StepProfiler:
    """Starts torch.profiler before step `first` and stops it after step `last` (see the module docstring)."""

    def __init__(self, window: list[int] | None, run_dir: Path, rank: int, cuda: bool):
        self.first, self.last = window if window else (0, -1)
        self.dir = Path(run_dir) / "profile"
        self.rank, self.cuda = rank, cuda
        self.prof = None
        self.steps, self.wall_s = 0, 0.0

    @property
    def active(self) -> bool:
        """Whether a window is open (its steps are being profiled)."""
        return self.prof is not None

    def before_step(self, step: int) -> None:
        """`step`: the number the coming optimizer step will have. Starts the window where it begins (or where a
        resumed run enters it)."""
        if self.prof is None and self.first <= step <= self.last:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = profile(activities=activities, record_shapes=False)
            self.prof.__enter__()
            self.steps, self.wall_s = 0, 0.0

    def after_step(self, step: int, wall_s: float) -> dict | None:
        """Counts the step; at the window's last step stops the profiler, writes this rank's files and returns
        {"first_step", "steps", "wall_s", "busy", "share_<kind>"...} (this rank's numbers), else None."""
        if self.prof is None:
            return None
        self.steps += 1
        self.wall_s += wall_s
        if step < self.last:
            return None
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.dir / f"rank{self.rank}.json"))
        averages = prof.key_averages()
        (self.dir / f"rank{self.rank}.txt").write_text(averages.table(
            sort_by="self_cuda_time_total" if self.cuda else "self_cpu_time_total", row_limit=40,
            max_name_column_width=70) + "\n")
        if self.cuda:  # where the host's time goes (a host-bound step leaves the GPU idle: see `busy`)
            (self.dir / f"rank{self.rank}_cpu.txt").write_text(averages.table(
                sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70) + "\n")
        comm = collective_times(prof, averages)
        wall = max(self.wall_s, 1e-9)
        return {"first_step": step - self.steps + 1, "steps": self.steps, "wall_s": self.wall_s,
                "busy": compute_busy_us(prof) / 1e6 / wall,
                **{f"share_{k}": comm[k] / 1e6 / wall for k in COLLECTIVES}}

    def close(self) -> None:
        """Stops an open window without output (a stop signal or an error inside it)."""
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.__exit__(None, None, None)


def profile_record(window: dict, step: int, device: torch.device, run_dir: Path) -> dict:
    """The profiling window's metrics record: wall time (slowest rank), compute-busy and collective shares (rank
    mean)."""
    shares = [k for k in window if k.startswith("share_") or k == "busy"]
    vals = torch.tensor([window[k] for k in shares] + [window["wall_s"]], dtype=torch.float64, device=device)
    if dist.is_initialized():
        wall = vals[-1:].clone()
        dist.all_reduce(vals)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        vals = torch.cat((vals[:-1] / dist.get_world_size(), wall))
    return {"kind": "profile", "step": step, "first_step": window["first_step"], "steps": window["steps"],
            "wall_s": float(vals[-1]), **{k: float(v) for k, v in zip(shares, vals[:-1].tolist())},
            "trace_dir": str(run_dir / "profile")}
