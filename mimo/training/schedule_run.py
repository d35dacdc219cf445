"""Running a step's microbatches on every rank of the world, in any layout: each microbatch's
encoder + bridge forward (``encode_and_bridge``), this rank's LLM stage (``mimo.llm.pipeline.
StageRunner``, the one stage runner that ``mimo eval`` and verification use too) and the bridge
(+ encoder) backward (``bridge_backward``); training puts them on a tick table of
``mimo.schedules`` (1F1B or the trivial all-forward-then-backward order: ``run_schedule``),
``mimo eval`` runs one microbatch forward at a time (``forward_only``).

Every rank walks the same ticks. At tick t it does, in this order:

(a) the encoder + bridge forwards whose tick is t (stage 0's F(k), or earlier with prefetch),
    in microbatch order, on every rank of each bridge. A non-colocated encoder rank only posts
    its sends and moves on, so it computes the next microbatches while the LLM ranks still
    work; before microbatch k it waits for the sends of k - prefetch (a bounded run-ahead);
(b) its own LLM stage's op at t, if any: F receives the activation (sent in an earlier tick),
    computes and posts an ``isend``; B receives the output gradient, runs backward and posts
    the input gradient; the last stage computes the loss;
(c) the bridge (+ encoder) backwards of microbatches whose stage-0 B runs at t.

With a ``GradSync``, each module's DP gradient sums start bucket by bucket *during* its last
backward on this rank (the stage's last B; the encoder's last bridge backward): the module is
armed before that backward, each bucket launches as soon as its gradients are final, the rest
right after it (first the TP sums of its partial gradients, once per step); the caller
finishes them before the optimizer step.

Why this cannot deadlock: the tick table only lets an op start after what it needs ran in an
*earlier* tick, so every receive waits for a send that is already posted; the bridges'
collectives are entered by all their ranks at the same tick in the same order; and an encoder
rank's wait for the sends of k - prefetch needs only the LLM's receive of k - prefetch, which
comes at an earlier or the same tick, before anything the LLM then needs from that rank.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from mimo.bridges.executor import Bridge
from mimo.bridges.plan import TransferPlan
from mimo.bridges.plan import image_bridge_plans as bridge_plans_of_images
from mimo.compose.model import MimoModel
from mimo.data.pipeline import Microbatch
from mimo.data.plan import SampleArrays
from mimo.llm.pipeline import StageRunner
from mimo.parallel.grid import ParallelGrid
from mimo.parallel.layout import RunPlacement
from mimo.schedules.pipeline import SCHEDULES, encoder_ticks, tick_of
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
        src, dst, plans = _bridge_plans(model, mb, name)
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


def image_bridge_plans(samples: SampleArrays | Sequence, placeholder: str, rows_per_image: int, width: int,
                       encoder_grid: ParallelGrid, encoder_blocks: Sequence[range], llm_grid: ParallelGrid,
                       llm_blocks: Sequence[range], sequence_parallel: bool, rank: int
                       ) -> tuple[RunPlacement, RunPlacement, tuple[TransferPlan, TransferPlan]]:
    """``mimo.bridges.plan.image_bridge_plans`` (the encoder's rows, the LLM first stage's
    placement of them near this rank's rows, this rank's plans both ways) of the images of
    ``placeholder`` in a microbatch of ``samples`` (its ``SampleArrays``, or ``PlannedSample``s):
    ``rows_per_image`` rows each image, or for a native tower (0) each image's own, of ``width``
    values."""
    arrays = SampleArrays.of(samples)
    return bridge_plans_of_images(arrays.tokens_N, arrays.images_for(placeholder), arrays.image_starts(placeholder),
                                  arrays.image_rows(placeholder, rows_per_image), width, encoder_grid, encoder_blocks,
                                  llm_grid, llm_blocks, sequence_parallel, rank)


def _bridge_plans(model: MimoModel, mb: Microbatch, name: str):
    """``image_bridge_plans`` of encoder ``name``: the data pipeline's (made on its thread with
    the microbatch), else made here once per microbatch (kept on ``mb``)."""
    cache = mb.bridge_plans
    if name not in cache:
        enc = model.config.encoders[name]
        cache[name] = image_bridge_plans(mb.arrays, enc.placeholder, 0 if enc.native else enc.rows_per_image,
                                         model.config.bridge_width(name),
                                         model.part(name).grid, mb.encoder_blocks[name], model.llm.grid,
                                         mb.llm_blocks, model.llm.ctx.sequence_parallel, model.rank)
    return cache[name]


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
    with torch.no_grad():
        _, image_rows = encode_and_bridge(model, mb)
        if runner is None:
            return None
        result = runner.forward(mb.pack, image_rows=image_rows, cache=cache)
        runner.finish()
    return result.logits


def run_schedule(model: MimoModel, mbs: list[Microbatch], num_loss_tokens: float, schedule: str = "1f1b",
                 prefetch: int = 1, trace: Trace | None = None, grad_sync: GradSync | None = None) -> float | torch.Tensor:
    """Forward and backward of every microbatch on the ``schedule``'s ticks; returns this
    rank's loss sum (non-zero on last-stage ranks only; a 0-dim tensor there, left on the
    device for the caller to read when it suits). Gradients are left accumulated (and
    with ``grad_sync``, their DP sums launched)."""
    stages, count = model.llm.grid.shape.get("pp", 1), len(mbs)
    ticks = SCHEDULES[schedule](stages, count)
    encode_at = encoder_ticks(ticks, count, prefetch)
    at = tick_of(ticks)
    bridge_back_at = [at[(0, "B", k)] for k in range(count)]
    runner = stage_runner(model, num_loss_tokens, trace)
    bridges: list = [None] * count
    image_rows: list = [None] * count
    last = count - 1
    now = 0  # the tick that bucket events are stamped with
    if grad_sync is not None:  # the run's GradSync serves every step: this step's trace or none
        grad_sync.note = (lambda kind, module, **extra: note(trace, now, kind, None, module, **extra)) if trace is not None else None
    encoders = [part.name for part in model.encoder_parts if part.module is not None]

    def last_backward(modules: list[str], run) -> None:
        """``run`` is these modules' last backward on this rank: their buckets reduce while it runs."""
        if grad_sync is None:
            return run()
        for m in modules:
            grad_sync.arm(m)
        run()
        for m in modules:
            grad_sync.accumulate(m)
            grad_sync.flush(m)

    def backward(modules: list[str], run) -> None:
        """An earlier backward of these modules: its bf16 gradients into the fp32 main gradients."""
        run()
        if grad_sync is not None:
            for m in modules:
                grad_sync.accumulate(m)

    in_flight: dict[int, list] = {}  # microbatch -> bridges whose sends this rank has not waited for

    def wait_sends(k: int) -> None:
        pending = in_flight.pop(k, [])
        start = time.perf_counter()
        for bridge, _ in pending:
            bridge.wait_sends()
        if pending:
            note(trace, now, "send_wait", k, pending[0][1], start=start)

    for now, ops in enumerate(ticks):
        for k in range(count):  # (a)
            if encode_at[k] == now:
                # a non-colocated encoder rank runs ahead of the LLM: its sends are only posted,
                # and at most `prefetch` microbatches' sends are in flight
                wait_sends(k - prefetch)
                bridges[k], image_rows[k] = encode_and_bridge(model, mbs[k], trace, now, k, defer_sends=True)
                in_flight[k] = [(b, name) for name, (b, _, _) in bridges[k].items() if b.fwd.deferred]
        for op in ops:  # (b)
            if runner is not None and op.stage == runner.index:
                if op.kind == "F":
                    runner.forward(mbs[op.mb].pack, op.mb, image_rows[op.mb], now)
                    image_rows[op.mb] = None
                elif op.mb == last:  # the stage's gradients become final
                    last_backward([model.llm.name], lambda: runner.backward(op.mb, now))
                else:
                    backward([model.llm.name], lambda: runner.backward(op.mb, now))
        for k in range(count):  # (c)
            if bridge_back_at[k] == now:
                if k == last:
                    last_backward(encoders, lambda: bridge_backward(model, bridges[k], trace, now, k))
                else:
                    backward(encoders, lambda: bridge_backward(model, bridges[k], trace, now, k))
                bridges[k] = None
    now = len(ticks)  # the buckets' ends are noted after the loop
    for k in sorted(in_flight):
        wait_sends(k)
    if runner is None:
        return 0.0
    runner.finish()
    return runner.loss
