"""`bench/step.py`'s Markdown body under the header `bench/results_io.write_results` adds: for one run, the main
table, each config's moela-vs-peers ratios, the first-step loss check, the kernel breakdown by family, the largest
unclassified kernels and the rows that failed; for rows gathered from several runs (each with its `source`), one
section per run with its table and ratios."""

from __future__ import annotations

from bench.steplib.kernels import FAMILIES

PEERS = ("titan-compile", "titan-eager", "hf")
LOSS_IMPLS = ("moela", "moela-nographs", "moela-fp32-moments", "moela-nomtp", "moela-no-prebuild",
              *(f"moela-{phase}-{kernel}" for phase in ("fwd", "dq", "dkdv") for kernel in ("triton", "gluon"))) + PEERS


def peer_versions() -> str:
    """The peers' library versions (torch and triton are in the header)."""
    parts = []
    for name in ("transformers", "torchtitan"):
        try:
            from importlib.metadata import version

            parts.append(f"{name} {version(name)}")
        except Exception:  # not installed: the rows that need it say so
            parts.append(f"{name} -")
    return ", ".join(parts)


def _f(value, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, fmt)


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "error" not in r]


def _syncs(r: dict) -> str:
    """Reported count, with the sync-debug warning count beside it when it differs."""
    n, warned = r.get("host_syncs_per_step"), r.get("sync_debug_warnings_per_step")
    if n is None or warned is None or round(warned) == round(n):
        return _f(n, ".0f")
    return f"{n:.0f} ({warned:.0f} warned)"


def _main_table(rows: list[dict]) -> list[str]:
    out = ["| config | impl | recipe | tokens/s | MFU | tokens/s, MFU unsynced | GPU busy | peak GiB | "
           "host syncs / step | first step s (from start / built; compiling, graphs) | recompiles after step 2 | "
           "step ms (min-max) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['config']} | {r['impl']} | {r['recipe']} | failed: {r['error'][:200]} "
                       f"| | | | | | | | |")
            continue
        window = (f"{r['tokens_per_s_window']:,.0f}, {_f(r.get('mfu_window'), '.1%')}"
                  if r.get("tokens_per_s_window") else "-")
        out.append(
            f"| {r['config']} | {r['impl']} | {r['recipe']} | {r['tokens_per_s']:,.0f} | {_f(r['mfu'], '.1%')} | "
            f"{window} | "
            f"{_f(r['busy'], '.0%')} | {r['peak_gib']:.1f} | {_syncs(r)} | "
            f"{r['first_step_s_from_start']:.0f} / {r['first_step_s_from_built']:.0f}{_compiling(r)} | "
            f"{r['recompiles_after_step2']} | {r['step_ms_median']:.0f} ({r['step_ms_min']:.0f}-"
            f"{r['step_ms_max']:.0f}) |")
    return out


def _compiling(r: dict) -> str:
    """'; N' seconds of the first step spent in torch.compile (', G graphs' it compiled), where the row recorded
    them."""
    if r.get("first_step_compile_s") is None:
        return ""
    graphs = f", {r['first_step_graphs']}" if r.get("first_step_graphs") is not None else ""
    return f"; {r['first_step_compile_s']:.0f}{graphs}"


def _ratios(rows: list[dict]) -> list[str]:
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = {r["impl"]: r for r in _ok(rows) if r["config"] == config and r["recipe"] == "bf16"}
        ours = mine.get("moela-nomtp") or mine.get("moela")
        if ours is None:
            continue
        peers = {p: mine[p]["tokens_per_s"] for p in PEERS if p in mine}
        if not peers:
            continue
        text = ", ".join(f"{ours['tokens_per_s'] / v:.2f}x {p}{_window_ratio(ours, mine[p])}"
                         for p, v in peers.items())
        titan = [p for p in ("titan-compile", "titan-eager") if p in mine]
        mem = ""
        if titan:
            best = max(titan, key=lambda p: mine[p]["tokens_per_s"])
            mem = f"; peak memory {ours['peak_gib']:.1f} GiB vs {best} {mine[best]['peak_gib']:.1f} GiB"
        out.append(f"- {config}: {ours['impl']} (bf16) is {text}{mem}")
    return out


def _window_ratio(ours: dict, peer: dict) -> str:
    """The same ratio at the trainer's pace (the unsynced windows), where both rows have one."""
    if ours.get("tokens_per_s_window") and peer.get("tokens_per_s_window"):
        return f" (unsynced {ours['tokens_per_s_window'] / peer['tokens_per_s_window']:.2f}x)"
    return ""


def _loss_table(rows: list[dict]) -> list[str]:
    """One column per implementation that ran (bf16), in LOSS_IMPLS order."""
    ran = {r["impl"] for r in _ok(rows) if r["recipe"] == "bf16"}
    impls = [i for i in LOSS_IMPLS if i in ran]
    out = ["| config | " + " | ".join(impls) + " |", "| --- |" + " --- |" * len(impls)]
    for config in dict.fromkeys(r["config"] for r in rows):
        got = {r["impl"]: r["first_step_loss"] for r in _ok(rows) if r["config"] == config and r["recipe"] == "bf16"}
        if got:
            out.append(f"| {config} | " + " | ".join(_f(got.get(i), ".4f") for i in impls) + " |")
    return out


def _breakdown_table(rows: list[dict]) -> list[str]:
    shown = [f for f in FAMILIES if any(r.get("kernel_breakdown", {}).get(f, {}).get("share", 0) > 0
                                        for r in _ok(rows))]
    out = ["| config | impl | recipe | kernel ms / step | " + " | ".join(shown) + " |",
           "| --- | --- | --- | --- |" + " --- |" * len(shown)]
    for r in _ok(rows):
        b = r.get("kernel_breakdown") or {}
        if not b:
            continue
        total = sum(v["ms_per_step"] for v in b.values())
        out.append(f"| {r['config']} | {r['impl']} | {r['recipe']} | {total:.0f} | "
                   + " | ".join(f"{100 * b[f]['share']:.0f}%" for f in shown) + " |")
    return out


def _other_kernels(rows: list[dict]) -> list[str]:
    out = []
    for r in _ok(rows):
        other = (r.get("kernel_breakdown") or {}).get("other")
        if other and other["share"] > 0.01:
            names = "; ".join(f"`{n}` {ms:.2f} ms" for n, ms in other["top"][:4])
            out.append(f"- {r['config']} {r['impl']} {r['recipe']} ({100 * other['share']:.0f}%): {names}")
    return out


def _launch_table(rows: list[dict]) -> list[str]:
    shown = [f for f in FAMILIES if any((r.get("launches_per_step") or {}).get(f, 0) > 0 for r in _ok(rows))]
    out = ["| config | impl | recipe | GPU busy | launches / step | " + " | ".join(shown) + " |",
           "| --- | --- | --- | --- | --- |" + " --- |" * len(shown)]
    for r in _ok(rows):
        n = r.get("launches_per_step") or {}
        if n:
            out.append(f"| {r['config']} | {r['impl']} | {r['recipe']} | {_f(r.get('busy'), '.0%')} | "
                       f"{n['total']:,.0f} | " + " | ".join(f"{n.get(f, 0):,.0f}" for f in shown) + " |")
    return out


def _most_launched(rows: list[dict], top: int = 8) -> list[str]:
    out = []
    for r in _ok(rows):
        ker = r.get("most_launched") or []
        if ker:
            names = "; ".join(f"`{k[0][:70]}` ({k[1]}) {k[2]:,.0f} x {k[3]:.1f} us"
                              + (f" < {k[4][0][:60]}" if len(k) > 4 and k[4] and k[4][0] else "") for k in ker[:top])
            out.append(f"- {r['config']} {r['impl']} {r['recipe']}: {names}")
    return out


def _host_ops(rows: list[dict], top: int = 6) -> list[str]:
    out = []
    for r in _ok(rows):
        ops = r.get("host_top_ops") or []
        if ops:
            names = "; ".join(f"`{n}` {ms:.1f} ms ({calls:,.0f} calls)" for n, ms, calls in ops[:top])
            out.append(f"- {r['config']} {r['impl']} {r['recipe']}: {names}")
    return out


def _display_order(rows: list[dict]) -> list[dict]:
    """Config by config (in run order), then moela, its variants (LOSS_IMPLS order) and the peers, bf16 before
    fp8."""
    configs = list(dict.fromkeys(r["config"] for r in rows))
    impl_rank = {impl: i for i, impl in enumerate(LOSS_IMPLS)}
    return sorted(rows, key=lambda r: (configs.index(r["config"]), impl_rank.get(r["impl"], len(impl_rank)),
                                       r["recipe"] != "bf16"))


def devices(rows: list[dict]) -> str:
    """The devices the rows ran on, for the header (the rows ran in child processes); empty when none ran."""
    return ", ".join(sorted({r["device_name"] for r in _ok(rows)}))


def render(rows: list[dict], *, counts: dict) -> str:
    """The body for the rows of one run."""
    rows = _display_order(rows)
    docs = [r for r in _ok(rows) if "doc_len_mean" in r]
    doc_text = (f", median {docs[0]['doc_len_median_drawn']} before the cuts at {docs[0]['doc_len_max']} and at "
                f"the row end; timed steps: mean document {docs[0]['doc_len_mean']:,.0f} tokens, token-weighted "
                f"mean {docs[0]['doc_len_token_weighted']:,.0f}" if docs else "")
    lines = [f"Peers: {peer_versions()}.", "",
             f"Per row: {counts['warmup']} warm-up steps (steps 1-2 included), the median of {counts['steps']} "
             f"timed steps (each waits for the device; \"unsynced\": as many more steps timed together, "
             f"synchronized once at the end, the trainer's pace), {counts['profile_steps']} step(s) profiled for "
             f"GPU busy (CUDA activity only; busy = the "
             f"union of the kernels' intervals over as many median timed steps, since profiling lengthens a "
             f"host-bound step) and "
             f"{counts['profile_steps']} more for the kernel breakdown (with CPU ops), {counts['sync_steps']} "
             f"step(s) counted for host syncs; one process per row. Tokens: synthetic packed documents (lognormal "
             f"lengths{doc_text}), the same for every row of a config. MFU = flops_per_token x tokens/s / bf16 "
             f"peak (the trainer's formula). The peers and "
             f"moela-nomtp run MTP off. A graphed row's kernel breakdown comes from steps that run the captured "
             f"work eagerly on the graph's buffers (a replay hides the ops that launched its kernels); those steps "
             f"also zero the gradients and add the first micro-batch's into them, which a `moela` replay does not "
             f"(it assigns them): the breakdown of `moela` holds that memset and fp32 add, its tokens/s do not.",
             ""]
    lines += _main_table(rows)
    ratios = _ratios(rows)
    if ratios:
        lines += ["", "## moela against the peers (tokens/s ratios, MTP off, bf16)", ""] + ratios
    lines += ["", "## Loss check: first-step LM loss, same weights and tokens", "",
              "Same function, so equal up to bf16 noise (moela keeps fp32 weights under bf16 autocast; the peers "
              "hold bf16 weights).", ""] + _loss_table(rows)
    breakdown = _breakdown_table(rows)
    if len(breakdown) > 2:
        lines += ["", "## Kernel time by family (share of the profiled steps' kernel time)", ""] + breakdown
    other = _other_kernels(rows)
    if other:
        lines += ["", "## Largest unclassified kernels (`other`)", ""] + other
    launched = _launch_table(rows)
    if len(launched) > 2:
        lines += ["", "## Host side: device launches per step by family, and the CPU ops with the most self time",
                  "", "Per step of the profiled run with CPU ops (`bench/steplib/host.py`; the profiler inflates "
                  "host times: compare rows).", ""] + launched + [""] + _host_ops(rows)
    frequent = _most_launched(rows)
    if frequent:
        lines += ["", "## Kernels launched most often per step (name, family, launches x device time each)", ""
                  ] + frequent
    compilers = _first_step_compilers(rows)
    if compilers:
        lines += ["", "## First step: the compilers it ran (seconds, calls)", "",
                  "Each timed where it is called (`bench/steplib/first_step.py`); torch.compile's phases are nested "
                  "(a phase includes those it calls), the autotuner's seconds include the JIT compiles it "
                  "triggers.", ""] + compilers
    checked = [r for r in _ok(rows) if r.get("sync_counter_check")]
    if checked:
        odd = [r for r in checked if r["sync_witness"] != "trace"]
        lines += ["", "## Host-sync counter", "",
                  f"Before counting, each row checked on the device that the counter sees a deliberate `.item()` "
                  f"and a `torch.cuda.synchronize()`: {len(checked) - len(odd)} of {len(checked)} rows counted by "
                  f"the CUDA trace hooks."] + [
                  f"- {r['config']} {r['impl']} {r['recipe']}: {r['sync_witness']} (check {r['sync_counter_check']})"
                  for r in odd]
    loads = [r for r in _ok(rows) if r.get("expert_imbalance") is not None]
    if loads:
        lines += ["", "## Expert load in the timed steps", "",
                  "The trainer's `expert_imbalance`: the most loaded expert's tokens over the mean, averaged over the "
                  "MoE layers (1.0 = balanced); the mean over the timed steps (min-max). A weight-gradient tile "
                  "takes as long as its expert's rows, so a skewed load slows the k-grouped GEMM "
                  "(bench/notes/decisions.md).", ""] + [
                  f"- {r['config']} {r['impl']} {r['recipe']}: {r['expert_imbalance']:.2f} "
                  f"({r['expert_imbalance_range'][0]:.2f}-{r['expert_imbalance_range'][1]:.2f})" for r in loads]
    walls = [r["row_wall_s"] for r in rows if "row_wall_s" in r]
    if walls:
        lines += ["", f"{len(walls)} rows ran in {sum(walls):.0f} s (slowest {max(walls):.0f} s)."]
    notes = sorted({f"{r['impl']}: {n}" for r in _ok(rows) for n in r.get("notes", [])})
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _first_step_compilers(rows: list[dict]) -> list[str]:
    out = []
    for r in _ok(rows):
        got = r.get("first_step_compilers")
        if not got:
            continue
        own = "; ".join(f"{name} {v[0]:.1f} s ({v[1]})" for name, v in got.items() if name != "torch.compile phases")
        phases = "; ".join(f"`{name}` {s:.1f} s ({n})" for name, (s, n) in got.get("torch.compile phases", {}).items())
        out.append(f"- {r['config']} {r['impl']} {r['recipe']}: {own or 'no kernel compiles outside torch.compile'}"
                   f"; torch.compile phases: {phases or '-'}")
    return out


def _joined(rows: list[dict], key: str) -> str:
    return ", ".join(sorted({str(r["source"].get(key) or "-") for r in rows}))


def sourced_versions(rows: list[dict]) -> dict:
    """The header's torch and triton versions for rows gathered from several runs: those their sources name."""
    return {"torch": _joined(rows, "torch"), "triton": _joined(rows, "triton")}


def _kept(command: str, run: list[dict]) -> str:
    """' (impl A only)' where the run's command named implementations whose rows were not kept."""
    named = command.split("--impls ")[1].split()[0].split(",") if "--impls " in command else []
    kept = list(dict.fromkeys(r["impl"] for r in run))
    return f" (impl {', '.join(kept)} only)" if set(named) - set(kept) else ""


def render_sourced(rows: list[dict]) -> str:
    """The body for rows gathered from several runs, each row's `source` naming its run (`what`, `date`, `commit`,
    `command`, the versions): one section per run, in the rows' order, with its main table and ratios."""
    runs: dict[tuple, list[dict]] = {}
    for r in rows:
        s = r["source"]
        runs.setdefault((s["what"], s["date"], s["commit"], s["command"]), []).append(r)
    lines = [f"Libraries: {_joined(rows, 'libraries')}. The current best rows of the runs below, one row per (config, "
             "impl, recipe) as that run wrote it (each row of step.json keeps its run's date, commit, command and "
             "versions under `source`); rows of different runs differ by a few percent from machine to machine, so "
             "compare rows of one run. Regenerate in one process tree with:", "",
             "`python bench/step.py --device cuda --steps 30 --configs small-32k,small-64k,v2lite6-64k "
             "--impls moela,moela-nomtp,titan-compile,hf --recipes bf16,fp8_blockwise`", "",
             "Per row: the median of the timed steps (each waits for the device; \"unsynced\": as many more steps "
             "timed together, synchronized once at the end, the trainer's pace); MFU = flops_per_token x tokens/s / "
             "bf16 peak (the trainer's formula); synthetic packed documents (lognormal lengths, median 2048 before "
             "the cuts at 4096), the same for every row of a config. The peers and moela-nomtp run MTP off."]
    for (what, date, commit, command), run in runs.items():
        lines += ["", f"## {what}", "", f"{date}, commit {commit}: `{command}`{_kept(command, run)}", ""]
        lines += _main_table(run)
        ratios = _ratios(run)
        if ratios:
            lines += [""] + ratios
    return "\n".join(lines) + "\n"
