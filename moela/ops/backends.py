"""The backend names every op accepts, and the MoE recipes, in one module that imports nothing.

A recipe names backends (`model.attention_backend`, `model.moe_backend`, `model.moe_recipe`, ...); validating it
must not import a Triton kernel, so the names live here and each op's dispatch (`moela.ops.dispatch`) is built from
them. "auto" picks the fastest backend that supports the call; "reference" is the pure-torch specification and runs
everywhere.
"""

ATTENTION_BACKENDS = ("auto", "reference", "triton", "sdpa", "flash")
MOE_BACKENDS = ("auto", "reference", "triton", "torch", "cublas", "deep_gemm")
MOE_RECIPES = ("bf16", "fp8_blockwise")
RMS_NORM_BACKENDS = ("auto", "reference", "compiled")
ROPE_BACKENDS = ("auto", "reference", "compiled")
SWIGLU_BACKENDS = ("auto", "reference", "compiled")
CROSS_ENTROPY_BACKENDS = ("auto", "reference", "compiled")
LINEAR_CROSS_ENTROPY_BACKENDS = ("auto", "reference", "chunked")
ROUTER_BACKENDS = ("auto", "reference", "triton")
QK_NORM_BACKENDS = ("auto", "reference", "triton")
LATENT_ATTENTION_BACKENDS = ("auto", "reference", "triton")
