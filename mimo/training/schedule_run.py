"""Running a step's microbatches on every rank of the world, in any layout: each microbatch's
encoder + bridge forward (``encode_and_bridge``), this rank's LLM stage (``mimo.llm.stage_runner.
StageRunner``, the one stage runner that ``mimo eval`` and verification use too) and the bridge
(+ encoder) backward (``bridge_backward``). Training hands them to the executor of
``mimo.schedules.executor`` (``run_schedule``), which calls them at the ticks of the step's plan
(``mimo.data.pipeline.StepPlan``: 1F1B or all forwards then all backwards, with encoder
prefetch; why that order cannot deadlock is said there); ``mimo eval`` runs one microbatch
forward at a time (``forward_only``). Every bridge runs the placements and transfer plans planned
with its microbatch: nothing is planned here.

With a ``GradSync``, each module's DP gradient sums start bucket by bucket *during* its last
backward on this rank (the stage's last B; the encoder's last bridge backward): the module is
armed before that backward, each bucket launches as soon as its gradients are final, the rest
right after it (first the TP sums of its partial gradients, once per step); the caller
finishes them before the optimizer step.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from mimo.bridges.executor import Bridge
from mimo.compose.model import MimoModel
from mimo.data.pipeline import Microbatch, StepPlan
from mimo.llm.stage_runner import StageRunner
from mimo.schedules.executor import execute
from mimo.training.optim import GradSync
from mimo.training.trace import Trace, note


def encode_and_bridge(model: MimoModel, mb: Microbatch, trace: Trace | None = None, tick: int | None = None,
                      index: int | None = None, defer_sends: bool = False) -> tuple[dict, dict]:
    """Each encoder's forward and its bridge to the LLM's first stage (a collective over the
    bridge's ranks). Returns (encoder -> (bridge, y, y_leaf), placeholder -> rows for stage 0).
    ``defer_sends``: a non-colocated encoder rank returns once its sends are posted (the
    caller waits for them with ``Bridge.wait_sends``). An encoder that trains nothing runs
    without autograd state."""
    rank, llm = model.rank, model.llm
    bridges, image_rows = {}, {}
    sequence_parallel = llm.ctx.sequence_parallel
    for part in model.encoder_parts:
        name, trains = part.name, part.trains
        if rank not in part.grid and rank not in llm.grid:  # the bridge's ranks: both grids
            continue
        placeholder = model.config.encoders[name].placeholder
        src, dst, plans = mb.plan.bridges[name]  # planned with the microbatch (``DataPipeline.plan_microbatch``)
        bridge = Bridge(src, dst, part.bridge_group,
                        src_replica_group=part.tp_group if rank in part.grid else None,
                        dst_replica_group=llm.tp_group if rank in llm.grid and not sequence_parallel else None,
                        needs_grad=trains, rank=rank, defer_sends=defer_sends, plans=plans)
        x = None
        if part.module is not None:
            start = time.perf_counter()
            with torch.set_grad_enabled(trains and torch.is_grad_enabled()):
                x = part.module(mb.pixels[name])
            note(trace, tick, "encoder_fwd", index, name, start=start)
        start = time.perf_counter()
        y = bridge(x) if x is not None else bridge(None, *_receive_as(model))
        note(trace, tick, "bridge_fwd", index, name, start=start)
        y_leaf = None
        if bridge.is_dst:
            y_leaf = y.detach().requires_grad_(trains)
            image_rows[placeholder] = y_leaf
        bridges[name] = (bridge, y, y_leaf)
    return bridges, image_rows


def _receive_as(model: MimoModel) -> tuple[torch.dtype, torch.device]:
    """What a rank without the encoder receives: its LLM stage's dtype and device (the gradient
    it sends back must match what the encoder ranks expect)."""
    p = next(model.llm.module.parameters())
    return p.dtype, p.device


def bridge_backward(model: MimoModel, bridges: dict, trace: Trace | None = None, tick: int | None = None,
                    index: int | None = None) -> None:
    """Each trained bridge's backward (the LLM side hands the gradient of the rows it
    received), continuing into the encoder; on every rank of the bridge."""
    for name, (bridge, y, y_leaf) in bridges.items():
        part = model.part(name)
        if not part.trains:
            continue
        start = time.perf_counter()
        if bridge.is_dst:
            g = y_leaf.grad if y_leaf.grad is not None else torch.zeros_like(y_leaf)
            y.backward(g)
        else:  # a non-colocated source: receive the gradient of what it sent
            Bridge.backward_source(y)
        # the bridge's backward continues into the encoder: one span for both
        note(trace, tick, "bridge_bwd", index, name, start=start)
        if part.module is not None:
            note(trace, tick, "encoder_bwd", index, name, start=start)


def stage_runner(model: MimoModel, num_loss_tokens: float | None = None, trace: Trace | None = None) -> StageRunner | None:
    """The runner of this rank's LLM stage (None on a rank without one); its events go to
    ``trace`` under the LLM's name."""
    llm = model.llm
    if llm.module is None:
        return None

    def notes(tick, kind, k, **extra):
        note(trace, tick, kind, k, llm.name, **extra)

    return StageRunner(llm.module, llm.grid, model.rank, num_loss_tokens, notes if trace is not None else None)


def forward_only(model: MimoModel, mb: Microbatch, runner: StageRunner | None, cache=None) -> torch.Tensor | None:
    """Microbatch ``mb`` forward without autograd on every rank of the world (``mimo eval``):
    encoders, bridges, this rank's stage (``runner``, from ``stage_runner``; ``cache``: its
    generation cache, ``mimo.llm.cache``); the last stage's vocab-parallel logits, else None.
    Stages run in order: each receive waits for a send posted by a stage that has already run."""
    model.graph_step()
    model.refresh_fp8()
    with torch.no_grad():
        _, image_rows = encode_and_bridge(model, mb)
        if runner is None:
            return None
        result = runner.forward(mb.pack, image_rows=image_rows, cache=cache)
        runner.finish()
    return result.logits


class _ModelStepOps:
    """``mimo.schedules.executor.StepOps`` of a model's step on this rank: the encoders, bridges
    and this rank's LLM stage (``runner``), each module's gradient buckets armed before its last
    backward and flushed after it (``grad_sync``)."""

    def __init__(self, model: MimoModel, mbs: Sequence[Microbatch], runner: StageRunner | None,
                 trace: Trace | None, grad_sync: GradSync | None):
        self.model, self.mbs, self.runner, self.trace, self.grad_sync = model, mbs, runner, trace, grad_sync
        self.bridges: list = [None] * len(mbs)
        self.image_rows: list = [None] * len(mbs)
        self.in_flight: dict[int, list] = {}  # microbatch -> bridges whose sends this rank has not waited for
        self.encoders = [part.name for part in model.encoder_parts if part.module is not None]
        self.now = 0  # the tick that bucket events are stamped with
        if grad_sync is not None:  # the run's GradSync serves every step: this step's trace or none
            grad_sync.note = (lambda kind, module, **extra: note(trace, self.now, kind, None, module, **extra)
                              ) if trace is not None else None

    def _backward(self, modules: list[str], last: bool, run) -> None:
        """A backward of ``modules``: their bf16 gradients into the fp32 main gradients; the last
        one of the step (``last``) reduces their buckets while it runs."""
        sync = self.grad_sync
        if sync is None:
            return run()
        if last:
            for m in modules:
                sync.arm(m)
        run()
        for m in modules:
            sync.accumulate(m)
            if last:
                sync.flush(m)

    def encode(self, k: int, tick: int) -> None:
        self.now = tick
        self.bridges[k], self.image_rows[k] = encode_and_bridge(self.model, self.mbs[k], self.trace, tick, k,
                                                                defer_sends=True)
        self.in_flight[k] = [(b, name) for name, (b, _, _) in self.bridges[k].items() if b.fwd.deferred]

    def wait_sends(self, k: int, tick: int) -> None:
        self.now = tick
        pending = self.in_flight.pop(k, [])
        start = time.perf_counter()
        for bridge, _ in pending:
            bridge.wait_sends()
        if pending:
            note(self.trace, tick, "send_wait", k, pending[0][1], start=start)

    def stage_op(self, op, tick: int, last: bool) -> None:
        self.now = tick
        if op.kind == "F":
            self.runner.forward(self.mbs[op.mb].pack, op.mb, self.image_rows[op.mb], tick)
            self.image_rows[op.mb] = None
        else:
            self._backward([self.model.llm.name], last, lambda: self.runner.backward(op.mb, tick))

    def bridge_backward(self, k: int, tick: int, last: bool) -> None:
        self.now = tick
        self._backward(self.encoders, last, lambda: bridge_backward(self.model, self.bridges[k], self.trace, tick, k))
        self.bridges[k] = None


def run_schedule(model: MimoModel, plan: StepPlan, num_loss_tokens: float, trace: Trace | None = None,
                 grad_sync: GradSync | None = None) -> float | torch.Tensor:
    """Forward and backward of the step ``plan``'s microbatches on its ticks; returns this
    rank's loss sum (non-zero on last-stage ranks only; a 0-dim tensor there, left on the
    device for the caller to read when it suits). Gradients are left accumulated (and
    with ``grad_sync``, their DP sums launched)."""
    runner = stage_runner(model, num_loss_tokens, trace)
    ops = _ModelStepOps(model, plan.microbatches, runner, trace, grad_sync)
    execute(plan.ticks, ops, runner.index if runner is not None else None)
    if runner is None:
        return 0.0
    runner.finish()
    return runner.loss
