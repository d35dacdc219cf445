"""The reference builders of ``mimo.parallel.layout``'s decisions, piece by piece and loop by
loop: test oracles and what ``mimo verify-bridge`` checks training's placements against, never
on the training path. ``dp_blocks_reference`` scans every candidate end of every DP block;
``dp_placement`` and ``packed_placement`` build a ``Placement`` piece by piece; the production
builders (``dp_blocks``, ``dp_runs``, ``packed_runs``) must give the very same results
(tests/test_plan_runs.py)."""

from __future__ import annotations

import bisect
import itertools
from typing import Sequence

from mimo.core.errors import LayoutError
from mimo.parallel.grid import ParallelGrid
from mimo.parallel.layout import PackLayout, Piece, Placement, _dp_layout, split_columns, split_even


def _blocks_needed(prefix: list[int], start: int, cap: int) -> int:
    """Fewest contiguous blocks with sum <= cap covering items start.. (greedy is optimal)."""
    n, count, i = len(prefix) - 1, 0, start
    while i < n:
        # furthest j with prefix[j] - prefix[i] <= cap
        j = bisect.bisect_right(prefix, prefix[i] + cap, lo=i + 1) - 1
        if j == i:  # a single item exceeds cap
            return n + 1
        count, i = count + 1, j
    return count


def dp_blocks_reference(costs: Sequence[int], dp: int) -> list[range]:
    """``dp_blocks`` by scanning every candidate end of every block (the reference)."""
    if dp < 1:
        raise LayoutError(f"dp must be >= 1, got {dp}")
    costs = [int(c) for c in costs]
    if any(c < 0 for c in costs):
        raise LayoutError("sample costs must be non-negative")
    n = len(costs)
    prefix = [0, *itertools.accumulate(costs)]
    # smallest feasible capacity: binary search over the integer range
    lo, hi = max(costs, default=0), prefix[-1]
    while lo < hi:
        mid = (lo + hi) // 2
        if _blocks_needed(prefix, 0, mid) <= dp:
            hi = mid
        else:
            lo = mid + 1
    cap = lo

    blocks, start = [], 0
    for b in range(dp):
        left = dp - b
        if left == 1:
            end = n
        else:
            share = (prefix[n] - prefix[start]) / left
            best, best_dist = None, None
            for end in range(start, n + 1):
                if prefix[end] - prefix[start] > cap:
                    break
                if _blocks_needed(prefix, end, cap) > left - 1:
                    continue
                dist = abs(prefix[end] - prefix[start] - share)
                if best is None or dist < best_dist:
                    best, best_dist = end, dist
            end = best
        blocks.append(range(start, end))
        start = end
    return blocks



def dp_placement(
    grid: ParallelGrid,
    sample_rows: Sequence[int],
    blocks: Sequence[range],
    hidden: int,
    shard: str | None = None,
) -> Placement:
    """Rows of a module whose DP rank d holds the samples of ``blocks[d]`` as one pack.

    Within a DP rank's TP group the pack is replicated (``shard=None``), split by hidden
    columns (``"hidden"``), or split by rows (``"seq"``: sequence-parallel, contiguous chunks
    of ceil(rows/tp)). With pipeline stages, the first stage holds the rows and later stages
    hold nothing. Any other grid dim must have size 1.
    """
    tp, dp = _dp_layout(grid, blocks, shard)
    starts = [0, *itertools.accumulate(sample_rows)]
    pieces, replicas = [], []
    local_rows = {r: 0 for r in grid.ranks}  # later pipeline stages hold nothing
    for d, block in enumerate(blocks):
        row0, n = starts[block.start], starts[block.stop] - starts[block.start]
        group = [grid.rank_at(**{k: v for k, v in (("tp", t), ("dp", d)) if k in grid.shape}) for t in range(tp)]
        for t, rank in enumerate(group):
            if shard == "seq":
                part = split_even(n, tp)[t]
                local_rows[rank] = len(split_even(n, tp)[0])
                pieces.append(Piece(rank, row0 + part.start, len(part), 0, 0, hidden))
            elif shard == "hidden":
                cols = split_columns(hidden, tp)[t]
                local_rows[rank] = n
                pieces.append(Piece(rank, row0, n, 0, cols.start, len(cols)))
            else:
                local_rows[rank] = n
                pieces.append(Piece(rank, row0, n, 0, 0, hidden))
        if shard is None and tp > 1:
            replicas.append(tuple(group))
    return Placement(starts[-1], hidden, tuple(pieces), local_rows, tuple(replicas))


def packed_placement(
    grid: ParallelGrid,
    samples: Sequence[tuple[int, Sequence[int]]],
    blocks: Sequence[range],
    hidden: int,
    sequence_parallel: bool = False,
) -> tuple[Placement, dict[int, list[int]]]:
    """Placement of the rows scattered into an LLM's packed sequences (its first stage).

    ``samples[i] = (sequence length, positions of its rows)``: the logical tensor's rows are
    those positions, sample after sample. DP rank d packs ``blocks[d]``; CP and TP follow
    ``PackLayout``. A rank's local buffer is compact: the rows it holds, in the order of their
    local positions; the second value gives those local positions (the slots to scatter to).
    Ranks of later pipeline stages hold nothing.
    """
    tp, cp, dp = (grid.shape.get(d, 1) for d in ("tp", "cp", "dp"))
    if len(blocks) != dp:
        raise LayoutError(f"{len(blocks)} DP blocks for dp={dp}")
    row_starts = [0, *itertools.accumulate(len(pos) for _, pos in samples)]
    rank_of = {
        (t, c, d): grid.rank_at(**{n: v for n, v in (("tp", t), ("cp", c), ("dp", d)) if n in grid.shape})
        for t in range(tp) for c in range(cp) for d in range(dp)
    }
    held: dict[int, list[tuple[int, int]]] = {r: [] for r in grid.ranks}  # rank -> (local pos, row)
    for d, block in enumerate(blocks):
        pack = PackLayout(tuple(samples[i][0] for i in block), tp, cp, sequence_parallel)
        for j, i in enumerate(block):
            for k, position in enumerate(samples[i][1]):
                c, t, local = pack.locate(j, position)
                for tt in range(tp) if t is None else (t,):
                    held[rank_of[(tt, c, d)]].append((local, row_starts[i] + k))
    pieces, slots, local_rows = [], {}, {}
    replicas = () if sequence_parallel or tp == 1 else tuple(tuple(g) for g in grid.partition("tp"))
    for rank, items in held.items():
        items.sort()
        slots[rank] = [pos for pos, _ in items]
        local_rows[rank] = len(items)
        start = 0
        for n in range(1, len(items) + 1):  # runs of consecutive logical rows
            if n == len(items) or items[n][1] != items[n - 1][1] + 1:
                pieces.append(Piece(rank, items[start][1], n - start, start, 0, hidden))
                start = n
    return Placement(row_starts[-1], hidden, tuple(pieces), local_rows, replicas), slots
