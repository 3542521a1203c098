"""The model on packed batches: no leakage between documents (attention or MTP), gradients everywhere, meta-device
build, parameter counts and FLOPs, config validation, activation checkpointing, autocast, and the fast CUDA paths
against the reference ones. Each layer against its formula: test_model_formulas.py."""

import math

import pytest
import torch

from factories import packed_batch, tiny_config
from moela.batch import IGNORE_INDEX, PackedBatch
from moela.model import build_model, count_params, flops_per_token, preset
from moela.model.moe import MoE
from moela.model.transformer import mtp_targets, shift_within_docs

# the tiny test model with three heads, six experts (three groups possible) and head dims that differ
MODEL = dict(vocab_size=101, hidden_size=40, intermediate_size=56, n_routed_experts=6, q_lora_rank=20,
             qk_rope_head_dim=6, v_head_dim=10, num_attention_heads=3, aux_loss_coef=0.01, z_loss_coef=1e-3)


def _cfg(**kw):
    return tiny_config(**{**MODEL, **kw})


def _split(batch):
    cu = batch.cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        yield PackedBatch(batch.input_ids[a:b], batch.labels[a:b], batch.position_ids[a:b],
                          torch.tensor([0, b - a], dtype=torch.int32), b - a)


VARIANTS = {
    "fal_headnorm_mtp2": dict(block="fal", qk_norm="head", num_nextn_predict_layers=2),
    "falplus_layernorm_noqlora_tied": dict(block="fal_plus", qk_norm="layer", q_lora_rank=None,
                                           tie_word_embeddings=True, first_k_dense_replace=0),
    "standard_yarn_dense2": dict(first_k_dense_replace=2, n_group=3, topk_group=2, n_shared_experts=0,
                                 rope_scaling={"factor": 4.0, "original_max_position_embeddings": 8}),
}


def _variant(name):
    kw = dict(VARIANTS[name])
    if isinstance(kw.get("rope_scaling"), dict):
        from moela.model import RopeScaling
        kw["rope_scaling"] = RopeScaling(**kw["rope_scaling"])
    return _cfg(**kw)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_packed_forward_equals_separate_documents(name):
    torch.manual_seed(0)
    cfg = _variant(name)
    model = build_model(cfg)
    batch = packed_batch(cfg.vocab_size, [7, 12, 3, 9], seed=1)
    with torch.no_grad():
        packed = model(batch, return_logits=True)
        docs = [model(b, return_logits=True) for b in _split(batch)]
    assert torch.allclose(packed.logits, torch.cat([d.logits for d in docs]), atol=1e-5)
    # every term is (sum over tokens or documents) / num_targets, so the packed value is the target-weighted sum
    n = packed.num_targets
    assert n == sum(d.num_targets for d in docs)
    for key in ["lm_loss", "mtp_loss", "aux_loss", "z_loss"]:
        assert key in packed.metrics, key
        want = sum(d.metrics[key] * d.num_targets for d in docs) / n
        assert torch.allclose(packed.metrics[key], want, rtol=1e-5, atol=1e-6), key
    assert torch.allclose(packed.loss, sum(d.loss * d.num_targets for d in docs) / n, rtol=1e-5)
    assert torch.equal(packed.expert_load, sum(d.expert_load for d in docs))
    assert packed.expert_load.shape == (cfg.num_moe_blocks, cfg.n_routed_experts)
    assert packed.expert_load.sum(1).eq(batch.num_tokens * cfg.num_experts_per_tok).all()


def test_changing_one_document_leaves_the_others_alone():
    cfg = _cfg(num_nextn_predict_layers=2, block="fal")
    model = build_model(cfg)
    a = packed_batch(cfg.vocab_size, [10, 6, 8], seed=3)
    b = packed_batch(cfg.vocab_size, [10, 6, 8], seed=3)
    b.input_ids[10:16] = (b.input_ids[10:16] + 1) % cfg.vocab_size
    with torch.no_grad():
        la, lb = model(a, return_logits=True).logits, model(b, return_logits=True).logits
    # Not bit for bit: the MoE layers run each expert's rows as one GEMM, and the changed document sends other row
    # counts to the experts, so the other documents' rows are rounded in other groupings (4.5e-8 seen on an AMD
    # EPYC). Leakage through attention or MTP would move the logits by O(1e-2) and more.
    torch.testing.assert_close(la[:10], lb[:10], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(la[16:], lb[16:], rtol=1e-5, atol=1e-6)
    assert (la[10:16] - lb[10:16]).abs().max() > 1e-2


def test_mtp_targets_shift_within_documents():
    x = torch.arange(10)
    last = torch.zeros(10, dtype=torch.bool)
    last[[3, 4, 9]] = True  # documents [0, 4), [4, 5), [5, 10)
    assert shift_within_docs(x, last, -1).tolist() == [1, 2, 3, -1, -1, 6, 7, 8, 9, -1]
    two = shift_within_docs(shift_within_docs(x, last, -1), last, -1)
    assert two.tolist() == [2, 3, -1, -1, -1, 7, 8, 9, -1, -1]
    batch = packed_batch(50, [4, 1, 5], seed=3)
    (t1, l1), (t2, l2) = mtp_targets(batch, 2)
    ids, labels = batch.input_ids.tolist(), batch.labels.tolist()
    assert t1.tolist() == ids[1:4] + [0, 0] + ids[6:10] + [0] and t2.tolist() == ids[2:4] + [0] * 3 + ids[7:10] + [0, 0]
    assert l1.tolist() == labels[1:4] + [IGNORE_INDEX] * 2 + labels[6:10] + [IGNORE_INDEX]
    assert l2.tolist() == labels[2:4] + [IGNORE_INDEX] * 3 + labels[7:10] + [IGNORE_INDEX] * 2


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gradients_reach_every_parameter(name):
    torch.manual_seed(1)
    cfg = _variant(name)
    model = build_model(cfg)
    out = model(packed_batch(cfg.vocab_size, [40, 33, 50], seed=2))
    out.loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, pname


def test_meta_build_then_init():
    cfg = _cfg(initializer_range=0.05, num_nextn_predict_layers=1)
    model = build_model(cfg, dtype=torch.bfloat16)
    for name, p in model.named_parameters():
        assert not p.is_meta and p.dtype == torch.bfloat16, name
        if name.endswith("norm.weight"):
            assert p.eq(1).all(), name
    assert math.isclose(model.embed.weight.float().std().item(), 0.05, rel_tol=0.05)
    for moe in model.moe_layers():
        b = moe.gate.e_score_correction_bias
        assert b.dtype == torch.float32 and b.eq(0).all()
    assert model.inv_freq.dtype == torch.float32 and torch.isfinite(model.inv_freq).all()


@pytest.mark.parametrize("kw", [{}, dict(q_lora_rank=None, tie_word_embeddings=True), dict(block="fal_plus"),
                                dict(qk_norm="layer", n_shared_experts=2, num_nextn_predict_layers=2),
                                dict(qk_norm="head", first_k_dense_replace=3)])
def test_count_params_matches_built_model(kw):
    cfg = _cfg(**kw)
    model = build_model(cfg)
    total, active = count_params(cfg)
    assert total == sum(p.numel() for p in model.parameters())
    routed = sum(m.experts.w13.numel() + m.experts.w2.numel() for m in model.moe_layers())
    assert active == total - routed * (1 - cfg.num_experts_per_tok / cfg.n_routed_experts)
    mtp = sum(p.numel() for p in model.mtp.parameters())
    assert count_params(cfg, include_mtp=False)[0] == total - mtp


def test_presets_and_deepseek_v3_size():
    for size in ["tiny", "small", "v2-lite", "v3"]:
        assert preset(size).validate() == []
    total, active = count_params(preset("v3"), include_mtp=False)
    assert 670e9 < total < 672e9 and 36.5e9 < active < 38e9  # DeepSeek-V3: 671B total, 37B activated
    total, active = count_params(preset("v2-lite"), include_mtp=False)
    assert 15e9 < total < 16.5e9 and 2.2e9 < active < 3e9  # DeepSeek-V2-Lite: 15.7B total, 2.4B activated


def test_flops_per_token():
    cfg = _cfg(num_nextn_predict_layers=1)
    model = build_model(cfg)
    routed = sum(m.experts.w13.numel() + m.experts.w2.numel() for m in model.moe_layers())
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("embed"))
    matmul = matrices - routed + routed * cfg.num_experts_per_tok / cfg.n_routed_experts + cfg.vocab_size * \
        cfg.hidden_size  # MTP reuses the head
    attn_layers = cfg.num_hidden_layers + 1
    for s in (1, 128, 4096):
        attention = 3 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * s * attn_layers
        assert math.isclose(flops_per_token(cfg, s), 6 * matmul + attention, rel_tol=1e-9)


def test_config_validation_messages():
    bad = {"n_group": dict(n_routed_experts=6, n_group=4), "topk_group": dict(n_group=2, topk_group=3),
           "qk_rope_head_dim": dict(qk_rope_head_dim=5), "num_experts_per_tok": dict(num_experts_per_tok=9),
           "size": dict(size="huge"), "attention_backend": dict(attention_backend="flash9")}
    for field_name, kw in bad.items():
        cfg = _cfg()
        for k, v in kw.items():
            setattr(cfg, k, v)
        errors = cfg.validate()
        assert any(e.startswith(f"{field_name}:") and ";" in e for e in errors), (field_name, errors)
    with pytest.raises(ValueError, match="n_group"):
        build_model(_cfg(n_group=4))


def _loss_and_grads(model, batch):
    """One forward + backward: (output, {name: gradient}); the model's gradients are reset afterwards."""
    out = model(batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out, grads


def test_blocks_are_safe_under_activation_checkpointing():
    torch.manual_seed(5)
    cfg = _cfg(block="fal", num_nextn_predict_layers=1)
    model = build_model(cfg)
    batch = packed_batch(cfg.vocab_size, [11, 17], seed=7)
    out, grads = _loss_and_grads(model, batch)
    for b in list(model.layers) + [m.block for m in model.mtp]:
        b.recompute = True
    again = model(batch)
    again.loss.backward()
    assert torch.equal(again.loss, out.loss) and torch.equal(again.expert_load, out.expert_load)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[n], atol=1e-6, rtol=1e-5), n


def test_fused_head_loss_path_equals_logits_path(monkeypatch):
    import functools

    import moela.model.transformer as tr
    import moela.ops.linear_cross_entropy as lce
    torch.manual_seed(6)
    cfg = _cfg(num_nextn_predict_layers=1, tie_word_embeddings=True)
    model = build_model(cfg)
    batch = packed_batch(cfg.vocab_size, [13, 8], seed=8)
    ref, grads = _loss_and_grads(model, batch)
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 4 * cfg.vocab_size)
    monkeypatch.setattr(lce, "MIN_CHUNK_ROWS", 1)
    monkeypatch.setattr(tr, "linear_cross_entropy", functools.partial(lce.linear_cross_entropy, backend="chunked"))
    out = model(batch)
    out.loss.backward()
    assert torch.allclose(out.loss, ref.loss, rtol=1e-6)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[n], atol=1e-6, rtol=1e-4), n


@pytest.mark.gpu
def test_cuda_auto_backends_match_reference_backends(monkeypatch):
    """float32 on CUDA: the fast paths that accept float32 (compiled small ops, chunked head + loss, the query's
    in-place RoPE, and any attention / expert kernels that support it) give the reference model's loss and
    gradients (the reference: the out-of-place RoPE, reference attention and experts)."""
    from moela.model import attention as attention_mod

    dtype = torch.float32
    torch.manual_seed(7)
    cfg = _cfg(hidden_size=128, num_attention_heads=4, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
               kv_lora_rank=64, q_lora_rank=96, moe_intermediate_size=128, n_routed_experts=8, n_group=2,
               num_nextn_predict_layers=1, block="fal", qk_norm="head")
    model = build_model(cfg, "cuda", dtype=dtype)
    batch = packed_batch(cfg.vocab_size, [37, 200, 5, 130], seed=9).to("cuda")

    rotate_in_place = attention_mod.rotate_q_in_place

    def run(attn_backend, moe_backend):
        # the reference: the query's RoPE out of place (split, rope, cat), as on the CPU
        monkeypatch.setattr(attention_mod, "rotate_q_in_place",
                            (lambda q: False) if attn_backend == "reference" else rotate_in_place)
        for blk in list(model.layers) + [m.block for m in model.mtp]:
            blk.attn.core_attention.keywords["backend"] = attn_backend
            if isinstance(blk.ffn, MoE):
                blk.ffn.experts.backend = moe_backend
        model.zero_grad(set_to_none=True)
        out = model(batch)
        out.loss.backward()
        return out, {n: p.grad.float() for n, p in model.named_parameters()}
    ref, ref_grads = run("reference", "reference")
    fast, fast_grads = run("auto", "auto")
    assert math.isclose(fast.loss.item(), ref.loss.item(), rel_tol=1e-4)
    for n, g in ref_grads.items():
        err = (fast_grads[n] - g).norm() / (g.norm() + 1e-12)
        assert err < 1e-3, (n, err.item())


def test_fp8_expert_recipe_runs_through_the_model():
    torch.manual_seed(8)
    cfg = _cfg(hidden_size=136, moe_intermediate_size=72)
    model = build_model(cfg)
    fp8 = build_model(_cfg(hidden_size=136, moe_intermediate_size=72, moe_recipe="fp8_blockwise"))
    fp8.load_state_dict(model.state_dict())
    batch = packed_batch(cfg.vocab_size, [21, 30], seed=10)
    a, b = model(batch), fp8(batch)
    assert fp8.moe_layers()[0].experts.recipe == "fp8_blockwise"
    assert a.loss.item() != b.loss.item() and math.isclose(a.loss.item(), b.loss.item(), rel_tol=1e-2)
    b.loss.backward()
    assert all(p.grad is not None for p in fp8.parameters())


def test_router_stays_float32_under_autocast():
    cfg = _cfg(first_k_dense_replace=0)
    gate = build_model(cfg).layers[0].ffn.gate
    x = torch.randn(9, cfg.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ids, weights, scores = gate(x)
    assert scores.dtype == torch.float32
    assert torch.allclose(scores, torch.sigmoid(x.double() @ gate.weight.double().t()).float(), atol=1e-6)


def test_moe_experts_follow_autocast():
    """moe_experts is invisible to autocast: it casts an fp32 input to the autocast dtype itself, so the bf16
    kernels (not the fp32 reference fallback) run under mixed precision, for the model's routed experts and for
    expert parallelism's local experts alike."""
    from moela.ops.moe import moe_experts

    torch.manual_seed(3)
    t, d, f, e = 9, 128, 128, 4
    x, w13, w2 = torch.randn(t, d), torch.randn(e, 2 * f, d) / d ** 0.5, torch.randn(e, d, f) / f ** 0.5
    ids, w = torch.stack([torch.randperm(e)[:2] for _ in range(t)]), torch.rand(t, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe_experts(x, ids, w, w13, w2)
        y_bf16 = moe_experts(x.bfloat16(), ids, w, w13, w2)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_bf16)
    assert moe_experts(x, ids, w, w13, w2).dtype == torch.float32  # no autocast: fp32 stays fp32


def test_batch_moved_from_cpu_counts_targets_without_reading_the_device():
    """The model asks for the labelled-token count once per micro-batch; a batch moved from the CPU carries it, so
    on a GPU that is no device synchronization (here: a meta tensor cannot be read at all)."""
    batch = packed_batch(64, [5, 1, 7])
    moved = batch.to("meta")
    assert moved.labels.device.type == "meta"
    assert moved.num_targets() == batch.num_targets() == int((batch.labels != IGNORE_INDEX).sum())


def test_building_draws_random_numbers_only_to_initialize():
    """Construction on the meta device draws no random numbers (only `init_weights` does); two builds from one seed
    are equal and leave the generator in the same state. A construction that allocated for real (it once did, after
    a test had patched torch.empty) would shift every random draw after it."""
    from moela.model.transformer import Transformer

    state = torch.get_rng_state()
    with torch.device("meta"):
        Transformer(tiny_config())
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(3)
    a = build_model(tiny_config())
    after_a = torch.get_rng_state()
    torch.manual_seed(3)
    b = build_model(tiny_config())
    assert torch.equal(torch.get_rng_state(), after_a)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
