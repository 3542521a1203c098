"""The network: embedding -> blocks -> norm -> head, plus DeepSeek-V3 multi-token prediction (MTP), on a flat
packed batch. `build_model` makes one on the meta device, materializes it with `to_empty`, then `init_weights`.

Decisions:
- The objective is token-mean over this micro-batch's labelled tokens, but every term is written as
  (sum over tokens or documents) / num_targets, so the trainer's weighting by num_targets / global targets gives
  exactly the single-process objective under gradient accumulation and data parallelism:
      loss = lm + mtp_loss_weight * mtp + aux_loss_coef * aux + z_loss_coef * z
  lm = sum CE / num_targets; mtp = mean over depths of (sum CE_d / num_targets); aux = sum over MoE layers of the
  document-weighted balance loss; z = mean over attention layers of the labelled-token mean of mean_h lse**2.
- MTP (depth D = num_nextn_predict_layers): depth d sees h^{d-1} and the embedding of the token d steps ahead,
  h^d = Block_d(eh_proj([enorm(emb); hnorm(h^{d-1})])), and predicts the token d + 1 steps ahead through
  `mtp.{d}.norm` and the shared output head. As where DeepSeek's MTP weights are used for speculative
  decoding (vLLM's `deepseek_mtp`), h^0 is the main stack's output AFTER the final norm, h^d (d >= 1) the
  MTP block's output before its norm, and the concatenation order is [emb; h]. Tokens and labels are shifted
  WITHIN each document: a position whose shifted token would come from the next document gets label
  IGNORE_INDEX (and a filler input token, which causal attention only lets later positions of the same document
  see, and those carry no label either).
- MTP blocks are standard blocks whose FFN kind copies the last main layer (MoE in DeepSeek-V3); their expert load
  rows follow the main MoE layers in `expert_load`, and `update_router_bias` updates them too. An MTP block's
  residual stream is in the main stack's dtype (the embedding's), not its input projection's (bf16 under
  autocast), so it adds its residuals as the main blocks do and a compiled MTP block reuses their graphs.
- Tied embeddings use `embed.weight` directly for the logits (no `head` module), so the tie survives `to_empty`.
- Initialization: every matrix ~ N(0, initializer_range), norms 1, router bias 0 (DeepSeek-V3 uses std 0.006).
  A module that replaces a part from outside (e.g. expert parallelism) may define `init_weights(std)`; it is
  called instead of the built-in rule for that module.
- Context parallelism attaches itself as `context_parallel`, a module without parameters whose
  `split(batch, mtp_targets) -> BatchPart` gives this rank's part of every batch and the `PackedContext` seams
  for it; the MTP targets are computed on the whole batch first, since a token's successors may sit on another
  rank. Without it (None), the model runs on the whole batch.
- Tensor parallelism attaches itself as `tensor_parallel` (`moela.parallel.tensor_parallel`): its `split` pads
  the batch (after the context-parallel split) to a multiple of the group size and gives each rank its rows of
  the residual stream, its `ce_sum` is the vocabulary-parallel loss, and `head_mean` completes the z-loss's mean
  over heads spread over the group.

Shapes: T tokens, D hidden, V vocabulary, N documents, E routed experts, L_moe MoE blocks (main + MTP).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from moela.batch import IGNORE_INDEX, PackedBatch
from moela.model.block import Block
from moela.model.config import ModelConfig
from moela.model.layers import BatchPart, Linear, PackedContext, RMSNorm, segment_sum
from moela.model.moe import Gate, MoE, RoutedExperts
from moela.model.output import ModelOutput
from moela.ops.linear_cross_entropy import linear_cross_entropy
from moela.ops.loss import cross_entropy
from moela.ops.rope import yarn_inv_freq


class MTPModule(nn.Module):
    """One MTP depth: h_d = Block(eh_proj([enorm(emb(next token)); hnorm(h_{d-1})]))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * d, d, cfg.fp8_linears)
        self.block = Block(cfg, moe=cfg.mtp_is_moe)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, ctx: PackedContext):
        """h, emb [T, D] -> (h_d [T, D], norm(h_d) [T, D], z, aux, load). The block's residual stream is in emb's
        dtype (the module docstring)."""
        x = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(h)), dim=-1)).to(emb.dtype)  # [T, D]
        x, _, z, aux, load = self.block(x, ctx)
        return x, self.norm(x), z, aux, load


def shift_within_docs(x: torch.Tensor, doc_last: torch.Tensor, fill: int) -> torch.Tensor:
    """y[i] = x[i+1], or `fill` where i is the last token of its document. x, doc_last [T] -> [T]."""
    nxt = torch.cat((x[1:], x.new_full((1,), fill)))  # [T]
    return torch.where(doc_last, torch.full_like(x, fill), nxt)


def mtp_targets(batch: PackedBatch, depth: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per MTP depth d = 1..depth, (input token [T], label [T]) of every position: the batch's tokens and labels
    shifted d steps within their document (a filler token 0 and IGNORE_INDEX past the document's end)."""
    doc_last = torch.zeros(batch.num_tokens, dtype=torch.bool, device=batch.input_ids.device)
    doc_last.index_fill_(0, (batch.cu_seqlens[1:] - 1).long(), True)  # [T]; a scalar fill, no host-to-device copy
    tokens, labels, out = batch.input_ids, batch.labels, []
    for _ in range(depth):
        tokens = shift_within_docs(tokens, doc_last, 0)  # [T]
        labels = shift_within_docs(labels, doc_last, IGNORE_INDEX)  # [T]
        out.append((tokens, labels))
    return out


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Block(cfg, moe=i >= cfg.first_k_dense_replace,
                  kind="standard" if i == 0 else cfg.block, keeps_a1=(i == 0 and cfg.block != "standard"))
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.mtp = nn.ModuleList(MTPModule(cfg) for _ in range(cfg.num_nextn_predict_layers))
        self.register_buffer("inv_freq", torch.empty(cfg.qk_rope_head_dim // 2, dtype=torch.float32),
                             persistent=False)
        # set by context parallelism (moela.parallel.context_parallel): splits every batch over its group
        self.context_parallel: nn.Module | None = None
        # set by tensor parallelism (moela.parallel.tensor_parallel): sequence-shards every batch, vocab-parallel loss
        self.tensor_parallel: nn.Module | None = None

    # ----- construction -----
    def part_names(self) -> list[str]:
        """The top-level parts of the whole model, in a fixed order: what `init_weights` seeds one by one and
        what pipeline stages divide (`moela.parallel.pp_stage`)."""
        cfg = self.cfg
        return (["embed"] + [f"layers.{i}" for i in range(cfg.num_hidden_layers)] + ["norm", "head"]
                + [f"mtp.{d}" for d in range(cfg.num_nextn_predict_layers)])

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialize every part from a generator seeded by one draw of the global one plus the part's index in
        `part_names`: a pipeline stage holding some parts initializes them exactly as the whole model does."""
        base = int(torch.randint(0, 2**62, ()))
        for index, name in enumerate(self.part_names()):
            part = self._part(name)
            if part is None:
                continue
            cuda = sorted({p.device.index or 0 for p in part.parameters() if p.device.type == "cuda"})
            with torch.random.fork_rng(devices=cuda):
                torch.manual_seed(base + index)
                self._init_part(part)
        self.inv_freq.copy_(self._inv_freq())

    def _part(self, name: str) -> nn.Module | None:
        """The part `name` of `part_names`, or None where this model (a pipeline stage) does not hold it."""
        owner, _, key = name.rpartition(".")
        container = self.get_submodule(owner) if owner else self
        if isinstance(container, nn.ModuleDict):
            return container[key] if key in container else None
        if isinstance(container, nn.ModuleList):
            return container[int(key)] if int(key) < len(container) else None
        return getattr(container, key, None)

    def _init_part(self, part: nn.Module) -> None:
        std = self.cfg.initializer_range
        for m in part.modules():
            if callable(getattr(m, "init_weights", None)):
                m.init_weights(std)
            elif isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
            elif isinstance(m, Gate):
                nn.init.normal_(m.weight, mean=0.0, std=std)
                m.e_score_correction_bias.zero_()
            elif isinstance(m, RoutedExperts):
                nn.init.normal_(m.w13, mean=0.0, std=std)
                nn.init.normal_(m.w2, mean=0.0, std=std)

    def _inv_freq(self) -> torch.Tensor:
        cfg, rs = self.cfg, self.cfg.rope_scaling
        if rs is None:
            return yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta)
        return yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, factor=rs.factor,
                             original_max_position_embeddings=rs.original_max_position_embeddings,
                             beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, truncate=rs.truncate)

    def blocks(self) -> list[Block]:
        """The main blocks this model holds, in order (a pipeline stage holds some, in a ModuleDict keyed by their
        index in the whole model, so that parameter names stay those of the whole model)."""
        return list(self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers)

    def mtp_modules(self) -> list[MTPModule]:
        return list(self.mtp.values() if isinstance(self.mtp, nn.ModuleDict) else self.mtp)

    def moe_layers(self) -> list[MoE]:
        """MoE FFNs in `expert_load` row order: main layers, then MTP blocks."""
        blocks = self.blocks() + [m.block for m in self.mtp_modules()]
        return [b.ffn for b in blocks if isinstance(b.ffn, MoE)]

    @torch.no_grad()
    def update_router_bias(self, expert_load: torch.Tensor | None, enabled: torch.Tensor | None = None) -> None:
        """Sign-based aux-loss-free bias update from expert_load [L_moe, E] (already summed over ranks); `enabled`
        (a 0-d bool device tensor, e.g. the step's finite flag) applies it or not without a host read."""
        moes = self.moe_layers()
        if not moes:
            return
        if expert_load is None or expert_load.shape != (len(moes), self.cfg.n_routed_experts):
            got = None if expert_load is None else tuple(expert_load.shape)
            raise ValueError(f"update_router_bias: expert_load must be [L_moe, E] = "
                             f"[{len(moes)}, {self.cfg.n_routed_experts}], got {got}; pass ModelOutput.expert_load "
                             f"summed over the step's micro-batches")
        for moe, load in zip(moes, expert_load):
            moe.gate.update_bias(load, self.cfg.bias_update_rate, enabled)

    # ----- forward -----
    def _context(self, batch: PackedBatch, num_targets: int | torch.Tensor, part: BatchPart | None = None
                 ) -> PackedContext:
        """The batch's context; with `part` (this rank's share of a split batch), its seams too. The document
        dimension (cu_seqlens, doc_weight) is marked dynamic for torch.compile: it changes every micro-batch, the
        token count of a padded batch does not (`moela.batch.pad_batch`)."""
        t, cu = batch.num_tokens, batch.cu_seqlens
        lengths = (cu[1:] - cu[:-1]).long()  # [N]
        doc_ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths,
                                          output_size=t)  # [T]
        token_weight = (batch.labels != IGNORE_INDEX).float() / _at_least_one(num_targets)  # [T]
        doc_weight = segment_sum(token_weight, doc_ids, lengths.numel())  # [N]
        for x in (cu, doc_weight):
            torch._dynamo.maybe_mark_dynamic(x, 0)
        seams = {} if part is None else dict(attend=part.attend, real_tokens=part.real_tokens,
                                             reduce_doc_stats=part.reduce_doc_stats)
        if part is not None and part.rows is not None:
            doc_ids = doc_ids[part.rows]  # [T_rows]
        if batch.filler_tokens is not None:
            if part is not None:
                raise ValueError("a padded batch (pad_batch, train.compile) cannot be split by context or tensor "
                                 "parallelism; set train.compile: false with parallel.cp > 1 or parallel.tp > 1")
            seams["real_tokens"] = torch.arange(t, device=cu.device) < t - batch.filler_tokens  # [T]
        return PackedContext(position_ids=batch.position_ids, cu_seqlens=cu, max_seqlen=batch.max_seqlen,
                             doc_ids=doc_ids, token_weight=token_weight, doc_weight=doc_weight,
                             inv_freq=self.inv_freq, **seams)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Normalized hidden states [T, D] -> logits [T, V]."""
        return self.head(h) if self.head is not None else F.linear(h, self.embed.weight)

    def _ce_sum(self, h: torch.Tensor, labels: torch.Tensor, want_logits: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Summed CE of normalized h [T, D] against labels [T]; through the fused head + loss unless the logits
        are wanted (then also returns them, [T, V])."""
        if self.tensor_parallel is not None:
            weight = self.head.weight if self.head is not None else self.embed.weight  # [V / tp, D] shard
            return self.tensor_parallel.ce_sum(h, weight, labels, want_logits)
        if want_logits:
            logits = self.logits(h)  # [T, V]
            return cross_entropy(logits, labels), logits
        weight = self.head.weight if self.head is not None else self.embed.weight  # [V, D]
        return linear_cross_entropy(h, weight, labels), None

    def prepare(self, batch: PackedBatch) -> Prepared:
        """This rank's part of `batch` (context and tensor parallelism split it), its MTP targets, labelled-token
        count and `PackedContext`: what every piece of the forward reads (and every pipeline stage makes for
        itself from its own copy of the micro-batch)."""
        targets = mtp_targets(batch, self.cfg.num_nextn_predict_layers)
        part = None
        if self.context_parallel is not None:
            part = self.context_parallel.split(batch, targets)
            batch, targets = part.batch, part.mtp_targets
        if self.tensor_parallel is not None:
            part = self.tensor_parallel.split(batch, targets, part)
            batch, targets = part.batch, part.mtp_targets
        # known on the host unless a context-parallel shard counts its own (then a device count: no host read)
        num_targets = batch.targets_on_host
        if num_targets is None:
            num_targets = (batch.labels != IGNORE_INDEX).sum()
        return Prepared(batch, targets, num_targets, self._context(batch, num_targets, part))

    def metric_keys(self) -> list[str]:
        """The detached statistics every forward reports (`ModelOutput.metrics`), in order."""
        cfg = self.cfg
        has_moe = cfg.num_hidden_layers > cfg.first_k_dense_replace or (cfg.num_nextn_predict_layers > 0
                                                                          and cfg.mtp_is_moe)
        return (["lm_loss"] + ["mtp_loss"] * (cfg.num_nextn_predict_layers > 0) + ["aux_loss"] * has_moe
                + ["z_loss"] * (cfg.z_loss_coef > 0))

    def objective(self, denom: int | torch.Tensor, *, lm_sum: torch.Tensor | None = None,
                  mtp_sum: torch.Tensor | None = None, auxs: list[torch.Tensor] = (),
                  zs: list[torch.Tensor] = ()) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, metrics) from summed terms: the whole objective when given every term, else the share of the
        terms given (a pipeline stage's). Every term is linear in its sums, so the stages' losses and metrics add
        up to the whole model's: z is the sum over attention layers divided by the whole model's count."""
        cfg = self.cfg
        zero = torch.zeros((), device=self.inv_freq.device)
        terms = {"lm_loss": zero if lm_sum is None else lm_sum / denom,
                 "mtp_loss": zero if mtp_sum is None else mtp_sum / (denom * max(cfg.num_nextn_predict_layers, 1)),
                 "aux_loss": torch.stack(list(auxs)).sum() if auxs else zero}
        z = torch.stack(list(zs)).sum() / (cfg.num_hidden_layers + cfg.num_nextn_predict_layers) if zs else zero
        if self.tensor_parallel is not None and zs:
            z = self.tensor_parallel.head_mean(z)
        terms["z_loss"] = z
        loss = (terms["lm_loss"] + cfg.mtp_loss_weight * terms["mtp_loss"]
                + (cfg.aux_loss_coef * terms["aux_loss"] if cfg.aux_loss_coef > 0 else 0.0)
                + (cfg.z_loss_coef * z if cfg.z_loss_coef > 0 else 0.0))
        return loss, {k: terms[k].detach() for k in self.metric_keys()}

    def forward(self, batch: PackedBatch, *, return_logits: bool = False) -> ModelOutput:
        """The objective on `batch` (under context parallelism: on this rank's part of it, see the module
        docstring); `return_logits` also returns the main head's logits."""
        prep = self.prepare(batch)
        batch, ctx, denom = prep.batch, prep.ctx, _at_least_one(prep.num_targets)
        h = self.embed(batch.input_ids)  # [T, D]
        a1 = None
        zs, auxs, loads = [], [], []
        for layer in self.blocks():
            h, a1, z, aux, load = layer(h, ctx, a1)
            zs.append(z)
            if load is not None:
                auxs.append(aux)
                loads.append(load)
        h = self.norm(h)  # [T, D]; also MTP depth 1's input h^0
        lm_sum, logits = self._ce_sum(h, batch.labels, return_logits)
        mtp_sum = None
        for module, (tokens, labels) in zip(self.mtp_modules(), prep.mtp_targets):  # [T], [T]
            h, normed, z, aux, load = module(h, self.embed(tokens), ctx)  # [T, D] x 2
            zs.append(z)
            if load is not None:
                auxs.append(aux)
                loads.append(load)
            ce = self._ce_sum(normed, labels, False)[0]
            mtp_sum = ce if mtp_sum is None else mtp_sum + ce
        loss, metrics = self.objective(denom, lm_sum=lm_sum, mtp_sum=mtp_sum, auxs=auxs, zs=zs)
        return ModelOutput(loss=loss, num_targets=prep.num_targets, metrics=metrics,
                           expert_load=torch.stack(loads).detach() if loads else None,
                           logits=logits)


class Prepared(NamedTuple):
    """`Transformer.prepare`'s result: this rank's batch, its MTP (input token, label) pairs per depth, its
    labelled-token count (a host int or a 0-d device tensor) and its `PackedContext`."""

    batch: PackedBatch
    mtp_targets: list[tuple[torch.Tensor, torch.Tensor]]
    num_targets: int | torch.Tensor
    ctx: PackedContext


def _at_least_one(n: int | torch.Tensor) -> int | torch.Tensor:
    return n.clamp_min(1) if isinstance(n, torch.Tensor) else max(n, 1)


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *,
                parallelize: Callable[[Transformer], object] | None = None) -> Transformer:
    """Build on the meta device, materialize on `device` with `to_empty`, then `init_weights` (torchtitan order).
    `parallelize(model)` runs on the meta model before materialization (sharding, expert parallelism), so only
    this rank's shards are ever allocated."""
    errors = cfg.validate()
    if errors:
        raise ValueError("invalid model config:\n  " + "\n  ".join(errors))
    with torch.device("meta"):
        model = Transformer(cfg)
    if dtype != torch.float32:
        model.to(dtype=dtype)
        for m in model.modules():  # the router bias and RoPE frequencies stay float32
            if isinstance(m, Gate):
                m.e_score_correction_bias = m.e_score_correction_bias.float()
        model.inv_freq = model.inv_freq.float()
    if parallelize is not None:
        parallelize(model)
    model.to_empty(device=device)
    model.init_weights()
    return model
