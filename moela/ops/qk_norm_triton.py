"""Triton kernels of the layer-wise QK-Norm (`moela.ops.qk_norm`): per-token statistics, normalization, backward.

The op is split where the cross-rank exchange must happen: the statistics kernels (`sum_squares`, `grad_dot`)
produce the per-token partial sums [T, 2] that the ranks add up; `normalize` and `grad_input` consume the summed
ones; `grad_weight` needs nothing from the other ranks, so the op runs it while the backward's exchange is in
flight. q and k are handled by the same launch where their row loops are alike (statically unrolled over the two
tensors), so the statistics of both land in one [T, 2] buffer and cross the network in one message.

All arithmetic is float32 (bf16 / fp16 inputs and weights are upcast on load), outputs are stored in the input's
dtype, weight gradients in float32 (the caller casts). Row blocks of BLOCK_T tokens, columns in chunks of BLOCK_N.

Shapes: T tokens, N columns of this rank's share (heads x head dim), C row chunks of the weight-gradient reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.triton_env import INTERPRET

BLOCK_T = 4 if INTERPRET else 16
BLOCK_N = 32 if INTERPRET else 256
WGRAD_ROWS = 64 if INTERPRET else 512  # rows per program of the weight-gradient reduction


@triton.jit
def _row_sum(x_ptr, y_ptr, w_ptr, rows, row_ok, n_cols, stride_x, stride_y, PRODUCT: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """sum_n x[r, n]^2 (PRODUCT=False) or sum_n y[r, n] * w[n] * x[r, n] (PRODUCT=True) per row, float32."""
    acc = tl.zeros([rows.shape[0]], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for n0 in range(0, n_cols, BLOCK_N):
        c = n0 + cols
        ok = row_ok[:, None] & (c[None, :] < n_cols)
        x = tl.load(x_ptr + rows[:, None] * stride_x + c[None, :], mask=ok, other=0.0).to(tl.float32)
        if PRODUCT:
            y = tl.load(y_ptr + rows[:, None] * stride_y + c[None, :], mask=ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c, mask=c < n_cols, other=0.0).to(tl.float32)
            acc += tl.sum(y * w[None, :] * x, axis=1)
        else:
            acc += tl.sum(x * x, axis=1)
    return acc


@triton.jit
def _qk_rms_norm_stats_kernel(q_ptr, k_ptr, gq_ptr, gk_ptr, wq_ptr, wk_ptr, out_ptr, T, NQ, NK, stride_q, stride_k,
                              stride_gq, stride_gk, PRODUCT: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_N: tl.constexpr):
    """out [T, 2]: per-token sum of squares of q and of k (PRODUCT=False), or sum g * w * x (PRODUCT=True)."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = rows < T
    sq = _row_sum(q_ptr, gq_ptr, wq_ptr, rows, row_ok, NQ, stride_q, stride_gq, PRODUCT, BLOCK_N)
    sk = _row_sum(k_ptr, gk_ptr, wk_ptr, rows, row_ok, NK, stride_k, stride_gk, PRODUCT, BLOCK_N)
    tl.store(out_ptr + rows * 2, sq, mask=row_ok)
    tl.store(out_ptr + rows * 2 + 1, sk, mask=row_ok)


@triton.jit
def _scale_rows(x_ptr, w_ptr, y_ptr, g_ptr, rows, row_ok, r, c2, n_cols, stride_x, stride_y, stride_g,
                GRAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Forward (GRAD=False): y = x * r * w. Backward: y = r * g * w - x * c2 (c2 = r^3 * S / N_full)."""
    cols = tl.arange(0, BLOCK_N)
    for n0 in range(0, n_cols, BLOCK_N):
        c = n0 + cols
        ok = row_ok[:, None] & (c[None, :] < n_cols)
        x = tl.load(x_ptr + rows[:, None] * stride_x + c[None, :], mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c, mask=c < n_cols, other=0.0).to(tl.float32)
        if GRAD:
            g = tl.load(g_ptr + rows[:, None] * stride_g + c[None, :], mask=ok, other=0.0).to(tl.float32)
            y = r[:, None] * g * w[None, :] - x * c2[:, None]
        else:
            y = x * r[:, None] * w[None, :]
        tl.store(y_ptr + rows[:, None] * stride_y + c[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _qk_rms_norm_fwd_kernel(q_ptr, k_ptr, wq_ptr, wk_ptr, ss_ptr, yq_ptr, yk_ptr, rstd_ptr, T, NQ, NK, inv_nq,
                            inv_nk, eps, stride_q, stride_k, stride_yq, stride_yk, BLOCK_T: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    """rstd = rsqrt(ss / N_full + eps) [T, 2] (stored for the backward), y = x * rstd * w for q and k."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = rows < T
    rq = tl.rsqrt(tl.load(ss_ptr + rows * 2, mask=row_ok, other=0.0) * inv_nq + eps)
    rk = tl.rsqrt(tl.load(ss_ptr + rows * 2 + 1, mask=row_ok, other=0.0) * inv_nk + eps)
    tl.store(rstd_ptr + rows * 2, rq, mask=row_ok)
    tl.store(rstd_ptr + rows * 2 + 1, rk, mask=row_ok)
    _scale_rows(q_ptr, wq_ptr, yq_ptr, q_ptr, rows, row_ok, rq, rq, NQ, stride_q, stride_yq, stride_q, False, BLOCK_N)
    _scale_rows(k_ptr, wk_ptr, yk_ptr, k_ptr, rows, row_ok, rk, rk, NK, stride_k, stride_yk, stride_k, False, BLOCK_N)


@triton.jit
def _qk_rms_norm_dx_kernel(q_ptr, k_ptr, gq_ptr, gk_ptr, wq_ptr, wk_ptr, rstd_ptr, s_ptr, dq_ptr, dk_ptr, T, NQ, NK,
                       inv_nq, inv_nk, stride_q, stride_k, stride_gq, stride_gk, stride_dq, stride_dk,
                       BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx = rstd * g * w - x * rstd^3 * S / N_full for q and k (S: the summed sum of g * w * x)."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = rows < T
    rq = tl.load(rstd_ptr + rows * 2, mask=row_ok, other=0.0)
    rk = tl.load(rstd_ptr + rows * 2 + 1, mask=row_ok, other=0.0)
    cq = rq * rq * rq * tl.load(s_ptr + rows * 2, mask=row_ok, other=0.0) * inv_nq
    ck = rk * rk * rk * tl.load(s_ptr + rows * 2 + 1, mask=row_ok, other=0.0) * inv_nk
    _scale_rows(q_ptr, wq_ptr, dq_ptr, gq_ptr, rows, row_ok, rq, cq, NQ, stride_q, stride_dq, stride_gq, True,
                BLOCK_N)
    _scale_rows(k_ptr, wk_ptr, dk_ptr, gk_ptr, rows, row_ok, rk, ck, NK, stride_k, stride_dk, stride_gk, True,
                BLOCK_N)


@triton.jit
def _qk_rms_norm_dw_kernel(x_ptr, g_ptr, rstd_ptr, out_ptr, T, N, stride_x, stride_g, which, ROWS: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[chunk, n] = sum over the chunk's ROWS tokens of g[t, n] * x[t, n] * rstd[t, which]."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    chunk = tl.program_id(1)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for t0 in range(0, ROWS, BLOCK_T):
        rows = (chunk * ROWS + t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        row_ok = rows < T
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        r = tl.load(rstd_ptr + rows * 2 + which, mask=row_ok, other=0.0)
        acc += tl.sum(g * x * r[:, None], axis=0)
    tl.store(out_ptr + chunk * N + cols, acc, mask=col_ok)


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dim() == 2 and t.stride(-1) != 1:
            raise ValueError(f"qk_norm kernels need row-major tensors with unit column stride, got stride "
                             f"{t.stride()}")


def _row_stats(q, k, gq, gk, wq, wk, product: bool) -> torch.Tensor:
    """[T, 2] float32 per-token sums over the q and the k columns: of x^2, or of g * w * x when `product`."""
    _check(q, k, gq, gk)
    t = q.shape[0]
    out = torch.empty(t, 2, device=q.device, dtype=torch.float32)
    _qk_rms_norm_stats_kernel[(triton.cdiv(t, BLOCK_T),)](
        q, k, gq, gk, wq, wk, out, t, q.shape[1], k.shape[1], q.stride(0), k.stride(0), gq.stride(0), gk.stride(0),
        PRODUCT=product, BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N)
    return out


def sum_squares(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [T, Nq], k [T, Nk] -> [T, 2] float32: each token's sum of squares of its q and of its k columns."""
    return _row_stats(q, k, q, k, q, k, product=False)  # g and w unused (pointers only)


def grad_dot(gq: torch.Tensor, q: torch.Tensor, wq: torch.Tensor, gk: torch.Tensor, k: torch.Tensor,
             wk: torch.Tensor) -> torch.Tensor:
    """[T, 2] float32: each token's sum of g * w * x over its q and over its k columns."""
    return _row_stats(q, k, gq, gk, wq, wk, product=True)


def normalize(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, ss: torch.Tensor, eps: float,
              width_q: int, width_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q * rstd_q * wq, k * rstd_k * wk, rstd [T, 2] float32) from the summed sums of squares ss [T, 2] over the
    full widths."""
    _check(q, k)
    t = q.shape[0]
    yq, yk = torch.empty_like(q), torch.empty_like(k)
    rstd = torch.empty(t, 2, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(t, BLOCK_T),)
    _qk_rms_norm_fwd_kernel[grid](q, k, wq, wk, ss, yq, yk, rstd, t, q.shape[1], k.shape[1], 1.0 / width_q,
                                  1.0 / width_k, eps, q.stride(0), k.stride(0), yq.stride(0), yk.stride(0),
                                  BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N)
    return yq, yk, rstd


def grad_weight(g: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, which: int) -> torch.Tensor:
    """sum_t g[t] * x[t] * rstd[t, which] -> [N] float32 (partial sums per row chunk, then one torch sum)."""
    _check(g, x)
    t, n = x.shape
    chunks = max(1, triton.cdiv(t, WGRAD_ROWS))
    partial = torch.empty(chunks, n, device=x.device, dtype=torch.float32)  # [C, N]
    grid = (triton.cdiv(n, BLOCK_N), chunks)
    _qk_rms_norm_dw_kernel[grid](x, g, rstd, partial, t, n, x.stride(0), g.stride(0), which, ROWS=WGRAD_ROWS,
                                 BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N)
    return partial.sum(0)


def grad_input(gq: torch.Tensor, q: torch.Tensor, wq: torch.Tensor, gk: torch.Tensor, k: torch.Tensor,
               wk: torch.Tensor, rstd: torch.Tensor, s: torch.Tensor, width_q: int, width_k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dk) from the summed S = sum g * w * x [T, 2] and the forward's rstd [T, 2]."""
    _check(q, k, gq, gk)
    t = q.shape[0]
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    grid = (triton.cdiv(t, BLOCK_T),)
    _qk_rms_norm_dx_kernel[grid](q, k, gq, gk, wq, wk, rstd, s, dq, dk, t, q.shape[1], k.shape[1], 1.0 / width_q,
                                 1.0 / width_k, q.stride(0), k.stride(0), gq.stride(0), gk.stride(0), dq.stride(0),
                                 dk.stride(0), BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N)
    return dq, dk
