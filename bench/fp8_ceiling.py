"""What the FP8 step targets ask of the GEMMs: a breakdown of measured bf16 and FP8 step rows (bench/step.py's JSON,
whose `results` are the rows; rows gathered from several runs are taken run by run, by their `source`) into the
time FP8 can act on and the time it cannot, and the GEMM speed-up a target needs.

Per config, from the bf16 row's kernel breakdown (ms per step):
- eligible: the GEMMs DeepSeek-V3's recipe runs in FP8: the expert GEMMs, and the dense GEMMs other than the
  output head (the head's GEMMs are the ones launched under `_ChunkedLinearCE`; the embedding, head, router, norms
  and attention core stay bf16, as the issue says). The head is found among the breakdown's listed kernels (the
  top 12 of the family); any dense GEMM outside that list, and the router's small float32 GEMM, count as eligible,
  which errs in the target's favour (a larger eligible time needs a smaller speed-up);
- the FP8 rows' added quantization work, measured: the growth of the norm/RoPE/activation (the FP8 SwiGLU that
  also quantizes) and copies/cat/casts (activation and weight quantization) families, and of the optimizer
  family (the weights' quantized copies), against the bf16 row;
- the needed GEMM speed-up s: the step-time target T_bf16 / target must come from the eligible time alone,
  eligible x (1 - 1/s) = T_bf16 - T_bf16 / target + overhead, with the step's non-kernel time unchanged;
- the ceiling: the step at s = 2, the H200's FP8 peak over its bf16 peak (1,979 / 989 TFLOP/s dense), with the
  measured overhead, and with the experts alone (what `moe_recipe: fp8_blockwise` runs).

Usage: python bench/fp8_ceiling.py [STEP.json ...] [--targets small-64k=1.1,v2lite6-64k=1.25]
Runs anywhere (it reads JSON only). Writes bench/results/fp8_ceiling.md and fp8_ceiling.json (`--out-dir`
elsewhere), headed by the rows' device (and torch / triton where their sources name them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.results_io import RESULTS, add_out_dir, write_results  # noqa: E402

PEAK_RATIO = 2.0  # H200 dense FP8 / bf16 tensor-core peak
OVERHEAD_FAMILIES = ("norm/RoPE/activation", "copies/cat/casts", "optimizer")


def head_ms(row: dict) -> float:
    """The output head's GEMM time: dense GEMM kernels launched under the chunked linear cross-entropy."""
    d = row["kernel_breakdown"]["dense GEMM"]
    return sum(ms for (_, ms), ctx in zip(d["top"], d.get("top_context", [])) if "LinearCE" in ctx)


def family(row: dict, name: str) -> float:
    return row["kernel_breakdown"][name]["ms_per_step"]


def analyse(bf16: dict, fp8_rows: list[dict], target: float | None) -> tuple[list[str], dict]:
    """(Markdown lines, the same numbers as a dict) for one config's bf16 row and its FP8 rows."""
    step = bf16["step_ms_median"]
    kernel = sum(v["ms_per_step"] for v in bf16["kernel_breakdown"].values())
    expert = family(bf16, "expert GEMM")
    head = head_ms(bf16)
    dense_rest = family(bf16, "dense GEMM") - head
    rest = kernel - expert - family(bf16, "dense GEMM") - family(bf16, "attention")
    lines = [f"### {bf16['config']}", "",
             f"bf16 row: step {step:.1f} ms (median), kernel time {kernel:.1f} ms: expert GEMMs {expert:.1f}, "
             f"dense GEMMs {family(bf16, 'dense GEMM'):.1f} of which the output head {head:.1f} (stays bf16), "
             f"attention {family(bf16, 'attention'):.1f}, the rest {rest:.1f}.",
             "",
             "| row | step ms | vs bf16 | expert GEMM ms | dense GEMM ms (head) | added quantization work ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: |",
             f"| bf16 | {step:.1f} | 1.000x | {expert:.1f} | {family(bf16, 'dense GEMM'):.1f} ({head:.1f}) | - |"]
    overheads = {}
    summary = dict(config=bf16["config"], step_ms=step, kernel_ms=kernel, expert_gemm_ms=expert, head_ms=head,
                   dense_gemm_ms=family(bf16, "dense GEMM"), attention_ms=family(bf16, "attention"), rows=[],
                   ceilings={})
    for r in fp8_rows:
        over = sum(max(0.0, family(r, f) - family(bf16, f)) for f in OVERHEAD_FAMILIES)
        overheads[r["recipe"]] = over
        summary["rows"].append(dict(recipe=r["recipe"], step_ms=r["step_ms_median"],
                                    expert_gemm_ms=family(r, "expert GEMM"), quantization_ms=over))
        lines.append(f"| {r['recipe']} | {r['step_ms_median']:.1f} | {step / r['step_ms_median']:.3f}x | "
                     f"{family(r, 'expert GEMM'):.1f} ({expert / family(r, 'expert GEMM'):.2f}x) | "
                     f"{family(r, 'dense GEMM'):.1f} ({head_ms(r):.1f}) | {over:.1f} |")
    lines.append("")
    over_experts = overheads.get("fp8_blockwise", 0.0)
    over_all = overheads.get("fp8", over_experts)
    for label, eligible, over in (("experts only (`moe_recipe: fp8_blockwise`)", expert, over_experts),
                                  ("experts and every dense GEMM but the head (`precision: fp8`)",
                                   expert + dense_rest, over_all)):
        ceiling = step / (step - eligible * (1 - 1 / PEAK_RATIO) + over)
        summary["ceilings"][label] = ceiling
        text = (f"- {label}: eligible {eligible:.1f} ms of the step; at FP8 = {PEAK_RATIO:g}x bf16 with the "
                f"measured {over:.1f} ms of quantization work the step could reach {ceiling:.3f}x")
        if target:
            need = step - step / target + over
            s = float("inf") if need >= eligible else 1 / (1 - need / eligible)
            text += (f"; the {target:g}x target needs {need:.1f} ms saved, i.e. those GEMMs "
                     + (f"{s:.2f}x faster than bf16" if s != float("inf") else "faster than infinitely fast")
                     + (" (beyond the hardware's 2x)" if s > PEAK_RATIO else ""))
        lines.append(text + ".")
    lines.append("")
    return lines, summary


def _run(row: dict) -> tuple:
    """The run a row came from: (date, commit, command) of its `source`, or () for the rows of a single run."""
    s = row.get("source")
    return (s["date"], s["commit"], s["command"]) if s else ()


def _versions(rows: list[dict]) -> dict:
    """torch and triton as the rows' sources name them (the header's, else this process's)."""
    if not rows or not all("torch" in r.get("source", {}) for r in rows):
        return {}
    return {key: ", ".join(sorted({r["source"][key] for r in rows})) for key in ("torch", "triton")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="*", default=[str((RESULTS / "step.json").relative_to(RESULTS.parents[1]))])
    ap.add_argument("--targets", default="small-64k=1.1,v2lite6-64k=1.25")
    add_out_dir(ap)
    args = ap.parse_args()
    targets = {k: float(v) for k, v in (t.split("=") for t in args.targets.split(",") if t)}
    lines, summaries, used = [], [], []
    for path in args.json:
        data = json.loads(Path(path).read_text())
        rows = data["results"] if isinstance(data, dict) else data
        for run, config in dict.fromkeys((_run(r), r["config"]) for r in rows):
            mine = [r for r in rows if _run(r) == run and r["config"] == config and r["impl"] == "moela"]
            bf16 = next((r for r in mine if r["recipe"] == "bf16"), None)
            fp8 = [r for r in mine if r["recipe"] != "bf16"]
            if bf16 is None or not fp8:
                continue
            where = f"`{path}`" + (f", the run of {run[0]}, commit {run[1]}" if run else "")
            lines.append(f"Source: {where} ({bf16.get('device_name', '')})")
            lines.append("")
            text, summary = analyse(bf16, fp8, targets.get(config))
            lines += text
            used += [bf16, *fp8]
            summaries.append(dict(source=path, run=dict(zip(("date", "commit", "command"), run)),
                                  device=bf16.get("device_name", ""), **summary))
    body = ["Each config's rows come from one bench/step.py run (the files below); times are the rows' median step and "
            "their profiled kernel time per family. See the script's docstring for the method.", "", *lines]
    devices = sorted({s["device"] for s in summaries if s.get("device")})
    md = write_results("fp8_ceiling", "FP8 step targets against the measured breakdown", "\n".join(body), summaries,
                       out_dir=args.out_dir, device=", ".join(devices) or None, **_versions(used))
    print(md.read_text())


if __name__ == "__main__":
    sys.exit(main())
