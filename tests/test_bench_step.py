"""bench/step.py's pieces on the CPU: the kernel-name classifier on real kernel names, the profiler walk that finds
each kernel's launching op, the host-sync counter's window logic, the synthetic packed-document source, the row
plan, the report, a whole moela row end to end, transformers' packed rows against moela, and the torchtitan
mapping (skipped when torchtitan 0.3.0 is not importable)."""

from __future__ import annotations

import importlib.util
import math
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.steplib.host import host_ops, launches  # noqa: E402
from bench.steplib.kernels import FAMILIES, breakdown, classify, device_kernels  # noqa: E402
from bench.steplib.measure import SYNC_WARNING, SyncCounter, compiled_graphs, reported_syncs  # noqa: E402
from bench.steplib.source import PackedDocs, TrainerLoader  # noqa: E402
from factories import tiny_overrides  # noqa: E402
from moela.batch import IGNORE_INDEX  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

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
    ("_masked_cast_kernel", ("moela::moe_experts_bwd",), "copies/cat/casts"),
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
    import time

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


def test_packed_docs_rows_documents_and_labels():
    src = PackedDocs(vocab_size=50, rows=3, row_len=97, grad_accum=2, max_doc_len=40, median_len=16, seed=5)
    batches = src.next_step()
    assert len(batches) == 2 and src.tokens_per_step == 2 * 3 * 97
    for mb in batches:
        ids, labels, pos = (t.numpy() for t in (mb.input_ids, mb.labels, mb.position_ids))
        assert ids.shape == (3 * 97,) and ids.min() >= 0 and ids.max() < 50
        assert mb.doc_lengths.max() <= 40 and mb.doc_lengths.sum() == 3 * 97
        assert (mb.grid("position_ids")[:, 0] == 0).all()  # every row starts a document
        ends = np.cumsum(mb.doc_lengths)
        assert set(np.flatnonzero(pos == 0)) == set(ends - mb.doc_lengths)
        assert (labels[ends - 1] == IGNORE_INDEX).all()
        inner = np.setdiff1d(np.arange(len(ids)), ends - 1)
        assert (labels[inner] == ids[inner + 1]).all()
        assert mb.num_targets == (labels != IGNORE_INDEX).sum()
        packed = mb.packed()
        packed.validate()
        assert packed.num_targets() == mb.num_targets and packed.cu_seqlens[-1] == len(ids)
    lengths = np.concatenate([b.doc_lengths for b in batches]).astype(float)
    assert src.token_weighted_doc_len() == pytest.approx((lengths ** 2).sum() / lengths.sum())


def test_packed_docs_same_seed_same_tokens_in_any_process():
    a = PackedDocs(vocab_size=1000, rows=2, row_len=300, grad_accum=1, max_doc_len=300, median_len=64, seed=1)
    b = PackedDocs(vocab_size=1000, rows=2, row_len=300, grad_accum=1, max_doc_len=300, median_len=64, seed=1)
    a.next_step()
    assert torch.equal(a.next_step()[0].input_ids, b.microbatch(1, 0).input_ids)
    c = PackedDocs(vocab_size=1000, rows=2, row_len=300, grad_accum=1, max_doc_len=300, median_len=64, seed=2)
    assert not torch.equal(c.microbatch(1, 0).input_ids, b.microbatch(1, 0).input_ids)


def test_packed_docs_lengths_are_lognormal_around_the_median():
    src = PackedDocs(vocab_size=10, rows=64, row_len=8192, grad_accum=1, max_doc_len=4096, seed=0)
    lengths = src.microbatch(0, 0).doc_lengths
    assert 1300 < np.median(lengths) < 2100  # median 2048 before the cuts at 4096 and at the row ends
    assert 1700 < lengths.mean() < 2200
    with pytest.raises(ValueError, match="row_len"):
        PackedDocs(vocab_size=10, rows=1, row_len=1, grad_accum=1, max_doc_len=4)


def test_trainer_loader_reports_step_totals():
    src = PackedDocs(vocab_size=50, rows=2, row_len=64, grad_accum=3, max_doc_len=64, median_len=16, seed=0)
    loader = TrainerLoader(src)
    batches = loader.next_step()
    again = PackedDocs(vocab_size=50, rows=2, row_len=64, grad_accum=3, max_doc_len=64, median_len=16, seed=0)
    raw = again.next_step()
    lengths = np.concatenate([b.doc_lengths for b in raw]).astype(float)
    assert loader.last_global_counts == (sum(b.num_targets for b in raw), 3 * 128, float((lengths ** 2).sum()))
    assert [b.num_targets() for b in batches] == [b.num_targets for b in raw]


def _step_module():
    spec = importlib.util.spec_from_file_location("bench_step", ROOT / "bench" / "step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_failed_row_names_its_exception_first(tmp_path):
    """A row that dies in backward: the summary leads with the exception, not with the traceback's frames."""
    step = _step_module()
    log = tmp_path / "row.log"
    log.write_text("Traceback (most recent call last):\n" + "  File \"x.py\", line 1, in f\n    g()\n" * 4
                   + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 25.00 GiB.\n"
                   + "  File \"y.py\", line 9, in h\n")
    assert step._tail(log).startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 25.00 GiB. | ")
    log.write_text("plain last line\n")
    assert step._tail(log) == "plain last line"


def test_plan_rows_peers_bf16_only_and_mtp_off():
    from moela.config import load_config

    step = _step_module()
    counts = dict(warmup=2, steps=1, profile_steps=0, sync_steps=0)
    specs = step.plan_rows(["small-16k", "small-64k"], list(step.IMPLS), ["bf16", "fp8_blockwise"], "cuda", counts,
                           "/tmp/r")
    labels = [(s["label"], s["config"][-3:], s["recipe"]) for s in specs]
    kernel_rows = [f"moela-{phase}-{kernel}" for phase in ("fwd", "dq", "dkdv") for kernel in ("triton", "gluon")]
    assert labels == [("moela", "16k", "bf16"), ("moela", "16k", "fp8_blockwise"), ("moela", "64k", "bf16"),
                      ("moela", "64k", "fp8_blockwise"), ("moela-nographs", "16k", "bf16"),
                      ("moela-nographs", "16k", "fp8_blockwise"), ("moela-nographs", "64k", "bf16"),
                      ("moela-nographs", "64k", "fp8_blockwise"), ("moela-fp32-moments", "16k", "bf16"),
                      ("moela-fp32-moments", "16k", "fp8_blockwise"), ("moela-fp32-moments", "64k", "bf16"),
                      ("moela-fp32-moments", "64k", "fp8_blockwise"), ("moela-nomtp", "16k", "bf16"),
                      ("moela-nomtp", "64k", "bf16"), ("moela-nomtp-recast", "16k", "bf16"),
                      ("moela-nomtp-recast", "64k", "bf16"), ("moela-wgrad-torch", "16k", "bf16"),
                      ("moela-wgrad-torch", "64k", "bf16"), ("moela-wgrad-triton", "16k", "bf16"),
                      ("moela-wgrad-triton", "64k", "bf16"), ("moela-wgrad-autotune", "16k", "bf16"),
                      ("moela-wgrad-autotune", "64k", "bf16"), ("moela-no-prebuild", "16k", "bf16"),
                      ("moela-no-prebuild", "64k", "bf16"),
                      *[(label, size, "bf16") for label in kernel_rows for size in ("16k", "64k")],
                      ("titan-compile", "16k", "bf16"), ("titan-compile", "64k", "bf16"), ("hf", "16k", "bf16"),
                      ("hf", "64k", "bf16"), ("titan-eager", "16k", "bf16"), ("titan-eager", "64k", "bf16")]
    for s in specs:
        mtp_off = "model.num_nextn_predict_layers=0" in s["overrides"]
        assert mtp_off == (s["label"] in ("moela-nomtp", "moela-nomtp-recast", "titan-compile", "hf",
                                          "titan-eager"))
        assert s["bf16_wgrad_impl"] == {"moela-wgrad-torch": "torch", "moela-wgrad-triton": "triton"}.get(s["label"])
        assert s["gemm_tuning"] == ("autotune" if s["label"] == "moela-wgrad-autotune" else None)
        assert ("train.prebuild_kernels=false" in s["overrides"]) == (s["label"] == "moela-no-prebuild")
        assert s["save_weight_copies"] == (s["label"] != "moela-nomtp-recast")
        assert ("train.cuda_graphs=false" in s["overrides"]) == (s["label"] == "moela-nographs")
        assert f"model.moe_recipe={s['recipe']}" in s["overrides"]
        assert s["rows"] * s["row_len"] == (65536 if s["config"] == "small-64k" else 16384)
        cfg = load_config(s["recipe_path"], s["overrides"])
        assert cfg.model.expert_recipe == s["recipe"] and not cfg.model.fp8_linears
        assert cfg.train.tokens_per_microbatch * cfg.train.grad_accum == 32768 or s["config"] == "small-64k"
        assert cfg.train.cuda_graphs == (s["label"] != "moela-nographs")
        assert cfg.optim.moment_dtype == ("float32" if s["label"] == "moela-fp32-moments" else "bfloat16")
        kernels = cfg.model.kernels
        chosen = {f"moela-fwd-{kernels.attention_forward}", f"moela-dq-{kernels.attention_dq}",
                  f"moela-dkdv-{kernels.attention_dkdv}"} & set(kernel_rows)
        assert chosen == ({s["label"]} if s["label"] in kernel_rows else set()), s["label"]
        assert (cfg.model.attention_backend == "triton") == (s["label"] in kernel_rows)

    fp8 = step.plan_rows(["small-64k"], ["moela", "titan-compile"], ["bf16", "fp8"], "cuda", counts, "/tmp/r")
    assert [(s["label"], s["recipe"]) for s in fp8] == [("moela", "bf16"), ("moela", "fp8"), ("titan-compile", "bf16")]
    model_fp8 = load_config(fp8[1]["recipe_path"], fp8[1]["overrides"]).model
    assert model_fp8.precision == "fp8" and model_fp8.fp8_linears and model_fp8.expert_recipe == "fp8_blockwise"

    v2 = step.plan_rows(["v2lite6-64k"], ["moela"], ["bf16"], "cuda", counts, "/tmp/r")[0]
    cfg = load_config(v2["recipe_path"], v2["overrides"]).model
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.n_routed_experts, cfg.n_shared_experts,
            cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.q_lora_rank, cfg.kv_lora_rank,
            cfg.first_k_dense_replace, cfg.num_hidden_layers, cfg.vocab_size) == (
        2048, 16, 64, 2, 6, 1408, None, 512, 1, 6, 102400)
    shipped = load_config(step.CONFIGS["small-16k"]["recipe"], step.CONFIGS["small-16k"]["overrides"]).train
    assert (shipped.tokens_per_microbatch, shipped.grad_accum) == (16384, 2)
    one = load_config(step.CONFIGS["small-32k"]["recipe"], step.CONFIGS["small-32k"]["overrides"]).train
    assert (one.tokens_per_microbatch, one.grad_accum) == (32768, 1)  # the shipped tokens per step, one micro-batch
    assert step.CONFIGS["small-32k"]["rows"] * step.CONFIGS["small-32k"]["row_len"] == 32768


def test_report_tables_ratios_and_failures(tmp_path):
    from bench.steplib.report import write_report

    def row(impl, tps, loss, recipe="bf16"):
        return {"config": "small-64k", "impl": impl, "recipe": recipe, "tokens_per_s": tps, "mfu": 0.2,
                "busy": 0.9, "peak_gib": 40.0, "host_syncs_per_step": 7.0, "sync_debug_warnings_per_step": 5.0,
                "sync_counter_check": {"item_traced": 1, "item_warned": 1, "synchronize_traced": 1},
                "sync_witness": "trace", "first_step_s_from_start": 30.0, "first_step_s_from_built": 20.0,
                "recompiles_after_step2": 0, "first_step_loss": loss, "step_ms_median": 400.0,
                "step_ms_min": 390.0, "step_ms_max": 420.0, "device_name": "NVIDIA H200",
                "kernel_breakdown": {f: {"ms_per_step": 10.0, "share": 1 / len(FAMILIES), "top": [["k", 1.0]]}
                                     for f in FAMILIES},
                "launches_per_step": {"expert GEMM": 24.0, "copies/cat/casts": 1500.0, "total": 1524.0},
                "host_top_ops": [["cuLaunchKernelEx", 12.5, 400.0], ["aten::mm", 3.0, 96.0]],
                "most_launched": [["triton_poi_fused_copy_3", "copies/cat/casts", 240.0, 2.5, ["aten::copy_ < f"]]]}
    rows = [row("moela-nomtp", 200e3, 8.3101), row("titan-compile", 160e3, 8.3105), row("hf", 50e3, 8.3098),
            {"config": "small-64k", "impl": "titan-eager", "recipe": "bf16", "error": "exit code 1: OutOfMemory"}]
    rows[0].update(tokens_per_s_window=210e3, mfu_window=0.21, first_step_compile_s=12.4, first_step_graphs=9)
    rows[1].update(tokens_per_s_window=150e3, mfu_window=0.15)
    md = write_report(rows, tmp_path, command="python bench/step.py", date="2026-12-01",
                      counts=dict(warmup=3, steps=6, profile_steps=2, sync_steps=1))
    assert (tmp_path / "step.json").exists() and (tmp_path / "step.md").read_text() == md
    assert "1.25x titan-compile (unsynced 1.40x), 4.00x hf;" in md
    assert "failed: exit code 1: OutOfMemory" in md
    assert "| 200,000 | 20.0% | 210,000, 21.0% | 90% |" in md and "| 50,000 | 20.0% | - | 90% |" in md
    assert "| 30 / 20; 12, 9 | 0 |" in md and "| 30 / 20 | 0 |" in md  # compile seconds and graphs where recorded
    assert "| config | moela-nomtp | titan-compile | hf |" in md  # the implementations that ran
    assert "| small-64k | 8.3101 | 8.3105 | 8.3098 |" in md
    assert "7 (5 warned)" in md and "3 of 3 rows counted by the CUDA trace hooks" in md
    assert "| small-64k | moela-nomtp | bf16 | 90% | 1,524 | 24 | 1,500 |" in md
    assert "`cuLaunchKernelEx` 12.5 ms (400 calls)" in md
    assert "`triton_poi_fused_copy_3` (copies/cat/casts) 240 x 2.5 us < aten::copy_ < f" in md


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("token_cache"))


TINY = tiny_overrides(vocab_size=4096, num_hidden_layers=2, n_routed_experts=4, q_lora_rank=16) + [
    "data.val_max_tokens=256"]


def test_moela_row_end_to_end_on_cpu(token_cache, tmp_path, monkeypatch):
    """A whole row through the real Trainer: the first-step loss of random tokens is near ln(V); the row's
    fp8_wgrad_impl reaches the FP8 GEMM dispatch, gemm_tuning the Triton grouped GEMMs."""
    from bench.steplib.row import run_row
    from moela.ops.moe import gemm_fp8, gemm_triton

    monkeypatch.setattr(gemm_fp8, "AUTO_KGROUPED_IMPL", "gluon")  # restored after the test
    monkeypatch.setitem(gemm_triton.TUNING, "mode", "table")

    spec = {"config": "tiny", "impl": "moela", "label": "moela", "recipe": "bf16", "device": "cpu",
            "recipe_path": str(ROOT / "recipes" / "tiny.yaml"),
            "overrides": TINY + [f"data.cache_dir={token_cache}", f"train.run_dir={tmp_path}", "train.device=cpu",
                                 "train.tokens_per_microbatch=128", "train.grad_accum=2", "train.eval_every=0",
                                 "logging.progress_bar=never", "checkpoint.every=0"],
            "rows": 2, "row_len": 64, "median_doc_len": 16, "warmup": 2, "steps": 2, "profile_steps": 1,
            "sync_steps": 1, "fp8_wgrad_impl": "triton", "gemm_tuning": "autotune"}
    r = run_row(spec)
    assert gemm_fp8.AUTO_KGROUPED_IMPL == "triton" and gemm_triton.TUNING["mode"] == "autotune"
    assert r["tokens_per_step"] == 256 and r["tokens_per_s"] > 0 and r["mtp_depth"] == 1
    assert r["tokens_per_s_window"] > 0 and r["mfu_window"] is None  # no bf16 peak known for a CPU
    assert r["first_step_compile_s"] == 0.0  # the tiny recipe trains uncompiled on the CPU
    assert abs(r["first_step_loss"] - math.log(4096)) < 0.05
    assert r["first_step_s_from_start"] >= r["first_step_s_from_built"] > 0
    assert r["recompiles_after_step2"] == 0 and r["mfu"] is None and r["host_syncs_per_step"] is None
    # the timed steps' expert load: max over mean is at least 1 and at most E / top-k (an expert takes a token once)
    low, high = r["expert_imbalance_range"]
    assert 1.0 <= low <= r["expert_imbalance"] <= high <= 8 / 2


def _tiny_config(*extra):
    """The tiny MTP-off model with init std 0.2: large enough logits that attention (RoPE, the document mask)
    moves them by far more than float rounding, so an equality test sees a wrong mask or rotation."""
    from moela.config import load_config

    return load_config(str(ROOT / "recipes" / "tiny.yaml"),
                       TINY + ["model.num_nextn_predict_layers=0", "model.initializer_range=0.2", "train.device=cpu",
                               *extra])


def test_hf_step_packed_rows_equal_moela(tmp_path):
    """transformers on [rows, row_len] with per-document positions computes moela's loss on the flat batch (fp32
    on the CPU: equal to float32 rounding; documents that saw each other would be off by far more)."""
    pytest.importorskip("transformers")
    from bench.steplib.impls import HFStep, moela_initial_model

    cfg = _tiny_config()
    src = PackedDocs(vocab_size=cfg.model.vocab_size, rows=2, row_len=64, grad_accum=1, max_doc_len=64,
                     median_len=16, seed=3)
    hf = HFStep(cfg, src, torch.device("cpu"))
    moela = moela_initial_model(cfg, torch.device("cpu"))
    mb = src.microbatch(0, 0)
    assert len(mb.doc_lengths) > 2
    with torch.no_grad():
        ours = moela(mb.packed()).metrics["lm_loss"]
        theirs = hf.loss_sum(mb) / mb.num_targets
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def _torchtitan():
    from bench.steplib import titan

    try:
        titan.import_torchtitan()
    except ImportError as e:
        pytest.skip(f"torchtitan is not importable here: {e}")
    return titan


def test_titan_config_maps_moela_shapes_and_weights():
    titan = _torchtitan()
    from torchtitan.models.common import RMSNorm

    from bench.steplib.impls import moela_initial_model

    cfg = _tiny_config("model.rms_norm_eps=1e-5", "model.routed_scaling_factor=2.5")
    f = cfg.model.moe_intermediate_size
    config = titan.titan_config(cfg.model, max_seq_len=64)
    dense, moe = config.layers[0], config.layers[1]
    assert dense.moe is None and dense.feed_forward is not None and moe.feed_forward is None
    router = moe.moe.router
    assert (router.num_experts, router.top_k, router.num_expert_groups, router.num_limited_groups,
            router.score_func, router.route_norm, router.route_scale) == (4, 2, 2, 1, "sigmoid", True, 2.5)
    assert moe.attention.q_lora_rank == 16 and moe.attention.kv_lora_rank == 16
    assert moe.moe.routed_experts.inner_experts.hidden_dim == f
    eps = []

    def walk(node):
        if isinstance(node, RMSNorm.Config):
            eps.append(node.eps)
        elif hasattr(node, "__dataclass_fields__"):
            for name in node.__dataclass_fields__:
                walk(getattr(node, name))
        elif isinstance(node, list):
            for item in node:
                walk(item)
    walk(config)
    assert len(eps) >= 7 and set(eps) == {1e-5}

    moela = moela_initial_model(cfg, torch.device("cpu"))
    model, config = titan.build_titan_model(cfg.model, 64, torch.device("cpu"))
    titan.load_moela_weights(model, config, moela)
    ours, theirs = moela.state_dict(), model.state_dict()
    assert torch.equal(theirs["layers.1.moe.routed_experts.inner_experts.w1_EFD"],
                       ours["layers.1.ffn.experts.w13"][:, :f])
    assert torch.equal(theirs["layers.1.moe.routed_experts.inner_experts.w3_EFD"],
                       ours["layers.1.ffn.experts.w13"][:, f:])
    assert torch.equal(theirs["layers.1.attention.wkv_b.weight"], ours["layers.1.attn.wkv_b.weight"])
    assert torch.equal(theirs["lm_head.weight"], ours["head.weight"])


def test_titan_computes_moela_function_on_the_same_tokens():
    """torchtitan's model on the CPU (dense-mask attention in place of FlexAttention, which has no CPU backward):
    moela's logits and loss. Its routed experts run their GEMMs on bf16 inputs, so the logits agree to 2% of their
    largest magnitude (a RoPE table that lost its imaginary part is off by ~80%)."""
    _torchtitan()
    from bench.steplib.impls import TitanStep, moela_initial_model

    cfg = _tiny_config()
    src = PackedDocs(vocab_size=cfg.model.vocab_size, rows=2, row_len=64, grad_accum=1, max_doc_len=64,
                     median_len=16, seed=4)
    step = TitanStep(cfg, src, torch.device("cpu"), compiled=False)
    moela = moela_initial_model(cfg, torch.device("cpu"))
    mb = src.microbatch(0, 0)
    assert len(mb.doc_lengths) > 2
    with torch.no_grad():
        out = moela(mb.packed(), return_logits=True)
        positions = mb.grid("position_ids").long()
        logits = step.model(mb.grid("input_ids"), positions=positions, attention_masks=step.dense_mask(positions))
        theirs = step.loss_sum(mb) / mb.num_targets
    ours = out.logits.view(logits.shape)
    assert (logits - ours).abs().max() < 0.02 * ours.abs().max()
    assert abs(float(theirs) - float(out.metrics["lm_loss"])) < 0.01
    loss = step.step()  # a whole training step runs: backward, clipping, AdamW
    assert math.isfinite(float(loss))


def test_titan_stand_ins_apply_only_where_torch_lacks_the_feature(monkeypatch):
    titan = _torchtitan()
    import torch.distributed.fsdp as fsdp
    import torch.nn.attention.flex_attention as flex
    import torchtitan.models.common.attention as attention
    import torchtitan.models.common.decoder as decoder

    assert titan._stand_in_mesh_dims() is (not hasattr(fsdp, "DataParallelMeshDims"))
    monkeypatch.delattr(fsdp, "DataParallelMeshDims", raising=False)
    assert titan._stand_in_mesh_dims() is True
    dims = fsdp.DataParallelMeshDims(shard="fsdp")
    assert (dims.shard, dims.replicate) == ("fsdp", None)

    calls = []
    monkeypatch.setattr(attention, "create_attention_mask", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(decoder, "create_attention_mask", attention.create_attention_mask)
    monkeypatch.setattr(flex, "create_block_mask", lambda mask_mod, B, H, Q_LEN, KV_LEN, device="cuda": None)
    assert titan._drop_separate_full_blocks() is True
    decoder.create_attention_mask("mod", 1, None, 8, 8, separate_full_blocks=True, BLOCK_SIZE=128)
    assert calls == [(("mod", 1, None, 8, 8), {"BLOCK_SIZE": 128})]


def test_the_first_step_clock_times_the_compilers_where_they_are_called(monkeypatch):
    """The clock's wrappers time each call of a wrapped compiler and pass its result through; its report lists
    them with torch.compile's phases (from Dynamo's own timers), and the report renders both. `install` wraps the
    real entry points (restored after the test) without changing what they return."""
    import bench.steplib.first_step as first_step
    from bench.steplib.report import _first_step_compilers
    from moela.ops.attention import flash

    clock = first_step.CompilerClock()
    slow = clock._wrap("a compiler", lambda x: (time.sleep(0.05), x + 1)[1])
    assert slow(1) == 2 and slow(2) == 3
    torch._dynamo.reset()
    torch.compile(lambda t: t.sin() + 1, backend="aot_eager")(torch.ones(3))
    got = clock.report()
    assert got["a compiler"][1] == 2 and 0.1 <= got["a compiler"][0] < 5
    assert got["torch.compile phases"] and all(s >= 0 and n >= 1 for s, n in got["torch.compile phases"].values())
    line = _first_step_compilers([{"config": "c", "impl": "moela", "recipe": "bf16", "first_step_compilers": got}])
    assert line[0].startswith("- c moela bf16: a compiler 0.1 s (2); torch.compile phases: `")

    triton_compiler = pytest.importorskip("triton.compiler")
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from triton.runtime.autotuner import Autotuner

    for owner, name in ((triton_compiler, "compile"), (Autotuner, "_bench"), (flash, "_flash_module"),
                        (CachingAutotuner, "precompile"), (CachingAutotuner, "autotune_to_one_config")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    loaded = flash._flash_module()
    clock.install()
    assert flash._flash_module() == loaded and triton_compiler.compile.__wrapped__ is not None
    assert CachingAutotuner.autotune_to_one_config.__wrapped__ is not None


def test_cold_rows_get_empty_caches_of_their_own(tmp_path):
    """`--cold`: a row's environment points every kernel cache at a new root and drops the variables that would
    point one elsewhere; each row run that way gets a new directory of its own under the log directory."""
    step = _step_module()
    env = {"PATH": "/bin", "TRITON_CACHE_DIR": "/warm/triton", "TORCHINDUCTOR_CACHE_DIR": "/warm/inductor",
           "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "/warm/fa", "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "0",
           "MOELA_CACHE_DIR": "/warm"}
    assert step.cold_env(env, tmp_path / "c") == {"PATH": "/bin", "MOELA_CACHE_DIR": str(tmp_path / "c")}
    counts = dict(warmup=2, steps=1, profile_steps=0, sync_steps=0)
    specs = step.plan_rows(["tiny"], ["moela"], ["bf16"], "cpu", counts, str(tmp_path / "run"))
    rows = step.run_rows(specs, tmp_path, row_timeout=600, budget=600, cold=True)
    assert "error" not in rows[0], rows[0].get("error")
    assert len(list(tmp_path.glob("caches_tiny_moela_bf16_*"))) == 1


def _ceiling_row(recipe: str, step_ms: float, **families: float) -> dict:
    kb = {f: {"ms_per_step": 0.0, "share": 0.0, "top": [], "top_context": []} for f in FAMILIES}
    for name, ms in families.items():
        kb[name.replace("_", " ")]["ms_per_step"] = ms
    kb["dense GEMM"]["top"] = [["nvjet_head", 30.0], ["nvjet_proj", kb["dense GEMM"]["ms_per_step"] - 30.0]]
    kb["dense GEMM"]["top_context"] = ["aten::mm < aten::matmul < _ChunkedLinearCE", "aten::mm < CompiledFxGraph"]
    return dict(config="c", impl="moela", recipe=recipe, step_ms_median=step_ms, kernel_breakdown=kb)


def test_fp8_ceiling_needs_and_bounds_from_a_breakdown():
    """bench/fp8_ceiling.py on rows with round numbers: eligible = experts + dense GEMMs but the head; the needed
    speed-up solves eligible (1 - 1/s) = T - T / target + overhead; the ceiling puts s = 2."""
    from bench.fp8_ceiling import analyse, head_ms

    bf16 = _ceiling_row("bf16", 200.0, expert_GEMM=60.0, dense_GEMM=70.0, optimizer=5.0)
    fp8 = _ceiling_row("fp8_blockwise", 180.0, expert_GEMM=40.0, dense_GEMM=70.0, optimizer=7.0)
    assert head_ms(bf16) == 30.0
    text = "\n".join(analyse(bf16, [fp8], 1.25))
    # overhead: the optimizer grew by 2 ms; experts only: need 200 - 160 + 2 = 42 of 60 -> s = 1 / (1 - 0.7)
    assert "| fp8_blockwise | 180.0 | 1.111x | 40.0 (1.50x) |" in text and "| 2.0 |" in text
    assert f"{1 / (1 - 42 / 60):.2f}x faster than bf16 (beyond the hardware's 2x)" in text
    # ceiling with the experts at 2x: 200 / (200 - 30 + 2)
    assert f"could reach {200 / 172:.3f}x" in text
    # experts and dense but the head: eligible 100, s = 1 / (1 - 0.42)
    assert f"{1 / (1 - 42 / 100):.2f}x faster than bf16." in text
