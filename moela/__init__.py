"""moela: train DeepSeek-V3-style MLA + MoE language models end to end.

Subpackages are imported explicitly by their users (`from moela.model import ...`); this file stays empty of
imports so that importing one part never pulls in (or breaks on) another.
"""

__version__ = "0.1.0"
