"""Pipeline schedules as tick tables: dependencies, per-stage 1F1B order, memory bound."""

from __future__ import annotations

import pytest

from mimo.schedules.pipeline import (SCHEDULES, Op, all_forward_then_backward, encoder_ticks, one_f_one_b,
                                     one_f_one_b_order, tick_of)

CASES = [(s, m) for s in range(1, 5) for m in range(1, 9)]


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("stages,mbs", CASES)
def test_every_op_once_and_dependencies_respected(name, stages, mbs):
    ticks = SCHEDULES[name](stages, mbs)
    ops = [op for now in ticks for op in now]
    assert len(ops) == len(set(ops)) == 2 * stages * mbs
    assert all(len({op.stage for op in now}) == len(now) for now in ticks)  # one op per stage and tick
    at = tick_of(ticks)
    for s in range(stages):
        for k in range(mbs):
            if s > 0:
                assert at[(s, "F", k)] > at[(s - 1, "F", k)]
            if s < stages - 1:
                assert at[(s, "B", k)] > at[(s + 1, "B", k)]
            assert at[(s, "B", k)] > at[(s, "F", k)]


@pytest.mark.parametrize("stages,mbs", CASES)
def test_each_stage_runs_1f1b_with_bounded_activations(stages, mbs):
    ticks = one_f_one_b(stages, mbs)
    for s in range(stages):
        mine = [op for now in ticks for op in now if op.stage == s]
        assert mine == one_f_one_b_order(stages, mbs, s)
        warmup = min(stages - s - 1, mbs)
        assert all(op.kind == "F" for op in mine[:warmup])
        # after warm-up: F, B alternate while forwards remain, then only backwards
        steady = mine[warmup:warmup + 2 * (mbs - warmup)]
        assert [op.kind for op in steady] == ["F", "B"] * (mbs - warmup)
        alive = peak = 0
        for op in mine:
            alive += 1 if op.kind == "F" else -1
            peak = max(peak, alive)
        assert peak <= stages - s


def test_last_stage_backward_follows_its_forward_immediately():
    at = tick_of(one_f_one_b(4, 6))
    for k in range(6):
        assert at[(3, "B", k)] == at[(3, "F", k)] + 1


@pytest.mark.parametrize("prefetch", [1, 2, 3])
@pytest.mark.parametrize("stages,mbs", [(1, 4), (2, 5), (4, 8)])
def test_encoder_prefetch_depth_is_bounded(stages, mbs, prefetch):
    ticks = one_f_one_b(stages, mbs)
    at, enc = tick_of(ticks), encoder_ticks(ticks, mbs, prefetch)
    assert enc == sorted(enc)
    for k in range(mbs):
        assert enc[k] <= at[(0, "F", k)]  # the encoder's output is there when stage 0 needs it
        for j in range(k, min(k + prefetch, mbs)):
            assert enc[j] <= at[(0, "F", k)]  # k..k+d-1 done by F(0, k)
        if k + prefetch < mbs:
            assert enc[k + prefetch] > at[(0, "F", k)]  # and no deeper


def test_trivial_schedule_runs_all_forwards_first():
    for s in range(3):
        kinds = [op.kind for now in all_forward_then_backward(3, 4) for op in now if op.stage == s]
        assert kinds == ["F"] * 4 + ["B"] * 4


def test_bad_arguments():
    with pytest.raises(ValueError):
        one_f_one_b(0, 3)
    with pytest.raises(ValueError):
        encoder_ticks(one_f_one_b(2, 3), 3, 0)
    assert Op(0, "F", 1) == Op(0, "F", 1)
