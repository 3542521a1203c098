"""Pipeline schedules as per-rank action lists, and a simulator that runs them on a cost model.

An action is `Action(kind, stage, mb)`: kind "F" (forward), "B" (whole backward), "I" (backward to the stage's
inputs only) or "W" (the rest: the weight gradients, deferred); `Overlap(f, b)` is DualPipeV's pair, one
chunk's forward run together with another chunk's backward. `schedule_actions(name, pp, m)` returns every rank's
list. Each rank runs its list in order; sends never wait, receives do, so a schedule is deadlock-free when
`simulate` finishes it.

- 1f1b (PipeDream-flush, Megatron's default): rank r runs pp - r - 1 warm-up forwards, then alternates one forward
  and one backward, then drains the backwards. Bubble (pp-1)(F+B) per step, activations of up to pp micro-batches.
- interleaved_1f1b (Megatron's virtual stages): rank r holds v stages r, r + pp, ...; forwards walk micro-batches
  in groups of pp through the chunks; bubble (pp-1)(F+B)/v, at the price of v times the stage-to-stage traffic.
- zbv (zero-bubble V, Qi et al. 2024): rank r holds stages r and 2pp-1-r (a V: the first and last stage on rank 0);
  backwards split into I and W so that deferred W fill the warm-up and cool-down gaps. Bubble about
  (pp-1)(F+B-2W) with I and W each about B/2, activations of up to 2pp chunk micro-batches (as 1f1b's pp).
- dualpipev (DeepSeek's DualPipe cut in half, the V layout of zbv): its steady state is pairs of one chunk's
  forward and the other chunk's backward (`Overlap`), whose all-to-alls hide under each other's compute; bubble
  (pp-1)(F&B + B - 3W) in DualPipe's notation (F&B the time of an overlapped pair).
"""

from __future__ import annotations

from typing import NamedTuple

SCHEDULES = ("1f1b", "interleaved_1f1b", "zbv", "dualpipev")


class Action(NamedTuple):
    kind: str  # "F", "B", "I" or "W"
    stage: int
    mb: int


class Overlap(NamedTuple):
    f: Action
    b: Action  # kind "B" or "I"


Step = Action | Overlap


def schedule_actions(name: str, pp: int, m: int, virtual_stages: int = 1) -> list[list[Step]]:
    """Every rank's action list for `m` micro-batches on `pp` ranks."""
    make = {"1f1b": _one_f_one_b, "interleaved_1f1b": _interleaved, "zbv": _zbv, "dualpipev": _dualpipev}[name]
    return [make(pp, m, r, virtual_stages) for r in range(pp)]


def _one_f_one_b(pp: int, m: int, r: int, v: int) -> list[Step]:
    warm = min(pp - r - 1, m)
    ops: list[Step] = [Action("F", r, i) for i in range(warm)]
    for i in range(m - warm):
        ops += [Action("F", r, warm + i), Action("B", r, i)]
    return ops + [Action("B", r, i) for i in range(m - warm, m)]


def _interleaved(pp: int, m: int, r: int, v: int) -> list[Step]:
    total = m * v

    def place(k: int, backward: bool) -> tuple[int, int]:  # k-th forward (backward) of this rank -> (stage, mb)
        group, within = divmod(k, pp * v)
        chunk = within // pp
        return (v - 1 - chunk if backward else chunk) * pp + r, group * pp + within % pp

    warm = min((pp - r - 1) * 2 + (v - 1) * pp, total)
    ops: list[Step] = [Action("F", *place(k, False)) for k in range(warm)]
    for k in range(total - warm):
        ops += [Action("F", *place(warm + k, False)), Action("B", *place(k, True))]
    return ops + [Action("B", *place(k, True)) for k in range(total - warm, total)]


def _zbv(pp: int, m: int, r: int, v: int) -> list[Step]:
    """ZB-V for m >= 2pp - 1: forwards of chunk 0 fill the V's descent; each backward is I then W at once in the
    steady state; in the cool-down, I's go first and the W's fill what would be bubble."""
    s0, s1 = r, 2 * pp - 1 - r
    ops: list[Step] = []
    n = {"F0": 0, "F1": 0, "I0": 0, "I1": 0, "W0": 0, "W1": 0}

    def add(kind: str, chunk: int) -> None:
        key = f"{kind}{chunk}"
        ops.append(Action(kind, s1 if chunk else s0, n[key]))
        n[key] += 1

    for _ in range(2 * (pp - r) - 1):
        add("F", 0)
    for _ in range(r):
        add("F", 1)
        add("F", 0)
    for _ in range(pp - r):
        add("F", 1)
        add("I", 1)
        add("W", 1)
    while n["F1"] < n["F0"] or n["F0"] < m:
        if n["F0"] < m:
            add("F", 0)
        add("I", 0)
        add("W", 0)
        add("F", 1)
        add("I", 1)
        add("W", 1)
    for _ in range(r):
        add("I", 0)
        add("I", 1)
    for _ in range(pp - r):
        add("I", 0)
        add("W", 0)
    while n["W1"] < n["I1"]:
        add("W", 1)
    while n["W0"] < n["I0"]:
        add("W", 0)
    return ops


def _dualpipev(pp: int, m: int, r: int, v: int) -> list[Step]:
    s0, s1 = r, 2 * pp - 1 - r
    ops: list[Step] = []
    n = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}
    deferred: list[Action] = []

    def f(chunk: int) -> Action:
        key = f"f{chunk}"
        n[key] += 1
        return Action("F", s0 if chunk == 0 else s1, n[key] - 1)

    def b(chunk: int, zero_bubble: bool = False) -> Action:
        key = f"b{chunk}"
        n[key] += 1
        stage = s0 if chunk == 0 else s1
        if zero_bubble:
            deferred.append(Action("W", stage, n[key] - 1))
            return Action("I", stage, n[key] - 1)
        return Action("B", stage, n[key] - 1)

    def w() -> None:
        ops.append(deferred.pop(0))

    for _ in range((pp - r - 1) * 2):  # 1: forwards of chunk 0
        ops.append(f(0))
    for _ in range(r + 1):  # 2: forwards of both chunks
        ops += [f(0), f(1)]
    for _ in range(pp - r - 1):  # 3: zero-bubble backwards of chunk 1 between forwards of chunk 1
        ops.append(b(1, True))
        w()
        ops.append(f(1))
    for i in range(m - 2 * pp + r + 1):  # 4: the steady state, overlapped pairs
        if i == 0 and r == pp - 1:  # the V's tip: chunk 1's backward needs chunk 0's forward just before
            ops += [f(0), b(1)]
        else:
            ops.append(Overlap(f(0), b(1)))
        ops.append(Overlap(f(1), b(0)))
    for _ in range(pp - r - 1):  # 5
        ops.append(b(1))
        ops.append(Overlap(f(1), b(0)))
    zero_bubble = False
    for i in range(r + 1):  # 6: the remaining backwards; the second half splits off its weight gradients
        if i == (r + 1) // 2 and r % 2 == 1:
            zero_bubble = True
        ops.append(b(1, zero_bubble))
        if i == (r + 1) // 2 and r % 2 == 0:
            zero_bubble = True
        ops.append(b(0, zero_bubble))
    for _ in range(pp - r - 1):  # 7
        w()
        ops.append(b(0, True))
    while deferred:  # 8
        w()
    return ops


def _deps(step: Action, last: int) -> list[Action]:
    """The actions `step` waits for: the previous stage's forward, the next stage's input gradient, its own
    forward, its own input-gradient part."""
    kind, s, mb = step
    if kind == "F":
        return [Action("F", s - 1, mb)] if s > 0 else []
    if kind in ("B", "I"):
        return [Action("F", s, mb)] + ([Action("I", s + 1, mb)] if s < last else [])
    return [Action("I", s, mb)]


def simulate(ranks: list[list[Step]], costs: dict[str, float], num_stages: int) -> dict:
    """Run the action lists on a cost model (seconds per action kind, an `Overlap` costing "FB" or F + B; a "B"
    completes its stage's "I" too); returns {"makespan", "busy" (per rank), "bubble" (idle share of all ranks'
    time)}. Raises RuntimeError on a deadlock."""
    done: dict[Action, float] = {}
    free = [0.0] * len(ranks)
    pos = [0] * len(ranks)
    busy = [0.0] * len(ranks)
    last = num_stages - 1
    while any(p < len(ops) for p, ops in zip(pos, ranks)):
        progressed = False
        for r, ops in enumerate(ranks):
            while pos[r] < len(ops):
                step = ops[pos[r]]
                parts = list(step) if isinstance(step, Overlap) else [step]
                deps = [d for p in parts for d in _deps(p, last)]
                if not all(d in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                cost = (costs.get("FB", costs["F"] + costs["B"]) if isinstance(step, Overlap)
                        else costs[step.kind])
                if isinstance(step, Overlap) and step.b.kind == "I":
                    cost += costs["I"] - costs["B"]
                free[r] = start + cost
                busy[r] += cost
                for p in parts:
                    done[p] = free[r]
                    if p.kind == "B":
                        done[Action("I", p.stage, p.mb)] = free[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: ops[pos[r]] for r, ops in enumerate(ranks) if pos[r] < len(ops)}
            raise RuntimeError(f"pipeline schedule deadlocks: each rank waits at {stuck}")
    makespan = max(free)
    return {"makespan": makespan, "busy": busy, "bubble": 1 - sum(busy) / (makespan * len(ranks))}
