"""Expert-parallel dispatch/combine on 2 and 4 gloo ranks against a float64 single-process reference.

Every rank draws the same global problem (tokens of all ranks, all experts' weights) from one seed, runs its own
tokens through `ExpertParallelExperts` holding only its experts, and checks y and the gradients of x, topk_weights
and its expert weights against float64 autograd over the whole problem (tolerance 1e-5: float32 arithmetic on
O(1) values). Both dispatches (`gather`, with one and two chunks, and `alltoall`) on every routing: random;
skewed so that experts (whole ranks at ep=4) receive nothing; every pair on rank 0's experts (the static bound of
the gather dispatch is reached on one rank: nothing may be dropped); a rank with no tokens; unequal token counts
throughout (the gather pads to the group's largest count).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from moela.ops.moe import moe_experts_reference
from moela.parallel.config import ParallelConfig
from moela.parallel.expert_parallel import ExpertParallelExperts, reduce_expert_load
from moela.parallel.mesh import build_mesh
from parallel_harness import spawn

E, D, FF, K = 8, 24, 20, 3
DISPATCHES = [("gather", 1), ("gather", 2), ("alltoall", 1)]
ROUTINGS = ["random", "skewed", "one_rank", "zero_tokens"]


def reference_experts(x, ids, weights, w13, w2):
    """Dense float64 definition: y[t] = sum_k w[t,k] * W2_e (silu(W1_e x) * W3_e x)."""
    h = torch.einsum("tkfd,td->tkf", w13[ids], x)  # [T, K, 2F]
    act = F.silu(h[..., :FF]) * h[..., FF:]  # [T, K, F]
    out = torch.einsum("tkdf,tkf->tkd", w2[ids], act)  # [T, K, D]
    return (out * weights[..., None]).sum(1)  # [T, D]


def make_problem(world_size: int, routing: str):
    g = torch.Generator().manual_seed(1234 + world_size + 10 * ROUTINGS.index(routing))
    tokens = [7 + 3 * r for r in range(world_size)]
    if routing == "zero_tokens":
        tokens[1] = 0
    t = sum(tokens)
    if routing == "one_rank":  # every pair on rank 0's experts (repeats allowed: E/ep may be < K)
        ids = torch.randint(0, E // world_size, (t, K), generator=g)  # [T, K]
    else:
        pool = 6 if routing == "skewed" else E  # skewed: the last experts (whole ranks when ep=4) receive nothing
        ids = torch.stack([torch.randperm(pool, generator=g)[:K] for _ in range(t)])  # [T, K]
    weights = torch.rand(t, K, generator=g, dtype=torch.float64)  # [T, K]
    x = torch.randn(t, D, generator=g, dtype=torch.float64)  # [T, D]
    w13 = torch.randn(E, 2 * FF, D, generator=g, dtype=torch.float64) / D**0.5  # [E, 2F, D]
    w2 = torch.randn(E, D, FF, generator=g, dtype=torch.float64) / FF**0.5  # [E, D, F]
    shared = torch.randn(D, D, generator=g, dtype=torch.float64) / D**0.5  # [D, D] a linear "shared expert"
    grad_y = torch.randn(t, D, generator=g, dtype=torch.float64)  # [T, D]
    return tokens, ids, weights, x, w13, w2, shared, grad_y


def ep_module(mesh, w13, w2, rank, **options) -> ExpertParallelExperts:
    ep = ExpertParallelExperts(E, D, FF, mesh["ep"], backend="reference", dtype=torch.float32, **options)
    lo, n = rank * ep.num_local, ep.num_local
    with torch.no_grad():
        ep.w13.to_local().copy_(w13[lo:lo + n])
        ep.w2.to_local().copy_(w2[lo:lo + n])
    return ep


def _check_routing(rank: int, world_size: int, routing: str) -> None:
    tokens, ids, weights, x, w13, w2, shared, grad_y = make_problem(world_size, routing)
    leaves = [t.clone().requires_grad_() for t in (x, weights, w13, w2)]
    ref = reference_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    ref.backward(grad_y)
    mesh = build_mesh(ParallelConfig(ep=world_size), world_size, "cpu")
    lo, hi = sum(tokens[:rank]), sum(tokens[:rank + 1])
    tol = dict(rtol=1e-4, atol=1e-5)  # float32 over gloo against float64: summation order varies by CPU
    for dispatch, chunks in DISPATCHES:
        ep = ep_module(mesh, w13, w2, rank, dispatch=dispatch, chunks=chunks)
        lo_e, n_e = rank * ep.num_local, ep.num_local
        xr = x[lo:hi].float().requires_grad_()
        wr = weights[lo:hi].float().requires_grad_()
        y = ep(xr, ids[lo:hi], wr)
        y.backward(grad_y[lo:hi].float())
        case = f"{routing} {dispatch} chunks={chunks}"
        torch.testing.assert_close(y.double(), ref[lo:hi].detach(), **tol, msg=lambda m, c=case: f"{c} y: {m}")
        torch.testing.assert_close(xr.grad.double(), leaves[0].grad[lo:hi], **tol, msg=lambda m, c=case: f"{c} {m}")
        torch.testing.assert_close(wr.grad.double(), leaves[1].grad[lo:hi], **tol, msg=lambda m, c=case: f"{c} {m}")
        torch.testing.assert_close(ep.w13.grad.to_local().double(), leaves[2].grad[lo_e:lo_e + n_e], **tol)
        torch.testing.assert_close(ep.w2.grad.to_local().double(), leaves[3].grad[lo_e:lo_e + n_e], **tol)
        torch.testing.assert_close(ep.w13.full_tensor().double(), w13.float().double())


def _check_shared_overlap(rank: int, world_size: int) -> None:
    """The shared experts handed to the module (run while the gathers are in flight) add to y, and their
    gradient, and the input's, are those of the single-process sum."""
    tokens, ids, weights, x, w13, w2, shared, grad_y = make_problem(world_size, "random")
    lo, hi = sum(tokens[:rank]), sum(tokens[:rank + 1])
    xs, ss = x[lo:hi].clone().requires_grad_(), shared.clone().requires_grad_()
    ref = reference_experts(xs, ids[lo:hi], weights[lo:hi], w13, w2) + xs @ ss
    ref.backward(grad_y[lo:hi])
    mesh = build_mesh(ParallelConfig(ep=world_size), world_size, "cpu")
    for chunks in (1, 2):
        ep = ep_module(mesh, w13, w2, rank, dispatch="gather", chunks=chunks)
        xr, sr = x[lo:hi].float().requires_grad_(), shared.float().requires_grad_()
        y = ep(xr, ids[lo:hi], weights[lo:hi].float(), shared=lambda v, s=sr: v @ s)
        y.backward(grad_y[lo:hi].float())
        torch.testing.assert_close(y.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xr.grad.double(), xs.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sr.grad.double(), ss.grad, rtol=1e-5, atol=1e-5)


def _check_fp8_and_load(rank: int, world_size: int) -> None:
    """The fp8_blockwise recipe runs per expert, so EP equals the single-process simulated-FP8 reference."""
    g = torch.Generator().manual_seed(99)
    t_all, d, ff = 2 * 9, 128, 128
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(t_all)])  # [T, 2]
    weights = torch.rand(t_all, 2, generator=g)  # [T, 2]
    x = torch.randn(t_all, d, generator=g)  # [T, D]
    w13 = torch.randn(E, 2 * ff, d, generator=g) / d**0.5  # [E, 2F, D]
    w2 = torch.randn(E, d, ff, generator=g) / ff**0.5  # [E, D, F]
    ref = moe_experts_reference(x, ids, weights, w13, w2, recipe="fp8_blockwise")
    mesh = build_mesh(ParallelConfig(ep=world_size), world_size, "cpu")
    for dispatch in ("gather", "alltoall"):
        ep = ExpertParallelExperts(E, d, ff, mesh["ep"], recipe="fp8_blockwise", backend="reference",
                                   dispatch=dispatch)
        n_e = ep.num_local
        with torch.no_grad():
            ep.w13.to_local().copy_(w13[rank * n_e:(rank + 1) * n_e])
            ep.w2.to_local().copy_(w2[rank * n_e:(rank + 1) * n_e])
        lo, hi = rank * 9, (rank + 1) * 9
        torch.testing.assert_close(ep(x[lo:hi], ids[lo:hi], weights[lo:hi]), ref[lo:hi], rtol=1e-5, atol=1e-5)

    load = torch.bincount(ids[lo:hi].reshape(-1), minlength=E).float()[None]  # [1, E] this rank's tokens
    reduce_expert_load(load, mesh)
    torch.testing.assert_close(load[0], torch.bincount(ids.reshape(-1), minlength=E).float())


def _check_autocast_dispatch(rank: int, world_size: int) -> None:
    """Under autocast an fp32 residual stream is cast before the dispatch (half the bytes), as moe_experts casts
    it; y comes back in the autocast dtype (as from moe_experts), the input gradient in fp32, both matching the
    fp32 run to bf16 precision."""
    import moela.parallel.expert_parallel as epm

    tokens, ids, weights, x, w13, w2, _, grad_y = make_problem(world_size, "random")
    mesh = build_mesh(ParallelConfig(ep=world_size), world_size, "cpu")
    lo, hi = sum(tokens[:rank]), sum(tokens[:rank + 1])
    xr, wr = x[lo:hi].float(), weights[lo:hi].float()
    for dispatch, name in (("gather", "gather_start"), ("alltoall", "all_to_all")):
        ep = ep_module(mesh, w13, w2, rank, dispatch=dispatch)
        y32 = ep(xr, ids[lo:hi], wr).detach()
        sent, plain = [], getattr(epm, name)
        setattr(epm, name, lambda rows, *a, plain=plain, sent=sent: (sent.append(rows.dtype), plain(rows, *a))[1])
        try:
            xa = xr.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = ep(xa, ids[lo:hi], wr)
            y.backward(grad_y[lo:hi].to(y.dtype))
        finally:
            setattr(epm, name, plain)
        assert sent[0] == torch.bfloat16, (dispatch, sent)  # the token dispatch
        assert y.dtype == torch.bfloat16 and xa.grad.dtype == torch.float32, dispatch
        torch.testing.assert_close(y.float(), y32, rtol=3e-2, atol=3e-2)


# ops whose result the host must read (a device-to-host copy and a wait on CUDA): scalar reads, data-dependent shapes
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
              "unique_consecutive", "bincount", "histc", "is_nonzero", "equal"}


class _HostReads(TorchDispatchMode):
    """Records every op that reads device values on the host; `allowed` marks the host-integer agreement."""

    def __init__(self):
        super().__init__()
        self.reads, self.allowed = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        data_dependent = name in HOST_READS or (name == "repeat_interleave" and kwargs.get("output_size") is None) \
            or (name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]))
        if data_dependent and not self.allowed:
            self.reads.append(name)
        return func(*args, **kwargs)


def dense_experts(x, ids, weights, w13, w2, *, recipe="bf16", backend="auto"):
    """moe_experts without data-dependent shapes (empty slots masked), to isolate the EP module's own host reads."""
    mine = ids >= 0
    h = torch.einsum("tkfd,td->tkf", w13[ids.clamp_min(0)], x)  # [T, K, 2F]
    f = w2.shape[2]
    out = torch.einsum("tkdf,tkf->tkd", w2[ids.clamp_min(0)], F.silu(h[..., :f]) * h[..., f:])  # [T, K, D]
    return (out * torch.where(mine, weights, 0.0)[..., None].to(out.dtype)).sum(1)  # [T, D]


def _check_no_host_reads(rank: int, world_size: int) -> None:
    """The gather dispatch reads no device value on the host in forward or backward (the token count agreement
    exchanges host integers over gloo); the alltoall dispatch does (its split sizes), which shows the check bites."""
    import moela.parallel.expert_parallel as epm

    tokens, ids, weights, x, w13, w2, shared, grad_y = make_problem(world_size, "random")
    lo, hi = sum(tokens[:rank]), sum(tokens[:rank + 1])
    mesh = build_mesh(ParallelConfig(ep=world_size), world_size, "cpu")
    plain_op, plain_agree, plain_tolist = epm.moe_experts, epm.agree_max, torch.Tensor.tolist
    found = {}
    for dispatch, chunks in DISPATCHES:
        ep = ep_module(mesh, w13, w2, rank, dispatch=dispatch, chunks=chunks)
        mode = _HostReads()

        def agree(value, group, mode=mode):
            mode.allowed = True
            try:
                return plain_agree(value, group)
            finally:
                mode.allowed = False

        def tolist(t, mode=mode):
            mode.reads.append("tolist")
            return plain_tolist(t)

        epm.moe_experts, epm.agree_max, torch.Tensor.tolist = dense_experts, agree, tolist
        try:
            xr = x[lo:hi].float().requires_grad_()
            with mode:
                y = ep(xr, ids[lo:hi], weights[lo:hi].float(), shared=lambda v: v @ shared.float())
                y.backward(grad_y[lo:hi].float())
        finally:
            epm.moe_experts, epm.agree_max, torch.Tensor.tolist = plain_op, plain_agree, plain_tolist
        found[(dispatch, chunks)] = mode.reads
    assert found[("gather", 1)] == [] and found[("gather", 2)] == [], found
    assert "tolist" in found[("alltoall", 1)], found


def _run_all(rank: int, world_size: int) -> None:
    for routing in ROUTINGS:
        _check_routing(rank, world_size, routing)
    _check_shared_overlap(rank, world_size)
    if world_size == 2:
        _check_fp8_and_load(rank, world_size)
        _check_autocast_dispatch(rank, world_size)
        _check_no_host_reads(rank, world_size)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_matches_single_process(world_size):
    spawn(_run_all, world_size)


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="cannot be split evenly"):
        ExpertParallelExperts(6, 8, 8, _FakeMesh(4))
    with pytest.raises(ValueError, match="ep_dispatch"):
        ExpertParallelExperts(8, 8, 8, _FakeMesh(4), dispatch="ring")
    with pytest.raises(ValueError, match="ep_chunks"):
        ExpertParallelExperts(8, 8, 8, _FakeMesh(4), chunks=3)


class _FakeMesh:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def _gpu_no_sync(rank: int, world_size: int) -> None:
    """On CUDA with NCCL and the fast expert kernels (bf16): after a warm-up call, the gather dispatch's forward and
    backward run under torch.cuda.set_sync_debug_mode("error") (any host sync raises), and match the reference
    backend to bf16 precision."""
    g = torch.Generator().manual_seed(7)
    e, d, ff, k, t = 8, 256, 128, 4, 1000 + 24 * rank  # unequal token counts: the padding agreement runs
    dev = torch.device("cuda", rank)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev)  # [T, K]
    weights = torch.rand(t, k, generator=g).to(dev)  # [T, K]
    x = torch.randn(t, d, generator=g).to(dev, torch.bfloat16)  # [T, D]
    mesh = build_mesh(ParallelConfig(ep=world_size), world_size, "cuda")
    out = {}
    for backend in ("reference", "auto"):
        torch.manual_seed(0)
        ep = ExpertParallelExperts(e, d, ff, mesh["ep"], backend=backend, dispatch="gather", chunks=2, device=dev)
        ep.init_weights(0.05)
        shared = torch.nn.Linear(d, d, device=dev, dtype=torch.bfloat16)
        for i in range(2):  # the second call runs with sync checking on (the first may autotune and compile)
            xr = x.clone().requires_grad_()
            torch.cuda.set_sync_debug_mode("error" if i and backend == "auto" else "default")
            try:
                y = ep(xr, ids, weights, shared=shared)
                y.float().square().sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        out[backend] = (y.float(), xr.grad.float(), ep.w13.grad.to_local().float())
    for got, want in zip(out["auto"], out["reference"]):
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gather_dispatch_has_no_host_sync_on_two_gpus():
    spawn(_gpu_no_sync, 2, backend="nccl")
