"""PowerSGD (Vogels et al., 2019): rank-r compression of gradient matrices for an all-reduce, as pure functions.

One round for a matrix M [n, m] (this rank's gradient plus its error feedback) and a warm-started Q [m, r]:
  P = M Q -> all-reduce (sum) -> orthonormalize the columns (fp32) -> P^
  Q' = M^T P^ -> all-reduce, divide by the group size -> Q' = mean(M)^T P^
  decompressed = P^ Q'^T = P^ P^^T mean(M)      error feedback = M - decompressed (this rank's, kept for next step)
  Q' is the next step's Q (one power iteration per step converges across steps).
Bytes handed in: (n + m) r instead of n m.

Decisions:
- Which tensors are compressed (`matrix_shape`): 1-D tensors (norms, biases, the router bias) never; a 2-D tensor
  is one matrix; a 3-D or higher tensor is a stack of matrices over its first dimension, compressed each on its
  own (the routed experts' w13 [E, 2F, D] and w2 [E, D, F]: one matrix per expert, whose gradient is the low-rank
  sum of its own tokens' outer products; a rank-r approximation of the whole stack would share one subspace among
  unrelated experts). A matrix is compressed only when its P and Q are at most `1 / min_compression` of its size
  (torch's DDP hook rule, default 2): small matrices (the router's E x D gate) are sent whole, which costs little
  and keeps them exact. The rank is capped at min(n, m), where the approximation is exact.
- Orthogonalization is Gram-Schmidt in fp32 with each projection applied twice ("twice is enough": as orthogonal
  as Householder QR), batched over the stack (r is small: r passes of batched matmuls, no per-matrix solver
  call); a column that is (numerically) dependent on the previous ones becomes zero instead of amplified
  rounding (P of a low-rank gradient, or any P at a rank above the gradient's), and NaN or inf stays
  non-finite, so a non-finite gradient still marks the step non-finite.
- Q starts as a standard normal matrix drawn from a generator seeded per tensor, so every rank of a replicate group
  draws the same one without communicating.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

MIN_COMPRESSION = 2.0  # compress a matrix only when P + Q are at most half its size
# a column whose part orthogonal to the previous ones is below this share of its norm is dependent on them: what
# is left is fp32 rounding (about 1e-7), mostly inside their span, which normalizing would blow up into a copy
ORTHO_EPS = 1e-5


def matrix_shape(shape: Iterable[int], rank: int, min_compression: float = MIN_COMPRESSION
                 ) -> tuple[int, int, int, int] | None:
    """(batch B, rows n, cols m, effective rank r) of the PowerSGD view of a tensor of `shape`, or None when it is
    sent uncompressed (see the module docstring)."""
    shape = tuple(shape)
    if len(shape) < 2 or math.prod(shape) == 0:
        return None
    batch, n, m = (1, shape[0], shape[1]) if len(shape) == 2 else (shape[0], shape[1], math.prod(shape[2:]))
    r = min(rank, n, m)
    if (n + m) * r * min_compression > n * m:
        return None
    return batch, n, m, r


def powersgd_bytes(shapes: Iterable[Iterable[int]], rank: int, *, element_size: int = 4,
                   min_compression: float = MIN_COMPRESSION) -> int:
    """Bytes one rank hands to the replicate all-reduces per compressed step for gradient shards of `shapes` (P and
    Q of the compressed ones, the others whole), at `element_size` bytes an element (fp32: 4). Uncompressed, the
    same shards cost sum(numel) * element_size."""
    total = 0
    for shape in shapes:
        shape = tuple(shape)
        view = matrix_shape(shape, rank, min_compression)
        if view is None:
            total += math.prod(shape)
        else:
            batch, n, m, r = view
            total += batch * (n + m) * r
    return total * element_size


def initial_q(batch: int, m: int, r: int, seed: int, device: torch.device) -> torch.Tensor:
    """The first Q of a tensor: [B, m, r] fp32 standard normal, the same on every rank for the same `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, m, r, generator=gen, dtype=torch.float32).to(device)


def orthogonalize_(p: torch.Tensor, eps: float = ORTHO_EPS) -> torch.Tensor:
    """Orthonormalize the columns of each matrix of `p` [B, n, r] (fp32) in place by Gram-Schmidt with two
    projections per column; a column whose norm falls below `eps` times its norm before projection becomes zero.
    Returns `p`."""
    for i in range(p.shape[-1]):
        col = p[..., i:i + 1]  # [B, n, 1]
        before = col.norm(dim=1, keepdim=True)  # [B, 1, 1]
        if i:
            done = p[..., :i]  # [B, n, i]
            for _ in range(2):
                col -= done @ (done.transpose(1, 2) @ col)
        norm = col.norm(dim=1, keepdim=True)  # [B, 1, 1]
        col *= torch.where(norm > eps * before, 1.0 / norm.clamp_min(torch.finfo(p.dtype).tiny), 0.0)
    return p
