"""The MoE path's grouped GEMMs from libraries, over the same m-grouped layout as gemm_grouped_triton.py:
torch._grouped_mm (bf16, m-grouped), DeepGEMM's m-grouped FP8 GEMM (when `deep_gemm` imports), cuBLAS blockwise FP8
through torch._scaled_mm.

cuBLAS (CUDA >= 12.9, torch >= 2.10, compute capability 9.x) takes DeepSeek's fp32 scales in its own layouts (with
`torch._scaled_mm(a [M, K] row-major, b [K, N] column-major)`): 1x128 scales of a as [M, K/128] with strides
(1, M) (M-major); 1x128 scales of b as [K/128, N] row-major (N-major); 128x128 scales of b as [K/128, N/128] with
strides (1, L4), L4 = K/128 rounded up to 4 (torch 2.11 accepts only K/128 = L4: K a multiple of 512). The
wrappers reorder the (small) scale tensors (once per call, except a's 1x128 scales in the m-grouped GEMM: once per
expert, since cuBLAS wants their M-stride to equal the expert's row count) and launch one `torch._scaled_mm` per
non-empty expert over its padded block (the expert bounds come from the host, one sync per layer, made by the
caller). `torch._grouped_mm` exists on torch 2.11 CUDA and on torch 2.13 CPU (the CPU tests).
"""
from __future__ import annotations

import functools
import importlib.util

import torch


def torch_mgrouped(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """bf16 m-grouped GEMM by torch._grouped_mm: rows past offsets[-1] are left unwritten (consumers mask them)."""
    return torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets[1:].to(torch.int32))


def _deep_gemm_imports() -> bool:
    """Whether `import deep_gemm` works; imported only when installed (find_spec does not import)."""
    if importlib.util.find_spec("deep_gemm") is None:
        return False
    try:
        import deep_gemm  # noqa: F401
    except Exception:  # ImportError, or a build that fails to load its library
        return False
    return True


# Probed once, at import: `auto` asks on every MoE call, also inside torch.compile's trace, which ignores an
# lru_cache and would run the import there (a graph break in every MoE block of an FP8 model).
DEEP_GEMM_IMPORTS = _deep_gemm_imports()


def deep_gemm_available() -> bool:
    return DEEP_GEMM_IMPORTS and torch.cuda.is_available()


def deep_gemm_mgrouped(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                       m_indices: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's m-grouped contiguous FP8 GEMM; same layout and fp32 scales, its scales TMA-aligned MN-major."""
    import deep_gemm

    out = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=torch.bfloat16)
    fn = getattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous", None) or \
        deep_gemm.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous
    fn((a, a_scale), (b.contiguous(), b_scale.contiguous()), out, m_indices)
    return out


# ----------------------------------------------------------------------------------------------------------------
# cuBLAS blockwise FP8 (torch._scaled_mm with 1x128 / 128x128 scales): one GEMM per expert


@functools.lru_cache(maxsize=None)
def cublas_blockwise_available(device: torch.device | None = None) -> bool:
    """cuBLAS's DeepSeek-style blockwise FP8 GEMM: Hopper (sm_9x) with torch >= 2.10 (whose `_scaled_mm` checks
    and passes 1x128 / 128x128 scales to cuBLASLt; measured with torch 2.11 + CUDA 13.0 on the H200)."""
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 10) and torch.cuda.get_device_capability(device)[0] == 9


def cublas_k_blocks_ok(k: int) -> bool:
    """cuBLASLt wants 128x128 scales with a K stride rounded up to 4 blocks; torch 2.11 accepts only K/128 that
    needs no rounding (measured on the H200: K = 1408 and 2816 are refused)."""
    return k % 512 == 0


def _mn_major(s: torch.Tensor) -> torch.Tensor:
    """[R, G] -> the same values with strides (1, R): the MN-major scale layout cuBLASLt reads."""
    return s.t().contiguous().t()


def cublas_mgrouped(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                    bounds: list[tuple[int, int]], out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 m-grouped GEMM: out [M_pad, N] with out[s:t] = a[s:t] @ b[e]^T for expert e's padded rows [s, t) =
    bounds[e], b [E, N, K] (expert slices K-contiguous, e.g. the transposed weight copy for the data gradient),
    a_scale [M_pad, K/128], b_scale [E, N/128, K/128] (any strides). Rows past the last expert are zeros."""
    m, k = a.shape
    e, n, k2 = b.shape
    if not cublas_k_blocks_ok(k):
        raise ValueError(f"cublas_mgrouped: K={k} is not a multiple of 512 (cuBLASLt's 128x128 scale layout); use "
                         f"the Triton mgrouped_gemm")
    if k2 != k or a.stride(1) != 1 or b.stride(2) != 1 or len(bounds) != e:
        raise ValueError(f"cublas_mgrouped: a {tuple(a.shape)} / b {tuple(b.shape)} must be K-contiguous with one "
                         f"bound per expert (got {len(bounds)})")
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    bsc = b_scale.contiguous()  # expert e: [N/128, K/128] -> transposed view [K/128, N/128], strides (1, K/128)
    end = 0
    for ex, (s, t) in enumerate(bounds):
        if t > s:
            torch._scaled_mm(a[s:t], b[ex].t(), _mn_major(a_scale[s:t]), bsc[ex].t(), out_dtype=out_dtype,
                             out=out[s:t])
        end = max(end, t)
    if end < m:
        out[end:].zero_()
    return out


_FP32_OUT = [True]  # cleared if this torch/cuBLAS refuses fp32 output for blockwise FP8 (then bf16, upcast)


def cublas_kgrouped(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                    bounds: list[tuple[int, int]], out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 k-grouped GEMM (weight gradient): out [E, N, K], out[e] = a[:, s:t] @ b[:, s:t]^T over expert e's padded
    rows [s, t) = bounds[e]; a [N, M_pad], b [K, M_pad] token-contiguous e4m3 with 128x1 (along tokens) scales
    [N, M_pad/128], [K, M_pad/128]. Empty experts get zeros."""
    n, m = a.shape
    k = b.shape[0]
    if a.stride(1) != 1 or b.stride(1) != 1 or b.shape[1] != m:
        raise ValueError(f"cublas_kgrouped: a {tuple(a.shape)} and b {tuple(b.shape)} must be token-contiguous "
                         f"over the same padded rows")
    out = torch.empty(len(bounds), n, k, device=a.device, dtype=out_dtype)
    ast, bst = a_scale.t().contiguous(), b_scale.t().contiguous()  # [M_pad/128, N], [M_pad/128, K]
    for ex, (s, t) in enumerate(bounds):
        if t == s:
            out[ex].zero_()
            continue
        args = (a[:, s:t], b[:, s:t].t(), ast[s // 128:t // 128].t(), bst[s // 128:t // 128])
        if out_dtype == torch.bfloat16:
            torch._scaled_mm(*args, out_dtype=torch.bfloat16, out=out[ex])
            continue
        if out_dtype != torch.float32 or not _FP32_OUT[0]:  # converted once more into out's dtype
            out[ex] = torch._scaled_mm(*args, out_dtype=torch.bfloat16)
            continue
        try:
            torch._scaled_mm(*args, out_dtype=torch.float32, out=out[ex])
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:  # this torch / cuBLAS refuses fp32 output: bf16 from now on
            _FP32_OUT[0] = False
            out[ex] = torch._scaled_mm(*args, out_dtype=torch.bfloat16)
    return out
