"""Fast ops, one public function per op family; each module holds the pure-torch reference first, then kernels.

`ops` imports nothing else from moela. Backend choice is per call (`backend="auto" | "reference" | ...`), see
`moela.ops.dispatch`.
"""
