"""The `triton` backend of `latent_attention` (see moela.inference.latent_attention): flash-decoding over the latent
cache, dequantizing int8 / int4 codes in registers.

Work split. The query rows of one sequence are its S tokens x H heads (M = S * H); every row reads the same cache
row, so one program takes BLOCK_M rows (heads) and one split of the slots, and each latent tile it loads serves all of
them. The slots are cut into splits (flash-decoding) so that a single long sequence still spreads over the whole
GPU: each program keeps an online softmax (running max, running sum, float32 accumulator [BLOCK_M, C]) over its
split and writes those partials; a second small kernel combines the splits of each row. Programs that share a
cache tile (the head blocks of one split) are adjacent in the grid, so the tile is read from HBM once and from L2
by the others.

One tile, both products. In the absorbed form the latent c is the key and the value: the tile [BLOCK_N, C] is
loaded and dequantized once and used for the scores (q_latent . c) and for the weighted sum (p . c), which halves
the reads a separate key and value pass would make. The whole latent width is one tile (C padded to a power of
two and masked): the accumulator must span C anyway, and C = 512 at BLOCK_N = 32 is a 32 KiB bf16 tile.

Dequantization: when C and the group size are powers of two (DeepSeek's 512 / 64), each code byte and each scale
is loaded once: int4 bytes split into their two nibbles, interleaved back into channel order (low nibble = even
channel) and sign-extended (x - 16 if x >= 8); the codes are viewed as [BLOCK_N, C / G, G] and multiplied by the
[BLOCK_N, C / G] scales. Other widths (tests' odd sizes) load per channel: byte c (int8) or c // 2 (int4) and
scale c // G, the re-reads hitting the cache. code * scale is cast to the compute dtype, as the reference's
dequantize does, so both dots see the same operand values. Scores and softmax are float32 in the log2 domain (exp2).

Shapes: B sequences, M = S * H query rows per sequence, L slots, C latent (C_PAD: next power of two), R RoPE dims.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moela.ops.triton_env import INTERPRET, require_interpreter_support

require_interpreter_support()

LOG2E = 1.4426950408889634
BLOCK_M = 16  # query rows per program: the smallest tl.dot tile; the 16 heads of V2-Lite in one program
BLOCK_N = 32  # slots per tile: [32, 512] bf16 latent = 32 KiB
NUM_WARPS = 8  # ptxas for sm_90 at C = 512, 3 stages: 128 (bf16), 250 (int8), 190 (int4) registers, no spills;
# 32 rows or 4 warps spill for int8
COMBINE_WARPS = 4
PROGRAMS_PER_SM = 2  # two waves: sequences of unequal lengths still finish close together
MIN_SPLIT_SLOTS = 256  # a split's float32 partials (C + 2 numbers a row) stay small next to the cache it reads
INTERPRETER_PROGRAMS = 8  # the interpreter's grid target, with one tile per split allowed (tests see splits)


@triton.jit
def _load_latent(LATENT, SCALES, slot, slot_ok, offs_c, c_ok, stride_lt, stride_st, BITS: tl.constexpr,
                 GROUP: tl.constexpr, ALIGNED: tl.constexpr, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                 C_PAD: tl.constexpr):
    """Latent tile [BN, C_PAD] in DTYPE of the slots `slot` (LATENT, SCALES: this sequence's rows)."""
    ok = slot_ok[:, None] & c_ok[None, :]
    if BITS == 16:
        return tl.load(LATENT + slot[:, None] * stride_lt + offs_c[None, :], mask=ok, other=0.0).to(DTYPE)
    if ALIGNED:
        # C and G powers of two: each byte and each scale is loaded once; scales broadcast over [BN, C/G, G]
        if BITS == 8:
            codes = tl.load(LATENT + slot[:, None] * stride_lt + offs_c[None, :], mask=ok, other=0).to(tl.int32)
        else:
            offs_byte = tl.arange(0, C_PAD // 2)
            packed = tl.load(LATENT + slot[:, None] * stride_lt + offs_byte[None, :], mask=slot_ok[:, None],
                             other=0).to(tl.int32)  # [BN, C/2]
            nibbles = tl.reshape(tl.join(packed & 15, (packed >> 4) & 15), [BLOCK_N, C_PAD])  # low nibble first
            codes = nibbles - ((nibbles & 8) << 1)  # two's complement of 4 bits: 8..15 -> -8..-1
        offs_g = tl.arange(0, C_PAD // GROUP)
        scales = tl.load(SCALES + slot[:, None] * stride_st + offs_g[None, :], mask=slot_ok[:, None], other=0.0)
        groups = tl.reshape(codes.to(tl.float32), [BLOCK_N, C_PAD // GROUP, GROUP]) * scales[:, :, None]
        return tl.reshape(groups, [BLOCK_N, C_PAD]).to(DTYPE)
    # any C and G: channel c reads byte c (int8) or c // 2 (int4) and scale c // G (re-reads hit the cache)
    if BITS == 8:
        codes = tl.load(LATENT + slot[:, None] * stride_lt + offs_c[None, :], mask=ok, other=0).to(tl.int32)
    else:
        packed = tl.load(LATENT + slot[:, None] * stride_lt + (offs_c // 2)[None, :], mask=ok, other=0)
        nibbles = (packed.to(tl.int32) >> ((offs_c % 2) * 4)[None, :]) & 15  # low nibble = even channel
        codes = nibbles - ((nibbles & 8) << 1)
    scales = tl.load(SCALES + slot[:, None] * stride_st + (offs_c // GROUP)[None, :], mask=ok, other=0.0)
    return (codes.to(tl.float32) * scales).to(DTYPE)


@triton.jit
def _split_kernel(
    Q_LAT, stride_qb, stride_qm,  # [B, M, C]
    Q_ROPE, stride_rb, stride_rm,  # [B, M, R]
    LATENT, stride_lb, stride_lt,  # [B, L, C] float, [B, L, C] int8 or [B, L, C/2] uint8
    SCALES, stride_sb, stride_st,  # [B, L, C/G] float32 (quantized caches)
    ROPE, stride_kb, stride_kt,  # [B, L, R]
    POS, stride_pb,  # [B, S] int64
    PART_ACC, PART_MAX, PART_SUM,  # [B, M, splits, C], [B, M, splits], [B, M, splits] float32
    M, H, C, R, num_splits, split_len, qk_scale,
    BITS: tl.constexpr, GROUP: tl.constexpr, ALIGNED: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, C_PAD: tl.constexpr, R_PAD: tl.constexpr,
):
    """Rows [pid_m * BLOCK_M, +BLOCK_M) of sequence pid_b over slots [pid_s * split_len, +split_len): online
    softmax partials (log2-domain max, sum, unnormalized accumulator)."""
    pid_m, pid_b, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = pid_b.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, C_PAD)
    offs_r = tl.arange(0, R_PAD)
    m_ok, c_ok, r_ok = offs_m < M, offs_c < C, offs_r < R
    # each row's last visible slot: the position of its token (row m is token m // H, head m % H)
    last = tl.load(POS + b * stride_pb + offs_m // H, mask=m_ok, other=-1)  # [BM]
    lo = pid_s * split_len
    hi = tl.minimum(lo + split_len, tl.max(last, 0) + 1)
    # the queries, resident for the whole split
    q_lat = tl.load(Q_LAT + b * stride_qb + offs_m[:, None] * stride_qm + offs_c[None, :],
                    mask=m_ok[:, None] & c_ok[None, :], other=0.0).to(DTYPE)  # [BM, CP]
    q_pe = tl.load(Q_ROPE + b * stride_rb + offs_m[:, None] * stride_rm + offs_r[None, :],
                   mask=m_ok[:, None] & r_ok[None, :], other=0.0).to(DTYPE)  # [BM, RP]
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, C_PAD], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)  # [BN]
        slot_ok = slots < hi
        # the tile: latent (dequantized in registers) and RoPE key
        c = _load_latent(LATENT + b * stride_lb, SCALES + b * stride_sb, slots.to(tl.int64), slot_ok, offs_c, c_ok,
                         stride_lt, stride_st, BITS, GROUP, ALIGNED, DTYPE, BLOCK_N, C_PAD)  # [BN, CP]
        k_pe = tl.load(ROPE + b * stride_kb + slots[:, None].to(tl.int64) * stride_kt + offs_r[None, :],
                       mask=slot_ok[:, None] & r_ok[None, :], other=0.0).to(DTYPE)  # [BN, RP]
        # scores [BM, BN] in the log2 domain; a row sees slots <= its position
        scores = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=PRECISION) * qk_scale
        visible = (slots[None, :] <= last[:, None]) & slot_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        # online softmax; a row with nothing visible yet keeps max -inf, so shift by 0 instead
        max_new = tl.maximum(row_max, tl.max(scores, 1))
        shift = tl.where(max_new == float("-inf"), 0.0, max_new)
        probs = tl.exp2(scores - shift[:, None])  # [BM, BN]
        alpha = tl.exp2(row_max - shift)
        row_sum = row_sum * alpha + tl.sum(probs, 1)
        acc = tl.dot(probs.to(DTYPE), c, acc * alpha[:, None], input_precision=PRECISION)
        row_max = max_new
    # the partials of this split
    part = (b * M + offs_m.to(tl.int64)) * num_splits + pid_s  # [BM]
    tl.store(PART_ACC + part[:, None] * C + offs_c[None, :], acc, mask=m_ok[:, None] & c_ok[None, :])
    tl.store(PART_MAX + part, row_max, mask=m_ok)
    tl.store(PART_SUM + part, row_sum, mask=m_ok)


@triton.jit
def _combine_kernel(PART_ACC, PART_MAX, PART_SUM, OUT, num_splits, C, C_PAD: tl.constexpr):
    """Row pid (of B * M): out = sum_s 2^(max_s - max) acc_s / sum_s 2^(max_s - max) sum_s."""
    row = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, C_PAD)
    c_ok = offs_c < C
    total_max = float("-inf")
    for s in range(0, num_splits):
        total_max = tl.maximum(total_max, tl.load(PART_MAX + row * num_splits + s))
    total_sum = 0.0
    acc = tl.zeros([C_PAD], dtype=tl.float32)
    for s in range(0, num_splits):
        part = row * num_splits + s
        weight = tl.exp2(tl.load(PART_MAX + part) - total_max)  # 0 for a split with no visible slot
        total_sum += weight * tl.load(PART_SUM + part)
        acc += weight * tl.load(PART_ACC + part * C + offs_c, mask=c_ok, other=0.0)
    tl.store(OUT + row * C + offs_c, (acc / total_sum).to(OUT.dtype.element_ty), mask=c_ok)


def triton_auto(q_latent: torch.Tensor) -> bool:
    return q_latent.is_cuda


def _num_splits(programs: int, num_slots: int, device: torch.device) -> int:
    """Splits of the slots so that the grid fills the GPU (PROGRAMS_PER_SM per SM), each at least MIN_SPLIT_SLOTS
    long."""
    if device.type == "cuda":
        target = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
        shortest = MIN_SPLIT_SLOTS
    else:
        target, shortest = INTERPRETER_PROGRAMS, BLOCK_N
    return max(1, min(triton.cdiv(num_slots, shortest), triton.cdiv(target, programs)))


_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def latent_attention_triton(q_latent: torch.Tensor, q_rope: torch.Tensor, layer, positions: torch.Tensor,
                            softmax_scale: float, num_slots: int, *, num_splits: int | None = None) -> torch.Tensor:
    """Launches the split and combine kernels -> [B, S, H, C] in q_latent's dtype. `num_splits` overrides the
    automatic split count (tests)."""
    b, s, h, c = q_latent.shape
    r, m = q_rope.shape[-1], s * h
    if q_latent.dtype not in _DTYPES:
        raise ValueError(f"latent_attention (triton): compute dtype {q_latent.dtype} is not one of float16, "
                         f"bfloat16, float32")
    if layer.latent.stride(-1) != 1 or layer.rope.stride(-1) != 1 or (
            layer.scales is not None and layer.scales.stride(-1) != 1):
        raise ValueError("latent_attention (triton): the cache's tensors must be contiguous in their last dim")
    q_lat = q_latent.reshape(b, m, c).contiguous()  # [B, M, C]
    q_pe = q_rope.reshape(b, m, r).contiguous()  # [B, M, R]
    pos = positions.to(torch.int64).contiguous()  # [B, S]
    # bf16 tiles run as float32 in the interpreter, whose bf16 tl.dot is wrong
    dtype = torch.float32 if INTERPRET and q_latent.dtype == torch.bfloat16 else q_latent.dtype
    c_pad, r_pad = max(16, triton.next_power_of_2(c)), max(16, triton.next_power_of_2(r))
    m_blocks = triton.cdiv(m, BLOCK_M)
    if num_splits is None:
        num_splits = _num_splits(b * m_blocks, num_slots, q_latent.device)
    split_len = triton.cdiv(triton.cdiv(num_slots, num_splits), BLOCK_N) * BLOCK_N
    num_splits = triton.cdiv(num_slots, split_len)
    dev = q_latent.device
    part_acc = torch.empty(b, m, num_splits, c, device=dev, dtype=torch.float32)
    part_max = torch.empty(b, m, num_splits, device=dev, dtype=torch.float32)
    part_sum = torch.empty(b, m, num_splits, device=dev, dtype=torch.float32)
    out = torch.empty(b, m, c, device=dev, dtype=q_latent.dtype)
    lat, rope, group = layer.latent, layer.rope, layer.group_size or 1
    scales = layer.scales if layer.bits is not None else lat  # an unused pointer for the 16-bit cache
    _split_kernel[(m_blocks, b, num_splits)](
        q_lat, q_lat.stride(0), q_lat.stride(1),
        q_pe, q_pe.stride(0), q_pe.stride(1),
        lat, lat.stride(0), lat.stride(1),
        scales, scales.stride(0), scales.stride(1),
        rope, rope.stride(0), rope.stride(1),
        pos, pos.stride(0),
        part_acc, part_max, part_sum,
        m, h, c, r, num_splits, split_len, softmax_scale * LOG2E,
        BITS=layer.bits or 16, GROUP=group, ALIGNED=c == c_pad and group & (group - 1) == 0, DTYPE=_DTYPES[dtype],
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, C_PAD=c_pad, R_PAD=r_pad, num_warps=NUM_WARPS,
    )
    _combine_kernel[(b * m,)](part_acc, part_max, part_sum, out, num_splits, c, C_PAD=c_pad,
                              num_warps=COMBINE_WARPS)
    return out.view(b, s, h, c)
