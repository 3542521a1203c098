"""Each layer of the model against its formula, computed independently: DeepSeek's group-limited routing and its
bias (selection without weighting, the sign-based update), the per-document balance loss, the z-loss, MLA's queries
and keys (LoRA, decoupled RoPE, YaRN, QK-Norm), and the FAL / FAL+ blocks."""

import math

import pytest
import torch

from factories import packed_batch, tiny_config
from moela.batch import IGNORE_INDEX
from moela.model import build_model
from moela.model.moe import MoE
from moela.ops.attention import mla_attention

# the tiny test model with three heads, six experts (three groups possible) and head dims that differ
MODEL = dict(vocab_size=101, hidden_size=40, intermediate_size=56, n_routed_experts=6, q_lora_rank=20,
             qk_rope_head_dim=6, v_head_dim=10, num_attention_heads=3, aux_loss_coef=0.01, z_loss_coef=1e-3)


def _cfg(**kw):
    return tiny_config(**{**MODEL, **kw})


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
