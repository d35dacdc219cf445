"""Running a step's microbatches on a tick table of ``mimo.schedules`` (1F1B or the trivial
all-forward-then-backward order), on every rank of the world, in any layout.

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
right after it; the caller finishes them before the optimizer step.

Why this cannot deadlock: the tick table only lets an op start after what it needs ran in an
*earlier* tick, so every receive waits for a send that is already posted; the bridges'
collectives are entered by all their ranks at the same tick in the same order; and an encoder
rank's wait for the sends of k - prefetch needs only the LLM's receive of k - prefetch, which
comes at an earlier or the same tick, before anything the LLM then needs from that rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimo.data.pipeline import Microbatch
from mimo.llm.pipeline import pp_neighbour
from mimo.compose.model import MimoModel
from mimo.training.optim import GradSync
from mimo.schedules.pipeline import SCHEDULES, encoder_ticks, tick_of
from mimo.training.step import Trace, _note, bridge_backward, encode_and_bridge


@dataclass
class _Activation:
    """What stage backward needs of one microbatch on this rank."""

    hidden_in: torch.Tensor | None  # received from the previous stage (requires grad)
    out: torch.Tensor  # sent to the next stage, or the loss on the last stage


class _StageRunner:
    """This rank's LLM stage: forward / backward of one microbatch with non-blocking sends."""

    def __init__(self, model: MimoModel, num_loss_tokens: float, trace: Trace | None):
        self.model, self.stage, self.trace = model, model.stage, trace
        self.num_loss_tokens = num_loss_tokens
        self.index = model.llm_grid.coords(model.rank).get("pp", 0)
        self.prev = pp_neighbour(model.llm_grid, model.rank, -1)
        self.next = pp_neighbour(model.llm_grid, model.rank, +1)
        self.alive: dict[int, _Activation] = {}
        self.sends: list[tuple] = []  # (work, tensor): the tensor must live until the send completes
        self.loss = 0.0

    def _note(self, tick, kind, k, **extra):
        _note(self.trace, tick, kind, k, self.model.llm_name, stage=self.index, **extra)

    def _send(self, tensor: torch.Tensor, dst: int, tick: int, k: int) -> None:
        tensor = tensor.contiguous()
        self.sends.append((dist.isend(tensor, dst=dst), tensor))
        self._note(tick, "send", k, peer=dst)

    def _recv(self, like_shape, dtype, src: int, tick: int, k: int) -> torch.Tensor:
        buf = torch.empty(like_shape, dtype=dtype, device=next(self.stage.parameters()).device)
        dist.recv(buf, src=src)
        self._note(tick, "recv", k, peer=src)
        return buf

    def forward(self, mb: Microbatch, image_rows: dict, tick: int, k: int) -> None:
        stage, batch = self.stage, mb.pack
        h_in = None
        if self.prev is not None:
            p = next(stage.parameters())
            h_in = self._recv((stage.local_len(batch), self.model.config.llm.arch.hidden), p.dtype, self.prev, tick, k)
            h_in.requires_grad_(True)
        start = time.perf_counter()
        out = stage(batch, hidden=h_in, image_rows=image_rows if stage.is_first else None)
        # alive: the microbatches whose activations this stage holds, this one included
        self._note(tick, "forward", k, start=start, alive=len(self.alive) + 1)
        if self.next is not None:
            self._send(out.detach(), self.next, tick, k)
        else:
            out = stage.loss(out, batch, self.num_loss_tokens)
            self.loss = self.loss + out.detach()  # read once after the step: no device sync per microbatch
        self.alive[k] = _Activation(h_in, out)

    def backward(self, tick: int, k: int) -> None:
        act = self.alive.pop(k)  # freed once backward is done
        grad = None if self.next is None else self._recv(act.out.shape, act.out.dtype, self.next, tick, k)
        start = time.perf_counter()
        if act.out.requires_grad:
            act.out.backward(grad)
        self._note(tick, "backward", k, start=start)
        if self.prev is not None:
            g = act.hidden_in.grad if act.hidden_in.grad is not None else torch.zeros_like(act.hidden_in)
            self._send(g, self.prev, tick, k)

    def finish(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


def run_schedule(model: MimoModel, mbs: list[Microbatch], num_loss_tokens: float, schedule: str = "1f1b",
                 prefetch: int = 1, trace: Trace | None = None, grad_sync: GradSync | None = None) -> float | torch.Tensor:
    """Forward and backward of every microbatch on the ``schedule``'s ticks; returns this
    rank's loss sum (non-zero on last-stage ranks only; a 0-dim tensor there, left on the
    device for the caller to read when it suits). Gradients are left accumulated (and
    with ``grad_sync``, their DP sums launched)."""
    stages, count = model.llm_grid.shape.get("pp", 1), len(mbs)
    ticks = SCHEDULES[schedule](stages, count)
    encode_at = encoder_ticks(ticks, count, prefetch)
    at = tick_of(ticks)
    bridge_back_at = [at[(0, "B", k)] for k in range(count)]
    runner = _StageRunner(model, num_loss_tokens, trace) if model.stage is not None else None
    bridges: list = [None] * count
    image_rows: list = [None] * count
    last = count - 1
    now = 0  # the tick that bucket events are stamped with
    if grad_sync is not None and trace is not None:
        grad_sync.note = lambda kind, module, **extra: _note(trace, now, kind, None, module, **extra)
    encoders = [name for name, part in model.encoders.items() if part.module is not None]

    def last_backward(modules: list[str], run) -> None:
        """``run`` is these modules' last backward on this rank: their buckets reduce while it runs."""
        if grad_sync is None:
            return run()
        for m in modules:
            grad_sync.arm(m)
        run()
        for m in modules:
            grad_sync.flush(m)

    in_flight: dict[int, list] = {}  # microbatch -> bridges whose sends this rank has not waited for

    def wait_sends(k: int) -> None:
        pending = in_flight.pop(k, [])
        start = time.perf_counter()
        for bridge, _ in pending:
            bridge.wait_sends()
        if pending:
            _note(trace, now, "send_wait", k, pending[0][1], start=start)

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
                    runner.forward(mbs[op.mb], image_rows[op.mb], now, op.mb)
                    image_rows[op.mb] = None
                elif op.mb == last:  # the stage's gradients become final
                    last_backward([model.llm_name], lambda: runner.backward(now, op.mb))
                else:
                    runner.backward(now, op.mb)
        for k in range(count):  # (c)
            if bridge_back_at[k] == now:
                if k == last:
                    last_backward(encoders, lambda: bridge_backward(model, bridges[k], trace, now, k))
                else:
                    bridge_backward(model, bridges[k], trace, now, k)
                bridges[k] = None
    now = len(ticks)  # the buckets' ends are noted after the loop
    for k in sorted(in_flight):
        wait_sends(k)
    if runner is None:
        return 0.0
    runner.finish()
    return runner.loss
