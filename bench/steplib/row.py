"""One row of `bench/step.py`, run in its own process: build the implementation, time its training step, profile
it, count its host syncs, and return the row as a dict (written as JSON for the parent).

Phases, in order (each step ends with a device synchronization outside what is measured):
1. build (model, optimizer; for moela the whole `Trainer`), then step 1 and step 2: the time to the end of step 1
   from process start (`MOELA_BENCH_T0`, set by the parent just before it starts this process) and from the model
   being built, and how much of it torch.compile spent compiling (`compile_seconds`); the loss of step 1 (before
   any update) for the loss check;
2. the remaining warm-up steps, then `steps` timed steps: tokens/s = tokens per step / median step time; MFU with
   the trainer's formula (`flops_per_token` at the token-weighted mean document length of the timed steps, over
   the device's bf16 peak from `moela.trainer.metrics`); then `steps` more in one window with a single
   synchronization at its end (tokens_per_s_window, mfu_window: the trainer's pace, where the host runs ahead of
   the device between logging steps; the timed steps above each wait for the device, so the host work between
   steps shows as idle GPU there); peak memory;
3. `profile_steps` steps under torch.profiler with CUDA activity only, for the GPU-busy share (the trainer's
   definition: the union of the kernels' intervals over the wall time; recording CPU ops too would slow the host
   and understate it for host-bound steps), then `profile_steps` more with CPU ops recorded, for the kernel-time
   breakdown by family (`kernels`: the launching op is part of a kernel's classification; a graphed row takes its
   breakdown from `profile_steps` more steps run eagerly on the graph's buffers, since a replay hides the ops);
4. `sync_steps` steps inside `SyncCounter` windows, after the counter proved on this device that it sees a
   deliberate `.item()` (the trace hooks it needs slow later steps, hence last);
Dynamo compilations after step 2 are counted over phases 2-4.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from bench.steplib.first_step import CompilerClock
from bench.steplib.host import host_ops, launches, most_launched
from bench.steplib.kernels import breakdown, device_kernels
from bench.steplib.measure import SyncCounter, compile_seconds, compiled_graphs, reported_syncs
from bench.steplib.source import PackedDocs
from moela.config import load_config
from moela.model import count_params, flops_per_token
from moela.trainer.metrics import device_peak_flops, memory_gib
from moela.trainer.profiling import compute_busy_us

T0_ENV = "MOELA_BENCH_T0"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(impl, device: torch.device):
    out = impl.step()
    _sync(device)
    return out


def _profiled(impl, device: torch.device, steps: int, with_cpu: bool):
    """`steps` steps under torch.profiler (CUDA activity, and CPU ops if `with_cpu`); returns (profiler, wall s)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if with_cpu else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            _step(impl, device)
        wall = time.perf_counter() - start
    return prof, wall


def run_row(spec: dict) -> dict:
    """`spec` (from `bench/step.py`): config, impl, recipe, device, recipe_path, overrides, rows, row_len,
    median_doc_len, warmup, steps, profile_steps, sync_steps. Kernel choices are recipe overrides
    (`model.kernels.<field>=...`)."""
    from bench.steplib.impls import build_impl

    t0 = float(os.environ.get(T0_ENV) or time.time())
    compiled_before, graphs_before = compile_seconds(), compiled_graphs()  # zero in the row's own process
    device = torch.device(spec["device"])
    cfg = load_config(spec["recipe_path"], spec["overrides"])
    source = PackedDocs(vocab_size=cfg.model.vocab_size, rows=spec["rows"], row_len=spec["row_len"],
                        grad_accum=cfg.train.grad_accum, seed=cfg.train.seed, median_len=spec["median_doc_len"],
                        max_doc_len=min(cfg.model.max_position_embeddings, spec["row_len"]))
    clock = CompilerClock()
    clock.install()
    impl = build_impl(spec["impl"], cfg, source, device)
    t_built = time.time()

    first_loss = float(_step(impl, device))
    t_first = time.time()
    first_compile_s = compile_seconds() - compiled_before  # the model build compiles nothing: all of it is step 1's
    first_graphs = compiled_graphs() - graphs_before
    first_compilers = clock.report()
    _step(impl, device)
    graphs_after_2 = compiled_graphs()
    for _ in range(max(spec["warmup"] - 2, 0)):
        _step(impl, device)
    source.reset_length_stats()
    first_record = len(getattr(impl, "records", ()))
    times = []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        _step(impl, device)
        times.append(time.perf_counter() - start)
    seq_len, mean_doc = source.token_weighted_doc_len(), source.mean_doc_len()
    # as many steps again, synchronized only after the last: the trainer's own pace, whose non-logging steps never
    # wait for the device, so the host prepares (and for a graphed row launches) step n+1 while step n runs
    start = time.perf_counter()
    for _ in range(spec["steps"]):
        impl.step()
    _sync(device)
    window_s = (time.perf_counter() - start) / spec["steps"]
    imbalance = impl.expert_imbalance(first_record) if hasattr(impl, "expert_imbalance") else []
    peak_gib = memory_gib(device)
    step_s = statistics.median(times)
    busy = busy_profiled = profiled_step_ms = None
    kernels, launched, host, frequent = {}, {}, [], []
    if device.type == "cuda" and spec["profile_steps"]:
        prof, wall = _profiled(impl, device, spec["profile_steps"], with_cpu=False)
        # the kernels' union over as many unprofiled (median) steps: the profiler's per-launch cost lengthens a
        # profiled step of a host-bound row, which would understate the share (kept as busy_profiled)
        union_s = compute_busy_us(prof) / 1e6
        busy = min(1.0, union_s / (spec["profile_steps"] * step_s))
        busy_profiled, profiled_step_ms = union_s / wall, 1e3 * wall / spec["profile_steps"]
        prof, _ = _profiled(impl, device, spec["profile_steps"], with_cpu=True)
        events = device_kernels(prof)
        kernels = breakdown(events, spec["profile_steps"])
        launched, host = launches(events, spec["profile_steps"]), host_ops(prof, spec["profile_steps"])
        frequent = most_launched(events, spec["profile_steps"])
        graphed = getattr(getattr(impl, "trainer", None), "graphed", None)
        if graphed is not None and graphed.graph is not None:
            # a replayed graph's kernels are launched by `cudaGraphLaunch`, which hides the ops that recorded them:
            # the breakdown comes from as many more steps that run the same work eagerly on the same buffers
            # (plus the gradient memset and add of an eager first micro-batch, which an assigning replay skips)
            graphed.eager_replay = True
            try:
                prof, _ = _profiled(impl, device, spec["profile_steps"], with_cpu=True)
            finally:
                graphed.eager_replay = False
            events = device_kernels(prof)  # (not captured, so the weight cache hits where a replay recomputes)
            kernels = breakdown(events, spec["profile_steps"])
            frequent = most_launched(events, spec["profile_steps"])

    syncs = warned = None
    check, witness = {}, "not counted on the CPU"
    if device.type == "cuda" and spec["sync_steps"]:
        counter = SyncCounter(cuda=True)
        check = counter.check(device)
        trainer = getattr(impl, "trainer", None)
        while trainer is not None and trainer.logs_at(trainer.step + 1):  # a logging step may read the device
            _step(impl, device)
        traced = warned = 0.0
        for _ in range(spec["sync_steps"]):
            with counter.window() as w:
                impl.step()
            _sync(device)
            traced, warned = traced + w.traced / spec["sync_steps"], warned + w.warned / spec["sync_steps"]
        syncs, witness = reported_syncs(check, traced, warned)

    tokens_per_s = source.tokens_per_step / step_s
    peak_flops = device_peak_flops(device, cfg.logging)
    flops_tok = flops_per_token(cfg.model, max(1, round(seq_len)))
    total, active = count_params(cfg.model)
    return {
        "config": spec["config"], "impl": spec["label"], "recipe": spec["recipe"],
        "tokens_per_s": tokens_per_s,
        "mfu": flops_tok * tokens_per_s / peak_flops if peak_flops else None,
        "tokens_per_s_window": source.tokens_per_step / window_s,
        "mfu_window": flops_tok * source.tokens_per_step / window_s / peak_flops if peak_flops else None,
        "busy": busy, "busy_profiled": busy_profiled, "profiled_step_ms": profiled_step_ms,
        "peak_gib": peak_gib, "host_syncs_per_step": syncs,
        "sync_debug_warnings_per_step": warned, "sync_counter_check": check, "sync_witness": witness,
        "first_step_s_from_start": t_first - t0, "first_step_s_from_built": t_first - t_built,
        "first_step_compile_s": first_compile_s,
        "first_step_graphs": first_graphs,
        "first_step_compilers": first_compilers,
        "recompiles_after_step2": compiled_graphs() - graphs_after_2,
        "first_step_loss": first_loss, "step_ms_median": 1e3 * step_s,
        "step_ms_min": 1e3 * min(times), "step_ms_max": 1e3 * max(times),
        "tokens_per_step": source.tokens_per_step, "grad_accum": cfg.train.grad_accum,
        "expert_imbalance": statistics.mean(imbalance) if imbalance else None,
        "expert_imbalance_range": [min(imbalance), max(imbalance)] if imbalance else None,
        "rows_x_row_len": [spec["rows"], spec["row_len"]], "doc_len_token_weighted": seq_len,
        "doc_len_mean": mean_doc, "doc_len_median_drawn": source.median_len, "doc_len_max": source.max_doc_len,
        "flops_per_token": flops_tok, "model_tflops": flops_tok * tokens_per_s / 1e12,
        "params": total, "active_params": active, "mtp_depth": cfg.model.num_nextn_predict_layers,
        "kernel_breakdown": kernels, "launches_per_step": launched, "most_launched": frequent,
        "host_top_ops": host, "notes": impl.notes,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
