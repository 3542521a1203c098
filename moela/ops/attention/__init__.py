"""Variable-length (packed) attention for MLA: `mla_attention` (moela.ops.attention.api) and its backends."""

from moela.ops.attention.api import mla_attention
from moela.ops.attention.reference import attention_reference

__all__ = ["attention_reference", "mla_attention"]
