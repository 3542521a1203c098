"""The `triton` backend of `router_topk` (see moela.ops.router): the forward kernel, its launcher, the torch backward,
and the `torch.library` custom op that holds them together for autograd and torch.compile.

Shapes: T tokens, E routed experts (E_PAD: next power of two), G groups, K experts per token.
"""

import torch
import triton
import triton.language as tl

NUM_WARPS = 4
TILE_ELEMENTS = 2048  # [BLOCK_T, E_PAD] scores per program: 16 float32 registers a thread per live tile at 4 warps;
# ptxas for sm_90: 80-128 registers, no spills, at E = 32 / 64 / 256 (twice the tile reaches 255 at E = 256)


@triton.jit
def _router_fwd_kernel(LOGITS, BIAS, SCORES, IDS, WEIGHTS, T, E, stride_lt, scaling, E_PAD: tl.constexpr,
                       EPG: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                       K: tl.constexpr, K_PAD: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr):
    """Rows [pid * BLOCK_T, +BLOCK_T): scores = sigmoid(logits); choice = scores + bias inside the kept groups;
    K arg-max passes give the ids (descending choice) and the weights."""
    neg = float("-inf")
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    cols = tl.arange(0, E_PAD)  # [EP]
    row_ok = rows < T
    col_ok = cols < E
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(LOGITS + rows[:, None].to(tl.int64) * stride_lt + cols[None, :], mask=ok, other=0.0)
    s = tl.sigmoid(x.to(tl.float32))  # [BT, EP]
    tl.store(SCORES + rows[:, None].to(tl.int64) * E + cols[None, :], s, mask=ok)
    b = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)  # [EP]
    c = tl.where(col_ok[None, :], s + b[None, :], neg)  # [BT, EP]
    if G > 1:
        gid = cols // EPG  # [EP]
        groups = tl.arange(0, G_PAD)  # [GP]
        gscore = tl.full([BLOCK_T, G_PAD], neg, dtype=tl.float32)
        for g in tl.static_range(G):  # group score: the sum of its two largest choices
            cg = tl.where((gid == g)[None, :], c, neg)  # [BT, EP]
            first = tl.argmax(cg, axis=1)  # [BT]
            top1 = tl.max(cg, axis=1)
            top2 = tl.max(tl.where(cols[None, :] == first[:, None], neg, cg), axis=1)
            gscore = tl.where(groups[None, :] == g, (top1 + top2)[:, None], gscore)
        keep = gid[None, :] < 0  # [BT, EP] all false
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(gscore, axis=1)  # [BT]
            keep = keep | (gid[None, :] == best[:, None])
            gscore = tl.where(groups[None, :] == best[:, None], neg, gscore)
        c = tl.where(keep, c, neg)
    ks = tl.arange(0, K_PAD)  # [KP]
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int64)
    w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    for k in tl.static_range(K):
        pick = tl.argmax(c, axis=1)  # [BT]
        hit = cols[None, :] == pick[:, None]  # [BT, EP]
        ids = tl.where(ks[None, :] == k, pick[:, None].to(tl.int64), ids)
        w = tl.where(ks[None, :] == k, tl.sum(tl.where(hit, s, 0.0), axis=1)[:, None], w)
        c = tl.where(hit, neg, c)
    if NORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    w = w * scaling
    out = rows[:, None].to(tl.int64) * K + ks[None, :]
    k_ok = row_ok[:, None] & (ks[None, :] < K)
    tl.store(IDS + out, ids, mask=k_ok)
    tl.store(WEIGHTS + out, w, mask=k_ok)


def router_forward(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, topk: int,
                   norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launches the forward kernel: (ids [T, K] int64, weights [T, K] float32, scores [T, E] float32)."""
    t, e = logits.shape
    if logits.stride(1) != 1 or not bias.is_contiguous():
        raise ValueError("router_topk (triton) needs logits contiguous in their last dim and a contiguous bias")
    scores = torch.empty(t, e, device=logits.device, dtype=torch.float32)
    ids = torch.empty(t, topk, device=logits.device, dtype=torch.int64)
    weights = torch.empty(t, topk, device=logits.device, dtype=torch.float32)
    if t == 0:
        return ids, weights, scores
    e_pad = triton.next_power_of_2(e)
    block_t = max(1, min(64, TILE_ELEMENTS // e_pad))
    _router_fwd_kernel[(triton.cdiv(t, block_t),)](
        logits, bias, scores, ids, weights, t, e, logits.stride(0), float(scaling), E_PAD=e_pad,
        EPG=e // n_group, G=n_group, G_PAD=triton.next_power_of_2(n_group), TOPK_GROUP=topk_group, K=topk,
        K_PAD=triton.next_power_of_2(topk), NORM=norm_topk_prob, BLOCK_T=block_t, num_warps=NUM_WARPS)
    return ids, weights, scores


def router_backward(d_weights: torch.Tensor | None, d_scores: torch.Tensor | None, ids: torch.Tensor,
                    scores: torch.Tensor, norm_topk_prob: bool, scaling: float) -> torch.Tensor:
    """d logits [T, E] from the gradients of the weights [T, K] and of the scores [T, E] (either may be None)."""
    ds = torch.zeros_like(scores) if d_scores is None else d_scores.float().clone()  # [T, E]
    if d_weights is not None:
        dw = d_weights.float() * scaling  # [T, K]: d of the (normalized) weights before scaling
        if norm_topk_prob:
            w = scores.gather(1, ids)  # [T, K]
            total = w.sum(-1, keepdim=True) + 1e-20  # [T, 1]
            dw = dw / total - (dw * w).sum(-1, keepdim=True) / total.square()
        ds.scatter_add_(1, ids, dw)
    return ds * scores * (1 - scores)


@torch.library.custom_op("moela::router_topk", mutates_args=())
def _router_topk_op(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, topk: int,
                    norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return router_forward(logits, bias, n_group, topk_group, topk, norm_topk_prob, scaling)


@_router_topk_op.register_fake
def _(logits, bias, n_group, topk_group, topk, norm_topk_prob, scaling):
    t, e = logits.shape
    return (logits.new_empty(t, topk, dtype=torch.int64), logits.new_empty(t, topk, dtype=torch.float32),
            logits.new_empty(t, e, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    ids, _, scores = output
    ctx.save_for_backward(ids, scores)
    ctx.norm_topk_prob, ctx.scaling = inputs[5], inputs[6]


def _backward(ctx, d_ids, d_weights, d_scores):
    ids, scores = ctx.saved_tensors
    d_logits = router_backward(d_weights, d_scores, ids, scores, ctx.norm_topk_prob, ctx.scaling)
    return d_logits, None, None, None, None, None, None


_router_topk_op.register_autograd(_backward, setup_context=_setup_context)


def router_topk_triton(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, topk: int,
                       norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _router_topk_op(logits.float(), bias.float().contiguous(), n_group, topk_group, topk, norm_topk_prob,
                           scaling)


def triton_auto(logits: torch.Tensor, *_, **__) -> bool:
    """`auto` takes the kernel for CUDA logits of up to 1024 experts (a row's scores stay in registers)."""
    return logits.is_cuda and logits.shape[-1] <= 1024
