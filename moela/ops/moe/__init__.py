"""Routed-expert computation of a Mixture-of-Experts layer: `moe_experts` (moela.ops.moe.api) and its backends."""

from moela.ops.moe.api import autocast_input, moe_experts, tokens_per_expert
from moela.ops.moe.reference import moe_experts_reference

__all__ = ["autocast_input", "moe_experts", "moe_experts_reference", "tokens_per_expert"]
