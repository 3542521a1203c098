"""Inference: decoding a trained model with the MLA latent cache (absorbed weights, optional int8 / int4 latent)
and sampling.

Public API: `generate(model, prompts, ...)`, `generate_uncached(...)`, `sample_next(logits, ...)`,
`LatentDecoder(model)`, `LatentCache`, `cache_bytes_per_token(...)`. Imports only `moela.model` and `moela.ops`.
"""

from moela.inference.cache import QUANT_BITS, LatentCache, cache_bytes_per_token
from moela.inference.decode import LatentDecoder
from moela.inference.sampling import generate, generate_uncached, make_generator, sample_next

__all__ = ["QUANT_BITS", "LatentCache", "LatentDecoder", "cache_bytes_per_token", "generate", "generate_uncached",
           "make_generator", "sample_next"]
