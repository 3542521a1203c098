"""Context parallelism: partition round trip, exact attention per layout (in one process, then with gloo
collectives on 2 and 4 ranks), and a tiny model's loss and every parameter gradient under CP=2 and CP=4 against
the single-process result on packed batches of odd document lengths."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist

from moela.batch import IGNORE_INDEX, PackedBatch
from moela.model import build_model
from moela.ops.attention import mla_attention
from moela.parallel.context_parallel import apply_context_parallel, attend_passes, cp_attention
from moela.parallel.cp_plan import LAYOUTS, attention_passes, make_plan, shard_batch, unshard
from tests.factories import packed_batch, tiny_config
from tests.parallel_harness import spawn

REF = functools.partial(mla_attention, backend="reference")


def make_batch(seed: int, n_docs: int, max_len: int = 23, vocab: int = 97) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (n_docs,), generator=g)
    lens[0] = 1  # a one-token document: every rank but one holds only its padding
    batch = packed_batch(vocab, lens.tolist(), seed)
    batch.validate()
    return batch


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_partition_round_trip(layout, cp):
    batch = make_batch(seed=cp * 10 + len(layout), n_docs=7)
    plan = make_plan(batch.cu_seqlens, cp, layout)
    shards = [shard_batch(batch, plan, r) for r in range(cp)]
    assert len({s.num_tokens for s in shards}) == 1
    for s in shards:
        s.validate()
    owners = torch.cat([plan.pad_to_orig[i] for i in plan.local_index])
    real = owners[owners >= 0]
    assert torch.equal(real.sort().values, torch.arange(batch.num_tokens))  # every token on exactly one rank
    for field in ("input_ids", "labels", "position_ids"):
        back = unshard([getattr(s, field) for s in shards], plan)
        assert torch.equal(back, getattr(batch, field)), field
    for s, idx in zip(shards, plan.local_index):
        pad = plan.pad_to_orig[idx] < 0
        assert bool((s.labels[pad] == IGNORE_INDEX).all())
    assert sum(s.num_targets() for s in shards) == batch.num_targets()
    if layout == "dualchunk" and cp == 2:  # chunks r and 2cp-1-r of a 4-chunk document
        one = PackedBatch(torch.arange(8), torch.arange(8), torch.arange(8, dtype=torch.int32),
                          torch.tensor([0, 8], dtype=torch.int32), 8)
        p = make_plan(one.cu_seqlens, 2, "dualchunk")
        assert shard_batch(one, p, 0).input_ids.tolist() == [0, 1, 6, 7]
        assert shard_batch(one, p, 1).input_ids.tolist() == [2, 3, 4, 5]


def _qkv(seed: int, t: int, h: int = 3, dqk: int = 10, dv: int = 6):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, d, generator=g, requires_grad=True) for d in (dqk, dqk, dv)]


def _local(x: torch.Tensor, plan, rank: int, seed: int) -> torch.Tensor:
    """Rows of this rank (original rows where real, fresh random values on padding)."""
    src = plan.pad_to_orig[plan.local_index[rank]]
    g = torch.Generator().manual_seed(seed + rank)
    filler = torch.randn((src.numel(),) + tuple(x.shape[1:]), generator=g).to(x.device)
    src = src.to(x.device)
    return torch.where((src >= 0)[:, None, None], x[src.clamp(min=0)], filler)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_attention_passes_exact_in_one_process(layout, cp):
    batch = make_batch(seed=100 + cp, n_docs=6)
    q, k, v = _qkv(cp, batch.num_tokens)
    ref, ref_lse = REF(q, k, v, batch.cu_seqlens, batch.max_seqlen, return_lse=True)
    w = torch.randn_like(ref)
    ((ref * w).sum() + (ref_lse ** 2).sum()).backward()
    ref_grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    plan = make_plan(batch.cu_seqlens, cp, layout)
    kv = torch.cat([torch.cat((_local(k, plan, r, 1), _local(v, plan, r, 2)), -1) for r in range(cp)])
    outs, lses, loss = [], [], 0.0
    for r in range(cp):
        out, lse = attend_passes(_local(q, plan, r, 3), kv, attention_passes(plan, r), REF, return_lse=True)
        outs.append(out)
        lses.append(lse.t())
        real = plan.pad_to_orig[plan.local_index[r]] >= 0
        src = plan.pad_to_orig[plan.local_index[r]][real]
        loss = loss + (out[real] * w[src]).sum() + (lse[:, real] ** 2).sum()
    loss.backward()
    torch.testing.assert_close(unshard(outs, plan), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unshard(lses, plan).t(), ref_lse, rtol=1e-5, atol=1e-5)
    for x, gref in zip((q, k, v), ref_grads):
        torch.testing.assert_close(x.grad, gref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="the Triton attention kernel needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_passes_with_triton_kernel(layout):
    """The fast kernel's separate cu_seqlens_k / bottom-right path under both layouts (CP=2): its error against the
    float32 reference (whole batch, no CP) stays within twice the same kernel's error without CP (bf16 on CUDA;
    fp32 under the CPU interpreter, whose bf16 dots are unreliable)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype, atol = (torch.bfloat16, 1e-3) if dev == "cuda" else (torch.float32, 1e-5)
    fast = functools.partial(mla_attention, backend="triton")
    batch = make_batch(seed=41, n_docs=2, max_len=9).to(dev)
    plan = make_plan(batch.cu_seqlens, 2, layout)
    base = [x.detach().to(dev) for x in _qkv(5, batch.num_tokens, h=2, dqk=16, dv=16)]
    weight = torch.linspace(-1, 1, batch.num_tokens * 2 * 16, device=dev).view(batch.num_tokens, 2, 16)

    def run(attention, cast, cp):
        q, k, v = (x.to(cast).requires_grad_() for x in base)
        if cp:
            kv = torch.cat([torch.cat((_local(k, plan, r, 1), _local(v, plan, r, 2)), -1) for r in range(2)])
            out = unshard([attend_passes(_local(q, plan, r, 3), kv, attention_passes(plan, r), attention)
                           for r in range(2)], plan)
        else:
            out = attention(q, k, v, batch.cu_seqlens, batch.max_seqlen)
        (out.float() * weight).sum().backward()
        return [t.detach().float() for t in (out, q.grad, k.grad, v.grad)]

    truth = run(REF, torch.float32, cp=False)
    whole = run(fast, dtype, cp=False)
    split = run(fast, dtype, cp=True)
    for name, t, w, c in zip(("out", "dq", "dk", "dv"), truth, whole, split):
        err_whole, err_split = (w - t).abs().max().item(), (c - t).abs().max().item()
        assert err_split <= 2 * err_whole + atol, f"{name}: CP error {err_split:.2e} vs whole {err_whole:.2e}"


TINY = dict(num_hidden_layers=2, n_routed_experts=4, n_group=1, qk_rope_head_dim=4, aux_loss_coef=0.03,
            z_loss_coef=0.1)


def _attention_case(world: int, layout: str) -> dict:
    """Inputs and single-process results (computed once, in the parent) for the multi-rank attention check."""
    batch = make_batch(seed=7 * world + len(layout), n_docs=5)
    q, k, v = _qkv(world, batch.num_tokens)
    ref = REF(q, k, v, batch.cu_seqlens, batch.max_seqlen)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    (ref * w).sum().backward()
    return dict(batch=batch, qkv=[x.detach() for x in (q, k, v)], w=w, out=ref.detach(),
                grads=[x.grad for x in (q, k, v)])


def _model_case(world: int, layout: str) -> dict:
    """Tiny MLA + MoE model with MTP, sequence-wise balance loss and attention z-loss: weights, batch and
    single-process loss / gradients."""
    torch.manual_seed(11)
    model = build_model(tiny_config(**TINY))
    batch = make_batch(seed=3 * world + len(layout), n_docs=5, max_len=29)
    ref = model(batch)
    ref.loss.backward()
    return dict(batch=batch, state=model.state_dict(), loss=ref.loss.detach(), metrics=ref.metrics,
                expert_load=ref.expert_load,
                grads={name: p.grad for name, p in model.named_parameters()})


def _check_attention(rank: int, world: int, layout: str, case: dict) -> None:
    q, k, v = (x.clone().requires_grad_() for x in case["qkv"])
    plan = make_plan(case["batch"].cu_seqlens, world, layout)
    out = cp_attention(_local(q, plan, rank, 3), _local(k, plan, rank, 1), _local(v, plan, rank, 2),
                       attention_passes(plan, rank), dist.group.WORLD, REF)
    src = plan.pad_to_orig[plan.local_index[rank]]
    real = src >= 0
    (out[real] * case["w"][src[real]]).sum().backward()
    outs = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(outs, out.detach().contiguous())
    torch.testing.assert_close(unshard(outs, plan), case["out"], rtol=1e-5, atol=1e-5)
    for x, gref in zip((q, k, v), case["grads"]):
        g = x.grad.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(g, gref, rtol=1e-5, atol=1e-5)


def _check_model(rank: int, world: int, layout: str, case: dict) -> None:
    model = build_model(tiny_config(**TINY))
    model.load_state_dict(case["state"])
    batch = case["batch"]
    apply_context_parallel(model, dist.group.WORLD, layout)  # as apply_parallelism does
    assert f"ContextParallel(cp={world}, rank={rank}, layout={layout})" in repr(model)
    out = model(batch)
    share = out.num_targets / batch.num_targets()
    (out.loss * share).backward()
    counts = torch.tensor([out.num_targets])
    dist.all_reduce(counts)
    assert int(counts) == batch.num_targets()
    loss = out.loss.detach() * share
    dist.all_reduce(loss)
    torch.testing.assert_close(loss, case["loss"], rtol=1e-5, atol=1e-6)
    for name in ("lm_loss", "mtp_loss", "z_loss", "aux_loss"):
        value = out.metrics[name] * share
        dist.all_reduce(value)
        torch.testing.assert_close(value, case["metrics"][name], rtol=1e-5, atol=1e-6)
    load = out.expert_load.clone()
    dist.all_reduce(load)
    torch.testing.assert_close(load, case["expert_load"], rtol=0, atol=0)  # padding tokens are not counted
    for name, p in model.named_parameters():
        gref = case["grads"][name]
        assert gref is not None, name
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(gref)
        dist.all_reduce(g)
        torch.testing.assert_close(g, gref, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def _cp_group(rank: int, world: int, cases: dict) -> None:
    for layout in LAYOUTS:
        _check_attention(rank, world, layout, cases["attention", layout])
        _check_model(rank, world, layout, cases["model", layout])


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_and_model_with_gloo(world):
    cases = {}
    for layout in LAYOUTS:
        cases["attention", layout] = _attention_case(world, layout)
        cases["model", layout] = _model_case(world, layout)
    spawn(_cp_group, world, cases)
