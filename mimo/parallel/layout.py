"""Placements: which rank holds which rows and hidden columns of a boundary tensor.

Three decisions live here and nowhere else, because every module, the data loader and the
bridges must agree on them:

* ``dp_blocks``: how a global microbatch (a list of samples with costs) is split into
  contiguous DP blocks — the partition whose largest block is smallest.
* ``cp_chunks``: which chunks of a sequence a context-parallel rank holds (load-balanced
  order: rank r holds chunks r and 2*cp-1-r of 2*cp).
* ``Placement``: for a logical ragged ``[rows, hidden]`` tensor, the pieces each rank holds
  and where they sit in its local buffer.

Training builds placements as arrays (``RunPlacement``) from per-sample runs of rows
(``SampleRuns``) with ``dp_runs`` and ``packed_runs``: numpy over runs and ranks, no Python loop
over rows, pieces or replicas. Their piece-by-piece references (``dp_placement``,
``packed_placement``, ``dp_blocks_reference``) live in ``mimo.parallel.layout_reference``, the
oracles of the tests and of ``mimo verify-bridge``.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from mimo.core.errors import LayoutError
from mimo.parallel.grid import ParallelGrid


# ---------------------------------------------------------------------------
# DP blocks
# ---------------------------------------------------------------------------
class DpBlocks(Sequence):
    """DP blocks: a sequence of ``range``s (equal to a list of them) kept as their bounds,
    ``start_D`` and ``stop_D``, so that array consumers (``dp_runs``, ``packed_runs``) need no
    Python loop over the blocks; a block's ``range`` is made when asked for (a rank reads its own)."""

    __hash__ = None  # as a list's

    def __init__(self, start_D: np.ndarray, stop_D: np.ndarray):
        self.start_D, self.stop_D = start_D, stop_D

    def __len__(self) -> int:
        return len(self.start_D)

    def __getitem__(self, d):
        if isinstance(d, slice):
            return list(map(range, self.start_D[d].tolist(), self.stop_D[d].tolist()))
        return range(int(self.start_D[d]), int(self.stop_D[d]))

    def __iter__(self):
        return map(range, self.start_D.tolist(), self.stop_D.tolist())

    def __eq__(self, other) -> bool:
        if isinstance(other, DpBlocks):
            return np.array_equal(self.start_D, other.start_D) and np.array_equal(self.stop_D, other.stop_D)
        return list(self) == other if isinstance(other, list) else NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))


def dp_blocks(costs: Sequence[int] | np.ndarray, dp: int) -> DpBlocks:
    """Split items (e.g. samples with token counts) into ``dp`` contiguous blocks.

    The largest block sum is the smallest possible; among such partitions, each block in
    turn takes the end closest to an even share of what is left (so trailing ranks are not
    starved needlessly; ties: the shorter block). Blocks may be empty. Deterministic: every
    rank gets the same answer. ``dp_blocks_reference`` scans; this one is numpy over items,
    blocks and candidate starts (``_block_ends``), with a list look-up per block at most, or
    ``dp`` look-ups when the items split into blocks of exactly total/dp (``_even_ends``).
    """
    prefix_N1, largest = _prefix(costs, dp)
    stop_D = _even_ends(prefix_N1, largest, dp)
    if stop_D is None:
        stop_D = _chosen_ends(prefix_N1, largest, dp)
    return DpBlocks(np.concatenate([[0], stop_D[:-1]]).astype(np.int64), stop_D)


def _even_ends(prefix_N1: np.ndarray, largest: int, dp: int) -> np.ndarray | None:
    """The blocks' ends when the items split into ``dp`` blocks of exactly total/dp each (even
    costs, items a multiple of dp), else None. Then the smallest cap is total/dp, and within
    it every block must hold exactly that much: block b ends where the prefix sum reaches
    (b+1) * total/dp, at the first such end (a zero-cost item goes to the next block: every
    such end is at distance 0 from the share, and ties take the shorter block). ``dp``
    look-ups, nothing over the items: a rank's cost stays that of its share."""
    total = int(prefix_N1[-1])
    if total % dp or largest > total // dp or total >= 2 ** 53:  # the reference's shares are floats
        return None
    bound_D = np.arange(1, dp, dtype=np.int64) * (total // dp)
    stop_D = np.searchsorted(prefix_N1, bound_D, "left")
    if not np.array_equal(prefix_N1[stop_D], bound_D):
        return None
    return np.append(stop_D, len(prefix_N1) - 1)


def _chosen_ends(prefix_N1: np.ndarray, largest: int, dp: int) -> np.ndarray:
    """The blocks' ends in general: the smallest cap, then ``_block_ends``."""
    # reach[b]: the furthest start of block b (b greedy blocks on from 0, found with the cap)
    cap, furthest_N1, reach_D1 = _cap(prefix_N1, largest, dp)
    n = len(prefix_N1) - 1
    # first_within[k]: the first end after which k blocks suffice (k greedy blocks back from n)
    first_within_K1 = _chain(np.searchsorted(prefix_N1, prefix_N1 - cap, "left"), n, dp)
    return _block_ends(prefix_N1, furthest_N1, first_within_K1, reach_D1[:-1])


def _furthest(prefix_N1: np.ndarray, cap: int) -> np.ndarray:
    """The furthest end of a block from each start whose sum stays within ``cap``."""
    return np.searchsorted(prefix_N1, prefix_N1 + cap, "right") - 1


def _chain(next_S: np.ndarray, state: int, steps: int) -> np.ndarray:
    """The states from ``state`` on, ``steps`` steps of ``next``, by doubling: with ``next``
    applied ``d`` times (``level``) the states ``d .. 2d - 1`` are ``level`` of states
    ``0 .. d - 1``, so a chain of a thousand blocks takes ten gathers, not a thousand look-ups."""
    out_C = np.empty(steps + 1, dtype=np.int64)
    out_C[0] = state
    level_S, done = next_S, 1
    while done <= steps:
        take = min(done, steps + 1 - done)
        out_C[done:done + take] = level_S[out_C[:take]]
        done += take
        if done <= steps:
            level_S = level_S[level_S]
    return out_C


# ``_block_ends`` tries every candidate start of every block while they number at most this
# many per item and block (a tight cap leaves few); beyond, it walks block by block
CANDIDATES_PER_ITEM = 16


def _block_ends(prefix_N1: np.ndarray, furthest_N1: np.ndarray, first_within_K1: np.ndarray,
                reach_D: np.ndarray) -> np.ndarray:
    """Each block's end, chosen in turn from its start (the previous block's end) by
    ``_closest_ends``: a chain, which would be a Python loop over the blocks.

    Block b can only start between ``first_within[dp - b]`` (the rest must fit in dp - b
    blocks) and ``reach[b]`` (b blocks from 0 must get there), and only where the items before
    cost something (a zero-cost item goes to the next block: ties take the shorter block).
    Choose the end from every such start of every block at once (numpy); then follow the chain
    from block 0 through that table (a look-up per block). Should the chain ever leave the
    table, or the candidates be too many, walk block by block instead (the same choices)."""
    n, dp = len(prefix_N1) - 1, len(first_within_K1) - 1
    if dp == 1:
        return np.array([n], dtype=np.int64)
    if int(prefix_N1[n]) >= 2 ** 53:  # shares as Python computes them need exact float sums
        return _block_ends_walk(prefix_N1, furthest_N1, first_within_K1)
    b_B = np.arange(dp - 1)  # the blocks whose end is chosen (the last one ends at n)
    run_R = np.flatnonzero(np.diff(prefix_N1, prepend=-1))  # the first end of each prefix sum
    first_B = np.searchsorted(run_R, first_within_K1[dp - b_B], "left")
    count_B = np.searchsorted(run_R, reach_D[:-1], "right") - first_B
    if int(count_B.sum()) > CANDIDATES_PER_ITEM * (n + dp):
        return _block_ends_walk(prefix_N1, furthest_N1, first_within_K1)
    # candidate m: block b_M[m] starting at start_M[m]; block b's candidates from offset_B[b]
    b_M, k_M = expand(count_B)
    start_M = run_R[first_B[b_M] + k_M]
    end_M = _closest_ends(prefix_N1, furthest_N1, first_within_K1, start_M, dp - b_M)
    # the next block's candidate starting at this end (the last chosen block's lead to
    # themselves); none: a sink state past the table
    offset_B, after_M, sink = _exclusive_cumsum(count_B), np.minimum(b_M + 1, dp - 2), len(b_M)
    k_next = np.searchsorted(run_R, end_M) - first_B[after_M]
    at_next = run_R[np.minimum(first_B[after_M] + k_next, len(run_R) - 1)]
    found = (k_next >= 0) & (k_next < count_B[after_M]) & (at_next == end_M)
    next_M = np.where(b_M + 1 < dp - 1, np.where(found, offset_B[after_M] + k_next, sink), np.arange(sink))
    chosen_B = _chain(np.append(next_M, sink), 0, dp - 2)
    if np.any(chosen_B == sink):
        return _block_ends_walk(prefix_N1, furthest_N1, first_within_K1)
    return np.append(end_M[chosen_B], n)


def _closest_ends(prefix_N1, furthest_N1, first_within_K1, start_B, left_B) -> np.ndarray:
    """``_closest_end`` of many blocks at once (sums and shares below 2**53: exact in float):
    the first end whose block sum is closest to the share, between the first end after which
    ``left - 1`` blocks suffice and the furthest end within the cap."""
    n = len(prefix_N1) - 1
    base_B = prefix_N1[start_B]
    share_B = (prefix_N1[n] - base_B) / left_B
    lo_B, hi_B = np.maximum(start_B, first_within_K1[left_B - 1]), furthest_N1[start_B]
    # the first end from lo whose sum reaches the share: prefix >= base + ceil(share), in integers
    above_B = np.clip(np.searchsorted(prefix_N1, base_B + np.ceil(share_B).astype(np.int64), "left"), lo_B, hi_B + 1)
    last_below_B = prefix_N1[np.maximum(above_B - 1, 0)]
    below_B = np.maximum(lo_B, np.searchsorted(prefix_N1, last_below_B, "left"))  # the first end with that sum
    far_B = np.abs(prefix_N1[np.minimum(above_B, n)] - base_B - share_B)
    take_below = (above_B > hi_B) | (np.abs(prefix_N1[below_B] - base_B - share_B) <= far_B)
    return np.where(above_B == lo_B, lo_B, np.where(take_below, below_B, above_B))


def _block_ends_walk(prefix_N1, furthest_N1, first_within_K1) -> np.ndarray:
    """``_block_ends`` block by block (``_closest_end``): for many candidate starts, or sums
    too large for exact float shares."""
    prefix, furthest, first_within = prefix_N1.tolist(), furthest_N1.tolist(), first_within_K1.tolist()
    n, dp = len(prefix) - 1, len(first_within) - 1
    ends, start = [], 0
    for b in range(dp):
        left = dp - b
        end = n if left == 1 else _closest_end(prefix, start, max(start, first_within[left - 1]), furthest[start],
                                                (prefix[n] - prefix[start]) / left)
        ends.append(end)
        start = end
    return np.array(ends, dtype=np.int64)


def _closest_end(prefix: list[int], start: int, lo: int, hi: int, share: float) -> int:
    """The first end in ``lo..hi`` whose block sum from ``start`` is closest to ``share``."""
    base = prefix[start]
    above = bisect.bisect_left(prefix, base + share, lo, hi + 1)
    # exact comparisons of sums with the share (base + share may round)
    while above > lo and prefix[above - 1] - base >= share:
        above -= 1
    while above <= hi and prefix[above] - base < share:
        above += 1
    if above == lo:
        return above
    below = bisect.bisect_left(prefix, prefix[above - 1], lo, above)  # the first end with that sum
    if above > hi or abs(prefix[below] - base - share) <= abs(prefix[above] - base - share):
        return below
    return above


def _costs_N(costs: Sequence[int] | np.ndarray) -> np.ndarray:
    """Costs as int64: integers as they are; anything else (floats, bools) through ``int``, as
    the reference reads them."""
    costs_N = np.asarray(costs)
    if costs_N.dtype.kind in "iu":
        return costs_N.astype(np.int64, copy=False)
    return np.array([int(c) for c in costs], dtype=np.int64)


def _greedy(prefix_N1: np.ndarray, cap: int, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy blocks within ``cap`` (each as far as it can go: the fewest): the furthest end from
    every start, and the starts of blocks 0 .. dp from item 0 (``_chain``: log(dp) numpy passes);
    the last one is the end exactly when ``dp`` blocks fit."""
    furthest_N1 = _furthest(prefix_N1, cap)
    return furthest_N1, _chain(furthest_N1, 0, dp)


def _largest_block(prefix_N1: np.ndarray, reach_D1: np.ndarray) -> int:
    """The largest sum of greedy blocks that fit: within it, the very same blocks fit."""
    return int(np.diff(prefix_N1[reach_D1]).max(initial=0))


def _next_cap(prefix_N1: np.ndarray, reach_D1: np.ndarray) -> int:
    """The least cap at which one of ``dp`` greedy blocks that do not fit takes one more item:
    below it they stay the same blocks, so they still do not fit."""
    return int((prefix_N1[reach_D1[1:] + 1] - prefix_N1[reach_D1[:-1]]).min())


def _prefix(costs: Sequence[int] | np.ndarray, dp: int) -> tuple[np.ndarray, int]:
    """(prefix sums, the largest cost) of valid costs."""
    if dp < 1:
        raise LayoutError(f"dp must be >= 1, got {dp}")
    costs_N = _costs_N(costs)
    if np.any(costs_N < 0):
        raise LayoutError("sample costs must be non-negative")
    return _exclusive_cumsum(costs_N), int(costs_N.max(initial=0))


def _cap(prefix_N1: np.ndarray, largest: int, dp: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(the smallest capacity that ``dp`` contiguous blocks can keep to, and ``_greedy``'s
    furthest ends and block starts within it)."""
    n, total = len(prefix_N1) - 1, int(prefix_N1[-1])
    # every block within ceil(total/dp) + the largest cost is feasible (each full block holds
    # more than total/dp); the lower bound is often feasible already (even costs): try it first
    lo = max(largest, -(-total // dp))
    greedy = _greedy(prefix_N1, lo, dp)
    if int(greedy[1][-1]) == n:
        return lo, *greedy
    # bisection whose bounds move to what the greedy blocks show: past a cap that does not fit,
    # to the next cap that changes its blocks; below one that fits, to its largest block
    lo, hi, fitting = _next_cap(prefix_N1, greedy[1]), min(total, lo + largest), None
    while lo < hi:
        mid = (lo + hi) // 2
        greedy = _greedy(prefix_N1, mid, dp)
        if int(greedy[1][-1]) == n:
            hi, fitting = _largest_block(prefix_N1, greedy[1]), (mid, greedy)
        else:
            lo = _next_cap(prefix_N1, greedy[1])
    if fitting is None:  # no cap below the first bound fits
        return lo, *_greedy(prefix_N1, lo, dp)
    mid, (furthest_N1, reach_D1) = fitting
    # the blocks found within mid are the greedy blocks within lo (its largest), not so every start's furthest end
    return lo, (furthest_N1 if mid == lo else _furthest(prefix_N1, lo)), reach_D1


def block_of(blocks: Sequence[range], item: int) -> int:
    for i, b in enumerate(blocks):
        if item in b:
            return i
    raise LayoutError(f"item {item} is in no block")


# ---------------------------------------------------------------------------
# Context parallel chunk order
# ---------------------------------------------------------------------------
def cp_chunks(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two of ``2*cp`` chunks that CP rank ``cp_rank`` holds (balances causal work)."""
    if not 0 <= cp_rank < cp:
        raise LayoutError(f"cp rank {cp_rank} outside 0..{cp - 1}")
    return cp_rank, 2 * cp - 1 - cp_rank


def cp_owner(position: int, padded_len: int, cp: int) -> tuple[int, int]:
    """(cp rank, local offset) of ``position`` in a sequence padded to a multiple of 2*cp.

    The local sequence of a CP rank is its first chunk followed by its second.
    """
    if padded_len % (2 * cp):
        raise LayoutError(f"sequence length {padded_len} is not a multiple of 2*cp={2 * cp}")
    if not 0 <= position < padded_len:
        raise LayoutError(f"position {position} outside 0..{padded_len - 1}")
    chunk_len = padded_len // (2 * cp)
    chunk, off = divmod(position, chunk_len)
    if chunk < cp:
        return chunk, off
    return 2 * cp - 1 - chunk, chunk_len + off


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ---------------------------------------------------------------------------
# Placements of ragged [rows, hidden] tensors
# ---------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class Piece:
    """Rows ``row .. row+rows`` and columns ``col .. col+cols`` of the logical tensor, held
    by ``rank`` at rows ``local_row ..`` of its local buffer (columns local from 0)."""

    rank: int
    row: int
    rows: int
    local_row: int
    col: int
    cols: int


@dataclass(frozen=True)
class Placement:
    """Where every element of a logical ``[rows, hidden]`` tensor lives.

    ``local_rows[rank]`` is the row count of each rank's local buffer (it may exceed the rows
    it holds, e.g. an LLM's packed sequence holds text rows between image rows). A rank holds
    one contiguous column range for all its pieces. ``replicas`` lists groups of ranks that
    hold identical copies of their rows (a TP group over which rows are replicated): the
    groups that can complete each other's copies with an all-gather.
    """

    rows: int
    hidden: int
    pieces: tuple[Piece, ...]
    local_rows: dict[int, int]
    replicas: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        self.validate()

    @property
    def ranks(self) -> list[int]:
        return sorted(self.local_rows)

    def pieces_of(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.rank == rank]

    def columns_of(self, rank: int) -> range:
        ps = self.pieces_of(rank)
        if not ps:
            return range(0, self.hidden)
        return range(ps[0].col, ps[0].col + ps[0].cols)

    def local_shape(self, rank: int) -> tuple[int, int]:
        return (self.local_rows.get(rank, 0), len(self.columns_of(rank)))

    def validate(self) -> None:
        """Every element held at least once; no rank holds two pieces in the same local rows;
        replica groups hold identical layouts."""
        for group in self.replicas:
            layouts = {
                (self.local_rows.get(r), tuple(sorted((p.row, p.rows, p.local_row, p.col, p.cols) for p in self.pieces_of(r))))
                for r in group
            }
            if len(layouts) != 1 or any(r not in self.local_rows for r in group):
                raise LayoutError(f"replica group {group} does not hold identical copies")
        for p in self.pieces:
            if p.rows < 0 or p.cols < 0 or p.row < 0 or p.col < 0 or p.local_row < 0:
                raise LayoutError(f"negative extent in {p}")
            if p.row + p.rows > self.rows or p.col + p.cols > self.hidden:
                raise LayoutError(f"{p} exceeds the tensor [{self.rows}, {self.hidden}]")
            if p.local_row + p.rows > self.local_rows.get(p.rank, -1):
                raise LayoutError(f"{p} exceeds rank {p.rank}'s local buffer")
        for rank in self.local_rows:
            ps = sorted(self.pieces_of(rank), key=lambda p: p.local_row)
            if len({(p.col, p.cols) for p in ps}) > 1:
                raise LayoutError(f"rank {rank} holds more than one column range")
            for a, b in zip(ps, ps[1:]):
                if a.local_row + a.rows > b.local_row:
                    raise LayoutError(f"rank {rank}: local rows of {a} and {b} overlap")
        # coverage: for each column range boundary, rows covered
        cuts = sorted({0, self.hidden, *(p.col for p in self.pieces), *(p.col + p.cols for p in self.pieces)})
        for c0, c1 in zip(cuts, cuts[1:]):
            spans = sorted((p.row, p.row + p.rows) for p in self.pieces if p.col <= c0 and c1 <= p.col + p.cols and p.rows)
            covered = 0
            for a, b in spans:
                if a > covered:
                    break
                covered = max(covered, b)
            if covered < self.rows:
                raise LayoutError(f"rows {covered}.. of columns {c0}:{c1} are held by no rank")

    def holders(self, row: int, col: int) -> list[tuple[int, int]]:
        """(rank, local row) of every copy of element (row, col)."""
        return [
            (p.rank, p.local_row + row - p.row)
            for p in self.pieces
            if p.row <= row < p.row + p.rows and p.col <= col < p.col + p.cols
        ]


def split_even(n: int, parts: int) -> list[range]:
    """``n`` items in ``parts`` contiguous ranges of ceil(n/parts) (the last ones shorter or
    empty): the sequence-parallel split of a buffer padded to a multiple of ``parts``."""
    size = -(-n // parts) if parts else 0
    return [range(min(i * size, n), min((i + 1) * size, n)) for i in range(parts)]


def split_columns(hidden: int, parts: int) -> list[range]:
    """Hidden columns in ``parts`` near-equal contiguous ranges (the first ones one larger)."""
    base, extra = divmod(hidden, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


SHARDS = (None, "hidden", "seq")


def _dp_layout(grid: ParallelGrid, blocks: Sequence[range], shard: str | None) -> tuple[int, int]:
    """(tp, dp) of a module whose rows ``dp_placement`` places; errors for what it cannot."""
    if shard not in SHARDS:
        raise LayoutError(f"shard must be one of {SHARDS}, got {shard!r}")
    for d in grid.dims:
        if d not in ("tp", "dp", "pp") and grid.shape[d] != 1:
            raise LayoutError(f"dp_placement needs {d}=1, got {grid.shape[d]}")
    tp, dp = grid.shape.get("tp", 1), grid.shape.get("dp", 1)
    if len(blocks) != dp:
        raise LayoutError(f"{len(blocks)} DP blocks for dp={dp}")
    return tp, dp


# ---------------------------------------------------------------------------
# Where positions of a packed sequence live (LLM side, THD)
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PackLayout:
    """How one DP rank's pack is laid out over its CP and TP ranks.

    cp == 1: samples end to end; with sequence parallelism the pack is padded at its end to a
    multiple of tp and split in tp equal contiguous parts. cp > 1: each sample is padded to a
    multiple of 2*cp (times tp with sequence parallelism) and split into 2*cp chunks; CP rank
    c holds chunks c and 2*cp-1-c of every sample, sample after sample; with sequence
    parallelism that local sequence is split in tp equal parts.
    """

    seq_lens: tuple[int, ...]
    tp: int
    cp: int
    sequence_parallel: bool

    @property
    def multiple(self) -> int:
        if self.cp == 1:
            return 1
        return 2 * self.cp * (self.tp if self.sequence_parallel else 1)

    @cached_property
    def padded_lens(self) -> list[int]:
        return [round_up(n, self.multiple) for n in self.seq_lens]

    @cached_property
    def _offsets(self) -> list[int]:
        return [0, *itertools.accumulate(self.padded_lens)]

    @cached_property
    def total_len(self) -> int:
        """Positions the DP rank computes over all its CP ranks, padding included."""
        total = sum(self.padded_lens)
        if self.cp == 1 and self.sequence_parallel:
            total = round_up(total, self.tp)
        return total

    @property
    def local_len(self) -> int:
        """Length of one (cp, tp) rank's local sequence."""
        n = self.total_len // self.cp
        return n // self.tp if self.sequence_parallel else n

    def chunk_lens(self) -> list[int]:
        """cp > 1: each sample's chunk length (its padded length / 2cp)."""
        return [n // (2 * self.cp) for n in self.padded_lens]

    def cp_local_index(self, cp_rank: int) -> list[int]:
        """Positions of the whole pack (padding included) that CP rank ``cp_rank`` holds, in its
        local order: sample after sample, its chunk ``cp_rank`` then its chunk ``2cp-1-cp_rank``
        (``locate``'s local index of a position is its place in this list)."""
        first, second = cp_chunks(cp_rank, self.cp)
        out: list[int] = []
        for start, c in zip(self._offsets, self.chunk_lens()):
            out.extend(range(start + first * c, start + (first + 1) * c))
            out.extend(range(start + second * c, start + (second + 1) * c))
        return out

    def locate_cp(self, sample: int, position: int) -> tuple[int, int]:
        """(cp rank, index in that CP rank's share of the pack, before any SP split)."""
        if not 0 <= position < self.seq_lens[sample]:
            raise LayoutError(f"position {position} outside sample {sample} of length {self.seq_lens[sample]}")
        before = self._offsets[sample]
        if self.cp == 1:
            return 0, before + position
        cp_rank, off = cp_owner(position, self.padded_lens[sample], self.cp)
        return cp_rank, before // self.cp + off

    def locate(self, sample: int, position: int) -> tuple[int, int | None, int]:
        """(cp rank, tp rank or None when replicated over TP, local index) of a position."""
        cp_rank, idx = self.locate_cp(sample, position)
        if not self.sequence_parallel:
            return cp_rank, None, idx
        return cp_rank, idx // self.local_len, idx % self.local_len


# ---------------------------------------------------------------------------
# The same placements as arrays, built from runs of rows (the per-microbatch hot path)
# ---------------------------------------------------------------------------
def expand(counts_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(parent, k) over ``sum(counts)`` items: item n repeated ``counts[n]`` times, k counting
    0 .. counts[n]-1 within it (a loop over a ragged range, vectorised)."""
    counts_N = np.asarray(counts_N, dtype=np.int64)
    parent = np.repeat(np.arange(len(counts_N)), counts_N)
    k = np.arange(len(parent)) - np.repeat(np.cumsum(counts_N) - counts_N, counts_N)
    return parent, k


def _exclusive_cumsum(x_N: np.ndarray) -> np.ndarray:
    """[0, x0, x0+x1, ...]: one longer than ``x_N``."""
    out = np.zeros(len(x_N) + 1, dtype=np.int64)
    np.cumsum(x_N, out=out[1:])
    return out


def _split_runs(start_U: np.ndarray, len_U: np.ndarray, period_U: np.ndarray):
    """Cut each run ``start .. start+len`` at the multiples of its period: (parent run, start,
    len) of the pieces (a run inside one period stays whole; empty runs vanish)."""
    first = start_U // period_U
    count = np.where(len_U > 0, (start_U + len_U - 1) // period_U - first + 1, 0)
    u, k = expand(count)
    lo = np.maximum(start_U[u], (first[u] + k) * period_U[u])
    hi = np.minimum(start_U[u] + len_U[u], (first[u] + k + 1) * period_U[u])
    return u, lo, hi - lo


@dataclass(frozen=True, eq=False)
class SampleRuns:
    """A global microbatch's rows as runs of positions: sample i is ``seq_len_N[i]`` positions
    long; run u holds the rows at positions ``start_U[u] .. start_U[u]+len_U[u]`` of sample
    ``sample_U[u]``. Rows are numbered sample after sample, run after run (runs in sample order)."""

    seq_len_N: np.ndarray
    sample_U: np.ndarray
    start_U: np.ndarray
    len_U: np.ndarray

    def __post_init__(self):
        if len(self.sample_U) and (np.any(np.diff(self.sample_U) < 0) or self.sample_U[0] < 0
                                   or self.sample_U[-1] >= len(self.seq_len_N)):
            raise LayoutError("runs of rows must come sample after sample")
        end_U = self.start_U + self.len_U
        bad = (self.start_U < 0) | (end_U > self.seq_len_N[self.sample_U]) | (self.len_U < 0)
        if np.any(bad):
            u = int(np.flatnonzero(bad)[0])
            raise LayoutError(f"rows at positions {int(self.start_U[u])}..{int(end_U[u]) - 1} outside sample "
                              f"{int(self.sample_U[u])} of length {int(self.seq_len_N[self.sample_U[u]])}")

    @classmethod
    def of_images(cls, seq_lens: Sequence[int], image_starts: Sequence[Sequence[int]], rows_per_image: int) -> "SampleRuns":
        """Each image a run of ``rows_per_image`` rows from its first position."""
        count_N = np.array(list(map(len, image_starts)), dtype=np.int64)
        start_U = np.array(list(itertools.chain.from_iterable(image_starts)), dtype=np.int64)
        return cls.of_image_arrays(seq_lens, count_N, start_U, rows_per_image)

    @classmethod
    def of_image_arrays(cls, seq_len_N, images_N: np.ndarray, start_U: np.ndarray, rows_per_image: int | np.ndarray) -> "SampleRuns":
        """``of_images`` from arrays: each sample's images, every image's first position;
        ``rows_per_image`` one count for all, or each image's own (native resolution)."""
        sample_U = np.repeat(np.arange(len(images_N)), images_N)
        len_U = (np.full(len(start_U), rows_per_image, dtype=np.int64) if np.ndim(rows_per_image) == 0
                 else np.asarray(rows_per_image, dtype=np.int64))
        return cls(np.asarray(seq_len_N, dtype=np.int64), sample_U, np.asarray(start_U, dtype=np.int64), len_U)

    @classmethod
    def of_positions(cls, samples: Sequence[tuple[int, Sequence[int]]]) -> "SampleRuns":
        """From ``packed_placement``'s argument, (sequence length, positions of its rows) per
        sample: maximal runs of consecutive positions."""
        seq_len_N = np.array([n for n, _ in samples], dtype=np.int64)
        count_N = np.array([len(pos) for _, pos in samples], dtype=np.int64)
        pos_R = np.fromiter(itertools.chain.from_iterable(pos for _, pos in samples), dtype=np.int64, count=int(count_N.sum()))
        sample_R = np.repeat(np.arange(len(samples)), count_N)
        new_run = np.ones(len(pos_R), dtype=bool)
        new_run[1:] = (pos_R[1:] != pos_R[:-1] + 1) | (sample_R[1:] != sample_R[:-1])
        first = np.flatnonzero(new_run)
        len_U = np.diff(np.append(first, len(pos_R)))
        return cls(seq_len_N, sample_R[first], pos_R[first], len_U)

    @cached_property
    def rows_N(self) -> np.ndarray:
        """Rows of each sample."""
        return np.bincount(self.sample_U, weights=self.len_U, minlength=len(self.seq_len_N)).astype(np.int64)

    @cached_property
    def row_U1(self) -> np.ndarray:
        """The first (logical) row of each run, and the rows of all of them."""
        return _exclusive_cumsum(self.len_U)

    @cached_property
    def row_U(self) -> np.ndarray:
        """The first (logical) row of each run."""
        return self.row_U1[:-1]

    def rows_before(self, samples: np.ndarray) -> np.ndarray:
        """Rows of the samples before each of ``samples`` (a look-up each: the first row of the
        first run from that sample on)."""
        return self.row_U1[np.searchsorted(self.sample_U, samples, "left")]


@dataclass(frozen=True, eq=False)
class RunPlacement:
    """A ``Placement`` as arrays, one entry per piece (``*_P``) and per rank (``*_R``).

    ``ranks_R`` ascending, with each rank's local row count; ``replica_GK``: one replica group
    per row (group-rank order), padded with -1 when groups differ in size. ``to_placement``
    gives the ``Placement`` with the same pieces in the same order; the rank queries below are
    what executors and plans ask.
    """

    rows: int
    hidden: int
    rank_P: np.ndarray
    row_P: np.ndarray
    rows_P: np.ndarray
    local_row_P: np.ndarray
    col_P: np.ndarray
    cols_P: np.ndarray
    ranks_R: np.ndarray
    local_rows_R: np.ndarray
    replica_GK: np.ndarray

    @classmethod
    def of_placement(cls, placement: Placement) -> "RunPlacement":
        fields = np.array([(p.rank, p.row, p.rows, p.local_row, p.col, p.cols) for p in placement.pieces],
                          dtype=np.int64).reshape(-1, 6)
        ranks = sorted(placement.local_rows)
        width = max((len(g) for g in placement.replicas), default=0)
        replica_GK = np.full((len(placement.replicas), width), -1, dtype=np.int64)
        for i, g in enumerate(placement.replicas):
            replica_GK[i, : len(g)] = g
        return cls(placement.rows, placement.hidden, *fields.T.copy(), np.array(ranks, dtype=np.int64),
                   np.array([placement.local_rows[r] for r in ranks], dtype=np.int64), replica_GK)

    def to_placement(self) -> Placement:
        """The reference object (validated): for tests and small layouts."""
        columns = (self.rank_P, self.row_P, self.rows_P, self.local_row_P, self.col_P, self.cols_P)
        pieces = tuple(Piece(*f) for f in zip(*(c.tolist() for c in columns)))
        return Placement(self.rows, self.hidden, pieces, dict(zip(self.ranks_R.tolist(), self.local_rows_R.tolist())),
                         self.replicas)

    @cached_property
    def replicas(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(r for r in g if r >= 0) for g in self.replica_GK.tolist())

    @cached_property
    def ranks(self) -> list[int]:
        return self.ranks_R.tolist()

    def _rank_index(self, rank: int) -> int | None:
        i = int(np.searchsorted(self.ranks_R, rank))
        return i if i < len(self.ranks_R) and self.ranks_R[i] == rank else None

    def holds_rank(self, rank: int) -> bool:
        """Whether ``rank`` is one of the placement's ranks (possibly holding no rows)."""
        return self._rank_index(rank) is not None

    def local_rows_of(self, rank: int) -> int:
        i = self._rank_index(rank)
        return 0 if i is None else int(self.local_rows_R[i])

    def pieces_of(self, rank: int) -> list[Piece]:
        mine = np.flatnonzero(self.rank_P == rank)
        columns = (self.rank_P, self.row_P, self.rows_P, self.local_row_P, self.col_P, self.cols_P)
        return [Piece(*f) for f in zip(*(c[mine].tolist() for c in columns))]

    def row_span(self, rank: int) -> tuple[int, int] | None:
        """(first, past the last) logical row of ``rank``'s pieces; None when it has none."""
        mine = self.rank_P == rank
        if not mine.any():
            return None
        return int(self.row_P[mine].min()), int((self.row_P[mine] + self.rows_P[mine]).max())

    def held_rows(self, rank: int) -> int:
        """Local rows that some piece of ``rank`` covers."""
        return int(self.rows_P[self.rank_P == rank].sum())

    def columns_of(self, rank: int) -> range:
        mine = np.flatnonzero(self.rank_P == rank)
        if not len(mine):
            return range(0, self.hidden)
        col = int(self.col_P[mine[0]])
        return range(col, col + int(self.cols_P[mine[0]]))

    def local_shape(self, rank: int) -> tuple[int, int]:
        return (self.local_rows_of(rank), len(self.columns_of(rank)))

    def replica_group_of(self, rank: int) -> tuple[int, ...] | None:
        """The last replica group listing ``rank`` (as ``Placement.replicas`` is read), or None."""
        hits = np.flatnonzero((self.replica_GK == rank).any(axis=1))
        return self.replicas[hits[-1]] if len(hits) else None


def as_runs(placement: Placement | RunPlacement) -> RunPlacement:
    return placement if isinstance(placement, RunPlacement) else RunPlacement.of_placement(placement)


def _rank_table(grid: ParallelGrid, dims: Sequence[str]) -> np.ndarray:
    """The rank at every coordinate of ``dims`` (other dims at 0), indexed in ``dims`` order."""
    return _rank_table_of(tuple(grid.shape.items()), grid.offset, tuple(dims))


@functools.lru_cache(maxsize=64)  # a pure function of the grid's shape: built once per run
def _rank_table_of(shape: tuple[tuple[str, int], ...], offset: int, dims: tuple[str, ...]) -> np.ndarray:
    grid = ParallelGrid(dict(shape), offset)
    table = np.full((1,) * len(dims), offset, dtype=np.int64)
    for axis, d in enumerate(dims):
        n = grid.shape.get(d, 1)
        stride = grid.rank_at(**{d: 1}) - offset if n > 1 else 0
        table = table + (np.arange(n, dtype=np.int64) * stride).reshape([n if a == axis else 1 for a in range(len(dims))])
    table.flags.writeable = False  # shared by every caller
    return table


def block_bounds(blocks: Sequence[range]) -> tuple[np.ndarray, np.ndarray]:
    """(start_D, stop_D) of DP blocks: ``dp_blocks``' arrays as they are, else read range by range."""
    if isinstance(blocks, DpBlocks):
        return blocks.start_D, blocks.stop_D
    start_D = np.array(list(map(operator.attrgetter("start"), blocks)), dtype=np.int64)
    stop_D = np.array(list(map(operator.attrgetter("stop"), blocks)), dtype=np.int64)
    return start_D, stop_D


def _local_rows(grid: ParallelGrid, rank_P: np.ndarray, rows_P: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every rank of ``grid`` with the rows its pieces hold (0 for ranks holding none)."""
    ranks_R = np.arange(grid.offset, grid.offset + grid.size, dtype=np.int64)
    local_R = np.bincount(rank_P - grid.offset, weights=rows_P, minlength=grid.size).astype(np.int64)
    return ranks_R, local_R


def dp_runs(grid: ParallelGrid, sample_rows: Sequence[int] | np.ndarray, blocks: Sequence[range], hidden: int,
            shard: str | None = None) -> RunPlacement:
    """``dp_placement`` as arrays: the same pieces, local rows and replica groups."""
    tp, dp = _dp_layout(grid, blocks, shard)
    starts = _exclusive_cumsum(np.asarray(sample_rows, dtype=np.int64))
    start_D, stop_D = block_bounds(blocks)
    row0_DT = np.repeat(starts[start_D][:, None], tp, axis=1)
    n_DT = np.repeat((starts[stop_D] - starts[start_D])[:, None], tp, axis=1)
    rank_DT = _rank_table(grid, ("dp", "tp"))
    t_DT = np.broadcast_to(np.arange(tp, dtype=np.int64), (dp, tp))
    col_DT, cols_DT, local_DT = np.zeros_like(n_DT), np.full_like(n_DT, hidden), n_DT
    if shard == "seq":  # split_even: ceil(n/tp) rows per TP rank, the last ones shorter or empty
        size_DT = -(-n_DT // tp)
        lo_DT = np.minimum(t_DT * size_DT, n_DT)
        row0_DT, n_DT, local_DT = row0_DT + lo_DT, np.minimum(lo_DT + size_DT, n_DT) - lo_DT, size_DT
    elif shard == "hidden":
        col_DT = np.broadcast_to(np.array([c.start for c in split_columns(hidden, tp)], dtype=np.int64), (dp, tp))
        cols_DT = np.broadcast_to(np.array([len(c) for c in split_columns(hidden, tp)], dtype=np.int64), (dp, tp))
    rank_P = rank_DT.ravel()
    ranks_R, local_R = _local_rows(grid, rank_P, local_DT.ravel())
    replica_GK = rank_DT if shard is None and tp > 1 else np.zeros((0, 0), dtype=np.int64)
    return RunPlacement(int(starts[-1]), hidden, rank_P, row0_DT.ravel(), n_DT.ravel(), np.zeros_like(rank_P),
                        np.ascontiguousarray(col_DT).ravel(), np.ascontiguousarray(cols_DT).ravel(),
                        ranks_R, local_R, replica_GK)


def _tp_groups(grid: ParallelGrid) -> np.ndarray:
    """Every TP group of ``grid`` in group-rank order, ordered by first rank (``partition``)."""
    tp = grid.shape.get("tp", 1)
    stride = grid.rank_at(tp=1) - grid.offset if tp > 1 else 1
    ranks = np.arange(grid.offset, grid.offset + grid.size, dtype=np.int64)
    first = ranks[((ranks - grid.offset) // stride) % tp == 0]
    return first[:, None] + np.arange(tp, dtype=np.int64) * stride


def _check_blocks(start_D: np.ndarray, stop_D: np.ndarray, n: int) -> None:
    if len(start_D) and (start_D[0] != 0 or stop_D[-1] != n or np.any(start_D[1:] != stop_D[:-1]) or np.any(stop_D < start_D)):
        raise LayoutError("packed placements need DP blocks covering the samples in order")


def _pack_offsets(seq_len_N: np.ndarray, start_D, stop_D, tp: int, cp: int, sequence_parallel: bool):
    """``PackLayout`` of DP blocks at once (covering ``seq_len_N``'s samples in order): each
    sample's block, padded length and offset in its pack; each block's local length (one
    (cp, tp) rank's)."""
    multiple = 1 if cp == 1 else 2 * cp * (tp if sequence_parallel else 1)
    padded_N = -(-seq_len_N // multiple) * multiple
    block_N = np.repeat(np.arange(len(start_D)), stop_D - start_D)
    prefix = _exclusive_cumsum(padded_N)
    before_N = prefix[:-1] - prefix[start_D][block_N]
    total_D = prefix[stop_D] - prefix[start_D]
    if cp == 1 and sequence_parallel:
        total_D = -(-total_D // tp) * tp
    local_len_D = total_D // cp // (tp if sequence_parallel else 1)
    return block_N, padded_N, before_N, local_len_D


def _blocks_reaching(runs: SampleRuns, start_D: np.ndarray, stop_D: np.ndarray, rows: tuple[int, int]) -> range:
    """The DP blocks holding some of rows ``lo .. hi-1``: a piece of any other block holds none
    of them (it may only end at lo or start at hi)."""
    lo, hi = rows
    if lo >= hi or len(start_D) == 1:
        return range(0, len(start_D) * (lo < hi))
    return range(int(np.searchsorted(runs.rows_before(stop_D), lo, "right")),
                 int(np.searchsorted(runs.rows_before(start_D), hi, "left")))


def packed_rows_of(grid: ParallelGrid, runs: SampleRuns, blocks: Sequence[range], rank: int) -> tuple[int, int] | None:
    """(first, past the last) row of the DP block that ``rank`` packs in ``packed_runs`` (its
    pieces lie within), None for a rank packing none (not in ``grid``, a later pipeline stage)."""
    coords = grid.coords(rank) if rank in grid else None
    if coords is None or any(v for d, v in coords.items() if d not in ("tp", "cp", "dp")):
        return None
    block = blocks[coords.get("dp", 0)]
    lo, hi = runs.rows_before(np.array([block.start, block.stop], dtype=np.int64)).tolist()
    return lo, hi


# ``_order_by`` sorts a combined key from this many keys on (below, the lexsort is as quick)
ORDER_BY_ARGSORT = 256


def _order_by(major_V: np.ndarray, minor_V: np.ndarray) -> np.ndarray:
    """``np.lexsort((minor, major))`` of integer keys: one stable argsort of a combined key
    while it fits in int64 (several times faster on thousands of keys), else the lexsort."""
    if len(major_V) < ORDER_BY_ARGSORT or not len(major_V):
        return np.lexsort((minor_V, major_V))
    major_lo, minor_lo = int(major_V.min()), int(minor_V.min())
    span = int(minor_V.max()) - minor_lo + 1
    if (int(major_V.max()) - major_lo + 1) * span >= 2 ** 62:
        return np.lexsort((minor_V, major_V))
    return np.argsort((major_V - major_lo) * span + (minor_V - minor_lo), kind="stable")


def _compact_pieces(rank_V, local_V, row_V, len_V):
    """Pieces of compact local buffers: each rank's rows in the order of their local
    positions, joined where logical rows continue. Returns (order of the first item of each
    piece, rank, row, rows, local row)."""
    order = _order_by(rank_V, local_V)
    rank_V, row_V, len_V = rank_V[order], row_V[order], len_V[order]
    before = _exclusive_cumsum(len_V)[:-1]
    new_rank = np.ones(len(rank_V), dtype=bool)
    new_rank[1:] = rank_V[1:] != rank_V[:-1]
    rank_first = np.maximum.accumulate(np.where(new_rank, np.arange(len(rank_V)), 0))
    compact_V = before - before[rank_first]
    new_piece = new_rank.copy()
    new_piece[1:] |= row_V[1:] != row_V[:-1] + len_V[:-1]
    first = np.flatnonzero(new_piece)
    rows_P = np.add.reduceat(len_V, first) if len(first) else np.zeros(0, dtype=np.int64)
    return order[first], rank_V[first], row_V[first], rows_P, compact_V[first]


def packed_runs(grid: ParallelGrid, runs: SampleRuns, blocks: Sequence[range], hidden: int,
                sequence_parallel: bool = False, rows: tuple[int, int] | None = None) -> RunPlacement:
    """``packed_placement`` as arrays (the same pieces, local rows and replica groups), from
    runs of rows: every run is cut where a CP chunk or an SP part ends, and mapped to its rank
    and local position as ``PackLayout.locate`` maps each of its positions.

    ``rows`` (lo, hi): only the pieces of the DP blocks holding some of rows lo .. hi-1, the
    other ranks holding none and no local rows here: all that the plans of a rank whose rows
    are those read (every holder of its rows), built from its share of the runs, not the world's."""
    tp, cp, dp = (grid.shape.get(d, 1) for d in ("tp", "cp", "dp"))
    if len(blocks) != dp:
        raise LayoutError(f"{len(blocks)} DP blocks for dp={dp}")
    start_D, stop_D = block_bounds(blocks)
    _check_blocks(start_D, stop_D, len(runs.seq_len_N))
    d = range(0, dp) if rows is None else _blocks_reaching(runs, start_D, stop_D, rows)
    n0, n1 = (int(start_D[d.start]), int(stop_D[d.stop - 1])) if len(d) else (0, 0)  # their samples
    block_N, padded_N, before_N, local_len_D = _pack_offsets(runs.seq_len_N[n0:n1], start_D[d.start:d.stop] - n0,
                                                             stop_D[d.start:d.stop] - n0, tp, cp, sequence_parallel)
    u = slice(*np.searchsorted(runs.sample_U, [n0, n1]).tolist())  # their runs
    keep = runs.len_U[u] > 0
    sample_V, start_V, len_V, row_V = (a[u][keep] for a in (runs.sample_U, runs.start_U, runs.len_U, runs.row_U))
    sample_V = sample_V - n0
    if cp > 1:  # a run continues in the pack only inside one of its sample's 2cp chunks
        chunk_V = padded_N[sample_V] // (2 * cp)
        u, split_V, len_V = _split_runs(start_V, len_V, chunk_V)
        sample_V, row_V, chunk_V, start_V = sample_V[u], row_V[u] + split_V - start_V[u], chunk_V[u], split_V
        chunk, off = np.divmod(start_V, chunk_V)
        cp_V = np.where(chunk < cp, chunk, 2 * cp - 1 - chunk)
        idx_V = before_N[sample_V] // cp + np.where(chunk < cp, off, chunk_V + off)
    else:
        cp_V, idx_V = np.zeros_like(start_V), before_N[sample_V] + start_V
    dp_V = block_N[sample_V]  # of the blocks ``d``
    table_TCD = _rank_table(grid, ("tp", "cp", "dp"))[:, :, d.start:d.stop]
    if sequence_parallel:  # ... and inside one TP rank's part of the CP rank's sequence
        part_V = local_len_D[dp_V]
        u, split_V, len_V = _split_runs(idx_V, len_V, part_V)
        row_V, cp_V, dp_V, part_V = row_V[u] + split_V - idx_V[u], cp_V[u], dp_V[u], part_V[u]
        tp_V, idx_V = np.divmod(split_V, part_V)
    else:  # replicated over TP: build TP rank 0's pieces, copy them to the others below
        tp_V = np.zeros_like(cp_V)
    first, rank_P, row_P, rows_P, local_P = _compact_pieces(table_TCD[tp_V, cp_V, dp_V], idx_V, row_V, len_V)
    replica_GK = np.zeros((0, 0), dtype=np.int64)
    if not sequence_parallel and tp > 1:
        rank_TP = table_TCD[:, cp_V[first], dp_V[first]]
        order = _order_by(rank_TP.ravel(), np.tile(local_P, tp))
        rank_P = rank_TP.ravel()[order]
        row_P, rows_P, local_P = (np.tile(a, tp)[order] for a in (row_P, rows_P, local_P))
        replica_GK = _tp_groups(grid)
    ranks_R, local_R = _local_rows(grid, rank_P, rows_P)
    return RunPlacement(int(runs.len_U.sum()), hidden, rank_P, row_P, rows_P, local_P, np.zeros_like(rank_P),
                        np.full_like(rank_P, hidden), ranks_R, local_R, replica_GK)
