"""DP blocks, CP chunk order and placements."""

from __future__ import annotations

import itertools
import random

import pytest

from mimo.core.errors import LayoutError
from mimo.parallel.grid import ParallelGrid
from mimo.parallel.layout import Piece, Placement, cp_chunks, cp_owner, dp_blocks, split_columns, split_even
from mimo.parallel.layout_reference import dp_placement


def brute_force_best_max(costs, dp):
    n = len(costs)
    best = None
    for cuts in itertools.combinations_with_replacement(range(n + 1), dp - 1):
        bounds = [0, *cuts, n]
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


def check_blocks(costs, dp, blocks):
    assert len(blocks) == dp
    assert [i for b in blocks for i in b] == list(range(len(costs)))  # contiguous, each once, in order
    assert all(b.step == 1 for b in blocks)


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_dp_blocks_minimise_the_largest_block(dp):
    rng = random.Random(dp)
    for _ in range(150):
        n = rng.randint(0, 8)
        costs = [rng.choice([1, 2, 3, 7, 30, 150]) for _ in range(n)]
        blocks = dp_blocks(costs, dp)
        check_blocks(costs, dp, blocks)
        largest = max((sum(costs[i] for i in b) for b in blocks), default=0)
        assert largest == (brute_force_best_max(costs, dp) if n else 0), (costs, blocks)


def test_dp_blocks_edge_cases():
    assert dp_blocks([], 3) == [range(0, 0)] * 3
    # fewer samples than ranks: every sample alone, the rest empty
    blocks = dp_blocks([5, 9], 4)
    check_blocks([5, 9], 4, blocks)
    assert sorted(len(b) for b in blocks) == [0, 0, 1, 1]
    # equal shares are found when they exist, no rank left idle
    assert dp_blocks([5, 5, 5, 5], 2) == [range(0, 2), range(2, 4)]
    assert [len(b) for b in dp_blocks([4, 4, 4, 4, 4, 4], 3)] == [2, 2, 2]
    assert [len(b) for b in dp_blocks([5, 5, 5, 5], 3)] == [1, 1, 2] or [len(b) for b in dp_blocks([5, 5, 5, 5], 3)] == [2, 1, 1]
    with pytest.raises(LayoutError):
        dp_blocks([1], 0)


def min_max_partition(costs, dp):
    """The smallest possible largest block, by dynamic programming over prefixes (independent
    of dp_blocks' binary search): best[j][i] = best largest block of costs[:i] in j blocks."""
    prefix = [0, *itertools.accumulate(costs)]
    n, inf = len(costs), float("inf")
    best = [[0] + [inf] * n] + [[inf] * (n + 1) for _ in range(dp)]
    for j in range(1, dp + 1):
        for i in range(n + 1):
            best[j][i] = min(max(best[j - 1][m], prefix[i] - prefix[m]) for m in range(i + 1))
    return best[dp][n]


@pytest.mark.parametrize("dp", [3, 4, 7])
def test_dp_blocks_are_optimal_on_long_inputs(dp):
    """300 samples (too many for the brute force above): the largest block is the optimum, and
    the answer depends only on the cost values (not on the sequence type holding them)."""
    rng = random.Random(7 + dp)
    costs = [rng.randint(1, 500) for _ in range(300)]
    blocks = dp_blocks(costs, dp)
    check_blocks(costs, dp, blocks)
    assert max(sum(costs[i] for i in b) for b in blocks) == min_max_partition(costs, dp)
    assert dp_blocks(tuple(costs), dp) == blocks and dp_blocks([float(c) for c in costs], dp) == blocks


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_cp_owner_is_a_bijection_in_chunk_order(cp):
    padded = 2 * cp * 5
    seen = {}
    for pos in range(padded):
        rank, off = cp_owner(pos, padded, cp)
        assert (rank, off) not in seen
        seen[(rank, off)] = pos
    chunk = padded // (2 * cp)
    for r in range(cp):
        first, second = cp_chunks(r, cp)
        local = [seen[(r, i)] for i in range(2 * chunk)]
        assert local == list(range(first * chunk, (first + 1) * chunk)) + list(range(second * chunk, (second + 1) * chunk))
    with pytest.raises(LayoutError, match="multiple"):
        cp_owner(0, 2 * cp + 1, cp)


def test_splits():
    assert split_even(7, 3) == [range(0, 3), range(3, 6), range(6, 7)]
    assert split_even(2, 4) == [range(0, 1), range(1, 2), range(2, 2), range(2, 2)]
    assert split_columns(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]


def test_placement_validation_catches_gaps_and_overlaps():
    ok = Placement(4, 2, (Piece(0, 0, 2, 0, 0, 2), Piece(1, 2, 2, 0, 0, 2)), {0: 2, 1: 2})
    assert ok.holders(3, 1) == [(1, 1)]
    with pytest.raises(LayoutError, match="held by no rank"):
        Placement(4, 2, (Piece(0, 0, 2, 0, 0, 2),), {0: 2})
    with pytest.raises(LayoutError, match="overlap"):
        Placement(4, 2, (Piece(0, 0, 2, 0, 0, 2), Piece(0, 2, 2, 1, 0, 2)), {0: 3})
    with pytest.raises(LayoutError, match="exceeds"):
        Placement(4, 2, (Piece(0, 0, 4, 1, 0, 2),), {0: 4})


@pytest.mark.parametrize("shard", [None, "hidden", "seq"])
def test_dp_placement_holds_every_element(shard):
    grid = ParallelGrid({"tp": 3, "dp": 2}, offset=2)
    rows = [4, 0, 7, 1, 0, 3]
    blocks = dp_blocks(rows, 2)
    pl = dp_placement(grid, rows, blocks, hidden=8, shard=shard)
    assert pl.rows == sum(rows) and sorted(pl.local_rows) == list(grid.ranks)
    starts = [0, *itertools.accumulate(rows)]
    for d, block in enumerate(blocks):
        block_rows = range(starts[block.start], starts[block.stop])
        for row in block_rows:
            for col in range(8):
                holders = pl.holders(row, col)
                ranks = {r for r, _ in holders}
                dp_ranks = {grid.rank_at(tp=t, dp=d) for t in range(3)}
                assert ranks <= dp_ranks
                assert len(holders) == (3 if shard is None else 1)
