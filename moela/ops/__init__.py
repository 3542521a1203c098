"""Fast ops, one public function per op, its pure-torch reference first, then its kernels.

Small ops are one module each (norm, rope, swiglu, loss, linear_cross_entropy); attention and the MoE expert path
are packages (`moela.ops.attention`, `moela.ops.moe`) whose `__init__` exports the public function. `ops` imports
nothing else from moela. Backend choice is per call (`backend="auto" | "reference" | ...`): the names are in
`moela.ops.backends`, the choice in `moela.ops.dispatch`.
"""
