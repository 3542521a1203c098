"""bench/step.py's measuring pieces on the CPU: the kernel-name classifier on real kernel names, the profiler
walk that finds each kernel's launching op, the launch and host-op counts, and the host-sync counter's window
logic."""

from __future__ import annotations

import time
import warnings
from types import SimpleNamespace

import pytest
import torch
from step_helpers import ROOT

from bench.steplib.host import host_ops, launches
from bench.steplib.kernels import FAMILIES, breakdown, classify, device_kernels
from bench.steplib.measure import SYNC_WARNING, SyncCounter, compiled_graphs, reported_syncs

# Kernel names as the CUDA profiler reports them on Hopper (cuBLAS, CUTLASS, ATen, Inductor, NCCL, moela's Triton),
# with the launching op context where it decides the family.
KERNELS = [
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT", (), "dense GEMM"),
    ("nvjet_tst_64x64_64x8_2x1_v_bz_splitK_TNT", ("aten::mm", "aten::linear"), "dense GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
     "__5x_cublas", (), "dense GEMM"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", (), "dense GEMM"),
    ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>"
     "(cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*)", (), "dense GEMM"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_segment_k_off_kernel"
     "__5x_cublas", ("aten::_scaled_mm", "MoEExpertsFn"), "expert GEMM"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_segment_k_off_kernel"
     "__5x_cublas", ("aten::_scaled_mm", "autograd::engine::evaluate_function: MoEExpertsFnBackward"),
     "expert GEMM"),
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<"
     "cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, cutlass::gemm::collective::CollectiveMma<"
     "cutlass::gemm::MainloopSm90ArrayTmaGmmaWarpSpecializedCooperative<4, cute::tuple<cute::C<1>, cute::C<2>, "
     "cute::C<1> >>>>>>(...)", ("aten::_grouped_mm",), "expert GEMM"),
    ("_mgrouped_kernel", ("MoEExpertsFn",), "expert GEMM"),
    ("_kgrouped_kernel", ("autograd::engine::evaluate_function: MoEExpertsFnBackward",), "expert GEMM"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, "
     "true, true, false, false>(pytorch_flash::Flash_fwd_params)", (), "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
     "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)", (), "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<cutlass::arch::"
     "Sm80, cutlass::bfloat16_t, true, false, true, 64, 64, 128, false>::Params)", (), "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", (),
     "attention"),
    ("triton_tem_fused_flex_attention_0", ("CompiledFunction",), "attention"),
    ("triton_tem_fused_flex_attention_backward_zeros_1", ("CompiledFunctionBackward",), "attention"),
    ("_fwd_kernel", ("_FlashMLA",), "attention"),
    ("_bwd_preprocess_kernel", ("autograd::engine::evaluate_function: _FlashMLABackward",), "attention"),
    ("_bwd_dkdv_kernel", (), "attention"),
    ("_bwd_dq_kernel", (), "attention"),
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_nn",
     ("aten::bmm", "aten::_scaled_dot_product_attention_math", "aten::scaled_dot_product_attention"), "attention"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
     "(at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, double*, double*>"
     "(...)", ("aten::_fused_adamw_", "Optimizer.step#AdamW.step"), "optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<1>, at::native::(anonymous namespace)::LpNormFunctor<float, (at::native::(anonymous "
     "namespace)::NormType)1, float, float>, float*, int>(...)", ("aten::_foreach_norm",), "optimizer"),
    ("void at::native::lpnorm_cleanup<float, (at::native::(anonymous namespace)::NormType)1, float, float>(float "
     "const*, at::native::(anonymous namespace)::TensorListAddresses, int)", (), "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> "
     ">(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)",
     ("aten::add_", "Optimizer.step#AdamW.step"), "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", (), "communication"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
     "namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)", ("aten::_log_softmax",), "loss"),
    ("void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(float*, "
     "float*, float const*, long const*, float const*, bool, long, long, long, long)", (), "loss"),
    ("triton_red_fused__log_softmax_backward_data_nll_loss_backward_0", (), "loss"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda(at::TensorIteratorBase&)::"
     "{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> "
     ">(int, ...)", ("aten::exp", "_ChunkedLinearCE"), "loss"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float const, "
     "unsigned int>, unsigned int, unsigned int, bool, unsigned int, unsigned int, at::cuda::detail::TensorInfo<"
     "float, unsigned int>, unsigned int, at::cuda::detail::TensorInfo<long, unsigned int>, unsigned int, float*)",
     ("aten::topk",), "router/top-k"),
    ("void at::native::mbtopk::radixFindKthValues<float, unsigned int, unsigned int, 2>(...)", (), "router/top-k"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::DeviceRadixSortPolicy<long, "
     "long, unsigned long long>::Policy900, true, long, long, unsigned long long, int, int>(...)",
     ("aten::sort", "aten::argsort"), "router/top-k"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::sigmoid_kernel_cuda(at::TensorIteratorBase&)::"
     "{lambda()#2}::operator()() const::{lambda()#3}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> "
     ">(int, ...)", ("aten::sigmoid",), "router/top-k"),
    ("_layout_count_kernel", ("MoEExpertsFn",), "router/top-k"),
    ("_layout_scan_kernel", ("MoEExpertsFn",), "router/top-k"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", (), "norm/RoPE/activation"),
    ("triton_red_fused__to_copy_add_div_mul_pow_sum_3", (), "norm/RoPE/activation"),
    ("triton_poi_fused_mul_silu_2", (), "norm/RoPE/activation"),
    ("triton_poi_fused_cat_cos_mul_neg_sin_stack_1", (), "norm/RoPE/activation"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)::"
     "{lambda()#1}::operator()() const::{lambda()#4}::operator()() const::{lambda(c10::BFloat16)#1}, "
     "std::array<char*, 2ul> >(int, ...)", (), "norm/RoPE/activation"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::complex<float>, "
     "c10::complex<float>, c10::complex<float>, at::native::binary_internal::MulFunctor<c10::complex<float> > >, "
     "std::array<char*, 3ul> >(int, ...)", ("aten::mul",), "norm/RoPE/activation"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
     "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
     "float>, unsigned int, float, 4, 4>)", ("aten::mean",), "norm/RoPE/activation"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>(int, float, float "
     "const*, float const*, float const*, float*, float*, float*)", (), "norm/RoPE/activation"),
    ("_swiglu_fwd_kernel", ("MoEExpertsFn",), "norm/RoPE/activation"),
    ("_swiglu_bwd_kernel", (), "norm/RoPE/activation"),
    ("_swiglu_bwd_plain_kernel", ("moela::moe_experts_bwd",), "norm/RoPE/activation"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy_contig<at::native::(anonymous namespace)::"
     "OpaqueType<2u>, unsigned int, 3, 128, 1>(...)", ("aten::cat",), "copies/cat/casts"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda(at::"
     "TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda()#8}::operator()() const::{lambda(float)#1}, "
     "std::array<char*, 2ul> >(int, ...)", ("aten::copy_", "aten::_to_copy", "aten::to"), "copies/cat/casts"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
     "{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul>, "
     "4, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::"
     "LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(...)", (), "copies/cat/casts"),
    ("Memcpy DtoD (Device -> Device)", (), "copies/cat/casts"),
    ("Memset (Device)", (), "copies/cat/casts"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> "
     ">(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)", ("aten::add",), "copies/cat/casts"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
     "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)", ("aten::zero_",), "copies/cat/casts"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, "
     "true>(...)", ("aten::index_select", "aten::embedding"), "copies/cat/casts"),
    ("triton_poi_fused_cat_1", (), "copies/cat/casts"),
    ("triton_poi_fused__to_copy_3", (), "copies/cat/casts"),
    ("triton_poi_fused_add_mul_4", (), "copies/cat/casts"),
    ("_permute_kernel", ("MoEExpertsFn",), "copies/cat/casts"),
    ("_combine_bwd_kernel", (), "copies/cat/casts"),
    ("_rowcol_quant_kernel", (), "copies/cat/casts"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
     "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
     "unsigned int, float, 4, 4> >(...)", ("aten::sum",), "other"),
]


@pytest.mark.parametrize("name,context,family", KERNELS, ids=[f"{k[2]}:{k[0][:40]}" for k in KERNELS])
def test_classify_real_kernel_names(name, context, family):
    assert classify(name, context) == family


def test_every_moela_kernel_has_a_family():
    """Each Triton / Gluon kernel in moela/ops lands in a named family (a new kernel must be placed in kernels.py)."""
    import re

    names = set()
    for path in (ROOT / "moela" / "ops").rglob("*.py"):
        names |= set(re.findall(r"@(?:triton|gluon)\.jit[^\n]*\n\s*def (\w+_kernel)\(", path.read_text()))
    assert {"_fwd_kernel", "_mgrouped_kernel", "_permute_kernel"} <= names
    assert {n: classify(n) for n in names if classify(n) == "other"} == {}


def test_every_family_is_exercised():
    assert {k[2] for k in KERNELS} == set(FAMILIES)


def _event(name, device, *, eid=0, linked=0, parent=None, start=0.0, end=0.0, with_link=True):
    e = SimpleNamespace(name=name, device_type=device, id=eid, cpu_parent=parent, kernels=[],
                        time_range=SimpleNamespace(start=start, end=end))
    if with_link:
        e.linked_correlation_id = linked
    return e


@pytest.mark.parametrize("with_link", [True, False], ids=["linked_correlation_id", "ops_kernel_lists"])
def test_device_kernels_walks_the_launching_op_and_its_parents(with_link):
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    fn = _event("MoEExpertsFn", cpu, eid=1)
    mm = _event("aten::_scaled_mm", cpu, eid=2, parent=fn)
    add = _event("aten::add", cpu, eid=3)
    gemm = "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n"
    elementwise = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>"
    mm.kernels = [SimpleNamespace(name=gemm, device=0, duration=30.0)]
    add.kernels = [SimpleNamespace(name=elementwise, device=0, duration=10.0)]
    events = [fn, mm, add,
              _event(gemm, cuda, linked=2, start=10.0, end=40.0, with_link=with_link),
              _event(elementwise, cuda, linked=3, start=40.0, end=50.0, with_link=with_link),
              _event("_permute_kernel", cuda, linked=0, start=50.0, end=60.0, with_link=with_link),
              _event("Optimizer.step#AdamW.step", cuda, linked=0, start=0.0, end=90.0, with_link=with_link)]
    events[-1].is_user_annotation = True  # a record_function range mirrored on the device: not a kernel
    prof = SimpleNamespace(events=lambda: events)
    kernels = device_kernels(prof)
    assert [(n[:8], us, ctx) for n, us, ctx in kernels] == [
        ("sm90_xmm", 30.0, ("aten::_scaled_mm", "MoEExpertsFn")), ("void at:", 10.0, ("aten::add",)),
        ("_permute", 10.0, ())]
    b = breakdown(kernels, steps=2)
    assert b["expert GEMM"]["ms_per_step"] == pytest.approx(0.015)
    assert b["expert GEMM"]["share"] == pytest.approx(0.6)
    assert b["copies/cat/casts"]["share"] == pytest.approx(0.4)
    assert sum(v["share"] for v in b.values()) == pytest.approx(1.0)
    assert b["copies/cat/casts"]["top"][0][0].startswith("void at::native")  # the largest kernel first
    assert b["expert GEMM"]["top_context"] == ["aten::_scaled_mm < MoEExpertsFn"]
    contexts = dict(zip((n for n, _ in b["copies/cat/casts"]["top"]), b["copies/cat/casts"]["top_context"]))
    assert contexts[elementwise] == "aten::add" and contexts["_permute_kernel"] == ""


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def test_profiler_events_carry_what_the_walk_reads():
    """On this torch, CPU profiler events have the ids, parents and correlation fields `device_kernels` reads, and
    an autograd Function's ops sit under an event named after it (the context that marks expert GEMMs)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _Square.apply(torch.ones(3, requires_grad=True)).sum().backward()
    events = prof.events()
    mul = next(e for e in events if e.name == "aten::mul" and e.cpu_parent is not None
               and e.cpu_parent.name == "_Square")
    assert isinstance(mul.id, int) and hasattr(mul, "linked_correlation_id")
    assert device_kernels(prof) == []  # no device kernels on the CPU


def test_launches_count_device_events_per_step_by_family():
    experts = ("moela::moe_experts_fwd",)
    kernels = [("_mgrouped_ws_kernel", 30.0, experts), ("_permute_kernel", 5.0, ()), ("_rowcol_quant_kernel", 2.0, ()),
               ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 9.0, ()), ("_mgrouped_ws_kernel", 31.0, experts)]
    n = launches(kernels, steps=2)
    assert n["expert GEMM"] == 1.0 and n["copies/cat/casts"] == 1.0 and n["dense GEMM"] == 0.5
    assert n["total"] == 2.5 and sum(n[f] for f in FAMILIES) == n["total"]


def test_host_ops_rank_cpu_self_time_and_count_calls_per_step():
    """Under the real profiler: 3 steps of 4 large matmuls and 2 small adds each; the matmuls lead, with 4 calls
    per step, and their self time is at most the profiled wall time."""

    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("probe"):
        start = time.perf_counter()
        for _ in range(3):
            for _ in range(4):
                torch.mm(a, b)
            for _ in range(2):
                torch.add(a[:1], 1)
        wall_ms = (time.perf_counter() - start) * 1e3
    # this thread's events only (the probe's): the profiler also records threads an earlier test left running
    mine = {e.thread for e in prof.events() if e.name == "probe"}
    view = SimpleNamespace(events=lambda: [e for e in prof.events() if e.thread in mine and e.name != "probe"])
    ops = {name: (ms, calls) for name, ms, calls in host_ops(view, steps=3)}
    assert host_ops(view, steps=3)[0][0] == "aten::mm"
    assert ops["aten::mm"][1] == 4.0 and ops["aten::add"][1] == 2.0
    assert 0 < ops["aten::mm"][0] * 3 <= wall_ms and ops["aten::add"][0] < ops["aten::mm"][0]


def test_sync_counter_counts_only_inside_its_window():
    from torch.cuda import _gpu_trace

    counter = SyncCounter(cuda=False)
    with counter.window():
        pass  # registers the trace callbacks
    _gpu_trace.StreamSynchronizationCallbacks.fire_callbacks(0)  # outside any window: not counted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an outer filter must not hide the warnings from the window
        with counter.window() as w:
            _gpu_trace.StreamSynchronizationCallbacks.fire_callbacks(0)
            _gpu_trace.DeviceSynchronizationCallbacks.fire_callbacks()
            _gpu_trace.EventSynchronizationCallbacks.fire_callbacks(1)
            for _ in range(2):
                warnings.warn(f"{SYNC_WARNING}", UserWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert (w.traced, w.warned) == (3, 2)
    with counter.window() as w2:
        pass
    assert (w2.traced, w2.warned) == (0, 0)


def test_reported_syncs_trusts_only_a_witness_that_saw_the_check():
    ok = {"item_traced": 1, "item_warned": 1, "synchronize_traced": 1}
    assert reported_syncs(ok, 5.0, 3.0) == (5.0, "trace")
    value, why = reported_syncs({"item_traced": 0, "item_warned": 1, "synchronize_traced": 0}, 0.0, 3.0)
    assert value == 3.0 and "warnings" in why
    assert reported_syncs({"item_traced": 0, "item_warned": 0, "synchronize_traced": 0}, 0.0, 0.0)[0] is None


def test_compiled_graphs_counts_dynamo_compilations():
    before = compiled_graphs()
    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    f(torch.ones(3))
    f(torch.ones(3, 2))  # a new rank: a recompilation
    assert compiled_graphs() - before == 2

