"""bench/step.py's torchtitan mapping (skipped when torchtitan 0.3.0 is not importable), the first-step clock and
the cold rows' caches, on the CPU."""

from __future__ import annotations

import math
import time

import pytest
import torch
from step_helpers import step_module, tiny_config

from bench.steplib.source import PackedDocs


def _torchtitan():
    from bench.steplib import titan

    try:
        titan.import_torchtitan()
    except ImportError as e:
        pytest.skip(f"torchtitan is not importable here: {e}")
    return titan


def test_titan_config_maps_moela_shapes_and_weights():
    titan = _torchtitan()
    from torchtitan.models.common import RMSNorm

    from bench.steplib.impls import moela_initial_model

    cfg = tiny_config("model.rms_norm_eps=1e-5", "model.routed_scaling_factor=2.5")
    f = cfg.model.moe_intermediate_size
    config = titan.titan_config(cfg.model, max_seq_len=64)
    dense, moe = config.layers[0], config.layers[1]
    assert dense.moe is None and dense.feed_forward is not None and moe.feed_forward is None
    router = moe.moe.router
    assert (router.num_experts, router.top_k, router.num_expert_groups, router.num_limited_groups,
            router.score_func, router.route_norm, router.route_scale) == (4, 2, 2, 1, "sigmoid", True, 2.5)
    assert moe.attention.q_lora_rank == 16 and moe.attention.kv_lora_rank == 16
    assert moe.moe.routed_experts.inner_experts.hidden_dim == f
    eps = []

    def walk(node):
        if isinstance(node, RMSNorm.Config):
            eps.append(node.eps)
        elif hasattr(node, "__dataclass_fields__"):
            for name in node.__dataclass_fields__:
                walk(getattr(node, name))
        elif isinstance(node, list):
            for item in node:
                walk(item)
    walk(config)
    assert len(eps) >= 7 and set(eps) == {1e-5}

    moela = moela_initial_model(cfg, torch.device("cpu"))
    model, config = titan.build_titan_model(cfg.model, 64, torch.device("cpu"))
    titan.load_moela_weights(model, config, moela)
    ours, theirs = moela.state_dict(), model.state_dict()
    assert torch.equal(theirs["layers.1.moe.routed_experts.inner_experts.w1_EFD"],
                       ours["layers.1.ffn.experts.w13"][:, :f])
    assert torch.equal(theirs["layers.1.moe.routed_experts.inner_experts.w3_EFD"],
                       ours["layers.1.ffn.experts.w13"][:, f:])
    assert torch.equal(theirs["layers.1.attention.wkv_b.weight"], ours["layers.1.attn.wkv_b.weight"])
    assert torch.equal(theirs["lm_head.weight"], ours["head.weight"])


def test_titan_computes_moela_function_on_the_same_tokens():
    """torchtitan's model on the CPU (dense-mask attention in place of FlexAttention, which has no CPU backward):
    moela's logits and loss. Its routed experts run their GEMMs on bf16 inputs, so the logits agree to 2% of their
    largest magnitude (a RoPE table that lost its imaginary part is off by ~80%)."""
    _torchtitan()
    from bench.steplib.impls import TitanStep, moela_initial_model

    cfg = tiny_config()
    src = PackedDocs(vocab_size=cfg.model.vocab_size, rows=2, row_len=64, grad_accum=1, max_doc_len=64,
                     median_len=16, seed=4)
    step = TitanStep(cfg, src, torch.device("cpu"), compiled=False)
    moela = moela_initial_model(cfg, torch.device("cpu"))
    mb = src.microbatch(0, 0)
    assert len(mb.doc_lengths) > 2
    with torch.no_grad():
        out = moela(mb.packed(), return_logits=True)
        positions = mb.grid("position_ids").long()
        logits = step.model(mb.grid("input_ids"), positions=positions, attention_masks=step.dense_mask(positions))
        theirs = step.loss_sum(mb) / mb.num_targets
    ours = out.logits.view(logits.shape)
    assert (logits - ours).abs().max() < 0.02 * ours.abs().max()
    assert abs(float(theirs) - float(out.metrics["lm_loss"])) < 0.01
    loss = step.step()  # a whole training step runs: backward, clipping, AdamW
    assert math.isfinite(float(loss))


def test_titan_stand_ins_apply_only_where_torch_lacks_the_feature(monkeypatch):
    titan = _torchtitan()
    import torch.distributed.fsdp as fsdp
    import torch.nn.attention.flex_attention as flex
    import torchtitan.models.common.attention as attention
    import torchtitan.models.common.decoder as decoder

    assert titan._stand_in_mesh_dims() is (not hasattr(fsdp, "DataParallelMeshDims"))
    monkeypatch.delattr(fsdp, "DataParallelMeshDims", raising=False)
    assert titan._stand_in_mesh_dims() is True
    dims = fsdp.DataParallelMeshDims(shard="fsdp")
    assert (dims.shard, dims.replicate) == ("fsdp", None)

    calls = []
    monkeypatch.setattr(attention, "create_attention_mask", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(decoder, "create_attention_mask", attention.create_attention_mask)
    monkeypatch.setattr(flex, "create_block_mask", lambda mask_mod, B, H, Q_LEN, KV_LEN, device="cuda": None)
    assert titan._drop_separate_full_blocks() is True
    decoder.create_attention_mask("mod", 1, None, 8, 8, separate_full_blocks=True, BLOCK_SIZE=128)
    assert calls == [(("mod", 1, None, 8, 8), {"BLOCK_SIZE": 128})]


def test_the_first_step_clock_times_the_compilers_where_they_are_called(monkeypatch):
    """The clock's wrappers time each call of a wrapped compiler and pass its result through; its report lists
    them with torch.compile's phases (from Dynamo's own timers), and the report renders both. `install` wraps the
    real entry points (restored after the test) without changing what they return."""
    import bench.steplib.first_step as first_step
    from bench.steplib.report import _first_step_compilers
    from moela.ops.attention import flash

    clock = first_step.CompilerClock()
    slow = clock._wrap("a compiler", lambda x: (time.sleep(0.05), x + 1)[1])
    assert slow(1) == 2 and slow(2) == 3
    torch._dynamo.reset()
    torch.compile(lambda t: t.sin() + 1, backend="aot_eager")(torch.ones(3))
    got = clock.report()
    assert got["a compiler"][1] == 2 and 0.1 <= got["a compiler"][0] < 5
    assert got["torch.compile phases"] and all(s >= 0 and n >= 1 for s, n in got["torch.compile phases"].values())
    line = _first_step_compilers([{"config": "c", "impl": "moela", "recipe": "bf16", "first_step_compilers": got}])
    assert line[0].startswith("- c moela bf16: a compiler 0.1 s (2); torch.compile phases: `")

    triton_compiler = pytest.importorskip("triton.compiler")
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from triton.runtime.autotuner import Autotuner

    for owner, name in ((triton_compiler, "compile"), (Autotuner, "_bench"), (flash, "_flash_module"),
                        (CachingAutotuner, "precompile"), (CachingAutotuner, "autotune_to_one_config")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    loaded = flash._flash_module()
    clock.install()
    assert flash._flash_module() == loaded and triton_compiler.compile.__wrapped__ is not None
    assert CachingAutotuner.autotune_to_one_config.__wrapped__ is not None


def test_cold_rows_get_empty_caches_of_their_own(tmp_path):
    """`--cold`: a row's environment points every kernel cache at a new root and drops the variables that would
    point one elsewhere; each row run that way gets a new directory of its own under the log directory."""
    step = step_module()
    env = {"PATH": "/bin", "TRITON_CACHE_DIR": "/warm/triton", "TORCHINDUCTOR_CACHE_DIR": "/warm/inductor",
           "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "/warm/fa", "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "0",
           "MOELA_CACHE_DIR": "/warm"}
    assert step.cold_env(env, tmp_path / "c") == {"PATH": "/bin", "MOELA_CACHE_DIR": str(tmp_path / "c")}
    counts = dict(warmup=2, steps=1, profile_steps=0, sync_steps=0)
    specs = step.plan_rows(["tiny"], ["moela"], ["bf16"], "cpu", counts, str(tmp_path / "run"))
    rows = step.run_rows(specs, tmp_path, row_timeout=600, budget=600, cold=True)
    assert "error" not in rows[0], rows[0].get("error")
    assert len(list(tmp_path.glob("caches_tiny_moela_bf16_*"))) == 1

