"""Pipeline schedules as pure tick tables (no torch, no process groups).

A schedule says, for every global tick, which op each pipeline stage runs: ``Op(stage, "F"|"B",
microbatch)``. Every rank computes the same table from (stages, microbatches), so all ranks
agree on what happens at each tick without talking. Ticks come from a discrete simulation
in which each op takes one tick and starts only after what it needs finished in an *earlier*
tick: F(s, k) after F(s-1, k); B(s, k) after B(s+1, k) and after F(s, k). An executor that sends
in tick t and receives in a later tick can therefore never wait on a send not yet posted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

Kind = Literal["F", "B"]


@dataclass(frozen=True)
class Op:
    stage: int
    kind: Kind
    mb: int


def one_f_one_b_order(stages: int, microbatches: int, stage: int) -> list[Op]:
    """One stage's own 1F1B order: warm-up forwards (so the pipeline fills), then one forward
    and one backward alternately, then the remaining backwards. At most ``stages - stage``
    microbatches' activations are alive on the stage."""
    warmup = min(stages - stage - 1, microbatches)
    order = [Op(stage, "F", k) for k in range(warmup)]
    for i in range(microbatches - warmup):
        order += [Op(stage, "F", warmup + i), Op(stage, "B", i)]
    order += [Op(stage, "B", k) for k in range(microbatches - warmup, microbatches)]
    return order


def all_forward_then_backward_order(stages: int, microbatches: int, stage: int) -> list[Op]:
    """The simplest order (GPipe-like): every forward, then every backward."""
    return [Op(stage, "F", k) for k in range(microbatches)] + [Op(stage, "B", k) for k in range(microbatches)]


def _simulate(stages: int, microbatches: int, order_of: Callable[[int, int, int], list[Op]]) -> list[list[Op]]:
    if stages < 1 or microbatches < 0:
        raise ValueError(f"need stages >= 1 and microbatches >= 0, got {stages}, {microbatches}")
    queues = [order_of(stages, microbatches, s) for s in range(stages)]
    done: dict[tuple, int] = {}  # (stage, kind, mb) -> tick it ran

    def ready(op: Op, t: int) -> bool:
        needs = []
        if op.kind == "F" and op.stage > 0:
            needs.append((op.stage - 1, "F", op.mb))
        if op.kind == "B":
            needs.append((op.stage, "F", op.mb))
            if op.stage < stages - 1:
                needs.append((op.stage + 1, "B", op.mb))
        return all(n in done and done[n] < t for n in needs)

    ticks: list[list[Op]] = []
    heads = [0] * stages
    t = 0
    while any(heads[s] < len(queues[s]) for s in range(stages)):
        now = []
        for s in range(stages):
            if heads[s] < len(queues[s]) and ready(queues[s][heads[s]], t):
                now.append(queues[s][heads[s]])
        if not now:  # cannot happen for the orders above; guards against a bad order function
            raise RuntimeError(f"schedule stuck at tick {t}")
        for op in now:
            done[(op.stage, op.kind, op.mb)] = t
            heads[op.stage] += 1
        ticks.append(now)
        t += 1
    return ticks


def one_f_one_b(stages: int, microbatches: int) -> list[list[Op]]:
    """The ops of every tick under 1F1B."""
    return _simulate(stages, microbatches, one_f_one_b_order)


def all_forward_then_backward(stages: int, microbatches: int) -> list[list[Op]]:
    """The ops of every tick when each stage runs all forwards, then all backwards."""
    return _simulate(stages, microbatches, all_forward_then_backward_order)


SCHEDULES = {"1f1b": one_f_one_b, "simple": all_forward_then_backward}


def tick_of(ticks: list[list[Op]]) -> dict[tuple[int, str, int], int]:
    """(stage, kind, mb) -> the tick it runs at."""
    return {(op.stage, op.kind, op.mb): t for t, ops in enumerate(ticks) for op in ops}


def encoder_ticks(ticks: list[list[Op]], microbatches: int, prefetch: int) -> list[int]:
    """The tick of each microbatch's encoder + bridge forward: with depth ``d`` the ones of
    k..k+d-1 are done no later than stage 0's F(k), so microbatch j runs at F(0, j-d+1)."""
    if prefetch < 1:
        raise ValueError(f"prefetch depth must be >= 1, got {prefetch}")
    at = tick_of(ticks)
    return [at[(0, "F", max(0, j - prefetch + 1))] for j in range(microbatches)]
