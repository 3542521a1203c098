"""The persistent schedule of the Gluon k-grouped FP8 GEMM (moela.ops.moe.kernels.gemm_fp8_gluon_kgrouped), on the CPU:
the kernel's own tile -> (expert, row block, column block) map and ring arithmetic (plain functions the kernel jits)
must cover every output tile exactly once at any shape, and a step-by-step model of the producer warp and the two
consumer warpgroups (their mbarrier waits and arrivals, a random interleaving) over ragged and empty experts with
several tiles per program must hand every consumer step the scales and tiles its producer step loaded, never
overwriting a slot a consumer still reads."""

from __future__ import annotations

import random

import pytest
import torch

from moela.ops.moe.kernels.gemm_fp8_gluon_kgrouped import (
    experts_by_load,
    ring_position,
    snake_index,
    snake_rounds,
    tile_blocks,
    token_block_major,
)

LANES = 32  # the producer warp: each lane's scale copies arrive on the slot's ready barrier


@pytest.mark.parametrize("n, k, e, group", [(256, 384, 5, 8), (4096, 7168, 8, 8), (4096, 7168, 2, 16),
                                            (1280, 384, 3, 8), (384, 2048, 2, 8), (3 * 128, 5 * 128, 7, 2)])
def test_every_tile_once(n, k, e, group):
    num_n, num_k = -(-n // 128), -(-k // 128)
    seen = [tile_blocks(t, num_n, num_k, group) for t in range(e * num_n * num_k)]
    assert sorted(seen) == [(x, a, b) for x in range(e) for a in range(num_n) for b in range(num_k)]
    first = seen[:min(group, num_n)]  # a band's first column block: GROUP row blocks sharing one B tile
    assert {b for _, _, b in first} == {0} and len({a for _, a, _ in first}) == len(first)


@pytest.mark.parametrize("programs", [1, 2, 7, 132])
@pytest.mark.parametrize("num_tiles", [1, 5, 7, 131, 132, 133, 264, 265, 1000])
def test_snake_deals_every_position_once(programs, num_tiles):
    """Each program's rounds (snake_rounds of them, positions snake_index) cover 0..num_tiles-1 exactly once, and a
    program's positions rise round by round (its tiles stay in list order)."""
    dealt = []
    for p in range(programs):
        mine = [snake_index(i, p, programs) for i in range(snake_rounds(p, programs, num_tiles))]
        assert mine == sorted(mine) and all(0 <= x < num_tiles for x in mine)
        dealt += mine
    assert sorted(dealt) == list(range(num_tiles))


def _cta_work(work, programs, order, snake, per_e):
    """Total work per program: tiles of the experts in `order` (expert-major, `work[e]` per tile of expert e,
    per_e tiles each), dealt by the snake or statically (tile t on program t mod programs, experts in index
    order)."""
    tiles = [order[i // per_e] for i in range(len(work) * per_e)] if snake else \
        [i // per_e for i in range(len(work) * per_e)]
    load = [0] * programs
    for p in range(programs):
        if snake:
            for i in range(snake_rounds(p, programs, len(tiles))):
                load[p] += work[tiles[snake_index(i, p, programs)]]
        else:
            load[p] = sum(work[tiles[t]] for t in range(p, len(tiles), programs))
    return load


@pytest.mark.parametrize("per_e", [64, 32])
def test_snake_balances_skewed_experts(per_e):
    """Zipf-like expert loads (the busiest expert ~6x the mean, as the synthetic training step's router at its
    initial weights) at `small`'s FP8 weight gradients (32 experts, 64 or 32 tiles each, 132 SMs): dealt
    busiest-expert-first along the snake, no program carries more than the mean plus one largest tile; dealt
    statically in index order, the busiest program carries over 1.2x the snake's."""
    torch.manual_seed(0)
    e, programs = 32, 132
    counts = (torch.arange(1, e + 1, dtype=torch.float64) ** -1.2)[torch.randperm(e)]
    counts = (counts / counts.mean() * 1024).round().to(torch.int64)  # tokens per expert, mean 1024
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    order = experts_by_load(offsets).tolist()
    assert [counts[x] for x in order] == sorted(counts.tolist(), reverse=True)
    work = counts.tolist()
    mean = sum(work) * per_e / programs
    snake, static = _cta_work(work, programs, order, True, per_e), _cta_work(work, programs, order, False, per_e)
    assert sum(snake) == sum(static) == sum(work) * per_e
    assert max(snake) <= mean + max(work)
    assert max(static) > 1.2 * max(snake)


class Barrier:
    """An mbarrier: `count` arrivals complete the current phase; waiters ask whether the phase of a parity ended."""

    def __init__(self, count: int):
        self.count, self.pending, self.completed = count, count, 0

    def arrive(self, n: int = 1):
        self.pending -= n
        assert self.pending >= 0, "more arrivals than the barrier's count in one phase"
        if self.pending == 0:
            self.completed += 1
            self.pending = self.count

    def passed(self, parity: int) -> bool:
        """try_wait.parity: the phase with this parity completed (the current phase has the other parity)."""
        return (self.completed & 1) != parity


def _program(p, programs, num_n, num_k, e, blocks, group):
    """(tile, expert, row block, column block, token blocks) of program p's tiles, in the kernel's order: the snake
    over the experts by load (the kernel's `_round_tile`)."""
    per_e, num_tiles = num_n * num_k, e * num_n * num_k
    sizes = torch.tensor([b - a for a, b in blocks])
    order = torch.argsort(sizes, descending=True, stable=True).tolist()
    for i in range(snake_rounds(p, programs, num_tiles)):
        idx = snake_index(i, p, programs)
        tile = order[idx // per_e] * per_e + idx % per_e
        x, nb, kb = tile_blocks(tile, num_n, num_k, group)
        yield tile, x, nb, kb, range(*blocks[x])


def _simulate(offsets, n, k, programs, stages, group, seed):
    num_n, num_k, e = -(-n // 128), -(-k // 128), len(offsets) - 1
    blocks = [(offsets[i] // 128, offsets[i + 1] // 128) for i in range(e)]
    rng = random.Random(seed)
    written = set()
    for p in range(programs):
        ready = [Barrier(1 + LANES) for _ in range(stages)]
        empty = [Barrier(2) for _ in range(stages)]
        slots = [None] * stages  # what the producer loaded into each slot: (tile, token block)
        work = [(t, tb) for t, *_, tbs in _program(p, programs, num_n, num_k, e, blocks, group) for tb in tbs]
        landed = []  # producer steps whose cp.async lanes and TMA bytes are still in flight
        prod, cons = 0, [0, 0]
        while prod < len(work) or min(cons) < len(work) or landed:
            moves = []
            if prod < len(work):
                slot, phase = ring_position(prod, stages)
                if empty[slot].passed(phase ^ 1):
                    moves.append("produce")
            if landed:
                moves.append("land")
            for g in (0, 1):
                if cons[g] < len(work):
                    slot, phase = ring_position(cons[g], stages)
                    if ready[slot].passed(phase):
                        moves.append(g)
            assert moves, f"program {p} deadlocks at producer step {prod}, consumer steps {cons}"
            move = rng.choice(moves)
            if move == "produce":
                slot, _ = ring_position(prod, stages)
                assert slots[slot] is None, "the producer overwrote a slot a consumer still reads"
                slots[slot] = work[prod]
                ready[slot].arrive()  # the expect of the TMA bytes (they land with the lanes' copies below)
                landed.append(slot)
                prod += 1
            elif move == "land":
                ready[landed.pop(0)].arrive(LANES)
            else:
                slot, _ = ring_position(cons[move], stages)
                assert slots[slot] == work[cons[move]], "a consumer read another step's scales and tiles"
                empty[slot].arrive()
                cons[move] += 1
                if empty[slot].pending == 2:  # both warpgroups released it: free for the next pass
                    slots[slot] = None
        written.update(t for t, *_ in _program(p, programs, num_n, num_k, e, blocks, group))
    assert written == set(range(e * num_n * num_k))


@pytest.mark.parametrize("programs", [1, 3, 7])
@pytest.mark.parametrize("stages", [4, 5])
def test_ring_agrees_across_tiles(programs, stages):
    """Ragged experts (1, 2, 3 and 9 token blocks: the ring wraps inside a tile and across tiles) and empty ones
    (first, middle, last), several tiles per program; K > GROUP column blocks so bands matter."""
    offsets = [0, 0, 128, 384, 384, 768, 1920, 1920]
    _simulate(offsets, n=384, k=1280, programs=programs, stages=stages, group=2, seed=programs * 10 + stages)


def test_weight_gradient_scales_token_block_major():
    """The Gluon weight gradient's scales: the same values with the token blocks adjacent in memory; a tensor
    already laid out so is passed through, not copied."""
    torch.manual_seed(0)
    s = torch.rand(384, 7)  # [rows, M/128], as the quantizers write it
    t = token_block_major(s)
    assert torch.equal(t, s) and t.stride() == (1, 384)
    assert token_block_major(t) is t
