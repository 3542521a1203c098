"""The GPU build of the Triton kernels, checked on a machine without a GPU: each is compiled for sm_90 (H100/H200) with
its production launch configuration (tests/sm90_compile.py, in a process without TRITON_INTERPRET). The block loops
of the attention and grouped-GEMM kernels must be pipelined (the Gluon attention forward's by its TMA producer,
without spills); the MoE path's non-GEMM kernels (moe_triton ...) must not spill registers, nor must the Gluon
kernels (moe_gluon: moela.ops.moe.kernels.quantize_gluon and the warp-specialized FP8 GEMMs of
moela.ops.moe.kernels.gemm_fp8_gluon_*, whose PTX must also hold fp8 wgmma, setmaxnreg and TMA copies), nor the QK-
Norm kernels (qk_norm: moela.ops.qk_norm_triton), nor the decoding attention over the latent cache (latent_attention:
moela.inference.latent_attention_triton), whose slot loop must be pipelined too, nor moela's AdamW with bf16 moments
(adamw: moela.trainer.adamw_moments)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

H200_SHARED_BYTES = 232448  # the per-block shared memory limit Triton reports on the H200


@pytest.mark.slow
def test_kernels_compile_for_sm90_pipelined_within_shared_memory():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    non_gemm = {name for name in result if name.startswith(("moe_triton ", "moe_gluon ", "qk_norm ",
                                                             "latent_attention ", "adamw "))}
    from moela.ops.attention import gluon_bwd

    # the Gluon backward's configs (spill bytes reported, not asserted: the benchmark decides which run)
    backward = {f"attention {name}" for name in gluon_bwd.CONFIGS} | {n for n in result if "gluon_dq" in n}
    assert len(result) - len(non_gemm) - len(backward) == 7 and len(non_gemm) >= 12, result
    assert {f"attention {name}" for name in gluon_bwd.CONFIGS} <= backward and len(backward) >= 8, sorted(result)
    assert result["attention gluon fwd"][3] == 0, f"the Gluon attention forward spills: {result['attention gluon fwd']}"
    for name, (shared, async_copies, regs, spills) in result.items():
        assert shared <= H200_SHARED_BYTES, f"{name}: {shared} bytes of shared memory do not fit the H200"
        if name.startswith("latent_attention split"):
            assert async_copies > 0, f"{name}: its slot loop is not software-pipelined (no async copies)"
        if name in non_gemm:
            assert spills == 0, f"{name}: ptxas spills {spills} bytes at {regs} registers per thread"
        else:
            assert async_copies > 0, f"{name}: its block loop is not software-pipelined (no async copies)"
