"""The MoE expert path end to end (`moe_experts`, both recipes, every backend that runs here) against float64 math
and the simulated-quantization reference; the weight copies the forward hands the backward; the forward op's fake;
the kernel choices reaching the GEMMs; the errors a caller can cause. Kernels run under TRITON_INTERPRET=1 on CPU;
`-m gpu` tests use real sizes."""

import pytest
import torch

from moe_cases import DEV, HALF, MOE_MARKS, NAMES, exact_grads, problem, rel, run
from moela.ops.moe import moe_experts

pytestmark = MOE_MARKS
gpu = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["triton", "torch_triton"])
def test_bf16_recipe_path_vs_float64(backend, monkeypatch):
    """Both bf16 backends run the weight gradients (w2, w13) on our Triton GEMM; `torch_triton` runs the forward and
    data gradients' four m-grouped GEMMs on torch._grouped_mm, `triton` on ours."""
    from moela.ops.moe import autograd as moe_autograd

    calls = []
    for name in ("kgrouped_gemm", "mgrouped_gemm", "torch_mgrouped"):
        gemm = getattr(moe_autograd, name)
        monkeypatch.setattr(moe_autograd, name, lambda *a, _g=gemm, _n=name, **kw: calls.append(_n) or _g(*a, **kw))
    prob = problem(29, 256, 128, 4, 3, HALF, skew=backend == "torch_triton")
    exact = exact_grads(*prob)
    got = run(*prob, "bf16", backend)
    m_grouped = "torch_mgrouped" if backend == "torch_triton" else "mgrouped_gemm"
    assert sorted(calls) == sorted(["kgrouped_gemm"] * 2 + [m_grouped] * 4), calls
    ref = run(*prob, "bf16", "reference")  # float32 math, output in x's dtype
    # slack: four units of roundoff of x's dtype (the fused path keeps its GEMM outputs h and o in it, the reference
    # in float32; d topk_weights = <dy, o> sees o's rounding): fp16 2^-11, bf16 (CUDA) 2^-8
    slack = 4 * torch.finfo(HALF).eps / 2
    for name, a, r, ex in zip(NAMES, got, ref, exact):
        assert torch.isfinite(a).all(), name
        assert rel(a, ex) <= 2 * rel(r, ex) + slack, (name, rel(a, ex), rel(r, ex))


def test_fp8_recipe_path_vs_float64_and_simulated_reference():
    prob = problem(31, 256, 128, 4, 2, HALF)
    exact = exact_grads(*prob)
    got = run(*prob, "fp8_blockwise", "triton")
    ref = run(*prob, "fp8_blockwise", "reference")  # same quantization, simulated; straight-through backward
    err = {n: (rel(a, ex), rel(r, ex)) for n, a, r, ex in zip(NAMES, got, ref, exact)}
    assert err["y"][0] <= 1.25 * err["y"][1] + 1e-3, err
    # the backward also quantizes dy, dh and the weight-gradient operands, which the reference does not
    for name in NAMES[1:]:
        assert err[name][0] <= 2.0 * err[name][1] + 1e-3, (name, err)
        assert err[name][0] < 0.12, (name, err)


@pytest.mark.parametrize("fp8_gemm,fp8_wgrad", [("auto", "auto"), ("triton", "auto"), ("auto", "triton")])
def test_kernel_choices_reach_the_fp8_gemms(fp8_gemm, fp8_wgrad, monkeypatch):
    """`fp8_gemm` reaches the four m-grouped FP8 GEMMs (forward, data gradient), `fp8_wgrad` the two weight
    gradients, through the compiled-graph-safe custom ops; the results do not depend on it where only the Triton
    kernel runs (the interpreter, or a GPU without Gluon)."""
    from moela.ops.moe import autograd as moe_autograd

    impls = []
    for name in ("mgrouped_fp8", "kgrouped_fp8"):
        gemm = getattr(moe_autograd, name)
        monkeypatch.setattr(moe_autograd, name,
                            lambda *a, _g=gemm, _n=name, **kw: impls.append((_n, kw["impl"])) or _g(*a, **kw))
    prob = problem(19, 256, 128, 3, 2, HALF)
    got = run(*prob, "fp8_blockwise", "triton", fp8_gemm=fp8_gemm, fp8_wgrad=fp8_wgrad)
    assert sorted(impls) == sorted([("kgrouped_fp8", fp8_wgrad)] * 2 + [("mgrouped_fp8", fp8_gemm)] * 4), impls
    if DEV == "cpu":
        for name, a, b in zip(NAMES, got, run(*prob, "fp8_blockwise", "triton")):
            assert torch.equal(a, b), name


def test_fp8_kernel_choices_are_checked():
    x, ids, w, w13, w2, _ = problem(5, 128, 128, 3, 2, HALF)
    with pytest.raises(ValueError, match="unknown fp8_wgrad 'cutlass'; choose one of auto, gluon, triton"):
        moe_experts(x, ids, w, w13, w2, recipe="fp8_blockwise", backend="triton", fp8_wgrad="cutlass")
    if DEV == "cpu":
        with pytest.raises(ValueError, match="impl='gluon' needs a Hopper"):
            moe_experts(x, ids, w, w13, w2, recipe="fp8_blockwise", backend="triton", fp8_gemm="gluon")


def test_the_recipes_kernel_keys_reach_moe_experts():
    """`model.kernels.moe_fp8_gemm` / `moe_fp8_wgrad` from a recipe override are what the routed experts pass to
    every moe_experts call."""
    from moela.config import load_config
    from moela.model.moe import RoutedExperts

    cfg = load_config(None, ["model.kernels.moe_fp8_gemm=triton", "model.kernels.moe_fp8_wgrad=gluon"])
    assert RoutedExperts(cfg.model).kernels == {"fp8_gemm": "triton", "fp8_wgrad": "gluon"}
    assert RoutedExperts(load_config(None, []).model).kernels == {"fp8_gemm": "auto", "fp8_wgrad": "auto"}


@pytest.mark.parametrize("recipe", ["bf16", "fp8_blockwise"])
def test_backward_reads_the_forwards_weight_copies(recipe, monkeypatch):
    """With the weight cache off (as while a CUDA graph is captured), a forward + backward casts / quantizes each
    expert weight once: the backward reads the copies the forward made, and computes what a backward that looks
    them up again (handed empty placeholders) computes."""
    from moela.ops.moe import autograd as moe_autograd

    made = []
    monkeypatch.setattr(moe_autograd.weight_cache, "cached",
                        lambda w, kind, compute: (made.append(kind), compute(w))[1])
    x, ids, w, w13, w2, g = problem(21, 256, 128, 3, 2, HALF)
    choices = (recipe, "triton", "auto", "auto")
    saved = moe_autograd.moe_experts_fwd(x, ids, w, w13, w2, *choices)[1:]
    assert len(made) == 2, made  # w13 and w2, in the forward
    made.clear()
    grads = moe_autograd.moe_experts_bwd(g.to(x.dtype), x, ids, w, w13, w2, *saved, *choices)
    assert made == []
    placeholders = [x.new_empty(0)] * 4
    looked_up = moe_autograd.moe_experts_bwd(g.to(x.dtype), x, ids, w, w13, w2, *saved[:7], *placeholders, *choices)
    assert len(made) == 2, made  # again, in the backward
    for name, a, b in zip(NAMES[1:], grads, looked_up):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("recipe,weight_dtype", [("bf16", torch.float32), ("bf16", None), ("fp8_blockwise", None)])
def test_forward_op_fake_matches_real_outputs(recipe, weight_dtype):
    """The compiler's view of the forward op (its fake implementation) gives every output the real shape and dtype,
    weight copies included: cast weights, an empty placeholder where no cast is needed (weights already in x's
    dtype), fp8 scales and transposed codes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moela.ops.moe.autograd import moe_experts_fwd

    x, ids, w, w13, w2, _ = problem(13, 256, 128, 3, 2, HALF)
    w13, w2 = (t.to(weight_dtype or HALF) for t in (w13, w2))
    choices = (recipe, "triton", "auto", "auto")
    real = moe_experts_fwd(x, ids, w, w13, w2, *choices)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = moe_experts_fwd(*(mode.from_tensor(t) for t in (x, ids, w, w13, w2)), *choices)
    assert [(tuple(t.shape), t.dtype) for t in fake] == [(tuple(t.shape), t.dtype) for t in real]


def test_cached_weight_copies_over_two_micro_batches():
    """Parameters (the weight cache on): two micro-batches accumulate the gradients of both, each backward reading
    the detached aliases of the cache's copies that its forward handed over."""
    dtype = HALF
    x, ids, w, w13, w2, g = problem(17, 256, 128, 3, 2, dtype)
    p13, p2 = torch.nn.Parameter(w13.clone()), torch.nn.Parameter(w2.clone())
    for _ in range(2):
        moe_experts(x, ids, w, p13, p2, recipe="bf16", backend="triton").backward(g.to(dtype))
    once = run(x, ids, w, w13, w2, g, "bf16", "triton")
    assert torch.allclose(p13.grad, 2 * once[3], rtol=1e-5, atol=1e-6)
    assert torch.allclose(p2.grad, 2 * once[4], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_blockwise"])
def test_empty_batch(recipe):
    """An expert-parallel rank can receive no rows: zeros out, zero weight gradients."""
    x, _, w, w13, w2, g = problem(1, 128, 128, 3, 1, HALF)
    ids = torch.zeros(0, 1, dtype=torch.int64, device=DEV)
    y, dx, dw, dw13, dw2 = run(x[:0], ids, w[:0], w13, w2, g[:0], recipe, "triton")
    assert y.shape == (0, 128) and dx.shape == (0, 128)
    assert (dw13 == 0).all() and (dw2 == 0).all()


def test_auto_backend_on_cpu_is_reference():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU choice")
    x, ids, w, w13, w2, _ = problem(5, 128, 128, 3, 2, torch.float32)
    y = moe_experts(x, ids, w, w13, w2, recipe="fp8_blockwise")
    torch.testing.assert_close(y, moe_experts(x, ids, w, w13, w2, recipe="fp8_blockwise", backend="reference"))


def test_the_deep_gemm_probe_traces_without_a_graph_break():
    """`auto` asks whether DeepGEMM imports on every MoE call, inside torch.compile's trace too (a CUDA MoE block
    is one graph): the answer is a constant probed at import, so Dynamo traces it without running an import."""
    from moela.ops.moe.kernels.gemm_libraries import DEEP_GEMM_IMPORTS, deep_gemm_available

    torch.manual_seed(0)
    x = torch.randn(3)
    traced = torch.compile(lambda t: t + float(deep_gemm_available()), fullgraph=True, backend="eager")
    torch.testing.assert_close(traced(x), x + float(DEEP_GEMM_IMPORTS and torch.cuda.is_available()))


def test_fast_backend_rejects_layouts_past_int32_offsets():
    t, d, f = 300_000, 128, 4096  # 2.4M padded rows x 2F = 8192 columns > 2^31
    x = torch.zeros(1, d, dtype=torch.float16).expand(t, d)
    ids = torch.zeros(t, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="int32 offsets"):
        moe_experts(x, ids, torch.zeros(t, 8), torch.zeros(2, 2 * f, d), torch.zeros(2, d, f), backend="triton")


def test_fast_backend_rejects_unaligned_shapes_with_a_clear_message():
    x, ids, w, w13, w2, _ = problem(5, 96, 128, 3, 2, torch.float16)
    with pytest.raises(ValueError, match="multiples of 128"):
        moe_experts(x, ids, w, w13, w2, backend="triton")


@gpu
@pytest.mark.parametrize("recipe,backend", [("fp8_blockwise", "triton"), ("fp8_blockwise", "cublas"),
                                            ("bf16", "triton"), ("bf16", "torch_triton")])
@pytest.mark.parametrize("skew", [False, True])
def test_gpu_whole_path_v2lite_shape(recipe, backend, skew):
    from moela.ops.moe.kernels.gemm_libraries import cublas_blockwise_available

    if backend == "cublas" and not cublas_blockwise_available():
        pytest.skip("cuBLAS blockwise FP8 needs a Hopper GPU and torch >= 2.10")
    prob = problem(2048, 2048, 1408, 16, 6, torch.bfloat16, skew=skew)
    exact = exact_grads(*prob)
    got = run(*prob, recipe, backend)
    ref = run(*prob, recipe, "reference")
    for name, a, r, ex in zip(NAMES, got, ref, exact):
        ea, er = rel(a, ex), rel(r, ex)
        bound = (1.25 if name == "y" else 2.0) * er + 2e-3 if recipe == "fp8_blockwise" else 2 * er + 5e-3
        assert ea <= bound, (name, ea, er)


def test_backend_recipe_mismatches_are_explained():
    x, ids, w, w13, w2, _ = problem(5, 128, 128, 3, 2, torch.float16)
    with pytest.raises(ValueError, match="recipe='bf16'"):
        moe_experts(x, ids, w, w13, w2, recipe="fp8_blockwise", backend="torch_triton")
    with pytest.raises(ValueError, match="recipe='fp8_blockwise'"):
        moe_experts(x, ids, w, w13, w2, recipe="bf16", backend="cublas")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="deep_gemm"):
            moe_experts(x, ids, w, w13, w2, recipe="fp8_blockwise", backend="deep_gemm")
        with pytest.raises(RuntimeError, match="Hopper"):
            moe_experts(x, ids, w, w13, w2, recipe="fp8_blockwise", backend="cublas")
