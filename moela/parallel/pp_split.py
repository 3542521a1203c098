"""The zero-bubble split of a stage's backward into I (the inputs' gradients, sent upstream at once) and W (the
parameters' gradients, deferred): `SplitBackward`.

Why a graph split rather than two passes: running the backward twice (I for the inputs, then the whole backward
again for W) is exact but makes W cost a whole backward, which gives back most of the bubble the zero-bubble
schedules remove. Here I walks only the part of the graph that leads to the stage's inputs and keeps the gradient
arriving at each boundary node: a node on that part with an edge towards a parameter (the matmul backward of
x @ W, whose incoming gradient I needs for dx anyway). W starts the engine at the boundary nodes with the kept
gradients and asks for the parameters only, so the engine runs just the parameter side of each boundary node (the
weight GEMM) and never the inputs' part again.

Groups: W runs one engine call per group of parameters reached through a common boundary node, so a call asks for
no parameter behind another boundary. A group with several boundaries (a parameter used in two places) pins each
boundary's incoming gradient to the kept one (a pre-hook returning it): the call may also carry one boundary's
input-side gradient into another, which must not count twice. A root the inputs' part does not reach (a loss term
of the parameters alone) is a boundary whose kept gradient is its seed (nothing flows into a root: no pin).

Custom autograd Functions (the fused expert op, the chunked head + cross-entropy) compute every output whenever
they run, weight gradients included, and their backward need not be safe to run twice (the expert op reuses its
saved buffers). A custom boundary is therefore never run again: I keeps the gradients it produces along its edges
towards the parameters (a post-hook), and W starts the engine below it, on those edges. Their weight gradients are
computed in I; the deferral saves the torch-native weight GEMMs.

Exactness: I runs the nodes the whole backward runs towards the inputs, with the same incoming gradients; W adds
to each parameter the same terms, from the same incoming gradients (or, below a custom boundary, the same
gradients).

FSDP2: its post-backward hooks sit on the forward's inputs and outputs, which W never reaches, so after a stage's
last W `finish_fsdp_backward` runs the post-backward (reduce-scatter, reshard) of the stage's units, as
torch.distributed.pipelining does after its own split backward.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def _graph(roots: list[torch.Tensor]) -> dict[Node, list[Node]]:
    """Every node reachable from the roots' gradient functions -> the nodes that feed gradients into it."""
    consumers: dict[Node, list[Node]] = {}
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    for node in stack:
        consumers.setdefault(node, [])
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if nxt not in consumers:
                consumers[nxt] = []
                stack.append(nxt)
            consumers[nxt].append(node)
    return consumers


def _upward(starts: list[Node], consumers: dict[Node, list[Node]], stop: set[Node] | None = None):
    """The nodes above `starts` (towards the roots), not walking past nodes in `stop`; returns (walked, stopped)."""
    walked, stopped, stack = set(starts), set(), list(starts)
    while stack:
        for up in consumers.get(stack.pop(), ()):
            if stop is not None and up in stop:
                stopped.add(up)
            elif up not in walked:
                walked.add(up)
                stack.append(up)
    return walked, stopped


class SplitBackward:
    """One stage micro-batch's backward from `roots` (with gradients `seeds`) split into `inputs_grad()` (I) and a
    later `weights_grad()` (W). `inputs` are the stage's received activations (leaves that require grad)."""

    def __init__(self, roots: list[torch.Tensor], seeds: list[torch.Tensor], inputs: list[torch.Tensor]):
        self.roots, self.seeds, self.inputs = roots, seeds, inputs
        consumers = _graph(roots)
        input_nodes = {get_gradient_edge(t).node for t in inputs}
        on_input_path, _ = _upward([n for n in input_nodes if n in consumers], consumers)
        params = [n for n in consumers if hasattr(n, "variable") and n not in input_nodes]  # AccumulateGrad nodes
        # each parameter's boundaries: the first nodes above it on the inputs' part, or roots off it
        self.groups: list[tuple[set[Node], list[Node]]] = []
        group_of: dict[Node, int] = {}
        for p in params:
            walked, stopped = _upward([p], consumers, stop=on_input_path)
            bounds = stopped | {n for n in walked if not consumers[n] and n not in on_input_path}
            merged = sorted({group_of[b] for b in bounds if b in group_of})
            if merged:
                keep = merged[0]
                for g in merged[1:]:
                    self.groups[keep][0].update(self.groups[g][0])
                    self.groups[keep][1].extend(self.groups[g][1])
                    self.groups[g] = (set(), [])
            else:
                keep = len(self.groups)
                self.groups.append((set(), []))
            self.groups[keep][0].update(bounds)
            self.groups[keep][1].append(p)
            for b in self.groups[keep][0]:
                group_of[b] = keep
        self.kept: dict[Node, list[torch.Tensor | None]] = defaultdict(list)
        watched = {b for bounds, _ in self.groups for b in bounds if b in on_input_path}
        self._custom = {b for b in watched if isinstance(b, BackwardCFunction)}  # kept: what they produce
        self._watch = watched - self._custom  # kept: what reaches them
        # a custom boundary's edges towards the parameters (off the inputs' part), where W starts instead
        self._below = {b: [(i, nxt, nr) for i, (nxt, nr) in enumerate(b.next_functions)
                           if nxt is not None and nxt not in on_input_path] for b in self._custom}
        self._produced: dict[Node, tuple] = {}
        for root, seed in zip(roots, seeds):  # roots off the inputs' part: their seeds are what reaches them
            node = root.grad_fn
            if node is not None and node not in on_input_path and node in group_of:
                grads = self.kept[node]
                while len(grads) <= root.output_nr:
                    grads.append(None)
                grads[root.output_nr] = seed if grads[root.output_nr] is None else grads[root.output_nr] + seed

    def inputs_grad(self) -> list[torch.Tensor | None]:
        """I: the inputs' gradients (None for an input the roots do not reach); keeps the boundaries' gradients."""
        if not self.inputs or not self.roots:
            return [None] * len(self.inputs)

        def keep(node):
            return lambda grads: self.kept.__setitem__(node, list(grads))

        def produced(node):
            return lambda grad_inputs, _: self._produced.__setitem__(node, grad_inputs)

        hooks = ([node.register_prehook(keep(node)) for node in self._watch]
                 + [node.register_hook(produced(node)) for node in self._custom])
        try:
            return list(torch.autograd.grad(self.roots, self.inputs, self.seeds, retain_graph=True,
                                            allow_unused=True))
        finally:
            for h in hooks:
                h.remove()

    def weights_grad(self) -> None:
        """W: accumulate the parameters' gradients (into `.grad`, as a whole backward does); frees the graph."""
        for bounds, params in self.groups:
            edges, grads = [], []
            below: dict[tuple[Node, int], torch.Tensor] = {}
            for node in bounds:
                if node in self._custom:  # start below it, from what it produced in I
                    out = self._produced.get(node, ())
                    for i, nxt, nr in self._below[node]:
                        if i < len(out) and out[i] is not None:
                            below[(nxt, nr)] = out[i] if (nxt, nr) not in below else below[(nxt, nr)] + out[i]
                    continue
                for i, g in enumerate(self.kept.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            for (nxt, nr), g in below.items():
                edges.append(GradientEdge(nxt, nr))
                grads.append(g)
            if not edges:
                continue
            pins = ([node.register_prehook(lambda _, kept=tuple(self.kept[node]): kept)
                     for node in bounds if node in self._watch] if len(bounds) > 1 else [])
            try:
                torch.autograd.backward(edges, grads, retain_graph=True, inputs=[p.variable for p in params])
            finally:
                for h in pins:
                    h.remove()
        self.roots = self.seeds = self.inputs = []
        self.kept.clear()
        self._produced.clear()
        self.groups.clear()


def finish_fsdp_backward(module) -> None:
    """Run the FSDP2 post-backward (gradient reduce-scatter and reshard, as the module's settings ask) of `module`
    (a root FSDPModule) and its units, and the root's end-of-backward callback, after a W pass."""
    state = module._get_fsdp_state()
    for s in state._state_ctx.all_states:
        groups = getattr(s, "_fsdp_param_groups", None)  # torch >= 2.12: a list; before: one group or None
        if groups is None:
            groups = [s._fsdp_param_group] if s._fsdp_param_group is not None else []
        for group in groups:
            group.post_backward()
    state._root_post_backward_final_callback()
