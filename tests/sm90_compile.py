"""Compiles moela's Triton kernels for an H100/H200 (sm_90) on a machine without a GPU and prints, per kernel,
[shared memory bytes, async copies, registers per thread, spill bytes] as JSON (run by tests/test_kernels_sm90.py
in a process without TRITON_INTERPRET, whose kernels are not compilable). It checks what the interpreter cannot:
that the GPU code generator accepts the kernel (constexpr globals, dot shapes, dtypes), that its block loops are
software-pipelined, that its shared memory fits and whether ptxas spills registers to local memory. Kernels are
compiled with the launch configurations used on the GPU (the MLA 192/128 attention table, the largest
grouped-GEMM autotune configuration, the warps and block sizes of the MoE launchers) and the launcher's
specialization. Names starting with "moe_triton" are the MoE path's non-GEMM kernels (no block loop to pipeline).

Registers and spills come from ptxas itself: Triton 3.6 keeps ptxas' `-v` report out of the compiled metadata
(`CompiledKernel.n_regs` / `n_spills` are only filled when the binary is loaded on a GPU), so the kernel's PTX is
assembled once more with the ptxas Triton itself uses for sm_90 (`get_ptxas(90)`: the bundled `ptxas` on 3.6,
`ptxas-blackwell` on 3.9, whose PTX the older one rejects) and its report parsed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def compile_sm90(kernel, args: dict, *, num_warps: int, num_stages: int = 3, require: tuple[str, ...] = ()):
    """args: every parameter by name: a constexpr's value; for the others a pointer type string ("*bf16",
    16-byte aligned like a torch allocation), a tensor descriptor type string (Gluon kernels' TMA descriptors),
    an int (i32, specialized as the launcher does: 1 becomes a constant, a multiple of 16 gets the divisibility
    hint) or a float (fp32). require: PTX instructions the kernel must contain (a RuntimeError names the missing
    ones). Returns (shared bytes, async copies in the TTGIR, registers per thread, spill bytes)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel
    while not isinstance(fn, triton.runtime.jit.JITFunction):  # unwrap @triton.autotune
        fn = fn.fn
    if set(args) != set(fn.arg_names):
        raise ValueError(f"{fn.__name__}: missing {set(fn.arg_names) - set(args)}, "
                         f"unknown {set(args) - set(fn.arg_names)}")
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        value = args[name]
        if i in fn.constexprs or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, str) and value.startswith("tensordesc"):
            signature[name] = value
        elif isinstance(value, str):
            signature[name], attrs[(i,)] = value, [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    compiled = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 128),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    missing = [instr for instr in require if instr not in compiled.asm["ptx"]]
    if missing:
        raise RuntimeError(f"{fn.__name__}: the sm_90 PTX lacks {missing}")
    regs, spills = ptxas_usage(compiled.asm["ptx"])
    copies = len(re.findall("async(?:_tma)?_copy_global_to_local", compiled.asm["ttgir"]))  # cp.async or TMA
    return compiled.metadata.shared, copies, regs, spills


def ptxas_usage(ptx: str, arch: str = "sm_90a"):
    """(registers per thread, spill bytes = max(spill stores, spill loads)) from ptxas -v on the kernel's PTX."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        ptxas = get_ptxas(90).path
        run = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
                             capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode:
        entry = re.search(r"\.entry (\w+)", ptx)
        raise RuntimeError(f"{ptxas} failed (exit {run.returncode}) on {entry and entry.group(1)}: {log[-1500:]}")
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return regs, max(int(spill.group(1)), int(spill.group(2)))


def attention_kernels():
    from moela.ops.attention.kernels import triton_backward, triton_forward
    from moela.ops.attention.kernels.triton_common import CONFIGS, head_dim_blocks

    d_qk, d_v = 192, 128
    common = dict(D_QK=d_qk, D_V=d_v, CAUSAL=True, HAS_ALIBI=True, UPCAST=False, **head_dim_blocks(d_qk, d_v))
    ptrs = dict(Q="*bf16", K="*bf16", V="*bf16", LSE="*fp32", CU_Q="*i32", CU_K="*i32", SLOPES="*fp32",
                ITEMS="*i32", n_items=1000, n_heads=16)
    strides = {f"stride_{t}{d}": s for t in ("q", "k", "dq", "dk") for d, s in (("t", 16 * d_qk), ("h", d_qk))}
    strides.update({f"stride_{t}{d}": s for t in ("v", "o", "do", "dv") for d, s in (("t", 16 * d_v), ("h", d_v))})
    strides["stride_lh"] = 4096
    grads = dict(DOut="*bf16", DELTA="*fp32", sm_scale=0.07)
    out = {}
    for name, kernel, extra in (("attention fwd", triton_forward._fwd_kernel, dict(Out="*bf16")),
                                ("attention dkdv", triton_backward._bwd_dkdv_kernel,
                                 dict(DK="*bf16", DV="*bf16", **grads)),
                                ("attention dq", triton_backward._bwd_dq_kernel, dict(DQ="*bf16", **grads))):
        bm, bn, warps, stages = CONFIGS[name.split()[1]]["wide"]
        args = {**ptrs, **strides, **extra, **common, "qk_scale": 0.1, "BLOCK_M": bm, "BLOCK_N": bn}
        args = {a: args[a] for a in kernel.arg_names}
        out[name] = compile_sm90(kernel, args, num_warps=warps, num_stages=stages)
    out.update(attention_gluon_kernels())
    return out


def attention_gluon_kernels():
    """The warp-specialized Gluon kernels (moela.ops.attention.kernels.gluon_*) at MLA's 192/128 and `small`'s 96/64:
    their PTX must hold the bf16 wgmma, setmaxnreg and the TMA loads."""
    from moela.ops.attention.kernels import gluon_common, gluon_dkdv, gluon_dq, gluon_forward
    from moela.ops.attention.kernels.gluon_common import BM, head_split

    if gluon_common.gluon is None:
        return {}
    gl = gluon_common.gl

    def desc(rows, cols):
        return f"tensordesc<bf16[{rows}, {cols}],{gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)}>"

    out = {}
    wgmma, setmaxnreg, tma = "wgmma.mma_async.sync.aligned.m64n{}k16.f32.bf16.bf16", \
        "setmaxnreg.inc.sync.aligned.u32", "cp.async.bulk.tensor"
    for d_qk, d_v in ((192, 128), (96, 64)):
        main, rest = head_split(d_qk)
        bn = gluon_forward.BN
        args = dict(q_desc=desc(BM, main), qr_desc=desc(BM, rest), k_desc=desc(bn, main), kr_desc=desc(bn, rest),
                    v_desc=desc(bn, d_v), Out="*bf16", stride_ot=16 * d_v, stride_oh=d_v, LSE="*fp32",
                    stride_lh=4096, CU_Q="*i32", CU_K="*i32", ITEMS="*i32", n_items=1000, n_heads=16,
                    NUM_PROGRAMS=132, qk_scale=0.1, D_QK=d_qk, D_MAIN=main, D_V=d_v, CAUSAL=True, BN=bn,
                    STAGES=gluon_forward.STAGES)
        out[f"attention gluon fwd {d_qk}/{d_v}"] = compile_sm90(
            gluon_forward._fwd_kernel, args, num_warps=gluon_forward.NUM_WARPS,
            require=(wgmma.format(bn), setmaxnreg, tma))
        # dK/dV: S^T by wgmma N = BM (query rows a step), dV += P^T dO with P^T from registers
        bm, bk = gluon_dkdv.STEP_ROWS, gluon_dkdv.BN
        args = dict(q_desc=desc(bm, main), qr_desc=desc(bm, rest), k_desc=desc(bk, main), kr_desc=desc(bk, rest),
                    v_desc=desc(bk, d_v), do_desc=desc(bm, d_v), LSE="*fp32", DELTA="*fp32", stride_lh=4096,
                    DK="*bf16", stride_dkt=16 * d_qk, stride_dkh=d_qk, DV="*bf16", stride_dvt=16 * d_v,
                    stride_dvh=d_v, CU_Q="*i32", CU_K="*i32", ITEMS="*i32", n_items=1000, n_heads=16, qk_scale=0.1,
                    sm_scale=0.07, D_QK=d_qk, D_MAIN=main, D_V=d_v, CAUSAL=True, BM=bm)
        out[f"attention gluon dkdv {d_qk}/{d_v}"] = compile_sm90(
            gluon_dkdv._dkdv_kernel, args, num_warps=4, require=(wgmma.format(bm), setmaxnreg, tma))
        bn = gluon_dq.BN
        args = dict(q_desc=desc(BM, main), qr_desc=desc(BM, rest), do_desc=desc(BM, d_v), k_desc=desc(bn, main),
                    kr_desc=desc(bn, rest), v_desc=desc(bn, d_v), LSE="*fp32", DELTA="*fp32", stride_lh=4096,
                    DQ="*bf16", stride_dqt=16 * d_qk, stride_dqh=d_qk, CU_Q="*i32", CU_K="*i32", ITEMS="*i32",
                    n_items=1000, n_heads=16, NUM_PROGRAMS=132, qk_scale=0.1, sm_scale=0.07, D_QK=d_qk,
                    D_MAIN=main, D_V=d_v, CAUSAL=True, BN=bn, STAGES=gluon_dq.STAGES)
        out[f"attention gluon dq {d_qk}/{d_v}"] = compile_sm90(
            gluon_dq._dq_kernel, args, num_warps=4, require=(wgmma.format(bn), setmaxnreg, tma))
    return out


def moe_kernels():
    """The MoE path's Triton GEMMs at the V3 layer's shapes: the persistent FP8 GEMMs (m-grouped: forward and data
    gradient; k-grouped: weight gradient) with their one launch configuration, and the bf16 weight gradient with the
    largest autotune configuration as the training step launches it (both operands the row-major activations read
    transposed, token-strided; fp32 output)."""
    from moela.ops.moe.kernels import gemm_fp8_triton as fp8_gemms
    from moela.ops.moe.kernels import gemm_grouped_triton as gemms

    m, n, k, e = 69632, 4096, 7168, 32
    fp8, f32 = "*fp8e4nv", "*fp32"
    cfg = fp8_gemms.MGROUPED
    out = {"moe mgrouped fp8": compile_sm90(fp8_gemms._mgrouped_fp8_kernel, dict(
        a_ptr=fp8, as_ptr=f32, s_asm=k // 128, s_ask=1, b_ptr=fp8, bs_ptr=f32, s_bse=n * k // 2 ** 14,
        s_bsn=k // 128, s_bsk=1, c_ptr="*bf16", m_idx_ptr="*i32", off_ptr="*i64", M=m, N=n, K=k, E=e,
        NUM_PROGRAMS=132, GROUPED=True, BM=cfg.bm, BN=cfg.bn, BK=128, GROUP=cfg.group),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)}
    cfg = fp8_gemms.KGROUPED
    out["moe kgrouped fp8"] = compile_sm90(fp8_gemms._kgrouped_fp8_kernel, dict(
        a_ptr=fp8, as_ptr=f32, s_asn=m // 128, s_ast=1, b_ptr=fp8, bs_ptr=f32, s_bsk=m // 128, s_bst=1, c_ptr=f32,
        off_ptr="*i64", N=n, K=k, M=m, E=e, NUM_PROGRAMS=132, GROUPED=True, BN=cfg.bm, BK=cfg.bn, BT=128,
        GROUP=cfg.group), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    largest = max(gemms.configs(), key=lambda c: (c.kwargs["BN"], c.num_stages))
    out["moe kgrouped bf16"] = compile_sm90(gemms._kgrouped_kernel, dict(
        a_ptr="*bf16", b_ptr="*bf16", offsets_ptr="*i64", stride_an=1, stride_at=n, stride_bk=1, stride_bt=k,
        c_ptr=f32, stride_ce=n * k, stride_cn=k, N=n, K=k, UPCAST=False, BT=64, BK=128, BN=largest.kwargs["BN"],
        GROUP_M=largest.kwargs["GROUP_M"]), num_warps=largest.num_warps, num_stages=largest.num_stages)
    return out


def moe_triton_kernels():
    """The non-GEMM MoE kernels at the V3 layer shape (T 8192, top-8, E 32, D 7168, F 2048, M_pad 69632) with their
    launchers' warps and block sizes; fp8 (quant) variants and the bf16 ones where the code differs."""
    from moela.ops.moe.kernels import combine, layout, permute, quantize_triton, swiglu
    from moela.ops.moe.kernels.triton_common import LAUNCH

    t, k, e, d, f = 8192, 8, 32, 7168, 2048
    m = layout.build_layout_rows(t, k, e)
    block_d = 1024
    fp8, bf16, f32, i32 = "*fp8e4nv", "*bf16", "*fp32", "*i32"
    out = {}

    def add(name, kernel, args, num_warps):
        out["moe_triton " + name] = compile_sm90(kernel, args, num_warps=num_warps)

    chunks = t * k // layout.CHUNK
    add("layout count", layout._layout_count_kernel, dict(ids_ptr="*i64", rank_ptr=i32, hist_ptr=i32, n_ids=t * k,
                                                          C=chunks, E=e, CH=layout.CHUNK, E_BLOCK=e, E_BLOCKS=1),
        **LAUNCH["layout"])
    add("layout scan", layout._layout_scan_kernel, dict(hist_ptr=i32, prefix_ptr=i32, counts_ptr="*i64", C=chunks,
                                                        BLOCK_C=chunks), **LAUNCH["layout"])
    for quant, place, data in ((True, True, True), (True, False, True), (False, True, True), (False, True, False)):
        tag = ("fp8" if quant else "bf16") + (" placing" if place else "") + ("" if data else " (no data)")
        add(f"permute {tag}", permute._permute_kernel, dict(
            x_ptr=bf16, ids_ptr="*i64", row_map_ptr=i32, rank_ptr=i32, prefix_ptr=i32, counts_ptr="*i64",
            offsets_ptr="*i64", m_idx_ptr=i32, src_ptr=i32, out_ptr=fp8 if quant else bf16,
            scale_ptr=f32 if quant else bf16, T=t, M_pad=m, E=e, C=chunks, D=d, K=k, K_PAD=k,
            BLOCK_D=permute.PERMUTE_BLOCK_D, CH=layout.CHUNK, E_PAD=e, QUANT=quant, PLACE=place, DATA=data),
            **LAUNCH["permute"])
    add("rowcol_quant gather colwise", quantize_triton._rowcol_quant_kernel, dict(
        x_ptr=bf16, src_ptr=i32, q_ptr=bf16, s_ptr=bf16, qt_ptr=fp8, st_ptr=f32, M=m, N=d, ld_x=d, gather_div=k,
        GATHER=True, ROWWISE=False, COLWISE=True), **LAUNCH["quant_rows_or_cols"])
    add("rowcol_quant rows+cols", quantize_triton._rowcol_quant_kernel, dict(
        x_ptr=bf16, src_ptr=bf16, q_ptr=fp8, s_ptr=f32, qt_ptr=fp8, st_ptr=f32, M=m, N=d, ld_x=d, gather_div=1,
        GATHER=False, ROWWISE=True, COLWISE=True), **LAUNCH["quant_rows_cols"])
    add("weight_quant", quantize_triton._weight_quant_kernel, dict(  # w13 [E, 2F, D]
        w_ptr=bf16, q_ptr=fp8, s_ptr=f32, stride_we=2 * f * d, stride_wn=d, stride_wk=1, N=2 * f, K=d),
        **LAUNCH["weight_quant"])
    add("swiglu_bwd fp8", swiglu._swiglu_bwd_kernel, dict(
        h_ptr=bf16, dact_ptr=bf16, m_idx_ptr=i32, dh_ptr=fp8, dh_s_ptr=f32, dht_ptr=fp8, dht_s_ptr=f32, actt_ptr=fp8,
        actt_s_ptr=f32, M=m, F=f), **LAUNCH["swiglu_bwd"])
    add("swiglu_bwd_plain bf16", swiglu._swiglu_bwd_plain_kernel, dict(
        h_ptr=bf16, dact_ptr=bf16, m_idx_ptr=i32, dh_ptr=bf16, act_ptr=bf16, F=f,
        BLOCK_M=swiglu.SWIGLU_BWD_PLAIN_ROWS), **LAUNCH["swiglu_bwd_plain"])
    for quant in (True, False):
        tag = "fp8" if quant else "bf16"
        add(f"swiglu_fwd {tag}", swiglu._swiglu_fwd_kernel, dict(
            h_ptr=bf16, m_idx_ptr=i32, out_ptr=fp8 if quant else bf16, s_ptr=f32 if quant else bf16, M=m, F=f,
            QUANT=quant), **LAUNCH["swiglu_fwd"])
        add(f"combine_bwd {tag}", combine._combine_bwd_kernel, dict(
            dy_ptr=bf16, o_ptr=bf16, src_ptr=i32, w_ptr=f32, do_ptr=fp8 if quant else bf16,
            do_s_ptr=f32 if quant else bf16, dot_ptr=fp8 if quant else bf16, dot_s_ptr=f32 if quant else bf16,
            partial_ptr=f32, M=m, D=d, K=k, QUANT=quant), **LAUNCH["combine_bwd"])
    add("combine", combine._combine_kernel, dict(o_ptr=bf16, row_map_ptr=i32, w_ptr=f32, y_ptr=bf16, D=d, K=k,
                                           BLOCK_D=block_d, WEIGHTED=True), **LAUNCH["combine"])
    return out


def moe_gluon_kernels():
    """The Gluon kernels (moela.ops.moe.kernels.quantize_gluon) at the V3 layer shape: the row+column quantization
    (both outputs, and the gathered column-only variant of the weight-gradient path), the SwiGLU backward and the
    weight quantization."""
    from moela.ops.moe.kernels import quantize_gluon as qg
    from moela.ops.moe.kernels.layout import build_layout_rows

    if qg.gluon is None:
        return {}
    m, d, k = build_layout_rows(8192, 8, 32), 7168, 8
    shared = qg.gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    desc = f"tensordesc<bf16[128, 128],{shared}>"
    chunks = dict(RC=qg.ROW_CHUNK, CC=qg.COL_CHUNK)
    return {"moe_gluon rowcol rows+cols": compile_sm90(qg._rowcol_tma_kernel, dict(
        x_desc=desc, q_ptr="*fp8e4nv", s_ptr="*fp32", qt_ptr="*fp8e4nv", st_ptr="*fp32", M=m, N=d, ROWWISE=True,
        COLWISE=True, **chunks), num_warps=qg.NUM_WARPS),
        "moe_gluon rowcol gather colwise": compile_sm90(qg._rowcol_gather_kernel, dict(
            x_ptr="*bf16", src_ptr="*i32", q_ptr="*bf16", s_ptr="*bf16", qt_ptr="*fp8e4nv", st_ptr="*fp32", M=m,
            N=d, ld_x=d, gather_div=k, ROWWISE=False, COLWISE=True, **chunks), num_warps=qg.NUM_WARPS),
        "moe_gluon swiglu_bwd": compile_sm90(qg._swiglu_bwd_kernel, dict(
            h_desc=desc, dact_desc=desc, m_idx_ptr="*i32", dh_ptr="*fp8e4nv", dh_s_ptr="*fp32",
            dht_ptr="*fp8e4nv", dht_s_ptr="*fp32", actt_ptr="*fp8e4nv", actt_s_ptr="*fp32", M=m, F=2048,
            RC=qg.ROW_CHUNK, CC=qg.SWIGLU_COL_CHUNK), num_warps=qg.SWIGLU_WARPS),
        "moe_gluon weight_quant": compile_sm90(qg._weight_quant_kernel, dict(  # w13 [E, 2F, D]
            w_desc=desc, q_ptr="*fp8e4nv", s_ptr="*fp32", qt_ptr="*fp8e4nv", N=4096, K=d, RC=qg.ROW_CHUNK,
            CC=qg.COL_CHUNK, TRANSPOSED=True), num_warps=qg.NUM_WARPS)}


def moe_gluon_gemm_kernels():
    """The warp-specialized FP8 GEMMs (moela.ops.moe.kernels.gemm_fp8_gluon_mgrouped, gemm_fp8_gluon_kgrouped) at the
    V3 layer's shapes (M_pad 69632, 2F 4096, D 7168, E 32: GEMM1's forward and weight gradient) with bf16 and fp32
    outputs and the launchers' ring depths. Their PTX must hold the fp8 wgmma of the consumer warpgroups, the
    register reallocation of the partitions (setmaxnreg) and the TMA loads (the weight gradient also the cp.async
    scale copies tracked by the ring's barriers); ptxas reports the launch budget (registers per thread over the 3
    warpgroups), the consumers run at CONSUMER_REGS."""
    from moela.ops.moe.kernels import gemm_fp8_gluon_kgrouped as kg
    from moela.ops.moe.kernels import gemm_fp8_gluon_mgrouped as ws

    if ws.gluon is None:
        return {}
    gl = ws.gl
    tile = gl.NVMMASharedLayout.get_default_for([ws.BM, ws.BK], gl.float8e4nv)
    fp8_desc = f"tensordesc<fp8e4nv[{ws.BM}, {ws.BK}],{tile}>"
    m, n, k, e = 69632, 4096, 7168, 32
    require = ("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3", "setmaxnreg.inc.sync.aligned.u32",
               "setmaxnreg.dec.sync.aligned.u32", "cp.async.bulk.tensor")
    out = {}
    for dtype, nbytes in (("bf16", 2), ("fp32", 4)):
        out_tile = gl.NVMMASharedLayout.get_default_for([64, ws.BN], gl.bfloat16 if nbytes == 2 else gl.float32)
        c_desc = f"tensordesc<{dtype}[64, {ws.BN}],{out_tile}>"
        out[f"moe_gluon fp8 gemm ws {dtype}"] = compile_sm90(ws._mgrouped_ws_kernel, dict(
            a_desc=fp8_desc, b_desc=fp8_desc, c_desc=c_desc, as_ptr="*fp32", s_asm=k // 128, s_ask=1,
            bs_ptr="*fp32", s_bse=n * k // 2 ** 14, s_bsn=k // 128, s_bsk=1, m_idx_ptr="*i32", off_ptr="*i64", M=m,
            N=n, K=k, E=e, NUM_PROGRAMS=132, GROUPED=True, GROUP=ws.GROUP, STAGES=ws.fit_stages(ws.STAGES, nbytes)),
            num_warps=ws.NUM_WARPS, require=require)
        out[f"moe_gluon fp8 wgrad ws {dtype}"] = compile_sm90(kg._kgrouped_ws_kernel, dict(
            a_desc=fp8_desc, b_desc=fp8_desc, c_desc=c_desc, as_ptr="*fp32", s_asn=1, s_ast=n, bs_ptr="*fp32",
            s_bsk=1, s_bst=k, off_ptr="*i64", order_ptr="*i32", N=n, K=k, M=m, E=e,  # scales token-block-major
            NUM_PROGRAMS=132, GROUPED=True, GROUP=ws.GROUP, STAGES=kg.fit_stages(kg.STAGES, nbytes)),
            num_warps=ws.NUM_WARPS, require=require + ("cp.async.mbarrier.arrive",))
    return out


def qk_norm_kernels():
    """The layer QK-Norm kernels (moela.ops.qk_norm_triton) at V2-Lite's width (16 heads x 192) in bf16."""
    from moela.ops import qk_norm_triton as qk

    t, n, bf16, f32 = 65536, 3072, "*bf16", "*fp32"
    blocks = dict(BLOCK_T=qk.BLOCK_T, BLOCK_N=qk.BLOCK_N)
    ptrs = dict(q_ptr=bf16, k_ptr=bf16, wq_ptr=f32, wk_ptr=f32)
    dims = dict(T=t, NQ=n, NK=n, stride_q=n, stride_k=n)
    grads = dict(gq_ptr=bf16, gk_ptr=bf16, stride_gq=n, stride_gk=n)
    out = {f"qk_norm stats{' grad' if product else ''}": compile_sm90(qk._qk_rms_norm_stats_kernel, dict(
        **ptrs, **grads, **dims, out_ptr=f32, PRODUCT=product, **blocks), num_warps=4) for product in (False, True)}
    out["qk_norm normalize"] = compile_sm90(qk._qk_rms_norm_fwd_kernel, dict(
        **ptrs, **dims, ss_ptr=f32, yq_ptr=bf16, yk_ptr=bf16, rstd_ptr=f32, inv_nq=1 / n, inv_nk=1 / n, eps=1e-6,
        stride_yq=n, stride_yk=n, **blocks), num_warps=4)
    out["qk_norm grad_input"] = compile_sm90(qk._qk_rms_norm_dx_kernel, dict(
        **ptrs, **grads, **dims, rstd_ptr=f32, s_ptr=f32, dq_ptr=bf16, dk_ptr=bf16, inv_nq=1 / n, inv_nk=1 / n,
        stride_dq=n, stride_dk=n, **blocks), num_warps=4)
    out["qk_norm grad_weight"] = compile_sm90(qk._qk_rms_norm_dw_kernel, dict(
        x_ptr=bf16, g_ptr=bf16, rstd_ptr=f32, out_ptr=f32, T=t, N=n, stride_x=n, stride_g=n, which=0,
        ROWS=qk.WGRAD_ROWS, **blocks), num_warps=4)
    return out


def latent_attention_kernels():
    """The decoding attention over the latent cache (moela.inference.latent_attention_triton) at DeepSeek's latent
    shapes (C 512, R 64, groups of 64), 16 heads, bf16 queries, for the bf16, int8 and int4 caches."""
    import triton.language as tl

    from moela.inference import latent_attention_triton as la

    c, r, slots, heads, splits = 512, 64, 32768, 16, 8
    out = {}
    for bits, ptr, width in ((16, "*bf16", c), (8, "*i8", c), (4, "*u8", c // 2)):
        out[f"latent_attention split {bits}-bit"] = compile_sm90(la._split_kernel, dict(
            Q_LAT="*bf16", stride_qb=heads * c, stride_qm=c, Q_ROPE="*bf16", stride_rb=heads * r, stride_rm=r,
            LATENT=ptr, stride_lb=slots * width, stride_lt=width, SCALES="*fp32", stride_sb=slots * c // 64,
            stride_st=c // 64, ROPE="*bf16", stride_kb=slots * r, stride_kt=r, POS="*i64", stride_pb=1,
            PART_ACC="*fp32", PART_MAX="*fp32", PART_SUM="*fp32", M=heads, H=heads, C=c, R=r, num_splits=splits,
            split_len=slots // splits, qk_scale=0.1, BITS=bits, GROUP=64, ALIGNED=True, DTYPE=tl.bfloat16,
            PRECISION="tf32", BLOCK_M=la.BLOCK_M, BLOCK_N=la.BLOCK_N, C_PAD=c, R_PAD=r), num_warps=la.NUM_WARPS)
    out["latent_attention combine"] = compile_sm90(la._combine_kernel, dict(
        PART_ACC="*fp32", PART_MAX="*fp32", PART_SUM="*fp32", OUT="*bf16", num_splits=splits, C=c, C_PAD=c),
        num_warps=la.COMBINE_WARPS)
    return out


def optimizer_kernels():
    """moela's AdamW (moela.trainer.adamw_moments) with bf16 and with fp32 moments, the skip flag and the gradient
    factor on. Its whole blocks must load and store 16 bytes a thread (the addresses come from a table, so only
    the kernel's alignment hint makes that possible)."""
    import triton.language as tl

    from moela.trainer import adamw_moments as am

    out = {}
    for tag, moment in (("bf16", tl.bfloat16), ("fp32", tl.float32)):
        out[f"adamw moments {tag}"] = compile_sm90(am._adamw_kernel, dict(
            table_ptr="*i64", work_ptr="*i32", found_ptr="*fp32", scale_ptr="*fp32", lr=1e-3, beta1=0.9,
            beta2=0.95, log2_beta1=-0.15, log2_beta2=-0.074, eps=1e-8, weight_decay=0.1, HAS_FOUND=True,
            HAS_SCALE=True, P_DTYPE=tl.float32, G_DTYPE=tl.float32, M_DTYPE=moment, BF16_MOMENTS=tag == "bf16",
            BLOCK=am.BLOCK), num_warps=4, require=("ld.global.v4.b32", "st.global.v4.b32"))
    return out


if __name__ == "__main__":
    print(json.dumps({**attention_kernels(), **moe_kernels(), **moe_triton_kernels(), **moe_gluon_kernels(),
                      **moe_gluon_gemm_kernels(), **qk_norm_kernels(), **latent_attention_kernels(),
                      **optimizer_kernels()}))
