"""The reference transfer planner: ``make_plan`` builds the whole plan of a pair of placements
cell by cell (every rank's moves and all-gathers), and ``minimum_numel`` counts, from the
placements alone, what any plan must move. Test oracles and what ``mimo verify-bridge`` checks
training's plans (``mimo.bridges.plan.rank_plans``) against; never on the training path."""

from __future__ import annotations

import bisect
from collections import defaultdict

from mimo.bridges.plan import FinishGather, Move, TransferPlan, _check_same_tensor, _cuts
from mimo.core.errors import LayoutError
from mimo.parallel.layout import Placement, split_even


def _elementary(placement_a: Placement, placement_b: Placement):
    """Row and column cut points common to both placements."""
    rows = _cuts([0, placement_a.rows] + [p.row for pl in (placement_a, placement_b) for p in pl.pieces]
                 + [p.row + p.rows for pl in (placement_a, placement_b) for p in pl.pieces])
    cols = _cuts([0, placement_a.hidden] + [p.col for pl in (placement_a, placement_b) for p in pl.pieces]
                 + [p.col + p.cols for pl in (placement_a, placement_b) for p in pl.pieces])
    return rows, cols


class _Holders:
    """Which (rank, local row) hold a row range x column range, by elementary cell."""

    def __init__(self, placement: Placement, row_cuts: list[int], col_cuts: list[int]):
        self.cells: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        for p in placement.pieces:
            if not p.rows or not p.cols:
                continue
            r0, r1 = bisect.bisect_left(row_cuts, p.row), bisect.bisect_left(row_cuts, p.row + p.rows)
            c0, c1 = bisect.bisect_left(col_cuts, p.col), bisect.bisect_left(col_cuts, p.col + p.cols)
            for ri in range(r0, r1):
                for ci in range(c0, c1):
                    self.cells[(ri, ci)].append((p.rank, p.local_row + row_cuts[ri] - p.row))


def _merge(moves: list[Move]) -> tuple[Move, ...]:
    """Join moves that continue each other (same ranks, columns, consecutive rows)."""
    out: list[Move] = []
    for m in sorted(moves, key=lambda m: (m.src, m.dst, m.col, m.cols, m.dst_row)):
        last = out[-1] if out else None
        if (last and (last.src, last.dst, last.col, last.cols) == (m.src, m.dst, m.col, m.cols)
                and last.src_row + last.rows == m.src_row and last.dst_row + last.rows == m.dst_row):
            out[-1] = Move(m.src, m.dst, last.src_row, last.dst_row, last.rows + m.rows, m.col, m.cols)
        else:
            out.append(m)
    return tuple(out)


def colocated_plan(src: Placement, dst: Placement) -> TransferPlan:
    _check_same_tensor(src, dst)
    if set(src.local_rows) != set(dst.local_rows):
        raise LayoutError("a colocated transfer needs the same ranks on both sides")
    row_cuts, col_cuts = _elementary(src, dst)
    src_cells = _Holders(src, row_cuts, col_cuts).cells
    moves = []
    for (ri, ci), dst_holders in _Holders(dst, row_cuts, col_cuts).cells.items():
        rows, col, cols = row_cuts[ri + 1] - row_cuts[ri], col_cuts[ci], col_cuts[ci + 1] - col_cuts[ci]
        holders = sorted(src_cells[(ri, ci)])
        for d, d_row in dst_holders:
            own = [h for h in holders if h[0] == d]
            s, s_row = own[0] if own else holders[d % len(holders)]
            moves.append(Move(s, d, s_row, d_row, rows, col, cols))
    return TransferPlan(src, dst, _merge(moves), (), colocated=True)


def noncolocated_plan(src: Placement, dst: Placement) -> TransferPlan:
    _check_same_tensor(src, dst)
    if set(src.local_rows) & set(dst.local_rows):
        raise LayoutError("a non-colocated transfer needs disjoint source and destination ranks")
    groups = [g for g in dst.replicas if len(g) > 1]
    group_of = {r: g for g in groups for r in g}
    chunk_of = {g: -(-dst.hidden // len(g)) for g in groups}
    # Column cuts include each replica group's chunk boundaries, so every elementary cell
    # lies inside one chunk.
    extra_cols = [min(i * chunk_of[g], dst.hidden) for g in groups for i in range(len(g) + 1)]
    row_cuts, col_cuts = _elementary(src, dst)
    col_cuts = _cuts(col_cuts + extra_cols)
    src_cells = _Holders(src, row_cuts, col_cuts).cells
    moves = []
    for (ri, ci), dst_holders in _Holders(dst, row_cuts, col_cuts).cells.items():
        r0, rows = row_cuts[ri], row_cuts[ri + 1] - row_cuts[ri]
        col, cols = col_cuts[ci], col_cuts[ci + 1] - col_cuts[ci]
        holders = sorted(src_cells[(ri, ci)])
        receivers = []
        for d, d_row in dst_holders:
            g = group_of.get(d)
            if g is None or col // chunk_of[g] == g.index(d):  # this replica's column chunk
                receivers.append((d, d_row))
        for d, d_row in receivers:
            for (s, s_row), part in zip(holders, split_even(rows, len(holders))):
                if len(part):
                    moves.append(Move(s, d, s_row + part.start, d_row + part.start, len(part), col, cols))
    gathers = tuple(FinishGather(g, dst.local_rows[g[0]], chunk_of[g]) for g in groups if dst.local_rows[g[0]])
    return TransferPlan(src, dst, _merge(moves), gathers, colocated=False)


def make_plan(src: Placement, dst: Placement) -> TransferPlan:
    """Colocated when both sides are the same ranks, non-colocated when disjoint."""
    s, d = set(src.local_rows), set(dst.local_rows)
    if s == d:
        return colocated_plan(src, dst)
    if not s & d:
        return noncolocated_plan(src, dst)
    raise LayoutError(
        f"source ranks {sorted(s)} and destination ranks {sorted(d)} partially overlap: "
        "modules must be colocated (same ranks) or on disjoint ranks"
    )


# ---------------------------------------------------------------------------
# The independent minimum (computed from the placements alone, not from a plan)
# ---------------------------------------------------------------------------
def _covered(pieces, r0: int, r1: int, c0: int, c1: int) -> bool:
    return any(p.row <= r0 and r1 <= p.row + p.rows and p.col <= c0 and c1 <= p.col + p.cols for p in pieces)


def _lacking_numel(have: list, want: list) -> int:
    """Elements inside the pieces ``want`` and outside the pieces ``have`` (one rank)."""
    rows = _cuts([x for p in have + want for x in (p.row, p.row + p.rows)])
    cols = _cuts([x for p in have + want for x in (p.col, p.col + p.cols)])
    return sum(
        (r1 - r0) * (c1 - c0)
        for r0, r1 in zip(rows, rows[1:])
        for c0, c1 in zip(cols, cols[1:])
        if _covered(want, r0, r1, c0, c1) and not _covered(have, r0, r1, c0, c1)
    )


def minimum_numel(src: Placement, dst: Placement) -> dict[str, int]:
    """Least elements any executor must move from ``src`` to ``dst``.

    Colocated: what each destination rank needs and does not already hold.
    Non-colocated: the logical size (every element crosses once); the finishing
    all-gather inside destination replica groups is reported beside it.
    """
    _check_same_tensor(src, dst)
    if set(src.local_rows) == set(dst.local_rows):
        need = sum(_lacking_numel(src.pieces_of(r), dst.pieces_of(r)) for r in dst.ranks)
        return {"cross": need, "allgather": 0}
    allgather = 0
    for g in dst.replicas:
        if len(g) > 1:
            # each member receives the other members' even-sized column chunks of its rows
            chunk = -(-dst.hidden // len(g))
            allgather += len(g) * (len(g) - 1) * chunk * dst.local_rows[g[0]]
    return {"cross": src.rows * src.hidden, "allgather": allgather}
