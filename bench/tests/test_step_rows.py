"""bench/step.py's rows on the CPU: the synthetic packed-document source, the row plan, the report, a whole moela
row end to end, and transformers' packed rows against moela."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch
from step_helpers import ROOT, TINY, step_module, tiny_config

from bench.steplib.kernels import FAMILIES
from bench.steplib.source import PackedDocs, TrainerLoader
from moela.batch import IGNORE_INDEX


def test_packed_docs_rows_documents_and_labels():
    src = PackedDocs(vocab_size=50, rows=3, row_len=97, grad_accum=2, max_doc_len=40, median_len=16, seed=5)
    batches = src.next_step()
    assert len(batches) == 2 and src.tokens_per_step == 2 * 3 * 97
    for mb in batches:
        ids, labels, pos = (t.numpy() for t in (mb.input_ids, mb.labels, mb.position_ids))
        assert ids.shape == (3 * 97,) and ids.min() >= 0 and ids.max() < 50
        assert mb.doc_lengths.max() <= 40 and mb.doc_lengths.sum() == 3 * 97
        assert (mb.grid("position_ids")[:, 0] == 0).all()  # every row starts a document
        ends = np.cumsum(mb.doc_lengths)
        assert set(np.flatnonzero(pos == 0)) == set(ends - mb.doc_lengths)
        assert (labels[ends - 1] == IGNORE_INDEX).all()
        inner = np.setdiff1d(np.arange(len(ids)), ends - 1)
        assert (labels[inner] == ids[inner + 1]).all()
        assert mb.num_targets == (labels != IGNORE_INDEX).sum()
        packed = mb.packed()
        packed.validate()
        assert packed.num_targets() == mb.num_targets and packed.cu_seqlens[-1] == len(ids)
    lengths = np.concatenate([b.doc_lengths for b in batches]).astype(float)
    assert src.token_weighted_doc_len() == pytest.approx((lengths ** 2).sum() / lengths.sum())


def test_packed_docs_same_seed_same_tokens_in_any_process():
    a = PackedDocs(vocab_size=1000, rows=2, row_len=300, grad_accum=1, max_doc_len=300, median_len=64, seed=1)
    b = PackedDocs(vocab_size=1000, rows=2, row_len=300, grad_accum=1, max_doc_len=300, median_len=64, seed=1)
    a.next_step()
    assert torch.equal(a.next_step()[0].input_ids, b.microbatch(1, 0).input_ids)
    c = PackedDocs(vocab_size=1000, rows=2, row_len=300, grad_accum=1, max_doc_len=300, median_len=64, seed=2)
    assert not torch.equal(c.microbatch(1, 0).input_ids, b.microbatch(1, 0).input_ids)


def test_packed_docs_lengths_are_lognormal_around_the_median():
    src = PackedDocs(vocab_size=10, rows=64, row_len=8192, grad_accum=1, max_doc_len=4096, seed=0)
    lengths = src.microbatch(0, 0).doc_lengths
    assert 1300 < np.median(lengths) < 2100  # median 2048 before the cuts at 4096 and at the row ends
    assert 1700 < lengths.mean() < 2200
    with pytest.raises(ValueError, match="row_len"):
        PackedDocs(vocab_size=10, rows=1, row_len=1, grad_accum=1, max_doc_len=4)


def test_trainer_loader_reports_step_totals():
    src = PackedDocs(vocab_size=50, rows=2, row_len=64, grad_accum=3, max_doc_len=64, median_len=16, seed=0)
    loader = TrainerLoader(src)
    batches = loader.next_step()
    again = PackedDocs(vocab_size=50, rows=2, row_len=64, grad_accum=3, max_doc_len=64, median_len=16, seed=0)
    raw = again.next_step()
    lengths = np.concatenate([b.doc_lengths for b in raw]).astype(float)
    assert loader.last_global_counts == (sum(b.num_targets for b in raw), 3 * 128, float((lengths ** 2).sum()))
    assert [b.num_targets() for b in batches] == [b.num_targets for b in raw]



def test_failed_row_names_its_exception_first(tmp_path):
    """A row that dies in backward: the summary leads with the exception, not with the traceback's frames."""
    step = step_module()
    log = tmp_path / "row.log"
    log.write_text("Traceback (most recent call last):\n" + "  File \"x.py\", line 1, in f\n    g()\n" * 4
                   + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 25.00 GiB.\n"
                   + "  File \"y.py\", line 9, in h\n")
    assert step._tail(log).startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 25.00 GiB. | ")
    log.write_text("plain last line\n")
    assert step._tail(log) == "plain last line"


def test_plan_rows_peers_bf16_only_and_mtp_off():
    from moela.config import load_config

    step = step_module()
    counts = dict(warmup=2, steps=1, profile_steps=0, sync_steps=0)
    specs = step.plan_rows(["small-16k", "small-64k"], list(step.IMPLS), ["bf16", "fp8_blockwise"], "cuda", counts,
                           "/tmp/r")
    labels = [(s["label"], s["config"][-3:], s["recipe"]) for s in specs]
    kernel_rows = [f"moela-{phase}-{kernel}" for phase in ("fwd", "dq", "dkdv") for kernel in ("triton", "gluon")]
    assert labels == [("moela", "16k", "bf16"), ("moela", "16k", "fp8_blockwise"), ("moela", "64k", "bf16"),
                      ("moela", "64k", "fp8_blockwise"), ("moela-nographs", "16k", "bf16"),
                      ("moela-nographs", "16k", "fp8_blockwise"), ("moela-nographs", "64k", "bf16"),
                      ("moela-nographs", "64k", "fp8_blockwise"), ("moela-fp32-moments", "16k", "bf16"),
                      ("moela-fp32-moments", "16k", "fp8_blockwise"), ("moela-fp32-moments", "64k", "bf16"),
                      ("moela-fp32-moments", "64k", "fp8_blockwise"), ("moela-nomtp", "16k", "bf16"),
                      ("moela-nomtp", "64k", "bf16"), ("moela-no-prebuild", "16k", "bf16"),
                      ("moela-no-prebuild", "64k", "bf16"),
                      *[(label, size, "bf16") for label in kernel_rows for size in ("16k", "64k")],
                      ("titan-compile", "16k", "bf16"), ("titan-compile", "64k", "bf16"), ("hf", "16k", "bf16"),
                      ("hf", "64k", "bf16"), ("titan-eager", "16k", "bf16"), ("titan-eager", "64k", "bf16")]
    for s in specs:
        mtp_off = "model.num_nextn_predict_layers=0" in s["overrides"]
        assert mtp_off == (s["label"] in ("moela-nomtp", "titan-compile", "hf", "titan-eager"))
        assert ("train.prebuild_kernels=false" in s["overrides"]) == (s["label"] == "moela-no-prebuild")
        assert ("train.cuda_graphs=false" in s["overrides"]) == (s["label"] == "moela-nographs")
        assert f"model.moe_recipe={s['recipe']}" in s["overrides"]
        assert s["rows"] * s["row_len"] == (65536 if s["config"] == "small-64k" else 16384)
        cfg = load_config(s["recipe_path"], s["overrides"])
        assert cfg.model.expert_recipe == s["recipe"] and not cfg.model.fp8_linears
        assert cfg.train.tokens_per_microbatch * cfg.train.grad_accum == 32768 or s["config"] == "small-64k"
        assert cfg.train.cuda_graphs == (s["label"] != "moela-nographs")
        assert cfg.optim.moment_dtype == ("float32" if s["label"] == "moela-fp32-moments" else "bfloat16")
        kernels = cfg.model.kernels
        chosen = {f"moela-fwd-{kernels.attention_forward}", f"moela-dq-{kernels.attention_dq}",
                  f"moela-dkdv-{kernels.attention_dkdv}"} & set(kernel_rows)
        assert chosen == ({s["label"]} if s["label"] in kernel_rows else set()), s["label"]
        assert (cfg.model.attention_backend == "triton") == (s["label"] in kernel_rows)

    fp8 = step.plan_rows(["small-64k"], ["moela", "titan-compile"], ["bf16", "fp8"], "cuda", counts, "/tmp/r")
    assert [(s["label"], s["recipe"]) for s in fp8] == [("moela", "bf16"), ("moela", "fp8"), ("titan-compile", "bf16")]
    model_fp8 = load_config(fp8[1]["recipe_path"], fp8[1]["overrides"]).model
    assert model_fp8.precision == "fp8" and model_fp8.fp8_linears and model_fp8.expert_recipe == "fp8_blockwise"

    v2 = step.plan_rows(["v2lite6-64k"], ["moela"], ["bf16"], "cuda", counts, "/tmp/r")[0]
    cfg = load_config(v2["recipe_path"], v2["overrides"]).model
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.n_routed_experts, cfg.n_shared_experts,
            cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.q_lora_rank, cfg.kv_lora_rank,
            cfg.first_k_dense_replace, cfg.num_hidden_layers, cfg.vocab_size) == (
        2048, 16, 64, 2, 6, 1408, None, 512, 1, 6, 102400)
    shipped = load_config(step.CONFIGS["small-16k"]["recipe"], step.CONFIGS["small-16k"]["overrides"]).train
    assert (shipped.tokens_per_microbatch, shipped.grad_accum) == (16384, 2)
    one = load_config(step.CONFIGS["small-32k"]["recipe"], step.CONFIGS["small-32k"]["overrides"]).train
    assert (one.tokens_per_microbatch, one.grad_accum) == (32768, 1)  # the shipped tokens per step, one micro-batch
    assert step.CONFIGS["small-32k"]["rows"] * step.CONFIGS["small-32k"]["row_len"] == 32768


def test_report_tables_ratios_and_failures():
    from bench.steplib.report import devices, render

    def row(impl, tps, loss, recipe="bf16"):
        return {"config": "small-64k", "impl": impl, "recipe": recipe, "tokens_per_s": tps, "mfu": 0.2,
                "busy": 0.9, "peak_gib": 40.0, "host_syncs_per_step": 7.0, "sync_debug_warnings_per_step": 5.0,
                "sync_counter_check": {"item_traced": 1, "item_warned": 1, "synchronize_traced": 1},
                "sync_witness": "trace", "first_step_s_from_start": 30.0, "first_step_s_from_built": 20.0,
                "recompiles_after_step2": 0, "first_step_loss": loss, "step_ms_median": 400.0,
                "step_ms_min": 390.0, "step_ms_max": 420.0, "device_name": "NVIDIA H200",
                "kernel_breakdown": {f: {"ms_per_step": 10.0, "share": 1 / len(FAMILIES), "top": [["k", 1.0]]}
                                     for f in FAMILIES},
                "launches_per_step": {"expert GEMM": 24.0, "copies/cat/casts": 1500.0, "total": 1524.0},
                "host_top_ops": [["cuLaunchKernelEx", 12.5, 400.0], ["aten::mm", 3.0, 96.0]],
                "most_launched": [["triton_poi_fused_copy_3", "copies/cat/casts", 240.0, 2.5, ["aten::copy_ < f"]]]}
    rows = [row("moela-nomtp", 200e3, 8.3101), row("titan-compile", 160e3, 8.3105), row("hf", 50e3, 8.3098),
            {"config": "small-64k", "impl": "titan-eager", "recipe": "bf16", "error": "exit code 1: OutOfMemory"}]
    rows[0].update(tokens_per_s_window=210e3, mfu_window=0.21, first_step_compile_s=12.4, first_step_graphs=9)
    rows[1].update(tokens_per_s_window=150e3, mfu_window=0.15)
    md = render(rows, counts=dict(warmup=3, steps=6, profile_steps=2, sync_steps=1))
    assert devices(rows) == "NVIDIA H200"
    assert "1.25x titan-compile (unsynced 1.40x), 4.00x hf;" in md
    assert "failed: exit code 1: OutOfMemory" in md
    assert "| 200,000 | 20.0% | 210,000, 21.0% | 90% |" in md and "| 50,000 | 20.0% | - | 90% |" in md
    assert "| 30 / 20; 12, 9 | 0 |" in md and "| 30 / 20 | 0 |" in md  # compile seconds and graphs where recorded
    assert "| config | moela-nomtp | titan-compile | hf |" in md  # the implementations that ran
    assert "| small-64k | 8.3101 | 8.3105 | 8.3098 |" in md
    assert "7 (5 warned)" in md and "3 of 3 rows counted by the CUDA trace hooks" in md
    assert "| small-64k | moela-nomtp | bf16 | 90% | 1,524 | 24 | 1,500 |" in md
    assert "`cuLaunchKernelEx` 12.5 ms (400 calls)" in md
    assert "`triton_poi_fused_copy_3` (copies/cat/casts) 240 x 2.5 us < aten::copy_ < f" in md


def test_report_only_rebuilds_gathered_rows_run_by_run(tmp_path, monkeypatch):
    """`--report-only` on rows of two runs (a bare list, as a gathered file starts): the writer's header names the
    rows' device and versions, one section per run holds its rows, and rebuilding from its own output gives the
    same body; rows without a source are refused with a one-line message."""
    step = step_module()

    def row(impl, tps, commit):
        return {"config": "small-32k", "impl": impl, "recipe": "bf16", "tokens_per_s": tps, "mfu": 0.3,
                "busy": 0.9, "peak_gib": 20.0, "first_step_s_from_start": 30.0, "first_step_s_from_built": 20.0,
                "recompiles_after_step2": 0, "first_step_loss": 8.0, "step_ms_median": 100.0, "step_ms_min": 99.0,
                "step_ms_max": 101.0, "device_name": "NVIDIA H200",
                "source": {"what": f"run {commit}", "date": "2026-12-01", "commit": commit, "torch": "2.11.0",
                           "triton": "3.6.0", "libraries": "transformers 5.17.0",
                           "command": f"python bench/step.py --impls moela-nomtp,titan-compile,hf # {commit}"}}
    rows = [row("moela-nomtp", 300e3, "aaa"), row("titan-compile", 200e3, "aaa"), row("moela-nomtp", 280e3, "bbb"),
            row("hf", 70e3, "bbb")]
    src = tmp_path / "rows.json"
    src.write_text(json.dumps(rows))
    monkeypatch.setattr(sys, "argv", ["bench/step.py", "--report-only", str(src), "--out-dir", str(tmp_path / "a")])
    step.main()
    data = json.loads((tmp_path / "a" / "step.json").read_text())
    assert data["results"] == rows
    assert {k: data["header"][k] for k in ("device", "torch", "triton")} == dict(
        device="NVIDIA H200", torch="2.11.0", triton="3.6.0")
    md = (tmp_path / "a" / "step.md").read_text()
    first, second = md.split("## run aaa")[1].split("## run bbb")
    assert "| 300,000 |" in first and "| 200,000 |" in first and "1.50x titan-compile" in first
    assert "| 280,000 |" in second and "4.00x hf" in second and "300,000" not in second
    assert "(impl moela-nomtp, titan-compile only)" in first and "(impl moela-nomtp, hf only)" in second

    monkeypatch.setattr(sys, "argv", ["bench/step.py", "--report-only", str(tmp_path / "a" / "step.json"),
                                      "--out-dir", str(tmp_path / "b")])
    step.main()
    body = (tmp_path / "b" / "step.md").read_text().split("Libraries:")[1]
    assert body == md.split("Libraries:")[1]

    del rows[1]["source"]
    src.write_text(json.dumps(rows))
    monkeypatch.setattr(sys, "argv", ["bench/step.py", "--report-only", str(src), "--out-dir", str(tmp_path / "c")])
    with pytest.raises(SystemExit, match="small-32k titan-compile bf16"):
        step.main()
    assert not (tmp_path / "c").exists()


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("token_cache"))




def test_moela_row_end_to_end_on_cpu(token_cache, tmp_path, monkeypatch):
    """A whole row through the real Trainer: the first-step loss of random tokens is near ln(V); a kernel choice
    rides in as a recipe override (`model.kernels.moe_fp8_wgrad`)."""
    import triton.compiler
    from triton.runtime.autotuner import Autotuner

    from bench.steplib.row import run_row
    from moela.ops.attention import flash

    # a row is a process of its own, so its first-step timers wrap the compilers for good: restore them here
    monkeypatch.setattr(flash, "_flash_module", flash._flash_module)
    monkeypatch.setattr(triton.compiler, "compile", triton.compiler.compile)
    monkeypatch.setattr(Autotuner, "_bench", Autotuner._bench)
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:
        pass
    else:
        for method in ("precompile", "autotune_to_one_config"):
            if hasattr(CachingAutotuner, method):
                monkeypatch.setattr(CachingAutotuner, method, getattr(CachingAutotuner, method))
    spec = {"config": "tiny", "impl": "moela", "label": "moela", "recipe": "bf16", "device": "cpu",
            "recipe_path": str(ROOT / "recipes" / "tiny.yaml"),
            "overrides": TINY + [f"data.cache_dir={token_cache}", f"train.run_dir={tmp_path}", "train.device=cpu",
                                 "train.tokens_per_microbatch=128", "train.grad_accum=2", "train.eval_every=0",
                                 "logging.progress_bar=never", "checkpoint.every=0",
                                 "model.kernels.moe_fp8_wgrad=triton"],
            "rows": 2, "row_len": 64, "median_doc_len": 16, "warmup": 2, "steps": 2, "profile_steps": 1,
            "sync_steps": 1}
    r = run_row(spec)
    assert r["tokens_per_step"] == 256 and r["tokens_per_s"] > 0 and r["mtp_depth"] == 1
    assert r["tokens_per_s_window"] > 0 and r["mfu_window"] is None  # no bf16 peak known for a CPU
    assert r["first_step_compile_s"] == 0.0  # the tiny recipe trains uncompiled on the CPU
    assert abs(r["first_step_loss"] - math.log(4096)) < 0.05
    assert r["first_step_s_from_start"] >= r["first_step_s_from_built"] > 0
    assert r["recompiles_after_step2"] == 0 and r["mfu"] is None and r["host_syncs_per_step"] is None
    # the timed steps' expert load: max over mean is at least 1 and at most E / top-k (an expert takes a token once)
    low, high = r["expert_imbalance_range"]
    assert 1.0 <= low <= r["expert_imbalance"] <= high <= 8 / 2


def test_hf_step_packed_rows_equal_moela(tmp_path):
    """transformers on [rows, row_len] with per-document positions computes moela's loss on the flat batch (fp32
    on the CPU: equal to float32 rounding; documents that saw each other would be off by far more)."""
    pytest.importorskip("transformers")
    from bench.steplib.impls import HFStep, moela_initial_model

    cfg = tiny_config()
    src = PackedDocs(vocab_size=cfg.model.vocab_size, rows=2, row_len=64, grad_accum=1, max_doc_len=64,
                     median_len=16, seed=3)
    hf = HFStep(cfg, src, torch.device("cpu"))
    moela = moela_initial_model(cfg, torch.device("cpu"))
    mb = src.microbatch(0, 0)
    assert len(mb.doc_lengths) > 2
    with torch.no_grad():
        ours = moela(mb.packed()).metrics["lm_loss"]
        theirs = hf.loss_sum(mb) / mb.num_targets
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

