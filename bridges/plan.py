"""Transfer plans: which rows and hidden columns move from which rank to which.

A plan is a pure function of (source placement, destination placement) and is computed
identically on every rank. Gradients travel by the plan of the opposite direction: under
the convention that a replicated tensor carries the complete gradient on every replica, the
gradient *is* a tensor in the destination placement that must reach the source placement.

Colocated (same ranks): every destination rank takes what it already holds from its own
source buffer and receives the rest; the sender of each missing block is chosen among its
holders by the receiving rank, which spreads load over source replicas.

Non-colocated (disjoint ranks): every element crosses exactly once. An element replicated
over a destination replica group of k ranks is split by hidden columns into k even chunks
(ceil(hidden/k) columns each, the last shorter or empty), one per replica; each chunk's rows
are split evenly over the element's source holders. The replica group then completes its
copies with an all-gather of even-sized chunks (see ``FinishGather``).

Training runs ``rank_plans``: one
rank's part of the plans of both directions (the moves it sends or receives, its all-gather)
with numpy over the elementary cells of that rank's own rows, at a cost that follows the rank's
share, not the world: the same ``Move`` values in the same order as the whole plan that
``mimo.bridges.plan_reference.make_plan`` builds cell by cell (the reference, a test oracle). ``image_bridge_plans`` builds a
microbatch's image bridge as training runs it (both placements from runs of rows, the rank's plans
of them); ``mimo verify-bridge --rows native`` checks it against the reference builders.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from mimo.core.errors import LayoutError
from mimo.parallel.grid import ParallelGrid
from mimo.parallel.layout import Placement, RunPlacement, SampleRuns, as_runs, dp_runs, expand, packed_rows_of, packed_runs


@dataclass(frozen=True)
class Move:
    """``rows`` rows and columns ``col .. col+cols`` (global) of the logical tensor, read at
    local row ``src_row`` of ``src``'s buffer and written at local row ``dst_row`` of ``dst``'s."""

    src: int
    dst: int
    src_row: int
    dst_row: int
    rows: int
    col: int
    cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class FinishGather:
    """A destination replica group that all-gathers column chunks of its local buffer:
    member i contributes columns ``i*chunk .. (i+1)*chunk`` (zero-padded past ``hidden``)."""

    ranks: tuple[int, ...]
    rows: int
    chunk: int

    @property
    def received_numel(self) -> int:
        """Elements each member receives: the other members' chunks of its rows."""
        return self.rows * self.chunk * (len(self.ranks) - 1)


@dataclass(frozen=True)
class TransferPlan:
    """``rank`` None: the whole plan. A rank's plan (``rank_plans``) holds only the moves that
    rank sends or receives (local copies included) and only its own all-gather."""

    src: Placement | RunPlacement
    dst: Placement | RunPlacement
    moves: tuple[Move, ...]
    gathers: tuple[FinishGather, ...]
    colocated: bool
    rank: int | None = None

    def moves_between(self, src: int, dst: int) -> list[Move]:
        return [m for m in self.moves if m.src == src and m.dst == dst]

    def sent_numel(self, rank: int | None = None) -> int:
        """Elements that cross between different ranks (local copies excluded)."""
        return sum(m.numel for m in self.moves if m.src != m.dst and (rank is None or m.src == rank))

    def gather_numel(self) -> int:
        """Elements received by all the finishing all-gathers together."""
        return sum(g.received_numel * len(g.ranks) for g in self.gathers)


# ---------------------------------------------------------------------------
def _cuts(values) -> list[int]:
    return sorted(set(values))


def _check_same_tensor(src: Placement, dst: Placement) -> None:
    if (src.rows, src.hidden) != (dst.rows, dst.hidden):
        raise LayoutError(
            f"source [{src.rows}, {src.hidden}] and destination [{dst.rows}, {dst.hidden}] "
            "placements describe different tensors"
        )


# ---------------------------------------------------------------------------
# One rank's plans, vectorised over the elementary cells of its own rows
# ---------------------------------------------------------------------------
class _Cells:
    """The elementary cells of ``_elementary`` (plus extra column cuts) as arrays; a cell's
    key is row cell * column cells + column cell."""

    def __init__(self, a: RunPlacement, b: RunPlacement, extra_cols=(), row: np.ndarray | None = None, whole=None):
        """``whole``: the placements whose column cuts count, when ``a`` and ``b`` are windows
        of them (``_window``): a move never joins across columns, so every cut must be there."""
        if row is None:
            row = np.unique(np.concatenate([[0, a.rows]] + [x for pl in (a, b) for x in (pl.row_P, pl.row_P + pl.rows_P)]))
        self.row = row
        bounds = [[0, a.hidden], np.asarray(extra_cols, dtype=np.int64)] + [_col_bounds(pl) for pl in (whole or (a, b))]
        self.col = np.unique(np.concatenate(bounds))
        self.ncol = len(self.col) - 1

    def rows(self, key_K: np.ndarray) -> np.ndarray:
        return np.diff(self.row)[key_K // self.ncol]

    def col_range(self, key_K: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.col[key_K % self.ncol], np.diff(self.col)[key_K % self.ncol]


def _col_bounds(pl: RunPlacement) -> np.ndarray:
    """The first and past-the-last columns of ``pl``'s pieces (repeated): of many pieces, two
    values when they all have the same columns (rows replicated or split: a pass, no sort over
    the world's pieces)."""
    if len(pl.col_P) > 64 and np.all(pl.col_P == pl.col_P[0]) and np.all(pl.cols_P == pl.cols_P[0]):
        return np.array([pl.col_P[0], pl.col_P[0] + pl.cols_P[0]], dtype=np.int64)
    return np.concatenate([pl.col_P, pl.col_P + pl.cols_P])


class _Held(NamedTuple):
    """Copies of elementary cells, sorted by (cell key, rank, local row): who holds each
    and at which local row of its buffer the cell starts."""

    key: np.ndarray
    rank: np.ndarray
    local_row: np.ndarray

    def only(self, keep: np.ndarray) -> "_Held":
        return _Held(self.key[keep], self.rank[keep], self.local_row[keep])

    def groups(self, key_K: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(first entry, number of holders) of each cell in ``key_K``."""
        start = np.searchsorted(self.key, key_K, "left")
        return start, np.searchsorted(self.key, key_K, "right") - start

    def holds(self, key_K: np.ndarray, rank_K: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(entry, found): the first copy of cell ``key_K[k]`` that ``rank_K[k]`` holds."""
        pos = np.searchsorted(self.key * width + self.rank, key_K * width + rank_K)
        at = np.minimum(pos, len(self.key) - 1)
        found = (pos < len(self.key)) & (self.key[at] == key_K) & (self.rank[at] == rank_K)
        return at, found


def _held(pl: RunPlacement, cells: _Cells, pieces, row_cells=None, col_cells=None) -> _Held:
    """The copies in ``pl``'s ``pieces`` (a mask) of every elementary cell, or only of the row
    cells ``row_cells`` (sorted) and the column cells ``col_cells`` (a range)."""
    sel = np.flatnonzero(pieces & (pl.rows_P > 0) & (pl.cols_P > 0))
    row0, col0 = pl.row_P[sel], pl.col_P[sel]
    r0, r1 = np.searchsorted(cells.row, row0), np.searchsorted(cells.row, row0 + pl.rows_P[sel])
    c0, c1 = np.searchsorted(cells.col, col0), np.searchsorted(cells.col, col0 + pl.cols_P[sel])
    if col_cells is not None:
        c0, c1 = np.maximum(c0, col_cells.start), np.minimum(c1, col_cells.stop)
    if row_cells is None:
        p, k = expand(r1 - r0)
        ri = r0[p] + k
    else:  # only the wanted row cells inside each piece: a contiguous range of row_cells
        a, b = np.searchsorted(row_cells, r0), np.searchsorted(row_cells, r1)
        p, k = expand(b - a)
        ri = row_cells[a[p] + k]
    q, k = expand(np.maximum(c1 - c0, 0)[p])
    p, ri, ci = p[q], ri[q], c0[p[q]] + k
    key, rank = ri * cells.ncol + ci, pl.rank_P[sel][p]
    local = pl.local_row_P[sel][p] + cells.row[ri] - row0[p]
    order = np.lexsort((local, rank, key))
    return _Held(key[order], rank[order], local[order])


def _col_cells(pl: RunPlacement, cells: _Cells, rank: int) -> range:
    cols = pl.columns_of(rank)
    return range(int(np.searchsorted(cells.col, cols.start)), int(np.searchsorted(cells.col, cols.stop)))


class _Local:
    """``rank``'s elementary cells in a placement and every copy of them in either placement,
    each computed once (a colocated bridge's two directions share them)."""

    def __init__(self, cells: _Cells, rank: int):
        self.cells, self.rank, self.memo = cells, rank, {}

    def own(self, pl: RunPlacement) -> _Held:
        """``rank``'s copies of cells in ``pl``."""
        if ("own", id(pl)) not in self.memo:
            self.memo["own", id(pl)] = _held(pl, self.cells, pl.rank_P == self.rank)
        return self.memo["own", id(pl)]

    def copies(self, pl: RunPlacement, of: RunPlacement) -> _Held:
        """Every copy in ``pl`` of the cells ``rank`` holds in ``of`` (inside its columns there)."""
        if ("copies", id(pl), id(of)) not in self.memo:
            row_cells = np.unique(self.own(of).key // self.cells.ncol)
            everywhere = np.ones(len(pl.rank_P), dtype=bool)
            self.memo["copies", id(pl), id(of)] = _held(pl, self.cells, everywhere, row_cells, _col_cells(of, self.cells, self.rank))
        return self.memo["copies", id(pl), id(of)]


class _Moves:
    """Moves as arrays (the columns of ``Move``, the cell's key for its columns)."""

    def __init__(self):
        self.parts: list[tuple[np.ndarray, ...]] = []

    def add(self, src, dst, src_row, dst_row, rows, key) -> None:
        n = len(key)
        self.parts.append(tuple(np.full(n, x, dtype=np.int64) if np.isscalar(x) else x for x in (src, dst, src_row, dst_row, rows, key)))

    def merged(self, cells: _Cells) -> tuple[Move, ...]:
        """``_merge`` of these moves: sorted by (src, dst, col, cols, dst_row), joined where
        both rows continue."""
        if not self.parts:
            return ()
        src, dst, src_row, dst_row, rows, key = (np.concatenate(c) for c in zip(*self.parts))
        if not len(key):
            return ()
        col, cols = cells.col_range(key)
        order = np.lexsort((dst_row, cols, col, dst, src))
        src, dst, src_row, dst_row, rows, col, cols = (x[order] for x in (src, dst, src_row, dst_row, rows, col, cols))
        joins = ((src[1:] == src[:-1]) & (dst[1:] == dst[:-1]) & (col[1:] == col[:-1]) & (cols[1:] == cols[:-1])
                 & (src_row[:-1] + rows[:-1] == src_row[1:]) & (dst_row[:-1] + rows[:-1] == dst_row[1:]))
        first = np.flatnonzero(np.concatenate([[True], ~joins]))
        rows = np.add.reduceat(rows, first)
        columns = (src[first], dst[first], src_row[first], dst_row[first], rows, col[first], cols[first])
        return tuple(Move(*m) for m in zip(*(c.tolist() for c in columns)))


def _width(src: RunPlacement, dst: RunPlacement) -> int:
    return int(max(src.ranks_R.max(initial=0), dst.ranks_R.max(initial=0))) + 1


def _colocated_moves(src: RunPlacement, dst: RunPlacement, local: _Local) -> tuple[Move, ...]:
    """``colocated_plan``'s choice per cell: a destination copies what it holds itself, else
    takes holder ``rank % holders`` (sorted); here only for cells ``rank`` receives or sends."""
    cells, rank, width, moves = local.cells, local.rank, _width(src, dst), _Moves()
    own = local.own(dst)  # what this rank receives or copies
    if len(own.key):
        held = local.copies(src, dst)
        start, n = held.groups(own.key)
        if np.any(n == 0):
            raise LayoutError("the source placement does not hold every element of the destination")
        at, found = held.holds(own.key, np.full_like(own.key, rank), width)
        pick = np.where(found, at, start + rank % n)
        moves.add(held.rank[pick], rank, held.local_row[pick], own.local_row, cells.rows(own.key), own.key)
    if len(local.own(src).key):  # what this rank sends
        held, want = local.copies(src, src), local.copies(dst, src)
        want = want.only(want.rank != rank)
        start, n = held.groups(want.key)
        _, holds_itself = held.holds(want.key, want.rank, width)
        pick = start + want.rank % n
        send = ~holds_itself & (held.rank[pick] == rank)
        moves.add(rank, want.rank[send], held.local_row[pick][send], want.local_row[send],
                  cells.rows(want.key[send]), want.key[send])
    return moves.merged(cells)


def _even_part(rows: np.ndarray, n: np.ndarray, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of part ``i`` of ``split_even(rows, n)``."""
    size = -(-rows // n)
    lo = np.minimum(i * size, rows)
    return lo, np.minimum(lo + size, rows) - lo


class _Receivers:
    """Which destination copies receive a cell (``noncolocated_plan``): a member of a replica
    group of k > 1 ranks only its column chunk (ceil(hidden/k) columns), any other all."""

    def __init__(self, dst: RunPlacement, width: int):
        self.hidden = dst.hidden
        self.size_W, self.index_W = np.zeros(width, dtype=np.int64), np.zeros(width, dtype=np.int64)
        size_G = (dst.replica_GK >= 0).sum(axis=1)
        for g in np.flatnonzero(size_G > 1):  # later groups win, as in group_of
            members = dst.replica_GK[g, : size_G[g]]
            self.size_W[members], self.index_W[members] = size_G[g], np.arange(size_G[g])

    def chunk_cuts(self) -> np.ndarray:
        sizes = np.unique(self.size_W[self.size_W > 1])
        return np.concatenate([np.minimum(np.arange(k + 1) * -(-self.hidden // k), self.hidden) for k in sizes] + [[]]).astype(np.int64)

    def keep(self, held: _Held, cells: _Cells) -> _Held:
        size = self.size_W[held.rank]
        col, _ = cells.col_range(held.key)
        return held.only((size <= 1) | (col // -(-self.hidden // np.maximum(size, 1)) == self.index_W[held.rank]))


def _noncolocated_moves(src: RunPlacement, dst: RunPlacement, rank: int, row_cuts: np.ndarray | None,
                        whole=None) -> tuple[Move, ...]:
    """``noncolocated_plan``'s moves for the cells ``rank`` receives or sends: each receiving
    copy gets part i of ``split_even(rows, holders)`` from the i-th (sorted) source holder."""
    receivers = _Receivers(dst, _width(src, dst))
    cells, moves = _Cells(src, dst, receivers.chunk_cuts(), row_cuts, whole), _Moves()
    local = _Local(cells, rank)
    own = receivers.keep(local.own(dst), cells)  # what this rank receives
    if len(own.key):
        held = local.copies(src, dst)
        start, n = held.groups(own.key)
        e, i = expand(n)
        lo, length = _even_part(cells.rows(own.key[e]), n[e], i)
        h, ok = start[e] + i, length > 0
        moves.add(held.rank[h][ok], rank, (held.local_row[h] + lo)[ok], (own.local_row[e] + lo)[ok], length[ok], own.key[e][ok])
    if len(local.own(src).key):  # what this rank sends
        held = local.copies(src, src)
        start, n = held.groups(held.key)
        me = np.flatnonzero(held.rank == rank)
        want = receivers.keep(local.copies(dst, src), cells)
        first, count = want.groups(held.key[me])
        e, j = expand(count)
        w, m = first[e] + j, me[e]
        lo, length = _even_part(cells.rows(held.key[m]), n[m], m - start[m])
        ok = length > 0
        moves.add(rank, want.rank[w][ok], (held.local_row[m] + lo)[ok], (want.local_row[w] + lo)[ok], length[ok], held.key[m][ok])
    return moves.merged(cells)


def _rank_gathers(dst: RunPlacement, rank: int) -> tuple[FinishGather, ...]:
    """``noncolocated_plan``'s all-gathers of the replica groups that ``rank`` belongs to."""
    out = []
    for g in np.flatnonzero((dst.replica_GK == rank).any(axis=1)):
        group = dst.replicas[g]
        if len(group) > 1 and dst.local_rows_of(group[0]):
            out.append(FinishGather(group, dst.local_rows_of(group[0]), -(-dst.hidden // len(group))))
    return tuple(out)


def _is_colocated(src: RunPlacement, dst: RunPlacement) -> bool:
    """Same ranks (True) or disjoint (False); a partial overlap is an error (as ``make_plan``)."""
    if np.array_equal(src.ranks_R, dst.ranks_R):
        return True
    if not len(np.intersect1d(src.ranks_R, dst.ranks_R)):
        return False
    raise LayoutError(
        f"source ranks {src.ranks} and destination ranks {dst.ranks} partially overlap: "
        "modules must be colocated (same ranks) or on disjoint ranks"
    )


def rank_plan(src: Placement | RunPlacement, dst: Placement | RunPlacement, rank: int) -> TransferPlan:
    """``make_plan(src, dst)`` as ``rank`` needs it: the moves it sends or receives (its local
    copies included), in the plan's order, and its all-gather."""
    return rank_plans(src, dst, rank, backward=False)[0]


def rank_plans(src: Placement | RunPlacement, dst: Placement | RunPlacement, rank: int,
               backward: bool = True) -> tuple[TransferPlan, ...]:
    """``rank``'s plans forward (``src`` to ``dst``) and backward (``dst`` to ``src``): the
    cuts between cells, and for a colocated bridge the cells themselves, serve both."""
    src, dst = as_runs(src), as_runs(dst)
    _check_same_tensor(src, dst)
    # the moves are found among the pieces near the rank's own rows only (``_window``): the
    # work stays the same however many samples and ranks the microbatch has
    src_w, dst_w = _window(src, dst, rank)
    pairs = [(src, dst, src_w, dst_w), (dst, src, dst_w, src_w)][: 2 if backward else 1]
    if _is_colocated(src, dst):
        local = _Local(_Cells(src_w, dst_w, whole=(src, dst)), rank)
        return tuple(TransferPlan(a, b, _colocated_moves(a_w, b_w, local), (), colocated=True, rank=rank)
                     for a, b, a_w, b_w in pairs)
    row_cuts = _Cells(src_w, dst_w).row
    return tuple(TransferPlan(a, b, _noncolocated_moves(a_w, b_w, rank, row_cuts, (src, dst)), _rank_gathers(b, rank),
                              colocated=False, rank=rank) for a, b, a_w, b_w in pairs)


def _window(src: RunPlacement, dst: RunPlacement, rank: int) -> tuple[RunPlacement, RunPlacement]:
    """Both placements with only the pieces that touch the logical rows of ``rank``'s pieces
    (ends included: the row cuts inside those rows stay those of the whole placements). Every
    move that ``rank`` sends or receives lies in those rows, and every holder of them is there."""
    spans = rows_near(rank, src, dst)
    return (src, dst) if spans is None else tuple(_pieces_touching(pl, *spans) for pl in (src, dst))


def rows_near(rank: int, *spans: RunPlacement | tuple[int, int] | None) -> tuple[int, int] | None:
    """(first, past the last) logical row of ``rank``'s pieces in the placements given (or of
    row spans given as they are); None when there are none."""
    spans = [s.row_span(rank) if isinstance(s, RunPlacement) else s for s in spans]
    spans = [s for s in spans if s is not None]
    return (min(lo for lo, _ in spans), max(hi for _, hi in spans)) if spans else None


def _pieces_touching(pl: RunPlacement, lo: int, hi: int) -> RunPlacement:
    keep = (pl.row_P <= hi) & (pl.row_P + pl.rows_P >= lo)
    columns = ("rank_P", "row_P", "rows_P", "local_row_P", "col_P", "cols_P")
    return dataclasses.replace(pl, **{c: getattr(pl, c)[keep] for c in columns})


# ---------------------------------------------------------------------------
# A microbatch's image bridge, as training builds it
# ---------------------------------------------------------------------------
def image_bridge_plans(tokens_N: np.ndarray, images_N: np.ndarray, image_start_I: np.ndarray, image_rows_I: np.ndarray,
                       width: int, encoder_grid: ParallelGrid, encoder_blocks: Sequence[range], llm_grid: ParallelGrid,
                       llm_blocks: Sequence[range], sequence_parallel: bool, rank: int
                       ) -> tuple[RunPlacement, RunPlacement, tuple[TransferPlan, TransferPlan]]:
    """One encoder's bridge on ``rank`` for a microbatch: sample i is ``tokens_N[i]`` positions
    long and holds ``images_N[i]`` images; image j (sample after sample) starts at position
    ``image_start_I[j]`` of its sample and has ``image_rows_I[j]`` rows (consecutive positions),
    each row ``width`` values (a native tower's ``hidden * (1 + deepstack levels)``). Returns the
    encoder's rows (its DP blocks ``encoder_blocks``, replicated over its TP), the LLM first
    stage's declared placement of them (``LLMStage.image_placement``: DP blocks ``llm_blocks``
    packed, CP order, sequence shards with ``sequence_parallel``) and this rank's plans both ways
    (``rank_plans``: what ``Bridge(..., plans=...)`` runs).

    The LLM's placement holds only the pieces of the LLM DP blocks that hold some of this
    rank's rows (its encoder block's, its LLM block's; ``packed_runs``' ``rows``): every move of
    its plans lies there and its own pieces and local rows are all there, so the work follows
    its share, not the world. Other ranks hold nothing in it: it serves this rank's bridge only."""
    runs = SampleRuns.of_image_arrays(tokens_N, images_N, image_start_I, image_rows_I)
    src = dp_runs(encoder_grid, runs.rows_N, encoder_blocks, width)
    rows = rows_near(rank, src, packed_rows_of(llm_grid, runs, llm_blocks, rank))
    dst = packed_runs(llm_grid, runs, llm_blocks, width, sequence_parallel, rows or (0, 0))
    return src, dst, rank_plans(src, dst, rank)
