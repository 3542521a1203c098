"""Which parts of the model each pipeline stage holds: `stage_layout(model_cfg, pp, virtual_stages, layout)`.

A layout is a compact string in Megatron-LM's spirit, one group of characters per stage, stages separated by `|`:

    E   the token embedding (first stage, first)          t   the next main transformer layer
    m   the next multi-token-prediction depth              L   the final norm, output head and loss
    (x)*n  the group x repeated n times                    c*n the character c repeated n times

e.g. `Et|tt|tt|tmL` (4 stages, 6 layers, one MTP depth) or `Et|(tt|)*3tmL`. Spaces are ignored. The string has
pp * virtual_stages stages in pipeline order (stage k feeds stage k + 1); `stage_ranks` says which rank holds
stage k for a schedule. Rules: every main layer and MTP depth appears once, in order; `E` opens the first stage;
`L` and every `m` sit in the last stage (the MTP depths read the final norm's output and use the output head);
no stage is empty.

Without a layout string the stages are balanced by training FLOPs per token (`part_costs`, the 6N-style count of
`moela.model.params` plus causal attention at `seq_len`): the embedding goes to the first stage and the head,
loss and MTP depths to the last, their costs counted in those stages' totals, and the main layers are cut into
contiguous runs so that the most expensive stage is as cheap as possible (an exact min-max partition).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moela.model.config import ModelConfig
from moela.model.params import _block_params


@dataclass(frozen=True)
class StageParts:
    """One pipeline stage's share of the model."""

    embed: bool  # the token embedding (and the MTP depths' input embeddings)
    layers: tuple[int, ...]  # main transformer layers, by index
    mtp: tuple[int, ...]  # MTP depths, by index
    loss: bool  # final norm + output head + loss

    def code(self) -> str:
        """This stage in the layout grammar."""
        return "E" * self.embed + "t" * len(self.layers) + "m" * len(self.mtp) + "L" * self.loss


def layout_string(stages: list[StageParts]) -> str:
    return "|".join(s.code() for s in stages)


def stage_ranks(pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """The pipeline rank holding each of the pp * virtual_stages stages: round-robin (stage k on rank k mod pp)
    for 1f1b and interleaved_1f1b; V-shaped for zbv and dualpipev (rank r holds stages r and 2pp-1-r, so the
    first and the last stage share rank 0)."""
    if schedule in ("zbv", "dualpipev"):
        return [k if k < pp else 2 * pp - 1 - k for k in range(2 * pp)]
    return [k % pp for k in range(pp * virtual_stages)]


def _expand(text: str) -> str:
    s = re.sub(r"\s+", "", text)
    while True:
        new = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
        new = re.sub(r"([EtmL|])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), new)
        if new == s:
            return s
        s = new


def parse_layout(text: str, num_layers: int, num_mtp: int, num_stages: int) -> list[StageParts]:
    """The stages a layout string describes; raises ValueError naming what is wrong and how to fix it."""
    hint = (f"write {num_stages} stages separated by '|' with 'E' first, {num_layers} 't', {num_mtp} 'm' and 'L' "
            f"in the last stage (e.g. {layout_string(_even(num_layers, num_mtp, num_stages))!r}), or leave "
            f"parallel.pp_layout empty for a balanced one")
    expanded = _expand(text)
    bad = sorted(set(expanded) - set("EtmL|"))
    if bad:
        raise ValueError(f"parallel.pp_layout {text!r}: unknown characters {''.join(bad)!r}; {hint}")
    groups = expanded.split("|")
    if len(groups) != num_stages:
        raise ValueError(f"parallel.pp_layout {text!r}: {len(groups)} stages but pp * virtual stages = "
                         f"{num_stages}; {hint}")
    stages, layer, depth = [], 0, 0
    for k, g in enumerate(groups):
        if not g:
            raise ValueError(f"parallel.pp_layout {text!r}: stage {k} is empty; {hint}")
        if "E" in g and (k != 0 or g.index("E") != 0 or g.count("E") > 1):
            raise ValueError(f"parallel.pp_layout {text!r}: 'E' must open the first stage, once; {hint}")
        if ("L" in g or "m" in g) and k != num_stages - 1:
            raise ValueError(f"parallel.pp_layout {text!r}: 'L' and 'm' belong in the last stage; {hint}")
        if g.count("L") > 1 or ("m" in g and "t" in g[g.index("m"):]):
            raise ValueError(f"parallel.pp_layout {text!r}: stage {k} has a 't' after an 'm' or two 'L'; {hint}")
        nt, nm = g.count("t"), g.count("m")
        stages.append(StageParts(embed="E" in g, layers=tuple(range(layer, layer + nt)),
                                 mtp=tuple(range(depth, depth + nm)), loss="L" in g))
        layer, depth = layer + nt, depth + nm
    if not stages[0].embed or not stages[-1].loss or layer != num_layers or depth != num_mtp:
        raise ValueError(f"parallel.pp_layout {text!r}: has {layer} 't' and {depth} 'm' (embedding "
                         f"{'present' if stages[0].embed else 'missing'}, loss "
                         f"{'present' if stages[-1].loss else 'missing'}); {hint}")
    return stages


def _even(num_layers: int, num_mtp: int, num_stages: int) -> list[StageParts]:
    """Layers spread as evenly as counts allow (only for error messages' examples)."""
    per = [num_layers // num_stages + (k < num_layers % num_stages) for k in range(num_stages)]
    starts = [sum(per[:k]) for k in range(num_stages)]
    return [StageParts(k == 0, tuple(range(starts[k], starts[k] + per[k])),
                       tuple(range(num_mtp)) if k == num_stages - 1 else (), k == num_stages - 1)
            for k in range(num_stages)]


def part_costs(cfg: ModelConfig, seq_len: int) -> dict[str, object]:
    """Training FLOPs per token of each part: "layers" (a list, one per main layer), "embed", "head" (final norm
    + output head + loss) and "mtp" (one depth: its block, projection and its pass through the head)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    attn = 3 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len
    layers = [6 * _block_params(cfg, i >= cfg.first_k_dense_replace, fal_norm=False, matmul_only=True)[1] + attn
              for i in range(cfg.num_hidden_layers)]
    mtp = 6 * (_block_params(cfg, cfg.mtp_is_moe, fal_norm=False, matmul_only=True)[1] + 2 * d * d + v * d) + attn
    return {"layers": layers, "embed": 6 * d, "head": 6 * v * d, "mtp": mtp}


def balanced_layout(cfg: ModelConfig, num_stages: int, seq_len: int = 4096) -> list[StageParts]:
    """The exact min-max partition of the main layers into `num_stages` contiguous runs, with the embedding's
    cost on the first stage and the head's and MTP depths' on the last (module docstring). Every stage between
    the first and the last gets at least one layer."""
    costs = part_costs(cfg, seq_len)
    layer_cost, n = costs["layers"], cfg.num_hidden_layers
    first_extra, last_extra = costs["embed"], costs["head"] + cfg.num_nextn_predict_layers * costs["mtp"]
    if num_stages == 1:
        return [StageParts(True, tuple(range(n)), tuple(range(cfg.num_nextn_predict_layers)), True)]
    prefix = [0.0]
    for c in layer_cost:
        prefix.append(prefix[-1] + c)
    inf = float("inf")

    def cost(k: int, i: int, j: int) -> float:  # stage k holding layers i..j-1
        extra = (first_extra if k == 0 else 0.0) + (last_extra if k == num_stages - 1 else 0.0)
        if j == i and 0 < k < num_stages - 1:
            return inf
        return prefix[j] - prefix[i] + extra

    # best[k][j]: the least possible maximum over stages 0..k when they hold layers 0..j-1; cut[k][j] its start
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(n + 1):
        best[0][j] = cost(0, 0, j)
    for k in range(1, num_stages):
        for j in range(n + 1):
            for i in range(j + 1):
                value = max(best[k - 1][i], cost(k, i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    if best[-1][n] == inf:
        raise ValueError(f"parallel.pp: {num_stages} pipeline stages need at least {num_stages - 2} main layers "
                         f"(one per middle stage), the model has {n}; lower parallel.pp or "
                         f"parallel.pp_virtual_stages")
    bounds, j = [n], n
    for k in range(num_stages - 1, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    bounds = [0] + bounds[::-1]
    depth = tuple(range(cfg.num_nextn_predict_layers))
    return [StageParts(k == 0, tuple(range(bounds[k], bounds[k + 1])), depth if k == num_stages - 1 else (),
                       k == num_stages - 1) for k in range(num_stages)]


def stage_layout(model_cfg: ModelConfig, pp: int, virtual_stages: int, layout: str | None, *,
                 seq_len: int = 4096) -> list[StageParts]:
    """The parts of each of the pp * virtual_stages stages, in pipeline order: parsed from `layout` if given,
    else balanced by training FLOPs at document length `seq_len`. Raises ValueError with the fix."""
    num_stages = pp * virtual_stages
    if layout:
        return parse_layout(layout, model_cfg.num_hidden_layers, model_cfg.num_nextn_predict_layers, num_stages)
    return balanced_layout(model_cfg, num_stages, seq_len)
