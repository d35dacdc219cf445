"""Placements from runs of rows and one rank's plans (issue 27) against the reference builders.

``dp_runs`` / ``packed_runs`` must give the very pieces of ``dp_placement`` / ``packed_placement``,
``rank_plans`` the very moves (and all-gathers) of ``make_plan`` that the rank sends or receives,
``dp_blocks`` the very blocks of ``dp_blocks_reference`` — across ragged samples, non-power-of-two
sizes, CP / SP packs, later pipeline stages, colocated and non-colocated grids. The mutation
tests break one step of the fast path at a time and check that these comparisons notice.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest

import mimo.bridges.plan as plan_mod
import mimo.parallel.layout as layout_mod
from mimo.bridges.plan import rank_plans
from mimo.bridges.plan_reference import make_plan
from mimo.core.errors import DataError, LayoutError
from mimo.data.index import Entry, Index
from mimo.data.pipeline import reader_runs
from mimo.data.plan import DataPlan, SampleArrays
from mimo.parallel.grid import ParallelGrid
from mimo.parallel.layout import Piece, Placement, SampleRuns, dp_blocks, dp_runs, packed_runs
from mimo.parallel.layout_reference import dp_blocks_reference, dp_placement, packed_placement


def reader_placement(images: list[int], blocks: list[range], readers: list[int], ranks: set[int], numel: int) -> Placement:
    """Pixel rows (one per image, sample after sample) held by the reader of each LLM DP
    block; every other rank of ``ranks`` holds none (the reference of ``reader_runs``)."""
    starts = [0, *itertools.accumulate(images)]
    pieces, local_rows = [], {r: 0 for r in ranks}
    for reader, block in zip(readers, blocks):
        n = starts[block.stop] - starts[block.start]
        local_rows[reader] = n
        pieces.append(Piece(reader, starts[block.start], n, 0, 0, numel))
    return Placement(starts[-1], numel, tuple(pieces), local_rows)


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


def test_order_by_is_the_lexsort(monkeypatch):
    """``_order_by`` (a combined key's stable argsort, the lexsort below a size or past int64)
    orders as ``np.lexsort``, and placements built through either path are the reference's."""
    rng = np.random.default_rng(0)
    for n, high in ((0, 5), (1, 5), (300, 3), (2000, 50), (3000, 10**6), (500, 2**40)):
        major, minor = rng.integers(-high, high, n), rng.integers(0, high, n)
        assert np.array_equal(layout_mod._order_by(major, minor), np.lexsort((minor, major)))
    monkeypatch.setattr(layout_mod, "ORDER_BY_ARGSORT", 0)  # the combined key on every size
    for seed in range(150):
        _check_packed(seed)


def test_rank_plans_over_many_pieces():
    """Past the pieces whose columns ``_col_bounds`` reads without a sort: replicated rows (one
    column range) and rows split by hidden columns, colocated, 80 ranks."""
    rng = random.Random(9)
    llm = ParallelGrid({"tp": 2, "cp": 1, "dp": 40, "pp": 1})
    samples = []
    for _ in range(90):
        before = rng.randint(0, 20)
        samples.append((before + 6 + rng.randint(0, 20), list(range(before, before + 6 * rng.randint(0, 1)))))
    rows = [len(p) for _, p in samples]
    dst, _ = packed_placement(llm, samples, dp_blocks([n for n, _ in samples], 40), 16)
    for grid, shard in ((ParallelGrid({"tp": 1, "dp": 80}), None), (ParallelGrid({"tp": 4, "dp": 20}), "hidden")):
        src = dp_placement(grid, rows, dp_blocks(rows, grid.shape["dp"]), 16, shard)
        whole = make_plan(src, dst), make_plan(dst, src)
        for rank in rng.sample(range(80), 12):
            for ref, mine in zip(whole, rank_plans(src, dst, rank)):
                assert mine.moves == tuple(m for m in ref.moves if rank in (m.src, m.dst)), (shard, rank)


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


def _check_windowed_bridge(seed: int) -> None:
    """``image_bridge_plans`` builds the LLM's placement only near the rank's rows (``packed_runs``'
    ``rows``): its plans must be those over the whole placements, and what the rank asks of
    its placement (pieces, local shape, rows held, ranks) the same."""
    from mimo.data.pipeline import microbatch_bridge_plans as image_bridge_plans

    rng = random.Random(seed)
    llm = _grid(rng, {"tp": rng.choice([1, 2, 3]), "cp": rng.choice([1, 2]), "dp": rng.choice([1, 2, 3, 5, 7]),
                      "pp": rng.choice([1, 2])}, rng.choice([0, 3]))
    per_image, hidden, sp = rng.choice([1, 3, 5]), rng.choice([5, 8, 12]), rng.random() < 0.5
    tokens, images, starts = [], [], []
    for _ in range(rng.randint(0, 24)):
        t = rng.randint(per_image, 40)
        k = rng.choice([0, 0, 1, 1, 2]) if rng.random() < 0.8 else 0
        tokens.append(t), images.append(k), starts.extend(sorted(rng.randint(0, t - per_image) for _ in range(k)))
    arrays = SampleArrays(np.array(tokens, dtype=np.int64), {"<image>": np.array(images, dtype=np.int64)},
                          {"<image>": np.array(starts, dtype=np.int64)})
    if seed % 2 == 0:  # colocated
        tp = rng.choice([t for t in (1, 2, 3, 4) if llm.size % t == 0])
        enc = _grid(rng, {"tp": tp, "dp": llm.size // tp}, llm.offset)
    else:
        enc = _grid(rng, {"tp": rng.choice([1, 2]), "dp": rng.choice([1, 2, 3, 6])}, llm.offset + llm.size)
    llm_blocks, enc_blocks = dp_blocks(tokens, llm.shape["dp"]), dp_blocks([k * per_image for k in images], enc.shape["dp"])
    runs = SampleRuns.of_image_arrays(arrays.tokens_N, arrays.images_for("<image>"), arrays.image_starts("<image>"), per_image)
    src = dp_runs(enc, runs.rows_N, enc_blocks, hidden)
    whole = packed_runs(llm, runs, llm_blocks, hidden, sp)
    pieces = set(zip(*(getattr(whole, c).tolist() for c in ("rank_P", "row_P", "rows_P", "local_row_P"))))
    for rank in sorted(set(llm.ranks) | set(enc.ranks)):
        s, d, plans = image_bridge_plans(arrays, "<image>", per_image, hidden, enc, enc_blocks, llm, llm_blocks, sp, rank)
        assert s.to_placement() == src.to_placement()
        for mine, want in zip(plans, rank_plans(src, whole, rank)):
            assert (mine.moves, mine.gathers, mine.colocated) == (want.moves, want.gathers, want.colocated), (seed, rank)
        assert d.pieces_of(rank) == whole.pieces_of(rank) and d.ranks == whole.ranks, (seed, rank)
        assert (d.holds_rank(rank), d.local_shape(rank), d.held_rows(rank)) == (
            whole.holds_rank(rank), whole.local_shape(rank), whole.held_rows(rank)), (seed, rank)
        assert set(zip(*(getattr(d, c).tolist() for c in ("rank_P", "row_P", "rows_P", "local_row_P")))) <= pieces


def _windowed_bridges() -> None:
    for seed in range(160):
        _check_windowed_bridge(seed)


def test_windowed_bridge_plans_equal_the_whole_ones():
    _windowed_bridges()


def test_windowed_bridge_plans_read_a_share():
    """At the bench's shape (LLM tp 2 x dp 8, vision dp 16, colocated) a rank's LLM placement
    holds a few blocks' pieces, not the world's."""
    from mimo.data.pipeline import microbatch_bridge_plans as image_bridge_plans

    llm, vision = ParallelGrid({"tp": 2, "cp": 1, "dp": 8, "pp": 1}), ParallelGrid({"tp": 1, "dp": 16})
    tokens = np.full(32, 30, dtype=np.int64)
    arrays = SampleArrays(tokens, {"<image>": np.ones(32, dtype=np.int64)}, {"<image>": np.arange(32) % 20})
    llm_blocks, enc_blocks = dp_blocks(tokens, 8), dp_blocks(np.full(32, 6), 16)
    for rank in range(16):  # its LLM block's pieces (one a TP rank), its encoder block's maybe in the next
        _, dst, _ = image_bridge_plans(arrays, "<image>", 6, 4, vision, enc_blocks, llm, llm_blocks, False, rank)
        assert 0 < len(dst.rank_P) <= 2 * 2, rank


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


def _adversarial_costs(rng: random.Random) -> list[int]:
    """Ragged costs with the cases that widen the candidate starts: zeros (text-only samples'
    image rows), runs of equal costs (ties), one huge cost, more blocks than items."""
    n = rng.randint(0, 60)
    kind = rng.randrange(6)
    if kind == 0:  # image rows: 0, 1 or 2 images
        return [rng.choice([0, 0, 576, 1152]) for _ in range(n)]
    if kind == 1:
        return [rng.choice([0, 0, 0, 0, 5, 100]) for _ in range(n)]
    if kind == 2:
        return [7] * n
    if kind == 3:
        return [rng.randint(0, 3) for _ in range(n)] + [10_000] + [rng.randint(0, 3) for _ in range(n)]
    if kind == 4:
        return [0] * n
    return [976 + rng.randint(-300, 300) for _ in range(n)]


@pytest.mark.parametrize("candidates", [layout_mod.CANDIDATES_PER_ITEM, 10**9, -1])
def test_dp_blocks_equal_the_scan_on_adversarial_costs(monkeypatch, candidates):
    """Through the table of candidate starts (always, when allowed any number), the walk block by
    block (-1: never the table) or either as it comes: the reference's blocks, as numpy arrays
    (any integer dtype) or lists, for non-power-of-two dp, dp above the items, dp = 1."""
    monkeypatch.setattr(layout_mod, "CANDIDATES_PER_ITEM", candidates)
    if candidates > 10**6:  # the chain through the table never leaves it (starts after zero costs are none)
        monkeypatch.setattr(layout_mod, "_block_ends_walk", lambda *a: pytest.fail("walked block by block"))
    rng = random.Random(candidates)
    for _ in range(1500):
        costs, dp = _adversarial_costs(rng), rng.choice([1, 2, 3, 5, 7, 12, 33, 64, 100])
        want = dp_blocks_reference(costs, dp)
        got = dp_blocks(np.array(costs, dtype=rng.choice([np.int64, np.int32, np.uint16])), dp)
        assert got == want, (costs, dp)
        assert (got.start_D.tolist(), got.stop_D.tolist()) == ([b.start for b in want], [b.stop for b in want])
    costs = [rng.choice([0, 576, 1152]) for _ in range(900)]
    for dp in (64, 300, 511, 1024):
        assert dp_blocks(costs, dp) == dp_blocks_reference(costs, dp), dp


def _even_costs(rng: random.Random, dp: int) -> list[int]:
    """Costs that split into ``dp`` blocks of exactly total/dp: each block a random cut of the
    same sum (even costs, or ragged ones), zero costs on either side of the bounds."""
    share, costs = rng.choice([1, 7, 576, 976, 1152]), []
    for _ in range(dp):
        parts = 1 if share == 1 else rng.choice([1, 1, 2, 3])
        cuts = sorted(rng.sample(range(1, share), parts - 1)) if parts > 1 else []
        block = [b - a for a, b in zip([0, *cuts], [*cuts, share])]
        costs += [0] * (rng.random() < 0.2) + block + [0] * (rng.random() < 0.2)
    return costs


def _check_even_splits(rng: random.Random, rounds: int) -> None:
    """Even splits (``_even_ends``: no cap search, no chain) and their near misses (one item
    more, one cost off: the general path) give the reference's blocks."""
    for _ in range(rounds):
        dp = rng.choice([1, 2, 3, 5, 7, 12, 64, 100, 128, 333])
        costs = _even_costs(rng, dp) if rng.random() < 0.5 else [rng.choice([1, 576, 976])] * (dp * rng.randint(1, 3))
        assert layout_mod._even_ends(*layout_mod._prefix(costs, dp), dp) is not None
        i = rng.randrange(len(costs))
        for c in (costs, costs + [costs[i] or 1], costs[:i] + [costs[i] + 1] + costs[i + 1:]):
            assert dp_blocks(c, dp) == dp_blocks_reference(c, dp), (c, dp)


def test_dp_blocks_of_even_splits_equal_the_scan():
    _check_even_splits(random.Random(11), 150)
    assert dp_blocks([0] * 6, 4) == dp_blocks_reference([0] * 6, 4) == [range(0, 0)] * 3 + [range(0, 6)]
    assert dp_blocks([5, 0, 5], 2) == [range(0, 1), range(1, 3)]  # the zero cost goes to the next block


def test_dp_blocks_read_costs_as_the_reference_does():
    """Floats truncate, bools count as 0/1, sums past 2**53 (no exact float shares) walk."""
    rng = random.Random(5)
    for _ in range(200):
        costs = [rng.random() * 50 for _ in range(rng.randint(0, 20))]
        dp = rng.randint(1, 6)
        assert dp_blocks(costs, dp) == dp_blocks_reference(costs, dp)
        assert dp_blocks(np.array(costs), dp) == dp_blocks_reference(costs, dp)
    assert dp_blocks([True, False, True], 2) == dp_blocks_reference([1, 0, 1], 2)
    big = [2**52 + rng.randint(0, 2**40) for _ in range(40)]
    for dp in (3, 7, 16):
        assert dp_blocks(big, dp) == dp_blocks_reference(big, dp)
    with pytest.raises(LayoutError, match="non-negative"):
        dp_blocks(np.array([3, -1]), 2)
    with pytest.raises(LayoutError, match="dp must be"):
        dp_blocks(np.array([3]), 0)


def _index(rng: random.Random, n: int) -> Index:
    """Entries with ragged tokens (some too long, some empty, some bad; the first one usable:
    a stream of empty samples has no microbatch end), 0-2 images of two placeholders."""
    entries = []
    for i in range(n):
        tokens = rng.choice([rng.randint(1, 60), rng.randint(60, 400), 0]) if i else 10
        starts = {p: sorted(rng.sample(range(tokens), rng.randint(0, min(2, tokens)))) for p in ("<image>", "<sketch>")
                  if rng.random() < 0.7}
        entries.append(Entry(0, str(i), {}, tokens, sum(map(len, starts.values())), starts,
                             "corrupt image: x" if i and rng.random() < 0.05 else None))
    return Index([], entries, "")


def _microbatch_ids_by_loop(plan: DataPlan, count: int) -> list[list[int]]:
    """The microbatches as ``DataPlan`` took them before issue 27: sample by sample."""
    starts, out = [0], []
    for k in range(count):
        pos, used = starts[-1], 0
        while True:
            t = plan.index.entries[plan._stream(pos)].tokens
            if used and used + t > plan.tokens_per_microbatch:
                break
            used, pos = used + t, pos + 1
        starts.append(pos)
        out.append([plan._stream(p) for p in range(starts[k], pos)])
    return out


def _same_arrays(a: SampleArrays, b: SampleArrays) -> bool:
    placeholders = set(a.images_N) | set(b.images_N)
    return np.array_equal(a.tokens_N, b.tokens_N) and all(
        np.array_equal(a.images_for(p), b.images_for(p)) and np.array_equal(a.image_starts(p), b.image_starts(p))
        for p in placeholders)


def _check_data_plans() -> None:
    # empty samples open microbatch 1: it takes them and then the long one (nothing counted yet)
    index = Index([], [Entry(0, str(i), {}, t) for i, t in enumerate([200, 0, 0, 300, 5, 7])], "")
    plan = DataPlan(index, 50, 400, 0, shuffle=False)
    assert [[s.id for s in plan.microbatch(k)] for k in range(4)] == [[0], [1, 2, 3], [4, 5], [0]]
    with pytest.raises(DataError, match="0 tokens"):  # microbatches would never fill: an error, not a hang
        DataPlan(Index([], [Entry(0, str(i), {}, 0) for i in range(3)], ""), 50, 400, 0)
    rng = random.Random(7)
    for seed in range(12):
        index = _index(rng, rng.randint(1, 90))
        plan = DataPlan(index, rng.choice([50, 300, 1000, 5000]), 350, seed, shuffle=seed % 3 != 0)
        count = rng.randint(1, 25)  # across epochs
        want = _microbatch_ids_by_loop(DataPlan(index, plan.tokens_per_microbatch, 350, seed, plan.shuffle), count)
        for k in rng.sample(range(count), count):  # in any order, as a resume asks
            assert [s.id for s in plan.microbatch(k)] == want[k]
            assert _same_arrays(plan.microbatch_arrays(k), SampleArrays.of_samples(plan.microbatch(k)))


def test_data_plan_arrays_equal_its_samples():
    """``DataPlan``'s microbatches (found a window of the stream at a time) are those of the
    sample-by-sample loop, and ``microbatch_arrays`` (gathered from the index's columns) holds
    what its ``PlannedSample``s say."""
    _check_data_plans()


def test_synthetic_plan_arrays_equal_its_samples():
    from pathlib import Path

    from mimo.compose.config import load_config
    from mimo.compose.inputs import data_plan

    config = Path(__file__).resolve().parents[1] / "configs/llava-1.3b.yaml"
    plan = data_plan(load_config(config, ["data.synthetic.images_per_sample=3", "modules.vision.arch.image_size=28"]), None)
    for k in (0, 3):
        assert _same_arrays(plan.microbatch_arrays(k), SampleArrays.of_samples(plan.microbatch(k)))


def test_reader_runs_equal_reader_placement():
    rng = random.Random(3)
    for _ in range(300):
        images = [rng.choice([0, 0, 1, 2, 5]) for _ in range(rng.randint(0, 30))]
        dp, world = rng.choice([1, 2, 3, 5]), rng.randint(6, 12)
        readers = rng.sample(range(world), dp)
        for blocks in (dp_blocks(images, dp), list(dp_blocks(images, dp))):  # arrays or ranges
            got = reader_runs(np.array(images, dtype=np.int64), blocks, readers, range(world), 7).to_placement()
            assert got == reader_placement(images, blocks, readers, set(range(world)), 7)


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


def _closest_ends_prefer_longer(prefix_N1, furthest_N1, first_within_K1, start_B, left_B):
    end_B = _CLOSEST_ENDS(prefix_N1, furthest_N1, first_within_K1, start_B, left_B)
    n, base_B = len(prefix_N1) - 1, prefix_N1[start_B]
    share_B = (prefix_N1[n] - base_B) / left_B
    next_B = np.minimum(end_B + 1, n)
    tie = (end_B < furthest_N1[start_B]) & (prefix_N1[next_B] - base_B - share_B == share_B - (prefix_N1[end_B] - base_B))
    return np.where(tie, next_B, end_B)


def _chain_one_step_ahead(next_S, state, steps):
    return _CHAIN(next_S, state, steps + 1)[1:]


def _greedy_always_fits(prefix_N1, cap, dp):
    furthest_N1, reach_D1 = _GREEDY(prefix_N1, cap, dp)
    reach_D1[-1] = len(prefix_N1) - 1  # dp greedy blocks always reach the end
    return furthest_N1, reach_D1


def _even_ends_one_late(prefix_N1, largest, dp):
    stop_D = _EVEN(prefix_N1, largest, dp)
    return stop_D if stop_D is None or dp == 1 else stop_D + np.append(stop_D[:-1] < stop_D[-1], False)


def _even_ends_unchecked(prefix_N1, largest, dp):
    """Every split taken as even: the bounds at multiples of total/dp, whether the sums get there or not."""
    bound_D = np.arange(1, dp) * (int(prefix_N1[-1]) // dp)
    return np.append(np.searchsorted(prefix_N1, bound_D, "left"), len(prefix_N1) - 1)


def _even_ends_zeros_before(prefix_N1, largest, dp):
    stop_D = _EVEN(prefix_N1, largest, dp)
    return stop_D if stop_D is None else np.append(np.searchsorted(prefix_N1, prefix_N1[stop_D[:-1]], "right") - 1, stop_D[-1])


def _blocks_reaching_all_but_the_last(runs, start_D, stop_D, rows):
    lo, hi = rows
    d = _REACHING(runs, start_D, stop_D, (lo, max(lo, hi - 1)))  # the window's last row left out
    return d


def _end_one_short(self, columns, pos):
    end = _END(self, columns, pos)
    return end - 1 if end - pos > 1 else end


def _pieces_inside(pl, lo, hi):
    """Only the pieces inside the window: those crossing its ends (holders of its first or last
    rows) left out."""
    keep = (pl.row_P >= lo) & (pl.row_P + pl.rows_P <= hi)
    columns = ("rank_P", "row_P", "rows_P", "local_row_P", "col_P", "cols_P")
    return dataclasses.replace(pl, **{c: getattr(pl, c)[keep] for c in columns})


_SPLIT, _HOLDS, _CLOSEST = layout_mod._split_runs, plan_mod._Held.holds, layout_mod._closest_end
_CLOSEST_ENDS, _CHAIN, _END = layout_mod._closest_ends, layout_mod._chain, DataPlan._end
_EXPAND, _GREEDY, _NEXT_CAP, _LARGEST = layout_mod.expand, layout_mod._greedy, layout_mod._next_cap, layout_mod._largest_block
_EVEN, _REACHING = layout_mod._even_ends, layout_mod._blocks_reaching
_ROW_U = layout_mod.SampleRuns.__dict__["row_U"]

MUTATIONS = {
    "run split one row long": (layout_mod, "_split_runs", _split_runs_off_by_one, "packed"),
    "runs not cut at chunk ends": (layout_mod, "_split_runs", _split_runs_dropping_the_cut, "packed"),
    "the last run's rows shifted": (layout_mod.SampleRuns, "row_U", property(_run_rows_shifted), "packed"),
    "split_even by floor": (plan_mod, "_even_part", _even_part_floor, "plans"),
    "own copies ignored": (plan_mod._Held, "holds", _holds_nothing, "plans"),
    "chunk cuts dropped": (plan_mod._Receivers, "chunk_cuts", lambda self: np.zeros(0, dtype=np.int64), "plans"),
    "ties to the longer block": (layout_mod, "_closest_end", _closest_end_prefers_longer, "walk"),
    "ties to the longer block, all at once": (layout_mod, "_closest_ends", _closest_ends_prefer_longer, "blocks"),
    "block bounds one step ahead": (layout_mod, "_chain", _chain_one_step_ahead, "blocks"),
    "candidate starts one late": (layout_mod, "expand", lambda counts_N: (lambda u, k: (u, k + 1))(*_EXPAND(counts_N)), "blocks"),
    "every cap fits": (layout_mod, "_greedy", _greedy_always_fits, "blocks"),
    "cap search one past the next cap": (layout_mod, "_next_cap", lambda *a: _NEXT_CAP(*a) + 1, "blocks"),
    "a fitting cap snapped below its largest block": (layout_mod, "_largest_block", lambda *a: _LARGEST(*a) - 1, "blocks"),
    "even block bounds one item late": (layout_mod, "_even_ends", _even_ends_one_late, "blocks"),
    "every split taken as even": (layout_mod, "_even_ends", _even_ends_unchecked, "blocks"),
    "even splits' zero costs kept in the block before": (layout_mod, "_even_ends", _even_ends_zeros_before, "blocks"),
    "microbatches one sample short": (DataPlan, "_end", _end_one_short, "data"),
    "window one block short": (layout_mod, "_blocks_reaching", lambda *a: (lambda d: range(d.start, max(d.start, d.stop - 1)))(_REACHING(*a)), "window"),
    "window from one block late": (layout_mod, "_blocks_reaching", lambda *a: (lambda d: range(min(d.start + 1, d.stop), d.stop))(_REACHING(*a)), "window"),
    "window without its last row's block": (layout_mod, "_blocks_reaching", _blocks_reaching_all_but_the_last, "window"),
    "window without the rank's LLM rows": (plan_mod, "packed_rows_of", lambda *a: None, "window"),
    "pieces ordered by local row first": (layout_mod, "_order_by", lambda major, minor: np.lexsort((major, minor)), "packed"),
    "uneven columns read from the first piece": (plan_mod, "_col_bounds", lambda pl: np.array([pl.col_P[0], pl.col_P[0] + pl.cols_P[0]]), "many"),
    "window without the pieces crossing its ends": (plan_mod, "_pieces_touching", _pieces_inside, "plans"),
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
    _check_even_splits(random.Random(2), 60)
    rng = random.Random(1)
    for _ in range(300):
        costs, dp = _adversarial_costs(rng), rng.choice([2, 3, 5, 12, 33])
        assert dp_blocks(costs, dp) == dp_blocks_reference(costs, dp)


def _walked_ties() -> None:
    """``_ties`` with every block chosen by the walk (``_closest_end``)."""
    saved, layout_mod.CANDIDATES_PER_ITEM = layout_mod.CANDIDATES_PER_ITEM, -1
    try:
        _ties()
    finally:
        layout_mod.CANDIDATES_PER_ITEM = saved


def _packed() -> None:
    for seed in range(300):
        _check_packed(seed)
    for seed in range(200):
        _fast_path_plans(seed)


def _plans() -> None:
    for seed in range(200):
        _check_plans(seed)


CHECKS = {"many": test_rank_plans_over_many_pieces, "window": _windowed_bridges, "packed": _packed, "plans": _plans, "blocks": _ties, "walk": _walked_ties, "data": _check_data_plans}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutations_are_caught(monkeypatch, name):
    owner, attr, broken, check = MUTATIONS[name]
    CHECKS[check]()  # passes as written
    monkeypatch.setattr(owner, attr, broken)
    with pytest.raises((AssertionError, LayoutError, IndexError, ValueError)):
        CHECKS[check]()
