"""The backend names every op accepts, and the MoE recipes, in one module that imports nothing.

A recipe names backends (`model.attention_backend`, `model.moe_backend`, `model.moe_recipe`, ...); validating it
must not import a Triton kernel, so the names live here and each op's dispatch (`moela.ops.dispatch`) is built from
them. "auto" picks the fastest backend that supports the call; "reference" is the pure-torch specification and runs
everywhere.
"""

ATTENTION_BACKENDS = ("auto", "reference", "triton", "sdpa", "flash")
# the kernels of each phase of the `triton` attention backend (forward, dQ, dK/dV: `moela.ops.attention.phases`)
ATTENTION_KERNELS = ("auto", "triton", "gluon")
MOE_BACKENDS = ("auto", "reference", "triton", "torch_triton", "cublas", "deep_gemm")
MOE_RECIPES = ("bf16", "fp8_blockwise")
FP8_GEMM_IMPLS = ("auto", "gluon", "triton")  # our FP8 grouped GEMMs (moela.ops.moe.kernels.gemm_fp8_triton)
RMS_NORM_BACKENDS = ("auto", "reference", "compiled")
ROPE_BACKENDS = ("auto", "reference", "compiled")
SWIGLU_BACKENDS = ("auto", "reference", "compiled")
CROSS_ENTROPY_BACKENDS = ("auto", "reference", "compiled")
LINEAR_CROSS_ENTROPY_BACKENDS = ("auto", "reference", "chunked")
ROUTER_BACKENDS = ("auto", "reference", "triton")
QK_NORM_BACKENDS = ("auto", "reference", "triton")
LATENT_ATTENTION_BACKENDS = ("auto", "reference", "triton")


def moe_backend_problems(backend: str, recipe: str, d: int, f: int) -> list[str]:
    """What a named fast MoE backend cannot run in this model, each as "backend ... (what does)": shapes D (hidden)
    and F (expert FFN width) and the recipe. The one statement of these rules: `moe_experts` raises the first, a
    recipe's validation lists them all (without importing a kernel)."""
    if backend in ("auto", "reference"):
        return []
    problems = []
    if d % 128 or f % 128:
        problems.append(f"needs D and F (hidden_size, moe_intermediate_size) multiples of 128, got D={d}, F={f} "
                        f"(reference runs any)")
    if backend == "torch_triton" and recipe != "bf16":
        problems.append("(torch._grouped_mm) runs only recipe='bf16' (fp8_blockwise: triton, cublas or deep_gemm)")
    if backend == "cublas" and recipe != "fp8_blockwise":
        problems.append("(blockwise FP8 torch._scaled_mm) runs only recipe='fp8_blockwise' (bf16: torch_triton or "
                        "triton)")
    return problems
