"""bench/scaling.py's tables from its rows (all runs, bench/notes/scaling.jsonl): the current rows (the latest per
layout, GPU count and shape) for bench/results/scaling.json, and the markdown table for bench/results/scaling.md
(bench/scaling.py writes both).

- Efficiency vs 1 GPU: tok/s per GPU over the latest 1-GPU row of the same recipe, model size, tokens per GPU and
  document length (weak scaling: the same work per GPU).
- CP check: a row with context parallelism and one data rank (cp = GPUs) against the latest 1-GPU row with the
  same micro-batch (the same data and initial weights: micro-batch seed 1000 i + dp rank, and a CP group is one
  data rank): the first step's loss and gradient norm must agree within bf16 noise, relative CP_TOLERANCE.
"""

from __future__ import annotations

CP_TOLERANCE = 2e-2
SHARES = ("a2a", "AG", "RS", "AR", "ep")
# the pipeline rows (`bench/scaling.py --pipeline-set`, the runbook's `pp` stage), by GPU count: each schedule at
# 8 micro-batches a step, and DualPipeV against 1F1B with expert parallelism; listed as pending until a GPU runs them
PIPELINE_LAYOUTS = {
    2: ["pp=2,ep=1,pp_schedule=1f1b,train.grad_accum=8",
        "pp=2,ep=1,pp_schedule=zbv,pp_virtual_stages=2,train.grad_accum=8",
        "pp=2,ep=1,pp_schedule=dualpipev,pp_virtual_stages=2,train.grad_accum=8"],
    4: ["pp=4,ep=1,pp_schedule=1f1b,train.grad_accum=8",
        "pp=4,ep=1,pp_schedule=interleaved_1f1b,pp_virtual_stages=2,train.grad_accum=8",
        "pp=4,ep=1,pp_schedule=zbv,pp_virtual_stages=2,train.grad_accum=8",
        "pp=4,ep=1,pp_schedule=dualpipev,pp_virtual_stages=2,train.grad_accum=8",
        "pp=2,ep=2,pp_schedule=1f1b,train.grad_accum=8",
        "pp=2,ep=2,pp_schedule=dualpipev,pp_virtual_stages=2,train.grad_accum=8"],
}


def _name(row: dict) -> str:
    """The layout name; rows written before names existed (FSDP2 with `ep=N` and other parallel overrides) are
    named the same way from their overrides."""
    if "name" in row:
        return row["name"]
    items = [i for i in row["layout"].split(",") if i and i != "default"]
    ep = next((int(i.split("=")[1]) for i in items if i.startswith("ep=")), 1)
    name = "1gpu" if row["world"] == 1 else "fsdp2" + (f"+ep{ep}" if ep > 1 else "")
    return " ".join([name] + [i for i in items if not i.startswith("ep=")])


def _shape(row: dict) -> tuple:
    return row["recipe"], row["size"], row["tokens_per_gpu"], row["doc_len"]


def _is_baseline(row: dict) -> bool:
    return row["world"] == 1 and _name(row) == "1gpu"


def current_rows(rows: list[dict]) -> list[dict]:
    """The latest row of each (layout name, GPU count, shape, GPU type), in first-seen order."""
    latest: dict[tuple, dict] = {}
    for row in rows:
        latest[(_name(row), row["world"], _shape(row), row.get("gpu"))] = row
    return list(latest.values())


def cp_check(row: dict, rows: list[dict]) -> dict | None:
    """{"loss_rel", "gnorm_rel", "ok"} of a context-parallel row against its same-data 1-GPU row; None for other
    rows or without such a baseline."""
    if "+cp" not in _name(row) or row.get("dp") != 1:  # with several data ranks the data differ from one GPU's
        return None
    same = [r for r in rows if _is_baseline(r) and r.get("microbatch") == row["microbatch"]
            and (r["recipe"], r["size"], r["doc_len"], r.get("gpu")) == (row["recipe"], row["size"], row["doc_len"],
                                                                         row.get("gpu"))]
    if not same:
        return None
    base = same[-1]
    loss_rel = abs(row["loss1"] - base["loss1"]) / abs(base["loss1"])
    gnorm_rel = (abs(row["gnorm1"] - base["gnorm1"]) / abs(base["gnorm1"])
                 if "gnorm1" in row and "gnorm1" in base else None)
    ok = loss_rel <= CP_TOLERANCE and (gnorm_rel is None or gnorm_rel <= CP_TOLERANCE)
    return dict(loss_rel=loss_rel, gnorm_rel=gnorm_rel, ok=ok, baseline_date=base["date"])


def _efficiency(row: dict, rows: list[dict]) -> float | None:
    base = [r for r in rows if _is_baseline(r) and _shape(r) == _shape(row) and r.get("gpu") == row.get("gpu")]
    return row["tok_s_gpu"] / base[-1]["tok_s_gpu"] if base else None


def json_rows(rows: list[dict]) -> list[dict]:
    """The current rows with the issue's keys first (layout, gpus, tokens_per_s_per_gpu, mfu, efficiency_vs_1gpu)."""
    out = []
    for r in current_rows(rows):
        out.append(dict(layout=_name(r), gpus=r["world"], tokens_per_s_per_gpu=r["tok_s_gpu"], mfu=r["mfu"],
                        efficiency_vs_1gpu=_efficiency(r, rows), overrides=r["layout"], recipe=r["recipe"],
                        size=r["size"], microbatch=r.get("microbatch", r["tokens_per_gpu"]),
                        tokens_per_gpu=r["tokens_per_gpu"], doc_len=r["doc_len"], step_ms=r["step_ms"],
                        mem_gib=r["mem_gib"], busy=r.get("busy"),
                        shares={k: r[f"share_{k}"] for k in SHARES if f"share_{k}" in r},
                        loss1=r["loss1"], gnorm1=r.get("gnorm1"), cp_check=cp_check(r, rows),
                        ep_dispatch=r.get("ep_dispatch"), ep_chunks=r.get("ep_chunks"), link=r.get("link") or None,
                        gpu=r.get("gpu"), torch=r.get("torch"), triton=r.get("triton"), date=r["date"],
                        commit=r.get("commit"), command=r.get("command")))
    return out


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def render(rows: list[dict]) -> str:
    last = rows[-1]
    lines = [
        f"Latest row: {last['date']}; {last['gpu']}; torch {last['torch']}; triton {last.get('triton', '-')}. The "
        "latest row per layout, GPU count and shape (each row's date, GPU and versions: scaling.json; all runs: "
        "bench/notes/scaling.jsonl). One "
        "micro-batch per data rank per step, synthetic documents of the doc column's length; bf16 autocast, "
        + ("FSDP2 fp32 params (CPU smoke run)" if last["gpu"] == "cpu"
           else "FSDP2 bf16 params / fp32 reduce (unless the layout sets reduce_dtype)")
        + "; AdamW. Column meanings and command lines: `bench/scaling.py`; the whole set: "
        "`bench/multi_gpu_runbook.sh`.",
        "",
    ]
    links = {r["world"]: r for r in rows if r.get("link")}
    for world, r in sorted(links.items()):
        bw = ", ".join(f"{k} {v:,.0f} GB/s" for k, v in r["link"].items())
        lines.append(f"Link, {world} GPUs (NCCL bus bandwidth at 256 MiB, {r['date']}): {bw}.")
    if links:
        lines.append("")
    lines += ["| GPUs | layout | tokens/GPU | doc | step ms | tok/s/GPU | vs 1 GPU | MFU | mem/GPU GiB | busy | a2a "
              "| AG | RS | AR | ep | loss@1 | gnorm@1 |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    checks = []
    for r in sorted(current_rows(rows), key=lambda r: (_shape(r), r["world"], _name(r))):
        eff = _efficiency(r, rows)
        shares = " | ".join(_pct(r.get(f"share_{k}")) for k in SHARES)
        gnorm = f"{r['gnorm1']:.4f}" if "gnorm1" in r else "-"
        lines.append(f"| {r['world']} | {_name(r)} | {r['tokens_per_gpu']} | {r['doc_len']} | {r['step_ms']:.1f} | "
                     f"{r['tok_s_gpu']:,.0f} | {'-' if eff is None else f'{eff:.3f}'} | {100 * r['mfu']:.1f}% | "
                     f"{r['mem_gib']:.1f} | {_pct(r.get('busy'))} | {shares} | {r['loss1']:.4f} | {gnorm} |")
        check = cp_check(r, rows)
        if check is not None:
            gn = "-" if check["gnorm_rel"] is None else f"{check['gnorm_rel']:.2e}"
            checks.append(f"- CP check, {r['world']} GPUs `{_name(r)}` at {r['microbatch']} tokens: loss@1 differs "
                          f"from the 1-GPU run's by {check['loss_rel']:.2e}, gnorm@1 by {gn} (relative; tolerance "
                          f"{CP_TOLERANCE:g}): **{'ok' if check['ok'] else 'FAILED'}**.")
    if checks:
        lines += [""] + checks
    measured = {(r["world"], r["layout"]) for r in rows if r.get("gpu") != "cpu"}
    pending = [(world, layout) for world, layouts in sorted(PIPELINE_LAYOUTS.items()) for layout in layouts
               if (world, layout) not in measured]
    if pending:
        lines += ["", "Pending (pipeline parallelism; no GPU row yet: `RUNBOOK_STAGES=pp bench/multi_gpu_runbook.sh "
                  "OUT_DIR` on a 2- or 4-GPU machine):", ""]
        lines += [f"- {world} GPUs: `{layout}`" for world, layout in pending]
    return "\n".join(lines) + "\n"
