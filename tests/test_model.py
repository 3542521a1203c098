"""The model on packed batches: no leakage between documents (attention or MTP), gradients everywhere, DeepSeek
routing and bias update, FAL / FAL+ formulas, meta-device build, parameter counts and FLOPs, config validation."""

import math

import pytest
import torch

from factories import packed_batch, tiny_config
from moela.batch import IGNORE_INDEX, PackedBatch
from moela.model import build_model, count_params, flops_per_token, preset
from moela.model.moe import MoE
from moela.model.transformer import mtp_targets, shift_within_docs
from moela.ops.attention import mla_attention

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


def _route_float64(s, bias, n_group, topk_group, k, norm, scale):
    """Brute force, one token at a time, float64: DeepSeek-V3's group-limited sigmoid routing."""
    e = s.numel()
    c = s + bias
    per = e // n_group
    group_score = [sorted(c[g * per:(g + 1) * per].tolist(), reverse=True)[:2] for g in range(n_group)]
    groups = sorted(range(n_group), key=lambda g: -sum(group_score[g]))[:topk_group]
    allowed = [i for g in groups for i in range(g * per, (g + 1) * per)]
    chosen = sorted(allowed, key=lambda i: -c[i].item())[:k]
    w = s[chosen]
    if norm:
        w = w / w.sum()
    return set(chosen), dict(zip(chosen, (w * scale).tolist()))


@pytest.mark.parametrize("norm", [True, False])
def test_group_limited_routing_matches_brute_force(norm):
    torch.manual_seed(2)
    cfg = _cfg(n_routed_experts=12, n_group=4, topk_group=2, num_experts_per_tok=3, norm_topk_prob=norm,
               routed_scaling_factor=2.5, first_k_dense_replace=0)
    gate = build_model(cfg).layers[0].ffn.gate
    with torch.no_grad():
        gate.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(37, cfg.hidden_size)
    ids, weights, scores = gate(x)
    s64 = torch.sigmoid(x.double() @ gate.weight.double().t())
    assert torch.allclose(scores.double(), s64, atol=1e-6)
    for t in range(x.shape[0]):
        chosen, w = _route_float64(s64[t], gate.e_score_correction_bias.double(), 4, 2, 3, norm, 2.5)
        assert set(ids[t].tolist()) == chosen
        assert len({i // 3 for i in chosen}) <= 2  # at most topk_group groups
        for j, i in enumerate(ids[t].tolist()):
            assert math.isclose(weights[t, j].item(), w[i], rel_tol=1e-5)


def test_bias_selects_but_does_not_weight():
    cfg = _cfg(first_k_dense_replace=0, n_group=1, topk_group=1, norm_topk_prob=False)
    gate = build_model(cfg).layers[0].ffn.gate
    x = torch.randn(25, cfg.hidden_size)
    with torch.no_grad():
        gate.e_score_correction_bias.zero_()
        gate.e_score_correction_bias[4] = 10.0
    ids, weights, scores = gate(x)
    assert (ids == 4).any(1).all()  # the boosted expert is always selected...
    assert torch.equal(weights, scores.gather(1, ids))  # ...but weighted by its plain affinity


def test_bias_update_is_sign_based_and_balances_load():
    cfg = _cfg(first_k_dense_replace=0, num_hidden_layers=2, num_nextn_predict_layers=1, bias_update_rate=0.01)
    model = build_model(cfg)
    load = torch.tensor([[5.0, 1, 3, 3, 0, 6], [2, 2, 2, 2, 2, 2], [0, 0, 0, 0, 0, 12]])
    model.update_router_bias(load)
    moes = model.moe_layers()
    assert len(moes) == 3  # two main layers + the MTP block
    for moe, row in zip(moes, load):
        assert torch.equal(moe.gate.e_score_correction_bias, 0.01 * torch.sign(row.mean() - row))
    with pytest.raises(ValueError, match="expert_load"):
        model.update_router_bias(load[:2])
    # closed loop on a deliberately skewed router: the bias update evens out the load
    gate = moes[0].gate
    x = torch.randn(600, cfg.hidden_size)
    x[:, 0] = 1.0  # a constant feature that the router weighs very differently per expert
    with torch.no_grad():
        gate.e_score_correction_bias.zero_()
        gate.weight[:, 0] = torch.linspace(-2.0, 2.0, cfg.n_routed_experts)

    def imbalance():
        ids = gate(x)[0]
        counts = torch.bincount(ids.flatten(), minlength=cfg.n_routed_experts).float()
        return (counts.max() / counts.mean()).item(), counts
    before, _ = imbalance()
    history = []
    for _ in range(60):
        gate.update_bias(imbalance()[1], 0.01)
        history.append(imbalance()[0])
    # a fixed-size sign step oscillates around balance, so judge the last 20 steps' mean, not the final step:
    # over seeds 0-59 it lies in [1.22, 1.76] while the skewed start is 3.0
    after = sum(history[-20:]) / 20
    assert before > 2.5 and after < 2.0, (before, after)


def test_sequence_balance_loss_per_document():
    torch.manual_seed(3)
    cfg = _cfg(first_k_dense_replace=0, num_hidden_layers=1, num_nextn_predict_layers=0)
    model = build_model(cfg)
    batch = packed_batch(cfg.vocab_size, [5, 11, 8], seed=4)
    moe: MoE = model.layers[0].ffn
    ctx = model._context(batch, batch.num_targets())
    x = torch.randn(batch.num_tokens, cfg.hidden_size)
    _, aux, _ = moe(x, ctx)
    ids, _, scores = moe.gate(x)
    e, k, total = cfg.n_routed_experts, cfg.num_experts_per_tok, 0.0
    cu = batch.cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        n = b - a
        s = scores[a:b].double()
        f = [e / (k * n) * (ids[a:b] == i).sum().item() for i in range(e)]
        p = (s / s.sum(1, keepdim=True)).mean(0)
        total += sum(fi * pi for fi, pi in zip(f, p.tolist())) * (n - 1) / batch.num_targets()
    assert math.isclose(aux.item(), total, rel_tol=1e-5)


def test_z_loss_is_mean_squared_lse_over_labelled_tokens():
    cfg = _cfg(num_nextn_predict_layers=0, num_hidden_layers=2)
    model = build_model(cfg)
    seen = []

    def recording(q, k, v, cu, mx, **kw):
        out, lse = mla_attention(q, k, v, cu, mx, **kw)
        seen.append(lse.detach().double())
        return out, lse
    for layer in model.layers:
        layer.attn.core_attention = recording
    batch = packed_batch(cfg.vocab_size, [6, 9], seed=5)
    z = model(batch).metrics["z_loss"]
    keep = batch.labels != IGNORE_INDEX
    want = sum(lse.pow(2).mean(0)[keep].mean() for lse in seen) / len(seen)
    assert math.isclose(z.item(), want.item(), rel_tol=1e-5)


@pytest.mark.parametrize("qk_norm", ["none", "head", "layer"])
def test_mla_queries_and_keys_follow_the_formulas(qk_norm):
    """q / k handed to the attention, rebuilt in float64: QK-Norm on the whole head (nope + rope parts) BEFORE
    RoPE, the RoPE key k_pe one vector for all heads (before any QK-Norm), interleaved pairs, cos / sin scaled by
    YaRN's attention factor (0.1 * mscale * ln(factor) + 1) / (0.1 * mscale_all_dim * ln(factor) + 1), YaRN's
    softmax scale qk_head_dim**-0.5 * (0.1 * mscale_all_dim * ln(factor) + 1)**2."""
    from moela.model import RopeScaling

    torch.manual_seed(7)
    rs = RopeScaling(factor=4.0, original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=0.8)
    factor = (0.1 * 1.0 * math.log(4.0) + 1) / (0.1 * 0.8 * math.log(4.0) + 1)  # != 1: a wrong factor shows
    cfg = _cfg(qk_norm=qk_norm, rope_scaling=rs, num_hidden_layers=1, first_k_dense_replace=1,
               num_nextn_predict_layers=0)
    model = build_model(cfg)
    attn = model.layers[0].attn
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    seen = {}

    def recording(q, k, v, cu, mx, **kw):
        seen.update(q=q.detach().double(), k=k.detach().double(), v=v.detach().double(), scale=kw["softmax_scale"],
                    v_contiguous=v.is_contiguous())
        return mla_attention(q, k, v, cu, mx, **kw)
    attn.core_attention = recording
    batch = packed_batch(cfg.vocab_size, [5, 13], seed=8)
    ctx = model._context(batch, batch.num_targets())
    x = torch.randn(batch.num_tokens, cfg.hidden_size, dtype=torch.float64)
    attn(x.float(), ctx)

    def rms(v, w, eps):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w.double()

    def rotate(v):  # [T, H, R], DeepSeek's interleaved pairs (x[2i], x[2i+1])
        ang = batch.position_ids.double()[:, None] * ctx.inv_freq.double()[None, :]  # [T, R/2]
        cos, sin = ang.cos()[:, None] * factor, ang.sin()[:, None] * factor
        v0, v1 = v[..., 0::2], v[..., 1::2]
        return torch.stack((v0 * cos - v1 * sin, v1 * cos + v0 * sin), -1).flatten(-2)

    t, h, dn, r = x.shape[0], cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    w = {n: p.detach().double() for n, p in attn.named_parameters()}
    q = rms(x @ w["wq_a.weight"].t(), w["q_norm.weight"], 1e-6) @ w["wq_b.weight"].t()
    q = q.view(t, h, dn + r)  # [T, H, Dqk]
    kv_a = x @ w["wkv_a.weight"].t()  # [T, C + R]
    kv = rms(kv_a[:, :cfg.kv_lora_rank], w["kv_norm.weight"], 1e-6) @ w["wkv_b.weight"].t()
    k_nope = kv.view(t, h, -1)[..., :dn]  # [T, H, Dn]
    k = torch.cat((k_nope, kv_a[:, None, cfg.kv_lora_rank:].expand(t, h, r)), -1)  # [T, H, Dqk]
    eps = cfg.rms_norm_eps
    if qk_norm == "head":
        q, k = rms(q, w["q_qk_norm.weight"], eps), rms(k, w["k_qk_norm.weight"], eps)
    elif qk_norm == "layer":
        q = rms(q.reshape(t, -1), w["q_qk_norm.weight"], eps).view(t, h, -1)
        k = rms(k.reshape(t, -1), w["k_qk_norm.weight"], eps).view(t, h, -1)
    q = torch.cat((q[..., :dn], rotate(q[..., dn:])), -1)
    k = torch.cat((k[..., :dn], rotate(k[..., dn:])), -1)
    torch.testing.assert_close(seen["q"], q, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(seen["k"], k, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(seen["v"], kv.view(t, h, -1)[..., dn:], rtol=1e-4, atol=1e-5)
    assert seen["v_contiguous"]
    if qk_norm == "none":
        assert torch.equal(seen["k"][:, :1, dn:].expand(t, h, r), seen["k"][..., dn:])  # k_pe shared by the heads
    assert math.isclose(seen["scale"], (dn + r) ** -0.5 * (0.1 * 0.8 * math.log(4.0) + 1) ** 2, rel_tol=1e-12)


@pytest.mark.parametrize("kind", ["fal", "fal_plus"])
def test_fal_blocks_follow_the_formulas(kind):
    torch.manual_seed(4)
    cfg = _cfg(block=kind, first_k_dense_replace=1)
    model = build_model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    batch = packed_batch(cfg.vocab_size, [8, 5], seed=6)
    ctx = model._context(batch, batch.num_targets())
    x1 = torch.randn(batch.num_tokens, cfg.hidden_size)
    b1, b2, b3 = model.layers

    def attn(blk, x):
        return blk.attn(x, ctx)[0]

    def mlp(blk, x):
        return blk.ffn(x) if not isinstance(blk.ffn, MoE) else blk.ffn(x, ctx)[0]
    with torch.no_grad():
        x2, a1, *_ = b1(x1, ctx)
        assert torch.allclose(a1, attn(b1, b1.attn_norm(x1)))
        h = x1 + a1
        assert torch.allclose(x2, h + mlp(b1, b1.ffn_norm(h)))
        x3, a1_out, *_ = b2(x2, ctx, a1)
        assert a1_out is a1
        if kind == "fal":
            want = x2 + attn(b2, b2.attn_norm(x2)) + mlp(b2, b2.ffn_norm(x2) + b2.a1_norm(a1))
        else:
            h = x2 + attn(b2, b2.attn_norm(x2))
            want = h + mlp(b2, b2.ffn_norm(h + b2.a1_norm(a1)))
        assert torch.allclose(x3, want, atol=1e-5)


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

    def run(attn_backend, moe_backend):
        monkeypatch.setitem(attention_mod.Q_ROPE, "mode", "cat" if attn_backend == "reference" else "in_place")
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
