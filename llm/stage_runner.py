"""This rank's LLM pipeline stage: forward and backward of microbatches, activations to the next
stage and their gradients back (``StageRunner``): the one runner of a stage that training
(``mimo.training.schedule_run`` puts its calls on a schedule's ticks), ``mimo eval`` (forward
only) and verification (``run_pipeline``: one pack, forward then backward) share.

Rank ``r`` of stage ``s`` talks to the rank with the same TP/CP/DP coordinates on stage
``s±1``; every stage knows the shape it receives from the pack (``[T_local, D]``) and receives
it on its own parameters' device and dtype. Sends are non-blocking (``finish`` waits for them);
a receive blocks, so callers order the calls so that every receive waits for a send that is
already posted (stages in order, or a schedule's tick table).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from mimo.core.batch import PackedBatch
from mimo.parallel.grid import ParallelGrid
from mimo.llm.model import LLMStage


def pp_neighbour(grid: ParallelGrid, rank: int, delta: int) -> int | None:
    """The rank ``delta`` stages away with this rank's other coordinates (None past an end)."""
    coords = grid.coords(rank)
    stage = coords.get("pp", 0) + delta
    if not 0 <= stage < grid.shape.get("pp", 1):
        return None
    coords["pp"] = stage
    return grid.rank_at(**coords)


@dataclass
class PipelineResult:
    logits: torch.Tensor | None  # last stage: this rank's vocab-parallel logits (detached)
    loss: torch.Tensor | None  # last stage, when a normaliser was given (detached)


@dataclass
class _Activation:
    """What backward needs of one microbatch on this rank."""

    hidden_in: torch.Tensor | None  # received from the previous stage (requires grad)
    out: torch.Tensor  # sent to the next stage, or the loss on the last stage


# note(tick, kind, microbatch, **extra): records an event (mimo.training.trace); kinds forward,
# backward (spans: start=, and for forward alive=), send, recv (peer=); stage= is always given
Note = Callable[..., None]


class StageRunner:
    """``stage`` (this rank's, of ``grid``) run microbatch by microbatch.

    ``forward`` under autograd keeps what ``backward`` of the same microbatch needs (the
    activation it received, its output or loss); without autograd it keeps nothing (eval).
    The last stage computes ``stage.loss`` over ``num_loss_tokens`` when one is given (summed
    over microbatches in ``loss``, left on the device)."""

    def __init__(self, stage: LLMStage, grid: ParallelGrid, rank: int, num_loss_tokens: float | None = None,
                 note: Note | None = None):
        self.stage, self.num_loss_tokens, self._notes = stage, num_loss_tokens, note
        self.index = grid.coords(rank).get("pp", 0)
        self.prev = pp_neighbour(grid, rank, -1)
        self.next = pp_neighbour(grid, rank, +1)
        p = next(stage.parameters())
        self.device, self.dtype = p.device, p.dtype  # what it receives: its own compute device and dtype
        self.alive: dict[int, _Activation] = {}
        self.sends: list[tuple] = []  # (work, tensor): the tensor must live until the send completes
        self.loss: float | torch.Tensor = 0.0

    def _note(self, tick, kind, k, **extra) -> None:
        if self._notes is not None:
            self._notes(tick, kind, k, stage=self.index, **extra)

    def _send(self, tensor: torch.Tensor, dst: int, tick, k: int) -> None:
        tensor = tensor.contiguous()
        self.sends.append((dist.isend(tensor, dst=dst), tensor))
        self._note(tick, "send", k, peer=dst)

    def _recv(self, shape, dtype: torch.dtype, src: int, tick, k: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, src=src)
        self._note(tick, "recv", k, peer=src)
        return buf

    def forward(self, batch: PackedBatch, k: int = 0, image_rows: Mapping[str, torch.Tensor] | None = None,
                tick: int | None = None, cache=None) -> PipelineResult:
        """Microbatch ``k`` through this stage: receive from the previous stage, compute, post
        the send to the next. ``image_rows`` reach the first stage only; ``cache``: this
        stage's generation cache (``LLMStage.forward``), without autograd."""
        stage, grad = self.stage, torch.is_grad_enabled()
        h_in = None
        if self.prev is not None:
            h_in = self._recv((stage.local_len(batch), stage.arch.hidden), self.dtype, self.prev, tick, k)
            h_in.requires_grad_(grad)
        start = time.perf_counter()
        # aux losses (MoE) join a training forward, normalised as the loss is
        out = stage(batch, hidden=h_in, image_rows=image_rows if stage.is_first else None,
                    loss_norm=self.num_loss_tokens if grad else None, cache=cache)
        # alive: the microbatches whose activations this stage holds, this one included
        self._note(tick, "forward", k, start=start, alive=len(self.alive) + int(grad))
        if self.next is not None:
            self._send(out.detach(), self.next, tick, k)
            result, target = PipelineResult(None, None), out
        else:
            loss = None
            if self.num_loss_tokens is not None:
                loss = stage.loss(out, batch, self.num_loss_tokens)
                self.loss = self.loss + loss.detach()  # read once after the step: no device sync per microbatch
            result, target = PipelineResult(out.detach(), None if loss is None else loss.detach()), loss
        if grad:
            if target is None:
                raise ValueError("backward through the last stage needs num_loss_tokens")
            self.alive[k] = _Activation(h_in, target)
        return result

    def backward(self, k: int = 0, tick: int | None = None) -> None:
        """Microbatch ``k`` back: receive the output gradient (the last stage starts from its
        loss), back-propagate, post the input gradient to the previous stage."""
        act = self.alive.pop(k)  # freed once backward is done
        grad = None if self.next is None else self._recv(act.out.shape, act.out.dtype, self.next, tick, k)
        start = time.perf_counter()
        if act.out.requires_grad:  # not when nothing before it trains (a frozen LLM's last stage)
            act.out.backward(grad)
        self._note(tick, "backward", k, start=start)
        if self.prev is not None:
            g = act.hidden_in.grad if act.hidden_in.grad is not None else torch.zeros_like(act.hidden_in)
            self._send(g, self.prev, tick, k)

    def finish(self) -> None:
        """Wait for every send posted so far."""
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


def run_pipeline(stage: LLMStage, grid: ParallelGrid, batch: PackedBatch, *,
                 image_rows: Mapping[str, torch.Tensor] | None = None,
                 num_loss_tokens: float | None = None, backward: bool = False,
                 rank: int | None = None) -> PipelineResult:
    """Run ``batch`` through every stage (this rank runs ``stage``), then, with ``backward``,
    back-propagate ``stage.loss`` to every stage's parameters (and to ``image_rows``).
    Verification and tests; training runs many microbatches on a schedule's ticks."""
    if backward and num_loss_tokens is None:
        raise ValueError("backward needs num_loss_tokens")
    rank = dist.get_rank() if rank is None else rank
    runner = StageRunner(stage, grid, rank, num_loss_tokens)
    with torch.set_grad_enabled(backward):
        result = runner.forward(batch, image_rows=image_rows)
    if backward:
        runner.backward()
    runner.finish()
    return result
