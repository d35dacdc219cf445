"""ParallelGrid rank arithmetic and process groups, checked against Megatron's tp-cp-ep-dp-pp order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mimo.core.errors import LayoutError
from mimo.parallel.grid import ParallelConfig, ParallelGrid, parse_rank_range

MEGATRON_ORDER = ("tp", "cp", "ep", "dp", "pp")


def megatron_groups(sizes: dict[str, int], group_dims: tuple[str, ...], offset: int) -> list[list[int]]:
    """Groups as Megatron's rank generator lays them out: ranks numbered with tp fastest, then
    cp, ep, dp, pp; a group over several dims varies the first-listed dim fastest."""
    order = [d for d in MEGATRON_ORDER if d in sizes]
    arr = np.arange(int(np.prod([sizes[d] for d in order]))).reshape([sizes[d] for d in reversed(order)])
    axes = {d: len(order) - 1 - i for i, d in enumerate(order)}
    moved = np.moveaxis(arr, [axes[d] for d in reversed(group_dims)], range(-len(group_dims), 0))
    size = int(np.prod([sizes[d] for d in group_dims]))
    return sorted((g + offset).tolist() for g in moved.reshape(-1, size))


@pytest.mark.parametrize(
    "sizes",
    [{"tp": 2, "dp": 3}, {"tp": 2, "cp": 2, "dp": 2}, {"tp": 3, "dp": 2, "pp": 2}, {"tp": 1, "cp": 3, "dp": 1, "pp": 2}],
)
def test_partitions_match_megatron_order(sizes):
    grid = ParallelGrid(sizes, offset=4)
    dims = list(sizes)
    combos = [(d,) for d in dims] + [(a, b) for i, a in enumerate(dims) for b in dims[i + 1 :]] + [tuple(dims)]
    for group_dims in combos:
        assert grid.partition(group_dims) == megatron_groups(sizes, group_dims, 4), group_dims


def test_coordinates_roundtrip_and_membership():
    grid = ParallelGrid({"tp": 3, "dp": 2, "pp": 2}, offset=2)
    assert list(grid.ranks) == list(range(2, 14))
    for r in grid.ranks:
        assert grid.rank_at(**grid.coords(r)) == r
    assert grid.coords(2 + 1 + 3 + 6) == {"tp": 1, "dp": 1, "pp": 1}
    assert grid.coord(2 + 2 + 3, ("tp", "dp")) == 2 + 3  # tp fastest inside the (tp, dp) group
    assert 1 not in grid and 14 not in grid
    with pytest.raises(LayoutError, match="not in"):
        grid.coords(14)
    with pytest.raises(LayoutError, match="unknown grid dim 'ep'"):
        grid.partition("ep")


def test_spec_example_world8_attention_and_expert_views():
    grid = ParallelGrid({"tp": 2, "cp": 1, "dp": 4, "pp": 1})
    assert grid.partition("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.partition("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    ev = grid.expert_view(etp=1, ep=4)
    assert ev.shape == {"etp": 1, "ep": 4, "edp": 2, "pp": 1}
    assert ev.partition("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ev.partition("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert ev.partition("pp") == grid.partition("pp")


def test_expert_view_with_pipeline_shares_pp_groups():
    grid = ParallelGrid({"tp": 2, "cp": 1, "dp": 2, "pp": 2})
    ev = grid.expert_view(etp=2, ep=2)
    assert ev.partition("pp") == grid.partition("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert ev.partition("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(LayoutError, match="does not divide"):
        grid.expert_view(etp=1, ep=3)


def test_parallel_config_and_rank_ranges():
    assert parse_rank_range("4:8") == range(4, 8)
    assert parse_rank_range("3") == range(3, 4)
    for bad in ("x", "5:5", "-1:2"):
        with pytest.raises(LayoutError):
            parse_rank_range(bad)
    g = ParallelConfig(tp=2, dp=2, ranks="4:8").grid(8)
    assert g.offset == 4 and g.size == 4


# ---- real process groups -------------------------------------------------------------------
def _group_members():
    """Every rank builds the same grids and asks for groups; members report what they got."""
    rank = dist.get_rank()
    grid = ParallelGrid({"tp": 2, "cp": 1, "dp": 4, "pp": 1})
    ev = grid.expert_view(etp=1, ep=4)
    small = ParallelGrid({"tp": 3}, offset=4)  # ranks 4..6 only; all ranks create its groups
    out = {}
    for name, g, dims in [("tp", grid, "tp"), ("dp", grid, "dp"), ("ep", ev, "ep"), ("edp", ev, "edp"), ("small_tp", small, "tp")]:
        pg = g.group(dims)
        if pg is None:
            out[name] = None
            continue
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=pg)
        out[name] = (sorted(dist.get_process_group_ranks(pg)), x.item())
    out["pp_same_object"] = grid.group("pp") is None and ev.group("pp") is None
    out["cached"] = grid.group("tp") is grid.group("tp")
    return out


def _pp_groups_shared():
    grid = ParallelGrid({"tp": 1, "cp": 1, "dp": 2, "pp": 2})
    ev = grid.expert_view(etp=1, ep=2)
    return grid.group("pp") is ev.group("pp") and grid.group("pp") is not None


def test_groups_on_eight_ranks(pools):
    results = pools(8).run(_group_members)
    for rank, out in enumerate(results):
        tp = [rank - rank % 2, rank - rank % 2 + 1]
        assert out["tp"] == (tp, float(sum(tp)))
        dp = [rank % 2 + 2 * i for i in range(4)]
        assert out["dp"] == (dp, float(sum(dp)))
        ep = [0, 1, 2, 3] if rank < 4 else [4, 5, 6, 7]
        assert out["ep"] == (ep, float(sum(ep)))
        edp = [rank % 4, rank % 4 + 4]
        assert out["edp"] == (edp, float(sum(edp)))
        assert out["small_tp"] == (([4, 5, 6], 15.0) if 4 <= rank < 7 else None)
        assert out["pp_same_object"] and out["cached"]


def test_pp_groups_are_the_same_objects_in_the_expert_view(pools):
    assert all(pools(4).run(_pp_groups_shared))
