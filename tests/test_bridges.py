"""Bridges: plans, the independent minimum, and colocated / non-colocated execution against the
one-process reference (bit-exact forward, and the gradient on every source replica)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mimo.bridges.executor import Bridge
from mimo.bridges.plan_reference import make_plan, minimum_numel
from mimo.bridges.verify import bridge_case, local_view, parse_layout, resolve, summarise
from mimo.core.errors import LayoutError
from mimo.parallel.grid import ParallelGrid
from mimo.parallel.layout import Piece, Placement, dp_blocks
from mimo.parallel.layout_reference import dp_placement

# (src, dst, colocated); every case runs ragged, with zero-row samples, over 3 microbatches
COLOCATED = [
    ("tp=1,dp=4", "tp=2,dp=2"),
    ("tp=2,dp=2", "tp=1,dp=4"),
    ("tp=4,dp=1", "tp=1,dp=4"),
    ("tp=1,dp=4", "tp=2,dp=2,shard=seq"),
    ("tp=1,dp=4", "tp=2,dp=2,shard=hidden"),
    ("tp=2,dp=2,shard=hidden", "tp=4,dp=1,shard=seq"),
    ("tp=2,dp=3", "tp=3,dp=2"),
    ("tp=3,dp=2", "tp=2,dp=3"),
    ("tp=2,dp=3", "tp=3,dp=2,shard=seq"),
    ("tp=3,dp=2,shard=seq", "tp=2,dp=3,shard=hidden"),
    ("tp=2,dp=4", "tp=4,cp=2,dp=1"),
    ("tp=2,dp=4", "tp=4,cp=2,dp=1,shard=seq"),
    ("tp=2,dp=4", "tp=2,cp=2,dp=2"),
    ("tp=2,dp=4", "tp=2,cp=2,dp=2,shard=seq"),
    ("tp=1,dp=4", "tp=1,dp=2,pp=2"),
    ("tp=2,dp=4", "tp=2,dp=2,pp=2,shard=seq"),
    ("tp=1,dp=8", "tp=2,cp=2,dp=1,pp=2,shard=seq"),
]
NONCOLOCATED = [
    ("tp=1,dp=3", "tp=2,dp=2"),
    ("tp=1,dp=3", "tp=2,dp=2,shard=seq"),
    ("tp=1,dp=3", "tp=2,dp=2,shard=hidden"),
    ("tp=2,dp=1", "tp=1,dp=4"),
    ("tp=2,dp=1,shard=hidden", "tp=1,dp=4"),
    ("tp=2,dp=1,shard=seq", "tp=1,dp=4"),
    ("tp=1,dp=1", "tp=2,dp=2"),
    ("tp=1,dp=1", "tp=2,dp=2,shard=seq"),
    ("tp=1,dp=1", "tp=4,dp=1"),
    ("tp=3,dp=1", "tp=2,cp=2,dp=1"),
    ("tp=2,dp=1", "tp=2,cp=2,dp=1,shard=seq"),
    ("tp=1,dp=2", "tp=2,dp=1,pp=2,shard=hidden"),
    ("tp=2,dp=1", "tp=1,dp=2,pp=2"),
]


def _run(pools, src, dst, colocated, hidden, ragged=True, microbatches=3, seed=0):
    report = summarise(pools(8).run(bridge_case, src, dst, colocated, hidden, microbatches, ragged, seed))
    assert report["fwd_max_abs_err"] == 0.0, report
    assert report["grad_max_abs_err"] == 0.0, report
    assert report["bytes_ratio"] == 1.0, report
    assert report["ok"], report
    # in the layouts training runs, the bridge is training's own, checked against the reference builders
    training_layout = "shard=" not in src and "shard=hidden" not in dst
    assert ("placement_problem_count" in report) == training_layout, report
    assert report.get("placement_problem_count", 0) == 0, report["placement_problems"]
    return report


@pytest.mark.parametrize("src,dst", COLOCATED, ids=[f"{s}->{d}" for s, d in COLOCATED])
def test_colocated_bit_exact(pools, src, dst):
    report = _run(pools, src, dst, True, hidden=10)
    assert report["allgather_bytes"] == 0


@pytest.mark.parametrize("src,dst", NONCOLOCATED, ids=[f"{s}->{d}" for s, d in NONCOLOCATED])
@pytest.mark.parametrize("hidden", [8, 10])
def test_noncolocated_bit_exact(pools, src, dst, hidden):
    _run(pools, src, dst, False, hidden=hidden)


def test_uniform_rows_and_same_layout(pools):
    _run(pools, "tp=2,dp=2", "tp=2,dp=2", True, hidden=6, ragged=False)
    # one DP rank with the same column split on both ends: nothing moves, either way
    report = _run(pools, "tp=2,dp=1,shard=hidden,ranks=0:2", "tp=2,dp=1,shard=hidden,ranks=0:2", True, hidden=6)
    assert report["bytes_sent"] == report["bytes_min"] == 0


# ---- a gradient-scale bug must not hide: TP computation upstream and downstream --------------
def _tp_chain(src_tp: int, dst_tp: int, seed: int):
    """Source: rows = (A @ W) replicated over the source TP group (W split by columns, summed
    by an all-reduce whose backward is the identity). Destination: loss = sum(Y * C). The
    gradient of W must equal the one-process d/dW sum((A@W) * C) on every source replica."""
    from mimo.parallel import reduce_from_group

    rank, world = dist.get_rank(), dist.get_world_size()
    sg = ParallelGrid({"tp": src_tp, "dp": 1})
    dg = ParallelGrid({"tp": dst_tp, "dp": 1}, offset=src_tp)
    s_tp, d_tp = sg.group("tp"), dg.group("tp")
    members = ParallelGrid({"b": src_tp + dst_tp}).group("b")
    g = torch.Generator().manual_seed(seed)
    rows, inner, hidden = 7, 6, 5
    A, W, C = (torch.randn(*s, generator=g) for s in ((rows, inner * src_tp), (inner * src_tp, hidden), (rows, hidden)))
    src_pl = dp_placement(sg, [rows], [range(0, 1)], hidden)
    dst_pl = dp_placement(dg, [rows], [range(0, 1)], hidden)
    if rank >= src_tp + dst_tp:
        return None
    bridge = Bridge(src_pl, dst_pl, members, s_tp if rank < src_tp else None, d_tp if rank >= src_tp else None)
    if bridge.is_src:
        t = rank
        w = W[t * inner : (t + 1) * inner].clone().requires_grad_()
        x = reduce_from_group(A[:, t * inner : (t + 1) * inner] @ w, s_tp)
        Bridge.backward_source(bridge(x))
        want = A[:, t * inner : (t + 1) * inner].T @ C  # one-process gradient of this slice of W
        return (w.grad - want).abs().max().item() / want.abs().max().item()
    y = bridge(None)
    (y * C).sum().backward()
    return 0.0


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (2, 3), (1, 2)])
def test_gradient_scale_through_tp_on_both_sides(pools, src_tp, dst_tp):
    errs = [e for e in pools(8).run(_tp_chain, src_tp, dst_tp, 3) if e is not None]
    assert max(errs) < 1e-6, errs


# ---- the independent minimum, by hand ---------------------------------------------------------
def test_minimum_matches_hand_counts():
    full = lambda rank, row, rows, local=0: Piece(rank, row, rows, local, 0, 4)  # noqa: E731
    src = Placement(4, 4, (full(0, 0, 3), full(1, 3, 1)), {0: 3, 1: 1})
    dst = Placement(4, 4, (full(0, 0, 4), full(1, 0, 4)), {0: 4, 1: 4}, replicas=((0, 1),))
    # rank 0 lacks row 3 (4 elements), rank 1 lacks rows 0-2 (12)
    assert minimum_numel(src, dst) == {"cross": 16, "allgather": 0}
    # back: every rank already holds what it needs
    assert minimum_numel(dst, src) == {"cross": 0, "allgather": 0}
    # non-colocated: logical size crosses once; the replica pair all-gathers 2 columns each way
    far = Placement(4, 4, (full(2, 0, 4), full(3, 0, 4)), {2: 4, 3: 4}, replicas=((2, 3),))
    assert minimum_numel(src, far) == {"cross": 16, "allgather": 2 * 1 * 2 * 4}
    # hidden-sharded destination on the same ranks: columns 2..3 of rows 0-2 must reach rank 1
    half = Placement(4, 4, (Piece(0, 0, 4, 0, 0, 2), Piece(1, 0, 4, 0, 2, 2)), {0: 4, 1: 4})
    assert minimum_numel(src, half) == {"cross": 2 * 1 + 2 * 3, "allgather": 0}
    plan = make_plan(src, half)
    assert plan.sent_numel() == 8


def test_plans_reject_partial_overlap_and_mismatched_tensors():
    a = Placement(2, 2, (Piece(0, 0, 2, 0, 0, 2),), {0: 2})
    b = Placement(2, 2, (Piece(0, 0, 1, 0, 0, 2), Piece(1, 1, 1, 0, 0, 2)), {0: 1, 1: 1})
    with pytest.raises(LayoutError, match="partially overlap"):
        make_plan(a, b)
    with pytest.raises(LayoutError, match="different tensors"):
        make_plan(a, Placement(3, 2, (Piece(0, 0, 3, 0, 0, 2),), {0: 3}))


def test_layout_parsing_errors():
    with pytest.raises(LayoutError, match="encoder"):
        resolve(parse_layout("pp=2"), parse_layout("dp=2"), 4, True)
    assert parse_layout("tp=2,dp=2,cp=2,shard=seq").cp == 2
    for bad, match in [("tp=0", "positive"), ("tp=2,zz=1", "unknown layout key"), ("shard=rows", "hidden, seq"),
                       ("tp=2,ranks=0:3", "ranks"), ("cp=2,shard=hidden", "shard=hidden")]:
        with pytest.raises(LayoutError, match=match):
            parse_layout(bad)


def test_local_view_roundtrip():
    grid = ParallelGrid({"tp": 2, "dp": 2})
    rows = [3, 0, 2]
    pl = dp_placement(grid, rows, dp_blocks(rows, 2), 4, "hidden")
    X = torch.randn(5, 4)
    rebuilt = torch.zeros(5, 4)
    for r in pl.ranks:
        for p in pl.pieces_of(r):
            rebuilt[p.row : p.row + p.rows, p.col : p.col + p.cols] = local_view(X, pl, r)[p.local_row : p.local_row + p.rows, p.col - pl.columns_of(r).start :][:, : p.cols]
    assert torch.equal(rebuilt, X)


# ---- the command line --------------------------------------------------------------------------
def test_cli_verify_bridge_ok_and_impossible_layouts(pools, mimo_here, lend_pools):
    """``mimo verify-bridge``, its command line in this process (``mimo_here``), its ranks this
    module's 8-rank pool (``lend_pools``: ``--world 8``, the layouts leaving ranks idle as the
    cases above do), not 8 fresh processes per check."""
    import json

    def _cli(*args):
        proc = mimo_here("verify-bridge", *args)
        return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout + proc.stderr

    with lend_pools(pools):
        code, report, out = _cli("--world", "8", "--src", "tp=1,dp=1", "--dst", "tp=2,dp=2,shard=seq", "--non-colocated", "--hidden", "7")
        assert code == 0 and report["ok"] and report["bytes_ratio"] == 1.0, out
        assert set(report) >= {"fwd_max_abs_err", "grad_max_abs_err", "bytes_sent", "bytes_min", "allgather_bytes", "bytes_ratio", "ok"}
        assert report["fwd_max_abs_err"] == report["grad_max_abs_err"] == 0.0 and report["bytes_sent"] > 0, out
        code, report, out = _cli("--world", "8", "--src", "tp=2,dp=3", "--dst", "tp=3,dp=2", "--colocated", "--rows", "uniform",
                                 "--microbatches", "2")
        assert code == 0 and report["ok"], out
    code, report, out = _cli("--world", "4", "--src", "tp=2,dp=2", "--dst", "tp=3,dp=1", "--colocated")
    assert code == 2 and not report["ok"] and "same rank count" in report["errors"][0] and "Traceback" not in out
