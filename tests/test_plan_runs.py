"""Placements from runs of rows and one rank's plans (issue 27) against the reference builders.

``dp_runs`` / ``packed_runs`` must give the very pieces of ``dp_placement`` / ``packed_placement``,
``rank_plans`` the very moves (and all-gathers) of ``make_plan`` that the rank sends or receives,
``dp_blocks`` the very blocks of ``dp_blocks_reference`` — across ragged samples, non-power-of-two
sizes, CP / SP packs, later pipeline stages, colocated and non-colocated grids. The mutation
tests break one step of the fast path at a time and check that these comparisons notice.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import mimo.bridges.plan as plan_mod
import mimo.parallel.layout as layout_mod
from mimo.bridges.plan import make_plan, rank_plans
from mimo.core.errors import LayoutError
from mimo.parallel.grid import ParallelGrid
from mimo.parallel.layout import (SampleRuns, dp_blocks, dp_blocks_reference, dp_placement, dp_runs, packed_placement,
                                  packed_runs)


def _grid(rng: random.Random, shape: dict[str, int], offset: int) -> ParallelGrid:
    dims = list(shape)
    rng.shuffle(dims)  # rank order must not be assumed
    return ParallelGrid({d: shape[d] for d in dims}, offset=offset)


def _samples(rng: random.Random, n: int) -> list[tuple[int, list[int]]]:
    """(sequence length, row positions): ragged images, abutting or not, sometimes listed backwards."""
    out = []
    for _ in range(n):
        length = rng.randint(1, 45)
        positions: set[int] = set()
        for _ in range(rng.randint(0, 3)):
            a = rng.randint(0, length - 1)
            positions.update(range(a, min(length, a + rng.randint(0, 13))))
        pos = sorted(positions)
        out.append((length, pos[::-1] if rng.random() < 0.15 else pos))
    return out


def _case(seed: int):
    """A random LLM grid (tp, cp, dp, pp), samples, DP blocks, SP flag, hidden."""
    rng = random.Random(seed)
    shape = {"tp": rng.choice([1, 2, 3, 4]), "cp": rng.choice([1, 2, 3]), "dp": rng.choice([1, 2, 3, 5]), "pp": rng.choice([1, 2])}
    grid = _grid(rng, shape, rng.choice([0, 3]))
    samples = _samples(rng, rng.randint(0, 9))
    blocks = dp_blocks([n for n, _ in samples], shape["dp"])
    return rng, grid, samples, blocks, rng.random() < 0.5, rng.choice([5, 8, 12])


def _source(rng: random.Random, llm: ParallelGrid, rows: list[int], hidden: int, colocated: bool):
    """An encoder placement on the LLM's ranks (colocated) or on ranks after them."""
    if colocated:
        tp = rng.choice([t for t in (1, 2, 3, 4) if llm.size % t == 0])
        grid = _grid(rng, {"tp": tp, "dp": llm.size // tp}, llm.offset)
    else:
        grid = _grid(rng, {"tp": rng.choice([1, 2, 3]), "dp": rng.choice([1, 2, 3]), "pp": rng.choice([1, 2])},
                     llm.offset + llm.size)
    shard = rng.choice([None, "hidden", "seq"])
    return dp_placement(grid, rows, dp_blocks(rows, grid.shape["dp"]), hidden, shard), (grid, shard)


def _same_rank_plans(src, dst) -> None:
    """Every rank's plans both ways == the reference plans' moves and gathers of that rank."""
    whole = make_plan(src, dst), make_plan(dst, src)
    for rank in sorted(set(src.local_rows) | set(dst.local_rows)):
        for ref, mine in zip(whole, rank_plans(src, dst, rank)):
            assert mine.moves == tuple(m for m in ref.moves if rank in (m.src, m.dst)), rank
            assert mine.gathers == tuple(g for g in ref.gathers if rank in g.ranks), rank
            assert mine.colocated == ref.colocated


def _check_packed(seed: int) -> None:
    _, grid, samples, blocks, sp, hidden = _case(seed)
    ref, _ = packed_placement(grid, samples, blocks, hidden, sp)
    assert packed_runs(grid, SampleRuns.of_positions(samples), blocks, hidden, sp).to_placement() == ref


def _check_dp(seed: int) -> None:
    rng = random.Random(seed)
    grid = _grid(rng, {"tp": rng.choice([1, 2, 3]), "dp": rng.choice([1, 2, 3, 5]), "pp": rng.choice([1, 2])}, rng.choice([0, 2]))
    rows = [rng.choice([0, 1, 3, 7, 576]) for _ in range(rng.randint(0, 9))]
    blocks = dp_blocks(rows, grid.shape["dp"])
    for shard in (None, "hidden", "seq"):
        assert dp_runs(grid, rows, blocks, 11, shard).to_placement() == dp_placement(grid, rows, blocks, 11, shard)


def _check_plans(seed: int) -> None:
    rng, grid, samples, blocks, sp, hidden = _case(seed)
    dst, _ = packed_placement(grid, samples, blocks, hidden, sp)
    src, _ = _source(rng, grid, [len(p) for _, p in samples], hidden, colocated=seed % 2 == 0)
    _same_rank_plans(src, dst)


@pytest.mark.parametrize("chunk", range(4))
def test_packed_runs_equal_packed_placement(chunk):
    for seed in range(chunk * 300, (chunk + 1) * 300):
        _check_packed(seed)


def test_dp_runs_equal_dp_placement():
    for seed in range(300):
        _check_dp(seed)


@pytest.mark.parametrize("chunk", range(4))
def test_rank_plans_equal_the_whole_plan(chunk):
    for seed in range(chunk * 150, (chunk + 1) * 150):
        _check_plans(seed)


def test_rank_plans_of_llava_like_runs():
    """The bench's shape at a small world: colocated vision dp=world, LLM tp=4 x dp=2, and the
    same rows on disjoint vision ranks (non-colocated, the LLM's TP groups gathering)."""
    rng = random.Random(5)
    llm = ParallelGrid({"tp": 4, "cp": 1, "dp": 2, "pp": 1})
    samples = []
    for _ in range(6):
        before = rng.randint(0, 30)
        samples.append((before + 48 + rng.randint(0, 30), list(range(before, before + 48))))
    rows = [len(p) for _, p in samples]
    dst, _ = packed_placement(llm, samples, dp_blocks([n for n, _ in samples], 2), 16)
    for vision in (ParallelGrid({"tp": 1, "dp": 8}), ParallelGrid({"tp": 1, "dp": 3}, offset=8)):
        _same_rank_plans(dp_placement(vision, rows, dp_blocks(rows, vision.shape["dp"]), 16), dst)


def test_dp_blocks_equal_the_scan():
    rng = random.Random(0)
    for _ in range(4000):
        costs = [rng.choice([0, 0, 1, 2, 3, 7, 30, 150]) if rng.random() < 0.5 else rng.randint(0, 1000)
                 for _ in range(rng.randint(0, 30))]
        dp = rng.randint(1, 12)
        assert dp_blocks(costs, dp) == dp_blocks_reference(costs, dp), (costs, dp)
    costs = [976 + rng.randint(-300, 300) for _ in range(700)]
    for dp in (1, 7, 64, 350, 700, 1000):
        assert dp_blocks(costs, dp) == dp_blocks_reference(costs, dp), dp


def test_sample_runs_of_images_and_errors():
    runs = SampleRuns.of_images([10, 7, 9], [[1, 5], [], [0]], 3)
    assert runs.rows_N.tolist() == [6, 0, 3]
    assert runs.row_U.tolist() == [0, 3, 6]
    assert (runs.sample_U.tolist(), runs.start_U.tolist()) == ([0, 0, 2], [1, 5, 0])
    with pytest.raises(LayoutError, match="outside sample 1"):
        SampleRuns.of_images([10, 7], [[], [5]], 3)
    with pytest.raises(LayoutError, match="sample after sample"):
        SampleRuns(np.array([5, 5]), np.array([1, 0]), np.array([0, 0]), np.array([1, 1]))
    grid = ParallelGrid({"tp": 1, "dp": 2})
    with pytest.raises(LayoutError, match="covering the samples in order"):
        packed_runs(grid, runs, [range(0, 1), range(2, 3)], 4)
    with pytest.raises(LayoutError, match="partially overlap"):
        rank_plans(dp_runs(grid, [1, 2], [range(0, 1), range(1, 2)], 4),
                   dp_runs(ParallelGrid({"dp": 2}, offset=1), [1, 2], [range(0, 1), range(1, 2)], 4), 0)


# ---------------------------------------------------------------------------
# Mutations: each breaks one step of the fast path; the comparisons above must fail
# ---------------------------------------------------------------------------
def _split_runs_off_by_one(start_U, len_U, period_U):
    u, lo, length = _SPLIT(start_U, len_U, period_U)
    return u, lo, length + (np.arange(len(u)) == 0)  # the first piece one row long


def _split_runs_dropping_the_cut(start_U, len_U, period_U):
    return np.arange(len(start_U)), start_U, len_U  # never cut at a chunk / SP part end


def _even_part_floor(rows, n, i):
    size = np.maximum(rows // n, 1)
    lo = np.minimum(i * size, rows)
    return lo, np.minimum(lo + size, rows) - lo


def _holds_nothing(self, key_K, rank_K, width):
    at, found = _HOLDS(self, key_K, rank_K, width)
    return at, np.zeros_like(found)


def _run_rows_shifted(self):
    row = _ROW_U.func(self)
    return row + (np.arange(len(row)) == len(row) - 1)  # the last run one row late


def _closest_end_prefers_longer(prefix, start, lo, hi, share):
    end = _CLOSEST(prefix, start, lo, hi, share)
    return min(end + 1, hi) if end < hi and prefix[end + 1] - prefix[start] - share == prefix[start] + share - prefix[end] else end


_SPLIT, _HOLDS, _CLOSEST = layout_mod._split_runs, plan_mod._Held.holds, layout_mod._closest_end
_ROW_U = layout_mod.SampleRuns.__dict__["row_U"]

MUTATIONS = {
    "run split one row long": (layout_mod, "_split_runs", _split_runs_off_by_one, "packed"),
    "runs not cut at chunk ends": (layout_mod, "_split_runs", _split_runs_dropping_the_cut, "packed"),
    "the last run's rows shifted": (layout_mod.SampleRuns, "row_U", property(_run_rows_shifted), "packed"),
    "split_even by floor": (plan_mod, "_even_part", _even_part_floor, "plans"),
    "own copies ignored": (plan_mod._Held, "holds", _holds_nothing, "plans"),
    "chunk cuts dropped": (plan_mod._Receivers, "chunk_cuts", lambda self: np.zeros(0, dtype=np.int64), "plans"),
    "ties to the longer block": (layout_mod, "_closest_end", _closest_end_prefers_longer, "blocks"),
}


def _fast_path_plans(seed: int) -> None:
    """As ``_check_plans``, with the destination built by ``packed_runs``."""
    rng, grid, samples, blocks, sp, hidden = _case(seed)
    ref, _ = packed_placement(grid, samples, blocks, hidden, sp)
    mine = packed_runs(grid, SampleRuns.of_positions(samples), blocks, hidden, sp)
    src, _ = _source(rng, grid, [len(p) for _, p in samples], hidden, colocated=seed % 2 == 0)
    whole = make_plan(src, ref)
    for rank in ref.local_rows:
        assert rank_plans(src, mine, rank)[0].moves == tuple(m for m in whole.moves if rank in (m.src, m.dst))


def _ties() -> None:
    for costs, dp in (([5, 5, 5, 5], 3), ([4, 4, 4, 4, 4, 4, 4], 4), ([1, 1, 1], 2)):
        assert dp_blocks(costs, dp) == dp_blocks_reference(costs, dp)
    test_dp_blocks_equal_the_scan()


def _packed() -> None:
    for seed in range(300):
        _check_packed(seed)
    for seed in range(200):
        _fast_path_plans(seed)


def _plans() -> None:
    for seed in range(200):
        _check_plans(seed)


CHECKS = {"packed": _packed, "plans": _plans, "blocks": _ties}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutations_are_caught(monkeypatch, name):
    owner, attr, broken, check = MUTATIONS[name]
    CHECKS[check]()  # passes as written
    monkeypatch.setattr(owner, attr, broken)
    with pytest.raises((AssertionError, LayoutError, IndexError, ValueError)):
        CHECKS[check]()
