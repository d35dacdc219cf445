"""Pipeline schedules as tick tables: dependencies, per-stage 1F1B order, memory bound."""

from __future__ import annotations

import pytest

from mimo.schedules.ticks import (SCHEDULES, Op, all_forward_then_backward, encoder_ticks, one_f_one_b,
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


class _Recorder:
    """``StepOps`` that records what the executor asks of one rank, in order."""

    def __init__(self):
        self.calls: list[tuple] = []

    def encode(self, k, tick):
        self.calls.append(("encode", k, tick))

    def wait_sends(self, k, tick):
        self.calls.append(("wait", k, tick))

    def stage_op(self, op, tick, last):
        self.calls.append((op.kind, op.mb, tick, last))

    def bridge_backward(self, k, tick, last):
        self.calls.append(("bridge_bwd", k, tick, last))


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("stages,mbs,prefetch", [(1, 1, 1), (1, 4, 2), (2, 5, 1), (3, 7, 2), (4, 3, 5)])
def test_the_executor_runs_each_op_of_its_stage_once_at_its_tick(name, stages, mbs, prefetch):
    """``execute`` on every stage: each microbatch encoded at its prefetch tick, after waiting for
    the sends of the one ``prefetch`` before it, and waited for exactly once; the stage's own ops
    at their ticks in order; the bridge backward of k at stage 0's B(k); ``last`` on the step's
    last backward of each module only."""
    from mimo.schedules.executor import TickPlan, execute

    plan = TickPlan.make(name, stages, mbs, prefetch)
    at = tick_of(plan.ticks)
    for stage in [*range(stages), None]:
        rec = _Recorder()
        execute(plan, rec, stage)
        encodes = [c for c in rec.calls if c[0] == "encode"]
        assert [c[1] for c in encodes] == list(range(mbs))
        assert all(t == plan.encode_at[k] <= at[(0, "F", k)] for _, k, t in encodes)
        waits = [c[1] for c in rec.calls if c[0] == "wait"]
        assert sorted(waits) == list(range(mbs))  # every microbatch's sends waited for, once
        for k in range(prefetch, mbs):  # the run-ahead is bounded: k - prefetch waited for before k
            assert rec.calls.index(("wait", k - prefetch, plan.encode_at[k])) < rec.calls.index(encodes[k])
        mine = [c for c in rec.calls if c[0] in ("F", "B")]
        want = [(op.kind, op.mb, t) for t, ops in enumerate(plan.ticks) for op in ops if op.stage == stage]
        assert [c[:3] for c in mine] == want
        assert [c for c in mine if c[3]] == ([("B", mbs - 1, at[(stage, "B", mbs - 1)], True)] if stage is not None else [])
        backs = [c for c in rec.calls if c[0] == "bridge_bwd"]
        assert backs == [("bridge_bwd", k, at[(0, "B", k)], k == mbs - 1) for k in range(mbs)]
        for k in range(mbs):  # within a tick: encoders first, the stage's op, then bridge backwards
            assert rec.calls.index(encodes[k]) < rec.calls.index(backs[k])
            if stage == 0:
                assert rec.calls.index(("F", k, at[(0, "F", k)], False)) > rec.calls.index(encodes[k])
                assert rec.calls.index(backs[k]) > rec.calls.index(("B", k, at[(0, "B", k)], k == mbs - 1))


def test_a_tick_plan_of_an_unknown_schedule_is_refused():
    from mimo.schedules.executor import TickPlan

    with pytest.raises(ValueError, match="unknown schedule"):
        TickPlan.make("zigzag", 2, 3)
    with pytest.raises(ValueError, match="prefetch"):
        TickPlan.make("1f1b", 2, 3, 0)
