"""``mimo verify-bridge --rows native`` (issue 46, issue 47 item 3): images of their own grids (rows
h*w/4 each), rows ``hidden * (1 + deepstack levels)`` wide, and the bridge that training builds
(``mimo.bridges.plan.image_bridge_plans``, its rank plans handed to ``Bridge``) checked against the
reference builders' placements and ``make_plan``'s moves, then moved bit-exactly both ways at the
minimum volume.

The pool cases run on the suite's shared 5-rank pool; the placement checks and their mutations run
in this process (planning is numpy, no ranks needed); one run goes through the command line.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

import mimo.bridges.plan as plan_mod
from mimo.bridges.verify import (LayoutSpec, bridge_case, native_blocks, native_placements, native_samples,
                                 placement_problems, production_plans, resolve, summarise)
from mimo.parallel.layout import SampleRuns

# (encoder, LLM, colocated, levels, dtype): every case native, 3 microbatches of 1..9 samples
CASES = [
    ("tp=1,dp=4", "tp=2,dp=2", True, 1, "fp32"),
    ("tp=1,dp=2", "tp=2,dp=1,shard=seq", True, 1, "bf16"),  # encoder dp 2 -> LLM tp 2, sequence parallel
    ("tp=1,dp=2", "tp=2,dp=1,shard=seq", False, 2, "fp32"),
    ("tp=1,dp=3", "tp=1,dp=2", False, 1, "fp32"),  # the DP ratio changes: 3 encoder blocks -> 2 LLM blocks
    ("tp=2,dp=1", "tp=1,dp=3", False, 3, "bf16"),  # encoder TP replicas share the sends
    ("tp=1,dp=4", "tp=2,cp=2,dp=1", True, 1, "fp32"),  # CP on the LLM: rows cut at chunk ends
    ("tp=1,dp=1", "tp=2,cp=2,dp=1,shard=seq", False, 1, "bf16"),
    ("tp=2,dp=2", "tp=1,dp=2,pp=2", True, 0, "fp32"),  # no deepstack; the LLM's later stage holds nothing
]
WORLD = 5


@pytest.mark.parametrize("src,dst,colocated,levels,dtype", CASES, ids=[f"{s}->{d}-{'co' if c else 'non'}-L{lv}-{dt}" for s, d, c, lv, dt in CASES])
def test_production_bridge_is_bit_exact_at_the_minimum(pools, src, dst, colocated, levels, dtype):
    hidden = 5  # odd: the replica groups' column chunks of hidden * (1 + levels) come uneven
    report = summarise(pools(WORLD).run(bridge_case, src, dst, colocated, hidden, 3, "native", 7, "cpu", dtype, levels),
                       itemsize=2 if dtype == "bf16" else 4)
    assert report["placement_problem_count"] == 0, report["placement_problems"]
    assert report["fwd_max_abs_err"] == 0.0 and report["grad_max_abs_err"] == 0.0, report
    assert report["bytes_ratio"] == 1.0 and report["bytes_sent"] > 0, report
    assert report["allgather_bytes"] == report["allgather_min_bytes"], report
    assert report["ok"] and report["width"] == hidden * (1 + levels) and report["images"] > 0, report


# ---- the samples ------------------------------------------------------------------------------------
def test_native_samples_have_grids_of_their_own():
    rng, rows, counts = random.Random(0), [], set()
    for _ in range(60):
        for s in native_samples(rng, 9):
            counts.add(len(s.image_starts))
            assert all(t == 1 and h % 2 == 0 and w % 2 == 0 for t, h, w in s.image_grids), s
            assert s.image_rows == tuple(h * w // 4 for _, h, w in s.image_grids)
            spans = [(a, a + r) for a, r in zip(s.image_starts, s.image_rows)]
            assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:])) and (not spans or spans[-1][1] < s.seq_len), s
            assert len(s.image_positions) == sum(s.image_rows) == len(set(s.image_positions))
            rows += s.image_rows
    assert counts == {0, 1, 2, 3} and min(rows) == 1 and max(rows) == 40 and rows.count(1) > 20
    assert len(set(rows)) > 20  # many sizes, not a few


# ---- the production placements against the reference, in this process -------------------------------
def _layouts(rng: random.Random) -> tuple[LayoutSpec, LayoutSpec, bool]:
    """A random encoder (rows replicated over its TP) and LLM layout (TP replicated or sequence
    parallel, CP, pipeline stages), colocated or on ranks after the encoder's."""
    dst = LayoutSpec(tp=rng.choice([1, 2, 3]), cp=rng.choice([1, 2]), dp=rng.choice([1, 2, 3]), pp=rng.choice([1, 1, 2]),
                     shard=rng.choice([None, "seq"]))
    if rng.random() < 0.5:
        tp = rng.choice([t for t in (1, 2, 3, 4) if dst.size % t == 0])
        return LayoutSpec(tp=tp, dp=dst.size // tp), dst, True
    return LayoutSpec(tp=rng.choice([1, 2]), dp=rng.choice([1, 2, 3, 5])), dst, False


def _problems(seed: int) -> list[str]:
    """Every rank's ``placement_problems`` for one random microbatch and layout."""
    rng = random.Random(seed)
    src, dst, colocated = _layouts(rng)
    sg, dg = resolve(src, dst, src.size + dst.size, colocated)
    samples = native_samples(rng, rng.randint(1, 9))
    width = rng.choice([3, 5, 8]) * (1 + rng.choice([0, 1, 3]))
    blocks = native_blocks(src, dst, samples)
    src_pl, dst_pl = native_placements(dst, sg, dg, samples, width, blocks)
    out = []
    for rank in sorted(set(sg.ranks) | set(dg.ranks)):
        try:
            out += placement_problems(*production_plans(dst, sg, dg, samples, width, blocks, rank), src_pl, dst_pl, rank)
        except Exception as e:  # noqa: BLE001 - a broken production path may raise anything: a problem too
            out.append(f"rank {rank}: {type(e).__name__}: {e}")
    return out


def _all_problems(seeds=range(120)) -> list[str]:
    return [p for seed in seeds for p in _problems(seed)]


def test_production_placements_equal_the_reference_ones():
    """120 random microbatches and layouts: every rank's encoder placement, its view of the LLM's,
    its plans both ways are the reference builders' and ``make_plan``'s."""
    assert _all_problems() == []


def test_training_wrapper_is_the_bridges_function():
    """``mimo.data.pipeline.microbatch_bridge_plans`` unpacks ``SampleArrays`` (a native
    placeholder's own rows per image) into the bridges' function: the same placements and plans."""
    from mimo.data.plan import SampleArrays
    from mimo.data.pipeline import microbatch_bridge_plans as image_bridge_plans

    rng = random.Random(4)
    for _ in range(10):
        src, dst, colocated = _layouts(rng)
        sg, dg = resolve(src, dst, src.size + dst.size, colocated)
        samples = native_samples(rng, rng.randint(1, 9))
        blocks = native_blocks(src, dst, samples)
        arrays = SampleArrays(np.array([s.seq_len for s in samples]), {"<img>": np.array([len(s.image_starts) for s in samples])},
                              {"<img>": np.array([p for s in samples for p in s.image_starts], dtype=np.int64)},
                              {"<img>": np.array([r for s in samples for r in s.image_rows], dtype=np.int64)})
        for rank in sorted(set(sg.ranks) | set(dg.ranks)):
            a = image_bridge_plans(arrays, "<img>", 0, 12, sg, blocks[0], dg, blocks[1], dst.shard == "seq", rank)
            b = production_plans(dst, sg, dg, samples, 12, blocks, rank)
            assert a[0].to_placement() == b[0].to_placement() and a[1].pieces_of(rank) == b[1].pieces_of(rank)
            assert [(p.moves, p.gathers) for p in a[2]] == [(p.moves, p.gathers) for p in b[2]]


_OF_IMAGE_ARRAYS = SampleRuns.of_image_arrays.__func__
_DP_RUNS, _PACKED_RUNS = plan_mod.dp_runs, plan_mod.packed_runs


def _first_image_rows(cls, seq_len_N, images_N, start_U, rows_I):
    rows_I = np.asarray(rows_I)
    return _OF_IMAGE_ARRAYS(cls, seq_len_N, images_N, start_U, np.full_like(rows_I, rows_I[0]) if len(rows_I) else rows_I)


MUTATIONS = {  # a production step broken at a time: the check above must notice
    "every image given the first image's rows": (SampleRuns, "of_image_arrays", classmethod(_first_image_rows)),
    "deepstack columns dropped by the encoder": (plan_mod, "dp_runs", lambda g, rows, blocks, width, *a: _DP_RUNS(g, rows, blocks, width // 2 or 1, *a)),
    "deepstack columns dropped by the LLM": (plan_mod, "packed_runs", lambda g, runs, blocks, width, *a: _PACKED_RUNS(g, runs, blocks, width // 2 or 1, *a)),
    "sequence parallelism ignored": (plan_mod, "packed_runs", lambda g, runs, blocks, width, sp, rows: _PACKED_RUNS(g, runs, blocks, width, False, rows)),
    "the LLM placement built near no rows": (plan_mod, "packed_rows_of", lambda *a: None),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_placement_mutations_are_caught(monkeypatch, name):
    owner, attr, broken = MUTATIONS[name]
    monkeypatch.setattr(owner, attr, broken)
    assert _all_problems(range(40)), name


# ---- the command line ----------------------------------------------------------------------------
def test_cli_verify_bridge_native(capfd):
    """``mimo verify-bridge --rows native`` in this process (its ranks fresh processes), and its
    refusals of layouts and options that native rows do not take (before any process starts)."""
    from mimo.commands.cli import main

    def _cli(*args):
        capfd.readouterr()
        code = main(["verify-bridge", *args])
        out, err = capfd.readouterr()
        return code, json.loads(out.strip().splitlines()[-1]), out + err

    code, report, out = _cli("--world", "2", "--src", "tp=1,dp=2", "--dst", "tp=2,dp=1,shard=seq", "--colocated", "--rows", "native",
                             "--levels", "2", "--hidden", "6", "--dtype", "bf16", "--microbatches", "2")
    assert code == 0 and report["ok"] and report["bytes_ratio"] == 1.0, out
    assert (report["rows"], report["levels"], report["width"], report["placement_problem_count"]) == ("native", 2, 18, 0), report
    assert "native rows, 2 deepstack levels: width 18" in out
    for args, match in ((("--src", "tp=2,dp=1,shard=seq", "--dst", "tp=2,dp=1", "--rows", "native"), "replicated over its TP"),
                        (("--src", "tp=1,dp=2", "--dst", "tp=2,dp=1,shard=hidden", "--rows", "native"), "shard=hidden"),
                        (("--src", "tp=1,dp=2", "--dst", "tp=2,dp=1", "--levels", "1"), "--levels goes with --rows native")):
        code, report, out = _cli("--world", "2", *args)
        assert code == 2 and not report["ok"] and match in report["errors"][0] and "Traceback" not in out, out

