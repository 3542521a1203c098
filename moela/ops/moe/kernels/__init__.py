"""The MoE expert path's kernels, one job per file: the layout's counting sort, permute, SwiGLU, combine, FP8
quantization (Triton and Gluon), and the grouped GEMMs (bf16 Triton, FP8 Triton and Gluon, library wrappers)."""
