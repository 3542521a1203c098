"""bench/fp8_ceiling.py's arithmetic on rows with round numbers."""

from __future__ import annotations

from bench.steplib.kernels import FAMILIES


def _ceiling_row(recipe: str, step_ms: float, **families: float) -> dict:
    kb = {f: {"ms_per_step": 0.0, "share": 0.0, "top": [], "top_context": []} for f in FAMILIES}
    for name, ms in families.items():
        kb[name.replace("_", " ")]["ms_per_step"] = ms
    kb["dense GEMM"]["top"] = [["nvjet_head", 30.0], ["nvjet_proj", kb["dense GEMM"]["ms_per_step"] - 30.0]]
    kb["dense GEMM"]["top_context"] = ["aten::mm < aten::matmul < _ChunkedLinearCE", "aten::mm < CompiledFxGraph"]
    return dict(config="c", impl="moela", recipe=recipe, step_ms_median=step_ms, kernel_breakdown=kb)


def test_fp8_ceiling_needs_and_bounds_from_a_breakdown():
    """bench/fp8_ceiling.py on rows with round numbers: eligible = experts + dense GEMMs but the head; the needed
    speed-up solves eligible (1 - 1/s) = T - T / target + overhead; the ceiling puts s = 2."""
    from bench.fp8_ceiling import analyse, head_ms

    bf16 = _ceiling_row("bf16", 200.0, expert_GEMM=60.0, dense_GEMM=70.0, optimizer=5.0)
    fp8 = _ceiling_row("fp8_blockwise", 180.0, expert_GEMM=40.0, dense_GEMM=70.0, optimizer=7.0)
    assert head_ms(bf16) == 30.0
    lines, summary = analyse(bf16, [fp8], 1.25)
    text = "\n".join(lines)
    assert summary["rows"] == [dict(recipe="fp8_blockwise", step_ms=180.0, expert_gemm_ms=40.0, quantization_ms=2.0)]
    assert summary["ceilings"]["experts only (`moe_recipe: fp8_blockwise`)"] == 200 / 172
    # overhead: the optimizer grew by 2 ms; experts only: need 200 - 160 + 2 = 42 of 60 -> s = 1 / (1 - 0.7)
    assert "| fp8_blockwise | 180.0 | 1.111x | 40.0 (1.50x) |" in text and "| 2.0 |" in text
    assert f"{1 / (1 - 42 / 60):.2f}x faster than bf16 (beyond the hardware's 2x)" in text
    # ceiling with the experts at 2x: 200 / (200 - 30 + 2)
    assert f"could reach {200 / 172:.3f}x" in text
    # experts and dense but the head: eligible 100, s = 1 / (1 - 0.42)
    assert f"{1 / (1 - 42 / 100):.2f}x faster than bf16." in text


def test_fp8_ceiling_reads_the_step_writers_json_run_by_run(tmp_path, monkeypatch):
    """step.json as bench/step.py writes it (`{"header", "results"}`), rows gathered from two runs of one config:
    each run's FP8 row is compared with its own bf16 row, and the header names the rows' device and versions."""
    import json
    import sys

    from bench.fp8_ceiling import main

    def sourced(row, commit):
        row["source"] = dict(what=commit, date="2026-12-01", commit=commit, command=f"python bench/step.py # {commit}",
                             torch="2.11.0", triton="3.6.0")
        return dict(row, device_name="NVIDIA H200")

    rows = [sourced(_ceiling_row("bf16", 200.0, expert_GEMM=60.0, dense_GEMM=70.0), "aaa"),
            sourced(_ceiling_row("fp8_blockwise", 180.0, expert_GEMM=40.0, dense_GEMM=70.0), "aaa"),
            sourced(_ceiling_row("bf16", 400.0, expert_GEMM=60.0, dense_GEMM=70.0), "bbb"),
            sourced(_ceiling_row("fp8_blockwise", 200.0, expert_GEMM=40.0, dense_GEMM=70.0), "bbb")]
    step = tmp_path / "step.json"
    step.write_text(json.dumps({"header": {"commit": "x"}, "results": rows}))
    monkeypatch.setattr(sys, "argv", ["bench/fp8_ceiling.py", str(step), "--out-dir", str(tmp_path / "out")])
    main()
    data = json.loads((tmp_path / "out" / "fp8_ceiling.json").read_text())
    assert [(s["run"]["commit"], s["step_ms"], s["rows"][0]["step_ms"]) for s in data["results"]] == [
        ("aaa", 200.0, 180.0), ("bbb", 400.0, 200.0)]
    assert {k: data["header"][k] for k in ("device", "torch", "triton")} == dict(
        device="NVIDIA H200", torch="2.11.0", triton="3.6.0")
    md = (tmp_path / "out" / "fp8_ceiling.md").read_text()
    assert "| fp8_blockwise | 180.0 | 1.111x |" in md and "| fp8_blockwise | 200.0 | 2.000x |" in md
    assert "the run of 2026-12-01, commit bbb" in md
