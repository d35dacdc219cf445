"""Placements: which rank holds which rows and hidden columns of a boundary tensor.

Three decisions live here and nowhere else, because every module, the data loader and the
bridges must agree on them:

* ``dp_blocks``: how a global microbatch (a list of samples with costs) is split into
  contiguous DP blocks — the partition whose largest block is smallest.
* ``cp_chunks``: which chunks of a sequence a context-parallel rank holds (load-balanced
  order: rank r holds chunks r and 2*cp-1-r of 2*cp).
* ``Placement``: for a logical ragged ``[rows, hidden]`` tensor, the pieces each rank holds
  and where they sit in its local buffer.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence

from mimo.core.errors import LayoutError
from mimo.parallel.grid import ParallelGrid


# ---------------------------------------------------------------------------
# DP blocks
# ---------------------------------------------------------------------------
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


def dp_blocks(costs: Sequence[int], dp: int) -> list[range]:
    """Split items (e.g. samples with token counts) into ``dp`` contiguous blocks.

    The largest block sum is the smallest possible; among such partitions, each block in
    turn takes the end closest to an even share of what is left (so trailing ranks are not
    starved needlessly). Blocks may be empty. Deterministic: every rank gets the same answer.
    """
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
    if shard not in SHARDS:
        raise LayoutError(f"shard must be one of {SHARDS}, got {shard!r}")
    for d in grid.dims:
        if d not in ("tp", "dp", "pp") and grid.shape[d] != 1:
            raise LayoutError(f"dp_placement needs {d}=1, got {grid.shape[d]}")
    tp, dp = grid.shape.get("tp", 1), grid.shape.get("dp", 1)
    if len(blocks) != dp:
        raise LayoutError(f"{len(blocks)} DP blocks for dp={dp}")
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
