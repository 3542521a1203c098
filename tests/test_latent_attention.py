"""latent_attention: the Triton kernel (int8 / int4 codes dequantized in registers, the float cache too) against a
float64 computation from the dequantized cache, on odd sizes (C not a power of two, lengths 1 and odd, several
splits, query tokens of one sequence at different positions); `auto` stays on the reference on CPU; greedy
generation through the kernel gives the reference's tokens.

Tolerance: err(kernel) <= 2 * err(reference in the same dtype) + atol, both against float64 (the kernel sums
the slots in another order). Slots past a sequence's position hold large finite values, so a read past the mask
moves the result far beyond the tolerance. Kernels run under TRITON_INTERPRET=1 on CPU, or on CUDA (`gpu`)."""

from __future__ import annotations

import math

import pytest
import torch

from factories import tiny_config
from moela.inference import generate
from moela.inference.latent_attention import DISPATCH, CachedLayer, latent_attention, latent_attention_reference
from moela.inference.quant import dequantize, quantize
from moela.model import build_model
from moela.ops import triton_env

needs_interpreter = pytest.mark.skipif(not triton_env.INTERPRET, reason="set TRITON_INTERPRET=1 to run Triton on CPU")
# (bits, group size, C): C = 48 loads per channel; C = 64 with power-of-two groups takes the aligned loads
CASES = [(None, 0, 48), (8, 8, 48), (8, 48, 48), (4, 16, 48), (4, 24, 48), (None, 0, 64), (8, 32, 64), (4, 16, 64),
         (4, 64, 64)]


def _inputs(b: int, s: int, h: int, c: int, r: int, slots: int, positions: list[list[int]], bits, group,
            dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """Queries, the cached layer and positions; the slots after each sequence's last position hold stale values 100x
    larger than the real ones."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.tensor(positions, dtype=torch.long)  # [B, S]
    latent = torch.randn(b, slots, c, generator=g)  # [B, L, C]
    rope = torch.randn(b, slots, r, generator=g)  # [B, L, R]
    stale = torch.arange(slots)[None, :] > pos.max(dim=1).values[:, None]  # [B, L]
    latent[stale] *= 100.0
    rope[stale] *= 100.0
    q_lat = (torch.randn(b, s, h, c, generator=g) / c ** 0.25).to(device, dtype)
    q_pe = (torch.randn(b, s, h, r, generator=g) / r ** 0.25).to(device, dtype)
    rope = rope.to(device, dtype)
    if bits is None:
        layer = CachedLayer(latent.to(device, dtype), rope)
    else:
        codes, scales = quantize(latent, bits, group)
        layer = CachedLayer(codes.to(device), rope, bits, scales.to(device), group)
    return q_lat, q_pe, layer, pos.to(device)


def _float64(q_lat, q_pe, layer: CachedLayer, pos, scale: float) -> torch.Tensor:
    """Each query token on its own: dequantize the cache in float64, softmax over slots [0, position]."""
    if layer.bits is None:
        latent = layer.latent.double()
    else:
        latent = dequantize(layer.latent, layer.scales, layer.bits, layer.group_size, torch.float64)
    out = torch.empty(q_lat.shape, dtype=torch.float64, device=q_lat.device)
    for i in range(q_lat.shape[0]):
        for j in range(q_lat.shape[1]):
            n = int(pos[i, j]) + 1
            keys, keys_pe = latent[i, :n], layer.rope[i, :n].double()  # [n, C], [n, R]
            scores = (q_lat[i, j].double() @ keys.T + q_pe[i, j].double() @ keys_pe.T) * scale  # [H, n]
            out[i, j] = scores.softmax(-1) @ keys
    return out


def _check_close(got, q_lat, q_pe, layer, pos, scale, num_slots, atol):
    want = _float64(q_lat, q_pe, layer, pos, scale)
    same_dtype = latent_attention_reference(q_lat, q_pe, layer, pos, scale, num_slots)
    assert got.shape == want.shape and got.dtype == q_lat.dtype
    err, err_ref = (got.double() - want).abs().max().item(), (same_dtype.double() - want).abs().max().item()
    assert err <= 2 * err_ref + atol, (err, err_ref)


@needs_interpreter
@pytest.mark.parametrize("bits,group,c", CASES)
def test_decode_step_matches_float64(bits, group, c):
    """One token per sequence at positions 0 (length 1), 16 and 36; automatic and forced split counts."""
    from moela.inference.latent_attention_triton import latent_attention_triton
    pos = [[0], [16], [36]]
    q_lat, q_pe, layer, pos_t = _inputs(3, 1, 5, c, 8, 41, pos, bits, group, torch.float32, seed=c + group)
    scale = 1 / math.sqrt(56)
    for splits in (None, 1, 3):
        got = latent_attention_triton(q_lat, q_pe, layer, pos_t, scale, 37, num_splits=splits)
        _check_close(got, q_lat, q_pe, layer, pos_t, scale, 37, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("bits,group", [(None, 0), (8, 20), (4, 8)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_several_query_tokens_at_their_own_positions(bits, group, dtype):
    """A prefill chunk: 7 tokens x 5 heads = 35 rows in two row blocks, each row masked at its token's position
    (right-padded sequences: the padding tokens' positions run past the real ones)."""
    pos = [[p + 3 for p in range(7)], [p for p in range(7)], [p + 26 for p in range(7)]]
    q_lat, q_pe, layer, pos_t = _inputs(3, 7, 5, 40, 8, 35, pos, bits, group, dtype, seed=7)
    got = latent_attention(q_lat, q_pe, layer, pos_t, softmax_scale=0.15, backend="triton")
    _check_close(got, q_lat, q_pe, layer, pos_t, 0.15, 33, atol=2e-3)


def test_auto_is_the_reference_on_cpu_and_bad_input_is_named():
    q_lat, q_pe, layer, pos = _inputs(2, 1, 3, 16, 8, 9, [[2], [8]], 8, 8, torch.float32)
    assert DISPATCH.choose("auto", q_lat) == "reference"
    got = latent_attention(q_lat, q_pe, layer, pos, softmax_scale=0.2)
    torch.testing.assert_close(got.double(), _float64(q_lat, q_pe, layer, pos, 0.2), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="positions must be"):
        latent_attention(q_lat, q_pe, layer, pos[:, 0], softmax_scale=0.2)
    with pytest.raises(ValueError, match="do not match the cache"):
        latent_attention(q_lat[..., :8], q_pe, layer, pos, softmax_scale=0.2)
    with pytest.raises(ValueError, match="slots asked"):
        latent_attention(q_lat, q_pe, layer, pos, softmax_scale=0.2, num_slots=10)
    with pytest.raises(ValueError, match="unknown backend"):
        latent_attention(q_lat, q_pe, layer, pos, softmax_scale=0.2, backend="cuda")


@needs_interpreter
@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_greedy_generation_through_the_kernel_equals_the_reference(quant):
    """The tiny model (C = 24, so int4 groups of 8 and int8 groups of 24), two prompts of different lengths."""
    model = build_model(tiny_config(kv_lora_rank=24, num_attention_heads=3, initializer_range=0.1,
                                    max_position_embeddings=64), dtype=torch.float32).eval()
    prompts = [[5, 9, 2, 7, 1], [3]]
    group = 8 if quant == "int4" else 24
    ref = generate(model, prompts, max_new_tokens=4, temperature=0, cache_quant=quant, group_size=group,
                   backend="reference")
    got = generate(model, prompts, max_new_tokens=4, temperature=0, cache_quant=quant, group_size=group,
                   backend="triton")
    assert got == ref and all(len(x) == 4 for x in got)


@pytest.mark.gpu
@pytest.mark.parametrize("bits,group", [(None, 0), (8, 64), (4, 64), (4, 32)])
def test_gpu_model_sizes(bits, group):
    """DeepSeek's latent shapes in bf16 on CUDA: C 512, R 64, 16 heads, a 4097-slot cache, lengths 1 to 4097."""
    pos = [[0], [1030], [4096]]
    q_lat, q_pe, layer, pos_t = _inputs(3, 1, 16, 512, 64, 4097, pos, bits, group, torch.bfloat16, "cuda", seed=5)
    scale = 1 / math.sqrt(192)
    got = latent_attention(q_lat, q_pe, layer, pos_t, softmax_scale=scale)
    _check_close(got, q_lat, q_pe, layer, pos_t, scale, 4097, atol=1e-3)
