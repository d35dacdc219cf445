"""The multi-module step executor: a step's ticks walked on one rank, the work itself handed to
the caller's ``StepOps`` (``mimo.training.schedule_run`` gives the model's; tests give recorders).

Every rank walks the same ticks. At tick t it does, in this order:

(a) the encoder + bridge forwards whose tick is t (stage 0's F(k), or earlier with prefetch),
    in microbatch order, on every rank of each bridge. A non-colocated encoder rank only posts
    its sends and moves on, so it computes the next microbatches while the LLM ranks still
    work; before microbatch k it waits for the sends of k - prefetch (a bounded run-ahead);
(b) its own LLM stage's op at t, if any (F receives, computes and posts its send; B receives
    the output gradient, runs backward and posts the input gradient);
(c) the bridge (+ encoder) backwards of microbatches whose stage-0 B runs at t.

An op is told whether it is its module's last backward of the step (``last``): that is where
gradient buckets reduce while the backward runs.

Why this cannot deadlock: the tick table only lets an op start after what it needs ran in an
*earlier* tick, so every receive waits for a send that is already posted; the bridges'
collectives are entered by all their ranks at the same tick in the same order; and an encoder
rank's wait for the sends of k - prefetch needs only the LLM's receive of k - prefetch, which
comes at an earlier or the same tick, before anything the LLM then needs from that rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from mimo.schedules.ticks import SCHEDULES, Op, encoder_ticks, tick_of


@dataclass(frozen=True)
class TickPlan:
    """A step's ticks: each tick's pipeline ops, and the tick of each microbatch's encoder +
    bridge forward (``encode_at``) and backward (``bridge_back_at``: stage 0's B of it)."""

    ticks: tuple[tuple[Op, ...], ...]
    encode_at: tuple[int, ...]
    bridge_back_at: tuple[int, ...]
    prefetch: int

    @classmethod
    def make(cls, schedule: str, stages: int, microbatches: int, prefetch: int = 1) -> "TickPlan":
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; one of {sorted(SCHEDULES)}")
        ticks = SCHEDULES[schedule](stages, microbatches)
        at = tick_of(ticks)
        return cls(tuple(tuple(ops) for ops in ticks), tuple(encoder_ticks(ticks, microbatches, prefetch)),
                   tuple(at[(0, "B", k)] for k in range(microbatches)), prefetch)

    @property
    def microbatches(self) -> int:
        return len(self.encode_at)


class StepOps(Protocol):
    """The work of a step on one rank, called by ``execute`` at the ticks of its plan."""

    def encode(self, k: int, tick: int) -> None:
        """Microbatch ``k``'s encoder + bridge forwards (a non-colocated encoder rank only posts its sends)."""

    def wait_sends(self, k: int, tick: int) -> None:
        """Wait for the sends that ``encode(k)`` left in flight (none: return)."""

    def stage_op(self, op: Op, tick: int, last: bool) -> None:
        """This rank's LLM stage's ``op``; ``last``: the stage's last backward of the step."""

    def bridge_backward(self, k: int, tick: int, last: bool) -> None:
        """Microbatch ``k``'s bridge (+ encoder) backwards; ``last``: the encoders' last of the step."""


def execute(plan: TickPlan, ops: StepOps, stage: int | None) -> None:
    """Walks ``plan``'s ticks on this rank (``stage``: its LLM stage, None without one)."""
    count = plan.microbatches
    for now, tick_ops in enumerate(plan.ticks):
        for k in range(count):  # (a)
            if plan.encode_at[k] == now:
                if k - plan.prefetch >= 0:
                    ops.wait_sends(k - plan.prefetch, now)
                ops.encode(k, now)
        for op in tick_ops:  # (b)
            if op.stage == stage:
                ops.stage_op(op, now, last=op.kind == "B" and op.mb == count - 1)
        for k in range(count):  # (c)
            if plan.bridge_back_at[k] == now:
                ops.bridge_backward(k, now, last=k == count - 1)
    for k in range(max(0, count - plan.prefetch), count):  # the sends no later encode waited for
        ops.wait_sends(k, len(plan.ticks))
