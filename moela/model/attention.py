"""Multi-head Latent Attention (DeepSeek-V2/V3) on the flat packed layout, with optional QK-Norm and z-loss.

q path:  x -> wq_a -> q_norm -> wq_b  (LoRA, `q_lora_rank` set)  or  x -> wq  (`q_lora_rank: null`)
kv path: x -> wkv_a -> [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)];  c_kv -> kv_norm -> wkv_b -> [k_nope | v]
Each head's key is [k_nope_h ; k_pe]: the RoPE part `k_pe` is one vector shared by all heads (decoupled RoPE).

Decisions:
- RoPE angles come from the batch's `position_ids` (restart per document); pairs are interleaved as in DeepSeek's
  checkpoints. YaRN (`rope_scaling`) changes the frequencies, scales cos/sin by HF's `attention_factor`
  (mscale / mscale_all_dim ratio, 1 for DeepSeek's configs) and multiplies the softmax scale by
  yarn_mscale(factor, mscale_all_dim)**2, exactly as HF `deepseek_v3` does, so exported models agree.
- QK-Norm (`qk_norm`) acts on the full q / k (nope and rope parts) before RoPE: `head` = RMSNorm over each head's
  Dqk dims (one weight [Dqk] shared by the heads, Qwen3 style), `layer` = RMSNorm over all heads concatenated
  (weight [H*Dqk], OLMo2 style). Both normalize k_pe together with each head's k_nope, so with QK-Norm on the
  RoPE part of the key differs per head (it is shared only without QK-Norm). The latent norms `q_norm` /
  `kv_norm` use eps 1e-6 as DeepSeek and HF do.
- The attention op is `self.core_attention` (`mla_attention` with the configured backend and the kernel of each
  phase, `model.kernels`, as keyword arguments); the batch's context
  applies it (`ctx.attend`): on this rank's own tokens, or under context parallelism on the keys of the whole
  group. When the z-loss is on, the differentiable lse [H, T] is requested and reduced here to
  sum_t token_weight[t] * mean_h lse[h, t]**2, i.e. the mean over labelled tokens.
- Tensor parallelism (`moela.parallel.tensor_parallel`) changes three attributes from outside: `n_heads` (the
  heads this rank holds), `gather_latents` (the latents [q input | c_kv | k_pe] are computed on this rank's
  tokens and all-gathered in one collective; a no-op by default) and `layer_qk_norm` (`qk_rms_norm` over the
  heads of the whole group). Everything after the gather runs on all tokens with this rank's heads.
- On CUDA the query's RoPE part is rotated in place in the projection's output, and its gradient rotated back in
  place (`moela.ops.rope_triton.rope_columns_`): no [T, H, Dqk] cat in either pass. Elsewhere (the CPU) the query
  is split, rotated and concatenated again.
- In a compiled block both are ops of the block's graph: the rotation a mutating torch.library op, the attention
  the op pair of `moela.ops.attention.graph` whenever a backend with separate forward and backward kernels can run
  it (flash-attn-4 or moela's kernels; `traces_in_graph`), so a block compiles as one graph instead of five
  pieces.

Shapes: T tokens, D hidden, H heads, Dqk = qk_nope_head_dim + qk_rope_head_dim, Dv = v_head_dim,
R = qk_rope_head_dim, C = kv_lora_rank.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from moela.model.config import ModelConfig
from moela.model.layers import Linear, PackedContext, RMSNorm, call_op
from moela.ops.attention import mla_attention
from moela.ops.attention.api import DISPATCH as ATTENTION_DISPATCH
from moela.ops.attention.graph import mla_attention_in_graph, traces_in_graph
from moela.ops.qk_norm import qk_rms_norm
from moela.ops.rope import rope, yarn_mscale

try:
    from moela.ops.rope_triton import rope_columns_
except ImportError:  # no triton on this platform: the out-of-place RoPE of the query
    rope_columns_ = None

LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: ModelConfig) -> float:
    scale = cfg.qk_head_dim ** -0.5
    rs = cfg.rope_scaling
    if rs is not None and rs.mscale_all_dim:
        scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
    return scale


def rope_attention_factor(cfg: ModelConfig) -> float:
    """HF's YaRN `attention_factor`, the scale of cos / sin."""
    rs = cfg.rope_scaling
    if rs is None:
        return 1.0
    if rs.attention_factor is not None:
        return rs.attention_factor
    if rs.mscale and rs.mscale_all_dim:
        return yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    return yarn_mscale(rs.factor)


def rotate_q_in_place(q: torch.Tensor) -> bool:
    """Whether the query's RoPE part is rotated in place (`rope_columns_`, module docstring): on CUDA, by default."""
    return q.is_cuda and rope_columns_ is not None


def keep_latents(*latents: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`MLA.gather_latents` of a rank that holds every token: nothing to gather."""
    return latents


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = cfg.qk_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.q_lora_rank = cfg.q_lora_rank
        h, d, fp8 = self.n_heads, cfg.hidden_size, cfg.fp8_linears
        if self.q_lora_rank is None:
            self.wq = Linear(d, h * self.qk_dim, fp8)
        else:
            self.wq_a = Linear(d, self.q_lora_rank, fp8)
            self.q_norm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = Linear(self.q_lora_rank, h * self.qk_dim, fp8)
        self.wkv_a = Linear(d, self.kv_lora_rank + self.rope_dim, fp8)
        self.kv_norm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = Linear(self.kv_lora_rank, h * (self.nope_dim + self.v_dim), fp8)
        self.wo = Linear(h * self.v_dim, d, fp8)
        self.qk_norm_kind = cfg.qk_norm
        if cfg.qk_norm == "head":
            self.q_qk_norm = RMSNorm(self.qk_dim, cfg.rms_norm_eps)
            self.k_qk_norm = RMSNorm(self.qk_dim, cfg.rms_norm_eps)
        elif cfg.qk_norm == "layer":
            self.q_qk_norm = RMSNorm(h * self.qk_dim, cfg.rms_norm_eps)
            self.k_qk_norm = RMSNorm(h * self.qk_dim, cfg.rms_norm_eps)
        self.softmax_scale = softmax_scale(cfg)
        self.attention_factor = rope_attention_factor(cfg)
        self.z_loss = cfg.z_loss_coef > 0
        self.attention_backend = cfg.attention_backend
        self.kernels = dict(forward_kernel=cfg.kernels.attention_forward, dq_kernel=cfg.kernels.attention_dq,
                            dkdv_kernel=cfg.kernels.attention_dkdv)  # mla_attention's keyword arguments
        self.core_attention = functools.partial(mla_attention, backend=cfg.attention_backend, **self.kernels)
        self.gather_latents = keep_latents  # tensor parallelism's seams (module docstring)
        self.layer_qk_norm = qk_rms_norm

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, h = q.shape[:2]
        if self.qk_norm_kind == "head":
            return self.q_qk_norm(q), self.k_qk_norm(k)  # [T, H, Dqk]
        q, k = self.layer_qk_norm(q.reshape(t, h * self.qk_dim), k.reshape(t, h * self.qk_dim),
                                  self.q_qk_norm.weight, self.k_qk_norm.weight, self.q_qk_norm.eps)  # [T, H*Dqk]
        return q.view(t, h, self.qk_dim), k.view(t, h, self.qk_dim)  # [T, H, Dqk]

    def _attention(self, q: torch.Tensor, *args, **kwargs):
        """`core_attention` as a compiled block calls it: the graph's op pair where a kernel backend can run it, else
        `call_op` (a graph break for the backends Dynamo cannot trace)."""
        if torch.compiler.is_compiling() and traces_in_graph(
                q.device.type, q.device.index, q.dtype, self.qk_dim, self.v_dim,
                kwargs.get("alibi_slopes") is not None, self.attention_backend):
            return mla_attention_in_graph(q, *args, backend=self.attention_backend, **self.kernels, **kwargs)
        return call_op(self.core_attention, ATTENTION_DISPATCH, q, *args, **kwargs)

    def forward(self, x: torch.Tensor, ctx: PackedContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (out [T, D], z [] = token-weighted mean_h lse**2, zero when the z-loss is off)."""
        q_in = x if self.q_lora_rank is None else self.q_norm(self.wq_a(x))  # [T, D] or [T, Cq]
        c_kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)  # [T, C], [T, R]
        q_in, c_kv, k_pe = self.gather_latents(q_in, self.kv_norm(c_kv), k_pe)
        q = self.wq(q_in) if self.q_lora_rank is None else self.wq_b(q_in)  # [T, H*Dqk]
        t, h = q.shape[0], self.n_heads
        q = q.view(t, h, self.qk_dim)  # [T, H, Dqk]
        kv = self.wkv_b(c_kv).view(t, h, self.nope_dim + self.v_dim)  # [T, H, Dn + Dv]
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [T, H, Dn], [T, H, Dv]
        k_pe = k_pe.unsqueeze(1)  # [T, 1, R]
        if self.qk_norm_kind != "none":
            k = torch.cat((k_nope, k_pe.expand(t, h, self.rope_dim)), dim=-1)  # [T, H, Dqk]
            q, k = self._qk_norm(q, k)
            k_nope, k_pe = k.split([self.nope_dim, self.rope_dim], dim=-1)  # [T, H, Dn], [T, H, R]
        k_pe = rope(k_pe, ctx.position_ids, ctx.inv_freq, attention_factor=self.attention_factor)  # [T, 1|H, R]
        k = torch.cat((k_nope, k_pe.expand(t, h, self.rope_dim)), dim=-1)  # [T, H, Dqk]
        if rotate_q_in_place(q):  # traced into a compiled block's graph
            q = rope_columns_(q, ctx.position_ids, ctx.inv_freq, self.nope_dim,
                              attention_factor=self.attention_factor)  # [T, H, Dqk], q's storage
        else:
            q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)  # [T, H, Dn], [T, H, R]
            q_pe = rope(q_pe, ctx.position_ids, ctx.inv_freq, attention_factor=self.attention_factor)  # [T, H, R]
            q = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, Dqk]
        res = ctx.attend(self._attention, q, k, v.contiguous(), ctx.cu_seqlens, ctx.max_seqlen, causal=True,
                         softmax_scale=self.softmax_scale, return_lse=self.z_loss)
        if self.z_loss:
            out, lse = res  # [T, H, Dv], [H, T]
            z = (lse.float().pow(2).mean(0) * ctx.token_weight).sum()  # []
        else:
            out, z = res, x.new_zeros((), dtype=torch.float32)
        return self.wo(out.reshape(t, h * self.v_dim)), z  # [T, D]
